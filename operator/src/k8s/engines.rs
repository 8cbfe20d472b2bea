//! [`PodHostAgent`]: the host agent of a node whose engines run in engine Pods
//! (`capyctl-node-agent --engine-runtime pod`). It wraps the node agent's client and adds what
//! only the operator may do (the node agent cannot create or delete Pods):
//!
//! - `start`: deletes the instance's old Pods, creates its engine Pod ([`super::pods`]: the
//!   next generation, owned by the instance's `Deployment` CR, on the node agent's node), then
//!   lets the node agent start it (it waits for the Pod to run and drives the engine); a failed
//!   start deletes the Pod again;
//! - `stop`: lets the node agent stop the engine, then deletes the instance's Pods (a parked
//!   engine keeps its Pod: `park` and `wake` only go to the node agent);
//! - `recover`: lets the node agent adopt what it can, then deletes the engine Pods of the node
//!   that belong to no adopted instance (nothing is leaked).
//!
//! How the engine is launched for parking (vLLM's `--enable-sleep-mode`, SGLang's CPU backup)
//! follows the node agent's `parkability` answer, as its own launch does.

use std::collections::BTreeMap;
use std::sync::Arc;

use capyctl_crds::k8s::Deployment;
use capyctl_node_agent::agent::{
    BoxFuture, EngineExit, ParkResult, RecoveryReport, StartedInstance, WakeReport,
};
use capyctl_node_agent::capability::EngineInfo;
use capyctl_node_agent::inventory::Inventory;
use capyctl_node_agent::load::LoadSample;
use capyctl_node_agent::measure::Measurement;
use capyctl_node_agent::spec::{HostSettings, InstanceSpec};
use capyctl_node_agent::tier::{LaunchParking, NoParkReason, ParkChoice, ParkTier};
use capyctl_node_agent::{AgentError, HostAgent};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, ResourceExt};
use tokio::sync::broadcast;

use super::pods::{
    EnginePod, EnginePodSettings, LABEL_DEPLOYMENT, LABEL_GENERATION, LABEL_INSTANCE, engine_pod,
};

/// The launch a parkability answer calls for (what the node agent's own launch does).
pub fn launch_for(choice: &Result<ParkChoice, AgentError>) -> LaunchParking {
    match choice {
        Ok(ParkChoice::Park(tier)) => LaunchParking {
            may_park: true,
            host_ram: *tier == ParkTier::HostRam,
        },
        Ok(ParkChoice::Stop(NoParkReason::NoRoomToPark)) => LaunchParking {
            may_park: true,
            host_ram: true,
        },
        Ok(ParkChoice::Stop(_)) | Err(_) => LaunchParking::default(),
    }
}

fn kube_error(what: &str, e: kube::Error) -> AgentError {
    AgentError::AgentUnreachable {
        url: "kubernetes".to_string(),
        detail: format!("{what}: {e}"),
    }
}

/// A host agent whose engines are Pods the operator creates (see the module doc).
pub struct PodHostAgent {
    inner: Arc<dyn HostAgent>,
    pods: Api<Pod>,
    crs: Api<Deployment>,
    settings: EnginePodSettings,
    host: HostSettings,
    node_name: String,
}

impl std::fmt::Debug for PodHostAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodHostAgent")
            .field("node_name", &self.node_name)
            .finish_non_exhaustive()
    }
}

impl PodHostAgent {
    /// Engine Pods on `node_name` built with `settings` and the engine commands of `host`,
    /// owned by the CRs of `crs`, in the namespace of `pods`; everything else goes to `inner`.
    pub fn new(
        inner: Arc<dyn HostAgent>,
        pods: Api<Pod>,
        crs: Api<Deployment>,
        settings: EnginePodSettings,
        host: HostSettings,
        node_name: impl Into<String>,
    ) -> Self {
        Self {
            inner,
            pods,
            crs,
            settings,
            host,
            node_name: node_name.into(),
        }
    }

    /// The engine Pods of this node, by instance.
    async fn pods_by_instance(&self) -> Result<BTreeMap<String, Vec<Pod>>, AgentError> {
        let list = self
            .pods
            .list(&ListParams::default().labels(LABEL_INSTANCE))
            .await
            .map_err(|e| kube_error("listing engine Pods", e))?;
        let mut by = BTreeMap::<String, Vec<Pod>>::new();
        for p in list.items {
            let on_node = p.spec.as_ref().and_then(|s| s.node_name.as_deref())
                == Some(self.node_name.as_str());
            if let (true, Some(i)) = (on_node, p.labels().get(LABEL_INSTANCE).cloned()) {
                by.entry(i).or_default().push(p);
            }
        }
        Ok(by)
    }

    async fn delete_pods(&self, pods: &[Pod]) {
        for p in pods {
            let name = p.name_any();
            match self.pods.delete(&name, &DeleteParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.is_not_found() => {}
                Err(e) => {
                    tracing::warn!(pod = %name, error = %e, "an engine Pod could not be deleted")
                }
            }
        }
    }

    /// Replaces the instance's Pods by a new one of the next generation.
    async fn create_pod(&self, instance: &str, spec: &InstanceSpec) -> Result<String, AgentError> {
        let old = self
            .pods_by_instance()
            .await?
            .remove(instance)
            .unwrap_or_default();
        let generation = old
            .iter()
            .filter_map(|p| p.labels().get(LABEL_GENERATION)?.parse::<u64>().ok())
            .max()
            .unwrap_or(0)
            + 1;
        self.delete_pods(&old).await;
        let owner = self
            .crs
            .get(&spec.name)
            .await
            .map_err(|e| kube_error(&format!("reading Deployment {}", spec.name), e))?;
        let parking = launch_for(&self.inner.parkability(spec).await);
        let pod = engine_pod(
            &EnginePod {
                owner: &owner,
                instance_id: instance,
                generation,
                spec,
                engine: self.host.engine(spec.engine),
                parking,
                node_name: &self.node_name,
                gpus: &[],
            },
            &self.settings,
        )
        .map_err(|e| AgentError::InvalidSpec {
            detail: e.to_string(),
        })?;
        let created = self
            .pods
            .create(&PostParams::default(), &pod)
            .await
            .map_err(|e| kube_error("creating the engine Pod", e))?;
        let name = created.name_any();
        tracing::info!(%instance, pod = %name, node = %self.node_name, "engine Pod created");
        Ok(name)
    }
}

impl HostAgent for PodHostAgent {
    fn inventory(&self) -> BoxFuture<'_, Result<Inventory, AgentError>> {
        self.inner.inventory()
    }

    fn engines(&self) -> BoxFuture<'_, Vec<EngineInfo>> {
        self.inner.engines()
    }

    fn measure<'a>(
        &'a self,
        spec: &'a InstanceSpec,
    ) -> BoxFuture<'a, Result<Measurement, AgentError>> {
        self.inner.measure(spec)
    }

    fn parkability<'a>(
        &'a self,
        spec: &'a InstanceSpec,
    ) -> BoxFuture<'a, Result<ParkChoice, AgentError>> {
        self.inner.parkability(spec)
    }

    fn start<'a>(
        &'a self,
        instance: &'a str,
        spec: &'a InstanceSpec,
    ) -> BoxFuture<'a, Result<StartedInstance, AgentError>> {
        Box::pin(async move {
            let pod = self.create_pod(instance, spec).await?;
            match self.inner.start(instance, spec).await {
                Ok(started) => Ok(started),
                Err(e) => {
                    tracing::warn!(%instance, %pod, error = %e, "the engine did not start; deleting its Pod");
                    let mine = self
                        .pods_by_instance()
                        .await
                        .ok()
                        .and_then(|mut m| m.remove(instance));
                    self.delete_pods(&mine.unwrap_or_default()).await;
                    Err(e)
                }
            }
        })
    }

    fn park<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<ParkResult, AgentError>> {
        Box::pin(async move {
            let result = self.inner.park(instance).await;
            // A model that does not park is stopped instead: its Pod goes.
            if let Ok(ParkResult::Stopped { .. }) = &result
                && let Ok(mut by) = self.pods_by_instance().await
            {
                self.delete_pods(&by.remove(instance).unwrap_or_default())
                    .await;
            }
            result
        })
    }

    fn wake<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<WakeReport, AgentError>> {
        Box::pin(async move {
            let report = self.inner.wake(instance).await;
            // A failed wake stops the engine: its Pod goes.
            let failed = match &report {
                Ok(r) => r.outcome.failure().is_some(),
                Err(_) => false,
            };
            if failed && let Ok(mut by) = self.pods_by_instance().await {
                self.delete_pods(&by.remove(instance).unwrap_or_default())
                    .await;
            }
            report
        })
    }

    fn stop<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<(), AgentError>> {
        Box::pin(async move {
            let result = self.inner.stop(instance).await;
            let pods = self.pods_by_instance().await?.remove(instance);
            self.delete_pods(&pods.unwrap_or_default()).await;
            result
        })
    }

    fn sample(&self, instance: &str) -> Option<LoadSample> {
        self.inner.sample(instance)
    }

    fn recover(&self) -> BoxFuture<'_, Result<RecoveryReport, AgentError>> {
        Box::pin(async move {
            let report = self.inner.recover().await?;
            let by = self.pods_by_instance().await?;
            for (instance, pods) in by {
                if !report.adopted.iter().any(|a| a.instance == instance) {
                    tracing::info!(%instance, "deleting the engine Pods of an instance nobody adopted");
                    self.delete_pods(&pods).await;
                }
            }
            Ok(report)
        })
    }

    fn subscribe_exits(&self) -> broadcast::Receiver<EngineExit> {
        self.inner.subscribe_exits()
    }

    fn samples(&self) -> BTreeMap<String, LoadSample> {
        self.inner.samples()
    }
}

/// The label selector of one deployment's engine Pods.
pub fn deployment_selector(name: &str) -> String {
    format!("{LABEL_DEPLOYMENT}={name}")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Mutex;

    use http::Method;

    use super::super::mock::{self, Exchange};
    use super::*;

    /// The node agent's side: start fails, stop and recover succeed; calls are kept.
    #[derive(Default)]
    struct Agent {
        calls: Mutex<Vec<String>>,
    }

    impl HostAgent for Agent {
        fn inventory(&self) -> BoxFuture<'_, Result<Inventory, AgentError>> {
            unimplemented!()
        }
        fn engines(&self) -> BoxFuture<'_, Vec<EngineInfo>> {
            Box::pin(async { Vec::new() })
        }
        fn measure<'a>(
            &'a self,
            _: &'a InstanceSpec,
        ) -> BoxFuture<'a, Result<Measurement, AgentError>> {
            unimplemented!()
        }
        fn parkability<'a>(
            &'a self,
            _: &'a InstanceSpec,
        ) -> BoxFuture<'a, Result<ParkChoice, AgentError>> {
            Box::pin(async { Ok(ParkChoice::Park(ParkTier::HostRam)) })
        }
        fn start<'a>(
            &'a self,
            instance: &'a str,
            _: &'a InstanceSpec,
        ) -> BoxFuture<'a, Result<StartedInstance, AgentError>> {
            self.calls.lock().unwrap().push(format!("start {instance}"));
            Box::pin(async {
                Err(AgentError::InvalidSpec {
                    detail: "the engine exited".into(),
                })
            })
        }
        fn park<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Result<ParkResult, AgentError>> {
            unimplemented!()
        }
        fn wake<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Result<WakeReport, AgentError>> {
            unimplemented!()
        }
        fn stop<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<(), AgentError>> {
            self.calls.lock().unwrap().push(format!("stop {instance}"));
            Box::pin(async { Ok(()) })
        }
        fn sample(&self, _: &str) -> Option<LoadSample> {
            None
        }
        fn recover(&self) -> BoxFuture<'_, Result<RecoveryReport, AgentError>> {
            Box::pin(async { Ok(RecoveryReport::default()) })
        }
    }

    const PODS: &str = "/api/v1/namespaces/capyctl/pods";

    fn pod(name: &str, instance: &str, generation: u64, node: &str) -> serde_json::Value {
        serde_json::json!({"metadata": {"name": name, "labels": {
                LABEL_INSTANCE: instance, LABEL_GENERATION: generation.to_string()}},
            "spec": {"nodeName": node, "containers": [{"name": "engine"}]}})
    }

    fn list(items: Vec<serde_json::Value>) -> serde_json::Value {
        serde_json::json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items})
    }

    fn spec() -> InstanceSpec {
        InstanceSpec::new(
            "01KDEP",
            "chat-a",
            capyctl_crds::EngineKind::Vllm,
            "Qwen3-4B",
        )
    }

    fn agent(client: kube::Client, inner: Arc<Agent>) -> PodHostAgent {
        PodHostAgent::new(
            inner,
            Api::namespaced(client.clone(), "capyctl"),
            Api::namespaced(client, "capyctl"),
            EnginePodSettings::default(),
            HostSettings::default(),
            "gpu-1",
        )
    }

    #[tokio::test]
    async fn start_replaces_old_pods_by_the_next_generation_and_a_failed_start_deletes_it() {
        let (client, handle) = mock::client();
        let cr = serde_json::json!({"apiVersion": "capyctl.io/v1alpha1", "kind": "Deployment",
            "metadata": {"name": "chat-a", "namespace": "capyctl", "uid": "uid-a"},
            "spec": {"engine": "vllm", "model": "Qwen3-4B"}});
        let created = pod("chat-a-0-g3", "01KDEP-0", 3, "gpu-1");
        let server = mock::serve(
            handle,
            vec![
                Exchange::ok(
                    Method::GET,
                    PODS,
                    list(vec![
                        pod("chat-a-0-g2", "01KDEP-0", 2, "gpu-1"),
                        // Another node's: not ours to count or delete.
                        pod("chat-a-0-g7", "01KDEP-0", 7, "gpu-2"),
                    ]),
                ),
                Exchange::ok(
                    Method::DELETE,
                    &format!("{PODS}/chat-a-0-g2"),
                    serde_json::json!({}),
                ),
                Exchange::ok(
                    Method::GET,
                    "/apis/capyctl.io/v1alpha1/namespaces/capyctl/deployments/chat-a",
                    cr,
                ),
                Exchange::new(Method::POST, PODS, 201, created.clone()),
                // The node agent's start failed: the new Pod goes.
                Exchange::ok(Method::GET, PODS, list(vec![created])),
                Exchange::ok(
                    Method::DELETE,
                    &format!("{PODS}/chat-a-0-g3"),
                    serde_json::json!({}),
                ),
            ],
        );
        let inner = Arc::new(Agent::default());
        let a = agent(client, inner.clone());
        let err = a.start("01KDEP-0", &spec()).await.unwrap_err();
        assert!(err.to_string().contains("the engine exited"), "{err}");
        assert_eq!(inner.calls.lock().unwrap().as_slice(), ["start 01KDEP-0"]);
        let seen = server.await.unwrap();
        let body = &seen[3].body;
        assert_eq!(body["metadata"]["name"], "chat-a-0-g3");
        assert_eq!(body["metadata"]["labels"][LABEL_GENERATION], "3");
        assert_eq!(body["metadata"]["ownerReferences"][0]["uid"], "uid-a");
        assert_eq!(body["spec"]["nodeName"], "gpu-1");
        let command = body["spec"]["containers"][0]["command"].as_array().unwrap();
        assert!(
            command.iter().any(|a| a == "--enable-sleep-mode"),
            "{command:?}"
        );
    }

    #[tokio::test]
    async fn stop_and_recovery_delete_the_pods_nobody_runs() {
        let (client, handle) = mock::client();
        let server = mock::serve(
            handle,
            vec![
                Exchange::ok(
                    Method::GET,
                    PODS,
                    list(vec![pod("chat-a-0-g1", "01KDEP-0", 1, "gpu-1")]),
                ),
                Exchange::ok(
                    Method::DELETE,
                    &format!("{PODS}/chat-a-0-g1"),
                    serde_json::json!({}),
                ),
                // Recovery: the node agent adopted nothing; the leftover Pod goes.
                Exchange::ok(
                    Method::GET,
                    PODS,
                    list(vec![pod("old-0-g4", "01KOLD-0", 4, "gpu-1")]),
                ),
                Exchange::ok(
                    Method::DELETE,
                    &format!("{PODS}/old-0-g4"),
                    serde_json::json!({}),
                ),
            ],
        );
        let inner = Arc::new(Agent::default());
        let a = agent(client, inner.clone());
        a.stop("01KDEP-0").await.unwrap();
        a.recover().await.unwrap();
        assert_eq!(inner.calls.lock().unwrap().as_slice(), ["stop 01KDEP-0"]);
        let seen = server.await.unwrap();
        assert!(
            seen[0]
                .query
                .contains("labelSelector=capyctl.io%2Finstance"),
            "{}",
            seen[0].query
        );
    }

    #[test]
    fn the_launch_follows_the_parkability() {
        assert_eq!(
            launch_for(&Ok(ParkChoice::Park(ParkTier::Deep))),
            LaunchParking {
                may_park: true,
                host_ram: false
            }
        );
        assert_eq!(
            launch_for(&Ok(ParkChoice::Stop(NoParkReason::RestartOnly))),
            LaunchParking::default()
        );
        assert_eq!(
            deployment_selector("chat-a"),
            "capyctl.io/deployment=chat-a"
        );
    }
}
