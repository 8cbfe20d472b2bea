//! End to end: `capyctl-operator` out of cluster, a `capyctl-node-agent --engine-runtime process`
//! whose engines are the engine simulator, two model manifests; a request through the router
//! switches them and the CRs' status and Events show the park and the wake; deleting a CR stops
//! its engine (the finalizer) and lets the object go. Then faults: a standby takes over from a
//! leader that releases its Lease, and from one killed mid-switch; a node agent goes away with
//! its engines.
//!
//! The same test body runs twice:
//! - against a small in-process fake API server (always; see [`fake`]): the Kubernetes calls the
//!   operator makes (Lease get/create/update, CR list/watch/patch, status apply, Events), with
//!   resource versions, finalizers, deletion and watch streams, and nothing else;
//! - against a real API server (`#[ignore = "needs cluster"]`), when `CAPYCTL_TEST_KUBECONFIG`
//!   names a kubeconfig: `CAPYCTL_TEST_KUBECONFIG=~/.kube/config cargo test -p capyctl-operator
//!   --test k8s_e2e -- --ignored`.
#![allow(clippy::unwrap_used)]

#[path = "k8s_support/crds.rs"]
mod crds;
#[path = "k8s_support/mod.rs"]
mod k8s_support;
#[path = "../../lifecycle/tests/lifecycle_support/mod.rs"]
mod support;

use std::time::Duration;

use capyctl_crds::Deployment;
use capyctl_operator::FINALIZER;
use capyctl_spec::InstanceState;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::events::v1::Event;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config, ResourceExt};

/// A child process stopped with SIGTERM (a clean shutdown: the node agent stops its engines,
/// the operator releases its Lease) when dropped.
struct Proc(std::process::Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        // A clean shutdown is bounded; one that hangs (a stalled call to the API server) is
        // killed rather than hanging the test.
        let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while std::time::Instant::now() < until {
            if !matches!(self.0.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The children's log filter: the test's `RUST_LOG`, else warnings only.
fn log_filter() -> String {
    std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".to_string())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The newest modification time of the files under `dir`.
fn newest(dir: &std::path::Path) -> std::time::SystemTime {
    let mut t = std::time::UNIX_EPOCH;
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        let m = if path.is_dir() {
            newest(&path)
        } else {
            entry
                .metadata()
                .and_then(|m| m.modified())
                .unwrap_or(std::time::UNIX_EPOCH)
        };
        t = t.max(m);
    }
    t
}

/// The `capyctl-node-agent` binary, built when missing or older than its sources (or the
/// crds').
fn node_agent_binary() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let bin = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("capyctl-node-agent");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let sources = newest(&root.join("node-agent/src"))
        .max(newest(&root.join("crds/src")))
        .max(newest(&root.join("spec/src")));
    let fresh = std::fs::metadata(&bin)
        .and_then(|m| m.modified())
        .is_ok_and(|t| t >= sources);
    if !fresh {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = std::process::Command::new(cargo)
            .args([
                "build",
                "-p",
                "capyctl-node-agent",
                "--bin",
                "capyctl-node-agent",
            ])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .unwrap();
        assert!(status.success(), "building capyctl-node-agent failed");
    }
    assert!(bin.exists(), "no capyctl-node-agent at {}", bin.display());
    bin
}

/// Polls `f` every 200 ms for at most `within` (the operator is another process: there is
/// nothing to wait on but the API server).
async fn eventually<T, F, Fut>(what: &str, within: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn model_cr(ns: &str, name: &str) -> Deployment {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "capyctl.io/v1alpha1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"engine": "vllm", "model": "Qwen3-4B",
                 "resources": {"gpuMemory": "6GiB", "weightsMemory": "64MiB"},
                 "env": {"ENGINE_SIM_WEIGHTS_BYTES": "64MiB"}},
    }))
    .unwrap()
}

async fn state_of(api: &Api<Deployment>, name: &str) -> Option<InstanceState> {
    api.get(name).await.ok()?.status?.state
}

async fn has_event(events: &Api<Event>, object: &str, reason: &str) -> bool {
    events
        .list(&ListParams::default())
        .await
        .map(|l| {
            l.items.iter().any(|e| {
                e.reason.as_deref() == Some(reason)
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(object)
            })
        })
        .unwrap_or(false)
}

/// A node agent with the process runtime whose engines are the engine simulator (one GPU of
/// 10 GiB, 1 GiB of host RAM); its port.
fn start_node_agent(dir: &std::path::Path) -> (Proc, u16) {
    let port = free_port();
    let agent = start_node_agent_at(dir, "e2e-node", "127.0.0.1", port);
    (agent, port)
}

/// A node agent of node `node` listening on `ip:port` (process runtime, the simulator).
fn start_node_agent_at(dir: &std::path::Path, node: &str, ip: &str, port: u16) -> Proc {
    let sim = support::engine_sim_binary();
    let host = dir.join(format!("host-{node}.yaml"));
    std::fs::write(
        &host,
        format!(
            "gpus: [{{memory: 10GiB}}]\nhost_memory: 1GiB\nresource_policy: {{queue: {{admission_window: 100ms}}}}\nengines:\n  vllm: {{command: [\"{}\"]}}\n",
            sim.display()
        ),
    )
    .unwrap();
    Proc(
        std::process::Command::new(node_agent_binary())
            .args(["--file", host.to_str().unwrap(), "--node-name", node])
            .args(["--engine-runtime", "process"])
            .args(["--listen", &format!("{ip}:{port}")])
            .args([
                "--data-dir",
                dir.join(format!("agent-{node}")).to_str().unwrap(),
            ])
            .env("CAPYCTL_AGENT_TOKEN", "e2e-agent-token")
            .env("RUST_LOG", log_filter())
            .spawn()
            .unwrap(),
    )
}

/// `capyctl-operator` out of cluster as replica `identity`; its inference listener.
fn start_operator(
    dir: &std::path::Path,
    kubeconfig: &std::path::Path,
    ns: &str,
    identity: &str,
    agent_port: u16,
) -> (Proc, std::net::SocketAddr) {
    start_operator_with(dir, kubeconfig, ns, identity, AgentsBy::Url(agent_port))
}

/// How the operator finds its node agents.
enum AgentsBy {
    /// `--node-agent http://127.0.0.1:<port>`.
    Url(u16),
    /// The Running node agent Pods of the namespace, on this port (as in a cluster).
    Pods(u16),
}

fn start_operator_with(
    dir: &std::path::Path,
    kubeconfig: &std::path::Path,
    ns: &str,
    identity: &str,
    agents: AgentsBy,
) -> (Proc, std::net::SocketAddr) {
    let (inference_port, management_port) = (free_port(), free_port());
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_capyctl-operator"));
    match agents {
        AgentsBy::Url(port) => {
            command.args(["--node-agent", &format!("http://127.0.0.1:{port}")]);
        }
        AgentsBy::Pods(port) => {
            command
                .env_remove("CAPYCTL_NODE_AGENT_URL")
                .env("CAPYCTL_NODE_AGENT_PORT", port.to_string());
        }
    }
    let operator = Proc(
        command
            .args([
                "--set",
                &format!("listen.inference=127.0.0.1:{inference_port}"),
            ])
            .args([
                "--set",
                &format!("listen.management=127.0.0.1:{management_port}"),
            ])
            .args(["--namespace", ns, "--identity", identity])
            .args(["--lease-name", "capyctl-e2e"])
            .args(["--data-dir", dir.join(identity).to_str().unwrap()])
            .env("KUBECONFIG", kubeconfig)
            .env("CAPYCTL_AGENT_TOKEN", "e2e-agent-token")
            .env("RUST_LOG", log_filter())
            .spawn()
            .unwrap(),
    );
    (
        operator,
        format!("127.0.0.1:{inference_port}").parse().unwrap(),
    )
}

async fn chat(inference: std::net::SocketAddr, model: &str) -> (u16, serde_json::Value) {
    support::post_json(
        inference,
        "/v1/chat/completions",
        serde_json::json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    )
    .await
}

async fn lease_holder(client: &Client, ns: &str) -> Option<String> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    leases.get("capyctl-e2e").await.ok()?.spec?.holder_identity
}

/// The end-to-end scenario in namespace `ns` of the API server of `kubeconfig` (`client`).
async fn scenario(client: Client, kubeconfig: &std::path::Path, ns: &str) {
    let dir = support::temp_dir("k8s-e2e");
    let (_agent, agent_port) = start_node_agent(&dir);
    let (_operator, inference) = start_operator(&dir, kubeconfig, ns, "op-e2e", agent_port);

    let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
    for name in ["chat-a", "chat-b"] {
        api.create(&PostParams::default(), &model_cr(ns, name))
            .await
            .unwrap();
    }
    let t = Duration::from_secs(60);
    for name in ["chat-a", "chat-b"] {
        eventually(&format!("{name} deployed"), t, || async {
            let cr = api.get(name).await.ok()?;
            let ok = cr.finalizers().iter().any(|f| f == FINALIZER)
                && cr.status?.deployment_id.is_some();
            ok.then_some(())
        })
        .await;
    }
    assert_eq!(lease_holder(&client, ns).await.as_deref(), Some("op-e2e"));

    let (status, body) = chat(inference, "chat-a").await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = chat(inference, "chat-b").await;
    assert_eq!(status, 200, "{body}");
    eventually("chat-a parked, chat-b ready in the status", t, || async {
        (state_of(&api, "chat-a").await == Some(InstanceState::Parked)
            && state_of(&api, "chat-b").await == Some(InstanceState::Ready))
        .then_some(())
    })
    .await;
    let (status, body) = chat(inference, "chat-a").await;
    assert_eq!(status, 200, "{body}");
    eventually("chat-a woken in the status", t, || async {
        (state_of(&api, "chat-a").await == Some(InstanceState::Ready)).then_some(())
    })
    .await;
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    for (object, reason) in [
        ("chat-a", "Parked"),
        ("chat-a", "Woken"),
        ("chat-a", "Switched"),
        ("chat-b", "Started"),
        ("chat-b", "Switched"),
        ("chat-b", "Parked"),
    ] {
        eventually(&format!("a {reason} event on {object}"), t, || async {
            has_event(&events, object, reason).await.then_some(())
        })
        .await;
    }
    let a = api.get("chat-a").await.unwrap().status.unwrap();
    assert_eq!(a.instances[0].generation, 1, "woken, not restarted");

    // Deleting a CR stops its engine and lets the object go.
    api.delete("chat-b", &DeleteParams::default())
        .await
        .unwrap();
    eventually("chat-b gone", t, || async {
        api.get_opt("chat-b").await.ok()?.is_none().then_some(())
    })
    .await;
    let (status, _) = chat(inference, "chat-b").await;
    assert_eq!(status, 404);
    drop(_operator);
    drop(_agent);
    let _ = std::fs::remove_dir_all(dir);
}

/// Two GPU nodes: the operator finds both node agents by their Pods (as the DaemonSet's), places
/// two models that do not fit on one GPU on one node each (nothing is parked), and a third one
/// switches on one node; the CRs' status names each instance's host.
async fn two_hosts(client: Client, kubeconfig: &std::path::Path, ns: &str) {
    let dir = support::temp_dir("k8s-e2e-hosts");
    // Both on one port, at two loopback addresses: the Pods' IPs.
    let port = free_port();
    let _a = start_node_agent_at(&dir, "node-a", "127.0.0.2", port);
    let _b = start_node_agent_at(&dir, "node-b", "127.0.0.3", port);
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), ns);
    for (name, ip) in [("agent-a", "127.0.0.2"), ("agent-b", "127.0.0.3")] {
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns,
                "labels": {"app.kubernetes.io/component": "node-agent"}},
            "spec": {"containers": [{"name": "agent", "image": "capyctl-node-agent"}],
                "automountServiceAccountToken": false},
        }))
        .unwrap();
        pods.create(&PostParams::default(), &pod).await.unwrap();
        // No kubelet: the test says it runs.
        let status = serde_json::json!({"status": {"phase": "Running", "podIP": ip,
            "podIPs": [{"ip": ip}]}});
        pods.patch_status(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&status),
        )
        .await
        .unwrap();
    }
    let (_operator, inference) =
        start_operator_with(&dir, kubeconfig, ns, "op-hosts", AgentsBy::Pods(port));

    let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
    for name in ["chat-a", "chat-b", "chat-c"] {
        api.create(&PostParams::default(), &model_cr(ns, name))
            .await
            .unwrap();
    }
    let t = Duration::from_secs(60);
    for name in ["chat-a", "chat-b", "chat-c"] {
        eventually(&format!("{name} deployed"), t, || async {
            api.get(name).await.ok()?.status?.deployment_id.map(|_| ())
        })
        .await;
    }
    let hosts_of = |name: &'static str| {
        let api = api.clone();
        async move {
            let status = api.get(name).await.ok()?.status?;
            Some((status.state, status.hosts))
        }
    };
    for name in ["chat-a", "chat-b"] {
        let (status, body) = chat(inference, name).await;
        assert_eq!(status, 200, "{name}: {body}");
    }
    let (a, b) = eventually("chat-a and chat-b ready, one per node", t, || async {
        let (sa, ha) = hosts_of("chat-a").await?;
        let (sb, hb) = hosts_of("chat-b").await?;
        let ready = sa == Some(InstanceState::Ready) && sb == Some(InstanceState::Ready);
        // One host each (the column joins several with commas).
        let one = |h: &Option<String>| h.clone().filter(|h| !h.is_empty() && !h.contains(','));
        Some((one(&ha)?, one(&hb)?)).filter(|_| ready)
    })
    .await;
    let mut nodes = [a.clone(), b.clone()];
    nodes.sort();
    assert_eq!(nodes, ["node-a".to_string(), "node-b".to_string()]);
    // chat-c fits on neither: one switch on one node parks the longer-idle chat-a.
    let (status, body) = chat(inference, "chat-c").await;
    assert_eq!(status, 200, "{body}");
    eventually(
        "chat-a parked where it ran, chat-c ready beside it",
        t,
        || async {
            let (sa, ha) = hosts_of("chat-a").await?;
            let (sc, hc) = hosts_of("chat-c").await?;
            let (sb, _) = hosts_of("chat-b").await?;
            (sa == Some(InstanceState::Parked)
                && sc == Some(InstanceState::Ready)
                && sb == Some(InstanceState::Ready)
                && ha.as_deref() == Some(a.as_str())
                && hc.as_deref() == Some(a.as_str()))
            .then_some(())
        },
    )
    .await;
    drop(_operator);
    drop(_a);
    drop(_b);
    let _ = std::fs::remove_dir_all(dir);
}

/// Failover: the leader shuts down (it stops its work, then releases the Lease), the standby
/// takes over, rebuilds the deployment from the CR's status (same ID) and adopts the running
/// engine from the node agent (a request is served by the same engine, generation 1).
async fn failover(client: Client, kubeconfig: &std::path::Path, ns: &str) {
    let dir = support::temp_dir("k8s-failover");
    let (_agent, agent_port) = start_node_agent(&dir);
    let (a, inference_a) = start_operator(&dir, kubeconfig, ns, "op-a", agent_port);
    let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
    api.create(&PostParams::default(), &model_cr(ns, "chat-a"))
        .await
        .unwrap();
    let t = Duration::from_secs(60);
    let id = eventually("chat-a deployed", t, || async {
        api.get("chat-a").await.ok()?.status?.deployment_id
    })
    .await;
    assert_eq!(lease_holder(&client, ns).await.as_deref(), Some("op-a"));
    let (_b, inference_b) = start_operator(&dir, kubeconfig, ns, "op-b", agent_port);
    let (status, body) = chat(inference_a, "chat-a").await;
    assert_eq!(status, 200, "{body}");
    eventually("chat-a ready in the status", t, || async {
        (state_of(&api, "chat-a").await == Some(InstanceState::Ready)).then_some(())
    })
    .await;
    // The standby does not serve while it stands by.
    assert!(
        support::try_post_json(inference_b, "/v1/chat/completions", serde_json::json!({}))
            .await
            .is_err()
    );

    drop(a);
    eventually("op-b holds the Lease", t, || async {
        (lease_holder(&client, ns).await.as_deref() == Some("op-b")).then_some(())
    })
    .await;
    let (status, body) = eventually("op-b serves chat-a", t, || async {
        let body = serde_json::json!({"model": "chat-a",
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
        support::try_post_json(inference_b, "/v1/chat/completions", body)
            .await
            .ok()
    })
    .await;
    assert_eq!(status, 200, "{body}");
    let cr = api.get("chat-a").await.unwrap();
    let st = cr.status.unwrap();
    assert_eq!(
        st.deployment_id.as_deref(),
        Some(id.as_str()),
        "the same deployment"
    );
    assert_eq!(
        st.instances[0].generation, 1,
        "the engine was adopted, not restarted"
    );
    assert_eq!(st.state, Some(InstanceState::Ready));
    let _ = std::fs::remove_dir_all(dir);
}

/// Kills `p` with SIGKILL (no clean shutdown: the Lease is not released, nothing is stopped).
fn kill9(p: &Proc) {
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &p.0.id().to_string()])
        .status();
}

/// A model CR whose engine takes `delay` to start (the simulator's start-up delay).
fn slow_model_cr(ns: &str, name: &str, delay: &str) -> Deployment {
    let mut cr = serde_json::to_value(model_cr(ns, name)).unwrap();
    cr["spec"]["env"]["ENGINE_SIM_STARTUP_DELAY"] = serde_json::json!(delay);
    serde_json::from_value(cr).unwrap()
}

/// One engine process of a node agent (a child of its process): its instance (from the
/// agent's record of it, `None` when the agent has no record: a leak) and whether it holds
/// its GPU memory now (started and not asleep, as the simulator says).
#[derive(Debug)]
struct EngineProc {
    pid: u32,
    instance: Option<String>,
    awake: bool,
}

/// The engine processes of the node agent `agent_pid` whose records are in `agent_dir`.
async fn engines_of(agent_dir: &std::path::Path, agent_pid: u32) -> Vec<EngineProc> {
    let mut records = std::collections::HashMap::new();
    for entry in std::fs::read_dir(agent_dir.join("engines"))
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Some(r) = std::fs::read_to_string(entry.path())
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            && let (Some(pid), Some(instance), Some(port)) = (
                r["pid"].as_u64(),
                r["instance"].as_str(),
                r["port"].as_u64(),
            )
        {
            records.insert(pid as u32, (instance.to_string(), port as u16));
        }
    }
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if capyctl_test_support::live_parent(u64::from(pid)) != Some(u64::from(agent_pid)) {
            continue;
        }
        let record = records.get(&pid).cloned();
        let mut awake = false;
        if let Some((_, port)) = &record {
            let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
            if let Ok((200, state)) = support::try_get_json(addr, "/sim/state").await {
                awake = state["started"] == true && state["asleep"] == false;
            }
        }
        out.push(EngineProc {
            pid,
            instance: record.map(|(i, _)| i),
            awake,
        });
    }
    out
}

/// No engine leaked (each engine process is one the agent knows, at most one per instance),
/// and at most one holds its GPU memory: each model needs 6 GiB of the node's 10 GiB, so two
/// awake would be the GPU double-booked.
#[track_caller]
fn assert_no_leak_no_double_booking(engines: &[EngineProc]) {
    let mut seen = std::collections::BTreeSet::new();
    for e in engines {
        let instance = e
            .instance
            .as_ref()
            .unwrap_or_else(|| panic!("engine {} has no record: leaked ({engines:?})", e.pid));
        assert!(
            seen.insert(instance.clone()),
            "two engines of {instance}: {engines:?}"
        );
    }
    let awake = engines.iter().filter(|e| e.awake).count();
    assert!(
        awake <= 1,
        "{awake} engines awake on one 10 GiB GPU: {engines:?}"
    );
}

/// The leader is killed (SIGKILL) in the middle of a switch, while the target's engine starts:
/// the standby takes over once the Lease expires, serves both models, and the node's engines
/// are the ones the agent knows, one per deployment at most, within the GPU's memory.
async fn leader_killed_mid_switch(client: Client, kubeconfig: &std::path::Path, ns: &str) {
    let dir = support::temp_dir("k8s-kill");
    let (agent, agent_port) = start_node_agent(&dir);
    let (a, inference_a) = start_operator(&dir, kubeconfig, ns, "op-a", agent_port);
    let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
    api.create(&PostParams::default(), &model_cr(ns, "chat-a"))
        .await
        .unwrap();
    api.create(&PostParams::default(), &slow_model_cr(ns, "chat-b", "4s"))
        .await
        .unwrap();
    let t = Duration::from_secs(60);
    for name in ["chat-a", "chat-b"] {
        eventually(&format!("{name} deployed"), t, || async {
            api.get(name).await.ok()?.status?.deployment_id.map(|_| ())
        })
        .await;
    }
    let (_b, inference_b) = start_operator(&dir, kubeconfig, ns, "op-b", agent_port);
    let (status, body) = chat(inference_a, "chat-a").await;
    assert_eq!(status, 200, "{body}");
    // The switch to chat-b: chat-a parks, chat-b's engine starts (4 s).
    let switching = tokio::spawn(async move {
        let body = serde_json::json!({"model": "chat-b",
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
        support::try_post_json(inference_a, "/v1/chat/completions", body).await
    });
    eventually("chat-b starting in the status", t, || async {
        (state_of(&api, "chat-b").await == Some(InstanceState::Starting)).then_some(())
    })
    .await;
    kill9(&a);
    // The request in flight ends with the leader (its connection is cut), never hangs.
    let ended = tokio::time::timeout(Duration::from_secs(10), switching).await;
    assert!(
        ended.is_ok(),
        "the request to the killed leader did not end"
    );

    eventually("op-b holds the Lease", t, || async {
        (lease_holder(&client, ns).await.as_deref() == Some("op-b")).then_some(())
    })
    .await;
    for name in ["chat-b", "chat-a", "chat-b"] {
        let (status, body) = eventually(&format!("op-b serves {name}"), t, || async {
            let body = serde_json::json!({"model": name,
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
            support::try_post_json(inference_b, "/v1/chat/completions", body)
                .await
                .ok()
                .filter(|(status, _)| *status == 200)
        })
        .await;
        assert_eq!(status, 200, "{name}: {body}");
    }
    let engines = engines_of(&dir.join("agent-e2e-node"), agent.0.id()).await;
    assert_no_leak_no_double_booking(&engines);
    assert_eq!(
        engines.iter().filter(|e| e.awake).count(),
        1,
        "chat-b serves: {engines:?}"
    );
    drop(a);
    drop(_b);
    drop(agent);
    let _ = std::fs::remove_dir_all(dir);
}

/// The `Ready` condition of CR `name`: (status, reason).
async fn ready_condition(api: &Api<Deployment>, name: &str) -> Option<(String, String)> {
    let status = api.get(name).await.ok()?.status?;
    let c = status.conditions.iter().find(|c| c.type_ == "Ready")?;
    Some((c.status.clone(), c.reason.clone()))
}

/// The node agent is gone (SIGKILL), with its engine (`engine_too`) or alone. Its instance is
/// reported (the CR's `Ready` condition turns `Unknown`, reason `node_agent_unreachable`).
/// - With its engine: a request for the model is answered with one of the page's errors,
///   promptly (never hung). When the node agent comes back (a new process at the same
///   address), the host is reconciled again: the lost instance is failed, and the next request
///   starts it afresh and is served.
/// - Alone: the model is still served by its engine meanwhile, and the agent's new life adopts
///   the same engine (served, `Ready` again, never started twice).
async fn node_agent_gone(client: Client, kubeconfig: &std::path::Path, ns: &str, engine_too: bool) {
    let dir = support::temp_dir("k8s-agent-gone");
    let (agent, agent_port) = start_node_agent(&dir);
    let (_operator, inference) = start_operator(&dir, kubeconfig, ns, "op-gone", agent_port);
    let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
    api.create(&PostParams::default(), &model_cr(ns, "chat-a"))
        .await
        .unwrap();
    let t = Duration::from_secs(60);
    eventually("chat-a deployed", t, || async {
        api.get("chat-a")
            .await
            .ok()?
            .status?
            .deployment_id
            .map(|_| ())
    })
    .await;
    let (status, body) = chat(inference, "chat-a").await;
    assert_eq!(status, 200, "{body}");
    let engines = engines_of(&dir.join("agent-e2e-node"), agent.0.id()).await;
    assert_eq!(engines.len(), 1, "{engines:?}");
    // The node agent goes without a word, and with it (a node lost) its engine.
    kill9(&agent);
    drop(agent);
    if engine_too {
        for e in &engines {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", e.pid)])
                .status();
        }
        for e in &engines {
            // Gone, or a zombie its dead parent left.
            eventually(&format!("engine {} gone", e.pid), t, || async {
                (!capyctl_test_support::alive(u64::from(e.pid))).then_some(())
            })
            .await;
        }
        for attempt in 0..3 {
            let asked = std::time::Instant::now();
            let answer =
                tokio::time::timeout(Duration::from_secs(30), chat(inference, "chat-a")).await;
            let (status, body) = answer.unwrap_or_else(|_| panic!("request {attempt} hung"));
            let code = body["code"].as_str().unwrap_or_default().to_string();
            assert!(
                matches!(status, 502 | 503),
                "request {attempt}: {status} {body}"
            );
            assert!(
                ["upstream_unavailable", "unavailable", "engine_failed"].contains(&code.as_str()),
                "request {attempt}: {body}"
            );
            assert!(asked.elapsed() < Duration::from_secs(30));
        }
    }
    eventually(
        "chat-a reported: its node agent is unreachable",
        t,
        || async {
            let (status, reason) = ready_condition(&api, "chat-a").await?;
            (status == "Unknown" && reason == "node_agent_unreachable").then_some(())
        },
    )
    .await;
    if !engine_too {
        let (status, body) = chat(inference, "chat-a").await;
        assert_eq!(status, 200, "served by its engine meanwhile: {body}");
    }
    // The node agent comes back, a new process at the same address.
    let agent = start_node_agent_at(&dir, "e2e-node", "127.0.0.1", agent_port);
    let served = eventually(
        "chat-a served after its node agent came back",
        t,
        || async {
            let (status, body) = chat(inference, "chat-a").await;
            (status == 200).then_some(body)
        },
    )
    .await;
    assert!(served["choices"].is_array(), "{served}");
    eventually("chat-a ready again", t, || async {
        let (status, reason) = ready_condition(&api, "chat-a").await?;
        (status == "True" && reason == "ready").then_some(())
    })
    .await;
    let started = engines_of(&dir.join("agent-e2e-node"), agent.0.id()).await;
    if engine_too {
        // One engine, started afresh by the agent's new life.
        assert_eq!(started.len(), 1, "{started:?}");
        assert!(
            engines.iter().all(|e| e.pid != started[0].pid),
            "{started:?}"
        );
    } else {
        // The same engine, adopted by the agent's new life: alive, and not started twice (the
        // new life has no engine child of its own; the adopted one's parent is init now).
        assert!(capyctl_test_support::alive(u64::from(engines[0].pid)));
        assert!(started.is_empty(), "started again: {started:?}");
    }
    drop(_operator);
    drop(agent);
    let _ = std::fs::remove_dir_all(dir);
}

/// A kubeconfig for the fake API server at `addr`, written in `dir`.
fn fake_kubeconfig(dir: &std::path::Path, addr: std::net::SocketAddr) -> std::path::PathBuf {
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters: [{{name: fake, cluster: {{server: \"http://{addr}\"}}}}]\nusers: [{{name: u, user: {{token: fake-token}}}}]\ncontexts: [{{name: fake, context: {{cluster: fake, user: u, namespace: capyctl}}}}]\ncurrent-context: fake\n"
        ),
    )
    .unwrap();
    kubeconfig
}

/// A client of the API server of `kubeconfig`.
async fn client_of(kubeconfig: &std::path::Path) -> Client {
    let kc = Kubeconfig::read_from(kubeconfig).unwrap();
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .unwrap();
    Client::try_from(config).unwrap()
}

/// The scenarios run one at a time: each runs an operator, node agents and engines, and on two
/// cores several at once only make each slower (and their ports, chosen free, more likely to
/// meet).
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn against_a_fake_api_server_the_operator_switches_two_models_and_the_crs_show_it() {
    let _one = ONE_AT_A_TIME.lock().await;
    let addr = fake::Fake::start().await;
    let dir = support::temp_dir("k8s-e2e-fake");
    let kubeconfig = fake_kubeconfig(&dir, addr);
    let client = client_of(&kubeconfig).await;
    scenario(client, &kubeconfig, "capyctl").await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn against_a_fake_api_server_the_standby_takes_over_and_adopts_the_engine() {
    let _one = ONE_AT_A_TIME.lock().await;
    let addr = fake::Fake::start().await;
    let dir = support::temp_dir("k8s-failover-fake");
    let kubeconfig = fake_kubeconfig(&dir, addr);
    let client = client_of(&kubeconfig).await;
    failover(client, &kubeconfig, "capyctl").await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn against_a_fake_api_server_two_node_agents_are_two_hosts() {
    let _one = ONE_AT_A_TIME.lock().await;
    let addr = fake::Fake::start().await;
    let dir = support::temp_dir("k8s-hosts-fake");
    let kubeconfig = fake_kubeconfig(&dir, addr);
    let client = client_of(&kubeconfig).await;
    two_hosts(client, &kubeconfig, "capyctl").await;
    let _ = std::fs::remove_dir_all(dir);
}

/// The cluster of `CAPYCTL_TEST_KUBECONFIG` with the chart's CRDs applied and established, and
/// a fresh namespace, cleaned up when dropped (the finalizers the stopped operator left
/// included); `None` when the variable is unset.
async fn cluster_namespace() -> Option<(std::path::PathBuf, k8s_support::TestNamespace)> {
    let (kubeconfig, client) = k8s_support::cluster().await?;
    crds::install_crds(&client).await;
    let ns = k8s_support::TestNamespace::create(&kubeconfig, &client, "capyctl-test").await;
    Some((kubeconfig, ns))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs cluster"]
async fn against_a_cluster_the_operator_switches_two_models_and_the_crs_show_it() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some((kubeconfig, ns)) = cluster_namespace().await else {
        return;
    };
    scenario(ns.client.clone(), &kubeconfig, &ns.name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs cluster"]
async fn against_a_cluster_two_node_agents_are_two_hosts() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some((kubeconfig, ns)) = cluster_namespace().await else {
        return;
    };
    two_hosts(ns.client.clone(), &kubeconfig, &ns.name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs cluster"]
async fn against_a_cluster_the_standby_takes_over_and_adopts_the_engine() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some((kubeconfig, ns)) = cluster_namespace().await else {
        return;
    };
    failover(ns.client.clone(), &kubeconfig, &ns.name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn against_a_fake_api_server_a_leader_killed_mid_switch_is_taken_over_cleanly() {
    let _one = ONE_AT_A_TIME.lock().await;
    let addr = fake::Fake::start().await;
    let dir = support::temp_dir("k8s-kill-fake");
    let kubeconfig = fake_kubeconfig(&dir, addr);
    let client = client_of(&kubeconfig).await;
    leader_killed_mid_switch(client, &kubeconfig, "capyctl").await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn against_a_fake_api_server_a_node_agent_gone_is_reported_and_served_again_when_back() {
    let _one = ONE_AT_A_TIME.lock().await;
    let addr = fake::Fake::start().await;
    let dir = support::temp_dir("k8s-gone-fake");
    let kubeconfig = fake_kubeconfig(&dir, addr);
    let client = client_of(&kubeconfig).await;
    node_agent_gone(client, &kubeconfig, "capyctl", true).await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs cluster"]
async fn against_a_cluster_a_leader_killed_mid_switch_is_taken_over_cleanly() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some((kubeconfig, ns)) = cluster_namespace().await else {
        return;
    };
    leader_killed_mid_switch(ns.client.clone(), &kubeconfig, &ns.name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs cluster"]
async fn against_a_cluster_a_node_agent_gone_is_reported_and_served_again_when_back() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some((kubeconfig, ns)) = cluster_namespace().await else {
        return;
    };
    node_agent_gone(ns.client.clone(), &kubeconfig, &ns.name, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn against_a_fake_api_server_a_node_agent_gone_alone_is_adopted_again_when_back() {
    let _one = ONE_AT_A_TIME.lock().await;
    let addr = fake::Fake::start().await;
    let dir = support::temp_dir("k8s-alone-fake");
    let kubeconfig = fake_kubeconfig(&dir, addr);
    let client = client_of(&kubeconfig).await;
    node_agent_gone(client, &kubeconfig, "capyctl", false).await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs cluster"]
async fn against_a_cluster_a_node_agent_gone_alone_is_adopted_again_when_back() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some((kubeconfig, ns)) = cluster_namespace().await else {
        return;
    };
    node_agent_gone(ns.client.clone(), &kubeconfig, &ns.name, false).await;
}

/// A small fake of the Kubernetes API server: objects in memory by path, resource versions,
/// merge patches with a `resourceVersion` precondition, JSON patches (with `test`),
/// server-side apply of `status`, updates
/// (409 on a stale `resourceVersion`), deletion held by finalizers, and watches.
mod fake {
    use std::collections::BTreeMap;
    use std::convert::Infallible;
    use std::net::SocketAddr;
    use std::sync::{Arc, Mutex};

    use axum::Router;
    use axum::body::{Body, Bytes};
    use axum::extract::State;
    use axum::response::Response;
    use http::{Method, StatusCode, Uri};
    use serde_json::{Value, json};
    use tokio::sync::watch;

    #[derive(Default)]
    struct Objects {
        rv: u64,
        /// By collection path (`/apis/g/v/namespaces/ns/plural`), then name.
        by_collection: BTreeMap<String, BTreeMap<String, Value>>,
        /// Every change: (rv, collection, watch event).
        log: Vec<(u64, String, Value)>,
    }

    #[derive(Clone)]
    pub struct Fake {
        objects: Arc<Mutex<Objects>>,
        changed: watch::Sender<u64>,
    }

    fn status(code: u16, reason: &str, message: &str) -> Response {
        let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                          "message": message, "reason": reason, "code": code});
        respond(code, &body)
    }

    fn respond(code: u16, body: &Value) -> Response {
        Response::builder()
            .status(StatusCode::from_u16(code).unwrap())
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Body::from(serde_json::to_vec(body).unwrap()))
            .unwrap()
    }

    /// RFC 7386.
    fn merge(target: &mut Value, patch: &Value) {
        match patch {
            Value::Object(p) => {
                if !target.is_object() {
                    *target = json!({});
                }
                let t = target.as_object_mut().unwrap();
                for (k, v) in p {
                    if v.is_null() {
                        t.remove(k);
                    } else {
                        merge(t.entry(k.clone()).or_insert(Value::Null), v);
                    }
                }
            }
            other => *target = other.clone(),
        }
    }

    /// Splits `/apis/g/v/namespaces/ns/plural[/name[/sub]]` (or `/api/v1/...`, or a
    /// cluster-scoped path) into (collection, name, subresource).
    fn split(path: &str) -> (String, Option<String>, Option<String>) {
        let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
        let base = if segs.first() == Some(&"api") { 2 } else { 3 };
        let start = if segs.get(base) == Some(&"namespaces") && segs.len() > base + 2 {
            base + 2
        } else {
            base
        };
        let collection = format!("/{}", segs[..=start.min(segs.len() - 1)].join("/"));
        (
            collection,
            segs.get(start + 1).map(|s| s.to_string()),
            segs.get(start + 2).map(|s| s.to_string()),
        )
    }

    impl Objects {
        fn record(&mut self, collection: &str, kind: &str, object: &Value) {
            self.log.push((
                self.rv,
                collection.to_string(),
                json!({"type": kind, "object": object}),
            ));
        }

        fn bump(&mut self, object: &mut Value) {
            self.rv += 1;
            object["metadata"]["resourceVersion"] = self.rv.to_string().into();
        }

        /// Stores `object` (modified), or removes it when it is being deleted and has no
        /// finalizer left.
        fn store(&mut self, collection: &str, name: &str, mut object: Value) -> Value {
            self.bump(&mut object);
            let finalizers_left = object["metadata"]["finalizers"]
                .as_array()
                .is_some_and(|f| !f.is_empty());
            if object["metadata"]["deletionTimestamp"].is_string() && !finalizers_left {
                self.by_collection
                    .entry(collection.to_string())
                    .or_default()
                    .remove(name);
                self.record(collection, "DELETED", &object);
            } else {
                self.by_collection
                    .entry(collection.to_string())
                    .or_default()
                    .insert(name.to_string(), object.clone());
                self.record(collection, "MODIFIED", &object);
            }
            object
        }
    }

    impl Fake {
        /// Serves on a loopback port; answers its address.
        pub async fn start() -> SocketAddr {
            let fake = Fake {
                objects: Arc::default(),
                changed: watch::channel(0).0,
            };
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let app = Router::new().fallback(handle).with_state(fake);
            tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
            addr
        }

        fn changed(&self, rv: u64) {
            self.changed.send_replace(rv);
        }
    }

    fn query(uri: &Uri) -> BTreeMap<String, String> {
        uri.query()
            .unwrap_or_default()
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.replace("%2F", "/").replace("%3D", "=")))
            .collect()
    }

    fn watch_stream(fake: Fake, collection: String, from: u64) -> Response {
        let rx = fake.changed.subscribe();
        let stream =
            futures_util::stream::unfold((fake, rx, from), move |(fake, mut rx, mut cursor)| {
                let collection = collection.clone();
                async move {
                    loop {
                        let lines: Vec<(u64, Value)> = {
                            let o = fake.objects.lock().unwrap();
                            o.log
                                .iter()
                                .filter(|(rv, c, _)| *rv > cursor && *c == collection)
                                .map(|(rv, _, e)| (*rv, e.clone()))
                                .collect()
                        };
                        if !lines.is_empty() {
                            let mut out = Vec::new();
                            for (rv, e) in lines {
                                cursor = cursor.max(rv);
                                out.extend(serde_json::to_vec(&e).unwrap());
                                out.push(b'\n');
                            }
                            return Some((
                                Ok::<_, Infallible>(Bytes::from(out)),
                                (fake, rx, cursor),
                            ));
                        }
                        if rx.changed().await.is_err() {
                            return None;
                        }
                    }
                }
            });
        Response::builder()
            .status(200)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Body::from_stream(stream))
            .unwrap()
    }

    async fn handle(State(fake): State<Fake>, method: Method, uri: Uri, body: Bytes) -> Response {
        let body: Value = if body.is_empty() {
            Value::Null
        } else {
            match serde_json::from_slice(&body) {
                Ok(v) => v,
                Err(e) => return status(400, "BadRequest", &e.to_string()),
            }
        };
        let q = query(&uri);
        let (collection, name, sub) = split(uri.path());
        let mut o = fake.objects.lock().unwrap();
        let answer = match (&method, name.as_deref(), sub.as_deref()) {
            (&Method::GET, None, _) if q.get("watch").map(String::as_str) == Some("true") => {
                let from = q
                    .get("resourceVersion")
                    .and_then(|r| r.parse().ok())
                    .unwrap_or(0);
                drop(o);
                return watch_stream(fake.clone(), collection, from);
            }
            (&Method::GET, None, _) => {
                let selector = q.get("labelSelector").cloned();
                let items: Vec<Value> = o
                    .by_collection
                    .get(&collection)
                    .map(|m| m.values().cloned().collect())
                    .unwrap_or_default();
                let items: Vec<Value> = items
                    .into_iter()
                    .filter(
                        |i| match selector.as_deref().and_then(|s| s.split_once('=')) {
                            Some((k, v)) => i["metadata"]["labels"][k] == v,
                            None => true,
                        },
                    )
                    .collect();
                respond(
                    200,
                    &json!({"apiVersion": "v1", "kind": "List",
                    "metadata": {"resourceVersion": o.rv.to_string()}, "items": items}),
                )
            }
            (&Method::GET, Some(n), _) => {
                match o.by_collection.get(&collection).and_then(|m| m.get(n)) {
                    Some(obj) => respond(200, obj),
                    None => status(404, "NotFound", &format!("{n} not found")),
                }
            }
            (&Method::POST, None, _) => {
                let mut obj = body.clone();
                let Some(n) = obj["metadata"]["name"].as_str().map(str::to_string) else {
                    return status(422, "Invalid", "metadata.name is required");
                };
                if o.by_collection
                    .get(&collection)
                    .is_some_and(|m| m.contains_key(&n))
                {
                    return status(409, "AlreadyExists", &format!("{n} already exists"));
                }
                obj["metadata"]["uid"] = format!("uid-{}-{}", n, o.rv + 1).into();
                obj["metadata"]["generation"] = 1.into();
                obj["metadata"]["creationTimestamp"] = "2026-12-03T08:00:00Z".into();
                o.bump(&mut obj);
                o.by_collection
                    .entry(collection.clone())
                    .or_default()
                    .insert(n, obj.clone());
                o.record(&collection, "ADDED", &obj);
                respond(201, &obj)
            }
            (&Method::PUT, Some(n), _) => {
                let Some(cur) = o
                    .by_collection
                    .get(&collection)
                    .and_then(|m| m.get(n))
                    .cloned()
                else {
                    return status(404, "NotFound", &format!("{n} not found"));
                };
                if body["metadata"]["resourceVersion"] != cur["metadata"]["resourceVersion"] {
                    return status(409, "Conflict", "the object has been modified");
                }
                let mut obj = body.clone();
                obj["metadata"]["uid"] = cur["metadata"]["uid"].clone();
                let obj = o.store(&collection, n, obj);
                respond(200, &obj)
            }
            (&Method::PATCH, Some(n), sub) => {
                let Some(mut cur) = o
                    .by_collection
                    .get(&collection)
                    .and_then(|m| m.get(n))
                    .cloned()
                else {
                    if collection.ends_with("/events") {
                        return respond(200, &body);
                    }
                    return status(404, "NotFound", &format!("{n} not found"));
                };
                if sub == Some("status") {
                    // Server-side apply of the status: the applied status replaces ours.
                    cur["status"] = body["status"].clone();
                } else if body.is_array() {
                    // A JSON patch (the finalizer helper's): all or nothing, 422 on a failed
                    // `test`. NB: the API server's `test` takes an absent member as `null`;
                    // json-patch needs it spelled.
                    let patch: json_patch::Patch = match serde_json::from_value(body.clone()) {
                        Ok(p) => p,
                        Err(e) => return status(400, "BadRequest", &e.to_string()),
                    };
                    let mut patched = cur.clone();
                    if let Some(m) = patched["metadata"].as_object_mut() {
                        m.entry("finalizers").or_insert(Value::Null);
                    }
                    if let Err(e) = json_patch::patch(&mut patched, &patch) {
                        return status(422, "Invalid", &e.to_string());
                    }
                    if patched["spec"] != cur["spec"] {
                        let g = patched["metadata"]["generation"].as_i64().unwrap_or(1) + 1;
                        patched["metadata"]["generation"] = g.into();
                    }
                    if let Some(m) = patched["metadata"].as_object_mut()
                        && m.get("finalizers").is_some_and(Value::is_null)
                    {
                        m.remove("finalizers");
                    }
                    cur = patched;
                } else {
                    let want = &body["metadata"]["resourceVersion"];
                    if want.is_string() && *want != cur["metadata"]["resourceVersion"] {
                        return status(409, "Conflict", "the object has been modified");
                    }
                    let mut patch = body.clone();
                    if let Some(m) = patch["metadata"].as_object_mut() {
                        m.remove("resourceVersion");
                    }
                    let spec_before = cur["spec"].clone();
                    merge(&mut cur, &patch);
                    if cur["spec"] != spec_before {
                        let g = cur["metadata"]["generation"].as_i64().unwrap_or(1) + 1;
                        cur["metadata"]["generation"] = g.into();
                    }
                }
                let obj = o.store(&collection, n, cur);
                respond(200, &obj)
            }
            (&Method::DELETE, Some(n), _) => {
                let Some(mut cur) = o
                    .by_collection
                    .get(&collection)
                    .and_then(|m| m.get(n))
                    .cloned()
                else {
                    return status(404, "NotFound", &format!("{n} not found"));
                };
                cur["metadata"]["deletionTimestamp"] = "2026-12-03T08:00:01Z".into();
                let obj = o.store(&collection, n, cur);
                respond(200, &obj)
            }
            _ => status(405, "MethodNotAllowed", &format!("{method} {uri}")),
        };
        let rv = o.rv;
        drop(o);
        fake.changed(rv);
        answer
    }
}
