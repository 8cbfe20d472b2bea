//! `capyctl-node-agent`: the host agent as a server (the node agent DaemonSet on Kubernetes;
//! DESIGN.md 4.1). It serves the operator over HTTP (`/agent/v1`, see
//! `capyctl_node_agent::remote`) with the shared agent token.
//!
//! ```text
//! capyctl-node-agent --file host.yaml [--set k=v]... [--node-name N]
//!     [--engine-runtime process|pod] [--publish-host] [--listen ADDR] [--data-dir DIR]
//! ```
//!
//! - the host document is the `host:` part of a standalone document; `--set a.b=c` and
//!   `CAPYCTL_SET__A__B=c` override it (`--set` wins);
//! - the node name: `--node-name`, else `NODE_NAME` (the downward API), else `host.id`;
//! - the listen address: `--listen`, else `CAPYCTL_AGENT_LISTEN`, else `0.0.0.0:7444` (the
//!   chart's `nodeAgent.port`);
//! - the token: the trimmed content of `CAPYCTL_AGENT_TOKEN_FILE`, else `CAPYCTL_AGENT_TOKEN`;
//!   without one the agent refuses to start;
//! - the data directory (pid records, engine logs): `--data-dir`, else `CAPYCTL_DATA_DIR`, else
//!   `/tmp/capyctl-node-agent` (the chart's root file system is read-only; `/tmp` is not);
//! - `--engine-runtime pod` (the default) drives the engine Pods the operator creates on this
//!   node (`capyctl_node_agent::k8s::pods::PodRuntime`; Pods of namespace `POD_NAMESPACE`, else
//!   the client's default namespace) and publishes the node's `Host` object
//!   (`capyctl_node_agent::k8s::host`); it needs the in-cluster configuration (or, out of a
//!   cluster, a kubeconfig: `KUBECONFIG`, else `~/.kube/config`), and without one the agent
//!   refuses to start;
//! - `--engine-runtime process` runs engines as child processes of the agent; with
//!   `--publish-host` (or `CAPYCTL_PUBLISH_HOST=1`) it publishes the `Host` object too (same
//!   configuration rules; the end-to-end tests run it against an API server without kubelet);
//! - the `Host` object is re-checked every 30 s and written only when it changed.
//!
//! SIGTERM or SIGINT: the server stops taking calls, then every engine is stopped (SIGTERM,
//! then SIGKILL after the stop grace) and the agent exits 0. Every failure to start prints one
//! line and exits non-zero.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use capyctl_crds::documents;
use capyctl_crds::overrides::Overrides;
use capyctl_node_agent::k8s::host::{self, HostPolicy, HostPublisher};
use capyctl_node_agent::k8s::pods::PodRuntime;
use capyctl_node_agent::process::ProcessRuntime;
use capyctl_node_agent::remote::wire::{AgentInfo, AgentTiming};
use capyctl_node_agent::remote::{ServerOptions, serve};
use capyctl_node_agent::runtime::EngineRuntime as Runtime;
use capyctl_node_agent::spec::HostSettings;
use capyctl_node_agent::{AgentConfig, AgentError, HostAgent, LocalHostAgent};
use clap::{Parser, ValueEnum};

/// The default listen address (the chart's `nodeAgent.port`).
const DEFAULT_LISTEN: &str = "0.0.0.0:7444";
/// The default data directory.
const DEFAULT_DATA_DIR: &str = "/tmp/capyctl-node-agent";
/// How long the server may take to finish the calls in flight at shutdown before the engines
/// are stopped anyway.
const DRAIN_AT_SHUTDOWN: Duration = Duration::from_secs(10);

/// How the agent runs engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum EngineRuntime {
    /// Engine Pods created by the operator on this node (Kubernetes).
    Pod,
    /// Child processes of the agent (single-box clusters, end-to-end tests).
    Process,
}

impl EngineRuntime {
    fn name(self) -> &'static str {
        match self {
            EngineRuntime::Pod => "pod",
            EngineRuntime::Process => "process",
        }
    }
}

/// CapyCTL's node agent: runs the engines of one host and serves the operator over HTTP.
#[derive(Debug, Parser)]
#[command(name = "capyctl-node-agent", version)]
struct Cli {
    /// The host document.
    #[arg(long)]
    file: PathBuf,
    /// An override, `a.b=c` (repeatable); wins over `CAPYCTL_SET__A__B=c`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// The node's name (default: `NODE_NAME`, else the host's ID).
    #[arg(long, env = "NODE_NAME")]
    node_name: Option<String>,
    /// How engines run.
    #[arg(long, value_enum, default_value = "pod")]
    engine_runtime: EngineRuntime,
    /// Where the operator reaches the agent.
    #[arg(long, env = "CAPYCTL_AGENT_LISTEN", default_value = DEFAULT_LISTEN)]
    listen: SocketAddr,
    /// Pid records and engine logs.
    #[arg(long, env = "CAPYCTL_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
    data_dir: PathBuf,
    /// Publish this node's `Host` object (always on with `--engine-runtime pod`).
    #[arg(long, env = "CAPYCTL_PUBLISH_HOST", value_parser = clap::builder::BoolishValueParser::new())]
    publish_host: bool,
}

/// A client of the cluster's API server: the in-cluster configuration, else the kubeconfig;
/// with the configuration's default namespace.
async fn kube_client(why: &str) -> Result<(kube::Client, String), String> {
    let config = kube::Config::infer().await.map_err(|e| {
        format!(
            "{why} needs a Kubernetes API server: no in-cluster configuration and no usable kubeconfig (KUBECONFIG, ~/.kube/config): {}",
            one_line(&e.to_string())
        )
    })?;
    let namespace = config.default_namespace.clone();
    let client = kube::Client::try_from(config).map_err(|e| {
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

/// The agent token: `CAPYCTL_AGENT_TOKEN_FILE`'s content (trimmed), else `CAPYCTL_AGENT_TOKEN`.
fn token() -> Result<String, String> {
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

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
                    _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch SIGTERM; only SIGINT stops the agent");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

async fn run(cli: Cli) -> Result<(), String> {
    let overrides = Overrides::from_args_and_env(cli.set.clone(), std::env::vars())
        .map_err(|e| e.to_string())?;
    let host = documents::load_host_file(&cli.file, &overrides).map_err(|e| e.to_string())?;
    let token = token()?;
    let node_name = cli
        .node_name
        .clone()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| host.id.clone());
    let config = AgentConfig::new(&cli.data_dir);
    let publish = cli.publish_host || cli.engine_runtime == EngineRuntime::Pod;
    let client = if publish {
        let why = match cli.engine_runtime {
            EngineRuntime::Pod => "--engine-runtime pod",
            EngineRuntime::Process => "--publish-host",
        };
        Some(kube_client(why).await?)
    } else {
        None
    };
    let data_dir_error = |e: AgentError| format!("data directory {}: {e}", cli.data_dir.display());
    let runtime: Arc<dyn Runtime> = match (&client, cli.engine_runtime) {
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
        capyctl_node_agent::inventory::default_probe(),
        runtime,
    ));
    let publisher = client.map(|(client, _)| {
        let agent: Arc<dyn HostAgent> = agent.clone();
        let publisher = HostPublisher::new(client, node_name.clone());
        tokio::spawn(publisher.run(agent, HostPolicy::from(&host), host::RECHECK))
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
            engine_runtime: cli.engine_runtime.name().into(),
            version: env!("CARGO_PKG_VERSION").into(),
            timing: AgentTiming::from(agent.config()),
        },
    };
    if let Ok(url) = std::env::var("CAPYCTL_OPERATOR_URL") {
        tracing::info!(%url, "CAPYCTL_OPERATOR_URL is set; the operator polls the samples from this agent");
    }
    tracing::info!(%addr, node = %node_name, host = %host.id, runtime = cli.engine_runtime.name(), data_dir = %cli.data_dir.display(), "node agent serving");

    let (stopped_tx, mut stopped_rx) = tokio::sync::oneshot::channel::<()>();
    let dyn_agent: Arc<dyn HostAgent> = agent.clone();
    let server = tokio::spawn(serve(listener, dyn_agent, options, async move {
        shutdown_signal().await;
        let _ = stopped_tx.send(());
    }));
    let mut server = server;
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
    if let Some(p) = &publisher {
        p.abort();
    }
    agent.stop_all().await;
    tracing::info!("engines stopped; bye");
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
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
            eprintln!("capyctl-node-agent: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(line) => {
            eprintln!("capyctl-node-agent: {line}");
            ExitCode::FAILURE
        }
    }
}
