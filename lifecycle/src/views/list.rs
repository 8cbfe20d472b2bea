//! A deployment's view (`GET /deployments`, `status deployment`): what it shows computed once
//! from its instances' snapshots ([`ViewFigures`]), then either built into the typed view
//! ([`deployment_view`]) or written straight into the answer's JSON
//! ([`write_deployment_view`], byte for byte `serde_json`'s of the typed view).
//!
//! NB (reads at scale): the deployments list writes 100,000 of these; each was built as an
//! owned view (some twenty small allocations: IDs, names, three conditions of four strings
//! each) and then encoded by serde. Now the document (`spec`) is written as encoded once per
//! revision (`Fixed::spec_json`); the rest from the snapshots (a view of an adapter, few, is
//! still built and encoded).

use std::fmt;

use bytes::BufMut;
use capyctl_interfaces::measure::{MeasureSource, Measurement};
use capyctl_interfaces::router::InstanceKey;
use capyctl_spec::api::{ConditionView, DeploymentView, InstanceView, MeasurementView};
use capyctl_spec::documents::DeploymentDoc;
use capyctl_spec::{Activation, InstanceState};

use super::{Ctx, DepShot, Hosts, deployment_state, json, tier_words};

/// One deployment's view, from its instances' snapshots (index 0 first: [`super::group`]).
pub(crate) fn deployment_view(units: &[DepShot], cx: &Ctx<'_>) -> DeploymentView {
    let doc = &units[0].fixed.doc;
    let spec = DeploymentDoc::clone(doc);
    match &doc.adapter {
        Some(adapter) => adapter_view(&units[0], &adapter.base, cx, spec),
        None => ViewFigures::of(units, cx).view(spec),
    }
}

/// [`deployment_view`]'s JSON appended to `out`, byte for byte `serde_json`'s of it, written
/// straight from the snapshots: no view built, the document as encoded once per revision (see
/// the module's NB). `tests` and `reads::tests` hold the bytes equal.
pub(crate) fn write_deployment_view<B: BufMut>(
    out: &mut B,
    units: &[DepShot],
    cx: &Ctx<'_>,
) -> serde_json::Result<()> {
    if units[0].fixed.doc.adapter.is_some() {
        serde_json::to_writer((&mut *out).writer(), &deployment_view(units, cx))
    } else {
        ViewFigures::of(units, cx).write(out)
    }
}

/// What a deployment's view (not an adapter's) shows beyond its snapshots' own fields, computed
/// once for [`ViewFigures::view`] and [`ViewFigures::write`].
struct ViewFigures<'a> {
    units: &'a [DepShot],
    cx: &'a Ctx<'a>,
    doc: &'a DeploymentDoc,
    state: InstanceState,
    ready_count: usize,
    replicas: u32,
    explicit: bool,
    ready: Ready<'a>,
    measured: bool,
}

/// Why the `Ready` condition says what it says.
enum Ready<'a> {
    /// An engine believed on a host whose node agent does not answer: what is shown is the
    /// last known, and the condition says it is unknown now, and why.
    AgentLost {
        host: &'a str,
        why: String,
        was: InstanceState,
    },
    /// Its one instance serves.
    Serves,
    /// Some of its instances serve.
    SomeServe { ready: usize, replicas: u32 },
    /// An operator's start waits for memory.
    WaitingForMemory,
    /// It failed: the last error.
    Failed(&'a str),
    /// It does not run: the state.
    NotRunning(InstanceState),
}

impl Ready<'_> {
    fn reason(&self) -> &'static str {
        match self {
            Ready::AgentLost { .. } => "node_agent_unreachable",
            Ready::Serves | Ready::SomeServe { .. } => "ready",
            Ready::WaitingForMemory => "waiting_for_memory",
            Ready::Failed(_) => "failed",
            Ready::NotRunning(_) => "not_running",
        }
    }

    /// The condition's `status` (the variants that serve are chosen only when an instance is
    /// ready).
    fn status(&self) -> &'static str {
        match self {
            Ready::AgentLost { .. } => "Unknown",
            Ready::Serves | Ready::SomeServe { .. } => "True",
            _ => "False",
        }
    }
}

/// The `Ready` condition's message.
impl fmt::Display for Ready<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Ready::AgentLost { host, why, was } => write!(
                f,
                "the node agent of host {host} cannot be reached, so the instance's state ({was}) is the last known: {why}"
            ),
            Ready::Serves => f.write_str("the instance serves requests"),
            Ready::SomeServe { ready, replicas } => {
                write!(f, "{ready} of {replicas} instances serve requests")
            }
            Ready::WaitingForMemory => f.write_str(
                "an operator start waits for GPU memory (start --evict parks idle models to make room)",
            ),
            Ready::Failed(e) => f.write_str(e),
            Ready::NotRunning(state) => write!(f, "the instance is {state}"),
        }
    }
}

impl<'a> ViewFigures<'a> {
    fn of(units: &'a [DepShot], cx: &'a Ctx<'a>) -> Self {
        let d = &units[0];
        let doc = &*d.fixed.doc;
        let state = deployment_state(units);
        let ready_count = units
            .iter()
            .filter(|u| u.state == InstanceState::Ready)
            .count();
        let replicas = doc.replicas();
        let agent_lost = units.iter().find_map(|u| {
            (!matches!(u.state, InstanceState::Stopped | InstanceState::Failed))
                .then(|| u.host.as_deref().and_then(|h| cx.hosts.get_key_value(h)))
                .flatten()
                .and_then(|(id, h)| Some((id, h.agent.unreachable()?, u.shown_state())))
        });
        let ready = if let Some((host, why, was)) = agent_lost {
            Ready::AgentLost { host, why, was }
        } else if ready_count > 0 {
            if replicas == 1 && units.len() == 1 {
                Ready::Serves
            } else {
                Ready::SomeServe {
                    ready: ready_count,
                    replicas,
                }
            }
        } else if units.iter().any(|u| u.pending_start) {
            Ready::WaitingForMemory
        } else if let Some(e) = units.iter().find_map(|u| u.last_error.as_deref()) {
            Ready::Failed(e)
        } else {
            Ready::NotRunning(state)
        };
        ViewFigures {
            units,
            cx,
            doc,
            state,
            ready_count,
            replicas,
            explicit: doc.activation() == Activation::Explicit || cx.any_host_explicit,
            ready,
            measured: !d.measurement.awaiting(),
        }
    }

    fn activation(&self) -> Activation {
        if self.explicit {
            Activation::Explicit
        } else {
            Activation::OnDemand
        }
    }

    /// The `Measured` condition's reason and message.
    fn measured_why(&self) -> (&'static str, &'static str) {
        if self.measured {
            ("measured", "the checkpoint's memory is known")
        } else if self.units.iter().any(|u| u.first_answered) {
            // Started, and still unknown: the host cannot read a process's GPU memory (no
            // NVML, or GPUs declared in the host document).
            (
                "awaiting_measurement",
                "the engine's GPU footprint could not be read on this host; it is placed as needing the whole GPU: declare resources.gpu_memory",
            )
        } else {
            (
                "awaiting_measurement",
                "no measurement yet: declare resources, or start it with --wait",
            )
        }
    }

    /// The typed view, with `spec` as its document.
    fn view(self, spec: DeploymentDoc) -> DeploymentView {
        let d = &self.units[0];
        let (measured_reason, measured_message) = self.measured_why();
        DeploymentView {
            id: d.fixed.id().to_string(),
            name: self.doc.name.clone(),
            state: self.state,
            ready: format!("{}/{}", self.ready_count, self.replicas),
            revision: d.fixed.revision,
            hosts: shown_hosts(self.units, self.cx.hosts)
                .map(str::to_string)
                .collect(),
            activation: self.activation(),
            warm: self.doc.warm(),
            operator_stopped: d.operator_stopped,
            engine: self.doc.engine_kind(),
            model: self.doc.model_arg().to_string(),
            residency: self.doc.residency,
            measurement: measurement(&d.measurement).map(|(gpu_memory, weights_memory, source)| {
                MeasurementView {
                    gpu_memory,
                    weights_memory,
                    source: source.to_string(),
                }
            }),
            instances: self
                .units
                .iter()
                .map(|u| InstanceView {
                    instance_id: u.instance_id().to_string(),
                    index: u.fixed.index,
                    host_id: instance_host(u, self.cx).to_string(),
                    generation: u.generation,
                    state: u.shown_state(),
                    parked_tier: u.tier.map(|t| tier_words(t).to_string()),
                    port: u.addr.map(|a| a.port()),
                    pid: u.pid,
                    last_error: u.last_error.clone(),
                })
                .collect(),
            conditions: vec![
                ConditionView {
                    kind: "Ready".to_string(),
                    status: self.ready.status().to_string(),
                    reason: self.ready.reason().to_string(),
                    message: self.ready.to_string(),
                },
                condition("Measured", self.measured, measured_reason, measured_message),
            ],
            spec,
        }
    }

    /// [`ViewFigures::view`]'s JSON with the deployment's own document, as `serde_json` writes
    /// it (the fields in their order, the optional ones left out when absent).
    fn write<B: BufMut>(&self, out: &mut B) -> serde_json::Result<()> {
        let d = &self.units[0];
        out.put_slice(br#"{"id":"#);
        json::string(out, d.fixed.id());
        out.put_slice(br#","name":"#);
        json::string(out, &self.doc.name);
        out.put_slice(br#","state":""#);
        // The enums' words need no escaping (`kinds` tests them against serde's).
        out.put_slice(self.state.as_str().as_bytes());
        out.put_slice(br#"","ready":""#);
        json::number(out, self.ready_count as u64);
        out.put_u8(b'/');
        json::number(out, u64::from(self.replicas));
        out.put_slice(br#"","revision":"#);
        json::number(out, d.fixed.revision);
        out.put_slice(br#","hosts":["#);
        for (i, h) in shown_hosts(self.units, self.cx.hosts).enumerate() {
            if i > 0 {
                out.put_u8(b',');
            }
            json::string(out, h);
        }
        out.put_slice(br#"],"activation":""#);
        out.put_slice(self.activation().as_str().as_bytes());
        out.put_slice(br#"","warm":"#);
        json::boolean(out, self.doc.warm());
        out.put_slice(br#","operator_stopped":"#);
        json::boolean(out, d.operator_stopped);
        out.put_slice(br#","engine":""#);
        out.put_slice(self.doc.engine_kind().as_str().as_bytes());
        out.put_slice(br#"","model":"#);
        json::string(out, self.doc.model_arg());
        if let Some(r) = self.doc.residency {
            out.put_slice(br#","residency":""#);
            out.put_slice(r.as_str().as_bytes());
            out.put_u8(b'"');
        }
        if let Some((gpu, weights, source)) = measurement(&d.measurement) {
            out.put_slice(br#","measurement":{"gpu_memory":"#);
            json::number(out, gpu);
            out.put_slice(br#","weights_memory":"#);
            json::number(out, weights);
            out.put_slice(br#","source":""#);
            out.put_slice(source.as_bytes());
            out.put_slice(br#""}"#);
        }
        out.put_slice(br#","instances":["#);
        for (i, u) in self.units.iter().enumerate() {
            if i > 0 {
                out.put_u8(b',');
            }
            write_instance(out, u, self.cx);
        }
        out.put_slice(br#"],"conditions":[{"type":"Ready","status":""#);
        out.put_slice(self.ready.status().as_bytes());
        out.put_slice(br#"","reason":""#);
        out.put_slice(self.ready.reason().as_bytes());
        out.put_slice(br#"","message":"#);
        json::display(out, &self.ready);
        let (reason, message) = self.measured_why();
        out.put_slice(br#"},{"type":"Measured","status":""#);
        out.put_slice(status(self.measured).as_bytes());
        out.put_slice(br#"","reason":""#);
        out.put_slice(reason.as_bytes());
        out.put_slice(br#"","message":"#);
        json::string(out, message);
        out.put_slice(br#"}],"spec":"#);
        match d.fixed.spec_json() {
            [] => serde_json::to_writer((&mut *out).writer(), self.doc)?,
            json => out.put_slice(json),
        }
        out.put_u8(b'}');
        Ok(())
    }
}

/// An instance's view ([`InstanceView`]) as `serde_json` writes it.
fn write_instance<B: BufMut>(out: &mut B, u: &DepShot, cx: &Ctx<'_>) {
    out.put_slice(br#"{"instance_id":"#);
    json::string(out, u.instance_id());
    out.put_slice(br#","index":"#);
    json::number(out, u64::from(u.fixed.index));
    out.put_slice(br#","host_id":"#);
    json::string(out, instance_host(u, cx));
    out.put_slice(br#","generation":"#);
    json::number(out, u.generation);
    out.put_slice(br#","state":""#);
    out.put_slice(u.shown_state().as_str().as_bytes());
    out.put_u8(b'"');
    if let Some(t) = u.tier {
        out.put_slice(br#","parked_tier":""#);
        out.put_slice(tier_words(t).as_bytes());
        out.put_u8(b'"');
    }
    if let Some(a) = u.addr {
        out.put_slice(br#","port":"#);
        json::number(out, u64::from(a.port()));
    }
    if let Some(pid) = u.pid {
        out.put_slice(br#","pid":"#);
        json::number(out, u64::from(pid));
    }
    if let Some(e) = &u.last_error {
        out.put_slice(br#","last_error":"#);
        json::string(out, e);
    }
    out.put_u8(b'}');
}

/// The host an instance's view names: its own, else the first host, else this one's.
fn instance_host<'a>(u: &DepShot, cx: &'a Ctx<'_>) -> &'a str {
    u.host(cx.hosts)
        .map_or(cx.config.host_id.as_str(), |(h, _)| h.as_str())
}

/// The measurement's figures: GPU memory, the weights' size and its source's word.
fn measurement(m: &Measurement) -> Option<(u64, u64, &'static str)> {
    let gpu = m.gpu_memory?;
    let source = match gpu.source {
        MeasureSource::Declared => "declared",
        MeasureSource::Checkpoint => "measured",
        MeasureSource::EngineFootprint => "observed",
    };
    Some((gpu.bytes, m.weights_bytes().unwrap_or(gpu.bytes), source))
}

fn status(ok: bool) -> &'static str {
    if ok { "True" } else { "False" }
}

fn condition(kind: &str, ok: bool, reason: &str, message: impl Into<String>) -> ConditionView {
    ConditionView {
        kind: kind.to_string(),
        status: status(ok).to_string(),
        reason: reason.to_string(),
        message: message.into(),
    }
}

/// The host a deployment's instance puts in its view's `hosts` (the HOSTS column): the host it
/// is bound to (running, parked, or on its way there); when it is bound to none, the one host
/// there is. NB: none (`-`) when it is bound to none and there are several hosts: placement
/// chooses among all of them when it starts. (Listing every host there instead made each
/// unplaced deployment's view as long as the host list: 10,000 deployments on 1,000 hosts
/// answered 10 million host names per list.)
fn shown_host<'a>(d: &'a DepShot, hosts: &'a Hosts) -> Option<&'a str> {
    match (&d.host, d.bound) {
        (Some(h), true) => Some(h),
        _ if hosts.len() == 1 => hosts.keys().next().map(String::as_str),
        _ => None,
    }
}

/// The hosts of a deployment's view: its instances' ([`shown_host`]), each once, in their order.
fn shown_hosts<'a>(units: &'a [DepShot], hosts: &'a Hosts) -> impl Iterator<Item = &'a str> {
    units.iter().enumerate().filter_map(move |(i, u)| {
        let h = shown_host(u, hosts)?;
        (!units[..i].iter().any(|e| shown_host(e, hosts) == Some(h))).then_some(h)
    })
}

/// An adapter's view (DESIGN 4.9): its base in `hosts`, the instances of its base that have
/// it loaded as its instances (`ready`: those of the base's instances known), `ready` when
/// loaded on any (`capyctl list deployments` shows `loaded` / `unloaded`), else `stopped`.
fn adapter_view(d: &DepShot, base: &str, cx: &Ctx<'_>, spec: DeploymentDoc) -> DeploymentView {
    let doc = &d.fixed.doc;
    let on = cx.adapters.by_adapter.get(doc.name.as_str());
    let on: &[InstanceKey] = on.map_or(&[], Vec::as_slice);
    let known = on
        .first()
        .and_then(|k| cx.adapters.instances.get(&k.deployment))
        .copied()
        .unwrap_or(0);
    let state = if on.is_empty() {
        InstanceState::Stopped
    } else {
        InstanceState::Ready
    };
    let loaded = !on.is_empty();
    DeploymentView {
        id: d.fixed.id().to_string(),
        name: doc.name.clone(),
        state,
        ready: format!("{}/{known}", on.len()),
        revision: d.fixed.revision,
        hosts: vec![base.to_string()],
        activation: Activation::OnDemand,
        warm: false,
        operator_stopped: false,
        engine: doc.engine_kind(),
        model: doc.model_arg().to_string(),
        residency: None,
        measurement: None,
        instances: on
            .iter()
            .map(|k| InstanceView {
                instance_id: crate::instance_id_at(&k.deployment, k.index),
                index: k.index,
                host_id: k.host_id.clone(),
                generation: k.generation,
                state: InstanceState::Ready,
                parked_tier: None,
                port: None,
                pid: None,
                last_error: None,
            })
            .collect(),
        conditions: vec![condition(
            "Ready",
            loaded,
            if loaded { "loaded" } else { "unloaded" },
            if loaded {
                format!("loaded into {} instance(s) of {base}", on.len())
            } else {
                format!("loaded into {base} by the next request that names it")
            },
        )],
        spec,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::net::SocketAddr;
    use std::sync::Arc;

    use capyctl_interfaces::agent::{
        BoxFuture, HostAgent, ParkResult, RecoveryReport, StartedInstance, WakeReport,
    };
    use capyctl_interfaces::capability::EngineInfo;
    use capyctl_interfaces::error::AgentError;
    use capyctl_interfaces::inventory::Inventory;
    use capyctl_interfaces::load::LoadSample;
    use capyctl_interfaces::measure::Measured;
    use capyctl_interfaces::spec::{HostSettings, InstanceSpec};
    use capyctl_interfaces::tier::{ParkChoice, ParkTier};
    use capyctl_spec::documents::parse_deployment_str;
    use capyctl_test_support::FakeHost;

    use super::*;
    use crate::LifecycleConfig;
    use crate::state::Host;
    use crate::store::DeploymentRecord;
    use crate::views::{AdapterSets, Fixed};

    /// A host whose node agent cannot be reached: the simulated host's answers, and why it is
    /// unreachable (a reason that needs escaping).
    struct Lost(FakeHost);

    impl HostAgent for Lost {
        fn inventory(&self) -> BoxFuture<'_, Result<Inventory, AgentError>> {
            self.0.inventory()
        }
        fn engines(&self) -> BoxFuture<'_, Vec<EngineInfo>> {
            self.0.engines()
        }
        fn measure<'a>(
            &'a self,
            spec: &'a InstanceSpec,
        ) -> BoxFuture<'a, Result<Measurement, AgentError>> {
            self.0.measure(spec)
        }
        fn parkability<'a>(
            &'a self,
            spec: &'a InstanceSpec,
        ) -> BoxFuture<'a, Result<ParkChoice, AgentError>> {
            self.0.parkability(spec)
        }
        fn start<'a>(
            &'a self,
            instance: &'a str,
            spec: &'a InstanceSpec,
        ) -> BoxFuture<'a, Result<StartedInstance, AgentError>> {
            self.0.start(instance, spec)
        }
        fn park<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<ParkResult, AgentError>> {
            self.0.park(instance)
        }
        fn wake<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<WakeReport, AgentError>> {
            self.0.wake(instance)
        }
        fn stop<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<(), AgentError>> {
            self.0.stop(instance)
        }
        fn sample(&self, instance: &str) -> Option<LoadSample> {
            self.0.sample(instance)
        }
        fn recover(&self) -> BoxFuture<'_, Result<RecoveryReport, AgentError>> {
            self.0.recover()
        }
        fn unreachable(&self) -> Option<String> {
            Some("connect to \"10.0.0.7:9090\": refused\n".into())
        }
    }

    fn host(agent: Arc<dyn HostAgent>, activation: Activation) -> Arc<Host> {
        Arc::new(Host {
            agent,
            activation,
            settings: HostSettings::default(),
            admission_window: None,
            remote: false,
            capacity: 80 << 30,
            gpus: Vec::new(),
        })
    }

    /// A snapshot of instance `index` of the deployment `rec`, varied by `v`.
    fn shot(rec: &DeploymentRecord, index: u32, v: usize) -> DepShot {
        let measured = |bytes, source| Some(Measured { bytes, source });
        let state = InstanceState::ALL[v % InstanceState::ALL.len()];
        DepShot {
            fixed: Arc::new(Fixed::of(rec, index)),
            state,
            measurement: [
                Measurement::default(),
                Measurement {
                    weights: None,
                    gpu_memory: measured(1 << 30, MeasureSource::Declared),
                },
                Measurement {
                    weights: measured(7, MeasureSource::Checkpoint),
                    gpu_memory: measured(u64::MAX, MeasureSource::Checkpoint),
                },
                Measurement {
                    weights: measured(5 << 30, MeasureSource::Checkpoint),
                    gpu_memory: measured(0, MeasureSource::EngineFootprint),
                },
                Measurement {
                    weights: measured(3, MeasureSource::Declared),
                    gpu_memory: None,
                },
            ][v % 5],
            generation: [0, 1, u64::MAX][v % 3],
            operator_stopped: v % 4 == 1,
            pending_start: v % 6 == 2,
            first_answered: v.is_multiple_of(2),
            tier: [
                None,
                Some(ParkTier::HostRam),
                Some(ParkTier::Deep),
                Some(ParkTier::KvOnly),
            ][v % 4],
            addr: (v % 3 == 1).then(|| SocketAddr::from(([127, 0, 0, 1], 40_000 + v as u16))),
            pid: (v % 3 != 2).then_some([0, 4242, u32::MAX][v % 3]),
            last_error: [
                None,
                Some("engine exited with status 1"),
                Some("wake_mismatch: \"x\"\\\u{1}é"),
            ][v % 3]
                .map(str::to_string),
            host: [None, Some("gpu-a"), Some("gpu-lost"), Some("gpu-gone")][(v / 2) % 4]
                .map(Arc::from),
            bound: v % 5 != 3,
        }
    }

    /// The deployments list's hand-written JSON is `serde_json`'s of the typed views, byte for
    /// byte, over varied deployments: replicas, every state, measurements of each source,
    /// parked tiers, failures (escaped), an unreachable node agent, waiting starts, priority,
    /// residency, explicit activation, warm, adapters loaded and not, one host and several.
    #[test]
    fn the_views_json_is_serde_jsons_over_varied_deployments() {
        let texts = [
            "name: plain\nengine: vllm\nmodel: m\n",
            "name: big\nengine: sglang\nmodel: org/m\nreplicas: 3\npriority: -5\nresidency: host_backed\nlifecycle: {activation: explicit, warm: true}\nresources: {gpu_memory: 1GiB}\n",
            "name: base\nengine: vllm\nmodel: m\nresources: {gpu_memory: 6GiB}\nadapters: {max_loaded: 4, max_rank: 16}\npriority: 7\n",
            "name: sql\nadapter: {base: base, path: /loras/sql}\n",
            "name: other\nadapter: {base: base, path: /loras/other}\n",
            "name: two\nengine: tensorfold\nmodel: m\nreplicas: 2\nresidency: deep\nenv: {A: \"q\\\"\"}\nextra_args: [\"--x\"]\nlifecycle: {warm: false}\n",
        ];
        let recs: Vec<DeploymentRecord> = texts
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let doc = parse_deployment_str("t.yaml", t).expect("parses");
                DeploymentRecord::first(format!("01K{i}\"id"), doc)
            })
            .collect();
        let sets = Arc::new(AdapterSets::new(vec![
            (
                InstanceKey {
                    deployment: recs[2].id.clone(),
                    index: 0,
                    host_id: "gpu-a".into(),
                    generation: 3,
                },
                vec!["sql".to_string()],
            ),
            (
                InstanceKey {
                    deployment: recs[2].id.clone(),
                    index: 1,
                    host_id: "gpu-b".into(),
                    generation: 1,
                },
                vec!["sql".to_string()],
            ),
        ]));
        let config = LifecycleConfig::new("this-host");
        let fake = || -> Arc<dyn HostAgent> { Arc::new(FakeHost::new()) };
        let one: Hosts = Arc::new(BTreeMap::from([(
            "gpu-a".to_string(),
            host(fake(), Activation::OnDemand),
        )]));
        let several: Hosts = Arc::new(BTreeMap::from([
            ("gpu-a".to_string(), host(fake(), Activation::OnDemand)),
            ("gpu-b".to_string(), host(fake(), Activation::Explicit)),
            (
                "gpu-lost".to_string(),
                host(Arc::new(Lost(FakeHost::new())), Activation::OnDemand),
            ),
        ]));
        let none: Hosts = Arc::default();
        let mut seen = std::collections::HashSet::new();
        let mut cases = 0;
        for hosts in [&one, &several, &none] {
            for explicit in [false, true] {
                let cx =
                    Ctx::with_explicit(&config, hosts, explicit).with_adapters(Arc::clone(&sets));
                for rec in &recs {
                    for v in 0..60 {
                        let units: Vec<DepShot> = (0..rec.doc.replicas().min(1 + v as u32 % 4))
                            .map(|i| shot(rec, i, v + 7 * i as usize))
                            .collect();
                        let typed = deployment_view(&units, &cx);
                        let mut out = bytes::BytesMut::from(&b"x"[..]);
                        write_deployment_view(&mut out, &units, &cx).expect("encodes");
                        assert_eq!(
                            String::from_utf8_lossy(&out[1..]),
                            serde_json::to_string(&typed).expect("encodes"),
                            "{v}"
                        );
                        seen.insert(typed.conditions[0].reason.clone());
                        seen.insert(
                            typed
                                .conditions
                                .last()
                                .map(|c| c.message.clone())
                                .unwrap_or_default(),
                        );
                        seen.insert(format!("{:?}", typed.measurement.map(|m| m.source)));
                        seen.insert(format!("hosts {}", typed.hosts.len()));
                        cases += 1;
                    }
                }
            }
        }
        assert!(cases > 1000, "{cases}");
        // Every reason of the `Ready` condition, each `Measured` message and measurement
        // source, and views of no, one and two hosts were among the cases.
        for s in [
            "node_agent_unreachable",
            "ready",
            "waiting_for_memory",
            "failed",
            "not_running",
            "loaded",
            "unloaded",
            "the checkpoint's memory is known",
            "no measurement yet: declare resources, or start it with --wait",
            "None",
            "Some(\"declared\")",
            "Some(\"measured\")",
            "Some(\"observed\")",
            "hosts 0",
            "hosts 1",
            "hosts 2",
        ] {
            assert!(seen.contains(s), "no case with {s}: {seen:?}");
        }
    }
}
