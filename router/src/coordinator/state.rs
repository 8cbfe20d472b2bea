//! The coordinator's state and its rules: plain data and functions, no tasks, no channels.
//!
//! Everything that decides lives here. Every entry point takes the current instant and an
//! [`Effects`] through which it answers requests and asks the lifecycle for things; the task in
//! `super` is only plumbing (inbox, replies, spawning the lifecycle's futures). Unit tests drive
//! this module with a recording [`Effects`] and made-up instants.
//!
//! NB: only the owning task ever holds a `State`, so nothing here is shared or locked; a
//! decision is always made on the state it changes ("a read that gates a mutation is a bug").

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use capyctl_spec::errors::ApiError;
use tokio::time::Instant;

use crate::admission::deadline_error;
use crate::config::RouterConfig;
use capyctl_interfaces::router::{
    DeploymentId, DrainReport, Executed, InstanceKey, Plan, PlanFor, SwitchOrder, Upstream,
};

use super::loads::{Published, PublishedInstance, PublishedInstances};
use super::routing::{self, Load, Ring};
use super::vec_map::{Keyed, KeyedVec};
use super::{OperatorResult, OperatorStart};

/// One request's number, unique per coordinator (allocated by the handle).
pub(crate) type Ticket = u64;

/// A switch's number within this coordinator; results of an older switch are ignored.
pub(crate) type SwitchSeq = u64;

/// A lifecycle-initiated release's number.
pub(crate) type ReleaseId = u64;

/// An operator's switch's number (`start --evict`, see [`State::operator_start`]).
pub(crate) type OperatorId = u64;

/// Whose drain an `engine_idle` answer belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DrainOwner {
    /// The drain of the switch with this number.
    Switch(SwitchSeq),
    /// The drain of a release.
    Release(ReleaseId),
}

/// What a granted request is charged to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Grant {
    /// Where to forward (shared with the instance's entry: a grant copies no strings).
    pub upstream: Arc<Upstream>,
    /// The serial of the instance entry it is charged to (see [`Inst::serial`]).
    pub serial: u64,
    /// How long it waited for one of the in-flight slots of its deployment while that was
    /// servable (see [`crate::admission::deadline_error`]).
    pub at_bound: Duration,
}

/// How a granted request ended (reported by the permit's `Drop`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Finished {
    /// The instance it was charged to.
    pub key: InstanceKey,
    /// The serial of that instance entry.
    pub serial: u64,
    /// The engine produced output for it.
    pub output: bool,
    /// It was cut short.
    pub cut: bool,
}

/// A request asking to be admitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AdmitRequest {
    /// Its number.
    pub ticket: Ticket,
    /// The deployment it names.
    pub deployment: DeploymentId,
    /// Past this it fails with `QueueDeadline` or `InFlightDeadline`.
    pub deadline: Instant,
    /// Its prompt's prefix key, for a deployment routed by `prefix` (`None`: least_loaded; see
    /// [`routing`]).
    pub prefix: Option<u64>,
    /// The instances that have the LoRA adapter it names loaded (DESIGN 4.9; empty for a
    /// model's request): one of them takes it when any is open with room (see
    /// [`routing::preferred`]), before its prefix or least_loaded.
    pub prefer: Box<[InstanceKey]>,
    /// Its deployment's `priority` as the request resolved it (DESIGN 4.10; 0 when unset).
    pub priority: i32,
    /// Its tenant, when the listener asks for keys (DESIGN 4.10: fair waiting, see
    /// [`Dep::next_waiter`]); `None`: no tenants.
    pub tenant: Option<Arc<str>>,
}

/// What the state asks of the world. The task implements it with channels and spawned
/// lifecycle futures; unit tests record the calls.
pub(crate) trait Effects {
    /// `Lifecycle::admissible`, asked synchronously.
    fn admissible(&mut self, deployment: &DeploymentId) -> Result<(), ApiError>;
    /// Answers a request with a permit. `false` when its client has gone (nothing is charged).
    fn grant(&mut self, ticket: Ticket, grant: Grant) -> bool;
    /// Answers a request with an error.
    fn refuse(&mut self, ticket: Ticket, error: ApiError);
    /// Starts `Lifecycle::plan`; its result comes back as [`State::plan_done`].
    fn plan(
        &mut self,
        seq: SwitchSeq,
        deployment: DeploymentId,
        protected: BTreeSet<DeploymentId>,
        who: PlanFor,
    );
    /// Starts `Lifecycle::execute`; its result comes back as [`State::execute_done`].
    fn execute(&mut self, seq: SwitchSeq, order: SwitchOrder);
    /// Answers an operator's switch.
    fn operator_done(&mut self, id: OperatorId, result: OperatorResult);
    /// `Lifecycle::abandon`.
    fn abandon(&mut self, switch_id: &str);
    /// `Lifecycle::switch_failed`.
    fn switch_failed(&mut self, failed: &SwitchOrder, error: &ApiError) {
        let _ = (failed, error);
    }
    /// `Lifecycle::switch_draining`.
    fn switch_draining(&mut self, switch_id: &str) {
        let _ = switch_id;
    }
    /// Starts `Lifecycle::engine_idle`; its answer comes back as [`State::engine_idle_done`].
    fn engine_idle(&mut self, owner: DrainOwner, instance: InstanceKey);
    /// Answers a release.
    fn released(
        &mut self,
        id: ReleaseId,
        result: Result<Vec<(InstanceKey, DrainReport)>, ApiError>,
    );
}

/// A request waiting in a deployment's queue.
#[derive(Debug, Clone)]
struct Waiter {
    ticket: Ticket,
    enqueued_at: Instant,
    deadline: Instant,
    /// See [`AdmitRequest::prefix`].
    prefix: Option<u64>,
    /// See [`AdmitRequest::prefer`].
    prefer: Box<[InstanceKey]>,
    /// See [`AdmitRequest::tenant`].
    tenant: Option<Arc<str>>,
}

/// A ready instance the router routes to.
#[derive(Debug, Clone)]
struct Inst {
    upstream: Arc<Upstream>,
    /// Unique per entry, so that a permit of an instance that went away and came back under
    /// the same key does not discharge the new entry.
    serial: u64,
    /// Requests forwarded to it now.
    in_flight: usize,
    /// Takes new requests. `false` while it drains (window closed, or a release).
    open: bool,
    /// The last instant a request started or finished on it (or it opened): the admission
    /// window's early close.
    last_activity: Instant,
    /// A request was cut before any output since it opened.
    cut_before_output: bool,
    /// A request was cut after output since it opened: wait for `engine_idle` before releasing.
    cut_after_output: bool,
    /// The engine's waiting requests as of its latest sample ([`State::engine_load`]), and
    /// when that was taken: least_loaded counts it while fresh ([`routing::Load`]).
    engine_waiting: usize,
    engine_sampled: Option<Instant>,
}

/// An instance is kept by its key, which its `Upstream` holds (no copy beside it).
impl Keyed<InstanceKey> for Inst {
    fn key(&self) -> &InstanceKey {
        &self.upstream.key
    }
}

impl Inst {
    /// Its load for the routing policies (`None` while closed: it takes nothing).
    fn load(&self) -> Option<Load> {
        self.open.then_some(Load {
            in_flight: self.in_flight,
            engine_waiting: self.engine_waiting,
            sampled_at: self.engine_sampled,
        })
    }
}

/// Why a deployment is not planned right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Blocked {
    /// The plan said `Later`: plan again when something changes (a switch ends, an instance
    /// opens or closes, a request finishes).
    Later,
    /// The plan said `AlreadyComing` (or the switch for it ended before its instance opened):
    /// wait for the instance; plan again when a switch ends or an instance opens or closes.
    Coming,
    /// The plan said `Later` while other switches with victims were in progress: what it waits
    /// for is most likely what they hold. Plan again when a switch moves on (its drain ends, or
    /// it ends) or an instance opens or closes, not at each request's end (see
    /// [`State::plan_done`]).
    LaterSwitching,
}

/// The router's view of one deployment.
#[derive(Debug, Default)]
struct Dep {
    /// Its instances the router knows, open or draining (a vector by key, each keyed by its
    /// `Upstream`'s: most deployments have one; see `vec_map.rs`).
    instances: KeyedVec<Inst>,
    /// Requests forwarded to it now (also those on instances that went away meanwhile).
    in_flight: usize,
    /// Requests waiting for it (to become servable, or for one of its in-flight slots), oldest
    /// first.
    queue: VecDeque<Waiter>,
    /// No-wait mode: a refused request asked for its wake or start at this instant (a wave of
    /// zero).
    wanted_since: Option<Instant>,
    /// Since when it has had an open instance without a break (`None`: it has none).
    servable_since: Option<Instant>,
    /// Its deployment is gone (deleted, or unknown to the lifecycle): the entry is dropped as
    /// soon as nothing is charged to it or waits for it ([`State::forget_deployment`]).
    forget: bool,
    /// The latest start or end of one of its requests (on any instance, also one that went
    /// away; those on lent slots once their lane is taken back, [`State::lent_used`]): its
    /// last use, which the lifecycle's idle timers and least-recently-used choice read
    /// (`DeploymentLoad::last_used`), and what [`State::release_if_idle`] decides on.
    last_used: Option<Instant>,
    /// The prefix ring over its open instances, built by the first prefix-routed pick after
    /// they changed ([`Dep::ring_for_open`]).
    ring: Option<Ring<InstanceKey>>,
    /// Its `priority`, as its latest request resolved it: of the waves waiting for room, the
    /// higher priority's is planned first ([`State::maybe_plan`]).
    priority: i32,
    /// The tenant of the waiter released last ([`Dep::next_waiter`]).
    last_tenant: Option<Arc<str>>,
}

impl Dep {
    /// Takes the next waiter to release (DESIGN 4.10, fair waiting). Without tenants (no
    /// waiter has one): the oldest, first come first served as the page says. With tenants:
    /// round-robin across the tenants waiting, in the order of their names, starting after
    /// the tenant released last; within one tenant, its oldest.
    ///
    /// NB: a scan of the queue (bounded by `max_pending_per_deployment`) only when a waiter
    /// has a tenant; the queue stays in arrival order, which the deadlines and the waves read.
    fn next_waiter(&mut self) -> Option<Waiter> {
        if self.queue.front()?.tenant.is_none() && self.queue.iter().all(|w| w.tenant.is_none()) {
            return self.queue.pop_front();
        }
        let after = self.last_tenant.as_deref();
        // The oldest waiter of the first tenant after `after`, else of the first tenant.
        let mut next: Option<(&str, usize)> = None;
        let mut first: Option<(&str, usize)> = None;
        for (i, w) in self.queue.iter().enumerate() {
            let t = w.tenant.as_deref().unwrap_or("");
            if first.is_none_or(|(f, _)| t < f) {
                first = Some((t, i));
            }
            if after.is_none_or(|a| t > a) && next.is_none_or(|(n, _)| t < n) {
                next = Some((t, i));
            }
        }
        let (_, at) = next.or(first)?;
        let w = self.queue.remove(at)?;
        self.last_tenant.clone_from(&w.tenant);
        Some(w)
    }

    /// Whether `tenant` may queue one more request, with `limit` the deployment's waiting
    /// limit: its share is the limit divided among the tenants waiting, itself included
    /// (never less than 1). When the queue is full but `tenant` is under its share, the
    /// newest waiter of the tenant with the most waiters (over its share) is the one to
    /// refuse: `Ok(Some(index))`. `Err(())`: `tenant` is at its share (or the queue is full
    /// without tenants).
    fn fair_room(&self, tenant: Option<&str>, limit: usize) -> Result<Option<usize>, ()> {
        let Some(tenant) = tenant else {
            return if self.queue.len() >= limit {
                Err(())
            } else {
                Ok(None)
            };
        };
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for w in &self.queue {
            *counts.entry(w.tenant.as_deref().unwrap_or("")).or_default() += 1;
        }
        let own = counts.get(tenant).copied().unwrap_or(0);
        let tenants = counts.len() + usize::from(own == 0);
        let share = (limit / tenants).max(1);
        if own >= share {
            return Err(());
        }
        if self.queue.len() < limit {
            return Ok(None);
        }
        // Full: the most waiting tenant (the first by name among equals) gives up its newest.
        let (most, n) = counts
            .iter()
            .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))
            .map(|(t, n)| (*t, *n))
            .ok_or(())?;
        if n <= share {
            return Err(());
        }
        let at = self
            .queue
            .iter()
            .rposition(|w| w.tenant.as_deref().unwrap_or("") == most)
            .ok_or(())?;
        Ok(Some(at))
    }

    fn has_open(&self) -> bool {
        self.instances.values().any(|i| i.open)
    }

    /// Notes whether it has an open instance, after its instances opened or closed.
    fn note_servable(&mut self, now: Instant) {
        self.servable_since = if self.has_open() {
            Some(self.servable_since.unwrap_or(now))
        } else {
            None
        };
    }

    /// How long the waiter `w` has waited, until `now`, for one of its in-flight slots while
    /// it was servable.
    fn at_bound(&self, w: &Waiter, now: Instant) -> Duration {
        self.servable_since.map_or(Duration::ZERO, |since| {
            now.saturating_duration_since(since.max(w.enqueued_at))
        })
    }

    fn has_closed(&self) -> bool {
        self.instances.values().any(|i| !i.open)
    }

    /// Its open instances.
    fn open_count(&self) -> usize {
        self.instances.values().filter(|i| i.open).count()
    }

    /// Whether an open instance runs fewer than `cap` requests: a request for it need not
    /// wait (the bound is per instance: DESIGN 4.7).
    fn has_room(&self, cap: usize) -> bool {
        self.instances.values().any(|i| i.open && i.in_flight < cap)
    }

    /// The open instance a request goes to (see [`routing`]): the least loaded of `prefer`
    /// (those with its adapter loaded) when one of them is open with room and there is a
    /// choice; else by its prefix key on the ring with bounded load when it has one and there
    /// is a choice, else least_loaded; never one that runs `cap` already (`None` when every
    /// open instance does).
    ///
    /// NB: no allocation unless the open instances changed since the ring was built.
    fn pick(
        &mut self,
        now: Instant,
        cap: usize,
        prefix: Option<u64>,
        prefer: &[InstanceKey],
    ) -> Option<&mut Inst> {
        if !prefer.is_empty()
            && self.open_count() > 1
            && let Some(at) = routing::preferred(
                now,
                cap,
                self.instances
                    .iter()
                    .map(|(k, i)| (i.load(), prefer.contains(k))),
            )
        {
            return self.instances.values_mut().nth(at);
        }
        if let Some(key) = prefix
            && self.open_count() > 1
        {
            self.ring_for_open();
            let Dep {
                ring, instances, ..
            } = self;
            let ring = ring.as_ref()?;
            let at = routing::bounded_pick(ring, key, cap, |k| {
                instances.get(k).filter(|i| i.open).map(|i| i.in_flight)
            })?;
            return instances.get_mut(ring.members().get(at)?);
        }
        let at = routing::least_loaded(now, cap, self.instances.values().map(Inst::load))?;
        self.instances.values_mut().nth(at)
    }

    /// Builds the prefix ring again if its members are not the open instances now. An
    /// instance is placed by its index and host (not its generation), so one that comes back
    /// gets its old share of prefixes.
    fn ring_for_open(&mut self) {
        let open = self
            .instances
            .iter()
            .filter(|(_, i)| i.open)
            .map(|(k, _)| k);
        if self
            .ring
            .as_ref()
            .is_some_and(|r| r.members().iter().eq(open.clone()))
        {
            return;
        }
        let members: Vec<InstanceKey> = open.cloned().collect();
        self.ring = Some(Ring::new(members, |k| {
            let mut h = routing::Fnv::new();
            h.write(k.host_id.as_bytes());
            h.write(&[0]);
            h.write(&k.index.to_le_bytes());
            h.finish()
        }));
    }

    /// Nothing is charged to it, waits for it or runs for it here: dropping the entry loses
    /// nothing (but a switch, a bring-up or a release may still name it: see
    /// [`State::droppable`]).
    fn holds_nothing(&self) -> bool {
        self.instances.is_empty()
            && self.in_flight == 0
            && self.queue.is_empty()
            && self.wanted_since.is_none()
    }

    /// The router half of its load read, as the owner publishes it.
    fn load(&self, config: &RouterConfig) -> Published {
        Published {
            in_flight: self.in_flight,
            // 32 per ready instance; 32 while none is (the bound its first instance will
            // have: the product page's figure for a model with one instance).
            in_flight_limit: config.in_flight_per_instance * self.open_count().max(1),
            waiting: self.queue.len(),
            waiting_limit: config.max_pending_per_deployment,
            last_used: self.last_used,
            instances: PublishedInstances::of(
                self.instances
                    .values()
                    .map(|i| PublishedInstance::new(Arc::clone(&i.upstream), i.in_flight, i.open)),
            ),
        }
    }

    /// When its demand began: its oldest waiter, or its no-wait wish.
    fn waiting_since(&self) -> Option<Instant> {
        let oldest = self.queue.front().map(|w| w.enqueued_at);
        match (oldest, self.wanted_since) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// Requests running on victims are finished (drain), then `engine_idle` answers are awaited.
#[derive(Debug)]
struct Drain {
    /// Every victim, in the plan's order.
    victims: Vec<InstanceKey>,
    /// The drain bound.
    deadline: Instant,
    /// Set once no request is charged to the victims any more: the reports, and the victims
    /// whose `engine_idle` answer is still awaited.
    settled: Option<Settling>,
}

#[derive(Debug)]
struct Settling {
    reports: Vec<(InstanceKey, DrainReport)>,
    awaiting: BTreeSet<InstanceKey>,
}

/// How a drain stands.
#[derive(Debug, PartialEq, Eq)]
enum DrainPoll {
    Pending,
    Done(Vec<(InstanceKey, DrainReport)>),
    TimedOut { charged: usize },
}

/// The phase of the switch in progress.
#[derive(Debug)]
enum Phase {
    /// `Lifecycle::plan` is running.
    Planning,
    /// The victims still take new requests.
    Window {
        switch_id: String,
        victims: Vec<InstanceKey>,
    },
    /// The victims take no new requests and finish their running ones.
    Draining { switch_id: String, drain: Drain },
    /// `Lifecycle::execute` is running: the victims are being released (forgotten here), the
    /// target wakes or starts. `victims`: whom it releases (no wave of theirs is planned until
    /// it has answered: the lifecycle holds them).
    Executing {
        switch_id: String,
        victims: Vec<InstanceKey>,
    },
}

/// A switch in progress: planning, or with victims (window, drain, execute). Several run at
/// once (switches on different GPUs or hosts, see [`State::maybe_plan`]); a bring-up (no
/// victims) leaves [`State::switches`] once it executes.
#[derive(Debug)]
struct Switch {
    seq: SwitchSeq,
    target: DeploymentId,
    /// When it began (the plan was asked for): the admission window counts from here.
    began: Instant,
    /// The requests waiting for the target when it began (its wave, for its record).
    wave: usize,
    /// The admission window that applies: the plan's (the host where the switch happens), or
    /// the router's.
    window: Duration,
    phase: Phase,
    /// The target was refused or became ready while planning: give the plan back.
    cancelled: bool,
    /// Why it was refused while planning (an operator's switch is answered with it; `None`:
    /// it became ready).
    refusal: Option<ApiError>,
    /// An operator's switch (`start --evict`): whom to answer, and since when it waited for
    /// its turn.
    operator: Option<(OperatorId, Instant)>,
}

impl Switch {
    /// Its victims the router still routes to or drains (window, drain); none while planning
    /// (not known yet) or executing (forgotten: the lifecycle releases them).
    fn routed_victims(&self) -> &[InstanceKey] {
        match &self.phase {
            Phase::Window { victims, .. } => victims,
            Phase::Draining { drain, .. } => &drain.victims,
            Phase::Planning | Phase::Executing { .. } => &[],
        }
    }
}

/// An operator's switch waiting for its turn (see [`State::maybe_plan`]).
#[derive(Debug)]
struct OperatorWait {
    id: OperatorId,
    target: DeploymentId,
    since: Instant,
}

/// A lifecycle-initiated release (operator park/stop/delete, idle timers).
#[derive(Debug)]
struct Release {
    drain: Drain,
}

/// The router's deployments, noting which ones each event changed, so that only their load is
/// published again after it (see `Loads` in `mod.rs`).
///
/// NB: every change goes through [`Deps::get_mut`] or [`Deps::entry`], which note it (but an
/// engine sample, which neither the published load nor the rules read: [`Deps::quiet_mut`]).
///
/// NB (memory at scale): each entry boxed. A `Dep` is 184 bytes, and a B-tree filled in ID
/// order keeps its nodes about half full (11 slots each: 386 bytes per deployment in
/// heaptrack); boxed, a slot is a pointer and the box is the entry's own size (some 130 bytes
/// less per deployment the router knows).
#[derive(Debug, Default)]
struct Deps {
    map: BTreeMap<DeploymentId, Box<Dep>>,
    /// Changed since the last [`State::take_changed`].
    changed: BTreeSet<DeploymentId>,
}

impl Deps {
    fn note(&mut self, id: &str) {
        if !self.changed.contains(id) {
            self.changed.insert(id.to_string());
        }
    }

    fn get(&self, id: &str) -> Option<&Dep> {
        self.map.get(id).map(|d| &**d)
    }

    fn get_mut(&mut self, id: &str) -> Option<&mut Dep> {
        if self.map.contains_key(id) {
            self.note(id);
        }
        self.map.get_mut(id).map(|d| &mut **d)
    }

    /// Its entry, for a change that its published load and the rules do not read (an engine
    /// sample): not noted.
    fn quiet_mut(&mut self, id: &str) -> Option<&mut Dep> {
        self.map.get_mut(id).map(|d| &mut **d)
    }

    /// Its entry, made empty where there is none.
    fn entry(&mut self, id: &DeploymentId) -> &mut Dep {
        self.note(id);
        self.map.entry(id.clone()).or_default()
    }
}

/// All routing state. Owned by the coordinator's task alone.
pub(crate) struct State {
    config: RouterConfig,
    deployments: Deps,
    /// Which deployment each waiting ticket waits for.
    waiting: HashMap<Ticket, DeploymentId>,
    /// Waiting requests over all deployments.
    waiting_total: usize,
    /// Waiting requests by deadline.
    deadlines: BTreeSet<(Instant, Ticket)>,
    /// The switches in progress, by number: at most one planning, any number with victims
    /// (window, drain, execute), each with its own phase, victims and deadlines. Never two to
    /// one target; an operator's switch runs alone (see [`State::maybe_plan`]).
    switches: BTreeMap<SwitchSeq, Switch>,
    /// Why deployments are not planned now (see [`Blocked`]).
    blocked: BTreeMap<DeploymentId, Blocked>,
    /// The deployments with demand (waiters, or a no-wait wish): the candidates of the next
    /// switch. Kept from the deployments each event changes ([`State::note_demand`]).
    demand: BTreeSet<DeploymentId>,
    /// Bring-ups (plans without victims) being executed, by switch number: their targets.
    /// They leave [`State::switches`] once executing (see `plan_done`).
    bring_ups: BTreeMap<SwitchSeq, DeploymentId>,
    /// The bring-ups and executing switches whose target the lifecycle announced ready while
    /// they executed: when their execute answers, the target is not "coming" any more, even
    /// with no open instance (its engine exited meanwhile: nothing announces it again).
    announced: BTreeSet<SwitchSeq>,
    next_seq: SwitchSeq,
    releases: BTreeMap<ReleaseId, Release>,
    /// Operators' switches waiting for their turn, oldest first.
    operators: VecDeque<OperatorWait>,
    next_serial: u64,
}

/// When the admission window of a switch that began at `began` closes, given its open
/// victims' `(in_flight, last_activity)`: `began + window`, or earlier once the victims have
/// gone one window length with no request starting or finishing and none running.
pub(crate) fn window_closes_at(
    began: Instant,
    window: Duration,
    victims: impl IntoIterator<Item = (usize, Instant)>,
) -> Instant {
    let hard = began + window;
    let mut last = None::<Instant>;
    for (in_flight, activity) in victims {
        if in_flight > 0 {
            return hard;
        }
        last = Some(last.map_or(activity, |l| l.max(activity)));
    }
    match last {
        None => began,
        Some(last) => (last + window).clamp(began, hard),
    }
}

impl State {
    /// Empty state.
    pub(crate) fn new(config: RouterConfig) -> Self {
        State {
            config,
            deployments: Deps::default(),
            waiting: HashMap::new(),
            waiting_total: 0,
            deadlines: BTreeSet::new(),
            switches: BTreeMap::new(),
            blocked: BTreeMap::new(),
            demand: BTreeSet::new(),
            bring_ups: BTreeMap::new(),
            announced: BTreeSet::new(),
            next_seq: 0,
            releases: BTreeMap::new(),
            operators: VecDeque::new(),
            next_serial: 0,
        }
    }

    // ----- entry points -----

    /// A request asks to be admitted (rule 1, rule 5, the limits, no-wait mode).
    pub(crate) fn admit(&mut self, now: Instant, req: AdmitRequest, fx: &mut impl Effects) {
        let cap = self.config.in_flight_per_instance;
        let no_wait = self.config.no_wait();
        let dep = self.deployments.entry(&req.deployment);
        dep.priority = req.priority;
        if dep.has_open() {
            // Waits only when every open instance runs its 32 (or others wait already).
            if dep.queue.is_empty() && dep.has_room(cap) {
                let route = (req.prefix, &*req.prefer);
                self.grant_now(now, &req.deployment, req.ticket, Duration::ZERO, route, fx);
            } else if no_wait {
                fx.refuse(
                    req.ticket,
                    ApiError::InFlightNoWait {
                        deployment: req.deployment,
                    },
                );
            } else {
                self.enqueue(now, req, fx);
            }
        } else if dep.has_closed() {
            // Its instances are draining (the window closed, or a release): 503, not a wait;
            // in no-wait mode the 429 of a model that is switching (nothing recorded either: a
            // retry once parking has begun asks for the wake).
            let deployment = req.deployment;
            fx.refuse(
                req.ticket,
                if no_wait {
                    ApiError::NotServableNoWait { deployment }
                } else {
                    ApiError::DispatchClosed { deployment }
                },
            );
        } else if let Err(e) = fx.admissible(&req.deployment) {
            if matches!(e, ApiError::NotFound { .. }) {
                // A deployment the lifecycle does not know (deleted meanwhile): no entry.
                dep.forget = true;
            }
            fx.refuse(req.ticket, e);
        } else if no_wait {
            // A wave of zero: refuse now, but ask for the wake or start all the same.
            if dep.wanted_since.is_none() {
                dep.wanted_since = Some(now);
            }
            fx.refuse(
                req.ticket,
                ApiError::NotServableNoWait {
                    deployment: req.deployment,
                },
            );
        } else {
            self.enqueue(now, req, fx);
        }
        self.settle(now, fx);
    }

    /// Whether `deployment`'s free slots may be lent to the handles (see `Lane` in `mod.rs`):
    /// exactly one instance, open, nobody waiting, and fewer than the per-instance bound
    /// running on it. Its instance, its entry's serial and the free slots (the bound less what
    /// runs on that instance: requests still charged to an instance that went away hold no
    /// slot of this one). A request taking a lent slot is what `admit` would do at once
    /// (`grant_now`: with one instance there is nothing to choose), ahead of time.
    pub(crate) fn lendable(&self, deployment: &str) -> Option<(&Arc<Upstream>, u64, usize)> {
        let cap = self.config.in_flight_per_instance;
        let dep = self.deployments.get(deployment)?;
        if !dep.queue.is_empty() || dep.instances.len() != 1 {
            return None;
        }
        let inst = dep
            .instances
            .values()
            .next()
            .filter(|i| i.open && i.in_flight < cap)?;
        Some((&inst.upstream, inst.serial, cap - inst.in_flight))
    }

    /// Whether a request that took a lent slot may give it back to the lane when it ends
    /// (without telling the owner).
    ///
    /// NB (when a slot may go back without an event): [`State::finished`] of a request that
    /// was not cut changes only counts and `last_activity`, which the owner takes from the lane
    /// before an event that reads them ([`State::lent_settled`]), with three exceptions, none
    /// of which applies to a lent slot's end: it hands the slot to a waiter (a lane is open
    /// only while nobody waits), it moves a drain on (a draining instance is closed, so it has
    /// no lane), and it lets deployments whose plan said `Later` plan again. That last one is
    /// why a slot may go back only while no deployment is blocked `Later`. (A finish during an
    /// admission window moves nothing either: a request that ran at or after the switch's
    /// start already holds the window open to its full length, see [`window_closes_at`].)
    pub(crate) fn returns(&self) -> bool {
        !self.blocked.values().any(|b| *b == Blocked::Later)
    }

    /// The deployments whose counts the rules read at any event: the victims of the switches
    /// in progress (their windows and drains) and of the releases (their drains).
    pub(crate) fn watched(&self) -> impl Iterator<Item = &DeploymentId> {
        let switch = self.switches.values().flat_map(Switch::routed_victims);
        let releases = self.releases.values().flat_map(|r| r.drain.victims.iter());
        switch.chain(releases).map(|k| &k.deployment)
    }

    /// The deployment whose queue `ticket` waits in.
    pub(crate) fn waits_for(&self, ticket: Ticket) -> Option<&DeploymentId> {
        self.waiting.get(&ticket)
    }

    /// The target of switch or bring-up `seq`, if it is in progress.
    pub(crate) fn targets_of(&self, seq: SwitchSeq) -> impl Iterator<Item = &DeploymentId> {
        let switch = self.switches.get(&seq).map(|sw| &sw.target);
        switch.into_iter().chain(self.bring_ups.get(&seq))
    }

    /// The deployments a plan's answer names: the target of the switch being planned and the
    /// plan's victims.
    pub(crate) fn named_by_plan<'a>(
        &'a self,
        result: &'a Result<Plan, ApiError>,
    ) -> impl Iterator<Item = &'a DeploymentId> {
        let victims = match result {
            Ok(Plan::Switch { victims, .. }) => victims.as_slice(),
            _ => &[],
        };
        self.switches
            .values()
            .filter(|sw| matches!(sw.phase, Phase::Planning))
            .map(|sw| &sw.target)
            .chain(victims.iter().map(|k| &k.deployment))
    }

    /// While the instance entry `serial` of `deployment` lent its slots, `net` more requests
    /// started on it than ended (negative: more ended; requests that took a lent slot start
    /// there, and some of them may have given it back), and the latest start or end was at
    /// `last_activity`: charged as `grant_now` and `finished` charge.
    pub(crate) fn lent_settled(
        &mut self,
        deployment: &DeploymentId,
        serial: u64,
        net: i64,
        last_activity: Instant,
    ) {
        let Some(dep) = self.deployments.get_mut(deployment) else {
            return;
        };
        let apply = |count: usize| {
            let magnitude = usize::try_from(net.unsigned_abs()).unwrap_or(usize::MAX);
            if net >= 0 {
                count.saturating_add(magnitude)
            } else {
                count.saturating_sub(magnitude)
            }
        };
        dep.in_flight = apply(dep.in_flight);
        if let Some(inst) = dep.instances.values_mut().find(|i| i.serial == serial) {
            inst.in_flight = apply(inst.in_flight);
            inst.last_activity = inst.last_activity.max(last_activity);
        }
    }

    /// A request started or ended on a lent slot of `deployment` at `at` (the latest such
    /// instant its lane holds, taken with its count by [`State::lent_settled`]): its last use.
    pub(crate) fn lent_used(&mut self, deployment: &DeploymentId, at: Instant) {
        if let Some(dep) = self.deployments.get_mut(deployment) {
            dep.last_used = dep.last_used.max(Some(at));
        }
    }

    /// The lifecycle sampled instance `key`'s engine at `at`: `waiting` requests wait there.
    /// Read by least_loaded while fresh ([`routing::ENGINE_SAMPLE_FRESH`]); an older sample
    /// than the one kept changes nothing. Nothing else depends on it: no rule runs, and the
    /// published load does not change.
    pub(crate) fn engine_load(&mut self, key: &InstanceKey, waiting: usize, at: Instant) {
        if let Some(inst) = self
            .deployments
            .quiet_mut(&key.deployment)
            .and_then(|d| d.instances.get_mut(key))
            && inst.engine_sampled.is_none_or(|t| t <= at)
        {
            inst.engine_waiting = waiting;
            inst.engine_sampled = Some(at);
        }
    }

    /// A request that had taken a lent slot gave it back while the owner decided the event
    /// that blocked a deployment `Later` (its lane still took the end): as [`State::finished`]
    /// would, the deployments blocked `Later` plan again.
    pub(crate) fn lent_ended(&mut self, now: Instant, fx: &mut impl Effects) {
        self.unblock(false);
        self.settle(now, fx);
    }

    /// A waiting client went away: it gives up its own place only.
    pub(crate) fn cancel(&mut self, now: Instant, ticket: Ticket, fx: &mut impl Effects) {
        if let Some(deployment) = self.waiting.remove(&ticket)
            && let Some(dep) = self.deployments.get_mut(&deployment)
            && let Some(pos) = dep.queue.iter().position(|w| w.ticket == ticket)
            && let Some(w) = dep.queue.remove(pos)
        {
            self.forget_waiter(&w);
        }
        self.settle(now, fx);
    }

    /// A granted request ended (its permit was dropped): its slot goes to the oldest waiter.
    pub(crate) fn finished(&mut self, now: Instant, f: Finished, fx: &mut impl Effects) {
        if let Some(dep) = self.deployments.get_mut(&f.key.deployment) {
            dep.in_flight = dep.in_flight.saturating_sub(1);
            dep.last_used = Some(now);
            if let Some(inst) = dep.instances.get_mut(&f.key)
                && inst.serial == f.serial
            {
                inst.in_flight = inst.in_flight.saturating_sub(1);
                inst.last_activity = now;
                if f.cut {
                    if f.output {
                        inst.cut_after_output = true;
                    } else {
                        inst.cut_before_output = true;
                    }
                }
            }
            let deployment = f.key.deployment.clone();
            self.dispatch(now, &deployment, fx);
        }
        self.unblock(false);
        self.settle(now, fx);
    }

    /// The lifecycle opened an instance (rule 5: its waiting requests are released together).
    pub(crate) fn instance_ready(&mut self, now: Instant, up: Upstream, fx: &mut impl Effects) {
        let deployment = up.key.deployment.clone();
        let serial = self.next_serial;
        let dep = self.deployments.entry(&deployment);
        dep.forget = false;
        match dep.instances.get_mut(&up.key) {
            Some(inst) => inst.upstream = Arc::new(up),
            None => {
                self.next_serial += 1;
                dep.instances.insert(Inst {
                    upstream: Arc::new(up),
                    serial,
                    in_flight: 0,
                    open: true,
                    last_activity: now,
                    cut_before_output: false,
                    cut_after_output: false,
                    engine_waiting: 0,
                    engine_sampled: None,
                });
            }
        }
        dep.note_servable(now);
        dep.wanted_since = None;
        let executing = self
            .bring_ups
            .iter()
            .filter(|(_, target)| **target == deployment)
            .map(|(seq, _)| *seq)
            .chain(
                self.switches
                    .iter()
                    .filter(|(_, sw)| {
                        sw.target == deployment && matches!(sw.phase, Phase::Executing { .. })
                    })
                    .map(|(seq, _)| *seq),
            );
        self.announced.extend(executing);
        self.unblock(true);
        // The target became ready by other means: the switch is not needed any more.
        self.cancel_switch_to(now, &deployment, None, fx);
        self.dispatch(now, &deployment, fx);
        self.settle(now, fx);
    }

    /// The lifecycle says an instance went away.
    pub(crate) fn instance_gone(&mut self, now: Instant, key: InstanceKey, fx: &mut impl Effects) {
        if let Some(dep) = self.deployments.get_mut(&key.deployment) {
            dep.instances.remove(&key);
            dep.note_servable(now);
            if dep.has_closed() {
                // The last open instance may have gone while others drain: then its waiters
                // end as when it closes, and as a request that comes now does (`admit`).
                self.end_waiters_of_closed(&key.deployment, fx);
            }
        }
        // NB: a victim that went away stays in its switch's or release's list: it counts as
        // drained (nothing charged) and is still named in the order, so that the lifecycle
        // settles its reservation.
        self.unblock(true);
        self.settle(now, fx);
    }

    /// The lifecycle's rules changed (see `CoordinatorHandle::replan`): everything blocked
    /// plans again.
    pub(crate) fn replan(&mut self, now: Instant, fx: &mut impl Effects) {
        self.unblock(true);
        self.settle(now, fx);
    }

    /// Fails every request waiting for `deployment` with `error` (e.g. an operator stop), and
    /// gives up a switch to it that has not begun executing.
    pub(crate) fn deployment_refused(
        &mut self,
        now: Instant,
        deployment: &DeploymentId,
        error: ApiError,
        fx: &mut impl Effects,
    ) {
        self.fail_waiters(deployment, &error, fx);
        if let Some(dep) = self.deployments.get_mut(deployment) {
            dep.wanted_since = None;
        }
        self.blocked.remove(deployment);
        self.refuse_operators(deployment, &error, fx);
        self.cancel_switch_to(now, deployment, Some(&error), fx);
        self.settle(now, fx);
    }

    /// `Lifecycle::plan` answered for switch `seq` (rule 2).
    pub(crate) fn plan_done(
        &mut self,
        now: Instant,
        seq: SwitchSeq,
        result: Result<Plan, ApiError>,
        fx: &mut impl Effects,
    ) {
        let planning = self
            .switches
            .get(&seq)
            .is_some_and(|sw| matches!(sw.phase, Phase::Planning));
        let Some(mut sw) = planning.then(|| self.switches.remove(&seq)).flatten() else {
            // Stale: give back whatever it reserved.
            if let Ok(Plan::BringUp { switch_id } | Plan::Switch { switch_id, .. }) = &result {
                fx.abandon(switch_id);
            }
            return;
        };
        let target = sw.target.clone();
        // An operator's switch goes on when the deployment already serves: with several
        // instances, `start --evict` makes room for each (the lifecycle's plan says "already
        // coming" once every one it starts is up).
        let target_ready =
            sw.operator.is_none() && self.deployments.get(&target).is_some_and(|d| d.has_open());
        if sw.cancelled || target_ready {
            if let Ok(Plan::BringUp { switch_id } | Plan::Switch { switch_id, .. }) = &result {
                fx.abandon(switch_id);
            }
            if let Some((id, _)) = sw.operator {
                fx.operator_done(id, sw.refusal.map_or(Ok(OperatorStart::AlreadyComing), Err));
            }
            self.settle(now, fx);
            return;
        }
        if let Some(operator) = sw.operator {
            self.operator_plan_done(now, sw, operator, result, fx);
            return;
        }
        match result {
            Err(e) => {
                self.fail_waiters(&target, &e, fx);
                if let Some(dep) = self.deployments.get_mut(&target) {
                    dep.wanted_since = None;
                }
            }
            Ok(Plan::AlreadyComing) => {
                // Not a switch ending: nothing else is unblocked (two `Later` deployments
                // would otherwise plan each other in a loop).
                if let Some(dep) = self.deployments.get_mut(&target) {
                    dep.wanted_since = None;
                    self.blocked.insert(target.clone(), Blocked::Coming);
                }
            }
            Ok(Plan::Later) => {
                // NB (no plan per request end while other switches run): the lifecycle answers
                // `Later` for memory held by other switches (reserved victims, claimed
                // targets) or by instances it is operating on; a request's end frees neither.
                // With other switches with victims in progress, the wave is planned again when
                // one of them moves on, which is never later than with one switch at a time
                // (it was planned only once the switch in progress ended), and the lent slots
                // keep giving ends back meanwhile ([`State::returns`]).
                if self.deployments.get(&target).is_some() {
                    let why = if self.switches.is_empty() {
                        Blocked::Later
                    } else {
                        Blocked::LaterSwitching
                    };
                    self.blocked.insert(target.clone(), why);
                }
            }
            Ok(Plan::BringUp { switch_id }) => {
                // NB: a bring-up releases nothing, so it leaves `switches` now: a cold
                // start that takes minutes does not hold up other switches. The lifecycle's
                // claim on the target and its memory reservation keep placements apart.
                self.bring_ups.insert(seq, target.clone());
                fx.execute(
                    seq,
                    SwitchOrder {
                        switch_id,
                        target,
                        victims: Vec::new(),
                        window: Duration::ZERO,
                        drain: Duration::ZERO,
                        began: sw.began,
                        wave: sw.wave,
                        operator: false,
                    },
                );
            }
            Ok(Plan::Switch {
                switch_id,
                victims,
                window,
            }) => {
                // Invariant: a victim is never protected. A request may have begun waiting for
                // a victim's deployment while the plan ran: give the plan back, plan again.
                if self.names_protected(&victims) {
                    fx.abandon(&switch_id);
                } else {
                    // A victim whose deployment has another open instance that no switch
                    // names as a victim has no window: close it now (its deployment's requests
                    // go to the other instances; its running ones drain).
                    let closing = self.without_window(&victims);
                    if let Some(window) = window {
                        sw.window = window;
                    }
                    sw.phase = Phase::Window { switch_id, victims };
                    self.switches.insert(seq, sw);
                    self.close(&closing, fx);
                }
            }
        }
        self.settle(now, fx);
    }

    /// `Lifecycle::execute` answered for switch `seq` (rule 4), a switch with victims or a
    /// bring-up.
    pub(crate) fn execute_done(
        &mut self,
        now: Instant,
        seq: SwitchSeq,
        result: Result<Executed, ApiError>,
        fx: &mut impl Effects,
    ) {
        // Announced (and perhaps gone since): not waited for as coming.
        let announced = self.announced.remove(&seq);
        let target = if let Some(target) = self.bring_ups.remove(&seq) {
            self.unblock(true);
            target
        } else {
            let executing = self
                .switches
                .get(&seq)
                .is_some_and(|sw| matches!(sw.phase, Phase::Executing { .. }));
            let Some(sw) = executing.then(|| self.switches.remove(&seq)).flatten() else {
                return;
            };
            self.end_switch();
            if let (Some((id, _)), Phase::Executing { switch_id, .. }) = (sw.operator, sw.phase) {
                // An operator's switch answers the operator; the target's waiters (if any) are
                // not the operator's: on an error they plan a switch of their own.
                let answer = match result {
                    Ok(executed) => {
                        if let Some(dep) = self.deployments.get_mut(&sw.target)
                            && !dep.has_open()
                            && !announced
                        {
                            // Its start or wake goes on in the lifecycle.
                            self.blocked.insert(sw.target.clone(), Blocked::Coming);
                        }
                        Ok(OperatorStart::Switched {
                            switch_id,
                            executed,
                        })
                    }
                    Err(e) => Err(e),
                };
                fx.operator_done(id, answer);
                self.settle(now, fx);
                return;
            }
            sw.target
        };
        match result {
            Ok(_) => {
                if let Some(dep) = self.deployments.get_mut(&target) {
                    dep.wanted_since = None;
                    if !dep.has_open() && !announced {
                        // The lifecycle has not announced the instance yet.
                        self.blocked.insert(target.clone(), Blocked::Coming);
                    }
                }
            }
            Err(e) => {
                self.fail_waiters(&target, &e, fx);
                if let Some(dep) = self.deployments.get_mut(&target) {
                    dep.wanted_since = None;
                }
            }
        }
        self.settle(now, fx);
    }

    /// `Lifecycle::engine_idle` answered for a victim of `owner`'s drain.
    pub(crate) fn engine_idle_done(
        &mut self,
        now: Instant,
        owner: DrainOwner,
        key: InstanceKey,
        idle: bool,
        fx: &mut impl Effects,
    ) {
        let drain = match owner {
            DrainOwner::Switch(seq) => match self.switches.get_mut(&seq).map(|sw| &mut sw.phase) {
                Some(Phase::Draining { drain, .. }) => Some(drain),
                _ => None,
            },
            DrainOwner::Release(id) => self.releases.get_mut(&id).map(|r| &mut r.drain),
        };
        if let Some(Drain {
            settled: Some(s), ..
        }) = drain
            && s.awaiting.remove(&key)
            && !idle
        {
            mark_cut_before_output(&mut s.reports, &key);
        }
        self.settle(now, fx);
    }

    /// The lifecycle asks to release `victims`: close them, drain them within the bound, and
    /// answer with their reports (or, on a drain timeout, reopen them and answer the error).
    pub(crate) fn release(
        &mut self,
        now: Instant,
        id: ReleaseId,
        victims: Vec<InstanceKey>,
        fx: &mut impl Effects,
    ) {
        self.close(&victims, fx);
        self.releases.insert(
            id,
            Release {
                drain: Drain {
                    victims,
                    deadline: now + self.config.drain_timeout,
                    settled: None,
                },
            },
        );
        self.settle(now, fx);
    }

    /// The lifecycle's idle timer asks to release `deployment` (its instances `victims`; none
    /// for a parked one) only if it is idle: nothing waits for it (no queue, no no-wait wish),
    /// nothing runs on it, no request of it started or ended after `idle_since`, and no
    /// switch, bring-up or release names it. Decided here, on the state the release changes
    /// (the lifecycle's view of the load is a snapshot): if idle, the release begins as
    /// [`State::release`] (its answer comes through `Effects::released`) and this says `true`;
    /// otherwise nothing changes and this says `false`.
    ///
    /// NB: the lifecycle reserves the deployment before it asks, so a request that comes after
    /// this answer finds it reserved when its switch is planned (`Later`, and planned again
    /// once it is parked or stopped).
    pub(crate) fn release_if_idle(
        &mut self,
        now: Instant,
        id: ReleaseId,
        deployment: &DeploymentId,
        victims: Vec<InstanceKey>,
        idle_since: Instant,
        fx: &mut impl Effects,
    ) -> bool {
        if !self.idle(deployment, &victims, idle_since) {
            return false;
        }
        self.release(now, id, victims, fx);
        true
    }

    /// See [`State::release_if_idle`].
    fn idle(
        &self,
        deployment: &DeploymentId,
        victims: &[InstanceKey],
        idle_since: Instant,
    ) -> bool {
        let named = self.watched().any(|d| d == deployment)
            || self.switches.values().any(|sw| sw.target == *deployment)
            || self.bring_ups.values().any(|t| t == deployment);
        if named || victims.iter().any(|k| k.deployment != *deployment) {
            return false;
        }
        self.deployments.get(deployment).is_none_or(|dep| {
            dep.queue.is_empty()
                && dep.wanted_since.is_none()
                && dep.in_flight == 0
                && dep.last_used.is_none_or(|t| t <= idle_since)
                && victims.iter().all(|k| {
                    dep.instances
                        .get(k)
                        .is_none_or(|i| i.open && i.in_flight == 0)
                })
        })
    }

    /// Timers: call when [`State::next_timer`] has passed.
    pub(crate) fn tick(&mut self, now: Instant, fx: &mut impl Effects) {
        self.settle(now, fx);
    }

    /// The next instant at which something is due (a deadline, the window, a drain bound).
    pub(crate) fn next_timer(&self) -> Option<Instant> {
        let mut next = self.deadlines.first().map(|(t, _)| *t);
        let mut at = |t: Instant| next = Some(next.map_or(t, |n: Instant| n.min(t)));
        for sw in self.switches.values() {
            match &sw.phase {
                Phase::Window { victims, .. } => {
                    at(self.window_end(sw.began, sw.window, victims));
                }
                Phase::Draining { drain, .. } => at(drain.deadline),
                Phase::Planning | Phase::Executing { .. } => {}
            }
        }
        for r in self.releases.values() {
            at(r.drain.deadline);
        }
        next
    }

    /// The deployment's entry was deleted in the lifecycle (or is not known there): its
    /// waiters fail, a switch to it that has not begun executing is given up, and its entry
    /// (its load, its counters) goes once nothing is charged to it.
    pub(crate) fn forget_deployment(
        &mut self,
        now: Instant,
        deployment: &DeploymentId,
        fx: &mut impl Effects,
    ) {
        let gone = ApiError::NotFound {
            what: format!("deployment {deployment}"),
        };
        self.fail_waiters(deployment, &gone, fx);
        if let Some(dep) = self.deployments.get_mut(deployment) {
            dep.forget = true;
            dep.wanted_since = None;
        }
        self.blocked.remove(deployment);
        self.refuse_operators(deployment, &gone, fx);
        self.cancel_switch_to(now, deployment, Some(&gone), fx);
        self.settle(now, fx);
    }

    /// Whether the entry of `deployment` may be dropped: it is to be forgotten, it holds
    /// nothing, and no switch, bring-up or release names it.
    fn droppable(&self, deployment: &DeploymentId) -> bool {
        let Some(dep) = self.deployments.get(deployment) else {
            return false;
        };
        if !dep.forget || !dep.holds_nothing() {
            return false;
        }
        let names = |keys: &[InstanceKey]| keys.iter().any(|k| &k.deployment == deployment);
        let in_switch = self
            .switches
            .values()
            .any(|sw| sw.target == *deployment || names(sw.routed_victims()));
        !in_switch
            && !self.bring_ups.values().any(|t| t == deployment)
            && !self.releases.values().any(|r| names(&r.drain.victims))
    }

    /// The deployments the events since the last call changed, each with its load now, or
    /// `None` where its entry is gone (dropped here when it may be, see
    /// [`State::forget_deployment`]).
    pub(crate) fn take_changed(&mut self) -> Vec<(DeploymentId, Option<Published>)> {
        self.note_demand();
        let changed = std::mem::take(&mut self.deployments.changed);
        changed
            .into_iter()
            .map(|id| {
                if self.droppable(&id) {
                    self.deployments.map.remove(&id);
                    self.blocked.remove(&id);
                    self.demand.remove(&id);
                }
                let load = self.deployments.get(&id).map(|d| d.load(&self.config));
                (id, load)
            })
            .collect()
    }

    // ----- the rules' machinery -----

    /// Brings everything up to date at `now`: deadlines, the switches' phases, releases, and
    /// starting the next switch.
    fn settle(&mut self, now: Instant, fx: &mut impl Effects) {
        self.expire(now, fx);
        self.advance_switches(now, fx);
        self.advance_releases(now, fx);
        self.maybe_plan(now, fx);
    }

    /// Charges a request to the open instance of `deployment` its routing picks (one with
    /// room: see [`Dep::pick`]) and answers it.
    fn grant_now(
        &mut self,
        now: Instant,
        deployment: &DeploymentId,
        ticket: Ticket,
        at_bound: Duration,
        (prefix, prefer): (Option<u64>, &[InstanceKey]),
        fx: &mut impl Effects,
    ) -> bool {
        let cap = self.config.in_flight_per_instance;
        let Some(dep) = self.deployments.get_mut(deployment) else {
            return false;
        };
        let Some(inst) = dep.pick(now, cap, prefix, prefer) else {
            return false;
        };
        let grant = Grant {
            upstream: Arc::clone(&inst.upstream),
            serial: inst.serial,
            at_bound,
        };
        if fx.grant(ticket, grant) {
            inst.in_flight += 1;
            inst.last_activity = now;
            dep.in_flight += 1;
            dep.last_used = Some(now);
            true
        } else {
            false
        }
    }

    /// Queues a request, if the limits allow.
    fn enqueue(&mut self, now: Instant, req: AdmitRequest, fx: &mut impl Effects) {
        let Some(dep) = self.deployments.get_mut(&req.deployment) else {
            return;
        };
        let room = dep.fair_room(
            req.tenant.as_deref(),
            self.config.max_pending_per_deployment,
        );
        let full = || ApiError::TooManyWaiting {
            deployment: req.deployment.clone(),
        };
        let evict = match room {
            Ok(evict) if evict.is_some() || self.waiting_total < self.config.max_pending_total => {
                evict
            }
            Ok(_) | Err(()) => {
                fx.refuse(req.ticket, full());
                return;
            }
        };
        // A tenant over its share gives its newest place to one under it.
        if let Some(w) = evict.and_then(|at| dep.queue.remove(at)) {
            self.forget_waiter(&w);
            fx.refuse(w.ticket, full());
        }
        let Some(dep) = self.deployments.get_mut(&req.deployment) else {
            return;
        };
        // NB (memory at scale): a queue keeps its room once emptied, and most hold one request
        // at a time: the first takes room for one, not the four of a first push.
        if dep.queue.capacity() == 0 {
            dep.queue.reserve_exact(1);
        }
        dep.queue.push_back(Waiter {
            ticket: req.ticket,
            enqueued_at: now,
            deadline: req.deadline,
            prefix: req.prefix,
            prefer: req.prefer,
            tenant: req.tenant,
        });
        self.waiting.insert(req.ticket, req.deployment);
        self.waiting_total += 1;
        self.deadlines.insert((req.deadline, req.ticket));
    }

    /// Drops a waiter's charges (it has been removed from its queue).
    fn forget_waiter(&mut self, w: &Waiter) {
        self.waiting.remove(&w.ticket);
        self.waiting_total = self.waiting_total.saturating_sub(1);
        self.deadlines.remove(&(w.deadline, w.ticket));
    }

    /// Releases `deployment`'s waiters, oldest first, while one of its open instances has a
    /// free in-flight slot (rule 5; the bound is per instance).
    fn dispatch(&mut self, now: Instant, deployment: &DeploymentId, fx: &mut impl Effects) {
        let cap = self.config.in_flight_per_instance;
        loop {
            let Some(dep) = self.deployments.get_mut(deployment) else {
                return;
            };
            if !dep.has_room(cap) {
                return;
            }
            let Some(w) = dep.next_waiter() else {
                return;
            };
            let at_bound = dep.at_bound(&w, now);
            self.forget_waiter(&w);
            self.grant_now(
                now,
                deployment,
                w.ticket,
                at_bound,
                (w.prefix, &w.prefer),
                fx,
            );
        }
    }

    /// Fails every waiter of `deployment` with `error`.
    fn fail_waiters(&mut self, deployment: &DeploymentId, error: &ApiError, fx: &mut impl Effects) {
        let Some(dep) = self.deployments.get_mut(deployment) else {
            return;
        };
        let queue = std::mem::take(&mut dep.queue);
        for w in queue {
            self.forget_waiter(&w);
            fx.refuse(w.ticket, error.clone());
        }
    }

    /// Answers the waiters whose deadline has passed.
    fn expire(&mut self, now: Instant, fx: &mut impl Effects) {
        while let Some(&(deadline, ticket)) = self.deadlines.first() {
            if deadline > now {
                return;
            }
            self.deadlines.pop_first();
            let Some(deployment) = self.waiting.remove(&ticket) else {
                continue;
            };
            let Some(dep) = self.deployments.get_mut(&deployment) else {
                continue;
            };
            if let Some(pos) = dep.queue.iter().position(|w| w.ticket == ticket)
                && let Some(w) = dep.queue.remove(pos)
            {
                let at_bound = dep.at_bound(&w, now);
                let waited = now.saturating_duration_since(w.enqueued_at);
                self.forget_waiter(&w);
                fx.refuse(ticket, deadline_error(&deployment, at_bound, waited));
            }
        }
    }

    /// Closes instances to new requests. Waiters of a deployment left with no open instance
    /// (they waited for one of its in-flight slots) get `DispatchClosed`.
    fn close(&mut self, keys: &[InstanceKey], fx: &mut impl Effects) {
        let mut touched = BTreeSet::new();
        for k in keys {
            if let Some(inst) = self
                .deployments
                .get_mut(&k.deployment)
                .and_then(|d| d.instances.get_mut(k))
            {
                inst.open = false;
                touched.insert(k.deployment.clone());
            }
        }
        for d in touched {
            if let Some(dep) = self.deployments.get_mut(&d)
                && !dep.has_open()
            {
                dep.servable_since = None;
            }
            self.end_waiters_of_closed(&d, fx);
        }
    }

    /// The waiters of `deployment` when it has no open instance left (they waited for its
    /// in-flight slots) get `DispatchClosed`.
    fn end_waiters_of_closed(&mut self, deployment: &DeploymentId, fx: &mut impl Effects) {
        if self
            .deployments
            .get(deployment)
            .is_some_and(|d| !d.has_open())
        {
            let e = ApiError::DispatchClosed {
                deployment: deployment.clone(),
            };
            self.fail_waiters(deployment, &e, fx);
        }
    }

    /// Reopens instances (a drain failed: the victims serve again).
    fn reopen(&mut self, now: Instant, keys: &[InstanceKey], fx: &mut impl Effects) {
        let mut touched = BTreeSet::new();
        for k in keys {
            if let Some(inst) = self
                .deployments
                .get_mut(&k.deployment)
                .and_then(|d| d.instances.get_mut(k))
            {
                inst.open = true;
                touched.insert(k.deployment.clone());
            }
        }
        for d in touched {
            if let Some(dep) = self.deployments.get_mut(&d) {
                dep.note_servable(now);
            }
            self.dispatch(now, &d, fx);
        }
    }

    /// Forgets instances the lifecycle is releasing (they are drained).
    fn forget(&mut self, keys: &[InstanceKey]) {
        for k in keys {
            if let Some(dep) = self.deployments.get_mut(&k.deployment) {
                dep.instances.remove(k);
                // Only ever closed instances: `servable_since` stays as it is.
            }
        }
    }

    /// A switch's window (from `began` until its victims closed) and drain (from then until
    /// `now`). The drain began `drain_timeout` before its deadline.
    fn phases(&self, began: Instant, drain: &Drain, now: Instant) -> (Duration, Duration) {
        let closed = drain
            .deadline
            .checked_sub(self.config.drain_timeout)
            .unwrap_or(began)
            .max(began);
        (closed - began, now.saturating_duration_since(closed))
    }

    /// When the window (of length `window`) of a switch that began at `began` closes, over its
    /// open victims.
    fn window_end(&self, began: Instant, window: Duration, victims: &[InstanceKey]) -> Instant {
        let open = victims.iter().filter_map(|k| {
            self.deployments
                .get(&k.deployment)
                .and_then(|d| d.instances.get(k))
                .filter(|i| i.open)
                .map(|i| (i.in_flight, i.last_activity))
        });
        window_closes_at(began, window, open)
    }

    /// Requests still charged to these instances.
    fn charged(&self, keys: &[InstanceKey]) -> usize {
        keys.iter()
            .filter_map(|k| {
                self.deployments
                    .get(&k.deployment)
                    .and_then(|d| d.instances.get(k))
            })
            .map(|i| i.in_flight)
            .sum()
    }

    /// Moves a drain on: settled once nothing is charged, then done once every `engine_idle`
    /// answered. Past the bound: timed out while requests run; while `engine_idle` answers are
    /// awaited, those victims count as cut before output (stop, not park).
    fn poll_drain(
        &self,
        now: Instant,
        drain: &mut Drain,
        owner: DrainOwner,
        fx: &mut impl Effects,
    ) -> DrainPoll {
        if drain.settled.is_none() {
            let charged = self.charged(&drain.victims);
            if charged > 0 {
                return if now >= drain.deadline {
                    DrainPoll::TimedOut { charged }
                } else {
                    DrainPoll::Pending
                };
            }
            let mut reports = Vec::new();
            let mut awaiting = BTreeSet::new();
            for k in &drain.victims {
                let inst = self
                    .deployments
                    .get(&k.deployment)
                    .and_then(|d| d.instances.get(k));
                let cut_before_output = inst.is_some_and(|i| i.cut_before_output);
                // A stop settles any request; only a park needs the engine's word.
                if !cut_before_output && inst.is_some_and(|i| i.cut_after_output) {
                    awaiting.insert(k.clone());
                    fx.engine_idle(owner, k.clone());
                }
                reports.push((k.clone(), DrainReport { cut_before_output }));
            }
            drain.settled = Some(Settling { reports, awaiting });
        }
        let Some(s) = &mut drain.settled else {
            return DrainPoll::Pending;
        };
        if !s.awaiting.is_empty() {
            if now < drain.deadline {
                return DrainPoll::Pending;
            }
            for k in std::mem::take(&mut s.awaiting) {
                mark_cut_before_output(&mut s.reports, &k);
            }
        }
        DrainPoll::Done(std::mem::take(&mut s.reports))
    }

    /// Moves every switch in progress on, oldest first.
    fn advance_switches(&mut self, now: Instant, fx: &mut impl Effects) {
        let mut from = 0;
        while let Some(seq) = self.switches.range(from..).next().map(|(seq, _)| *seq) {
            self.advance_switch(now, seq, fx);
            from = seq + 1;
        }
    }

    /// Moves switch `seq` through window → drain → execute.
    fn advance_switch(&mut self, now: Instant, seq: SwitchSeq, fx: &mut impl Effects) {
        loop {
            let Some(sw) = self.switches.remove(&seq) else {
                return;
            };
            match sw.phase {
                Phase::Window { switch_id, victims } => {
                    if now < self.window_end(sw.began, sw.window, &victims) {
                        self.switches.insert(
                            seq,
                            Switch {
                                phase: Phase::Window { switch_id, victims },
                                ..sw
                            },
                        );
                        return;
                    }
                    self.close(&victims, fx);
                    fx.switch_draining(&switch_id);
                    self.switches.insert(
                        seq,
                        Switch {
                            phase: Phase::Draining {
                                switch_id,
                                drain: Drain {
                                    victims,
                                    deadline: now + self.config.drain_timeout,
                                    settled: None,
                                },
                            },
                            ..sw
                        },
                    );
                }
                Phase::Draining {
                    switch_id,
                    mut drain,
                } => match self.poll_drain(now, &mut drain, DrainOwner::Switch(sw.seq), fx) {
                    DrainPoll::Pending => {
                        self.switches.insert(
                            seq,
                            Switch {
                                phase: Phase::Draining { switch_id, drain },
                                ..sw
                            },
                        );
                        return;
                    }
                    DrainPoll::TimedOut { charged } => {
                        self.reopen(now, &drain.victims, fx);
                        let e = ApiError::DrainTimeout {
                            deployment: sw.target.clone(),
                            drain_ms: duration_ms(self.config.drain_timeout),
                            charged,
                        };
                        let (window, drained) = self.phases(sw.began, &drain, now);
                        let failed = SwitchOrder {
                            switch_id: switch_id.clone(),
                            target: sw.target.clone(),
                            victims: drain
                                .victims
                                .iter()
                                .map(|k| (k.clone(), DrainReport::default()))
                                .collect(),
                            window,
                            drain: drained,
                            began: sw.began,
                            wave: sw.wave,
                            operator: sw.operator.is_some(),
                        };
                        // Told before the plan is given back: its record ends failed, not
                        // given up.
                        fx.switch_failed(&failed, &e);
                        fx.abandon(&switch_id);
                        if let Some((id, _)) = sw.operator {
                            fx.operator_done(id, Err(e));
                        } else {
                            self.fail_waiters(&sw.target, &e, fx);
                            if let Some(dep) = self.deployments.get_mut(&sw.target) {
                                dep.wanted_since = None;
                            }
                        }
                        self.unblock(true);
                        return;
                    }
                    DrainPoll::Done(reports) => {
                        // Parking begins: requests for a victim wait from now on (rule 4).
                        self.forget(&drain.victims);
                        let (window, drained) = self.phases(sw.began, &drain, now);
                        fx.execute(
                            sw.seq,
                            SwitchOrder {
                                switch_id: switch_id.clone(),
                                target: sw.target.clone(),
                                victims: reports,
                                window,
                                drain: drained,
                                began: sw.began,
                                wave: sw.wave,
                                operator: sw.operator.is_some(),
                            },
                        );
                        let victims = drain.victims;
                        self.switches.insert(
                            seq,
                            Switch {
                                phase: Phase::Executing { switch_id, victims },
                                ..sw
                            },
                        );
                        self.unblock(true);
                        return;
                    }
                },
                phase @ (Phase::Planning | Phase::Executing { .. }) => {
                    self.switches.insert(seq, Switch { phase, ..sw });
                    return;
                }
            }
        }
    }

    /// Moves the releases' drains on and answers the finished ones.
    fn advance_releases(&mut self, now: Instant, fx: &mut impl Effects) {
        let ids: Vec<ReleaseId> = self.releases.keys().copied().collect();
        for id in ids {
            let Some(mut r) = self.releases.remove(&id) else {
                continue;
            };
            match self.poll_drain(now, &mut r.drain, DrainOwner::Release(id), fx) {
                DrainPoll::Pending => {
                    self.releases.insert(id, r);
                }
                DrainPoll::Done(reports) => {
                    self.forget(&r.drain.victims);
                    self.unblock(true);
                    fx.released(id, Ok(reports));
                }
                DrainPoll::TimedOut { charged } => {
                    self.reopen(now, &r.drain.victims, fx);
                    let deployment = r
                        .drain
                        .victims
                        .first()
                        .map(|k| k.deployment.clone())
                        .unwrap_or_default();
                    fx.released(
                        id,
                        Err(ApiError::DrainTimeout {
                            deployment,
                            drain_ms: duration_ms(self.config.drain_timeout),
                            charged,
                        }),
                    );
                }
            }
        }
    }

    /// Starts planning the next switch, while other switches run (rule 6 and "switches on
    /// different GPUs or hosts run at the same time"): the deployment, among those waiting with
    /// no open or draining instance, not blocked and not already switched to, whose oldest
    /// request has waited longest, or the oldest operator's switch when it has waited longer.
    ///
    /// NB (what runs at once): one plan at a time (a plan is quick, and the lifecycle decides
    /// on its own state, keeping the victims and memory of concurrent plans apart: a plan that
    /// needs what another switch holds answers `Later`); once it has answered, the next one is
    /// planned while the first drains or executes. An operator's switch runs alone: it is
    /// planned once no other switch is in progress (no wave newer than it is planned while it
    /// waits, so it waits only for the switches in progress when its turn came, each bounded),
    /// and nothing else is planned until its execute answered; so its plan sees the memory of
    /// no other switch, and `Later` means what it meant with one switch at a time.
    ///
    /// NB (fairness): the oldest eligible wave is always the next one planned, and everything
    /// that may free memory (a switch's drain ends or it ends, an instance opens or closes;
    /// with no other switch in progress, a request's end too, see [`Blocked`]) lets the
    /// blocked `Later` ones plan again, oldest first. So a newer wave is planned before an
    /// older one only while the older is blocked (`Later`: nothing can be released for it now;
    /// `Coming`), and what a switch frees when it ends is offered to the oldest first.
    fn maybe_plan(&mut self, now: Instant, fx: &mut impl Effects) {
        let planning_or_operator = self
            .switches
            .values()
            .any(|sw| matches!(sw.phase, Phase::Planning) || sw.operator.is_some());
        if planning_or_operator {
            return;
        }
        self.note_demand();
        // NB: only the deployments with demand are looked at, never every deployment.
        let next = self
            .demand
            .iter()
            .filter_map(|id| Some((id, self.deployments.get(id)?)))
            .filter(|(id, d)| !self.blocked.contains_key(*id) && !d.has_open() && !d.has_closed())
            .filter(|(id, _)| !self.switching(id))
            // The higher priority first (DESIGN 4.10), then the oldest.
            .filter_map(|(id, d)| d.waiting_since().map(|t| (Reverse(d.priority), t, id)))
            .min()
            .map(|(_, t, id)| (t, id.clone()));
        let operator_first = self
            .operators
            .front()
            .is_some_and(|o| next.as_ref().is_none_or(|(t, _)| o.since <= *t));
        let (target, window, who, operator) = if operator_first {
            if !self.switches.is_empty() {
                // Its turn: it waits for the switches in progress; nothing newer starts.
                return;
            }
            let Some(o) = self.operators.pop_front() else {
                return;
            };
            // An operator's switch has no admission window: its victims close at once.
            (
                o.target,
                Duration::ZERO,
                PlanFor::Operator,
                Some((o.id, o.since)),
            )
        } else {
            let Some((_, target)) = next else { return };
            (
                target,
                self.config.admission_window,
                PlanFor::Requests,
                None,
            )
        };
        let mut protected = self.protected();
        protected.insert(target.clone());
        self.next_seq += 1;
        let seq = self.next_seq;
        let wave = self.deployments.get(&target).map_or(0, |d| d.queue.len());
        self.switches.insert(
            seq,
            Switch {
                seq,
                target: target.clone(),
                began: now,
                wave,
                window,
                phase: Phase::Planning,
                cancelled: false,
                refusal: None,
                operator,
            },
        );
        fx.plan(seq, target, protected, who);
    }

    /// Whether `deployment` is the target of a switch or bring-up in progress, or a victim of
    /// a switch executing (the lifecycle releases it; its wave is planned once that answered).
    fn switching(&self, deployment: &DeploymentId) -> bool {
        self.bring_ups.values().any(|t| t == deployment)
            || self.switches.values().any(|sw| {
                sw.target == *deployment
                    || matches!(&sw.phase, Phase::Executing { victims, .. }
                        if victims.iter().any(|k| k.deployment == *deployment))
            })
    }

    /// The victims (of a plan just answered) that get no admission window: those whose
    /// deployment keeps another open instance that neither these victims nor another switch's
    /// (in its window) name. Victims of a deployment with no such instance keep the window.
    fn without_window(&self, victims: &[InstanceKey]) -> Vec<InstanceKey> {
        let windowed = |k: &InstanceKey| {
            victims.contains(k)
                || self.switches.values().any(
                    |sw| matches!(&sw.phase, Phase::Window { victims, .. } if victims.contains(k)),
                )
        };
        victims
            .iter()
            .filter(|v| {
                self.deployments
                    .get(&v.deployment)
                    .is_some_and(|dep| dep.instances.iter().any(|(k, i)| i.open && !windowed(k)))
            })
            .cloned()
            .collect()
    }

    /// Whether a plan's `victims` name a deployment that has begun waiting since the plan was
    /// asked for (the plan is then given back: a victim is never protected).
    fn names_protected(&self, victims: &[InstanceKey]) -> bool {
        victims.iter().any(|v| {
            self.deployments
                .get(&v.deployment)
                .is_some_and(|d| !d.queue.is_empty())
        })
    }

    /// The deployments with waiting requests now: never a victim (rule 6).
    fn protected(&self) -> BTreeSet<DeploymentId> {
        self.demand
            .iter()
            .filter(|id| {
                self.deployments
                    .get(id)
                    .is_some_and(|d| !d.queue.is_empty())
            })
            .cloned()
            .collect()
    }

    /// An operator asks to start `target`, releasing what it needs (`start --evict`): a switch
    /// like a wave's, without an admission window, that runs alone in its turn (see
    /// [`State::maybe_plan`]).
    pub(crate) fn operator_start(
        &mut self,
        now: Instant,
        id: OperatorId,
        target: DeploymentId,
        fx: &mut impl Effects,
    ) {
        self.operators.push_back(OperatorWait {
            id,
            target,
            since: now,
        });
        self.settle(now, fx);
    }

    /// `Lifecycle::plan` answered for an operator's switch (`sw`, taken from the slot).
    fn operator_plan_done(
        &mut self,
        now: Instant,
        mut sw: Switch,
        (id, since): (OperatorId, Instant),
        result: Result<Plan, ApiError>,
        fx: &mut impl Effects,
    ) {
        match result {
            Err(e) => fx.operator_done(id, Err(e)),
            Ok(Plan::AlreadyComing) => fx.operator_done(id, Ok(OperatorStart::AlreadyComing)),
            Ok(Plan::Later) => fx.operator_done(id, Ok(OperatorStart::Later)),
            Ok(Plan::BringUp { switch_id }) => {
                // Nothing to release: executed at once (the lifecycle answers once the start
                // or wake has begun).
                fx.execute(
                    sw.seq,
                    SwitchOrder {
                        switch_id: switch_id.clone(),
                        target: sw.target.clone(),
                        victims: Vec::new(),
                        window: Duration::ZERO,
                        drain: Duration::ZERO,
                        began: sw.began,
                        wave: sw.wave,
                        operator: true,
                    },
                );
                sw.phase = Phase::Executing {
                    switch_id,
                    victims: Vec::new(),
                };
                self.switches.insert(sw.seq, sw);
            }
            Ok(Plan::Switch {
                switch_id,
                victims,
                window: _,
            }) => {
                // Invariant: a victim is never protected. A request may have begun waiting for
                // a victim's deployment while the plan ran: give the plan back and plan again,
                // in the same turn.
                if self.names_protected(&victims) {
                    fx.abandon(&switch_id);
                    self.operators.push_front(OperatorWait {
                        id,
                        target: sw.target,
                        since,
                    });
                } else {
                    // No window (`sw.window` is zero): the victims close at once, then drain.
                    sw.phase = Phase::Window { switch_id, victims };
                    self.switches.insert(sw.seq, sw);
                }
            }
        }
        self.settle(now, fx);
    }

    /// Answers the operators' switches to `deployment` that wait for their turn with `error`.
    fn refuse_operators(
        &mut self,
        deployment: &DeploymentId,
        error: &ApiError,
        fx: &mut impl Effects,
    ) {
        self.operators.retain(|o| {
            if o.target == *deployment {
                fx.operator_done(o.id, Err(error.clone()));
                false
            } else {
                true
            }
        });
    }

    /// Gives up the switch to `target` unless it has begun executing: while planning, the plan
    /// is given back when it arrives; in the window or the drain, the victims serve again now.
    /// An operator's switch is answered `why`, or (`None`: the target became ready)
    /// `AlreadyComing`.
    fn cancel_switch_to(
        &mut self,
        now: Instant,
        target: &DeploymentId,
        why: Option<&ApiError>,
        fx: &mut impl Effects,
    ) {
        // NB: a deployment is the target of one switch at most. An instance that opens does not
        // end an operator's switch (`why` is `None`): it brings up another instance of its
        // deployment (the plan claimed that one; nothing else brings it up).
        let Some(seq) = self
            .switches
            .iter()
            .find(|(_, sw)| sw.target == *target && (why.is_some() || sw.operator.is_none()))
            .map(|(seq, _)| *seq)
        else {
            return;
        };
        let Some(sw) = self.switches.remove(&seq) else {
            return;
        };
        match sw.phase {
            Phase::Planning => {
                self.switches.insert(
                    seq,
                    Switch {
                        cancelled: true,
                        refusal: why.cloned(),
                        ..sw
                    },
                );
                return;
            }
            Phase::Window { switch_id, victims } => {
                fx.abandon(&switch_id);
                self.reopen(now, &victims, fx);
            }
            Phase::Draining { switch_id, drain } => {
                fx.abandon(&switch_id);
                self.reopen(now, &drain.victims, fx);
            }
            Phase::Executing { .. } => {
                self.switches.insert(seq, sw);
                return;
            }
        }
        if let Some((id, _)) = sw.operator {
            fx.operator_done(
                id,
                why.cloned().map_or(Ok(OperatorStart::AlreadyComing), Err),
            );
        }
        self.unblock(true);
    }

    /// A switch ended (taken out of [`State::switches`]); everything blocked may be planned
    /// again.
    fn end_switch(&mut self) {
        self.unblock(true);
    }

    /// Something changed: plan `Later` deployments again, and (`all`) `Coming` ones too.
    fn unblock(&mut self, all: bool) {
        if all {
            self.blocked.clear();
        } else {
            self.blocked.retain(|_, b| *b != Blocked::Later);
        }
    }

    /// Brings [`State::demand`] up to date with the deployments changed since the last
    /// [`State::take_changed`] (every change of a queue or a no-wait wish is noted).
    fn note_demand(&mut self) {
        for id in &self.deployments.changed {
            let wants = self
                .deployments
                .get(id)
                .is_some_and(|d| !d.queue.is_empty() || d.wanted_since.is_some());
            if wants {
                if !self.demand.contains(id) {
                    self.demand.insert(id.clone());
                }
            } else {
                self.demand.remove(id);
            }
        }
    }
}

/// Marks one victim's report as cut before output.
fn mark_cut_before_output(reports: &mut [(InstanceKey, DrainReport)], key: &InstanceKey) {
    for (k, r) in reports.iter_mut() {
        if k == key {
            r.cut_before_output = true;
        }
    }
}

/// A duration in whole milliseconds, saturating.
fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    //! The rules as pure functions: a recording `Effects`, made-up instants, no tasks.
    #![allow(clippy::unwrap_used)]

    use super::*;
    use std::net::{Ipv4Addr, SocketAddr};

    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Fx {
        Grant(Ticket),
        Refuse(Ticket, ApiError),
        Plan(SwitchSeq, DeploymentId, BTreeSet<DeploymentId>),
        Execute(SwitchSeq, SwitchOrder),
        Abandon(String),
        EngineIdle(InstanceKey),
        Released(ReleaseId),
        Operator(OperatorId),
    }

    #[derive(Default)]
    struct Recorder {
        calls: Vec<Fx>,
    }

    impl Recorder {
        fn take(&mut self) -> Vec<Fx> {
            std::mem::take(&mut self.calls)
        }
    }

    impl Effects for Recorder {
        fn admissible(&mut self, _: &DeploymentId) -> Result<(), ApiError> {
            Ok(())
        }
        fn grant(&mut self, ticket: Ticket, _: Grant) -> bool {
            self.calls.push(Fx::Grant(ticket));
            true
        }
        fn refuse(&mut self, ticket: Ticket, error: ApiError) {
            self.calls.push(Fx::Refuse(ticket, error));
        }
        fn plan(&mut self, seq: SwitchSeq, d: DeploymentId, p: BTreeSet<DeploymentId>, _: PlanFor) {
            self.calls.push(Fx::Plan(seq, d, p));
        }
        fn operator_done(&mut self, id: OperatorId, _: OperatorResult) {
            self.calls.push(Fx::Operator(id));
        }
        fn execute(&mut self, seq: SwitchSeq, order: SwitchOrder) {
            self.calls.push(Fx::Execute(seq, order));
        }
        fn abandon(&mut self, switch_id: &str) {
            self.calls.push(Fx::Abandon(switch_id.into()));
        }
        fn engine_idle(&mut self, _: DrainOwner, instance: InstanceKey) {
            self.calls.push(Fx::EngineIdle(instance));
        }
        fn released(
            &mut self,
            id: ReleaseId,
            _: Result<Vec<(InstanceKey, DrainReport)>, ApiError>,
        ) {
            self.calls.push(Fx::Released(id));
        }
    }

    fn key(d: &str) -> InstanceKey {
        InstanceKey {
            deployment: d.into(),
            index: 0,
            host_id: "h".into(),
            generation: 1,
        }
    }

    fn up(d: &str) -> Upstream {
        Upstream {
            key: key(d),
            addr: SocketAddr::from((Ipv4Addr::LOCALHOST, 1)),
        }
    }

    fn req(ticket: Ticket, d: &str, deadline: Instant) -> AdmitRequest {
        AdmitRequest {
            ticket,
            deployment: d.into(),
            deadline,
            prefix: None,
            prefer: Box::default(),
            priority: 0,
            tenant: None,
        }
    }

    const W: Duration = Duration::from_secs(2);

    #[test]
    fn window_is_the_full_length_while_a_victim_runs() {
        let t = Instant::now();
        let at = window_closes_at(t, W, [(1, t - Duration::from_secs(60))]);
        assert_eq!(at, t + W);
    }

    #[test]
    fn window_closes_at_once_for_a_long_idle_victim() {
        let t = Instant::now();
        let at = window_closes_at(t, W, [(0, t - Duration::from_secs(60))]);
        assert_eq!(at, t);
    }

    #[test]
    fn window_closes_one_length_after_the_last_activity() {
        let t = Instant::now();
        let last = t - Duration::from_millis(500);
        assert_eq!(window_closes_at(t, W, [(0, last)]), last + W);
        // Activity after the start never extends past the full length.
        assert_eq!(window_closes_at(t, W, [(0, t + W)]), t + W);
    }

    #[test]
    fn window_without_open_victims_is_empty() {
        let t = Instant::now();
        assert_eq!(window_closes_at(t, W, []), t);
    }

    #[test]
    fn a_wave_is_one_plan_and_one_execute() {
        let t = Instant::now();
        let far = t + Duration::from_secs(600);
        let mut s = State::new(RouterConfig::default());
        let mut fx = Recorder::default();
        s.instance_ready(t - Duration::from_secs(60), up("a"), &mut fx);
        s.admit(t, req(1, "b", far), &mut fx);
        s.admit(t, req(2, "b", far), &mut fx);
        let protected: BTreeSet<_> = ["b".to_string()].into();
        assert_eq!(fx.take(), vec![Fx::Plan(1, "b".into(), protected)]);
        s.plan_done(
            t,
            1,
            Ok(Plan::Switch {
                switch_id: "s".into(),
                victims: vec![key("a")],
                window: None,
            }),
            &mut fx,
        );
        // chat-a idle for a minute: no window; nothing running: drained; execute now.
        let calls = fx.take();
        assert!(
            matches!(&calls[..], [Fx::Execute(1, o)] if o.victims.len() == 1),
            "{calls:?}"
        );
        s.instance_ready(t + W, up("b"), &mut fx);
        assert_eq!(fx.take(), vec![Fx::Grant(1), Fx::Grant(2)]);
        s.execute_done(t + W, 1, Ok(Executed::default()), &mut fx);
        assert!(fx.take().is_empty());
        assert_eq!(s.next_timer(), None);
    }

    /// The target's engine exits after it was announced ready and before its bring-up's
    /// execute answered (the lifecycle still saving its record): nothing will announce it
    /// again, so it is not taken for coming, and the request waiting for it plans anew.
    #[test]
    fn a_target_gone_before_its_execute_answered_is_planned_again() {
        let t = Instant::now();
        let far = t + Duration::from_secs(600);
        let mut s = State::new(RouterConfig::default());
        let mut fx = Recorder::default();
        let protected: BTreeSet<_> = ["a".to_string()].into();
        s.admit(t, req(1, "a", far), &mut fx);
        assert_eq!(fx.take(), vec![Fx::Plan(1, "a".into(), protected.clone())]);
        s.plan_done(
            t,
            1,
            Ok(Plan::BringUp {
                switch_id: "s".into(),
            }),
            &mut fx,
        );
        let calls = fx.take();
        assert!(matches!(&calls[..], [Fx::Execute(1, _)]), "{calls:?}");
        s.instance_ready(t, up("a"), &mut fx);
        assert_eq!(fx.take(), vec![Fx::Grant(1)]);
        s.instance_gone(t, key("a"), &mut fx);
        // A request while the bring-up is still executing waits for its answer.
        s.admit(t, req(2, "a", far), &mut fx);
        fx.take();
        s.execute_done(t, 1, Ok(Executed::default()), &mut fx);
        assert_eq!(fx.take(), vec![Fx::Plan(2, "a".into(), protected)]);
    }

    #[test]
    fn two_later_deployments_do_not_plan_each_other_in_a_loop() {
        let t = Instant::now();
        let far = t + Duration::from_secs(600);
        let mut s = State::new(RouterConfig::default());
        let mut fx = Recorder::default();
        s.admit(t, req(1, "b", far), &mut fx);
        s.admit(t, req(2, "c", far), &mut fx);
        assert!(matches!(&fx.take()[..], [Fx::Plan(1, d, _)] if d == "b"));
        s.plan_done(t, 1, Ok(Plan::Later), &mut fx);
        assert!(matches!(&fx.take()[..], [Fx::Plan(2, d, _)] if d == "c"));
        s.plan_done(t, 2, Ok(Plan::Later), &mut fx);
        assert!(fx.take().is_empty(), "both wait for a change");
        // A change (an instance opens) plans the oldest again.
        s.instance_ready(t, up("x"), &mut fx);
        assert!(matches!(&fx.take()[..], [Fx::Plan(3, d, _)] if d == "b"));
    }

    /// DESIGN 4.10: of the waves waiting for room, the higher priority's is planned first, and
    /// again first once room may have freed; equal priorities keep the oldest first.
    #[test]
    fn the_higher_prioritys_wave_is_planned_first() {
        let t = Instant::now();
        let far = t + Duration::from_secs(600);
        let mut s = State::new(RouterConfig::default());
        let mut fx = Recorder::default();
        let with = |ticket, d: &str, priority, at| AdmitRequest {
            priority,
            ..req(ticket, d, at)
        };
        s.admit(t, req(1, "b", far), &mut fx);
        assert!(matches!(&fx.take()[..], [Fx::Plan(1, d, _)] if d == "b"));
        // While b's plan is asked, c (priority 0) and then d (priority 100) come.
        s.admit(t + W, req(2, "c", far), &mut fx);
        s.admit(t + 2 * W, with(3, "d", 100, far), &mut fx);
        assert!(fx.take().is_empty(), "one plan at a time");
        s.plan_done(t + 2 * W, 1, Ok(Plan::Later), &mut fx);
        assert!(
            matches!(&fx.take()[..], [Fx::Plan(2, d, _)] if d == "d"),
            "d, the newest but of priority 100, before c"
        );
        s.plan_done(t + 2 * W, 2, Ok(Plan::Later), &mut fx);
        assert!(matches!(&fx.take()[..], [Fx::Plan(3, d, _)] if d == "c"));
        s.plan_done(t + 2 * W, 3, Ok(Plan::Later), &mut fx);
        assert!(fx.take().is_empty(), "all wait for a change");
        // Room may have freed: the higher priority is offered it first, then the oldest.
        s.instance_ready(t + 3 * W, up("x"), &mut fx);
        assert!(matches!(&fx.take()[..], [Fx::Plan(4, d, _)] if d == "d"));
        s.plan_done(t + 3 * W, 4, Ok(Plan::Later), &mut fx);
        assert!(matches!(&fx.take()[..], [Fx::Plan(5, d, _)] if d == "b"));
        // A negative priority goes after every one of 0.
        s.admit(t + 3 * W, with(4, "e", -1, far), &mut fx);
        s.plan_done(t + 3 * W, 5, Ok(Plan::Later), &mut fx);
        assert!(matches!(&fx.take()[..], [Fx::Plan(6, d, _)] if d == "c"));
        s.plan_done(t + 3 * W, 6, Ok(Plan::Later), &mut fx);
        assert!(matches!(&fx.take()[..], [Fx::Plan(7, d, _)] if d == "e"));
    }

    #[test]
    fn a_stale_plan_is_given_back() {
        let t = Instant::now();
        let mut s = State::new(RouterConfig::default());
        let mut fx = Recorder::default();
        s.plan_done(
            t,
            7,
            Ok(Plan::BringUp {
                switch_id: "old".into(),
            }),
            &mut fx,
        );
        assert_eq!(fx.take(), vec![Fx::Abandon("old".into())]);
    }

    fn as_tenant(ticket: Ticket, tenant: &str, deadline: Instant) -> AdmitRequest {
        AdmitRequest {
            tenant: Some(Arc::from(tenant)),
            ..req(ticket, "a", deadline)
        }
    }

    /// One request runs on "a" at a time; `limit` may wait.
    fn one_at_a_time(t: Instant, limit: usize) -> (State, Recorder) {
        let mut s = State::new(RouterConfig {
            in_flight_per_instance: 1,
            max_pending_per_deployment: limit,
            ..RouterConfig::default()
        });
        let mut fx = Recorder::default();
        s.instance_ready(t, up("a"), &mut fx);
        (s, fx)
    }

    fn end_one(s: &mut State, t: Instant, fx: &mut Recorder) -> Vec<Fx> {
        let done = Finished {
            key: key("a"),
            serial: 0,
            output: true,
            cut: false,
        };
        s.finished(t, done, fx);
        fx.take()
    }

    /// DESIGN 4.10: beyond the running bound, requests start round-robin across tenants, first
    /// come first served within one: tenant x's burst of 5 does not keep y's and z's single
    /// requests behind it.
    #[tokio::test(start_paused = true)]
    async fn tenants_take_turns_beyond_the_running_bound() {
        let t = Instant::now();
        let far = t + Duration::from_secs(600);
        let (mut s, mut fx) = one_at_a_time(t, 64);
        s.admit(t, as_tenant(1, "x", far), &mut fx);
        assert_eq!(fx.take(), vec![Fx::Grant(1)]);
        for ticket in 2..=6 {
            s.admit(t, as_tenant(ticket, "x", far), &mut fx);
        }
        tokio::time::advance(Duration::from_millis(10)).await;
        s.admit(Instant::now(), as_tenant(7, "z", far), &mut fx);
        s.admit(Instant::now(), as_tenant(8, "y", far), &mut fx);
        s.admit(Instant::now(), as_tenant(9, "y", far), &mut fx);
        assert!(fx.take().is_empty());
        // In the order of the names, from the first (a request granted at once takes no
        // turn): x, y, z, x, y, then x's last (each tenant's oldest first).
        let mut order = Vec::new();
        for _ in 0..8 {
            tokio::time::advance(Duration::from_millis(10)).await;
            order.extend(end_one(&mut s, Instant::now(), &mut fx));
        }
        let granted: Vec<Ticket> = order
            .iter()
            .map(|f| match f {
                Fx::Grant(t) => *t,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(granted, [2, 8, 7, 3, 9, 4, 5, 6]);
    }

    #[tokio::test(start_paused = true)]
    async fn without_tenants_the_queue_is_first_come_first_served() {
        let t = Instant::now();
        let far = t + Duration::from_secs(600);
        let (mut s, mut fx) = one_at_a_time(t, 64);
        for ticket in 1..=4 {
            s.admit(t, req(ticket, "a", far), &mut fx);
        }
        assert_eq!(fx.take(), vec![Fx::Grant(1)]);
        for want in 2..=4 {
            assert_eq!(end_one(&mut s, t, &mut fx), vec![Fx::Grant(want)]);
        }
    }

    /// One tenant's waiting limit is the deployment's divided among the tenants waiting
    /// (never less than 1): a tenant that filled the queue alone gives its newest place to a
    /// newcomer under its share.
    #[tokio::test(start_paused = true)]
    async fn the_waiting_limit_is_shared_among_the_tenants_waiting() {
        let t = Instant::now();
        let far = t + Duration::from_secs(600);
        let (mut s, mut fx) = one_at_a_time(t, 4);
        s.admit(t, as_tenant(1, "x", far), &mut fx);
        for ticket in 2..=5 {
            s.admit(t, as_tenant(ticket, "x", far), &mut fx);
        }
        assert_eq!(fx.take(), vec![Fx::Grant(1)]);
        // Alone, x has the whole limit: its fifth waiter is refused.
        s.admit(t, as_tenant(6, "x", far), &mut fx);
        let full = ApiError::TooManyWaiting {
            deployment: "a".into(),
        };
        assert_eq!(fx.take(), vec![Fx::Refuse(6, full.clone())]);
        // y comes: the share is 2 each; x's newest gives up its place.
        s.admit(t, as_tenant(7, "y", far), &mut fx);
        assert_eq!(fx.take(), vec![Fx::Refuse(5, full.clone())]);
        s.admit(t, as_tenant(8, "y", far), &mut fx);
        assert_eq!(fx.take(), vec![Fx::Refuse(4, full.clone())]);
        // y at its share of 2: its third is refused, x keeps 2 and 3.
        s.admit(t, as_tenant(9, "y", far), &mut fx);
        assert_eq!(fx.take(), vec![Fx::Refuse(9, full.clone())]);
        // x (over its share no more) gets nothing more either.
        s.admit(t, as_tenant(10, "x", far), &mut fx);
        assert_eq!(fx.take(), vec![Fx::Refuse(10, full.clone())]);
        assert_eq!(s.waiting_total, 4);
        // z comes: three tenants on a limit of 4, a share of 1 each; x and y are over it, and
        // x (the first of the two by name) gives up its newest.
        s.admit(t, as_tenant(11, "z", far), &mut fx);
        assert_eq!(fx.take(), vec![Fx::Refuse(3, full.clone())]);
        // A fourth tenant: a share of 1 each; y still has 2, over it: its newest gives way.
        s.admit(t, as_tenant(12, "w", far), &mut fx);
        assert_eq!(fx.take(), vec![Fx::Refuse(8, full.clone())]);
        // A fifth: everyone is at a share of 1 (4 / 5, never less than 1): refused.
        s.admit(t, as_tenant(13, "v", far), &mut fx);
        assert_eq!(fx.take(), vec![Fx::Refuse(13, full)]);
        let mut order = Vec::new();
        for _ in 0..4 {
            order.extend(end_one(&mut s, t, &mut fx));
        }
        // Round-robin by name: w, x, y, z.
        assert_eq!(
            order,
            vec![Fx::Grant(12), Fx::Grant(2), Fx::Grant(7), Fx::Grant(11)]
        );
    }

    #[test]
    fn waiting_deadline_is_the_next_timer() {
        let t = Instant::now();
        let deadline = t + Duration::from_secs(5);
        let mut s = State::new(RouterConfig::default());
        let mut fx = Recorder::default();
        s.admit(t, req(1, "b", deadline), &mut fx);
        s.plan_done(t, 1, Ok(Plan::Later), &mut fx);
        fx.take();
        assert_eq!(s.next_timer(), Some(deadline));
        s.tick(deadline, &mut fx);
        assert_eq!(
            fx.take(),
            vec![Fx::Refuse(
                1,
                ApiError::QueueDeadline {
                    deployment: "b".into()
                }
            )]
        );
        assert_eq!(s.waiting_total, 0);
    }
}
