//! `Deployment` CRs into the lifecycle, and the lifecycle's state back into their status.
//!
//! The CRs come from the watched namespaces ([`Reconciler::with_watch`]: the operator's own,
//! and a list or every namespace), one controller per namespace or one for all. The router
//! routes by name, so of several CRs with one name only the holder ([`super::watch`], the
//! oldest) is the lifecycle's deployment; every CR is reconciled again when a name changes
//! hands.
//!
//! [`Reconciler::reconcile`] handles one CR (the controller calls it on every change, and
//! every [`ReconcilerConfig::requeue`]):
//!
//! The finalizer [`FINALIZER`] is kube-runtime's [`finalizer`] helper's: the reconcile runs
//! inside it, as its `Apply` (a live object that has the finalizer) or its `Cleanup` (an
//! object being deleted that still has it). It patches with JSON patches whose `test`
//! operation guards the finalizers list (not the whole object), so a concurrent change of the
//! list fails the patch (the controller retries) and a change of anything else does not.
//!
//! 1. deleted (a `deletionTimestamp`) with the finalizer (`Cleanup`): if it holds its name,
//!    delete the deployment from the lifecycle through [`ManagementApi::delete`] (its engines
//!    stop; an unknown name is fine); then the helper removes the finalizer (an object gone
//!    meanwhile is fine); Kubernetes then deletes the object, and the name goes to the next
//!    object of that name, if any. A failed delete keeps the finalizer. Deleted without it,
//!    nothing but forgetting the object;
//! 2. without the finalizer: the helper adds it, and nothing else happens in that pass (the
//!    patch is a change the controller sees: the next pass is the `Apply`). With it (`Apply`),
//!    a CR whose name another namespace's CR holds is refused (`Accepted=False`, reason
//!    `name_taken`, naming the holder, and a `NameTaken` Warning) and nothing else happens;
//! 3. the spec as a deployment document ([`Deployment::to_document`], every rule of the
//!    document): deployed through [`ManagementApi::deploy`], which changes nothing for the same
//!    document and bumps the revision for a changed one, so a changed generation re-deploys; a
//!    spec refused (by the document's rules or the lifecycle) leaves the running revision as it
//!    is, says why in `Accepted=False` and a Warning event, and keeps `observedGeneration`;
//! 4. the status from the lifecycle's view ([`super::status`]), written only when it changed.
//!
//! A base of adapters (`spec.adapters`) deployed for the first time has every CR reconciled
//! again while some spec is refused: an adapter applied before its base is then taken at once.
//!
//! Parks, wakes and failures happen without any change of the CR: [`Reconciler::sync_status`]
//! (looped by [`Reconciler::run_status_sync`]) reads every known deployment's view and writes
//! the changed statuses.
//!
//! Events: [`Reconciler::run_events`] takes the [`Observed`] happenings of the
//! [`super::events`] feed (the views read around every switch and command and by the status
//! sync, switches, refusals) and records an Event for each [`Happening`]: a view is compared
//! with the last one told for its deployment ([`happenings`]: `Started`, `Parked`, `Woken`,
//! `Stopped`, `WakeFailed`, `EngineFailed`); `Switched` and `SwitchFailed` on the switch's
//! target; `RequestRefused` and `CommandRefused` (at most one per deployment, source and code
//! every [`REFUSAL_EVERY`]: a flood of refused requests is one Event, which Kubernetes then
//! counts as a series). Without a feed (tests) the status sync tells its views itself.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use capyctl_crds::{Deployment, DeploymentStatus};
use capyctl_node_agent::HostAgent;
use capyctl_node_agent::spec::InstanceSpec;
use capyctl_spec::InstanceState;
use capyctl_spec::api::{ActionReceipt, DeployOutcome, DeploymentView};
use capyctl_spec::errors::ApiError;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::finalizer::{self, Event as Finalize, finalizer};
use kube::runtime::watcher;
use kube::{Api, Resource, ResourceExt};
use tokio::sync::{mpsc, watch};

use super::events::{EventFeed, Observed, Views};
use super::status::{
    Parkability, StatusInput, apply_status, deployment_status, name_taken_status, needs_write,
};
use super::store::CrStore;
use super::watch::{Claims, Watch};
use super::{CONTROLLER_NAME, FINALIZER};
use capyctl_lifecycle::api::ManagementApi;

/// The reconciler's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReconcilerConfig {
    /// Every CR is reconciled again after this long without a change. Default 5 min.
    pub requeue: Duration,
    /// After a failed reconcile, before the next try. Default 5 s.
    pub retry: Duration,
    /// Between two reads of the lifecycle's views by [`Reconciler::run_status_sync`].
    /// Default 1 s.
    pub status_interval: Duration,
}

/// After a change of the lifecycle's state, how long the status writer waits for more before it
/// reads the views (a switch changes several deployments within milliseconds).
pub const STATUS_DEBOUNCE: Duration = Duration::from_millis(50);

/// At most one refusal Event per deployment, source and code this often.
pub const REFUSAL_EVERY: Duration = Duration::from_secs(30);

impl Default for ReconcilerConfig {
    fn default() -> Self {
        Self {
            requeue: Duration::from_secs(300),
            retry: Duration::from_secs(5),
            status_interval: Duration::from_secs(1),
        }
    }
}

/// What can go wrong reconciling one CR; the controller retries after
/// [`ReconcilerConfig::retry`].
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// A call to the API server failed.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// The lifecycle failed a call that must succeed (a delete).
    #[error("lifecycle: {0}")]
    Lifecycle(#[source] ApiError),
    /// The API server refused or failed the patch adding or removing the finalizer
    /// [`FINALIZER`]: among others a failed `test` (the object's finalizers changed since it
    /// was read), which the next pass retries on the object as it is now.
    #[error("{action} the finalizer {FINALIZER}: {source}")]
    Finalizer {
        /// `adding` or `removing`.
        action: &'static str,
        /// The API server's error.
        #[source]
        source: kube::Error,
    },
    /// The finalizer helper could not patch the object at all (it has no name).
    #[error("the finalizer {FINALIZER} cannot be kept on this object: {0}")]
    Unpatchable(String),
}

impl From<finalizer::Error<ReconcileError>> for ReconcileError {
    fn from(e: finalizer::Error<ReconcileError>) -> Self {
        match e {
            finalizer::Error::ApplyFailed(e) | finalizer::Error::CleanupFailed(e) => e,
            finalizer::Error::AddFinalizer(source) => ReconcileError::Finalizer {
                action: "adding",
                source,
            },
            finalizer::Error::RemoveFinalizer(source) => ReconcileError::Finalizer {
                action: "removing",
                source,
            },
            other @ (finalizer::Error::UnnamedObject | finalizer::Error::InvalidFinalizer) => {
                ReconcileError::Unpatchable(other.to_string())
            }
        }
    }
}

impl ReconcileError {
    /// A short, stable label for metrics and logs.
    pub fn metric_label(&self) -> &'static str {
        match self {
            ReconcileError::Kube(_) | ReconcileError::Finalizer { .. } => "kube",
            ReconcileError::Lifecycle(e) => e.metric_label(),
            ReconcileError::Unpatchable(_) => "unpatchable",
        }
    }
}

/// Something that happened to a deployment, told as a Kubernetes Event on its CR.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Happening {
    /// `Normal` or `Warning`.
    pub warning: bool,
    /// The Event's reason (`Parked`, `Woken`, `WakeFailed`, ...), PascalCase.
    pub reason: &'static str,
    /// The Event's action (`Park`, `Wake`, `Start`, `Stop`, `Switch`, `Deploy`, `Delete`).
    pub action: &'static str,
    /// The note, for people.
    pub note: String,
}

impl Happening {
    fn normal(reason: &'static str, action: &'static str, note: String) -> Self {
        Self {
            warning: false,
            reason,
            action,
            note,
        }
    }

    fn warning(reason: &'static str, action: &'static str, note: String) -> Self {
        Self {
            warning: true,
            reason,
            action,
            note,
        }
    }

    /// A refusal: the lifecycle (or the document's rules) refused what the CR asks.
    pub fn refused(why: &str) -> Self {
        Self::warning("Refused", "Deploy", why.to_string())
    }

    /// A start that released others: `Switched` with its `switch_id` and victims (none when
    /// the start released nothing).
    pub fn from_receipt(receipt: &ActionReceipt) -> Option<Self> {
        let switch_id = receipt.switch_id.as_deref()?;
        let victims: Vec<(String, String)> = receipt
            .victims
            .iter()
            .map(|v| (v.name.clone(), v.released.words().to_string()))
            .collect();
        Some(Self::switched(
            switch_id,
            &receipt.deployment.name,
            &victims,
        ))
    }

    /// `Switched`: switch `switch_id` released `victims` (name, how) for `target`.
    pub fn switched(switch_id: &str, target: &str, victims: &[(String, String)]) -> Self {
        let victims: Vec<String> = victims
            .iter()
            .map(|(n, how)| format!("{n} {how}"))
            .collect();
        Self::normal(
            "Switched",
            "Switch",
            format!("switch {switch_id}: {} for {target}", victims.join(", ")),
        )
    }

    /// `SwitchFailed` (a Warning): switch `switch_id` for this deployment failed with `code`.
    pub fn switch_failed(switch_id: &str, code: &str, message: &str) -> Self {
        Self::warning(
            "SwitchFailed",
            "Switch",
            format!("switch {switch_id} failed: {code}: {message}"),
        )
    }

    /// A refusal (a Warning) of a request (`by` = `Request`: `RequestRefused`) or of a command
    /// (`Start`, `Stop`, ...: `CommandRefused`), with the error's code and message.
    pub fn refusal(by: &'static str, code: &str, message: &str) -> Self {
        let reason = if by == "Request" {
            "RequestRefused"
        } else {
            "CommandRefused"
        };
        let action = match by {
            "Request" => "Serve",
            other => other,
        };
        Self::warning(reason, action, format!("{code}: {message}"))
    }

    /// The Event to publish.
    pub fn to_event(&self) -> Event {
        Event {
            type_: if self.warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: self.reason.to_string(),
            note: Some(truncate(&self.note, 1000)),
            action: self.action.to_string(),
            secondary: None,
        }
    }
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// What happened between two views of one deployment (instance 0), as Events tell it:
/// `Started`, `Parked`, `Woken`, `Stopped`, `WakeFailed`, `EngineFailed`.
pub fn happenings(before: Option<&DeploymentView>, after: &DeploymentView) -> Vec<Happening> {
    let Some(now) = after.instances.first() else {
        return Vec::new();
    };
    let then = before.and_then(|b| b.instances.first());
    let was = then.map(|i| i.state);
    if was == Some(now.state) && then.map(|i| i.generation) == Some(now.generation) {
        return Vec::new();
    }
    let on = |what: &str| format!("{what} on host {}", now.host_id);
    match now.state {
        InstanceState::Parked if was != Some(InstanceState::Parked) => {
            let tier = now.parked_tier.as_deref().unwrap_or("unknown tier");
            vec![Happening::normal(
                "Parked",
                "Park",
                on(&format!("instance {} parked ({tier})", now.instance_id)),
            )]
        }
        InstanceState::Ready
            if matches!(was, Some(InstanceState::Parked | InstanceState::Waking))
                && then.map(|i| i.generation) == Some(now.generation) =>
        {
            vec![Happening::normal(
                "Woken",
                "Wake",
                on(&format!(
                    "instance {} woke and passed its check",
                    now.instance_id
                )),
            )]
        }
        InstanceState::Ready if was != Some(InstanceState::Ready) || then.is_none() => {
            vec![Happening::normal(
                "Started",
                "Start",
                on(&format!(
                    "instance {} ready (generation {})",
                    now.instance_id, now.generation
                )),
            )]
        }
        InstanceState::Stopped
            if matches!(
                was,
                Some(
                    InstanceState::Ready
                        | InstanceState::Closed
                        | InstanceState::Parking
                        | InstanceState::Parked
                        | InstanceState::Stopping
                )
            ) =>
        {
            vec![Happening::normal(
                "Stopped",
                "Stop",
                on(&format!("instance {} stopped", now.instance_id)),
            )]
        }
        InstanceState::Failed if was != Some(InstanceState::Failed) => {
            let error = now
                .last_error
                .clone()
                .unwrap_or_else(|| "failed".to_string());
            if error.starts_with("wake_") || was == Some(InstanceState::Waking) {
                vec![Happening::warning("WakeFailed", "Wake", on(&error))]
            } else {
                vec![Happening::warning("EngineFailed", "Start", on(&error))]
            }
        }
        _ => Vec::new(),
    }
}

/// What the reconciler remembers of one CR.
#[derive(Debug, Clone)]
struct Known {
    /// The CR, for its Events.
    reference: ObjectReference,
    /// The status the API server holds, as last read or written.
    status: Option<DeploymentStatus>,
    /// The generation the lifecycle runs.
    observed_generation: Option<i64>,
    /// Why the current spec was refused, if it was.
    refused: Option<String>,
    /// The view the status was last computed from.
    view: Option<DeploymentView>,
    /// How it parks, and the revision that was asked about.
    parkability: Parkability,
    parkability_revision: Option<u64>,
}

/// Reconciles the CRs of the watched namespaces into one lifecycle.
pub struct Reconciler {
    lifecycle: Arc<dyn ManagementApi>,
    /// The client of every CR's own namespace.
    client: kube::Client,
    /// The namespace of `crs` (the release namespace): where a CR without one is.
    release: String,
    /// The APIs the controller watches (one per namespace, or one of every namespace).
    watched: Vec<Api<Deployment>>,
    /// Which object holds each deployment name.
    claims: Arc<Claims>,
    /// Bumped when a name changes hands: every CR is reconciled again.
    retrigger: watch::Sender<u64>,
    recorder: Option<Recorder>,
    host: Option<Arc<dyn HostAgent>>,
    config: ReconcilerConfig,
    known: Mutex<HashMap<String, Known>>,
    /// The lifecycle's store, whose records go into the CRs' `lifecycleRecord`.
    store: Option<Arc<CrStore>>,
    /// The Events feed the status sync sends its views to, and how it reads them.
    events: Option<(EventFeed, Arc<dyn Views>)>,
    /// The last view told as Events, by deployment name.
    told: Mutex<HashMap<String, DeploymentView>>,
    /// When a refusal was last told, by deployment, source and code.
    refusals: Mutex<HashMap<(String, &'static str, &'static str), tokio::time::Instant>>,
    /// The next status sync writes every status ([`Reconciler::rewrite_statuses`]).
    rewrite: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Reconciler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reconciler")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Reconciler {
    /// A reconciler of the CRs behind `crs` (the operator's namespace) into `lifecycle`;
    /// [`Reconciler::with_watch`] makes it watch more namespaces.
    /// `recorder` publishes Events (none without); `host` answers how deployments park (the
    /// `Parkable` condition; the document alone says less without it).
    pub fn new(
        lifecycle: Arc<dyn ManagementApi>,
        crs: Api<Deployment>,
        recorder: Option<Recorder>,
        host: Option<Arc<dyn HostAgent>>,
        config: ReconcilerConfig,
    ) -> Self {
        let release = crs.namespace().unwrap_or("default").to_string();
        Self {
            lifecycle,
            client: crs.clone().into_client(),
            release,
            watched: vec![crs],
            claims: Arc::new(Claims::default()),
            retrigger: watch::channel(0).0,
            recorder,
            host,
            config,
            known: Mutex::new(HashMap::new()),
            store: None,
            events: None,
            told: Mutex::new(HashMap::new()),
            refusals: Mutex::new(HashMap::new()),
            rewrite: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Watches the CRs of `watch`'s namespaces, with the claims of their names `claims`
    /// (seeded by the leader from its list of the CRs, and shared with the engine Pods' side,
    /// which finds a deployment's object by them).
    pub fn with_watch(mut self, watch: &Watch, claims: Arc<Claims>) -> Self {
        self.watched = watch.apis(&self.client);
        self.release = watch.release().to_string();
        self.claims = claims;
        self
    }

    /// The CRs of `namespace`.
    fn api(&self, namespace: &str) -> Api<Deployment> {
        Api::namespaced(self.client.clone(), namespace)
    }

    fn namespace_of(&self, cr: &Deployment) -> String {
        cr.namespace().unwrap_or_else(|| self.release.clone())
    }

    /// The CRs of the namespace of the object `reference`.
    fn api_of(&self, reference: &ObjectReference) -> Api<Deployment> {
        self.api(reference.namespace.as_deref().unwrap_or(&self.release))
    }

    /// Has every CR reconciled again (a name changed hands).
    fn retrigger(&self) {
        self.retrigger.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Tells Events from the happenings of `feed` ([`Reconciler::run_events`]); the status
    /// sync sends the views it reads (through `views`) to it.
    pub fn with_events(mut self, feed: EventFeed, views: Arc<dyn Views>) -> Self {
        self.events = Some((feed, views));
        self
    }

    fn told(&self) -> std::sync::MutexGuard<'_, HashMap<String, DeploymentView>> {
        self.told.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What happened since the view last told for the deployment; `view` is told from now.
    fn tell(&self, view: &DeploymentView) -> Vec<Happening> {
        let mut told = self.told();
        let hs = happenings(told.get(&view.name), view);
        told.insert(view.name.clone(), view.clone());
        hs
    }

    /// The CR of deployment `name`, once reconciled.
    fn reference_of(&self, name: &str) -> Option<ObjectReference> {
        self.known().get(name).map(|k| k.reference.clone())
    }

    /// Records the Events of one happening (see the module doc).
    pub async fn handle(&self, o: Observed) {
        match o {
            Observed::View(v) => {
                let Some(reference) = self.reference_of(&v.name) else {
                    return;
                };
                for h in self.tell(&v) {
                    self.publish(&reference, &h).await;
                }
            }
            Observed::Switched {
                switch_id,
                target,
                victims,
            } => {
                if let Some(reference) = self.reference_of(&target) {
                    self.publish(
                        &reference,
                        &Happening::switched(&switch_id, &target, &victims),
                    )
                    .await;
                }
            }
            Observed::SwitchFailed {
                switch_id,
                target,
                code,
                message,
            } => {
                if let Some(reference) = self.reference_of(&target) {
                    self.publish(
                        &reference,
                        &Happening::switch_failed(&switch_id, code, &message),
                    )
                    .await;
                }
            }
            Observed::Refused {
                deployment,
                by,
                code,
                message,
            } => {
                let Some(reference) = self.reference_of(&deployment) else {
                    return;
                };
                let now = tokio::time::Instant::now();
                {
                    let mut last = self.refusals.lock().unwrap_or_else(PoisonError::into_inner);
                    last.retain(|_, t| now.duration_since(*t) < REFUSAL_EVERY);
                    let key = (deployment, by, code);
                    if last.contains_key(&key) {
                        return;
                    }
                    last.insert(key, now);
                }
                self.publish(&reference, &Happening::refusal(by, code, &message))
                    .await;
            }
        }
    }

    /// Records the Events of the feed's happenings until `shutdown` turns `true`.
    pub async fn run_events(
        self: Arc<Self>,
        mut feed: mpsc::Receiver<Observed>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        loop {
            tokio::select! {
                o = feed.recv() => match o {
                    Some(o) => self.handle(o).await,
                    None => return,
                },
                _ = super::until(&mut shutdown, true) => return,
            }
        }
    }

    /// Keeps the lifecycle's records (operator decisions, first answers) in the CRs' status,
    /// so that a new leader restores them ([`CrStore::from_crs`]).
    pub fn with_store(mut self, store: Arc<CrStore>) -> Self {
        self.store = Some(store);
        self
    }

    /// An Events recorder for `client`, reporting as [`CONTROLLER_NAME`] from `instance` (the
    /// Pod's name).
    pub fn recorder(client: kube::Client, instance: Option<String>) -> Recorder {
        Recorder::new(
            client,
            Reporter {
                controller: CONTROLLER_NAME.to_string(),
                instance,
            },
        )
    }

    fn known(&self) -> std::sync::MutexGuard<'_, HashMap<String, Known>> {
        self.known.lock().unwrap_or_else(PoisonError::into_inner)
    }

    async fn publish(&self, reference: &ObjectReference, h: &Happening) {
        let Some(recorder) = &self.recorder else {
            return;
        };
        if let Err(e) = recorder.publish(&h.to_event(), reference).await {
            tracing::warn!(reason = h.reason, object = ?reference.name, error = %e, "an Event could not be published");
        }
    }

    /// Reconciles one CR (see the module doc). `Ok` tells the controller when to look again.
    pub async fn reconcile(&self, cr: Arc<Deployment>) -> Result<Action, ReconcileError> {
        let name = cr.name_any();
        let namespace = self.namespace_of(&cr);
        let claim = self.claims.observe(&cr);
        if claim.changed {
            self.retrigger();
        }
        let holds = claim.holds(&namespace);
        let deleting = cr.metadata.deletion_timestamp.is_some();
        let done = finalizer(&self.api(&namespace), FINALIZER, cr, |event| async move {
            match event {
                Finalize::Apply(cr) => self.apply(&cr, holds, claim.holder).await,
                Finalize::Cleanup(cr) => self.clean_up(&cr, holds).await,
            }
        })
        .await;
        let action = match done {
            Ok(action) => action,
            // Gone between the cleanup and the finalizer's removal: nothing holds it any more.
            Err(finalizer::Error::RemoveFinalizer(kube::Error::Api(s))) if s.is_not_found() => {
                Action::await_change()
            }
            Err(e) => return Err(e.into()),
        };
        if deleting {
            // The finalizer is gone (or was never there): the object is as good as gone.
            if holds {
                self.known().remove(&name);
                self.told().remove(&name);
            }
            if self.claims.forget(&namespace, &name) {
                self.retrigger();
            }
        }
        Ok(action)
    }

    /// The finalizer helper's `Cleanup` of a CR being deleted: only the holder of the name is
    /// the lifecycle's deployment, deleted there (an unknown name is fine). An error keeps the
    /// finalizer.
    async fn clean_up(&self, cr: &Deployment, holds: bool) -> Result<Action, ReconcileError> {
        if !holds {
            return Ok(Action::await_change());
        }
        let name = cr.name_any();
        match self.lifecycle.delete(&name).await {
            Ok(_) => {
                self.publish(
                    &cr.object_ref(&()),
                    &Happening::normal(
                        "Deleted",
                        "Delete",
                        format!("deployment {name} deleted; its engines stopped"),
                    ),
                )
                .await;
                Ok(Action::await_change())
            }
            Err(ApiError::NotFound { .. } | ApiError::ModelNotFound { .. }) => {
                Ok(Action::await_change())
            }
            Err(e) => Err(ReconcileError::Lifecycle(e)),
        }
    }

    /// The finalizer helper's `Apply` of a live CR that has the finalizer: refused when
    /// another namespace's object holds its name (`holder`), else deployed and its status
    /// written.
    async fn apply(
        &self,
        cr: &Deployment,
        holds: bool,
        holder: Option<String>,
    ) -> Result<Action, ReconcileError> {
        if !holds {
            return self.refuse_taken_name(cr, holder).await;
        }
        let name = cr.name_any();
        let namespace = self.namespace_of(cr);
        let reference = cr.object_ref(&());
        let generation = cr.metadata.generation;

        // What is known of the name belongs to this object only if it held the name before.
        let previous = self
            .known()
            .get(&name)
            .filter(|k| k.reference.namespace.as_deref() == Some(namespace.as_str()))
            .cloned();
        let mut observed_generation = previous
            .as_ref()
            .and_then(|k| k.observed_generation)
            .or_else(|| cr.status.as_ref().and_then(|s| s.observed_generation));
        let mut refused = None;
        let mut view = None;
        let mut happening = None;
        match cr.to_document() {
            Err(e) => refused = Some(e.to_string()),
            Ok(doc) => match self.lifecycle.deploy(doc).await {
                Ok(receipt) => {
                    observed_generation = generation;
                    // A new base of adapters: the adapter objects refused for want of it (applied
                    // before it) are taken now, not at their next requeue.
                    if receipt.outcome == DeployOutcome::Created
                        && receipt.deployment.spec.adapters.is_some()
                        && self.known().values().any(|k| k.refused.is_some())
                    {
                        self.retrigger();
                    }
                    happening = match receipt.outcome {
                        DeployOutcome::Created => Some(Happening::normal(
                            "Deployed",
                            "Deploy",
                            format!(
                                "deployment {} ({}), revision {}",
                                name, receipt.deployment.id, receipt.deployment.revision
                            ),
                        )),
                        DeployOutcome::Updated => Some(Happening::normal(
                            "Redeployed",
                            "Deploy",
                            format!(
                                "deployment {} is at revision {}",
                                name, receipt.deployment.revision
                            ),
                        )),
                        DeployOutcome::Unchanged => None,
                    };
                    view = Some(receipt.deployment);
                }
                Err(e) => refused = Some(e.to_string()),
            },
        }
        if let Some(why) = &refused {
            let first_time = previous
                .as_ref()
                .is_none_or(|k| k.refused.as_deref() != Some(why.as_str()));
            if first_time {
                tracing::warn!(deployment = %name, %why, "the spec is refused");
                happening = Some(Happening::refused(why));
            }
            view = self.lifecycle.get(&name).await.ok();
        }
        if let Some(h) = &happening {
            self.publish(&reference, h).await;
        }

        let server_status = match &previous {
            Some(k) => k.status.clone(),
            None => cr.status.clone(),
        };
        let mut known = Known {
            reference,
            status: server_status,
            observed_generation,
            refused,
            view: previous.as_ref().and_then(|k| k.view.clone()),
            parkability: previous
                .as_ref()
                .map(|k| k.parkability.clone())
                .unwrap_or(Parkability::Unknown),
            parkability_revision: previous.as_ref().and_then(|k| k.parkability_revision),
        };
        if let Some(v) = &view {
            // The first view of a deployment is where its Events start from.
            self.told()
                .entry(v.name.clone())
                .or_insert_with(|| v.clone());
        }
        self.write_status(&name, &mut known, view, false).await?;
        self.known().insert(name, known);
        Ok(Action::requeue(self.config.requeue))
    }

    /// An object whose name another namespace's object holds (`holder`): checked that the
    /// holder is still there (an object whose finalizer was removed by hand is gone without
    /// the reconciler seeing it), then refused with `Accepted=False` (reason
    /// [`super::watch::REASON_NAME_TAKEN`]) naming the holder, once as a Warning Event;
    /// nothing else changes.
    async fn refuse_taken_name(
        &self,
        cr: &Deployment,
        holder: Option<String>,
    ) -> Result<Action, ReconcileError> {
        let name = cr.name_any();
        let namespace = self.namespace_of(cr);
        let mut holder = holder;
        if let Some(h) = holder.clone()
            && h != namespace
        {
            match self.api(&h).get_opt(&name).await? {
                Some(object) => {
                    self.claims.observe(&object);
                }
                None => {
                    // Gone: the name is free for the oldest remaining object.
                    self.claims.forget(&h, &name);
                    self.retrigger();
                    holder = self.claims.holder(&name);
                    if holder.as_deref() == Some(namespace.as_str()) {
                        return Ok(Action::requeue(Duration::ZERO));
                    }
                }
            }
        }
        let by = holder.unwrap_or_else(|| "?".to_string());
        let message = format!(
            "the deployment name {name} is taken by the Deployment object {by}/{name}: the router routes requests by model name, so one namespace's object serves a name (the oldest); delete or rename one of them"
        );
        let now = Timestamp::from_second(Timestamp::now().as_second())
            .unwrap_or_else(|_| Timestamp::now());
        let desired = name_taken_status(cr.status.as_ref(), &message, now);
        if needs_write(cr.status.as_ref(), &desired) {
            tracing::warn!(deployment = %name, %namespace, holder = %by, "the deployment name is taken by another namespace's object");
            self.publish(
                &cr.object_ref(&()),
                &Happening::warning("NameTaken", "Deploy", message),
            )
            .await;
            match apply_status(&self.api(&namespace), &name, &desired).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.is_not_found() => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(Action::requeue(self.config.requeue))
    }

    /// Asks the host how the deployment parks, once per revision.
    async fn refresh_parkability(&self, known: &mut Known, view: &DeploymentView) {
        if known.parkability_revision == Some(view.revision) {
            return;
        }
        known.parkability = match &self.host {
            Some(host) => {
                let spec = InstanceSpec::from_doc(view.id.clone(), &view.spec);
                match host.parkability(&spec).await {
                    Ok(choice) => Parkability::from_agent(&Ok(choice)),
                    Err(e) => match Parkability::from_agent(&Err(e)) {
                        // The host could not answer: what the document says, asked again later.
                        Parkability::Unknown => {
                            known.parkability = Parkability::from_doc(&view.spec);
                            return;
                        }
                        p => p,
                    },
                }
            }
            None => Parkability::from_doc(&view.spec),
        };
        known.parkability_revision = Some(view.revision);
    }

    /// Computes the status from `view` and writes it when it differs from what the API server
    /// holds; records `view` as the last one seen.
    async fn write_status(
        &self,
        name: &str,
        known: &mut Known,
        view: Option<DeploymentView>,
        rewrite: bool,
    ) -> Result<(), ReconcileError> {
        if let Some(v) = &view {
            self.refresh_parkability(known, v).await;
        }
        let record = match (&self.store, &view) {
            (Some(store), Some(v)) => store.lifecycle_record(&v.id),
            _ => None,
        };
        let desired = deployment_status(StatusInput {
            view: view.as_ref(),
            observed_generation: known.observed_generation,
            parkability: &known.parkability,
            refused: known.refused.as_deref(),
            previous: known.status.as_ref(),
            // Whole seconds: what the API server keeps of a condition's time.
            now: Timestamp::from_second(Timestamp::now().as_second())
                .unwrap_or_else(|_| Timestamp::now()),
            lifecycle_record: record.as_deref(),
        });
        if rewrite || needs_write(known.status.as_ref(), &desired) {
            match apply_status(&self.api_of(&known.reference), name, &desired).await {
                Ok(written) => known.status = written.status.or(Some(desired)),
                Err(kube::Error::Api(s)) if s.is_not_found() => {}
                Err(e) => return Err(e.into()),
            }
        }
        known.view = view;
        Ok(())
    }

    /// Reads every known CR's deployment from the lifecycle, writes the statuses that changed
    /// and publishes what happened since the last read.
    pub async fn sync_status(&self) {
        let rewrite = self
            .rewrite
            .swap(false, std::sync::atomic::Ordering::SeqCst);
        let mut failed = false;
        let names: Vec<String> = self.known().keys().cloned().collect();
        for name in names {
            let Some(mut known) = self.known().get(&name).cloned() else {
                continue;
            };
            let view = self.lifecycle.get(&name).await.ok();
            match &self.events {
                Some((feed, views)) => feed.views(views.as_ref(), &[name.as_str()]),
                None => {
                    if let Some(v) = &view {
                        for h in self.tell(v) {
                            self.publish(&known.reference, &h).await;
                        }
                    }
                }
            }
            if let Err(e) = self.write_status(&name, &mut known, view, rewrite).await {
                tracing::warn!(deployment = %name, error = %e, "the status could not be written");
                failed = true;
                continue;
            }
            // Keep it only if the CR was not deleted meanwhile.
            if let Some(k) = self.known().get_mut(&name) {
                *k = known;
            }
        }
        if rewrite && failed {
            // Not every status was written again: the next sync tries them all again.
            self.rewrite_statuses();
        }
    }

    /// The next [`Reconciler::sync_status`] writes every CR's status, changed or not (after a
    /// hold-over: what the API server kept may be older than what this replica last wrote or
    /// tried to write).
    pub fn rewrite_statuses(&self) {
        self.rewrite
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Runs [`Reconciler::sync_status`] whenever the lifecycle's state changes (at most every
    /// [`STATUS_DEBOUNCE`]) and at least every [`ReconcilerConfig::status_interval`], until
    /// `shutdown` turns `true`.
    pub async fn run_status_sync(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let mut changes = self.lifecycle.changes();
        loop {
            let changed = async {
                match changes.as_mut() {
                    Some(rx) => {
                        if rx.changed().await.is_err() {
                            std::future::pending::<()>().await;
                        }
                        tokio::time::sleep(STATUS_DEBOUNCE).await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(self.config.status_interval) => {}
                () = changed => {}
                _ = super::until(&mut shutdown, true) => return,
            }
            if let Some(rx) = changes.as_mut() {
                rx.borrow_and_update();
            }
            self.sync_status().await;
        }
    }

    /// Runs the controllers (a watch of the CRs of each watched namespace, or one of every
    /// namespace; [`Reconciler::reconcile`] on each change, and on every CR when a name
    /// changes hands) until `shutdown` turns `true`.
    pub async fn run_controller(self: Arc<Self>, shutdown: watch::Receiver<bool>) {
        let retry = self.config.retry;
        let controllers = self.watched.clone().into_iter().map(|api| {
            let mut shutdown = shutdown.clone();
            let names_moved = futures_util::stream::unfold(self.retrigger.subscribe(), |mut rx| async move {
                rx.changed().await.ok()?;
                Some(((), rx))
            });
            Controller::new(api, watcher::Config::default())
                .reconcile_all_on(names_moved)
                .graceful_shutdown_on(async move {
                    let _ = shutdown.wait_for(|s| *s).await;
                })
                .run(
                    |cr, ctx: Arc<Reconciler>| async move { ctx.reconcile(cr).await },
                    move |cr, error, _ctx| {
                        tracing::warn!(deployment = %cr.name_any(), namespace = ?cr.namespace(), error = %error, "reconcile failed; retrying");
                        Action::requeue(retry)
                    },
                    self.clone(),
                )
                .for_each(|_| async {})
        });
        futures_util::future::join_all(controllers).await;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use http::Method;

    use super::super::mock::{self, Exchange, FakeApi, Seen, status_body, view_of};
    use super::*;

    const CR_PATH: &str = "/apis/capyctl.io/v1alpha1/namespaces/capyctl/deployments/chat-a";
    const STATUS_PATH: &str =
        "/apis/capyctl.io/v1alpha1/namespaces/capyctl/deployments/chat-a/status";
    const EVENTS_PATH: &str = "/apis/events.k8s.io/v1/namespaces/capyctl/events";

    fn cr_json(finalizers: &[&str], generation: i64, spec: serde_json::Value) -> serde_json::Value {
        serde_json::json!({
            "apiVersion": "capyctl.io/v1alpha1",
            "kind": "Deployment",
            "metadata": {
                "name": "chat-a",
                "namespace": "capyctl",
                "uid": "6f1c0d5e-0000-4000-8000-000000000001",
                "resourceVersion": format!("{}", 100 + generation),
                "generation": generation,
                "finalizers": finalizers,
            },
            "spec": spec,
        })
    }

    fn spec() -> serde_json::Value {
        serde_json::json!({"engine": "vllm", "model": "Qwen3-4B"})
    }

    fn cr(v: serde_json::Value) -> Arc<Deployment> {
        Arc::new(serde_json::from_value(v).unwrap())
    }

    fn with_status(mut v: serde_json::Value, status: &serde_json::Value) -> serde_json::Value {
        v["status"] = status.clone();
        v
    }

    /// `object` with the JSON patch (RFC 6902) `seen` applied, as the API server would; a
    /// failed `test` fails.
    fn json_patched(object: &serde_json::Value, seen: &Seen) -> serde_json::Value {
        assert_eq!(
            seen.content_type.as_deref(),
            Some("application/json-patch+json")
        );
        let patch: json_patch::Patch = serde_json::from_value(seen.body.clone()).unwrap();
        let mut object = object.clone();
        // NB: the API server's `test` takes an absent member as `null`; json-patch needs it
        // spelled.
        let metadata = object["metadata"].as_object_mut().unwrap();
        metadata
            .entry("finalizers")
            .or_insert(serde_json::Value::Null);
        json_patch::patch(&mut object, &patch).unwrap();
        object
    }

    fn reconciler(client: kube::Client, lifecycle: Arc<FakeApi>, events: bool) -> Reconciler {
        let recorder = events.then(|| Reconciler::recorder(client.clone(), Some("op-a".into())));
        Reconciler::new(
            lifecycle,
            Api::namespaced(client, "capyctl"),
            recorder,
            None,
            ReconcilerConfig::default(),
        )
    }

    #[tokio::test]
    async fn a_new_cr_gets_the_finalizer_then_is_deployed_and_its_status_written_once() {
        let (client, handle) = mock::client();
        let fresh = cr_json(&[], 1, spec());
        let finalized = cr_json(&[FINALIZER], 1, spec());
        // The status the server answers the apply with is echoed back below.
        let server = mock::serve(
            handle,
            vec![
                Exchange::ok(Method::PATCH, CR_PATH, finalized.clone()),
                Exchange::ok(Method::POST, EVENTS_PATH, serde_json::json!({})),
                // Answered with the applied object, which the test fills in below.
                Exchange::ok(Method::PATCH, STATUS_PATH, finalized.clone()),
            ],
        );
        let lifecycle = Arc::new(FakeApi::default());
        let r = reconciler(client, lifecycle.clone(), true);
        // The first pass adds the finalizer and nothing else: its patch is a change the
        // controller sees, and the next pass deploys.
        let action = r.reconcile(cr(fresh.clone())).await.unwrap();
        assert_eq!(action, Action::await_change());
        assert!(lifecycle.calls().is_empty());
        let action = r.reconcile(cr(finalized)).await.unwrap();
        assert_eq!(action, Action::requeue(Duration::from_secs(300)));
        assert_eq!(lifecycle.calls(), ["deploy chat-a"]);
        let seen = server.await.unwrap();
        // The finalizer, guarded by a test of the finalizers list read (none).
        assert_eq!(
            seen[0].body,
            serde_json::json!([
                {"op": "test", "path": "/metadata/finalizers", "value": null},
                {"op": "add", "path": "/metadata/finalizers", "value": [FINALIZER]},
            ])
        );
        let mut unset = fresh.clone();
        unset["metadata"]
            .as_object_mut()
            .unwrap()
            .remove("finalizers");
        assert_eq!(
            json_patched(&unset, &seen[0])["metadata"]["finalizers"],
            serde_json::json!([FINALIZER])
        );
        // The Event.
        assert_eq!(seen[1].body["reason"], "Deployed");
        assert_eq!(seen[1].body["regarding"]["name"], "chat-a");
        assert_eq!(seen[1].body["reportingController"], CONTROLLER_NAME);
        // The status: server-side apply with the one field manager, forced.
        let apply = &seen[2];
        assert_eq!(
            apply.content_type.as_deref(),
            Some("application/apply-patch+yaml")
        );
        assert!(
            apply.query.contains("fieldManager=capyctl-operator"),
            "{}",
            apply.query
        );
        assert!(apply.query.contains("force=true"), "{}", apply.query);
        let status = &apply.body["status"];
        assert_eq!(status["deploymentId"], "01KCHAT-A");
        assert_eq!(status["revision"], 1);
        assert_eq!(status["observedGeneration"], 1);
        assert_eq!(status["state"], "stopped");
        assert_eq!(status["ready"], "0/1");
        assert_eq!(status["hosts"], "gpu-1");
        let parkable = status["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Parkable")
            .unwrap();
        assert_eq!(parkable["status"], "Unknown");
    }

    #[tokio::test]
    async fn an_unchanged_status_is_not_written_again() {
        let (client, handle) = mock::client();
        let finalized = cr_json(&[FINALIZER], 1, spec());
        let lifecycle = Arc::new(FakeApi::default());
        // First pass: the apply is answered with the status it carried.
        let (status_tx, status_rx) = tokio::sync::oneshot::channel::<serde_json::Value>();
        let server = {
            let finalized = finalized.clone();
            tokio::spawn(async move {
                let mut handle = handle;
                handle
                    .answer(Exchange::with(Method::PATCH, STATUS_PATH, move |call| {
                        let answer = with_status(finalized, &call.body["status"]);
                        status_tx.send(call.body["status"].clone()).unwrap();
                        (200, answer)
                    }))
                    .await;
                // Nothing else may come before the client is dropped.
                if let Some((call, _)) = handle.next_call().await {
                    panic!("a second call: {call}");
                }
            })
        };
        let r = reconciler(client, lifecycle.clone(), false);
        r.reconcile(cr(finalized.clone())).await.unwrap();
        let written = status_rx.await.unwrap();
        // The watch delivers the object with its status; reconciling it again, and syncing
        // with no change in the lifecycle, writes nothing (the mock would see a call).
        r.reconcile(cr(with_status(finalized.clone(), &written)))
            .await
            .unwrap();
        r.sync_status().await;
        assert_eq!(lifecycle.calls(), ["deploy chat-a", "deploy chat-a"]);
        drop(r);
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_new_reconciler_trusts_the_status_the_cr_carries() {
        // After a restart or failover: the CR's status is what the server holds; the same facts
        // again write nothing. The status is computed once to know what "the same" is.
        let lifecycle = Arc::new(FakeApi::default());
        let (client, handle) = mock::client();
        let finalized = cr_json(&[FINALIZER], 1, spec());
        let server = mock::serve(
            handle,
            vec![Exchange::ok(Method::PATCH, STATUS_PATH, finalized.clone())],
        );
        let first = reconciler(client, lifecycle.clone(), false);
        first.reconcile(cr(finalized.clone())).await.unwrap();
        let seen = server.await.unwrap();
        let status = seen[0].body["status"].clone();

        let (client, handle) = mock::client();
        let server = mock::serve(handle, vec![]);
        let second = reconciler(client, lifecycle.clone(), false);
        second
            .reconcile(cr(with_status(finalized, &status)))
            .await
            .unwrap();
        assert!(server.await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_changed_generation_redeploys_and_moves_observed_generation() {
        let lifecycle = Arc::new(FakeApi::default());
        let (client, handle) = mock::client();
        let v1 = cr_json(&[FINALIZER], 1, spec());
        let v2 = cr_json(
            &[FINALIZER],
            2,
            serde_json::json!({"engine": "vllm", "model": "Qwen3-4B", "maxConcurrentRequests": 8}),
        );
        let server = mock::serve(
            handle,
            vec![
                Exchange::ok(Method::PATCH, STATUS_PATH, v1.clone()),
                Exchange::ok(Method::PATCH, STATUS_PATH, v2.clone()),
            ],
        );
        let r = reconciler(client, lifecycle.clone(), false);
        r.reconcile(cr(v1)).await.unwrap();
        r.reconcile(cr(v2)).await.unwrap();
        let seen = server.await.unwrap();
        assert_eq!(seen[1].body["status"]["revision"], 2);
        assert_eq!(seen[1].body["status"]["observedGeneration"], 2);
        let spec = &lifecycle.deps.lock().unwrap()["chat-a"].spec;
        assert_eq!(spec.max_concurrent_requests, Some(8));
    }

    /// `kubectl scale` changes `spec.replicas` through the scale subresource (a new
    /// generation, like any spec change): redeployed with the new replicas, and the status's
    /// `replicas` and READY follow; one below `scale.min` is refused and the running replicas
    /// stay in the status.
    #[tokio::test]
    async fn a_scaled_cr_redeploys_its_replicas_and_the_status_follows() {
        let lifecycle = Arc::new(FakeApi::default());
        let (client, handle) = mock::client();
        let with = |generation: i64, replicas: u32| {
            cr_json(
                &[FINALIZER],
                generation,
                serde_json::json!({"engine": "vllm", "model": "Qwen3-4B",
                                   "scale": {"min": 2}, "replicas": replicas}),
            )
        };
        // As the API server keeps it: `replicas: 2` written by the user, then scaled to 3,
        // then to 1 (below scale.min).
        let (v1, v2, v3) = (with(1, 2), with(2, 3), with(3, 1));
        let server = mock::serve(
            handle,
            vec![
                Exchange::ok(Method::PATCH, STATUS_PATH, v1.clone()),
                Exchange::ok(Method::PATCH, STATUS_PATH, v2.clone()),
                Exchange::ok(Method::PATCH, STATUS_PATH, v3.clone()),
            ],
        );
        let r = reconciler(client, lifecycle.clone(), false);
        r.reconcile(cr(v1)).await.unwrap();
        r.reconcile(cr(v2)).await.unwrap();
        let replicas = |l: &FakeApi| l.deps.lock().unwrap()["chat-a"].spec.replicas();
        assert_eq!(replicas(&lifecycle), 3);
        r.reconcile(cr(v3)).await.unwrap();
        assert_eq!(replicas(&lifecycle), 3, "a refused scale changes nothing");
        let seen = server.await.unwrap();
        let status = |i: usize| seen[i].body["status"].clone();
        assert_eq!(
            (
                &status(0)["replicas"],
                &status(0)["readyReplicas"],
                &status(0)["ready"]
            ),
            (
                &serde_json::json!(2),
                &serde_json::json!(0),
                &serde_json::json!("0/2")
            )
        );
        assert_eq!(
            (
                &status(1)["replicas"],
                &status(1)["ready"],
                &status(1)["revision"]
            ),
            (
                &serde_json::json!(3),
                &serde_json::json!("0/3"),
                &serde_json::json!(2)
            )
        );
        assert_eq!(status(1)["observedGeneration"], 2);
        // Refused: still 3 replicas of generation 2, and why.
        assert_eq!(status(2)["replicas"], 3);
        assert_eq!(status(2)["observedGeneration"], 2);
        let why = refusal(&status(2));
        assert!(
            why.contains("spec.scale.min: 2 is above replicas (1)"),
            "{why}"
        );
    }

    /// The message of a status's `Accepted=False` condition.
    fn refusal(status: &serde_json::Value) -> String {
        let accepted = status["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Accepted")
            .unwrap();
        assert_eq!(accepted["status"], "False");
        accepted["message"].as_str().unwrap().to_string()
    }

    #[tokio::test]
    async fn a_bad_spec_is_refused_and_changes_nothing() {
        let lifecycle = Arc::new(FakeApi::default());
        let (client, handle) = mock::client();
        let good = cr_json(&[FINALIZER], 1, spec());
        let bad = cr_json(
            &[FINALIZER],
            2,
            serde_json::json!({"engine": "vllm", "model": "Qwen3-4B", "maxConcurrentRequests": 0}),
        );
        let server = mock::serve(
            handle,
            vec![
                Exchange::ok(Method::PATCH, STATUS_PATH, good.clone()),
                Exchange::ok(Method::POST, EVENTS_PATH, serde_json::json!({})),
                Exchange::ok(Method::PATCH, STATUS_PATH, bad.clone()),
            ],
        );
        let r = reconciler(client.clone(), lifecycle.clone(), false);
        r.reconcile(cr(good)).await.unwrap();
        let r = Reconciler {
            recorder: Some(Reconciler::recorder(client, None)),
            ..r
        };
        r.reconcile(cr(bad)).await.unwrap();
        let seen = server.await.unwrap();
        assert_eq!(seen[1].body["type"], "Warning");
        assert_eq!(seen[1].body["reason"], "Refused");
        let status = &seen[2].body["status"];
        // Still revision 1 of generation 1, and why not 2.
        assert_eq!(status["revision"], 1);
        assert_eq!(status["observedGeneration"], 1);
        let why = refusal(status);
        assert!(why.contains("spec.maxConcurrentRequests"), "{why}");
        assert_eq!(lifecycle.calls(), ["deploy chat-a"]);
    }

    #[tokio::test]
    async fn deletion_deletes_from_the_lifecycle_then_removes_the_finalizer() {
        let lifecycle = Arc::new(FakeApi::default());
        let (client, handle) = mock::client();
        let live = cr_json(&["other.io/keep", FINALIZER], 1, spec());
        let mut deleting = live.clone();
        deleting["metadata"]["deletionTimestamp"] = "2026-12-03T08:00:00Z".into();
        let server = mock::serve(
            handle,
            vec![
                Exchange::ok(Method::PATCH, STATUS_PATH, live.clone()),
                Exchange::ok(Method::PATCH, CR_PATH, live.clone()),
            ],
        );
        let r = reconciler(client, lifecycle.clone(), false);
        r.reconcile(cr(live)).await.unwrap();
        let action = r.reconcile(cr(deleting.clone())).await.unwrap();
        assert_eq!(action, Action::await_change());
        assert_eq!(lifecycle.calls(), ["deploy chat-a", "delete chat-a"]);
        assert!(lifecycle.deps.lock().unwrap().is_empty());
        let seen = server.await.unwrap();
        // Only our finalizer goes, by its index, guarded by a test that it is ours there;
        // another's stays.
        assert_eq!(
            seen[1].body,
            serde_json::json!([
                {"op": "test", "path": "/metadata/finalizers/1", "value": FINALIZER},
                {"op": "remove", "path": "/metadata/finalizers/1"},
            ])
        );
        assert_eq!(
            json_patched(&deleting, &seen[1])["metadata"]["finalizers"],
            serde_json::json!(["other.io/keep"])
        );
        // Forgotten: a sync reads nothing.
        r.sync_status().await;
    }

    #[tokio::test]
    async fn the_finalizer_goes_after_the_others_and_a_changed_list_deploys_nothing() {
        let lifecycle = Arc::new(FakeApi::default());
        let (client, handle) = mock::client();
        let other = cr_json(&["other.io/keep"], 1, spec());
        // The server's list changed since it was read: the `test` fails (422).
        let server = mock::serve(
            handle,
            vec![Exchange::new(
                Method::PATCH,
                CR_PATH,
                422,
                status_body(
                    422,
                    "Invalid",
                    "the server rejected our request: test failed",
                ),
            )],
        );
        let r = reconciler(client, lifecycle.clone(), false);
        let err = r.reconcile(cr(other.clone())).await.unwrap_err();
        assert!(
            matches!(
                err,
                ReconcileError::Finalizer {
                    action: "adding",
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(
            err.to_string()
                .starts_with("adding the finalizer capyctl.io/finalizer: "),
            "{err}"
        );
        assert_eq!(err.metric_label(), "kube");
        assert!(lifecycle.calls().is_empty());
        let seen = server.await.unwrap();
        assert_eq!(
            seen[0].body,
            serde_json::json!([
                {"op": "test", "path": "/metadata/finalizers", "value": ["other.io/keep"]},
                {"op": "add", "path": "/metadata/finalizers/-", "value": FINALIZER},
            ])
        );
        assert_eq!(
            json_patched(&other, &seen[0])["metadata"]["finalizers"],
            serde_json::json!(["other.io/keep", FINALIZER])
        );
    }

    #[tokio::test]
    async fn a_failed_lifecycle_delete_keeps_the_finalizer() {
        let failing = FakeApi {
            delete_error: Some(ApiError::Internal {
                detail: "the host agent did not answer".into(),
            }),
            ..FakeApi::default()
        };
        let (client, handle) = mock::client();
        let server = mock::serve(handle, vec![]);
        let r = Reconciler::new(
            Arc::new(failing),
            Api::namespaced(client, "capyctl"),
            None,
            None,
            ReconcilerConfig::default(),
        );
        let mut deleting = cr_json(&[FINALIZER], 1, spec());
        deleting["metadata"]["deletionTimestamp"] = "2026-12-03T08:00:00Z".into();
        let err = r.reconcile(cr(deleting)).await.unwrap_err();
        assert_eq!(err.metric_label(), "internal");
        // No call to the API server: the finalizer stays until the lifecycle let go.
        assert!(server.await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_deleted_cr_already_gone_from_the_lifecycle_still_loses_its_finalizer() {
        let lifecycle = Arc::new(FakeApi::default());
        let (client, handle) = mock::client();
        let mut deleting = cr_json(&[FINALIZER], 1, spec());
        deleting["metadata"]["deletionTimestamp"] = "2026-12-03T08:00:00Z".into();
        let server = mock::serve(
            handle,
            vec![Exchange::new(
                Method::PATCH,
                CR_PATH,
                404,
                status_body(404, "NotFound", "gone"),
            )],
        );
        let r = reconciler(client, lifecycle.clone(), false);
        assert_eq!(
            r.reconcile(cr(deleting)).await.unwrap(),
            Action::await_change()
        );
        assert_eq!(lifecycle.calls(), ["delete chat-a"]);
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_park_in_the_lifecycle_writes_the_status_and_an_event() {
        let lifecycle = Arc::new(FakeApi::default());
        let (client, handle) = mock::client();
        let finalized = cr_json(&[FINALIZER], 1, spec());
        let server = mock::serve(
            handle,
            vec![
                Exchange::ok(Method::PATCH, STATUS_PATH, finalized.clone()),
                Exchange::ok(Method::POST, EVENTS_PATH, serde_json::json!({})),
                Exchange::ok(Method::PATCH, STATUS_PATH, finalized.clone()),
                Exchange::ok(Method::POST, EVENTS_PATH, serde_json::json!({})),
                Exchange::ok(Method::PATCH, STATUS_PATH, finalized.clone()),
            ],
        );
        let r = reconciler(client.clone(), lifecycle.clone(), false);
        r.reconcile(cr(finalized)).await.unwrap();
        let r = Reconciler {
            recorder: Some(Reconciler::recorder(client, None)),
            ..r
        };
        lifecycle.set_state("chat-a", InstanceState::Ready, None);
        r.sync_status().await;
        lifecycle.set_state("chat-a", InstanceState::Parked, Some("host_ram"));
        r.sync_status().await;
        // Nothing changed since: nothing written, nothing told.
        r.sync_status().await;
        let seen = server.await.unwrap();
        assert_eq!(seen[1].body["reason"], "Started");
        assert_eq!(seen[2].body["status"]["state"], "ready");
        assert_eq!(seen[3].body["reason"], "Parked");
        assert!(seen[3].body["note"].as_str().unwrap().contains("host_ram"));
        assert_eq!(seen[4].body["status"]["state"], "parked");
        assert_eq!(
            seen[4].body["status"]["instances"][0]["residency"],
            "host_backed"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_feed_tells_a_quick_park_and_wake_switches_and_throttled_refusals() {
        let lifecycle = Arc::new(FakeApi::default());
        let (client, handle) = mock::client();
        let finalized = cr_json(&[FINALIZER], 1, spec());
        let mut script = vec![Exchange::ok(Method::PATCH, STATUS_PATH, finalized.clone())];
        // Parked, Woken, Switched, RequestRefused; RequestRefused again after the pause (the
        // recorder makes it a series of the first: a patch).
        for _ in 0..4 {
            script.push(Exchange::ok(
                Method::POST,
                EVENTS_PATH,
                serde_json::json!({}),
            ));
        }
        script.push(Exchange::ok_under(
            Method::PATCH,
            &format!("{EVENTS_PATH}/chat-a."),
            serde_json::json!({}),
        ));
        let server = mock::serve(handle, script);
        let r = reconciler(client.clone(), lifecycle.clone(), false);
        r.reconcile(cr(finalized)).await.unwrap();
        let r = Reconciler {
            recorder: Some(Reconciler::recorder(client, None)),
            ..r
        };
        let base = lifecycle.deps.lock().unwrap()["chat-a"].clone();
        let ready = with_instance(&base, InstanceState::Ready, 0, None);
        let mut parked = with_instance(&base, InstanceState::Parked, 0, None);
        parked.instances[0].parked_tier = Some("host_ram".into());
        // Told first as ready (a start told elsewhere), then parked and woken within
        // milliseconds: both are told.
        r.tell(&ready);
        r.handle(Observed::View(Box::new(parked.clone()))).await;
        r.handle(Observed::View(Box::new(parked))).await;
        r.handle(Observed::View(Box::new(ready))).await;
        r.handle(Observed::Switched {
            switch_id: "sw-9".into(),
            target: "chat-a".into(),
            victims: vec![("chat-b".into(), "parked (host_ram)".into())],
        })
        .await;
        let refused = || Observed::Refused {
            deployment: "chat-a".into(),
            by: "Request",
            code: "deployment_inactive",
            message: "deployment 01KCHAT-A is not running and its activation is explicit".into(),
        };
        r.handle(refused()).await;
        r.handle(refused()).await;
        tokio::time::advance(REFUSAL_EVERY).await;
        r.handle(refused()).await;
        // Unknown deployments are not told.
        r.handle(Observed::Refused {
            deployment: "nobody".into(),
            by: "Request",
            code: "deployment_inactive",
            message: String::new(),
        })
        .await;
        let seen = server.await.unwrap();
        let reasons: Vec<&str> = seen[1..]
            .iter()
            .map(|c| c.body["reason"].as_str().unwrap())
            .collect();
        assert_eq!(
            reasons,
            [
                "Parked",
                "Woken",
                "Switched",
                "RequestRefused",
                "RequestRefused"
            ]
        );
        assert_eq!(seen[5].body["series"]["count"], 2);
        assert_eq!(
            seen[3].body["note"],
            "switch sw-9: chat-b parked (host_ram) for chat-a"
        );
        assert_eq!(seen[4].body["type"], "Warning");
        assert_eq!(seen[4].body["action"], "Serve");
        assert!(
            seen[4].body["note"]
                .as_str()
                .unwrap()
                .starts_with("deployment_inactive: "),
            "{}",
            seen[4].body["note"]
        );
    }

    fn ns_path(ns: &str, rest: &str) -> String {
        format!("/apis/capyctl.io/v1alpha1/namespaces/{ns}/deployments/chat-a{rest}")
    }

    fn cr_in(ns: &str, created: &str, finalizers: &[&str], model: &str) -> serde_json::Value {
        let mut v = cr_json(
            finalizers,
            1,
            serde_json::json!({"engine": "vllm", "model": model}),
        );
        v["metadata"]["namespace"] = ns.into();
        v["metadata"]["uid"] = format!("uid-{ns}").into();
        v["metadata"]["creationTimestamp"] = created.into();
        v
    }

    fn watching(client: kube::Client, lifecycle: Arc<FakeApi>, claims: Arc<Claims>) -> Reconciler {
        let watch = Watch::parse("capyctl", "team-a,team-b", "test").unwrap();
        Reconciler::new(
            lifecycle,
            Api::namespaced(client.clone(), "capyctl"),
            Some(Reconciler::recorder(client, None)),
            None,
            ReconcilerConfig::default(),
        )
        .with_watch(&watch, claims)
    }

    #[tokio::test]
    async fn a_name_another_namespace_holds_is_refused_naming_it_and_taken_over_when_it_goes() {
        let lifecycle = Arc::new(FakeApi::default());
        let claims = Arc::new(Claims::default());
        let a = cr_in("team-a", "2026-12-01T00:00:00Z", &[FINALIZER], "model-a");
        let b = cr_in("team-b", "2026-12-02T00:00:00Z", &[FINALIZER], "model-b");
        let mut a_deleting = a.clone();
        a_deleting["metadata"]["deletionTimestamp"] = "2026-12-03T08:00:00Z".into();
        let events = |ns: &str| format!("/apis/events.k8s.io/v1/namespaces/{ns}/events");
        let (client, handle) = mock::client();
        let server = mock::serve(
            handle,
            vec![
                // team-a's object: deployed, its status written in team-a.
                Exchange::ok(Method::POST, &events("team-a"), serde_json::json!({})),
                Exchange::ok(Method::PATCH, &ns_path("team-a", "/status"), a.clone()),
                // team-b's: the holder is read (still there), then refused in team-b.
                Exchange::ok(Method::GET, &ns_path("team-a", ""), a.clone()),
                Exchange::ok(Method::POST, &events("team-b"), serde_json::json!({})),
                Exchange::ok(Method::PATCH, &ns_path("team-b", "/status"), b.clone()),
                // team-a's deleted: the deployment goes, then the finalizer.
                Exchange::ok(Method::POST, &events("team-a"), serde_json::json!({})),
                Exchange::ok(Method::PATCH, &ns_path("team-a", ""), a.clone()),
                // team-b's, reconciled again: now it holds the name and is deployed.
                Exchange::ok(Method::POST, &events("team-b"), serde_json::json!({})),
                Exchange::ok(Method::PATCH, &ns_path("team-b", "/status"), b.clone()),
            ],
        );
        let r = watching(client, lifecycle.clone(), claims.clone());
        let mut moved = r.retrigger.subscribe();
        r.reconcile(cr(a.clone())).await.unwrap();
        moved.borrow_and_update();
        r.reconcile(cr(b.clone())).await.unwrap();
        // Refused: nothing reached the lifecycle, the name did not move.
        assert_eq!(lifecycle.calls(), ["deploy chat-a"]);
        assert_eq!(
            lifecycle.deps.lock().unwrap()["chat-a"].spec.model_arg(),
            "model-a"
        );
        assert!(!moved.has_changed().unwrap());
        r.reconcile(cr(a_deleting.clone())).await.unwrap();
        assert_eq!(lifecycle.calls(), ["deploy chat-a", "delete chat-a"]);
        // The name moved: every object is reconciled again.
        assert!(moved.has_changed().unwrap());
        assert_eq!(claims.holder("chat-a").as_deref(), Some("team-b"));
        r.reconcile(cr(b)).await.unwrap();
        assert_eq!(
            lifecycle.calls(),
            ["deploy chat-a", "delete chat-a", "deploy chat-a"]
        );
        assert_eq!(
            lifecycle.deps.lock().unwrap()["chat-a"].spec.model_arg(),
            "model-b"
        );

        let seen = server.await.unwrap();
        let taken = &seen[4].body["status"];
        let accepted = &taken["conditions"][0];
        assert_eq!(accepted["type"], "Accepted");
        assert_eq!(accepted["status"], "False");
        assert_eq!(accepted["reason"], "name_taken");
        assert!(
            accepted["message"]
                .as_str()
                .unwrap()
                .contains("taken by the Deployment object team-a/chat-a"),
            "{accepted}"
        );
        assert!(taken.get("deploymentId").is_none(), "{taken}");
        assert_eq!(seen[3].body["reason"], "NameTaken");
        assert_eq!(seen[3].body["type"], "Warning");
        assert_eq!(seen[5].body["reason"], "Deleted");
        assert_eq!(
            json_patched(&a_deleting, &seen[6])["metadata"]["finalizers"],
            serde_json::json!([])
        );
        assert_eq!(seen[7].body["reason"], "Deployed");
        assert_eq!(seen[8].body["status"]["deploymentId"], "01KCHAT-A");
        assert!(
            seen[8].body["status"]["conditions"]
                .as_array()
                .unwrap()
                .iter()
                .all(|c| c["type"] != "Accepted")
        );
    }

    #[tokio::test]
    async fn deleting_an_object_refused_for_its_name_leaves_the_holders_deployment() {
        let lifecycle = Arc::new(FakeApi::default());
        let claims = Arc::new(Claims::default());
        let a = cr_in("team-a", "2026-12-01T00:00:00Z", &[FINALIZER], "model-a");
        let mut b = cr_in("team-b", "2026-12-02T00:00:00Z", &[FINALIZER], "model-b");
        b["metadata"]["deletionTimestamp"] = "2026-12-03T08:00:00Z".into();
        claims.seed([&*cr(a.clone()), &*cr(b.clone())]);
        let (client, handle) = mock::client();
        let server = mock::serve(
            handle,
            vec![Exchange::ok(
                Method::PATCH,
                &ns_path("team-b", ""),
                b.clone(),
            )],
        );
        let r = watching(client, lifecycle.clone(), claims.clone());
        r.reconcile(cr(b.clone())).await.unwrap();
        // Only its finalizer went; the lifecycle was not asked.
        assert!(lifecycle.calls().is_empty());
        assert_eq!(claims.holder("chat-a").as_deref(), Some("team-a"));
        let seen = server.await.unwrap();
        assert_eq!(
            json_patched(&b, &seen[0])["metadata"]["finalizers"],
            serde_json::json!([])
        );
    }

    #[tokio::test]
    async fn a_holder_gone_unseen_frees_the_name() {
        // team-a's object lost its finalizer by hand and is gone: team-b's finds out when it
        // reads it, and takes the name.
        let lifecycle = Arc::new(FakeApi::default());
        let claims = Arc::new(Claims::default());
        let a = cr_in("team-a", "2026-12-01T00:00:00Z", &[FINALIZER], "model-a");
        let b = cr_in("team-b", "2026-12-02T00:00:00Z", &[FINALIZER], "model-b");
        claims.seed([&*cr(a), &*cr(b.clone())]);
        let (client, handle) = mock::client();
        let server = mock::serve(
            handle,
            vec![Exchange::new(
                Method::GET,
                &ns_path("team-a", ""),
                404,
                status_body(404, "NotFound", "gone"),
            )],
        );
        let r = watching(client, lifecycle.clone(), claims.clone());
        let mut moved = r.retrigger.subscribe();
        let action = r.reconcile(cr(b)).await.unwrap();
        assert_eq!(action, Action::requeue(Duration::ZERO));
        assert!(moved.has_changed().unwrap());
        moved.borrow_and_update();
        assert_eq!(claims.holder("chat-a").as_deref(), Some("team-b"));
        assert!(lifecycle.calls().is_empty());
        server.await.unwrap();
    }

    fn with_instance(
        v: &DeploymentView,
        state: InstanceState,
        generation: u64,
        error: Option<&str>,
    ) -> DeploymentView {
        let mut v = v.clone();
        v.state = state;
        v.instances[0].state = state;
        v.instances[0].generation = generation;
        v.instances[0].last_error = error.map(str::to_string);
        v
    }

    #[test]
    fn happenings_tell_parks_wakes_starts_stops_and_failures() {
        let doc = capyctl_spec::documents::parse_deployment_str(
            "t.yaml",
            "name: chat-a\nengine: vllm\nmodel: m\n",
        )
        .unwrap();
        let base = view_of(&doc, 1);
        let reasons = |a: &DeploymentView, b: &DeploymentView| -> Vec<&'static str> {
            happenings(Some(a), b).iter().map(|h| h.reason).collect()
        };
        let stopped = with_instance(&base, InstanceState::Stopped, 1, None);
        let ready = with_instance(&base, InstanceState::Ready, 1, None);
        let parked = with_instance(&base, InstanceState::Parked, 1, None);
        let waking = with_instance(&base, InstanceState::Waking, 1, None);
        assert_eq!(reasons(&stopped, &ready), ["Started"]);
        assert_eq!(reasons(&ready, &parked), ["Parked"]);
        assert_eq!(reasons(&parked, &ready), ["Woken"]);
        assert_eq!(reasons(&waking, &ready), ["Woken"]);
        assert_eq!(reasons(&parked, &stopped), ["Stopped"]);
        assert!(reasons(&ready, &ready).is_empty());
        let wake_failed = with_instance(
            &base,
            InstanceState::Failed,
            1,
            Some("wake_mismatch: the answer differs"),
        );
        let h = happenings(Some(&waking), &wake_failed);
        assert_eq!(h[0].reason, "WakeFailed");
        assert!(h[0].warning);
        assert_eq!(h[0].to_event().type_, EventType::Warning);
        let crashed = with_instance(
            &base,
            InstanceState::Failed,
            1,
            Some("engine exited with status 1"),
        );
        assert_eq!(reasons(&ready, &crashed), ["EngineFailed"]);
        // A restart into a new generation is a start, not a wake.
        let restarted = with_instance(&base, InstanceState::Ready, 2, None);
        assert_eq!(reasons(&parked, &restarted), ["Started"]);
    }

    #[test]
    fn a_receipt_with_a_switch_tells_its_victims() {
        let doc = capyctl_spec::documents::parse_deployment_str(
            "t.yaml",
            "name: chat-a\nengine: vllm\nmodel: m\n",
        )
        .unwrap();
        let receipt = ActionReceipt {
            action: "start".into(),
            deployment: view_of(&doc, 1),
            switch_id: Some("sw-7".into()),
            victims: vec![capyctl_spec::api::Victim {
                deployment_id: "01KB".into(),
                name: "chat-b".into(),
                instance_id: "01KB-0".into(),
                released: capyctl_spec::api::Released::StoppedNoRoomToPark,
            }],
        };
        let h = Happening::from_receipt(&receipt).unwrap();
        assert_eq!(h.reason, "Switched");
        assert_eq!(
            h.note,
            "switch sw-7: chat-b stopped (no room to park) for chat-a"
        );
        let none = ActionReceipt {
            switch_id: None,
            victims: vec![],
            ..receipt
        };
        assert!(Happening::from_receipt(&none).is_none());
    }
}
