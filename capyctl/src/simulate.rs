//! `capyctl simulate`: replays a request trace through the production switching code under a
//! virtual clock.
//!
//! What runs is what `capyctl start standalone` runs: the lifecycle ([`Core`], its owner task,
//! placement, victims, idle timers) and the router's coordinator (admission, waves, windows,
//! drains), assembled by the same functions ([`lifecycle_config`], [`router_config`],
//! [`assemble`]) from the same document and overrides, without the listener. Only the host agent is simulated ([`SimHost`]: park, wake,
//! start and stop take time and start nothing) and the engines' answers (a request holds its
//! permit for its duration). The runtime is a current-thread tokio runtime with paused time,
//! which jumps to the next timer whenever every task waits: an hour of trace runs in seconds.
//!
//! A simulated request does what the listener does (`router/src/proxy`): it resolves its model,
//! asks the coordinator for a permit with its deadline (arrival + `request_deadline`), holds
//! the permit for its duration and drops it. Its wait is its admission less its arrival; an
//! admission refused is an error with the product page's code.
//!
//! The simulation begins, unless `--cold`, with every deployment of the document started in
//! order with `--evict` (the last ones ready, the others parked or stopped as room allows: a
//! server that has run a while); time 0 of the trace is then.
//!
//! Engine times, per model (`simulate.models.<name>.<key>` wins over `simulate.<key>`):
//!
//! | key | default |
//! |---|---|
//! | `park` | host RAM: weights / `simulate.host_bandwidth` (16GiB/s); deep or KV only: 0 s |
//! | `wake` | host RAM: weights / `host_bandwidth`; deep: weights / `simulate.disk_bandwidth` (2GiB/s); KV only: 0 s; plus `wake_check` |
//! | `wake_check` | the check prompt and the warm-up: 17 tokens at `token_rate` when that is known, else 0 s |
//! | `start` | 30s |
//! | `stop` | 1s |
//! | `token_rate` | none: a trace with `output_tokens` needs it (tokens per second per request) |
//!
//! With `--measured`, each model's times are those its switches took on a running server: the
//! median of each phase of its switch records ([`measured_sets`]; `--set` still wins).
//!
//! The weights are the deployment's `resources.weights_memory`; a deployment without
//! `resources` is taken as 90% of the largest GPU with 16GiB of weights. Without `host.gpus` the
//! host has one 80GiB GPU, without `host.host_memory` 256GiB of RAM. Without `--file`, each
//! model the trace names is a vLLM deployment of that name without `resources`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use capyctl_interfaces::router::Lifecycle;
use capyctl_lifecycle::api::ManagementApi;
use capyctl_lifecycle::metrics::Metrics;
use capyctl_lifecycle::store::MemoryStore;
use capyctl_lifecycle::{Core, instance_id_at};
use capyctl_router::admission::{Admission, Permit};
use capyctl_server::assembly::assemble;
use capyctl_server::standalone::{lifecycle_config, router_config};
use capyctl_spec::api::StartRequest;
use capyctl_spec::documents::{self, DeploymentDoc, ResourcesDoc};
use capyctl_spec::overrides::Overrides;
use capyctl_spec::settings::{GpuOverride, StandaloneConfig};
use capyctl_spec::units::{ByteSize, DurationSetting};
use serde::Serialize;
use tokio::time::Instant;

use crate::trace::{self, Size, TraceRequest};
use capyctl_node_agent::sim_host::{Op, OpKind, SimHost, Timings};

const GIB: u64 = 1 << 30;

/// The index of `op`'s instance within its deployment (0 unless it has `replicas`).
pub(crate) fn instance_index(op: &Op) -> u32 {
    capyctl_lifecycle::split_instance_id(&op.instance_id).map_or(0, |(_, i)| i)
}
/// The check prompt's tokens and the warm-up's one, run after every wake.
const CHECK_TOKENS: f64 = capyctl_node_agent::verify::CHECK_MAX_TOKENS as f64 + 1.0;

/// `x` seconds, at most ten years (an engine time or a request's length from a rate: a
/// tiny rate must not overflow the virtual clock).
fn secs(x: f64) -> Duration {
    const MAX: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
    Duration::try_from_secs_f64(x).map_or(MAX, |d| d.min(MAX))
}

/// A request "waited" (the report's WAITED columns) when it waited at least this long.
pub const WAITED_AT_LEAST: Duration = Duration::from_millis(100);

/// What `capyctl simulate` was asked.
#[derive(Debug, Clone)]
pub struct SimulateArgs {
    /// The trace.
    pub trace: PathBuf,
    /// The standalone document.
    pub file: Option<PathBuf>,
    /// `--set` overrides: document keys, and `simulate.…` keys.
    pub set: Vec<String>,
    /// `--compare key=v1,v2,…`.
    pub compare: Option<String>,
    /// `--svg FILE`.
    pub svg: Option<PathBuf>,
    /// `--json`.
    pub json: bool,
    /// `--cold`: every deployment stopped at time 0.
    pub cold: bool,
}

/// The engine times one model's settings give (each `None`: the default).
#[derive(Debug, Clone, Default, PartialEq)]
struct EngineKeys {
    park: Option<Duration>,
    wake: Option<Duration>,
    wake_check: Option<Duration>,
    start: Option<Duration>,
    stop: Option<Duration>,
    token_rate: Option<f64>,
}

/// `simulate.adapter_load` when unset: a LoRA adapter's load into a running engine, which takes
/// milliseconds (a measured one is in the `adapter_load` phase of `capyctl switches`).
const DEFAULT_ADAPTER_LOAD: Duration = Duration::from_millis(50);

/// The `simulate.…` settings.
#[derive(Debug, Clone, PartialEq)]
struct SimSettings {
    host_bandwidth: u64,
    disk_bandwidth: u64,
    /// How long a LoRA adapter's load into its base takes (`simulate.adapter_load`).
    adapter_load: Duration,
    all: EngineKeys,
    models: BTreeMap<String, EngineKeys>,
}

impl Default for SimSettings {
    fn default() -> Self {
        SimSettings {
            host_bandwidth: 16 * GIB,
            disk_bandwidth: 2 * GIB,
            adapter_load: DEFAULT_ADAPTER_LOAD,
            all: EngineKeys::default(),
            models: BTreeMap::new(),
        }
    }
}

impl SimSettings {
    /// Applies one `simulate.…=value` (`key` without `simulate.`).
    fn apply(&mut self, key: &str, value: &str, source: &str) -> Result<(), String> {
        let bad = |what: String| format!("{source}: {what}");
        let duration = |v: &str| {
            v.trim()
                .parse::<DurationSetting>()
                .map(Duration::from)
                .map_err(|e| bad(e.to_string()))
        };
        let bandwidth = |v: &str| {
            let v = v.trim();
            let v = v.strip_suffix("/s").unwrap_or(v);
            match v.parse::<ByteSize>() {
                Ok(b) if b.as_u64() > 0 => Ok(b.as_u64()),
                Ok(_) => Err(bad("a bandwidth must be above 0".into())),
                Err(e) => Err(bad(e.to_string())),
            }
        };
        let parts: Vec<&str> = key.split('.').collect();
        let (keys, leaf) = match parts.as_slice() {
            ["host_bandwidth"] => {
                self.host_bandwidth = bandwidth(value)?;
                return Ok(());
            }
            ["disk_bandwidth"] => {
                self.disk_bandwidth = bandwidth(value)?;
                return Ok(());
            }
            ["adapter_load"] => {
                self.adapter_load = duration(value)?;
                return Ok(());
            }
            [leaf] => (&mut self.all, *leaf),
            ["models", model, leaf] => {
                (self.models.entry((*model).to_string()).or_default(), *leaf)
            }
            _ => {
                return Err(bad(format!(
                    "unknown key simulate.{key}; expected simulate.host_bandwidth, simulate.disk_bandwidth, simulate.adapter_load, simulate.<park|wake|wake_check|start|stop|token_rate> or simulate.models.<name>.<park|wake|wake_check|start|stop|token_rate>"
                )));
            }
        };
        match leaf {
            "park" => keys.park = Some(duration(value)?),
            "wake" => keys.wake = Some(duration(value)?),
            "wake_check" => keys.wake_check = Some(duration(value)?),
            "start" => keys.start = Some(duration(value)?),
            "stop" => keys.stop = Some(duration(value)?),
            "token_rate" => match value.trim().parse::<f64>() {
                Ok(r) if r.is_finite() && r > 0.0 => keys.token_rate = Some(r),
                _ => {
                    return Err(bad(format!(
                        "`{value}` is not a token rate: a number of tokens per second above 0"
                    )));
                }
            },
            other => {
                return Err(bad(format!(
                    "unknown key `{other}`; expected park, wake, wake_check, start, stop or token_rate"
                )));
            }
        }
        Ok(())
    }

    /// The token rate of `model`, if any.
    fn token_rate(&self, model: &str) -> Option<f64> {
        self.models
            .get(model)
            .and_then(|k| k.token_rate)
            .or(self.all.token_rate)
    }

    /// The engine times of a deployment.
    fn timings(&self, doc: &DeploymentDoc) -> Timings {
        let weights = doc
            .resources
            .and_then(|r| r.weights_memory)
            .map_or(16 * GIB, ByteSize::as_u64);
        self.timings_of(&doc.name, weights)
    }

    /// The engine times of model `name` with `weights` bytes of weights.
    fn timings_of(&self, name: &str, weights: u64) -> Timings {
        let own = self.models.get(name);
        let pick = |f: fn(&EngineKeys) -> Option<Duration>| own.and_then(f).or(f(&self.all));
        let copy = |bandwidth: u64| secs(weights as f64 / bandwidth as f64);
        let check = pick(|k| k.wake_check).unwrap_or_else(|| {
            self.token_rate(name)
                .map_or(Duration::ZERO, |r| secs(CHECK_TOKENS / r))
        });
        let wake = pick(|k| k.wake);
        let park = pick(|k| k.park);
        Timings {
            start: pick(|k| k.start).unwrap_or(Duration::from_secs(30)),
            park_host_ram: park.unwrap_or_else(|| copy(self.host_bandwidth)),
            park_deep: park.unwrap_or(Duration::ZERO),
            wake_host_ram: wake.unwrap_or_else(|| copy(self.host_bandwidth) + check),
            wake_deep: wake.unwrap_or_else(|| copy(self.disk_bandwidth) + check),
            wake_kv_only: wake.unwrap_or(check),
            wake_check: check,
            stop: pick(|k| k.stop).unwrap_or(Duration::from_secs(1)),
        }
    }
}

/// One run's inputs: the resolved document and the simulation settings.
struct Setup {
    config: StandaloneConfig,
    sim: SimSettings,
}

/// Splits `--set` into document overrides and `simulate.…` settings, and resolves both.
fn setup(
    file: Option<&Path>,
    set: &[String],
    trace_name: &str,
    requests: &[TraceRequest],
) -> Result<Setup, String> {
    let mut doc_sets = Vec::new();
    let mut sim = SimSettings::default();
    for s in set {
        match s.split_once('=') {
            Some((k, v)) if k.trim().starts_with("simulate.") => {
                sim.apply(&k.trim()["simulate.".len()..], v, &format!("--set {s}"))?;
            }
            _ => doc_sets.push(s.clone()),
        }
    }
    let overrides =
        Overrides::from_args_and_env(doc_sets, std::env::vars()).map_err(|e| e.to_string())?;
    let mut config = match file {
        Some(path) => documents::load_standalone_file(path, &overrides),
        None => documents::standalone_from_overrides(&overrides),
    }
    .map_err(|e| e.to_string())?;
    let gpus = config.host.gpus.get_or_insert_with(|| {
        vec![GpuOverride {
            memory: 80 * GIB,
            unified: false,
            uuid: None,
        }]
    });
    let largest = gpus.iter().map(|g| g.memory).max().unwrap_or(80 * GIB);
    config.host.host_memory.get_or_insert(256 * GIB);
    if file.is_none() {
        let mut names: Vec<&str> = requests.iter().map(|r| r.model.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        for name in names {
            let text = format!("name: {name}\nengine: vllm\nmodel: {name}\n");
            let doc = documents::parse_deployment_str(&format!("the trace's model {name}"), &text)
                .map_err(|e| e.to_string())?;
            config.deployments.push(doc);
        }
    }
    // An adapter holds no memory of its own (its base does).
    for d in config
        .deployments
        .iter_mut()
        .filter(|d| d.adapter.is_none())
    {
        let r = d.resources.get_or_insert_with(ResourcesDoc::default);
        if r.gpu_memory.is_none() {
            r.gpu_memory = Some(ByteSize::bytes(largest / 10 * 9));
        }
        if r.weights_memory.is_none() {
            let gpu = r.gpu_memory.map_or(16 * GIB, ByteSize::as_u64);
            r.weights_memory = Some(ByteSize::bytes(gpu.min(16 * GIB)));
        }
    }
    // A request sized in tokens needs its model's rate.
    for r in requests {
        if let Size::Tokens(_) = r.size
            && sim.token_rate(&r.model).is_none()
        {
            return Err(format!(
                "{trace_name}:{}: `output_tokens` needs the engine's token rate: --set simulate.token_rate=N (tokens per second per request) or simulate.models.{}.token_rate=N",
                r.line, r.model
            ));
        }
    }
    Ok(Setup { config, sim })
}

/// How one simulated request went.
#[derive(Debug, Clone)]
pub struct Served {
    /// Its model.
    pub model: String,
    /// When it arrived.
    pub arrival: Instant,
    /// When it was admitted; `None` when refused.
    pub admitted: Option<Instant>,
    /// When it ended (its refusal, or its permit dropped).
    pub ended: Instant,
    /// The refusal's code.
    pub error: Option<&'static str>,
    /// The instance that served it (its index within the deployment); `None` when refused.
    pub instance: Option<u32>,
    /// The indices of the GPUs that instance used.
    pub gpus: Vec<u32>,
}

/// Everything one run produced.
#[derive(Debug)]
pub struct Run {
    /// Time 0 of the trace.
    pub t0: Instant,
    /// When the last request ended.
    pub end: Instant,
    /// Every request, in trace order.
    pub requests: Vec<Served>,
    /// Every engine operation from time 0 on (those under way then included).
    pub ops: Vec<Op>,
    /// The deployments, in document order.
    pub models: Vec<String>,
    /// The host's GPUs.
    pub gpu_count: usize,
    /// What went wrong before time 0 (a deployment that could not be started).
    pub notes: Vec<String>,
}

/// Runs the trace once on a fresh paused runtime.
fn simulate_once(setup: Setup, requests: &[TraceRequest], cold: bool) -> Result<Run, String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    rt.block_on(simulate_in(setup, requests, cold))
}

async fn simulate_in(setup: Setup, requests: &[TraceRequest], cold: bool) -> Result<Run, String> {
    let Setup { mut config, sim } = setup;
    let timings: BTreeMap<String, Timings> = config
        .deployments
        .iter()
        .map(|d| (d.name.clone(), sim.timings(d)))
        .collect();
    let host = Arc::new(
        SimHost::from_settings(
            capyctl_node_agent::spec::HostSettings::from(&config.host),
            timings,
            sim.timings_of("", 16 * GIB),
        )
        .map_err(|e| format!("the simulated host: {e}"))?
        .with_adapter_load(sim.adapter_load),
    );
    // Adapters are not started: their requests load them into their base.
    let models: Vec<String> = config
        .deployments
        .iter()
        .filter(|d| d.adapter.is_none())
        .map(|d| d.name.clone())
        .collect();
    let deployments = std::mem::take(&mut config.deployments);
    let metrics = Arc::new(Metrics::new());
    let server = Core::open(
        host.clone(),
        Arc::new(MemoryStore::new([])),
        lifecycle_config(&config, metrics),
    )
    .await
    .map_err(|e| format!("the simulated server did not open: {e}"))?;
    let router = assemble(&server, server.clone(), router_config(&config), None)
        .await
        .router;
    server
        .deploy_all(deployments)
        .await
        .map_err(|(name, e)| format!("deployment {name}: {}", e.message()))?;
    let mut notes = Vec::new();
    if !cold {
        for name in &models {
            let started = server
                .start(
                    name,
                    StartRequest {
                        evict: true,
                        wait: true,
                    },
                )
                .await;
            if let Err(e) = started {
                notes.push(format!(
                    "{name} could not be started before the trace: {}",
                    e.message()
                ));
            }
        }
    }
    let t0 = Instant::now();
    let deadline_after = config.host.queue.request_deadline;
    let mut tasks = Vec::with_capacity(requests.len());
    for r in requests {
        let duration = match r.size {
            Size::Duration(d) => d,
            Size::Tokens(n) => {
                let rate = sim.token_rate(&r.model).unwrap_or(1.0);
                secs(n as f64 / rate)
            }
        };
        let model = r.model.clone();
        let at = t0 + r.at;
        let router = router.clone();
        let host = host.clone();
        let server = server.clone();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(at).await;
            let arrival = Instant::now();
            let refused = |error: &'static str| Served {
                model: model.clone(),
                arrival,
                admitted: None,
                ended: Instant::now(),
                error: Some(error),
                instance: None,
                gpus: Vec::new(),
            };
            let Some(deployment) = router.resolve(&model) else {
                return refused("model_not_found");
            };
            let adapter = server.adapter(&model);
            match router.admit(deployment, arrival + deadline_after).await {
                Ok(permit) => {
                    // As the listener does: a request for an adapter loads it first.
                    let _lease = match &adapter {
                        Some(route) => match server
                            .acquire_adapter(
                                &permit.upstream().key,
                                route,
                                arrival + deadline_after,
                            )
                            .await
                        {
                            Ok(lease) => Some(lease),
                            Err(e) => return refused(e.code()),
                        },
                        None => None,
                    };
                    let admitted = Instant::now();
                    let key = &permit.upstream().key;
                    let (instance, gpus) = (
                        key.index,
                        host.gpus_of_instance(&instance_id_at(&key.deployment, key.index)),
                    );
                    permit.first_output();
                    tokio::time::sleep(duration).await;
                    drop(permit);
                    Served {
                        model,
                        arrival,
                        admitted: Some(admitted),
                        ended: Instant::now(),
                        error: None,
                        instance: Some(instance),
                        gpus,
                    }
                }
                Err(e) => refused(e.code()),
            }
        }));
    }
    let mut served = Vec::with_capacity(tasks.len());
    for t in tasks {
        served.push(
            t.await
                .map_err(|e| format!("a simulated request failed: {e}"))?,
        );
    }
    let end = served.iter().map(|s| s.ended).max().unwrap_or(t0);
    server.close();
    let ops = host.ops().into_iter().filter(|o| o.ended > t0).collect();
    Ok(Run {
        t0,
        end,
        requests: served,
        ops,
        models,
        gpu_count: host.gpu_count(),
        notes,
    })
}

// ----- the report -----

/// One model's figures.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ModelReport {
    /// The model.
    pub model: String,
    /// Requests of the trace for it.
    pub requests: usize,
    /// Requests admitted (served).
    pub served: usize,
    /// Waits of the admitted requests, in milliseconds: median.
    pub wait_p50_ms: u64,
    /// 99th percentile.
    pub wait_p99_ms: u64,
    /// Mean.
    pub wait_mean_ms: u64,
    /// Admitted requests that waited at least 100 ms.
    pub waited: usize,
    /// Their median wait.
    pub waited_p50_ms: u64,
    /// Their mean wait.
    pub waited_mean_ms: u64,
    /// Refusals by code.
    pub errors: BTreeMap<String, usize>,
    /// Times it was woken or started during the trace.
    pub switches: usize,
}

/// Shares of GPU time from time 0 to the last request's end: of one GPU, or of all the host's
/// (their mean).
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct GpuShares {
    /// Some request running on it, no engine operation under way on it.
    pub serving: f64,
    /// An engine operation (park, wake, start, stop) under way on it.
    pub switching: f64,
    /// Neither.
    pub idle: f64,
}

/// One GPU's shares.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct GpuShare {
    /// Its index in `host.gpus`.
    pub gpu: u32,
    /// Its shares.
    #[serde(flatten)]
    pub shares: GpuShares,
}

/// One run's report.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Report {
    /// `--compare`'s `key=value`; `None` without `--compare`.
    pub setting: Option<String>,
    /// From time 0 to the last request's end, in milliseconds of simulated time.
    pub span_ms: u64,
    /// Per model, in document order (then models the document does not have).
    pub models: Vec<ModelReport>,
    /// The GPU time.
    pub gpu: GpuShares,
    /// Each GPU's.
    pub gpus: Vec<GpuShare>,
    /// What went wrong before time 0.
    pub notes: Vec<String>,
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The nearest-rank percentile `p` (0..1] of sorted `v`.
fn percentile(v: &[Duration], p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

fn mean(v: &[Duration]) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.iter().sum::<Duration>() / u32::try_from(v.len()).unwrap_or(u32::MAX)
}

/// Merged intervals' total length.
fn union_len(mut spans: Vec<(Duration, Duration)>) -> Duration {
    spans.sort();
    let mut total = Duration::ZERO;
    let mut current: Option<(Duration, Duration)> = None;
    for (a, b) in spans {
        match &mut current {
            Some((_, end)) if a <= *end => *end = (*end).max(b),
            _ => {
                if let Some((s, e)) = current.take() {
                    total += e - s;
                }
                current = Some((a, b));
            }
        }
    }
    if let Some((s, e)) = current {
        total += e - s;
    }
    total
}

impl Run {
    fn rel(&self, at: Instant) -> Duration {
        at.saturating_duration_since(self.t0)
    }

    /// The engine operations on GPU `gpu` as spans from time 0.
    fn op_spans(&self, gpu: u32) -> Vec<(Duration, Duration)> {
        self.ops
            .iter()
            .filter(|o| o.gpus.contains(&gpu))
            .map(|o| (self.rel(o.began), self.rel(o.ended)))
            .collect()
    }

    /// The service of the requests admitted on GPU `gpu` as spans from time 0.
    fn serving_spans(&self, gpu: u32) -> Vec<(Duration, Duration)> {
        self.requests
            .iter()
            .filter(|r| r.gpus.contains(&gpu))
            .filter_map(|r| Some((self.rel(r.admitted?), self.rel(r.ended))))
            .collect()
    }

    /// GPU `gpu`'s shares of `span`.
    fn gpu_shares(&self, gpu: u32, span: Duration) -> GpuShares {
        let ops = self.op_spans(gpu);
        let switching = union_len(ops.clone());
        let mut both = ops;
        both.extend(self.serving_spans(gpu));
        let busy = union_len(both);
        let share = |d: Duration| {
            if span.is_zero() {
                0.0
            } else {
                d.as_secs_f64() / span.as_secs_f64()
            }
        };
        GpuShares {
            // Serving only: what serving adds to the union beyond the switching.
            serving: share(busy.saturating_sub(switching)),
            switching: share(switching),
            idle: share(span.saturating_sub(busy)),
        }
    }

    /// The deployments in document order, then any other model the trace asked for.
    pub fn model_names(&self) -> Vec<String> {
        let mut names = self.models.clone();
        for r in &self.requests {
            if !names.contains(&r.model) {
                names.push(r.model.clone());
            }
        }
        names
    }

    /// The report (see [`Report`]).
    pub fn report(&self, setting: Option<String>) -> Report {
        let names = self.model_names();
        let models = names
            .iter()
            .filter(|n| self.requests.iter().any(|r| &r.model == *n))
            .map(|name| {
                let of: Vec<&Served> = self.requests.iter().filter(|r| &r.model == name).collect();
                let mut waits: Vec<Duration> = of
                    .iter()
                    .filter_map(|r| Some(r.admitted?.saturating_duration_since(r.arrival)))
                    .collect();
                waits.sort();
                let waited: Vec<Duration> = waits
                    .iter()
                    .copied()
                    .filter(|w| *w >= WAITED_AT_LEAST)
                    .collect();
                let mut errors = BTreeMap::new();
                for r in &of {
                    if let Some(code) = r.error {
                        *errors.entry(code.to_string()).or_insert(0) += 1;
                    }
                }
                ModelReport {
                    model: name.clone(),
                    requests: of.len(),
                    served: waits.len(),
                    wait_p50_ms: ms(percentile(&waits, 0.5)),
                    wait_p99_ms: ms(percentile(&waits, 0.99)),
                    wait_mean_ms: ms(mean(&waits)),
                    waited: waited.len(),
                    waited_p50_ms: ms(percentile(&waited, 0.5)),
                    waited_mean_ms: ms(mean(&waited)),
                    errors,
                    switches: self
                        .ops
                        .iter()
                        .filter(|o| {
                            &o.model == name
                                && matches!(o.kind, OpKind::Wake | OpKind::Start)
                                && o.began >= self.t0
                        })
                        .count(),
                }
            })
            .collect();
        let span = self.rel(self.end);
        let gpus: Vec<GpuShare> = (0..self.gpu_count)
            .filter_map(|g| u32::try_from(g).ok())
            .map(|gpu| GpuShare {
                gpu,
                shares: self.gpu_shares(gpu, span),
            })
            .collect();
        let mean = |f: fn(&GpuShares) -> f64| {
            gpus.iter().map(|g| f(&g.shares)).sum::<f64>() / gpus.len().max(1) as f64
        };
        Report {
            setting,
            span_ms: ms(span),
            models,
            gpu: GpuShares {
                serving: mean(|s| s.serving),
                switching: mean(|s| s.switching),
                idle: mean(|s| s.idle),
            },
            gpus,
            notes: self.notes.clone(),
        }
    }
}

/// A wait as people read it: `0ms`, `850ms`, `5.9s`, `2m05s`.
fn human(ms: u64) -> String {
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms < 60_000 {
        format!("{:.1}s", ms as f64 / 1000.0)
    } else {
        format!("{}m{:02}s", ms / 60_000, (ms % 60_000) / 1000)
    }
}

fn pct(x: f64) -> String {
    format!("{:.0}%", x * 100.0)
}

/// Left-aligned columns, three spaces apart.
fn table(rows: &[Vec<String>]) -> String {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for r in rows {
        let mut line = String::new();
        for (c, cell) in r.iter().enumerate() {
            line.push_str(cell);
            if c + 1 < r.len() {
                line.push_str(&" ".repeat(widths[c] - cell.chars().count() + 3));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// A compared setting as a column shows it: its key's last segment and the value
/// (`admission_window=5s`).
fn short(setting: Option<&str>) -> String {
    let s = setting.unwrap_or_default();
    match s.split_once('=') {
        Some((key, value)) => format!("{}={value}", key.rsplit('.').next().unwrap_or(key)),
        None => s.to_string(),
    }
}

/// The reports as text: one row per model (and compared value), then the GPU time.
pub fn render(reports: &[Report]) -> String {
    let compare = reports.iter().any(|r| r.setting.is_some());
    let mut rows = Vec::new();
    let mut head: Vec<String> = Vec::new();
    if compare {
        head.push("SETTING".into());
    }
    head.extend(
        [
            "MODEL",
            "REQUESTS",
            "WAIT P50",
            "WAIT P99",
            "WAITED",
            "WAITED P50",
            "ERRORS",
            "SWITCHES",
        ]
        .map(String::from),
    );
    rows.push(head);
    for r in reports {
        for m in &r.models {
            let mut row = Vec::new();
            if compare {
                row.push(short(r.setting.as_deref()));
            }
            let errors = if m.errors.is_empty() {
                "-".to_string()
            } else {
                m.errors
                    .iter()
                    .map(|(c, n)| format!("{c}:{n}"))
                    .collect::<Vec<_>>()
                    .join(",")
            };
            row.extend([
                m.model.clone(),
                m.requests.to_string(),
                human(m.wait_p50_ms),
                human(m.wait_p99_ms),
                m.waited.to_string(),
                if m.waited == 0 {
                    "-".into()
                } else {
                    human(m.waited_p50_ms)
                },
                errors,
                m.switches.to_string(),
            ]);
            rows.push(row);
        }
    }
    let mut out = table(&rows);
    out.push('\n');
    let mut rows = Vec::new();
    let mut head: Vec<String> = Vec::new();
    if compare {
        head.push("SETTING".into());
    }
    // With several GPUs, a row for each and one for all of them (their mean).
    let several = reports.iter().any(|r| r.gpus.len() > 1);
    if several {
        head.extend(["SPAN", "GPU", "SERVING", "SWITCHING", "IDLE"].map(String::from));
    } else {
        head.extend(["SPAN", "GPU SERVING", "SWITCHING", "IDLE"].map(String::from));
    }
    rows.push(head);
    for r in reports {
        let mut lines = vec![(None, r.gpu)];
        if several {
            lines.extend(r.gpus.iter().map(|g| (Some(g.gpu), g.shares)));
        }
        for (gpu, shares) in lines {
            let mut row = Vec::new();
            if compare {
                row.push(short(r.setting.as_deref()));
            }
            row.push(human(r.span_ms));
            if several {
                row.push(gpu.map_or_else(|| "all".to_string(), |g| g.to_string()));
            }
            row.extend([pct(shares.serving), pct(shares.switching), pct(shares.idle)]);
            rows.push(row);
        }
    }
    out.push_str(&table(&rows));
    for r in reports {
        for n in &r.notes {
            let at = r
                .setting
                .as_ref()
                .map(|s| format!("{s}: "))
                .unwrap_or_default();
            out.push_str(&format!("note: {at}{n}\n"));
        }
    }
    out
}

/// `--compare key=v1,v2`: the key and its values.
fn compare_values(compare: &str) -> Result<(String, Vec<String>), String> {
    let (key, values) = compare.split_once('=').ok_or_else(|| {
        format!("--compare {compare}: expected key=v1,v2,… e.g. host.resource_policy.queue.admission_window=5s,20s")
    })?;
    let values: Vec<String> = values
        .split(',')
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(str::to_string)
        .collect();
    if key.trim().is_empty() || values.is_empty() {
        return Err(format!("--compare {compare}: expected key=v1,v2,…"));
    }
    Ok((key.trim().to_string(), values))
}

/// Every run of `args`: one, or one per compared value; with its `key=value`.
pub fn runs(args: &SimulateArgs) -> Result<Vec<(Option<String>, Run)>, String> {
    let requests = trace::load(&args.trace)?;
    let variants: Vec<Option<String>> = match &args.compare {
        None => vec![None],
        Some(c) => {
            let (key, values) = compare_values(c)?;
            values
                .into_iter()
                .map(|v| Some(format!("{key}={v}")))
                .collect()
        }
    };
    let mut out = Vec::new();
    for v in variants {
        let mut set = args.set.clone();
        set.extend(v.clone());
        let name = args.trace.display().to_string();
        let setup = setup(args.file.as_deref(), &set, &name, &requests)?;
        out.push((v, simulate_once(setup, &requests, args.cold)?));
    }
    Ok(out)
}

/// The `--set` keys of the engine times that switch `records` measured, per model: the median
/// of each phase that ended (`park` and `stop` of the victims, `start`, `wake` and `wake_check`
/// of the targets; the simulated `wake` includes its check, as the record's two phases do
/// together), as `simulate.models.<name>.<key>=<ms>ms`, in model then key order.
pub fn measured_sets(records: &[capyctl_spec::api::SwitchRecord]) -> Vec<String> {
    use capyctl_spec::api::SwitchPhaseKind as Kind;
    let mut took: BTreeMap<(String, &'static str), Vec<u64>> = BTreeMap::new();
    for r in records {
        let name_of = |instance: &str| {
            if instance == r.instance {
                return Some(r.deployment.clone());
            }
            r.victims
                .iter()
                .find(|v| v.instance == instance)
                .map(|v| v.deployment.clone())
        };
        for p in &r.phases {
            let key = match p.phase {
                Kind::Park => "park",
                Kind::Stop => "stop",
                Kind::Start => "start",
                Kind::Wake => "wake",
                Kind::WakeCheck => "wake_check",
                // Adapter loads are no engine times of the model's own (SimHost's
                // `adapter_load` setting models them).
                Kind::AdmissionWindow
                | Kind::Drain
                | Kind::Release
                | Kind::AdapterLoad
                | Kind::AdapterUnload => continue,
            };
            if let (Some(end), Some(name)) = (p.ended_ms, name_of(&p.instance)) {
                took.entry((name, key))
                    .or_default()
                    .push(end.saturating_sub(p.began_ms));
            }
        }
    }
    let median = |v: &mut Vec<u64>| {
        v.sort_unstable();
        v[v.len() / 2]
    };
    let mut medians: BTreeMap<(String, &'static str), u64> = took
        .into_iter()
        .map(|(k, mut v)| (k, median(&mut v)))
        .collect();
    let checks: Vec<(String, u64)> = medians
        .iter()
        .filter(|((_, k), _)| *k == "wake_check")
        .map(|((n, _), ms)| (n.clone(), *ms))
        .collect();
    for (name, check) in checks {
        if let Some(wake) = medians.get_mut(&(name, "wake")) {
            *wake += check;
        }
    }
    medians
        .into_iter()
        .map(|((name, key), ms)| format!("simulate.models.{name}.{key}={ms}ms"))
        .collect()
}

/// `capyctl simulate`.
pub fn run(args: SimulateArgs) -> Result<(), String> {
    let started = std::time::Instant::now();
    let runs = runs(&args)?;
    let reports: Vec<Report> = runs.iter().map(|(s, r)| r.report(s.clone())).collect();
    if let Some(path) = &args.svg {
        let svg = crate::simulate_svg::render(&runs);
        std::fs::write(path, svg).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    if args.json {
        let text = serde_json::to_string_pretty(&reports).map_err(|e| e.to_string())?;
        println!("{text}");
    } else {
        let requests: usize = reports
            .first()
            .map_or(0, |r| r.models.iter().map(|m| m.requests).sum());
        let span = reports.first().map_or(0, |r| r.span_ms);
        println!(
            "simulated {requests} requests over {} of trace in {:.1} s",
            human(span),
            started.elapsed().as_secs_f64()
        );
        print!("{}", render(&reports));
        if let Some(path) = &args.svg {
            println!("timeline: {}", path.display());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A switch record of `target` (instance `t-0`) with `victim` (instance `v-0`) parked,
    /// its phases as (phase, began, ended) in ms.
    fn record(target: &str, victim: &str, phases: &[(&str, u64, u64)]) -> String {
        let phases: Vec<String> = phases
            .iter()
            .map(|(p, b, e)| {
                let instance = if matches!(*p, "park" | "stop") {
                    "v-0"
                } else {
                    "t-0"
                };
                format!(
                    r#"{{"phase":"{p}","instance":"{instance}","began_ms":{b},"ended_ms":{e}}}"#
                )
            })
            .collect();
        format!(
            r#"{{"seq":1,"switch_id":"s","deployment":"{target}","deployment_id":"t","instance":"t-0","host_id":"h","gpus":[],"cause":"wave","wave":1,"began_ms":0,"ended_ms":9000,"outcome":"ok","error":null,"victims":[{{"deployment":"{victim}","deployment_id":"v","instance":"v-0","action":"park","result":"parked","error":null}}],"phases":[{}]}}"#,
            phases.join(",")
        )
    }

    #[test]
    fn measured_times_are_each_phases_median_per_model_the_wake_with_its_check() {
        let records: Vec<capyctl_spec::api::SwitchRecord> = [
            record(
                "a",
                "b",
                &[
                    ("drain", 0, 50),
                    ("park", 50, 1050),
                    ("wake", 1050, 3050),
                    ("wake_check", 3050, 3550),
                ],
            ),
            record(
                "a",
                "b",
                &[
                    ("park", 0, 3000),
                    ("wake", 3000, 4000),
                    ("wake_check", 4000, 4300),
                ],
            ),
            record(
                "a",
                "b",
                &[
                    ("park", 0, 2000),
                    ("wake", 2000, 5000),
                    ("wake_check", 5000, 5400),
                ],
            ),
            record("b", "a", &[("stop", 0, 700), ("start", 700, 30700)]),
        ]
        .iter()
        .map(|r| serde_json::from_str(r).unwrap())
        .collect();
        assert_eq!(
            measured_sets(&records),
            [
                "simulate.models.a.stop=700ms",
                // wake 2000 (of 1000, 2000, 3000) + its check 400 (of 300, 400, 500)
                "simulate.models.a.wake=2400ms",
                "simulate.models.a.wake_check=400ms",
                // park 2000 (of 1000, 2000, 3000)
                "simulate.models.b.park=2000ms",
                "simulate.models.b.start=30000ms",
            ]
        );
    }

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    fn dir(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("capyctl-simulate-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    const DOC: &str = "server:\n  switching:\n    drain_timeout: 30s\nhost:\n  id: box\n  gpus: [{memory: 10GiB}]\n  host_memory: 8GiB\n  resource_policy:\n    queue:\n      admission_window: 1s\ndeployments:\n  - name: a\n    engine: vllm\n    model: m\n    resources: {gpu_memory: 6GiB, weights_memory: 2GiB}\n  - name: b\n    engine: vllm\n    model: m\n    resources: {gpu_memory: 6GiB, weights_memory: 2GiB}\n";

    fn args(trace: PathBuf, file: Option<PathBuf>, set: &[&str]) -> SimulateArgs {
        SimulateArgs {
            trace,
            file,
            set: set.iter().map(|s| s.to_string()).collect(),
            compare: None,
            svg: None,
            json: false,
            cold: false,
        }
    }

    /// Replicas on a box of two GPUs, cold: a request for `a` (two replicas) starts both
    /// instances, one on each GPU (10 s each), and runs 20 s on one of them. The GPU time is
    /// counted per GPU: the one that served was switching a third of the 30 s and serving the
    /// rest; the other switching a third and idle the rest; the whole box is their mean. The
    /// timeline has a row per instance, and its bars name their GPU.
    #[test]
    fn replicas_are_counted_and_drawn_per_instance_and_gpu() {
        let d = dir("replicas");
        let doc = DOC
            .replace(
                "gpus: [{memory: 10GiB}]",
                "gpus: [{memory: 10GiB}, {memory: 10GiB}]",
            )
            .replace("  - name: b\n", "    replicas: 2\n  - name: b\n");
        let file = write(&d, "s.yaml", &doc);
        let trace = write(
            &d,
            "t.jsonl",
            "{\"at_ms\": 0, \"model\": \"a\", \"duration_ms\": 20000}\n",
        );
        let mut a = args(trace, Some(file), &["simulate.start=10s"]);
        a.cold = true;
        let runs = runs(&a).unwrap();
        let run = &runs[0].1;
        let mut started: Vec<(u32, Vec<u32>)> = run
            .ops
            .iter()
            .filter(|o| o.kind == OpKind::Start)
            .map(|o| (instance_index(o), o.gpus.clone()))
            .collect();
        started.sort();
        assert_eq!(started, [(0, vec![0]), (1, vec![1])], "{:#?}", run.ops);
        let served = &run.requests[0];
        let on = served.gpus.clone();
        assert_eq!(on.len(), 1, "{served:?}");
        assert_eq!(
            served.instance,
            Some(on[0]),
            "instance i runs on GPU i here"
        );
        let report = run.report(None);
        assert_eq!(report.span_ms, 30_000);
        let near = |x: f64, want: f64| (x - want).abs() < 0.01;
        let third = 1.0 / 3.0;
        for g in &report.gpus {
            let s = g.shares;
            assert!(near(s.switching, third), "{report:#?}");
            if g.gpu == on[0] {
                assert!(
                    near(s.serving, 2.0 * third) && near(s.idle, 0.0),
                    "{report:#?}"
                );
            } else {
                assert!(
                    near(s.serving, 0.0) && near(s.idle, 2.0 * third),
                    "{report:#?}"
                );
            }
        }
        assert_eq!(report.gpus.len(), 2);
        let all = report.gpu;
        assert!(
            near(all.serving, third) && near(all.switching, third) && near(all.idle, third),
            "{report:#?}"
        );
        let text = render(std::slice::from_ref(&report));
        assert!(text.contains("GPU   SERVING"), "{text}");
        assert!(text.contains("all   33%"), "{text}");
        let svg = crate::simulate_svg::render(&runs);
        for needle in [
            ">a #0</text>",
            ">a #1</text>",
            "a #1 start on GPU 1: 10.00 s",
            ">b</text>",
        ] {
            assert!(svg.contains(needle), "{needle} missing in {svg}");
        }
    }

    /// Two models on a GPU that holds one: b is ready after the warm-up, so a's wave waits for
    /// the window (1 s), the park of b (2 GiB at 1 GiB/s) and the wake of a (2 s + 0.5 s check);
    /// b's wave after it waits for the park and the wake.
    #[test]
    fn a_wave_waits_for_the_window_the_park_and_the_wake() {
        let d = dir("wave");
        let file = write(&d, "s.yaml", DOC);
        let trace = write(
            &d,
            "t.jsonl",
            "{\"at_ms\": 0, \"model\": \"a\", \"duration_ms\": 1000}\n\
             {\"at_ms\": 0, \"model\": \"a\", \"duration_ms\": 1000}\n\
             {\"at_ms\": 20000, \"model\": \"b\", \"duration_ms\": 1000}\n\
             {\"at_ms\": 40000, \"model\": \"c\", \"duration_ms\": 1000}\n",
        );
        let runs = runs(&args(
            trace,
            Some(file),
            &[
                "simulate.host_bandwidth=1GiB/s",
                "simulate.wake_check=500ms",
            ],
        ))
        .unwrap();
        let report = runs[0].1.report(None);
        let a = &report.models[0];
        assert_eq!(a.model, "a");
        assert_eq!(a.requests, 2);
        assert_eq!(a.waited, 2);
        // window 1 s (nothing runs on b) + park 2 s + wake 2.5 s.
        assert!((5_400..=5_600).contains(&a.wait_p50_ms), "{report:#?}");
        assert_eq!(a.switches, 1);
        // a has been idle for longer than the window when b's wave comes: no window.
        let b = &report.models[1];
        assert!((4_400..=4_600).contains(&b.wait_p50_ms), "{report:#?}");
        let c = &report.models[2];
        assert_eq!(c.errors.get("model_not_found"), Some(&1), "{report:#?}");
        let g = report.gpu;
        assert!(
            (g.serving + g.switching + g.idle - 1.0).abs() < 1e-6,
            "{g:?}"
        );
        assert!(g.switching > 0.15 && g.serving > 0.03, "{g:?}");
        let text = render(&[report]);
        assert!(text.contains("MODEL   REQUESTS   WAIT P50"), "{text}");
        // The timeline: a row per model, b's park and a's wake as bars, the waiting line.
        let svg = crate::simulate_svg::render(&runs);
        assert!(
            svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""),
            "{svg}"
        );
        for needle in [
            "<title>b park: 2.00 s</title>",
            "<title>a wake: 2.50 s</title>",
            "waiting (max 2)",
            ">c</text>",
        ] {
            assert!(svg.contains(needle), "{needle} missing in {svg}");
        }
    }

    /// A GPU with room for two of four models: two waves that come together switch at once
    /// (the lifecycle gives each its own victim), so the second waits no longer than the first
    /// (one after the other, it waited 2.5 s more: c and d 6.5 s and 9.0 s, a and b 7.5 s and
    /// 10.0 s).
    #[test]
    fn two_waves_on_a_gpu_with_room_for_two_switch_at_once() {
        let d = dir("concurrent");
        let models: String = ["a", "b", "c", "d"]
            .iter()
            .map(|m| {
                format!(
                    "  - name: {m}\n    engine: vllm\n    model: m\n    resources: {{gpu_memory: 6GiB, weights_memory: 2GiB}}\n"
                )
            })
            .collect();
        let doc = DOC
            .replace("gpus: [{memory: 10GiB}]", "gpus: [{memory: 12GiB}]")
            .replace("host_memory: 8GiB", "host_memory: 16GiB");
        let doc = format!("{}{models}", &doc[..doc.find("  - name: a").unwrap()]);
        let file = write(&d, "s.yaml", &doc);
        // a and b at 0 s (they are loaded), then c and d together at 20 s.
        let lines: String = [(0, "a"), (0, "b"), (20_000, "c"), (20_000, "d")]
            .iter()
            .map(|(at, m)| {
                format!("{{\"at_ms\": {at}, \"model\": \"{m}\", \"duration_ms\": 1000}}\n")
            })
            .collect();
        let trace = write(&d, "t.jsonl", &lines);
        let set = [
            "simulate.host_bandwidth=1GiB/s",
            "simulate.wake_check=500ms",
        ];
        let runs = runs(&args(trace, Some(file), &set)).unwrap();
        let report = runs[0].1.report(None);
        let wait = |i: usize| report.models[i].wait_p50_ms;
        assert_eq!(report.models.len(), 4, "{report:#?}");
        assert!(report.models.iter().all(|m| m.switches == 1), "{report:#?}");
        assert!(wait(0) > 1_000 && wait(2) > 1_000, "{report:#?}");
        assert!(wait(0).abs_diff(wait(1)) <= 100, "{report:#?}");
        assert!(wait(2).abs_diff(wait(3)) <= 100, "{report:#?}");
    }

    #[test]
    fn compare_runs_once_per_value_and_the_window_moves_the_waits() {
        let d = dir("compare");
        let file = write(&d, "s.yaml", DOC);
        let trace = write(
            &d,
            "t.jsonl",
            "{\"at_ms\": 0, \"model\": \"a\", \"output_tokens\": 40}\n",
        );
        let mut a = args(trace, Some(file), &["simulate.token_rate=40"]);
        a.compare = Some("host.resource_policy.queue.admission_window=1s,5s".into());
        let runs = runs(&a).unwrap();
        let reports: Vec<Report> = runs.iter().map(|(s, r)| r.report(s.clone())).collect();
        assert_eq!(reports.len(), 2);
        let w = |i: usize| reports[i].models[0].wait_p50_ms;
        // The window's 4 s more, to within a millisecond or two of the paused clock.
        assert!((w(1) - w(0)).abs_diff(4_000) <= 5, "{reports:#?}");
        assert_eq!(
            reports[1].setting.as_deref(),
            Some("host.resource_policy.queue.admission_window=5s")
        );
        let text = render(&reports);
        assert!(text.starts_with("SETTING"), "{text}");
    }

    #[test]
    fn without_a_document_the_trace_names_the_models_and_bad_keys_are_named() {
        let d = dir("nodoc");
        let trace = write(
            &d,
            "t.jsonl",
            "{\"at_ms\": 0, \"model\": \"x\", \"output_tokens\": 10}\n{\"at_ms\": 0, \"model\": \"y\", \"duration_ms\": 10}\n",
        );
        let e = runs(&args(trace.clone(), None, &[])).unwrap_err();
        assert!(
            e.contains(":1: `output_tokens` needs the engine's token rate"),
            "{e}"
        );
        let e = runs(&args(trace.clone(), None, &["simulate.wake_time=1s"])).unwrap_err();
        assert!(e.contains("unknown key `wake_time`"), "{e}");
        let runs = runs(&args(trace, None, &["simulate.models.x.token_rate=10"])).unwrap();
        let report = runs[0].1.report(None);
        assert_eq!(report.models.len(), 2);
        assert!(
            report.models.iter().all(|m| m.errors.is_empty()),
            "{report:#?}"
        );
    }
}
