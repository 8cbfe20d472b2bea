//! What the management API shows: deployment views, the load read and the host view, as pure
//! functions of snapshots.
//!
//! NB (reads at scale): a read never builds its views under the lifecycle's lock. It copies each
//! deployment into a [`DepShot`] under the lock (O(1) per deployment: the document and the spec
//! are shared through [`Fixed`], not copied), a chunk of deployments at a time, and the hosts as
//! one shared map ([`Hosts`]); the views, the JSON and the host agents' calls all happen after
//! the lock is let go (`Core::shots`).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::{BufMut, BytesMut};
use capyctl_engine_rules::max_running::{MaxRunningInput, max_running};
use capyctl_interfaces::inventory::Inventory;
use capyctl_interfaces::launch::MaxRunning;
use capyctl_interfaces::load::LoadSample;
use capyctl_interfaces::measure::{MeasureSource, Measurement};
use capyctl_interfaces::router::InstanceKey;
use capyctl_interfaces::spec::InstanceSpec;
use capyctl_interfaces::tier::ParkTier;
use capyctl_spec::api::{
    ConditionView, DeploymentView, EngineLoadView, GpuView, HostView, InstanceView,
    MeasurementView, STALE_AFTER_MS, STALE_SAMPLE_KEPT_MS, SampleView,
};
use capyctl_spec::documents::DeploymentDoc;
use capyctl_spec::{Activation, InstanceState};

use crate::LifecycleConfig;
use crate::state::{Dep, Host, Hosts};
use crate::store::DeploymentRecord;

mod load;
pub(crate) use load::{load_view, write_load_view};

/// What a deployment's views show that only a deploy changes: shared (one `Arc`) between the
/// deployment and every snapshot of it, renewed when its revision moves on.
#[derive(Debug)]
pub(crate) struct Fixed {
    /// The revision it was taken at.
    pub revision: u64,
    /// The deployment's ID.
    pub id: String,
    /// Its document (its record's, shared).
    pub doc: Arc<DeploymentDoc>,
    /// Its instance spec (from the document; the deployment's, shared).
    pub spec: Arc<InstanceSpec>,
    /// Its instance's ID (`super::instance_id_at`).
    pub instance_id: String,
    /// Its instance's index.
    pub index: u32,
    /// How its load view's JSON begins ([`load_head`]): written as it is by each full load
    /// read ([`write_load_view`]).
    load_head: Box<[u8]>,
}

impl Fixed {
    /// Of `rec`, whose instance spec is `spec`.
    pub(crate) fn of(rec: &DeploymentRecord, spec: Arc<InstanceSpec>, index: u32) -> Self {
        Fixed {
            revision: rec.revision,
            id: rec.id.clone(),
            doc: Arc::clone(&rec.doc),
            spec,
            instance_id: super::instance_id_at(&rec.id, index),
            index,
            load_head: load::load_head(&rec.id, &rec.doc.name),
        }
    }

    fn name(&self) -> &str {
        &self.doc.name
    }
}

/// One deployment as the views show it, copied under the lifecycle's lock in O(1) (see the
/// module's NB).
#[derive(Debug, Clone)]
pub(crate) struct DepShot {
    /// Its ID, document and spec (shared).
    pub fixed: Arc<Fixed>,
    state: InstanceState,
    measurement: Measurement,
    generation: u64,
    operator_stopped: bool,
    pending_start: bool,
    first_answered: bool,
    tier: Option<ParkTier>,
    addr: Option<SocketAddr>,
    pid: Option<u32>,
    last_error: Option<String>,
    /// `Dep::host`: where its instance is, or last was (shared).
    host: Option<Arc<str>>,
    /// Its instance is bound to `host` (holds memory there, is parked there, or is on its way).
    bound: bool,
    max_running: Option<MaxRunning>,
}

impl DepShot {
    /// A copy of `d` (its shared part is renewed by the deploy that changes it:
    /// `Dep::renew_fixed`).
    pub(crate) fn of(d: &Dep) -> Self {
        debug_assert_eq!(d.fixed.revision, d.rec.revision, "renewed by the deploy");
        DepShot {
            fixed: Arc::clone(&d.fixed),
            state: d.state,
            measurement: d.measurement,
            generation: d.rec.generation,
            operator_stopped: d.rec.operator_stopped,
            pending_start: d.rec.pending_start,
            first_answered: d.rec.first_answer.is_some(),
            tier: d.tier,
            addr: d.addr,
            pid: d.pid,
            last_error: d.last_error.clone(),
            host: d.host.clone(),
            bound: d.bound_host().is_some(),
            max_running: d.max_running,
        }
    }

    /// Its ID.
    pub(crate) fn id(&self) -> &str {
        &self.fixed.id
    }

    /// Its name.
    pub(crate) fn name(&self) -> &str {
        self.fixed.name()
    }

    /// The state shown (see [`shown_state`]).
    pub(crate) fn shown_state(&self) -> InstanceState {
        shown(self.state, &self.measurement)
    }

    fn instance_id(&self) -> &str {
        &self.fixed.instance_id
    }

    /// The host of its instance, else the first host (one host in standalone).
    fn host<'a>(&self, hosts: &'a Hosts) -> Option<(&'a String, &'a Arc<Host>)> {
        self.host
            .as_deref()
            .and_then(|h| hosts.get_key_value(h))
            .or_else(|| hosts.iter().next())
    }
}

/// What every view of one read shares: the settings, and the hosts as of the read.
pub(crate) struct Ctx<'a> {
    config: &'a LifecycleConfig,
    hosts: &'a Hosts,
    /// Some host says `lifecycle.activation: explicit`.
    any_host_explicit: bool,
    /// The adapters loaded on each instance (DESIGN 4.9), as the adapter owner knows them.
    adapters: Arc<AdapterSets>,
}

/// The adapters loaded on each instance of a base, by instance and by adapter
/// ([`crate::adapters::Adapters::loaded_on`]), for the views and the load read.
#[derive(Debug, Default)]
pub(crate) struct AdapterSets {
    /// (base's deployment ID, index) → the adapters loaded there.
    by_instance: HashMap<(String, u32), Vec<String>>,
    /// Adapter name → the instances that have it, and how many instances of its base are
    /// known (both by the base's ID).
    by_adapter: HashMap<String, Vec<InstanceKey>>,
    /// Base deployment ID → the instances known.
    instances: HashMap<String, usize>,
}

impl AdapterSets {
    pub(crate) fn new(loaded: Vec<(InstanceKey, Vec<String>)>) -> Self {
        let mut sets = Self::default();
        for (key, names) in loaded {
            *sets.instances.entry(key.deployment.clone()).or_default() += 1;
            for n in &names {
                sets.by_adapter
                    .entry(n.clone())
                    .or_default()
                    .push(key.clone());
            }
            sets.by_instance.insert((key.deployment, key.index), names);
        }
        sets
    }
}

impl<'a> Ctx<'a> {
    pub(crate) fn new(config: &'a LifecycleConfig, hosts: &'a Hosts) -> Self {
        Self::with_explicit(config, hosts, any_host_explicit(hosts))
    }

    /// [`Ctx::new`] with [`any_host_explicit`] of `hosts` already asked.
    pub(crate) fn with_explicit(
        config: &'a LifecycleConfig,
        hosts: &'a Hosts,
        any_host_explicit: bool,
    ) -> Self {
        Ctx {
            config,
            hosts,
            any_host_explicit,
            adapters: Arc::default(),
        }
    }

    /// The same with the adapters loaded on each instance.
    pub(crate) fn with_adapters(mut self, adapters: Arc<AdapterSets>) -> Self {
        self.adapters = adapters;
        self
    }
}

/// Some host says `lifecycle.activation: explicit`.
pub(crate) fn any_host_explicit(hosts: &Hosts) -> bool {
    hosts.values().any(|h| h.activation == Activation::Explicit)
}

/// Milliseconds since the Unix epoch.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The state shown: the instance's, with `awaiting_measurement` for a stopped deployment whose
/// checkpoint is not measured yet.
pub(crate) fn shown_state(d: &Dep) -> InstanceState {
    shown(d.state, &d.measurement)
}

fn shown(state: InstanceState, measurement: &Measurement) -> InstanceState {
    if state == InstanceState::Stopped && measurement.awaiting() {
        InstanceState::AwaitingMeasurement
    } else {
        state
    }
}

pub(crate) fn tier_words(t: ParkTier) -> &'static str {
    match t {
        ParkTier::HostRam => "host_ram",
        ParkTier::Deep => "deep",
        ParkTier::KvOnly => "kv_only",
    }
}

fn measurement_view(m: &Measurement) -> Option<MeasurementView> {
    let gpu = m.gpu_memory?;
    let source = match gpu.source {
        MeasureSource::Declared => "declared",
        MeasureSource::Checkpoint => "measured",
        MeasureSource::EngineFootprint => "observed",
    };
    Some(MeasurementView {
        gpu_memory: gpu.bytes,
        weights_memory: m.weights_bytes().unwrap_or(gpu.bytes),
        source: source.to_string(),
    })
}

fn condition(kind: &str, ok: bool, reason: &str, message: String) -> ConditionView {
    ConditionView {
        kind: kind.to_string(),
        status: if ok { "True" } else { "False" }.to_string(),
        reason: reason.to_string(),
        message,
    }
}

/// The hosts a deployment's view names (`hosts`, the HOSTS column): the host its instance is
/// bound to (running, parked, or on its way there); when it is bound to none, the one host
/// there is. NB: none (`-`) when it is bound to none and there are several hosts: placement
/// chooses among all of them when it starts. (Listing every host there instead made each
/// unplaced deployment's view as long as the host list: 10,000 deployments on 1,000 hosts
/// answered 10 million host names per list.)
fn view_hosts(d: &DepShot, hosts: &Hosts) -> Vec<String> {
    match (&d.host, d.bound) {
        (Some(h), true) => vec![h.to_string()],
        _ if hosts.len() == 1 => hosts.keys().cloned().collect(),
        _ => Vec::new(),
    }
}

/// The state a deployment shows, from its instances' (one instance: its own): the most
/// serving one, in this order.
pub(crate) fn deployment_state(units: &[DepShot]) -> InstanceState {
    const ORDER: [InstanceState; 10] = [
        InstanceState::Ready,
        InstanceState::Waking,
        InstanceState::Starting,
        InstanceState::Closed,
        InstanceState::Parking,
        InstanceState::Stopping,
        InstanceState::Parked,
        InstanceState::Failed,
        InstanceState::AwaitingMeasurement,
        InstanceState::Stopped,
    ];
    let shown: Vec<InstanceState> = units.iter().map(DepShot::shown_state).collect();
    ORDER
        .iter()
        .copied()
        .find(|s| shown.contains(s))
        .unwrap_or(InstanceState::Stopped)
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
        id: d.fixed.id.clone(),
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

/// One deployment's view, from its instances' snapshots (index 0 first: [`group`]).
pub(crate) fn deployment_view(units: &[DepShot], cx: &Ctx<'_>) -> DeploymentView {
    deployment_view_with(units, cx, DeploymentDoc::clone(&units[0].fixed.doc))
}

/// Writes deployment views' JSON (byte for byte `serde_json`'s of [`deployment_view`]) without
/// a copy of each one's document: each view is built around one document kept for the
/// purpose (the least there is, so that its encoding costs little), encoded, and that
/// document's encoding at its end (`"spec"` is the last field) replaced by the deployment's
/// own, encoded from the shared one. NB (reads at scale): the
/// deployments list writes 100,000 of these.
#[derive(Default)]
pub(crate) struct ViewWriter {
    /// The document each view is built with, and `,"spec":<its JSON>}`: how a view ends.
    stand_in: Option<(DeploymentDoc, Vec<u8>)>,
}

impl ViewWriter {
    /// Appends the view of `units` to `out`.
    pub(crate) fn write(
        &mut self,
        out: &mut BytesMut,
        units: &[DepShot],
        cx: &Ctx<'_>,
    ) -> serde_json::Result<()> {
        let doc = &units[0].fixed.doc;
        let (stand_in, tail) = match self.stand_in.take() {
            Some(s) => s,
            None => {
                let stand_in = least_document();
                let mut tail = br#","spec":"#.to_vec();
                serde_json::to_writer(&mut tail, &stand_in)?;
                tail.push(b'}');
                (stand_in, tail)
            }
        };
        let start = out.len();
        let view = deployment_view_with(units, cx, stand_in);
        let written = serde_json::to_writer((&mut *out).writer(), &view);
        self.stand_in = Some((view.spec, tail));
        written?;
        let tail = self
            .stand_in
            .as_ref()
            .map_or(&[][..], |(_, t)| t.as_slice());
        if out.ends_with(tail) {
            // Keep `,"spec":`.
            out.truncate(out.len() - tail.len() + br#","spec":"#.len());
            serde_json::to_writer((&mut *out).writer(), &**doc)?;
            out.put_u8(b'}');
            Ok(())
        } else {
            // The view's fields moved: encoded whole (the same bytes, at the old cost).
            out.truncate(start);
            serde_json::to_writer(out.writer(), &deployment_view(units, cx))
        }
    }
}

/// The document whose encoding is the shortest (`{"name":""}`): [`ViewWriter`]'s stand-in,
/// encoded with each view and then replaced.
fn least_document() -> DeploymentDoc {
    DeploymentDoc {
        name: String::new(),
        engine: None,
        model: None,
        residency: None,
        max_concurrent_requests: None,
        extra_args: Vec::new(),
        env: std::collections::BTreeMap::new(),
        resources: None,
        lifecycle: None,
        decision: None,
        replicas: None,
        scale: None,
        gpus_per_instance: None,
        routing: None,
        priority: None,
        adapters: None,
        adapter: None,
    }
}

/// [`deployment_view`] with `spec` as its document.
fn deployment_view_with(units: &[DepShot], cx: &Ctx<'_>, spec: DeploymentDoc) -> DeploymentView {
    let d = &units[0];
    let doc = &d.fixed.doc;
    let state = deployment_state(units);
    let explicit = doc.activation() == Activation::Explicit || cx.any_host_explicit;
    let ready_count = units
        .iter()
        .filter(|u| u.state == InstanceState::Ready)
        .count();
    let replicas = doc.replicas() as usize;
    // An engine believed on a host whose node agent does not answer: what is shown is the
    // last known, and the `Ready` condition says it is unknown now, and why.
    let agent_lost = units.iter().find_map(|u| {
        (!matches!(u.state, InstanceState::Stopped | InstanceState::Failed))
            .then(|| u.host.as_deref().and_then(|h| cx.hosts.get_key_value(h)))
            .flatten()
            .and_then(|(id, h)| Some((id, h.agent.unreachable()?, u.shown_state())))
    });
    let pending = units.iter().any(|u| u.pending_start);
    let last_error = units.iter().find_map(|u| u.last_error.clone());
    let (ready_reason, ready_message) = if let Some((host, why, was)) = &agent_lost {
        (
            "node_agent_unreachable",
            format!(
                "the node agent of host {host} cannot be reached, so the instance's state ({was}) is the last known: {why}"
            ),
        )
    } else if ready_count > 0 {
        (
            "ready",
            if replicas == 1 && units.len() == 1 {
                "the instance serves requests".to_string()
            } else {
                format!("{ready_count} of {replicas} instances serve requests")
            },
        )
    } else if pending {
        (
            "waiting_for_memory",
            "an operator start waits for GPU memory (start --evict parks idle models to make room)"
                .to_string(),
        )
    } else if let Some(e) = last_error {
        ("failed", e)
    } else {
        ("not_running", format!("the instance is {state}"))
    };
    if let Some(adapter) = &doc.adapter {
        return adapter_view(d, &adapter.base, cx, spec);
    }
    let measured = !d.measurement.awaiting();
    let mut hosts: Vec<String> = Vec::new();
    for u in units {
        for h in view_hosts(u, cx.hosts) {
            if !hosts.contains(&h) {
                hosts.push(h);
            }
        }
    }
    DeploymentView {
        id: d.fixed.id.clone(),
        name: doc.name.clone(),
        state,
        ready: format!("{ready_count}/{replicas}"),
        revision: d.fixed.revision,
        hosts,
        activation: if explicit {
            Activation::Explicit
        } else {
            Activation::OnDemand
        },
        warm: doc.warm(),
        operator_stopped: d.operator_stopped,
        engine: doc.engine_kind(),
        model: doc.model_arg().to_string(),
        residency: doc.residency,
        measurement: measurement_view(&d.measurement),
        instances: units
            .iter()
            .map(|u| InstanceView {
                instance_id: u.instance_id().to_string(),
                index: u.fixed.index,
                host_id: u
                    .host(cx.hosts)
                    .map_or_else(|| cx.config.host_id.clone(), |(h, _)| h.clone()),
                generation: u.generation,
                state: u.shown_state(),
                parked_tier: u.tier.map(|t| tier_words(t).to_string()),
                port: u.addr.map(|a| a.port()),
                pid: u.pid,
                last_error: u.last_error.clone(),
            })
            .collect(),
        conditions: vec![
            if agent_lost.is_some() {
                ConditionView {
                    status: "Unknown".to_string(),
                    ..condition("Ready", false, ready_reason, ready_message)
                }
            } else {
                condition("Ready", ready_count > 0, ready_reason, ready_message)
            },
            condition(
                "Measured",
                measured,
                if measured {
                    "measured"
                } else {
                    "awaiting_measurement"
                },
                if measured {
                    "the checkpoint's memory is known".to_string()
                } else if units.iter().any(|u| u.first_answered) {
                    // Started, and still unknown: the host cannot read a process's GPU memory
                    // (no NVML, or GPUs declared in the host document).
                    "the engine's GPU footprint could not be read on this host; it is placed as needing the whole GPU: declare resources.gpu_memory".to_string()
                } else {
                    "no measurement yet: declare resources, or start it with --wait".to_string()
                },
            ),
        ],
        spec,
    }
}

/// Whether `b`, taken after `a` in key order (`State::deps`: a deployment's ID, then its other
/// instances' IDs), is another instance of `a`'s deployment.
fn same_deployment(a: &DepShot, b: &DepShot) -> bool {
    b.fixed.index > 0 && a.fixed.id == b.fixed.id
}

/// Puts each deployment's instances, in snapshots taken in key order, in index order (in
/// place): [`deployments`] then yields them a deployment at a time.
pub(crate) fn order_instances(shots: &mut [DepShot]) {
    for g in shots.chunk_by_mut(same_deployment) {
        if g.len() > 1 {
            g.sort_by_key(|s| s.fixed.index);
        }
    }
}

/// The deployments of `shots` (taken in key order, then [`order_instances`]): each one's
/// instances, index 0 first. NB: slices of one vector, not a vector per deployment (100,000
/// of those were a tenth of a full load read).
pub(crate) fn deployments(shots: &[DepShot]) -> impl Iterator<Item = &[DepShot]> {
    shots.chunk_by(same_deployment)
}

/// Groups snapshots taken in key order by deployment, each group's instances in index order.
pub(crate) fn group(mut shots: Vec<DepShot>) -> Vec<Vec<DepShot>> {
    order_instances(&mut shots);
    let mut out: Vec<Vec<DepShot>> = Vec::new();
    for s in shots {
        match out.last_mut() {
            Some(g) if g.last().is_some_and(|l| same_deployment(l, &s)) => g.push(s),
            _ => out.push(vec![s]),
        }
    }
    out
}

/// What CapyCTL passes or expects before the engine says (the deployment's figure).
fn expected_max_running(
    spec: &InstanceSpec,
    config: &LifecycleConfig,
    host: Option<&Host>,
) -> MaxRunning {
    let settings = host.map_or(&config.host_settings, |h| &h.settings);
    max_running(&MaxRunningInput {
        engine: spec.engine,
        declared: spec.max_concurrent_requests,
        extra_args: &spec.extra_args,
        host_command: &settings.engine(spec.engine).command,
        engine_reported: None,
        hybrid_checkpoint: false,
        sized_on_host: host.is_some_and(|h| h.remote),
    })
}

/// The sample as the load read shows it: `None` when none is held or it is older than
/// [`STALE_SAMPLE_KEPT_MS`].
pub(crate) fn sample_view(s: &LoadSample, now_ms: u64, ingress: u64) -> Option<SampleView> {
    let age = now_ms.saturating_sub(s.sampled_at_ms);
    if age > STALE_SAMPLE_KEPT_MS {
        return None;
    }
    Some(SampleView {
        sampled_at_ms: s.sampled_at_ms,
        age_ms: age,
        fresh: age < STALE_AFTER_MS,
        ingress_in_flight: ingress,
        // NB: the API's engine figures are all-or-nothing; one the engine did not report
        // makes `engine` null rather than a made-up zero.
        engine: s.engine.and_then(|e| {
            Some(EngineLoadView {
                running: e.running?,
                waiting: e.waiting?,
                kv_usage_ppm: u64::from(e.kv_usage_ppm?),
            })
        }),
    })
}

/// What a host's deployments hold, for its view (summed under the lock from the by-host index).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct HostUse {
    /// GPU memory: loaded instances, and what parked engines still hold.
    pub gpu: u64,
    /// Host RAM: the copies of engines parked there.
    pub parked_in_host_ram: u64,
}

impl HostUse {
    /// What `deps`, the deployments on a host of `capacity` bytes, hold.
    pub(crate) fn of<'a>(capacity: u64, deps: impl Iterator<Item = &'a Dep>) -> Self {
        let mut used = HostUse::default();
        for d in deps {
            used.gpu += if d.occupies() {
                d.need(capacity)
            } else {
                d.parked_holds()
            };
            if d.state == InstanceState::Parked && d.tier == Some(ParkTier::HostRam) {
                used.parked_in_host_ram += d.measurement.weights_bytes().unwrap_or(0);
            }
        }
        used
    }
}

/// A host's view.
pub(crate) fn host_view(
    id: &str,
    host: &Host,
    inv: Option<&Inventory>,
    used: HostUse,
    cordoned: bool,
) -> HostView {
    let mut left = used.gpu;
    HostView {
        id: id.to_string(),
        gpus: inv
            .map(|i| {
                i.gpus
                    .iter()
                    .map(|g| {
                        let here = left.min(g.total_bytes);
                        left -= here;
                        GpuView {
                            index: g.index,
                            uuid: g.uuid.clone(),
                            memory: g.total_bytes,
                            unified: g.unified,
                            used: here,
                        }
                    })
                    .collect()
            })
            .unwrap_or_default(),
        host_memory: inv.map_or(0, |i| i.host_memory.total_bytes),
        host_memory_used: used.parked_in_host_ram,
        activation: host.activation,
        cordoned,
        unreachable: host.agent.unreachable(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use capyctl_interfaces::load::EngineLoad;
    use std::time::Duration;

    /// A sample taken at `at` (for the load views' tests too).
    pub(super) fn sample(at: u64, engine: Option<EngineLoad>) -> LoadSample {
        LoadSample {
            sampled_at_ms: at,
            took: Duration::from_millis(2),
            engine,
        }
    }

    #[test]
    fn a_sample_is_fresh_then_stale_then_dropped() {
        let e = Some(EngineLoad {
            running: Some(3),
            waiting: Some(0),
            kv_usage_ppm: Some(121_000),
        });
        let v = sample_view(&sample(1000, e), 1400, 3).expect("held");
        assert_eq!((v.age_ms, v.fresh, v.ingress_in_flight), (400, true, 3));
        assert_eq!(v.engine.map(|e| e.kv_usage_ppm), Some(121_000));
        let v = sample_view(&sample(1000, e), 4000, 0).expect("kept");
        assert!(!v.fresh);
        assert!(sample_view(&sample(1000, e), 1000 + 30_001, 0).is_none());
    }

    #[test]
    fn unknown_engine_figures_are_null_never_zero() {
        let e = Some(EngineLoad {
            running: Some(1),
            waiting: None,
            kv_usage_ppm: Some(5),
        });
        assert_eq!(
            sample_view(&sample(10, e), 20, 0).expect("held").engine,
            None
        );
        assert_eq!(
            sample_view(&sample(10, None), 20, 0).expect("held").engine,
            None
        );
    }
}
