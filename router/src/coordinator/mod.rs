//! The switch coordinator: one task that owns all routing state.
//!
//! [`Coordinator::spawn`] starts the task and returns a [`CoordinatorHandle`]. The task owns the
//! ready instances of every deployment and their in-flight counts, the per-deployment waiting
//! queues, the buffered bytes, the switches in progress and their timers; nothing else reads or
//! writes them. Everything reaches it as an event:
//!
//! - through the bounded inbox (senders await room): admissions, the lifecycle's
//!   `instance_ready` / `instance_gone` / `deployment_refused` / `release` / `forget`, and the
//!   results of the lifecycle futures it started (plan, execute, engine idle);
//! - through the endings channel, which is sent to from `Drop` and so cannot await: a waiting
//!   client that went away, a permit that ended. It is unbounded in type but not in use: each
//!   request sends at most one ending, so it never holds more than the requests alive.
//!
//! The load read never goes through the inbox: after each event the task publishes the load of
//! the deployments the event changed (`Loads`), and a read copies what is published, without a
//! turn of the task (so no admission ever waits behind a read, however many deployments there
//! are).
//!
//! The rules themselves are in `state` (pure functions over the state, behind an `Effects`
//! trait); see `router/DESIGN.md` for the phases of a switch and how each rule maps to code.

mod link;
mod loads;
pub(crate) mod routing;
mod state;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
mod vec_map;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use capyctl_spec::errors::ApiError;
use futures_util::FutureExt as _;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::admission::{Admission, Permit};
use crate::config::RouterConfig;
use capyctl_interfaces::router::{
    DeploymentId, DeploymentRef, Executed, InstanceKey, Lifecycle, Plan, PlanFor, SwitchOrder,
    Upstream,
};

pub use loads::LoadsInOrder;
use loads::{ById, LoadCell, Loads};
use state::{
    AdmitRequest, DrainOwner, Effects, Finished, Grant, OperatorId, ReleaseId, State, SwitchSeq,
    Ticket,
};

/// Room in the inbox. Senders wait when it is full (back-pressure), never the coordinator.
const INBOX_CAPACITY: usize = 1024;

/// `Lane::word`: the open bit; below it the slots lent; above it the binding's generation.
const LANE_OPEN: u64 = 1 << 31;
/// `Lane::word`: a request that took a slot may give it back to the lane when it ends.
const LANE_RETURNS: u64 = 1 << 30;
/// `Lane::word`: the slots lent.
const LANE_CREDITS: u64 = LANE_RETURNS - 1;

/// Free slots of one deployment that the coordinator lends to the handles between two of its
/// events, so that a request for a ready deployment with room is admitted, and usually ends,
/// without a round trip to the task (see `router/DESIGN.md`, "Lent slots").
///
/// NB (who owns what): only the coordinator opens a lane (`word` = generation, open, returns,
/// credits) and it closes every lane (one atomic swap) before it handles any event, counting
/// the slots taken and given back meanwhile as started and ended requests. A handle only takes
/// a slot (a compare-and-swap that fails on a closed lane, a changed binding or no credits);
/// its permit gives the slot back with the same kind of compare-and-swap when the request
/// ends uncut while the lane is still open with returns allowed and the same binding, and
/// otherwise reports the end through the endings channel as every permit does. So the state
/// is never read outside the task, and every decision of the task is made on exact counts: no
/// lane is open while it decides.
///
/// NB (reads at scale): `repr(C)`, `word` and `lent` first (a full read's count of the lane,
/// [`Lane::net`], is made of them: they follow the load cell's figures, `loads.rs`).
#[repr(C)]
struct Lane {
    /// Generation (upper 32 bits) | `LANE_OPEN` | `LANE_RETURNS` | credits.
    word: AtomicU64,
    /// The slots lent when the lane was last opened (for the load read: the slots taken since
    /// are this less the credits left).
    lent: AtomicU64,
    /// The latest start through the lane, in nanoseconds since `Loads::base`.
    last_start: AtomicU64,
    /// The latest end given back to the lane, in nanoseconds since `Loads::base`.
    last_end: AtomicU64,
    /// The instance the slots are on (`None` until the lane is first opened); replaced (with
    /// the next generation) when that changes.
    grant: Mutex<Option<Arc<LaneGrant>>>,
}

impl Lane {
    /// A lane never opened (each deployment's load cell has one: see `loads.rs`).
    fn new() -> Self {
        Lane {
            word: AtomicU64::new(0),
            lent: AtomicU64::new(0),
            last_start: AtomicU64::new(0),
            last_end: AtomicU64::new(0),
            grant: Mutex::new(None),
        }
    }

    /// Requests started through the lane less those ended through it, since it was opened (the
    /// owner has not counted them yet); 0 while it is closed.
    fn net(&self) -> i64 {
        let word = self.word.load(Ordering::SeqCst);
        if word & LANE_OPEN == 0 {
            return 0;
        }
        let lent = self.lent.load(Ordering::SeqCst);
        i64::try_from(lent).unwrap_or(i64::MAX) - i64::try_from(word & LANE_CREDITS).unwrap_or(0)
    }

    /// Gives back a slot taken under `generation`: true if the lane took it (open, returns
    /// allowed, same binding), false if the end must go to the owner as an event.
    fn give_back(&self, generation: u32, base: Instant) -> bool {
        let mut word = self.word.load(Ordering::Acquire);
        if !Self::takes_back(word, generation) {
            return false;
        }
        // Before the slot goes back, so that the owner, which sees the slot, sees the end's
        // instant too (an end that then fails to go back makes the activity later, never
        // earlier: the window closes later, never sooner).
        self.last_end
            .fetch_max(nanos_since(base, Instant::now()), Ordering::Release);
        loop {
            if !Self::takes_back(word, generation) {
                return false;
            }
            match self.word.compare_exchange_weak(
                word,
                word + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(now) => word = now,
            }
        }
    }

    /// Takes one lent slot, if the lane is open and has one: its grant. `base` is
    /// `Loads::base`.
    fn take(&self, base: Instant) -> Option<Arc<LaneGrant>> {
        let grant = match self.grant.lock() {
            Ok(g) => g.clone()?,
            Err(poisoned) => poisoned.into_inner().clone()?,
        };
        let mut word = self.word.load(Ordering::Acquire);
        loop {
            if (word >> 32) as u32 != grant.generation
                || word & LANE_OPEN == 0
                || word & LANE_CREDITS == 0
            {
                return None;
            }
            match self.word.compare_exchange_weak(
                word,
                word - 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break,
                Err(now) => word = now,
            }
        }
        self.last_start
            .fetch_max(nanos_since(base, Instant::now()), Ordering::Relaxed);
        Some(grant)
    }

    /// The latest start or end through the lane (`None`: none yet).
    fn last_use(&self, base: Instant) -> Option<Instant> {
        let nanos = self
            .last_start
            .load(Ordering::Relaxed)
            .max(self.last_end.load(Ordering::Acquire));
        // NB: `Loads::base` is a moment before the task began, so 0 is no instant of a request.
        (nanos > 0).then(|| base + Duration::from_nanos(nanos))
    }

    fn takes_back(word: u64, generation: u32) -> bool {
        (word >> 32) as u32 == generation
            && word & (LANE_OPEN | LANE_RETURNS) == LANE_OPEN | LANE_RETURNS
            && word & LANE_CREDITS < LANE_CREDITS
    }
}

struct LaneGrant {
    generation: u32,
    upstream: Arc<Upstream>,
    serial: u64,
}

/// Nanoseconds from `base` to `at`, saturating.
fn nanos_since(base: Instant, at: Instant) -> u64 {
    u64::try_from(at.saturating_duration_since(base).as_nanos()).unwrap_or(u64::MAX)
}

impl Loads {
    /// Takes one lent slot of `deployment`'s lane (found through its load cell), if it is open
    /// and has one.
    fn take(&self, deployment: &str) -> Option<(Arc<LoadCell>, Arc<LaneGrant>)> {
        let cell = self.cell(deployment)?;
        let grant = cell.lane.take(self.base)?;
        Some((cell, grant))
    }
}
/// A lane the task has opened, with what it lent (its cell, where the lane is, is the key it
/// is kept under: [`ById`]).
struct Lent {
    serial: u64,
    credits: u64,
}

// What the lifecycle reads and is answered (the interfaces' values): re-exported under their
// old paths.
pub use capyctl_interfaces::router::{
    DeploymentLoad, IdleRelease, InstanceLoad, LoadFigures, OperatorResult, OperatorStart,
    ReleaseResult,
};

/// Reads each deployment's last use as the router recorded it ([`CoordinatorHandle::last_used`])
/// without a handle that keeps the coordinator alive. Cheap to clone.
#[derive(Clone)]
pub struct LastUses {
    loads: Arc<Loads>,
}

impl std::fmt::Debug for LastUses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LastUses").finish_non_exhaustive()
    }
}

impl LastUses {
    /// See [`CoordinatorHandle::last_used`] (`None` as well once the coordinator has stopped).
    pub fn of(&self, deployment: &str) -> Option<Instant> {
        self.loads.last_used(deployment)
    }

    /// Requests the router forwards to instance `index` of `deployment` now, as last
    /// published (0 when it knows none): which of a deployment's instances is in use.
    pub fn in_flight_of(&self, deployment: &str, index: u32) -> usize {
        self.loads.in_flight_of(deployment, index)
    }
}

/// Starts the switch coordinator.
pub struct Coordinator;

impl Coordinator {
    /// Starts the coordinator's task (on the current tokio runtime) and returns its handle.
    ///
    /// The task runs until every handle is gone. NB: a lifecycle that keeps a handle (to
    /// announce instances) keeps the task alive with it; that is the normal server shape.
    pub fn spawn(lifecycle: Arc<dyn Lifecycle>, config: RouterConfig) -> CoordinatorHandle {
        let (inbox_tx, inbox_rx) = mpsc::channel(INBOX_CAPACITY);
        let (endings_tx, endings_rx) = mpsc::unbounded_channel();
        let now = Instant::now();
        let loads = Arc::new(Loads::new(
            now.checked_sub(Duration::from_nanos(1)).unwrap_or(now),
        ));
        let driver = Driver {
            state: State::new(config.clone()),
            lent: HashMap::new(),
            loads: Arc::clone(&loads),
            cell_of: HashSet::new(),
            begun: Vec::new(),
            fx: TaskEffects {
                plan_timeout: config.drain_timeout,
                execute_timeout: config.execute_timeout,
                engine_idle_timeout: config.drain_timeout,
                lifecycle: lifecycle.clone(),
                inbox: inbox_tx.downgrade(),
                endings: endings_tx.clone(),
                replies: HashMap::new(),
                release_replies: HashMap::new(),
                operator_replies: HashMap::new(),
                idle_replies: HashMap::new(),
            },
            next_release: 0,
            next_operator: 0,
        };
        tokio::spawn(driver.run(inbox_rx, endings_rx));
        CoordinatorHandle {
            inbox: inbox_tx,
            endings: endings_tx,
            lifecycle,
            next_ticket: Arc::new(AtomicU64::new(0)),
            loads,
        }
    }
}

/// The coordinator's address: the listener's [`Admission`], and the lifecycle's way to tell the
/// router about instances. Cheap to clone.
#[derive(Clone)]
pub struct CoordinatorHandle {
    /// The coordinator's bounded inbox.
    inbox: mpsc::Sender<Command>,
    /// Endings sent from `Drop` (cancelled admissions).
    endings: mpsc::UnboundedSender<Ending>,
    /// For `resolve`, which needs no state of the router.
    lifecycle: Arc<dyn Lifecycle>,
    /// Request numbers, shared by every clone.
    next_ticket: Arc<AtomicU64>,
    /// The load the coordinator publishes after its events, and (in each deployment's cell)
    /// the slots it lends between them.
    loads: Arc<Loads>,
}

impl std::fmt::Debug for CoordinatorHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CoordinatorHandle").finish_non_exhaustive()
    }
}

impl CoordinatorHandle {
    /// The lifecycle opened an instance for traffic: its deployment's waiting requests are
    /// released (up to the in-flight bound).
    pub async fn instance_ready(&self, upstream: Upstream) {
        self.send(Command::InstanceReady(upstream)).await;
    }

    /// The lifecycle says an instance went away (parked, stopped, crashed).
    pub async fn instance_gone(&self, key: InstanceKey) {
        self.send(Command::InstanceGone(key)).await;
    }

    /// Fails every request waiting for `deployment` with `error` (e.g. an operator stop:
    /// `DeploymentStopped`), and gives up a switch to it that has not begun executing.
    pub async fn deployment_refused(&self, deployment: DeploymentId, error: ApiError) {
        self.send(Command::Refused { deployment, error }).await;
    }

    /// Something the lifecycle decides by changed without an instance coming or going (its
    /// switches held or resumed, a fence ended): every deployment waiting is planned again,
    /// so that its requests get the new answer (a refusal, or a switch) without waiting for
    /// their deadline.
    pub async fn replan(&self) {
        self.send(Command::Replan).await;
    }

    /// The lifecycle sampled instance `key`'s engine at `at` (on the coordinator's clock):
    /// `waiting` requests wait there. least_loaded routing adds it to the router's own count
    /// of the instance while the sample is fresh (no older than
    /// [`ENGINE_SAMPLE_FRESH`](routing::ENGINE_SAMPLE_FRESH), 2 s; an older one counts as 0).
    /// Never waits: when the inbox is full the sample is dropped (it is advice, and the next
    /// one comes a moment later), and `false` says so.
    pub fn note_engine_load(&self, key: InstanceKey, waiting: usize, at: Instant) -> bool {
        self.inbox
            .try_send(Command::EngineLoad { key, waiting, at })
            .is_ok()
    }

    /// The router half of the load read: every deployment the router knows, by ID. Empty when
    /// the coordinator has stopped. A copy of what the coordinator published after its last
    /// event (with the requests on lent slots since): it takes no turn of its task, so no
    /// admission waits behind it.
    pub async fn load(&self) -> Vec<DeploymentLoad> {
        self.loads.all()
    }

    /// The router half of the load read of one deployment (see [`CoordinatorHandle::load`]);
    /// `None` when the router does not know it (nothing ever waited for it or ran on it, or
    /// it was forgotten).
    pub async fn load_of(&self, deployment: &str) -> Option<DeploymentLoad> {
        self.loads.load_of(deployment)
    }

    /// Each deployment the router knows, its ID and the figures of its load now (as
    /// [`CoordinatorHandle::figures_of`]'s), in ID order, handed to `each`: for a reader of them
    /// all that keeps none (the lifecycle's idle timers and queue gauges, each second), with
    /// nothing allocated per deployment ([`CoordinatorHandle::load`] makes each one's
    /// `DeploymentLoad`: its ID and each instance's key copied). Takes no turn of the task.
    pub fn each_load(&self, each: &mut dyn FnMut(&str, &LoadFigures)) {
        self.loads.each_figures(each);
    }

    /// The figures of [`CoordinatorHandle::load_of`] without waiting (copied from the published
    /// load as [`LoadsInOrder::get`] copies them: no IDs, no last use); `None` when the router
    /// does not know it.
    pub fn figures_of(&self, deployment: &str) -> Option<LoadFigures> {
        self.loads.figures_of(deployment)
    }

    /// The figures of [`CoordinatorHandle::load_of`] of every deployment, for a read that asks
    /// for them in ascending order of ID (the lifecycle's full load read): no map look-up and
    /// nothing allocated per deployment (each one's figures are copied into the reader's one
    /// record), and the list of cells in ID order is kept between reads until a deployment
    /// joins or leaves the router. Like every load read it takes no turn of the task.
    pub fn loads_in_order(&self) -> LoadsInOrder {
        self.loads.in_order()
    }

    /// The lifecycle deleted `deployment`: its waiting requests fail (`not_found`), a switch
    /// to it that has not begun executing is given up, and its entry (load, counters) goes
    /// once nothing is charged to it any more.
    pub async fn forget(&self, deployment: DeploymentId) {
        self.send(Command::Forget(deployment)).await;
    }

    /// For releases the lifecycle starts itself (operator park or stop, delete, idle
    /// timers): closes `victims` to new requests (requests for them get `DispatchClosed` while
    /// no other instance is open), waits for their running requests within `drain_timeout`
    /// (and, after a cut answer, for `engine_idle`), forgets them and answers their reports.
    /// On a drain timeout they serve again and the answer is `DrainTimeout`.
    pub async fn release(&self, victims: Vec<InstanceKey>) -> ReleaseResult {
        let deployment = victims
            .first()
            .map(|k| k.deployment.clone())
            .unwrap_or_default();
        let (reply, rx) = oneshot::channel();
        self.send(Command::Release { victims, reply }).await;
        rx.await
            .unwrap_or(Err(ApiError::DispatchClosed { deployment }))
    }

    /// An operator's `start --evict` of `deployment`: a switch like a wave's, ordered by the
    /// operator, that runs alone in its turn (after the switches in progress). The
    /// deployments with waiting requests are protected (decided in the coordinator, on its own
    /// state), the plan is asked for with [`PlanFor::Operator`], there is no admission window
    /// (the victims close at once), the victims drain as a switch's do (within
    /// `drain_timeout`), and the order is executed by the lifecycle. A stopped coordinator
    /// answers `DispatchClosed`.
    pub async fn operator_start(&self, deployment: DeploymentId) -> OperatorResult {
        let (reply, rx) = oneshot::channel();
        self.send(Command::OperatorStart {
            deployment: deployment.clone(),
            reply,
        })
        .await;
        rx.await
            .unwrap_or(Err(ApiError::DispatchClosed { deployment }))
    }

    /// For the lifecycle's idle timers: releases `deployment` (its instances `victims`, none
    /// for a parked one) as [`CoordinatorHandle::release`] does, but only if the coordinator
    /// finds it idle on its own state: nothing waits for it, nothing runs on it, none of its
    /// requests started or ended after `idle_since`, and no switch or release names it.
    /// Otherwise it changes nothing and answers [`IdleRelease::InUse`]. The lifecycle reserves
    /// the deployment before it asks (so that a request coming after the answer plans a wake
    /// only once it has been put away).
    pub async fn release_if_idle(
        &self,
        deployment: DeploymentId,
        victims: Vec<InstanceKey>,
        idle_since: Instant,
    ) -> IdleRelease {
        let closed = ApiError::DispatchClosed {
            deployment: deployment.clone(),
        };
        let (reply, rx) = oneshot::channel();
        self.send(Command::ReleaseIfIdle {
            deployment,
            victims,
            idle_since,
            reply,
        })
        .await;
        rx.await.unwrap_or(IdleRelease::Released(Err(closed)))
    }

    /// When a request of `deployment` last started or ended (see
    /// [`DeploymentLoad::last_used`]): `None` when none did while the router knew it. Takes no
    /// turn of the task, as the load read.
    pub fn last_used(&self, deployment: &str) -> Option<Instant> {
        self.loads.last_used(deployment)
    }

    /// A reader of [`CoordinatorHandle::last_used`] that does not keep the coordinator alive.
    pub fn last_uses(&self) -> LastUses {
        LastUses {
            loads: Arc::clone(&self.loads),
        }
    }

    /// Sends a command; a stopped coordinator drops it (its replies then fail).
    async fn send(&self, command: Command) {
        let _ = self.inbox.send(command).await;
    }

    /// The admission itself (see [`Admission::admit`]).
    async fn admit_inner(
        self,
        deployment: DeploymentRef,
        deadline: Instant,
        prefix: Option<u64>,
        tenant: Option<Arc<str>>,
        prefer: Vec<InstanceKey>,
    ) -> Result<CoordinatorPermit, ApiError> {
        // A prefix key matters only to a deployment routed by `prefix`.
        let prefix = prefix.filter(|_| deployment.routing == capyctl_spec::Routing::Prefix);
        // A ready deployment with room and nobody waiting: a lent slot, no round trip.
        if let Some((cell, grant)) = self.loads.take(&deployment.id) {
            return Ok(CoordinatorPermit {
                upstream: Arc::clone(&grant.upstream),
                serial: grant.serial,
                lane: Some(LaneSlot {
                    cell,
                    generation: grant.generation,
                    base: self.loads.base,
                }),
                first_output: AtomicBool::new(false),
                cut: AtomicBool::new(false),
                at_bound: Duration::ZERO,
                endings: Some(self.endings.clone()),
            });
        }
        let ticket = self.next_ticket.fetch_add(1, Ordering::Relaxed);
        // Dropped before the answer (the client went away): give up the place.
        let guard = CancelGuard {
            ticket,
            endings: Some(self.endings.clone()),
        };
        let (reply, rx) = oneshot::channel();
        let closed = || ApiError::DispatchClosed {
            deployment: deployment.id.clone(),
        };
        self.inbox
            .send(Command::Admit {
                request: AdmitRequest {
                    ticket,
                    deployment: deployment.id.clone(),
                    deadline,
                    prefix,
                    prefer: prefer.into_boxed_slice(),
                    priority: deployment.priority,
                    tenant,
                },
                reply,
            })
            .await
            .map_err(|_| closed())?;
        let answer = rx.await;
        guard.disarm();
        answer.unwrap_or_else(|_| Err(closed()))
    }
}

impl Admission for CoordinatorHandle {
    type Permit = CoordinatorPermit;

    fn resolve(&self, model: &str) -> Option<DeploymentRef> {
        self.lifecycle.resolve(model)
    }

    fn admit(
        &self,
        deployment: DeploymentRef,
        deadline: Instant,
    ) -> impl Future<Output = Result<Self::Permit, ApiError>> + Send {
        self.clone()
            .admit_inner(deployment, deadline, None, None, Vec::new())
    }

    fn admit_routed(
        &self,
        deployment: DeploymentRef,
        deadline: Instant,
        prefix: Option<u64>,
    ) -> impl Future<Output = Result<Self::Permit, ApiError>> + Send {
        self.clone()
            .admit_inner(deployment, deadline, prefix, None, Vec::new())
    }

    fn admit_as(
        &self,
        deployment: DeploymentRef,
        deadline: Instant,
        prefix: Option<u64>,
        tenant: Option<Arc<str>>,
    ) -> impl Future<Output = Result<Self::Permit, ApiError>> + Send {
        self.clone()
            .admit_inner(deployment, deadline, prefix, tenant, Vec::new())
    }

    fn admit_preferring(
        &self,
        deployment: DeploymentRef,
        deadline: Instant,
        prefix: Option<u64>,
        tenant: Option<Arc<str>>,
        prefer: Vec<InstanceKey>,
    ) -> impl Future<Output = Result<Self::Permit, ApiError>> + Send {
        self.clone()
            .admit_inner(deployment, deadline, prefix, tenant, prefer)
    }
}

/// One admitted request's charge on an instance. Its methods only set flags; its `Drop` gives
/// a lent slot back to its lane, or reports the end (with the flags) to the coordinator, which
/// frees the slot.
pub struct CoordinatorPermit {
    /// Where to forward.
    upstream: Arc<Upstream>,
    /// The instance entry it is charged to.
    serial: u64,
    /// The lane it took its slot from, if it did.
    lane: Option<LaneSlot>,
    /// Set by `first_output`; read once, in `Drop`.
    first_output: AtomicBool,
    /// Set by `cut`; read once, in `Drop`.
    cut: AtomicBool,
    /// How long it waited at its deployment's in-flight bound (see [`Grant::at_bound`]).
    at_bound: Duration,
    /// Where the end goes; `None` once defused (never handed out).
    endings: Option<mpsc::UnboundedSender<Ending>>,
}

/// Where a permit that took a lent slot may give it back.
struct LaneSlot {
    /// The deployment's cell, where the lane is.
    cell: Arc<LoadCell>,
    generation: u32,
    base: Instant,
}

impl std::fmt::Debug for CoordinatorPermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CoordinatorPermit")
            .field("upstream", &self.upstream)
            .field("serial", &self.serial)
            .field("lent", &self.lane.is_some())
            .finish_non_exhaustive()
    }
}

impl CoordinatorPermit {
    /// A permit that was never handed out reports nothing.
    fn defuse(mut self) {
        self.endings = None;
    }
}

impl Permit for CoordinatorPermit {
    fn upstream(&self) -> &Upstream {
        &self.upstream
    }

    fn first_output(&self) {
        self.first_output.store(true, Ordering::Relaxed);
    }

    fn cut(&self) {
        self.cut.store(true, Ordering::Relaxed);
    }

    fn waited_at_bound(&self) -> Duration {
        self.at_bound
    }
}

impl Drop for CoordinatorPermit {
    fn drop(&mut self) {
        if let Some(endings) = self.endings.take() {
            let cut = self.cut.load(Ordering::Relaxed);
            // A cut is news for the owner (park or stop); an ordinary end of a lent slot is not.
            if !cut
                && let Some(slot) = &self.lane
                && slot.cell.lane.give_back(slot.generation, slot.base)
            {
                return;
            }
            let _ = endings.send(Ending::Finished(Finished {
                key: self.upstream.key.clone(),
                serial: self.serial,
                output: self.first_output.load(Ordering::Relaxed),
                cut,
            }));
        }
    }
}

/// Sends `Cancel` when an admission is dropped before its answer.
struct CancelGuard {
    ticket: Ticket,
    endings: Option<mpsc::UnboundedSender<Ending>>,
}

impl CancelGuard {
    fn disarm(mut self) {
        self.endings = None;
    }
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if let Some(endings) = self.endings.take() {
            let _ = endings.send(Ending::Cancel(self.ticket));
        }
    }
}

/// Events that arrive through the bounded inbox.
enum Command {
    Admit {
        request: AdmitRequest,
        reply: oneshot::Sender<Result<CoordinatorPermit, ApiError>>,
    },
    InstanceReady(Upstream),
    InstanceGone(InstanceKey),
    Replan,
    Refused {
        deployment: DeploymentId,
        error: ApiError,
    },
    Forget(DeploymentId),
    Release {
        victims: Vec<InstanceKey>,
        reply: oneshot::Sender<ReleaseResult>,
    },
    OperatorStart {
        deployment: DeploymentId,
        reply: oneshot::Sender<OperatorResult>,
    },
    ReleaseIfIdle {
        deployment: DeploymentId,
        victims: Vec<InstanceKey>,
        idle_since: Instant,
        reply: oneshot::Sender<IdleRelease>,
    },
    PlanDone {
        seq: SwitchSeq,
        result: Result<Plan, ApiError>,
    },
    ExecuteDone {
        seq: SwitchSeq,
        result: Result<Executed, ApiError>,
    },
    EngineIdle {
        owner: DrainOwner,
        key: InstanceKey,
        idle: bool,
    },
    EngineLoad {
        key: InstanceKey,
        waiting: usize,
        at: Instant,
    },
}

/// Events sent from `Drop`, which cannot wait for room.
#[derive(Debug)]
enum Ending {
    /// A waiting client went away.
    Cancel(Ticket),
    /// A permit ended.
    Finished(Finished),
}

/// The task: the state, and the plumbing that carries out its effects.
struct Driver {
    /// All routing state; only this task touches it.
    state: State,
    /// The lanes open now, by deployment.
    lent: HashMap<ById, Lent>,
    /// Shared with the handles (each deployment's lane is found through its cell).
    loads: Arc<Loads>,
    /// The same cells, for the task (by deployment ID).
    cell_of: HashSet<ById>,
    /// The cells being changed in this turn (`seq` odd until the turn ends).
    begun: Vec<Arc<LoadCell>>,
    /// Replies and lifecycle calls.
    fx: TaskEffects,
    /// Release numbers.
    next_release: ReleaseId,
    /// Operators' switch numbers.
    next_operator: OperatorId,
}

impl Driver {
    async fn run(
        mut self,
        mut inbox: mpsc::Receiver<Command>,
        mut endings: mpsc::UnboundedReceiver<Ending>,
    ) {
        // One timer, moved (`reset`) only when the next instant changes: most events (an
        // admission, a finished request) leave it where it is.
        let timer = tokio::time::sleep_until(Instant::now());
        tokio::pin!(timer);
        let mut armed: Option<Instant> = None;
        loop {
            let next = self.state.next_timer();
            if next != armed {
                if let Some(at) = next {
                    timer.as_mut().reset(at);
                }
                armed = next;
            }
            let returned = self.state.returns();
            let began = nanos_since(self.loads.base, Instant::now());
            tokio::select! {
                biased;
                Some(ending) = endings.recv() => {
                    self.on_ending(ending);
                    // Every ending already there, before anything else (as `biased` would).
                    while let Ok(ending) = endings.try_recv() {
                        self.on_ending(ending);
                    }
                }
                command = inbox.recv() => match command {
                    Some(command) => self.on_command(command),
                    None => break,
                },
                () = &mut timer, if armed.is_some() => {
                    armed = None;
                    self.reclaim_watched();
                    self.state.tick(Instant::now(), &mut self.fx);
                }
            }
            if returned && !self.state.returns() {
                // A deployment is blocked `Later` now: no slot may go back without the owner
                // hearing of it (see `State::returns`), so every lane is lent again without.
                let all: Vec<DeploymentId> =
                    self.lent.keys().map(|c| c.0.id().to_string()).collect();
                let last_end = self.reclaim(&all);
                if last_end > began {
                    // A request ended on a lane while this turn decided: it is heard now.
                    self.state.lent_ended(Instant::now(), &mut self.fx);
                }
            }
            self.publish();
            for cell in self.begun.drain(..) {
                cell.end();
            }
        }
        let all: Vec<DeploymentId> = self.lent.keys().map(|c| c.0.id().to_string()).collect();
        self.reclaim(&all);
        for cell in self.begun.drain(..) {
            cell.end();
        }
    }

    /// Publishes the load of the deployments this turn changed (and drops the cells of those
    /// whose entry went, with their lanes), and lends the free slots of those that may lend.
    fn publish(&mut self) {
        for (id, load) in self.state.take_changed() {
            match (load, self.cell_of.get(id.as_str())) {
                (Some(load), Some(cell)) => {
                    cell.0.begin(&mut self.begun);
                    cell.0.set(load);
                }
                (Some(load), None) => {
                    let cell = Arc::new(LoadCell::new(&id, load));
                    self.loads.insert(Arc::clone(&cell));
                    self.cell_of.insert(ById(cell));
                }
                (None, _) => {
                    // Its lane goes with its cell.
                    if self.cell_of.remove(id.as_str()) {
                        self.loads.remove(&id);
                    }
                    continue;
                }
            }
            self.lend(&id);
        }
    }

    /// Takes back, before an event, the lanes of the deployments whose counts it may read or
    /// change: those it names, and those the rules read at any event ([`State::watched`]).
    ///
    /// NB (why not every lane): no rule reads another deployment's counts, so a lane of a
    /// deployment an event does not concern stays open through it (its requests are counted
    /// when its own next event, or a read of the load, comes); an event costs the lanes it
    /// concerns, not one per ready deployment.
    fn reclaim_for<'a>(&mut self, named: impl IntoIterator<Item = &'a DeploymentId>) {
        if self.lent.is_empty() {
            return;
        }
        let mut ids: Vec<DeploymentId> = named
            .into_iter()
            .filter(|id| self.lent.contains_key(id.as_str()))
            .cloned()
            .collect();
        ids.extend(
            self.state
                .watched()
                .filter(|id| self.lent.contains_key(id.as_str()))
                .cloned(),
        );
        self.reclaim(&ids);
    }

    /// [`Driver::reclaim_for`] an event that names no deployment (a timer).
    fn reclaim_watched(&mut self) {
        self.reclaim_for(std::iter::empty());
    }

    /// Closes the lanes of `ids` that are open and charges the slots taken from them and given
    /// back to them as started and ended requests. The latest end given back to one of them
    /// (nanoseconds since `Loads::base`; 0 for none).
    fn reclaim(&mut self, ids: &[DeploymentId]) -> u64 {
        let now = Instant::now();
        let base = self.loads.base;
        let mut last_end = 0;
        for id in ids {
            let Some((ById(cell), lent)) = self.lent.remove_entry(id.as_str()) else {
                continue;
            };
            // The lane's count moves into the state: readers of its load copy again meanwhile.
            if let Some(published) = self.cell_of.get(id.as_str()) {
                published.0.begin(&mut self.begun);
            }
            let word = cell
                .lane
                .word
                .fetch_and(!(LANE_OPEN | LANE_RETURNS | LANE_CREDITS), Ordering::AcqRel);
            let left = word & LANE_CREDITS;
            // NB: the activity is taken even when nothing moved (its instants only grow, and
            // an instant can repeat under a paused clock, so "it moved" cannot be told apart).
            let net = i64::try_from(lent.credits).unwrap_or(i64::MAX)
                - i64::try_from(left).unwrap_or(i64::MAX);
            let ended = cell.lane.last_end.load(Ordering::Acquire);
            last_end = last_end.max(ended);
            let nanos = cell.lane.last_start.load(Ordering::Relaxed).max(ended);
            let last = (base + Duration::from_nanos(nanos)).min(now);
            self.state.lent_settled(id, lent.serial, net, last);
            if nanos > 0 {
                self.state.lent_used(id, last);
            }
        }
        last_end
    }

    /// Opens `deployment`'s lane if its free slots may be lent and it is not open already.
    fn lend(&mut self, deployment: &DeploymentId) {
        if self.lent.contains_key(deployment.as_str()) {
            return;
        }
        let returns = self.state.returns();
        let Some((upstream, serial, free)) = self.state.lendable(deployment) else {
            return;
        };
        // Its cell was published before (`Driver::publish`): the lane lives in it.
        let Some(cell) = self.cell_of.get(deployment.as_str()) else {
            return;
        };
        let lane = &cell.0.lane;
        let generation = {
            let mut grant = match lane.grant.lock() {
                Ok(g) => g,
                Err(poisoned) => poisoned.into_inner(),
            };
            match &*grant {
                Some(g) if g.serial == serial && Arc::ptr_eq(&g.upstream, upstream) => g.generation,
                // The first grant is generation 0; each change of instance the next.
                old => {
                    let generation = old.as_ref().map_or(0, |g| g.generation.wrapping_add(1));
                    *grant = Some(Arc::new(LaneGrant {
                        generation,
                        upstream: Arc::clone(upstream),
                        serial,
                    }));
                    generation
                }
            }
        };
        let credits = u64::try_from(free)
            .unwrap_or(LANE_CREDITS)
            .min(LANE_CREDITS);
        let returns = if returns { LANE_RETURNS } else { 0 };
        lane.lent.store(credits, Ordering::SeqCst);
        lane.word.store(
            (u64::from(generation) << 32) | LANE_OPEN | returns | credits,
            Ordering::SeqCst,
        );
        self.lent.insert(cell.clone(), Lent { serial, credits });
    }

    fn on_ending(&mut self, ending: Ending) {
        match &ending {
            Ending::Cancel(ticket) => {
                let waits_for = self.state.waits_for(*ticket).cloned();
                self.reclaim_for(waits_for.as_ref());
            }
            Ending::Finished(f) => self.reclaim_for([&f.key.deployment]),
        }
        let now = Instant::now();
        match ending {
            Ending::Cancel(ticket) => {
                self.fx.replies.remove(&ticket);
                self.state.cancel(now, ticket, &mut self.fx);
            }
            Ending::Finished(f) => self.state.finished(now, f, &mut self.fx),
        }
    }

    fn on_command(&mut self, command: Command) {
        match &command {
            Command::Admit { request, .. } => self.reclaim_for([&request.deployment]),
            Command::InstanceReady(up) => self.reclaim_for([&up.key.deployment]),
            Command::InstanceGone(key) => self.reclaim_for([&key.deployment]),
            Command::Replan => {}
            Command::Refused { deployment, .. }
            | Command::Forget(deployment)
            | Command::OperatorStart { deployment, .. } => {
                self.reclaim_for([deployment]);
            }
            Command::Release { victims, .. } => {
                let named: Vec<DeploymentId> =
                    victims.iter().map(|k| k.deployment.clone()).collect();
                self.reclaim_for(&named);
            }
            Command::PlanDone { result, .. } => {
                let named: Vec<DeploymentId> = self.state.named_by_plan(result).cloned().collect();
                self.reclaim_for(&named);
            }
            Command::ExecuteDone { seq, .. } => {
                let named: Vec<DeploymentId> = self.state.targets_of(*seq).cloned().collect();
                self.reclaim_for(&named);
            }
            Command::EngineIdle { key, .. } => self.reclaim_for([&key.deployment]),
            Command::ReleaseIfIdle { deployment, .. } => self.reclaim_for([deployment]),
            // Reads and changes no count: nothing to take back.
            Command::EngineLoad { .. } => {}
        }
        let now = Instant::now();
        let fx = &mut self.fx;
        match command {
            Command::Admit { request, reply } => {
                // Gone before we saw it (its cancel may have come first): nothing to do.
                if reply.is_closed() {
                    return;
                }
                fx.replies.insert(request.ticket, reply);
                self.state.admit(now, request, fx);
            }
            Command::InstanceReady(up) => self.state.instance_ready(now, up, fx),
            Command::InstanceGone(key) => self.state.instance_gone(now, key, fx),
            Command::Replan => self.state.replan(now, fx),
            Command::Refused { deployment, error } => {
                self.state.deployment_refused(now, &deployment, error, fx)
            }
            Command::Forget(deployment) => self.state.forget_deployment(now, &deployment, fx),
            Command::Release { victims, reply } => {
                let id = self.next_release;
                self.next_release += 1;
                fx.release_replies.insert(id, reply);
                self.state.release(now, id, victims, fx);
            }
            Command::OperatorStart { deployment, reply } => {
                let id = self.next_operator;
                self.next_operator += 1;
                fx.operator_replies.insert(id, reply);
                self.state.operator_start(now, id, deployment, fx);
            }
            Command::PlanDone { seq, result } => self.state.plan_done(now, seq, result, fx),
            Command::ExecuteDone { seq, result } => self.state.execute_done(now, seq, result, fx),
            Command::EngineIdle { owner, key, idle } => {
                self.state.engine_idle_done(now, owner, key, idle, fx)
            }
            Command::ReleaseIfIdle {
                deployment,
                victims,
                idle_since,
                reply,
            } => self.release_if_idle(now, deployment, victims, idle_since, reply),
            Command::EngineLoad { key, waiting, at } => self.state.engine_load(&key, waiting, at),
        }
    }

    /// [`CoordinatorHandle::release_if_idle`], decided by [`State::release_if_idle`] (its
    /// lane, if any, is taken back first: the counts and the last use are exact).
    fn release_if_idle(
        &mut self,
        now: Instant,
        deployment: DeploymentId,
        victims: Vec<InstanceKey>,
        idle_since: Instant,
        reply: oneshot::Sender<IdleRelease>,
    ) {
        let id = self.next_release;
        self.next_release += 1;
        // Before the decision: a release that ends at once answers within it.
        self.fx.idle_replies.insert(id, reply);
        let fx = &mut self.fx;
        if !self
            .state
            .release_if_idle(now, id, &deployment, victims, idle_since, fx)
            && let Some(reply) = self.fx.idle_replies.remove(&id)
        {
            let _ = reply.send(IdleRelease::InUse);
        }
    }
}

impl Drop for Driver {
    /// A task that stops (its runtime shut down) lends nothing any more: handles then go to
    /// the closed inbox and answer `DispatchClosed`.
    fn drop(&mut self) {
        for ById(cell) in self.lent.keys() {
            cell.lane
                .word
                .fetch_and(!(LANE_OPEN | LANE_RETURNS | LANE_CREDITS), Ordering::AcqRel);
        }
        // The load read of a stopped coordinator is empty.
        self.loads.clear();
    }
}

/// The task's [`Effects`]: answers through the requests' reply channels and runs the
/// lifecycle's futures as tasks that report back through the inbox.
struct TaskEffects {
    lifecycle: Arc<dyn Lifecycle>,
    /// Bounds on the lifecycle's futures: past them (or when one panics) the owner is told
    /// that it failed, so that no switch waits forever for an answer.
    plan_timeout: Duration,
    execute_timeout: Duration,
    engine_idle_timeout: Duration,
    /// Weak, so that the coordinator's own spawned work does not keep it alive.
    inbox: mpsc::WeakSender<Command>,
    /// Handed to every permit.
    endings: mpsc::UnboundedSender<Ending>,
    /// The reply channels of admitted-but-unanswered requests.
    replies: HashMap<Ticket, oneshot::Sender<Result<CoordinatorPermit, ApiError>>>,
    /// The reply channels of releases in progress.
    release_replies: HashMap<ReleaseId, oneshot::Sender<ReleaseResult>>,
    /// The reply channels of operators' switches in progress.
    operator_replies: HashMap<OperatorId, oneshot::Sender<OperatorResult>>,
    /// The reply channels of idle releases in progress (same numbers as `release_replies`).
    idle_replies: HashMap<ReleaseId, oneshot::Sender<IdleRelease>>,
}

impl TaskEffects {
    /// Runs `work` (a lifecycle future) as a task and sends its outcome back through the
    /// inbox. If it panics, or has not answered within `bound`, `lost(why)` is sent instead,
    /// so that the owner never waits forever: a hung or panicking lifecycle does not stop all
    /// switching. A late answer is still sent when it comes (the owner ignores it, or gives a
    /// plan back, since its switch is over); the work itself is not cancelled, so the
    /// lifecycle's own steps run to their end.
    fn report_back<F>(
        &self,
        what: &'static str,
        bound: Duration,
        work: F,
        lost: impl FnOnce(ApiError) -> Command + Send + 'static,
    ) where
        F: Future<Output = Command> + Send + 'static,
    {
        let inbox = self.inbox.clone();
        // One task runs the work and bounds it (no task of its own: a hand-off less on every
        // switch's path); a panic is caught here as the runtime would catch it in a task.
        tokio::spawn(async move {
            let mut work = pin!(AssertUnwindSafe(work).catch_unwind());
            let first = tokio::select! {
                joined = &mut work => Some(joined),
                () = tokio::time::sleep(bound) => None,
            };
            let send = |command: Command| async {
                if let Some(inbox) = inbox.upgrade() {
                    let _ = inbox.send(command).await;
                }
            };
            match first {
                Some(Ok(command)) => send(command).await,
                Some(Err(panic)) => {
                    let why = panic
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_default();
                    tracing::error!(panic = %why, "the lifecycle's {what} failed");
                    send(lost(ApiError::Internal {
                        detail: format!("the lifecycle's {what} failed"),
                    }))
                    .await;
                }
                None => {
                    tracing::error!(
                        bound_ms = bound.as_millis(),
                        "the lifecycle's {what} did not answer in time"
                    );
                    send(lost(ApiError::Internal {
                        detail: format!(
                            "the lifecycle's {what} did not answer within {} ms",
                            bound.as_millis()
                        ),
                    }))
                    .await;
                    if let Ok(late) = work.await {
                        send(late).await;
                    }
                }
            }
        });
    }
}

impl Effects for TaskEffects {
    fn admissible(&mut self, deployment: &DeploymentId) -> Result<(), ApiError> {
        self.lifecycle.admissible(deployment)
    }

    fn grant(&mut self, ticket: Ticket, grant: Grant) -> bool {
        let Some(reply) = self.replies.remove(&ticket) else {
            return false;
        };
        let permit = CoordinatorPermit {
            upstream: grant.upstream,
            serial: grant.serial,
            lane: None,
            first_output: AtomicBool::new(false),
            cut: AtomicBool::new(false),
            at_bound: grant.at_bound,
            endings: Some(self.endings.clone()),
        };
        match reply.send(Ok(permit)) {
            Ok(()) => true,
            Err(unsent) => {
                if let Ok(permit) = unsent {
                    permit.defuse();
                }
                false
            }
        }
    }

    fn refuse(&mut self, ticket: Ticket, error: ApiError) {
        if let Some(reply) = self.replies.remove(&ticket) {
            let _ = reply.send(Err(error));
        }
    }

    fn plan(
        &mut self,
        seq: SwitchSeq,
        deployment: DeploymentId,
        protected: BTreeSet<DeploymentId>,
        who: PlanFor,
    ) {
        let lifecycle = self.lifecycle.clone();
        self.report_back(
            "plan",
            self.plan_timeout,
            async move {
                let result = lifecycle.plan(&deployment, &protected, who).await;
                Command::PlanDone { seq, result }
            },
            move |error| Command::PlanDone {
                seq,
                result: Err(error),
            },
        );
    }

    fn execute(&mut self, seq: SwitchSeq, order: SwitchOrder) {
        let lifecycle = self.lifecycle.clone();
        self.report_back(
            "execute",
            self.execute_timeout,
            async move {
                let result = lifecycle.execute(order).await;
                Command::ExecuteDone { seq, result }
            },
            move |error| Command::ExecuteDone {
                seq,
                result: Err(error),
            },
        );
    }

    fn abandon(&mut self, switch_id: &str) {
        self.lifecycle.abandon(switch_id);
    }

    fn switch_failed(&mut self, failed: &SwitchOrder, error: &ApiError) {
        self.lifecycle.switch_failed(failed, error);
    }

    fn switch_draining(&mut self, switch_id: &str) {
        self.lifecycle.switch_draining(switch_id);
    }

    fn engine_idle(&mut self, owner: DrainOwner, key: InstanceKey) {
        let lifecycle = self.lifecycle.clone();
        let lost_key = key.clone();
        self.report_back(
            "engine_idle",
            self.engine_idle_timeout,
            async move {
                let idle = lifecycle.engine_idle(&key).await;
                Command::EngineIdle { owner, key, idle }
            },
            // Unreadable: the requests count as cut before output (stop, not park).
            move |_| Command::EngineIdle {
                owner,
                key: lost_key,
                idle: false,
            },
        );
    }

    fn released(&mut self, id: ReleaseId, result: ReleaseResult) {
        if let Some(reply) = self.idle_replies.remove(&id) {
            let _ = reply.send(IdleRelease::Released(result));
            return;
        }
        if let Some(reply) = self.release_replies.remove(&id) {
            let _ = reply.send(result);
        }
    }

    fn operator_done(&mut self, id: OperatorId, result: OperatorResult) {
        if let Some(reply) = self.operator_replies.remove(&id) {
            let _ = reply.send(result);
        }
    }
}
