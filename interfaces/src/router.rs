//! The router's interface to the lifecycle: what the router needs from it ([`Lifecycle`]), and
//! what the lifecycle tells the router (moved here from `router/src/lifecycle.rs`, a name that
//! was another crate's).
//!
//! The router never talks to an engine's control API. It asks the lifecycle, through
//! [`Lifecycle`], which deployment a model name means, whether and how that deployment can be
//! made servable, and to carry out a switch (park or stop the victims, wake or start the
//! waiting deployment). The lifecycle in turn tells the router, through the coordinator's
//! handle, when instances open for traffic and when they go away.
//!
//! NB: the lifecycle owns instance state; the router owns queues and in-flight counts. A plan
//! the lifecycle hands out reserves its victims inside the lifecycle, so two plans never name
//! the same victim and an operator command cannot move a victim behind the router's back.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use capyctl_spec::api::Victim;
use capyctl_spec::errors::ApiError;
use tokio::sync::oneshot;
use tokio::time::Instant;

/// The one boxed future (keeps [`Lifecycle`] object-safe: `Arc<dyn Lifecycle>`).
pub use crate::BoxFuture;

/// A deployment's ID (a ULID, as text).
pub type DeploymentId = String;

/// One engine process of a deployment on one host.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InstanceKey {
    /// The deployment the instance belongs to.
    pub deployment: DeploymentId,
    /// The instance's index within its deployment.
    pub index: u32,
    /// The host it runs on.
    pub host_id: String,
    /// Bumped every time the instance is started afresh.
    pub generation: u64,
}

/// A ready instance the router may forward to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    /// Which instance this is.
    pub key: InstanceKey,
    /// Where its engine listens (plain HTTP).
    pub addr: SocketAddr,
}

/// What the router knows of a deployment a request named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeploymentRef {
    /// The deployment's ID.
    pub id: DeploymentId,
    /// Its name (what requests put in `model`).
    pub name: String,
    /// How its requests choose among its instances (the document's `routing:`).
    pub routing: capyctl_spec::Routing,
}

/// How a deployment that has no ready instance can become servable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// It is already starting or waking (e.g. an operator's start): wait for it to open.
    AlreadyComing,
    /// It can start or wake now: there is room, nothing has to be released. The router does
    /// not wait for this one to finish before it plans the next switch (a cold start can take
    /// minutes): the lifecycle keeps the target claimed and its memory reserved meanwhile.
    BringUp {
        /// The switch's ID, for logs, metrics and receipts.
        switch_id: String,
    },
    /// It can start or wake once these instances have been released (parked or stopped).
    /// The router runs the admission window and the drain on them first.
    Switch {
        /// The switch's ID, for logs, metrics and receipts.
        switch_id: String,
        /// The instances to release. Never one with waiting requests, never an explicit one.
        victims: Vec<InstanceKey>,
        /// The admission window that applies: the one of the host where the switch happens
        /// (`resource_policy.queue.admission_window` of that host); `None` for the router's
        /// own ([`crate::config::RouterConfig::admission_window`]).
        window: Option<Duration>,
    },
    /// Not now: memory is held by instances that cannot be released yet (busy, or reserved by
    /// another switch). The router asks again after the next switch or instance change.
    Later,
}

/// Whom a plan is for, which decides whom it may name as victims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanFor {
    /// A wave of waiting requests: idle ready instances and parked engines, never one that
    /// `protected` names. The target must be admissible.
    Requests,
    /// An operator's `start --evict`: those, and starts or wakes in progress that no request
    /// waits for (they are ended, their engines stopped, when the order is executed). The
    /// operator's start is what makes the target admissible, so that is not asked.
    Operator,
}

/// How the requests of a drained victim ended; decides between parking and stopping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DrainReport {
    /// A request was cut (client gone, stalled or oversized) before the engine produced any of
    /// its answer: the engine's "no running requests" proves nothing about it, so the victim
    /// must be stopped rather than parked.
    pub cut_before_output: bool,
}

/// The switch the router asks the lifecycle to carry out once the victims are drained.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SwitchOrder {
    /// The switch's ID (from the plan).
    pub switch_id: String,
    /// The deployment to wake or start.
    pub target: DeploymentId,
    /// The drained victims to park (or stop), with how their requests ended.
    pub victims: Vec<(InstanceKey, DrainReport)>,
    /// How long the admission window lasted (from the switch's start until the victims
    /// closed); zero without victims.
    pub window: Duration,
    /// How long the drain took; zero without victims.
    pub drain: Duration,
    /// When the switch began (the plan was asked for): its admission window began then, and
    /// its drain `window` later (for the switch's record).
    pub began: Instant,
    /// The requests waiting for the target when the switch began (its wave).
    pub wave: usize,
    /// An operator's switch (`start --evict`, planned with [`PlanFor::Operator`]): `execute`
    /// answers once the victims are released and the target's start or wake has begun (the
    /// operator's `--wait` decides whether to wait for the rest, [`Executed::bring_up`]); a
    /// victim that could not be released fails it and the target is not brought up.
    pub operator: bool,
}

/// What [`Lifecycle::execute`] did.
#[derive(Debug, Default)]
pub struct Executed {
    /// The instances released, and how (for an operator's receipt); parked copies stopped to
    /// make room for a victim's copy come after it.
    pub released: Vec<Victim>,
    /// For an operator's switch ([`SwitchOrder::operator`]): the target's start or wake, which
    /// goes on after `execute` answered; resolves with its outcome. `None` otherwise.
    pub bring_up: Option<oneshot::Receiver<Result<(), ApiError>>>,
}

/// The lifecycle, as the router sees it. Implemented by the server's lifecycle (standalone and
/// Kubernetes) and, in tests, by a scripted fake.
pub trait Lifecycle: Send + Sync + 'static {
    /// The deployment a request's `model` names, or `None` (the router answers 404
    /// `model_not_found`).
    fn resolve(&self, model: &str) -> Option<DeploymentRef>;

    /// Whether the deployment may be started or woken by a request at all: `Err` with
    /// `deployment_stopped` (an operator stopped it) or `deployment_inactive` (explicit and not
    /// running or coming), answered at once with nothing queued.
    fn admissible(&self, deployment: &DeploymentId) -> Result<(), ApiError>;

    /// Plans bringing `deployment` up, for `who` (which decides whom it may name as victims).
    /// `protected` are the deployments that have waiting requests now: none of their
    /// instances may be chosen as a victim. An `Err` fails every request waiting for
    /// `deployment` with that error (or, for an operator, answers the operator's command).
    fn plan<'a>(
        &'a self,
        deployment: &'a DeploymentId,
        protected: &'a BTreeSet<DeploymentId>,
        who: PlanFor,
    ) -> BoxFuture<'a, Result<Plan, ApiError>>;

    /// Releases the victims (park, or stop where parking is impossible or a report says so),
    /// then wakes or starts the target. Resolves once the target has a ready instance (which
    /// the lifecycle also announces with `instance_ready`), or with the error that fails the
    /// waiting requests (e.g. `wake_mismatch`). An operator's order answers earlier (see
    /// [`SwitchOrder::operator`]).
    fn execute(&self, order: SwitchOrder) -> BoxFuture<'_, Result<Executed, ApiError>>;

    /// Gives back a plan the router will not carry out (the drain failed, or every waiting
    /// request went away before the switch began): its victims serve again.
    fn abandon(&self, switch_id: &str);

    /// A switch failed in the router before it reached the lifecycle (the drain timed out,
    /// `error`): `failed` is the order it would have executed (its victims, not released,
    /// its window and drain up to the failure); for metrics and the switch's record. Called
    /// just before [`Lifecycle::abandon`] gives its plan back.
    fn switch_failed(&self, failed: &SwitchOrder, error: &ApiError) {
        let _ = (failed, error);
    }

    /// The admission window of switch `switch_id` has closed now: its victims drain (for the
    /// switch's record while it runs; the order carries the exact times).
    fn switch_draining(&self, switch_id: &str) {
        let _ = switch_id;
    }

    /// Resolves once the instance's engine reports no running and no waiting requests, or
    /// `false` if that could not be read (the router then treats requests as cut before
    /// output).
    fn engine_idle<'a>(&'a self, instance: &'a InstanceKey) -> BoxFuture<'a, bool>;
}
