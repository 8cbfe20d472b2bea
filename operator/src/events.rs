//! What happens to deployments, fed to the reconciler, which tells it as Kubernetes Events
//! on their CRs (the issue: "Events for parks, wakes, switches, refusals and wake failures").
//!
//! The feed is an [`EventFeed`]: a bounded channel of [`Observed`] that never blocks its
//! senders (a full channel drops, and counts, what does not fit). Nothing in it is
//! Kubernetes: whoever sees a happening sends it. Today three places do, without the
//! lifecycle knowing:
//!
//! - [`ObservedLifecycle`] wraps the lifecycle as the router sees it: refusals of requests
//!   (`admissible` and `plan` errors: `deployment_inactive`, `deployment_stopped`,
//!   `parked_capacity`, `capability_missing:deep_park`, ...), and every switch: the views of
//!   its target and victims just before and after it runs, then `Switched` (or
//!   `SwitchFailed`; a wake failure shows in the target's view);
//! - [`ObservedApi`] wraps the management API (`capyctl` and `kubectl capyctl`): the views
//!   before and after each start, stop, park and preinitialize, the switch of a start's
//!   receipt, and the refusals of commands;
//! - the reconciler's status sync sends the views it reads after every change of the
//!   lifecycle's state (idle timers, engine exits).
//!
//! The reconciler ([`super::reconcile::Reconciler::run_events`]) compares each view with the
//! last one it told for the deployment ([`super::reconcile::happenings`]), so a park and a
//! wake in quick succession are each told as long as some view shows the parked state: a
//! request that wakes a model reads its view (parked) before the wake runs.
//!
//! NB: a park immediately followed by a wake with no view in between (an operator's park,
//! then, before the status sync's 50 ms debounce, an operator's start or a request) is still
//! told, because both paths read the view first. What is not seen is a state the lifecycle
//! passes through entirely inside one operation (a failed wake's `waking`); the lifecycle
//! could send [`Observed`] itself for those (see the report of this change).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use capyctl_interfaces::router::{
    BoxFuture as RouterFuture, DeploymentId, DeploymentRef, Executed, InstanceKey, Lifecycle, Plan,
    PlanFor, SwitchOrder,
};
use capyctl_spec::api::{
    ActionReceipt, DeployReceipt, DeploymentList, DeploymentView, EngineList, HostDrainReceipt,
    HostList, LoadReport, StartRequest,
};
use capyctl_spec::documents::DeploymentDoc;
use capyctl_spec::errors::ApiError;
use tokio::sync::mpsc;

use capyctl_lifecycle::api::{BoxFuture, JsonParts, ManagementApi};

/// How many happenings wait for the reconciler at most.
pub const FEED_CAPACITY: usize = 1024;

/// One happening, as the reconciler takes it.
#[derive(Debug, Clone, PartialEq)]
pub enum Observed {
    /// A deployment's view at one moment (compared with the last one told).
    View(Box<DeploymentView>),
    /// A switch released `victims` (their names) and brought `target` up.
    Switched {
        /// The switch's ID.
        switch_id: String,
        /// The deployment brought up (its name).
        target: String,
        /// Each victim's name and how it was released (`parked (host_ram)`, `stopped`, ...).
        victims: Vec<(String, String)>,
    },
    /// A switch failed (drain timeout, `parked_capacity`, an engine that did not start).
    SwitchFailed {
        /// The switch's ID.
        switch_id: String,
        /// The deployment it was for (its name).
        target: String,
        /// The error's code.
        code: &'static str,
        /// The error's message.
        message: String,
    },
    /// A request or a command was refused.
    Refused {
        /// The deployment (its name).
        deployment: String,
        /// `Request` or the command (`Start`, `Stop`, `Park`, `Preinitialize`).
        by: &'static str,
        /// The error's code.
        code: &'static str,
        /// The error's message.
        message: String,
    },
}

/// The sending side of the feed. Cheap to clone; never blocks.
#[derive(Debug, Clone)]
pub struct EventFeed {
    tx: mpsc::Sender<Observed>,
    dropped: Arc<AtomicU64>,
    /// Held while a view is read and sent, so the channel's order is the reads' order.
    order: Arc<Mutex<()>>,
}

impl EventFeed {
    /// A feed and its receiving end, holding at most `capacity` happenings.
    pub fn channel(capacity: usize) -> (Self, mpsc::Receiver<Observed>) {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        (
            Self {
                tx,
                dropped: Arc::new(AtomicU64::new(0)),
                order: Arc::new(Mutex::new(())),
            },
            rx,
        )
    }

    /// Sends `o`, or drops it when the channel is full (counted in [`Self::dropped`]).
    pub fn send(&self, o: Observed) {
        if self.tx.try_send(o).is_err() {
            let n = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
            if n.is_power_of_two() {
                tracing::warn!(
                    dropped = n,
                    "the Events feed is full; happenings were dropped"
                );
            }
        }
    }

    /// Reads the views of `keys` (names or IDs) and sends them, in read order with every other
    /// sender's views.
    pub fn views(&self, views: &dyn Views, keys: &[&str]) {
        let _order = self.order.lock().unwrap_or_else(PoisonError::into_inner);
        for key in keys {
            if let Some(v) = views.view(key) {
                self.send(Observed::View(Box::new(v)));
            }
        }
    }

    /// How many happenings did not fit.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// Reads a deployment's view now (by name or ID); the lifecycle's `Core::view`.
pub trait Views: Send + Sync {
    /// The view, if the deployment exists.
    fn view(&self, name_or_id: &str) -> Option<DeploymentView>;
}

impl Views for capyctl_lifecycle::Core {
    fn view(&self, name_or_id: &str) -> Option<DeploymentView> {
        capyctl_lifecycle::Core::view(self, name_or_id)
    }
}

/// How a victim was released, from its view after the switch.
fn released_words(v: Option<&DeploymentView>) -> String {
    let Some(i) = v.and_then(|v| v.instances.first()) else {
        return "released".to_string();
    };
    let no_room = capyctl_spec::api::Released::StoppedNoRoomToPark;
    match (i.state, i.parked_tier.as_deref()) {
        (capyctl_spec::InstanceState::Parked, Some(tier)) => format!("parked ({tier})"),
        (capyctl_spec::InstanceState::Stopped, _)
            if i.last_error.as_deref() == Some(no_room.status_line().as_str()) =>
        {
            no_room.words().to_string()
        }
        (state, _) => state.to_string(),
    }
}

/// The router's lifecycle, observed (see the module doc).
pub struct ObservedLifecycle {
    inner: Arc<dyn Lifecycle>,
    views: Arc<dyn Views>,
    feed: EventFeed,
    /// The target of each switch planned and not ended, by switch ID.
    targets: Mutex<HashMap<String, DeploymentId>>,
}

impl std::fmt::Debug for ObservedLifecycle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObservedLifecycle").finish_non_exhaustive()
    }
}

impl ObservedLifecycle {
    /// `inner`, observed into `feed`; `views` reads the deployments' views.
    pub fn new(inner: Arc<dyn Lifecycle>, views: Arc<dyn Views>, feed: EventFeed) -> Self {
        Self {
            inner,
            views,
            feed,
            targets: Mutex::new(HashMap::new()),
        }
    }

    fn name_of(&self, id: &str) -> String {
        self.views
            .view(id)
            .map(|v| v.name)
            .unwrap_or_else(|| id.to_string())
    }

    fn refused(&self, id: &str, e: &ApiError) {
        self.feed.send(Observed::Refused {
            deployment: self.name_of(id),
            by: "Request",
            code: e.code(),
            message: e.message(),
        });
    }

    fn targets(&self) -> std::sync::MutexGuard<'_, HashMap<String, DeploymentId>> {
        self.targets.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Lifecycle for ObservedLifecycle {
    fn resolve(&self, model: &str) -> Option<DeploymentRef> {
        self.inner.resolve(model)
    }

    fn admissible(&self, deployment: &DeploymentId) -> Result<(), ApiError> {
        let r = self.inner.admissible(deployment);
        if let Err(e) = &r {
            self.refused(deployment, e);
        }
        r
    }

    fn plan<'a>(
        &'a self,
        deployment: &'a DeploymentId,
        protected: &'a std::collections::BTreeSet<DeploymentId>,
        who: PlanFor,
    ) -> RouterFuture<'a, Result<Plan, ApiError>> {
        Box::pin(async move {
            let r = self.inner.plan(deployment, protected, who).await;
            // NB: an operator's switch (`start --evict`) is told by [`ObservedApi`], from the
            // command's receipt or refusal: not twice.
            if who == PlanFor::Operator {
                return r;
            }
            match &r {
                Err(e) => self.refused(deployment, e),
                Ok(Plan::BringUp { switch_id } | Plan::Switch { switch_id, .. }) => {
                    self.targets().insert(switch_id.clone(), deployment.clone());
                }
                Ok(_) => {}
            }
            r
        })
    }

    fn execute(&self, order: SwitchOrder) -> RouterFuture<'_, Result<Executed, ApiError>> {
        Box::pin(async move {
            if order.operator {
                // Told by [`ObservedApi`] (see `plan`).
                return self.inner.execute(order).await;
            }
            let switch_id = order.switch_id.clone();
            let target = order.target.clone();
            let victims: Vec<String> = order
                .victims
                .iter()
                .map(|(k, _)| k.deployment.clone())
                .collect();
            let keys: Vec<&str> = std::iter::once(target.as_str())
                .chain(victims.iter().map(String::as_str))
                .collect();
            // Before: a parked target is told as parked before it wakes.
            self.feed.views(self.views.as_ref(), &keys);
            let r = self.inner.execute(order).await;
            self.targets().remove(&switch_id);
            self.feed.views(self.views.as_ref(), &keys);
            let target_name = self.name_of(&target);
            match &r {
                Ok(_) if !victims.is_empty() => {
                    let victims = victims
                        .iter()
                        .map(|id| {
                            let v = self.views.view(id);
                            let name = v.as_ref().map(|v| v.name.clone()).unwrap_or(id.clone());
                            (name, released_words(v.as_ref()))
                        })
                        .collect();
                    self.feed.send(Observed::Switched {
                        switch_id,
                        target: target_name,
                        victims,
                    });
                }
                Ok(_) => {}
                // A wake failure is the target's own (its view says it).
                Err(ApiError::WakeFailed { .. }) => {}
                Err(e) => self.feed.send(Observed::SwitchFailed {
                    switch_id,
                    target: target_name,
                    code: e.code(),
                    message: e.message(),
                }),
            }
            r
        })
    }

    fn abandon(&self, switch_id: &str) {
        self.inner.abandon(switch_id);
    }

    fn switch_draining(&self, switch_id: &str) {
        self.inner.switch_draining(switch_id);
    }

    fn switch_failed(&self, failed: &SwitchOrder, error: &ApiError) {
        self.inner.switch_failed(failed, error);
        let switch_id = failed.switch_id.as_str();
        let target = self.targets().remove(switch_id);
        if let Some(target) = target {
            self.feed.send(Observed::SwitchFailed {
                switch_id: switch_id.to_string(),
                target: self.name_of(&target),
                code: error.code(),
                message: error.message(),
            });
        }
    }

    fn engine_idle<'a>(&'a self, instance: &'a InstanceKey) -> RouterFuture<'a, bool> {
        self.inner.engine_idle(instance)
    }

    fn adapter(&self, model: &str) -> Option<capyctl_interfaces::router::AdapterRoute> {
        self.inner.adapter(model)
    }

    fn acquire_adapter<'a>(
        &'a self,
        instance: &'a InstanceKey,
        adapter: &'a capyctl_interfaces::router::AdapterRoute,
        deadline: tokio::time::Instant,
    ) -> RouterFuture<'a, Result<capyctl_interfaces::router::AdapterLease, ApiError>> {
        self.inner.acquire_adapter(instance, adapter, deadline)
    }

    fn adapter_lost(&self, instance: &InstanceKey, adapter: &str) {
        self.inner.adapter_lost(instance, adapter);
    }
}

/// The management API, observed (see the module doc).
pub struct ObservedApi {
    inner: Arc<dyn ManagementApi>,
    views: Arc<dyn Views>,
    feed: EventFeed,
}

impl std::fmt::Debug for ObservedApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObservedApi").finish_non_exhaustive()
    }
}

impl ObservedApi {
    /// `inner`, observed into `feed`; `views` reads the deployments' views.
    pub fn new(inner: Arc<dyn ManagementApi>, views: Arc<dyn Views>, feed: EventFeed) -> Self {
        Self { inner, views, feed }
    }

    /// Runs a command on `key`, telling the views before and after, its switch and its
    /// refusal.
    async fn command(
        &self,
        by: &'static str,
        key: &str,
        run: BoxFuture<'_, Result<ActionReceipt, ApiError>>,
    ) -> Result<ActionReceipt, ApiError> {
        self.feed.views(self.views.as_ref(), &[key]);
        let r = run.await;
        match &r {
            Ok(receipt) => {
                let mut keys: Vec<&str> = vec![receipt.deployment.id.as_str()];
                keys.extend(receipt.victims.iter().map(|v| v.deployment_id.as_str()));
                self.feed.views(self.views.as_ref(), &keys);
                if let Some(switch_id) = &receipt.switch_id
                    && !receipt.victims.is_empty()
                {
                    self.feed.send(Observed::Switched {
                        switch_id: switch_id.clone(),
                        target: receipt.deployment.name.clone(),
                        victims: receipt
                            .victims
                            .iter()
                            .map(|v| (v.name.clone(), v.released.words().to_string()))
                            .collect(),
                    });
                }
            }
            Err(ApiError::NotFound { .. } | ApiError::ModelNotFound { .. }) => {}
            Err(e) => {
                let deployment = self
                    .views
                    .view(key)
                    .map(|v| v.name)
                    .unwrap_or_else(|| key.to_string());
                self.feed.send(Observed::Refused {
                    deployment,
                    by,
                    code: e.code(),
                    message: e.message(),
                });
            }
        }
        r
    }
}

impl ManagementApi for ObservedApi {
    fn list(&self) -> BoxFuture<'_, DeploymentList> {
        self.inner.list()
    }

    fn list_json(&self) -> BoxFuture<'_, Result<Vec<u8>, ApiError>> {
        self.inner.list_json()
    }

    fn list_parts(&self) -> BoxFuture<'_, Result<JsonParts, ApiError>> {
        self.inner.list_parts()
    }

    fn deploy(&self, doc: DeploymentDoc) -> BoxFuture<'_, Result<DeployReceipt, ApiError>> {
        self.inner.deploy(doc)
    }

    fn get<'a>(&'a self, name_or_id: &'a str) -> BoxFuture<'a, Result<DeploymentView, ApiError>> {
        self.inner.get(name_or_id)
    }

    fn delete<'a>(
        &'a self,
        name_or_id: &'a str,
    ) -> BoxFuture<'a, Result<DeploymentView, ApiError>> {
        self.inner.delete(name_or_id)
    }

    fn start<'a>(
        &'a self,
        name_or_id: &'a str,
        request: StartRequest,
    ) -> BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        Box::pin(self.command("Start", name_or_id, self.inner.start(name_or_id, request)))
    }

    fn stop<'a>(&'a self, name_or_id: &'a str) -> BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        Box::pin(self.command("Stop", name_or_id, self.inner.stop(name_or_id)))
    }

    fn park<'a>(&'a self, name_or_id: &'a str) -> BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        Box::pin(self.command("Park", name_or_id, self.inner.park(name_or_id)))
    }

    fn preinitialize<'a>(
        &'a self,
        name_or_id: &'a str,
    ) -> BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        Box::pin(self.command(
            "Preinitialize",
            name_or_id,
            self.inner.preinitialize(name_or_id),
        ))
    }

    fn engines(&self) -> BoxFuture<'_, EngineList> {
        self.inner.engines()
    }

    fn hosts(&self) -> BoxFuture<'_, HostList> {
        self.inner.hosts()
    }

    fn drain_host<'a>(
        &'a self,
        host_id: &'a str,
        drain: bool,
    ) -> BoxFuture<'a, Result<HostDrainReceipt, ApiError>> {
        self.inner.drain_host(host_id, drain)
    }

    fn load<'a>(
        &'a self,
        deployment: Option<&'a str>,
    ) -> BoxFuture<'a, Result<LoadReport, ApiError>> {
        self.inner.load(deployment)
    }

    fn load_json<'a>(
        &'a self,
        deployment: Option<&'a str>,
    ) -> BoxFuture<'a, Result<bytes::Bytes, ApiError>> {
        self.inner.load_json(deployment)
    }

    fn ready(&self) -> bool {
        self.inner.ready()
    }

    fn changes(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.inner.changes()
    }

    fn switches(
        &self,
        query: capyctl_spec::api::SwitchQuery,
    ) -> BoxFuture<'_, Result<capyctl_spec::api::SwitchList, ApiError>> {
        self.inner.switches(query)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::collections::BTreeSet;
    use std::sync::atomic::AtomicBool;
    use std::time::Duration;

    use capyctl_interfaces::router::DrainReport;
    use capyctl_spec::InstanceState;

    use super::super::mock::view_of;
    use super::*;

    fn view(name: &str, state: InstanceState, tier: Option<&str>) -> DeploymentView {
        let doc = capyctl_spec::documents::parse_deployment_str(
            "t.yaml",
            &format!("name: {name}\nengine: vllm\nmodel: m\n"),
        )
        .unwrap();
        let mut v = view_of(&doc, 1);
        v.state = state;
        v.instances[0].state = state;
        v.instances[0].parked_tier = tier.map(str::to_string);
        v
    }

    /// Before a switch chat-a is parked and chat-b ready; after it, the other way round.
    #[derive(Default)]
    struct Scene {
        switched: AtomicBool,
    }

    impl Views for Scene {
        fn view(&self, key: &str) -> Option<DeploymentView> {
            let after = self.switched.load(Ordering::SeqCst);
            match (key, after) {
                ("01KCHAT-A" | "chat-a", false) => {
                    Some(view("chat-a", InstanceState::Parked, Some("host_ram")))
                }
                ("01KCHAT-A" | "chat-a", true) => Some(view("chat-a", InstanceState::Ready, None)),
                ("01KCHAT-B" | "chat-b", false) => Some(view("chat-b", InstanceState::Ready, None)),
                ("01KCHAT-B" | "chat-b", true) => {
                    Some(view("chat-b", InstanceState::Parked, Some("host_ram")))
                }
                _ => None,
            }
        }
    }

    /// The router's lifecycle: chat-c is explicit and refused; plans switch; execute flips the
    /// scene.
    struct Fake(Arc<Scene>);

    impl Lifecycle for Fake {
        fn resolve(&self, _: &str) -> Option<DeploymentRef> {
            None
        }
        fn admissible(&self, deployment: &DeploymentId) -> Result<(), ApiError> {
            if deployment == "01KCHAT-C" {
                return Err(ApiError::DeploymentInactive {
                    deployment: deployment.clone(),
                });
            }
            Ok(())
        }
        fn plan<'a>(
            &'a self,
            _: &'a DeploymentId,
            _: &'a BTreeSet<DeploymentId>,
            _: PlanFor,
        ) -> RouterFuture<'a, Result<Plan, ApiError>> {
            Box::pin(async {
                Ok(Plan::Switch {
                    switch_id: "sw-1".into(),
                    victims: vec![],
                    window: None,
                })
            })
        }
        fn execute(&self, _: SwitchOrder) -> RouterFuture<'_, Result<Executed, ApiError>> {
            Box::pin(async {
                self.0.switched.store(true, Ordering::SeqCst);
                Ok(Executed::default())
            })
        }
        fn abandon(&self, _: &str) {}
        fn engine_idle<'a>(&'a self, _: &'a InstanceKey) -> RouterFuture<'a, bool> {
            Box::pin(async { true })
        }
    }

    fn key(deployment: &str) -> InstanceKey {
        InstanceKey {
            deployment: deployment.into(),
            index: 0,
            host_id: "gpu-1".into(),
            generation: 0,
        }
    }

    fn drain(rx: &mut mpsc::Receiver<Observed>) -> Vec<Observed> {
        let mut out = Vec::new();
        while let Ok(o) = rx.try_recv() {
            out.push(o);
        }
        out
    }

    #[tokio::test]
    async fn a_switch_is_seen_before_and_after_it_runs_and_told() {
        let scene = Arc::new(Scene::default());
        let (feed, mut rx) = EventFeed::channel(16);
        let lc = ObservedLifecycle::new(Arc::new(Fake(scene.clone())), scene.clone(), feed);
        let plan = lc
            .plan(
                &"01KCHAT-A".to_string(),
                &BTreeSet::new(),
                PlanFor::Requests,
            )
            .await
            .unwrap();
        assert!(matches!(plan, Plan::Switch { .. }));
        lc.execute(SwitchOrder {
            switch_id: "sw-1".into(),
            target: "01KCHAT-A".into(),
            victims: vec![(key("01KCHAT-B"), DrainReport::default())],
            window: Duration::ZERO,
            drain: Duration::ZERO,
            began: tokio::time::Instant::now(),
            wave: 0,
            operator: false,
        })
        .await
        .unwrap();
        let seen = drain(&mut rx);
        let states: Vec<(String, InstanceState)> = seen
            .iter()
            .filter_map(|o| match o {
                Observed::View(v) => Some((v.name.clone(), v.state)),
                _ => None,
            })
            .collect();
        assert_eq!(
            states,
            [
                ("chat-a".to_string(), InstanceState::Parked),
                ("chat-b".to_string(), InstanceState::Ready),
                ("chat-a".to_string(), InstanceState::Ready),
                ("chat-b".to_string(), InstanceState::Parked),
            ]
        );
        assert_eq!(
            seen.last().unwrap(),
            &Observed::Switched {
                switch_id: "sw-1".into(),
                target: "chat-a".into(),
                victims: vec![("chat-b".into(), "parked (host_ram)".into())],
            }
        );
    }

    #[tokio::test]
    async fn refusals_and_a_failed_drain_are_told_by_deployment_name() {
        let scene = Arc::new(Scene::default());
        let (feed, mut rx) = EventFeed::channel(16);
        let lc = ObservedLifecycle::new(Arc::new(Fake(scene.clone())), scene.clone(), feed);
        assert!(lc.admissible(&"01KCHAT-C".to_string()).is_err());
        assert!(lc.admissible(&"01KCHAT-A".to_string()).is_ok());
        lc.plan(
            &"01KCHAT-B".to_string(),
            &BTreeSet::new(),
            PlanFor::Requests,
        )
        .await
        .unwrap();
        let error = ApiError::DrainTimeout {
            deployment: "01KCHAT-B".into(),
            drain_ms: 30_000,
            charged: 2,
        };
        lc.switch_failed(
            &SwitchOrder {
                switch_id: "sw-1".into(),
                target: "01KCHAT-B".into(),
                victims: Vec::new(),
                window: Duration::ZERO,
                drain: Duration::from_secs(30),
                began: tokio::time::Instant::now(),
                wave: 1,
                operator: false,
            },
            &error,
        );
        let seen = drain(&mut rx);
        assert_eq!(seen.len(), 2, "{seen:?}");
        match &seen[0] {
            Observed::Refused {
                deployment,
                by,
                code,
                ..
            } => {
                // chat-c has no view here: its ID stands for its name.
                assert_eq!(
                    (deployment.as_str(), *by, *code),
                    ("01KCHAT-C", "Request", "deployment_inactive")
                );
            }
            other => panic!("{other:?}"),
        }
        match &seen[1] {
            Observed::SwitchFailed { target, code, .. } => {
                assert_eq!((target.as_str(), *code), ("chat-b", "unavailable"));
            }
            other => panic!("{other:?}"),
        }
    }

    /// The switch's event says why a victim stopped: `stopped (no room to park)`.
    #[test]
    fn a_victim_stopped_for_want_of_room_is_told_so() {
        let mut v = view("chat-b", InstanceState::Stopped, None);
        assert_eq!(released_words(Some(&v)), "stopped");
        v.instances[0].last_error =
            Some(capyctl_spec::api::Released::StoppedNoRoomToPark.status_line());
        assert_eq!(released_words(Some(&v)), "stopped (no room to park)");
    }

    #[test]
    fn a_full_feed_drops_and_counts() {
        let (feed, mut rx) = EventFeed::channel(1);
        let o = || Observed::Refused {
            deployment: "d".into(),
            by: "Request",
            code: "queue_full",
            message: String::new(),
        };
        feed.send(o());
        feed.send(o());
        assert_eq!(feed.dropped(), 1);
        assert_eq!(drain(&mut rx).len(), 1);
    }
}
