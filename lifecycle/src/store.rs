//! Where the server's state lives: deployments (document, ID, revision), the operator's decisions
//! and the first answers. [`Store`] is the seam: the lifecycle loads every record once when it
//! opens, then writes only what changed: the changed records, a batch in one transaction, and
//! the IDs of deleted ones. [`RedbStore`] keeps them in `<data-dir>/state.redb` (standalone); on
//! Kubernetes the CR status takes its place (`k8s::store::CrStore`).
//!
//! Instance states are not stored: they are facts about engines, and after a restart the host
//! agent's recovery tells what is still running (adopted) and what is not.
//!
//! NB: `state.redb` is a [redb](https://docs.rs/redb) database: pure Rust (no C toolchain, so
//! it builds quickly on small machines, where SQLite through rusqlite compiles SQLite's C), one
//! file, ACID transactions whose commit is durable when it returns (copy-on-write B-trees and a
//! checksummed commit slot: a crash at any moment leaves the last commit, never a torn one).
//! The state is records by ID and nothing queries them otherwise, so a key-value store is all it
//! takes. Table `deployments` maps a deployment's ID to the JSON of its [`DeploymentRecord`];
//! table `meta` holds the format version ([`STATE_VERSION`]). Before it, the state was one JSON
//! file, `<data-dir>/state.json`, rewritten whole on every change: the first start that finds
//! it (and no state database) imports it in one transaction and renames it
//! `state.json.migrated`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use capyctl_interfaces::verify::FirstAnswer;
use capyctl_spec::documents::DeploymentDoc;
use redb::{ReadableDatabase, ReadableTable, TableDefinition, TableError};
use serde::{Deserialize, Serialize};

/// The state's format version (of `state.redb`'s records, and of the `state.json` before it).
pub const STATE_VERSION: u32 = 1;

/// The state database's file name in the data directory.
pub const STATE_FILE: &str = "state.redb";

/// The state file of CapyCTL before the state database, imported on the first start.
pub const LEGACY_STATE_FILE: &str = "state.json";

/// What [`LEGACY_STATE_FILE`] is renamed to once imported.
pub const MIGRATED_STATE_FILE: &str = "state.json.migrated";

/// Deployment ID -> the JSON of its [`DeploymentRecord`].
const RECORDS: TableDefinition<&str, &str> = TableDefinition::new("deployments");
/// `version` -> [`STATE_VERSION`]; `migrated_from_state_json` -> 1 once `state.json` was
/// imported (written in the import's transaction).
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const VERSION_KEY: &str = "version";
const MIGRATED_KEY: &str = "migrated_from_state_json";

/// redb's page cache: the whole state of 10,000 deployments is a few MiB.
const CACHE_BYTES: usize = 16 << 20;

/// One deployment as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeploymentRecord {
    /// The deployment's ID (a ULID).
    pub id: String,
    /// Bumped by a re-deploy of a changed document; starts at 1.
    pub revision: u64,
    /// The document as deployed (the latest revision). Shared (one copy per deployment): with
    /// the views' [`crate::views`] part and the records of the deployment's other instances.
    #[serde(with = "shared_doc")]
    pub doc: Arc<DeploymentDoc>,
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

impl DeploymentRecord {
    /// The record of a deployment first deployed as `doc`: revision 1, never started, no
    /// operator's flag.
    pub fn first(id: String, doc: DeploymentDoc) -> Self {
        DeploymentRecord {
            id,
            revision: 1,
            doc: Arc::new(doc),
            operator_stopped: false,
            operator_started: false,
            pending_start: false,
            generation: 0,
            first_answer: None,
        }
    }
}

/// A shared document, stored as the document itself.
mod shared_doc {
    use std::sync::Arc;

    use capyctl_spec::documents::DeploymentDoc;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub(super) fn serialize<S: Serializer>(
        doc: &Arc<DeploymentDoc>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        DeploymentDoc::serialize(doc, s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Arc<DeploymentDoc>, D::Error> {
        DeploymentDoc::deserialize(d).map(Arc::new)
    }
}

/// What one [`Store::write`] changes, in one transaction.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Changes {
    /// Records written (added, or replacing the one of the same ID).
    pub put: Vec<DeploymentRecord>,
    /// IDs of deleted deployments (an ID not stored is no error).
    pub remove: Vec<String>,
}

impl Changes {
    /// Nothing to write.
    pub fn is_empty(&self) -> bool {
        self.put.is_empty() && self.remove.is_empty()
    }
}

/// A store that keeps its records in memory, by ID: each write changes only the records it
/// names. The Kubernetes store is one (its records reach the API server as the CRs' status),
/// and so are the tests' and the benches' stores.
///
/// NB (memory at scale): the records are a set ordered by their own ID ([`ById`]), not a map
/// keyed by a copy of it (some 50 bytes of heap per deployment).
#[derive(Debug, Default)]
pub struct MemoryStore {
    records: Mutex<BTreeSet<ById>>,
}

/// A record in [`MemoryStore`]: ordered, compared and looked up by its ID alone.
#[derive(Debug)]
struct ById(DeploymentRecord);

impl PartialEq for ById {
    fn eq(&self, other: &Self) -> bool {
        self.0.id == other.0.id
    }
}

impl Eq for ById {}

impl PartialOrd for ById {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ById {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.id.cmp(&other.0.id)
    }
}

impl std::borrow::Borrow<str> for ById {
    fn borrow(&self) -> &str {
        &self.0.id
    }
}

impl MemoryStore {
    /// A store holding `records`.
    pub fn new(records: impl IntoIterator<Item = DeploymentRecord>) -> Self {
        Self {
            records: Mutex::new(records.into_iter().map(ById).collect()),
        }
    }

    /// The record of deployment `id`, as last written.
    pub fn get(&self, id: &str) -> Option<DeploymentRecord> {
        self.lock().get(id).map(|r| r.0.clone())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<ById>> {
        self.records.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Store for MemoryStore {
    /// By ID.
    fn load(&self) -> Result<Vec<DeploymentRecord>, StoreError> {
        Ok(self.lock().iter().map(|r| r.0.clone()).collect())
    }

    fn write(&self, changes: &Changes) -> Result<(), StoreError> {
        let mut records = self.lock();
        for r in &changes.put {
            records.replace(ById(r.clone()));
        }
        for id in &changes.remove {
            records.remove(id.as_str());
        }
        Ok(())
    }
}

/// What can go wrong reading or writing the state. Each names the file.
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
    /// The state database could not be opened, read or written.
    #[error("state database {}: cannot {what}: {source}", path.display())]
    Database {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The database's error.
        #[source]
        source: Box<redb::Error>,
    },
    /// The state (a file, a record) is not valid.
    #[error("state {} is corrupt: {what}: {detail}", path.display())]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What of it is not valid.
        what: String,
        /// Why.
        detail: String,
    },
    /// The state database was closed ([`Store::close`]): nothing more is written.
    #[error("state database {}: closed (the server is closing)", path.display())]
    Closed {
        /// The file.
        path: PathBuf,
    },
    /// The state was written by a newer CapyCTL.
    #[error("state {}: version {found} is newer than this CapyCTL understands ({STATE_VERSION})", path.display())]
    Version {
        /// The file.
        path: PathBuf,
        /// The version found.
        found: u64,
    },
}

impl StoreError {
    /// A short, stable label for metrics and event reasons.
    pub fn metric_label(&self) -> &'static str {
        match self {
            StoreError::Io { .. } => "io",
            StoreError::Database { .. } => "database",
            StoreError::Corrupt { .. } => "corrupt",
            StoreError::Closed { .. } => "closed",
            StoreError::Version { .. } => "version",
        }
    }
}

/// Loads and writes the server's state. A [`Store::write`] is atomic: after a crash, `load`
/// answers every record as before it or every record as after it.
pub trait Store: Send + Sync {
    /// Every record stored (none when nothing was ever written), in no particular order.
    /// The lifecycle reads it once, when it opens.
    fn load(&self) -> Result<Vec<DeploymentRecord>, StoreError>;
    /// Writes `changes` in one transaction: each record of `put` replaces the one of its ID
    /// (or is added), each ID of `remove` is deleted. Records not named are not touched.
    fn write(&self, changes: &Changes) -> Result<(), StoreError>;
    /// Lets go of what it holds (the server closes): later writes fail. The default holds
    /// nothing.
    fn close(&self) {}
}

/// The state in `<data-dir>/state.redb` (see the module's doc).
pub struct RedbStore {
    /// `<data-dir>/state.redb`. Read-only.
    path: PathBuf,
    /// Taken by [`Store::close`], which lets go of the file (and its lock: a server opened
    /// next on the same directory, in this process too, opens it again).
    db: Mutex<Option<redb::Database>>,
}

impl std::fmt::Debug for RedbStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedbStore")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl RedbStore {
    /// Opens (or creates) the state database of `data_dir` (created when missing). A new
    /// database imports `<data-dir>/state.json` when there is one, in one transaction, then
    /// renames that file `state.json.migrated`. Refused, naming the file: a database that is
    /// not one or is damaged, one of a newer version, a `state.json` to import that is not
    /// valid or is of a newer version.
    pub fn open(data_dir: impl AsRef<Path>) -> Result<Self, StoreError> {
        let dir = data_dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|source| StoreError::Io {
            what: "create the data directory",
            path: dir.to_path_buf(),
            source,
        })?;
        let path = dir.join(STATE_FILE);
        // Every page's checksum is verified on open: a file damaged outside redb is refused
        // (`Corrupt`) instead of trusted. It reads the whole file: a few MiB for 10,000
        // deployments.
        let db = redb::Builder::new()
            .set_cache_size(CACHE_BYTES)
            .set_check_integrity_on_open(true)
            .create(&path)
            .map_err(|e| db_error("open", &path, e))?;
        let store = RedbStore {
            path,
            db: Mutex::new(Some(db)),
        };
        store.initialize(dir)?;
        Ok(store)
    }

    /// `f` on the database, unless it is closed.
    fn with_db<R>(
        &self,
        f: impl FnOnce(&redb::Database) -> Result<R, StoreError>,
    ) -> Result<R, StoreError> {
        match self
            .db
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
        {
            Some(db) => f(db),
            None => Err(StoreError::Closed {
                path: self.path.clone(),
            }),
        }
    }

    /// The state database's file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Checks the version of an initialized database; initializes a new one (importing
    /// `state.json` when there is one).
    fn initialize(&self, dir: &Path) -> Result<(), StoreError> {
        let err = |e: redb::Error| db_error("read", &self.path, e);
        let (version, migrated) = self.with_db(|db| {
            let read = db.begin_read().map_err(|e| err(e.into()))?;
            match read.open_table(META) {
                Ok(meta) => {
                    let get = |key: &str| {
                        meta.get(key)
                            .map(|v| v.map(|v| v.value()))
                            .map_err(|e| err(e.into()))
                    };
                    Ok((get(VERSION_KEY)?, get(MIGRATED_KEY)?.is_some()))
                }
                Err(TableError::TableDoesNotExist(_)) => Ok((None, false)),
                Err(e) => Err(err(e.into())),
            }
        })?;
        let legacy = dir.join(LEGACY_STATE_FILE);
        let legacy_exists = legacy.try_exists().map_err(|source| StoreError::Io {
            what: "look for",
            path: legacy.clone(),
            source,
        })?;
        match version {
            Some(found) if found > u64::from(STATE_VERSION) => Err(StoreError::Version {
                path: self.path.clone(),
                found,
            }),
            Some(_) => {
                if legacy_exists {
                    let renamed = dir.join(MIGRATED_STATE_FILE);
                    if migrated && !renamed.exists() {
                        // Imported, but the rename did not happen (a crash in between).
                        rename_migrated(dir)?;
                        tracing::info!(file = %legacy.display(), "the state file was imported before; renamed {MIGRATED_STATE_FILE}");
                    } else {
                        tracing::warn!(file = %legacy.display(), database = %self.path.display(), "a state file beside the state database is ignored: the database holds the state");
                    }
                }
                Ok(())
            }
            None => {
                let records = if legacy_exists {
                    read_legacy(&legacy)?
                } else {
                    Vec::new()
                };
                let count = records.len();
                self.commit(
                    &Changes {
                        put: records,
                        remove: Vec::new(),
                    },
                    Some(legacy_exists),
                )?;
                if legacy_exists {
                    rename_migrated(dir)?;
                    tracing::info!(
                        from = %legacy.display(),
                        to = %self.path.display(),
                        deployments = count,
                        "imported the state file into the state database; the file is renamed {MIGRATED_STATE_FILE}"
                    );
                }
                Ok(())
            }
        }
    }

    /// One transaction: `changes`, and with `init` the meta entries of a new database
    /// (`Some(true)`: imported from `state.json`).
    fn commit(&self, changes: &Changes, init: Option<bool>) -> Result<(), StoreError> {
        // Encoded before the transaction begins: nothing fails half-way through it for that.
        let put: Vec<(&str, String)> = changes
            .put
            .iter()
            .map(|r| {
                serde_json::to_string(r)
                    .map(|json| (r.id.as_str(), json))
                    .map_err(|e| StoreError::Corrupt {
                        path: self.path.clone(),
                        what: format!("record {} cannot be written as JSON", r.id),
                        detail: e.to_string(),
                    })
            })
            .collect::<Result<_, _>>()?;
        let err = |e: redb::Error| db_error("write", &self.path, e);
        self.with_db(|db| {
            let txn = db.begin_write().map_err(|e| err(e.into()))?;
            {
                let mut table = txn.open_table(RECORDS).map_err(|e| err(e.into()))?;
                for (id, json) in &put {
                    table
                        .insert(*id, json.as_str())
                        .map_err(|e| err(e.into()))?;
                }
                for id in &changes.remove {
                    table.remove(id.as_str()).map_err(|e| err(e.into()))?;
                }
                if let Some(imported) = init {
                    let mut meta = txn.open_table(META).map_err(|e| err(e.into()))?;
                    meta.insert(VERSION_KEY, u64::from(STATE_VERSION))
                        .map_err(|e| err(e.into()))?;
                    if imported {
                        meta.insert(MIGRATED_KEY, 1).map_err(|e| err(e.into()))?;
                    }
                }
            }
            txn.commit().map_err(|e| err(e.into()))
        })
    }
}

impl Store for RedbStore {
    fn load(&self) -> Result<Vec<DeploymentRecord>, StoreError> {
        let err = |e: redb::Error| db_error("read", &self.path, e);
        let read = self.with_db(|db| db.begin_read().map_err(|e| err(e.into())))?;
        let table = match read.open_table(RECORDS) {
            Ok(t) => t,
            Err(TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
            Err(e) => return Err(err(e.into())),
        };
        let mut records = Vec::new();
        for entry in table.iter().map_err(|e| err(e.into()))? {
            let (id, json) = entry.map_err(|e| err(e.into()))?;
            let record: DeploymentRecord =
                serde_json::from_str(json.value()).map_err(|e| StoreError::Corrupt {
                    path: self.path.clone(),
                    what: format!("record {}", id.value()),
                    detail: e.to_string(),
                })?;
            if record.id != id.value() {
                return Err(StoreError::Corrupt {
                    path: self.path.clone(),
                    what: format!("record {}", id.value()),
                    detail: format!("it holds deployment {}", record.id),
                });
            }
            records.push(record);
        }
        Ok(records)
    }

    fn write(&self, changes: &Changes) -> Result<(), StoreError> {
        if changes.is_empty() {
            return Ok(());
        }
        self.commit(changes, None)
    }

    fn close(&self) {
        self.db
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
    }
}

/// A redb error while doing `what` on `path`: [`StoreError::Corrupt`] when redb says the file
/// is damaged or is not a database, [`StoreError::Database`] otherwise.
fn db_error(what: &'static str, path: &Path, e: impl Into<redb::Error>) -> StoreError {
    let e: redb::Error = e.into();
    let corrupt = match &e {
        redb::Error::Corrupted(detail) => Some(detail.clone()),
        redb::Error::Io(io) if io.kind() == std::io::ErrorKind::InvalidData => Some(io.to_string()),
        _ => None,
    };
    match corrupt {
        Some(detail) => StoreError::Corrupt {
            path: path.to_path_buf(),
            what: format!("cannot {what} it as a redb database"),
            detail,
        },
        None => StoreError::Database {
            what,
            path: path.to_path_buf(),
            source: Box::new(e),
        },
    }
}

/// `state.json` as CapyCTL wrote it before the state database.
#[derive(Deserialize)]
struct LegacyState {
    version: u64,
    deployments: Vec<DeploymentRecord>,
}

/// The records of `state.json` at `path`.
fn read_legacy(path: &Path) -> Result<Vec<DeploymentRecord>, StoreError> {
    let text = std::fs::read(path).map_err(|source| StoreError::Io {
        what: "read",
        path: path.to_path_buf(),
        source,
    })?;
    let state: LegacyState = serde_json::from_slice(&text).map_err(|e| StoreError::Corrupt {
        path: path.to_path_buf(),
        what: "not a valid state file".to_string(),
        detail: e.to_string(),
    })?;
    if state.version > u64::from(STATE_VERSION) {
        return Err(StoreError::Version {
            path: path.to_path_buf(),
            found: state.version,
        });
    }
    Ok(state.deployments)
}

/// Renames the imported `state.json` `state.json.migrated`.
fn rename_migrated(dir: &Path) -> Result<(), StoreError> {
    let from = dir.join(LEGACY_STATE_FILE);
    std::fs::rename(&from, dir.join(MIGRATED_STATE_FILE)).map_err(|source| StoreError::Io {
        what: "rename (imported into the state database)",
        path: from,
        source,
    })
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

    fn record(id: &str, name: &str) -> DeploymentRecord {
        DeploymentRecord::first(id.into(), doc(name))
    }

    fn sorted(mut records: Vec<DeploymentRecord>) -> Vec<DeploymentRecord> {
        records.sort_by(|a, b| a.id.cmp(&b.id));
        records
    }

    #[test]
    fn the_memory_store_writes_only_the_records_named_and_loads_by_id() {
        let store = MemoryStore::new([record("b", "two"), record("a", "one")]);
        let mut changed = record("b", "two");
        changed.revision = 2;
        store
            .write(&Changes {
                put: vec![changed, record("c", "three")],
                remove: vec!["a".into(), "not-stored".into()],
            })
            .unwrap();
        let loaded = store.load().unwrap();
        let ids: Vec<&str> = loaded.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["b", "c"]);
        assert_eq!(store.get("b").unwrap().revision, 2);
        assert_eq!(store.get("c").unwrap().doc.name, "three");
        assert!(store.get("a").is_none());
    }

    /// The raw JSON of every record in the database at `path` (the store closed), by ID.
    fn raw(path: &Path) -> std::collections::BTreeMap<String, String> {
        let db = redb::Database::open(path).unwrap();
        let read = db.begin_read().unwrap();
        let table = read.open_table(RECORDS).unwrap();
        table
            .iter()
            .unwrap()
            .map(|e| {
                let (k, v) = e.unwrap();
                (k.value().to_string(), v.value().to_string())
            })
            .collect()
    }

    fn put(records: &[DeploymentRecord]) -> Changes {
        Changes {
            put: records.to_vec(),
            remove: Vec::new(),
        }
    }

    #[test]
    fn nothing_written_loads_empty() {
        let d = dir("empty");
        let s = RedbStore::open(&d).unwrap();
        assert_eq!(s.load().unwrap(), []);
        assert_eq!(s.path(), d.join("state.redb"));
        drop(s);
        assert!(d.join("state.redb").is_file());
    }

    #[test]
    fn records_round_trip_across_an_open() {
        let d = dir("round");
        let s = RedbStore::open(&d).unwrap();
        let mut a = record("01KA", "chat-a");
        a.revision = 3;
        a.operator_stopped = true;
        a.pending_start = true;
        a.generation = 2;
        a.first_answer = Some(FirstAnswer::Text {
            text: "Paris".into(),
        });
        let b = record("01KB", "chat-b");
        s.write(&put(&[a.clone(), b.clone()])).unwrap();
        assert_eq!(sorted(s.load().unwrap()), [a.clone(), b.clone()]);
        drop(s);
        assert_eq!(sorted(RedbStore::open(&d).unwrap().load().unwrap()), [a, b]);
    }

    #[test]
    fn a_write_touches_only_the_records_it_names() {
        let d = dir("only");
        let path = d.join(STATE_FILE);
        let s = RedbStore::open(&d).unwrap();
        s.write(&put(&[record("01KA", "chat-a"), record("01KB", "chat-b")]))
            .unwrap();
        drop(s);
        // B as another writer left it: its text is not what this store would write.
        let b_text = format!(
            "{{ \"revision\": 1, \"id\": \"01KB\", \"doc\": {} }}",
            serde_json::to_string(&doc("chat-b")).unwrap()
        );
        {
            let db = redb::Database::open(&path).unwrap();
            let txn = db.begin_write().unwrap();
            txn.open_table(RECORDS)
                .unwrap()
                .insert("01KB", b_text.as_str())
                .unwrap();
            txn.commit().unwrap();
        }
        let s = RedbStore::open(&d).unwrap();
        let mut a = record("01KA", "chat-a");
        a.revision = 2;
        s.write(&put(std::slice::from_ref(&a))).unwrap();
        drop(s);
        let stored = raw(&path);
        // A is the new one; B's bytes are as they were: it was not written again.
        assert_eq!(stored["01KA"], serde_json::to_string(&a).unwrap());
        assert_eq!(stored["01KB"], b_text);
    }

    #[test]
    fn a_removed_record_is_gone_and_the_others_stay() {
        let d = dir("remove");
        let s = RedbStore::open(&d).unwrap();
        let (a, b) = (record("01KA", "chat-a"), record("01KB", "chat-b"));
        s.write(&put(&[a.clone(), b])).unwrap();
        s.write(&Changes {
            put: Vec::new(),
            remove: vec!["01KB".into(), "01KNEVER".into()],
        })
        .unwrap();
        assert_eq!(s.load().unwrap(), std::slice::from_ref(&a));
        drop(s);
        assert_eq!(RedbStore::open(&d).unwrap().load().unwrap(), [a]);
        assert_eq!(raw(&d.join(STATE_FILE)).len(), 1);
    }

    #[test]
    fn a_state_json_is_imported_once_and_renamed() {
        let d = dir("migrate");
        let mut a = record("01KA", "chat-a");
        a.operator_started = true;
        a.generation = 4;
        let b = record("01KB", "chat-b");
        // As the file store wrote it.
        let text = serde_json::to_string_pretty(&serde_json::json!({
            "version": 1,
            "deployments": [a, b],
        }))
        .unwrap();
        std::fs::write(d.join("state.json"), &text).unwrap();
        let s = RedbStore::open(&d).unwrap();
        assert_eq!(sorted(s.load().unwrap()), [a.clone(), b.clone()]);
        assert!(!d.join("state.json").exists());
        assert_eq!(
            std::fs::read_to_string(d.join("state.json.migrated")).unwrap(),
            text
        );
        s.write(&Changes {
            put: Vec::new(),
            remove: vec!["01KB".into()],
        })
        .unwrap();
        drop(s);
        // A second start does not import again, even with a state.json back beside it.
        std::fs::write(d.join("state.json"), &text).unwrap();
        let s = RedbStore::open(&d).unwrap();
        assert_eq!(s.load().unwrap(), [a]);
        assert!(
            d.join("state.json").exists(),
            "not imported: left where it is"
        );
    }

    #[test]
    fn an_import_interrupted_before_the_rename_is_finished_without_importing_again() {
        let d = dir("migrate-crash");
        let a = record("01KA", "chat-a");
        let text = serde_json::to_string(&serde_json::json!({
            "version": 1, "deployments": [a],
        }))
        .unwrap();
        std::fs::write(d.join("state.json"), &text).unwrap();
        drop(RedbStore::open(&d).unwrap());
        // The crash: the import committed, the file was not renamed.
        std::fs::rename(d.join("state.json.migrated"), d.join("state.json")).unwrap();
        let s = RedbStore::open(&d).unwrap();
        s.write(&Changes {
            put: Vec::new(),
            remove: vec!["01KA".into()],
        })
        .unwrap();
        assert!(!d.join("state.json").exists());
        assert!(d.join("state.json.migrated").exists());
        drop(s);
        assert_eq!(RedbStore::open(&d).unwrap().load().unwrap(), []);
    }

    #[test]
    fn a_closed_store_lets_go_of_the_file_and_writes_nothing_more() {
        let d = dir("close");
        let s = RedbStore::open(&d).unwrap();
        s.write(&put(&[record("01KA", "chat-a")])).unwrap();
        s.close();
        // The next server on the directory, while this one still exists.
        let next = RedbStore::open(&d).unwrap();
        assert_eq!(next.load().unwrap().len(), 1);
        let err = s.write(&put(&[record("01KB", "chat-b")])).unwrap_err();
        assert_eq!(err.metric_label(), "closed");
        assert!(err.to_string().contains("state.redb"), "{err}");
    }

    #[test]
    fn a_corrupt_database_names_itself() {
        let d = dir("corrupt");
        std::fs::write(d.join("state.redb"), vec![0x5a; 8192]).unwrap();
        let err = RedbStore::open(&d).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains(&*d.join("state.redb").to_string_lossy()),
            "{text}"
        );
        assert_eq!(err.metric_label(), "corrupt", "{text}");
    }

    #[test]
    fn a_corrupt_record_names_the_file_and_the_record() {
        let d = dir("corrupt-record");
        drop(RedbStore::open(&d).unwrap());
        {
            let db = redb::Database::open(d.join(STATE_FILE)).unwrap();
            let txn = db.begin_write().unwrap();
            txn.open_table(RECORDS)
                .unwrap()
                .insert("01KA", "{not json")
                .unwrap();
            txn.commit().unwrap();
        }
        let err = RedbStore::open(&d).unwrap().load().unwrap_err().to_string();
        assert!(err.contains("state.redb") && err.contains("01KA"), "{err}");
    }

    #[test]
    fn a_corrupt_state_json_names_itself_and_is_left_in_place() {
        let d = dir("corrupt-json");
        std::fs::write(d.join("state.json"), "{not json").unwrap();
        let err = RedbStore::open(&d).unwrap_err().to_string();
        assert!(err.contains("state.json"), "{err}");
        assert!(d.join("state.json").exists());
    }

    #[test]
    fn a_newer_version_is_refused() {
        let d = dir("version");
        drop(RedbStore::open(&d).unwrap());
        {
            let db = redb::Database::open(d.join(STATE_FILE)).unwrap();
            let txn = db.begin_write().unwrap();
            txn.open_table(META)
                .unwrap()
                .insert(VERSION_KEY, 99)
                .unwrap();
            txn.commit().unwrap();
        }
        let err = RedbStore::open(&d).unwrap_err();
        assert_eq!(err.metric_label(), "version");
        assert!(err.to_string().contains("state.redb"), "{err}");
        // A newer state.json is refused too, and not imported.
        let d = dir("version-json");
        std::fs::write(
            d.join("state.json"),
            r#"{"version": 99, "deployments": []}"#,
        )
        .unwrap();
        let err = RedbStore::open(&d).unwrap_err();
        assert_eq!(err.metric_label(), "version");
        assert!(err.to_string().contains("state.json"), "{err}");
        assert!(d.join("state.json").exists());
    }
}
