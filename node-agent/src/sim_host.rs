//! [`SimHost`]: a host agent whose engines are simulated. Nothing is started: each engine
//! operation (start, park, wake, stop) takes its simulated time on the tokio clock (paused in
//! `capyctl simulate` and in most tests, so it costs nothing) and ends as the real agent's would.
//! It is the host of `capyctl simulate` and of the tests (the lifecycle's, the management app's,
//! the scale benchmark's): one type, so that what a test proves of the lifecycle over this host
//! holds for the simulator too.
//!
//! What it decides, by [`Decisions`]:
//!
//! - [`Decisions::Agent`] (`capyctl simulate`, [`SimHost::from_settings`]): as a real agent
//!   does, the parking tier (the agent's own [`choose_tier`], with the room left in host RAM by
//!   the copies parked), the engine's request bound ([`max_running`]); it keeps its instances,
//!   and an operation on one it does not run is refused;
//! - [`Decisions::Declared`] (the tests, [`SimHost::new`]): every copy parks in host RAM, the
//!   bound is the router's 32, and it keeps no instances (a benchmark's memory figures count no
//!   bookkeeping of the host's).
//!
//! Both measure what a deployment declares (its `resources`, or a local checkpoint's headers)
//! and take their times from [`Timings`] (per deployment name, and a default). Besides, for the
//! tests (and for any simulation of faults):
//!
//! - a latency for each `inventory` and `engines` call ([`SimHost::with_latency`]: a round
//!   trip to a node agent; on the tokio clock, or kept to within some 0.1 ms of real time,
//!   [`SimHost::with_exact_latency`]), and a count of such calls in progress shared by several hosts
//!   ([`SimHost::counting`], [`Concurrency`]);
//! - the calls `start <iid>`, `park <iid>`, `wake <iid>`, `stop <iid>` in order, as they begin
//!   ([`SimHost::calls`]), and the operations with when they began and ended, as they end
//!   ([`SimHost::ops`]); [`SimHost::without_call_log`] keeps neither, for figures of memory;
//! - operations that never end by themselves ([`SimHost::hang`]): the starts of a deployment
//!   named so, the wakes of an instance so named; a stop of their instance ends them
//!   (`cancelled`), as the real agents do;
//! - stops that fail ([`SimHost::fail_stops`]): the engine could not be stopped (after ending
//!   a hanging operation of its instance);
//! - a hook called on every `sample` ([`SimHost::on_sample`]), which answers none unless
//!   [`SimHost::set_engine_waiting`] said so, and one called on every `inventory`
//!   ([`SimHost::on_inventory`]).
//!
//! - LoRA adapters (DESIGN 4.9): each instance's loaded set (emptied when its engine starts
//!   or stops; kept across a park and a wake), loads that take [`SimHost::with_adapter_load`]
//!   and are logged (`load_adapter <iid> <name>`, `unload_adapter <iid> <name>`), and loads of
//!   a path named by [`SimHost::fail_adapter_path`] refused as an engine refuses a directory
//!   that is not PEFT.
//!
//! Mutex poisoning is a panic elsewhere (a test's): the host goes on with the data.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use capyctl_spec::EngineKind;
use tokio::time::Instant;

use crate::agent::{BoxFuture, ParkResult, RecoveryReport, StartedInstance, WakeReport};
use crate::capability::{EngineInfo, engine_info};
use crate::inventory::{GpuInfo, HostMemory, Inventory, default_probe, inventory};
use crate::launch::{MaxRunning, MaxRunningInput, MaxRunningSource, max_running};
use crate::load::{EngineLoad, LoadSample};
use crate::measure::{Measurement, measure_before_start};
use crate::spec::{HostSettings, InstanceSpec};
use crate::tier::{
    LaunchParking, NoParkReason, ParkChoice, ParkTier, TierInput, choose_tier, launch_parking,
};
use crate::verify::{FirstAnswer, WakeOutcome};
use crate::{AgentError, HostAgent};

const GIB: u64 = 1 << 30;

/// How long one model's engine operations take in the simulation.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Timings {
    /// A cold start, to ready with its first answer.
    pub start: Duration,
    /// A park into host RAM (the weights copied out).
    pub park_host_ram: Duration,
    /// A deep park (the weights dropped) or a KV-only one.
    pub park_deep: Duration,
    /// A wake from host RAM, check prompt and warm-up included.
    pub wake_host_ram: Duration,
    /// A wake from a deep park (the weights reloaded from disk), check included.
    pub wake_deep: Duration,
    /// A wake from a KV-only park, check included.
    pub wake_kv_only: Duration,
    /// The wake check (check prompt and warm-up), the last part of every wake.
    pub wake_check: Duration,
    /// A stop.
    pub stop: Duration,
}

/// What a [`SimHost`] decides itself (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decisions {
    /// As a real agent: the tier choice, the engine's bound, its instances kept.
    Agent,
    /// Host RAM parking, the router's bound, no instances kept.
    Declared,
}

/// What an engine operation was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum OpKind {
    /// A cold start.
    Start,
    /// A park.
    Park,
    /// A wake.
    Wake,
    /// A stop.
    Stop,
}

impl OpKind {
    /// Its name, for the report and the timeline.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Start => "start",
            OpKind::Park => "park",
            OpKind::Wake => "wake",
            OpKind::Stop => "stop",
        }
    }
}

/// One engine operation of the simulation.
#[derive(Debug, Clone)]
pub struct Op {
    /// The deployment's name.
    pub model: String,
    /// The instance's ID.
    pub instance_id: String,
    /// The indices of the GPUs the instance uses.
    pub gpus: Vec<u32>,
    /// What it was.
    pub kind: OpKind,
    /// When it began.
    pub began: Instant,
    /// When it ended.
    pub ended: Instant,
}

/// Calls in progress now, and the most at once (of every host that shares it).
#[derive(Debug, Default)]
pub struct Concurrency {
    now: AtomicUsize,
    most: AtomicUsize,
}

impl Concurrency {
    /// Runs `work`, counted while it runs.
    pub async fn during<T>(&self, work: impl Future<Output = T>) -> T {
        let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(n, Ordering::SeqCst);
        let out = work.await;
        self.now.fetch_sub(1, Ordering::SeqCst);
        out
    }

    /// The most calls at once since the last [`Concurrency::reset_most`].
    pub fn most(&self) -> usize {
        self.most.load(Ordering::SeqCst)
    }

    /// Forgets the most so far.
    pub fn reset_most(&self) {
        self.most.store(0, Ordering::SeqCst);
    }
}

/// What [`SimHost::on_sample`] calls, with the instance ID.
type SampleHook = Box<dyn Fn(&str) + Send + Sync>;

/// What [`SimHost::on_inventory`] calls.
type InventoryHook = Box<dyn Fn() + Send + Sync>;

#[derive(Debug)]
struct SimInstance {
    spec: InstanceSpec,
    measurement: Measurement,
    launched: LaunchParking,
    /// The tier it is parked in, with the bytes its copy holds in host RAM.
    parked: Option<(ParkTier, u64)>,
}

/// The simulated host (see the module doc). Build it with [`SimHost::new`] or
/// [`SimHost::from_settings`] and the `with_…` methods.
pub struct SimHost {
    decisions: Decisions,
    /// The host's GPUs and RAM, as its inventory says.
    inventory: Inventory,
    /// Where an engine's `CUDA_VISIBLE_DEVICES` may be set besides its spec.
    settings: HostSettings,
    /// The engines it runs.
    engines: Vec<EngineKind>,
    /// By deployment name; `default_timings` for the others.
    timings: BTreeMap<String, Timings>,
    default_timings: Timings,
    /// Where every started engine answers.
    upstream: SocketAddr,
    /// `None`: the inventory and engines calls answer without a sleep.
    latency: Option<Duration>,
    /// The latency is waited on [`exact_sleep`]'s thread, not on the tokio clock.
    exact_latency: bool,
    in_progress: Option<Arc<Concurrency>>,
    /// `None`: no call log and no op log.
    calls: Option<Mutex<Vec<String>>>,
    ops: Option<Mutex<Vec<Op>>>,
    /// The instances it runs ([`Decisions::Agent`] only).
    instances: Mutex<BTreeMap<String, SimInstance>>,
    hangs: Mutex<BTreeSet<String>>,
    failing_stops: Mutex<BTreeSet<String>>,
    failing_parks: Mutex<BTreeSet<String>>,
    /// The instances stopped so far (what ends their hanging operations).
    stopped: Mutex<BTreeSet<String>>,
    stops: tokio::sync::Notify,
    sample_hook: OnceLock<SampleHook>,
    inventory_hook: OnceLock<InventoryHook>,
    /// Engines whose samples say they have requests waiting ([`SimHost::set_engine_waiting`]);
    /// the others have no sample.
    engine_waiting: Mutex<HashMap<String, u64>>,
    /// How long an adapter load takes.
    adapter_load: Duration,
    /// The adapters each instance's engine has loaded.
    adapters: Mutex<BTreeMap<String, BTreeSet<String>>>,
    /// Adapter paths whose loads the engine refuses.
    failing_adapter_paths: Mutex<BTreeSet<String>>,
}

impl Default for SimHost {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for SimHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimHost")
            .field("decisions", &self.decisions)
            .field("gpus", &self.inventory.gpus.len())
            .field("upstream", &self.upstream)
            .field("latency", &self.latency)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Sleeps `d`, unless it is zero (then nothing: no yield either).
async fn pause(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}

/// What the real agent measures before a start: the declared resources (or a local
/// checkpoint's headers).
fn measured(spec: &InstanceSpec) -> Measurement {
    measure_before_start(spec).unwrap_or_default()
}

/// The tier choice's input for `spec` on this host.
fn tier_input(
    spec: &InstanceSpec,
    unified_memory: bool,
    weights_bytes: Option<u64>,
    host_room: u64,
    launched: Option<LaunchParking>,
) -> TierInput {
    TierInput {
        engine: spec.engine,
        residency: spec.residency,
        speculative: spec.speculative(),
        decision_model: spec.decision.is_some(),
        unified_memory,
        weights_bytes,
        host_room: Some(host_room),
        refusal: None,
        launched,
    }
}

/// One GPU of `bytes` at index `index`, with `uuid` (the first's as given, the others' with
/// `-<index>` added).
fn gpu(index: u32, bytes: u64, uuid: Option<&str>) -> GpuInfo {
    GpuInfo {
        index,
        uuid: uuid.map(|u| match index {
            0 => u.to_string(),
            _ => format!("{u}-{index}"),
        }),
        name: None,
        total_bytes: bytes,
        free_bytes: None,
        unified: false,
    }
}

impl SimHost {
    /// The tests' host ([`Decisions::Declared`]): one 10 GiB GPU, 64 GiB of host RAM, vLLM,
    /// engines at `127.0.0.1:9`, operations taking no time, no latency, the calls logged.
    pub fn new() -> Self {
        SimHost {
            decisions: Decisions::Declared,
            inventory: Inventory {
                gpus: vec![gpu(0, 10 * GIB, None)],
                gpus_overridden: true,
                host_memory: HostMemory {
                    total_bytes: 64 * GIB,
                    available_bytes: 64 * GIB,
                    overridden: true,
                },
            },
            settings: HostSettings::default(),
            engines: vec![EngineKind::Vllm],
            timings: BTreeMap::new(),
            default_timings: Timings::default(),
            upstream: SocketAddr::from(([127, 0, 0, 1], 9)),
            latency: None,
            exact_latency: false,
            in_progress: None,
            calls: Some(Mutex::new(Vec::new())),
            ops: Some(Mutex::new(Vec::new())),
            instances: Mutex::new(BTreeMap::new()),
            hangs: Mutex::new(BTreeSet::new()),
            failing_stops: Mutex::new(BTreeSet::new()),
            failing_parks: Mutex::new(BTreeSet::new()),
            stopped: Mutex::new(BTreeSet::new()),
            stops: tokio::sync::Notify::new(),
            sample_hook: OnceLock::new(),
            inventory_hook: OnceLock::new(),
            engine_waiting: Mutex::new(HashMap::new()),
            adapter_load: Duration::ZERO,
            adapters: Mutex::new(BTreeMap::new()),
            failing_adapter_paths: Mutex::new(BTreeSet::new()),
        }
    }

    /// Every adapter load takes `took`.
    pub fn with_adapter_load(mut self, took: Duration) -> Self {
        self.adapter_load = took;
        self
    }

    /// Loads of the adapter at `path` fail, as an engine refuses a directory that is not a
    /// PEFT adapter.
    pub fn fail_adapter_path(&self, path: &str) {
        lock(&self.failing_adapter_paths).insert(path.to_string());
    }

    /// The adapters instance `instance`'s engine has loaded.
    pub fn adapters_of(&self, instance: &str) -> Vec<String> {
        lock(&self.adapters)
            .get(instance)
            .map(|s| s.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// The host of `settings` as `capyctl simulate` runs it ([`Decisions::Agent`], every
    /// engine), whose `gpus` and `host_memory` must be set (they replace what a real agent
    /// reads); `timings` by deployment name, `default_timings` for any other. An error only
    /// where they are not set and the machine cannot be read.
    pub fn from_settings(
        settings: HostSettings,
        timings: BTreeMap<String, Timings>,
        default_timings: Timings,
    ) -> Result<Self, AgentError> {
        // `host.gpus` and `host.host_memory` are always set here: the probe is never asked.
        let inventory = inventory(&settings, default_probe().as_ref())?;
        Ok(SimHost {
            decisions: Decisions::Agent,
            inventory,
            settings,
            engines: vec![EngineKind::Vllm, EngineKind::Sglang, EngineKind::Tensorfold],
            timings,
            default_timings,
            ..SimHost::new()
        })
    }

    /// Every operation of a deployment takes `times` (a wake's check is `wake_check` of its
    /// `wake_host_ram`).
    pub fn with_times(mut self, times: Timings) -> Self {
        self.default_timings = times;
        self
    }

    /// The GPUs' memory.
    pub fn with_gpu(mut self, bytes: u64) -> Self {
        for g in &mut self.inventory.gpus {
            g.total_bytes = bytes;
        }
        self
    }

    /// `count` GPUs of the same memory (`with_gpu`) and UUID (`with_gpu_uuid`), indexes 0 to
    /// `count - 1`.
    pub fn with_gpus(mut self, count: u32) -> Self {
        let first = &self.inventory.gpus[0];
        let (bytes, uuid) = (first.total_bytes, first.uuid.clone());
        self.inventory.gpus = (0..count).map(|i| gpu(i, bytes, uuid.as_deref())).collect();
        self
    }

    /// The GPUs' UUID, as its inventory says: the first's is `uuid`, the others' have
    /// `-<index>` added.
    pub fn with_gpu_uuid(mut self, uuid: &str) -> Self {
        for g in &mut self.inventory.gpus {
            *g = gpu(g.index, g.total_bytes, Some(uuid));
        }
        self
    }

    /// Where every started engine answers.
    pub fn with_upstream(mut self, addr: SocketAddr) -> Self {
        self.upstream = addr;
        self
    }

    /// Each `inventory` and `engines` call sleeps `latency` (a sleep even when zero).
    pub fn with_latency(mut self, latency: Duration) -> Self {
        self.latency = Some(latency);
        self
    }

    /// [`SimHost::with_latency`] in real time, to within some 0.1 ms ([`exact_sleep`]):
    /// tokio's timer ends a sleep at its next millisecond tick or later, so a 1 ms call
    /// begun just after a tick takes 2 ms. For benchmarks (the paused clock does not move it).
    pub fn with_exact_latency(mut self, latency: Duration) -> Self {
        self.latency = Some(latency);
        self.exact_latency = true;
        self
    }

    /// Each `inventory` and `engines` call is counted in `calls` while it runs.
    pub fn counting(mut self, calls: Arc<Concurrency>) -> Self {
        self.in_progress = Some(calls);
        self
    }

    /// Keeps no call log and no op log ([`SimHost::calls`] and [`SimHost::ops`] are then
    /// empty): a benchmark's memory figures count no bookkeeping.
    pub fn without_call_log(mut self) -> Self {
        self.calls = None;
        self.ops = None;
        self
    }

    /// Calls `hook` with the instance ID on every `sample`; set once (later hooks are
    /// ignored). A hook set after the host was handed out (it may need the server built on
    /// it) is fine.
    pub fn on_sample(&self, hook: impl Fn(&str) + Send + Sync + 'static) {
        let _ = self.sample_hook.set(Box::new(hook));
    }

    /// Calls `hook` on every `inventory`, before it answers; set once, as
    /// [`SimHost::on_sample`]. (A hook that panics is a host agent's bug, in the caller's task.)
    pub fn on_inventory(&self, hook: impl Fn() + Send + Sync + 'static) {
        let _ = self.inventory_hook.set(Box::new(hook));
    }

    /// From now on `instance`'s samples (taken now) say its engine has `waiting` requests
    /// waiting and none running.
    pub fn set_engine_waiting(&self, instance: &str, waiting: u64) {
        lock(&self.engine_waiting).insert(instance.to_string(), waiting);
    }

    /// The calls so far, as they began: `start <iid>`, `park <iid>`, `wake <iid>`, `stop <iid>`.
    pub fn calls(&self) -> Vec<String> {
        self.calls
            .as_ref()
            .map(|c| lock(c).clone())
            .unwrap_or_default()
    }

    /// Every operation so far, in the order they ended.
    pub fn ops(&self) -> Vec<Op> {
        self.ops
            .as_ref()
            .map(|o| lock(o).clone())
            .unwrap_or_default()
    }

    /// From now on, the starts of the deployment named `name` and the wakes of the instance
    /// with the ID `name` never end by themselves: a stop of their instance ends them.
    pub fn hang(&self, name: &str) {
        lock(&self.hangs).insert(name.to_string());
    }

    /// Operations that begin from now on end again at once.
    pub fn stop_hanging(&self) {
        lock(&self.hangs).clear();
    }

    /// From now on, stops of `instance` fail (after ending a hanging operation of it).
    pub fn fail_stops(&self, instance: &str) {
        lock(&self.failing_stops).insert(instance.to_string());
    }

    /// Stops succeed again.
    pub fn stop_failing(&self) {
        lock(&self.failing_stops).clear();
    }

    /// From now on, parks of `instance` fail (its engine is left as it was).
    pub fn fail_parks(&self, instance: &str) {
        lock(&self.failing_parks).insert(instance.to_string());
    }

    /// The number of GPUs of the host.
    pub fn gpu_count(&self) -> usize {
        self.inventory.gpus.len()
    }

    /// The indices of the GPUs instance `instance` (an instance ID) uses now; empty when it
    /// does not run (or the host keeps no instances).
    pub fn gpus_of_instance(&self, instance: &str) -> Vec<u32> {
        lock(&self.instances)
            .get(instance)
            .map(|i| self.gpus_of(&i.spec))
            .unwrap_or_default()
    }

    fn record(&self, call: String) {
        if let Some(calls) = &self.calls {
            lock(calls).push(call);
        }
    }

    fn timings(&self, name: &str) -> Timings {
        self.timings
            .get(name)
            .copied()
            .unwrap_or(self.default_timings)
    }

    fn unified(&self) -> bool {
        self.inventory.gpus.iter().any(|g| g.unified)
    }

    /// Host RAM left for one more copy: the host's less the copies parked there.
    fn host_room(&self, instances: &BTreeMap<String, SimInstance>) -> u64 {
        let held: u64 = instances
            .values()
            .filter_map(|i| i.parked)
            .map(|p| p.1)
            .sum();
        self.inventory.host_memory.total_bytes.saturating_sub(held)
    }

    /// The indices of the GPUs an engine of `spec` uses: those its `CUDA_VISIBLE_DEVICES`
    /// names (the lifecycle sets it on a host with several GPUs), else every GPU.
    fn gpus_of(&self, spec: &InstanceSpec) -> Vec<u32> {
        let visible = spec.env.get("CUDA_VISIBLE_DEVICES").or_else(|| {
            self.settings
                .engine(spec.engine)
                .env
                .get("CUDA_VISIBLE_DEVICES")
        });
        match self.inventory.gpus_named(visible.map(String::as_str)) {
            Some(named) => named.iter().map(|g| g.index).collect(),
            None => self.inventory.gpus.iter().map(|g| g.index).collect(),
        }
    }

    /// Takes `took` of simulated time (none when zero), logged as `kind` of instance
    /// `instance` of `spec`.
    async fn take(&self, instance: &str, spec: &InstanceSpec, kind: OpKind, took: Duration) {
        let began = Instant::now();
        pause(took).await;
        if let Some(ops) = &self.ops {
            let gpus = self.gpus_of(spec);
            lock(ops).push(Op {
                model: spec.name.clone(),
                instance_id: instance.to_string(),
                gpus,
                kind,
                began,
                ended: Instant::now(),
            });
        }
    }

    /// Hangs when `name`'s operations hang, until `instance` is stopped.
    async fn maybe_hang(
        &self,
        name: &str,
        instance: &str,
        what: &'static str,
    ) -> Result<(), AgentError> {
        if !lock(&self.hangs).contains(name) {
            return Ok(());
        }
        loop {
            let stopped = self.stops.notified();
            if lock(&self.stopped).contains(instance) {
                return Err(AgentError::Cancelled {
                    instance: instance.to_string(),
                    what,
                });
            }
            stopped.await;
        }
    }

    /// A round trip: the latency, counted while it runs.
    async fn round_trip<T>(&self, answer: impl FnOnce() -> T) -> T {
        let trip = async {
            match self.latency {
                Some(latency) if self.exact_latency => exact_sleep(latency).await,
                Some(latency) => tokio::time::sleep(latency).await,
                None => {}
            }
            answer()
        };
        match &self.in_progress {
            Some(calls) => calls.during(trip).await,
            None => trip.await,
        }
    }

    fn gone(instance: &str) -> AgentError {
        AgentError::WrongState {
            instance: instance.to_string(),
            detail: "the simulated host has no such instance".into(),
        }
    }

    /// The spec, choice and copy size of a park of `instance` ([`Decisions::Agent`]).
    fn park_choice(&self, instance: &str) -> Result<(InstanceSpec, ParkChoice, u64), AgentError> {
        let instances = lock(&self.instances);
        let inst = instances
            .get(instance)
            .ok_or_else(|| Self::gone(instance))?;
        let spec = &inst.spec;
        let choice = choose_tier(&tier_input(
            spec,
            self.unified(),
            inst.measurement.weights_bytes(),
            self.host_room(&instances),
            Some(inst.launched),
        ))?;
        let choice = match choice {
            ParkChoice::Park(_) if !inst.launched.may_park => {
                ParkChoice::Stop(NoParkReason::NoRoomToPark)
            }
            c => c,
        };
        let copy = inst.measurement.weights_bytes().unwrap_or(0);
        Ok((spec.clone(), choice, copy))
    }
}

impl HostAgent for SimHost {
    fn inventory(&self) -> BoxFuture<'_, Result<Inventory, AgentError>> {
        Box::pin(self.round_trip(|| {
            if let Some(hook) = self.inventory_hook.get() {
                hook();
            }
            Ok(self.inventory.clone())
        }))
    }

    fn engines(&self) -> BoxFuture<'_, Vec<EngineInfo>> {
        Box::pin(self.round_trip(|| self.engines.iter().map(|e| engine_info(*e, None)).collect()))
    }

    fn measure<'a>(
        &'a self,
        spec: &'a InstanceSpec,
    ) -> BoxFuture<'a, Result<Measurement, AgentError>> {
        Box::pin(async move { Ok(measured(spec)) })
    }

    fn parkability<'a>(
        &'a self,
        spec: &'a InstanceSpec,
    ) -> BoxFuture<'a, Result<ParkChoice, AgentError>> {
        Box::pin(async move {
            match self.decisions {
                Decisions::Declared => Ok(ParkChoice::Park(ParkTier::HostRam)),
                Decisions::Agent => {
                    let instances = lock(&self.instances);
                    choose_tier(&tier_input(
                        spec,
                        self.unified(),
                        measured(spec).weights_bytes(),
                        self.host_room(&instances),
                        None,
                    ))
                }
            }
        })
    }

    fn start<'a>(
        &'a self,
        instance: &'a str,
        spec: &'a InstanceSpec,
    ) -> BoxFuture<'a, Result<StartedInstance, AgentError>> {
        Box::pin(async move {
            self.record(format!("start {instance}"));
            // A fresh engine has no adapters.
            lock(&self.adapters).remove(instance);
            // Starts hang by deployment name.
            self.maybe_hang(&spec.name, instance, "start").await?;
            let measurement = measured(spec);
            let launched = match self.decisions {
                Decisions::Declared => LaunchParking::default(),
                Decisions::Agent => {
                    let instances = lock(&self.instances);
                    launch_parking(&tier_input(
                        spec,
                        self.unified(),
                        measurement.weights_bytes(),
                        self.host_room(&instances),
                        None,
                    ))
                }
            };
            self.take(
                instance,
                spec,
                OpKind::Start,
                self.timings(&spec.name).start,
            )
            .await;
            let bound = match self.decisions {
                Decisions::Declared => MaxRunning {
                    count: Some(32),
                    source: MaxRunningSource::Default,
                },
                Decisions::Agent => {
                    let mut bound = max_running(&MaxRunningInput {
                        engine: spec.engine,
                        declared: spec.max_concurrent_requests,
                        extra_args: &spec.extra_args,
                        host_command: &[],
                        engine_reported: None,
                        hybrid_checkpoint: false,
                        sized_on_host: false,
                    });
                    // SGLang sizes itself at start: the simulation takes the router's bound.
                    bound.count = bound.count.or(Some(32));
                    lock(&self.instances).insert(
                        instance.to_string(),
                        SimInstance {
                            spec: spec.clone(),
                            measurement,
                            launched,
                            parked: None,
                        },
                    );
                    bound
                }
            };
            Ok(StartedInstance {
                instance: instance.to_string(),
                pid: 1,
                port: self.upstream.port(),
                base_url: format!("http://{}", self.upstream),
                version: None,
                measurement,
                first_answer: FirstAnswer::Text {
                    text: "simulated".into(),
                },
                max_running: bound,
                parking: launched,
            })
        })
    }

    fn park<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<ParkResult, AgentError>> {
        Box::pin(async move {
            self.record(format!("park {instance}"));
            if lock(&self.failing_parks).contains(instance) {
                return Err(AgentError::AgentUnreachable {
                    url: "http://gpu-1:9100".into(),
                    detail: "the engine did not answer its sleep call".into(),
                });
            }
            if self.decisions == Decisions::Declared {
                let t = self.default_timings;
                pause(t.park_host_ram).await;
                return Ok(ParkResult::Parked {
                    tier: ParkTier::HostRam,
                    gpu_held: None,
                });
            }
            let (spec, choice, copy) = self.park_choice(instance)?;
            let t = self.timings(&spec.name);
            match choice {
                ParkChoice::Park(tier) => {
                    let (took, held) = match tier {
                        ParkTier::HostRam => (t.park_host_ram, copy),
                        ParkTier::Deep | ParkTier::KvOnly => (t.park_deep, 0),
                    };
                    // The copy's room is taken from the choice on, as the real agent does.
                    if let Some(inst) = lock(&self.instances).get_mut(instance) {
                        inst.parked = Some((tier, held));
                    }
                    self.take(instance, &spec, OpKind::Park, took).await;
                    Ok(ParkResult::Parked {
                        tier,
                        gpu_held: None,
                    })
                }
                ParkChoice::Stop(reason) => {
                    self.take(instance, &spec, OpKind::Stop, t.stop).await;
                    lock(&self.instances).remove(instance);
                    Ok(ParkResult::Stopped { reason })
                }
            }
        })
    }

    fn wake<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<WakeReport, AgentError>> {
        Box::pin(async move {
            self.record(format!("wake {instance}"));
            // Wakes hang by instance ID.
            self.maybe_hang(instance, instance, "wake").await?;
            if self.decisions == Decisions::Declared {
                let t = self.default_timings;
                pause(t.wake_host_ram).await;
                return Ok(WakeReport {
                    outcome: WakeOutcome::Pass,
                    took: t.wake_host_ram,
                    checked: Some(t.wake_check.min(t.wake_host_ram)),
                });
            }
            let (spec, tier) = {
                let instances = lock(&self.instances);
                let inst = instances
                    .get(instance)
                    .ok_or_else(|| Self::gone(instance))?;
                (inst.spec.clone(), inst.parked.map(|p| p.0))
            };
            let t = self.timings(&spec.name);
            let took = match tier {
                Some(ParkTier::HostRam) | None => t.wake_host_ram,
                Some(ParkTier::Deep) => t.wake_deep,
                Some(ParkTier::KvOnly) => t.wake_kv_only,
            };
            self.take(instance, &spec, OpKind::Wake, took).await;
            if let Some(inst) = lock(&self.instances).get_mut(instance) {
                inst.parked = None;
            }
            Ok(WakeReport {
                outcome: WakeOutcome::Pass,
                took,
                checked: Some(t.wake_check.min(took)),
            })
        })
    }

    fn stop<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<(), AgentError>> {
        Box::pin(async move {
            self.record(format!("stop {instance}"));
            lock(&self.stopped).insert(instance.to_string());
            lock(&self.adapters).remove(instance);
            self.stops.notify_waiters();
            if lock(&self.failing_stops).contains(instance) {
                return Err(AgentError::AgentUnreachable {
                    url: "http://gpu-1:9100".into(),
                    detail: "the engine's process group would not die".into(),
                });
            }
            let spec = lock(&self.instances).get(instance).map(|i| i.spec.clone());
            if let Some(spec) = spec {
                self.take(instance, &spec, OpKind::Stop, self.timings(&spec.name).stop)
                    .await;
                lock(&self.instances).remove(instance);
            }
            Ok(())
        })
    }

    fn load_adapter<'a>(
        &'a self,
        instance: &'a str,
        name: &'a str,
        path: &'a str,
    ) -> BoxFuture<'a, Result<(), AgentError>> {
        Box::pin(async move {
            self.record(format!("load_adapter {instance} {name}"));
            pause(self.adapter_load).await;
            if lock(&self.failing_adapter_paths).contains(path) {
                return Err(AgentError::EngineStatus {
                    engine: EngineKind::Vllm,
                    step: "load_lora_adapter",
                    url: format!("{}/v1/load_lora_adapter", self.upstream),
                    status: 400,
                    body: format!("Loading lora {name} failed: no adapter found for {path}"),
                });
            }
            lock(&self.adapters)
                .entry(instance.to_string())
                .or_default()
                .insert(name.to_string());
            Ok(())
        })
    }

    fn unload_adapter<'a>(
        &'a self,
        instance: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<(), AgentError>> {
        Box::pin(async move {
            self.record(format!("unload_adapter {instance} {name}"));
            if let Some(set) = lock(&self.adapters).get_mut(instance) {
                set.remove(name);
            }
            Ok(())
        })
    }

    fn adapters<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<Vec<String>, AgentError>> {
        Box::pin(async move { Ok(self.adapters_of(instance)) })
    }

    fn sample(&self, instance: &str) -> Option<LoadSample> {
        if let Some(hook) = self.sample_hook.get() {
            hook(instance);
        }
        let waiting = *lock(&self.engine_waiting).get(instance)?;
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        Some(LoadSample {
            sampled_at_ms: now_ms,
            took: Duration::ZERO,
            engine: Some(EngineLoad {
                running: Some(0),
                waiting: Some(waiting),
                kv_usage_ppm: Some(0),
            }),
        })
    }

    fn recover(&self) -> BoxFuture<'_, Result<RecoveryReport, AgentError>> {
        Box::pin(async { Ok(RecoveryReport::default()) })
    }
}

/// Waits `d` in real time, to within the wake-up of a thread (some 0.1 ms): one thread, shared
/// by every simulated host, sleeps until the earliest deadline and ends every wait due.
/// tokio's timer rounds each sleep up to its next millisecond tick.
async fn exact_sleep(d: Duration) {
    let (tx, rx) = tokio::sync::oneshot::channel();
    ExactTimer::get().add(std::time::Instant::now() + d, tx);
    let _ = rx.await;
}

/// [`exact_sleep`]'s waits: by deadline (and a sequence number, for equal ones).
type Waits = BTreeMap<(std::time::Instant, u64), tokio::sync::oneshot::Sender<()>>;

/// [`exact_sleep`]'s timer: the next sequence number and the waits.
#[derive(Default)]
struct ExactTimer {
    due: Mutex<(u64, Waits)>,
    changed: std::sync::Condvar,
}

impl ExactTimer {
    /// The one timer, its thread started on first use.
    fn get() -> &'static ExactTimer {
        static TIMER: OnceLock<&'static ExactTimer> = OnceLock::new();
        TIMER.get_or_init(|| {
            let timer: &'static ExactTimer = Box::leak(Box::default());
            std::thread::Builder::new()
                .name("sim-host-timer".into())
                .spawn(|| timer.run())
                .map_or_else(|e| panic!("cannot start the timer's thread: {e}"), drop);
            timer
        })
    }

    fn add(&self, at: std::time::Instant, done: tokio::sync::oneshot::Sender<()>) {
        let mut due = lock(&self.due);
        let seq = due.0;
        due.0 += 1;
        let first = due.1.keys().next().is_none_or(|(next, _)| at < *next);
        due.1.insert((at, seq), done);
        drop(due);
        if first {
            self.changed.notify_one();
        }
    }

    fn run(&self) {
        let mut due = lock(&self.due);
        loop {
            let now = std::time::Instant::now();
            while let Some(e) = due.1.first_entry()
                && e.key().0 <= now
            {
                let _ = e.remove().send(());
            }
            due = match due.1.keys().next() {
                None => self
                    .changed
                    .wait(due)
                    .unwrap_or_else(PoisonError::into_inner),
                Some((next, _)) => {
                    let wait = next.saturating_duration_since(now);
                    self.changed
                        .wait_timeout(due, wait)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                }
            };
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn spec(name: &str) -> InstanceSpec {
        InstanceSpec::new("01KDEP", name, EngineKind::Vllm, "m")
    }

    #[tokio::test(start_paused = true)]
    async fn a_hanging_start_ends_with_a_stop_and_the_calls_are_logged() {
        let host = Arc::new(SimHost::new());
        host.hang("x");
        let starting = {
            let host = host.clone();
            tokio::spawn(async move { host.start("i-0", &spec("x")).await })
        };
        while host.calls().is_empty() {
            tokio::task::yield_now().await;
        }
        assert!(!starting.is_finished());
        host.stop("i-0").await.unwrap();
        let ended = starting.await.unwrap();
        assert!(
            matches!(ended, Err(AgentError::Cancelled { what: "start", .. })),
            "{ended:?}"
        );
        host.fail_stops("i-1");
        assert!(host.stop("i-1").await.is_err());
        host.stop_failing();
        host.stop("i-1").await.unwrap();
        assert_eq!(
            host.calls(),
            ["start i-0", "stop i-0", "stop i-1", "stop i-1"]
        );
    }

    /// The exact latency never ends a call before its time, whatever the order the waits
    /// were begun in (one timer for them all).
    #[tokio::test]
    async fn an_exact_latency_never_ends_early() {
        let calls = Arc::new(Concurrency::default());
        let hosts: Vec<SimHost> = [7, 2, 5, 2]
            .iter()
            .map(|ms| {
                SimHost::new()
                    .with_exact_latency(Duration::from_millis(*ms))
                    .counting(calls.clone())
            })
            .collect();
        let timed = hosts.iter().map(|h| async move {
            let t = std::time::Instant::now();
            h.inventory().await.unwrap();
            t.elapsed()
        });
        let took = futures_util::future::join_all(timed).await;
        for (ms, took) in [7, 2, 5, 2].iter().zip(&took) {
            assert!(*took >= Duration::from_millis(*ms), "{ms} ms: {took:?}");
        }
        assert_eq!(calls.most(), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn inventory_and_engines_take_the_latency_and_are_counted() {
        let calls = Arc::new(Concurrency::default());
        let host = SimHost::new()
            .with_gpu(3 * GIB)
            .with_latency(Duration::from_millis(10))
            .counting(calls.clone());
        let t = tokio::time::Instant::now();
        let (inv, engines) = tokio::join!(host.inventory(), host.engines());
        assert_eq!(t.elapsed(), Duration::from_millis(10));
        assert_eq!(inv.unwrap().gpus[0].total_bytes, 3 * GIB);
        assert_eq!(engines.len(), 1);
        assert_eq!(calls.most(), 2);
        calls.reset_most();
        assert_eq!(calls.most(), 0);
    }
}
