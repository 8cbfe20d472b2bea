//! Where the server's state lives: deployments (document, ID, revision), the operator's decisions
//! and the first answers. [`Store`] is the seam; [`FileStore`] keeps it in
//! `<data-dir>/state.json` (standalone); on Kubernetes the CR status takes its place.
//!
//! Instance states are not stored: they are facts about engines, and after a restart the host
//! agent's recovery tells what is still running (adopted) and what is not.
//!
//! NB: every save writes the whole state (a handful of deployments) to a temporary file, fsyncs
//! it, renames it over `state.json` and fsyncs the directory, so a crash at any moment leaves
//! either the old or the new file, never a torn one.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use capyctl_node_agent::verify::FirstAnswer;
use capyctl_spec::documents::DeploymentDoc;
use serde::{Deserialize, Serialize};

/// The state file's format version.
pub const STATE_VERSION: u32 = 1;

/// One deployment as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeploymentRecord {
    /// The deployment's ID (a ULID).
    pub id: String,
    /// Bumped by a re-deploy of a changed document; starts at 1.
    pub revision: u64,
    /// The document as deployed (the latest revision).
    pub doc: DeploymentDoc,
    /// An operator stopped it: requests get 409 `deployment_stopped` until a start.
    #[serde(default)]
    pub operator_stopped: bool,
    /// An operator started it and has not stopped or parked it since (explicit activation:
    /// the model the operator wants running).
    #[serde(default)]
    pub operator_started: bool,
    /// An operator start waits for memory (without `--evict`); it is tried again whenever
    /// memory is freed, also after a restart.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pending_start: bool,
    /// The instance's generation: bumped on every fresh start.
    #[serde(default)]
    pub generation: u64,
    /// The first answer of the current generation, once recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_answer: Option<FirstAnswer>,
}

/// Everything stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredState {
    /// [`STATE_VERSION`].
    pub version: u32,
    /// Every deployment, by name.
    pub deployments: Vec<DeploymentRecord>,
}

impl Default for StoredState {
    fn default() -> Self {
        Self {
            version: STATE_VERSION,
            deployments: Vec::new(),
        }
    }
}

/// What can go wrong reading or writing the state.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A file operation failed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The state file is not valid.
    #[error("state file {}: {source}", path.display())]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// The parser's error.
        #[source]
        source: serde_json::Error,
    },
    /// The state file was written by a newer CapyCTL.
    #[error("state file {}: version {found} is newer than this CapyCTL understands ({STATE_VERSION})", path.display())]
    Version {
        /// The file.
        path: PathBuf,
        /// The version found.
        found: u32,
    },
}

impl StoreError {
    /// A short, stable label for metrics and event reasons.
    pub fn metric_label(&self) -> &'static str {
        match self {
            StoreError::Io { .. } => "io",
            StoreError::Corrupt { .. } => "corrupt",
            StoreError::Version { .. } => "version",
        }
    }
}

/// Loads and saves the server's state. `save` is atomic: after a crash, `load` answers either
/// the state before or the state after the last save.
pub trait Store: Send + Sync {
    /// Everything stored; the empty state when nothing was ever saved.
    fn load(&self) -> Result<StoredState, StoreError>;
    /// Replaces everything stored with `state`.
    fn save(&self, state: &StoredState) -> Result<(), StoreError>;
}

/// The state in `<data-dir>/state.json`.
#[derive(Debug)]
pub struct FileStore {
    /// `<data-dir>/state.json`. Read-only.
    path: PathBuf,
    /// Serialises writers (one temporary file at a time).
    write: Mutex<()>,
}

impl FileStore {
    /// The store of `data_dir` (created when missing).
    pub fn new(data_dir: impl AsRef<Path>) -> Result<Self, StoreError> {
        let dir = data_dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|source| StoreError::Io {
            what: "create the data directory",
            path: dir.to_path_buf(),
            source,
        })?;
        Ok(Self {
            path: dir.join("state.json"),
            write: Mutex::new(()),
        })
    }

    /// The state file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Store for FileStore {
    fn load(&self) -> Result<StoredState, StoreError> {
        let text = match std::fs::read(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(StoredState::default());
            }
            Err(source) => {
                return Err(StoreError::Io {
                    what: "read",
                    path: self.path.clone(),
                    source,
                });
            }
        };
        let state: StoredState =
            serde_json::from_slice(&text).map_err(|source| StoreError::Corrupt {
                path: self.path.clone(),
                source,
            })?;
        if state.version > STATE_VERSION {
            return Err(StoreError::Version {
                path: self.path.clone(),
                found: state.version,
            });
        }
        Ok(state)
    }

    fn save(&self, state: &StoredState) -> Result<(), StoreError> {
        let _guard = self.write.lock().unwrap_or_else(PoisonError::into_inner);
        let tmp = self.path.with_extension("json.tmp");
        let io = |what: &'static str, path: &Path| {
            let path = path.to_path_buf();
            move |source| StoreError::Io { what, path, source }
        };
        let text = serde_json::to_vec_pretty(state).map_err(|source| StoreError::Corrupt {
            path: self.path.clone(),
            source,
        })?;
        {
            let mut file = std::fs::File::create(&tmp).map_err(io("create", &tmp))?;
            file.write_all(&text).map_err(io("write", &tmp))?;
            file.sync_all().map_err(io("fsync", &tmp))?;
        }
        std::fs::rename(&tmp, &self.path).map_err(io("rename", &self.path))?;
        if let Some(dir) = self.path.parent()
            && let Ok(d) = std::fs::File::open(dir)
        {
            // Makes the rename itself durable; a directory that cannot be fsynced (some
            // filesystems) still has the new file in place.
            let _ = d.sync_all();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "capyctl-store-{name}-{}-{}",
            std::process::id(),
            ulid::Ulid::new()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn doc(name: &str) -> DeploymentDoc {
        capyctl_spec::documents::parse_deployment_str(
            "t.yaml",
            &format!("name: {name}\nengine: vllm\nmodel: Qwen3-4B\n"),
        )
        .unwrap()
    }

    #[test]
    fn nothing_saved_loads_empty() {
        let s = FileStore::new(dir("empty")).unwrap();
        assert_eq!(s.load().unwrap(), StoredState::default());
    }

    #[test]
    fn save_then_load_round_trips_and_leaves_no_temp_file() {
        let d = dir("round");
        let s = FileStore::new(&d).unwrap();
        let state = StoredState {
            version: STATE_VERSION,
            deployments: vec![DeploymentRecord {
                id: "01K".into(),
                revision: 3,
                doc: doc("chat-a"),
                operator_stopped: true,
                operator_started: false,
                pending_start: true,
                generation: 2,
                first_answer: None,
            }],
        };
        s.save(&state).unwrap();
        assert_eq!(FileStore::new(&d).unwrap().load().unwrap(), state);
        assert!(!d.join("state.json.tmp").exists());
    }

    #[test]
    fn a_corrupt_file_names_itself() {
        let d = dir("corrupt");
        std::fs::write(d.join("state.json"), "{not json").unwrap();
        let err = FileStore::new(&d).unwrap().load().unwrap_err().to_string();
        assert!(err.contains("state.json"), "{err}");
    }

    #[test]
    fn a_newer_version_is_refused() {
        let d = dir("version");
        std::fs::write(
            d.join("state.json"),
            r#"{"version": 99, "deployments": []}"#,
        )
        .unwrap();
        let err = FileStore::new(&d).unwrap().load().unwrap_err();
        assert_eq!(err.metric_label(), "version");
    }
}
