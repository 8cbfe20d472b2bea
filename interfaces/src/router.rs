//! The router and the lifecycle, as each sees the other: what the router needs from the
//! lifecycle ([`Lifecycle`]; moved here from `router/src/lifecycle.rs`, a name that was another
//! crate's), what the lifecycle tells and asks of the router ([`Router`]) and reads of it
//! ([`DeploymentLoad`], [`LastUses`]), the listener's catalog ([`ModelEntry`]) and what it tells
//! of each request ([`RequestObserver`]).
//!
//! The router never talks to an engine's control API. It asks the lifecycle, through
//! [`Lifecycle`], which deployment a model name means, whether and how that deployment can be
//! made servable, and to carry out a switch (park or stop the victims, wake or start the
//! waiting deployment). The lifecycle in turn tells the router, through [`Router`] (the
//! coordinator's handle, given to it by the assembly), when instances open for traffic and when
//! they go away.
//!
//! NB: the lifecycle owns instance state; the router owns queues and in-flight counts. A plan
//! the lifecycle hands out reserves its victims inside the lifecycle, so two plans never name
//! the same victim and an operator command cannot move a victim behind the router's back.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use capyctl_spec::api::Victim;
use capyctl_spec::errors::ApiError;
use serde::Serialize;
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
    /// Its `priority` (DESIGN 4.10; 0 when unset): of several deployments waiting for room,
    /// the higher priority's wave is planned first.
    pub priority: i32,
}

/// A LoRA adapter a request named (DESIGN 4.9), as the router loads it into its base's
/// instances: [`Lifecycle::resolve`] of its name answers the base, [`Lifecycle::adapter`] this.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterRoute {
    /// The adapter's own deployment ID.
    pub id: DeploymentId,
    /// Its name: what requests put in `model`, and the name it is loaded under.
    pub name: String,
    /// Its files (`adapter.path`), as the base's engine reads them.
    pub path: String,
    /// The base's deployment ID.
    pub base: DeploymentId,
    /// The base's `adapters.max_loaded`: adapters loaded at once per instance.
    pub max_loaded: u32,
    /// The field of a request's body that names the adapter to the base's engine, besides
    /// `model` (SGLang's `lora_path`: its OpenAI routes run a request whose `model` is a bare
    /// adapter name on the base); `None`: `model` alone does (vLLM). The engine rules say which
    /// (`capyctl_engine_rules::adapters::adapter_request_field`).
    pub request_field: Option<&'static str>,
}

impl AdapterRoute {
    /// A request's JSON body with the adapter named in [`AdapterRoute::request_field`]
    /// (replacing what the client put there); `None` when the engine needs no such field or
    /// the body is not a JSON object (the request goes as it came).
    #[must_use]
    pub fn name_in_body(&self, body: &[u8]) -> Option<Vec<u8>> {
        let field = self.request_field?;
        let mut request: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(body).ok()?;
        request.insert(field.into(), serde_json::Value::String(self.name.clone()));
        serde_json::to_vec(&request).ok()
    }
}

/// A request's use of a loaded adapter ([`Lifecycle::acquire_adapter`]): dropping it ends the
/// use (the least recently used adapter with no use may then be unloaded for another).
pub type AdapterLease = Box<dyn std::any::Any + Send + Sync>;

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

    /// The adapter `model` names (DESIGN 4.9), `None` for a model (or no deployment):
    /// [`Lifecycle::resolve`] of an adapter's name answers its base, which requests for it make
    /// servable. A lifecycle without adapters keeps the default.
    fn adapter(&self, model: &str) -> Option<AdapterRoute> {
        let _ = model;
        None
    }

    /// Waits until `adapter` is loaded into ready instance `instance` of its base and counts
    /// the request as running on it (loading it there, one load at a time per instance, and
    /// unloading the least recently used idle adapter for room), or fails with
    /// `adapter_load_failed` (the engine's reason), `queue_full` or the queue deadline's
    /// error at `deadline`. The request holds the lease until it ends.
    fn acquire_adapter<'a>(
        &'a self,
        instance: &'a InstanceKey,
        adapter: &'a AdapterRoute,
        deadline: Instant,
    ) -> BoxFuture<'a, Result<AdapterLease, ApiError>> {
        let _ = (instance, deadline);
        Box::pin(async move {
            Err(ApiError::AdapterLoadFailed {
                adapter: adapter.name.clone(),
                reason: "this server loads no adapters".into(),
            })
        })
    }

    /// The instances of its base that have adapter `adapter` loaded, as far as known (a
    /// request for it prefers them: DESIGN 4.9). A lifecycle without adapters keeps the
    /// default (none).
    fn adapter_loaded_on(&self, adapter: &str) -> Vec<InstanceKey> {
        let _ = adapter;
        Vec::new()
    }

    /// The engine of `instance` answered a request for `adapter` as if it did not have it
    /// (vLLM's 404 for an unknown model, SGLang's 400 or stream error naming it): the next
    /// request loads it again.
    fn adapter_lost(&self, instance: &InstanceKey, adapter: &str) {
        let _ = (instance, adapter);
    }
}

/// One line of `GET /v1/models`: a deployment the inference listener serves, as the lifecycle
/// lists it (the listener's catalog).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModelEntry {
    /// The name requests put in `model`.
    pub id: String,
    /// The deployment's ID.
    pub deployment_id: String,
    /// Its state as `capyctl list deployments` shows it (`ready`, `parked`, `stopped`, ...).
    pub state: String,
}

/// One finished request, as the inference listener tells its observer (metrics, logs) once,
/// when it ends.
///
/// NB (when a request "ends"): an error answer ends when it is rendered; an answer forwarded
/// from an engine ends when the engine's answer is over or the request is cut (its permit is
/// released then); a client that hangs up before any answer ends its request at that moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestEvent {
    /// The deployment its `model` named; `None` if it never got that far (bad body, unknown
    /// model, another route).
    pub deployment_id: Option<String>,
    /// The body's `model`; `None` if it had none (or the route takes no body).
    pub model: Option<String>,
    /// The status sent to the client, or 499 (nginx's) if the client hung up before any was
    /// sent.
    pub status: u16,
    /// Why it ended abnormally: a catalogue error's code (`ApiError::code`), or one of the
    /// listener's own codes (`client_gone`, `read_stall`, ...); `None` for an answer that
    /// ended normally (whatever the engine's status).
    pub code: Option<&'static str>,
    /// How long it waited for its admission (queue, switch and the in-flight bound); zero if it
    /// never asked for one.
    pub waited: Duration,
    /// From its admission (its dispatch to the engine) to its end; zero if it was never
    /// admitted.
    pub served: Duration,
    /// Whether the answer was a stream (`text/event-stream`).
    pub streamed: bool,
}

/// Told about every request exactly once, when it ends. Called from the request's own task
/// (or from the body's `Drop`): keep it short and never block.
pub trait RequestObserver: Send + Sync + 'static {
    /// One request ended.
    fn finished(&self, event: &RequestEvent);
}

/// What a release the lifecycle starts answers ([`Router::release`]): the drained instances
/// with how their requests ended, or `DrainTimeout` (they serve again).
pub type ReleaseResult = Result<Vec<(InstanceKey, DrainReport)>, ApiError>;

/// What an operator's switch answers ([`Router::operator_start`]): how it went, or the error
/// of its plan, its drain (`DrainTimeout`: the victims serve again) or its execute.
pub type OperatorResult = Result<OperatorStart, ApiError>;

/// How an operator's switch (`start --evict`) went.
#[derive(Debug)]
pub enum OperatorStart {
    /// The plan was carried out: the victims (if any) drained and released, the target's start
    /// or wake begun (see [`SwitchOrder::operator`]).
    Switched {
        /// The switch's ID (from the plan).
        switch_id: String,
        /// What the lifecycle's execute did.
        executed: Executed,
    },
    /// Nothing can be released for it now (the plan said `Later`): the operator's start waits
    /// for memory.
    Later,
    /// It is ready, or already starting or waking.
    AlreadyComing,
}

/// What [`Router::release_if_idle`] answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdleRelease {
    /// Not idle (a request waits or runs, or one started or ended after the instant, or a
    /// switch or release names it): nothing changed, it serves on.
    InUse,
    /// Idle: released as [`Router::release`] releases (closed, drained, forgotten), with its
    /// answer.
    Released(ReleaseResult),
}

/// The router's live load of one deployment (the `router` half of the load read).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeploymentLoad {
    /// The deployment's ID.
    pub deployment_id: DeploymentId,
    /// Requests the router is forwarding to it now.
    pub in_flight: usize,
    /// The bound on `in_flight`: 32 per open instance (the router's `in_flight_per_instance`
    /// × open instances; 32 while none is open).
    pub in_flight_limit: usize,
    /// Requests waiting in the router for it (to load, or for one of the in-flight slots).
    pub waiting: usize,
    /// The waiting limit per deployment (`max_pending_per_deployment`; 0 is no waiting).
    pub waiting_limit: usize,
    /// Its instances the router routes to (open) or drains (closed).
    pub instances: Vec<InstanceLoad>,
    /// When one of its requests last started or ended (`None`: none since the router has known
    /// it): the one record of its last use, which the lifecycle's idle timers and
    /// least-recently-used choice read (see [`Router::last_uses`]).
    pub last_used: Option<Instant>,
}

/// The router's live load of one instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceLoad {
    /// Which instance.
    pub key: InstanceKey,
    /// Requests the router is forwarding to it now (`router_in_flight`).
    pub router_in_flight: usize,
    /// Whether it takes new requests (`false` while it drains before a park or stop).
    pub open: bool,
}

impl DeploymentLoad {
    /// Its figures as a reader of every deployment copies them ([`LoadsInOrder::get`]).
    pub fn figures(&self) -> LoadFigures {
        LoadFigures {
            in_flight: self.in_flight,
            in_flight_limit: self.in_flight_limit,
            waiting: self.waiting,
            waiting_limit: self.waiting_limit,
            instances: self
                .instances
                .iter()
                .map(|i| InstanceFigures {
                    index: i.key.index,
                    generation: i.key.generation,
                    router_in_flight: i.router_in_flight,
                    open: i.open,
                })
                .collect(),
        }
    }
}

/// The figures of one deployment's load that the load read shows ([`DeploymentLoad`]'s, less
/// the IDs and the last use), as [`LoadsInOrder::get`] copies them: into one record the reader
/// keeps and fills again for each deployment, so that a read of every deployment allocates
/// nothing per deployment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadFigures {
    /// [`DeploymentLoad::in_flight`].
    pub in_flight: usize,
    /// [`DeploymentLoad::in_flight_limit`].
    pub in_flight_limit: usize,
    /// [`DeploymentLoad::waiting`].
    pub waiting: usize,
    /// [`DeploymentLoad::waiting_limit`].
    pub waiting_limit: usize,
    /// [`DeploymentLoad::instances`]: each one's index, generation and count.
    pub instances: Vec<InstanceFigures>,
}

impl LoadFigures {
    /// The requests the router forwards to instance `index` of generation `generation` (`None`
    /// when it knows no such instance).
    pub fn router_in_flight(&self, index: u32, generation: u64) -> Option<usize> {
        self.instances
            .iter()
            .find(|i| i.index == index && i.generation == generation)
            .map(|i| i.router_in_flight)
    }
}

/// [`InstanceLoad`]'s figures, its key's index and generation (see [`LoadFigures`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InstanceFigures {
    /// [`InstanceKey::index`].
    pub index: u32,
    /// [`InstanceKey::generation`].
    pub generation: u64,
    /// [`InstanceLoad::router_in_flight`].
    pub router_in_flight: usize,
    /// [`InstanceLoad::open`].
    pub open: bool,
}

/// Reads each deployment's last use as the router recorded it, without keeping the router
/// alive ([`Router::last_uses`]).
pub trait LastUses: std::fmt::Debug + Send + Sync + 'static {
    /// When a request of `deployment` last started or ended: `None` when none did while the
    /// router knew it (and once the router has stopped).
    fn of(&self, deployment: &str) -> Option<Instant>;

    /// Requests the router forwards to instance `index` of `deployment` now, as last
    /// published (0 when it knows none): which of a deployment's instances is in use.
    fn in_flight_of(&self, deployment: &str, index: u32) -> usize;
}

/// The router's published loads of every deployment, looked up in ascending order of
/// deployment ID ([`Router::loads_in_order`]).
pub trait LoadsInOrder: Send {
    /// The figures of `deployment`'s load now (as [`Router::figures_of`]'s), copied into the
    /// reader's own record (filled again by the next call); `None` when the router did not know
    /// it when the reader was made. Asked in ascending order of ID, each look-up moves on from
    /// the last (a merge: one pass over the router's deployments for them all).
    fn get(&mut self, deployment: &str) -> Option<&LoadFigures>;
}

/// The router, as the lifecycle sees it: what the lifecycle tells it of instances and
/// deployments, the releases it asks of it, and the load it reads. Implemented by the router's
/// coordinator handle; the assembly (`capyctl_server::assembly`) builds the router and gives it
/// to the lifecycle. None of the reads takes a turn of the router's task.
pub trait Router: Send + Sync + 'static {
    /// An instance opened for traffic: its deployment's waiting requests are released (up to
    /// the in-flight bound).
    fn instance_ready(&self, upstream: Upstream) -> BoxFuture<'_, ()>;

    /// An instance went away (parked, stopped, crashed).
    fn instance_gone(&self, key: InstanceKey) -> BoxFuture<'_, ()>;

    /// Fails every request waiting for `deployment` with `error` (e.g. an operator stop), and
    /// gives up a switch to it that has not begun executing.
    fn deployment_refused(&self, deployment: DeploymentId, error: ApiError) -> BoxFuture<'_, ()>;

    /// Something the lifecycle decides by changed without an instance coming or going: every
    /// deployment waiting is planned again.
    fn replan(&self) -> BoxFuture<'_, ()>;

    /// The lifecycle deleted `deployment`: its waiting requests fail, a switch to it that has
    /// not begun executing is given up, and the router forgets it.
    fn forget(&self, deployment: DeploymentId) -> BoxFuture<'_, ()>;

    /// A release the lifecycle starts (operator park or stop, delete): closes `victims` to new
    /// requests, drains them within the drain timeout, forgets them and answers their
    /// reports; on a drain timeout they serve again (`DrainTimeout`).
    fn release(&self, victims: Vec<InstanceKey>) -> BoxFuture<'_, ReleaseResult>;

    /// An operator's `start --evict` of `deployment`: a switch planned with
    /// [`PlanFor::Operator`], drained and executed as a wave's is.
    fn operator_start(&self, deployment: DeploymentId) -> BoxFuture<'_, OperatorResult>;

    /// For idle timers: releases `deployment` (its instances `victims`) as
    /// [`Router::release`] does, but only if the router finds it idle: nothing waits or runs,
    /// none of its requests started or ended after `idle_since`, no switch or release names
    /// it; else [`IdleRelease::InUse`].
    fn release_if_idle(
        &self,
        deployment: DeploymentId,
        victims: Vec<InstanceKey>,
        idle_since: Instant,
    ) -> BoxFuture<'_, IdleRelease>;

    /// Instance `key`'s engine was sampled at `at`: `waiting` requests wait there (advice for
    /// least-loaded routing). Never waits; `false` when the sample was dropped.
    fn note_engine_load(&self, key: InstanceKey, waiting: usize, at: Instant) -> bool;

    /// Every deployment the router knows, its ID and the figures of its load now (as
    /// [`Router::figures_of`]'s), in ID order, handed to `each`: for a reader of them all that
    /// keeps none, with nothing allocated per deployment.
    fn each_load(&self, each: &mut dyn FnMut(&str, &LoadFigures));

    /// The figures of the router half of the load read of one deployment (as
    /// [`LoadsInOrder::get`] copies them); `None` when the router does not know it.
    fn figures_of(&self, deployment: &str) -> Option<LoadFigures>;

    /// [`Router::figures_of`] of every deployment, for a read that asks in ascending order of
    /// ID.
    fn loads_in_order(&self) -> Box<dyn LoadsInOrder>;

    /// A reader of each deployment's last use that does not keep the router alive.
    fn last_uses(&self) -> Arc<dyn LastUses>;
}

/// A shared reader is a reader (the lifecycle keeps the one [`Router::last_uses`] gives it).
impl<T: LastUses + ?Sized> LastUses for Arc<T> {
    fn of(&self, deployment: &str) -> Option<Instant> {
        (**self).of(deployment)
    }

    fn in_flight_of(&self, deployment: &str, index: u32) -> usize {
        (**self).in_flight_of(deployment, index)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::AdapterRoute;

    fn route(field: Option<&'static str>) -> AdapterRoute {
        AdapterRoute {
            id: "id".into(),
            name: "support-bot".into(),
            path: "/loras/support-bot".into(),
            base: "base".into(),
            max_loaded: 1,
            request_field: field,
        }
    }

    #[test]
    fn the_adapter_is_named_in_the_engines_field() {
        let body = br#"{"model":"support-bot","lora_path":"other","prompt":"hi"}"#;
        let named = route(Some("lora_path")).name_in_body(body).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&named).unwrap();
        assert_eq!(v["lora_path"], "support-bot", "the client's value replaced");
        assert_eq!(v["model"], "support-bot", "model as it came");
        assert_eq!(v["prompt"], "hi");
        // vLLM: the body goes as it came; so does one that is not a JSON object.
        assert_eq!(route(None).name_in_body(body), None);
        assert_eq!(route(Some("lora_path")).name_in_body(b"[1]"), None);
    }
}
