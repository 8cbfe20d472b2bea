//! The lifecycle's state and its rules: [`State`], owned by the lifecycle's owner task
//! (`owner.rs`), the one writer. Its methods decide on the state they change, take the time
//! (`now`) where a rule reads it, and never wait: no host agent, no router, no store is called
//! here. A record a rule changes is noted in [`State::dirty`] and written by the next save;
//! engine calls run between two calls, on the caller's task (see `lifecycle/DESIGN.md`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use capyctl_node_agent::HostAgent;
use capyctl_node_agent::launch::MaxRunning;
use capyctl_node_agent::measure::Measurement;
use capyctl_node_agent::spec::{HostSettings, InstanceSpec};
use capyctl_node_agent::tier::ParkTier;
use capyctl_router::coordinator::LastUses;
use capyctl_router::lifecycle::{InstanceKey, Plan, PlanFor};
use capyctl_spec::errors::ApiError;
use capyctl_spec::{Activation, InstanceState};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::placement::{Fit, Hold, Holder, place};
use crate::store::DeploymentRecord;
use crate::{engine_addr, not_found, parked_room, split_instance_id, views};

/// One instance of a deployment (a *unit*: the lifecycle's rules take one instance at a time),
/// with its deployment's record. Index 0 is keyed by the deployment's ID, index `i` by its
/// instance ID `<deployment id>-<i>` ([`unit_id`]); the units of one deployment share what the
/// deployment's record says (the document, the operator's flags: [`State::sync_units`]) and
/// keep their own generation and first answer.
#[derive(Debug)]
pub(crate) struct Dep {
    /// Its key in [`State::deps`] ([`unit_id`]).
    pub(crate) unit: String,
    /// Its instance's index within the deployment.
    pub(crate) index: u32,
    /// The GPUs (indexes on its host) its engine is given, when its host has several; empty:
    /// the whole host (one GPU, or none known).
    pub(crate) gpus: Vec<u32>,
    pub(crate) rec: DeploymentRecord,
    pub(crate) spec: InstanceSpec,
    pub(crate) measurement: Measurement,
    pub(crate) state: InstanceState,
    /// An engine operation is in progress (the state says which).
    pub(crate) busy: bool,
    /// Reserved as a victim by this switch or release.
    pub(crate) reserved: Option<String>,
    /// The target of this switch (memory promised, not yet starting).
    pub(crate) claim: Option<String>,
    /// The host its instance is placed on (claimed, running, parked, or last run on).
    pub(crate) host: Option<String>,
    /// What its engine still holds on the GPU while parked (the agent's reading or estimate).
    pub(crate) parked_gpu: Option<u64>,
    /// Where the engine answers (from the host agent's `base_url`: loopback for child
    /// processes, the Pod's IP for engine Pods).
    pub(crate) addr: Option<SocketAddr>,
    pub(crate) pid: Option<u32>,
    pub(crate) tier: Option<ParkTier>,
    pub(crate) last_error: Option<String>,
    /// The last state change that counts as use (a request's start or end is the router's to
    /// record: [`Dep::used_at`] reads both).
    pub(crate) last_used: Instant,
    /// When it last failed on its own (a start, wake, park or stop that failed, its engine
    /// exited): the scaler's back-off ([`FAILED_BACKOFF`]) counts from here. `None` while it
    /// never did, and when its host lost its engine ([`Dep::lost`]).
    pub(crate) failed_at: Option<Instant>,
    pub(crate) max_running: Option<MaxRunning>,
    /// Set (once per bring-up) to end the start or wake in progress: what its waiting requests
    /// and the bring-up's caller get (`deployment_stopped` for a stop, `model_not_found` for
    /// a delete, `unavailable` for `start --evict` of another model). See
    /// [`Server::end_bring_up`].
    pub(crate) end: watch::Sender<Option<ApiError>>,
    /// The start or wake last ended could not stop its engine (the agent's error): the engine
    /// may still hold its GPU memory, so `start --evict` does not count it as released.
    /// Cleared when the next bring-up begins.
    pub(crate) ended_stop_failed: Option<String>,
    /// The start or wake in progress (or last begun) is an operator's: `start`, a pending
    /// start, `start --evict`, `preinitialize`. Another model's requests never end it
    /// ([`Victims::Idle`]); only the operator's `stop`, `delete` or another `start --evict`
    /// do. Set by every [`State::begin_up`].
    pub(crate) operator_up: bool,
    /// Where its requests' last use is read: the router's record ([`RouterUses`]; set by
    /// [`State::insert`]).
    pub(crate) uses: RouterUses,
    /// Marked gone when it is dropped: the name cache's entries for it are stale then.
    pub(crate) presence: PresenceOf,
    /// What the views show of its record that only a deploy changes, shared with the reads
    /// that build views outside the lock (renewed when the revision moves on).
    pub(crate) fixed: Arc<views::Fixed>,
}

impl Dep {
    pub(crate) fn new(rec: DeploymentRecord) -> Self {
        Self::replica(rec, 0)
    }

    /// Instance `index` of the deployment `rec` records.
    pub(crate) fn replica(rec: DeploymentRecord, index: u32) -> Self {
        let spec = InstanceSpec::from_doc(rec.id.clone(), &rec.doc);
        let fixed = Arc::new(views::Fixed::of(&rec, spec.clone(), index));
        Self {
            unit: unit_id(&rec.id, index),
            index,
            gpus: Vec::new(),
            rec,
            spec,
            measurement: Measurement::default(),
            state: InstanceState::Stopped,
            busy: false,
            reserved: None,
            claim: None,
            host: None,
            parked_gpu: None,
            addr: None,
            pid: None,
            tier: None,
            last_error: None,
            last_used: Instant::now(),
            failed_at: None,
            max_running: None,
            end: watch::channel(None).0,
            ended_stop_failed: None,
            operator_up: false,
            uses: RouterUses::default(),
            presence: PresenceOf(Arc::new(AtomicBool::new(false))),
            fixed,
        }
    }

    /// Renews what the views share of its record after a deploy changed it.
    pub(crate) fn renew_fixed(&mut self) {
        self.fixed = Arc::new(views::Fixed::of(&self.rec, self.spec.clone(), self.index));
    }

    /// Its last use: the later of a request's start or end (as the router records it, read
    /// without a turn of its task) and the last state change that counts as use.
    pub(crate) fn used_at(&self) -> Instant {
        self.uses
            .of(&self.rec.id)
            .map_or(self.last_used, |t| t.max(self.last_used))
    }

    /// The spec its engine starts with: its deployment's, on the GPUs placement chose for it
    /// (`CUDA_VISIBLE_DEVICES`) when its host has several. Those are NVML's indices (PCI bus
    /// order, as `nvidia-smi` numbers them), so `CUDA_DEVICE_ORDER=PCI_BUS_ID` goes with them:
    /// CUDA's own default order puts the fastest GPU first, which on a box of mixed GPUs would
    /// give the engine other GPUs than the ones whose memory was counted for it.
    pub(crate) fn launch_spec(&self) -> InstanceSpec {
        let mut spec = self.spec.clone();
        if !self.gpus.is_empty() {
            let list: Vec<String> = self.gpus.iter().map(u32::to_string).collect();
            spec.env
                .insert(crate::VISIBLE_DEVICES.to_string(), list.join(","));
            spec.env
                .insert("CUDA_DEVICE_ORDER".to_string(), "PCI_BUS_ID".to_string());
        }
        spec
    }

    /// Marks it failed, with `why`: its engine is gone (no address, process or tier), and the
    /// scaler's back-off starts now.
    pub(crate) fn fail(&mut self, why: String) {
        self.state = InstanceState::Failed;
        self.tier = None;
        self.addr = None;
        self.pid = None;
        self.last_error = Some(why);
        self.failed_at = Some(Instant::now());
    }

    /// Marks it failed because its host no longer has its engine (a node agent that came
    /// back without it): the engine did not fail on its own, so no back-off holds it.
    pub(crate) fn lost(&mut self, why: String) {
        self.fail(why);
        self.failed_at = None;
    }

    /// In the scaler's back-off: failed on its own less than [`FAILED_BACKOFF`] before `now`.
    pub(crate) fn backing_off(&self, now: Instant) -> bool {
        self.state == InstanceState::Failed
            && self
                .failed_at
                .is_some_and(|at| now.saturating_duration_since(at) < FAILED_BACKOFF)
    }

    /// Nothing runs, is on its way or is reserved for it: dropping it loses nothing.
    pub(crate) fn holds_nothing(&self) -> bool {
        !self.busy
            && self.reserved.is_none()
            && self.claim.is_none()
            && matches!(
                self.state,
                InstanceState::Stopped | InstanceState::Failed | InstanceState::AwaitingMeasurement
            )
    }

    /// A start or a wake is in progress.
    pub(crate) fn bringing_up(&self) -> bool {
        self.busy && matches!(self.state, InstanceState::Starting | InstanceState::Waking)
    }

    /// Its key in [`State::deps`]: the deployment's ID for index 0, else its instance ID.
    pub(crate) fn id(&self) -> &str {
        &self.unit
    }

    /// Its deployment's ID.
    pub(crate) fn dep_id(&self) -> &str {
        &self.rec.id
    }

    pub(crate) fn name(&self) -> &str {
        &self.rec.doc.name
    }

    pub(crate) fn instance_id(&self) -> String {
        crate::instance_id_at(&self.rec.id, self.index)
    }

    /// Whether the engine holds GPU memory now.
    pub(crate) fn occupies(&self) -> bool {
        matches!(
            self.state,
            InstanceState::Starting
                | InstanceState::Ready
                | InstanceState::Closed
                | InstanceState::Parking
                | InstanceState::Waking
                | InstanceState::Stopping
        )
    }

    /// GPU memory it needs awake: the measurement, or the whole GPU when unknown.
    pub(crate) fn need(&self, capacity: u64) -> u64 {
        self.measurement
            .gpu_memory
            .map(|m| m.bytes)
            .unwrap_or(capacity)
    }

    /// The host its instance is bound to: where it holds GPU memory, is parked, or is claimed
    /// or on its way. `None` when it may be placed on any host.
    pub(crate) fn bound_host(&self) -> Option<&str> {
        let bound = self.occupies() || self.state == InstanceState::Parked || self.claim.is_some();
        if bound { self.host.as_deref() } else { None }
    }

    /// Whether it holds GPU memory, or is promised it: its engine holds memory, it is claimed by
    /// a switch, or it is parked with a residue on the GPU (what placement counts).
    pub(crate) fn holds_gpu(&self) -> bool {
        self.occupies() || self.claim.is_some() || self.parked_holds() > 0
    }

    /// GPU memory its parked engine holds (0 unless parked).
    pub(crate) fn parked_holds(&self) -> u64 {
        if self.state == InstanceState::Parked {
            self.parked_gpu.unwrap_or(0)
        } else {
            0
        }
    }

    /// What it would still hold on the GPU once parked: the agent's estimate of a parked
    /// engine's residue, or 0 when it stops instead of parking.
    pub(crate) fn residue_if_parked(&self) -> u64 {
        if !self.parks() {
            return 0;
        }
        capyctl_node_agent::measure::parked_estimate(
            self.measurement.weights_bytes(),
            self.spec.speculative(),
            self.spec.tensor_parallel.unwrap_or(1),
        )
        .unwrap_or(0)
    }

    /// Whether it parks when released (not TensorFold, `restart_only` or a decision model).
    pub(crate) fn parks(&self) -> bool {
        parked_room::parks(&self.spec)
    }

    /// Ready, starting, waking, or claimed by a switch that brings it up.
    pub(crate) fn up(&self) -> bool {
        matches!(
            self.state,
            InstanceState::Starting | InstanceState::Ready | InstanceState::Waking
        ) || self.claim.is_some()
    }

    /// Running or on its way (what explicit activation admits requests for).
    pub(crate) fn running_or_coming(&self) -> bool {
        self.up() || self.rec.pending_start
    }

    /// The key of its instance, on its host (`default_host` while it has none).
    pub(crate) fn key(&self, default_host: &str) -> InstanceKey {
        State::key_of(self, self.host.as_deref().unwrap_or(default_host))
    }

    pub(crate) fn warm(&self) -> bool {
        self.rec.doc.warm()
    }
}

/// The key in [`State::deps`] of instance `index` of deployment `deployment`: the deployment's
/// ID for index 0 (so every rule that names a deployment names its first instance), its
/// instance ID `<deployment id>-<index>` otherwise.
pub(crate) fn unit_id(deployment: &str, index: u32) -> String {
    if index == 0 {
        deployment.to_string()
    } else {
        crate::instance_id_at(deployment, index)
    }
}

/// The unit ([`unit_id`]) an instance ID names.
pub(crate) fn deployment_of(instance_id: &str) -> Option<String> {
    split_instance_id(instance_id).map(|(dep, index)| unit_id(dep, index))
}

/// The deployment ID of a unit key ([`unit_id`]).
pub(crate) fn dep_of_unit(unit: &str) -> &str {
    split_instance_id(unit).map_or(unit, |(dep, _)| dep)
}

/// The instance ID of a unit key ([`unit_id`]).
pub(crate) fn unit_instance(unit: &str) -> String {
    let (dep, index) = split_instance_id(unit).unwrap_or((unit, 0));
    crate::instance_id_at(dep, index)
}

/// The unit an instance key names.
pub(crate) fn unit_of_key(key: &InstanceKey) -> String {
    unit_id(&key.deployment, key.index)
}

/// How long the scaler leaves a failed instance before it brings it up again.
pub(crate) const FAILED_BACKOFF: Duration = Duration::from_secs(30);

/// One deployment as the scaler reads it ([`State::scale_inputs`]).
#[derive(Debug, Clone)]
pub(crate) struct ScaleInput {
    pub(crate) deployment: String,
    pub(crate) replicas: u32,
    pub(crate) scale: Option<capyctl_spec::documents::Scale>,
    pub(crate) stopped: bool,
    pub(crate) units: Vec<crate::scale::UnitInfo>,
}

/// A plan's or an operator release's reservation.
#[derive(Debug, Default)]
pub(crate) struct Reservation {
    pub(crate) target: Option<String>,
    pub(crate) victims: Vec<String>,
    /// The victims stop instead of parking (a parked engine's residue would be in the way).
    pub(crate) stop: bool,
    /// An operator's plan (`start --evict`): its target's bring-up is the operator's
    /// ([`Dep::operator_up`]).
    pub(crate) operator: bool,
}

/// What the rules changed: the records to save, and the deployments whose instances the owner
/// brings in step at the end of its turn.
#[derive(Debug, Default)]
pub(crate) struct Dirty {
    /// The IDs of the records changed and not written yet (deleted ones too). The rules mark
    /// them (`&mut`, no lock); a save takes them under the state's read lock (the one thing a
    /// reader changes, behind a mutex of its own), and gives them back when its write fails.
    unsaved: std::sync::Mutex<BTreeSet<String>>,
    /// The deployments touched in this turn of the owner ([`State::sync_touched`] takes them).
    touched: BTreeSet<String>,
}

impl Dirty {
    /// Marks `id`'s record for the next save (a unit's: its deployment's record), and its
    /// deployment's instances to be brought in step at the end of the owner's turn
    /// ([`State::sync_touched`]).
    pub(crate) fn mark(&mut self, id: &str) {
        let id = dep_of_unit(id);
        if !self.touched.contains(id) {
            self.touched.insert(id.to_string());
        }
        let set = self
            .unsaved
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        if !set.contains(id) {
            set.insert(id.to_string());
        }
    }

    /// Whether `id`'s record waits for a save.
    pub(crate) fn has(&self, id: &str) -> bool {
        self.lock().contains(id)
    }

    /// Whether any record waits for a save.
    pub(crate) fn any(&self) -> bool {
        !self.lock().is_empty()
    }

    /// Takes the IDs marked (a save).
    pub(crate) fn take(&self) -> BTreeSet<String> {
        std::mem::take(&mut *self.lock())
    }

    /// Gives back the IDs of a save whose write failed.
    pub(crate) fn give_back(&self, ids: BTreeSet<String>) {
        self.lock().extend(ids);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<String>> {
        self.unsaved.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Every host, by ID: shared as a whole with the reads that build views outside the lock
/// (replaced, copy on write, when a host joins).
pub(crate) type Hosts = Arc<BTreeMap<String, Arc<Host>>>;

#[derive(Debug, Default)]
pub(crate) struct State {
    /// By ID.
    pub(crate) deps: BTreeMap<String, Dep>,
    /// Deployment IDs by name (kept by [`State::insert`] and [`State::remove`]; a name never
    /// changes: a deploy of the same name is the same deployment).
    pub(crate) by_name: HashMap<String, String>,
    /// IDs whose records changed since they were last written (deleted ones too): the next
    /// save writes them ([`Server::save`]).
    pub(crate) dirty: Dirty,
    pub(crate) reservations: HashMap<String, Reservation>,
    /// Every host, by ID.
    pub(crate) hosts: Hosts,
    /// The deployments whose instance is on each host (`Dep::host`: claimed, running, parked,
    /// or last run there), by host ID: placement and the host view read a host's deployments
    /// without scanning all of them. Kept by [`State::set_host`], the one writer of
    /// `Dep::host` (and [`State::remove`]).
    pub(crate) by_host: HashMap<String, BTreeSet<String>>,
    /// The hosts drained and out of service (`capyctl drain host`): placement passes them by.
    pub(crate) cordoned: BTreeSet<String>,
    /// The deployments that may hold GPU memory on each host (bound there since
    /// [`State::prune_holding`] last found them holding): what placement reads.
    pub(crate) holding: HashMap<String, BTreeSet<String>>,
    /// The router's record of last uses, shared with every deployment ([`Dep::used_at`]).
    pub(crate) uses: RouterUses,
    /// The deployments with more than one instance (or instances past their `replicas`):
    /// what the scaler reads (kept by [`State::sync_units`] and [`State::remove`]).
    pub(crate) replicated: BTreeSet<String>,
    /// The deployments with several instances an operator parked: the scaler brings none of
    /// their instances up again until a request or a start brings one up ([`State::begin_up`]).
    pub(crate) operator_parked: BTreeSet<String>,
    /// The deployments with several instances whose idle timer took an instance down, and
    /// when: the scaler brings none of their instances up again until the deployment is used
    /// after that (a request: the router's last use; a start: [`State::begin_up`]). Else the
    /// scaler woke each instance the timer parked (the others, ready, said the deployment was
    /// in use), and a deployment of several instances never idled out.
    pub(crate) idle_taken: HashMap<String, Instant>,
    /// The host an instance's key names while it is on none (standalone's one host).
    pub(crate) host_id: String,
    /// Some host says `lifecycle.activation: explicit`: every deployment is explicit then.
    pub(crate) any_host_explicit: bool,
    /// Switches are held (the operator's leader cannot reach the API server: hold-over):
    /// every switch, start, wake, park and stop is refused with this (see [`State::hold`]).
    pub(crate) held: Option<ApiError>,
    /// The fence after a takeover (see [`State::set_fence`]).
    pub(crate) fence: Option<Fence>,
}

/// The instances a new leader adopted as ready from a leader that may still serve them (it
/// did not release its Lease): not parked or stopped until `until` ([`State::set_fence`]).
#[derive(Debug, Clone)]
pub(crate) struct Fence {
    /// When the previous leader has stopped serving at the latest.
    pub(crate) until: Instant,
    /// The deployments adopted ready.
    pub(crate) ids: BTreeSet<String>,
}

/// The router's record of each deployment's last use (its requests' starts and ends,
/// [`CoordinatorHandle::last_used`]), once a router is attached: one shared cell, so that
/// [`Dep::used_at`] reads it wherever a deployment is at hand. Reading it takes a read lock of
/// its own and no turn of the router's task.
#[derive(Debug, Clone, Default)]
pub(crate) struct RouterUses(pub(crate) Arc<RwLock<Option<LastUses>>>);

impl RouterUses {
    /// Requests the router forwards to instance `index` of `deployment` now.
    pub(crate) fn in_flight_of(&self, deployment: &str, index: u32) -> usize {
        self.0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map_or(0, |u| u.in_flight_of(deployment, index))
    }

    pub(crate) fn of(&self, deployment: &str) -> Option<Instant> {
        self.0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()?
            .of(deployment)
    }

    pub(crate) fn attach(&self, uses: LastUses) {
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = Some(uses);
    }
}

/// A host the lifecycle places instances on.
#[derive(Clone)]
pub(crate) struct Host {
    /// Its agent (in-process, or a node agent over HTTP).
    pub(crate) agent: Arc<dyn HostAgent>,
    /// Its `lifecycle.activation`.
    pub(crate) activation: Activation,
    /// Its engine commands (shown by `engine list`, and what `max_running` expects).
    pub(crate) settings: HostSettings,
    /// Its admission window, where it differs from the router's: given to the router with
    /// each switch on this host.
    pub(crate) admission_window: Option<Duration>,
    /// A node agent reached over HTTP: its engines' launch inputs are the host's to read.
    pub(crate) remote: bool,
    /// Total GPU memory, bytes.
    pub(crate) capacity: u64,
    /// Its GPUs, as its inventory said when it joined (the switch records name them).
    pub(crate) gpus: Vec<capyctl_node_agent::inventory::GpuInfo>,
}

impl std::fmt::Debug for Host {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Host")
            .field("activation", &self.activation)
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

impl State {
    pub(crate) fn by_name_or_id(&self, key: &str) -> Option<&Dep> {
        self.deps.get(key).or_else(|| self.by_name(key))
    }

    pub(crate) fn by_name(&self, name: &str) -> Option<&Dep> {
        self.by_name.get(name).and_then(|id| self.deps.get(id))
    }

    /// Every instance of deployment `dep` (its units: [`unit_id`]), in key order.
    pub(crate) fn units_of<'a>(&'a self, dep: &'a str) -> impl Iterator<Item = &'a Dep> + 'a {
        self.deps
            .range::<str, _>((std::ops::Bound::Included(dep), std::ops::Bound::Unbounded))
            .take_while(move |(k, _)| {
                k.as_str() == dep || k.strip_prefix(dep).is_some_and(|r| r.starts_with('-'))
            })
            .map(|(_, d)| d)
            .filter(move |d| d.rec.id == dep)
    }

    /// The unit keys of deployment `dep`'s instances.
    pub(crate) fn unit_ids(&self, dep: &str) -> Vec<String> {
        self.units_of(dep).map(|d| d.unit.clone()).collect()
    }

    /// Adds `dep` (a name already known keeps its deployment: the first one loaded), with its
    /// other instances ([`State::sync_units`]).
    pub(crate) fn insert(&mut self, mut dep: Dep) {
        dep.uses = self.uses.clone();
        self.by_name
            .entry(dep.name().to_string())
            .or_insert_with(|| dep.rec.id.clone());
        let id = dep.rec.id.clone();
        self.deps.insert(id.clone(), dep);
        self.sync_units(&id);
    }

    /// Brings the instances of every deployment whose record changed in this turn in step
    /// with it ([`State::sync_units`]); the owner runs it after each turn.
    pub(crate) fn sync_touched(&mut self) {
        for id in std::mem::take(&mut self.dirty.touched) {
            self.sync_units(&id);
        }
    }

    /// Keeps deployment `dep`'s instances in step with its record (instance 0's): one unit per
    /// replica, each with the record's document, revision and operator's flags (its
    /// generation, first answer and pending start are its own) and the deployment's
    /// measurement; units past `replicas` that hold nothing are dropped (those still running
    /// are stopped by the scaler first: [`State::surplus`]).
    pub(crate) fn sync_units(&mut self, dep: &str) {
        let Some(first) = self.deps.get(dep).filter(|d| d.index == 0) else {
            return;
        };
        let replicas = first.rec.doc.replicas();
        let mut measurement = first.measurement;
        let learnt = self
            .units_of(dep)
            .map(|d| d.measurement)
            .find(|m| m.gpu_memory.is_some());
        if measurement.gpu_memory.is_none()
            && let Some(m) = learnt
        {
            measurement = m;
            if let Some(first) = self.deps.get_mut(dep) {
                first.measurement = m;
            }
        }
        let Some(first) = self.deps.get(dep) else {
            return;
        };
        let rec = first.rec.clone();
        for index in 1..replicas {
            let unit = unit_id(dep, index);
            match self.deps.get_mut(&unit) {
                Some(d) => {
                    if d.rec.revision != rec.revision || d.rec.doc != rec.doc {
                        d.rec.doc = rec.doc.clone();
                        d.rec.revision = rec.revision;
                        d.spec = InstanceSpec::from_doc(rec.id.clone(), &rec.doc);
                        d.renew_fixed();
                    }
                    d.rec.operator_stopped = rec.operator_stopped;
                    d.rec.operator_started = rec.operator_started;
                    if d.measurement.gpu_memory.is_none() {
                        d.measurement = measurement;
                    }
                }
                None => {
                    let mut own = rec.clone();
                    own.generation = 0;
                    own.first_answer = None;
                    own.pending_start = false;
                    let mut d = Dep::replica(own, index);
                    d.measurement = measurement;
                    d.uses = self.uses.clone();
                    self.deps.insert(unit, d);
                }
            }
        }
        let gone: Vec<String> = self
            .units_of(dep)
            .filter(|d| d.index >= replicas && d.holds_nothing())
            .map(|d| d.unit.clone())
            .collect();
        for unit in gone {
            self.set_host(&unit, None);
            self.deps.remove(&unit);
        }
        if self.units_of(dep).nth(1).is_some() {
            if !self.replicated.contains(dep) {
                self.replicated.insert(dep.to_string());
            }
        } else {
            self.replicated.remove(dep);
        }
    }

    /// The deployments with an instance past `replicas` that holds nothing any more (the
    /// scaler stopped it, or it failed): [`State::sync_units`] drops it.
    pub(crate) fn settled_surplus(&self) -> Vec<String> {
        self.replicated
            .iter()
            .filter(|id| {
                self.deps.get(*id).is_some_and(|first| {
                    let replicas = first.rec.doc.replicas();
                    self.units_of(id)
                        .any(|u| u.index >= replicas && u.holds_nothing())
                })
            })
            .cloned()
            .collect()
    }

    /// What the scaler reads of each deployment with several instances
    /// ([`crate::scale::decide`]): its replicas, scale, operator's stop and instances.
    pub(crate) fn scale_inputs(&self, now: Instant) -> Vec<ScaleInput> {
        self.replicated
            .iter()
            .filter_map(|id| {
                let first = self.deps.get(id)?;
                let mut units: Vec<crate::scale::UnitInfo> = self
                    .units_of(id)
                    .map(|u| crate::scale::UnitInfo {
                        unit: u.unit.clone(),
                        index: u.index,
                        state: u.state,
                        // A failed instance is brought up again only after a back-off: an
                        // engine that crashes at once is not restarted every tick.
                        held: u.busy
                            || u.reserved.is_some()
                            || u.claim.is_some()
                            || u.backing_off(now),
                        claimed: u.claim.is_some(),
                    })
                    .collect();
                units.sort_by_key(|u| u.index);
                Some(ScaleInput {
                    deployment: id.clone(),
                    replicas: first.rec.doc.replicas(),
                    scale: first.rec.doc.scale(),
                    // Parked by an operator or put away idle, held or fenced: the scaler
                    // moves nothing either.
                    stopped: first.rec.operator_stopped
                        || self.scaler_kept_off(id)
                        || self.held.is_some()
                        || self.fence.is_some(),
                    units,
                })
            })
            .collect()
    }

    /// The ready instances of the deployments with several, with their host's agent and
    /// instance ID: whose engines' waiting counts the router's `least_loaded` reads
    /// (`Server::feed_engine_loads`).
    pub(crate) fn engine_feeds(&self) -> Vec<(InstanceKey, Arc<dyn HostAgent>, String)> {
        self.replicated
            .iter()
            .flat_map(|id| self.units_of(id))
            .filter(|u| u.state == InstanceState::Ready)
            .filter_map(|u| {
                let host = u.host.as_deref()?;
                let agent = Arc::clone(&self.hosts.get(host)?.agent);
                Some((Self::key_of(u, host), agent, u.instance_id()))
            })
            .collect()
    }

    /// The scaler brings none of `dep`'s instances up: an operator parked it
    /// ([`State::operator_parked`]), or its idle timer took an instance down and nothing has
    /// used it since ([`State::idle_taken`]).
    fn scaler_kept_off(&self, dep: &str) -> bool {
        self.operator_parked.contains(dep)
            || self
                .idle_taken
                .get(dep)
                .is_some_and(|at| self.uses.of(dep).is_none_or(|used| used <= *at))
    }

    /// The scaler's bring-up of `unit` (see [`crate::scale`]): into free room only, never
    /// naming a victim; `None` when there is none now, or it is not free to come up.
    pub(crate) fn scale_up(&mut self, unit: &str, now: Instant) -> Option<Up> {
        let d = self.deps.get(unit)?;
        let free = !d.busy
            && d.reserved.is_none()
            && d.claim.is_none()
            && !d.rec.operator_stopped
            && matches!(
                d.state,
                InstanceState::Parked | InstanceState::Stopped | InstanceState::Failed
            );
        if !free || self.held.is_some() || self.scaler_kept_off(dep_of_unit(unit)) {
            return None;
        }
        let (placed, fit) = self.place_target(unit, &BTreeSet::new(), Victims::None, now);
        if fit != Fit::Now {
            return None;
        }
        self.set_placed(unit, placed);
        // The scaler's: no operator asked for it.
        self.begin_up(unit, false, now)
    }

    /// Removes deployment `id` (every instance; the first is returned).
    pub(crate) fn remove(&mut self, id: &str) -> Option<Dep> {
        self.replicated.remove(id);
        self.operator_parked.remove(id);
        self.idle_taken.remove(id);
        for unit in self.unit_ids(id) {
            if unit != id {
                self.set_host(&unit, None);
                self.deps.remove(&unit);
            }
        }
        self.set_host(id, None);
        let dep = self.deps.remove(id)?;
        if self.by_name.get(dep.name()).is_some_and(|i| i == id) {
            self.by_name.remove(dep.name());
        }
        Some(dep)
    }

    pub(crate) fn release_reservation(&mut self, rid: &str) {
        if let Some(r) = self.reservations.remove(rid) {
            for v in r.victims {
                if let Some(d) = self.deps.get_mut(&v)
                    && d.reserved.as_deref() == Some(rid)
                {
                    d.reserved = None;
                }
            }
            if let Some(t) = r.target
                && let Some(d) = self.deps.get_mut(&t)
                && d.claim.as_deref() == Some(rid)
            {
                d.claim = None;
            }
        }
    }
}

/// The by-host index.
impl State {
    /// Binds (or unbinds) deployment `id`'s instance to `host`, keeping the by-host indexes:
    /// a deployment bound to a host is among its possible GPU holders (`holding`) until
    /// [`State::prune_holding`] finds it holds nothing there.
    pub(crate) fn set_host(&mut self, id: &str, host: Option<String>) {
        let Some(d) = self.deps.get_mut(id) else {
            return;
        };
        if d.host != host
            && let Some(old) = d.host.take()
        {
            for index in [&mut self.by_host, &mut self.holding] {
                if let Some(ids) = index.get_mut(&old) {
                    ids.remove(id);
                    if ids.is_empty() {
                        index.remove(&old);
                    }
                }
            }
        }
        if let Some(new) = &host {
            for index in [&mut self.by_host, &mut self.holding] {
                let ids = index.entry(new.clone()).or_default();
                if !ids.contains(id) {
                    ids.insert(id.to_string());
                }
            }
        }
        d.host = host;
    }

    /// Binds unit `id` where a placement chose: its host, and the GPUs there.
    pub(crate) fn set_placed(&mut self, id: &str, placed: Placed) {
        self.set_host(id, placed.host);
        if let Some(d) = self.deps.get_mut(id) {
            d.gpus = placed.gpus;
        }
    }

    /// Lets go, in the GPU holders' index, of the deployments that hold nothing on their host
    /// any more (stopped, failed, or parked with nothing left on the GPU): placement then reads
    /// a host's holders without going through every deployment that ever ran there. Run by
    /// the rules that place (`plan`, `start`, `start_pending`, `preinitialize`) before they do;
    /// each deployment is let go once, so it costs what changed since the last one.
    pub(crate) fn prune_holding(&mut self) {
        let deps = &self.deps;
        self.holding.retain(|host, ids| {
            ids.retain(|id| {
                deps.get(id)
                    .is_some_and(|d| d.host.as_deref() == Some(host.as_str()) && d.holds_gpu())
            });
            !ids.is_empty()
        });
    }

    /// The deployments that may hold GPU memory on `host` (a superset of those that do,
    /// until [`State::prune_holding`]), by ID.
    fn holding_on<'a>(&'a self, host: &'a str) -> impl Iterator<Item = &'a Dep> + 'a {
        self.holding
            .get(host)
            .into_iter()
            .flatten()
            .filter_map(|id| self.deps.get(id))
            .filter(move |d| d.host.as_deref() == Some(host))
    }

    /// The deployments whose instance is on `host` (`Dep::host`), by ID.
    pub(crate) fn on_host<'a>(&'a self, host: &'a str) -> impl Iterator<Item = &'a Dep> + 'a {
        self.by_host
            .get(host)
            .into_iter()
            .flatten()
            .filter_map(|id| self.deps.get(id))
            .filter(move |d| d.host.as_deref() == Some(host))
    }
}

/// Whom a placement may name as victims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Victims {
    /// Nobody: a start without `--evict` (and a pending one) waits for memory instead.
    None,
    /// Idle ready instances and parked engines, and starts or wakes in progress that no
    /// request waits for and no operator asked for ([`Dep::operator_up`]): a request's switch.
    /// A start that hangs once its requests gave up is then ended (its engine stopped, as a
    /// stop ends it) for another model's requests, without an operator.
    Idle,
    /// Those, and the operator's starts or wakes in progress that no request waits for
    /// (`start --evict`): they are ended, their engines stopped.
    IdleAndBringUps,
}

/// How an instance is to be brought up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Up {
    Wake,
    Start,
}

/// A deployment's presence flag for the name cache: marks it gone when the deployment is
/// dropped.
#[derive(Debug)]
pub(crate) struct PresenceOf(pub(crate) Arc<AtomicBool>);

impl Drop for PresenceOf {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Among GPUs of equal rank, which victims go first: those that run no request now, then the
/// longest idle.
type VictimOrder = (bool, std::cmp::Reverse<Duration>);

/// One GPU as [`State::place_on_gpus`] reads it: its bytes, the instance's share of its
/// memory there, and what holds that GPU.
type GpuRoom<'a> = (u64, u64, Vec<Holder<'a>>);

/// `victims` (sorted), each GPU's choice for an instance over several GPUs (`rooms`), less
/// those the others make unneeded: a victim that spans several of these GPUs frees its share on
/// each, so the victim another GPU named beside it may not be needed at all. Tried for removal
/// the most recently used first; one goes when every GPU still has room with the rest released
/// (parked, keeping their residue; stopped, none, when `stop`).
fn fewest_victims(rooms: &[GpuRoom<'_>], mut victims: Vec<String>, stop: bool) -> Vec<String> {
    let idle_for = |id: &str| {
        rooms
            .iter()
            .flat_map(|(_, _, on_gpu)| on_gpu.iter())
            .find(|h| h.id == id)
            .map_or(Duration::ZERO, |h| h.idle_for)
    };
    let room_with = |released: &[String]| {
        rooms.iter().all(|(cap, need, on_gpu)| {
            let held: u64 = on_gpu
                .iter()
                .map(|h| {
                    if released.iter().any(|v| v == h.id) {
                        h.left_after_release(stop)
                    } else {
                        h.bytes
                    }
                })
                .sum();
            cap.saturating_sub(held) >= *need
        })
    };
    let mut order = victims.clone();
    order.sort_by_key(|id| (idle_for(id), id.clone()));
    for id in order {
        let without: Vec<String> = victims.iter().filter(|v| **v != id).cloned().collect();
        if room_with(&without) {
            victims = without;
        }
    }
    victims
}

/// A GPU that may take an instance ([`State::place_on_gpus`]): its index, the fit there, its
/// rank, the order of its victims, and its room.
type GpuChoice<'a> = (u32, Fit, (u8, u64), VictimOrder, GpuRoom<'a>);

/// A placement on some GPUs of a host: the GPUs, the fit, and its rank ([`rank_of`]).
type GpuPlacement = (Vec<u32>, Fit, (u8, u64));

/// Where [`State::place_target`] would put an instance: the host (`None` when it fits nowhere
/// now), and the GPUs there (empty: the host as a whole).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Placed {
    pub(crate) host: Option<String>,
    pub(crate) gpus: Vec<u32>,
}

/// How good a placement on a host (or GPU) of `capacity` is, lower first: room now (the
/// fullest that fits), then victims that park before victims that must stop (fewest bytes
/// first), then later. `None` for `Never`.
fn rank_of(fit: &Fit, capacity: u64, need: u64, holders: &[Holder<'_>]) -> Option<(u8, u64)> {
    Some(match fit {
        Fit::Now => {
            let used: u64 = holders.iter().map(|h| h.bytes).sum();
            (0, capacity.saturating_sub(used).saturating_sub(need))
        }
        Fit::After(victims) | Fit::AfterStopping(victims) => (
            if matches!(fit, Fit::After(_)) { 1 } else { 2 },
            holders
                .iter()
                .filter(|h| victims.iter().any(|v| v == h.id))
                .map(|h| h.bytes)
                .sum(),
        ),
        Fit::Later => (3, 0),
        Fit::Never(_) => return None,
    })
}

/// Why nothing is placed on the drained `hosts`.
fn cordoned_words(hosts: &[&str]) -> String {
    let (which, them) = match hosts {
        [one] => (format!("host {one} is"), format!("host {one}")),
        _ => (
            format!("every host ({}) is", hosts.join(", ")),
            "one of them".to_string(),
        ),
    };
    format!("{which} drained and out of service; `capyctl uncordon host` puts {them} back")
}

/// The rules.
impl State {
    /// The key of `d`'s instance on `host`.
    pub(crate) fn key_of(d: &Dep, host: &str) -> InstanceKey {
        InstanceKey {
            deployment: d.rec.id.clone(),
            index: d.index,
            host_id: host.to_string(),
            generation: d.rec.generation,
        }
    }

    /// "A model is explicit when its deployment or any host it may run on says so."
    pub(crate) fn explicit(&self, d: &Dep) -> bool {
        d.rec.doc.activation() == Activation::Explicit || self.any_host_explicit
    }

    /// Where `target` fits: on the host its instance is bound to (parked there, say), or on the
    /// best of all hosts: one with room now (the fullest that fits: large models keep room
    /// elsewhere), else the one needing the fewest victim bytes, else `Later` where some host
    /// could take it once memory frees. `Never` only when no host can ever take it.
    pub(crate) fn place_target(
        &mut self,
        target: &str,
        protected: &BTreeSet<String>,
        victims: Victims,
        now: Instant,
    ) -> (Placed, Fit) {
        let (host, gpus, fit) = self.place_target_gpus(target, protected, victims, now);
        (Placed { host, gpus }, fit)
    }

    /// [`State::place_target`], with the GPUs chosen on the host (empty: the host as a whole).
    fn place_target_gpus(
        &mut self,
        target: &str,
        protected: &BTreeSet<String>,
        victims: Victims,
        now: Instant,
    ) -> (Option<String>, Vec<u32>, Fit) {
        self.prune_holding();
        let Some(d) = self.deps.get(target) else {
            return (
                None,
                Vec::new(),
                Fit::Never(format!("deployment {target} is not known")),
            );
        };
        let bound = d.bound_host();
        let mut best: Option<((u8, u8, u64), &String, Fit)> = None;
        let mut never = Vec::new();
        // Bound: its host only. NB: each host's holders come from the holders' index
        // (`holding`, pruned above), so a placement reads the hosts and what holds memory on
        // them, never every deployment per host, nor every one that ever ran there.
        // A drained host (cordoned) takes nothing: a deployment bound to one waits until the
        // drain has stopped it (then it may go elsewhere), and one free to go anywhere goes
        // elsewhere; nowhere else to go is said at once.
        if bound.is_some_and(|b| self.cordoned.contains(b)) {
            return (None, Vec::new(), Fit::Later);
        }
        if bound.is_none()
            && !self.hosts.is_empty()
            && self.hosts.keys().all(|h| self.cordoned.contains(h))
        {
            let all: Vec<&str> = self.hosts.keys().map(String::as_str).collect();
            return (None, Vec::new(), Fit::Never(cordoned_words(&all)));
        }
        let candidates: Box<dyn Iterator<Item = (&String, &Arc<Host>)>> = match bound {
            Some(b) => Box::new(self.hosts.get_key_value(b).into_iter()),
            None => Box::new(
                self.hosts
                    .iter()
                    .filter(|(id, _)| !self.cordoned.contains(*id)),
            ),
        };
        // Instances go to hosts that run none of their deployment's yet, where they can: among
        // hosts with the same kind of fit (room now, victims, later), one that does ranks
        // after every one that does not.
        let siblings_on = |host: &str| {
            self.units_of(&d.rec.id)
                .any(|u| u.unit != d.unit && u.holds_gpu() && u.host.as_deref() == Some(host))
        };
        let mut best_gpus: Vec<u32> = Vec::new();
        let want = d.rec.doc.gpus_per_instance() as usize;
        for (id, host) in candidates {
            // A host whose GPUs are listed has too few (one whose GPUs are not listed is
            // taken as it says).
            if !host.gpus.is_empty() && want > host.gpus.len() {
                never.push((
                    id,
                    format!(
                        "it needs {want} GPUs (gpus_per_instance) and the host has {}",
                        host.gpus.len()
                    ),
                ));
                continue;
            }
            let holders = self.holders(id, target, protected, victims, now);
            let (gpus, fit, rank) = if host.gpus.len() > 1 {
                match self.place_on_gpus(d, id, host, &holders, victims != Victims::None) {
                    Ok(placed) => placed,
                    Err(why) => {
                        never.push((id, why));
                        continue;
                    }
                }
            } else {
                let need = d.need(host.capacity);
                let fit = place(host.capacity, need, &holders, victims != Victims::None);
                let Some(rank) = rank_of(&fit, host.capacity, need, &holders) else {
                    if let Fit::Never(why) = fit {
                        never.push((id, why));
                    }
                    continue;
                };
                (Vec::new(), fit, rank)
            };
            let rank = (rank.0, u8::from(siblings_on(id)), rank.1);
            if best.as_ref().is_none_or(|(r, _, _)| rank < *r) {
                best = Some((rank, id, fit));
                best_gpus = gpus;
            }
        }
        match best {
            Some((_, id, fit)) => (Some(id.clone()), best_gpus, fit),
            None if never.is_empty() => (
                None,
                Vec::new(),
                Fit::Never(match bound {
                    Some(b) => format!("its host {b} is not known"),
                    None => "no host is known".to_string(),
                }),
            ),
            None if self.hosts.len() == 1 => (None, Vec::new(), Fit::Never(never.remove(0).1)),
            None => (
                None,
                Vec::new(),
                Fit::Never(
                    never
                        .iter()
                        .map(|(h, why)| format!("on host {h}: {why}"))
                        .collect::<Vec<_>>()
                        .join("; "),
                ),
            ),
        }
    }

    /// Where `d`'s instance fits on the GPUs of `host` (a host with several): on
    /// `gpus_per_instance` GPUs that run no other instance of its deployment (the ones it is
    /// bound to, when parked there), each taking its share of the instance's memory, chosen
    /// as a host is (room now, the fullest that fits; else the fewest victim bytes). `holders`
    /// are the host's; one whose GPUs are not known counts on every GPU. `Err` says why it
    /// never fits there.
    fn place_on_gpus(
        &self,
        d: &Dep,
        host_id: &str,
        host: &Host,
        holders: &[Holder<'_>],
        evict: bool,
    ) -> Result<GpuPlacement, String> {
        // NB: `want` is at most the host's GPUs (`place_target_gpus`).
        let want = d.rec.doc.gpus_per_instance() as usize;
        let bound: &[u32] = if d.bound_host().is_some() {
            &d.gpus
        } else {
            &[]
        };
        let taken: BTreeSet<u32> = self
            .units_of(&d.rec.id)
            // NB: bound there, not only holding memory: a parked sibling whose residue is not
            // known still wakes on its GPUs.
            .filter(|u| u.unit != d.unit && u.bound_host() == Some(host_id))
            .flat_map(|u| u.gpus.iter().copied())
            .collect();
        let gpus_of = |id: &str| -> &[u32] { self.deps.get(id).map_or(&[], |h| h.gpus.as_slice()) };
        // Each GPU that may take it: its index, the fit there, its rank, whether a victim it
        // names runs requests now (the router's count: a deployment's last use is every one of
        // its instances'), and how long they have been idle; among equal ranks the victims
        // that run nothing, then the longest idle, go first.
        let mut each: Vec<GpuChoice<'_>> = Vec::new();
        let mut never = Vec::new();
        for gpu in &host.gpus {
            if !bound.is_empty() && !bound.contains(&gpu.index) {
                continue;
            }
            if bound.is_empty() && taken.contains(&gpu.index) {
                continue;
            }
            let cap = gpu.total_bytes;
            let need = d
                .measurement
                .gpu_memory
                .map_or(cap, |m| m.bytes.div_ceil(want as u64));
            let on_gpu: Vec<Holder<'_>> = holders
                .iter()
                .filter_map(|h| {
                    let theirs = gpus_of(h.id);
                    if !theirs.is_empty() && !theirs.contains(&gpu.index) {
                        return None;
                    }
                    let n = theirs.len().max(1) as u64;
                    Some(Holder {
                        bytes: (h.bytes / n).min(cap),
                        keeps: h.keeps / n,
                        ..h.clone()
                    })
                })
                .collect();
            let fit = place(cap, need, &on_gpu, evict);
            let idle = match &fit {
                Fit::After(v) | Fit::AfterStopping(v) => (
                    v.iter().any(|id| {
                        self.deps
                            .get(id)
                            .is_some_and(|u| u.uses.in_flight_of(u.dep_id(), u.index) > 0)
                    }),
                    std::cmp::Reverse(
                        on_gpu
                            .iter()
                            .filter(|h| v.iter().any(|id| id == h.id))
                            .map(|h| h.idle_for)
                            .min()
                            .unwrap_or_default(),
                    ),
                ),
                _ => (false, std::cmp::Reverse(Duration::ZERO)),
            };
            match rank_of(&fit, cap, need, &on_gpu) {
                Some(rank) => each.push((gpu.index, fit, rank, idle, (cap, need, on_gpu))),
                None => {
                    if let Fit::Never(why) = fit {
                        never.push(format!("GPU {}: {why}", gpu.index));
                    }
                }
            }
        }
        if each.len() < want {
            let free = each.len();
            return Err(if never.is_empty() || taken.len() + free >= want {
                format!(
                    "its other instances already run on {} of the host's {} GPUs, and each instance needs GPUs of its own",
                    taken.len(),
                    host.gpus.len()
                )
            } else {
                never.join("; ")
            });
        }
        each.sort_by_key(|(index, _, rank, idle, _)| (*rank, *idle, *index));
        each.truncate(want);
        let gpus: Vec<u32> = each.iter().map(|(i, _, _, _, _)| *i).collect();
        let worst = each
            .iter()
            .map(|(_, _, r, _, _)| *r)
            .max()
            .unwrap_or((0, 0));
        let mut stop = false;
        let mut victims: Vec<String> = Vec::new();
        let mut later = false;
        let mut rooms: Vec<GpuRoom<'_>> = Vec::with_capacity(each.len());
        for (_, fit, _, _, room) in each {
            rooms.push(room);
            match fit {
                Fit::Now => {}
                Fit::After(v) => victims.extend(v),
                Fit::AfterStopping(v) => {
                    stop = true;
                    victims.extend(v);
                }
                Fit::Later | Fit::Never(_) => later = true,
            }
        }
        victims.sort();
        victims.dedup();
        if !later && rooms.len() > 1 {
            victims = fewest_victims(&rooms, victims, stop);
        }
        let fit = if later {
            Fit::Later
        } else if victims.is_empty() {
            Fit::Now
        } else if stop {
            Fit::AfterStopping(victims)
        } else {
            Fit::After(victims)
        };
        let rank = match fit {
            Fit::Now => (0, worst.1),
            _ => worst,
        };
        Ok((gpus, fit, rank))
    }

    /// The GPU holders of `host` as placement sees them, for bringing up `target`.
    pub(crate) fn holders<'a>(
        &'a self,
        host: &'a str,
        target: &str,
        protected: &BTreeSet<String>,
        victims: Victims,
        now: Instant,
    ) -> Vec<Holder<'a>> {
        let capacity = self.hosts.get(host).map_or(0, |h| h.capacity);
        let target_dep = dep_of_unit(target);
        self.holding_on(host)
            .filter(|d| d.id() != target && d.holds_gpu())
            .map(|d| {
                // NB: an explicit or warm model that is draining, parking or stopping on an
                // operator's command (reserved by it; never by a switch) is on its way out:
                // its memory frees soon, so others wait for it instead of being refused.
                let leaving = d.reserved.is_some()
                    || matches!(d.state, InstanceState::Parking | InstanceState::Stopping);
                // A parked target a switch has claimed is about to take its whole memory.
                let parked = d.state == InstanceState::Parked && d.claim.is_none();
                // A start or wake no request waits for (those with waiting requests are
                // `protected`), ended for the target (it stops): `start --evict` ends any such,
                // a request's switch those no operator asked for.
                let ends = match victims {
                    Victims::None => false,
                    Victims::Idle => !d.operator_up,
                    Victims::IdleAndBringUps => true,
                } && d.bringing_up()
                    && d.end.borrow().is_none();
                let hold = if (self.explicit(d) || d.warm()) && !leaving {
                    Hold::Pinned
                } else if d.dep_id() == target_dep {
                    // Another instance of the target's own deployment: never its victim.
                    Hold::Busy
                } else if (ends
                    || matches!(d.state, InstanceState::Ready | InstanceState::Parked) && !d.busy)
                    && d.reserved.is_none()
                    && d.claim.is_none()
                    && !protected.contains(d.dep_id())
                    // A fenced instance (adopted from a leader that may still serve it) is
                    // released only once the fence ends: meanwhile placement waits (`Later`).
                    && !self.fenced(d.id())
                {
                    Hold::Releasable
                } else {
                    Hold::Busy
                };
                Holder {
                    id: d.id(),
                    name: d.name(),
                    bytes: if parked {
                        d.parked_holds()
                    } else {
                        d.need(capacity)
                    },
                    hold,
                    idle_for: now.saturating_duration_since(d.used_at()),
                    parked,
                    keeps: if parked || ends {
                        0
                    } else {
                        d.residue_if_parked()
                    },
                }
            })
            .collect()
    }

    /// Marks `id` as coming up and says how; `operator`: an operator asked for it
    /// ([`Dep::operator_up`]).
    pub(crate) fn begin_up(&mut self, id: &str, operator: bool, now: Instant) -> Option<Up> {
        if let Some(f) = &mut self.fence {
            // Brought up by this leader: no longer the previous leader's.
            f.ids.remove(id);
        }
        // In use again: the scaler brings up the other instances (never called by the scaler
        // for a deployment it keeps off: `scale_up`).
        self.operator_parked.remove(dep_of_unit(id));
        self.idle_taken.remove(dep_of_unit(id));
        let d = self.deps.get_mut(id)?;
        if std::mem::take(&mut d.rec.pending_start) || d.state != InstanceState::Parked {
            // A pending start taken, a new generation: saved by the bring-up.
            self.dirty.mark(id);
        }
        d.claim = None;
        d.busy = true;
        d.last_error = None;
        d.last_used = now;
        d.end = watch::channel(None).0;
        d.ended_stop_failed = None;
        d.operator_up = operator;
        if d.state == InstanceState::Parked {
            d.parked_gpu = None;
            d.state = InstanceState::Waking;
            Some(Up::Wake)
        } else {
            d.state = InstanceState::Starting;
            d.rec.generation += 1;
            d.rec.first_answer = None;
            Some(Up::Start)
        }
    }

    /// Whether requests may bring deployment `id` up now (see [`crate::Lifecycle`]'s
    /// `admissible`).
    pub(crate) fn admissible(&self, id: &str) -> Result<(), ApiError> {
        let Some(d) = self.deps.get(id) else {
            return Err(not_found(id));
        };
        if d.rec.operator_stopped {
            return Err(ApiError::DeploymentStopped {
                deployment: id.to_string(),
            });
        }
        let dep = dep_of_unit(id);
        if self.explicit(d) && !self.units_of(dep).any(Dep::running_or_coming) {
            return Err(ApiError::DeploymentInactive {
                deployment: id.to_string(),
            });
        }
        // Held: only what is ready or already on its way serves; nothing is switched.
        if let Some(e) = &self.held
            && !self.units_of(dep).any(|u| {
                matches!(
                    u.state,
                    InstanceState::Ready | InstanceState::Starting | InstanceState::Waking
                )
            })
        {
            return Err(e.clone());
        }
        Ok(())
    }

    /// Plans bringing `target` up for `who` (see [`PlanFor`]): reserves the victims and
    /// claims the target. An operator's plan (`start --evict`) may also name starts and wakes
    /// in progress that no request waits for ([`Victims::IdleAndBringUps`]); it does not ask
    /// whether requests may bring the target up (the operator's start is what does).
    pub(crate) fn plan(
        &mut self,
        target: &str,
        protected: &BTreeSet<String>,
        who: PlanFor,
        switch_id: String,
        now: Instant,
    ) -> Result<Plan, ApiError> {
        if who == PlanFor::Requests {
            self.admissible(target)?;
        }
        if !self.deps.contains_key(target) {
            return Err(not_found(target));
        }
        // The instance to bring up: one already on its way says so; else a parked one (a wake
        // is quicker than a start), else a stopped one; `Later` while every one is busy. An
        // operator's `start --evict` makes room for every instance it starts
        // ([`State::unit_to_fill`]).
        let pick = match who {
            PlanFor::Requests => self.unit_to_bring_up(target),
            PlanFor::Operator => self.unit_to_fill(target),
        };
        let target = match pick {
            Some(unit) => unit,
            None => return Ok(Plan::AlreadyComing),
        };
        let target = target.as_str();
        let Some(d) = self.deps.get(target) else {
            return Err(not_found(target));
        };
        // NB: an operator start that waits for memory (`pending_start`) never evicts; a
        // request for the same deployment plans as usual and may, taking the start over.
        if d.claim.is_some() {
            return Ok(Plan::AlreadyComing);
        }
        match d.state {
            InstanceState::Ready | InstanceState::Starting | InstanceState::Waking => {
                return Ok(Plan::AlreadyComing);
            }
            _ if d.busy || d.reserved.is_some() => return Ok(Plan::Later),
            InstanceState::Closed | InstanceState::Parking | InstanceState::Stopping => {
                return Ok(Plan::Later);
            }
            _ => {}
        }
        if let Some(e) = &self.held {
            return Err(e.clone());
        }
        let policy = match who {
            PlanFor::Requests => Victims::Idle,
            PlanFor::Operator => Victims::IdleAndBringUps,
        };
        let (placed, fit) = self.place_target(target, protected, policy, now);
        let plan = match fit {
            Fit::Now => {
                self.reservations.insert(
                    switch_id.clone(),
                    Reservation {
                        target: Some(target.to_string()),
                        victims: Vec::new(),
                        stop: false,
                        operator: who == PlanFor::Operator,
                    },
                );
                // NB: a pending operator start stays pending until the bring-up begins
                // (`begin_up` takes it): a switch given back leaves it waiting as before.
                if let Some(d) = self.deps.get_mut(target) {
                    d.claim = Some(switch_id.clone());
                }
                self.set_placed(target, placed);
                Plan::BringUp { switch_id }
            }
            Fit::After(ref victims) | Fit::AfterStopping(ref victims) => {
                let stop = matches!(fit, Fit::AfterStopping(_));
                let victims = victims.clone();
                let window = placed
                    .host
                    .as_ref()
                    .and_then(|h| self.hosts.get(h))
                    .and_then(|h| h.admission_window);
                // The router drains the ready victims; parked ones (stopped for what they still
                // hold on the GPU) and starts or wakes in progress (ended) are the lifecycle's
                // alone.
                let mut keys = Vec::new();
                for v in &victims {
                    if let Some(vd) = self.deps.get_mut(v) {
                        vd.reserved = Some(switch_id.clone());
                        if vd.state == InstanceState::Ready {
                            let host = vd.host.as_deref().unwrap_or(self.host_id.as_str());
                            keys.push(Self::key_of(vd, host));
                        }
                    }
                }
                if let Some(d) = self.deps.get_mut(target) {
                    d.claim = Some(switch_id.clone());
                }
                self.set_placed(target, placed);
                self.reservations.insert(
                    switch_id.clone(),
                    Reservation {
                        target: Some(target.to_string()),
                        victims,
                        stop,
                        operator: who == PlanFor::Operator,
                    },
                );
                if keys.is_empty() {
                    Plan::BringUp { switch_id }
                } else {
                    Plan::Switch {
                        switch_id,
                        victims: keys,
                        // The window of the host where the switch happens.
                        window,
                    }
                }
            }
            Fit::Later => Plan::Later,
            Fit::Never(detail) => {
                return Err(ApiError::DoesNotFit {
                    deployment: target.to_string(),
                    detail,
                });
            }
        };
        Ok(plan)
    }

    /// The instance of deployment `dep` a plan brings up: `None` when one is ready, coming or
    /// claimed (the plan is "already coming"); else the first parked one that nothing holds,
    /// else the first stopped or failed one, else the first instance (whose state then says
    /// `Later`). Only instances within `replicas` count.
    pub(crate) fn unit_to_bring_up(&self, dep: &str) -> Option<String> {
        let replicas = self.deps.get(dep).map_or(1, |d| d.rec.doc.replicas());
        if self.units_of(dep).any(|u| u.index < replicas && u.up()) {
            return None;
        }
        Some(self.next_to_bring_up(dep, replicas, |_| true))
    }

    /// Of deployment `dep`'s instances within `replicas` that nothing holds (no operation, no
    /// reservation) and that `may` come up, the one to bring up first: a parked one (a wake
    /// is quicker than a start), else the lowest index; the first instance when there is none
    /// (its state then says `Later` or "already coming").
    fn next_to_bring_up(&self, dep: &str, replicas: u32, may: impl Fn(&Dep) -> bool) -> String {
        self.units_of(dep)
            .filter(|u| u.index < replicas && !u.busy && u.reserved.is_none() && may(u))
            .min_by_key(|u| (u.state != InstanceState::Parked, u.index))
            .map_or_else(|| dep.to_string(), |u| u.unit.clone())
    }

    /// The instance of deployment `dep` an operator's `start --evict` brings up next: one that
    /// is not up while fewer than the instances a start runs (`replicas`, or `scale.min`, at
    /// least one) are ready or on their way; `None` once they are. One instance: as
    /// [`State::unit_to_bring_up`].
    pub(crate) fn unit_to_fill(&self, dep: &str) -> Option<String> {
        let Some(first) = self.deps.get(dep) else {
            return Some(dep.to_string());
        };
        let replicas = first.rec.doc.replicas();
        if replicas == 1 {
            return self.unit_to_bring_up(dep);
        }
        let (wanted, up) = self.filled(dep);
        if up >= wanted {
            return None;
        }
        Some(self.next_to_bring_up(dep, replicas, |u| {
            u.claim.is_none()
                && matches!(
                    u.state,
                    InstanceState::Parked
                        | InstanceState::Stopped
                        | InstanceState::Failed
                        | InstanceState::AwaitingMeasurement
                )
        }))
    }

    /// How many of deployment `dep`'s instances an operator's start wants up, and how many
    /// are ready or on their way.
    pub(crate) fn filled(&self, dep: &str) -> (usize, usize) {
        let Some(first) = self.deps.get(dep) else {
            return (0, 0);
        };
        let replicas = first.rec.doc.replicas();
        let wanted = first
            .rec
            .doc
            .scale()
            .map_or(replicas, |s| s.min.max(1))
            .min(replicas) as usize;
        let up = self
            .units_of(dep)
            .filter(|u| u.index < replicas)
            .filter(|u| u.up())
            .count();
        (wanted, up)
    }

    /// Begins taking `id` down: `Ok(Some(true))` ready (drain first),
    /// `Ok(Some(false))` parked (stop directly), `Ok(None)` nothing runs.
    pub(crate) fn begin_down(&mut self, id: &str, rid: &str) -> Result<Option<bool>, ApiError> {
        self.command_refusal(id)?;
        let d = self.deps.get_mut(id).ok_or_else(|| not_found(id))?;
        if d.busy || d.reserved.is_some() || d.claim.is_some() {
            return Err(ApiError::Conflict {
                detail: format!(
                    "deployment {} is {} now; try again once that has finished",
                    d.name(),
                    views::shown_state(d)
                ),
            });
        }
        d.rec.pending_start = false;
        let down = match d.state {
            InstanceState::Ready => Some(true),
            InstanceState::Parked => Some(false),
            _ => return Ok(None),
        };
        // Reserved like a switch's victim: nothing else wakes, plans or stops it meanwhile.
        d.reserved = Some(rid.to_string());
        self.reservations.insert(
            rid.to_string(),
            Reservation {
                target: None,
                victims: vec![id.to_string()],
                ..Reservation::default()
            },
        );
        Ok(down)
    }
}

/// Engine exits.
impl State {
    /// An engine exited by itself on `host`: a ready, draining or parked instance there is
    /// `failed` (the next request starts it afresh, unless it is explicit); the key to tell
    /// the router is gone. Nothing for an instance with an operation in progress (the
    /// operation sees the failure itself), nor for an engine of a host it left.
    pub(crate) fn engine_exited(
        &mut self,
        host: &str,
        exit: &capyctl_node_agent::agent::EngineExit,
    ) -> Option<InstanceKey> {
        let d = self.deps.get_mut(&deployment_of(&exit.instance)?)?;
        if d.host.as_deref() != Some(host) || d.busy {
            return None;
        }
        if !matches!(
            d.state,
            InstanceState::Ready | InstanceState::Parked | InstanceState::Closed
        ) {
            return None;
        }
        d.last_used = Instant::now();
        d.fail(format!(
            "the engine exited: {}",
            exit.status.as_deref().unwrap_or("status unknown")
        ));
        Some(d.key(&self.host_id))
    }
}

/// What adding a host leaves to do ([`State::add_host`]).
#[derive(Debug, Default)]
pub(crate) struct Adoption {
    /// Engines to stop there: of deployments that no longer exist, or run elsewhere.
    pub(crate) to_stop: Vec<String>,
    /// Instances adopted ready (or at a new address): the router is told.
    pub(crate) came: Vec<(InstanceKey, SocketAddr)>,
    /// Instances believed on that host that it no longer has: failed, the router is told.
    pub(crate) lost: Vec<InstanceKey>,
}

/// Hosts.
impl State {
    /// Adds host `host_id` (or replaces its agent) and reconciles the deployments with the
    /// engines it reports (`adopted`): engines it holds are adopted (ready or parked) unless
    /// an operation on them is in flight (then only where the engine answers is learnt);
    /// engines of unknown deployments, or of a deployment bound elsewhere, are to be stopped;
    /// instances believed on that host that it no longer has are failed.
    pub(crate) fn add_host(
        &mut self,
        host_id: String,
        host: Host,
        adopted: &[capyctl_node_agent::agent::AdoptedInstance],
    ) -> Adoption {
        Arc::make_mut(&mut self.hosts).insert(host_id.clone(), Arc::new(host));
        self.any_host_explicit = self
            .hosts
            .values()
            .any(|h| h.activation == Activation::Explicit);
        let mut to_stop = Vec::new();
        let mut came = Vec::new();
        let mut lost = Vec::new();
        let mut adopted_here = BTreeSet::new();
        let mut changed = BTreeSet::new();
        let multi_gpu = self.hosts.get(&host_id).is_some_and(|h| h.gpus.len() > 1);
        for adopted in adopted {
            let Some(d) = deployment_of(&adopted.instance)
                .and_then(|id| self.deps.get_mut(&id))
                .filter(|d| d.instance_id() == adopted.instance)
            else {
                tracing::info!(host = %host_id, instance = %adopted.instance, "stopping an engine of a deployment that no longer exists");
                to_stop.push(adopted.instance.clone());
                continue;
            };
            let elsewhere = d.bound_host().is_some_and(|h| h != host_id);
            if elsewhere {
                tracing::info!(host = %host_id, instance = %adopted.instance, "stopping a second engine of a deployment that runs elsewhere");
                to_stop.push(adopted.instance.clone());
                continue;
            }
            if d.busy || d.reserved.is_some() || d.claim.is_some() {
                // An operation on it is in flight (a start, a wake, a drain, a park): it
                // decides the state; only where the engine answers is learnt.
                if d.host.as_deref() == Some(host_id.as_str()) {
                    d.pid = Some(adopted.pid);
                    if let Some(addr) = engine_addr(&adopted.base_url) {
                        d.addr = Some(addr);
                    }
                    adopted_here.insert(d.id().to_string());
                }
                continue;
            }
            let was = (d.state, d.addr);
            d.state = if adopted.parked.is_some() {
                InstanceState::Parked
            } else {
                InstanceState::Ready
            };
            d.tier = adopted.parked;
            d.parked_gpu = adopted.gpu_held.map(|g| g.bytes);
            d.pid = Some(adopted.pid);
            // The GPUs it was given (placement on a host of several GPUs sets them).
            d.gpus = if multi_gpu {
                adopted
                    .spec
                    .env
                    .get(crate::VISIBLE_DEVICES)
                    .map(|v| v.split(',').filter_map(|g| g.trim().parse().ok()).collect())
                    .unwrap_or_default()
            } else {
                Vec::new()
            };
            d.addr = engine_addr(&adopted.base_url);
            if adopted.parked.is_none() && d.rec.pending_start {
                // It runs: a start that waited for memory has happened.
                d.rec.pending_start = false;
                self.dirty.mark(&d.rec.id);
            }
            let id = d.id().to_string();
            if (d.state, d.addr) != was {
                changed.insert(id.clone());
            }
            tracing::info!(host = %host_id, instance = %adopted.instance, state = %d.state, "adopted an engine");
            if let Some(f) = &mut self.fence
                && d.state == InstanceState::Ready
            {
                // A host that joins while the fence lasts: what it holds ready is inherited too.
                f.ids.insert(id.clone());
            }
            self.set_host(&id, Some(host_id.clone()));
            adopted_here.insert(id);
        }
        // Only deployments on this host can be adopted here or lost by it.
        let on_this_host: Vec<String> =
            self.on_host(&host_id).map(|d| d.id().to_string()).collect();
        for id in &on_this_host {
            let Some(d) = self.deps.get_mut(id) else {
                continue;
            };
            if adopted_here.contains(d.id()) {
                if changed.contains(d.id())
                    && d.state == InstanceState::Ready
                    && let Some(addr) = d.addr
                {
                    came.push((Self::key_of(d, &host_id), addr));
                }
                continue;
            }
            let held = d.occupies() || d.state == InstanceState::Parked;
            if held && !d.busy && d.reserved.is_none() && d.claim.is_none() {
                lost.push(Self::key_of(d, &host_id));
                d.lost(format!(
                    "its engine is gone: host {host_id} no longer has it"
                ));
            }
        }
        Adoption {
            to_stop,
            came,
            lost,
        }
    }
}

/// What a started engine reports ([`UpDone::Ready`]).
#[derive(Debug)]
pub(crate) struct Started {
    /// Where it answers (`None`: not an IP address and port).
    pub(crate) addr: Option<SocketAddr>,
    pub(crate) pid: u32,
    pub(crate) max_running: MaxRunning,
    pub(crate) measurement: Measurement,
}

/// How a start or a wake ended ([`State::up_done`]).
#[derive(Debug)]
pub(crate) enum UpDone {
    /// It is ready: what a started engine reports (`None` for a wake: it keeps its engine).
    Ready(Option<Started>),
    /// It failed with `error`; `ended`: it was ended ([`Dep::end`]), and the agent's stop of
    /// its engine answered this.
    Failed {
        error: ApiError,
        ended: Option<Result<(), String>>,
    },
}

/// Bring-ups.
impl State {
    /// Started `id`'s engine gave its first answer (the reference its wakes are checked
    /// against): recorded before the instance is announced (the caller saves it then).
    pub(crate) fn answered_first(
        &mut self,
        id: &str,
        first: capyctl_node_agent::verify::FirstAnswer,
    ) {
        if let Some(d) = self.deps.get_mut(id) {
            d.rec.first_answer = Some(first);
        }
    }

    /// Writes how the start or wake of `id` (`up`, begun by [`State::begin_up`]) ended:
    /// `ready`, or `failed` with the error (`stopped` when it was ended and its engine
    /// stopped). The key to announce, with the address, when ready; `Err(key)` to tell the
    /// router it is gone; `None` when `id` is gone (deleted meanwhile).
    pub(crate) fn up_done(
        &mut self,
        id: &str,
        up: Up,
        done: UpDone,
        now: Instant,
    ) -> Option<Result<(InstanceKey, Option<SocketAddr>), InstanceKey>> {
        let d = self.deps.get_mut(id)?;
        d.busy = false;
        d.last_used = now;
        match done {
            UpDone::Ready(started) => {
                if let Some(s) = started {
                    d.addr = s.addr;
                    d.pid = Some(s.pid);
                    d.max_running = Some(s.max_running);
                    if !s.measurement.awaiting() {
                        d.measurement = s.measurement;
                    }
                }
                d.state = InstanceState::Ready;
                d.tier = None;
                Some(Ok((d.key(&self.host_id), d.addr)))
            }
            UpDone::Failed { error: e, ended } => {
                d.fail(format!("{}: {}", e.code(), e.message()));
                if let Some(stopped) = ended {
                    let what = match up {
                        Up::Start => "start",
                        Up::Wake => "wake",
                    };
                    match stopped {
                        Ok(()) => {
                            d.state = InstanceState::Stopped;
                            d.last_error =
                                Some(format!("{what} ended and engine stopped: {}", e.message()));
                        }
                        Err(stop) => {
                            d.last_error = Some(format!(
                                "{what} ended ({}), but stopping the engine failed: {stop}",
                                e.message()
                            ));
                            d.ended_stop_failed = Some(stop);
                        }
                    }
                }
                Some(Err(d.key(&self.host_id)))
            }
        }
    }
}

/// Operator starts that wait for memory.
impl State {
    /// Begins the operator's start of `id` that waits for memory (`pending_start`) when it
    /// fits now, without victims (as a start without `--evict`); how it comes up. `None`
    /// when it no longer waits, something else has it, or it does not fit yet.
    pub(crate) fn start_pending(&mut self, id: &str, now: Instant) -> Option<Up> {
        let d = self.deps.get(id)?;
        if !d.rec.pending_start || d.busy || d.reserved.is_some() || d.claim.is_some() {
            return None;
        }
        if self.held.is_some() {
            return None;
        }
        let (placed, fit) = self.place_target(id, &BTreeSet::new(), Victims::None, now);
        if fit != Fit::Now {
            return None;
        }
        self.set_placed(id, placed);
        self.begin_up(id, true, now)
    }
}

/// Switches.
impl State {
    /// The end of switch `switch_id`'s release: its reservation goes, and its target comes up
    /// (how; `None` when it is up or on its way already). `conflict` when the switch was
    /// given up meanwhile (the target no longer claimed by it); the target's `admissible`
    /// error when requests may no longer bring it up.
    pub(crate) fn switch_target_up(
        &mut self,
        switch_id: &str,
        target: &str,
        now: Instant,
    ) -> Result<Option<Up>, ApiError> {
        let claimed = self
            .deps
            .get(target)
            .is_some_and(|d| d.claim.as_deref() == Some(switch_id));
        let operator = self.reservations.get(switch_id).is_some_and(|r| r.operator);
        self.release_reservation(switch_id);
        if !claimed {
            return Err(ApiError::Conflict {
                detail: format!("switch {switch_id} to deployment {target} was given up"),
            });
        }
        if let Some(e) = &self.held {
            return Err(e.clone());
        }
        self.admissible(target)?;
        let d = self.deps.get(target).ok_or_else(|| not_found(target))?;
        if d.busy || d.occupies() {
            return Ok(None);
        }
        Ok(self.begin_up(target, operator, now))
    }
}

/// What an operator's start does next ([`State::start`]).
#[derive(Debug)]
pub(crate) enum StartNext {
    /// Nothing: it is ready or on its way.
    Nothing,
    /// Bring it up so (begun).
    Up(Up),
    /// A `start --evict`: an operator's switch, through the router's coordinator.
    Evict,
    /// It waits for memory (`pending_start`).
    Pending,
}

/// Operator commands.
impl State {
    /// An operator's start of `id` (`wait`: `--wait`; `evict`: `--evict`): clears the operator
    /// stop and decides. `awaiting_measurement` unless `wait` (or it runs); `conflict` while it
    /// is going away; without `--evict`, placement without victims: it comes up now, or waits
    /// for memory; with it, the switch is the coordinator's.
    pub(crate) fn start(
        &mut self,
        id: &str,
        wait: bool,
        evict: bool,
        now: Instant,
    ) -> Result<StartNext, ApiError> {
        self.held_refusal()?;
        let d = self.deps.get(id).ok_or_else(|| not_found(id))?;
        if d.measurement.awaiting() && !wait && d.state != InstanceState::Ready {
            return Err(ApiError::AwaitingMeasurement {
                deployment: id.to_string(),
            });
        }
        if matches!(
            d.state,
            InstanceState::Closed | InstanceState::Parking | InstanceState::Stopping
        ) || d.reserved.is_some()
        {
            return Err(ApiError::Conflict {
                detail: format!(
                    "deployment {} is {} now; start it again once that has finished",
                    d.name(),
                    views::shown_state(d)
                ),
            });
        }
        let coming = matches!(
            d.state,
            InstanceState::Ready | InstanceState::Starting | InstanceState::Waking
        ) || d.claim.is_some()
            // A start that waits for memory is taken over by a start with --evict.
            || (d.rec.pending_start && !evict);
        // With --evict the placement is the switch's (`operator_switch`); without, nothing
        // is released.
        let fit = (!evict).then(|| self.place_target(id, &BTreeSet::new(), Victims::None, now));
        let d = self.deps.get_mut(id).ok_or_else(|| not_found(id))?;
        d.rec.operator_stopped = false;
        d.rec.operator_started = true;
        if coming {
            return Ok(StartNext::Nothing);
        }
        let Some((placed, fit)) = fit else {
            return Ok(StartNext::Evict);
        };
        match fit {
            Fit::Now => {
                self.set_placed(id, placed);
                Ok(self
                    .begin_up(id, true, now)
                    .map_or(StartNext::Nothing, StartNext::Up))
            }
            // Without --evict nothing is released: placement never names victims then.
            Fit::Later | Fit::After(_) | Fit::AfterStopping(_) => {
                if let Some(d) = self.deps.get_mut(id) {
                    d.rec.pending_start = true;
                }
                Ok(StartNext::Pending)
            }
            Fit::Never(detail) => Err(ApiError::DoesNotFit {
                deployment: id.to_string(),
                detail,
            }),
        }
    }
}

impl State {
    /// An operator's park of ready `id` begins (reserved by `rid`, shown `parking` at once:
    /// it drains and parks in the background; see [`State::begin_down`]). `None`: nothing to
    /// do (parked meanwhile by a switch, or gone).
    pub(crate) fn park(&mut self, id: &str, rid: &str) -> Result<Option<bool>, ApiError> {
        if self
            .deps
            .get(id)
            .is_none_or(|d| d.state != InstanceState::Ready)
        {
            return Ok(None);
        }
        let down = self.begin_down(id, rid)?;
        if let Some(d) = self.deps.get_mut(id) {
            d.rec.operator_started = false;
            d.state = InstanceState::Parking;
        }
        Ok(down)
    }
}

impl State {
    /// A preinitialize of `id` with its fresh measurement: when still unmeasured, idle and the
    /// GPU has room now (no victims), its start begins (`true`: run it without serving, then
    /// park); `conflict` when no memory is free, `does_not_fit` when none ever is.
    pub(crate) fn preinitialize(
        &mut self,
        id: &str,
        measured: Measurement,
        now: Instant,
    ) -> Result<bool, ApiError> {
        self.held_refusal()?;
        let d = self.deps.get_mut(id).ok_or_else(|| not_found(id))?;
        if !measured.awaiting() {
            d.measurement = measured;
        }
        let idle = matches!(d.state, InstanceState::Stopped | InstanceState::Failed)
            && !d.busy
            && d.reserved.is_none()
            && d.claim.is_none()
            && !d.rec.pending_start;
        if !d.measurement.awaiting() || !idle {
            return Ok(false);
        }
        let name = d.name().to_string();
        let (placed, fit) = self.place_target(id, &BTreeSet::new(), Victims::None, now);
        match fit {
            Fit::Now => {
                self.set_placed(id, placed);
                Ok(self.begin_up(id, true, now).is_some())
            }
            Fit::Later | Fit::After(_) | Fit::AfterStopping(_) => Err(ApiError::Conflict {
                detail: format!(
                    "no GPU memory is free to measure deployment {name} now; park or stop the others, or start it with --wait"
                ),
            }),
            Fit::Never(detail) => Err(ApiError::DoesNotFit {
                deployment: id.to_string(),
                detail,
            }),
        }
    }
}

/// The idle timers (`server.lifecycle_defaults`).
impl State {
    /// The deployments whose idle timer is due at `now`: ready ones idle for
    /// `ready_idle_timeout` (`true`: to park), parked ones for `parked_idle_timeout` (`false`:
    /// to stop). Never explicit or warm ones, never one busy, reserved, claimed or waiting for
    /// memory, never one in `in_use` (requests wait or run, as the router's load says). Only
    /// candidates: each is decided again by [`State::begin_idle_down`], and then by the router.
    pub(crate) fn idle_due(
        &self,
        timeouts: &capyctl_spec::settings::LifecycleDefaults,
        in_use: &BTreeSet<String>,
        now: Instant,
    ) -> Vec<(String, bool)> {
        self.deps
            .values()
            .filter(|d| !self.explicit(d) && !d.warm() && !d.busy && d.reserved.is_none())
            .filter(|d| d.claim.is_none() && !d.rec.pending_start && !in_use.contains(d.id()))
            // Held or fenced: no idle timer parks or stops either.
            .filter(|d| self.held.is_none() && !self.fenced(d.id()))
            .filter_map(|d| {
                let idle = now.saturating_duration_since(d.used_at());
                let due = |t: Option<Duration>| t.is_some_and(|t| idle >= t);
                match d.state {
                    InstanceState::Ready if due(timeouts.ready_idle_timeout) => {
                        Some((d.id().to_string(), true))
                    }
                    InstanceState::Parked if due(timeouts.parked_idle_timeout) => {
                        Some((d.id().to_string(), false))
                    }
                    _ => None,
                }
            })
            .collect()
    }

    /// The idle timer of `id` (`ready`: its ready timer, else its parked one) takes it down,
    /// decided again at `now` on the state it changes: still in that state, not used since
    /// `now - timeout`, not waiting for memory; reserved by `rid` (see [`State::begin_down`]).
    /// What [`State::begin_down`] says, and the instant the router checks that nothing used
    /// it after; `None` when it is not due after all.
    pub(crate) fn begin_idle_down(
        &mut self,
        id: &str,
        ready: bool,
        timeouts: &capyctl_spec::settings::LifecycleDefaults,
        rid: &str,
        now: Instant,
    ) -> Option<(Option<bool>, Instant)> {
        let d = self.deps.get(id)?;
        let timeout = match d.state {
            InstanceState::Ready if ready => timeouts.ready_idle_timeout?,
            InstanceState::Parked if !ready => timeouts.parked_idle_timeout?,
            _ => return None,
        };
        // No use after this instant: the rule, as the router checks it.
        let idle_since = now.checked_sub(timeout)?;
        if d.used_at() > idle_since || d.rec.pending_start {
            return None;
        }
        let down = self.begin_down(id, rid).ok()?;
        let dep = dep_of_unit(id);
        if self.replicated.contains(dep) {
            self.idle_taken.insert(dep.to_string(), now);
        }
        Some((down, idle_since))
    }
}

/// The parked set's room in host RAM.
impl State {
    /// Reserves `id`'s parked copy in host RAM (by `rid`), to be stopped for room: only while
    /// it is parked there, with no operation, reservation or claim on it (see
    /// [`State::begin_down`]). Its name; `None` when it is not such a copy now.
    pub(crate) fn reserve_parked_copy(&mut self, id: &str, rid: &str) -> Option<String> {
        let d = self.deps.get(id)?;
        if d.state != InstanceState::Parked || d.tier != Some(ParkTier::HostRam) {
            return None;
        }
        let name = d.name().to_string();
        matches!(self.begin_down(id, rid), Ok(Some(false))).then_some(name)
    }
}

/// The operator's hold-over and fence (see `lifecycle/DESIGN.md`, "Leadership on
/// Kubernetes").
impl State {
    /// Holds every switch with `refusal` (503 `unavailable`): a request for a deployment that
    /// is not ready (or already starting or waking) is refused at once, plans fail with it,
    /// and no operator command, idle timer or pending start changes anything. Ready instances
    /// serve on; engine exits are still recorded.
    pub(crate) fn hold(&mut self, refusal: ApiError) {
        self.held = Some(refusal);
    }

    /// Ends the hold: switching resumes.
    pub(crate) fn resume(&mut self) {
        self.held = None;
    }

    /// Fences the instances ready now (adopted from a leader that did not release its Lease):
    /// until `until` they are not victims of any switch, no idle timer takes them down, and an
    /// operator's park or stop of them is refused ([`State::command_refusal`]). Their names.
    pub(crate) fn set_fence(&mut self, until: Instant, now: Instant) -> Vec<String> {
        if until <= now {
            self.fence = None;
            return Vec::new();
        }
        let ids: BTreeSet<String> = self
            .deps
            .values()
            .filter(|d| d.state == InstanceState::Ready)
            .map(|d| d.id().to_string())
            .collect();
        let names = ids
            .iter()
            .filter_map(|id| self.deps.get(id).map(|d| d.name().to_string()))
            .collect();
        self.fence = Some(Fence { until, ids });
        names
    }

    /// Ends the fence once `now` has reached its end; whether it ended now.
    pub(crate) fn end_fence(&mut self, now: Instant) -> bool {
        if self.fence.as_ref().is_some_and(|f| now >= f.until) {
            self.fence = None;
            return true;
        }
        false
    }

    /// Whether deployment `id` is fenced ([`State::set_fence`]; the fence is dropped at its
    /// end by [`State::end_fence`]).
    pub(crate) fn fenced(&self, id: &str) -> bool {
        self.fence.as_ref().is_some_and(|f| f.ids.contains(id))
    }

    /// The refusal of every change while switches are held ([`State::hold`]).
    pub(crate) fn held_refusal(&self) -> Result<(), ApiError> {
        match &self.held {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Why taking deployment `id` down (an operator's stop, park or delete, a host drain, an
    /// idle timer) is refused now: held, or `id` fenced (answered with the fence's end).
    pub(crate) fn command_refusal(&self, id: &str) -> Result<(), ApiError> {
        self.held_refusal()?;
        match &self.fence {
            Some(f) if f.ids.contains(id) => {
                let left = f.until.saturating_duration_since(Instant::now());
                let name = self.deps.get(id).map_or(id, |d| d.name());
                Err(ApiError::Unavailable {
                    detail: format!(
                        "deployment {name} was adopted from the previous leader, which may still serve it; it is not parked or stopped for another {} s (until that leader's hold-over has surely ended)",
                        left.as_secs() + 1
                    ),
                    retry_after: u32::try_from(left.as_secs() + 1).unwrap_or(u32::MAX),
                })
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    //! The rules on plain state, with the time given (no owner task, no host calls).
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::instance_id;
    use capyctl_node_agent::agent::EngineExit;
    use capyctl_node_agent::measure::{MeasureSource, Measured};
    use capyctl_spec::settings::LifecycleDefaults;

    const GIB: u64 = 1 << 30;

    /// One host, `gpu-1`, of 10 GiB, and deployments `a`, `b`, `c` needing 6 GiB each.
    fn state(now: Instant) -> State {
        let mut s = State {
            host_id: "gpu-1".into(),
            ..State::default()
        };
        s.add_host("gpu-1".into(), host(), &[]);
        for id in ["a", "b", "c"] {
            s.insert(dep(id, &format!("chat-{id}"), "", now));
        }
        s
    }

    /// A host of 10 GiB (the fake host agent).
    fn host() -> Host {
        Host {
            agent: Arc::new(capyctl_test_support::FakeHost::new()),
            activation: Activation::OnDemand,
            settings: HostSettings::default(),
            admission_window: None,
            remote: false,
            capacity: 10 * GIB,
            gpus: Vec::new(),
        }
    }

    /// A deployment of 6 GiB (declared), last used at `now`.
    fn dep(id: &str, name: &str, extra: &str, now: Instant) -> Dep {
        sized_dep(id, name, extra, 6, now)
    }

    /// A deployment of `gib` GiB (declared), last used at `now`.
    fn sized_dep(id: &str, name: &str, extra: &str, gib: u64, now: Instant) -> Dep {
        let doc = capyctl_spec::documents::parse_deployment_str(
            "t.yaml",
            &format!("name: {name}\nengine: vllm\nmodel: m\n{extra}"),
        )
        .unwrap();
        let mut d = Dep::new(DeploymentRecord {
            id: id.to_string(),
            revision: 1,
            doc,
            operator_stopped: false,
            operator_started: false,
            pending_start: false,
            generation: 0,
            first_answer: None,
        });
        d.measurement.gpu_memory = Some(Measured {
            bytes: gib * GIB,
            source: MeasureSource::Declared,
        });
        d.last_used = now;
        d
    }

    /// Makes `id` ready on `gpu-1`, last used at `used`.
    fn ready(s: &mut State, id: &str, used: Instant) {
        s.set_host(id, Some("gpu-1".into()));
        let d = s.deps.get_mut(id).unwrap();
        d.state = InstanceState::Ready;
        d.addr = Some(([127, 0, 0, 1], 9).into());
        d.last_used = used;
    }

    fn none() -> BTreeSet<String> {
        BTreeSet::new()
    }

    fn held() -> ApiError {
        ApiError::Unavailable {
            detail: "the Kubernetes API server cannot be reached; this replica serves ready models only until it can renew its leadership".into(),
            retry_after: 2,
        }
    }

    /// A host of `n` GPUs of `gib` GiB each.
    fn gpus_host(n: u32, gib: u64) -> Host {
        Host {
            capacity: u64::from(n) * gib * GIB,
            gpus: (0..n)
                .map(|index| capyctl_node_agent::inventory::GpuInfo {
                    index,
                    uuid: None,
                    name: None,
                    total_bytes: gib * GIB,
                    free_bytes: None,
                    unified: false,
                })
                .collect(),
            ..host()
        }
    }

    /// A state with one host, `id`, of `gpus` GPUs of `gib` GiB each.
    fn one_host(id: &str, gpus: u32, gib: u64) -> State {
        let mut s = State {
            host_id: id.into(),
            ..State::default()
        };
        s.add_host(id.into(), gpus_host(gpus, gib), &[]);
        s
    }

    /// Brings unit `unit` up as a plan would (placed, claimed, then ready).
    fn bring_up(s: &mut State, unit: &str, now: Instant) -> (Option<String>, Vec<u32>) {
        let (placed, fit) = s.place_target(unit, &none(), Victims::Idle, now);
        assert_eq!(fit, Fit::Now, "{unit}");
        let host = placed.host.clone();
        s.set_placed(unit, placed);
        let d = s.deps.get_mut(unit).unwrap();
        d.state = InstanceState::Ready;
        (host, d.gpus.clone())
    }

    #[tokio::test(start_paused = true)]
    async fn replicas_are_units_on_distinct_gpus_and_never_each_others_victims() {
        let now = Instant::now();
        let mut s = one_host("box", 4, 10);
        s.insert(dep("r", "chat-r", "replicas: 3", now));
        s.insert(dep("b", "chat-b", "", now));
        // One unit per replica, keyed `r`, `r-1`, `r-2`; one deployment to the views.
        assert_eq!(s.unit_ids("r"), ["r", "r-1", "r-2"]);
        assert_eq!(s.deps["r-2"].instance_id(), "r-2");
        assert_eq!(s.deps["r"].instance_id(), "r-0");
        // Each on a GPU of its own (6 of 10 GiB: two would fit no GPU anyway; with 3 GiB they
        // would, and still go apart).
        let mut used = BTreeSet::new();
        for unit in ["r", "r-1", "r-2"] {
            let (host, gpus) = bring_up(&mut s, unit, now);
            assert_eq!(host.as_deref(), Some("box"));
            assert_eq!(gpus.len(), 1);
            assert!(used.insert(gpus[0]), "{unit} on a GPU of its own: {gpus:?}");
            let env = s.deps[unit].launch_spec().env;
            assert_eq!(env["CUDA_VISIBLE_DEVICES"], gpus[0].to_string());
            assert_eq!(env["CUDA_DEVICE_ORDER"], "PCI_BUS_ID", "NVML's numbering");
        }
        // A fourth (replicas raised) finds the free GPU only.
        let mut d = s.deps["r"].rec.clone();
        d.doc.replicas = Some(4);
        d.revision = 2;
        s.deps.get_mut("r").unwrap().rec = d;
        s.deps.get_mut("r").unwrap().renew_fixed();
        s.sync_units("r");
        let (_, gpus) = bring_up(&mut s, "r-3", now);
        assert!(!used.contains(&gpus[0]));
        // Every GPU now holds an instance of r: chat-b names one instance (the longest idle),
        // never two; r's own plan never names its siblings.
        s.deps.get_mut("r-1").unwrap().last_used = now - Duration::from_secs(60);
        let plan = s
            .plan("b", &none(), PlanFor::Requests, "sw-1".into(), now)
            .unwrap();
        match plan {
            Plan::Switch { victims, .. } => {
                assert_eq!(victims.len(), 1, "{victims:?}");
                assert_eq!((victims[0].deployment.as_str(), victims[0].index), ("r", 1));
            }
            other => panic!("{other:?}"),
        }
        // Lowering replicas leaves the running units to the scaler; stopped ones go at once.
        s.release_reservation("sw-1");
        s.deps.get_mut("r-3").unwrap().state = InstanceState::Stopped;
        let mut d = s.deps["r"].rec.clone();
        d.doc.replicas = Some(2);
        d.revision = 3;
        s.deps.get_mut("r").unwrap().rec = d;
        s.deps.get_mut("r").unwrap().renew_fixed();
        s.sync_units("r");
        assert_eq!(s.unit_ids("r"), ["r", "r-1", "r-2"]);
        s.remove("r");
        assert!(s.unit_ids("r").is_empty());
        assert!(s.replicated.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn an_operators_evict_fills_every_replica() {
        let now = Instant::now();
        let mut s = one_host("box", 4, 10);
        for id in ["a", "b", "c"] {
            s.insert(dep(id, &format!("chat-{id}"), "", now));
            bring_up(&mut s, id, now);
        }
        s.insert(dep("r", "chat-r", "replicas: 3", now));
        bring_up(&mut s, "r", now);
        assert_eq!(s.filled("r"), (3, 1));
        assert_eq!(s.unit_to_fill("r").as_deref(), Some("r-1"));
        let mut protected = none();
        protected.insert("r".to_string());
        let plan = s
            .plan("r", &protected, PlanFor::Operator, "sw-1".into(), now)
            .unwrap();
        match plan {
            Plan::Switch { victims, .. } => assert_eq!(victims.len(), 1, "{victims:?}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(s.deps["r-1"].claim.as_deref(), Some("sw-1"));
        // Requests' plans do not fill: one instance is up.
        assert_eq!(
            s.plan("r", &none(), PlanFor::Requests, "sw-2".into(), now)
                .unwrap(),
            Plan::AlreadyComing
        );
    }

    #[tokio::test(start_paused = true)]
    async fn instances_prefer_hosts_without_a_sibling_and_span_gpus_per_instance() {
        let now = Instant::now();
        let mut s = one_host("a", 1, 40);
        s.add_host("b".into(), gpus_host(1, 40), &[]);
        s.insert(dep("r", "chat-r", "replicas: 2", now));
        let (first, _) = bring_up(&mut s, "r", now);
        let (second, _) = bring_up(&mut s, "r-1", now);
        assert_ne!(first, second, "the second instance goes to the other host");

        // gpus_per_instance: 2 on a host of 4 GPUs: two GPUs, each with half the memory.
        let mut s = one_host("box", 4, 10);
        s.insert(sized_dep(
            "t",
            "chat-t",
            "replicas: 2\ngpus_per_instance: 2",
            16,
            now,
        ));
        assert_eq!(s.deps["t-1"].spec.tensor_parallel, Some(2));
        let (_, g0) = bring_up(&mut s, "t", now);
        let (_, g1) = bring_up(&mut s, "t-1", now);
        assert_eq!((g0.len(), g1.len()), (2, 2));
        assert!(g0.iter().all(|g| !g1.contains(g)), "{g0:?} {g1:?}");
        // More GPUs than the host has: never (on a host of one GPU too: its engine would
        // start tensor-parallel on one).
        for (gpus, gib, want) in [(2, 10, 3), (1, 40, 2)] {
            let mut s = one_host("h", gpus, gib);
            s.insert(dep(
                "w",
                "chat-w",
                &format!("gpus_per_instance: {want}"),
                now,
            ));
            let (_, fit) = s.place_target("w", &none(), Victims::Idle, now);
            assert_eq!(
                fit,
                Fit::Never(format!(
                    "it needs {want} GPUs (gpus_per_instance) and the host has {gpus}"
                ))
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_instance_over_several_gpus_names_no_victim_another_one_already_makes_room_for() {
        let start = Instant::now();
        tokio::time::advance(Duration::from_secs(600)).await;
        let now = Instant::now();
        let mut s = one_host("box", 2, 10);
        // v spans both GPUs (7 GiB on each); x (2 GiB) shares one of them, idle longer.
        s.insert(sized_dep("v", "chat-v", "gpus_per_instance: 2", 14, start));
        s.insert(sized_dep("x", "chat-x", "", 2, start));
        let (_, gv) = bring_up(&mut s, "v", start);
        let (_, gx) = bring_up(&mut s, "x", start);
        assert_eq!((gv.len(), gx.len()), (2, 1));
        s.deps.get_mut("v").unwrap().last_used = now - Duration::from_secs(50);
        s.deps.get_mut("x").unwrap().last_used = now - Duration::from_secs(500);
        // t needs 4 GiB on each GPU. On x's GPU alone x goes first (the longest idle), and is
        // not enough, so v too; on the other, v. Yet v, released, frees 7 GiB on both: x is
        // not needed, and is no victim (it was, when each GPU chose alone).
        s.insert(sized_dep("t", "chat-t", "gpus_per_instance: 2", 8, now));
        let (_, fit) = s.place_target("t", &none(), Victims::Idle, now);
        assert_eq!(fit, Fit::After(vec!["v".into()]));
    }

    #[tokio::test(start_paused = true)]
    async fn the_scaler_starts_a_stopped_instance_where_a_parked_one_has_no_room() {
        let now = Instant::now();
        let mut s = one_host("box", 3, 10);
        s.insert(dep("r", "chat-r", "replicas: 3", now));
        s.insert(dep("b", "chat-b", "", now));
        bring_up(&mut s, "r", now);
        let (_, g1) = bring_up(&mut s, "r-1", now);
        let d = s.deps.get_mut("r-1").unwrap();
        d.state = InstanceState::Parked;
        d.parked_gpu = Some(GIB);
        // Another model takes the parked instance's GPU (the fullest that fits).
        let (_, gb) = bring_up(&mut s, "b", now);
        assert_eq!(gb, g1);
        // The parked instance can wake only there: no room, so the scaler's next candidate,
        // the stopped one, is started on the free GPU (`Server::scale_run` tries them in
        // the order `scale::decide` gives).
        assert_eq!(s.scale_up("r-1", now), None);
        assert!(s.scale_up("r-2", now).is_some());
        assert!(
            !s.deps["r-2"].gpus.contains(&g1[0]),
            "{:?}",
            s.deps["r-2"].gpus
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_scaler_waits_out_the_back_off_of_an_engine_that_failed_not_one_its_host_lost() {
        let long_ago = Instant::now();
        tokio::time::advance(Duration::from_secs(600)).await;
        let mut s = one_host("box", 3, 10);
        s.insert(dep("r", "chat-r", "replicas: 3", long_ago));
        for unit in ["r", "r-1", "r-2"] {
            bring_up(&mut s, unit, long_ago);
            s.deps.get_mut(unit).unwrap().last_used = long_ago;
        }
        let held = |s: &State, unit: &str| {
            let now = Instant::now();
            s.scale_inputs(now)[0]
                .units
                .iter()
                .find(|u| u.unit == unit)
                .unwrap()
                .held
        };
        // r-1's engine exits, unused for ten minutes: the back-off counts from the exit.
        let exit = capyctl_node_agent::agent::EngineExit {
            instance: "r-1".into(),
            status: Some("signal 9".into()),
        };
        assert!(s.engine_exited("box", &exit).is_some());
        assert!(held(&s, "r-1"), "within the back-off");
        tokio::time::advance(FAILED_BACKOFF - Duration::from_secs(1)).await;
        assert!(held(&s, "r-1"), "still within it");
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(!held(&s, "r-1"), "past it");
        // The host comes back (its agent restarted) without its engines: r-2 failed, but not
        // on its own, so the scaler may bring it back at once, used a moment ago or not.
        s.deps.get_mut("r-2").unwrap().last_used = Instant::now();
        let lost = s.add_host("box".into(), gpus_host(3, 10), &[]).lost;
        assert!(lost.iter().any(|k| k.index == 2), "{lost:?}");
        assert_eq!(s.deps["r-2"].state, InstanceState::Failed);
        assert!(!held(&s, "r-2"), "a lost engine is no failure of its own");
    }

    #[tokio::test(start_paused = true)]
    async fn a_parked_instance_keeps_its_gpu_from_its_siblings_with_no_residue_known() {
        let now = Instant::now();
        let mut s = one_host("box", 3, 10);
        s.insert(dep("r", "chat-r", "replicas: 3", now));
        let (_, g0) = bring_up(&mut s, "r", now);
        let (_, g1) = bring_up(&mut s, "r-1", now);
        // r-1 parks, and what its engine keeps on the GPU is not known (no NVML reading):
        // it holds nothing placement counts, yet it can only wake on that GPU.
        let d = s.deps.get_mut("r-1").unwrap();
        d.state = InstanceState::Parked;
        d.parked_gpu = None;
        assert!(!s.deps["r-1"].holds_gpu());
        let (_, g2) = bring_up(&mut s, "r-2", now);
        assert!(
            !g2.contains(&g1[0]) && !g2.contains(&g0[0]),
            "r-2 on a GPU of its own: {g0:?} {g1:?} {g2:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn held_switches_refuse_every_change_but_ready_models_serve_on() {
        let now = Instant::now();
        let mut s = state(now);
        ready(&mut s, "a", now);
        let mut c = s.deps.remove("c").unwrap();
        c.rec.pending_start = true;
        s.insert(c);
        s.hold(held());
        // A request for a model that is not ready is refused at once, with the cause.
        let e = s.admissible("b").unwrap_err();
        assert_eq!(
            (e.status(), e.code(), e.retry_after()),
            (503, "unavailable", Some(2))
        );
        assert!(
            e.message().contains("API server cannot be reached"),
            "{}",
            e.message()
        );
        // The ready one is admissible (its requests are forwarded, not switched).
        assert!(s.admissible("a").is_ok());
        // Plans fail with it (requests and an operator's --evict): nothing reserved.
        for who in [PlanFor::Requests, PlanFor::Operator] {
            let e = s.plan("b", &none(), who, "sw-1".into(), now).unwrap_err();
            assert_eq!(e.code(), "unavailable");
        }
        assert_eq!(s.deps["a"].reserved, None);
        assert_eq!(s.deps["b"].claim, None);
        // Operator commands: start, preinitialize, park/stop (begin_down) refused.
        assert_eq!(
            s.start("b", true, false, now).unwrap_err().code(),
            "unavailable"
        );
        assert_eq!(s.park("a", "park-1").unwrap_err().code(), "unavailable");
        assert_eq!(
            s.begin_down("a", "stop-1").unwrap_err().code(),
            "unavailable"
        );
        assert_eq!(s.deps["a"].state, InstanceState::Ready);
        assert_eq!(s.deps["a"].reserved, None);
        // No idle timer, no pending start.
        let timers = LifecycleDefaults {
            ready_idle_timeout: Some(Duration::from_secs(1)),
            ..LifecycleDefaults::default()
        };
        let later = now + Duration::from_secs(60);
        assert!(s.idle_due(&timers, &none(), later).is_empty());
        assert!(s.start_pending("c", later).is_none());
        // An engine exit is still recorded.
        let exit = EngineExit {
            instance: instance_id("a"),
            status: Some("signal 9".into()),
        };
        assert!(s.engine_exited("gpu-1", &exit).is_some());
        assert_eq!(s.deps["a"].state, InstanceState::Failed);
        // Resumed: switching again.
        s.resume();
        assert!(s.admissible("b").is_ok());
        let plan = s
            .plan("b", &none(), PlanFor::Requests, "sw-2".into(), later)
            .unwrap();
        assert!(matches!(plan, Plan::BringUp { .. }), "{plan:?}");
        assert_eq!(s.idle_due(&timers, &none(), later).len(), 0, "a failed");
    }

    #[tokio::test(start_paused = true)]
    async fn a_fenced_ready_instance_is_no_victim_until_the_fence_ends() {
        let now = Instant::now();
        let mut s = state(now);
        ready(&mut s, "a", now);
        let until = now + Duration::from_secs(90);
        assert_eq!(s.set_fence(until, now), ["chat-a"]);
        // `b` needs `a`'s memory: it waits (`Later`), never `does_not_fit`.
        let plan = s
            .plan("b", &none(), PlanFor::Requests, "sw-1".into(), now)
            .unwrap();
        assert!(matches!(plan, Plan::Later), "{plan:?}");
        let plan = s
            .plan("b", &none(), PlanFor::Operator, "sw-2".into(), now)
            .unwrap();
        assert!(matches!(plan, Plan::Later), "{plan:?}");
        // No operator park or stop of it, naming the fence; no idle timer.
        let e = s.park("a", "park-1").unwrap_err();
        assert_eq!((e.status(), e.code()), (503, "unavailable"));
        assert!(e.message().contains("previous leader"), "{}", e.message());
        assert_eq!(e.retry_after(), Some(91));
        assert_eq!(s.deps["a"].state, InstanceState::Ready);
        let timers = LifecycleDefaults {
            ready_idle_timeout: Some(Duration::from_secs(1)),
            ..LifecycleDefaults::default()
        };
        assert!(
            s.idle_due(&timers, &none(), now + Duration::from_secs(60))
                .is_empty()
        );
        // Not yet over 1 s before its end.
        assert!(!s.end_fence(until - Duration::from_secs(1)));
        assert!(s.fenced("a"));
        // Its end: `a` is the victim as usual.
        assert!(s.end_fence(until));
        let plan = s
            .plan("b", &none(), PlanFor::Requests, "sw-3".into(), until)
            .unwrap();
        let Plan::Switch { victims, .. } = plan else {
            panic!("a switch: {plan:?}");
        };
        assert_eq!(victims[0].deployment, "a");
        // A fence that ends before it begins (a hold-over of 0) fences nothing.
        assert!(s.set_fence(until, until).is_empty());
        assert!(s.fence.is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_host_that_joins_during_the_fence_has_what_it_holds_ready_fenced_too() {
        let now = Instant::now();
        let mut s = state(now);
        ready(&mut s, "a", now);
        s.set_fence(now + Duration::from_secs(90), now);
        let adopted = capyctl_node_agent::agent::AdoptedInstance {
            instance: instance_id("b"),
            spec: s.deps["b"].spec.clone(),
            base_url: "http://127.0.0.1:9".into(),
            pid: 4242,
            parked: None,
            gpu_held: None,
        };
        s.add_host("gpu-2".into(), host(), &[adopted]);
        assert_eq!(s.deps["b"].state, InstanceState::Ready);
        assert!(s.fenced("b"));
        assert_eq!(
            s.begin_down("b", "stop-1").unwrap_err().code(),
            "unavailable"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_plan_reserves_its_victim_so_a_second_plan_waits_instead_of_naming_it_again() {
        let now = Instant::now();
        let mut s = state(now);
        ready(&mut s, "a", now);
        let plan = s
            .plan("b", &none(), PlanFor::Requests, "sw-1".into(), now)
            .unwrap();
        let Plan::Switch {
            switch_id, victims, ..
        } = plan
        else {
            panic!("a switch: {plan:?}");
        };
        assert_eq!(switch_id, "sw-1");
        assert_eq!(victims.len(), 1);
        assert_eq!(victims[0].deployment, "a");
        assert_eq!(s.deps["a"].reserved.as_deref(), Some("sw-1"));
        assert_eq!(s.deps["b"].claim.as_deref(), Some("sw-1"));
        // `a` is reserved and `b` claims the rest: `c` waits for memory.
        let later = s
            .plan("c", &none(), PlanFor::Requests, "sw-2".into(), now)
            .unwrap();
        assert!(matches!(later, Plan::Later), "{later:?}");
        assert_eq!(s.deps["a"].reserved.as_deref(), Some("sw-1"));
        // `b` already has its switch.
        let again = s
            .plan("b", &none(), PlanFor::Requests, "sw-3".into(), now)
            .unwrap();
        assert!(matches!(again, Plan::AlreadyComing), "{again:?}");
        // Given back, the victim serves on and the target is no longer claimed.
        s.release_reservation("sw-1");
        assert_eq!(s.deps["a"].reserved, None);
        assert_eq!(s.deps["b"].claim, None);
        // A switch given up does not bring its target up.
        let err = s.switch_target_up("sw-1", "b", now).unwrap_err();
        assert_eq!(err.code(), "conflict");
    }

    #[tokio::test(start_paused = true)]
    async fn the_longest_idle_is_the_victim_never_a_protected_or_warm_one() {
        let t0 = Instant::now();
        let now = t0 + Duration::from_secs(60);
        let mut s = state(t0);
        // `p` and `q` (3 GiB each) hold 6 of 10 GiB; `b` needs 6: one of them must go (parked,
        // it still holds its residue, 512 MiB).
        for id in ["p", "q"] {
            s.insert(sized_dep(id, &format!("chat-{id}"), "", 3, t0));
        }
        ready(&mut s, "p", t0 + Duration::from_secs(30));
        ready(&mut s, "q", t0 + Duration::from_secs(10));
        let victims = |plan: Plan| match plan {
            Plan::Switch { victims, .. } => victims
                .into_iter()
                .map(|k| k.deployment)
                .collect::<Vec<_>>(),
            other => panic!("a switch: {other:?}"),
        };
        let plan = s
            .plan("b", &none(), PlanFor::Requests, "sw-1".into(), now)
            .unwrap();
        assert_eq!(victims(plan), ["q"], "idle for 50 s, p for 30 s");
        s.release_reservation("sw-1");
        // Requests wait for `q`: `p` goes instead.
        let protected = BTreeSet::from(["q".to_string()]);
        let plan = s
            .plan("b", &protected, PlanFor::Requests, "sw-2".into(), now)
            .unwrap();
        assert_eq!(victims(plan), ["p"]);
        s.release_reservation("sw-2");
        // A warm model is pinned: with `q` protected and `p` warm, nothing can be released,
        // and nothing ever can while they hold the GPU.
        s.deps.get_mut("p").unwrap().rec.doc =
            dep("p", "chat-p", "lifecycle:\n  warm: true\n", t0).rec.doc;
        let plan = s
            .plan("b", &protected, PlanFor::Requests, "sw-3".into(), now)
            .unwrap();
        assert!(matches!(plan, Plan::Later), "q is only protected: {plan:?}");
        s.deps.get_mut("q").unwrap().rec.doc =
            dep("q", "chat-q", "lifecycle:\n  warm: true\n", t0).rec.doc;
        let err = s
            .plan("b", &none(), PlanFor::Requests, "sw-4".into(), now)
            .unwrap_err();
        assert_eq!(err.code(), "does_not_fit", "{err:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn placement_reads_only_what_may_hold_the_gpu_and_lets_go_of_what_no_longer_does() {
        let now = Instant::now();
        let mut s = state(now);
        ready(&mut s, "a", now);
        ready(&mut s, "b", now);
        let holding = |s: &State| -> Vec<String> {
            s.holding
                .get("gpu-1")
                .into_iter()
                .flatten()
                .cloned()
                .collect()
        };
        assert_eq!(holding(&s), ["a", "b"]);
        // `a` stops (no GPU memory any more), `b` parks with nothing left on the GPU: both
        // stay bound to gpu-1 (b's copy is there) but hold nothing.
        s.deps.get_mut("a").unwrap().state = InstanceState::Stopped;
        s.deps.get_mut("b").unwrap().state = InstanceState::Parked;
        let plan = s
            .plan("c", &none(), PlanFor::Requests, "sw-1".into(), now)
            .unwrap();
        assert!(matches!(plan, Plan::BringUp { .. }), "{plan:?}");
        assert_eq!(holding(&s), ["c"], "let go of a and b; c is claimed");
        let on: Vec<&str> = s.on_host("gpu-1").map(|d| d.id()).collect();
        assert_eq!(on, ["a", "b", "c"], "the by-host index still has them all");
        // Woken, `b` is bound again: a holder again.
        s.release_reservation("sw-1");
        s.deps.get_mut("c").unwrap().state = InstanceState::Stopped;
        let plan = s
            .plan("b", &none(), PlanFor::Requests, "sw-2".into(), now)
            .unwrap();
        assert!(matches!(plan, Plan::BringUp { .. }), "{plan:?}");
        assert_eq!(holding(&s), ["b"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_cordoned_host_takes_nothing_and_what_is_bound_there_waits() {
        let now = Instant::now();
        let mut s = state(now);
        ready(&mut s, "a", now);
        s.deps.get_mut("a").unwrap().state = InstanceState::Parked;
        s.cordoned.insert("gpu-1".into());
        let plan = s
            .plan("a", &none(), PlanFor::Requests, "sw-1".into(), now)
            .unwrap();
        assert!(
            matches!(plan, Plan::Later),
            "bound there: waits for the drain {plan:?}"
        );
        let err = s
            .plan("b", &none(), PlanFor::Requests, "sw-2".into(), now)
            .unwrap_err();
        assert_eq!(err.code(), "does_not_fit");
        assert!(
            err.message()
                .ends_with("host gpu-1 is drained and out of service; `capyctl uncordon host` puts host gpu-1 back"),
            "{}",
            err.message()
        );
        s.cordoned.clear();
        let plan = s
            .plan("b", &none(), PlanFor::Requests, "sw-3".into(), now)
            .unwrap();
        assert!(
            matches!(plan, Plan::Switch { .. } | Plan::BringUp { .. }),
            "{plan:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn requests_may_not_bring_up_an_explicit_model_but_an_operators_switch_may() {
        let now = Instant::now();
        let mut s = state(now);
        s.insert(dep(
            "x",
            "chat-x",
            "lifecycle:\n  activation: explicit\n",
            now,
        ));
        let err = s
            .plan("x", &none(), PlanFor::Requests, "sw-1".into(), now)
            .unwrap_err();
        assert_eq!(err.code(), "deployment_inactive");
        let plan = s
            .plan("x", &none(), PlanFor::Operator, "sw-2".into(), now)
            .unwrap();
        assert!(matches!(plan, Plan::BringUp { .. }), "{plan:?}");
        s.deps.get_mut("b").unwrap().rec.operator_stopped = true;
        assert_eq!(s.admissible("b").unwrap_err().code(), "deployment_stopped");
    }

    #[tokio::test(start_paused = true)]
    async fn idle_timers_are_due_by_the_last_use_and_are_decided_again_before_they_act() {
        let t0 = Instant::now();
        let mut s = state(t0);
        let timeouts = LifecycleDefaults {
            ready_idle_timeout: Some(Duration::from_secs(300)),
            parked_idle_timeout: Some(Duration::from_secs(3600)),
        };
        ready(&mut s, "a", t0);
        ready(&mut s, "b", t0 + Duration::from_secs(200));
        s.deps.get_mut("c").unwrap().state = InstanceState::Parked;
        let now = t0 + Duration::from_secs(301);
        assert_eq!(
            s.idle_due(&timeouts, &none(), now),
            [("a".to_string(), true)],
            "b was used 101 s ago; c is parked for less than an hour"
        );
        let in_use = BTreeSet::from(["a".to_string()]);
        assert!(s.idle_due(&timeouts, &in_use, now).is_empty(), "in use");
        assert_eq!(
            s.idle_due(&timeouts, &none(), t0 + Duration::from_secs(3600)),
            [
                ("a".to_string(), true),
                ("b".to_string(), true),
                ("c".to_string(), false)
            ]
        );
        // Used again since the list was made: not taken down.
        s.deps.get_mut("a").unwrap().last_used = now;
        assert_eq!(s.begin_idle_down("a", true, &timeouts, "idle-1", now), None);
        // Due: reserved, and the router is told the instant to check.
        let later = now + Duration::from_secs(300);
        let (down, since) = s
            .begin_idle_down("a", true, &timeouts, "idle-2", later)
            .unwrap();
        assert_eq!(down, Some(true), "ready: drained first");
        assert_eq!(since, now);
        assert_eq!(s.deps["a"].reserved.as_deref(), Some("idle-2"));
        // A reserved one is nobody else's candidate.
        assert!(
            !s.idle_due(&timeouts, &none(), later)
                .iter()
                .any(|(id, _)| id == "a")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_engine_exit_fails_an_idle_instance_on_its_host_only() {
        let now = Instant::now();
        let mut s = state(now);
        ready(&mut s, "a", now);
        ready(&mut s, "b", now);
        let exit = |instance: &str| EngineExit {
            instance: instance.to_string(),
            status: Some("signal 9".into()),
        };
        assert_eq!(s.engine_exited("gpu-2", &exit("a-0")), None, "not its host");
        s.deps.get_mut("b").unwrap().busy = true;
        assert_eq!(
            s.engine_exited("gpu-1", &exit("b-0")),
            None,
            "its operation sees it"
        );
        let key = s.engine_exited("gpu-1", &exit("a-0")).unwrap();
        assert_eq!(
            (key.deployment.as_str(), key.host_id.as_str()),
            ("a", "gpu-1")
        );
        let a = &s.deps["a"];
        assert_eq!(a.state, InstanceState::Failed);
        assert_eq!(a.addr, None);
        assert_eq!(a.last_error.as_deref(), Some("the engine exited: signal 9"));
        assert_eq!(s.engine_exited("gpu-1", &exit("a-0")), None, "once");
    }

    #[tokio::test(start_paused = true)]
    async fn a_start_without_evict_waits_for_memory_and_begins_once_it_is_free() {
        let now = Instant::now();
        let mut s = state(now);
        ready(&mut s, "a", now);
        let next = s.start("b", false, false, now).unwrap();
        assert!(matches!(next, StartNext::Pending), "{next:?}");
        assert!(s.deps["b"].rec.pending_start);
        assert!(s.deps["b"].rec.operator_started);
        assert_eq!(s.start_pending("b", now), None, "a still holds the GPU");
        s.deps.get_mut("a").unwrap().state = InstanceState::Stopped;
        assert_eq!(s.start_pending("b", now), Some(Up::Start));
        let b = &s.deps["b"];
        assert_eq!(b.state, InstanceState::Starting);
        assert!(b.busy && !b.rec.pending_start);
        assert_eq!(b.rec.generation, 1);
        assert!(s.dirty.has("b"), "the taken start and generation are saved");
        // With --evict the start is the coordinator's switch.
        assert!(matches!(
            s.start("c", false, true, now).unwrap(),
            StartNext::Evict
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn an_ended_bring_up_is_stopped_or_failed_with_its_reason() {
        let now = Instant::now();
        let mut s = state(now);
        s.set_host("a", Some("gpu-1".into()));
        assert_eq!(s.begin_up("a", false, now), Some(Up::Start));
        let refusal = ApiError::DeploymentStopped {
            deployment: "a".into(),
        };
        let gone = s
            .up_done(
                "a",
                Up::Start,
                UpDone::Failed {
                    error: refusal.clone(),
                    ended: Some(Ok(())),
                },
                now,
            )
            .unwrap();
        assert!(gone.is_err(), "the router is told it is gone");
        assert_eq!(s.deps["a"].state, InstanceState::Stopped);
        assert!(
            s.deps["a"]
                .last_error
                .as_deref()
                .unwrap()
                .starts_with("start ended and engine stopped")
        );
        assert_eq!(s.begin_up("a", false, now), Some(Up::Start));
        s.up_done(
            "a",
            Up::Start,
            UpDone::Failed {
                error: refusal,
                ended: Some(Err("connection refused".into())),
            },
            now,
        );
        let a = &s.deps["a"];
        assert_eq!(a.state, InstanceState::Failed);
        assert_eq!(a.ended_stop_failed.as_deref(), Some("connection refused"));
    }

    fn on(inner: &State, host: &str) -> Vec<String> {
        inner.on_host(host).map(|d| d.id().to_string()).collect()
    }

    #[test]
    fn the_by_host_index_follows_binds_moves_and_removals() {
        let mut inner = State::default();
        inner.insert(dep("a", "chat-a", "", Instant::now()));
        inner.insert(dep("b", "chat-b", "", Instant::now()));
        inner.insert(dep("c", "chat-c", "", Instant::now()));
        inner.set_host("b", Some("gpu-1".into()));
        inner.set_host("a", Some("gpu-1".into()));
        inner.set_host("c", Some("gpu-2".into()));
        assert_eq!(on(&inner, "gpu-1"), ["a", "b"], "by ID");
        assert_eq!(on(&inner, "gpu-2"), ["c"]);
        inner.set_host("a", Some("gpu-2".into()));
        assert_eq!(on(&inner, "gpu-1"), ["b"]);
        assert_eq!(on(&inner, "gpu-2"), ["a", "c"]);
        inner.remove("c");
        assert_eq!(on(&inner, "gpu-2"), ["a"]);
        inner.set_host("b", None);
        assert_eq!(on(&inner, "gpu-1"), Vec::<String>::new());
        assert!(
            !inner.by_host.contains_key("gpu-1"),
            "an empty host's set goes"
        );
        assert_eq!(on(&inner, "gpu-9"), Vec::<String>::new());
    }

    #[tokio::test(start_paused = true)]
    async fn the_last_use_is_the_routers_record_of_requests_or_a_later_state_change() {
        use capyctl_router::admission::Admission;
        use capyctl_router::config::RouterConfig;
        use capyctl_router::coordinator::testing::{FakeLifecycle, FakeState, FakeTimings};
        use tokio::time::{Instant, advance};

        let fake = FakeLifecycle::new(FakeTimings::default());
        let a = fake.add("a", "chat-a", FakeState::Ready, 1);
        let router = fake.spawn(RouterConfig::default());
        fake.announce("a").await;
        let mut inner = State::default();
        inner.insert(dep("a", "chat-a", "", Instant::now()));
        let changed = inner.deps["a"].last_used;
        assert_eq!(inner.deps["a"].used_at(), changed, "no router yet");
        inner.uses.attach(router.last_uses());
        assert_eq!(inner.deps["a"].used_at(), changed, "no request yet");

        // A request's start and end, as the router records them (on its lane: no turn of its
        // task), are the deployment's last use.
        advance(Duration::from_secs(5)).await;
        let deadline = Instant::now() + Duration::from_secs(60);
        let permit = router.admit(a, deadline).await.unwrap();
        assert_eq!(inner.deps["a"].used_at(), changed + Duration::from_secs(5));
        advance(Duration::from_secs(1)).await;
        drop(permit);
        assert_eq!(inner.deps["a"].used_at(), changed + Duration::from_secs(6));
        // A later state change that counts as use wins when it is the later one.
        advance(Duration::from_secs(1)).await;
        inner.deps.get_mut("a").unwrap().last_used = Instant::now();
        assert_eq!(inner.deps["a"].used_at(), changed + Duration::from_secs(7));
        // Dropped, a deployment says so to the name cache entries that still hold it.
        let gone = Arc::clone(&inner.deps["a"].presence.0);
        assert!(!gone.load(Ordering::Acquire));
        inner.remove("a");
        assert!(gone.load(Ordering::Acquire));
    }
}
