//! `capyctl-operator`'s command line ([`Args`]) and what it runs ([`Args::run`]): the
//! documents and tokens read, the API server found, the [`OperatorOptions`] assembled and
//! [`run`] until a shutdown signal. The binary only parses and calls in.

use std::path::PathBuf;
use std::sync::Arc;

use capyctl_lifecycle::metrics::Metrics;
use capyctl_spec::documents;
use capyctl_spec::overrides::Overrides;
use capyctl_spec::units::DurationSetting;
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
    /// The operator's own Deployment (apps/v1, in its namespace), read once at start and made
    /// the Lease's owner, so that deleting the Deployment deletes the Lease; unset: no owner.
    #[arg(long, env = "CAPYCTL_OPERATOR_DEPLOYMENT")]
    pub operator_deployment: Option<String>,
    /// How long a Lease not renewed stays its holder's (`leaseDurationSeconds`).
    #[arg(long, env = "CAPYCTL_LEASE_DURATION", default_value = "15s")]
    pub lease_duration: String,
    /// A leader that has not renewed its Lease for this long stops switching: it steps down,
    /// or is held over when the API server cannot be reached. Shorter than the lease duration.
    #[arg(long, env = "CAPYCTL_LEASE_RENEW_DEADLINE", default_value = "10s")]
    pub lease_renew_deadline: String,
    /// Between two tries of the election (a leader's renewals, a standby's attempts).
    #[arg(long, env = "CAPYCTL_LEASE_RETRY_PERIOD", default_value = "2s")]
    pub lease_retry_period: String,
    /// How long past the renew deadline a leader that cannot reach the API server keeps
    /// serving its ready models (switching nothing) before it steps down; also how long a new
    /// leader that took an unreleased Lease over leaves the instances it adopted alone. `0s`:
    /// step down at the renew deadline.
    #[arg(long, env = "CAPYCTL_LEADER_HOLDOVER", default_value = "90s")]
    pub leader_holdover: String,
    /// A label the leader sets to "true" on its own Pod (the Services select it).
    #[arg(long, env = "CAPYCTL_LEADER_LABEL")]
    pub leader_label: Option<String>,
    /// The node agent's URL (default: the one Running node agent Pod of the namespace).
    #[arg(long, env = "CAPYCTL_NODE_AGENT_URL")]
    pub node_agent: Option<String>,
    /// The node agents' port, for a node agent found by its Pod.
    #[arg(long, env = "CAPYCTL_NODE_AGENT_PORT", default_value_t = 7444)]
    pub node_agent_port: u16,
    /// Where the admin token is generated when the server document names no token file, and
    /// where the leader keeps its switch records (`switches.jsonl`).
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

/// Reads duration setting `text` of `name` (`CAPYCTL_…`, and its flag `flag`).
fn duration_of(name: &str, flag: &str, text: &str) -> Result<std::time::Duration, String> {
    text.parse::<DurationSetting>()
        .map(std::time::Duration::from)
        .map_err(|e| format!("{name} ({flag}) is not a duration: {e}"))
}

impl Args {
    /// The election's settings for replica `identity`, checked (each error names its
    /// setting).
    pub fn lease_config(&self, identity: String) -> Result<LeaseConfig, String> {
        let mut lease = LeaseConfig::new(self.lease_name.clone(), identity);
        lease.lease_duration = duration_of(
            "CAPYCTL_LEASE_DURATION",
            "--lease-duration",
            &self.lease_duration,
        )?;
        lease.renew_deadline = duration_of(
            "CAPYCTL_LEASE_RENEW_DEADLINE",
            "--lease-renew-deadline",
            &self.lease_renew_deadline,
        )?;
        lease.retry_period = duration_of(
            "CAPYCTL_LEASE_RETRY_PERIOD",
            "--lease-retry-period",
            &self.lease_retry_period,
        )?;
        lease.holdover = duration_of(
            "CAPYCTL_LEADER_HOLDOVER",
            "--leader-holdover",
            &self.leader_holdover,
        )?;
        lease.owner_deployment = self.operator_deployment.clone().filter(|n| !n.is_empty());
        lease.validate()?;
        Ok(lease)
    }

    /// Creates the data directory when missing: the leader's switch records go there even when
    /// the admin token is a mounted file (the chart's case, where nothing else creates it).
    fn prepare_data_dir(&self) -> Result<(), String> {
        std::fs::create_dir_all(&self.data_dir).map_err(|e| {
            format!(
                "--data-dir (CAPYCTL_DATA_DIR) {}: cannot create it: {e}",
                self.data_dir.display()
            )
        })
    }

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
        self.prepare_data_dir()?;
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
        let lease = self.lease_config(identity.clone())?;
        tracing::info!(%namespace, watch = %watch.describe(), %identity, lease = %self.lease_name, "capyctl-operator starting");
        let options = OperatorOptions {
            server,
            namespace,
            watch,
            lease,
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
            switch_log: Some(self.data_dir.join(capyctl_lifecycle::switches::FILE)),
        };
        run(client, options, capyctl_node_agent::cli::shutdown_signal())
            .await
            .map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn args(extra: &[&str]) -> Args {
        let mut argv = vec!["capyctl-operator"];
        argv.extend_from_slice(extra);
        Args::try_parse_from(argv).unwrap()
    }

    #[test]
    fn the_holdover_and_the_lease_timing_are_read_and_checked_naming_the_setting() {
        let lease = args(&[]).lease_config("op-a".into()).unwrap();
        assert_eq!(lease.holdover, std::time::Duration::from_secs(90));
        assert_eq!(lease.renew_deadline, std::time::Duration::from_secs(10));
        let lease = args(&["--leader-holdover", "0s", "--lease-duration", "20s"])
            .lease_config("op-a".into())
            .unwrap();
        assert_eq!(lease.holdover, std::time::Duration::ZERO);
        assert_eq!(lease.lease_duration, std::time::Duration::from_secs(20));
        let e = args(&["--leader-holdover", "soon"])
            .lease_config("op-a".into())
            .unwrap_err();
        assert!(e.contains("CAPYCTL_LEADER_HOLDOVER"), "{e}");
        let e = args(&["--lease-duration", "10s"])
            .lease_config("op-a".into())
            .unwrap_err();
        assert!(e.contains("CAPYCTL_LEASE_DURATION"), "{e}");
        assert!(e.contains("renew deadline"), "{e}");
    }

    #[test]
    fn the_operators_deployment_names_the_leases_owner_and_empty_is_none() {
        assert_eq!(
            args(&[])
                .lease_config("op-a".into())
                .unwrap()
                .owner_deployment,
            None
        );
        let lease = args(&["--operator-deployment", "capyctl-operator"])
            .lease_config("op-a".into())
            .unwrap();
        assert_eq!(lease.owner_deployment.as_deref(), Some("capyctl-operator"));
        let lease = args(&["--operator-deployment", ""])
            .lease_config("op-a".into())
            .unwrap();
        assert_eq!(lease.owner_deployment, None);
    }

    /// The chart mounts the admin token, so nothing but this creates the data directory where
    /// the leader opens its switch records (the operator exited at its first leadership, found
    /// by the local cluster).
    #[test]
    fn the_data_directory_is_created_and_a_bad_one_is_named() {
        let base = capyctl_test_support::temp_dir("operator-data-dir");
        let dir = base.join("a").join("b");
        let dir_arg = dir.to_string_lossy().into_owned();
        args(&["--data-dir", &dir_arg]).prepare_data_dir().unwrap();
        assert!(dir.is_dir());
        let file = base.join("a-file");
        std::fs::write(&file, "x").unwrap();
        let under_file = file.join("d").to_string_lossy().into_owned();
        let e = args(&["--data-dir", &under_file])
            .prepare_data_dir()
            .unwrap_err();
        assert!(e.contains("CAPYCTL_DATA_DIR"), "{e}");
        assert!(e.contains(&under_file), "{e}");
    }
}
