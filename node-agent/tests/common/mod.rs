//! Shared helpers of the integration tests.
#![allow(dead_code, clippy::unwrap_used)]

pub mod agents;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

/// A fresh, empty temporary directory.
pub fn temp_dir(name: &str) -> PathBuf {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let dir = std::env::temp_dir().join(format!(
        "capyctl-node-agent-{name}-{}-{nanos}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn newest_source(dir: &Path) -> SystemTime {
    let mut newest = UNIX_EPOCH;
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        let t = if path.is_dir() {
            newest_source(&path)
        } else {
            entry
                .metadata()
                .and_then(|m| m.modified())
                .unwrap_or(UNIX_EPOCH)
        };
        newest = newest.max(t);
    }
    newest
}

/// The `engine-sim` binary: `target/debug/engine-sim` next to this test binary's directory,
/// built with `cargo build -p capyctl-engine-sim --bin engine-sim` when missing or older than
/// the simulator's sources.
pub fn engine_sim_binary() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let exe = std::env::current_exe().unwrap();
        // target/debug/deps/<test> → target/debug
        let profile_dir = exe.parent().unwrap().parent().unwrap().to_path_buf();
        let bin = profile_dir.join("engine-sim");
        let sources = Path::new(env!("CARGO_MANIFEST_DIR")).join("../engine-sim");
        let fresh = std::fs::metadata(&bin)
            .and_then(|m| m.modified())
            .is_ok_and(|t| t >= newest_source(&sources.join("src")));
        if !fresh {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let status = std::process::Command::new(cargo)
                .args(["build", "-p", "capyctl-engine-sim", "--bin", "engine-sim"])
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .status()
                .unwrap();
            assert!(status.success(), "building engine-sim failed");
        }
        assert!(bin.exists(), "no engine-sim at {}", bin.display());
        bin
    })
    .clone()
}

/// Writes a safetensors file with `tensors` (name, dtype, shape); the data is zeros.
pub fn write_safetensors(path: &Path, tensors: &[(&str, &str, &[u64])]) -> u64 {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut offset = 0u64;
    for (name, dtype, shape) in tensors {
        let elem = match *dtype {
            "F16" | "BF16" => 2,
            "F32" => 4,
            "F64" | "I64" => 8,
            _ => 1,
        };
        let size = shape.iter().product::<u64>() * elem;
        header.insert(
            (*name).into(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}),
        );
        offset += size;
    }
    let text = serde_json::Value::Object(header).to_string();
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(text.as_bytes());
    bytes.resize(bytes.len() + offset as usize, 0);
    std::fs::write(path, bytes).unwrap();
    offset
}
