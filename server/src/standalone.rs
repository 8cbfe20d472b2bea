//! `capyctl start standalone`: the server and one host in one process.
//!
//! [`Standalone::listen`] builds, in order: the host agent ([`LocalHostAgent`], engines as child
//! processes, GPUs from the default probe or `host.gpus`), the state database ([`RedbStore`],
//! `<data-dir>/state.redb`, which imports a `state.json` of an earlier CapyCTL), the
//! lifecycle ([`Core`], which loads the state and adopts engines a previous run left); then
//! it checks the whole document's deployments against the hosts ([`Core::check_all`]), and
//! only then takes the admin token and opens the switch coordinator, the inference listener
//! and the management listener. [`Standalone::deploy_checked`] deploys what was checked
//! (deployed, not started), and only then does `/readyz` answer ready. [`Standalone::start`]
//! is both. [`Standalone::deploy_document`] applies a document again on a reload (`capyctl
//! start standalone` on SIGHUP), checked whole first as well.
//!
//! A start that is refused changes nothing: the files it created in the data directory (the
//! state database, the switch records) are removed again, the admin token is written only once
//! the listeners are bound, and a document that cannot work is refused before any listener
//! opens.
//!
//! Crash-only: a clean [`Standalone::shutdown`] stops the engines; after a kill they keep
//! running and the next start adopts them (or stops those it cannot use).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use capyctl_interfaces::tenants::{Tenant, TenantRate};
use capyctl_node_agent::agent::AgentConfig;
use capyctl_node_agent::inventory::{GpuProbe, default_probe};
use capyctl_node_agent::remote::{RemoteConfig, RemoteHostAgent};
use capyctl_node_agent::spec::HostSettings;
use capyctl_node_agent::{AgentError, LocalHostAgent};
use capyctl_router::config::RouterConfig;
use capyctl_router::proxy::ProxyConfig;
use capyctl_router::tenants::Tenants;
use capyctl_spec::errors::ApiError;
use capyctl_spec::settings::{StandaloneConfig, TenantSettings};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::assembly::{self, BindError, FirstHost, Inference, assemble};
use crate::management::ManagementOptions;
use capyctl_lifecycle::api::ManagementApi;
use capyctl_lifecycle::metrics::Metrics;
use capyctl_lifecycle::store::{RedbStore, StoreError};
use capyctl_lifecycle::{Checked, Core, CoreError, HostEntry, LifecycleConfig};

/// What can go wrong starting standalone. Each names what failed and where.
#[derive(Debug, thiserror::Error)]
pub enum StandaloneError {
    /// The host agent could not be set up (data directory, engines directory).
    #[error("host agent: {0}")]
    Agent(#[from] AgentError),
    /// The state database could not be opened (or a `state.json` to import could not be read).
    #[error("{0}")]
    Store(#[from] StoreError),
    /// The lifecycle could not start (state, inventory, recovery).
    #[error("{0}")]
    Core(#[from] CoreError),
    /// A listener could not be bound.
    #[error(transparent)]
    Bind(#[from] BindError),
    /// The admin token could not be read or written.
    #[error("{0}")]
    Token(#[from] crate::management::TokenError),
    /// The listeners' certificate or key (`server.listen.tls`) cannot be used.
    #[error("{0}")]
    Tls(#[from] capyctl_router::tls::TlsError),
    /// Another CapyCTL holds the data directory.
    #[error(
        "data directory {} is in use by another CapyCTL (its lock {} is held); stop it or use another --data-dir",
        dir.display(),
        lock.display()
    )]
    DataDirInUse {
        /// The data directory.
        dir: PathBuf,
        /// Its lock file.
        lock: PathBuf,
    },
    /// The data directory's lock could not be taken.
    #[error("cannot lock the data directory {}: {source}", dir.display())]
    Lock {
        /// The data directory.
        dir: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A node agent given with `--node-agent` could not be used.
    #[error("node agent {url} (--node-agent): {detail}")]
    NodeAgent {
        /// Its URL.
        url: String,
        /// Why.
        detail: String,
    },
    /// `server.inference_auth` was refused by the key table (the document's own check
    /// passed; this only catches a rule the two would disagree on).
    #[error("server.inference_auth: {0}")]
    Tenants(String),
    /// A deployment of the document was refused.
    #[error("deployment {name} of the standalone document: {source}")]
    Deploy {
        /// The deployment's name.
        name: String,
        /// Why.
        #[source]
        source: ApiError,
    },
}

impl StandaloneError {
    /// A short, stable label for metrics and event reasons.
    pub fn metric_label(&self) -> &'static str {
        match self {
            StandaloneError::Agent(e) => e.metric_label(),
            StandaloneError::Store(e) => e.metric_label(),
            StandaloneError::Core(e) => e.metric_label(),
            StandaloneError::Bind(_) => "bind",
            StandaloneError::Token(e) => e.metric_label(),
            StandaloneError::Deploy { .. } => "deploy",
            StandaloneError::DataDirInUse { .. } => "data_dir_in_use",
            StandaloneError::Lock { .. } => "lock",
            StandaloneError::Tls(e) => e.metric_label(),
            StandaloneError::NodeAgent { .. } => "node_agent",
            StandaloneError::Tenants(_) => "tenants",
        }
    }
}

/// The router's tenants of `server.inference_auth` (the interfaces' value).
pub fn tenant_list(set: &[TenantSettings]) -> Vec<Tenant> {
    set.iter()
        .map(|t| Tenant {
            name: t.name.clone(),
            keys: t.keys.iter().map(|k| k.0.clone()).collect(),
            models: t.models.clone(),
            rate: (t.requests_per_minute.is_some() || t.tokens_per_minute.is_some()).then(|| {
                TenantRate {
                    requests_per_minute: t
                        .requests_per_minute
                        .map(|r| u32::try_from(r).unwrap_or(u32::MAX)),
                    tokens_per_minute: t.tokens_per_minute,
                }
            }),
        })
        .collect()
}

/// The name of the data directory's lock file.
pub const LOCK_FILE: &str = "lock";

/// Takes the data directory's exclusive lock (`<data-dir>/lock`), held as long as the returned
/// file is open: the OS lets it go when the process ends, however it ends.
pub fn lock_data_dir(dir: &Path) -> Result<std::fs::File, StandaloneError> {
    let lock_err = |source| StandaloneError::Lock {
        dir: dir.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(lock_err)?;
    let path = dir.join(LOCK_FILE);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(lock_err)?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(StandaloneError::DataDirInUse {
            dir: dir.to_path_buf(),
            lock: path,
        }),
        Err(std::fs::TryLockError::Error(e)) => Err(lock_err(e)),
    }
}

/// The lifecycle's settings from the standalone document (its host the first), counting into
/// `metrics`, its switch records in memory only.
pub fn lifecycle_config(config: &StandaloneConfig, metrics: Arc<Metrics>) -> LifecycleConfig {
    let first = FirstHost {
        id: config.host.id.clone(),
        activation: config.host.activation,
        settings: HostSettings::from(&config.host),
    };
    assembly::lifecycle_config(&config.server, first, &config.host.queue, metrics, None)
}

/// The router's settings from the standalone document.
pub fn router_config(config: &StandaloneConfig) -> RouterConfig {
    assembly::router_config(&config.server, &config.host.queue)
}

/// A node agent that a standalone server drives besides its own host (`capyctl start
/// standalone --node-agent URL`): another box's GPUs, as `capyctl start host` serves them.
#[derive(Clone)]
pub struct NodeAgentLink {
    /// `http://host:port` of its agent API.
    pub url: String,
    /// Its agent token (`CAPYCTL_AGENT_TOKEN` of both sides).
    pub token: String,
}

impl std::fmt::Debug for NodeAgentLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeAgentLink")
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

/// The hosts of the node agents `links`, each under the `host.id` of its own host document,
/// with the activation and engine commands of `own` (the standalone document's host; as the
/// operator gives a node agent named by URL its host document's). Fails naming the agent that
/// cannot be reached, runs its engines as Pods, or has a host ID already taken.
async fn node_agent_hosts(
    links: &[NodeAgentLink],
    own: &HostEntry,
) -> Result<Vec<HostEntry>, StandaloneError> {
    let mut taken = vec![own.id.clone()];
    let mut hosts = Vec::new();
    for link in links {
        let failed = |detail: String| StandaloneError::NodeAgent {
            url: link.url.clone(),
            detail,
        };
        let mut remote = RemoteConfig::new(link.url.clone(), link.token.clone());
        remote.follow_agent_timing = true;
        let agent = RemoteHostAgent::new(remote).map_err(|e| failed(e.to_string()))?;
        let info = agent.info().await.map_err(|e| failed(e.to_string()))?;
        // Exits are watched before the recovery reads what runs there: an engine that exits
        // in between is then reported, not missed.
        if tokio::time::timeout(Duration::from_secs(30), agent.watching_exits())
            .await
            .is_err()
        {
            return Err(failed(
                "its engine exits could not be watched within 30 s".into(),
            ));
        }
        if info.engine_runtime == "pod" {
            return Err(failed(
                "it runs engines as Pods (--engine-runtime pod), which needs the operator on Kubernetes; start it with --engine-runtime process".into(),
            ));
        }
        let id = if info.host_id.is_empty() {
            info.node_name.clone()
        } else {
            info.host_id.clone()
        };
        if taken.contains(&id) {
            return Err(failed(format!(
                "its host.id {id} is already another host's; give each host document its own host.id"
            )));
        }
        taken.push(id.clone());
        hosts.push(HostEntry {
            id,
            agent: Arc::new(agent),
            activation: own.activation,
            settings: own.settings.clone(),
            admission_window: own.admission_window,
            remote: true,
        });
    }
    Ok(hosts)
}

/// A running standalone server.
pub struct Standalone {
    /// The data directory's lock, held while this runs.
    _lock: std::fs::File,
    /// The lifecycle.
    server: Arc<Core>,
    /// The host agent (engines are stopped through it on shutdown).
    agent: Arc<LocalHostAgent>,
    inference_addr: SocketAddr,
    management_addr: SocketAddr,
    admin_token: String,
    /// `true` stops the listeners.
    stop: watch::Sender<bool>,
    /// The listeners' tasks.
    tasks: Vec<JoinHandle<()>>,
    /// The document's deployments, checked by `listen` and not deployed yet
    /// ([`Standalone::deploy_checked`]).
    checked: std::sync::Mutex<Option<Checked>>,
    /// The inference listener's tenants (`server.inference_auth`).
    tenants: Arc<Tenants>,
}

/// The files of a data directory that a start creates, noted before it begins: dropped
/// without [`Created::keep`] (the start refused), it removes those that were not there, and
/// gives an imported `state.json` its name back.
struct Created {
    files: Vec<PathBuf>,
    /// The host agent's `engines/`, when it was not there (removed if still empty).
    dirs: Vec<PathBuf>,
    /// (`state.json`, `state.json.migrated`) when the first is there and the second is not.
    legacy: Option<(PathBuf, PathBuf)>,
}

impl Created {
    fn note(data_dir: &Path) -> Created {
        use capyctl_lifecycle::store::{LEGACY_STATE_FILE, MIGRATED_STATE_FILE, STATE_FILE};
        let files = [STATE_FILE, capyctl_lifecycle::switches::FILE]
            .iter()
            .map(|f| data_dir.join(f))
            .filter(|p| !p.exists())
            .collect();
        let (json, migrated) = (
            data_dir.join(LEGACY_STATE_FILE),
            data_dir.join(MIGRATED_STATE_FILE),
        );
        let legacy = (json.exists() && !migrated.exists()).then_some((json, migrated));
        let dirs = Some(data_dir.join("engines"))
            .filter(|d| !d.exists())
            .into_iter()
            .collect();
        Created {
            files,
            dirs,
            legacy,
        }
    }

    /// The start went through: its files stay.
    fn keep(mut self) {
        self.files.clear();
        self.dirs.clear();
        self.legacy = None;
    }
}

impl Drop for Created {
    fn drop(&mut self) {
        if let Some((json, migrated)) = &self.legacy
            && !json.exists()
            && migrated.exists()
            && let Err(e) = std::fs::rename(migrated, json)
        {
            tracing::warn!(path = %json.display(), error = %e, "a refused start could not give state.json its name back");
        }
        for path in &self.files {
            if let Err(e) = std::fs::remove_file(path)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(path = %path.display(), error = %e, "a refused start could not remove a file it created");
            }
        }
        for dir in &self.dirs {
            // Only when empty: nothing of an engine is ever removed.
            let _ = std::fs::remove_dir(dir);
        }
    }
}

impl std::fmt::Debug for Standalone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Standalone")
            .field("inference_addr", &self.inference_addr)
            .field("management_addr", &self.management_addr)
            .finish_non_exhaustive()
    }
}

impl Standalone {
    /// Starts standalone with GPUs from the default probe (NVML with the `nvml` feature of the
    /// node agent; `host.gpus` overrides it).
    pub async fn start(
        config: StandaloneConfig,
        data_dir: PathBuf,
    ) -> Result<Standalone, StandaloneError> {
        Self::start_with_probe(config, data_dir, default_probe()).await
    }

    /// [`Standalone::start`] with a given GPU probe.
    pub async fn start_with_probe(
        config: StandaloneConfig,
        data_dir: PathBuf,
        probe: Arc<dyn GpuProbe>,
    ) -> Result<Standalone, StandaloneError> {
        let standalone = Self::listen(config, data_dir, probe).await?;
        standalone.deploy_checked().await;
        Ok(standalone)
    }

    /// Everything of [`Standalone::start`] but deploying the document's deployments: they are
    /// checked (a refusal comes before any listener opens and changes nothing), the listeners
    /// answer, and `/readyz` says not ready until [`Standalone::deploy_checked`] has deployed
    /// them.
    pub async fn listen(
        config: StandaloneConfig,
        data_dir: PathBuf,
        probe: Arc<dyn GpuProbe>,
    ) -> Result<Standalone, StandaloneError> {
        Self::listen_with(config, data_dir, probe, &[]).await
    }

    /// [`Standalone::listen`] with the hosts of node agents besides its own
    /// ([`NodeAgentLink`]): placement chooses among all of them. Their engines are theirs: a
    /// clean shutdown stops this host's engines and leaves theirs running, for the next start
    /// to adopt (stop a node agent to stop its engines).
    pub async fn listen_with(
        mut config: StandaloneConfig,
        data_dir: PathBuf,
        probe: Arc<dyn GpuProbe>,
        node_agents: &[NodeAgentLink],
    ) -> Result<Standalone, StandaloneError> {
        // Read before anything is touched: unusable TLS files change nothing.
        let tls = capyctl_router::tls::listen_config(config.server.listen.tls.as_ref())?;
        // Then: a second CapyCTL on the same directory would adopt (or stop) the first one's
        // engines before failing to bind its ports.
        let lock = lock_data_dir(&data_dir)?;
        // Declared before the store and the server: dropped after them.
        let created = Created::note(&data_dir);
        let mut agent_config = AgentConfig::new(&data_dir);
        agent_config.wake_window = config.server.switching.wake_timeout;
        let agent = Arc::new(LocalHostAgent::new(
            agent_config,
            HostSettings::from(&config.host),
            probe,
        )?);
        let metrics = Arc::new(Metrics::new());
        let mut lifecycle = lifecycle_config(&config, metrics.clone());
        // The switch records, kept across restarts beside the state.
        lifecycle.switch_log = Some(data_dir.join(capyctl_lifecycle::switches::FILE));
        let own = lifecycle.own_host(agent.clone());
        let mut hosts = node_agent_hosts(node_agents, &own).await?;
        hosts.insert(0, own);
        let store = Arc::new(RedbStore::open(&data_dir)?);
        let server = Core::open_fixed_hosts(hosts, store, lifecycle).await?;
        // Not ready until the document's deployments exist (`deploy_checked`).
        server.set_ready(false);
        // The whole document, before any listener opens: a refusal changes nothing.
        let deployments = std::mem::take(&mut config.deployments);
        let checked = match server.check_all(deployments).await {
            Ok(checked) => checked,
            Err((name, source)) => {
                server.close();
                return Err(StandaloneError::Deploy { name, source });
            }
        };

        let (inference, inference_addr) =
            assembly::bind("server.listen.inference", config.server.listen.inference).await?;
        let (management, management_addr) =
            assembly::bind("server.listen.management", config.server.listen.management).await?;
        let admin_token = crate::management::load_or_create_token(
            config.server.admin_token_file.as_deref(),
            &data_dir,
        )?;

        let (stop, _) = watch::channel(false);
        let tenants = Arc::new(Tenants::new());
        // Before the listener opens: no request is served without a key meant to need one.
        if let Some(set) = &config.server.inference_auth {
            tenants
                .install(tenant_list(set))
                .map_err(StandaloneError::Tenants)?;
        }
        let inference = Inference {
            listener: inference,
            config: ProxyConfig {
                tls: tls.clone(),
                ..assembly::proxy_config(&config.host.queue)
            },
            observer: Some(metrics.clone()),
            stop: stop.subscribe(),
            give_back: None,
            tenants: Arc::clone(&tenants),
        };
        let assembled = assemble(
            &server,
            server.clone(),
            router_config(&config),
            Some(inference),
        )
        .await;
        let mut tasks: Vec<JoinHandle<()>> = assembled.inference.into_iter().collect();
        {
            let api: Arc<dyn ManagementApi> = server.clone();
            let mut rx = stop.subscribe();
            let options = ManagementOptions {
                token: admin_token.clone(),
                metrics,
                tenants: Some(Arc::clone(&tenants)),
            };
            tasks.push(tokio::spawn(async move {
                let shutdown = async move {
                    let _ = rx.wait_for(|s| *s).await;
                };
                let served =
                    crate::management::serve_listener(management, tls, api, options, shutdown);
                if let Err(e) = served.await {
                    tracing::error!(error = %e, "the management listener failed");
                }
            }));
        }
        tracing::info!(%inference_addr, %management_addr, "standalone listening");
        created.keep();
        Ok(Standalone {
            _lock: lock,
            server,
            agent,
            inference_addr,
            management_addr,
            admin_token,
            stop,
            tasks,
            checked: std::sync::Mutex::new(Some(checked)),
            tenants,
        })
    }

    /// Deploys the document's deployments that [`Standalone::listen`] checked (once; later
    /// calls deploy nothing), then lets `/readyz` answer ready. What they change is written in
    /// one transaction: unchanged ones write nothing.
    pub async fn deploy_checked(&self) {
        let checked = self
            .checked
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
            .unwrap_or_default();
        let count = checked.len();
        self.server.deploy_checked(checked).await;
        self.server.set_ready(true);
        tracing::info!(deployments = count, "standalone ready");
    }

    /// Deploys the document's deployments in order (a changed document bumps its revision, the
    /// same one changes nothing), then lets `/readyz` answer ready. The whole document is
    /// checked first: a refusal names that deployment and changes nothing, and `/readyz` stays
    /// as it was.
    /// What they change is written in one transaction ([`Core::deploy_all`]): unchanged ones
    /// write nothing.
    pub async fn deploy_document(
        &self,
        deployments: Vec<capyctl_spec::documents::DeploymentDoc>,
    ) -> Result<(), StandaloneError> {
        let count = deployments.len();
        self.server
            .deploy_all(deployments)
            .await
            .map_err(|(name, source)| StandaloneError::Deploy { name, source })?;
        self.server.set_ready(true);
        tracing::info!(deployments = count, "standalone ready");
        Ok(())
    }

    /// Replaces the inference listener's tenants with `server.inference_auth` of a document
    /// read again (SIGHUP): `None` turns keys off. A set that is refused changes nothing and
    /// says what is wrong (never a key).
    pub fn replace_tenants(&self, set: Option<&[TenantSettings]>) -> Result<(), String> {
        self.tenants
            .install(set.map(tenant_list).unwrap_or_default())
    }

    /// The inference listener's tenants.
    pub fn tenants(&self) -> &Arc<Tenants> {
        &self.tenants
    }

    /// Where the inference listener listens.
    pub fn inference_addr(&self) -> SocketAddr {
        self.inference_addr
    }

    /// Where the management listener listens.
    pub fn management_addr(&self) -> SocketAddr {
        self.management_addr
    }

    /// The admin token the management API asks for.
    pub fn admin_token(&self) -> &str {
        &self.admin_token
    }

    /// The lifecycle (for in-process callers and tests).
    pub fn server(&self) -> &Arc<Core> {
        &self.server
    }

    /// A clean shutdown: stops accepting, lets answers in progress finish (the listener's
    /// grace), stops the background work and every engine.
    pub async fn shutdown(self) {
        self.stop.send_replace(true);
        for t in self.tasks {
            let _ = t.await;
        }
        self.server.close();
        self.agent.stop_all().await;
    }
}
