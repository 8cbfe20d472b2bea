//! The node agent as a program: `capyctl-node-agent` (the node agent DaemonSet on Kubernetes;
//! DESIGN.md 4.1), and the entry point of `capyctl start host` ("a host agent: the same
//! program as capyctl-node-agent"). It serves the operator over HTTP (`/agent/v1`, see
//! [`crate::remote`]) with the shared agent token.
//!
//! ```text
//! capyctl-node-agent --file host.yaml [--set k=v]... [--node-name N]
//!     [--engine-runtime process|pod] [--publish-host] [--listen ADDR] [--data-dir DIR]
//! ```
//!
//! - [`Args`] are the flags (a `clap` parser; `#[command(flatten)]` it into another command);
//!   [`run`] runs the agent until SIGTERM or SIGINT, [`run_until`] until a future of the
//!   caller's; [`main`] is the whole binary (flags, logging, runtime, exit code);
//! - the host document is the `host:` part of a standalone document; `--set a.b=c` and
//!   `CAPYCTL_SET__A__B=c` override it (`--set` wins);
//! - the node name: `--node-name`, else `NODE_NAME` (the downward API), else `host.id`;
//! - the listen address: `--listen`, else `CAPYCTL_AGENT_LISTEN`, else `0.0.0.0:7444` (the
//!   chart's `nodeAgent.port`);
//! - the token: the trimmed content of `CAPYCTL_AGENT_TOKEN_FILE`, else `CAPYCTL_AGENT_TOKEN`;
//!   without one the agent refuses to start;
//! - the data directory (pid records, engine logs): `--data-dir`, else `CAPYCTL_DATA_DIR`, else
//!   `/tmp/capyctl-node-agent`. NB: the engines' records must outlive the agent's process, and
//!   on Kubernetes its Pod: the chart sets `CAPYCTL_DATA_DIR` to a hostPath
//!   (`nodeAgent.dataDir.hostPath`, `/var/lib/capyctl/node-agent`), so that a DaemonSet
//!   rollout keeps them; with the pod runtime a record that is lost anyway is rebuilt from the
//!   engine Pod's annotations ([`crate::k8s::pods`]);
//! - `--engine-runtime pod` (the default) drives the engine Pods the operator creates on this
//!   node ([`PodRuntime`]; Pods of namespace `POD_NAMESPACE`, else the client's default
//!   namespace) and publishes the node's `Host` object ([`crate::k8s::host`]); it needs the
//!   in-cluster configuration (or, out of a cluster, a kubeconfig: `KUBECONFIG`, else
//!   `~/.kube/config`), and without one the agent refuses to start;
//! - `--engine-runtime process` runs engines as child processes of the agent; with
//!   `--publish-host` (or `CAPYCTL_PUBLISH_HOST=1`) it publishes the `Host` object too (same
//!   configuration rules; the end-to-end tests run it against an API server without kubelet);
//! - the `Host` object is re-checked every 30 s and written only when it changed; its status
//!   says `Ready=True` while the agent serves and `Ready=False` once it stops;
//! - every call to the API server is bounded ([`capyctl_crds::api_client`]);
//! - the operator polls the agent (load samples about once a second, engine exits by long
//!   poll) over HTTP, not through the API server; the agent never calls the operator.
//!
//! Timing the operator follows (`GET /agent/v1/info`): with the pod runtime an engine Pod may
//! take up to the ready timeout (1800 s) to be Running, image pull included, and then up to
//! the ready timeout again for the engine to answer; the agent reports twice the ready timeout,
//! so the operator's start call waits for both.
//!
//! SIGTERM or SIGINT: the server stops taking calls, then every engine is stopped (SIGTERM,
//! then SIGKILL after the stop grace; engine Pods are left to the operator) and the agent
//! exits 0. Every failure to start is one line ([`CliError`]).

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use capyctl_spec::documents;
use capyctl_spec::overrides::Overrides;
use clap::{Parser, ValueEnum};

use crate::k8s::host::{self, HostPolicy, HostPublisher};
use crate::k8s::pods::PodRuntime;
use crate::process::ProcessRuntime;
use crate::remote::wire::{AgentInfo, AgentTiming};
use crate::remote::{ServerOptions, serve};
use crate::runtime::EngineRuntime as Runtime;
use crate::spec::HostSettings;
use crate::{AgentConfig, AgentError, HostAgent, LocalHostAgent};
use capyctl_crds::api_client::{self as api, API_CALL_TIMEOUT};

/// The default listen address (the chart's `nodeAgent.port`).
pub const DEFAULT_LISTEN: &str = "0.0.0.0:7444";
/// The default data directory.
pub const DEFAULT_DATA_DIR: &str = "/tmp/capyctl-node-agent";
/// How long the server may take to finish the calls in flight at shutdown before the engines
/// are stopped anyway.
pub const DRAIN_AT_SHUTDOWN: Duration = Duration::from_secs(10);

/// How the agent runs engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EngineRuntime {
    /// Engine Pods created by the operator on this node (Kubernetes).
    Pod,
    /// Child processes of the agent (single-box clusters, end-to-end tests).
    Process,
}

impl Args {
    /// The engine runtime: `--engine-runtime`, else `pod` inside a Kubernetes Pod and
    /// `process` elsewhere (`capyctl start host` on a GPU box).
    pub fn runtime(&self) -> EngineRuntime {
        self.engine_runtime.unwrap_or_else(|| {
            if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some_and(|v| !v.is_empty()) {
                EngineRuntime::Pod
            } else {
                EngineRuntime::Process
            }
        })
    }
}

impl EngineRuntime {
    /// `pod` or `process` (what `GET /agent/v1/info` says).
    pub fn name(self) -> &'static str {
        match self {
            EngineRuntime::Pod => "pod",
            EngineRuntime::Process => "process",
        }
    }
}

/// CapyCTL's node agent: runs the engines of one host and serves the operator over HTTP.
#[derive(Debug, Clone, Parser)]
#[command(name = "capyctl-node-agent", version)]
pub struct Args {
    /// The host document.
    #[arg(long)]
    pub file: PathBuf,
    /// An override, `a.b=c` (repeatable); wins over `CAPYCTL_SET__A__B=c`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// The node's name (default: `NODE_NAME`, else the host's ID).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// How engines run [default: `pod` in a Kubernetes Pod (`KUBERNETES_SERVICE_HOST` set),
    /// else `process`].
    #[arg(long, value_enum, env = "CAPYCTL_ENGINE_RUNTIME")]
    pub engine_runtime: Option<EngineRuntime>,
    /// Where the operator reaches the agent.
    #[arg(long, env = "CAPYCTL_AGENT_LISTEN", default_value = DEFAULT_LISTEN)]
    pub listen: SocketAddr,
    /// Pid records and engine logs.
    #[arg(long, env = "CAPYCTL_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
    pub data_dir: PathBuf,
    /// Publish this node's `Host` object (always on with `--engine-runtime pod`).
    #[arg(long, env = "CAPYCTL_PUBLISH_HOST", value_parser = clap::builder::BoolishValueParser::new())]
    pub publish_host: bool,
}

/// Why the agent did not start, or stopped: one line for people.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct CliError(String);

impl CliError {
    /// The line.
    pub fn line(&self) -> &str {
        &self.0
    }
}

impl From<String> for CliError {
    fn from(line: String) -> Self {
        CliError(line)
    }
}

/// A client of the cluster's API server (every call bounded): the in-cluster configuration,
/// else the kubeconfig; with the configuration's default namespace.
async fn kube_client(why: &str) -> Result<(kube::Client, String), String> {
    let config = kube::Config::infer().await.map_err(|e| {
        format!(
            "{why} needs a Kubernetes API server: no in-cluster configuration and no usable kubeconfig (KUBECONFIG, ~/.kube/config): {}",
            one_line(&e.to_string())
        )
    })?;
    let namespace = config.default_namespace.clone();
    let client = api::client(config, API_CALL_TIMEOUT, None).map_err(|e| {
        format!(
            "{why}: cannot use the Kubernetes configuration: {}",
            one_line(&e.to_string())
        )
    })?;
    Ok((client, namespace))
}

/// `text` on one line.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The token the operator and the node agents share: `CAPYCTL_AGENT_TOKEN_FILE`'s content
/// (trimmed), else `CAPYCTL_AGENT_TOKEN`; the error is one line.
pub fn agent_token() -> Result<String, String> {
    if let Some(path) = std::env::var_os("CAPYCTL_AGENT_TOKEN_FILE").filter(|p| !p.is_empty()) {
        let path = PathBuf::from(path);
        let text = std::fs::read_to_string(&path).map_err(|e| {
            format!(
                "cannot read the agent token file {} (CAPYCTL_AGENT_TOKEN_FILE): {e}",
                path.display()
            )
        })?;
        let token = text.trim();
        if token.is_empty() {
            return Err(format!(
                "the agent token file {} (CAPYCTL_AGENT_TOKEN_FILE) is empty",
                path.display()
            ));
        }
        return Ok(token.to_string());
    }
    match std::env::var("CAPYCTL_AGENT_TOKEN") {
        Ok(t) if !t.trim().is_empty() => Ok(t.trim().to_string()),
        _ => Err(
            "no agent token: set CAPYCTL_AGENT_TOKEN_FILE (a file holding it) or CAPYCTL_AGENT_TOKEN"
                .into(),
        ),
    }
}

/// Ignores SIGHUP from now on, logging each one: `what` (the host agent, the operator) has no
/// document to read again, and the default action would end it and leave its engines running
/// (operators send SIGHUP for a reload; a closing terminal sends it too). Call it in a runtime.
/// `capyctl start standalone` reads its document again on SIGHUP instead.
pub fn ignore_hangup(what: &'static str) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::hangup()) {
            Ok(mut hangup) => {
                tokio::spawn(async move {
                    while hangup.recv().await.is_some() {
                        tracing::info!("SIGHUP ignored: {what} has nothing to reload");
                    }
                });
            }
            Err(e) => tracing::warn!(error = %e, "cannot watch SIGHUP; it would end {what}"),
        }
    }
}

/// Resolves on SIGTERM or SIGINT. NB: the handlers are installed when this is called, not when
/// the future is first polled, so that a signal that comes while the agent starts up is not
/// the default action's (an exit without stopping the engines). Call it in a runtime.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let term = signal(SignalKind::terminate());
        let int = signal(SignalKind::interrupt());
        async move {
            match (term, int) {
                (Ok(mut term), Ok(mut int)) => {
                    tokio::select! {
                        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
                        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
                    }
                }
                (term, int) => {
                    let e = term.err().or(int.err());
                    tracing::warn!(error = ?e, "cannot watch SIGTERM or SIGINT; only Ctrl-C stops the agent");
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    {
        async move {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// The timing the agent reports to the operator (see the module doc).
pub fn reported_timing(config: &AgentConfig, runtime: EngineRuntime) -> AgentTiming {
    let mut timing = AgentTiming::from(config);
    if runtime == EngineRuntime::Pod {
        // The Pod's start (image pull included), then the engine's readiness: each gets the
        // ready timeout.
        timing.ready_timeout = timing.ready_timeout.saturating_mul(2);
    }
    timing
}

/// Runs the agent of `args` until SIGTERM or SIGINT (see the module doc).
pub async fn run(args: Args) -> Result<(), CliError> {
    ignore_hangup("the host agent");
    run_until(args, shutdown_signal()).await
}

/// Runs the agent of `args` until `shutdown` resolves (see the module doc); then its engines
/// are stopped and `Ok` is answered.
pub async fn run_until(
    args: Args,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), CliError> {
    Ok(run_inner(args, shutdown).await?)
}

async fn run_inner(
    cli: Args,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), String> {
    let overrides = Overrides::from_args_and_env(cli.set.clone(), std::env::vars())
        .map_err(|e| e.to_string())?;
    let host = documents::load_host_file(&cli.file, &overrides).map_err(|e| e.to_string())?;
    let token = agent_token()?;
    let node_name = cli
        .node_name
        .clone()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| host.id.clone());
    let config = AgentConfig::new(&cli.data_dir);
    let runtime_kind = cli.runtime();
    let publish = cli.publish_host || runtime_kind == EngineRuntime::Pod;
    let client = if publish {
        let why = match runtime_kind {
            EngineRuntime::Pod => "--engine-runtime pod",
            EngineRuntime::Process => "--publish-host",
        };
        Some(kube_client(why).await?)
    } else {
        None
    };
    let data_dir_error = |e: AgentError| format!("data directory {}: {e}", cli.data_dir.display());
    let runtime: Arc<dyn Runtime> = match (&client, runtime_kind) {
        (Some((client, default_ns)), EngineRuntime::Pod) => {
            let namespace = std::env::var("POD_NAMESPACE")
                .ok()
                .filter(|n| !n.is_empty())
                .unwrap_or_else(|| default_ns.clone());
            Arc::new(
                PodRuntime::new(client.clone(), &namespace, &node_name, &cli.data_dir)
                    .map_err(data_dir_error)?,
            )
        }
        _ => Arc::new(ProcessRuntime::new(&cli.data_dir).map_err(data_dir_error)?),
    };
    let agent = Arc::new(LocalHostAgent::with_runtime(
        config,
        HostSettings::from(&host),
        crate::inventory::default_probe(),
        runtime,
    ));
    let publisher = client.map(|(client, _)| {
        let agent: Arc<dyn HostAgent> = agent.clone();
        let publisher = HostPublisher::new(client, node_name.clone());
        publisher.spawn(agent, HostPolicy::from(&host), host::RECHECK)
    });
    let listener = tokio::net::TcpListener::bind(cli.listen)
        .await
        .map_err(|e| {
            format!(
                "cannot listen on {} (--listen / CAPYCTL_AGENT_LISTEN): {e}",
                cli.listen
            )
        })?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("cannot listen on {}: {e}", cli.listen))?;
    let options = ServerOptions {
        token,
        info: AgentInfo {
            node_name: node_name.clone(),
            host_id: host.id.clone(),
            engine_runtime: cli.runtime().name().into(),
            version: env!("CARGO_PKG_VERSION").into(),
            timing: reported_timing(agent.config(), runtime_kind),
        },
    };
    tracing::info!(%addr, node = %node_name, host = %host.id, runtime = cli.runtime().name(), data_dir = %cli.data_dir.display(), "node agent serving");

    let (stopped_tx, mut stopped_rx) = tokio::sync::oneshot::channel::<()>();
    let dyn_agent: Arc<dyn HostAgent> = agent.clone();
    let mut server = tokio::spawn(serve(listener, dyn_agent, options, async move {
        shutdown.await;
        let _ = stopped_tx.send(());
    }));
    // NB: biased, the signal first: after a signal with nothing in flight the server ends at
    // once, and both branches are ready together (the signal is sent before the server's
    // graceful shutdown begins).
    tokio::select! {
        biased;
        Ok(()) = &mut stopped_rx => {}
        r = &mut server => {
            // The server ended without a signal: it failed.
            agent.stop_all().await;
            return match r {
                Ok(Ok(())) => Err("the server stopped unexpectedly".into()),
                Ok(Err(e)) => Err(format!("the server failed: {e}")),
                Err(e) => Err(format!("the server failed: {e}")),
            };
        }
    }
    match tokio::time::timeout(DRAIN_AT_SHUTDOWN, &mut server).await {
        Ok(Ok(Err(e))) => tracing::warn!(error = %e, "the server failed while shutting down"),
        Ok(_) => {}
        Err(_) => {
            tracing::warn!(
                "calls still in flight after {DRAIN_AT_SHUTDOWN:?}; stopping the engines anyway"
            );
            server.abort();
        }
    }
    if let Some(p) = publisher {
        p.stop().await;
    }
    agent.stop_all().await;
    tracing::info!("engines stopped; bye");
    Ok(())
}

/// The `capyctl-node-agent` binary: parses [`Args`] and runs [`run`] (see [`run_binary`]).
pub fn main() -> ExitCode {
    let args = Args::parse();
    run_binary("capyctl-node-agent", || run(args))
}

/// A CapyCTL server binary's `main` after its arguments are parsed: logs to stderr
/// (`RUST_LOG`, default `info`), runs `work` on a multi-threaded runtime; a failure is one
/// line on stderr, `<program>: <error>`, and a non-zero exit.
pub fn run_binary<F, E>(program: &str, work: impl FnOnce() -> F) -> ExitCode
where
    F: std::future::Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("{program}: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(work()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{program}: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_flags_are_the_binarys() {
        Args::command().debug_assert();
        let a = Args::try_parse_from([
            "capyctl-node-agent",
            "--file",
            "host.yaml",
            "--set",
            "lifecycle.activation=explicit",
            "--node-name",
            "gpu-1",
            "--engine-runtime",
            "process",
            "--listen",
            "127.0.0.1:9444",
            "--data-dir",
            "/var/lib/capyctl/node-agent",
            "--publish-host",
        ])
        .unwrap();
        assert_eq!(a.file, PathBuf::from("host.yaml"));
        assert_eq!(a.set, ["lifecycle.activation=explicit"]);
        assert_eq!(a.node_name.as_deref(), Some("gpu-1"));
        assert_eq!(a.engine_runtime, Some(EngineRuntime::Process));
        assert_eq!(a.runtime(), EngineRuntime::Process);
        assert_eq!(a.listen, "127.0.0.1:9444".parse().unwrap());
        assert!(a.publish_host);
        assert!(Args::try_parse_from(["capyctl-node-agent"]).is_err());
    }

    #[test]
    fn the_pod_runtime_reports_time_for_the_pod_and_the_engine() {
        let config = AgentConfig::new("/tmp/x");
        let pod = reported_timing(&config, EngineRuntime::Pod);
        let process = reported_timing(&config, EngineRuntime::Process);
        assert_eq!(process.ready_timeout, config.ready_timeout);
        assert_eq!(pod.ready_timeout, config.ready_timeout * 2);
        assert_eq!(pod.wake_window, process.wake_window);
    }
}
