//! The host agent the lifecycle calls: [`HostAgent`], and [`LocalHostAgent`], which drives
//! the engines of this machine through an [`EngineRuntime`]: child processes
//! ([`ProcessRuntime`]: standalone, the node agent's `process` runtime) or the operator's engine
//! Pods (`k8s::pods::PodRuntime` (feature `kubernetes`): the node agent's `pod` runtime).
//! [`RemoteHostAgent`](crate::remote::RemoteHostAgent) implements the same trait over HTTP (a
//! node agent on another machine).
//!
//! The lifecycle is the one writer of instance state and calls one operation at a time per
//! instance; the agent keeps only what it needs to drive the engines (ports, tiers, first
//! answers, measurements), also in the pid records so that a restarted CapyCTL can go on. A
//! park or a wake writes its intent into the record before it calls the engine and its
//! outcome after, so that a recovery after a kill at any moment adopts an engine where it
//! really is, or stops it ([`crate::recovery`]).
//!
//! An engine that exits by itself (a crash, an OOM kill) outside a wake is reported once on
//! [`HostAgent::subscribe_exits`] and forgotten; one that exits during a wake fails the wake
//! (the [`WakeReport`] says so) and one the agent stops is not reported at all.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use capyctl_spec::EngineKind;
use tokio::sync::{broadcast, watch};
use tokio::task::{AbortHandle, JoinHandle};
use tokio::time::Instant;

// The trait and its values (`capyctl-interfaces`), under the paths they always had here.
pub use capyctl_interfaces::agent::{
    AdoptedInstance, AgentHealth, BoxFuture, EngineExit, HostAgent, ParkResult, RecoveryReport,
    StartedInstance, WakeReport,
};

use crate::capability::{EngineInfo, RefusalRow, engine_info, refusal_for};
use crate::checkpoint::{ModelFacts, ReadFacts};
use crate::driver::{Driver, DriverTimeouts, Endpoint};
use crate::error::{AgentError, StartFailure};
use crate::inventory::{GpuProbe, Inventory, inventory};
use crate::launch::{MaxRunningInput, max_running};
use crate::load::LoadSample;
use crate::measure::{
    GpuHeld, GpuHeldSource, MeasureSource, Measurement, add_footprint, footprint,
    measure_before_start, parked_estimate,
};
use crate::process::{ExitWatch, PidRecord, ProcessRuntime, now_ms};
use crate::recovery::{EngineState, RecoveryVerdict, Transition, recovery_verdict, settled};
use crate::runtime::{Answers, EngineRuntime, LaunchRequest, Launched};
use crate::spec::{HostSettings, InstanceSpec};
use crate::tier::{
    LaunchParking, NoParkReason, ParkChoice, ParkTier, TierInput, choose_tier, host_ram_room,
    launch_parking,
};
use crate::verify::WakeOutcome;

/// What [`LocalHostAgent::prepare`] learns about a deployment before a start or a park.
struct Prepared {
    inv: Inventory,
    measurement: Measurement,
    refusal: Option<&'static RefusalRow>,
    facts: ModelFacts,
}

/// The agent's timing and where it keeps its files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentConfig {
    /// The data directory (pid records and engine logs go under `engines/`).
    pub data_dir: PathBuf,
    /// How long an engine may take to answer `/health` with 200 after its start.
    pub ready_timeout: Duration,
    /// The wake window: past it a wake is `wake_uncertain` (`server.switching.wake_timeout`).
    pub wake_window: Duration,
    /// Between SIGTERM and SIGKILL when stopping an engine.
    pub stop_grace: Duration,
    /// Between two load samples.
    pub sample_interval: Duration,
    /// The driver's step timeouts.
    pub timeouts: DriverTimeouts,
}

/// How long an engine may take to become ready after its start, by default.
pub const DEFAULT_READY_TIMEOUT: Duration = Duration::from_secs(1800);

impl AgentConfig {
    /// The defaults: ready 1800 s, wake window 600 s, grace 30 s, a sample a second.
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            ready_timeout: DEFAULT_READY_TIMEOUT,
            wake_window: Duration::from_secs(600),
            stop_grace: Duration::from_secs(30),
            sample_interval: Duration::from_secs(1),
            timeouts: DriverTimeouts::default(),
        }
    }
}

/// How many exits a slow subscriber may fall behind before it misses some
/// ([`broadcast::error::RecvError::Lagged`]).
const EXIT_EVENTS: usize = 64;

/// One engine the agent drives.
#[derive(Debug)]
struct Instance {
    spec: InstanceSpec,
    endpoint: Endpoint,
    parking: LaunchParking,
    refusal: Option<&'static RefusalRow>,
    /// Changing facts; a std mutex, never held across an `.await`. Shared with the sampler,
    /// which reads whether a park or a wake is in progress (see [`LocalHostAgent::spawn_sampler`]).
    state: Arc<Mutex<InstanceState>>,
    /// The latest sample, written by the sampler task.
    sample: watch::Receiver<Option<LoadSample>>,
    /// The sampler task; aborted when the instance goes.
    sampler: JoinHandle<()>,
    /// The task watching the engine's exit; aborted when the instance goes. Set once, right
    /// after the instance is built.
    exit_watcher: Mutex<Option<AbortHandle>>,
    /// Held across each adapter call to the engine (DESIGN 4.9), and taken by a park (after it
    /// marks the instance parking) and a stop before they reach the engine: a park or a stop
    /// never meets a load half done. See [`LocalHostAgent::adapter_call`].
    adapter_calls: tokio::sync::Mutex<()>,
    /// Set once a stop of the instance begins: an adapter call in flight ends with
    /// [`AgentError::Cancelled`] (a hanging load would otherwise hold the stop).
    stopping: watch::Sender<bool>,
}

#[derive(Debug, Clone)]
struct InstanceState {
    record: PidRecord,
    measurement: Measurement,
    /// A wake is in progress: an exit now is the wake's to report, and the sampler leaves the
    /// engine alone.
    waking: bool,
    /// A park into this tier is in progress: a host-RAM park's copy is counted against the
    /// host's room from its choice on, so two parks at once cannot both count the same free
    /// memory. The sampler leaves the engine alone meanwhile.
    parking: Option<ParkTier>,
}

impl InstanceState {
    /// A park or a wake of the engine is in progress: its calls are on a switch's path.
    fn moving(&self) -> bool {
        self.waking || self.parking.is_some()
    }
}

fn lock_state(state: &Mutex<InstanceState>) -> std::sync::MutexGuard<'_, InstanceState> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Instance {
    fn state(&self) -> std::sync::MutexGuard<'_, InstanceState> {
        lock_state(&self.state)
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        self.sampler.abort();
        if let Some(watcher) = self
            .exit_watcher
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            watcher.abort();
        }
    }
}

type InstanceMap = Mutex<HashMap<String, Arc<Instance>>>;

fn lock_map(map: &InstanceMap) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Instance>>> {
    map.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What an exit watcher or a finished wake needs to report an engine that exited by itself.
/// Weak references: an agent that is dropped (CapyCTL "crashing") reports nothing and leaves
/// the pid records for the next run's recovery.
#[derive(Clone)]
struct ExitReporter {
    instances: Weak<InstanceMap>,
    runtime: Weak<dyn EngineRuntime>,
    exits: broadcast::Sender<EngineExit>,
}

impl ExitReporter {
    /// Forgets `inst` and sends one event, unless the instance is no longer the one the agent
    /// holds under `id` (the agent stopped it, or another report already went out).
    fn report(&self, id: &str, inst: &Arc<Instance>, status: Option<String>) {
        let (Some(instances), Some(runtime)) = (self.instances.upgrade(), self.runtime.upgrade())
        else {
            return;
        };
        {
            let mut map = lock_map(&instances);
            if !map.get(id).is_some_and(|held| Arc::ptr_eq(held, inst)) {
                return;
            }
            map.remove(id);
            // Under the map's lock, so a new start of the same ID cannot slip in between.
            runtime.forget(id);
        }
        tracing::warn!(instance = id, status = ?status, "engine exited by itself; instance forgotten");
        let _ = self.exits.send(EngineExit {
            instance: id.to_string(),
            status,
        });
    }

    /// Waits for the engine of `inst` to exit, then reports it unless a wake is in progress
    /// (the wake reports it, see [`WakeGuard`]).
    async fn watch(self, id: String, mut exit: ExitWatch, inst: Weak<Instance>) {
        let status = match exit.wait_for(Option::is_some).await {
            Ok(status) => status.clone(),
            // The runtime's wait task is gone without a status: nothing to tell.
            Err(_) => return,
        };
        let Some(inst) = inst.upgrade() else { return };
        if inst.state().waking {
            return;
        }
        self.report(&id, &inst, status);
    }
}

/// Marks an instance as waking; on drop (the wake finished, or its future was dropped) clears
/// the mark and reports an exit that happened meanwhile and that the wake did not handle (a
/// failed wake stops the instance first, so nothing is reported twice).
struct WakeGuard<'a> {
    id: &'a str,
    inst: &'a Arc<Instance>,
    exit: Option<ExitWatch>,
    reporter: ExitReporter,
}

impl<'a> WakeGuard<'a> {
    fn new(
        id: &'a str,
        inst: &'a Arc<Instance>,
        exit: Option<ExitWatch>,
        reporter: ExitReporter,
    ) -> Self {
        inst.state().waking = true;
        Self {
            id,
            inst,
            exit,
            reporter,
        }
    }
}

impl Drop for WakeGuard<'_> {
    fn drop(&mut self) {
        self.inst.state().waking = false;
        let status = self.exit.as_ref().and_then(|e| e.borrow().clone());
        if let Some(status) = status {
            self.reporter.report(self.id, self.inst, Some(status));
        }
    }
}

/// The in-process host agent: the engines of this machine, through its [`EngineRuntime`].
pub struct LocalHostAgent {
    /// Read-only.
    config: AgentConfig,
    /// Read-only.
    settings: HostSettings,
    /// GPU inventory and footprints.
    probe: Arc<dyn GpuProbe>,
    /// Engine calls.
    driver: Driver,
    /// Engines and their records; shared (weakly) with the exit watchers.
    runtime: Arc<dyn EngineRuntime>,
    /// Instances by ID; a std mutex, never held across an `.await`; shared (weakly) with the
    /// exit watchers, which remove an instance whose engine exited by itself.
    instances: Arc<InstanceMap>,
    /// Engines that exited by themselves; every subscriber gets each one.
    exits: broadcast::Sender<EngineExit>,
    /// Engine versions seen, by kind.
    versions: Mutex<HashMap<EngineKind, String>>,
    /// Measurements learned from engines' footprints, by deployment and model, so that a later
    /// start knows what the checkpoint alone does not say (a hub model's size).
    learned: Mutex<HashMap<(String, String), Measurement>>,
    /// Taken while a park's tier is chosen and its host-RAM copy reserved; never held across an
    /// `.await`.
    park_choice: Mutex<()>,
    /// Starts and wakes in progress, by instance ID: a stop ends them.
    in_progress: Arc<Mutex<HashMap<String, Arc<InProgress>>>>,
}

/// A start or a wake in progress, which a stop of the same instance ends.
struct InProgress {
    /// Set by a stop: the operation stops its engine and answers [`AgentError::Cancelled`].
    cancel: watch::Sender<bool>,
    /// Never sent on; closed when the operation has ended (its [`OpGuard`] dropped).
    ended: watch::Receiver<()>,
}

/// Registers a start or a wake in [`LocalHostAgent::in_progress`] for as long as it lives.
struct OpGuard {
    map: Weak<Mutex<HashMap<String, Arc<InProgress>>>>,
    id: String,
    entry: Arc<InProgress>,
    /// Dropped with the guard: a stop waiting for the operation's end learns it.
    _ended: watch::Sender<()>,
}

impl OpGuard {
    /// Fires once a stop has asked the operation to end (never, otherwise).
    fn cancelled(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.entry.cancel.subscribe();
        async move {
            if rx.wait_for(|c| *c).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Whether a stop has asked the operation to end.
    fn is_cancelled(&self) -> bool {
        *self.entry.cancel.borrow()
    }
}

impl Drop for OpGuard {
    fn drop(&mut self) {
        if let Some(map) = self.map.upgrade() {
            let mut map = map.lock().unwrap_or_else(PoisonError::into_inner);
            if map
                .get(&self.id)
                .is_some_and(|e| Arc::ptr_eq(e, &self.entry))
            {
                map.remove(&self.id);
            }
        }
    }
}

impl std::fmt::Debug for LocalHostAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalHostAgent")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, AgentError> + Send + 'static,
) -> Result<T, AgentError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| AgentError::io("a blocking task failed", std::io::Error::other(e)))?
}

/// Waits up to `bound` for the engine to exit; its status when it did.
async fn exited_within(exit: &mut ExitWatch, bound: Duration) -> Option<String> {
    match tokio::time::timeout(bound, exit.wait_for(Option::is_some)).await {
        Ok(Ok(status)) => status.clone(),
        _ => None,
    }
}

impl LocalHostAgent {
    /// An agent with these settings and GPU probe, running engines as child processes
    /// ([`ProcessRuntime`]); creates the data directory.
    pub fn new(
        config: AgentConfig,
        settings: HostSettings,
        probe: Arc<dyn GpuProbe>,
    ) -> Result<Self, AgentError> {
        let runtime = Arc::new(ProcessRuntime::new(&config.data_dir)?);
        Ok(Self::with_runtime(config, settings, probe, runtime))
    }

    /// An agent running its engines with `runtime` (whose records live under
    /// `config.data_dir`).
    pub fn with_runtime(
        config: AgentConfig,
        settings: HostSettings,
        probe: Arc<dyn GpuProbe>,
        runtime: Arc<dyn EngineRuntime>,
    ) -> Self {
        Self {
            runtime,
            driver: Driver::new(config.timeouts),
            config,
            settings,
            probe,
            instances: Arc::new(Mutex::new(HashMap::new())),
            exits: broadcast::channel(EXIT_EVENTS).0,
            versions: Mutex::new(HashMap::new()),
            learned: Mutex::new(HashMap::new()),
            park_choice: Mutex::new(()),
            in_progress: Arc::default(),
        }
    }

    /// Registers a start or a wake of `id`; `WrongState` while another one is in progress.
    fn begin_op(&self, id: &str, what: &str) -> Result<OpGuard, AgentError> {
        let mut map = self
            .in_progress
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if map.contains_key(id) {
            return Err(AgentError::WrongState {
                instance: id.to_string(),
                detail: format!("a start or a wake is in progress; cannot {what} it now"),
            });
        }
        let (ended_tx, ended) = watch::channel(());
        let entry = Arc::new(InProgress {
            cancel: watch::channel(false).0,
            ended,
        });
        map.insert(id.to_string(), Arc::clone(&entry));
        Ok(OpGuard {
            map: Arc::downgrade(&self.in_progress),
            id: id.to_string(),
            entry,
            _ended: ended_tx,
        })
    }

    /// Ends a start or a wake of `id` in progress (it stops its engine) and waits until it has
    /// ended; `false` when none was in progress.
    async fn end_op(&self, id: &str) -> bool {
        let entry = self
            .in_progress
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(id)
            .cloned();
        let Some(entry) = entry else { return false };
        tracing::info!(instance = id, "a stop ends the start or wake in progress");
        entry.cancel.send_replace(true);
        let mut ended = entry.ended.clone();
        drop(entry);
        // Answers an error once the operation's guard is dropped (nothing is ever sent).
        let _ = ended.changed().await;
        true
    }

    /// How this agent runs engines (`process` or `pod`).
    pub fn runtime_name(&self) -> &'static str {
        self.runtime.name()
    }

    fn instances(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Instance>>> {
        lock_map(&self.instances)
    }

    fn reporter(&self) -> ExitReporter {
        ExitReporter {
            instances: Arc::downgrade(&self.instances),
            runtime: Arc::downgrade(&self.runtime),
            exits: self.exits.clone(),
        }
    }

    fn instance(&self, id: &str) -> Result<Arc<Instance>, AgentError> {
        self.instances()
            .get(id)
            .cloned()
            .ok_or_else(|| AgentError::UnknownInstance {
                instance: id.to_string(),
            })
    }

    fn version_of(&self, kind: EngineKind) -> Option<String> {
        self.settings.engine(kind).version.clone().or_else(|| {
            self.versions
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(&kind)
                .cloned()
        })
    }

    /// The agent's timing and data directory.
    pub fn config(&self) -> &AgentConfig {
        &self.config
    }

    /// The pid of an instance's engine.
    pub fn pid(&self, instance: &str) -> Option<u32> {
        self.runtime.pid(instance)
    }

    /// Runs adapter call `call` (`what`: `adapter load`, `adapter unload` or `adapter list`)
    /// against the engine of instance `id` while it takes adapters (DESIGN 4.9; `doing`: what
    /// a refusal says it cannot do). The instance's `adapter_calls` lock is held across the
    /// engine call, and the instance is checked both before it is taken (a refusal does not
    /// wait behind a load) and once it is held. A park marks the instance parking and then
    /// takes the lock, so it waits for the call in flight and every later call is refused; a
    /// stop sets `stopping`, which ends the call in flight with [`AgentError::Cancelled`].
    async fn adapter_call<T, F>(
        &self,
        id: &str,
        what: &'static str,
        doing: &str,
        call: impl FnOnce(Endpoint) -> F,
    ) -> Result<T, AgentError>
    where
        F: Future<Output = Result<T, AgentError>>,
    {
        let inst = self.instance(id)?;
        self.takes_adapters(id, &inst, doing)?;
        let cancelled = || AgentError::Cancelled {
            instance: id.to_string(),
            what,
        };
        let stopping = inst.stopping.subscribe();
        let _calls = tokio::select! {
            biased;
            () = stopped(stopping.clone()) => return Err(cancelled()),
            held = inst.adapter_calls.lock() => held,
        };
        self.takes_adapters(id, &inst, doing)?;
        tokio::select! {
            biased;
            () = stopped(stopping) => Err(cancelled()),
            done = call(inst.endpoint.clone()) => done,
        }
    }

    /// Whether the engine of `inst` takes adapters now: started with `adapters` (else
    /// [`AgentError::InvalidSpec`]); known to the agent, not being stopped, with no start or
    /// wake in progress, not parked, parking or in a recorded transition (else
    /// [`AgentError::WrongState`]: a parked vLLM would hold the call until a wake).
    fn takes_adapters(&self, id: &str, inst: &Instance, doing: &str) -> Result<(), AgentError> {
        if inst.spec.adapters.is_none() {
            return Err(AgentError::InvalidSpec {
                detail: format!(
                    "instance {id} (deployment {}) was started without adapters; cannot {doing} it",
                    inst.spec.name
                ),
            });
        }
        let refused = |why: String| AgentError::WrongState {
            instance: id.to_string(),
            detail: format!("{why}; cannot {doing} it now"),
        };
        if *inst.stopping.borrow() {
            return Err(refused("it is being stopped".into()));
        }
        if self.in_progress(id) {
            return Err(refused("a start or a wake is in progress".into()));
        }
        let s = inst.state();
        if let Some(tier) = s.record.parked {
            return Err(refused(format!("it is parked ({tier:?}) until it wakes")));
        }
        if let Some(tier) = s.parking {
            return Err(refused(format!("it is parking ({tier:?})")));
        }
        if let Some(t) = s.record.transition {
            return Err(refused(format!("a transition is in progress ({t:?})")));
        }
        Ok(())
    }

    /// The engine's endpoint of an instance.
    pub fn endpoint(&self, instance: &str) -> Option<Endpoint> {
        self.instances().get(instance).map(|i| i.endpoint.clone())
    }

    /// Whether a start or a wake of an instance is in progress.
    pub fn in_progress(&self, instance: &str) -> bool {
        self.in_progress
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains_key(instance)
    }

    /// The tier an instance is parked in.
    pub fn parked_tier(&self, instance: &str) -> Option<ParkTier> {
        self.instances()
            .get(instance)
            .and_then(|i| i.state().record.parked)
    }

    /// While an instance is parked: the GPU memory it still holds.
    pub fn parked_gpu_held(&self, instance: &str) -> Option<GpuHeld> {
        self.instances().get(instance).and_then(|i| {
            let s = i.state();
            s.record.parked.and(s.record.gpu_held)
        })
    }

    /// Room in host RAM for one more copy ([`host_ram_room`]): the copies of the other
    /// instances parked in host RAM (held) and of those parking there now (copying).
    /// Waits until the engine answers `/health` with 200 from its own listener, for at most
    /// the ready timeout. An engine binds its port only once loaded, so another process may
    /// take the port meanwhile and answer in its place: such an answer is not the engine's
    /// (the engine then fails to bind and exits with its own error, or the wait ends naming
    /// the holder).
    async fn wait_engine_ready(&self, ep: &Endpoint, record: &PidRecord) -> Result<(), AgentError> {
        let bound = self.config.ready_timeout;
        let deadline = Instant::now() + bound;
        let mut holder: Option<String> = None;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if let (Some(holder), true) = (&holder, remaining.is_zero()) {
                return Err(AgentError::EngineTimeout {
                    engine: ep.engine,
                    step: "readiness (GET /health until 200 from the engine's own listener)",
                    url: format!(
                        "{} (last: port {} answered, but it is held by {holder}, not by the engine)",
                        ep.url("/health"),
                        record.port
                    ),
                    after: bound,
                });
            }
            self.driver.wait_ready(ep, remaining).await?;
            let Some(now_held) = self.runtime.port_held_by_another(record) else {
                return Ok(());
            };
            if holder.is_none() {
                tracing::warn!(instance = %record.instance, port = record.port, holder = %now_held,
                    "the engine's port answers but is held by another process; waiting for the engine");
            }
            holder = Some(now_held);
            tokio::time::sleep(Duration::from_millis(100).min(remaining)).await;
        }
    }

    fn host_room(&self, inv: &Inventory, except: &str) -> u64 {
        let (mut held, mut copying) = (0u64, 0u64);
        for (id, i) in self.instances().iter() {
            if id.as_str() == except {
                continue;
            }
            let s = i.state();
            let bytes = s.measurement.weights_bytes().unwrap_or(0);
            if s.parking == Some(ParkTier::HostRam) {
                copying = copying.saturating_add(bytes);
            } else if s.record.parked == Some(ParkTier::HostRam) {
                held = held.saturating_add(bytes);
            }
        }
        host_ram_room(&inv.host_memory, held, copying)
    }

    /// The `CUDA_VISIBLE_DEVICES` an engine of `spec` starts with: the deployment's `env`, the
    /// host's `engines.<kind>.env`, or the agent's own environment.
    fn visible_devices(&self, spec: &InstanceSpec) -> Option<String> {
        const VAR: &str = "CUDA_VISIBLE_DEVICES";
        spec.env
            .get(VAR)
            .or_else(|| self.settings.engine(spec.engine).env.get(VAR))
            .cloned()
            .or_else(|| std::env::var(VAR).ok())
    }

    /// Whether the GPUs `spec`'s engine uses have unified memory.
    fn unified_for(&self, inv: &Inventory, spec: &InstanceSpec) -> bool {
        inv.unified_for(self.visible_devices(spec).as_deref())
    }

    /// `measured` (before a start) completed with what an earlier start of the same
    /// deployment and model showed: a figure no other source gives.
    fn with_learned(&self, spec: &InstanceSpec, measured: Measurement) -> Measurement {
        let learned = self
            .learned
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&(spec.deployment_id.clone(), spec.model.clone()))
            .copied()
            .unwrap_or_default();
        Measurement {
            weights: measured.weights.or(learned.weights),
            gpu_memory: measured.gpu_memory.or(learned.gpu_memory),
        }
    }

    /// Keeps `m` for later starts of `spec` when it holds the engine's footprint.
    fn learn(&self, spec: &InstanceSpec, m: Measurement) {
        if m.gpu_memory
            .is_some_and(|g| g.source == MeasureSource::EngineFootprint)
        {
            self.learned
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert((spec.deployment_id.clone(), spec.model.clone()), m);
        }
    }

    /// What a parked engine of `inst` (process `pid`) holds on the GPU now: the probe's reading
    /// of its processes, else the estimate.
    fn gpu_held(&self, inst: &Instance, pid: u32, tier: ParkTier) -> Option<GpuHeld> {
        if let Some(bytes) = footprint(self.probe.as_ref(), pid) {
            return Some(GpuHeld {
                bytes,
                source: GpuHeldSource::Observed,
            });
        }
        let weights = inst.state().measurement.weights_bytes();
        let workers = inst.spec.tensor_parallel.unwrap_or(1);
        parked_estimate(weights, tier == ParkTier::KvOnly, workers).map(|bytes| GpuHeld {
            bytes,
            source: GpuHeldSource::Estimated,
        })
    }

    /// What starting, parking or judging `spec` needs to know first: the inventory, the
    /// measurement, the refusal row and the checkpoint's facts.
    async fn prepare(&self, spec: &InstanceSpec) -> Result<Prepared, AgentError> {
        let inv = inventory(&self.settings, self.probe.as_ref())?;
        let s = spec.clone();
        let (measurement, facts) =
            blocking(move || Ok((measure_before_start(&s)?, ModelFacts::read(&s.model)))).await?;
        let measurement = self.with_learned(spec, measurement);
        let version = self.version_of(spec.engine);
        let refusal = refusal_for(spec.engine, version.as_deref(), &facts, spec.speculative());
        Ok(Prepared {
            inv,
            measurement,
            refusal,
            facts,
        })
    }

    /// Scrapes the engine's load every `sample_interval`, except while a park or a wake of it
    /// is in progress (`state`'s [`InstanceState::moving`]): those calls are on a switch's
    /// path, and a scrape of vLLM holds its event loop for 10-27 ms on a loaded CPU, during
    /// which a park or wake call waits. The previous sample stays until the next tick after.
    fn spawn_sampler(
        &self,
        endpoint: Endpoint,
        state: Arc<Mutex<InstanceState>>,
    ) -> (watch::Receiver<Option<LoadSample>>, JoinHandle<()>) {
        let (tx, rx) = watch::channel(None);
        let driver = self.driver.clone();
        let every = self.config.sample_interval;
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if lock_state(&state).moving() {
                    continue;
                }
                let sampled_at_ms = now_ms();
                let began = Instant::now();
                let engine = driver
                    .scrape(&endpoint, every.max(Duration::from_millis(200)))
                    .await;
                let sample = LoadSample {
                    sampled_at_ms,
                    took: began.elapsed(),
                    engine,
                };
                if tx.send(Some(sample)).is_err() {
                    return;
                }
            }
        });
        (rx, task)
    }

    fn register(
        &self,
        record: PidRecord,
        refusal: Option<&'static RefusalRow>,
        measurement: Measurement,
    ) -> Arc<Instance> {
        let endpoint = endpoint_at(&record.spec, self.runtime.base_url(&record));
        let state = Arc::new(Mutex::new(InstanceState {
            record: record.clone(),
            measurement,
            waking: false,
            parking: None,
        }));
        let (sample, sampler) = self.spawn_sampler(endpoint.clone(), Arc::clone(&state));
        let inst = Arc::new(Instance {
            spec: record.spec.clone(),
            endpoint,
            parking: record.parking,
            refusal,
            state,
            sample,
            sampler,
            exit_watcher: Mutex::new(None),
            adapter_calls: tokio::sync::Mutex::new(()),
            stopping: watch::Sender::new(false),
        });
        self.instances()
            .insert(record.instance.clone(), Arc::clone(&inst));
        if let Some(exit) = self.runtime.exit_watch(&record.instance) {
            let watcher = tokio::spawn(self.reporter().watch(
                record.instance.clone(),
                exit,
                Arc::downgrade(&inst),
            ));
            *inst
                .exit_watcher
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(watcher.abort_handle());
        }
        inst
    }

    /// Changes the record of `inst` and writes it, unless the agent no longer holds `inst`
    /// (its engine exited meanwhile and was forgotten: no record may come back for it).
    fn save(
        &self,
        inst: &Arc<Instance>,
        change: impl FnOnce(&mut PidRecord),
    ) -> Result<(), AgentError> {
        let record = {
            let mut s = inst.state();
            change(&mut s.record);
            s.record.clone()
        };
        let map = self.instances();
        if !map
            .get(&record.instance)
            .is_some_and(|held| Arc::ptr_eq(held, inst))
        {
            return Ok(());
        }
        // Under the map's lock, so an exit report cannot remove the record in between.
        self.runtime.write_record(&record)
    }

    /// [`LocalHostAgent::save`] of an outcome: a record that cannot be written is logged (the
    /// engine's state already changed; the record's transition makes a recovery stop it).
    fn save_outcome(&self, inst: &Arc<Instance>, change: impl FnOnce(&mut PidRecord)) {
        if let Err(e) = self.save(inst, change) {
            tracing::warn!(instance = %inst.state().record.instance, error = %e, "cannot update pid record");
        }
    }

    async fn do_start(&self, id: &str, spec: &InstanceSpec) -> Result<StartedInstance, AgentError> {
        if self.instances().contains_key(id) {
            return Err(AgentError::WrongState {
                instance: id.to_string(),
                detail: "already running".into(),
            });
        }
        let op = self.begin_op(id, "start")?;
        let cancelled = || AgentError::Cancelled {
            instance: id.to_string(),
            what: "start",
        };
        let prepared = tokio::select! {
            p = self.prepare(spec) => p?,
            () = op.cancelled() => return Err(cancelled()),
        };
        let Prepared {
            inv,
            measurement,
            refusal,
            facts,
        } = prepared;
        let input = TierInput {
            engine: spec.engine,
            residency: spec.residency,
            speculative: spec.speculative(),
            decision_model: spec.decision.is_some(),
            unified_memory: self.unified_for(&inv, spec),
            weights_bytes: measurement.weights_bytes(),
            host_room: Some(self.host_room(&inv, id)),
            refusal,
            launched: None,
        };
        let parking = launch_parking(&input);
        let launch = self.runtime.launch(LaunchRequest {
            instance: id,
            spec,
            engine: self.settings.engine(spec.engine),
            parking,
            ready_timeout: self.config.ready_timeout,
            now_ms: now_ms(),
        });
        // Cut by a stop only where the runtime says a launch may be dropped (an engine Pod's
        // launch waits, up to the ready timeout, for a Pod the operator deletes): a process
        // launch dropped half-way could leave a process nobody knows.
        let launched = if self.runtime.launch_cancellable() {
            tokio::select! {
                biased;
                () = op.cancelled() => None,
                l = launch => Some(l),
            }
        } else {
            Some(launch.await)
        };
        let Some(launched) = launched else {
            let _ = self.runtime.stop(id, self.config.stop_grace).await;
            return Err(cancelled());
        };
        let Launched {
            record,
            base_url,
            mut exit,
        } = launched?;
        let port = record.port;
        let endpoint = endpoint_at(spec, base_url);
        let log = self.runtime.log_location(&record);
        let ready_and_answer = async {
            tokio::select! {
                r = self.wait_engine_ready(&endpoint, &record) => r,
                status = exit.wait_for(Option::is_some) => Err(AgentError::EngineExited {
                    engine: spec.engine,
                    instance: id.to_string(),
                    status: status.ok().and_then(|s| s.clone()).unwrap_or_default(),
                    log: None,
                }),
            }?;
            self.driver
                .check_answer(
                    &endpoint,
                    spec.decision.as_ref(),
                    self.config.timeouts.check,
                )
                .await
        };
        let first = tokio::select! {
            biased;
            () = op.cancelled() => Err(cancelled()),
            r = ready_and_answer => r,
        };
        let first = match first {
            Ok(f) => f,
            Err(e) => {
                let _ = self.runtime.stop(id, self.config.stop_grace).await;
                return Err(e.not_ready(spec.engine, id, log));
            }
        };
        let version = self.driver.version(&endpoint).await;
        if let Some(v) = &version {
            self.versions
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(spec.engine, v.clone());
        }
        let reported = match spec.engine {
            EngineKind::Sglang => self.driver.sglang_max_running(&endpoint).await,
            _ => None,
        };
        let measurement = add_footprint(measurement, self.probe.as_ref(), record.pid);
        self.learn(spec, measurement);
        let mut record = record;
        record.first_answer = Some(first.clone());
        record.measurement = Some(measurement);
        if op.is_cancelled() {
            let _ = self.runtime.stop(id, self.config.stop_grace).await;
            return Err(cancelled());
        }
        // Before the exit watcher starts (in `register`), so a record is never written back
        // for an engine already forgotten.
        if let Err(e) = self.runtime.write_record(&record) {
            tracing::warn!(instance = id, error = %e, "cannot update pid record");
        }
        self.register(record.clone(), refusal, measurement);
        Ok(StartedInstance {
            instance: id.to_string(),
            pid: record.pid,
            port,
            base_url: endpoint.base_url.clone(),
            version,
            measurement,
            first_answer: first,
            max_running: max_running(&MaxRunningInput {
                engine: spec.engine,
                declared: spec.max_concurrent_requests,
                extra_args: &spec.extra_args,
                host_command: &self.settings.engine(spec.engine).command,
                engine_reported: reported,
                hybrid_checkpoint: facts.hybrid_state,
                sized_on_host: false,
            }),
            parking,
        })
    }

    /// Chooses how `inst` gives back its memory and, for a park, marks it parking (which
    /// reserves a host-RAM copy's room, see [`LocalHostAgent::host_room`]) in one step: two
    /// parks at once never both count the same free memory.
    fn choose_and_reserve(
        &self,
        id: &str,
        inst: &Instance,
        inv: &Inventory,
    ) -> Result<ParkChoice, AgentError> {
        let _one_at_a_time = self
            .park_choice
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let measurement = inst.state().measurement;
        let choice = choose_tier(&TierInput {
            engine: inst.spec.engine,
            residency: inst.spec.residency,
            speculative: inst.spec.speculative(),
            decision_model: inst.spec.decision.is_some(),
            unified_memory: self.unified_for(inv, &inst.spec),
            weights_bytes: measurement.weights_bytes(),
            host_room: Some(self.host_room(inv, id)),
            refusal: inst.refusal,
            launched: Some(inst.parking),
        })?;
        if let ParkChoice::Park(tier) = choice
            && inst.parking.may_park
        {
            inst.state().parking = Some(tier);
        }
        Ok(choice)
    }

    async fn do_park(&self, id: &str) -> Result<ParkResult, AgentError> {
        let inst = self.instance(id)?;
        {
            let s = inst.state();
            if s.record.parked.is_some() || s.parking.is_some() {
                return Err(AgentError::WrongState {
                    instance: id.to_string(),
                    detail: "already parked or parking".into(),
                });
            }
        }
        let inv = inventory(&self.settings, self.probe.as_ref())?;
        match self.choose_and_reserve(id, &inst, &inv)? {
            ParkChoice::Park(tier) if inst.parking.may_park => {
                // Marked parking: adapter calls from now on are refused; the one in flight
                // ends before the park reaches the engine.
                drop(inst.adapter_calls.lock().await);
                let parked = self.park_engine(&inst, tier).await;
                inst.state().parking = None;
                parked
            }
            ParkChoice::Park(_) => {
                self.stop_engine(id).await?;
                Ok(ParkResult::Stopped {
                    reason: NoParkReason::NoRoomToPark,
                })
            }
            ParkChoice::Stop(reason) => {
                self.stop_engine(id).await?;
                Ok(ParkResult::Stopped { reason })
            }
        }
    }

    /// Records the intent, parks the engine in `tier`, records the outcome. A park that fails
    /// leaves the intent recorded: the engine's state is uncertain, and a recovery stops it.
    async fn park_engine(
        &self,
        inst: &Arc<Instance>,
        tier: ParkTier,
    ) -> Result<ParkResult, AgentError> {
        self.save(inst, |r| r.transition = Some(Transition::Parking(tier)))?;
        self.driver.park(&inst.endpoint, tier).await?;
        let pid = inst.state().record.pid;
        let gpu_held = self.gpu_held(inst, pid, tier);
        self.save_outcome(inst, |r| {
            r.parked = Some(tier);
            r.gpu_held = gpu_held;
            r.transition = None;
        });
        Ok(ParkResult::Parked { tier, gpu_held })
    }

    async fn do_wake(&self, id: &str, window: Duration) -> Result<WakeReport, AgentError> {
        let inst = self.instance(id)?;
        let (tier, first) = {
            let s = inst.state();
            (s.record.parked, s.record.first_answer.clone())
        };
        let Some(tier) = tier else {
            return Err(AgentError::WrongState {
                instance: id.to_string(),
                detail: "not parked".into(),
            });
        };
        let op = self.begin_op(id, "wake")?;
        self.save(&inst, |r| r.transition = Some(Transition::Waking(tier)))?;
        let guard = WakeGuard::new(id, &inst, self.runtime.exit_watch(id), self.reporter());
        let began = Instant::now();
        let attempt = tokio::select! {
            biased;
            () = op.cancelled() => None,
            a = self.driver.wake_and_verify(
                &inst.endpoint,
                tier,
                inst.spec.decision.as_ref(),
                first.as_ref(),
                window,
            ) => Some(a),
        };
        let Some(attempt) = attempt else {
            // Forgotten before the guard reports: the exit that follows is the stop's own.
            let _ = self.stop_engine(id).await;
            drop(guard);
            return Err(AgentError::Cancelled {
                instance: id.to_string(),
                what: "wake",
            });
        };
        let checked = attempt.check_began.map(|b| b.elapsed());
        let mut outcome = attempt.outcome;
        if outcome != WakeOutcome::Pass
            && let Some(status) = self.exited(id, attempt.engine_unreachable).await
        {
            outcome = WakeOutcome::EngineExited(format!(
                "{}; the engine exited during the wake: {status}",
                outcome.detail()
            ));
        }
        if outcome == WakeOutcome::Pass {
            self.save_outcome(&inst, |r| {
                r.parked = None;
                r.gpu_held = None;
                r.transition = None;
            });
        } else {
            tracing::warn!(instance = id, outcome = ?outcome, "wake failed; stopping the instance");
            let _ = self.stop_engine(id).await;
        }
        drop(guard);
        Ok(WakeReport {
            outcome,
            took: began.elapsed(),
            checked,
        })
    }

    /// The exit status when the engine has exited; when it could not be reached
    /// (`unreachable`), waiting briefly for it to be reaped.
    async fn exited(&self, id: &str, unreachable: bool) -> Option<String> {
        let mut exit = self.runtime.exit_watch(id)?;
        if !unreachable {
            return exit.borrow().clone();
        }
        exited_within(&mut exit, Duration::from_secs(2)).await
    }

    /// [`HostAgent::stop`]: ends a start or a wake in progress, then stops the engine.
    async fn do_stop(&self, id: &str) -> Result<(), AgentError> {
        let ended = self.end_op(id).await;
        match self.stop_engine(id).await {
            // The start or wake that was ended has stopped its engine itself.
            Err(AgentError::UnknownInstance { .. }) if ended => Ok(()),
            other => other,
        }
    }

    /// Stops the engine of `id` (not a start or wake of it in progress: see
    /// [`LocalHostAgent::do_stop`]).
    async fn stop_engine(&self, id: &str) -> Result<(), AgentError> {
        let inst = self.instances().get(id).cloned();
        if let Some(inst) = inst {
            // An adapter call in flight ends (Cancelled) before the engine is stopped.
            inst.stopping.send_replace(true);
            drop(inst.adapter_calls.lock().await);
        }
        let known = self.instances().remove(id);
        let stopped = self.runtime.stop(id, self.config.stop_grace).await;
        match (known, stopped) {
            (_, Ok(())) | (Some(_), Err(AgentError::UnknownInstance { .. })) => Ok(()),
            (_, Err(e)) => Err(e),
        }
    }

    async fn do_recover(&self) -> Result<RecoveryReport, AgentError> {
        // NB (a caller that restarted): a start or wake still in progress was asked by a caller
        // that is gone, and nobody waits for its outcome. Reported as it is (parked, while its
        // wake runs), the new caller would wake it again, be refused (an operation in
        // progress), fail it and start the model elsewhere, while this engine runs on to the
        // end of its window: two engines of one deployment. So it is ended and its engine
        // stopped (as a stop does), and reported `stopped`: the next request starts it afresh.
        let busy: Vec<String> = self
            .in_progress
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .keys()
            .cloned()
            .collect();
        let mut ended = Vec::new();
        for id in busy {
            tracing::warn!(instance = %id, "a recovery ends the start or wake its caller left in progress");
            if let Err(e) = self.do_stop(&id).await {
                tracing::warn!(instance = %id, error = %e, "stopping it failed");
            }
            ended.push(id);
        }
        // Engines this agent already drives (a node agent that outlived its caller: the
        // operator restarted or failed over) are reported as adopted too, as they are now.
        let held: Vec<AdoptedInstance> = self
            .instances()
            .iter()
            .map(|(id, inst)| {
                let s = inst.state();
                AdoptedInstance {
                    instance: id.clone(),
                    spec: inst.spec.clone(),
                    base_url: inst.endpoint.base_url.clone(),
                    pid: s.record.pid,
                    parked: s.record.parked,
                    gpu_held: s.record.parked.and(s.record.gpu_held),
                }
            })
            .collect();
        let verdicts: Arc<Mutex<HashMap<String, RecoveryVerdict>>> = Arc::default();
        let driver = self.driver.clone();
        let seen = Arc::clone(&verdicts);
        let answers: Answers = Arc::new(move |record: PidRecord, base_url: String| {
            let driver = driver.clone();
            let seen = Arc::clone(&seen);
            Box::pin(async move {
                let verdict = match record.transition {
                    // Nothing the engine says changes it: do not make it generate.
                    Some(Transition::Waking(_)) => {
                        recovery_verdict(&record, &EngineState::NoAnswer(String::new()))
                    }
                    _ => {
                        let ep = endpoint_at(&record.spec, base_url);
                        let expect_awake = record.parked.is_none() && record.transition.is_none();
                        let state = driver.engine_state(&ep, expect_awake).await;
                        recovery_verdict(&record, &state)
                    }
                };
                if let RecoveryVerdict::Stop(why) = &verdict {
                    tracing::warn!(instance = %record.instance, pid = record.pid, reason = %why, "left-behind engine not adopted; stopping it");
                }
                let adopts = verdict.adopts();
                seen.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(record.instance, verdict);
                adopts
            })
        });
        let recovery = self
            .runtime
            .recover(answers, self.config.stop_grace)
            .await?;
        let mut report = RecoveryReport {
            stopped: ended
                .into_iter()
                .chain(recovery.stopped.into_iter().map(|r| r.instance))
                .collect(),
            gone: recovery.gone.into_iter().map(|r| r.instance).collect(),
            ..Default::default()
        };
        for record in recovery.adopted {
            let verdict = verdicts
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&record.instance);
            let record = match verdict {
                Some(v) => settled(record, &v),
                None => record,
            };
            let prepared = self.prepare(&record.spec).await?;
            let measurement = record.measurement.unwrap_or(prepared.measurement);
            self.learn(&record.spec, measurement);
            let inst = self.register(record.clone(), prepared.refusal, measurement);
            // A park whose outcome was not recorded: what the engine holds now.
            let gpu_held = match (record.parked, record.gpu_held) {
                (Some(tier), None) => self.gpu_held(&inst, record.pid, tier),
                (_, held) => held,
            };
            let record = PidRecord { gpu_held, ..record };
            self.save_outcome(&inst, |r| *r = record.clone());
            report.adopted.push(AdoptedInstance {
                instance: record.instance.clone(),
                spec: record.spec.clone(),
                base_url: inst.endpoint.base_url.clone(),
                pid: record.pid,
                parked: record.parked,
                gpu_held: record.parked.and(record.gpu_held),
            });
        }
        for inst in held {
            if !report.adopted.iter().any(|a| a.instance == inst.instance) {
                report.adopted.push(inst);
            }
        }
        Ok(report)
    }

    /// Stops every engine this agent runs (shutdown).
    pub async fn stop_all(&self) {
        self.instances().clear();
        self.runtime.stop_all(self.config.stop_grace).await;
    }
}

/// The endpoint of `spec`'s engine on loopback `port`.
pub fn endpoint_of(spec: &InstanceSpec, port: u16) -> Endpoint {
    endpoint_at(spec, crate::runtime::loopback_url(port))
}

/// The endpoint of `spec`'s engine at `base_url` (`http://<address>:<port>`).
pub fn endpoint_at(spec: &InstanceSpec, base_url: String) -> Endpoint {
    Endpoint {
        engine: spec.engine,
        base_url,
        model_name: match spec.engine {
            EngineKind::Tensorfold => spec.model.clone(),
            EngineKind::Vllm | EngineKind::Sglang => spec.name.clone(),
        },
        model: spec.model.clone(),
    }
}

impl HostAgent for LocalHostAgent {
    fn inventory(&self) -> BoxFuture<'_, Result<Inventory, AgentError>> {
        Box::pin(async move { inventory(&self.settings, self.probe.as_ref()) })
    }

    fn engines(&self) -> BoxFuture<'_, Vec<EngineInfo>> {
        Box::pin(async move {
            EngineKind::ALL
                .iter()
                .map(|k| engine_info(*k, self.version_of(*k)))
                .collect()
        })
    }

    fn measure<'a>(
        &'a self,
        spec: &'a InstanceSpec,
    ) -> BoxFuture<'a, Result<Measurement, AgentError>> {
        Box::pin(async move {
            // Declared weights read no file: measured here, without a blocking task (a
            // standalone start measures every deployment of its document).
            let measured = if spec.resources.weights_memory.is_some() {
                measure_before_start(spec)?
            } else {
                let s = spec.clone();
                blocking(move || measure_before_start(&s)).await?
            };
            Ok(self.with_learned(spec, measured))
        })
    }

    fn parkability<'a>(
        &'a self,
        spec: &'a InstanceSpec,
    ) -> BoxFuture<'a, Result<ParkChoice, AgentError>> {
        Box::pin(async move {
            let Prepared {
                inv,
                measurement,
                refusal,
                ..
            } = self.prepare(spec).await?;
            choose_tier(&TierInput {
                engine: spec.engine,
                residency: spec.residency,
                speculative: spec.speculative(),
                decision_model: spec.decision.is_some(),
                unified_memory: self.unified_for(&inv, spec),
                weights_bytes: measurement.weights_bytes(),
                host_room: Some(self.host_room(&inv, "")),
                refusal,
                launched: None,
            })
        })
    }

    fn start<'a>(
        &'a self,
        instance: &'a str,
        spec: &'a InstanceSpec,
    ) -> BoxFuture<'a, Result<StartedInstance, AgentError>> {
        Box::pin(self.do_start(instance, spec))
    }

    fn park<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<ParkResult, AgentError>> {
        Box::pin(self.do_park(instance))
    }

    fn wake<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<WakeReport, AgentError>> {
        Box::pin(self.do_wake(instance, self.config.wake_window))
    }

    fn wake_within<'a>(
        &'a self,
        instance: &'a str,
        window: Duration,
    ) -> BoxFuture<'a, Result<WakeReport, AgentError>> {
        Box::pin(self.do_wake(instance, window))
    }

    fn stop<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<(), AgentError>> {
        Box::pin(self.do_stop(instance))
    }

    fn sample(&self, instance: &str) -> Option<LoadSample> {
        let inst = self.instances().get(instance).cloned()?;
        *inst.sample.borrow()
    }

    fn load_adapter<'a>(
        &'a self,
        instance: &'a str,
        name: &'a str,
        path: &'a str,
    ) -> BoxFuture<'a, Result<(), AgentError>> {
        Box::pin(async move {
            self.adapter_call(
                instance,
                "adapter load",
                "load an adapter into",
                |ep| async move { self.driver.load_adapter(&ep, name, path).await },
            )
            .await
        })
    }

    fn unload_adapter<'a>(
        &'a self,
        instance: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<(), AgentError>> {
        Box::pin(async move {
            self.adapter_call(
                instance,
                "adapter unload",
                "unload an adapter from",
                |ep| async move { self.driver.unload_adapter(&ep, name).await },
            )
            .await
        })
    }

    fn adapters<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<Vec<String>, AgentError>> {
        Box::pin(async move {
            self.adapter_call(
                instance,
                "adapter list",
                "list the adapters of",
                |ep| async move { self.driver.adapters(&ep).await },
            )
            .await
        })
    }

    fn recover(&self) -> BoxFuture<'_, Result<RecoveryReport, AgentError>> {
        Box::pin(self.do_recover())
    }

    fn subscribe_exits(&self) -> broadcast::Receiver<EngineExit> {
        self.exits.subscribe()
    }

    fn samples(&self) -> BTreeMap<String, LoadSample> {
        let instances: Vec<(String, Arc<Instance>)> = self
            .instances()
            .iter()
            .map(|(id, i)| (id.clone(), Arc::clone(i)))
            .collect();
        instances
            .into_iter()
            .filter_map(|(id, i)| {
                let sample = *i.sample.borrow();
                sample.map(|s| (id, s))
            })
            .collect()
    }
}

/// Resolves once `stopping` is set (an instance's stop began).
async fn stopped(mut stopping: watch::Receiver<bool>) {
    if stopping.wait_for(|s| *s).await.is_err() {
        std::future::pending::<()>().await;
    }
}
