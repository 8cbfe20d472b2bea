//! `capyctl-node-agent --engine-runtime process --publish-host` against a stand-in API server
//! on a loopback socket (a kubeconfig pointing at it): the agent's `Host` object arrives as a
//! server-side apply.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{OriginalUri, State};
use axum::routing::{get, patch};
use tokio::sync::mpsc;

/// What the stand-in API server saw: path, query and JSON body of each PATCH.
type Seen = (String, String, serde_json::Value);

async fn apply(
    State(tx): State<mpsc::UnboundedSender<Seen>>,
    OriginalUri(uri): OriginalUri,
    body: Bytes,
) -> ([(&'static str, &'static str); 1], Bytes) {
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let _ = tx.send((
        uri.path().to_string(),
        uri.query().unwrap_or_default().to_string(),
        json,
    ));
    // An apply answers the object.
    ([("content-type", "application/json")], body)
}

/// Engine Pods: an empty list, and a watch that never sends anything. Each call's path and
/// query go to `tx` (with a `Null` body).
async fn pods(
    State(tx): State<mpsc::UnboundedSender<Seen>>,
    OriginalUri(uri): OriginalUri,
) -> axum::response::Response {
    let query = uri.query().unwrap_or_default().to_string();
    let watch = query.contains("watch=true");
    let _ = tx.send((uri.path().to_string(), query, serde_json::Value::Null));
    let body = if watch {
        axum::body::Body::from_stream(
            futures_util::stream::pending::<Result<Bytes, std::io::Error>>(),
        )
    } else {
        axum::body::Body::from(
            r#"{"apiVersion":"v1","kind":"PodList","metadata":{"resourceVersion":"1"},"items":[]}"#,
        )
    };
    axum::response::Response::builder()
        .header("content-type", "application/json")
        .body(body)
        .unwrap()
}

/// A stand-in API server: its address, and what it saw.
async fn stand_in() -> (std::net::SocketAddr, mpsc::UnboundedReceiver<Seen>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let app = Router::new()
        .route("/apis/capyctl.io/v1alpha1/hosts/{name}", patch(apply))
        .route("/api/v1/namespaces/{ns}/pods", get(pods))
        .with_state(tx);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let api = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (api, rx)
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
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
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

#[tokio::test]
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

#[tokio::test]
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
