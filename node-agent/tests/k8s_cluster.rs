//! The node agent against a real API server (Kubernetes 1.34; no kubelet needed: only objects
//! are written). Every test is `#[ignore = "needs cluster"]` and runs when
//! `CAPYCTL_TEST_KUBECONFIG` names a kubeconfig whose user may manage CRDs and `Host` objects:
//!
//! ```sh
//! CAPYCTL_TEST_KUBECONFIG=~/.kube/config cargo test -p capyctl-node-agent --test k8s_cluster -- --ignored
//! ```
//!
//! The `Host` CRD is applied from `charts/capyctl/crds/` (server-side apply, so a rerun is
//! harmless); each test's `Host` has a name of its own and is deleted at its end.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use capyctl_crds::EngineKind;
use capyctl_crds::k8s::{Host, chart_crd_dir};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DeleteParams, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config, ResourceExt};

const TOKEN: &str = "k8s-cluster-test-token";

/// The kubeconfig and its client, or `None` (the test returns) when `CAPYCTL_TEST_KUBECONFIG`
/// is unset.
async fn cluster() -> Option<(PathBuf, Client)> {
    let Some(path) = std::env::var_os("CAPYCTL_TEST_KUBECONFIG").filter(|p| !p.is_empty()) else {
        eprintln!("CAPYCTL_TEST_KUBECONFIG is not set; skipping");
        return None;
    };
    let kubeconfig = Kubeconfig::read_from(&path).unwrap();
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap();
    Some((PathBuf::from(path), Client::try_from(config).unwrap()))
}

/// Applies the chart's `Host` CRD and waits until it is established.
async fn install_host_crd(client: &Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let path = chart_crd_dir().join("hosts.capyctl.io.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let crd: CustomResourceDefinition = serde_yaml_ng::from_str(&text).unwrap();
    let name = crd.name_any();
    crds.patch(
        &name,
        &PatchParams::apply("capyctl-tests").force(),
        &Patch::Apply(&crd),
    )
    .await
    .unwrap();
    tokio::time::timeout(
        Duration::from_secs(30),
        kube::runtime::wait::await_condition(
            crds,
            &name,
            kube::runtime::wait::conditions::is_crd_established(),
        ),
    )
    .await
    .unwrap()
    .unwrap();
}

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

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

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

/// Polls (bounded) until the `Host` `name` satisfies `ok`; the agent must stay up meanwhile.
async fn wait_host(
    api: &Api<Host>,
    name: &str,
    child: &mut Child,
    ok: impl Fn(&Host) -> bool,
) -> Host {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        assert!(child.try_wait().unwrap().is_none(), "the node agent exited");
        if let Some(host) = api.get_opt(name).await.unwrap()
            && ok(&host)
        {
            return host;
        }
        assert!(
            Instant::now() < deadline,
            "no matching Host {name} within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
#[ignore = "needs cluster"]
async fn the_node_agent_publishes_its_host_and_updates_it_in_place() {
    let Some((kubeconfig, client)) = cluster().await else {
        return;
    };
    install_host_crd(&client).await;
    let hosts: Api<Host> = Api::all(client.clone());
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let node = format!("capyctl-test-node-{nanos}");
    let dir = common::temp_dir("k8s-cluster");
    let data = dir.join("data");

    let mut child = agent(&kubeconfig, &host_document(&dir, "1GiB"), &node, &data);
    let host = wait_host(&hosts, &node, &mut child, |_| true).await;
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
    let managers: Vec<(String, String)> = host
        .managed_fields()
        .iter()
        .map(|m| {
            (
                m.manager.clone().unwrap_or_default(),
                m.operation.clone().unwrap_or_default(),
            )
        })
        .collect();
    assert!(
        managers.contains(&("capyctl-node-agent".to_string(), "Apply".to_string())),
        "{managers:?}"
    );
    let uid = host.uid().unwrap();
    let status = stop(child);
    assert_eq!(status.code(), Some(0), "{status:?}");

    // A changed host document: the same object, updated.
    let mut child = agent(&kubeconfig, &host_document(&dir, "2GiB"), &node, &data);
    let host = wait_host(&hosts, &node, &mut child, |h| {
        h.spec.host_memory.map(|m| m.as_u64()) == Some(2 << 30)
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

    hosts.delete(&node, &DeleteParams::default()).await.unwrap();
    let _ = std::fs::remove_dir_all(dir);
}
