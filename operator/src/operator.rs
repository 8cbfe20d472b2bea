//! `capyctl-operator`: the server on Kubernetes, leader-elected.
//!
//! [`run`] runs until its shutdown future fires:
//!
//! - always: the Lease election ([`super::leader`]) and the management listener, which answers
//!   `/healthz` and `/readyz` on every replica and the management API on the leader (a standby
//!   answers it 500 `internal`, "this replica is the standby"). With the leader label
//!   (`CAPYCTL_LEADER_LABEL`, which the Services select the leader by) a replica first removes
//!   the label from its own Pod (a leader killed in the same Pod leaves it), and only then is a
//!   standby ready and takes part in the election; without the label only the leader is
//!   ready (see [`SwitchableApi`]);
//! - while leading ([`lead`]): the node agent (found by `--node-agent`, else as the one Running
//!   node agent Pod of the namespace; with its `pod` engine runtime wrapped in
//!   [`PodHostAgent`], which creates and deletes the engine Pods), the lifecycle (its records rebuilt from the CRs,
//!   [`super::store::CrStore`]; the agent's recovery adopts the engines the previous leader
//!   left), the router and the inference listener, the reconciler, its status sync and its
//!   Events (the router's lifecycle and the management API observed: [`super::events`]), and
//!   the leader label on the replica's own Pod.
//!
//! A leader that loses the Lease stops everything it started and [`run`] returns
//! [`OperatorError::LostLeadership`]: crash-only, the process exits and comes back as a standby
//! (the engines keep running for the next leader to adopt). A shutdown releases the Lease.
//! Either way the inference listener first finishes the answers in progress for its shutdown
//! grace, and just before the grace ends the requests still waiting for a switch are answered
//! 503 `unavailable` instead of losing their connections ([`refuse_waiting_after`]). With the
//! leader label the stopping leader stays ready and labelled, its inference port answering new
//! requests 503 `unavailable`, until the next leader is labelled and Ready (at most
//! [`super::handover::LINGER_MAX`] after the Lease is released): the router Service is never
//! without an endpoint across a takeover ([`super::handover`] says why).
//!
//! A leader that cannot reach the API server is **held over** (see [`super::leader`]) instead
//! of losing the Lease at its renew deadline: [`follow_holdover`] tells the lifecycle to hold
//! every switch (`Core::hold_switches`: its ready models serve on, a request that needs a
//! switch and every operator command that changes something get 503 `unavailable`, "the
//! Kubernetes API server cannot be reached; …", with `Retry-After`), and [`SwitchableApi`]
//! refuses the changes of the management API with the same answer; engine exits are still
//! recorded. A renewal ends it: switching resumes and the reconciler writes every CR's status
//! again (what changed meanwhile could not be written). The Lease read naming another holder,
//! or `renew_deadline + holdover` without a renewal, ends the leadership as above. A leader
//! that took the Lease over from one that did not release it fences what it adopted as ready
//! (`Core::fence`) until its takeover plus `holdover`: those instances serve at once but
//! are not parked or stopped (not victims, no idle timer, an operator's park or stop is 503
//! `unavailable` naming the fence's end) before the old leader's hold-over has surely ended.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use capyctl_crds::{Deployment, Host};
use capyctl_node_agent::HostAgent;
use capyctl_node_agent::remote::{RemoteConfig, RemoteHostAgent};
use capyctl_node_agent::spec::HostSettings;
use capyctl_router::coordinator::CoordinatorHandle;
use capyctl_router::proxy::ProxyConfig;
use capyctl_router::tenants::Tenants;
use capyctl_spec::Activation;
use capyctl_spec::api::{
    ActionReceipt, DeployReceipt, DeploymentList, DeploymentView, EngineList, HostDrainReceipt,
    HostList, LoadReport, StartRequest,
};
use capyctl_spec::documents::DeploymentDoc;
use capyctl_spec::errors::ApiError;
use capyctl_spec::settings::{HostConfig, Mode, QueueSettings, ServerConfig};
use futures_util::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::runtime::WatchStreamExt;
use kube::{Api, Client, ResourceExt};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::engines::PodHostAgent;
use super::events::{EventFeed, FEED_CAPACITY, ObservedApi, ObservedLifecycle, Views};
use super::leader::{
    LeaderElector, Leadership, LeaseConfig, clear_leader_label, deployment_owner, set_leader_label,
};
use super::pods::EnginePodSettings;
use super::reconcile::{Reconciler, ReconcilerConfig};
use super::store::CrStore;
use super::watch::{Claims, Watch};
use capyctl_lifecycle::api::{BoxFuture, JsonParts, ManagementApi};
use capyctl_lifecycle::metrics::Metrics;
use capyctl_lifecycle::{Core, HostEntry};
use capyctl_server::assembly::{
    Assembly, BindError, FirstHost, Inference, assemble, bind, lifecycle_config, proxy_config,
    router_config,
};
use capyctl_server::management::ManagementOptions;

/// How often the leader looks for node agents that joined or moved.
pub const NODE_AGENT_RECHECK: Duration = Duration::from_secs(10);

/// Between two tries to remove a stale leader label from the replica's own Pod.
pub const LABEL_RETRY: Duration = Duration::from_secs(2);

/// The label selector of the node agent Pods (the chart's `component: node-agent`).
pub const NODE_AGENT_SELECTOR: &str = "app.kubernetes.io/component=node-agent";

/// Everything `capyctl-operator` runs with.
#[derive(Debug, Clone)]
pub struct OperatorOptions {
    /// The server document, resolved (listeners, drain and wake timeouts, idle timers).
    pub server: ServerConfig,
    /// The operator's own namespace (`POD_NAMESPACE`, the release namespace): engine Pods,
    /// Lease, node agents, and Deployment objects.
    pub namespace: String,
    /// The namespaces whose Deployment objects are reconciled (`--watch-namespaces`): the
    /// release namespace, and a list or every namespace.
    pub watch: Watch,
    /// The election's settings (`CAPYCTL_LEASE_NAME`, `POD_NAME`).
    pub lease: LeaseConfig,
    /// `CAPYCTL_LEADER_LABEL`: the label the leader sets on its own Pod; `None` = none.
    pub leader_label: Option<String>,
    /// The node agent's URL (`--node-agent`); `None` = the one Running node agent Pod.
    pub node_agent_url: Option<String>,
    /// The node agents' port (`CAPYCTL_NODE_AGENT_PORT`), for a node agent found by its Pod.
    pub node_agent_port: u16,
    /// The token the operator and the node agents share.
    pub agent_token: String,
    /// The admin token of the management API.
    pub admin_token: String,
    /// The reconciler's timing.
    pub reconciler: ReconcilerConfig,
    /// How engine Pods are built (`CAPYCTL_ENGINE_PODS_FILE`), for a node agent with the
    /// `pod` engine runtime.
    pub engine_pods: EnginePodSettings,
    /// The server's metrics (the management listener's `/metrics`); the Kubernetes client's
    /// calls are observed into them too (see [`super::api_client`]).
    pub metrics: Arc<Metrics>,
    /// The host document the chart renders for the node agents (`CAPYCTL_HOST_FILE`): the
    /// engines' commands and environment of engine Pods, and the resource policy and
    /// activation until the node's `Host` object says them (see [`HostPolicy`]).
    pub host: Option<HostConfig>,
    /// Both listeners' TLS (`server.listen.tls`, read by
    /// `capyctl_router::tls::listen_config`); `None`: plain HTTP.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// Where the leader keeps its switch records across its restarts (`<data dir>/switches.jsonl`;
    /// the chart's data directory is the Pod's `emptyDir`, which a container restart keeps and a
    /// new Pod, or the standby taking over, does not); `None`: in memory only.
    pub switch_log: Option<std::path::PathBuf>,
}

/// What the router and the lifecycle take from the host: its queue settings and activation.
///
/// They come from the node's `Host` object (what its node agent applies, its own overrides
/// included); before the agent has published it, from the host document the chart renders for
/// the agents (`CAPYCTL_HOST_FILE`); without either, from the defaults. While it leads, the
/// operator watches the `Host` object: when it says another policy (a `helm upgrade` of
/// `host.resource_policy.queue.*` or `host.lifecycle.activation` rolls the node agents, which
/// publish the new one), the leader steps down ([`OperatorError::HostPolicyChanged`]) and the
/// next leader runs the router with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostPolicy {
    /// `resource_policy.queue.*`.
    pub queue: QueueSettings,
    /// `lifecycle.activation`.
    pub activation: Activation,
}

impl HostPolicy {
    /// The policy a published `Host` says.
    pub fn of_host(host: &Host) -> Self {
        Self {
            queue: QueueSettings::from(&host.spec.resource_policy.queue),
            activation: host.spec.lifecycle.activation,
        }
    }

    /// The policy that applies (see the type's doc).
    pub fn of(published: Option<&Host>, document: Option<&HostConfig>) -> Self {
        match (published, document) {
            (Some(h), _) => Self::of_host(h),
            (None, Some(d)) => Self {
                queue: d.queue,
                activation: d.activation,
            },
            (None, None) => Self {
                queue: QueueSettings::defaults(Mode::ServerAndHosts),
                activation: Activation::OnDemand,
            },
        }
    }
}

/// The policies the leader runs with, by host ID (a host that joins later is added).
pub type RunningPolicies = Arc<std::sync::Mutex<BTreeMap<String, HostPolicy>>>;

/// Watches every `Host` until one of the hosts in `running` says a policy other than the one
/// the leader runs with, and answers that host and its policy. A missing or deleted `Host`
/// changes nothing (its agent publishes it again); a host not (yet) in `running` neither.
pub async fn host_policy_change(api: Api<Host>, running: RunningPolicies) -> (String, HostPolicy) {
    let mut events = kube::runtime::watcher(api, kube::runtime::watcher::Config::default())
        .default_backoff()
        .boxed();
    while let Some(event) = events.next().await {
        let host = match event {
            Ok(
                kube::runtime::watcher::Event::Apply(h)
                | kube::runtime::watcher::Event::InitApply(h),
            ) => h,
            Ok(_) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "watching the Host objects failed; retrying");
                continue;
            }
        };
        let name = host.name_any();
        let policy = HostPolicy::of_host(&host);
        let known = running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&name)
            .copied();
        if known.is_some_and(|p| p != policy) {
            return (name, policy);
        }
    }
    std::future::pending().await
}

/// The router's queue settings over several hosts: the waiting limits, the request deadline
/// and the stream silence bound are the tightest any host sets (the product page's multi-host
/// rule); the admission window is the first host's (each switch carries its own host's).
pub fn merged_queue<'a>(
    policies: impl IntoIterator<Item = &'a HostPolicy>,
) -> Option<QueueSettings> {
    let policies: Vec<&HostPolicy> = policies.into_iter().collect();
    let first = policies.first()?;
    let tight = capyctl_spec::settings::tightest(policies.iter().map(|p| &p.queue))?;
    let mut queue = first.queue;
    queue.max_pending_per_deployment = tight.max_pending_per_deployment;
    queue.max_pending_total = tight.max_pending_total;
    queue.max_buffered_bytes_total = tight.max_buffered_bytes_total;
    queue.request_deadline = tight.request_deadline;
    queue.stream_idle_timeout = policies
        .iter()
        .map(|p| p.queue.stream_idle_timeout)
        .min()
        .unwrap_or(first.queue.stream_idle_timeout);
    Some(queue)
}

/// Why the operator stopped.
#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    /// A listener could not be bound.
    #[error(transparent)]
    Bind(#[from] BindError),
    /// The node agent could not be used.
    #[error("node agent: {0}")]
    Agent(#[from] capyctl_node_agent::AgentError),
    /// The lifecycle could not start.
    #[error("{0}")]
    Core(#[from] capyctl_lifecycle::CoreError),
    /// The API server refused a call the operator cannot do without.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// Another replica took the Lease: this one stopped what it ran and exits.
    #[error("lost the leadership (the Lease is another replica's or could not be renewed)")]
    LostLeadership,
    /// A node's `Host` object says another resource policy or activation than the router runs
    /// with, or a node agent joined whose policy tightens the router's limits: the leader
    /// stepped down so that the next one runs with it.
    #[error(
        "the Host object of {host} changed its resource policy or activation; stepping down so that the next leader runs with it"
    )]
    HostPolicyChanged {
        /// The host.
        host: String,
    },
}

impl OperatorError {
    /// A short, stable label for metrics and logs.
    pub fn metric_label(&self) -> &'static str {
        match self {
            OperatorError::Bind(_) => "bind",
            OperatorError::Agent(e) => e.metric_label(),
            OperatorError::Core(e) => e.metric_label(),
            OperatorError::Kube(_) => "kube",
            OperatorError::LostLeadership => "lost_leadership",
            OperatorError::HostPolicyChanged { .. } => "host_policy_changed",
        }
    }
}

fn standby_error() -> ApiError {
    ApiError::Internal {
        detail: "this replica is the standby; the leader serves the management API".to_string(),
    }
}

/// The refusal of a deploy through the operator's management API (see [`SwitchableApi`]).
pub fn deploy_refused(name: &str) -> ApiError {
    ApiError::Conflict {
        detail: format!(
            "on Kubernetes the Deployment objects say what is deployed: apply a Deployment object named {name} (kubectl apply, or kubectl capyctl deploy model --file F, which writes it)"
        ),
    }
}

/// The refusal of a delete through the operator's management API (see [`SwitchableApi`]).
pub fn delete_refused(name_or_id: &str) -> ApiError {
    ApiError::Conflict {
        detail: format!(
            "on Kubernetes the Deployment objects say what is deployed: delete the Deployment object of {name_or_id} (kubectl delete cdeploy NAME, or kubectl capyctl delete deployment NAME); its finalizer stops the engines"
        ),
    }
}

/// The management API of a replica: the lifecycle's while it leads, a standby's otherwise.
///
/// On Kubernetes the `Deployment` objects say what is deployed, so deploys and deletes are
/// refused here ([`deploy_refused`], [`delete_refused`]): nothing may be deployed that no
/// object records (it would be lost at the next failover, and an engine Pod needs its object
/// as owner), nor deleted while an object still asks for it (the reconciler would deploy it
/// again). `kubectl capyctl deploy model` and `delete deployment` write the objects
/// themselves, with the user's own rights (`capyctl/src/cluster.rs`); the reconciler calls the
/// lifecycle directly.
///
/// Readiness (`/readyz`, which decides the Services' endpoints) follows the leadership: the
/// leader is ready once its lifecycle is; a standby only when it may be ready at all (the
/// Services select the leader by its label) AND its own Pod is known to carry no leader label
/// ([`SwitchableApi::set_standby_ready`]), so that a Pod with a stale label never receives the
/// Services' traffic.
///
/// While the leader is held over ([`SwitchableApi::set_held`]) every command that changes
/// something (deploy, delete, start, stop, park, preinitialize, drain) is refused with the
/// hold-over's 503 `unavailable` before it reaches the lifecycle; reads answer.
pub struct SwitchableApi {
    leader: RwLock<Option<Arc<dyn ManagementApi>>>,
    standby_ready: AtomicBool,
    held: RwLock<Option<ApiError>>,
}

/// The refusal of every switch and command while the leader is held over (see
/// [`super::leader`]): 503 `unavailable`, retryable, `Retry-After` the election's retry period.
pub fn holdover_refusal(retry_period: Duration) -> ApiError {
    ApiError::Unavailable {
        detail: "the Kubernetes API server cannot be reached; this replica serves ready models only until it can renew its leadership; retry shortly".to_string(),
        retry_after: u32::try_from(retry_period.as_secs().max(1)).unwrap_or(u32::MAX),
    }
}

impl std::fmt::Debug for SwitchableApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SwitchableApi")
            .field("leading", &self.current().is_some())
            .field("standby_ready", &self.standby_ready.load(Ordering::SeqCst))
            .finish()
    }
}

impl SwitchableApi {
    /// A standby's API; `standby_ready` is what `/readyz` says while standing by.
    pub fn new(standby_ready: bool) -> Self {
        Self {
            leader: RwLock::new(None),
            standby_ready: AtomicBool::new(standby_ready),
            held: RwLock::new(None),
        }
    }

    /// Held over: commands that change something get `refusal` (`None`: they go through).
    pub fn set_held(&self, refusal: Option<ApiError>) {
        *self
            .held
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = refusal;
    }

    /// `Err` with the hold-over's refusal while held over.
    fn changes_allowed(&self) -> Result<(), ApiError> {
        match &*self
            .held
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
        {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// What `/readyz` says while standing by.
    pub fn set_standby_ready(&self, ready: bool) {
        self.standby_ready.store(ready, Ordering::SeqCst);
    }

    /// Serves `api` (leading), or the standby's answers (`None`).
    pub fn set(&self, api: Option<Arc<dyn ManagementApi>>) {
        *self
            .leader
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = api;
    }

    fn current(&self) -> Option<Arc<dyn ManagementApi>> {
        self.leader
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// The deployments list of a replica that is not the leader (yet): none.
fn no_deployments() -> Result<Vec<u8>, ApiError> {
    capyctl_lifecycle::api::encoded(&DeploymentList {
        deployments: Vec::new(),
    })
}

impl ManagementApi for SwitchableApi {
    fn list(&self) -> BoxFuture<'_, DeploymentList> {
        let api = self.current();
        Box::pin(async move {
            match api {
                Some(a) => a.list().await,
                None => DeploymentList {
                    deployments: Vec::new(),
                },
            }
        })
    }

    fn list_json(&self) -> BoxFuture<'_, Result<Vec<u8>, ApiError>> {
        let api = self.current();
        Box::pin(async move {
            match api {
                Some(a) => a.list_json().await,
                None => no_deployments(),
            }
        })
    }

    fn list_parts(&self) -> BoxFuture<'_, Result<JsonParts, ApiError>> {
        let api = self.current();
        Box::pin(async move {
            match api {
                Some(a) => a.list_parts().await,
                None => no_deployments().map(JsonParts::whole),
            }
        })
    }

    fn deploy(&self, doc: DeploymentDoc) -> BoxFuture<'_, Result<DeployReceipt, ApiError>> {
        let held = self.changes_allowed();
        Box::pin(async move {
            held?;
            Err(deploy_refused(&doc.name))
        })
    }

    fn get<'a>(&'a self, name_or_id: &'a str) -> BoxFuture<'a, Result<DeploymentView, ApiError>> {
        let api = self.current();
        Box::pin(async move { api.ok_or_else(standby_error)?.get(name_or_id).await })
    }

    fn delete<'a>(
        &'a self,
        name_or_id: &'a str,
    ) -> BoxFuture<'a, Result<DeploymentView, ApiError>> {
        let api = self.current();
        let held = self.changes_allowed();
        Box::pin(async move {
            // An unknown name is still 404, as everywhere.
            api.ok_or_else(standby_error)?.get(name_or_id).await?;
            held?;
            Err(delete_refused(name_or_id))
        })
    }

    fn start<'a>(
        &'a self,
        name_or_id: &'a str,
        request: StartRequest,
    ) -> BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        let api = self.current();
        let held = self.changes_allowed();
        Box::pin(async move {
            let api = api.ok_or_else(standby_error)?;
            held?;
            api.start(name_or_id, request).await
        })
    }

    fn stop<'a>(&'a self, name_or_id: &'a str) -> BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        let api = self.current();
        let held = self.changes_allowed();
        Box::pin(async move {
            let api = api.ok_or_else(standby_error)?;
            held?;
            api.stop(name_or_id).await
        })
    }

    fn park<'a>(&'a self, name_or_id: &'a str) -> BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        let api = self.current();
        let held = self.changes_allowed();
        Box::pin(async move {
            let api = api.ok_or_else(standby_error)?;
            held?;
            api.park(name_or_id).await
        })
    }

    fn preinitialize<'a>(
        &'a self,
        name_or_id: &'a str,
    ) -> BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        let api = self.current();
        let held = self.changes_allowed();
        Box::pin(async move {
            let api = api.ok_or_else(standby_error)?;
            held?;
            api.preinitialize(name_or_id).await
        })
    }

    fn engines(&self) -> BoxFuture<'_, EngineList> {
        let api = self.current();
        Box::pin(async move {
            match api {
                Some(a) => a.engines().await,
                None => EngineList {
                    engines: Vec::new(),
                },
            }
        })
    }

    fn hosts(&self) -> BoxFuture<'_, HostList> {
        let api = self.current();
        Box::pin(async move {
            match api {
                Some(a) => a.hosts().await,
                None => HostList { hosts: Vec::new() },
            }
        })
    }

    fn drain_host<'a>(
        &'a self,
        host_id: &'a str,
        drain: bool,
    ) -> BoxFuture<'a, Result<HostDrainReceipt, ApiError>> {
        let api = self.current();
        let held = self.changes_allowed();
        Box::pin(async move {
            let api = api.ok_or_else(standby_error)?;
            held?;
            api.drain_host(host_id, drain).await
        })
    }

    fn load<'a>(
        &'a self,
        deployment: Option<&'a str>,
    ) -> BoxFuture<'a, Result<LoadReport, ApiError>> {
        let api = self.current();
        Box::pin(async move { api.ok_or_else(standby_error)?.load(deployment).await })
    }

    fn load_json<'a>(
        &'a self,
        deployment: Option<&'a str>,
    ) -> BoxFuture<'a, Result<bytes::Bytes, ApiError>> {
        let api = self.current();
        Box::pin(async move { api.ok_or_else(standby_error)?.load_json(deployment).await })
    }

    fn ready(&self) -> bool {
        match self.current() {
            Some(a) => a.ready(),
            None => self.standby_ready.load(Ordering::SeqCst),
        }
    }

    /// The leader's records (kept in its memory: a new leader begins with none).
    fn switches(
        &self,
        query: capyctl_spec::api::SwitchQuery,
    ) -> BoxFuture<'_, Result<capyctl_spec::api::SwitchList, ApiError>> {
        let api = self.current();
        Box::pin(async move { api.ok_or_else(standby_error)?.switches(query).await })
    }
}

/// The URLs of the Running node agent Pods of the namespace, by Pod name (one per GPU node).
pub async fn find_node_agents(
    pods: &Api<Pod>,
    port: u16,
) -> Result<BTreeMap<String, String>, OperatorError> {
    let list = pods
        .list(&ListParams::default().labels(NODE_AGENT_SELECTOR))
        .await?;
    Ok(list
        .items
        .iter()
        .filter(|p| {
            p.metadata.deletion_timestamp.is_none()
                && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
        })
        .filter_map(|p| {
            let ip = p.status.as_ref()?.pod_ip.clone()?;
            let url = if ip.contains(':') {
                format!("http://[{ip}]:{port}")
            } else {
                format!("http://{ip}:{port}")
            };
            Some((p.name_any(), url))
        })
        .collect())
}

/// A node agent the leader drives: the lifecycle's host entry and the policy it runs with.
struct Joined {
    entry: HostEntry,
    policy: HostPolicy,
}

/// Connects to the node agent at `url`: its identity, its node's published policy, and, with
/// the pod runtime, the operator's engine-Pod side around it.
async fn join(
    client: &Client,
    options: &OperatorOptions,
    claims: &Arc<Claims>,
    url: &str,
) -> Result<Joined, OperatorError> {
    let mut remote = RemoteConfig::new(url.to_string(), options.agent_token.clone());
    remote.follow_agent_timing = true;
    let agent = Arc::new(RemoteHostAgent::new(remote)?);
    let info = agent.info().await?;
    // Exits are watched before the recovery reads what runs there (an engine that exits in
    // between is then reported, not missed); bounded, as the agent just answered.
    let _ = tokio::time::timeout(Duration::from_secs(30), agent.watching_exits()).await;
    // The chart's host ID is the node's name.
    let host_id = if info.node_name.is_empty() {
        info.host_id.clone()
    } else {
        info.node_name.clone()
    };
    // The host's resource policy: see `HostPolicy`.
    let hosts: Api<Host> = Api::all(client.clone());
    let published = match hosts.get_opt(&host_id).await {
        Ok(h) => h,
        Err(e) => {
            tracing::warn!(host = %host_id, error = %e, "the Host object could not be read; the host document's (or the default) resource policy applies");
            None
        }
    };
    let policy = HostPolicy::of(published.as_ref(), options.host.as_ref());
    let settings = options
        .host
        .as_ref()
        .map(HostSettings::from)
        .unwrap_or_default();
    // With the pod runtime the operator creates and deletes the engine Pods.
    let dyn_agent: Arc<dyn HostAgent> = if info.engine_runtime == "pod" {
        Arc::new(
            PodHostAgent::new(
                agent.clone(),
                client.clone(),
                &options.namespace,
                options.engine_pods.clone(),
                settings.clone(),
                host_id.clone(),
            )
            .with_claims(claims.clone()),
        )
    } else {
        agent
    };
    tracing::info!(host = %host_id, node_agent = %url, runtime = %info.engine_runtime, "node agent joined");
    Ok(Joined {
        entry: HostEntry {
            id: host_id,
            agent: dyn_agent,
            activation: policy.activation,
            settings,
            admission_window: Some(policy.queue.admission_window),
            remote: true,
        },
        policy,
    })
}

/// What [`follow_node_agents`] works with.
struct Following {
    client: Client,
    options: OperatorOptions,
    server: Arc<Core>,
    /// Which object holds each deployment name (engine Pods find their object by it).
    claims: Arc<Claims>,
    /// The policies the leader runs with (a joining host is added).
    running: RunningPolicies,
    /// The node agents joined, by Pod name: their URLs.
    known: BTreeMap<String, String>,
    /// The router's queue settings (the tightest of the hosts when the leader began).
    router_queue: QueueSettings,
    /// Where a joining host that would tighten them says so.
    step_down: tokio::sync::mpsc::Sender<String>,
}

/// Follows the node agents while the leader leads: a new one (a node labelled later, or an
/// agent Pod replaced, at another address) joins the lifecycle through `upsert_host`; one whose
/// policy would tighten the router's limits makes the leader step down instead.
async fn follow_node_agents(following: Following, mut stop: watch::Receiver<bool>) {
    let Following {
        client,
        options,
        server,
        claims,
        running,
        mut known,
        router_queue,
        step_down,
    } = following;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &options.namespace);
    let mut tick = tokio::time::interval(NODE_AGENT_RECHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = super::until(&mut stop, true) => return,
        }
        let found = match find_node_agents(&pods, options.node_agent_port).await {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!(error = %e, "listing the node agents failed; trying again");
                continue;
            }
        };
        for (pod, url) in found {
            if known.get(&pod) == Some(&url) {
                continue;
            }
            let joined = match join(&client, &options, &claims, &url).await {
                Ok(j) => j,
                Err(e) => {
                    tracing::info!(%pod, %url, error = %e, "a node agent does not answer yet");
                    continue;
                }
            };
            let host = joined.entry.id.clone();
            let merged = {
                let mut all = running
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                all.insert(host.clone(), joined.policy);
                merged_queue(all.values())
            };
            if merged.is_some_and(|q| q != router_queue) {
                // The host that tightens the router's limits: the next leader runs with them.
                let _ = step_down.send(host).await;
                return;
            }
            match server.upsert_host(joined.entry).await {
                Ok(()) => {
                    known.insert(pod, url);
                }
                Err(e) => tracing::warn!(%host, error = %e, "a node agent could not join"),
            }
        }
    }
}

/// What [`follow_holdover`] tells of a hold-over.
struct Holding {
    server: Arc<Core>,
    api: Arc<SwitchableApi>,
    reconciler: Arc<Reconciler>,
    refusal: ApiError,
}

/// Follows the leader's hold-over (see [`super::leader`]) until `stop`: held, the lifecycle
/// holds every switch and the management API refuses every change; renewed again, switching
/// resumes and every CR's status is written again (what changed meanwhile, an engine that
/// exited say, could not be written).
async fn follow_holdover(
    holding: Holding,
    mut leading: watch::Receiver<Leadership>,
    mut stop: watch::Receiver<bool>,
) {
    let mut held = false;
    loop {
        let now = leading.borrow_and_update().held;
        if now != held {
            held = now;
            if held {
                tracing::warn!(
                    "held over: serving the ready models, refusing every switch and command until the Lease is renewed"
                );
                holding.api.set_held(Some(holding.refusal.clone()));
                holding.server.hold_switches(holding.refusal.clone()).await;
            } else {
                tracing::info!("the Lease is renewed: switching resumes, the statuses catch up");
                holding.server.resume_switches().await;
                holding.api.set_held(None);
                holding.reconciler.rewrite_statuses();
            }
        }
        tokio::select! {
            changed = leading.changed() => if changed.is_err() { return },
            _ = super::until(&mut stop, true) => return,
        }
    }
}

/// Waits until `rx` says `false` (leadership lost) or `stop` says `true`; answers whether the
/// leadership was lost.
async fn lost_or_stopped(
    rx: &mut watch::Receiver<Leadership>,
    stop: &mut watch::Receiver<bool>,
) -> bool {
    tokio::select! {
        _ = rx.wait_for(|l| !l.leading) => true,
        _ = super::until(stop, true) => false,
    }
}

/// What every replica serves and the leader fills: the metrics, the management API it switches
/// to the leader's, and the inference listener's tenants.
pub struct Served<'a> {
    /// The process's metrics.
    pub metrics: Arc<Metrics>,
    /// The management API, answered by the leader's lifecycle while it leads.
    pub api: &'a Arc<SwitchableApi>,
    /// The tenants' keys (`capyctl tenants list` on any replica; the leader's listener asks
    /// for them).
    pub tenants: Arc<Tenants>,
}

/// Runs the leader's part until the leadership is lost (`Err(LostLeadership)`) or `stop`
/// turns `true` (`Ok`).
pub async fn lead(
    client: Client,
    options: &OperatorOptions,
    served: Served<'_>,
    mut leading: watch::Receiver<Leadership>,
    mut stop: watch::Receiver<bool>,
    handed_over: watch::Receiver<bool>,
) -> Result<(), OperatorError> {
    let Served {
        metrics,
        api,
        tenants,
    } = served;
    let ns = options.namespace.as_str();
    // Which object holds each deployment name: seeded below from the list of the CRs, before
    // anything asks.
    let claims = Arc::new(Claims::default());
    // The node agents: one named (`--node-agent`), or every Running node agent Pod; the leader
    // waits for at least one, and the others join as they answer (`follow_node_agents`).
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let (joined, known) = loop {
        let found: BTreeMap<String, String> = match &options.node_agent_url {
            Some(u) => BTreeMap::from([(String::new(), u.clone())]),
            None => find_node_agents(&pods, options.node_agent_port).await?,
        };
        let mut joined = Vec::new();
        let mut known = BTreeMap::new();
        for (pod, url) in &found {
            match join(&client, options, &claims, url).await {
                Ok(j) => {
                    joined.push(j);
                    known.insert(pod.clone(), url.clone());
                }
                Err(e) => tracing::warn!(%url, error = %e, "the node agent does not answer yet"),
            }
        }
        if !joined.is_empty() {
            break (joined, known);
        }
        if found.is_empty() {
            tracing::info!("waiting for a Running node agent Pod ({NODE_AGENT_SELECTOR})");
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(2)) => {}
            _ = leading.wait_for(|l| !l.leading) => return Err(OperatorError::LostLeadership),
            _ = super::until(&mut stop, true) => return Ok(()),
        }
    };
    let running: RunningPolicies = Arc::new(std::sync::Mutex::new(
        joined
            .iter()
            .map(|j| (j.entry.id.clone(), j.policy))
            .collect(),
    ));
    let policies: Vec<HostPolicy> = joined.iter().map(|j| j.policy).collect();
    // `joined` is never empty here.
    let queue = merged_queue(&policies).unwrap_or(policies[0].queue);
    let first = &joined[0].entry;
    let host_id = first.id.clone();
    let first_agent = first.agent.clone();
    let host_settings = first.settings.clone();
    let activation = first.activation;
    let host_ids: Vec<String> = joined.iter().map(|j| j.entry.id.clone()).collect();

    // The lifecycle, its records rebuilt from the CRs of every watched namespace (of a name
    // several namespaces use, the holder's: `super::watch`).
    let crs: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let mut existing = Vec::new();
    for api in options.watch.apis(&client) {
        existing.extend(api.list(&ListParams::default()).await?.items);
    }
    claims.seed(&existing);
    let store = Arc::new(CrStore::from_crs(
        existing.iter().filter(|cr| claims.holds(cr)),
    ));
    let first = FirstHost {
        id: host_id.clone(),
        activation,
        settings: host_settings,
    };
    let server = Core::open_hosts(
        joined.into_iter().map(|j| j.entry).collect(),
        store.clone(),
        // NB: the leader's switch records are kept in its data directory, not in the API
        // server (CRs and ConfigMaps are no place for a ring of 1,000 records): a standby that
        // takes over begins with its own.
        lifecycle_config(
            &options.server,
            first,
            &queue,
            metrics.clone(),
            options.switch_log.clone(),
        ),
    )
    .await?;
    // Taken over from a leader that did not release the Lease: what it adopted as ready is
    // fenced (that leader may be held over and still serving it; see `super::leader`).
    let fence_until = leading.borrow().fence_until;
    if let Some(until) = fence_until {
        let fenced = server.fence(until).await;
        if !fenced.is_empty() {
            tracing::warn!(deployments = ?fenced, for_s = until.saturating_duration_since(tokio::time::Instant::now()).as_secs(), "taken over from a leader that did not release the Lease: the instances adopted ready are not parked or stopped until its hold-over has surely ended");
        }
    }

    // What happens, for the Events (`super::events`): the router's lifecycle and the
    // management API observed.
    let (feed, happenings) = EventFeed::channel(FEED_CAPACITY);
    let views: Arc<dyn Views> = server.clone();

    // The router and the inference listener.
    let (inference, _) = bind("server.listen.inference", options.server.listen.inference).await?;
    let observed = Arc::new(ObservedLifecycle::new(
        server.clone(),
        views.clone(),
        feed.clone(),
    ));
    let inference_config = ProxyConfig {
        tls: options.tls.clone(),
        ..proxy_config(&queue)
    };
    let grace = inference_config.shutdown_grace;
    let (stop_tasks, _) = watch::channel(false);
    // The inference port's socket, given back by the router's listener when it stops
    // accepting (see `super::handover`), to answer 503 on it while this leader stays
    // labelled. Without the leader label nobody would take it: then it is closed at the stop
    // (clients get a connection refused at once, not a backlog nobody accepts).
    let (give_back, given_back) = tokio::sync::oneshot::channel();
    let give_back = options.leader_label.is_some().then_some(give_back);
    // The `Tenant` objects and their Secrets feed the listener's keys (DESIGN 4.10), read
    // whole before the listener serves: until then it would ask for no key. The leader alone
    // watches them (it writes their status).
    let mut tenant_watch = crate::tenants::spawn(client.clone(), ns, tenants.clone());
    loop {
        tokio::select! {
            () = tenant_watch.synced() => break,
            () = tokio::time::sleep(Duration::from_secs(10)) => tracing::warn!(
                "the Tenant objects and their Secrets are not read yet; the inference listener waits for them"
            ),
        }
    }
    let inference = Inference {
        listener: inference,
        config: inference_config,
        observer: Some(metrics.clone()),
        stop: stop_tasks.subscribe(),
        give_back,
        tenants,
    };
    let Assembly { router, inference } = assemble(
        &server,
        observed,
        router_config(&options.server, &queue),
        Some(inference),
    )
    .await;
    let mut tasks: Vec<JoinHandle<()>> = inference.into_iter().collect();
    api.set(Some(Arc::new(ObservedApi::new(
        server.clone(),
        views.clone(),
        feed.clone(),
    ))));

    // The reconciler.
    let pod_name = options.lease.identity.clone();
    let reconciler = Arc::new(
        Reconciler::new(
            server.clone(),
            crs,
            Some(Reconciler::recorder(client.clone(), Some(pod_name.clone()))),
            Some(first_agent),
            options.reconciler.clone(),
        )
        .with_store(store)
        .with_events(feed, views)
        .with_watch(&options.watch, claims.clone()),
    );
    tasks.push(tokio::spawn(
        reconciler.clone().run_controller(stop_tasks.subscribe()),
    ));
    tasks.push(tokio::spawn(
        reconciler
            .clone()
            .run_events(happenings, stop_tasks.subscribe()),
    ));
    tasks.push(tokio::spawn(
        reconciler.clone().run_status_sync(stop_tasks.subscribe()),
    ));
    tasks.push(tokio::spawn(follow_holdover(
        Holding {
            server: server.clone(),
            api: api.clone(),
            reconciler: reconciler.clone(),
            refusal: holdover_refusal(options.lease.retry_period),
        },
        leading.clone(),
        stop_tasks.subscribe(),
    )));
    let (step_down_tx, mut step_down) = tokio::sync::mpsc::channel(1);
    if options.node_agent_url.is_none() {
        let following = Following {
            client: client.clone(),
            options: options.clone(),
            server: server.clone(),
            claims: claims.clone(),
            running: running.clone(),
            known,
            router_queue: queue,
            step_down: step_down_tx,
        };
        tasks.push(tokio::spawn(follow_node_agents(
            following,
            stop_tasks.subscribe(),
        )));
    }
    if let Some(label) = &options.leader_label
        && let Err(e) = set_leader_label(&pods, &pod_name, label, true).await
    {
        tracing::warn!(pod = %pod_name, error = %e, "the leader label could not be set");
    }
    tracing::info!(hosts = ?host_ids, watch = %options.watch.describe(), "leading: lifecycle, router and reconciler running");

    let hosts: Api<Host> = Api::all(client.clone());
    let policy_change = host_policy_change(hosts, running.clone());
    let outcome = tokio::select! {
        lost = lost_or_stopped(&mut leading, &mut stop) => {
            if lost { Err(OperatorError::LostLeadership) } else { Ok(()) }
        }
        (host, published) = policy_change => {
            tracing::warn!(%host, published = ?published, "the host's resource policy or activation changed; stepping down");
            Err(OperatorError::HostPolicyChanged { host })
        }
        Some(host) = step_down.recv() => {
            tracing::warn!(%host, "a node agent joined whose resource policy tightens the router's limits; stepping down");
            Err(OperatorError::HostPolicyChanged { host })
        }
    };
    // With the leader label: ready and labelled until the next leader is (see
    // `super::handover`), answering what the router no longer takes 503 `unavailable`.
    // Without: not ready from now (the Services select the ready replica).
    api.set_standby_ready(options.leader_label.is_some());
    api.set(None);
    stop_tasks.send_replace(true);
    if options.leader_label.is_some() {
        tokio::spawn(super::handover::serve_unavailable_given_back(
            given_back,
            super::handover::handing_over(),
            options.tls.clone(),
            handed_over,
        ));
    }
    let refusing = tokio::spawn(refuse_waiting_after(
        router.clone(),
        grace.saturating_sub(REFUSE_BEFORE_GRACE_ENDS),
    ));
    for t in tasks {
        let _ = t.await;
    }
    refusing.abort();
    server.close();
    // The label is removed by `run` once the Lease is released and the next leader has it.
    outcome
}

/// How long before the inference listener's shutdown grace ends a stopping leader answers the
/// requests still waiting in its router ([`refuse_waiting_after`]).
const REFUSE_BEFORE_GRACE_ENDS: Duration = Duration::from_secs(2);

/// A leader that stops (shutdown, or the leadership lost) lets its inference listener finish
/// the answers in progress for its shutdown grace, then drops the connections left; a request
/// still waiting for a switch then would lose its connection without an answer. So after
/// `after` (just before the grace ends) every request still waiting in `router` is answered
/// 503 `unavailable`, "dispatch to deployment <id> is closed; retry shortly" (the product
/// page's, retryable: the next leader serves the retry), and a switch to its deployment that
/// has not begun executing is given up; one executing runs on (its engine is adopted by the
/// next leader). Requests a switch serves within the grace are answered as usual.
async fn refuse_waiting_after(router: CoordinatorHandle, after: Duration) {
    tokio::time::sleep(after).await;
    for load in router.load().await {
        if load.waiting == 0 {
            continue;
        }
        tracing::warn!(deployment = %load.deployment_id, waiting = load.waiting, "this leader stops: the requests still waiting for the deployment are answered 503 (retry shortly)");
        let deployment = load.deployment_id;
        let error = ApiError::DispatchClosed {
            deployment: deployment.clone(),
        };
        router.deployment_refused(deployment, error).await;
    }
}

/// Runs the operator until `shutdown` (see the module doc).
pub async fn run(
    client: Client,
    options: OperatorOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), OperatorError> {
    let metrics = options.metrics.clone();
    // A standby is ready only once its own Pod is known to carry no leader label (a leader
    // killed in this Pod may have left it): see `SwitchableApi`.
    let api = Arc::new(SwitchableApi::new(false));
    // `stop`: the shutdown signal (the leader's work stops on it); `finish`: sent once that
    // work has stopped, it ends the election (a leader releases the Lease only then, so a
    // standby never takes over while this replica still serves) and the management listener.
    let (stop, _) = watch::channel(false);
    let (finish, _) = watch::channel(false);
    // The inference listener's tenants: `capyctl tenants list` reads them on every replica; the
    // leader fills them from the `Tenant` objects (`super::tenants`).
    let tenants = Arc::new(Tenants::default());
    // Sent once a stopping leader has handed the router Service over (`super::handover`): the
    // inference port's 503s and the management listener end.
    let (handed_over, _) = watch::channel(false);

    let (management, _) =
        bind("server.listen.management", options.server.listen.management).await?;
    let management_task = {
        let api: Arc<dyn ManagementApi> = api.clone();
        let tls = options.tls.clone();
        let mut rx = handed_over.subscribe();
        let opts = ManagementOptions {
            token: options.admin_token.clone(),
            metrics: metrics.clone(),
            tenants: Some(tenants.clone()),
        };
        tokio::spawn(async move {
            let shutdown = async move {
                super::until(&mut rx, true).await;
            };
            let served =
                capyctl_server::management::serve_listener(management, tls, api, opts, shutdown);
            if let Err(e) = served.await {
                tracing::error!(error = %e, "the management listener failed");
            }
        })
    };

    {
        let stop = stop.clone();
        tokio::spawn(async move {
            shutdown.await;
            stop.send_replace(true);
        });
    }
    // A leader killed in this Pod may have left its label: remove it before this replica
    // takes part in the election (so that its own leadership's label is never removed), and
    // only then say ready.
    if let Some(label) = &options.leader_label {
        let pods: Api<Pod> = Api::namespaced(client.clone(), &options.namespace);
        let pod = &options.lease.identity;
        if clear_leader_label(&pods, pod, label, LABEL_RETRY, stop.subscribe()).await {
            api.set_standby_ready(true);
        }
    }

    let (leading_tx, mut leading) = watch::channel(Leadership::default());
    // The Lease's owner, the operator's own Deployment, read once (see `leader`'s doc).
    let owner = match &options.lease.owner_deployment {
        Some(name) => {
            let deployments = Api::namespaced(client.clone(), &options.namespace);
            deployment_owner(&deployments, name, options.lease.renew_deadline).await
        }
        None => None,
    };
    let elector = LeaderElector::new(
        Api::<Lease>::namespaced(client.clone(), &options.namespace),
        options.lease.clone(),
    )
    .with_owner(owner);
    let election = tokio::spawn(elector.run(leading_tx, finish.subscribe()));

    let mut stopping = stop.subscribe();
    let became_leader = tokio::select! {
        _ = leading.wait_for(|l| l.leading) => true,
        _ = super::until(&mut stopping, true) => false,
    };
    // A replica leads once: losing the leadership ends the process (crash-only).
    let result = if became_leader {
        lead(
            client.clone(),
            &options,
            Served {
                metrics: metrics.clone(),
                api: &api,
                tenants,
            },
            leading.clone(),
            stop.subscribe(),
            handed_over.subscribe(),
        )
        .await
    } else {
        Ok(())
    };
    finish.send_replace(true);
    let _ = election.await;
    if became_leader && let Some(label) = &options.leader_label {
        // The Lease is released: stay the router Service's endpoint (ready, labelled, the
        // inference port answering 503) until the next leader is one (`super::handover`).
        let pods: Api<Pod> = Api::namespaced(client.clone(), &options.namespace);
        let me = options.lease.identity.as_str();
        let selector = format!("{label}=true");
        if !super::handover::linger(&pods, &selector, me, label).await {
            tracing::warn!(
                "no next leader labelled within {:?}; removing the leader label",
                super::handover::LINGER_MAX
            );
        }
        match set_leader_label(&pods, me, label, false).await {
            Ok(()) => {}
            Err(kube::Error::Api(s)) if s.is_not_found() => {}
            Err(e) => {
                tracing::warn!(pod = %me, error = %e, "the leader label could not be removed")
            }
        }
    }
    handed_over.send_replace(true);
    let _ = management_task.await;
    result
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use http::Method;

    use super::super::mock::{self, Exchange, FakeApi};
    use super::*;

    #[tokio::test]
    async fn a_standby_answers_health_but_not_the_api() {
        let api = SwitchableApi::new(true);
        assert!(api.ready());
        let err = api.get("chat-a").await.unwrap_err();
        assert_eq!(err.code(), "internal");
        assert!(err.message().contains("standby"), "{}", err.message());
        assert!(api.list().await.deployments.is_empty());
        assert!(!SwitchableApi::new(false).ready());
        // The switch records are the leader's.
        let query = capyctl_spec::api::SwitchQuery {
            after: Some(7),
            ..Default::default()
        };
        let err = api.switches(query.clone()).await.unwrap_err();
        assert!(err.message().contains("standby"), "{}", err.message());
        api.set(Some(Arc::new(FakeApi::default())));
        let list = api.switches(query).await.unwrap();
        assert!(list.switches.is_empty());
        assert_eq!(list.next, 7);
    }

    #[tokio::test]
    async fn deploys_and_deletes_are_refused_naming_the_objects_and_nothing_reaches_the_lifecycle()
    {
        let doc = capyctl_spec::documents::parse_deployment_str(
            "t.yaml",
            "name: chat-a\nengine: vllm\nmodel: m\n",
        )
        .unwrap();
        let lifecycle = Arc::new(FakeApi::default());
        lifecycle
            .deps
            .lock()
            .unwrap()
            .insert("chat-a".into(), mock::view_of(&doc, 1));
        let api = SwitchableApi::new(false);
        api.set(Some(lifecycle.clone()));

        let e = api.deploy(doc).await.unwrap_err();
        assert_eq!(e.status(), 409);
        assert_eq!(e.code(), "conflict");
        assert!(
            e.message()
                .contains("apply a Deployment object named chat-a"),
            "{}",
            e.message()
        );

        let e = api.delete("chat-a").await.unwrap_err();
        assert_eq!(e.code(), "conflict");
        assert!(
            e.message()
                .contains("delete the Deployment object of chat-a"),
            "{}",
            e.message()
        );
        // An unknown name is 404, not a conflict.
        let e = api.delete("nope").await.unwrap_err();
        assert_eq!(e.code(), "not_found");
        // Nothing reached the lifecycle.
        assert!(lifecycle.calls().is_empty());

        // Everything else goes through.
        assert_eq!(api.list().await.deployments[0].name, "chat-a");
        assert_eq!(api.get("chat-a").await.unwrap().name, "chat-a");
        assert!(api.ready());
    }

    #[test]
    fn readiness_follows_the_leadership_and_the_label() {
        // A replica starts not ready: its Pod may carry a stale leader label.
        let api = SwitchableApi::new(false);
        assert!(!api.ready());
        // The label is gone: a standby may be ready (the Services do not select it).
        api.set_standby_ready(true);
        assert!(api.ready());
        // Leading: ready as its lifecycle is.
        api.set(Some(Arc::new(FakeApi::ready(false))));
        assert!(!api.ready());
        api.set(Some(Arc::new(FakeApi::ready(true))));
        assert!(api.ready());
        // Stepping down: not ready until the label is removed again.
        api.set_standby_ready(false);
        api.set(None);
        assert!(!api.ready());
    }

    #[tokio::test]
    async fn the_one_running_node_agent_is_found_by_its_pod() {
        let (client, handle) = mock::client();
        let pod = |name: &str, phase: &str, ip: &str| {
            serde_json::json!({"metadata": {"name": name},
                "status": {"phase": phase, "podIP": ip}})
        };
        let list = |items: Vec<serde_json::Value>| serde_json::json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items});
        let path = "/api/v1/namespaces/capyctl/pods";
        let server = mock::serve(
            handle,
            vec![
                Exchange::ok(
                    Method::GET,
                    path,
                    list(vec![
                        pod("na-1", "Running", "10.1.2.3"),
                        pod("na-2", "Pending", "10.1.2.4"),
                    ]),
                ),
                Exchange::ok(Method::GET, path, list(vec![])),
                Exchange::ok(
                    Method::GET,
                    path,
                    list(vec![
                        pod("na-1", "Running", "10.1.2.3"),
                        pod("na-2", "Running", "10.1.2.4"),
                    ]),
                ),
            ],
        );
        let pods: Api<Pod> = Api::namespaced(client, "capyctl");
        let url = |s: &str| s.to_string();
        assert_eq!(
            find_node_agents(&pods, 7444).await.unwrap(),
            BTreeMap::from([(url("na-1"), url("http://10.1.2.3:7444"))])
        );
        assert!(find_node_agents(&pods, 7444).await.unwrap().is_empty());
        // One per GPU node: every Running one.
        assert_eq!(
            find_node_agents(&pods, 7444).await.unwrap(),
            BTreeMap::from([
                (url("na-1"), url("http://10.1.2.3:7444")),
                (url("na-2"), url("http://10.1.2.4:7444")),
            ])
        );
        let seen = server.await.unwrap();
        assert!(
            seen[0]
                .query
                .contains("labelSelector=app.kubernetes.io%2Fcomponent%3Dnode-agent"),
            "{}",
            seen[0].query
        );
    }

    fn host_json(window: &str, activation: &str) -> serde_json::Value {
        let mut queue = serde_json::to_value(capyctl_crds::QueueSpec::default()).unwrap();
        queue["admissionWindow"] = window.into();
        serde_json::json!({"apiVersion": "capyctl.io/v1alpha1", "kind": "Host",
            "metadata": {"name": "gpu-1", "resourceVersion": "5"},
            "spec": {"resourcePolicy": {"queue": queue}, "lifecycle": {"activation": activation}}})
    }

    #[test]
    fn the_published_host_wins_then_the_host_document_then_the_defaults() {
        let published: Host = serde_json::from_value(host_json("500ms", "explicit")).unwrap();
        let mut document = HostConfig::defaults(Mode::ServerAndHosts);
        document.queue.admission_window = Duration::from_secs(5);
        let p = HostPolicy::of(Some(&published), Some(&document));
        assert_eq!(p.queue.admission_window, Duration::from_millis(500));
        assert_eq!(p.activation, Activation::Explicit);
        let p = HostPolicy::of(None, Some(&document));
        assert_eq!(p.queue.admission_window, Duration::from_secs(5));
        assert_eq!(p.activation, Activation::OnDemand);
        let p = HostPolicy::of(None, None);
        assert_eq!(p.queue, QueueSettings::defaults(Mode::ServerAndHosts));
    }

    #[tokio::test]
    async fn a_changed_host_policy_is_seen_by_the_leaders_watch() {
        let (client, handle) = mock::client();
        let path = "/apis/capyctl.io/v1alpha1/hosts";
        let list = serde_json::json!({"apiVersion": "capyctl.io/v1alpha1", "kind": "HostList",
            "metadata": {"resourceVersion": "5"}, "items": [host_json("2s", "on_demand")]});
        let server = mock::serve(
            handle,
            vec![
                Exchange::ok(Method::GET, path, list),
                // The agents rolled with a new host document: the Host says it.
                Exchange::ok(
                    Method::GET,
                    path,
                    serde_json::json!({"type": "MODIFIED", "object": host_json("750ms", "on_demand")}),
                ),
            ],
        );
        let running: RunningPolicies = Arc::new(std::sync::Mutex::new(BTreeMap::from([(
            "gpu-1".to_string(),
            HostPolicy::of(None, None),
        )])));
        let hosts: Api<Host> = Api::all(client);
        let (host, changed) = host_policy_change(hosts, running).await;
        assert_eq!(host, "gpu-1");
        assert_eq!(changed.queue.admission_window, Duration::from_millis(750));
        let seen = server.await.unwrap();
        assert!(seen[1].query.contains("watch=true"), "{}", seen[1].query);
    }

    #[test]
    fn several_hosts_take_the_tightest_limits() {
        let mut a = HostPolicy::of(None, None);
        let mut b = a;
        a.queue.max_pending_per_deployment = 0;
        a.queue.request_deadline = Duration::from_secs(300);
        b.queue.max_pending_total = 10;
        b.queue.admission_window = Duration::from_millis(300);
        b.queue.stream_idle_timeout = Duration::from_secs(30);
        let q = merged_queue([&a, &b]).unwrap();
        assert_eq!(q.max_pending_per_deployment, 0);
        assert_eq!(q.max_pending_total, 10);
        assert_eq!(q.request_deadline, Duration::from_secs(300));
        assert_eq!(q.stream_idle_timeout, Duration::from_secs(30));
        // The router's own window is the first host's; a switch carries its host's.
        assert_eq!(q.admission_window, a.queue.admission_window);
        assert!(merged_queue(std::iter::empty::<&HostPolicy>()).is_none());
    }

    #[test]
    fn the_router_takes_the_hosts_queue_and_the_servers_drain() {
        let server = ServerConfig::default();
        let mut queue = QueueSettings::defaults(Mode::ServerAndHosts);
        queue.max_pending_per_deployment = 3;
        let r = router_config(&server, &queue);
        assert_eq!(r.max_pending_per_deployment, 3);
        assert_eq!(r.drain_timeout, server.switching.drain_timeout);
        assert_eq!(r.request_deadline, Duration::from_secs(600));
        assert_eq!(proxy_config(&queue).max_buffered_bytes_total, 64 << 20);
    }
}
