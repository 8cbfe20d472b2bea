//! Switch records (DESIGN 4.8): every switch, whatever started it, phase by phase.
//!
//! [`SwitchLog`] keeps the newest [`KEEP`] records (in progress and ended) in a ring behind a
//! small lock of its own: neither the request path nor the owner's turn touches it. A switch's
//! code holds a [`Recording`] and notes its phases, victims and end as they happen; each change
//! is one short hold of the lock. The record is known to the code that runs inside the switch
//! through a task-local ([`current`], set by [`Recording::scope`]): the park or stop of a victim
//! and the wake or start of a target note themselves in whatever switch runs them, so each
//! phase is noted in one place (`Core::release_drained`, `Core::finish_up_inner`), and a
//! start or wake that runs outside every switch is a `bring_up` record of its own.
//!
//! Kept across restarts: each change of a record marks it due; the first change since the
//! writer thread last took the due records wakes it (a one-place channel that never waits),
//! and it lets the changes gather for [`BATCH`] before it takes the due records as they are
//! then and appends each as a JSON line to `switches.jsonl` in the data directory, syncing once
//! per batch: nothing is dropped however fast switches come, and several changes of a record
//! within a batch are one line. A flush (close, tests) ends the gathering at once.
//!
//! NB (why a batch, not a write per change): a switch changes its record about ten times (its
//! phases, victims, end) within a few milliseconds. Woken for each, the writer woke, took the
//! lock (which the switch's task then waited for), wrote and synced up to ten times during the
//! switch: 12-16 of a switch's 27-36 thread wake-ups in CapyCTL's process (`switch_share`), each
//! a halted virtual CPU woken on a quiet machine. Now the writer wakes once for the switch and
//! writes once, [`BATCH`] later, mostly after the switch is over. The price: a crash of the
//! process (a kill, not a stop) loses the changes of the last [`BATCH`] at most. A torn
//! last line (a crash mid-write) is skipped when read. Past [`COMPACT_AT`] lines, the file is
//! rewritten with the newest [`KEEP`] records (a temporary file, synced, renamed over it), so
//! it stays bounded on disk too. At open, the last line of each record wins; a record still in
//! progress is read back `failed` with `interrupted`.
//!
//! Times: Unix milliseconds, from one anchor taken at open (a tokio instant and the wall
//! clock), so that a switch's phases are exact relative to each other (and under tokio's
//! paused clock in tests).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, mpsc as std_mpsc};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use capyctl_spec::api::{
    SWITCHES_PAGE_MAX, SwitchCause, SwitchError, SwitchList, SwitchOutcome, SwitchPhase,
    SwitchPhaseKind, SwitchQuery, SwitchRecord, SwitchVictim, VictimAction, VictimResult,
};
use capyctl_spec::errors::ApiError;
use tokio::time::Instant;

use crate::metrics::Metrics;

/// The records kept, in memory and (after a compaction) on disk: the newest ones.
pub const KEEP: usize = 1000;

/// The file's name in the data directory.
pub const FILE: &str = "switches.jsonl";

/// The lines past which the file is rewritten with the newest [`KEEP`] records.
const COMPACT_AT: usize = 4 * KEEP;

/// How long the writer lets changes gather once the first one woke it (see the module's doc).
pub const BATCH: Duration = Duration::from_millis(50);

/// The error of a switch that was in progress when the server stopped.
pub fn interrupted() -> SwitchError {
    SwitchError {
        code: "interrupted".into(),
        message: "the server stopped during this switch".into(),
    }
}

/// A switch's error from an API error.
///
/// NB: the code is the error's precise label (`drain_timeout`, `wake_mismatch`, ...: the
/// metrics' `outcome`), not its wire code, which several share (`unavailable`).
pub fn error_of(e: &ApiError) -> SwitchError {
    SwitchError {
        code: e.metric_label().to_string(),
        message: e.message(),
    }
}

enum ToWriter {
    /// Records are due.
    Due,
    /// Answer once everything due so far is written.
    Flush(std_mpsc::Sender<()>),
}

struct Ring {
    /// Ascending `seq`.
    records: VecDeque<SwitchRecord>,
    next_seq: u64,
    /// Changed since the writer last took them (only with a file).
    due: BTreeSet<u64>,
    /// The writer was woken for `due` and has not taken them yet: a change only adds to them.
    woken: bool,
}

impl Ring {
    fn get_mut(&mut self, seq: u64) -> Option<&mut SwitchRecord> {
        let i = self.records.partition_point(|r| r.seq < seq);
        self.records.get_mut(i).filter(|r| r.seq == seq)
    }
}

/// The switch records (see the module's doc). Shared as `Arc<SwitchLog>`.
pub struct SwitchLog {
    ring: Arc<Mutex<Ring>>,
    anchor: (Instant, u64),
    writer: Option<std_mpsc::SyncSender<ToWriter>>,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for SwitchLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SwitchLog")
            .field("persisted", &self.writer.is_some())
            .finish_non_exhaustive()
    }
}

/// What can go wrong opening the file.
#[derive(Debug, thiserror::Error)]
#[error("switch records {}: {source}", path.display())]
pub struct SwitchLogError {
    path: PathBuf,
    source: std::io::Error,
}

fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl SwitchLog {
    /// Records kept in memory only (the operator, tests).
    pub fn in_memory(metrics: Arc<Metrics>) -> Self {
        Self::with(Vec::new(), None, metrics)
    }

    /// Records kept in `path` too (standalone: `<data dir>/switches.jsonl`): the records there
    /// are read back (those in progress as interrupted) and the file rewritten with them.
    pub fn open(path: &Path, metrics: Arc<Metrics>) -> Result<Self, SwitchLogError> {
        let err = |source| SwitchLogError {
            path: path.to_path_buf(),
            source,
        };
        let records = read_file(path).map_err(err)?;
        rewrite(path, &records).map_err(err)?;
        let file = OpenOptions::new()
            .append(true)
            .create(true)
            .open(path)
            .map_err(err)?;
        let (tx, rx) = std_mpsc::sync_channel(1);
        let lines = records.len();
        let log = Self::with(records, Some(tx), metrics);
        let (at, ring) = (path.to_path_buf(), Arc::clone(&log.ring));
        std::thread::Builder::new()
            .name("switch-records".into())
            .spawn(move || write_lines(&at, file, lines, &ring, &rx))
            .map_err(err)?;
        Ok(log)
    }

    fn with(
        records: Vec<SwitchRecord>,
        writer: Option<std_mpsc::SyncSender<ToWriter>>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let next_seq = records.last().map_or(1, |r| r.seq + 1);
        SwitchLog {
            ring: Arc::new(Mutex::new(Ring {
                records: records.into(),
                next_seq,
                due: BTreeSet::new(),
                woken: false,
            })),
            anchor: (Instant::now(), wall_ms()),
            writer,
            metrics,
        }
    }

    /// `at` in Unix milliseconds.
    pub fn ms(&self, at: Instant) -> u64 {
        let (base, base_ms) = self.anchor;
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        if at >= base {
            base_ms.saturating_add(ms(at - base))
        } else {
            base_ms.saturating_sub(ms(base - at))
        }
    }

    /// `GET /switches`: the records with `seq > after`, oldest first, at most `limit` (default
    /// and maximum [`SWITCHES_PAGE_MAX`]); `deployment`, when given, is matched against the
    /// record's deployment name and ID (the caller resolves nothing: a deleted deployment's
    /// records are still found by name).
    pub fn list(&self, query: &SwitchQuery) -> SwitchList {
        let after = query.after.unwrap_or(0);
        let limit = query
            .limit
            .unwrap_or(SWITCHES_PAGE_MAX)
            .clamp(1, SWITCHES_PAGE_MAX);
        let ring = self.ring.lock().unwrap_or_else(PoisonError::into_inner);
        let from = ring.records.partition_point(|r| r.seq <= after);
        let switches: Vec<SwitchRecord> = ring
            .records
            .range(from..)
            .filter(|r| {
                query
                    .deployment
                    .as_deref()
                    .is_none_or(|d| r.deployment == d || r.deployment_id == d)
            })
            .take(limit)
            .cloned()
            .collect();
        let next = switches.last().map_or(after, |r| r.seq);
        SwitchList { switches, next }
    }

    /// Waits until the writer has written every change handed to it so far (tests, close).
    pub fn flush(&self) {
        let Some(writer) = &self.writer else { return };
        let (tx, rx) = std_mpsc::channel();
        let sent = writer.send(ToWriter::Flush(tx));
        if sent.is_ok() {
            let _ = rx.recv();
        }
    }

    /// Begins a record: the switch `switch_id` for `target` started by `cause` at `began`.
    pub fn begin(
        self: &Arc<Self>,
        target: Target,
        cause: SwitchCause,
        began: Instant,
    ) -> Recording {
        let record = |seq| SwitchRecord {
            seq,
            switch_id: target.switch_id.clone(),
            deployment: target.deployment.clone(),
            deployment_id: target.deployment_id.clone(),
            instance: target.instance.clone(),
            host_id: target.host_id.clone(),
            gpus: target.gpus.clone(),
            cause,
            wave: target.wave,
            began_ms: self.ms(began),
            ended_ms: None,
            outcome: SwitchOutcome::InProgress,
            error: None,
            victims: Vec::new(),
            phases: Vec::new(),
        };
        let seq = {
            let mut ring = self.ring.lock().unwrap_or_else(PoisonError::into_inner);
            let seq = ring.next_seq;
            ring.next_seq += 1;
            ring.records.push_back(record(seq));
            self.persist(&mut ring, seq);
            while ring.records.len() > KEEP {
                ring.records.pop_front();
            }
            seq
        };
        let span = tracing::info_span!(
            "switch",
            switch_id = %target.switch_id,
            deployment = %target.deployment,
            cause = cause.word(),
            seq,
        );
        Recording(Arc::new(Rec {
            log: Arc::clone(self),
            seq,
            engine: target.engine,
            instance: target.instance,
            span,
        }))
    }

    /// Changes record `seq` (gone from the ring: nothing) and hands it to the writer.
    fn change(&self, seq: u64, f: impl FnOnce(&mut SwitchRecord)) {
        let mut ring = self.ring.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(r) = ring.get_mut(seq) {
            f(r);
            self.persist(&mut ring, seq);
        }
    }

    /// Marks record `seq` due for the writer and wakes it (a wake-up already pending will do).
    fn persist(&self, ring: &mut Ring, seq: u64) {
        let Some(writer) = &self.writer else { return };
        ring.due.insert(seq);
        if !ring.woken {
            ring.woken = true;
            let _ = writer.try_send(ToWriter::Due);
        }
    }
}

/// Whom a switch is for, as its record says.
#[derive(Debug, Clone, Default)]
pub struct Target {
    /// The switch's ID.
    pub switch_id: String,
    /// The target deployment's name.
    pub deployment: String,
    /// Its ID.
    pub deployment_id: String,
    /// Its instance.
    pub instance: String,
    /// The host where it goes.
    pub host_id: String,
    /// The UUIDs of the GPUs it goes to (empty when unknown).
    pub gpus: Vec<String>,
    /// Its engine (`vllm`, ...): the metrics' label of its phases.
    pub engine: &'static str,
    /// The requests waiting for it when the switch began.
    pub wave: u64,
}

struct Rec {
    log: Arc<SwitchLog>,
    seq: u64,
    engine: &'static str,
    instance: String,
    span: tracing::Span,
}

/// A record being written by the switch it describes (cheap to clone: shared).
#[derive(Clone)]
pub struct Recording(Arc<Rec>);

impl std::fmt::Debug for Recording {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recording")
            .field("seq", &self.0.seq)
            .finish_non_exhaustive()
    }
}

/// A phase noted in a record, to end later ([`Recording::end_phase`]).
#[derive(Debug, Clone)]
pub struct PhaseMark {
    index: usize,
    began: Instant,
    kind: SwitchPhaseKind,
    engine: &'static str,
    /// Shown while it runs only: no span, no metric (see [`Recording::begin_live_phase`]).
    live: bool,
}

tokio::task_local! {
    static CURRENT: Recording;
}

/// The switch the running task works for, if any (see [`Recording::scope`]).
pub fn current() -> Option<Recording> {
    CURRENT.try_with(Clone::clone).ok()
}

impl Recording {
    /// The record's `seq`.
    pub fn seq(&self) -> u64 {
        self.0.seq
    }

    /// The switch's span (`switch`, with its ID, deployment and cause).
    pub fn span(&self) -> &tracing::Span {
        &self.0.span
    }

    /// Runs `work` as part of this switch: what it parks, stops, wakes or starts is noted in
    /// this record ([`current`]), and it runs in the switch's span.
    pub async fn scope<T>(&self, work: impl std::future::Future<Output = T>) -> T {
        use tracing::Instrument;
        CURRENT
            .scope(self.clone(), work.instrument(self.0.span.clone()))
            .await
    }

    /// The target's instance.
    pub fn instance(&self) -> &str {
        &self.0.instance
    }

    /// The target's engine.
    pub fn engine(&self) -> &'static str {
        self.0.engine
    }

    /// Notes a phase that began at `began` on `instance` (of engine `engine`), still running.
    pub fn begin_phase(
        &self,
        kind: SwitchPhaseKind,
        instance: &str,
        engine: &'static str,
        began: Instant,
    ) -> PhaseMark {
        let mut index = 0;
        let began_ms = self.0.log.ms(began);
        self.0.log.change(self.0.seq, |r| {
            index = r.phases.len();
            r.phases.push(SwitchPhase {
                phase: kind,
                instance: instance.to_string(),
                began_ms,
                ended_ms: None,
            });
        });
        PhaseMark {
            index,
            began,
            kind,
            engine,
            live: false,
        }
    }

    /// [`Recording::begin_phase`] of a phase shown while it runs, whose exact times come later
    /// (the router's window and drain, replaced by [`Recording::rebase`]): its end is neither
    /// a span nor a metric.
    pub fn begin_live_phase(
        &self,
        kind: SwitchPhaseKind,
        engine: &'static str,
        began: Instant,
    ) -> PhaseMark {
        let instance = self.0.instance.clone();
        PhaseMark {
            live: true,
            ..self.begin_phase(kind, &instance, engine, began)
        }
    }

    /// Starts the record over at `began` with `wave` (the router's exact times, known once it
    /// orders or fails the switch): the phases noted so far, live ones, are dropped.
    pub fn rebase(&self, began: Instant, wave: u64) {
        let began_ms = self.0.log.ms(began);
        self.0.log.change(self.0.seq, |r| {
            r.began_ms = began_ms;
            r.wave = wave;
            r.phases.clear();
        });
    }

    /// Ends a phase noted by [`Recording::begin_phase`] at `ended`: its child span and its
    /// `capyctl_switch_phase_seconds`.
    pub fn end_phase(&self, mark: &PhaseMark, ended: Instant) {
        let ended_ms = self.0.log.ms(ended);
        let mut instance = String::new();
        self.0.log.change(self.0.seq, |r| {
            if let Some(p) = r.phases.get_mut(mark.index) {
                p.ended_ms = Some(ended_ms);
                instance.clone_from(&p.instance);
            }
        });
        if !mark.live {
            self.ended(mark.kind, mark.engine, &instance, mark.began, ended);
        }
    }

    /// Notes a phase with both its ends known.
    pub fn phase(
        &self,
        kind: SwitchPhaseKind,
        instance: &str,
        engine: &'static str,
        began: Instant,
        ended: Instant,
    ) {
        let mark = self.begin_phase(kind, instance, engine, began);
        self.end_phase(&mark, ended);
    }

    /// A phase's child span (created with its times as fields: no span is held across the
    /// awaits of the phase) and its metric.
    fn ended(
        &self,
        kind: SwitchPhaseKind,
        engine: &'static str,
        instance: &str,
        began: Instant,
        ended: Instant,
    ) {
        let took = ended.saturating_duration_since(began);
        let span = tracing::info_span!(
            parent: &self.0.span,
            "switch_phase",
            phase = kind.word(),
            instance,
            began_ms = self.0.log.ms(began),
            ended_ms = self.0.log.ms(ended),
            took_ms = u64::try_from(took.as_millis()).unwrap_or(u64::MAX),
        );
        span.in_scope(|| tracing::debug!("phase ended"));
        self.0.log.metrics.switch_phase(kind.word(), engine, took);
    }

    /// Notes a victim, or what became of it (the one with the same instance is replaced).
    pub fn victim(&self, victim: SwitchVictim) {
        self.0.log.change(self.0.seq, |r| {
            match r.victims.iter_mut().find(|v| v.instance == victim.instance) {
                Some(v) => *v = victim,
                None => r.victims.push(victim),
            }
        });
    }

    /// Sets where the target went (its host and GPUs), once known.
    pub fn placed(&self, host_id: &str, gpus: Vec<String>) {
        self.0.log.change(self.0.seq, |r| {
            if r.host_id.is_empty() {
                r.host_id = host_id.to_string();
            }
            if r.gpus.is_empty() {
                r.gpus = gpus;
            }
        });
    }

    /// Ends the record at `ended`: `ok`, or `failed` with the error. Phases still open end
    /// then too. Counted in `capyctl_switches_total` and `capyctl_switch_seconds`.
    pub fn finish(&self, result: Result<(), &ApiError>, ended: Instant) {
        let outcome = match result {
            Ok(()) => SwitchOutcome::Ok,
            Err(_) => SwitchOutcome::Failed,
        };
        let took = self.end(outcome, result.err().map(error_of), ended);
        self.0.log.metrics.switch_finished(
            match result {
                Ok(()) => "ok",
                Err(e) => e.metric_label(),
            },
            took,
        );
        let _entered = self.0.span.enter();
        match result {
            Ok(()) => tracing::info!("switch done"),
            Err(e) => tracing::warn!(error = %e, "switch failed"),
        }
    }

    /// Ends the record as given up (`abandoned`), not counted as a switch.
    pub fn abandon(&self, ended: Instant) {
        let _entered = self.0.span.enter();
        tracing::info!("switch given up");
        self.end(SwitchOutcome::Abandoned, None, ended);
    }

    /// Ends the record (once); how long it lasted.
    fn end(&self, outcome: SwitchOutcome, error: Option<SwitchError>, ended: Instant) -> Duration {
        let ended_ms = self.0.log.ms(ended);
        let mut took = Duration::ZERO;
        self.0.log.change(self.0.seq, |r| {
            if r.outcome != SwitchOutcome::InProgress {
                return;
            }
            took = Duration::from_millis(ended_ms.saturating_sub(r.began_ms));
            for p in &mut r.phases {
                p.ended_ms.get_or_insert(ended_ms);
            }
            r.ended_ms = Some(ended_ms);
            r.outcome = outcome;
            r.error = error;
        });
        took
    }
}

/// A victim's entry, as a switch notes it; `unit` is the victim's key in the lifecycle (its
/// deployment's ID for instance 0, else its instance ID).
pub fn victim_entry(
    name: &str,
    unit: &str,
    stop: bool,
    result: VictimResult,
    error: Option<SwitchError>,
) -> SwitchVictim {
    let (deployment_id, index) = crate::split_instance_id(unit).unwrap_or((unit, 0));
    SwitchVictim {
        deployment: name.to_string(),
        deployment_id: deployment_id.to_string(),
        instance: crate::instance_id_at(deployment_id, index),
        action: if stop {
            VictimAction::Stop
        } else {
            VictimAction::Park
        },
        result,
        error,
    }
}

/// The newest [`KEEP`] records of `path` (none when it does not exist), the last line of each
/// winning, those in progress made `failed` / `interrupted`. Lines that do not parse (a torn
/// last line) are skipped.
fn read_file(path: &Path) -> std::io::Result<Vec<SwitchRecord>> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut by_seq: BTreeMap<u64, SwitchRecord> = BTreeMap::new();
    let mut skipped = 0usize;
    for line in BufReader::new(file).split(b'\n') {
        let line = line?;
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        match serde_json::from_slice::<SwitchRecord>(&line) {
            Ok(r) => {
                by_seq.insert(r.seq, r);
            }
            Err(_) => skipped += 1,
        }
    }
    if skipped > 0 {
        tracing::warn!(file = %path.display(), lines = skipped, "switch records: lines that do not parse were skipped (a write cut short)");
    }
    while by_seq.len() > KEEP {
        by_seq.pop_first();
    }
    Ok(by_seq
        .into_values()
        .map(|mut r| {
            if r.outcome == SwitchOutcome::InProgress {
                let last = r
                    .phases
                    .iter()
                    .map(|p| p.ended_ms.unwrap_or(p.began_ms))
                    .max()
                    .unwrap_or(r.began_ms)
                    .max(r.began_ms);
                for p in &mut r.phases {
                    p.ended_ms.get_or_insert(last);
                }
                r.ended_ms = Some(last);
                r.outcome = SwitchOutcome::Failed;
                r.error = Some(interrupted());
            }
            r
        })
        .collect())
}

/// Replaces `path` with `records`, one line each: a temporary file beside it, synced, renamed
/// over it, the directory synced.
fn rewrite<'a>(
    path: &Path,
    records: impl IntoIterator<Item = &'a SwitchRecord>,
) -> std::io::Result<()> {
    let tmp = path.with_extension("jsonl.tmp");
    {
        let mut out = std::io::BufWriter::new(File::create(&tmp)?);
        for r in records {
            serde_json::to_writer(&mut out, r)?;
            out.write_all(b"\n")?;
        }
        out.flush()?;
        out.get_ref().sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent()
        && let Ok(d) = File::open(dir)
    {
        let _ = d.sync_all();
    }
    Ok(())
}

/// The writer thread: appends the due records as lines, syncs once per batch, compacts the
/// file past [`COMPACT_AT`] lines (`lines`: those in it now). Ends when the log is dropped.
fn write_lines(
    path: &Path,
    mut file: File,
    mut lines: usize,
    ring: &Mutex<Ring>,
    rx: &std_mpsc::Receiver<ToWriter>,
) {
    let mut failing = false;
    while let Ok(first) = rx.recv() {
        let mut flushes = Vec::new();
        if let ToWriter::Flush(done) = first {
            flushes.push(done);
        } else {
            // The batch gathers until BATCH has passed or a flush asks for it.
            let until = std::time::Instant::now() + BATCH;
            loop {
                let left = until.saturating_duration_since(std::time::Instant::now());
                match rx.recv_timeout(left) {
                    Ok(ToWriter::Due) => {}
                    Ok(ToWriter::Flush(done)) => {
                        flushes.push(done);
                        break;
                    }
                    Err(_) => break,
                }
            }
        }
        for m in rx.try_iter() {
            if let ToWriter::Flush(done) = m {
                flushes.push(done);
            }
        }
        let (due, kept) = {
            let mut ring = ring.lock().unwrap_or_else(PoisonError::into_inner);
            ring.woken = false;
            let seqs = std::mem::take(&mut ring.due);
            let due: Vec<SwitchRecord> = seqs
                .into_iter()
                .filter_map(|seq| ring.get_mut(seq).map(|r| r.clone()))
                .collect();
            let kept = (lines + due.len() > COMPACT_AT)
                .then(|| ring.records.iter().cloned().collect::<Vec<_>>());
            (due, kept)
        };
        let written = if let Some(kept) = kept {
            rewrite(path, &kept).and_then(|()| {
                lines = kept.len();
                file = OpenOptions::new().append(true).open(path)?;
                Ok(())
            })
        } else if due.is_empty() {
            Ok(())
        } else {
            let mut buf = Vec::new();
            for r in &due {
                if serde_json::to_writer(&mut buf, r).is_ok() {
                    buf.push(b'\n');
                    lines += 1;
                }
            }
            file.write_all(&buf).and_then(|()| file.sync_data())
        };
        match written {
            Ok(()) => failing = false,
            Err(e) if !failing => {
                failing = true;
                tracing::error!(file = %path.display(), error = %e, "writing the switch records failed");
            }
            Err(_) => {}
        }
        for done in flushes {
            let _ = done.send(());
        }
    }
}
