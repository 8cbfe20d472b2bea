//! `capyctl-operator`'s command line ([`Args`]) and what it runs ([`Args::run`]): the
//! documents and tokens read, the API server found, the [`OperatorOptions`] assembled and
//! [`run`] until a shutdown signal. The binary only parses and calls in.

use std::path::PathBuf;
use std::sync::Arc;

use capyctl_lifecycle::metrics::Metrics;
use capyctl_spec::documents;
use capyctl_spec::overrides::Overrides;
use clap::Parser;

use super::api_client;
use super::leader::LeaseConfig;
use super::operator::{OperatorOptions, run};
use super::pods::EnginePodSettings;
use super::reconcile::ReconcilerConfig;
use super::watch::Watch;

/// CapyCTL's server on Kubernetes: reconciles Deployment objects into the lifecycle and runs
/// the router, leader-elected on a Lease.
#[derive(Debug, Parser)]
#[command(name = "capyctl-operator", version)]
pub struct Args {
    /// The server document (server.yaml); without it the defaults and the overrides.
    #[arg(long)]
    pub file: Option<PathBuf>,
    /// An override, `a.b=c` (repeatable); wins over `CAPYCTL_SET__A__B=c`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// The namespace of the Deployment objects, engine Pods, Lease and node agents (default:
    /// `POD_NAMESPACE`, else the kubeconfig's).
    #[arg(long, env = "POD_NAMESPACE")]
    pub namespace: Option<String>,
    /// The namespaces whose Deployment objects are reconciled besides the operator's own:
    /// comma-separated, or `*` for every namespace (the chart's `operator.watchNamespaces`;
    /// its RBAC must grant the same).
    #[arg(long, env = "CAPYCTL_WATCH_NAMESPACES", default_value = "")]
    pub watch_namespaces: String,
    /// This replica's identity in the Lease (default: `POD_NAME`, else the hostname).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// The Lease the replicas elect their leader on.
    #[arg(long, env = "CAPYCTL_LEASE_NAME", default_value = "capyctl-operator")]
    pub lease_name: String,
    /// A label the leader sets to "true" on its own Pod (the Services select it).
    #[arg(long, env = "CAPYCTL_LEADER_LABEL")]
    pub leader_label: Option<String>,
    /// The node agent's URL (default: the one Running node agent Pod of the namespace).
    #[arg(long, env = "CAPYCTL_NODE_AGENT_URL")]
    pub node_agent: Option<String>,
    /// The node agents' port, for a node agent found by its Pod.
    #[arg(long, env = "CAPYCTL_NODE_AGENT_PORT", default_value_t = 7444)]
    pub node_agent_port: u16,
    /// Where the admin token is generated when the server document names no token file.
    #[arg(
        long,
        env = "CAPYCTL_DATA_DIR",
        default_value = "/tmp/capyctl-operator"
    )]
    pub data_dir: PathBuf,
    /// How engine Pods are built (the chart's engine-pods.yaml); the chart's defaults without.
    #[arg(long, env = "CAPYCTL_ENGINE_PODS_FILE")]
    pub engine_pods_file: Option<PathBuf>,
    /// The node agents' host document (the chart's host.yaml): engine commands and environment
    /// of engine Pods, and the resource policy until the node's Host object says it.
    #[arg(long, env = "CAPYCTL_HOST_FILE")]
    pub host_file: Option<PathBuf>,
}

impl Args {
    /// Reads the documents and the tokens, finds the API server, and runs the operator
    /// ([`run`]) until SIGTERM or Ctrl-C; every error names what is wrong.
    pub async fn run(self) -> Result<(), String> {
        capyctl_node_agent::cli::ignore_hangup("the operator");
        let overrides = Overrides::from_args_and_env(self.set.clone(), std::env::vars())
            .map_err(|e| e.to_string())?;
        let server = match &self.file {
            Some(f) => documents::load_server_file(f, &overrides),
            None => documents::server_from_overrides(&overrides),
        }
        .map_err(|e| e.to_string())?;
        let engine_pods = match &self.engine_pods_file {
            Some(f) => EnginePodSettings::load(f).map_err(|e| e.to_string())?,
            None => EnginePodSettings::default(),
        };
        let host = match &self.host_file {
            Some(f) => {
                Some(documents::load_host_file(f, &Overrides::none()).map_err(|e| e.to_string())?)
            }
            None => None,
        };
        let tls = capyctl_router::tls::listen_config(server.listen.tls.as_ref())
            .map_err(|e| e.to_string())?;
        let agent_token = capyctl_node_agent::cli::agent_token()?;
        let admin_token = capyctl_server::management::load_or_create_token(
            server.admin_token_file.as_deref(),
            &self.data_dir,
        )
        .map_err(|e| e.to_string())?;
        let metrics = Arc::new(Metrics::new());
        let config = kube::Config::infer().await.map_err(|e| {
            format!("cannot find the Kubernetes API (in-cluster, or KUBECONFIG): {e}")
        })?;
        let client = api_client(config, metrics.clone())
            .map_err(|e| format!("cannot use the Kubernetes configuration: {e}"))?;
        let namespace = self
            .namespace
            .clone()
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| client.default_namespace().to_string());
        let watch = Watch::parse(
            &namespace,
            &self.watch_namespaces,
            "--watch-namespaces (CAPYCTL_WATCH_NAMESPACES)",
        )?;
        let identity = self
            .identity
            .clone()
            .filter(|n| !n.is_empty())
            .unwrap_or_else(capyctl_spec::settings::default_host_id);
        tracing::info!(%namespace, watch = %watch.describe(), %identity, lease = %self.lease_name, "capyctl-operator starting");
        let options = OperatorOptions {
            server,
            namespace,
            watch,
            lease: LeaseConfig::new(self.lease_name.clone(), identity),
            leader_label: self.leader_label.clone().filter(|l| !l.is_empty()),
            node_agent_url: self.node_agent.clone().filter(|u| !u.is_empty()),
            node_agent_port: self.node_agent_port,
            agent_token,
            admin_token,
            reconciler: ReconcilerConfig::default(),
            engine_pods,
            metrics,
            host,
            tls,
        };
        run(client, options, capyctl_node_agent::cli::shutdown_signal())
            .await
            .map_err(|e| e.to_string())
    }
}
