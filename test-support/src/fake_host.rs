//! [`FakeHost`]: one in-process host agent for the lifecycle's tests and the scale benchmark.
//!
//! Its host has one GPU (10 GiB unless [`FakeHost::with_gpu`]) and 64 GiB of host RAM, and
//! runs vLLM. Measurements are the declared resources; engines start, park (in host RAM), wake
//! (verified) and stop at once, every one answering at one address (`127.0.0.1:9` unless
//! [`FakeHost::with_upstream`]). What the tests need besides:
//!
//! - a latency for each `inventory` and `engines` call ([`FakeHost::with_latency`]: a round
//!   trip to a node agent), and a count of such calls in progress shared by several hosts
//!   ([`FakeHost::counting`], [`Concurrency`]);
//! - the calls `start <iid>`, `park <iid>`, `wake <iid>`, `stop <iid>` in order
//!   ([`FakeHost::calls`]; [`FakeHost::without_call_log`] keeps none, for figures of memory);
//! - operations that never end by themselves ([`FakeHost::hang`]): the starts of a deployment
//!   named so, the wakes of an instance so named; a stop of their instance ends them
//!   (`cancelled`), as the real agents do;
//! - stops that fail ([`FakeHost::fail_stops`]): the engine could not be stopped (after ending
//!   a hanging operation of its instance);
//! - a hook called on every `sample` ([`FakeHost::on_sample`]), which answers none, and one
//!   called on every `inventory` ([`FakeHost::on_inventory`]);
//!
//! Mutex poisoning is a test's panic elsewhere: the fake goes on with the data.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use capyctl_node_agent::agent::{
    BoxFuture, ParkResult, RecoveryReport, StartedInstance, WakeReport,
};
use capyctl_node_agent::capability::{EngineInfo, engine_info};
use capyctl_node_agent::inventory::{GpuInfo, HostMemory, Inventory};
use capyctl_node_agent::launch::{MaxRunning, MaxRunningSource};
use capyctl_node_agent::load::LoadSample;
use capyctl_node_agent::measure::{MeasureSource, Measured, Measurement};
use capyctl_node_agent::spec::InstanceSpec;
use capyctl_node_agent::tier::{LaunchParking, ParkChoice, ParkTier};
use capyctl_node_agent::verify::{FirstAnswer, WakeOutcome};
use capyctl_node_agent::{AgentError, HostAgent};
use capyctl_spec::EngineKind;

const GIB: u64 = 1 << 30;

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

/// What [`FakeHost::on_sample`] calls, with the instance ID.
type SampleHook = Box<dyn Fn(&str) + Send + Sync>;

/// What [`FakeHost::on_inventory`] calls.
type InventoryHook = Box<dyn Fn() + Send + Sync>;

/// An in-process host agent whose engines start, park, wake and stop at once (see the
/// module's doc). Build it with [`FakeHost::new`] and the `with_…` methods.
pub struct FakeHost {
    gpu_bytes: u64,
    /// How many GPUs of `gpu_bytes` it has (1 by default).
    gpu_count: u32,
    /// The GPU's UUID in the inventory (none by default).
    gpu_uuid: Option<String>,
    upstream: SocketAddr,
    /// `None`: the inventory and engines calls answer without a sleep.
    latency: Option<Duration>,
    in_progress: Option<Arc<Concurrency>>,
    /// `None`: no call log.
    calls: Option<Mutex<Vec<String>>>,
    hangs: Mutex<BTreeSet<String>>,
    failing_stops: Mutex<BTreeSet<String>>,
    /// The instances stopped so far (what ends their hanging operations).
    stopped: Mutex<BTreeSet<String>>,
    stops: tokio::sync::Notify,
    sample_hook: OnceLock<SampleHook>,
    inventory_hook: OnceLock<InventoryHook>,
    /// Engines whose samples say they have requests waiting ([`FakeHost::set_engine_waiting`]);
    /// the others have no sample.
    engine_waiting: Mutex<std::collections::HashMap<String, u64>>,
    /// How long engine operations take (none by default).
    times: OpTimes,
}

/// How long a [`FakeHost`]'s engine operations take (in tokio's time: virtual under a paused
/// clock), see [`FakeHost::with_times`].
#[derive(Debug, Clone, Copy, Default)]
pub struct OpTimes {
    /// A start.
    pub start: Duration,
    /// A park.
    pub park: Duration,
    /// A wake, before its check.
    pub wake: Duration,
    /// A wake's check (reported as the wake's `checked`).
    pub check: Duration,
}

impl Default for FakeHost {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for FakeHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeHost")
            .field("gpu_bytes", &self.gpu_bytes)
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

/// The declared resources of `spec`, as measured.
fn declared(spec: &InstanceSpec) -> Measurement {
    let declared = |b: Option<u64>| {
        b.map(|bytes| Measured {
            bytes,
            source: MeasureSource::Declared,
        })
    };
    Measurement {
        weights: declared(spec.resources.weights_memory),
        gpu_memory: declared(spec.resources.gpu_memory),
    }
}

impl FakeHost {
    /// One 10 GiB GPU, engines at `127.0.0.1:9`, no latency, the calls logged.
    pub fn new() -> Self {
        FakeHost {
            gpu_bytes: 10 * GIB,
            gpu_count: 1,
            gpu_uuid: None,
            upstream: SocketAddr::from(([127, 0, 0, 1], 9)),
            latency: None,
            in_progress: None,
            calls: Some(Mutex::new(Vec::new())),
            hangs: Mutex::new(BTreeSet::new()),
            failing_stops: Mutex::new(BTreeSet::new()),
            stopped: Mutex::new(BTreeSet::new()),
            stops: tokio::sync::Notify::new(),
            sample_hook: OnceLock::new(),
            inventory_hook: OnceLock::new(),
            engine_waiting: Mutex::new(std::collections::HashMap::new()),
            times: OpTimes::default(),
        }
    }

    /// Starts, parks and wakes take `times` (a wake reports its check's part).
    pub fn with_times(mut self, times: OpTimes) -> Self {
        self.times = times;
        self
    }

    /// The GPU's memory.
    pub fn with_gpu(mut self, bytes: u64) -> Self {
        self.gpu_bytes = bytes;
        self
    }

    /// `count` GPUs of the same memory (`with_gpu`), indexes 0 to `count - 1`.
    pub fn with_gpus(mut self, count: u32) -> Self {
        self.gpu_count = count;
        self
    }

    /// The GPU's UUID, as its inventory says.
    pub fn with_gpu_uuid(mut self, uuid: &str) -> Self {
        self.gpu_uuid = Some(uuid.to_string());
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

    /// Each `inventory` and `engines` call is counted in `calls` while it runs.
    pub fn counting(mut self, calls: Arc<Concurrency>) -> Self {
        self.in_progress = Some(calls);
        self
    }

    /// Keeps no call log ([`FakeHost::calls`] is then empty): a benchmark's memory figures
    /// count no test bookkeeping.
    pub fn without_call_log(mut self) -> Self {
        self.calls = None;
        self
    }

    /// Calls `hook` with the instance ID on every `sample`; set once (later hooks are
    /// ignored). A hook set after the host was handed out (it may need the server built on
    /// it) is fine.
    pub fn on_sample(&self, hook: impl Fn(&str) + Send + Sync + 'static) {
        let _ = self.sample_hook.set(Box::new(hook));
    }

    /// Calls `hook` on every `inventory`, before it answers; set once, as
    /// [`FakeHost::on_sample`]. (A hook that panics is a host agent's bug, in the caller's task.)
    pub fn on_inventory(&self, hook: impl Fn() + Send + Sync + 'static) {
        let _ = self.inventory_hook.set(Box::new(hook));
    }

    /// From now on `instance`'s samples (taken now) say its engine has `waiting` requests
    /// waiting and none running.
    pub fn set_engine_waiting(&self, instance: &str, waiting: u64) {
        self.engine_waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(instance.to_string(), waiting);
    }

    /// The calls so far: `start <iid>`, `park <iid>`, `wake <iid>`, `stop <iid>`.
    pub fn calls(&self) -> Vec<String> {
        self.calls
            .as_ref()
            .map(|c| lock(c).clone())
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

    fn record(&self, call: String) {
        if let Some(calls) = &self.calls {
            lock(calls).push(call);
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
            if let Some(latency) = self.latency {
                tokio::time::sleep(latency).await;
            }
            answer()
        };
        match &self.in_progress {
            Some(calls) => calls.during(trip).await,
            None => trip.await,
        }
    }
}

impl HostAgent for FakeHost {
    fn inventory(&self) -> BoxFuture<'_, Result<Inventory, AgentError>> {
        Box::pin(self.round_trip(|| {
            if let Some(hook) = self.inventory_hook.get() {
                hook();
            }
            Ok(Inventory {
                gpus: (0..self.gpu_count)
                    .map(|index| GpuInfo {
                        index,
                        // The first GPU's is the UUID given; the others' have `-<index>` added.
                        uuid: self.gpu_uuid.as_ref().map(|u| match index {
                            0 => u.clone(),
                            _ => format!("{u}-{index}"),
                        }),
                        name: None,
                        total_bytes: self.gpu_bytes,
                        free_bytes: None,
                        unified: false,
                    })
                    .collect(),
                gpus_overridden: true,
                host_memory: HostMemory {
                    total_bytes: 64 * GIB,
                    available_bytes: 64 * GIB,
                    overridden: true,
                },
            })
        }))
    }

    fn engines(&self) -> BoxFuture<'_, Vec<EngineInfo>> {
        Box::pin(self.round_trip(|| vec![engine_info(EngineKind::Vllm, None)]))
    }

    fn measure<'a>(
        &'a self,
        spec: &'a InstanceSpec,
    ) -> BoxFuture<'a, Result<Measurement, AgentError>> {
        Box::pin(async move { Ok(declared(spec)) })
    }

    fn parkability<'a>(
        &'a self,
        _: &'a InstanceSpec,
    ) -> BoxFuture<'a, Result<ParkChoice, AgentError>> {
        Box::pin(async { Ok(ParkChoice::Park(ParkTier::HostRam)) })
    }

    fn start<'a>(
        &'a self,
        instance: &'a str,
        spec: &'a InstanceSpec,
    ) -> BoxFuture<'a, Result<StartedInstance, AgentError>> {
        Box::pin(async move {
            self.record(format!("start {instance}"));
            // Starts hang by deployment name.
            self.maybe_hang(&spec.name, instance, "start").await?;
            pause(self.times.start).await;
            Ok(StartedInstance {
                instance: instance.to_string(),
                pid: 1,
                port: self.upstream.port(),
                base_url: format!("http://{}", self.upstream),
                version: None,
                measurement: declared(spec),
                first_answer: FirstAnswer::Text { text: "x".into() },
                max_running: MaxRunning {
                    count: Some(32),
                    source: MaxRunningSource::Default,
                },
                parking: LaunchParking::default(),
            })
        })
    }

    fn park<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<ParkResult, AgentError>> {
        Box::pin(async move {
            self.record(format!("park {instance}"));
            pause(self.times.park).await;
            Ok(ParkResult::Parked {
                tier: ParkTier::HostRam,
                gpu_held: None,
            })
        })
    }

    fn wake<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<WakeReport, AgentError>> {
        Box::pin(async move {
            self.record(format!("wake {instance}"));
            // Wakes hang by instance ID.
            self.maybe_hang(instance, instance, "wake").await?;
            let OpTimes { wake, check, .. } = self.times;
            pause(wake + check).await;
            Ok(WakeReport {
                outcome: WakeOutcome::Pass,
                took: wake + check,
                checked: Some(check),
            })
        })
    }

    fn stop<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<(), AgentError>> {
        Box::pin(async move {
            self.record(format!("stop {instance}"));
            lock(&self.stopped).insert(instance.to_string());
            self.stops.notify_waiters();
            if lock(&self.failing_stops).contains(instance) {
                return Err(AgentError::AgentUnreachable {
                    url: "http://gpu-1:9100".into(),
                    detail: "the engine's process group would not die".into(),
                });
            }
            Ok(())
        })
    }

    fn sample(&self, instance: &str) -> Option<LoadSample> {
        if let Some(hook) = self.sample_hook.get() {
            hook(instance);
        }
        let waiting = *self
            .engine_waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(instance)?;
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        Some(LoadSample {
            sampled_at_ms: now_ms,
            took: Duration::ZERO,
            engine: Some(capyctl_node_agent::load::EngineLoad {
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn spec(name: &str) -> InstanceSpec {
        InstanceSpec::new("01KDEP", name, EngineKind::Vllm, "m")
    }

    #[tokio::test(start_paused = true)]
    async fn a_hanging_start_ends_with_a_stop_and_the_calls_are_logged() {
        let host = Arc::new(FakeHost::new());
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

    #[tokio::test(start_paused = true)]
    async fn inventory_and_engines_take_the_latency_and_are_counted() {
        let calls = Arc::new(Concurrency::default());
        let host = FakeHost::new()
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
