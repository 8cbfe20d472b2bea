//! The operator's end-to-end harness (`k8s_e2e.rs`, `k8s_apiserver_gone.rs`, `k8s_scale.rs`):
//! the operator and node agent binaries started as child processes ([`Proc`]), the engine
//! simulator as their engines, a kubeconfig for the fake API server ([`fake_kubeconfig`],
//! [`crate::fake_api_server`]), and the small helpers the scenarios share.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use capyctl_crds::Deployment;
use capyctl_spec::InstanceState;
use k8s_openapi::api::coordination::v1::Lease;
use kube::{Api, Client};

// What the scenarios call beside these.
pub use crate::cluster::client_of;
pub use crate::free_port;
use crate::{engine_sim_binary, workspace_binary};

/// A child process stopped with SIGTERM (a clean shutdown: the node agent stops its engines,
/// the operator releases its Lease) when dropped.
pub struct Proc(pub std::process::Child);

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
pub fn log_filter() -> String {
    std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".to_string())
}

/// The `capyctl-node-agent` binary, built when missing or older than its sources
/// ([`workspace_binary`]).
pub fn node_agent_binary() -> std::path::PathBuf {
    workspace_binary("capyctl-node-agent", "capyctl-node-agent")
}

/// The `capyctl-operator` binary, built when missing or older than its sources.
pub fn operator_binary() -> std::path::PathBuf {
    workspace_binary("capyctl-operator", "capyctl-operator")
}

/// Polls `f` every 200 ms for at most `within` (the operator is another process: there is
/// nothing to wait on but the API server).
pub async fn eventually<T, F, Fut>(what: &str, within: Duration, mut f: F) -> T
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

/// A simulator `Deployment` CR `name` in namespace `ns` (6 GiB on the GPU, 64 MiB of weights).
pub fn model_cr(ns: &str, name: &str) -> Deployment {
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

/// The instance state in `name`'s status, if it has one (an adapter's `loaded` / `unloaded`
/// is none: [`state_word_of`]).
pub async fn state_of(api: &Api<Deployment>, name: &str) -> Option<InstanceState> {
    state_word_of(api, name).await?.parse().ok()
}

/// `status.state` of `name` as written (STATE of `kubectl get cdeploy`), if it has one.
pub async fn state_word_of(api: &Api<Deployment>, name: &str) -> Option<String> {
    api.get(name).await.ok()?.status?.state
}

/// A node agent with the process runtime whose engines are the engine simulator (one GPU of
/// 10 GiB, 1 GiB of host RAM); its port.
pub fn start_node_agent(dir: &std::path::Path) -> (Proc, u16) {
    let port = free_port();
    let agent = start_node_agent_at(dir, "e2e-node", "127.0.0.1", port);
    (agent, port)
}

/// A node agent of node `node` listening on `ip:port` (process runtime, the simulator).
pub fn start_node_agent_at(dir: &std::path::Path, node: &str, ip: &str, port: u16) -> Proc {
    let sim = engine_sim_binary();
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
pub fn start_operator(
    dir: &std::path::Path,
    kubeconfig: &std::path::Path,
    ns: &str,
    identity: &str,
    agent_port: u16,
) -> (Proc, std::net::SocketAddr) {
    start_operator_with(dir, kubeconfig, ns, identity, AgentsBy::Url(agent_port))
}

/// How the operator finds its node agents.
pub enum AgentsBy {
    /// `--node-agent http://127.0.0.1:<port>`.
    Url(u16),
    /// The Running node agent Pods of the namespace, on this port (as in a cluster).
    Pods(u16),
}

/// `capyctl-operator` out of cluster as replica `identity`, finding its node agents by `agents`;
/// its inference listener.
pub fn start_operator_with(
    dir: &std::path::Path,
    kubeconfig: &std::path::Path,
    ns: &str,
    identity: &str,
    agents: AgentsBy,
) -> (Proc, std::net::SocketAddr) {
    let started = start_operator_env(dir, kubeconfig, ns, identity, agents, &[]);
    (started.process, started.inference)
}

/// An operator started by [`start_operator_env`].
pub struct Operator {
    /// The process.
    pub process: Proc,
    /// Its inference listener.
    pub inference: std::net::SocketAddr,
    /// Its management listener.
    pub management: std::net::SocketAddr,
    /// Its data directory (where it writes its admin token).
    pub data_dir: std::path::PathBuf,
}

impl Operator {
    /// Its admin token, once it has written it.
    pub fn admin_token(&self) -> Option<String> {
        let path = capyctl_server::management::token_path(&self.data_dir);
        let token = std::fs::read_to_string(path).ok()?;
        Some(token.trim().to_string()).filter(|t| !t.is_empty())
    }
}

/// `capyctl-operator` out of cluster as replica `identity`, with `env` set besides.
pub fn start_operator_env(
    dir: &std::path::Path,
    kubeconfig: &std::path::Path,
    ns: &str,
    identity: &str,
    agents: AgentsBy,
    env: &[(&str, &str)],
) -> Operator {
    let (inference_port, management_port) = (free_port(), free_port());
    let mut command = std::process::Command::new(operator_binary());
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
    for (k, v) in env {
        command.env(k, v);
    }
    let data_dir = dir.join(identity);
    let process = Proc(
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
            .args(["--data-dir", data_dir.to_str().unwrap()])
            .env("KUBECONFIG", kubeconfig)
            .env("CAPYCTL_AGENT_TOKEN", "e2e-agent-token")
            .env("RUST_LOG", log_filter())
            .spawn()
            .unwrap(),
    );
    Operator {
        process,
        inference: format!("127.0.0.1:{inference_port}").parse().unwrap(),
        management: format!("127.0.0.1:{management_port}").parse().unwrap(),
        data_dir,
    }
}

/// A chat request for `model` to the inference listener at `inference`.
pub async fn chat(inference: std::net::SocketAddr, model: &str) -> (u16, serde_json::Value) {
    chat_as(inference, None, model).await
}

/// [`chat`] with the tenant's API key `key` (`Authorization: Bearer`), or none.
pub async fn chat_as(
    inference: std::net::SocketAddr,
    key: Option<&str>,
    model: &str,
) -> (u16, serde_json::Value) {
    crate::http::try_post_json_as(
        inference,
        "/v1/chat/completions",
        key,
        serde_json::json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    )
    .await
    .unwrap()
}

/// The holder of the operators' Lease in `ns`.
pub async fn lease_holder(client: &Client, ns: &str) -> Option<String> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    leases.get("capyctl-e2e").await.ok()?.spec?.holder_identity
}

/// Kills `p` with SIGKILL (no clean shutdown: the Lease is not released, nothing is stopped).
pub fn kill9(p: &Proc) {
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &p.0.id().to_string()])
        .status();
}

/// A kubeconfig for the fake API server at `addr`, written in `dir`.
pub fn fake_kubeconfig(dir: &std::path::Path, addr: std::net::SocketAddr) -> std::path::PathBuf {
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

/// A fresh in-process fake API server (`fake.rs`): a temporary directory named after `name`,
/// a kubeconfig for the server in it, and a client of it.
pub async fn fake_api_server(name: &str) -> (std::path::PathBuf, std::path::PathBuf, Client) {
    let addr = crate::fake_api_server::FakeApiServer::start().await;
    let dir = crate::temp_dir(name);
    let kubeconfig = fake_kubeconfig(&dir, addr);
    let client = client_of(&kubeconfig).await;
    (dir, kubeconfig, client)
}

/// The cluster of `CAPYCTL_TEST_KUBECONFIG` with the chart's CRDs applied and established, and
/// a fresh namespace, cleaned up when dropped (the finalizers the stopped operator left
/// included); fails the test when the variable is unset ([`crate::cluster::kubeconfig`]).
pub async fn cluster_namespace() -> (std::path::PathBuf, crate::cluster::TestNamespace) {
    let (kubeconfig, client) = crate::cluster::cluster().await;
    crate::cluster::install_crds(&client).await;
    let ns = crate::cluster::TestNamespace::create(&kubeconfig, &client, "capyctl-test").await;
    (kubeconfig, ns)
}
