//! For tests of the simulator and of its users: PEFT adapter directories for the LoRA routes.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Adapter directories under a fresh temporary directory, removed on drop: each with a PEFT
/// `adapter_config.json` (`peft_type` LORA, rank `r`, `lora_alpha` 16: what the engines read),
/// or, without a rank, only a `config.json` (a directory that is no adapter).
#[derive(Debug)]
pub struct AdapterDirs(PathBuf);

impl AdapterDirs {
    /// `adapters` as `(name, rank)` under a temporary directory named after `prefix`.
    pub fn new(prefix: &str, adapters: &[(&str, Option<u64>)]) -> std::io::Result<AdapterDirs> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let root = std::env::temp_dir().join(format!(
            "{prefix}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&root);
        let dirs = AdapterDirs(root);
        for (name, rank) in adapters {
            let d = dirs.0.join(name);
            std::fs::create_dir_all(&d)?;
            match rank {
                Some(r) => std::fs::write(
                    d.join("adapter_config.json"),
                    serde_json::json!({"peft_type": "LORA", "r": r, "lora_alpha": 16}).to_string(),
                )?,
                None => std::fs::write(d.join("config.json"), "{}")?,
            }
        }
        Ok(dirs)
    }

    /// Directories of rank 8 named `names`.
    pub fn rank8(prefix: &str, names: &[&str]) -> std::io::Result<AdapterDirs> {
        let adapters: Vec<(&str, Option<u64>)> = names.iter().map(|n| (*n, Some(8))).collect();
        AdapterDirs::new(prefix, &adapters)
    }

    /// The directory holding them.
    pub fn root(&self) -> &Path {
        &self.0
    }

    /// The directory of adapter `name`, as text (as a load names it).
    pub fn path(&self, name: &str) -> String {
        self.0.join(name).to_string_lossy().into_owned()
    }
}

impl Drop for AdapterDirs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
