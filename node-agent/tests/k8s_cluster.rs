//! The node agent against a real API server (Kubernetes 1.34; no kubelet needed: only objects
//! are written). Every test is `#[ignore = "needs cluster"]` and runs when
//! `CAPYCTL_TEST_KUBECONFIG` names a kubeconfig whose user may manage CRDs and `Host` objects:
//!
//! ```sh
//! CAPYCTL_TEST_KUBECONFIG=~/.kube/config cargo test -p capyctl-node-agent --test k8s_cluster -- --ignored
//! ```
//!
//! The CRDs are applied from `charts/capyctl/crds/` (server-side apply, so a rerun is
//! harmless); each test's `Node` and `Host` have names of their own and are deleted when it
//! ends, passed or failed.
#![allow(clippy::unwrap_used)]

mod common;
use capyctl_test_support::cluster;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use capyctl_crds::Host;
use capyctl_spec::EngineKind;
use k8s_openapi::api::core::v1::Node;
use kube::api::PostParams;
use kube::{Api, ResourceExt};

const TOKEN: &str = "k8s-cluster-test-token";

/// A host document whose engines are the simulator.
fn host_document(dir: &Path, host_memory: &str) -> PathBuf {
    let bin = common::engine_sim_binary();
    let bin = bin.display();
    let path = dir.join(format!("host-{host_memory}.yaml"));
    std::fs::write(
        &path,
        format!(
            "id: box-k8s\ngpus:\n  - memory: 80GiB\n    unified: false\n    uuid: GPU-k8s-test-0\nhost_memory: {host_memory}\nengines:\n  vllm:\n    command: [\"{bin}\"]\n    version: \"0.31.0\"\n  sglang:\n    command: [\"{bin}\"]\n  tensorfold:\n    command: [\"{bin}\"]\n"
        ),
    )
    .unwrap();
    path
}

use capyctl_test_support::free_port;

/// Runs `capyctl-node-agent --engine-runtime process --publish-host` as node `node`.
fn agent(kubeconfig: &Path, doc: &Path, node: &str, data: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_capyctl-node-agent"))
        .env_remove("CAPYCTL_AGENT_TOKEN_FILE")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("KUBERNETES_SERVICE_PORT")
        .env("CAPYCTL_AGENT_TOKEN", TOKEN)
        .env("KUBECONFIG", kubeconfig)
        .env("RUST_LOG", "warn")
        .arg("--file")
        .arg(doc)
        .args([
            "--node-name",
            node,
            "--engine-runtime",
            "process",
            "--publish-host",
        ])
        .args(["--listen", &format!("127.0.0.1:{}", free_port())])
        .arg("--data-dir")
        .arg(data)
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

/// SIGTERM, then the exit status (bounded).
fn stop(mut child: Child) -> std::process::ExitStatus {
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the node agent did not exit within 30 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits (a watch, bounded) until the `Host` `name` satisfies `ok`; the agent must stay up.
async fn wait_host(
    api: &Api<Host>,
    name: &str,
    child: &mut Child,
    ok: impl Fn(&Host) -> bool,
) -> Host {
    let cond = move |h: Option<&Host>| h.is_some_and(&ok);
    let found = tokio::time::timeout(
        Duration::from_secs(30),
        kube::runtime::wait::await_condition(api.clone(), name, cond),
    )
    .await;
    match found {
        Ok(Ok(Some(host))) => host,
        Ok(other) => panic!("watching Host {name}: {other:?}"),
        Err(_) => panic!(
            "no matching Host {name} within 30 s (the node agent {})",
            match child.try_wait().unwrap() {
                Some(status) => format!("exited: {status}"),
                None => "still runs".to_string(),
            }
        ),
    }
}

fn ready_condition(host: &Host) -> Option<String> {
    host.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .map(|c| c.status.clone())
}

#[tokio::test]
#[ignore = "needs cluster"]
async fn the_node_agent_publishes_its_host_owned_by_its_node_ready_and_updates_it_in_place() {
    let (kubeconfig, client) = cluster::cluster().await;
    cluster::install_crds(&client).await;
    let hosts: Api<Host> = Api::all(client.clone());
    let node = cluster::unique("capyctl-test-node");
    // Cleanup (the Node and the Host are cluster-scoped) rides on a namespace of its own.
    let cleanup = cluster::TestNamespace::create(&kubeconfig, &client, "capyctl-test").await;
    cleanup.also_delete(format!("/apis/capyctl.io/v1alpha1/hosts/{node}"));
    cleanup.also_delete(format!("/api/v1/nodes/{node}"));
    // A Node object (no kubelet behind it): the Host's owner.
    let nodes: Api<Node> = Api::all(client.clone());
    let node_object: Node =
        serde_json::from_value(serde_json::json!({"metadata": {"name": node}})).unwrap();
    let node_uid = nodes
        .create(&PostParams::default(), &node_object)
        .await
        .unwrap()
        .uid()
        .unwrap();
    let dir = common::temp_dir("k8s-cluster");
    let data = dir.join("data");

    let mut child = agent(&kubeconfig, &host_document(&dir, "1GiB"), &node, &data);
    let host = wait_host(&hosts, &node, &mut child, |h| {
        ready_condition(h).as_deref() == Some("True")
    })
    .await;
    let spec = &host.spec;
    assert_eq!(spec.gpus.len(), 1);
    assert_eq!(spec.gpus[0].uuid.as_deref(), Some("GPU-k8s-test-0"));
    assert_eq!(spec.gpus[0].memory.as_u64(), 80 << 30);
    assert!(!spec.gpus[0].unified);
    assert_eq!(spec.host_memory.map(|m| m.as_u64()), Some(1 << 30));
    assert_eq!(spec.engines.len(), EngineKind::ALL.len());
    let vllm = spec
        .engines
        .iter()
        .find(|e| e.engine == EngineKind::Vllm)
        .unwrap();
    assert_eq!(vllm.version.as_deref(), Some("0.31.0"));
    assert_eq!(vllm.deep_park, "enabled");
    let tf = spec
        .engines
        .iter()
        .find(|e| e.engine == EngineKind::Tensorfold)
        .unwrap();
    assert_eq!(tf.deep_park, "TensorFold does not park: it stops");
    let owners = host.owner_references();
    assert_eq!(owners.len(), 1, "{owners:?}");
    assert_eq!(
        (owners[0].kind.as_str(), owners[0].uid.as_str()),
        ("Node", node_uid.as_str())
    );
    let managers: Vec<(String, String, Option<String>)> = host
        .managed_fields()
        .iter()
        .map(|m| {
            (
                m.manager.clone().unwrap_or_default(),
                m.operation.clone().unwrap_or_default(),
                m.subresource.clone(),
            )
        })
        .collect();
    for sub in [None, Some("status".to_string())] {
        assert!(
            managers.contains(&(
                "capyctl-node-agent".to_string(),
                "Apply".to_string(),
                sub.clone()
            )),
            "{managers:?}"
        );
    }
    let uid = host.uid().unwrap();
    let status = stop(child);
    assert_eq!(status.code(), Some(0), "{status:?}");
    // A clean stop says so.
    let stopped = hosts.get(&node).await.unwrap();
    assert_eq!(ready_condition(&stopped).as_deref(), Some("False"));

    // A changed host document: the same object, updated, ready again.
    let mut child = agent(&kubeconfig, &host_document(&dir, "2GiB"), &node, &data);
    let host = wait_host(&hosts, &node, &mut child, |h| {
        h.spec.host_memory.map(|m| m.as_u64()) == Some(2 << 30)
            && ready_condition(h).as_deref() == Some("True")
    })
    .await;
    assert_eq!(
        host.uid().as_deref(),
        Some(uid.as_str()),
        "the Host was recreated"
    );
    assert_eq!(host.spec.gpus[0].uuid.as_deref(), Some("GPU-k8s-test-0"));
    let status = stop(child);
    assert_eq!(status.code(), Some(0), "{status:?}");
    let _ = std::fs::remove_dir_all(dir);
}
