//! This node's `Host` object (cluster-scoped, name = the node's name), written by its node
//! agent: the GPUs (UUID, memory, unified), the host's RAM, the engines with their versions and
//! DEEP PARK, and the resource policy and activation of the host document.
//!
//! It is written by server-side apply with the field manager [`FIELD_MANAGER`] (forced: the
//! node agent owns these fields), at start and whenever what it would write changes; the
//! agent re-checks every [`RECHECK`] and never writes an unchanged object twice. Host RAM is
//! the total (or the `host_memory` override), not what is available, so the object does not
//! change with every allocation.

use std::sync::Arc;
use std::time::Duration;

use capyctl_crds::Activation;
use capyctl_crds::k8s::{
    EngineSpec, GpuSpec, Host, HostLifecycleSpec, HostSpec, QueueSpec, ResourcePolicySpec,
};
use capyctl_crds::settings::HostConfig;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};

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

/// Writes this node's `Host` object when it changes.
#[derive(Clone)]
pub struct HostPublisher {
    api: Api<Host>,
    node: String,
    /// The spec last written; `None` before the first write.
    last: Option<HostSpec>,
}

impl std::fmt::Debug for HostPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostPublisher")
            .field("node", &self.node)
            .field("last", &self.last)
            .finish_non_exhaustive()
    }
}

impl HostPublisher {
    /// A publisher of the `Host` named `node` through `client`.
    pub fn new(client: Client, node: impl Into<String>) -> Self {
        Self {
            api: Api::all(client),
            node: node.into(),
            last: None,
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

    /// Applies `spec` unless it is the one last written; true when it wrote.
    pub async fn publish(&mut self, spec: HostSpec) -> Result<bool, kube::Error> {
        if self.last.as_ref() == Some(&spec) {
            return Ok(false);
        }
        let host = Host::new(&self.node, spec.clone());
        self.api
            .patch(
                &self.node,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&host),
            )
            .await?;
        tracing::info!(node = %self.node, "Host object published");
        self.last = Some(spec);
        Ok(true)
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

    /// Publishes at once, then every `every`, until the task is aborted. Failures are logged
    /// and retried at the next tick.
    pub async fn run(mut self, agent: Arc<dyn HostAgent>, policy: HostPolicy, every: Duration) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if let Err(e) = self.publish_from(agent.as_ref(), &policy).await {
                tracing::warn!(node = %self.node, error = %e, "cannot publish the Host object; retrying");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::pin::pin;

    use capyctl_crds::EngineKind;
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
            capyctl_crds::settings::Mode::ServerAndHosts,
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

    /// Answers every call with its own JSON body (as an apply does) and returns what it saw:
    /// method, path, query and body.
    fn serve(
        handle: mock::Handle<Request<Body>, Response<Body>>,
        calls: usize,
    ) -> tokio::task::JoinHandle<Vec<(String, String, String, serde_json::Value)>> {
        tokio::spawn(async move {
            let mut handle = pin!(handle);
            let mut seen = Vec::new();
            for _ in 0..calls {
                let (request, send) = handle.next_request().await.unwrap();
                let (parts, body) = request.into_parts();
                let bytes = body.collect_bytes().await.unwrap();
                let body: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
                seen.push((
                    parts.method.to_string(),
                    parts.uri.path().to_string(),
                    parts.uri.query().unwrap_or_default().to_string(),
                    body.clone(),
                ));
                send.send_response(
                    Response::builder()
                        .status(200)
                        .header(http::header::CONTENT_TYPE, "application/json")
                        .body(Body::from(serde_json::to_vec(&body).unwrap()))
                        .unwrap(),
                );
            }
            seen
        })
    }

    fn publisher() -> (HostPublisher, mock::Handle<Request<Body>, Response<Body>>) {
        let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
        (
            HostPublisher::new(Client::new(service, "capyctl"), "gpu-node-1"),
            handle,
        )
    }

    #[tokio::test]
    async fn the_host_is_applied_server_side_with_the_agents_field_manager() {
        let (mut publisher, handle) = publisher();
        let server = serve(handle, 1);
        assert!(publisher.publish(spec(80 << 30)).await.unwrap());
        let seen = server.await.unwrap();
        let (method, path, query, body) = &seen[0];
        assert_eq!(method, "PATCH");
        assert_eq!(path, "/apis/capyctl.io/v1alpha1/hosts/gpu-node-1");
        let mut pairs: Vec<&str> = query.split('&').filter(|p| !p.is_empty()).collect();
        pairs.sort_unstable();
        assert_eq!(pairs, ["fieldManager=capyctl-node-agent", "force=true"]);
        assert_eq!(body["apiVersion"], "capyctl.io/v1alpha1");
        assert_eq!(body["kind"], "Host");
        assert_eq!(body["metadata"]["name"], "gpu-node-1");
        assert!(body["metadata"].get("namespace").is_none());
        assert_eq!(body["spec"]["gpus"][0]["uuid"], "GPU-1234");
        assert_eq!(body["spec"]["gpus"][0]["memory"], "80GiB");
        assert_eq!(body["spec"]["hostMemory"], "64GiB");
        assert_eq!(
            body["spec"]["engines"].as_array().unwrap().len(),
            EngineKind::ALL.len()
        );
        assert!(body["spec"]["resourcePolicy"]["queue"].is_object());
        assert!(body.get("status").is_none_or(serde_json::Value::is_null));
    }

    #[tokio::test]
    async fn an_unchanged_host_is_not_written_again_and_a_change_is() {
        let (mut publisher, handle) = publisher();
        let server = serve(handle, 2);
        assert!(publisher.publish(spec(80 << 30)).await.unwrap());
        assert!(!publisher.publish(spec(80 << 30)).await.unwrap());
        assert!(publisher.publish(spec(40 << 30)).await.unwrap());
        let seen = server.await.unwrap();
        assert_eq!(seen.len(), 2);
        assert_eq!(seen[1].3["spec"]["gpus"][0]["memory"], "40GiB");
        assert_eq!(publisher.last(), Some(&spec(40 << 30)));
    }

    #[tokio::test]
    async fn a_failed_write_is_retried_at_the_next_publish() {
        let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
        let mut publisher = HostPublisher::new(Client::new(service, "capyctl"), "gpu-node-1");
        let server = tokio::spawn(async move {
            let mut handle = pin!(handle);
            let (_, send) = handle.next_request().await.unwrap();
            send.send_response(
                Response::builder()
                    .status(403)
                    .header(http::header::CONTENT_TYPE, "application/json")
                    .body(Body::from(
                        serde_json::to_vec(&serde_json::json!({
                            "kind": "Status", "apiVersion": "v1", "metadata": {},
                            "status": "Failure", "message": "forbidden", "reason": "Forbidden", "code": 403
                        }))
                        .unwrap(),
                    ))
                    .unwrap(),
            );
            let (request, send) = handle.next_request().await.unwrap();
            let method = request.method().to_string();
            let body = request.into_body().collect_bytes().await.unwrap();
            send.send_response(
                Response::builder()
                    .status(200)
                    .body(Body::from(body.to_vec()))
                    .unwrap(),
            );
            method
        });
        assert!(publisher.publish(spec(80 << 30)).await.is_err());
        assert_eq!(publisher.last(), None);
        assert!(publisher.publish(spec(80 << 30)).await.unwrap());
        assert_eq!(server.await.unwrap(), "PATCH");
    }
}
