//! [`SimHost`]: the host agent of `capyctl simulate`. Nothing is started: each engine operation
//! (start, park, wake, stop) takes its simulated time on the tokio clock (paused, so it costs
//! nothing), and is logged with when it began and ended for the report and the timeline.
//!
//! What it decides as a real agent does: the parking tier (the agent's own [`choose_tier`],
//! with the room left in host RAM by the copies parked), the engine's request bound
//! ([`max_running`]), what a deployment measures (its declared `resources`). Times come from
//! [`Timings`] (see `simulate.rs` for where each comes from).

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use capyctl_node_agent::agent::{
    BoxFuture, ParkResult, RecoveryReport, StartedInstance, WakeReport,
};
use capyctl_node_agent::capability::{EngineInfo, engine_info};
use capyctl_node_agent::inventory::{Inventory, default_probe, inventory};
use capyctl_node_agent::launch::{MaxRunningInput, max_running};
use capyctl_node_agent::load::LoadSample;
use capyctl_node_agent::measure::{Measurement, measure_before_start};
use capyctl_node_agent::spec::{HostSettings, InstanceSpec};
use capyctl_node_agent::tier::{
    LaunchParking, ParkChoice, ParkTier, TierInput, choose_tier, launch_parking,
};
use capyctl_node_agent::verify::{FirstAnswer, WakeOutcome};
use capyctl_node_agent::{AgentError, HostAgent};
use capyctl_spec::EngineKind;
use tokio::time::Instant;

/// How long one model's engine operations take in the simulation.
#[derive(Debug, Clone, Copy, PartialEq)]
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
    /// The instance's index within its deployment (0 unless it has `replicas`).
    pub instance: u32,
    /// The indices of the GPUs the instance uses.
    pub gpus: Vec<u32>,
    /// What it was.
    pub kind: OpKind,
    /// When it began.
    pub began: Instant,
    /// When it ended.
    pub ended: Instant,
}

#[derive(Debug)]
struct SimInstance {
    spec: InstanceSpec,
    measurement: Measurement,
    launched: LaunchParking,
    /// The tier it is parked in, with the bytes its copy holds in host RAM.
    parked: Option<(ParkTier, u64)>,
}

/// The simulated host (see the module doc).
#[derive(Debug)]
pub struct SimHost {
    /// `host.gpus` and `host.host_memory`, both set.
    settings: HostSettings,
    unified: bool,
    host_memory: u64,
    /// By deployment name; `default` for the others.
    timings: BTreeMap<String, Timings>,
    default_timings: Timings,
    instances: Mutex<BTreeMap<String, SimInstance>>,
    ops: Mutex<Vec<Op>>,
    /// The host's GPUs (`host.gpus`), to read which an engine uses.
    inventory: Inventory,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
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

impl SimHost {
    /// The host of `settings`, whose `gpus` and `host_memory` must be set (they replace what
    /// a real agent reads); `timings` by deployment name, `default_timings` for any other.
    /// An error only where they are not set and the machine cannot be read.
    pub fn new(
        settings: HostSettings,
        timings: BTreeMap<String, Timings>,
        default_timings: Timings,
    ) -> Result<Self, AgentError> {
        // `host.gpus` and `host.host_memory` are always set here: the probe is never asked.
        let inventory = inventory(&settings, default_probe().as_ref())?;
        Ok(SimHost {
            inventory,
            unified: settings.gpus.iter().flatten().any(|g| g.unified),
            host_memory: settings.host_memory.unwrap_or(0),
            settings,
            timings,
            default_timings,
            instances: Mutex::new(BTreeMap::new()),
            ops: Mutex::new(Vec::new()),
        })
    }

    /// Every operation so far, in the order they ended.
    pub fn ops(&self) -> Vec<Op> {
        lock(&self.ops).clone()
    }

    fn timings(&self, name: &str) -> Timings {
        self.timings
            .get(name)
            .copied()
            .unwrap_or(self.default_timings)
    }

    fn unified(&self) -> bool {
        self.unified
    }

    /// Host RAM left for one more copy: the host's less the copies parked there.
    fn host_room(&self, instances: &BTreeMap<String, SimInstance>) -> u64 {
        let held: u64 = instances
            .values()
            .filter_map(|i| i.parked)
            .map(|p| p.1)
            .sum();
        self.host_memory.saturating_sub(held)
    }

    /// The number of GPUs of the host.
    pub fn gpu_count(&self) -> usize {
        self.inventory.gpus.len()
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

    /// The indices of the GPUs instance `instance` (an instance ID) uses now; empty when it
    /// does not run.
    pub fn gpus_of_instance(&self, instance: &str) -> Vec<u32> {
        lock(&self.instances)
            .get(instance)
            .map(|i| self.gpus_of(&i.spec))
            .unwrap_or_default()
    }

    /// Takes `took` of simulated time, logged as `kind` of instance `instance` of `spec`.
    async fn take(&self, instance: &str, spec: &InstanceSpec, kind: OpKind, took: Duration) {
        let began = Instant::now();
        tokio::time::sleep(took).await;
        lock(&self.ops).push(Op {
            model: spec.name.clone(),
            instance: capyctl_lifecycle::split_instance_id(instance).map_or(0, |(_, i)| i),
            gpus: self.gpus_of(spec),
            kind,
            began,
            ended: Instant::now(),
        });
    }

    fn gone(instance: &str) -> AgentError {
        AgentError::WrongState {
            instance: instance.to_string(),
            detail: "the simulated host has no such instance".into(),
        }
    }
}

impl HostAgent for SimHost {
    fn inventory(&self) -> BoxFuture<'_, Result<Inventory, AgentError>> {
        Box::pin(async move { Ok(self.inventory.clone()) })
    }

    fn engines(&self) -> BoxFuture<'_, Vec<EngineInfo>> {
        Box::pin(async {
            [EngineKind::Vllm, EngineKind::Sglang, EngineKind::Tensorfold]
                .into_iter()
                .map(|e| engine_info(e, None))
                .collect()
        })
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
            let instances = lock(&self.instances);
            choose_tier(&tier_input(
                spec,
                self.unified(),
                measured(spec).weights_bytes(),
                self.host_room(&instances),
                None,
            ))
        })
    }

    fn start<'a>(
        &'a self,
        instance: &'a str,
        spec: &'a InstanceSpec,
    ) -> BoxFuture<'a, Result<StartedInstance, AgentError>> {
        Box::pin(async move {
            let measurement = measured(spec);
            let launched = {
                let instances = lock(&self.instances);
                launch_parking(&tier_input(
                    spec,
                    self.unified(),
                    measurement.weights_bytes(),
                    self.host_room(&instances),
                    None,
                ))
            };
            self.take(
                instance,
                spec,
                OpKind::Start,
                self.timings(&spec.name).start,
            )
            .await;
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
            Ok(StartedInstance {
                instance: instance.to_string(),
                pid: 1,
                port: 9,
                base_url: "http://127.0.0.1:9".to_string(),
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
            let (spec, choice, copy) = {
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
                        ParkChoice::Stop(capyctl_node_agent::tier::NoParkReason::NoRoomToPark)
                    }
                    c => c,
                };
                let copy = inst.measurement.weights_bytes().unwrap_or(0);
                (spec.clone(), choice, copy)
            };
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
            let spec = lock(&self.instances).get(instance).map(|i| i.spec.clone());
            if let Some(spec) = spec {
                self.take(instance, &spec, OpKind::Stop, self.timings(&spec.name).stop)
                    .await;
                lock(&self.instances).remove(instance);
            }
            Ok(())
        })
    }

    fn sample(&self, _: &str) -> Option<LoadSample> {
        None
    }

    fn recover(&self) -> BoxFuture<'_, Result<RecoveryReport, AgentError>> {
        Box::pin(async { Ok(RecoveryReport::default()) })
    }
}
