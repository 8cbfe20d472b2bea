//! The chart end to end on a real node (issue 29): `scripts/local-cluster.sh up` (kubelet and
//! containerd here) and `scripts/local-images.sh` (the images imported into its containerd)
//! first, then
//!
//! ```sh
//! CAPYCTL_TEST_KUBECONFIG=~/.cache/capyctl-k8s/local-cluster/kubeconfig \
//!   cargo test -p capyctl-e2e --test local_cluster -- --ignored
//! ```
//!
//! `scripts/helm install` of the chart with `values-local.yaml` in a namespace of the test's own,
//! the node labelled as a GPU host, the node agent and the operators running, two `Deployment`
//! objects whose engines are engine-sim, requests through the router Service's ClusterIP that
//! start one model, switch to the other (the first parked, its engine Pod kept) and back (woken),
//! the objects' status following, a deleted object's engine Pod removed, and `helm uninstall`
//! leaving none of the release's objects. Skipped when `CAPYCTL_TEST_KUBECONFIG` is unset, as
//! every needs-cluster test, and when the cluster has no Ready node (a control plane only, as
//! `../shared/tools/k8s/k8s-up.sh` starts).
#![allow(clippy::unwrap_used)]

#[path = "../../operator/tests/k8s_support/mod.rs"]
mod k8s_support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment as AppsDeployment};
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, Secret, Service};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const RELEASE: &str = "capyctl";
const RELEASE_LABEL: &str = "app.kubernetes.io/instance=capyctl";

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// `scripts/helm ARGS` against the kubeconfig; panics with its output when it fails.
fn helm(kubeconfig: &std::path::Path, args: &[&str]) -> String {
    let out = std::process::Command::new(repo_root().join("scripts/helm"))
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .current_dir(repo_root())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "scripts/helm {args:?} failed: {text}");
    text
}

/// Polls `check` until it gives `Some`, at most `limit`; panics naming `what` and the last state.
async fn wait_for<T, F, Fut>(what: &str, limit: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + limit;
    loop {
        match check().await {
            Ok(v) => return v,
            Err(last) if Instant::now() >= deadline => {
                panic!("{what}: not within {limit:?}; last: {last}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}

/// One chat completion through the router Service at `addr` (its ClusterIP, which kube-proxy
/// serves on this node): the status code and the body.
async fn chat(addr: &str, model: &str) -> (u16, String) {
    let body = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 4,
    })
    .to_string();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream.write_all(request.as_bytes()).await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        Ok::<_, std::io::Error>(response)
    };
    let response = tokio::time::timeout(Duration::from_secs(120), exchange)
        .await
        .unwrap_or_else(|_| panic!("no answer for {model} within 120 s"))
        .unwrap();
    let text = String::from_utf8_lossy(&response).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (status, body)
}

/// The `state` of the CR's status (what `kubectl get cdeploy` prints as STATE).
async fn state(crs: &Api<capyctl_crds::Deployment>, name: &str) -> String {
    let cr = crs.get(name).await.unwrap();
    let v = serde_json::to_value(&cr).unwrap();
    v["status"]["state"].as_str().unwrap_or("").to_string()
}

/// Waits until the CRs named are in the states given.
async fn wait_states(crs: &Api<capyctl_crds::Deployment>, want: &[(&str, &str)]) {
    wait_for(
        &format!("states {want:?}"),
        Duration::from_secs(60),
        || async {
            let mut seen = Vec::new();
            for (name, _) in want {
                seen.push(state(crs, name).await);
            }
            if want.iter().zip(&seen).all(|((_, w), s)| w == s) {
                Ok(())
            } else {
                Err(format!("{seen:?}"))
            }
        },
    )
    .await
}

/// The engine Pods of the CR `name` that are Running.
async fn running_engine_pods(pods: &Api<Pod>, name: &str) -> Vec<String> {
    let lp = ListParams::default().labels(&format!("capyctl.io/deployment={name}"));
    pods.list(&lp)
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|p| {
            p.metadata.deletion_timestamp.is_none()
                && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
        })
        .map(|p| p.name_any())
        .collect()
}

/// The release's objects of kind `K` left in the test's namespace, as `kind/name`.
async fn release_objects<K>(ns: &k8s_support::TestNamespace, kind: &str) -> Vec<String>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
    <K as kube::Resource>::DynamicType: Default,
{
    let api: Api<K> = ns.api();
    api.list(&ListParams::default().labels(RELEASE_LABEL))
        .await
        .unwrap()
        .items
        .iter()
        .map(|o| format!("{kind}/{}", o.name_any()))
        .collect()
}

fn pod_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

#[tokio::test]
#[ignore = "needs cluster"]
async fn the_chart_runs_end_to_end_on_a_real_node() {
    let Some((kubeconfig, client)) = k8s_support::cluster().await else {
        return;
    };
    let nodes: Api<Node> = Api::all(client.clone());
    let ready = nodes.list(&ListParams::default()).await.unwrap().items;
    let Some(node) = ready.into_iter().find(|n| {
        n.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
    }) else {
        eprintln!(
            "the cluster has no Ready node (scripts/local-cluster.sh up, then \
             scripts/local-images.sh); skipping"
        );
        return;
    };
    let node_name = node.name_any();
    let started = Instant::now();

    // The node is a GPU host (values-local.yaml declares its GPU in host.gpus).
    let label = serde_json::json!({"metadata": {"labels": {"capyctl.io/gpu-host": "true"}}});
    nodes
        .patch(&node_name, &PatchParams::default(), &Patch::Merge(&label))
        .await
        .unwrap();

    let ns = k8s_support::TestNamespace::create(&kubeconfig, &client, "capyctl-node").await;
    for suffix in ["operator", "node-agent"] {
        let name = format!("{RELEASE}-{}-{suffix}", ns.name);
        ns.also_delete(format!(
            "/apis/rbac.authorization.k8s.io/v1/clusterroles/{name}"
        ));
        ns.also_delete(format!(
            "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{name}"
        ));
    }
    helm(
        &kubeconfig,
        &[
            "install",
            RELEASE,
            "charts/capyctl",
            "-n",
            &ns.name,
            "-f",
            "charts/capyctl/values-local.yaml",
        ],
    );

    // The node agent and both operators run and are ready.
    let pods: Api<Pod> = ns.api();
    wait_for(
        "the node agent and 2 operators Ready",
        Duration::from_secs(120),
        || async {
            let list = pods.list(&ListParams::default()).await.unwrap().items;
            let ready = |component: &str| {
                list.iter()
                    .filter(|p| {
                        p.labels()
                            .get("app.kubernetes.io/component")
                            .map(String::as_str)
                            == Some(component)
                            && pod_ready(p)
                    })
                    .count()
            };
            let (agents, operators) = (ready("node-agent"), ready("operator"));
            if agents == 1 && operators == 2 {
                Ok(())
            } else {
                Err(format!(
                    "{agents} node agent(s), {operators} operator(s) Ready"
                ))
            }
        },
    )
    .await;
    // The router Service selects the leader only: one operator leads (and labels its Pod).
    wait_for("a leader", Duration::from_secs(60), || async {
        let leaders = pods
            .list(&ListParams::default().labels("capyctl.io/leader=true"))
            .await
            .unwrap()
            .items;
        if leaders.iter().any(pod_ready) {
            Ok(())
        } else {
            Err(format!("{} labelled leader, none Ready", leaders.len()))
        }
    })
    .await;
    let agent = pods
        .list(&ListParams::default().labels("app.kubernetes.io/component=node-agent"))
        .await
        .unwrap()
        .items
        .remove(0);
    assert_eq!(
        agent.spec.as_ref().unwrap().node_name.as_deref(),
        Some(node_name.as_str())
    );

    // Two models that do not fit together on the declared 24 GiB GPU.
    let crs: Api<capyctl_crds::Deployment> = ns.api();
    for (name, model) in [("chat-a", "Qwen3-4B"), ("chat-b", "Qwen3-8B")] {
        let cr: capyctl_crds::Deployment = serde_json::from_value(serde_json::json!({
            "apiVersion": "capyctl.io/v1alpha1",
            "kind": "Deployment",
            "metadata": {"name": name},
            "spec": {"engine": "vllm", "model": model,
                     "resources": {"gpuMemory": "16GiB", "weightsMemory": "14GiB"}},
        }))
        .unwrap();
        crs.create(&PostParams::default(), &cr).await.unwrap();
    }
    wait_states(&crs, &[("chat-a", "stopped"), ("chat-b", "stopped")]).await;

    let services: Api<Service> = ns.api();
    let router = services.get(&format!("{RELEASE}-router")).await.unwrap();
    let spec = router.spec.unwrap();
    let addr = format!(
        "{}:{}",
        spec.cluster_ip.unwrap(),
        spec.ports.unwrap()[0].port
    );

    // A request starts chat-a: its engine Pod runs in containerd and answers.
    let (status, body) = chat(&addr, "chat-a").await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(r#""model":"chat-a""#), "{body}");
    wait_states(&crs, &[("chat-a", "ready"), ("chat-b", "stopped")]).await;
    assert_eq!(running_engine_pods(&pods, "chat-a").await.len(), 1);

    // chat-b's request switches the GPU: chat-a parks (its engine Pod stays), chat-b starts.
    let (status, body) = chat(&addr, "chat-b").await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(r#""model":"chat-b""#), "{body}");
    wait_states(&crs, &[("chat-a", "parked"), ("chat-b", "ready")]).await;
    let parked = running_engine_pods(&pods, "chat-a").await;
    assert_eq!(parked.len(), 1, "the parked engine's Pod is kept");

    // And back: chat-a wakes in the same Pod, chat-b parks.
    let (status, body) = chat(&addr, "chat-a").await;
    assert_eq!(status, 200, "{body}");
    wait_states(&crs, &[("chat-a", "ready"), ("chat-b", "parked")]).await;
    assert_eq!(running_engine_pods(&pods, "chat-a").await, parked);

    // Deleting an object removes its engine Pod (the finalizer stops the engine).
    crs.delete("chat-b", &DeleteParams::default())
        .await
        .unwrap();
    wait_for(
        "chat-b and its engine Pod gone",
        Duration::from_secs(60),
        || async {
            let left = pods
                .list(&ListParams::default().labels("capyctl.io/deployment=chat-b"))
                .await
                .unwrap()
                .items
                .len();
            let cr = crs.get_opt("chat-b").await.unwrap();
            if left == 0 && cr.is_none() {
                Ok(())
            } else {
                Err(format!("{left} Pod(s), object present: {}", cr.is_some()))
            }
        },
    )
    .await;
    crs.delete("chat-a", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("chat-a gone", Duration::from_secs(60), || async {
        match crs.get_opt("chat-a").await.unwrap() {
            None => Ok(()),
            Some(_) => Err("present".to_string()),
        }
    })
    .await;

    // helm uninstall leaves none of the release's objects.
    helm(&kubeconfig, &["uninstall", RELEASE, "-n", &ns.name]);
    wait_for(
        "the release's objects gone",
        Duration::from_secs(90),
        || async {
            let mut left: Vec<String> = pods
                .list(&ListParams::default())
                .await
                .unwrap()
                .items
                .iter()
                .map(|p| format!("pod/{}", p.name_any()))
                .collect();
            left.extend(release_objects::<DaemonSet>(&ns, "daemonset").await);
            left.extend(release_objects::<AppsDeployment>(&ns, "deployment").await);
            left.extend(release_objects::<Service>(&ns, "service").await);
            left.extend(release_objects::<ConfigMap>(&ns, "configmap").await);
            left.extend(release_objects::<Secret>(&ns, "secret").await);
            if left.is_empty() {
                Ok(())
            } else {
                Err(left.join(", "))
            }
        },
    )
    .await;
    eprintln!("end to end on node {node_name} in {:?}", started.elapsed());
}
