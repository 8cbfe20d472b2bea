//! The lifecycle's state and its rules: [`State`], owned by the lifecycle's owner task
//! (`owner.rs`), the one writer. Its methods decide on the state they change, take the time
//! (`now`) where a rule reads it, and never wait: no host agent, no router, no store is called
//! here. A record a rule changes is noted in [`State::dirty`] and written by the next save;
//! engine calls run between two calls, on the caller's task (see `lifecycle/DESIGN.md`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, PoisonError};
use std::time::Duration;

use capyctl_interfaces::HostAgent;
use capyctl_interfaces::launch::MaxRunning;
use capyctl_interfaces::measure::Measurement;
use capyctl_interfaces::router::InstanceKey;
use capyctl_interfaces::spec::{HostSettings, InstanceSpec};
use capyctl_interfaces::tier::ParkTier;
use capyctl_spec::errors::ApiError;
use capyctl_spec::{Activation, EngineKind, InstanceState};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::ids::split_instance_id;
use crate::placement::Fit;
use crate::store::DeploymentRecord;
use crate::{parked_room, views};

mod commands;
mod held;
mod placing;
mod releases;
mod requests;
mod rules;
#[cfg(test)]
mod tests;

pub(crate) use held::Units;
pub(crate) use placing::{Placed, Victims};
pub(crate) use releases::{DownDone, Releasing};
pub(crate) use requests::{NoRequests, Requests, RouterUses};
pub(crate) use rules::{Adoption, StartNext, Started, Up, UpDone};

/// One instance of a deployment (a *unit*: the lifecycle's rules take one instance at a time),
/// with its deployment's record. Index 0 is keyed by the deployment's ID, index `i` by its
/// instance ID `<deployment id>-<i>` ([`unit_id`]); the units of one deployment share what the
/// deployment's record says (the document, the operator's flags: [`State::sync_units`]) and
/// keep their own generation and first answer.
#[derive(Debug)]
pub(crate) struct Dep {
    /// Its key in [`State::deps`] ([`unit_id`]) where it is not its deployment's ID (index
    /// 0: [`Dep::id`] is `rec.id`). NB (memory at scale): a copy of the ID per deployment
    /// was some 50 bytes of heap.
    unit: Option<Box<str>>,
    /// Its instance's index within the deployment.
    pub(crate) index: u32,
    /// The GPUs (indexes on its host) its engine is given, when its host has several; empty:
    /// the whole host (one GPU, or none known).
    pub(crate) gpus: Vec<u32>,
    pub(crate) rec: DeploymentRecord,
    pub(crate) measurement: Measurement,
    pub(crate) state: InstanceState,
    /// An engine operation is in progress (the state says which).
    pub(crate) busy: bool,
    /// Reserved as a victim by this switch or release. NB (memory at scale): this, `claim`,
    /// `ended_stop_failed` and `unit` are `Box<str>`, set for few deployments at a time: a
    /// `String`'s capacity word in each was 32 bytes of every `Dep`.
    pub(crate) reserved: Option<Box<str>>,
    /// The target of this switch (memory promised, not yet starting).
    pub(crate) claim: Option<Box<str>>,
    /// The host its instance is placed on (claimed, running, parked, or last run on): one
    /// shared copy of each host's ID ([`State::host_names`]). NB (reads at scale): a read
    /// copies it per deployment; a string of its own per deployment was a memory access of its
    /// own (and an allocation) per deployment per read, a fifth of a full load read.
    pub(crate) host: Option<Arc<str>>,
    /// What its engine still holds on the GPU while parked (the agent's reading or estimate).
    pub(crate) parked_gpu: Option<u64>,
    /// Where the engine answers (from the host agent's `base_url`: loopback for child
    /// processes, the Pod's IP for engine Pods).
    pub(crate) addr: Option<SocketAddr>,
    pub(crate) pid: Option<u32>,
    pub(crate) tier: Option<ParkTier>,
    pub(crate) last_error: Option<String>,
    /// The last state change that counts as use (a request's start or end is the router's to
    /// record: [`State::used_at`] reads both).
    pub(crate) last_used: Instant,
    /// When it last failed on its own (a start, wake, park or stop that failed, its engine
    /// exited): the scaler's back-off ([`FAILED_BACKOFF`]) counts from here. `None` while it
    /// never did, and when its host lost its engine ([`Dep::lost`]).
    pub(crate) failed_at: Option<Instant>,
    pub(crate) max_running: Option<MaxRunning>,
    /// Set (once per bring-up) to end the start or wake in progress: what its waiting requests
    /// and the bring-up's caller get (`deployment_stopped` for a stop, `model_not_found` for
    /// a delete, `unavailable` for `start --evict` of another model). See
    /// [`Core::end_bring_up`]. Made when first asked for ([`Dep::end`]) and let go when the
    /// bring-up is over (each one is some 400 bytes: 40 MB for 100,000 deployments used).
    pub(crate) end: OnceLock<watch::Sender<Option<ApiError>>>,
    /// The stop of its engine failed (the agent's error): after a start or wake it ended, a
    /// park that failed, or a stop. The engine may still hold its GPU memory: while it is
    /// failed so, the books count that memory ([`Dep::keeps_engine`]) and `start --evict` does
    /// not count it as released. Cleared when a stop succeeds, when its engine is seen gone
    /// (it exited, or its host no longer has it), and when the next bring-up begins.
    pub(crate) ended_stop_failed: Option<Box<str>>,
    /// The start or wake in progress (or last begun) is an operator's: `start`, a pending
    /// start, `start --evict`, `preinitialize`. Another model's requests never end it
    /// ([`Victims::Idle`]); only the operator's `stop`, `delete` or another `start --evict`
    /// do. Set by every [`State::begin_up`].
    pub(crate) operator_up: bool,
    /// Marked gone when it is dropped: the name cache's entries for it are stale then.
    pub(crate) presence: PresenceOf,
    /// What the views show of its record that only a deploy changes, shared with the reads
    /// that build views outside the lock (renewed when the revision moves on).
    pub(crate) fixed: Arc<views::Fixed>,
}

impl Dep {
    /// Instance 0 of the deployment `rec` records, last used `now`.
    pub(crate) fn new(rec: DeploymentRecord, now: Instant) -> Self {
        Self::replica(rec, 0, now)
    }

    /// Instance `index` of the deployment `rec` records, last used `now`.
    pub(crate) fn replica(rec: DeploymentRecord, index: u32, now: Instant) -> Self {
        let fixed = Arc::new(views::Fixed::of(&rec, index));
        Self {
            unit: (index > 0).then(|| unit_id(&rec.id, index).into()),
            index,
            gpus: Vec::new(),
            rec,
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
            last_used: now,
            failed_at: None,
            max_running: None,
            end: OnceLock::new(),
            ended_stop_failed: None,
            operator_up: false,
            presence: PresenceOf(Arc::new(AtomicBool::new(false))),
            fixed,
        }
    }

    /// Renews what the views share of its record after a deploy changed it.
    pub(crate) fn renew_fixed(&mut self) {
        self.fixed = Arc::new(views::Fixed::of(&self.rec, self.index));
    }

    /// Its instance spec, as its host agent is given it: made from its document when asked
    /// for (an engine's start, measure or park; nothing on a read's path or in placement reads
    /// one: they read the document, e.g. [`parked_room::TierModel`]). NB (memory at scale):
    /// not kept; one per deployment (an `Arc` of 280 bytes and three strings copied from the
    /// document) was some 350 bytes of heap and four allocations per deployment.
    pub(crate) fn spec(&self) -> InstanceSpec {
        InstanceSpec::from_doc(self.rec.id.clone(), &self.rec.doc)
    }

    /// Its engine (its spec's).
    pub(crate) fn engine(&self) -> EngineKind {
        self.rec.doc.engine_kind()
    }

    /// The spec its engine starts with: its deployment's, on the GPUs placement chose for it
    /// (`CUDA_VISIBLE_DEVICES`) when its host has several. Those are NVML's indices (PCI bus
    /// order, as `nvidia-smi` numbers them), so `CUDA_DEVICE_ORDER=PCI_BUS_ID` goes with them:
    /// CUDA's own default order puts the fastest GPU first, which on a box of mixed GPUs would
    /// give the engine other GPUs than the ones whose memory was counted for it.
    pub(crate) fn launch_spec(&self) -> InstanceSpec {
        let mut spec = self.spec();
        if !self.gpus.is_empty() {
            let list: Vec<String> = self.gpus.iter().map(u32::to_string).collect();
            spec.env
                .insert(crate::gpus::VISIBLE_DEVICES.to_string(), list.join(","));
            spec.env
                .insert("CUDA_DEVICE_ORDER".to_string(), "PCI_BUS_ID".to_string());
        }
        spec
    }

    /// The signal that ends its bring-up in progress (see the field).
    pub(crate) fn end(&self) -> &watch::Sender<Option<ApiError>> {
        self.end.get_or_init(|| watch::channel(None).0)
    }

    /// Counts `now` as its last use (a state change that counts as use; a request's is the
    /// router's record: [`State::used_at`]). The one place `last_used` is stamped.
    pub(crate) fn touch(&mut self, now: Instant) {
        self.last_used = now;
    }

    /// Marks it failed at `now`, with `why`: its engine is gone (no address, process or tier),
    /// and the scaler's back-off starts.
    pub(crate) fn fail(&mut self, why: String, now: Instant) {
        self.engine_gone(why, Some(now));
    }

    /// Marks it failed because its host no longer has its engine (a node agent that came
    /// back without it): the engine did not fail on its own, so no back-off holds it.
    pub(crate) fn lost(&mut self, why: String) {
        self.engine_gone(why, None);
    }

    /// Marks it failed, with `why` and the back-off's start (`failed_at`).
    fn engine_gone(&mut self, why: String, failed_at: Option<Instant>) {
        self.state = InstanceState::Failed;
        self.tier = None;
        self.addr = None;
        self.pid = None;
        self.last_error = Some(why);
        self.failed_at = failed_at;
    }

    /// In the scaler's back-off: failed on its own less than [`FAILED_BACKOFF`] before `now`.
    pub(crate) fn backing_off(&self, now: Instant) -> bool {
        self.state == InstanceState::Failed
            && self
                .failed_at
                .is_some_and(|at| now.saturating_duration_since(at) < FAILED_BACKOFF)
    }

    /// Nothing runs, is on its way or is reserved for it, and no engine it could not stop may
    /// still hold its memory ([`Dep::keeps_engine`]): dropping it loses nothing. NB: a failed
    /// instance past `replicas` dropped while its engine was kept counted that memory free.
    pub(crate) fn holds_nothing(&self) -> bool {
        !self.busy
            && self.reserved.is_none()
            && self.claim.is_none()
            && !self.keeps_engine()
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
        self.unit.as_deref().unwrap_or(&self.rec.id)
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

    /// Failed, but its engine could not be stopped ([`Dep::ended_stop_failed`]): the engine may
    /// still hold its GPU memory, so placement counts what it needs awake on its host until a
    /// stop succeeds or the engine is seen gone.
    ///
    /// NB: counted free, another model could be brought up on that memory (a park that failed
    /// and whose engine could not be stopped either: the GPU over-booked).
    pub(crate) fn keeps_engine(&self) -> bool {
        self.state == InstanceState::Failed && self.ended_stop_failed.is_some()
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
        let bound = self.occupies()
            || self.keeps_engine()
            || self.state == InstanceState::Parked
            || self.claim.is_some();
        if bound { self.host.as_deref() } else { None }
    }

    /// The bytes it holds on a host of `capacity` bytes, as placement counts them while
    /// [`Dep::holds_gpu`]: what its parked engine still holds (parked and not claimed), else
    /// what it needs awake.
    pub(crate) fn held_bytes(&self, capacity: u64) -> u64 {
        if self.state == InstanceState::Parked && self.claim.is_none() {
            self.parked_holds()
        } else {
            self.need(capacity)
        }
    }

    /// Whether it holds GPU memory, or is promised it: its engine holds memory (or may: it could
    /// not be stopped, [`Dep::keeps_engine`]), it is claimed by a switch, or it is parked with
    /// a residue on the GPU (what placement counts).
    pub(crate) fn holds_gpu(&self) -> bool {
        self.occupies() || self.keeps_engine() || self.claim.is_some() || self.parked_holds() > 0
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
        let model = parked_room::TierModel::from(&*self.rec.doc);
        if !parked_room::parks(model) {
            return 0;
        }
        capyctl_engine_rules::parked::parked_estimate(
            self.measurement.weights_bytes(),
            model.speculative,
            capyctl_interfaces::spec::tensor_parallel(&self.rec.doc).unwrap_or(1),
        )
        .unwrap_or(0)
    }

    /// Whether it parks when released (not TensorFold, `restart_only` or a decision model).
    pub(crate) fn parks(&self) -> bool {
        parked_room::parks(&*self.rec.doc)
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
    /// By ID. Boxed: a `Dep` is about a kilobyte, and a map filled in ID order (a document's
    /// new deployments: ULIDs) leaves its nodes about half full, so inline each deployment cost
    /// about twice its size.
    /// Written only through [`Units`]' own methods, which note each unit written for the held
    /// sums ([`State::gpu_held`]).
    pub(crate) deps: Units,
    /// The GPU memory held on each host and GPU, kept in step with `deps` by
    /// [`State::settle_held`]: placement answers "it fits now" from these (`state/held.rs`).
    pub(crate) gpu_held: held::Held,
    /// Deployment IDs by name (kept by [`State::insert`] and [`State::remove`]; a name never
    /// changes: a deploy of the same name is the same deployment). NB (memory at scale): the
    /// one copy of each ID that the by-host index and the held sums' `counted` share.
    pub(crate) by_name: HashMap<String, Arc<str>>,
    /// IDs whose records changed since they were last written (deleted ones too): the next
    /// save writes them ([`Core::save`]).
    pub(crate) dirty: Dirty,
    pub(crate) reservations: HashMap<String, Reservation>,
    /// Every host, by ID.
    pub(crate) hosts: Hosts,
    /// The deployments whose instance is on each host (`Dep::host`: claimed, running, parked,
    /// or last run there), by host ID: placement and the host view read a host's deployments
    /// without scanning all of them. Kept by [`State::set_host`], the one writer of
    /// `Dep::host` (and [`State::remove`]).
    /// NB (memory at scale): the IDs are [`State::by_name`]'s, shared (`Arc<str>`; so are the
    /// held sums' `counted`, [`held::Held::counted`]): a `String` of its own in each was some
    /// 70 bytes per deployment used.
    pub(crate) by_host: HashMap<String, BTreeSet<Arc<str>>>,
    /// The host IDs units are bound to, once each: what `Dep::host` shares
    /// ([`State::set_host`]; those no unit holds are let go when they outnumber the hosts).
    pub(crate) host_names: BTreeSet<Arc<str>>,
    /// The hosts drained and out of service (`capyctl drain host`): placement passes them by.
    pub(crate) cordoned: BTreeSet<String>,
    /// The deployments that hold GPU memory on each host (exactly those once
    /// [`State::settle_held`] has run; a unit bound since may be among them): what placement
    /// reads when it needs the victims. NB (memory at scale): the IDs are `by_host`'s, shared.
    pub(crate) holding: HashMap<String, BTreeSet<Arc<str>>>,
    /// The units that may hold a parked copy in host RAM, by host: what a park reads to make
    /// room for its copy (`Core::make_parked_room`).
    pub(crate) parked_copies: parked_room::CopiesIndex,
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
    pub(crate) gpus: Vec<capyctl_interfaces::inventory::GpuInfo>,
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
        self.deps
            .get(key)
            .map(|d| &**d)
            .or_else(|| self.by_name(key))
    }

    pub(crate) fn by_name(&self, name: &str) -> Option<&Dep> {
        self.by_name
            .get(name)
            .and_then(|id| self.deps.get(&**id))
            .map(|d| &**d)
    }

    /// Every instance of deployment `dep` (its units: [`unit_id`]), in key order.
    pub(crate) fn units_of<'a>(&'a self, dep: &'a str) -> impl Iterator<Item = &'a Dep> + 'a {
        self.deps
            .range::<str, _>((std::ops::Bound::Included(dep), std::ops::Bound::Unbounded))
            .take_while(move |(k, _)| {
                k.as_str() == dep || k.strip_prefix(dep).is_some_and(|r| r.starts_with('-'))
            })
            .map(|(_, d)| &**d)
            .filter(move |d| d.rec.id == dep)
    }

    /// Unit `d`'s last use: the later of a request's start or end (the router's record,
    /// `requests`) and the last state change that counts as use ([`Dep::touch`]).
    pub(crate) fn used_at(d: &Dep, requests: &dyn Requests) -> Instant {
        requests
            .last_use(&d.rec.id)
            .map_or(d.last_used, |t| t.max(d.last_used))
    }

    /// Unit `d` runs requests the router forwarded to it now (its record, `requests`).
    pub(crate) fn runs_requests(d: &Dep, requests: &dyn Requests) -> bool {
        requests.in_flight(d.dep_id(), d.index) > 0
    }

    /// The unit keys of deployment `dep`'s instances.
    pub(crate) fn unit_ids(&self, dep: &str) -> Vec<String> {
        self.units_of(dep).map(|d| d.id().to_string()).collect()
    }

    /// Adds `dep` (a name already known keeps its deployment: the first one loaded), with its
    /// other instances ([`State::sync_units`], created as last used when `dep` was).
    pub(crate) fn insert(&mut self, dep: Dep) {
        self.by_name
            .entry(dep.name().to_string())
            .or_insert_with(|| Arc::from(dep.rec.id.as_str()));
        let id = dep.rec.id.clone();
        let born = dep.last_used;
        self.deps.insert(id.clone(), Box::new(dep));
        self.sync_units(&id, born);
    }

    /// Brings the instances of every deployment whose record changed in this turn in step
    /// with it ([`State::sync_units`]); the owner runs it after each turn.
    pub(crate) fn sync_touched(&mut self, now: Instant) {
        for id in std::mem::take(&mut self.dirty.touched) {
            self.sync_units(&id, now);
        }
    }

    /// Keeps deployment `dep`'s instances in step with its record (instance 0's): one unit per
    /// replica, each with the record's document, revision and operator's flags (its
    /// generation, first answer and pending start are its own) and the deployment's
    /// measurement; units past `replicas` that hold nothing are dropped (those still running
    /// are stopped by the scaler first: [`State::surplus`]).
    pub(crate) fn sync_units(&mut self, dep: &str, now: Instant) {
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
                        d.rec.doc = Arc::clone(&rec.doc);
                        d.rec.revision = rec.revision;
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
                    let mut d = Dep::replica(own, index, now);
                    d.measurement = measurement;
                    self.deps.insert(unit, Box::new(d));
                }
            }
        }
        let gone: Vec<String> = self
            .units_of(dep)
            .filter(|d| d.index >= replicas && d.holds_nothing())
            .map(|d| d.id().to_string())
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
    pub(crate) fn scale_inputs(&self, requests: &dyn Requests, now: Instant) -> Vec<ScaleInput> {
        self.replicated
            .iter()
            .filter_map(|id| {
                let first = self.deps.get(id)?;
                let mut units: Vec<crate::scale::UnitInfo> = self
                    .units_of(id)
                    .map(|u| crate::scale::UnitInfo {
                        unit: u.id().to_string(),
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
                        || self.scaler_kept_off(id, requests)
                        || self.held.is_some()
                        || self.fence.is_some(),
                    units,
                })
            })
            .collect()
    }

    /// The ready instances of the deployments with several, with their host's agent and
    /// instance ID: whose engines' waiting counts the router's `least_loaded` reads
    /// (`Core::feed_engine_loads`).
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
    /// used it since ([`State::idle_taken`]; its requests: the router's record, `requests`).
    fn scaler_kept_off(&self, dep: &str, requests: &dyn Requests) -> bool {
        self.operator_parked.contains(dep)
            || self
                .idle_taken
                .get(dep)
                .is_some_and(|at| requests.last_use(dep).is_none_or(|used| used <= *at))
    }

    /// The scaler's bring-up of `unit` (see [`crate::scale`]): into free room only, never
    /// naming a victim; `None` when there is none now, or it is not free to come up.
    /// `requests`: the router's record (whether the deployment was used since its idle timer
    /// took an instance down).
    pub(crate) fn scale_up(
        &mut self,
        unit: &str,
        requests: &dyn Requests,
        now: Instant,
    ) -> Option<Up> {
        let d = self.deps.get(unit)?;
        let free = !d.busy
            && d.reserved.is_none()
            && d.claim.is_none()
            && !d.rec.operator_stopped
            && matches!(
                d.state,
                InstanceState::Parked | InstanceState::Stopped | InstanceState::Failed
            );
        if !free || self.held.is_some() || self.scaler_kept_off(dep_of_unit(unit), requests) {
            return None;
        }
        // NB: no victims, so the placement reads nothing of the record.
        let (placed, fit) =
            self.place_target(unit, &BTreeSet::new(), Victims::None, &NoRequests, now);
        if fit != Fit::Now {
            return None;
        }
        self.set_placed(unit, placed);
        // The scaler's: no operator asked for it.
        self.begin_up(unit, false, now)
    }

    /// The scaler's bring-up of the first of `units` (best first) that has room now (see
    /// [`State::scale_up`]), in one turn: no other change comes between the tries.
    pub(crate) fn scale_up_first(
        &mut self,
        units: Vec<String>,
        requests: &dyn Requests,
        now: Instant,
    ) -> Option<(String, Up)> {
        units.into_iter().find_map(|unit| {
            let up = self.scale_up(&unit, requests, now)?;
            Some((unit, up))
        })
    }

    /// Drops the instances past a lowered `replicas` of deployments `deps` that hold nothing
    /// any more ([`State::settled_surplus`]), at `now`.
    pub(crate) fn drop_surplus(&mut self, deps: &[String], now: Instant) {
        for dep in deps {
            self.sync_units(dep, now);
        }
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
        let dep = *self.deps.remove(id)?;
        if self.by_name.get(dep.name()).is_some_and(|i| &**i == id) {
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

/// Puts `id` in `host`'s set in a by-host `index` ([`State::holding`]) where it is not there
/// yet, as `shared` makes it (the one copy of the ID the indexes share): [`unindex`]'s twin.
pub(crate) fn index(
    index: &mut HashMap<String, BTreeSet<Arc<str>>>,
    host: &str,
    id: &str,
    shared: impl FnOnce() -> Arc<str>,
) {
    let ids = index.entry(host.to_string()).or_default();
    if !ids.contains(id) {
        ids.insert(shared());
    }
}

/// Takes `id` out of `host`'s set in a by-host `index` ([`State::by_host`], [`State::holding`]),
/// and the set with it when it is left empty.
pub(crate) fn unindex<K: std::borrow::Borrow<str> + Ord>(
    index: &mut HashMap<String, BTreeSet<K>>,
    host: &str,
    id: &str,
) {
    if let Some(ids) = index.get_mut(host) {
        ids.remove(id);
        if ids.is_empty() {
            index.remove(host);
        }
    }
}

/// The by-host index.
impl State {
    /// Binds (or unbinds) deployment `id`'s instance to `host`, keeping the by-host indexes:
    /// a deployment bound to a host is among its possible GPU holders (`holding`) until
    /// [`State::settle_held`] finds it holds nothing there.
    pub(crate) fn set_host(&mut self, id: &str, host: Option<String>) {
        let host = host.map(|h| match self.host_names.get(h.as_str()) {
            Some(name) => Arc::clone(name),
            None => {
                // Bounded: the names no unit holds any more (hosts gone) are let go once
                // there are twice as many names as hosts.
                if self.host_names.len() > 2 * self.hosts.len() + 64 {
                    self.host_names.retain(|n| Arc::strong_count(n) > 1);
                }
                let name: Arc<str> = Arc::from(h);
                self.host_names.insert(Arc::clone(&name));
                name
            }
        });
        let Some(d) = self.deps.get_mut(id) else {
            return;
        };
        if d.host != host
            && let Some(old) = d.host.take()
        {
            unindex(&mut self.by_host, &old, id);
            unindex(&mut self.holding, &old, id);
        }
        if let Some(new) = &host {
            let ids = self.by_host.entry(new.to_string()).or_default();
            let shared = match ids.get(id) {
                Some(shared) => Arc::clone(shared),
                None => {
                    // The deployment's ID as `by_name` holds it (an instance after the first
                    // has a key of its own).
                    let shared = self.by_name.get(d.name()).filter(|i| &***i == id);
                    let shared = shared.map_or_else(|| Arc::from(id), Arc::clone);
                    ids.insert(Arc::clone(&shared));
                    shared
                }
            };
            index(&mut self.holding, new, id, || shared);
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

    /// The deployments that hold GPU memory on `host` (a superset of those that do until
    /// [`State::settle_held`] runs), by ID.
    fn holding_on<'a>(&'a self, host: &'a str) -> impl Iterator<Item = &'a Dep> + 'a {
        self.holding
            .get(host)
            .into_iter()
            .flatten()
            .filter_map(|id| self.deps.get(&**id).map(|d| &**d))
            .filter(move |d| d.host.as_deref() == Some(host))
    }

    /// The deployments whose instance is on `host` (`Dep::host`), by ID.
    pub(crate) fn on_host<'a>(&'a self, host: &'a str) -> impl Iterator<Item = &'a Dep> + 'a {
        self.by_host
            .get(host)
            .into_iter()
            .flatten()
            .filter_map(|id| self.deps.get(&**id).map(|d| &**d))
            .filter(move |d| d.host.as_deref() == Some(host))
    }
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
