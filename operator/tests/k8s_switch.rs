//! The Kubernetes adapter on the real lifecycle: `Deployment` CRs reconciled into the same
//! lifecycle, router and listener the standalone mode uses, with the real `engine-sim` binary
//! as the engines (in-process host agent), and a mock API server holding the CRs (the shared
//! `CrsApi`, on tower-test) that answers every call and keeps what it was sent. A request through the router switches the GPU; the
//! CRs' status and Events show the park and the wake; deleting a CR removes its deployment.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use capyctl_crds::Deployment;
use capyctl_lifecycle::api::ManagementApi;
use capyctl_node_agent::HostAgent;
use capyctl_operator::FINALIZER;
use capyctl_operator::reconcile::{Reconciler, ReconcilerConfig};
use capyctl_spec::InstanceState;
use capyctl_test_support::crs_api::CrsApi;
use capyctl_test_support::harness::{Harness, Opts, temp_dir};
use kube::Api;

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
    let mock = CrsApi::default();
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
        assert_eq!(status.state.as_deref(), Some("stopped"));
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
        mock.cr("chat-a").status.unwrap().state.as_deref(),
        Some(InstanceState::Parked.as_str())
    );
    assert_eq!(
        mock.cr("chat-b").status.unwrap().state.as_deref(),
        Some(InstanceState::Ready.as_str())
    );
    assert_eq!(h.chat("chat-a").await.0, 200);
    r.sync_status().await;
    // Nothing changed since: nothing is written again.
    let writes_a = mock.status_writes("chat-a").len();
    r.sync_status().await;
    assert_eq!(mock.status_writes("chat-a").len(), writes_a);

    let a = mock.cr("chat-a").status.unwrap();
    assert_eq!(a.state.as_deref(), Some(InstanceState::Ready.as_str()));
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
    assert_eq!(b.state.as_deref(), Some(InstanceState::Parked.as_str()));
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
