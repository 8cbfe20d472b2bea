//! The chart end to end on a real node (issue 29): `scripts/local-cluster.sh up` (kubelet and
//! containerd here) and `scripts/local-images.sh` (the images imported into its containerd)
//! first, then
//!
//! ```sh
//! CAPYCTL_TEST_KUBECONFIG=~/.cache/capyctl-k8s/local-cluster/kubeconfig \
//!   cargo test -p capyctl-tests --test local_cluster -- --ignored
//! ```
//!
//! `scripts/helm install` of the chart with `values-local.yaml` in a namespace of the test's own,
//! the node labelled as a GPU host, the node agent and the operators running, two `Deployment`
//! objects whose engines are engine-sim, requests through the router Service's ClusterIP that
//! start one model, switch to the other (the first parked, its engine Pod kept) and back (woken),
//! the objects' status following (`kubectl get cdeploy`, `kubectl capyctl list/status`),
//! `kubectl capyctl start --evict`, the faults of a real node (the node agent's container killed:
//! its engines adopted, none started twice; an engine Pod deleted by hand: its model fails and
//! its next request starts it afresh; the kubelet restarted: everything runs on), a deleted
//! object's engine Pod removed, the operators stopped (the leader releases its Lease) and
//! `helm uninstall` leaving none of the release's objects. Skipped when
//! `CAPYCTL_TEST_KUBECONFIG` is unset, as every needs-cluster test, and when the cluster has no
//! Ready node (a control plane only, as `../shared/tools/k8s/k8s-up.sh` starts). Runs as root
//! (it kills a container through containerd and restarts the kubelet).
#![allow(clippy::unwrap_used)]

use capyctl_test_support::cluster;

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

/// The engine Pods of the CR `name` that are Running (and not being deleted), by name.
async fn running_engine_pods(pods: &Api<Pod>, name: &str) -> Vec<String> {
    engine_pod_uids(pods, name)
        .await
        .into_iter()
        .map(|(name, _)| name)
        .collect()
}

/// [`running_engine_pods`] with their UIDs (a Pod made again under the same name differs).
async fn engine_pod_uids(pods: &Api<Pod>, name: &str) -> Vec<(String, String)> {
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
        .map(|p| (p.name_any(), p.uid().unwrap_or_default()))
        .collect()
}

/// The release's objects of kind `K` left in the test's namespace, as `kind/name`.
async fn release_objects<K>(ns: &cluster::TestNamespace, kind: &str) -> Vec<String>
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

/// `kubectl ARGS` (the one `scripts/local-cluster.sh` runs: `$CAPYCTL_K8S_HOME/bin/kubectl`,
/// else the PATH's) against the kubeconfig; panics with its output when it fails.
fn kubectl(kubeconfig: &std::path::Path, args: &[&str]) -> String {
    let home = std::env::var_os("CAPYCTL_K8S_HOME").map_or_else(
        || PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/capyctl-k8s"),
        PathBuf::from,
    );
    let built = home.join("bin/kubectl");
    let program = if built.exists() {
        built
    } else {
        PathBuf::from("kubectl")
    };
    run(&program, args, &[("KUBECONFIG", kubeconfig.as_os_str())])
}

/// `kubectl capyctl ARGS` (the workspace's `kubectl-capyctl`, built first when missing or stale)
/// against the kubeconfig; panics with its output when it fails.
fn kubectl_capyctl(kubeconfig: &std::path::Path, args: &[&str]) -> String {
    let plugin = capyctl_test_support::workspace_binary("capyctl", "kubectl-capyctl");
    run(&plugin, args, &[("KUBECONFIG", kubeconfig.as_os_str())])
}

/// Runs `program ARGS` with `env` in the workspace; its stdout, or a panic with its output.
fn run(program: &std::path::Path, args: &[&str], env: &[(&str, &std::ffi::OsStr)]) -> String {
    let mut command = std::process::Command::new(program);
    command.args(args).current_dir(repo_root());
    for (k, v) in env {
        command.env(k, v);
    }
    for k in ["CAPYCTL_SERVER", "CAPYCTL_ADMIN_TOKEN", "CAPYCTL_NAMESPACE"] {
        command.env_remove(k);
    }
    let out = command.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{} {args:?} failed: {stdout}{}",
        program.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The `State` column of `kubectl get cdeploy` (the CRD's printer columns) for each row, by
/// name.
fn printed_states(kubeconfig: &std::path::Path, ns: &str) -> Vec<(String, String)> {
    let table = kubectl(kubeconfig, &["get", "cdeploy", "-n", ns]);
    let mut lines = table.lines();
    let header: Vec<&str> = lines.next().unwrap_or("").split_whitespace().collect();
    let column = header
        .iter()
        .position(|h| *h == "STATE")
        .unwrap_or_else(|| panic!("no STATE column: {table}"));
    lines
        .map(|l| {
            let cells: Vec<&str> = l.split_whitespace().collect();
            (cells[0].to_string(), cells[column].to_string())
        })
        .collect()
}

/// The states `kubectl capyctl list deployments --json` gives, by name.
fn listed_states(kubeconfig: &std::path::Path, ns: &str) -> Vec<(String, String)> {
    let out = kubectl_capyctl(kubeconfig, &["-n", ns, "list", "deployments", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let mut states: Vec<(String, String)> = v["deployments"]
        .as_array()
        .unwrap_or_else(|| panic!("no deployments: {out}"))
        .iter()
        .map(|d| {
            (
                d["name"].as_str().unwrap().to_string(),
                d["state"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    states.sort();
    states
}

/// The node agent's Pod (there is one node).
async fn agent_pod(pods: &Api<Pod>) -> Pod {
    pods.list(&ListParams::default().labels("app.kubernetes.io/component=node-agent"))
        .await
        .unwrap()
        .items
        .remove(0)
}

/// The restart count and the container ID (without its `containerd://`) of `pod`'s first
/// container.
fn container_of(pod: &Pod) -> (i32, String) {
    let status = &pod
        .status
        .as_ref()
        .unwrap()
        .container_statuses
        .as_ref()
        .unwrap()[0];
    let id = status.container_id.clone().unwrap_or_default();
    (
        status.restart_count,
        id.trim_start_matches("containerd://").to_string(),
    )
}

/// The local cluster's containerd (`scripts/local-cluster.sh`'s socket).
const CONTAINERD: &str = "/run/capyctl-local/containerd.sock";

fn pod_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

#[tokio::test]
#[ignore = "needs cluster"]
async fn the_chart_runs_end_to_end_on_a_real_node() {
    let (kubeconfig, client) = cluster::cluster().await;
    let nodes: Api<Node> = Api::all(client.clone());
    let ready = nodes.list(&ListParams::default()).await.unwrap().items;
    let Some(node) = ready.into_iter().find(|n| {
        n.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
    }) else {
        panic!(
            "this test needs a cluster with a Ready node: `scripts/local-cluster.sh up`, then \
             `scripts/local-images.sh` (README, A local cluster); against a cluster of an API \
             server alone (`k8s-up.sh`), leave it out with \
             `--skip the_chart_runs_end_to_end_on_a_real_node`"
        );
    };
    let node_name = node.name_any();
    let started = Instant::now();

    // The node is a GPU host (values-local.yaml declares its GPU in host.gpus).
    let label = serde_json::json!({"metadata": {"labels": {"capyctl.io/gpu-host": "true"}}});
    nodes
        .patch(&node_name, &PatchParams::default(), &Patch::Merge(&label))
        .await
        .unwrap();

    let ns = cluster::TestNamespace::create(&kubeconfig, &client, "capyctl-node").await;
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

    // The objects' printer columns and `kubectl capyctl` follow the states.
    let want = |a: &str, b: &str| {
        vec![
            ("chat-a".to_string(), a.to_string()),
            ("chat-b".to_string(), b.to_string()),
        ]
    };
    assert_eq!(
        printed_states(&kubeconfig, &ns.name),
        want("ready", "parked")
    );
    assert_eq!(
        listed_states(&kubeconfig, &ns.name),
        want("ready", "parked")
    );
    let status = kubectl_capyctl(
        &kubeconfig,
        &["-n", &ns.name, "status", "deployment", "chat-a", "--json"],
    );
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(status["state"], "ready", "{status}");
    assert_eq!(status["name"], "chat-a", "{status}");
    // `start --evict` parks chat-a to make room and wakes chat-b.
    let t = Instant::now();
    kubectl_capyctl(
        &kubeconfig,
        &[
            "-n",
            &ns.name,
            "start",
            "deployment",
            "chat-b",
            "--evict",
            "--wait",
        ],
    );
    eprintln!("kubectl capyctl start --evict in {:?}", t.elapsed());
    assert_eq!(
        listed_states(&kubeconfig, &ns.name),
        want("parked", "ready")
    );
    wait_states(&crs, &[("chat-a", "parked"), ("chat-b", "ready")]).await;
    assert_eq!(
        printed_states(&kubeconfig, &ns.name),
        want("parked", "ready")
    );
    let (status, body) = chat(&addr, "chat-b").await;
    assert_eq!(status, 200, "{body}");

    // Fault: the node agent's container killed. The kubelet restarts it; the new agent adopts
    // both engines (chat-b ready, chat-a parked) in their Pods: none is started again.
    let t = Instant::now();
    let engines = [
        engine_pod_uids(&pods, "chat-a").await,
        engine_pod_uids(&pods, "chat-b").await,
    ];
    let before = agent_pod(&pods).await;
    let (restarts, container) = container_of(&before);
    run(
        std::path::Path::new("ctr"),
        &[
            "--address",
            CONTAINERD,
            "-n",
            "k8s.io",
            "task",
            "kill",
            "-s",
            "SIGKILL",
            &container,
        ],
        &[],
    );
    let agent_name = before.name_any();
    wait_for(
        "the node agent's container restarted and Ready",
        Duration::from_secs(120),
        || async {
            let p = pods.get(&agent_name).await.unwrap();
            let (now, _) = container_of(&p);
            if now > restarts && pod_ready(&p) {
                Ok(())
            } else {
                Err(format!("{now} restart(s), ready: {}", pod_ready(&p)))
            }
        },
    )
    .await;
    // The operator hears of the restart (the agent's exits' epoch) and has it recover.
    let adopted = wait_for(
        "the restarted node agent adopting both engine Pods",
        Duration::from_secs(60),
        || async {
            let log = pods
                .logs(&agent_name, &kube::api::LogParams::default())
                .await
                .map_err(|e| e.to_string())?;
            let adopted = log
                .lines()
                .filter(|l| l.contains("engine Pod adopted"))
                .count();
            if adopted >= 2 {
                Ok(adopted)
            } else {
                Err(format!("{adopted} adopted: {log}"))
            }
        },
    )
    .await;
    assert_eq!(adopted, 2);
    assert_eq!(
        [
            engine_pod_uids(&pods, "chat-a").await,
            engine_pod_uids(&pods, "chat-b").await,
        ],
        engines,
        "no engine started twice"
    );
    let (status, body) = chat(&addr, "chat-b").await;
    assert_eq!(status, 200, "{body}");
    // The adopted parked engine wakes in its Pod.
    let (status, body) = chat(&addr, "chat-a").await;
    assert_eq!(status, 200, "{body}");
    wait_states(&crs, &[("chat-a", "ready"), ("chat-b", "parked")]).await;
    assert_eq!(engine_pod_uids(&pods, "chat-a").await, engines[0]);
    eprintln!(
        "node agent killed, restarted, engines adopted in {:?}",
        t.elapsed()
    );

    // Fault: chat-a's engine Pod deleted by hand (after the agent's restart: the adopted engine
    // is watched). The model fails; its next request starts it afresh in a new Pod.
    let t = Instant::now();
    pods.delete(&engines[0][0].0, &DeleteParams::default())
        .await
        .unwrap();
    wait_states(&crs, &[("chat-a", "failed"), ("chat-b", "parked")]).await;
    let (status, body) = chat(&addr, "chat-a").await;
    assert_eq!(status, 200, "{body}");
    wait_states(&crs, &[("chat-a", "ready"), ("chat-b", "parked")]).await;
    let restarted = engine_pod_uids(&pods, "chat-a").await;
    assert_eq!(restarted.len(), 1, "{restarted:?}");
    assert_ne!(restarted, engines[0], "a new engine Pod");
    eprintln!(
        "engine Pod deleted, model failed and restarted in {:?}",
        t.elapsed()
    );

    // Fault: the kubelet restarted. The engines and the node agent run on in their Pods; the
    // models serve and switch as before.
    let t = Instant::now();
    let engines = [restarted, engine_pod_uids(&pods, "chat-b").await];
    let (restarts, _) = container_of(&agent_pod(&pods).await);
    run(
        &repo_root().join("scripts/local-cluster.sh"),
        &["restart", "kubelet"],
        &[],
    );
    let (status, body) = chat(&addr, "chat-a").await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = chat(&addr, "chat-b").await;
    assert_eq!(status, 200, "{body}");
    wait_states(&crs, &[("chat-a", "parked"), ("chat-b", "ready")]).await;
    assert_eq!(
        [
            engine_pod_uids(&pods, "chat-a").await,
            engine_pod_uids(&pods, "chat-b").await,
        ],
        engines
    );
    assert_eq!(container_of(&agent_pod(&pods).await).0, restarts);
    eprintln!("kubelet restarted, models switched in {:?}", t.elapsed());

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

    // The clean uninstall (README, A local cluster): the operators stopped first, the leader
    // releases its Lease on SIGTERM (its Role is still there), then helm uninstall.
    let operators: Api<AppsDeployment> = ns.api();
    let scale = serde_json::json!({"spec": {"replicas": 0}});
    operators
        .patch(
            &format!("{RELEASE}-operator"),
            &PatchParams::default(),
            &Patch::Merge(&scale),
        )
        .await
        .unwrap();
    wait_for("the operators stopped", Duration::from_secs(90), || async {
        let left = pods
            .list(&ListParams::default().labels("app.kubernetes.io/component=operator"))
            .await
            .unwrap()
            .items
            .len();
        if left == 0 {
            Ok(())
        } else {
            Err(format!("{left} operator Pod(s)"))
        }
    })
    .await;
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> = ns.api();
    let lease = leases.get(&format!("{RELEASE}-operator")).await.unwrap();
    let holder = lease.spec.and_then(|s| s.holder_identity);
    assert_eq!(holder, None, "the leader released its Lease");

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
