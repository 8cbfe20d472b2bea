//! Engines as child processes (standalone, and the node agent's `process` runtime).
//!
//! Each engine runs in its own process group on a free loopback port, its stdout and stderr
//! appended to `<data dir>/engines/<instance>.log`. A pid record
//! (`<data dir>/engines/<instance>.json`: pid, port, start time, command, and what the agent
//! needs to go on) is written before [`ProcessRuntime::spawn`] returns and removed when the
//! engine is stopped, so a restarted CapyCTL finds every engine it left behind:
//! [`ProcessRuntime::recover`] adopts an engine whose process is alive, is the same process
//! (same `/proc/<pid>/cmdline`, or the same start time when an engine rewrote its title) and
//! that its caller's check accepts (the agent asks the engine where it is and compares with
//! the record, see [`crate::recovery`]); it stops one that is alive but not accepted; it drops
//! the record of one that is gone (stopping what it left in its process group), or whose pid
//! now belongs to another program (which it leaves alone).
//!
//! Stopping sends SIGTERM to the engine's process group (`kill -TERM -<pgid>`, so worker
//! processes go too), waits for the grace period, then SIGKILLs the group. The `kill` command
//! is used because the workspace forbids `unsafe` (no `libc::kill`).
//!
//! Engines start workers (tensor-parallel ranks, vLLM's engine core) in their leader's process
//! group, and a worker can outlive its leader while holding GPU memory. So the group is
//! stopped even when the leader has already exited: on [`ProcessRuntime::stop`], on
//! [`ProcessRuntime::forget`] (an engine that exited by itself) and when recovery finds the
//! leader gone. A process-group ID can be taken by another program once every process of the
//! group has ended, so the group is signalled only while it is still this engine's: a live
//! leader must have the recorded start time; without the leader, every member must carry the
//! engine's instance in its environment ([`INSTANCE_ENV`], inherited by the workers) and have
//! started after the leader. Otherwise the group is left alone.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use capyctl_spec::EngineKind;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::error::AgentError;
use crate::launch::LaunchCommand;
use crate::measure::{GpuHeld, Measurement};
use crate::recovery::Transition;
use crate::spec::InstanceSpec;
use crate::tier::{LaunchParking, ParkTier};
use crate::verify::FirstAnswer;

/// What the agent records about a running engine, in `<data dir>/engines/<instance>.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PidRecord {
    /// The instance's ID.
    pub instance: String,
    /// The engine.
    pub engine: EngineKind,
    /// The engine's pid (also its process group).
    pub pid: u32,
    /// Its loopback port.
    pub port: u16,
    /// When it was started, milliseconds since the Unix epoch.
    pub started_at_ms: u64,
    /// The process's start time in clock ticks after boot (`/proc/<pid>/stat` field 22).
    pub start_ticks: Option<u64>,
    /// Program and arguments, as `/proc/<pid>/cmdline` shows them.
    pub command: Vec<String>,
    /// The log file.
    pub log: PathBuf,
    /// The deployment it runs.
    pub spec: InstanceSpec,
    /// How it was launched for parking.
    pub parking: LaunchParking,
    /// Its first answer, once recorded.
    pub first_answer: Option<FirstAnswer>,
    /// The tier it is parked in, while parked.
    pub parked: Option<ParkTier>,
    /// A park or wake begun and not yet recorded as done: written before the engine is
    /// called (see [`crate::recovery`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transition: Option<Transition>,
    /// While parked: the GPU memory the parked engine still holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_held: Option<GpuHeld>,
    /// The deployment's measurement, with the engine's footprint once read (so that a
    /// restarted agent knows it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measurement: Option<Measurement>,
}

/// How an engine ended: `None` while it runs.
pub type ExitWatch = watch::Receiver<Option<String>>;

/// The environment variable every engine process carries, and the workers it starts inherit:
/// the instance it runs for. It tells this engine's processes from a program that took over
/// its process-group ID.
pub const INSTANCE_ENV: &str = "CAPYCTL_ENGINE_INSTANCE";

/// How long the workers an engine left behind get between SIGTERM and SIGKILL when its leader
/// exited by itself (they have lost their engine and only hold memory).
pub const LEFTOVER_GRACE: Duration = Duration::from_secs(5);

/// How long a stop waits for a process group to be gone after SIGKILL.
const KILL_WAIT: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct Tracked {
    pid: u32,
    /// The port it was given (never given to another engine while this one is tracked).
    port: u16,
    exit: ExitWatch,
    group: EngineGroup,
}

/// An engine's process group: its ID (the leader's pid), the leader's start time, and the
/// instance its members carry in [`INSTANCE_ENV`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineGroup {
    /// The process-group ID: the leader's pid.
    pub pgid: u32,
    /// The leader's start time in clock ticks after boot, when recorded.
    pub leader_ticks: Option<u64>,
    /// The instance the engine runs for.
    pub instance: String,
}

impl EngineGroup {
    /// The group of the engine `record` describes.
    pub fn of(record: &PidRecord) -> Self {
        Self {
            pgid: record.pid,
            leader_ticks: record.start_ticks,
            instance: record.instance.clone(),
        }
    }

    /// The live processes of the group (zombies excluded), when the group is still this
    /// engine's (see the module doc); `None` when it belongs to another program now.
    pub fn members(&self) -> Option<Vec<u32>> {
        let members = group_members(self.pgid);
        let marked = |pid: u32| environ_has(pid, INSTANCE_ENV, &self.instance);
        let ours = if members.contains(&self.pgid) {
            match self.leader_ticks {
                Some(ticks) => start_ticks(self.pgid) == Some(ticks),
                None => marked(self.pgid),
            }
        } else {
            // A worker that set its process title over its environment (vLLM's
            // `VLLM::EngineCore` and `VLLM::Worker` do) no longer shows the instance's variable
            // there: the title overwrote the start of the block. Once the leader is gone, a
            // member that started after it and carries no instance variable at all counts as
            // the engine's too (one marked for another instance never does). Linux does not
            // reuse a pid while it is a live group's ID, so while a worker of this engine is
            // alive, nobody else can have made a group of this ID; without the leader's start
            // time, only marked members count.
            members.iter().all(|&pid| match self.leader_ticks {
                Some(t) => {
                    (marked(pid) || environ_lacks(pid, INSTANCE_ENV))
                        && start_ticks(pid).is_some_and(|s| s >= t)
                }
                None => marked(pid),
            })
        };
        ours.then_some(members)
    }

    /// Whether nothing of the group is left running (or what is left is not this engine's).
    pub fn gone(&self) -> bool {
        self.members().is_none_or(|m| m.is_empty())
    }

    /// Sends `signal` to the group while it is this engine's and has members; true when sent.
    async fn signal(&self, signal: &str) -> bool {
        match self.members() {
            Some(members) if !members.is_empty() => {
                kill(signal, &format!("-{}", self.pgid)).await;
                true
            }
            _ => false,
        }
    }

    /// Whether no process of the group is left at all (zombies apart), whoever's: once the
    /// group was found to be this engine's and signalled, every member is the engine's (Linux
    /// does not reuse a pid while it is a live group's ID, and only members can add members).
    /// [`EngineGroup::gone`] is not enough after a signal: a member that is exiting has no
    /// readable environment any more, so it stops counting as the engine's some time before it
    /// stops running (and before its memory is given back).
    fn drained(&self) -> bool {
        group_members(self.pgid).is_empty()
    }

    /// Stops the group: SIGTERM, up to `grace` for it to end, then SIGKILL. Returns at once
    /// when nothing of it is left, and otherwise once no member runs any more.
    pub async fn stop(&self, grace: Duration) {
        if !self.signal("TERM").await {
            return;
        }
        if !wait_until(grace, || self.drained()).await {
            tracing::warn!(instance = %self.instance, pgid = self.pgid, "engine processes ignored SIGTERM; killing them");
            self.signal("KILL").await;
            if !wait_until(KILL_WAIT, || self.drained()).await {
                tracing::error!(instance = %self.instance, pgid = self.pgid, "engine processes survived SIGKILL");
            }
        }
    }
}

/// The pids `/proc` lists now (none when it cannot be read).
fn proc_pids() -> impl Iterator<Item = u32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()))
}

/// The live (not zombie) processes whose process group is `pgid`, from `/proc/*/stat`.
fn group_members(pgid: u32) -> Vec<u32> {
    proc_pids()
        .filter(|&pid| {
            stat_fields(pid).is_some_and(|f| {
                f.first().is_some_and(|state| state != "Z" && state != "X")
                    && f.get(2).and_then(|g| g.parse::<u32>().ok()) == Some(pgid)
            })
        })
        .collect()
}

/// Whether process `pid` was started with `key=value` in its environment
/// (`/proc/<pid>/environ`; false when unreadable, as for another user's process).
fn environ_has(pid: u32, key: &str, value: &str) -> bool {
    let wanted = format!("{key}={value}");
    std::fs::read(format!("/proc/{pid}/environ"))
        .is_ok_and(|raw| raw.split(|b| *b == 0).any(|v| v == wanted.as_bytes()))
}

/// Whether process `pid`'s `/proc/<pid>/environ` is readable and has no `key=` entry at all
/// (what a process whose title overwrote its environment shows; false when unreadable).
fn environ_lacks(pid: u32, key: &str) -> bool {
    let prefix = format!("{key}=");
    std::fs::read(format!("/proc/{pid}/environ")).is_ok_and(|raw| {
        !raw.split(|b| *b == 0)
            .any(|v| v.starts_with(prefix.as_bytes()))
    })
}

/// Polls `done` every 20 ms until it holds, for at most `bound`; true when it did.
async fn wait_until(bound: Duration, done: impl Fn() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + bound;
    loop {
        if done() {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What [`ProcessRuntime::recover`] did with each record left behind.
#[derive(Debug, Default)]
pub struct Recovery {
    /// Engines alive and answering: adopted, tracked as if started now.
    pub adopted: Vec<PidRecord>,
    /// Engines alive but not answering: stopped, record removed.
    pub stopped: Vec<PidRecord>,
    /// Engines gone (or pid reused by another program): record removed.
    pub gone: Vec<PidRecord>,
}

/// Starts, tracks and stops engine processes. Shared state is one std mutex over the tracked
/// processes, never held across an `.await`.
#[derive(Debug)]
pub struct ProcessRuntime {
    /// `<data dir>/engines`. Read-only.
    dir: PathBuf,
    /// Engines started or adopted by this runtime, by instance.
    tracked: Mutex<HashMap<String, Tracked>>,
}

/// The wall clock in Unix milliseconds (what records and load samples are dated with).
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The fields after `(comm)` of `/proc/<pid>/stat`: index 0 is field 3 (state).
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 1..];
    Some(after.split_whitespace().map(str::to_string).collect())
}

/// Whether `pid` is a live process (not gone, not a zombie).
pub fn alive(pid: u32) -> bool {
    stat_fields(pid)
        .and_then(|f| f.first().cloned())
        .is_some_and(|state| state != "Z" && state != "X")
}

/// `pid`'s start time in clock ticks after boot.
pub fn start_ticks(pid: u32) -> Option<u64> {
    stat_fields(pid)?.get(19)?.parse().ok()
}

/// `pid`'s command line from `/proc/<pid>/cmdline`.
pub fn cmdline(pid: u32) -> Option<Vec<String>> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let mut parts: Vec<String> = raw
        .split(|b| *b == 0)
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .collect();
    if parts.last().is_some_and(String::is_empty) {
        parts.pop();
    }
    Some(parts)
}

/// Who holds TCP port `port` in listening state when it is not `group` (the engine's): `None`
/// when a member of the group listens there, when nobody does yet, or when `/proc` cannot
/// tell (another network namespace); otherwise `pid N (name)` of the holder, or "a process
/// CapyCTL cannot see" when its descriptors are not readable. Reads `/proc/net/tcp{,6}` and
/// the members' descriptors; only called while an engine becomes ready.
pub fn port_held_by_another(group: &EngineGroup, port: u16) -> Option<String> {
    let sockets = listening_sockets(port);
    if sockets.is_empty() {
        return None;
    }
    let members = group.members().unwrap_or_default();
    if members.iter().any(|&pid| holds_socket(pid, &sockets)) {
        return None;
    }
    Some(match proc_pids().find(|&pid| holds_socket(pid, &sockets)) {
        Some(pid) => {
            let name = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            format!("pid {pid} ({})", name.trim())
        }
        None => "a process CapyCTL cannot see".to_string(),
    })
}

/// The inodes of the sockets listening on TCP port `port` (IPv4 and IPv6) in this network
/// namespace, from `/proc/net/tcp` and `/proc/net/tcp6` (state `0A` is LISTEN).
fn listening_sockets(port: u16) -> Vec<u64> {
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let local_port = f
                .get(1)
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            if local_port == Some(port) && f.get(3) == Some(&"0A") {
                inodes.extend(f.get(9).and_then(|i| i.parse::<u64>().ok()));
            }
        }
    }
    inodes
}

/// Whether one of `pid`'s open descriptors is one of the sockets `inodes`.
fn holds_socket(pid: u32, inodes: &[u64]) -> bool {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        std::fs::read_link(fd.path()).is_ok_and(|target| {
            target
                .to_str()
                .and_then(|t| t.strip_prefix("socket:[")?.strip_suffix(']'))
                .and_then(|i| i.parse::<u64>().ok())
                .is_some_and(|i| inodes.contains(&i))
        })
    })
}

/// A free loopback port (bound and released; the engine binds it once it has loaded).
pub fn free_port() -> Result<u16, AgentError> {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0))
        .map_err(|e| AgentError::io("find a free loopback port", e))?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|e| AgentError::io("find a free loopback port", e))
}

/// The first port from `next` not in `given` (a few tries: the kernel's picks are spread over
/// thousands of ports).
fn unused_port(
    given: &HashSet<u16>,
    mut next: impl FnMut() -> Result<u16, AgentError>,
) -> Result<u16, AgentError> {
    const TRIES: usize = 64;
    for _ in 0..TRIES {
        let port = next()?;
        if !given.contains(&port) {
            return Ok(port);
        }
    }
    Err(AgentError::io(
        format!(
            "find a free loopback port: the {TRIES} the kernel offered in a row were given to engines already"
        ),
        std::io::ErrorKind::AddrInUse.into(),
    ))
}

/// Runs `kill -<signal> -- <target>` (a pid, or `-<pgid>` for a group).
async fn kill(signal: &str, target: &str) {
    let result = tokio::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg("--")
        .arg(target)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await;
    if let Err(e) = result {
        tracing::warn!(target, signal, error = %e, "cannot run kill");
    }
}

/// Waits until `exit` reports an exit, for at most `bound`; true when it did.
async fn wait_exit(exit: &mut ExitWatch, bound: Duration) -> bool {
    tokio::time::timeout(bound, exit.wait_for(Option::is_some))
        .await
        .is_ok_and(|r| r.is_ok())
}

/// Polls a process that is not our child until it is gone.
fn watch_foreign(pid: u32) -> ExitWatch {
    let (tx, rx) = watch::channel(None);
    tokio::spawn(async move {
        while alive(pid) {
            if tx.is_closed() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let _ = tx.send(Some("exited (adopted process)".to_string()));
    });
    rx
}

impl ProcessRuntime {
    /// A runtime keeping its records and logs under `<data_dir>/engines`.
    pub fn new(data_dir: &Path) -> Result<Self, AgentError> {
        let dir = data_dir.join("engines");
        std::fs::create_dir_all(&dir)
            .map_err(|e| AgentError::io(format!("create {}", dir.display()), e))?;
        Ok(Self {
            dir,
            tracked: Mutex::new(HashMap::new()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Tracked>> {
        self.tracked.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn record_path(&self, instance: &str) -> PathBuf {
        self.dir.join(format!("{}.json", file_stem(instance)))
    }

    /// The log file of `instance`.
    pub fn log_path(&self, instance: &str) -> PathBuf {
        self.dir.join(format!("{}.log", file_stem(instance)))
    }

    /// Writes the record of an engine, whole or not at all as a kill of CapyCTL sees it.
    ///
    /// NB (no rename over the record): on ext4 (with `auto_da_alloc`, its default) a rename
    /// that replaces a file first starts writing the new file's data out to the disk: about
    /// 0.1-0.2 ms here, and a switch writes four records on its path (each park's and each
    /// wake's intent and outcome). So the record is written whole to `<stem>.json.tmp`, the old
    /// `<stem>.json` removed, and the new one renamed to it (replacing nothing): about a fifth
    /// of the time. Killed while the `.json.tmp` is written, the old `.json` is still there
    /// and is what [`ProcessRuntime::records`] reads; killed between the removal and the
    /// rename, only the whole `.json.tmp` is there, and it reads that. (A power loss is not
    /// covered, as it was not before, with no sync: it ends the engines the records are of.)
    ///
    /// NB (in place): that new file is still most of a write's cost (ext4 allocates an inode
    /// and a block for it, and frees the old ones: 60-100 µs here, against 15-30 µs to
    /// rewrite the record where it is). So a record that is already there and stays within
    /// [`IN_PLACE_MAX`] (one page) is written over itself, with a single `write` at offset 0,
    /// padded with spaces to the old length when shorter (JSON allows trailing whitespace;
    /// nothing is truncated). Whole or not at all as a kill sees it: Linux copies a write into
    /// the page cache a page at a time and checks for a fatal signal only before each page,
    /// so a write within one page is never left half done by a kill. A short write falls
    /// back to the new file, which replaces whatever it left; a failed one (nothing written)
    /// is the error, as a failed new file was.
    pub fn write_record(&self, record: &PidRecord) -> Result<(), AgentError> {
        let path = self.record_path(&record.instance);
        let tmp = path.with_extension("json.tmp");
        let text = serde_json::to_vec_pretty(record).map_err(|e| AgentError::Json {
            what: format!("write {}", path.display()),
            source: e,
        })?;
        if write_in_place(&path, &text)
            .map_err(|e| AgentError::io(format!("write {}", path.display()), e))?
        {
            return Ok(());
        }
        std::fs::write(&tmp, text)
            .and_then(|()| match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            })
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|e| AgentError::io(format!("write {}", path.display()), e))
    }

    fn remove_record(&self, instance: &str) {
        let path = self.record_path(instance);
        for path in [path.with_extension("json.tmp"), path] {
            if let Err(e) = std::fs::remove_file(&path)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(path = %path.display(), error = %e, "cannot remove pid record");
            }
        }
    }

    /// Every record in the data directory (unreadable ones are reported and skipped): each
    /// `<stem>.json`, and a `<stem>.json.tmp` that has no `<stem>.json` beside it (see
    /// [`ProcessRuntime::write_record`]).
    pub fn records(&self) -> Result<Vec<PidRecord>, AgentError> {
        let entries = std::fs::read_dir(&self.dir)
            .map_err(|e| AgentError::io(format!("list {}", self.dir.display()), e))?;
        let mut records = Vec::new();
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let path = if name.ends_with(".json") {
                path
            } else if let Some(stem) = name.strip_suffix(".json.tmp") {
                let whole = self.dir.join(format!("{stem}.json"));
                if whole.exists() {
                    continue;
                }
                path
            } else {
                continue;
            };
            let parsed = std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<PidRecord>(&b).map_err(|e| e.to_string()));
            match parsed {
                Ok(r) => records.push(r),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "skipping unreadable pid record")
                }
            }
        }
        records.sort_by(|a, b| a.instance.cmp(&b.instance));
        Ok(records)
    }

    /// Starts `command` for `instance` (on the port it names) and writes its record. The record
    /// is built by `record` from the pid, the start time and the log path.
    pub fn spawn(
        &self,
        instance: &str,
        engine: EngineKind,
        command: &LaunchCommand,
        record: impl FnOnce(u32, Option<u64>, PathBuf) -> PidRecord,
    ) -> Result<(PidRecord, ExitWatch), AgentError> {
        if self.lock().contains_key(instance) {
            return Err(AgentError::WrongState {
                instance: instance.to_string(),
                detail: "an engine is already running for it".into(),
            });
        }
        let log = self.log_path(instance);
        let open = || {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log)
                .map_err(|e| AgentError::io(format!("open {}", log.display()), e))
        };
        let (stdout, stderr) = (open()?, open()?);
        let mut cmd = tokio::process::Command::new(&command.program);
        cmd.args(&command.args)
            .envs(&command.env)
            .env(INSTANCE_ENV, instance)
            .stdin(Stdio::null())
            .stdout(Stdio::from(stdout))
            .stderr(Stdio::from(stderr))
            .process_group(0)
            .kill_on_drop(false);
        let mut child = cmd
            .spawn()
            .map_err(|e| AgentError::io(format!("start {} ({})", command.program, instance), e))?;
        let Some(pid) = child.id() else {
            return Err(AgentError::EngineExited {
                engine,
                instance: instance.to_string(),
                status: "exited at once".into(),
                log: Some(log.display().to_string()),
            });
        };
        let rec = record(pid, start_ticks(pid), log.clone());
        let (tx, rx) = watch::channel(None);
        tokio::spawn(async move {
            let status = match child.wait().await {
                Ok(s) => s.to_string(),
                Err(e) => format!("unknown ({e})"),
            };
            let _ = tx.send(Some(status));
        });
        let group = EngineGroup::of(&rec);
        if let Err(e) = self.write_record(&rec) {
            // Never leave an engine without a record.
            tokio::spawn(async move { group.stop(Duration::ZERO).await });
            return Err(e);
        }
        self.lock().insert(
            instance.to_string(),
            Tracked {
                pid,
                port: rec.port,
                exit: rx.clone(),
                group,
            },
        );
        Ok((rec, rx))
    }

    /// A port for a new engine: free now ([`free_port`]) and not given to an engine this
    /// runtime tracks. An engine binds its port only once its weights are loaded (vLLM starts
    /// its HTTP server last, tens of seconds later), and until then the port is free to the
    /// kernel, which may hand it out again; two engines on one port would make one of them
    /// fail, so the ports given out are remembered while their engines run.
    pub fn engine_port(&self) -> Result<u16, AgentError> {
        let given: HashSet<u16> = self.lock().values().map(|t| t.port).collect();
        unused_port(&given, free_port)
    }

    /// The exit watch of a tracked engine.
    pub fn exit_watch(&self, instance: &str) -> Option<ExitWatch> {
        self.lock().get(instance).map(|t| t.exit.clone())
    }

    /// The pid of a tracked engine.
    pub fn pid(&self, instance: &str) -> Option<u32> {
        self.lock().get(instance).map(|t| t.pid)
    }

    /// Stops `instance`'s engine: SIGTERM to its process group, `grace`, then SIGKILL; removes
    /// its record. The group is stopped even when the engine itself has already exited (its
    /// workers may still hold GPU memory).
    pub async fn stop(&self, instance: &str, grace: Duration) -> Result<(), AgentError> {
        let Some(Tracked {
            pid, exit, group, ..
        }) = self.lock().remove(instance)
        else {
            self.remove_record(instance);
            return Err(AgentError::UnknownInstance {
                instance: instance.to_string(),
            });
        };
        group.stop(grace).await;
        // The leader's exit is reported once it is reaped (a child of this process) or seen
        // gone (an adopted one). A group that is not this engine's any more was not signalled:
        // nothing to wait for.
        let mut exit = exit;
        if group.members().is_some()
            && exit.borrow().is_none()
            && !wait_exit(&mut exit, KILL_WAIT).await
        {
            tracing::error!(instance, pid, "engine survived SIGKILL");
        }
        self.remove_record(instance);
        Ok(())
    }

    /// Stops every tracked engine.
    pub async fn stop_all(&self, grace: Duration) {
        let instances: Vec<String> = self.lock().keys().cloned().collect();
        for instance in instances {
            let _ = self.stop(&instance, grace).await;
        }
    }

    /// Adopts or stops what a previous run left behind (see the module doc). `answers(record)`
    /// tells whether to adopt a live engine; one it refuses is stopped.
    pub async fn recover<F, Fut>(&self, answers: F, grace: Duration) -> Result<Recovery, AgentError>
    where
        F: Fn(PidRecord) -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let mut recovery = Recovery::default();
        for record in self.records()? {
            if self.lock().contains_key(&record.instance) {
                continue;
            }
            let pid = record.pid;
            let group = EngineGroup::of(&record);
            let same = alive(pid)
                && (cmdline(pid).as_ref() == Some(&record.command)
                    || (record.start_ticks.is_some() && start_ticks(pid) == record.start_ticks));
            if !same {
                // The engine is gone (or its pid is another program's now); workers it left in
                // its group still go.
                group.stop(grace).await;
                self.remove_record(&record.instance);
                recovery.gone.push(record);
                continue;
            }
            let exit = watch_foreign(pid);
            self.lock().insert(
                record.instance.clone(),
                Tracked {
                    pid,
                    port: record.port,
                    exit: exit.clone(),
                    group,
                },
            );
            if answers(record.clone()).await {
                recovery.adopted.push(record);
            } else {
                tracing::warn!(instance = %record.instance, pid, "left-behind engine does not answer; stopping it");
                let _ = self.stop(&record.instance, grace).await;
                recovery.stopped.push(record);
            }
        }
        Ok(recovery)
    }

    /// Forgets an engine that exited by itself (its record is removed) and stops, in the
    /// background, the workers it left in its process group ([`LEFTOVER_GRACE`]).
    pub fn forget(&self, instance: &str) {
        if let Some(Tracked { group, .. }) = self.lock().remove(instance)
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            rt.spawn(async move { group.stop(LEFTOVER_GRACE).await });
        }
        self.remove_record(instance);
    }

    /// Milliseconds since the Unix epoch (for records).
    pub fn now_ms() -> u64 {
        now_ms()
    }
}

/// The longest record [`ProcessRuntime::write_record`] writes over itself: one page (on every
/// Linux platform a page is at least this).
const IN_PLACE_MAX: usize = 4096;

/// Writes `text` over the record at `path` if there is one and both fit in [`IN_PLACE_MAX`]
/// (see [`ProcessRuntime::write_record`]'s NB): `Ok(false)` when it did not (no record there,
/// too long, or a short write), for the caller to write a new file.
fn write_in_place(path: &Path, text: &[u8]) -> std::io::Result<bool> {
    use std::os::unix::fs::FileExt as _;
    if text.len() > IN_PLACE_MAX {
        return Ok(false);
    }
    let file = match std::fs::OpenOptions::new().write(true).open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    let old = usize::try_from(file.metadata()?.len()).unwrap_or(usize::MAX);
    if old > IN_PLACE_MAX {
        return Ok(false);
    }
    let mut whole = Vec::with_capacity(old.max(text.len()));
    whole.extend_from_slice(text);
    whole.resize(old.max(text.len()), b' ');
    // One `write` (not `write_all_at`, which would go on with a second); again if a signal
    // came before it wrote anything.
    loop {
        match file.write_at(&whole, 0) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            written => return Ok(written? == whole.len()),
        }
    }
}

/// A file name for an instance ID: characters outside `[A-Za-z0-9._-]` become `_`.
fn file_stem(instance: &str) -> String {
    instance
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_record_is_written_over_itself_only_when_there_and_within_a_page() {
        let dir = std::env::temp_dir().join(format!(
            "capyctl-in-place-{}-{}",
            std::process::id(),
            ProcessRuntime::now_ms()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.json");
        // No record there: a new file is for the caller to write.
        assert!(!write_in_place(&path, b"{\"n\": 1}").unwrap());
        assert!(!path.exists());
        // A shorter record over a longer one: padded to the old length, read back whole.
        std::fs::write(&path, b"{\"n\": 1, \"longer\": \"than the next\"}").unwrap();
        let old_len = std::fs::metadata(&path).unwrap().len();
        assert!(write_in_place(&path, b"{\"n\": 2}").unwrap());
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes.len() as u64, old_len, "nothing truncated");
        let read: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(read, serde_json::json!({"n": 2}));
        // A longer one grows the file.
        let long = format!("{{\"n\": 3, \"pad\": \"{}\"}}", "x".repeat(100));
        assert!(write_in_place(&path, long.as_bytes()).unwrap());
        assert_eq!(std::fs::read(&path).unwrap(), long.as_bytes());
        // Over a page: not in place (the file is left as it was).
        let huge = format!("{{\"pad\": \"{}\"}}", "x".repeat(IN_PLACE_MAX));
        assert!(!write_in_place(&path, huge.as_bytes()).unwrap());
        assert_eq!(std::fs::read(&path).unwrap(), long.as_bytes());
        // A record already over a page is not written over either.
        std::fs::write(&path, &huge).unwrap();
        assert!(!write_in_place(&path, b"{\"n\": 4}").unwrap());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_port_given_to_a_running_engine_is_not_given_again() {
        let given: HashSet<u16> = [40_001, 40_003].into();
        let mut picks = [40_001, 40_003, 40_005].into_iter();
        let port = unused_port(&given, || Ok(picks.next().unwrap())).unwrap();
        assert_eq!(port, 40_005);
    }

    #[test]
    fn a_kernel_that_keeps_giving_taken_ports_is_an_error_not_a_loop() {
        let given: HashSet<u16> = [40_001].into();
        let mut tries = 0;
        let err = unused_port(&given, || {
            tries += 1;
            Ok(40_001)
        })
        .unwrap_err();
        assert_eq!(tries, 64);
        assert!(
            err.to_string().contains("given to engines already"),
            "{err}"
        );
    }

    /// An engine of `instance` (a process-group leader) that starts one worker with `worker`'s
    /// environment (`env -i` and its assignments) and exits, as a killed engine does: the
    /// engine's group and the worker's pid.
    fn group_left_by_an_engine(instance: &str, worker: &str) -> (EngineGroup, u32) {
        use std::os::unix::process::CommandExt as _;
        let mut leader = std::process::Command::new("sh")
            .args([
                "-c",
                &format!("env -i {worker} sleep 60 & echo $!; sleep 0.5"),
            ])
            .env(INSTANCE_ENV, instance)
            .stdout(Stdio::piped())
            .process_group(0)
            .spawn()
            .unwrap();
        let pgid = leader.id();
        let leader_ticks = start_ticks(pgid);
        let mut out = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(leader.stdout.take().unwrap()),
            &mut out,
        )
        .unwrap();
        let worker: u32 = out.trim().parse().unwrap();
        leader.wait().unwrap();
        let group = EngineGroup {
            pgid,
            leader_ticks,
            instance: instance.to_string(),
        };
        (group, worker)
    }

    /// vLLM's engine core and workers set their process titles over their environment, so
    /// `/proc/<pid>/environ` no longer shows the instance's variable: once the engine (the
    /// group's leader) is gone, they are still its group's, and stopping the group stops them
    /// (on a GPU they hold memory).
    #[tokio::test]
    async fn workers_without_the_instance_variable_are_stopped_with_the_engines_group() {
        let (group, worker) = group_left_by_an_engine("blank-environ-0", "");
        assert!(environ_lacks(worker, INSTANCE_ENV));
        assert_eq!(group.members(), Some(vec![worker]));
        group.stop(Duration::from_secs(5)).await;
        assert!(group.gone());
    }

    /// A member marked for another instance is never taken for this engine's.
    #[test]
    fn a_member_marked_for_another_instance_is_not_the_engines() {
        let (group, other) = group_left_by_an_engine("mine-0", &format!("{INSTANCE_ENV}=other-0"));
        assert_eq!(group.members(), None);
        let _ = std::process::Command::new("kill")
            .args(["-KILL", &other.to_string()])
            .status();
    }

    #[test]
    fn a_free_port_can_be_bound() {
        let port = free_port().unwrap();
        drop(std::net::TcpListener::bind(("127.0.0.1", port)).unwrap());
    }
}
