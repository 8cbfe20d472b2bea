//! What the management API shows: deployment views, the load read and the host view, as pure
//! functions of snapshots.
//!
//! NB (reads at scale): a read never builds its views under the lifecycle's lock. It copies each
//! deployment into a [`DepShot`] under the lock (O(1) per deployment: the document is shared
//! through [`Fixed`], not copied), a chunk of deployments at a time, and the hosts as
//! one shared map ([`Hosts`]); the views, the JSON and the host agents' calls all happen after
//! the lock is let go (`Core::shots`).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use capyctl_engine_rules::max_running::{MaxRunningInput, max_running};
use capyctl_interfaces::inventory::Inventory;
use capyctl_interfaces::launch::MaxRunning;
use capyctl_interfaces::load::LoadSample;
use capyctl_interfaces::measure::Measurement;
use capyctl_interfaces::router::InstanceKey;
use capyctl_interfaces::tier::ParkTier;
use capyctl_spec::api::{
    EngineLoadView, GpuView, HostView, STALE_AFTER_MS, STALE_SAMPLE_KEPT_MS, SampleView,
};
use capyctl_spec::documents::DeploymentDoc;
use capyctl_spec::{Activation, InstanceState};

use crate::LifecycleConfig;
use crate::state::{Dep, Host, Hosts};
use crate::store::DeploymentRecord;

mod json;
mod list;
mod load;
pub(crate) use list::{deployment_view, write_deployment_view};
pub(crate) use load::{LoadChunk, LoadUnit, load_view, write_load_view};

/// What a deployment's views show that only a deploy changes: shared (one `Arc`) between the
/// deployment and every snapshot of it, renewed when its revision moves on.
///
/// NB (memory and reads at scale): its four texts (the ID, the instance's ID, the load view's
/// head and the document's JSON) are one allocation ([`Fixed::text`]): a full load read
/// compares the ID with the router's, writes the head and looks the instance's sample up by
/// its ID, all from one place (four allocations were a memory access each per deployment, and
/// some 100 bytes of the allocator's own). The ID is not written twice: it begins the
/// instance's ID (`<id>-<index>`).
#[derive(Debug)]
pub(crate) struct Fixed {
    /// The revision it was taken at.
    pub revision: u64,
    /// Its document (its record's, shared): what the views read of its spec too (no
    /// [`capyctl_interfaces::spec::InstanceSpec`] is kept per deployment: `Dep::spec`).
    pub doc: Arc<DeploymentDoc>,
    /// Its instance's index.
    pub index: u32,
    /// Where [`Fixed::text`]'s first three parts end (the first two both begin at 0).
    ends: [u32; 3],
    /// One after the other: its instance's ID (`super::instance_id_at`), whose first part is
    /// the deployment's ID; how its load view's JSON begins ([`load_head`]: written as it is
    /// by each full load read, [`write_load_view`]); its document's JSON (`serde_json`'s:
    /// written as it is as the `spec` of each of its views in the deployments list,
    /// [`write_deployment_view`], from its first instance's; empty for the others, and where it
    /// did not encode, then encoded by each view. NB (reads at scale): some 100-200 bytes per
    /// deployment kept, against a fifth of the list's CPU encoding it per view).
    text: Box<str>,
}

impl Fixed {
    /// Of instance `index` of `rec`.
    pub(crate) fn of(rec: &DeploymentRecord, index: u32) -> Self {
        let instance_id = super::instance_id_at(&rec.id, index);
        let head = load::load_head(&rec.id, &rec.doc.name);
        // Only the first instance's is written (a deployment's view reads its first unit's).
        let spec_json = if index == 0 {
            serde_json::to_string(&*rec.doc).unwrap_or_default()
        } else {
            String::new()
        };
        let end = |len: usize| u32::try_from(len).unwrap_or(u32::MAX);
        let mut text = String::with_capacity(instance_id.len() + head.len() + spec_json.len());
        text.push_str(&instance_id);
        text.push_str(&head);
        let ends = [
            end(rec.id.len()),
            end(instance_id.len()),
            end(instance_id.len() + head.len()),
        ];
        text.push_str(&spec_json);
        Fixed {
            revision: rec.revision,
            doc: Arc::clone(&rec.doc),
            index,
            ends,
            text: text.into_boxed_str(),
        }
    }

    /// [`Fixed::text`]'s part `i` (0 and 1 both begin at 0: the ID begins the instance's ID).
    fn part(&self, i: usize) -> &str {
        let start = i
            .checked_sub(1)
            .filter(|&j| j > 0)
            .map_or(0, |j| self.ends[j] as usize);
        let end = self.ends.get(i).map_or(self.text.len(), |&e| e as usize);
        self.text.get(start..end).unwrap_or_default()
    }

    /// The deployment's ID.
    pub(crate) fn id(&self) -> &str {
        self.part(0)
    }

    /// Its instance's ID.
    pub(crate) fn instance_id(&self) -> &str {
        self.part(1)
    }

    /// How its load view's JSON begins ([`load_head`]).
    fn load_head(&self) -> &str {
        self.part(2)
    }

    /// Its document's JSON; empty where it did not encode.
    fn spec_json(&self) -> &[u8] {
        self.part(3).as_bytes()
    }

    fn name(&self) -> &str {
        &self.doc.name
    }
}

/// Asks for the memory a read copies of `d` (its record's fields, its [`Fixed`], its texts and
/// its document) without using it. NB (reads at scale): a chunk's deployments are fetched so, one
/// after the other, before any is copied: each is a few memory accesses that depend on one
/// another (the boxed `Dep`, then its `Fixed`, then its texts), so a copy that follows them
/// deployment by deployment waits for each access in turn, where these loads, independent
/// across deployments, are in flight together.
pub(crate) fn fetch(d: &Dep) {
    let f = &*d.fixed;
    std::hint::black_box((
        d.state,
        d.rec.generation,
        // The bytes themselves, not their addresses: `black_box` of a reference reads nothing.
        f.text.as_bytes().first().copied(),
        f.text.as_bytes().get(f.ends[2] as usize).copied(),
        f.doc.max_concurrent_requests,
    ));
}

/// One deployment as the views show it, copied under the lifecycle's lock in O(1) (see the
/// module's NB).
#[derive(Debug, Clone)]
pub(crate) struct DepShot {
    /// Its ID and document (shared).
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
        }
    }

    /// Its ID.
    pub(crate) fn id(&self) -> &str {
        self.fixed.id()
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
        self.fixed.instance_id()
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
    ORDER
        .iter()
        .copied()
        .find(|s| units.iter().any(|u| u.shown_state() == *s))
        .unwrap_or(InstanceState::Stopped)
}

/// Whether `b`, taken after `a` in key order (`State::deps`: a deployment's ID, then its other
/// instances' IDs), is another instance of `a`'s deployment.
fn same_deployment(a: &DepShot, b: &DepShot) -> bool {
    b.fixed.index > 0 && a.fixed.id() == b.fixed.id()
}

/// Puts each deployment's instances, in snapshots taken in key order, in index order (in
/// place): [`deployments`] then yields them a deployment at a time.
pub(crate) fn order_instances(shots: &mut [DepShot]) {
    in_index_order(shots, same_deployment, |s| s.fixed.index);
}

/// Puts each deployment's units, taken in key order, in index order (in place): `same` says
/// that two units are of one deployment, `index` is a unit's index (the snapshots', the load
/// read's `LoadChunk`).
pub(crate) fn in_index_order<T>(
    units: &mut [T],
    mut same: impl FnMut(&T, &T) -> bool,
    mut index: impl FnMut(&T) -> u32,
) {
    for g in units.chunk_by_mut(|a, b| same(a, b)) {
        if g.len() > 1 {
            g.sort_by_key(&mut index);
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
    doc: &DeploymentDoc,
    config: &LifecycleConfig,
    host: Option<&Host>,
) -> MaxRunning {
    let settings = host.map_or(&config.host_settings, |h| &h.settings);
    let engine = doc.engine_kind();
    max_running(&MaxRunningInput {
        engine,
        declared: doc.max_concurrent_requests,
        extra_args: &doc.extra_args,
        host_command: &settings.engine(engine).command,
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
