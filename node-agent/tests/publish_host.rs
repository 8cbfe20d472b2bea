//! `capyctl-node-agent --engine-runtime process --publish-host` against a stand-in API server
//! (the shared mock API server) on a loopback socket (a kubeconfig pointing at it): the agent's `Host` object arrives as a
//! server-side apply.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use capyctl_test_support::{Answer, MockApi, status_body};
use http::Method;
use tokio::sync::mpsc;

/// What the stand-in API server saw: path, query and JSON body of each PATCH.
type Seen = (String, String, serde_json::Value);

/// A stand-in API server (the shared mock API server behind a loopback listener): its
/// address, and what it saw. A Host apply answers the object; the engine Pods are an empty
/// list, and a watch that never answers. Each call's path, query and body (`Null` for the
/// Pods) go to the receiver; anything else (the Node, the Host's status) is 404.
async fn stand_in() -> (std::net::SocketAddr, mpsc::UnboundedReceiver<Seen>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let (url, api) = MockApi::listen().await;
    api.serve_with(move |call| {
        let pods = call.path.starts_with("/api/v1/namespaces/") && call.path.ends_with("/pods");
        let host = call
            .path
            .strip_prefix("/apis/capyctl.io/v1alpha1/hosts/")
            .is_some_and(|name| !name.contains('/'));
        if call.method == Method::PATCH && host {
            let _ = tx.send((call.path.clone(), call.query.clone(), call.body.clone()));
            // An apply answers the object.
            Answer::Raw {
                status: 200,
                body: call.raw_body.clone(),
            }
        } else if call.method == Method::GET && pods {
            let _ = tx.send((
                call.path.clone(),
                call.query.clone(),
                serde_json::Value::Null,
            ));
            if call.query_value("watch").as_deref() == Some("true") {
                Answer::Hang
            } else {
                Answer::Json {
                    status: 200,
                    body: serde_json::json!({"apiVersion": "v1", "kind": "PodList",
                        "metadata": {"resourceVersion": "1"}, "items": []}),
                }
            }
        } else {
            // Anything else (the Node, the Host's status) is not there.
            Answer::Json {
                status: 404,
                body: status_body(404, "NotFound", &format!("{} not found", call.path)),
            }
        }
    });
    let addr = url.trim_start_matches("http://").parse().unwrap();
    (addr, rx)
}

/// The agent's command line: `runtime`, node `node-9`, the kubeconfig of `api`.
fn agent_command(dir: &std::path::Path, api: std::net::SocketAddr, runtime: &str) -> Command {
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: stand-in\n  cluster:\n    server: http://{api}\nusers:\n- name: u\n  user:\n    token: t\ncontexts:\n- name: c\n  context:\n    cluster: stand-in\n    user: u\n    namespace: capyctl\ncurrent-context: c\n"
        ),
    )
    .unwrap();
    let bin = common::engine_sim_binary();
    let doc = dir.join("host.yaml");
    std::fs::write(
        &doc,
        format!(
            "id: box-1\ngpus:\n  - memory: 80GiB\n    unified: false\n    uuid: GPU-0\nhost_memory: 1GiB\nengines:\n  vllm:\n    command: [\"{0}\"]\n  sglang:\n    command: [\"{0}\"]\n  tensorfold:\n    command: [\"{0}\"]\n",
            bin.display()
        ),
    )
    .unwrap();
    let port = capyctl_test_support::free_port();
    let mut c = Command::new(env!("CARGO_BIN_EXE_capyctl-node-agent"));
    c.env_remove("CAPYCTL_AGENT_TOKEN_FILE")
        .env_remove("CAPYCTL_PUBLISH_HOST")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("KUBERNETES_SERVICE_PORT")
        .env_remove("NODE_NAME")
        .env_remove("POD_NAMESPACE")
        .env("CAPYCTL_AGENT_TOKEN", "tok")
        .env("KUBECONFIG", &kubeconfig)
        .env("RUST_LOG", "warn")
        .arg("--file")
        .arg(&doc)
        .args(["--node-name", "node-9", "--engine-runtime", runtime])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .arg("--data-dir")
        .arg(dir.join("data"))
        .stdout(Stdio::null());
    c
}

/// SIGTERM, then the exit status (bounded).
fn stop(mut child: std::process::Child) -> std::process::ExitStatus {
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the node agent did not exit");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_process_runtime_publishes_the_host_with_publish_host() {
    let (api, mut rx) = stand_in().await;
    let dir = common::temp_dir("publish-host");
    let mut child = agent_command(&dir, api, "process")
        .env("CAPYCTL_PUBLISH_HOST", "1")
        .spawn()
        .unwrap();
    let seen = tokio::time::timeout(Duration::from_secs(20), rx.recv()).await;
    let alive = child.try_wait().unwrap().is_none();
    let status = stop(child);
    assert!(alive, "the node agent exited early: {status:?}");
    let (path, query, body) = seen.expect("no apply within 20 s").unwrap();
    assert_eq!(path, "/apis/capyctl.io/v1alpha1/hosts/node-9");
    assert!(query.contains("fieldManager=capyctl-node-agent"), "{query}");
    assert!(query.contains("force=true"), "{query}");
    assert_eq!(body["kind"], "Host");
    assert_eq!(body["metadata"]["name"], "node-9");
    assert_eq!(body["spec"]["gpus"][0]["uuid"], "GPU-0");
    assert_eq!(body["spec"]["gpus"][0]["memory"], "80GiB");
    assert_eq!(body["spec"]["hostMemory"], "1GiB");
    assert_eq!(body["spec"]["engines"].as_array().unwrap().len(), 3);
    assert_eq!(status.code(), Some(0), "{status:?}");
    // Unchanged: not written again while it ran.
    assert!(rx.try_recv().is_err());
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pod_runtime_watches_its_nodes_engine_pods_and_publishes_the_host() {
    let (api, mut rx) = stand_in().await;
    let dir = common::temp_dir("pod-runtime");
    let mut child = agent_command(&dir, api, "pod")
        .env("POD_NAMESPACE", "capyctl-system")
        .spawn()
        .unwrap();
    // The Host apply and the Pod list come in either order.
    let (mut host, mut list) = (None, None);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while host.is_none() || list.is_none() {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(call)) if call.0.starts_with("/apis/") => host = host.or(Some(call)),
            Ok(Some(call)) => list = list.or(Some(call)),
            _ => break,
        }
    }
    let alive = child.try_wait().unwrap().is_none();
    let status = stop(child);
    let (host, list) = (host.expect("no Host apply"), list.expect("no Pod list"));
    assert!(alive, "the node agent exited early: {status:?}");
    assert_eq!(status.code(), Some(0), "{status:?}");
    assert_eq!(host.0, "/apis/capyctl.io/v1alpha1/hosts/node-9");
    assert_eq!(host.2["spec"]["gpus"][0]["uuid"], "GPU-0");
    assert_eq!(list.0, "/api/v1/namespaces/capyctl-system/pods");
    assert!(
        list.1.contains("fieldSelector=spec.nodeName%3Dnode-9"),
        "{}",
        list.1
    );
    assert!(
        list.1.contains("labelSelector=capyctl.io%2Finstance"),
        "{}",
        list.1
    );
    let _ = std::fs::remove_dir_all(dir);
}
