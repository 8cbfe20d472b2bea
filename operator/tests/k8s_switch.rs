//! The Kubernetes adapter on the real lifecycle: `Deployment` CRs reconciled into the same
//! lifecycle, router and listener the standalone mode uses, with the real `engine-sim` binary
//! as the engines (in-process host agent), and a mock API server (the shared `MockApi`, on tower-test) that answers
//! every call and keeps what it was sent. A request through the router switches the GPU; the
//! CRs' status and Events show the park and the wake; deleting a CR removes its deployment.
#![allow(clippy::unwrap_used)]

#[path = "../../lifecycle/tests/lifecycle_support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use capyctl_crds::Deployment;
use capyctl_lifecycle::api::ManagementApi;
use capyctl_node_agent::HostAgent;
use capyctl_operator::FINALIZER;
use capyctl_operator::reconcile::{Reconciler, ReconcilerConfig};
use capyctl_spec::InstanceState;
use http::Method;
use kube::{Api, Client};
use support::{Harness, Opts, temp_dir};

const NS_PATH: &str = "/apis/capyctl.io/v1alpha1/namespaces/capyctl/deployments/";

/// One call the mock API server answered.
#[derive(Debug, Clone)]
struct Call {
    method: Method,
    path: String,
    body: serde_json::Value,
}

/// A mock API server holding CRs: finalizer patches and status applies change them, Events
/// are echoed; every call is kept.
#[derive(Clone, Default)]
struct MockApi {
    crs: Arc<Mutex<BTreeMap<String, serde_json::Value>>>,
    calls: Arc<Mutex<Vec<Call>>>,
}

impl MockApi {
    fn cr(&self, name: &str) -> Deployment {
        serde_json::from_value(self.crs.lock().unwrap()[name].clone()).unwrap()
    }

    fn answer(
        &self,
        method: &Method,
        path: &str,
        body: &serde_json::Value,
    ) -> (u16, serde_json::Value) {
        let mut crs = self.crs.lock().unwrap();
        if let Some(rest) = path.strip_prefix(NS_PATH) {
            let (name, status) = match rest.strip_suffix("/status") {
                Some(n) => (n, true),
                None => (rest, false),
            };
            let Some(cr) = crs.get_mut(name) else {
                return (
                    404,
                    serde_json::json!({"kind": "Status", "code": 404, "reason": "NotFound", "message": "not found"}),
                );
            };
            if *method == Method::PATCH {
                if status {
                    cr["status"] = body["status"].clone();
                } else {
                    // The finalizer helper's JSON patch; the API server's `test` takes an
                    // absent member as `null`, json-patch needs it spelled.
                    let patch: json_patch::Patch = serde_json::from_value(body.clone()).unwrap();
                    let mut patched = cr.clone();
                    patched["metadata"]
                        .as_object_mut()
                        .unwrap()
                        .entry("finalizers")
                        .or_insert(serde_json::Value::Null);
                    if let Err(e) = json_patch::patch(&mut patched, &patch) {
                        return (
                            422,
                            serde_json::json!({"kind": "Status", "code": 422, "reason": "Invalid", "message": e.to_string()}),
                        );
                    }
                    *cr = patched;
                }
                let rv: u64 = cr["metadata"]["resourceVersion"]
                    .as_str()
                    .unwrap()
                    .parse()
                    .unwrap();
                cr["metadata"]["resourceVersion"] = (rv + 1).to_string().into();
            }
            return (200, cr.clone());
        }
        if path.starts_with("/apis/events.k8s.io/v1/namespaces/capyctl/events") {
            return (200, body.clone());
        }
        (
            404,
            serde_json::json!({"kind": "Status", "code": 404, "reason": "NotFound", "message": path}),
        )
    }

    fn client(&self) -> Client {
        let (client, api) = capyctl_test_support::MockApi::client("capyctl");
        let me = self.clone();
        api.serve_with(move |call| {
            let (status, body) = me.answer(&call.method, &call.path, &call.body);
            me.calls.lock().unwrap().push(Call {
                method: call.method.clone(),
                path: call.path.clone(),
                body: call.body.clone(),
            });
            capyctl_test_support::Answer::Json { status, body }
        });
        client
    }

    /// The reasons of the Events about `name`, in order.
    fn events(&self, name: &str) -> Vec<String> {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .filter(|c| c.path.contains("/events") && c.body["regarding"]["name"] == name)
            .map(|c| c.body["reason"].as_str().unwrap_or_default().to_string())
            .collect()
    }

    fn status_writes(&self, name: &str) -> Vec<serde_json::Value> {
        let path = format!("{NS_PATH}{name}/status");
        self.calls
            .lock()
            .unwrap()
            .iter()
            .filter(|c| c.method == Method::PATCH && c.path == path)
            .map(|c| c.body["status"].clone())
            .collect()
    }
}

fn cr_json(name: &str, uid: &str) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "capyctl.io/v1alpha1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": "capyctl", "uid": uid,
                     "resourceVersion": "1", "generation": 1},
        "spec": {"engine": "vllm", "model": "Qwen3-4B",
                 "resources": {"gpuMemory": "6GiB", "weightsMemory": "64MiB"},
                 "env": {"ENGINE_SIM_WEIGHTS_BYTES": "64MiB"}},
    })
}

#[tokio::test]
async fn crs_switch_through_the_router_and_their_status_and_events_show_it() {
    let dir = temp_dir("k8s-switch");
    let h = Harness::new(&dir, Opts::default()).await;
    let mock = MockApi::default();
    mock.crs
        .lock()
        .unwrap()
        .insert("chat-a".into(), cr_json("chat-a", "uid-a"));
    mock.crs
        .lock()
        .unwrap()
        .insert("chat-b".into(), cr_json("chat-b", "uid-b"));
    let client = mock.client();
    let agent: Arc<dyn HostAgent> = h.agent.clone();
    let r = Reconciler::new(
        h.server.clone(),
        Api::namespaced(client.clone(), "capyctl"),
        Some(Reconciler::recorder(client, Some("op-a".into()))),
        Some(agent),
        ReconcilerConfig::default(),
    );

    // New CRs: the finalizer first (a pass that does nothing else), then the pass its patch
    // triggers deploys into the lifecycle and writes the status.
    for name in ["chat-a", "chat-b"] {
        r.reconcile(Arc::new(mock.cr(name))).await.unwrap();
        assert!(
            h.server.get(name).await.is_err(),
            "not deployed before its finalizer"
        );
        r.reconcile(Arc::new(mock.cr(name))).await.unwrap();
    }
    for name in ["chat-a", "chat-b"] {
        let cr = mock.cr(name);
        assert!(
            cr.metadata
                .finalizers
                .unwrap()
                .contains(&FINALIZER.to_string())
        );
        let status = cr.status.unwrap();
        let view = h.server.get(name).await.unwrap();
        assert_eq!(status.deployment_id.as_deref(), Some(view.id.as_str()));
        assert_eq!(status.state, Some(InstanceState::Stopped));
        assert_eq!(status.hosts.as_deref(), Some("gpu-box"));
        let parkable = status
            .conditions
            .iter()
            .find(|c| c.type_ == "Parkable")
            .unwrap();
        assert_eq!(
            (parkable.status.as_str(), parkable.reason.as_str()),
            ("True", "host_ram"),
            "the host agent says how it parks"
        );
    }

    // A request for chat-a starts it; one for chat-b switches the GPU; one for chat-a again
    // wakes it.
    assert_eq!(h.chat("chat-a").await.0, 200);
    r.sync_status().await;
    assert_eq!(h.chat("chat-b").await.0, 200);
    r.sync_status().await;
    assert_eq!(
        mock.cr("chat-a").status.unwrap().state,
        Some(InstanceState::Parked)
    );
    assert_eq!(
        mock.cr("chat-b").status.unwrap().state,
        Some(InstanceState::Ready)
    );
    assert_eq!(h.chat("chat-a").await.0, 200);
    r.sync_status().await;
    // Nothing changed since: nothing is written again.
    let writes_a = mock.status_writes("chat-a").len();
    r.sync_status().await;
    assert_eq!(mock.status_writes("chat-a").len(), writes_a);

    let a = mock.cr("chat-a").status.unwrap();
    assert_eq!(a.state, Some(InstanceState::Ready));
    assert_eq!(a.ready.as_deref(), Some("1/1"));
    assert_eq!(a.instances[0].generation, 1, "woken, not restarted");
    // The switch back to chat-a is recorded phase by phase, its wake check apart from the
    // wake (the agent's report says how long the check took).
    let back = loop {
        let list = h
            .server
            .switches(capyctl_spec::api::SwitchQuery::default())
            .await
            .unwrap();
        let found = list.switches.into_iter().rev().find(|r| {
            r.deployment == "chat-a"
                && r.cause == capyctl_spec::api::SwitchCause::Wave
                && r.outcome != capyctl_spec::api::SwitchOutcome::InProgress
        });
        if let Some(r) = found {
            break r;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert_eq!(
        back.outcome,
        capyctl_spec::api::SwitchOutcome::Ok,
        "{back:?}"
    );
    let phases: Vec<&str> = back.phases.iter().map(|p| p.phase.word()).collect();
    assert_eq!(
        phases,
        [
            "admission_window",
            "drain",
            "park",
            "wake",
            "wake_check",
            "release"
        ],
        "{back:?}"
    );
    assert_eq!(back.victims[0].deployment, "chat-b", "{back:?}");
    let b = mock.cr("chat-b").status.unwrap();
    assert_eq!(b.state, Some(InstanceState::Parked));
    assert_eq!(
        b.instances[0].residency,
        Some(capyctl_spec::Residency::HostBacked)
    );
    assert_eq!(
        mock.events("chat-a"),
        ["Deployed", "Started", "Parked", "Woken"]
    );
    assert_eq!(mock.events("chat-b"), ["Deployed", "Started", "Parked"]);

    // Deleting chat-b: gone from the lifecycle (its engine stopped), then the finalizer goes.
    let mut deleting = mock.crs.lock().unwrap()["chat-b"].clone();
    deleting["metadata"]["deletionTimestamp"] = "2026-12-03T08:00:00Z".into();
    let deleting: Deployment = serde_json::from_value(deleting).unwrap();
    r.reconcile(Arc::new(deleting)).await.unwrap();
    assert!(h.server.get("chat-b").await.is_err());
    assert!(
        h.agent
            .sample(&format!("{}-0", b.deployment_id.unwrap()))
            .is_none()
    );
    let finalizers = mock.cr("chat-b").metadata.finalizers.unwrap_or_default();
    assert!(
        !finalizers.contains(&FINALIZER.to_string()),
        "{finalizers:?}"
    );
    assert_eq!(
        mock.events("chat-b").last().map(String::as_str),
        Some("Deleted")
    );
    // The router no longer knows it.
    assert_eq!(h.chat("chat-b").await.0, 404);
    h.shutdown().await;
}
