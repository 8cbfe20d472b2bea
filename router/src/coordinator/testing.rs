//! A scripted fake [`Lifecycle`] for tests: a GPU that fits `capacity` deployments, parks and
//! wakes with set delays (tokio time, so a paused clock makes them exact), and records every
//! call with its instant.
//!
//! Natural behaviour, unless a test scripts otherwise:
//! - `plan(d)`: `AlreadyComing` when `d` is ready or coming; `BringUp` while fewer than
//!   `capacity` deployments are loaded; otherwise `Switch` with every instance of the
//!   lowest-named loaded deployment that is not protected, not pinned and not reserved; else
//!   `Later`.
//! - `execute`: waits `park_delay` per switch with victims (they become parked, or stopped when
//!   a report says `cut_before_output`), then `wake_delay` (parked target) or `start_delay`
//!   (stopped target), then announces the target's instances with `instance_ready` and
//!   answers `Ok` (or the scripted error). An operator's order (`start --evict`) answers after
//!   the park, naming the victims released, and its bring-up goes on (`Executed::bring_up`).
//! - `engine_idle`: answers `engine_idle_answer` after `engine_idle_delay`.
//!
//! Call [`FakeLifecycle::attach`] with the coordinator's handle before the first request.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use capyctl_spec::api::{Released, Victim};
use capyctl_spec::errors::ApiError;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::config::RouterConfig;
use capyctl_interfaces::router::{
    BoxFuture, DeploymentId, DeploymentRef, Executed, InstanceKey, Lifecycle, Plan, PlanFor,
    SwitchOrder, Upstream,
};

use super::{Coordinator, CoordinatorHandle};

/// Where a fake deployment stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FakeState {
    /// Not running; a start takes `start_delay`.
    Stopped,
    /// Parked; a wake takes `wake_delay`.
    Parked,
    /// Starting or waking (by an `execute` or [`FakeLifecycle::set_state`]).
    Coming,
    /// Loaded and serving.
    Ready,
}

/// One call the router made, as recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    /// `admissible(deployment)`.
    Admissible(DeploymentId),
    /// `plan(deployment, protected, who)`.
    Plan {
        /// The deployment to bring up.
        deployment: DeploymentId,
        /// The deployments with waiting requests.
        protected: BTreeSet<DeploymentId>,
        /// Whom it plans for.
        who: PlanFor,
    },
    /// What `plan` answered (recorded just after its `Plan` call; plans are asked one at a
    /// time).
    Planned(DeploymentId, Result<Plan, ApiError>),
    /// `execute(order)`.
    Execute(SwitchOrder),
    /// `abandon(switch_id)`.
    Abandon(String),
    /// `switch_failed(switch_id, error, window, drain)`.
    SwitchFailed(String, ApiError, Duration, Duration),
    /// `engine_idle(instance)`.
    EngineIdle(InstanceKey),
}

/// The fake's timings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FakeTimings {
    /// How many deployments fit on the GPU at once.
    pub capacity: usize,
    /// How long parking the victims takes.
    pub park_delay: Duration,
    /// How long a wake takes.
    pub wake_delay: Duration,
    /// How long a start takes.
    pub start_delay: Duration,
    /// How long `engine_idle` takes to answer.
    pub engine_idle_delay: Duration,
}

impl Default for FakeTimings {
    /// One deployment fits; park 1 s, wake 3 s, start 10 s, engine idle 500 ms.
    fn default() -> Self {
        FakeTimings {
            capacity: 1,
            park_delay: Duration::from_secs(1),
            wake_delay: Duration::from_secs(3),
            start_delay: Duration::from_secs(10),
            engine_idle_delay: Duration::from_millis(500),
        }
    }
}

#[derive(Debug)]
struct FakeDeployment {
    name: String,
    state: FakeState,
    instances: u32,
    generation: u64,
    /// `admissible` answers this error (an operator stop, explicit activation).
    refusal: Option<ApiError>,
    /// Never chosen as a victim (explicit).
    pinned: bool,
    /// Its `routing:` (`resolve` says it).
    routing: capyctl_spec::Routing,
    /// Its `priority` (`resolve` says it).
    priority: i32,
}

#[derive(Debug, Default)]
struct Inner {
    deployments: BTreeMap<DeploymentId, FakeDeployment>,
    calls: Vec<(Instant, Call)>,
    scripted_plans: BTreeMap<DeploymentId, VecDeque<Result<Plan, ApiError>>>,
    execute_errors: BTreeMap<DeploymentId, ApiError>,
    /// Victims reserved by a plan, per switch ID.
    reserved: BTreeMap<String, Vec<InstanceKey>>,
    engine_idle_answer: bool,
    next_switch: u64,
    /// The admission window natural `Switch` plans carry (the host's).
    plan_window: Option<Duration>,
    /// `plan` never answers (a hung lifecycle).
    hang_plans: bool,
    /// `execute` never answers, or panics.
    execute_fault: Option<ExecuteFault>,
}

/// How a scripted `execute` misbehaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExecuteFault {
    /// It never answers.
    Hang,
    /// It panics.
    Panic,
}

/// The scripted fake lifecycle.
#[derive(Debug)]
pub struct FakeLifecycle {
    timings: FakeTimings,
    inner: Mutex<Inner>,
    handle: OnceLock<CoordinatorHandle>,
}

impl FakeLifecycle {
    /// A fake GPU with these timings and no deployments.
    pub fn new(timings: FakeTimings) -> Arc<Self> {
        Arc::new(FakeLifecycle {
            timings,
            inner: Mutex::new(Inner {
                engine_idle_answer: true,
                ..Inner::default()
            }),
            handle: OnceLock::new(),
        })
    }

    /// Starts a coordinator on this fake and attaches its handle.
    pub fn spawn(self: &Arc<Self>, config: RouterConfig) -> CoordinatorHandle {
        let handle = Coordinator::spawn(self.clone(), config);
        self.attach(handle.clone());
        handle
    }

    /// Gives the fake the coordinator's handle (for `instance_ready`).
    pub fn attach(&self, handle: CoordinatorHandle) {
        let _ = self.handle.set(handle);
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn record(&self, call: Call) {
        self.lock().calls.push((Instant::now(), call));
    }

    /// Adds a deployment with `instances` instances; `id` doubles as its name's suffix.
    pub fn add(&self, id: &str, name: &str, state: FakeState, instances: u32) -> DeploymentRef {
        self.lock().deployments.insert(
            id.to_string(),
            FakeDeployment {
                name: name.to_string(),
                state,
                instances,
                generation: 1,
                refusal: None,
                pinned: false,
                routing: capyctl_spec::Routing::LeastLoaded,
                priority: 0,
            },
        );
        DeploymentRef {
            id: id.to_string(),
            name: name.to_string(),
            routing: capyctl_spec::Routing::LeastLoaded,
            priority: 0,
        }
    }

    /// Sets a deployment's `priority`; its reference as `resolve` now answers it.
    pub fn set_priority(&self, id: &str, priority: i32) -> DeploymentRef {
        let mut inner = self.lock();
        let d = inner
            .deployments
            .get_mut(id)
            .expect("set_priority: add the deployment first");
        d.priority = priority;
        DeploymentRef {
            id: id.to_string(),
            name: d.name.clone(),
            routing: d.routing,
            priority,
        }
    }

    /// Sets a deployment's `routing:`; its reference as `resolve` now answers it.
    pub fn set_routing(&self, id: &str, routing: capyctl_spec::Routing) -> DeploymentRef {
        let mut inner = self.lock();
        let d = inner
            .deployments
            .get_mut(id)
            .expect("set_routing: add the deployment first");
        d.routing = routing;
        DeploymentRef {
            id: id.to_string(),
            name: d.name.clone(),
            routing,
            priority: d.priority,
        }
    }

    /// The key of a deployment's instance `index` (current generation).
    pub fn key(&self, id: &str, index: u32) -> InstanceKey {
        let generation = self.lock().deployments.get(id).map_or(1, |d| d.generation);
        InstanceKey {
            deployment: id.to_string(),
            index,
            host_id: "gpu-box".to_string(),
            generation,
        }
    }

    /// The upstream of a deployment's instance `index`.
    pub fn upstream(&self, id: &str, index: u32) -> Upstream {
        let key = self.key(id, index);
        let port = 9000 + u16::try_from(index).unwrap_or(0);
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        Upstream { key, addr }
    }

    /// Announces every instance of a ready deployment to the coordinator.
    pub async fn announce(&self, id: &str) {
        let n = self.lock().deployments.get(id).map_or(0, |d| d.instances);
        if let Some(h) = self.handle.get() {
            for i in 0..n {
                h.instance_ready(self.upstream(id, i)).await;
            }
        }
    }

    /// Deletes a deployment: `admissible` then answers `not_found` for it.
    pub fn remove(&self, id: &str) {
        self.lock().deployments.remove(id);
    }

    /// Sets a deployment's state (e.g. `Coming` for an operator's start).
    pub fn set_state(&self, id: &str, state: FakeState) {
        if let Some(d) = self.lock().deployments.get_mut(id) {
            d.state = state;
        }
    }

    /// A deployment's state.
    pub fn state(&self, id: &str) -> Option<FakeState> {
        self.lock().deployments.get(id).map(|d| d.state)
    }

    /// Makes `admissible` answer `refusal` for the deployment (`None`: admissible again).
    pub fn set_refusal(&self, id: &str, refusal: Option<ApiError>) {
        if let Some(d) = self.lock().deployments.get_mut(id) {
            d.refusal = refusal;
        }
    }

    /// Marks a deployment as never a victim (explicit activation).
    pub fn pin(&self, id: &str) {
        if let Some(d) = self.lock().deployments.get_mut(id) {
            d.pinned = true;
        }
    }

    /// The next `plan` for `id` answers `result` instead of the natural plan (queued, in order).
    pub fn script_plan(&self, id: &str, result: Result<Plan, ApiError>) {
        self.lock()
            .scripted_plans
            .entry(id.to_string())
            .or_default()
            .push_back(result);
    }

    /// The next `execute` for `id` as target fails with `error` (after the park).
    pub fn fail_execute(&self, id: &str, error: ApiError) {
        self.lock().execute_errors.insert(id.to_string(), error);
    }

    /// The admission window that natural `Switch` plans carry from now on (the host's; `None`:
    /// the router's own).
    pub fn set_plan_window(&self, window: Option<Duration>) {
        self.lock().plan_window = window;
    }

    /// Every `plan` from now on hangs (never answers).
    pub fn hang_plans(&self) {
        self.lock().hang_plans = true;
    }

    /// The next `execute` misbehaves this way (after recording the call).
    pub fn fault_execute(&self, fault: ExecuteFault) {
        self.lock().execute_fault = Some(fault);
    }

    /// What `engine_idle` answers from now on.
    pub fn set_engine_idle(&self, answer: bool) {
        self.lock().engine_idle_answer = answer;
    }

    /// Every call so far, with its instant.
    pub fn calls(&self) -> Vec<(Instant, Call)> {
        self.lock().calls.clone()
    }

    /// The recorded plans: `(instant, deployment, protected)`.
    pub fn plans(&self) -> Vec<(Instant, DeploymentId, BTreeSet<DeploymentId>)> {
        self.plans_for(|_| true)
    }

    /// The recorded plans for operators' switches: `(instant, deployment, protected)`.
    pub fn operator_plans(&self) -> Vec<(Instant, DeploymentId, BTreeSet<DeploymentId>)> {
        self.plans_for(|who| who == PlanFor::Operator)
    }

    /// The recorded plans that were not answered `Later` (a switch, a bring-up, an error, or
    /// `AlreadyComing`): `(instant, deployment, protected)`.
    pub fn plans_not_later(&self) -> Vec<(Instant, DeploymentId, BTreeSet<DeploymentId>)> {
        let mut out = Vec::new();
        let mut asked = None;
        for (t, c) in self.calls() {
            match c {
                Call::Plan {
                    deployment,
                    protected,
                    ..
                } => asked = Some((t, deployment, protected)),
                Call::Planned(_, answer) => {
                    if let Some(p) = asked.take()
                        && !matches!(answer, Ok(Plan::Later))
                    {
                        out.push(p);
                    }
                }
                _ => {}
            }
        }
        out
    }

    /// The recorded plans answered `Later`: `(instant, deployment)`.
    pub fn later_plans(&self) -> Vec<(Instant, DeploymentId)> {
        self.calls()
            .into_iter()
            .filter_map(|(t, c)| match c {
                Call::Planned(d, Ok(Plan::Later)) => Some((t, d)),
                _ => None,
            })
            .collect()
    }

    fn plans_for(
        &self,
        wanted: impl Fn(PlanFor) -> bool,
    ) -> Vec<(Instant, DeploymentId, BTreeSet<DeploymentId>)> {
        self.calls()
            .into_iter()
            .filter_map(|(t, c)| match c {
                Call::Plan {
                    deployment,
                    protected,
                    who,
                } if wanted(who) => Some((t, deployment, protected)),
                _ => None,
            })
            .collect()
    }

    /// The recorded executes: `(instant, order)`.
    pub fn executes(&self) -> Vec<(Instant, SwitchOrder)> {
        self.calls()
            .into_iter()
            .filter_map(|(t, c)| match c {
                Call::Execute(o) => Some((t, o)),
                _ => None,
            })
            .collect()
    }

    /// The recorded failed switches: `(instant, error, window, drain)`.
    pub fn failed_switches(&self) -> Vec<(Instant, ApiError, Duration, Duration)> {
        self.calls()
            .into_iter()
            .filter_map(|(t, c)| match c {
                Call::SwitchFailed(_, e, w, d) => Some((t, e, w, d)),
                _ => None,
            })
            .collect()
    }

    /// The recorded abandons: `(instant, switch_id)`.
    pub fn abandons(&self) -> Vec<(Instant, String)> {
        self.calls()
            .into_iter()
            .filter_map(|(t, c)| match c {
                Call::Abandon(s) => Some((t, s)),
                _ => None,
            })
            .collect()
    }

    /// The recorded `engine_idle` calls: `(instant, instance)`.
    pub fn engine_idles(&self) -> Vec<(Instant, InstanceKey)> {
        self.calls()
            .into_iter()
            .filter_map(|(t, c)| match c {
                Call::EngineIdle(k) => Some((t, k)),
                _ => None,
            })
            .collect()
    }

    fn natural_plan(&self, inner: &mut Inner, d: &str, protected: &BTreeSet<DeploymentId>) -> Plan {
        let Some(dep) = inner.deployments.get(d) else {
            return Plan::Later;
        };
        if matches!(dep.state, FakeState::Ready | FakeState::Coming) {
            return Plan::AlreadyComing;
        }
        let reserved: BTreeSet<&InstanceKey> = inner.reserved.values().flatten().collect();
        let loaded = inner
            .deployments
            .values()
            .filter(|x| matches!(x.state, FakeState::Ready | FakeState::Coming))
            .count();
        inner.next_switch += 1;
        let switch_id = format!("sw-{}", inner.next_switch);
        if loaded < self.timings.capacity {
            inner.reserved.insert(switch_id.clone(), Vec::new());
            return Plan::BringUp { switch_id };
        }
        let victim = inner.deployments.iter().find(|(id, x)| {
            x.state == FakeState::Ready
                && !x.pinned
                && !protected.contains(*id)
                && (0..x.instances).all(|i| {
                    !reserved.contains(&InstanceKey {
                        deployment: (*id).clone(),
                        index: i,
                        host_id: "gpu-box".into(),
                        generation: x.generation,
                    })
                })
        });
        match victim {
            None => Plan::Later,
            Some((id, x)) => {
                let victims: Vec<InstanceKey> = (0..x.instances)
                    .map(|i| InstanceKey {
                        deployment: id.clone(),
                        index: i,
                        host_id: "gpu-box".into(),
                        generation: x.generation,
                    })
                    .collect();
                inner.reserved.insert(switch_id.clone(), victims.clone());
                Plan::Switch {
                    switch_id,
                    victims,
                    window: inner.plan_window,
                }
            }
        }
    }
}

impl Lifecycle for FakeLifecycle {
    fn resolve(&self, model: &str) -> Option<DeploymentRef> {
        self.lock()
            .deployments
            .iter()
            .find(|(_, d)| d.name == model)
            .map(|(id, d)| DeploymentRef {
                id: id.clone(),
                name: d.name.clone(),
                routing: d.routing,
                priority: d.priority,
            })
    }

    fn admissible(&self, deployment: &DeploymentId) -> Result<(), ApiError> {
        self.record(Call::Admissible(deployment.clone()));
        match self.lock().deployments.get(deployment) {
            Some(d) => d.refusal.clone().map_or(Ok(()), Err),
            None => Err(ApiError::NotFound {
                what: format!("deployment {deployment}"),
            }),
        }
    }

    fn plan<'a>(
        &'a self,
        deployment: &'a DeploymentId,
        protected: &'a BTreeSet<DeploymentId>,
        who: PlanFor,
    ) -> BoxFuture<'a, Result<Plan, ApiError>> {
        Box::pin(async move {
            self.record(Call::Plan {
                deployment: deployment.clone(),
                protected: protected.clone(),
                who,
            });
            if self.lock().hang_plans {
                std::future::pending::<()>().await;
            }
            let answer = {
                let mut inner = self.lock();
                if let Some(r) = inner
                    .scripted_plans
                    .get_mut(deployment)
                    .and_then(|q| q.pop_front())
                {
                    if let Ok(Plan::Switch {
                        switch_id, victims, ..
                    }) = &r
                    {
                        inner.reserved.insert(switch_id.clone(), victims.clone());
                    }
                    r
                } else {
                    Ok(self.natural_plan(&mut inner, deployment, protected))
                }
            };
            self.record(Call::Planned(deployment.clone(), answer.clone()));
            answer
        })
    }

    fn execute(&self, order: SwitchOrder) -> BoxFuture<'_, Result<Executed, ApiError>> {
        Box::pin(async move {
            self.record(Call::Execute(order.clone()));
            let fault = self.lock().execute_fault.take();
            match fault {
                Some(ExecuteFault::Hang) => std::future::pending::<()>().await,
                Some(ExecuteFault::Panic) => panic!("scripted: execute panics"),
                None => {}
            }
            let from = {
                let mut inner = self.lock();
                let from = inner
                    .deployments
                    .get(&order.target)
                    .map_or(FakeState::Stopped, |d| d.state);
                if let Some(d) = inner.deployments.get_mut(&order.target) {
                    d.state = FakeState::Coming;
                }
                from
            };
            let mut released = Vec::new();
            if !order.victims.is_empty() {
                tokio::time::sleep(self.timings.park_delay).await;
                let mut inner = self.lock();
                for (k, report) in &order.victims {
                    if let Some(d) = inner.deployments.get_mut(&k.deployment) {
                        let (state, how) = if report.cut_before_output {
                            (FakeState::Stopped, Released::Stopped)
                        } else {
                            (FakeState::Parked, Released::Parked)
                        };
                        d.state = state;
                        released.push(Victim {
                            deployment_id: k.deployment.clone(),
                            name: d.name.clone(),
                            instance_id: format!("{}-{}", k.deployment, k.index),
                            released: how,
                        });
                    }
                }
            }
            if order.operator {
                // An operator's order answers now; its bring-up goes on.
                let failed = self.lock().execute_errors.remove(&order.target);
                if let Some(e) = failed {
                    self.lock().reserved.remove(&order.switch_id);
                    return Err(e);
                }
                let (tx, rx) = oneshot::channel();
                let me = self.handle.get().cloned();
                let delay = match from {
                    FakeState::Stopped => self.timings.start_delay,
                    _ => self.timings.wake_delay,
                };
                let n = {
                    let mut inner = self.lock();
                    inner.reserved.remove(&order.switch_id);
                    // NB: counted as loaded from now on (a victim of a later plan once ready).
                    let d = inner.deployments.get_mut(&order.target);
                    d.map_or(0, |d| {
                        d.state = FakeState::Ready;
                        d.instances
                    })
                };
                let up: Vec<Upstream> = (0..n).map(|i| self.upstream(&order.target, i)).collect();
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    if let Some(h) = me {
                        for u in up {
                            h.instance_ready(u).await;
                        }
                    }
                    let _ = tx.send(Ok(()));
                });
                return Ok(Executed {
                    released,
                    bring_up: Some(rx),
                });
            }
            tokio::time::sleep(match from {
                FakeState::Stopped => self.timings.start_delay,
                _ => self.timings.wake_delay,
            })
            .await;
            let failed = {
                let mut inner = self.lock();
                inner.reserved.remove(&order.switch_id);
                let failed = inner.execute_errors.remove(&order.target);
                if let Some(d) = inner.deployments.get_mut(&order.target) {
                    d.state = if failed.is_some() {
                        FakeState::Stopped
                    } else {
                        FakeState::Ready
                    };
                }
                failed
            };
            if let Some(e) = failed {
                return Err(e);
            }
            self.announce(&order.target).await;
            Ok(Executed {
                released,
                bring_up: None,
            })
        })
    }

    fn abandon(&self, switch_id: &str) {
        self.record(Call::Abandon(switch_id.to_string()));
        self.lock().reserved.remove(switch_id);
    }

    fn switch_failed(&self, failed: &SwitchOrder, error: &ApiError) {
        self.record(Call::SwitchFailed(
            failed.switch_id.clone(),
            error.clone(),
            failed.window,
            failed.drain,
        ));
    }

    fn engine_idle<'a>(&'a self, instance: &'a InstanceKey) -> BoxFuture<'a, bool> {
        Box::pin(async move {
            self.record(Call::EngineIdle(instance.clone()));
            tokio::time::sleep(self.timings.engine_idle_delay).await;
            self.lock().engine_idle_answer
        })
    }
}

/// A lifecycle of one deployment whose instances are all ready from the start (the caller
/// announces them with `instance_ready`): `resolve` names it with its `routing`, a plan answers
/// `AlreadyComing`, and nothing is ever parked or started. For the tests and the benchmark of
/// routing among instances (`tests/replicas_engine_sim.rs`, `benches/proxy/replicas.rs`).
#[derive(Debug, Clone)]
pub struct AllReady {
    /// The deployment's ID.
    pub id: DeploymentId,
    /// Its name (requests' `model`).
    pub name: String,
    /// Its `routing:`.
    pub routing: capyctl_spec::Routing,
}

impl Lifecycle for AllReady {
    fn resolve(&self, model: &str) -> Option<DeploymentRef> {
        (model == self.name).then(|| DeploymentRef {
            id: self.id.clone(),
            name: self.name.clone(),
            routing: self.routing,
            priority: 0,
        })
    }

    fn admissible(&self, _deployment: &DeploymentId) -> Result<(), ApiError> {
        Ok(())
    }

    fn plan<'a>(
        &'a self,
        _deployment: &'a DeploymentId,
        _protected: &'a BTreeSet<DeploymentId>,
        _who: PlanFor,
    ) -> BoxFuture<'a, Result<Plan, ApiError>> {
        Box::pin(async { Ok(Plan::AlreadyComing) })
    }

    fn execute(&self, _order: SwitchOrder) -> BoxFuture<'_, Result<Executed, ApiError>> {
        Box::pin(async { Ok(Executed::default()) })
    }

    fn abandon(&self, _switch_id: &str) {}

    fn engine_idle<'a>(&'a self, _instance: &'a InstanceKey) -> BoxFuture<'a, bool> {
        Box::pin(async { true })
    }
}
