//! This node's `Host` object (cluster-scoped, name = the node's name), written by its node
//! agent: the GPUs (UUID, memory, unified), the host's RAM, the engines with their versions and
//! DEEP PARK, and the resource policy and activation of the host document.
//!
//! It is written by server-side apply with the field manager [`FIELD_MANAGER`] (forced: the
//! node agent owns these fields), at start and whenever what it would write changes; the
//! agent re-checks every [`RECHECK`] and never writes an unchanged object twice. Host RAM is
//! the total (or the `host_memory` override), not what is available, so the object does not
//! change with every allocation.
//!
//! - Its status carries the `Ready` condition (the `Host`'s `Ready` printer column): `True`
//!   (`Serving`) once the agent publishes, `False` (`Stopped`) when it stops cleanly. NB: an
//!   agent killed without a chance to stop leaves `True` until it comes back; the operator's
//!   own view of the agent (it polls it every second) is what counts for serving.
//! - The object is owned by the node's `Node` (an owner reference, both cluster-scoped), so the
//!   garbage collector deletes it with the node. A `helm uninstall` does not delete it (the
//!   chart did not create it): `kubectl delete hosts.capyctl.io --all` after an uninstall. Out
//!   of a cluster (no `Node` of that name) it has no owner.

use std::sync::Arc;
use std::time::Duration;

use capyctl_crds::{
    EngineSpec, GpuSpec, Host, HostLifecycleSpec, HostSpec, HostStatus, QueueSpec,
    ResourcePolicySpec, conditions,
};
use capyctl_spec::Activation;
use capyctl_spec::settings::HostConfig;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, OwnerReference, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use tokio::sync::watch;

use crate::agent::HostAgent;
use crate::capability::EngineInfo;
use crate::inventory::Inventory;

/// The field manager of the node agent's server-side applies.
pub const FIELD_MANAGER: &str = "capyctl-node-agent";
/// How often the agent re-checks its `Host` object.
pub const RECHECK: Duration = Duration::from_secs(30);

/// What the host document says of the host's policy (it does not change while the agent runs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPolicy {
    /// The resolved `resource_policy.queue`.
    pub queue: QueueSpec,
    /// `lifecycle.activation`.
    pub activation: Activation,
}

impl From<&HostConfig> for HostPolicy {
    fn from(h: &HostConfig) -> Self {
        Self {
            queue: QueueSpec::from(&h.queue),
            activation: h.activation,
        }
    }
}

/// The `Host` spec of a host with this inventory, these engines and this policy.
pub fn host_spec(inv: &Inventory, engines: &[EngineInfo], policy: &HostPolicy) -> HostSpec {
    HostSpec {
        gpus: inv
            .gpus
            .iter()
            .map(|g| GpuSpec {
                uuid: g.uuid.clone(),
                memory: g.total_bytes.into(),
                unified: g.unified,
            })
            .collect(),
        host_memory: Some(inv.host_memory.total_bytes.into()),
        engines: engines
            .iter()
            .map(|e| EngineSpec {
                engine: e.engine,
                version: e.version.clone(),
                deep_park: e.deep_park.to_string(),
            })
            .collect(),
        resource_policy: ResourcePolicySpec {
            queue: policy.queue.clone(),
        },
        lifecycle: HostLifecycleSpec {
            activation: policy.activation,
        },
    }
}

/// The reason of `Ready=True`: the agent serves.
pub const REASON_SERVING: &str = "Serving";
/// The reason of `Ready=False` written when the agent stops.
pub const REASON_STOPPED: &str = "Stopped";
/// How long a stopping agent tries to write `Ready=False`.
pub const STOP_WRITE_BOUND: Duration = Duration::from_secs(5);

/// The owner reference of a `Host` to its `Node` (both cluster-scoped), so that the garbage
/// collector removes the `Host` with the node.
pub fn node_owner(node: &Node) -> Option<OwnerReference> {
    Some(OwnerReference {
        api_version: "v1".to_string(),
        kind: "Node".to_string(),
        name: node.metadata.name.clone()?,
        uid: node.metadata.uid.clone().filter(|u| !u.is_empty())?,
        controller: None,
        block_owner_deletion: None,
    })
}

/// The `Host` status: the `Ready` condition (`Serving` while the agent serves, `Stopped` once
/// it stopped) for the object's `generation`; `since` is the condition's transition time.
pub fn host_status(ready: bool, generation: Option<i64>, since: Timestamp) -> HostStatus {
    let (status, reason, message) = if ready {
        (
            "True",
            REASON_SERVING,
            "the node agent serves the operator and reports this host",
        )
    } else {
        (
            "False",
            REASON_STOPPED,
            "the node agent stopped; its engines are not driven until it is back",
        )
    };
    HostStatus {
        conditions: vec![Condition {
            type_: conditions::HOST_READY.to_string(),
            status: status.to_string(),
            reason: reason.to_string(),
            message: message.to_string(),
            observed_generation: generation,
            last_transition_time: Time(since),
        }],
        observed_generation: generation,
    }
}

/// Writes this node's `Host` object when it changes, and its `Ready` condition.
#[derive(Clone)]
pub struct HostPublisher {
    api: Api<Host>,
    nodes: Api<Node>,
    node: String,
    /// The spec last written; `None` before the first write.
    last: Option<HostSpec>,
    /// The object's generation after the last write.
    generation: Option<i64>,
    /// The owner reference to the `Node`; `None` until the `Node` has been read (or when
    /// there is no such `Node`: out of a cluster, tests).
    owner: Option<OwnerReference>,
    /// Whether the `Node` has been looked up (found or not).
    owner_known: bool,
    /// The `Ready` status last written, the generation it was for and since when.
    ready: Option<(bool, Option<i64>, Timestamp)>,
}

impl std::fmt::Debug for HostPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostPublisher")
            .field("node", &self.node)
            .field("last", &self.last)
            .field("owner", &self.owner)
            .finish_non_exhaustive()
    }
}

/// The running publisher (see [`HostPublisher::spawn`]).
#[derive(Debug)]
pub struct PublisherHandle {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl PublisherHandle {
    /// Stops publishing and writes `Ready=False` (bounded by [`STOP_WRITE_BOUND`]).
    pub async fn stop(self) {
        self.stop.send_replace(true);
        if tokio::time::timeout(STOP_WRITE_BOUND * 2, self.task)
            .await
            .is_err()
        {
            tracing::warn!("the Host publisher did not stop in time");
        }
    }
}

impl HostPublisher {
    /// A publisher of the `Host` named `node` through `client`.
    pub fn new(client: Client, node: impl Into<String>) -> Self {
        Self {
            api: Api::all(client.clone()),
            nodes: Api::all(client),
            node: node.into(),
            last: None,
            generation: None,
            owner: None,
            owner_known: false,
            ready: None,
        }
    }

    /// The node's name (the object's name).
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The spec last written.
    pub fn last(&self) -> Option<&HostSpec> {
        self.last.as_ref()
    }

    /// Reads the `Node` once for the owner reference (again after a failed read).
    async fn look_up_owner(&mut self) {
        if self.owner_known {
            return;
        }
        match self.nodes.get_opt(&self.node).await {
            Ok(node) => {
                self.owner = node.as_ref().and_then(node_owner);
                self.owner_known = true;
                if self.owner.is_none() {
                    tracing::info!(node = %self.node, "no Node of this name: the Host object has no owner and outlives the agent");
                }
            }
            Err(e) => {
                tracing::warn!(node = %self.node, error = %e, "cannot read the Node; the Host object is written without its owner for now");
            }
        }
    }

    /// Applies `spec` unless it is the one last written, then the `Ready=True` status unless it
    /// is written already; true when it wrote the spec.
    pub async fn publish(&mut self, spec: HostSpec) -> Result<bool, kube::Error> {
        let had_owner = self.owner.is_some();
        self.look_up_owner().await;
        let wrote = if self.last.as_ref() == Some(&spec) && had_owner == self.owner.is_some() {
            false
        } else {
            let mut host = Host::new(&self.node, spec.clone());
            host.metadata.owner_references = self.owner.clone().map(|o| vec![o]);
            let written = self
                .api
                .patch(
                    &self.node,
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(&host),
                )
                .await?;
            tracing::info!(node = %self.node, "Host object published");
            self.last = Some(spec);
            self.generation = written.metadata.generation;
            true
        };
        self.set_ready(true).await?;
        Ok(wrote)
    }

    /// Writes the `Ready` condition (`ready`) in the status unless it is written already for
    /// the current generation.
    pub async fn set_ready(&mut self, ready: bool) -> Result<(), kube::Error> {
        let since = match self.ready {
            Some((r, g, _)) if r == ready && g == self.generation => return Ok(()),
            Some((r, _, since)) if r == ready => since,
            // Whole seconds: what the API server keeps of a condition's time.
            _ => Timestamp::from_second(Timestamp::now().as_second())
                .unwrap_or_else(|_| Timestamp::now()),
        };
        let body = serde_json::json!({
            "apiVersion": capyctl_crds::API_VERSION,
            "kind": "Host",
            "status": host_status(ready, self.generation, since),
        });
        self.api
            .patch_status(
                &self.node,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&body),
            )
            .await?;
        self.ready = Some((ready, self.generation, since));
        Ok(())
    }

    /// Reads the agent's inventory and engines and publishes them: see [`Self::publish`].
    pub async fn publish_from(
        &mut self,
        agent: &dyn HostAgent,
        policy: &HostPolicy,
    ) -> Result<bool, String> {
        let inv = agent.inventory().await.map_err(|e| e.to_string())?;
        let engines = agent.engines().await;
        self.publish(host_spec(&inv, &engines, policy))
            .await
            .map_err(|e| format!("cannot write the Host object {}: {e}", self.node))
    }

    /// Publishes at once, then every `every`, until [`PublisherHandle::stop`], which writes
    /// `Ready=False`. Failures are logged and retried at the next tick.
    pub fn spawn(
        mut self,
        agent: Arc<dyn HostAgent>,
        policy: HostPolicy,
        every: Duration,
    ) -> PublisherHandle {
        let (stop, mut stopping) = watch::channel(false);
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = stopping.wait_for(|s| *s) => break,
                }
                if let Err(e) = self.publish_from(agent.as_ref(), &policy).await {
                    tracing::warn!(node = %self.node, error = %e, "cannot publish the Host object; retrying");
                }
            }
            if self.last.is_some() {
                match tokio::time::timeout(STOP_WRITE_BOUND, self.set_ready(false)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        tracing::warn!(node = %self.node, error = %e, "cannot write Ready=False on the Host object")
                    }
                    Err(_) => {
                        tracing::warn!(node = %self.node, "writing Ready=False on the Host object took too long")
                    }
                }
            }
        });
        PublisherHandle { stop, task }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::pin::pin;

    use capyctl_spec::EngineKind;
    use http::{Request, Response};
    use kube::client::Body;
    use tower_test::mock;

    use super::*;
    use crate::capability::engine_info;
    use crate::inventory::{GpuInfo, HostMemory};

    fn inventory(gpu_bytes: u64) -> Inventory {
        Inventory {
            gpus: vec![GpuInfo {
                index: 0,
                uuid: Some("GPU-1234".into()),
                name: None,
                total_bytes: gpu_bytes,
                free_bytes: None,
                unified: false,
            }],
            gpus_overridden: true,
            host_memory: HostMemory {
                total_bytes: 64 << 30,
                available_bytes: 60 << 30,
                overridden: true,
            },
        }
    }

    fn policy() -> HostPolicy {
        HostPolicy::from(&HostConfig::defaults(
            capyctl_spec::settings::Mode::ServerAndHosts,
        ))
    }

    fn spec(gpu_bytes: u64) -> HostSpec {
        let engines: Vec<EngineInfo> = EngineKind::ALL
            .iter()
            .map(|k| engine_info(*k, Some("0.31.0".into())))
            .collect();
        host_spec(&inventory(gpu_bytes), &engines, &policy())
    }

    #[test]
    fn the_spec_has_the_gpus_memory_engines_and_policy() {
        let s = spec(80 << 30);
        assert_eq!(s.gpus.len(), 1);
        assert_eq!(s.gpus[0].uuid.as_deref(), Some("GPU-1234"));
        assert_eq!(s.gpus[0].memory.as_u64(), 80 << 30);
        assert!(!s.gpus[0].unified);
        assert_eq!(s.host_memory.map(|b| b.as_u64()), Some(64 << 30));
        assert_eq!(s.engines.len(), EngineKind::ALL.len());
        let tf = s
            .engines
            .iter()
            .find(|e| e.engine == EngineKind::Tensorfold)
            .unwrap();
        assert_eq!(tf.deep_park, "TensorFold does not park: it stops");
        let vllm = s
            .engines
            .iter()
            .find(|e| e.engine == EngineKind::Vllm)
            .unwrap();
        assert_eq!(vllm.deep_park, "enabled");
        assert_eq!(vllm.version.as_deref(), Some("0.31.0"));
        assert_eq!(s.resource_policy.queue, policy().queue);
    }

    /// A mock API server: `GET` of the Node answers `node` (404 when `None`), a `PATCH` of
    /// the Host answers its body with a generation bumped on every spec write, a `PATCH` of
    /// its status answers its body; `fail_first` answers the first Host write 403. Returns
    /// what it saw: method, path, query and body.
    fn serve(
        handle: mock::Handle<Request<Body>, Response<Body>>,
        calls: usize,
        node: Option<serde_json::Value>,
        fail_first: bool,
    ) -> tokio::task::JoinHandle<Vec<(String, String, String, serde_json::Value)>> {
        tokio::spawn(async move {
            let mut handle = pin!(handle);
            let mut seen = Vec::new();
            let mut generation = 0;
            let mut failed = !fail_first;
            for _ in 0..calls {
                let (request, send) = handle.next_request().await.unwrap();
                let (parts, body) = request.into_parts();
                let bytes = body.collect_bytes().await.unwrap();
                let body: serde_json::Value = if bytes.is_empty() {
                    serde_json::Value::Null
                } else {
                    serde_json::from_slice(&bytes).unwrap()
                };
                let path = parts.uri.path().to_string();
                seen.push((
                    parts.method.to_string(),
                    path.clone(),
                    parts.uri.query().unwrap_or_default().to_string(),
                    body.clone(),
                ));
                let (status, answer) = if path.starts_with("/api/v1/nodes/") {
                    match &node {
                        Some(n) => (200, n.clone()),
                        None => (
                            404,
                            serde_json::json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
                                "status": "Failure", "reason": "NotFound", "code": 404, "message": "not found"}),
                        ),
                    }
                } else if !failed {
                    failed = true;
                    (
                        403,
                        serde_json::json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
                            "status": "Failure", "message": "forbidden", "reason": "Forbidden", "code": 403}),
                    )
                } else if path.ends_with("/status") {
                    let mut b = body;
                    b["metadata"] = serde_json::json!({"name": "gpu-node-1"});
                    b["spec"] = serde_json::json!({});
                    (200, b)
                } else {
                    generation += 1;
                    let mut b = body;
                    b["metadata"]["generation"] = generation.into();
                    (200, b)
                };
                send.send_response(
                    Response::builder()
                        .status(status)
                        .header(http::header::CONTENT_TYPE, "application/json")
                        .body(Body::from(serde_json::to_vec(&answer).unwrap()))
                        .unwrap(),
                );
            }
            seen
        })
    }

    fn node() -> serde_json::Value {
        serde_json::json!({"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": "gpu-node-1", "uid": "node-uid-1"}})
    }

    fn publisher() -> (HostPublisher, mock::Handle<Request<Body>, Response<Body>>) {
        let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
        (
            HostPublisher::new(Client::new(service, "capyctl"), "gpu-node-1"),
            handle,
        )
    }

    #[tokio::test]
    async fn the_host_is_applied_server_side_owned_by_its_node_and_ready() {
        let (mut publisher, handle) = publisher();
        let server = serve(handle, 3, Some(node()), false);
        assert!(publisher.publish(spec(80 << 30)).await.unwrap());
        let seen = server.await.unwrap();
        assert_eq!(seen[0].0, "GET");
        assert_eq!(seen[0].1, "/api/v1/nodes/gpu-node-1");
        let (method, path, query, body) = &seen[1];
        assert_eq!(method, "PATCH");
        assert_eq!(path, "/apis/capyctl.io/v1alpha1/hosts/gpu-node-1");
        let mut pairs: Vec<&str> = query.split('&').filter(|p| !p.is_empty()).collect();
        pairs.sort_unstable();
        assert_eq!(pairs, ["fieldManager=capyctl-node-agent", "force=true"]);
        assert_eq!(body["apiVersion"], "capyctl.io/v1alpha1");
        assert_eq!(body["kind"], "Host");
        assert_eq!(body["metadata"]["name"], "gpu-node-1");
        assert!(body["metadata"].get("namespace").is_none());
        let owner = &body["metadata"]["ownerReferences"][0];
        assert_eq!(owner["kind"], "Node");
        assert_eq!(owner["apiVersion"], "v1");
        assert_eq!(owner["uid"], "node-uid-1");
        assert_eq!(body["spec"]["gpus"][0]["uuid"], "GPU-1234");
        assert_eq!(body["spec"]["gpus"][0]["memory"], "80GiB");
        assert_eq!(body["spec"]["hostMemory"], "64GiB");
        assert_eq!(
            body["spec"]["engines"].as_array().unwrap().len(),
            EngineKind::ALL.len()
        );
        assert!(body["spec"]["resourcePolicy"]["queue"].is_object());
        assert!(body.get("status").is_none_or(serde_json::Value::is_null));
        // The status: Ready=True for the generation written.
        let (method, path, query, body) = &seen[2];
        assert_eq!(method, "PATCH");
        assert_eq!(path, "/apis/capyctl.io/v1alpha1/hosts/gpu-node-1/status");
        assert!(query.contains("fieldManager=capyctl-node-agent"), "{query}");
        let ready = &body["status"]["conditions"][0];
        assert_eq!(ready["type"], "Ready");
        assert_eq!(ready["status"], "True");
        assert_eq!(ready["reason"], REASON_SERVING);
        assert_eq!(ready["observedGeneration"], 1);
        assert_eq!(body["status"]["observedGeneration"], 1);
    }

    #[tokio::test]
    async fn an_unchanged_host_is_not_written_again_and_a_change_is() {
        let (mut publisher, handle) = publisher();
        // No Node of that name: no owner. Then: spec, status; nothing; spec, status (a new
        // generation).
        let server = serve(handle, 5, None, false);
        assert!(publisher.publish(spec(80 << 30)).await.unwrap());
        assert!(!publisher.publish(spec(80 << 30)).await.unwrap());
        assert!(publisher.publish(spec(40 << 30)).await.unwrap());
        let seen = server.await.unwrap();
        let calls: Vec<(&str, &str)> = seen
            .iter()
            .map(|(m, p, _, _)| (m.as_str(), p.rsplit('/').next().unwrap()))
            .collect();
        assert_eq!(
            calls,
            [
                ("GET", "gpu-node-1"),
                ("PATCH", "gpu-node-1"),
                ("PATCH", "status"),
                ("PATCH", "gpu-node-1"),
                ("PATCH", "status")
            ]
        );
        assert!(seen[1].3["metadata"].get("ownerReferences").is_none());
        assert_eq!(seen[3].3["spec"]["gpus"][0]["memory"], "40GiB");
        assert_eq!(seen[4].3["status"]["observedGeneration"], 2);
        // The transition time stays: Ready did not change.
        assert_eq!(
            seen[2].3["status"]["conditions"][0]["lastTransitionTime"],
            seen[4].3["status"]["conditions"][0]["lastTransitionTime"]
        );
        assert_eq!(publisher.last(), Some(&spec(40 << 30)));
    }

    #[tokio::test]
    async fn a_failed_write_is_retried_at_the_next_publish() {
        let (mut publisher, handle) = publisher();
        let server = serve(handle, 4, Some(node()), true);
        assert!(publisher.publish(spec(80 << 30)).await.is_err());
        assert_eq!(publisher.last(), None);
        assert!(publisher.publish(spec(80 << 30)).await.unwrap());
        let seen = server.await.unwrap();
        // The Node is read once.
        assert_eq!(
            seen.iter()
                .filter(|s| s.1.starts_with("/api/v1/nodes"))
                .count(),
            1
        );
        assert_eq!(
            seen[3].1,
            "/apis/capyctl.io/v1alpha1/hosts/gpu-node-1/status"
        );
    }

    /// An agent answering the inventory and the engines of [`spec`].
    struct Fixed;

    impl HostAgent for Fixed {
        fn inventory(&self) -> crate::agent::BoxFuture<'_, Result<Inventory, crate::AgentError>> {
            Box::pin(async { Ok(inventory(80 << 30)) })
        }
        fn engines(&self) -> crate::agent::BoxFuture<'_, Vec<EngineInfo>> {
            Box::pin(async {
                EngineKind::ALL
                    .iter()
                    .map(|k| engine_info(*k, Some("0.31.0".into())))
                    .collect()
            })
        }
        fn measure<'a>(
            &'a self,
            _: &'a crate::spec::InstanceSpec,
        ) -> crate::agent::BoxFuture<'a, Result<crate::measure::Measurement, crate::AgentError>>
        {
            unimplemented!()
        }
        fn parkability<'a>(
            &'a self,
            _: &'a crate::spec::InstanceSpec,
        ) -> crate::agent::BoxFuture<'a, Result<crate::tier::ParkChoice, crate::AgentError>>
        {
            unimplemented!()
        }
        fn start<'a>(
            &'a self,
            _: &'a str,
            _: &'a crate::spec::InstanceSpec,
        ) -> crate::agent::BoxFuture<'a, Result<crate::agent::StartedInstance, crate::AgentError>>
        {
            unimplemented!()
        }
        fn park<'a>(
            &'a self,
            _: &'a str,
        ) -> crate::agent::BoxFuture<'a, Result<crate::agent::ParkResult, crate::AgentError>>
        {
            unimplemented!()
        }
        fn wake<'a>(
            &'a self,
            _: &'a str,
        ) -> crate::agent::BoxFuture<'a, Result<crate::agent::WakeReport, crate::AgentError>>
        {
            unimplemented!()
        }
        fn stop<'a>(
            &'a self,
            _: &'a str,
        ) -> crate::agent::BoxFuture<'a, Result<(), crate::AgentError>> {
            unimplemented!()
        }
        fn sample(&self, _: &str) -> Option<crate::load::LoadSample> {
            None
        }
        fn recover(
            &self,
        ) -> crate::agent::BoxFuture<'_, Result<crate::agent::RecoveryReport, crate::AgentError>>
        {
            unimplemented!()
        }
    }

    #[tokio::test]
    async fn a_stopping_publisher_says_ready_false() {
        let (publisher, handle) = publisher();
        let mut handle = Box::pin(handle);
        let running = publisher.spawn(Arc::new(Fixed), policy(), Duration::from_secs(3600));
        let answer = |send: mock::SendResponse<Response<Body>>, mut body: serde_json::Value| {
            body["metadata"]["name"] = "gpu-node-1".into();
            if body.get("spec").is_none() {
                body["spec"] = serde_json::json!({});
            }
            send.send_response(
                Response::builder()
                    .status(200)
                    .body(Body::from(serde_json::to_vec(&body).unwrap()))
                    .unwrap(),
            );
        };
        // The first tick publishes at once: the Node, the spec, Ready=True.
        let mut paths = Vec::new();
        let mut last = serde_json::Value::Null;
        for i in 0..3 {
            let (request, send) = handle.next_request().await.unwrap();
            paths.push(request.uri().path().to_string());
            let bytes = request.into_body().collect_bytes().await.unwrap();
            let body: serde_json::Value = if i == 0 {
                node()
            } else {
                serde_json::from_slice(&bytes).unwrap()
            };
            last = body.clone();
            answer(send, body);
        }
        assert_eq!(last["status"]["conditions"][0]["status"], "True");
        let stopping = tokio::spawn(running.stop());
        let (request, send) = handle.next_request().await.unwrap();
        paths.push(request.uri().path().to_string());
        let body: serde_json::Value =
            serde_json::from_slice(&request.into_body().collect_bytes().await.unwrap()).unwrap();
        answer(send, body.clone());
        stopping.await.unwrap();
        assert_eq!(
            paths,
            [
                "/api/v1/nodes/gpu-node-1",
                "/apis/capyctl.io/v1alpha1/hosts/gpu-node-1",
                "/apis/capyctl.io/v1alpha1/hosts/gpu-node-1/status",
                "/apis/capyctl.io/v1alpha1/hosts/gpu-node-1/status",
            ]
        );
        let ready = &body["status"]["conditions"][0];
        assert_eq!(ready["status"], "False");
        assert_eq!(ready["reason"], REASON_STOPPED);
    }
}
