//! CapyCTL's lifecycle, without Kubernetes and without sockets: the one writer of deployment and
//! instance state (see `lifecycle/DESIGN.md`).
//!
//! - [`api`]: [`api::ManagementApi`], what the management listener asks of the server; the
//!   lifecycle implements it (the Kubernetes operator wraps it, management tests use a fake).
//! - [`store`]: where the state lives, behind the [`store::Store`] trait (the standalone store;
//!   on Kubernetes the operator's CR-backed one).
//! - [`metrics`]: the server's Prometheus metrics.
//!
//! The store and the host agents are traits: this crate does not know whether it runs under
//! Kubernetes, and a test checks that kube is not in its dependency tree.
//!
//! [`Server`]'s state (every deployment and its instance: one per deployment on one host, index
//! 0) has one writer, the owner task (`owner.rs`), which runs the rules of `state.rs` one call
//! at a time; reads take a read lock, no turn of the task. An engine operation (start, park,
//! wake, stop) is a call that marks the instance busy (`starting`, `parking`, ...), the host
//! agent's call on the caller's task, and a call that writes the outcome; a busy or reserved
//! instance is never touched by anything else. A plan the router asks for reserves its victims
//! (and claims the target) in one call, so two plans or an operator command never name the
//! same victim.
//!
//! The server implements the router's [`Lifecycle`] and [`ManagementApi`]; it tells the router
//! about instances through the [`CoordinatorHandle`] given to [`Server::attach_router`], and
//! releases ready instances it parks or stops itself with [`CoordinatorHandle::release`], so
//! that running requests always finish first (its idle timers with
//! [`CoordinatorHandle::release_if_idle`]: the router decides, on its own state, that nothing
//! waits, runs or came since). A request's last use is the router's record
//! ([`CoordinatorHandle::last_uses`]), which `Dep::used_at` reads.

pub mod api;
mod holdover;
pub mod metrics;
mod owner;
mod parked_room;
mod placement;
mod scale;
mod state;
pub mod store;
pub mod switches;
mod views;
mod writer;

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::ops::Bound;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, Weak};
use std::time::Duration;

use capyctl_node_agent::HostAgent;
use capyctl_node_agent::agent::{AgentHealth, EngineExit, ParkResult};
use capyctl_node_agent::measure::Measurement;
use capyctl_node_agent::spec::{HostSettings, InstanceSpec};
use capyctl_node_agent::tier::{NoParkReason, ParkTier};
use capyctl_router::config::RouterConfig;
use capyctl_router::coordinator::Coordinator;
use capyctl_router::coordinator::{CoordinatorHandle, IdleRelease, OperatorResult, OperatorStart};
use capyctl_router::lifecycle::{
    BoxFuture, DeploymentId, DeploymentRef, DrainReport, Executed, InstanceKey, Lifecycle, Plan,
    PlanFor, SwitchOrder, Upstream,
};
use capyctl_router::proxy::{ModelEntry, Proxy, ProxyConfig};
use capyctl_spec::api::{
    ActionReceipt, DeployOutcome, DeployReceipt, DeploymentList, DeploymentView, EngineList,
    EngineView, HostDrainReceipt, HostList, LoadReport, Released, StartRequest, SwitchCause,
    SwitchError, SwitchPhaseKind, Victim, VictimResult,
};
use capyctl_spec::documents::DeploymentDoc;
use capyctl_spec::errors::ApiError;
use capyctl_spec::settings::LifecycleDefaults;
use capyctl_spec::{Activation, InstanceState};
use futures_util::StreamExt;
use tokio::sync::{broadcast, mpsc, oneshot, watch};
use tokio::time::Instant;
use tracing::Instrument;

use crate::api::ManagementApi;
use crate::metrics::Metrics;
use crate::store::{DeploymentRecord, Store, StoreError};
use crate::switches::{Recording, SwitchLog, Target, victim_entry};
use state::{Dep, Host, Hosts, StartNext, State, Up, dep_of_unit, unit_instance, unit_of_key};

/// How many deployments [`Server::open_hosts`] measures at once.
const MEASURE_AT_ONCE: usize = 16;

/// The lifecycle's settings.
#[derive(Debug, Clone)]
pub struct LifecycleConfig {
    /// The host's ID (`host.id`).
    pub host_id: String,
    /// The host's `lifecycle.activation`: `explicit` makes every deployment explicit.
    pub host_activation: Activation,
    /// Idle timers (`server.lifecycle_defaults`); both off by default.
    pub lifecycle_defaults: LifecycleDefaults,
    /// The host's engine commands (shown by `engine list`).
    pub host_settings: HostSettings,
    /// `max_pending_per_deployment`, for the load read of a deployment the router has not seen.
    pub waiting_limit: u32,
    /// How often idle timers are checked (and the queue gauges refreshed).
    pub timer_tick: Duration,
    /// Where parks, wakes, switches, requests and queues are counted.
    pub metrics: Arc<Metrics>,
    /// Where the switch records are kept across restarts (standalone:
    /// `<data dir>/switches.jsonl`, [`switches::FILE`]); `None`: in memory only.
    pub switch_log: Option<std::path::PathBuf>,
    /// The wake window of every wake, on every host (`server.switching.wake_timeout`: the
    /// node agents get it with each wake); `None`: each agent's own.
    pub wake_window: Option<Duration>,
}

impl LifecycleConfig {
    /// Defaults for host `host_id`: on-demand, no idle timers, a timer check every second.
    pub fn new(host_id: impl Into<String>) -> Self {
        Self {
            host_id: host_id.into(),
            host_activation: Activation::OnDemand,
            lifecycle_defaults: LifecycleDefaults::default(),
            host_settings: HostSettings::default(),
            waiting_limit: 64,
            timer_tick: Duration::from_secs(1),
            metrics: Arc::new(Metrics::new()),
            switch_log: None,
            wake_window: None,
        }
    }

    /// The host these settings describe (`host_id`, its activation and engine commands,
    /// the router's admission window), served by `agent` in this process.
    pub fn own_host(&self, agent: Arc<dyn HostAgent>) -> HostEntry {
        HostEntry {
            id: self.host_id.clone(),
            agent,
            activation: self.host_activation,
            settings: self.host_settings.clone(),
            admission_window: None,
            remote: false,
        }
    }
}

/// What can go wrong opening the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The state could not be loaded.
    #[error("loading the state: {0}")]
    Store(#[from] StoreError),
    /// The host agent failed (inventory, recovery).
    #[error("host agent: {0}")]
    Agent(#[from] capyctl_node_agent::AgentError),
    /// The switch records could not be read or written.
    #[error("{0}")]
    Switches(#[from] switches::SwitchLogError),
}

impl ServerError {
    /// A short, stable label for metrics and event reasons.
    pub fn metric_label(&self) -> &'static str {
        match self {
            ServerError::Store(e) => e.metric_label(),
            ServerError::Agent(e) => e.metric_label(),
            ServerError::Switches(_) => "switch_records",
        }
    }
}

/// The UUIDs of the GPUs `d`'s engine uses on its host (those its `CUDA_VISIBLE_DEVICES`
/// names, the deployment's or the host's engine setting, else every GPU of the host), where
/// the host's inventory knows them.
fn gpus_of(inner: &State, d: &Dep) -> Vec<String> {
    const VAR: &str = VISIBLE_DEVICES;
    let Some(host) = d.host.as_deref().and_then(|h| inner.hosts.get(h)) else {
        return Vec::new();
    };
    let spec = d.launch_spec();
    let visible = spec
        .env
        .get(VAR)
        .or_else(|| host.settings.engine(d.spec.engine).env.get(VAR))
        .map(|v| v.trim())
        .filter(|v| !v.is_empty());
    let used = |g: &capyctl_node_agent::inventory::GpuInfo| {
        visible.is_none_or(|v| {
            v.split(',')
                .map(str::trim)
                .any(|name| match name.parse::<u32>() {
                    Ok(index) => g.index == index,
                    Err(_) => g
                        .uuid
                        .as_deref()
                        .is_some_and(|u| u.eq_ignore_ascii_case(name)),
                })
        })
    };
    host.gpus
        .iter()
        .filter(|g| used(g))
        .filter_map(|g| g.uuid.clone())
        .collect()
}

/// The variable that gives an engine its GPUs.
pub(crate) const VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";

/// The ID of a deployment's instance: `<deployment id>-0`.
pub fn instance_id(deployment_id: &str) -> String {
    instance_id_at(deployment_id, 0)
}

/// The ID of a deployment's instance `index`: `<deployment id>-<index>`.
pub fn instance_id_at(deployment_id: &str, index: u32) -> String {
    format!("{deployment_id}-{index}")
}

/// The deployment ID and index an instance ID (`<deployment id>-<index>`) names.
pub fn split_instance_id(instance_id: &str) -> Option<(&str, u32)> {
    let (dep, index) = instance_id.rsplit_once('-')?;
    let index: u32 = index.parse().ok()?;
    (!dep.is_empty()).then_some((dep, index))
}

/// How the router is asked to release instances the lifecycle puts away itself.
#[derive(Debug, Clone, Copy)]
enum Ask {
    /// Whatever runs drains first (an operator's command, `start --evict`).
    Always,
    /// Only if its coordinator finds the deployment idle, with no use after this instant (the
    /// idle timers): see `CoordinatorHandle::release_if_idle`.
    IfIdleSince(Instant),
}

/// A host as given to [`Server::open_hosts`] and [`Server::upsert_host`].
#[derive(Clone)]
pub struct HostEntry {
    /// Its ID (`host.id`; the node's name on Kubernetes).
    pub id: String,
    /// Its agent.
    pub agent: Arc<dyn HostAgent>,
    /// Its `lifecycle.activation`: `explicit` makes every deployment explicit.
    pub activation: Activation,
    /// Its engine commands.
    pub settings: HostSettings,
    /// Its `resource_policy.queue.admission_window`: the window of a switch on this host
    /// (`None`: the router's).
    pub admission_window: Option<Duration>,
    /// A node agent over HTTP (Kubernetes): the engine's `max_running` is the host's to size
    /// until the engine reports (`source: on_host`).
    pub remote: bool,
}

impl std::fmt::Debug for HostEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostEntry")
            .field("id", &self.id)
            .field("activation", &self.activation)
            .finish_non_exhaustive()
    }
}

/// How many deployments a read copies per hold of the lock ([`Server::shots`]).
const SHOT_CHUNK: usize = 256;

/// How many calls to host agents a read (`engine list`, `hosts`) makes at once.
const HOST_CALLS_AT_ONCE: usize = 64;

/// How many hosts' deployments the host view sums per hold of the lock.
const HOSTS_PER_HOLD: usize = 32;

/// How often an ended start or wake is asked to stop again until it has ended (see
/// [`Server::unless_ended`]).
const STOP_AGAIN: Duration = Duration::from_millis(500);

/// The error of a `start --evict` of deployment `target` (its name) whose victims in
/// `not_released` (ID, name, why) could not be stopped; `None` when every victim was released.
fn evict_failed(target: &str, not_released: &[(String, String, String)]) -> Option<ApiError> {
    let ((first, name, why), rest) = not_released.split_first()?;
    let others: Vec<&str> = rest.iter().map(|(_, n, _)| n.as_str()).collect();
    let also = if others.is_empty() {
        String::new()
    } else {
        format!(" (and of {})", others.join(", "))
    };
    Some(ApiError::EngineFailed {
        deployment: first.clone(),
        detail: format!(
            "start --evict of {target} could not stop {name}{also}: {why}; {target} was not started"
        ),
    })
}

/// How many deployments a host drain stops at once.
const DRAINS_AT_ONCE: usize = 16;

/// The longest [`Server::idle_engine`] waits: the drain bound's maximum (600 s).
const IDLE_ENGINE_BOUND: Duration = Duration::from_secs(600);

/// What a release does when its copy finds no room in host RAM (only explicit parked copies
/// stand in the way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NoRoom {
    /// Refuse the park (`parked_capacity`); the model serves again (an operator park, the
    /// idle timer).
    Refuse,
    /// Stop it instead (`released: stopped (no room to park)`): a switch's victim, whose
    /// memory a waiting model needs, or an instance the scaler takes away.
    Stop,
}

/// Whether a drained instance parks or stops, and why it stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Put {
    /// It parks (the agent may still stop it where it does not park, or for want of host RAM).
    Park,
    /// It stops: an operator's stop, or a request cut before output.
    Stop,
    /// It stops because the GPU has no room to keep it parked: a victim whose parked residue
    /// would be in the way, or a parked engine stopped for what it holds. Said as
    /// `released: stopped (no room to park)` when it would otherwise park.
    StopNoRoom,
}

impl Put {
    /// How a victim is put away: stopped after a cut before output, stopped for room when
    /// `no_room`, else parked.
    fn victim(cut: bool, no_room: bool) -> Put {
        if cut {
            Put::Stop
        } else if no_room {
            Put::StopNoRoom
        } else {
            Put::Park
        }
    }
}

/// How a drained instance was put away.
#[derive(Debug)]
struct PutAway {
    /// Its own release.
    released: Released,
    /// Parked copies stopped to make room in host RAM for its copy
    /// (`released: stopped (no room to park)`).
    room: Vec<Victim>,
}

/// How a start or a wake in progress was ended ([`Server::end_bring_up`]).
#[derive(Debug)]
struct Ended {
    /// What its waiting requests and its caller get.
    refusal: ApiError,
    /// The agent's stop of its engine.
    stopped: Result<(), capyctl_node_agent::AgentError>,
}

/// The record of a switch the router planned, while its window and drain run.
struct Planned {
    rec: Recording,
    /// Its window's or drain's phase, as seen live.
    open: Option<switches::PhaseMark>,
    /// Its victims (ID, name): `kept` if it is given back.
    victims: Vec<(String, String)>,
}

/// Deployment documents measured and checked against the hosts ([`Server::check_all`]), not
/// deployed yet ([`Server::deploy_checked`]).
#[derive(Debug, Default)]
pub struct Checked(Vec<CheckedDoc>);

impl Checked {
    /// How many documents it holds.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// It holds none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// One checked document: its deployment's ID (new or existing), its measurement.
#[derive(Debug)]
struct CheckedDoc {
    doc: DeploymentDoc,
    id: String,
    measured: Option<Measurement>,
    /// The same document is deployed already: nothing to do.
    unchanged: bool,
}

/// The server's lifecycle and placement on one host. Shared as `Arc<Server>`.
pub struct Server {
    /// Read-only.
    config: LifecycleConfig,
    /// Engine exits of every host, forwarded (host ID, exit) to the owner's task.
    exits_tx: mpsc::Sender<(String, EngineExit)>,
    /// Where the records go.
    store: Arc<dyn Store>,
    /// The owner of all state: its one writer (see `owner.rs`).
    owner: owner::Owner,
    /// The idle timers are running (a tick while they run does nothing); cleared by the
    /// run's [`Running`] however it ends.
    timers_running: Arc<AtomicBool>,
    /// A scaler's run is under way (`Server::scale_run`); cleared as `timers_running` is.
    scaling: Arc<AtomicBool>,
    /// Per deployment, since when its load has allowed one fewer instance (the scaler's).
    below_since: Mutex<HashMap<String, Instant>>,
    /// The task forwarding each host's engine exits (replaced with its agent).
    host_exits: Mutex<HashMap<String, tokio::task::AbortHandle>>,
    /// Serialises the commits (`writer.rs`); taken on the blocking pool, or by `close`.
    persist: Arc<Mutex<()>>,
    /// The router, once attached; taken by `close`.
    router: Mutex<Option<CoordinatorHandle>>,
    /// Bumped after every turn of the owner (waiters of `--wait` and tests watch it).
    changes: Arc<watch::Sender<u64>>,
    /// Model names → deployments, for the router's `resolve` without this server's lock.
    names: NameCache,
    /// Set by `close`: background tasks end.
    closed: watch::Sender<bool>,
    /// `/readyz`.
    ready: AtomicBool,
    /// No host joins after the open (standalone, [`Server::open`]): a deployment no host can
    /// place is refused at deploy. Hosts may join otherwise ([`Server::upsert_host`]: a
    /// cluster's nodes), so placement answers `does_not_fit` per request instead.
    hosts_fixed: AtomicBool,
    /// Switch and release numbers.
    next_id: AtomicU64,
    /// The switch records (`GET /switches`).
    switches: Arc<SwitchLog>,
    /// The records of the router's switches planned and not yet executed, failed or given
    /// back, by switch ID (shown while their window and drain run).
    planned: Mutex<HashMap<String, Planned>>,
    /// Itself, for the background work it spawns.
    me: Weak<Server>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("host_id", &self.config.host_id)
            .finish_non_exhaustive()
    }
}

fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::Internal {
        detail: e.to_string(),
    }
}

pub(crate) fn not_found(key: &str) -> ApiError {
    ApiError::NotFound {
        what: format!("deployment {key}"),
    }
}

impl Server {
    /// Opens the server on one host (standalone; `config.host_*` describe it): see
    /// [`Server::open_hosts`]. No other host ever joins: a deployment needing more GPU memory
    /// than this one has is refused at deploy.
    pub async fn open(
        agent: Arc<dyn HostAgent>,
        store: Arc<dyn Store>,
        config: LifecycleConfig,
    ) -> Result<Arc<Server>, ServerError> {
        let host = config.own_host(agent);
        Self::open_fixed_hosts(vec![host], store, config).await
    }

    /// [`Server::open_hosts`] for hosts that are all known now and never join later
    /// (standalone, with its own host and the node agents it was given): a deployment that fits
    /// none of them is refused at deploy.
    pub async fn open_fixed_hosts(
        hosts: Vec<HostEntry>,
        store: Arc<dyn Store>,
        config: LifecycleConfig,
    ) -> Result<Arc<Server>, ServerError> {
        let server = Self::open_hosts(hosts, store, config).await?;
        server.hosts_fixed.store(true, Ordering::Relaxed);
        Ok(server)
    }

    /// Opens the server: loads the stored deployments, then for each host reads its
    /// inventory and recovers the engines a previous run left there (adopted ones come back
    /// ready or parked and are announced once a router is attached; unknown ones are
    /// stopped), then measures each deployment.
    pub async fn open_hosts(
        hosts: Vec<HostEntry>,
        store: Arc<dyn Store>,
        config: LifecycleConfig,
    ) -> Result<Arc<Server>, ServerError> {
        let mut inner = State {
            host_id: config.host_id.clone(),
            ..State::default()
        };
        for rec in store.load()? {
            inner.insert(Dep::new(rec));
        }
        let switches = Arc::new(match &config.switch_log {
            Some(path) => SwitchLog::open(path, Arc::clone(&config.metrics))?,
            None => SwitchLog::in_memory(Arc::clone(&config.metrics)),
        });
        let changes = Arc::new(watch::channel(0).0);
        let (closed, _) = watch::channel(false);
        let (exits_tx, exits_rx) = mpsc::channel(256);
        let server = Arc::new_cyclic(|me: &Weak<Server>| {
            let owner = owner::Owner::spawn(
                inner,
                Arc::clone(&changes),
                exits_rx,
                config.timer_tick,
                me.clone(),
                closed.subscribe(),
            );
            Server {
                owner,
                timers_running: Arc::new(AtomicBool::new(false)),
                scaling: Arc::new(AtomicBool::new(false)),
                below_since: Mutex::new(HashMap::new()),
                config,
                exits_tx,
                store,
                host_exits: Mutex::new(HashMap::new()),
                persist: Arc::new(Mutex::new(())),
                router: Mutex::new(None),
                names: NameCache::new(changes.subscribe()),
                changes,
                closed,
                ready: AtomicBool::new(false),
                hosts_fixed: AtomicBool::new(false),
                next_id: AtomicU64::new(1),
                switches,
                planned: Mutex::new(HashMap::new()),
                me: me.clone(),
            }
        });
        for host in hosts {
            server.add_host(host).await?;
        }
        let specs: Vec<(String, InstanceSpec)> = server.read(|inner| {
            inner
                .deps
                .values()
                .map(|d| (d.rec.id.clone(), d.spec.clone()))
                .collect()
        });
        // A few at a time: each is a call to a host agent (a blocking task of a local one).
        let measured: Vec<(String, Measurement)> = futures_util::stream::iter(specs)
            .map(|(id, spec)| {
                let server = &server;
                async move {
                    let agent = server.agent_of(&id).ok()?;
                    Some((id, agent.measure(&spec).await.unwrap_or_default()))
                }
            })
            .buffer_unordered(MEASURE_AT_ONCE)
            .filter_map(std::future::ready)
            .collect()
            .await;
        server
            .write(move |inner| {
                for (id, m) in measured {
                    if let Some(d) = inner.deps.get_mut(&id)
                        && d.measurement.awaiting()
                    {
                        d.measurement = m;
                    }
                }
                // NB: measured by deployment, into its first instance: the others take it from
                // there. Left unknown, each would count a whole GPU in placement until the next
                // deploy (the soak found a GPU over-booked after a restart so, seed 42).
                let replicated: Vec<String> = inner.replicated.iter().cloned().collect();
                for dep in replicated {
                    inner.sync_units(&dep);
                }
            })
            .await;
        server.ready.store(true, Ordering::SeqCst);
        Ok(server)
    }

    /// Adds a host, or replaces the agent of a known one (a node agent that came back at
    /// another address): reads its inventory, then its recovery report, and reconciles the
    /// deployments with it: engines it holds are adopted (ready or parked), engines of unknown
    /// deployments (or of a deployment already running elsewhere) are stopped, and instances
    /// believed to be on this host that it no longer has are failed (the next request starts
    /// them afresh).
    pub async fn upsert_host(&self, host: HostEntry) -> Result<(), ServerError> {
        self.add_host(host).await
    }

    async fn add_host(&self, entry: HostEntry) -> Result<(), ServerError> {
        let HostEntry {
            id: host_id,
            agent,
            activation,
            settings,
            admission_window,
            remote,
        } = entry;
        let inventory = agent.inventory().await?;
        let capacity = inventory.gpus.iter().map(|g| g.total_bytes).sum();
        let report = agent.recover().await?;
        let host = Host {
            agent: agent.clone(),
            activation,
            settings,
            admission_window,
            remote,
            capacity,
            gpus: inventory.gpus,
        };
        let (adopted, stopped, gone) = (report.adopted, report.stopped, report.gone);
        if let Some(exits) = self.host_exits_of().remove(&host_id) {
            // The replaced agent's exits are no longer this host's.
            exits.abort();
        }
        let hid = host_id.clone();
        let state::Adoption {
            to_stop,
            came,
            lost,
        } = self
            .write(move |inner| inner.add_host(hid, host, &adopted))
            .await;
        for gone in stopped.iter().chain(gone.iter()) {
            tracing::info!(host = %host_id, instance = %gone, "an engine a previous run left is gone or did not answer");
        }
        for iid in to_stop {
            if let Err(e) = agent.stop(&iid).await {
                tracing::warn!(host = %host_id, instance = %iid, error = %e, "stopping a left engine failed");
            }
        }
        let exits = self.forward_exits(
            host_id.clone(),
            agent.subscribe_exits(),
            agent.subscribe_health(),
        );
        self.host_exits_of().insert(host_id.clone(), exits);
        self.flush_due().await;
        for key in lost {
            self.announce_gone(key).await;
        }
        for (key, addr) in came {
            self.announce_ready(key, addr).await;
        }
        if self.router().is_some() {
            self.memory_freed();
        }
        Ok(())
    }

    /// Forwards `host`'s engine exits to the owner's task, until the server closes or the
    /// agent's channel does; follows the agent's health: reconciles the host again
    /// ([`Server::resync_host`]) each time its agent says it may have lost track of engines
    /// (`resyncs`: a node agent that restarted, or missed exits), and tells the views' readers
    /// (the status writer) when it becomes unreachable or answers again.
    fn forward_exits(
        &self,
        host: String,
        mut exits: broadcast::Receiver<EngineExit>,
        mut health: watch::Receiver<AgentHealth>,
    ) -> tokio::task::AbortHandle {
        let tx = self.exits_tx.clone();
        let mut closed = self.closed.subscribe();
        let me = self.me.clone();
        let mut health_open = true;
        let mut resyncs = health.borrow_and_update().resyncs;
        let task = tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = closed.changed() => return,
                    changed = health.changed(), if health_open => {
                        if changed.is_err() {
                            // An agent that never tells (in this process).
                            health_open = false;
                            continue;
                        }
                        let Some(server) = me.upgrade() else { return };
                        let now = health.borrow_and_update().resyncs;
                        if now == resyncs {
                            // Unreachable, or answering again: the views say so.
                            server.changes.send_modify(|n| *n = n.wrapping_add(1));
                            continue;
                        }
                        resyncs = now;
                        // Run apart and awaited: the reconciliation replaces this very task
                        // (it aborts it once the agent's report is in), which must not cut
                        // the reconciliation short.
                        let host = host.clone();
                        let _ = tokio::spawn(async move { server.resync_host(&host).await }).await;
                    }
                    exit = exits.recv() => match exit {
                        Ok(exit) => {
                            if tx.send((host.clone(), exit)).await.is_err() {
                                return;
                            }
                        }
                        Err(broadcast::error::RecvError::Lagged(n)) => {
                            tracing::warn!(%host, missed = n, "missed engine exit events");
                        }
                        Err(broadcast::error::RecvError::Closed) => return,
                    },
                }
            }
        });
        task.abort_handle()
    }

    /// Wakes `iid` on `agent` within the server's wake window when one is set (every host's
    /// wake then has the same bound, `server.switching.wake_timeout`), else the agent's own.
    async fn wake(
        &self,
        agent: &Arc<dyn HostAgent>,
        iid: &str,
    ) -> Result<capyctl_node_agent::agent::WakeReport, capyctl_node_agent::AgentError> {
        match self.config.wake_window {
            Some(window) => agent.wake_within(iid, window).await,
            None => agent.wake(iid).await,
        }
    }

    /// Reconciles host `host_id` with its agent again, as [`Server::upsert_host`] does with
    /// the agent it already has: what the agent still runs is adopted, instances it no longer
    /// has are failed (the router hears of both). Retried while the agent cannot answer
    /// (every second, then up to every 30 s), until it does or the host is replaced.
    async fn resync_host(&self, host_id: &str) {
        let mut pause = Duration::from_secs(1);
        let mut closed = self.closed.subscribe();
        loop {
            let Some(host) = self.read(|inner| inner.hosts.get(host_id).cloned()) else {
                return;
            };
            let entry = HostEntry {
                id: host_id.to_string(),
                agent: host.agent.clone(),
                activation: host.activation,
                settings: host.settings.clone(),
                admission_window: host.admission_window,
                remote: host.remote,
            };
            match self.add_host(entry).await {
                Ok(()) => {
                    tracing::info!(host = %host_id, "host reconciled again with its agent");
                    return;
                }
                Err(e) => {
                    tracing::warn!(host = %host_id, error = %e, "reconciling the host again failed; retrying");
                }
            }
            tokio::select! {
                _ = closed.changed() => return,
                () = tokio::time::sleep(pause) => {}
            }
            pause = (pause * 2).min(Duration::from_secs(30));
        }
    }

    /// Every host, by ID (shared: one `Arc` copied under the read lock).
    fn hosts_now(&self) -> Hosts {
        self.read(|inner| Arc::clone(&inner.hosts))
    }

    /// The agent of the host `id`'s instance is bound to; the first host's when it is bound
    /// to none (measurements, capability checks).
    fn agent_of(&self, id: &str) -> Result<Arc<dyn HostAgent>, ApiError> {
        self.read(|inner| {
            let host = inner.deps.get(id).and_then(|d| d.host.as_deref());
            host.and_then(|h| inner.hosts.get(h))
                .or_else(|| inner.hosts.values().next())
                .map(|h| h.agent.clone())
        })
        .ok_or_else(|| internal("no host is known"))
    }

    /// Attaches the router (after `Coordinator::spawn(server.clone(), cfg)`): announces the
    /// ready instances (adopted ones) and starts the background work (idle timers, engine
    /// exits).
    pub async fn attach_router(&self, router: CoordinatorHandle) {
        *self.router.lock().unwrap_or_else(PoisonError::into_inner) = Some(router.clone());
        self.read(|inner| inner.uses.attach(router.last_uses()));
        let ready: Vec<(InstanceKey, SocketAddr)> = self.read(|inner| {
            inner
                .deps
                .values()
                .filter(|d| d.state == InstanceState::Ready)
                .filter_map(|d| Some((d.key(&inner.host_id), d.addr?)))
                .collect()
        });
        for (key, addr) in ready {
            router.instance_ready(Upstream { key, addr }).await;
        }
        // Operator starts that waited for memory when the previous run ended wait again.
        if self.read(|inner| inner.deps.values().any(|d| d.rec.pending_start)) {
            self.memory_freed();
        }
    }

    /// The router of one assembly, as standalone, the operator, the tests and the benches
    /// build it: the coordinator over `lifecycle` (this server, or a wrapper of it such as the
    /// operator's observer), spawned and attached to this server ([`Server::attach_router`]).
    pub async fn spawn_router(
        &self,
        lifecycle: Arc<dyn Lifecycle>,
        config: RouterConfig,
    ) -> CoordinatorHandle {
        let router = Coordinator::spawn(lifecycle, config);
        self.attach_router(router.clone()).await;
        router
    }

    /// The inference listener's [`Proxy`] over `router`, whose catalog (`GET /v1/models`) is
    /// this server's models ([`Server::models`]; none once the server is gone).
    pub fn proxy(
        &self,
        router: CoordinatorHandle,
        config: ProxyConfig,
    ) -> Proxy<CoordinatorHandle> {
        let server = self.me.clone();
        let catalog = move || server.upgrade().map(|s| s.models()).unwrap_or_default();
        Proxy::new(router, catalog, config)
    }

    /// Holds `/readyz` at not ready (`false`), or lets it answer ready again (`true`): standalone
    /// holds it while it deploys its document's deployments. ([`Server::open`] leaves it ready.)
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    /// Stops the background work and lets go of the router (engines are left as they are;
    /// stop them through the host agent for a clean shutdown); writes what is not written yet
    /// (a batch of deploys cut short) and closes the store: nothing is written after it.
    pub fn close(&self) {
        if self.read(|inner| inner.dirty.any()) {
            // On the caller's thread: the last commit, after any still running.
            let _order = self.persist.lock().unwrap_or_else(PoisonError::into_inner);
            let saved = writer::commit(self.store.as_ref(), &self.owner.shared());
            self.log_failed(saved.map_err(|e| self.save_failed(&e)));
        }
        // The switch records changed so far are on disk (a switch still running is read back
        // as interrupted).
        self.switches.flush();
        self.store.close();
        self.closed.send_replace(true);
        self.ready.store(false, Ordering::SeqCst);
        self.router
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
    }

    /// The deployments for `GET /v1/models`.
    pub fn models(&self) -> Vec<ModelEntry> {
        let (shots, _) = self.shots();
        let mut models: Vec<ModelEntry> = shots
            .iter()
            .map(|d| ModelEntry {
                id: d[0].name().to_string(),
                deployment_id: d[0].id().to_string(),
                state: views::deployment_state(d).to_string(),
            })
            .collect();
        // By name (IDs made in the same millisecond are in no particular order).
        models.sort_by(|a, b| a.id.cmp(&b.id));
        models
    }

    /// Waits until deployment `name_or_id` is in one of `states`, for at most `within`; its
    /// view then, or the last view with `Err` when the time ran out.
    pub async fn wait_for_state(
        &self,
        name_or_id: &str,
        states: &[InstanceState],
        within: Duration,
    ) -> Result<DeploymentView, Option<DeploymentView>> {
        let mut rx = self.changes.subscribe();
        let deadline = Instant::now() + within;
        loop {
            let view = self.view(name_or_id);
            if let Some(v) = view.clone()
                && states.contains(&v.state)
            {
                return Ok(v);
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                _ => return Err(view),
            }
        }
    }

    /// The view of one deployment, if it exists.
    pub fn view(&self, name_or_id: &str) -> Option<DeploymentView> {
        let (d, hosts) = self.shot(name_or_id)?;
        Some(views::deployment_view(
            &d,
            &views::Ctx::new(&self.config, &hosts),
        ))
    }

    // ----- reads: snapshots copied under the read lock, views built outside it -----

    /// Every deployment as the views need it (by ID), and the hosts: copied under the read lock
    /// [`SHOT_CHUNK`] deployments at a time, the lock let go between chunks, so that a request
    /// or a switch waits for one chunk at most, never for a whole read. NB: so the copies are
    /// not of one instant; each deployment's is of one.
    fn shots(&self) -> (Vec<Vec<views::DepShot>>, Hosts) {
        let mut all: Vec<Vec<views::DepShot>> = Vec::new();
        let hosts = self.shot_chunks(|chunk, _, total| {
            all.reserve(total.saturating_sub(all.len()));
            all.append(chunk);
        });
        (all, hosts)
    }

    /// [`Server::shots`] a chunk at a time: `each` gets every chunk (in ID order; it may take
    /// the copies) once the lock is let go, with the hosts and the number of instances at
    /// the chunk's copy. A read that builds its views chunk by chunk keeps no copy of every
    /// deployment at once. A chunk holds whole deployments: every instance of each.
    fn shot_chunks(
        &self,
        mut each: impl FnMut(&mut Vec<Vec<views::DepShot>>, &Hosts, usize),
    ) -> Hosts {
        let mut taken: Vec<views::DepShot> = Vec::with_capacity(SHOT_CHUNK);
        let mut hosts: Option<Hosts> = None;
        let mut after: Option<String> = None;
        loop {
            let (hosts, total, last) = {
                let inner = self.owner.state();
                let hosts = Arc::clone(hosts.get_or_insert_with(|| Arc::clone(&inner.hosts)));
                let total = inner.deps.len();
                let from = after
                    .as_ref()
                    .map_or(Bound::Unbounded, |k| Bound::Excluded(k.as_str()));
                let mut it = inner
                    .deps
                    .range::<str, _>((from, Bound::Unbounded))
                    .peekable();
                while taken.len() < SHOT_CHUNK
                    && let Some((_, d)) = it.next()
                {
                    taken.push(views::DepShot::of(d));
                }
                // The rest of the last deployment's instances (they follow it in key order).
                while let Some((_, d)) = it.peek()
                    && d.index > 0
                    && taken.last().is_some_and(|t| t.fixed.id == d.rec.id)
                {
                    taken.push(views::DepShot::of(d));
                    it.next();
                }
                after = it.peek().is_some().then(|| {
                    let l = taken.last().map(|t| &t.fixed);
                    l.map(|f| state::unit_id(&f.id, f.index))
                        .unwrap_or_default()
                });
                (hosts, total, it.peek().is_none())
            };
            let mut chunk = views::group(std::mem::take(&mut taken));
            each(&mut chunk, &hosts, total);
            if last {
                return hosts;
            }
        }
    }

    /// Deployment `name_or_id` as the views need it (every instance, index 0 first), and the
    /// hosts.
    fn shot(&self, name_or_id: &str) -> Option<(Vec<views::DepShot>, Hosts)> {
        let inner = self.owner.state();
        let d = inner.by_name_or_id(name_or_id)?;
        let units = inner.units_of(d.dep_id()).map(views::DepShot::of).collect();
        Some((views::group(units).remove(0), Arc::clone(&inner.hosts)))
    }

    // ----- plumbing -----

    /// Reads the state (see [`owner::Owner::read`]).
    fn read<R>(&self, f: impl FnOnce(&State) -> R) -> R {
        self.owner.read(f)
    }

    /// [`Server::write`] of deployment `id`'s change: `f` gets the state and `id`.
    async fn on<R: Send + 'static>(
        &self,
        id: &str,
        f: impl FnOnce(&mut State, &str) -> R + Send + 'static,
    ) -> R {
        let id = id.to_string();
        self.owner.call(move |inner| f(inner, &id)).await
    }

    /// Changes the state: `f` runs on the owner's task, in its turn (see
    /// [`owner::Owner::call`]).
    async fn write<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut State) -> R + Send + 'static,
    ) -> R {
        self.owner.call(f).await
    }

    fn host_exits_of(&self) -> MutexGuard<'_, HashMap<String, tokio::task::AbortHandle>> {
        self.host_exits
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Plans bringing `target` up for `who` (see [`State::plan`]).
    async fn plan_now(
        &self,
        target: &str,
        protected: &BTreeSet<String>,
        who: PlanFor,
    ) -> Result<Plan, ApiError> {
        let switch_id = self.fresh_id("sw");
        let (id, protected) = (target.to_string(), protected.clone());
        let plan = self
            .write(move |inner| inner.plan(&id, &protected, who, switch_id, Instant::now()))
            .await;
        if let Ok(Plan::BringUp { switch_id } | Plan::Switch { switch_id, .. }) = &plan {
            self.record_plan(target, switch_id, who, &plan);
        }
        plan
    }

    /// Begins the record of a switch the router planned, shown while it runs: a request's
    /// window begins now (an operator's switch has none: its drain begins when the router
    /// says, [`Lifecycle::switch_draining`]). [`Server::record_order`] gives it the router's
    /// exact times.
    fn record_plan(
        &self,
        target: &str,
        switch_id: &str,
        who: PlanFor,
        plan: &Result<Plan, ApiError>,
    ) {
        let now = Instant::now();
        let victims: Vec<(String, String)> = match plan {
            Ok(Plan::Switch { victims, .. }) => self.read(|inner| {
                victims
                    .iter()
                    .map(|k| {
                        let unit = unit_of_key(k);
                        let name = inner
                            .deps
                            .get(&unit)
                            .map_or(k.deployment.as_str(), |d| d.name())
                            .to_string();
                        (unit, name)
                    })
                    .collect()
            }),
            _ => Vec::new(),
        };
        let cause = match (victims.is_empty(), who) {
            (true, _) => SwitchCause::BringUp,
            (false, PlanFor::Operator) => SwitchCause::Operator,
            (false, PlanFor::Requests) => SwitchCause::Wave,
        };
        let rec = self
            .switches
            .begin(self.target_of(target, switch_id, 0), cause, now);
        let open = (cause == SwitchCause::Wave)
            .then(|| rec.begin_live_phase(SwitchPhaseKind::AdmissionWindow, rec.engine(), now));
        self.planned_of()
            .insert(switch_id.to_string(), Planned { rec, open, victims });
    }

    fn planned_of(&self) -> MutexGuard<'_, HashMap<String, Planned>> {
        self.planned.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn router(&self) -> Option<CoordinatorHandle> {
        self.router
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn fresh_id(&self, what: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{what}-{}-{n}", ulid::Ulid::new())
    }

    /// Saves the records changed and not written yet (`State::dirty`), if any: those a
    /// change marked for a later save (a pending start taken, an adoption, a batch of
    /// deploys).
    async fn flush_due(&self) {
        if self.read(|inner| inner.dirty.any()) {
            self.log_failed(self.save().await);
        }
    }

    /// Saves deployment `id`'s record (or its removal, when it is gone) and every other one
    /// changed and not written yet: it is durable when this returns, unless the write failed,
    /// which is logged and must not undo what was decided (the next save writes it again).
    /// `id` may be an instance's unit: its deployment's record is the one stored (instance 0's;
    /// the others' copies are never written over it).
    async fn save_logged(&self, id: &str) {
        let id = dep_of_unit(id).to_string();
        self.read(|inner| inner.dirty.give_back(BTreeSet::from([id])));
        self.log_failed(self.save().await);
    }

    fn log_failed(&self, saved: Result<(), ApiError>) {
        if let Err(e) = saved {
            tracing::warn!(error = %e, "the state was not written; the next change writes it again");
        }
    }

    /// Writes every record in `State::dirty` (and removes the deleted ones) in one transaction,
    /// on Tokio's blocking pool under the persist lock (`writer.rs`: no worker waits for the
    /// disk): saves land in order, each with the records as they are when its commit takes
    /// them, and one that returns `Ok` has every change made before it committed. Saves that
    /// meet while one commits are written by the next (group commit). A failed write gives its
    /// records back to `dirty`, for the next save.
    async fn save(&self) -> Result<(), ApiError> {
        let (order, store, state) = (
            Arc::clone(&self.persist),
            Arc::clone(&self.store),
            self.owner.shared(),
        );
        let committed = tokio::task::spawn_blocking(move || {
            let _order = order.lock().unwrap_or_else(PoisonError::into_inner);
            writer::commit(store.as_ref(), &state)
        })
        .await
        .unwrap_or_else(|e| Err(format!("the commit did not run: {e}")));
        committed.map_err(|e| self.save_failed(&e))
    }

    fn save_failed(&self, e: &str) -> ApiError {
        tracing::error!(error = %e, "saving the state failed");
        internal(format!("saving the state: {e}"))
    }

    fn find(&self, name_or_id: &str) -> Result<String, ApiError> {
        self.read(|inner| inner.by_name_or_id(name_or_id).map(|d| d.rec.id.clone()))
            .ok_or_else(|| not_found(name_or_id))
    }

    fn spawn(&self, work: impl FnOnce(Arc<Server>) -> BoxFuture<'static, ()>) {
        if let Some(me) = self.me.upgrade() {
            tokio::spawn(work(me));
        }
    }

    async fn announce_ready(&self, key: InstanceKey, addr: SocketAddr) {
        if let Some(r) = self.router() {
            r.instance_ready(Upstream { key, addr }).await;
        }
    }

    async fn announce_gone(&self, key: InstanceKey) {
        if let Some(r) = self.router() {
            r.instance_gone(key).await;
        }
    }

    /// Runs the start or wake begun by [`State::begin_up`]; announces the instance when ready.
    /// Its phases go to the record of the switch it is part of; outside every switch (an
    /// operator's start, a pending start taken) it is a `bring_up` record of its own.
    async fn finish_up(&self, id: &str, up: Up) -> Result<(), ApiError> {
        let name = self
            .read(|inner| inner.deps.get(id).map(|d| d.name().to_string()))
            .unwrap_or_default();
        let span = tracing::info_span!("bring_up", deployment = %name, how = ?up);
        if switches::current().is_some() {
            return self.finish_up_inner(id, up).instrument(span).await;
        }
        let switch_id = self.fresh_id("up");
        let rec = self.switches.begin(
            self.target_of(id, &switch_id, 0),
            SwitchCause::BringUp,
            Instant::now(),
        );
        let result = rec
            .scope(self.finish_up_inner(id, up).instrument(span))
            .await;
        rec.finish(result.as_ref().map(|_| ()), Instant::now());
        result
    }

    async fn finish_up_inner(&self, id: &str, up: Up) -> Result<(), ApiError> {
        let Some((iid, spec)) = self.read(|inner| {
            inner
                .deps
                .get(id)
                .map(|d| (d.instance_id(), d.launch_spec()))
        }) else {
            return Err(not_found(id));
        };
        let agent = match self.agent_of(id) {
            Ok(a) => a,
            Err(e) => {
                let (id, why) = (id.to_string(), e.message());
                self.write(move |inner| {
                    if let Some(d) = inner.deps.get_mut(&id) {
                        d.busy = false;
                        d.fail(why);
                    }
                })
                .await;
                return Err(e);
            }
        };
        if up == Up::Start {
            // The generation is part of the record.
            self.save_logged(id).await;
        }
        let began = Instant::now();
        let (woken_from, host) = self.read(|inner| {
            inner
                .deps
                .get(id)
                .map(|d| (d.tier, d.host.clone().map(|h| (h, gpus_of(inner, d)))))
                .unzip()
        });
        let rec = switches::current();
        let engine = spec.engine.as_str();
        let mark = rec.as_ref().map(|r| {
            if let Some((host, gpus)) = host.flatten() {
                r.placed(&host, gpus);
            }
            let phase = match up {
                Up::Start => SwitchPhaseKind::Start,
                Up::Wake => SwitchPhaseKind::Wake,
            };
            r.begin_phase(phase, &iid, engine, began)
        });
        let woken_from = woken_from.flatten();
        // How long the wake's check took (the end of the wake), as the agent says.
        let mut checked = None;
        let bring_up = async {
            match up {
                Up::Start => match agent.start(&iid, &spec).await {
                    Ok(s) if engine_addr(&s.base_url).is_none() => {
                        // Requests could never reach it: a failed start, not a ready instance.
                        let _ = agent.stop(&iid).await;
                        Err(ApiError::EngineFailed {
                            deployment: id.to_string(),
                            detail: format!(
                                "the engine answers at {}, which is not an IP address and port",
                                s.base_url
                            ),
                        })
                    }
                    Ok(s) => Ok(Some(s)),
                    Err(e) => Err(ApiError::EngineFailed {
                        deployment: id.to_string(),
                        detail: e.to_string(),
                    }),
                },
                Up::Wake => match self.wake(&agent, &iid).await {
                    Ok(report) => {
                        checked = report.checked;
                        match report.into_result() {
                            Ok(()) => Ok(None),
                            Err(e) => Err(e.to_api_error(id).unwrap_or(ApiError::EngineFailed {
                                deployment: id.to_string(),
                                detail: e.to_string(),
                            })),
                        }
                    }
                    Err(e) => {
                        let _ = agent.stop(&iid).await;
                        Err(ApiError::EngineFailed {
                            deployment: id.to_string(),
                            detail: e.to_string(),
                        })
                    }
                },
            }
        };
        let (outcome, ended): (
            Result<Option<capyctl_node_agent::agent::StartedInstance>, ApiError>,
            _,
        ) = match self.unless_ended(id, agent.as_ref(), &iid, bring_up).await {
            Ok(outcome) => (outcome, None),
            Err(ended) => (Err(ended.refusal.clone()), Some(ended)),
        };
        let up_ended = Instant::now();
        if let (Some(rec), Some(mark)) = (&rec, &mark) {
            let check_began = checked
                .and_then(|c| up_ended.checked_sub(c))
                .map(|c| c.max(began));
            rec.end_phase(mark, check_began.unwrap_or(up_ended));
            if let Some(check_began) = check_began {
                rec.phase(
                    SwitchPhaseKind::WakeCheck,
                    &iid,
                    engine,
                    check_began,
                    up_ended,
                );
            }
        }
        if up == Up::Wake {
            let code = match &outcome {
                Ok(_) => "ok",
                Err(e) => e.code(),
            };
            self.config.metrics.wake(
                woken_from.map_or("unknown", views::tier_words),
                code,
                began.elapsed(),
            );
        }
        // A started engine's address (a woken one keeps the one it had).
        let started_addr = match &outcome {
            Ok(Some(s)) => Some(engine_addr(&s.base_url)),
            _ => None,
        };
        // A start's first answer is committed before the router hears of the instance: once
        // a request was served by it, the record has it (the commit runs off the runtime, so
        // anything after the announce may come after the request's answer).
        if let Ok(Some(started)) = &outcome {
            let (target, first) = (id.to_string(), started.first_answer.clone());
            self.write(move |inner| inner.answered_first(&target, first))
                .await;
            self.save_logged(id).await;
        }
        // The router hears of a ready instance before anyone can see it ready (status, `start
        // --wait`): a client that saw `ready` and asks at once finds the router routing to it.
        let announced = match &outcome {
            Ok(_) => {
                let at = self.read(|inner| {
                    let d = inner.deps.get(id)?;
                    Some((d.key(&inner.host_id), started_addr.unwrap_or(d.addr)?))
                });
                match at {
                    Some((key, addr)) => {
                        self.announce_ready(key.clone(), addr).await;
                        // The router opened it and released its waiters.
                        if let Some(rec) = &rec {
                            rec.phase(
                                SwitchPhaseKind::Release,
                                &iid,
                                engine,
                                up_ended,
                                Instant::now(),
                            );
                        }
                        Some(key)
                    }
                    None => None,
                }
            }
            Err(_) => None,
        };
        let done = match &outcome {
            Ok(started) => state::UpDone::Ready(started.as_ref().map(|s| state::Started {
                addr: started_addr.flatten(),
                pid: s.pid,
                max_running: s.max_running,
                measurement: s.measurement,
            })),
            Err(e) => state::UpDone::Failed {
                error: e.clone(),
                ended: ended
                    .as_ref()
                    .map(|ended| ended.stopped.as_ref().map_err(ToString::to_string).copied()),
            },
        };
        let target = id.to_string();
        let ready = self
            .write(move |inner| inner.up_done(&target, up, done, Instant::now()))
            .await;
        // A start's generation was saved as it began, its first answer before the announce; a
        // pending start taken is saved whatever came of it.
        if self.read(|inner| inner.dirty.has(id)) {
            self.save_logged(id).await;
        }
        match ready {
            Some(Ok((key, Some(addr)))) => {
                if announced.as_ref() != Some(&key) {
                    self.announce_ready(key, addr).await;
                }
                // Its deployment's other replicas follow, as room allows.
                self.scale_soon();
            }
            Some(Ok((_, None))) => {}
            Some(Err(key)) => {
                tracing::warn!(error = ?outcome.as_ref().err(), "bringing the instance up failed");
                self.announce_gone(key).await;
                self.memory_freed();
            }
            // Gone meanwhile (deleted): the router forgets what it was told.
            None => {
                if let Some(key) = announced {
                    self.announce_gone(key).await;
                }
            }
        }
        outcome.map(|_| ())
    }

    /// Runs `op`, the start or the wake of `id` (instance `iid` on `agent`) that
    /// [`State::begin_up`] began, unless it is ended meanwhile ([`Server::end_bring_up`]):
    /// then the agent is asked to stop the engine, which ends `op` (the agent answers it
    /// `cancelled`), and both are awaited: when this answers, the engine is gone. Ended before
    /// it began, `op` is never run (and the engine of a wake, parked, is stopped).
    async fn unless_ended<T>(
        &self,
        id: &str,
        agent: &dyn HostAgent,
        iid: &str,
        op: impl std::future::Future<Output = T>,
    ) -> Result<T, Ended> {
        let Some(mut end) = self.read(|inner| inner.deps.get(id).map(|d| d.end.subscribe())) else {
            return Ok(op.await);
        };
        let asked_before = end.borrow().clone();
        let refusal = match asked_before {
            // Ended before it began: it never runs (a parked engine is stopped below).
            Some(refusal) => refusal,
            None => {
                let asked = async {
                    end.wait_for(Option::is_some)
                        .await
                        .ok()
                        .and_then(|w| w.clone())
                };
                tokio::pin!(op);
                let refusal = tokio::select! {
                    out = &mut op => return Ok(out),
                    Some(refusal) = asked => refusal,
                };
                tracing::info!(instance = %iid, reason = %refusal.message(), "ending the start or wake in progress: stopping its engine");
                // The agent's stop ends the operation and waits for it, so both run together.
                // A call still on its way to a node agent when the stop arrives is not ended by
                // it: the stop is asked again until the operation has ended.
                let stops = async {
                    loop {
                        let _ = agent.stop(iid).await;
                        tokio::time::sleep(STOP_AGAIN).await;
                    }
                };
                tokio::select! {
                    _ = &mut op => {}
                    () = stops => {}
                }
                refusal
            }
        };
        // Once more, for an engine a start finished just before the stop could end it, or the
        // parked engine of a wake ended before it began.
        let stopped = match agent.stop(iid).await {
            Err(capyctl_node_agent::AgentError::UnknownInstance { .. }) => Ok(()),
            other => other,
        };
        if let Err(e) = &stopped {
            tracing::warn!(instance = %iid, error = %e, "stopping the engine of an ended start or wake failed");
        }
        Err(Ended { refusal, stopped })
    }

    /// Ends the start or wake of `id` in progress, if any: its requests and its caller get
    /// `refusal`, its engine is stopped. Waits until no operation is in progress on `id`
    /// (whatever it was); `false` when `id` is gone.
    async fn end_bring_up(&self, id: &str, refusal: &ApiError) -> bool {
        let mut rx = self.changes.subscribe();
        loop {
            let busy = self.read(|inner| {
                let d = inner.deps.get(id)?;
                if d.bringing_up() && d.end.borrow().is_none() {
                    d.end.send_replace(Some(refusal.clone()));
                }
                Some(d.busy)
            });
            match busy {
                None => return false,
                Some(false) => return true,
                Some(true) => {}
            }
            if rx.changed().await.is_err() {
                return false;
            }
        }
    }

    /// Makes room in host RAM for `id`'s parked copy: stops the copies the pure
    /// [`parked_room::parked_room`] names (least recently used first, never explicit, warm,
    /// busy, reserved or claimed ones), or `ParkedCapacity` when only copies never stopped
    /// for room stand in the way. Nothing is done when the copy would not go to host RAM, or
    /// does not fit even in empty host RAM (the agent then parks deep or stops it).
    async fn make_parked_room(&self, id: &str) -> Result<Vec<Victim>, ApiError> {
        let Ok(agent) = self.agent_of(id) else {
            return Ok(Vec::new());
        };
        let Ok(inv) = agent.inventory().await else {
            return Ok(Vec::new());
        };
        let unified = inv.unified_memory();
        let planned = Instant::now();
        let plan = self.read(|inner| {
            let d = inner.deps.get(id)?;
            let copy = parked_room::NewCopy {
                bytes: d.measurement.weights_bytes(),
                to_host_ram: parked_room::parks_in_host_ram(&d.spec, unified),
            };
            let copies: Vec<parked_room::ParkedCopy<'_>> = d
                .host
                .as_deref()
                .into_iter()
                .flat_map(|h| inner.on_host(h))
                .filter(|o| {
                    o.id() != id
                        && o.state == InstanceState::Parked
                        && o.tier == Some(ParkTier::HostRam)
                })
                .map(|o| parked_room::ParkedCopy {
                    id: o.id(),
                    bytes: o.measurement.weights_bytes().unwrap_or(0),
                    used_at: o.used_at(),
                    kept: inner.explicit(o) || o.warm() || o.busy || o.reserved.is_some(),
                    claimed: o.claim.is_some(),
                })
                .collect();
            Some(parked_room::parked_room(copy, &inv.host_memory, &copies))
        });
        let victims = match plan {
            None | Some(parked_room::ParkedRoom::NothingToStop) => return Ok(Vec::new()),
            Some(parked_room::ParkedRoom::Capacity) => {
                return Err(ApiError::ParkedCapacity {
                    deployment: id.to_string(),
                });
            }
            Some(parked_room::ParkedRoom::Stop(victims)) => victims,
        };
        // Each copy named is stopped only if the router's coordinator, deciding on its own
        // state, finds nobody waiting for it and no use of it since the room was planned (a
        // request that came meanwhile wakes it instead): as an idle timer's stop.
        let mut stopped = Vec::new();
        for v in victims {
            let rid = self.fresh_id("room");
            let r = rid.clone();
            let reserved = self
                .on(&v, move |inner, v| inner.reserve_parked_copy(v, &r))
                .await;
            let Some(name) = reserved else { continue };
            let idle = match self.router() {
                Some(r) => r.release_if_idle(v.clone(), Vec::new(), planned).await,
                None => IdleRelease::Released(Ok(Vec::new())),
            };
            let result = match idle {
                IdleRelease::Released(Ok(_)) => {
                    tracing::info!(instance = %unit_instance(&v), "stopping a parked copy to make room for a newer one");
                    let began = Instant::now();
                    Some(match self.release_drained(&v, true).await {
                        Ok(_) => Ok(self.stopped_for_room(&v, began).await),
                        Err(e) => Err(e),
                    })
                }
                IdleRelease::Released(Err(e)) => Some(Err(e)),
                IdleRelease::InUse => None,
            };
            self.write(move |inner| inner.release_reservation(&rid))
                .await;
            match result {
                Some(Ok(released)) => stopped.push(Victim {
                    instance_id: unit_instance(&v),
                    deployment_id: v,
                    name,
                    released,
                }),
                Some(Err(e)) => {
                    tracing::warn!(deployment = %v, error = %e, "stopping a parked copy for room failed");
                }
                None => {
                    tracing::info!(deployment = %v, "a parked copy in use is kept: no room made for a newer one");
                }
            }
        }
        Ok(stopped)
    }

    /// Parks (or stops, per `put` or where it does not park) an instance whose requests have
    /// drained: state `Closed`/`Ready`/`Parked`, reserved by the caller or idle. Says how it
    /// was released, and which parked copies were stopped to make room for its copy;
    /// `ParkedCapacity` leaves it ready (announced again).
    async fn put_away(&self, id: &str, put: Put, no_room: NoRoom) -> Result<PutAway, ApiError> {
        let room = if put == Put::Park {
            self.make_parked_room(id).await
        } else {
            Ok(Vec::new())
        };
        let (room, put) = match room {
            Ok(room) => (room, put),
            Err(ApiError::ParkedCapacity { .. }) if no_room == NoRoom::Stop => {
                (Vec::new(), Put::StopNoRoom)
            }
            Err(e) => {
                self.put_back(id).await;
                return Err(e);
            }
        };
        // Stopped for room only says so of a model that would have parked.
        let parks = self.read(|inner| {
            inner
                .deps
                .get(id)
                .is_some_and(|d| d.state == InstanceState::Parked || d.parks())
        });
        let began = Instant::now();
        let released = self.release_drained(id, put != Put::Park).await?;
        if put == Put::StopNoRoom && parks && released == Released::Stopped {
            return Ok(PutAway {
                released: self.stopped_for_room(id, began).await,
                room,
            });
        }
        Ok(PutAway { released, room })
    }

    /// Says of `id`, stopped where it would have parked, that it was stopped for want of room
    /// (its status, the metrics, the log), as its release reads.
    async fn stopped_for_room(&self, id: &str, began: Instant) -> Released {
        self.on(id, |inner, id| {
            if let Some(d) = inner.deps.get_mut(id) {
                d.last_error = Some(Released::StoppedNoRoomToPark.status_line());
            }
        })
        .await;
        self.config
            .metrics
            .park("none", "stopped_no_room_to_park", began.elapsed());
        tracing::info!(instance = %unit_instance(id), released = Released::StoppedNoRoomToPark.words(), "released: no room to keep it parked");
        Released::StoppedNoRoomToPark
    }

    /// Serves a drained instance again (a park refused before it began).
    async fn put_back(&self, id: &str) {
        let back = self
            .on(id, |inner, id| {
                let d = inner.deps.get_mut(id)?;
                d.busy = false;
                d.state = InstanceState::Ready;
                Some((d.key(&inner.host_id), d.addr?))
            })
            .await;
        if let Some((key, addr)) = back {
            self.announce_ready(key, addr).await;
        }
    }

    /// The engine half of [`Server::put_away`].
    async fn release_drained(&self, id: &str, stop: bool) -> Result<Released, ApiError> {
        let agent = self.agent_of(id)?;
        let begun = self
            .on(id, move |inner, id| {
                let d = inner.deps.get_mut(id)?;
                let parked = d.state == InstanceState::Parked;
                d.busy = true;
                d.state = if stop || parked {
                    InstanceState::Stopping
                } else {
                    InstanceState::Parking
                };
                let noted = (d.name().to_string(), d.spec.engine.as_str());
                Some((d.instance_id(), d.key(&inner.host_id), parked, noted))
            })
            .await;
        let Some((iid, key, parked, (name, engine))) = begun else {
            return Err(not_found(id));
        };
        let began = Instant::now();
        // The park or stop is a phase of the switch it is part of, and this a victim of it.
        let rec = switches::current();
        let phase = if stop || parked {
            SwitchPhaseKind::Stop
        } else {
            SwitchPhaseKind::Park
        };
        let mark = rec
            .as_ref()
            .map(|r| r.begin_phase(phase, &iid, engine, began));
        let result = if stop || parked {
            agent.stop(&iid).await.map(|()| Released::Stopped)
        } else {
            match agent.park(&iid).await {
                Ok(ParkResult::Parked { tier, gpu_held }) => {
                    self.config
                        .metrics
                        .park(views::tier_words(tier), "ok", began.elapsed());
                    self.on(id, move |inner, id| {
                        if let Some(d) = inner.deps.get_mut(id) {
                            d.tier = Some(tier);
                            d.parked_gpu = gpu_held.map(|g| g.bytes);
                        }
                    })
                    .await;
                    Ok(Released::Parked)
                }
                Ok(ParkResult::Stopped {
                    reason: NoParkReason::NoRoomToPark,
                }) => {
                    self.config
                        .metrics
                        .park("none", "stopped_no_room_to_park", began.elapsed());
                    Ok(Released::StoppedNoRoomToPark)
                }
                Ok(ParkResult::Stopped { .. }) => {
                    self.config.metrics.park("none", "stopped", began.elapsed());
                    Ok(Released::Stopped)
                }
                // A model its engine cannot wake correctly is stopped, never parked.
                Err(e @ capyctl_node_agent::AgentError::CapabilityMissing { .. }) => {
                    tracing::info!(instance = %iid, reason = %e, "stopped instead of parked");
                    self.config
                        .metrics
                        .park("none", "capability_missing", began.elapsed());
                    agent.stop(&iid).await.map(|()| Released::Stopped)
                }
                Err(e) => {
                    self.config
                        .metrics
                        .park("unknown", e.metric_label(), began.elapsed());
                    let _ = agent.stop(&iid).await;
                    Err(e)
                }
            }
        };
        let outcome = result.as_ref().copied().map_err(ToString::to_string);
        self.on(id, move |inner, id| {
            if let Some(d) = inner.deps.get_mut(id) {
                d.busy = false;
                d.last_used = Instant::now();
                match &outcome {
                    Ok(Released::Parked) => d.state = InstanceState::Parked,
                    Ok(r) => {
                        d.state = InstanceState::Stopped;
                        d.tier = None;
                        d.addr = None;
                        d.pid = None;
                        if *r == Released::StoppedNoRoomToPark {
                            d.last_error = Some(Released::StoppedNoRoomToPark.status_line());
                        }
                    }
                    Err(e) => d.fail(format!("park or stop failed: {e}")),
                }
            }
        })
        .await;
        tracing::info!(instance = %iid, released = ?result.as_ref().map(|r| r.words()), "released");
        if let (Some(rec), Some(mark)) = (rec, mark) {
            rec.end_phase(&mark, Instant::now());
            let (noted, error) = match &result {
                Ok(Released::Parked) => (VictimResult::Parked, None),
                Ok(_) => (VictimResult::Stopped, None),
                Err(e) => (
                    VictimResult::Failed,
                    Some(SwitchError {
                        code: "engine_failed".into(),
                        message: e.to_string(),
                    }),
                ),
            };
            rec.victim(victim_entry(&name, id, stop || parked, noted, error));
        }
        self.announce_gone(key).await;
        self.memory_freed();
        result.map_err(|e| ApiError::EngineFailed {
            deployment: id.to_string(),
            detail: e.to_string(),
        })
    }

    /// Drains ready instances `ids` (reserved by `rid`) through the router: running requests
    /// finish first. `shown` is the state they show meanwhile (`closed`, or `parking` for an
    /// operator park). On a drain timeout they serve again.
    async fn drain(
        &self,
        ids: &[String],
        shown: InstanceState,
    ) -> Result<HashMap<String, DrainReport>, ApiError> {
        self.drain_as(ids, Some(shown), Ask::Always)
            .await
            .map(Option::unwrap_or_default)
    }

    /// [`Server::drain`], asked as `ask` says: `Ok(None)` (and they serve on, as they were)
    /// when the router finds them in use. `shown: None`: a parked deployment, no instance to
    /// drain (the router is still asked, for `Ask::IfIdleSince`: nothing may wait for it).
    /// NB: with `Ask::IfIdleSince` they show `shown` only once the router has released them,
    /// so that a refusal shows nothing.
    async fn drain_as(
        &self,
        ids: &[String],
        shown: Option<InstanceState>,
        ask: Ask,
    ) -> Result<Option<HashMap<String, DrainReport>>, ApiError> {
        let show = |shown: InstanceState| {
            let ids = ids.to_vec();
            self.write(move |inner| {
                ids.iter()
                    .filter_map(|id| {
                        let d = inner.deps.get_mut(id)?;
                        d.state = shown;
                        Some(d.key(&inner.host_id))
                    })
                    .collect::<Vec<InstanceKey>>()
            })
        };
        let keys = match (shown, ask) {
            (None, _) => Vec::new(),
            (Some(shown), Ask::Always) => show(shown).await,
            (Some(_), Ask::IfIdleSince(_)) => self.read(|inner| {
                ids.iter()
                    .filter_map(|id| Some(inner.deps.get(id)?.key(&inner.host_id)))
                    .collect()
            }),
        };
        let Some(router) = self.router() else {
            return Ok(Some(
                ids.iter()
                    .map(|i| (i.clone(), DrainReport::default()))
                    .collect(),
            ));
        };
        // A release's drain is a phase of its record (a switch's drain is the router's, noted
        // from its order).
        let rec = switches::current();
        let mark = rec.as_ref().map(|r| {
            r.begin_phase(
                SwitchPhaseKind::Drain,
                r.instance(),
                r.engine(),
                Instant::now(),
            )
        });
        let answer = match ask {
            Ask::Always => Some(router.release(keys).await),
            Ask::IfIdleSince(since) => {
                let deployment = ids
                    .first()
                    .map(|u| state::dep_of_unit(u).to_string())
                    .unwrap_or_default();
                match router.release_if_idle(deployment, keys, since).await {
                    IdleRelease::InUse => None,
                    IdleRelease::Released(result) => Some(result),
                }
            }
        };
        if let (Some(rec), Some(mark)) = (&rec, &mark) {
            rec.end_phase(mark, Instant::now());
        }
        match answer {
            Some(Ok(reports)) => {
                if let (Some(shown), Ask::IfIdleSince(_)) = (shown, ask) {
                    show(shown).await;
                }
                Ok(Some(
                    reports
                        .into_iter()
                        .map(|(k, r)| (unit_of_key(&k), r))
                        .collect(),
                ))
            }
            answer => {
                if let Some(shown) = shown {
                    let ids = ids.to_vec();
                    self.write(move |inner| {
                        for id in &ids {
                            if let Some(d) = inner.deps.get_mut(id)
                                && d.state == shown
                            {
                                d.state = InstanceState::Ready;
                            }
                        }
                    })
                    .await;
                }
                answer.transpose().map(|_| None)
            }
        }
    }

    /// Memory was freed: operator starts waiting for memory try again, and the router's
    /// `Later` deployments plan again (it is told through `instance_gone`).
    fn memory_freed(&self) {
        self.spawn(|me| {
            Box::pin(async move {
                let pending: Vec<String> = me.read(|inner| {
                    inner
                        .deps
                        .values()
                        .filter(|d| d.rec.pending_start)
                        .map(|d| d.id().to_string())
                        .collect()
                });
                for id in pending {
                    let up = me
                        .on(&id, |inner, id| inner.start_pending(id, Instant::now()))
                        .await;
                    if let Some(up) = up {
                        let _ = me.finish_up(&id, up).await;
                    }
                }
            })
        });
    }

    // ----- the router's questions -----

    /// Carries out a switch's order (see [`Lifecycle::execute`]): releases the victims, then
    /// brings the target up. An operator's order answers once the bring-up has begun; the
    /// bring-up goes on in a task of its own, whose outcome [`Executed::bring_up`] carries (a
    /// failure also fails the requests waiting for the target). The switch's record (begun
    /// here, with the router's window and drain) ends once the bring-up has ended.
    async fn execute_order(&self, mut order: SwitchOrder) -> Result<Executed, ApiError> {
        // Held (the operator's hold-over): no switch is carried out.
        self.refuse_held_order(&order).await?;
        // The instance the plan chose (its reservation's target); the router names the
        // deployment.
        if let Some(unit) = self.read(|inner| {
            inner
                .reservations
                .get(&order.switch_id)
                .and_then(|r| r.target.clone())
        }) {
            order.target = unit;
        }
        let rec = self.record_order(&order);
        let released = rec.scope(self.execute_inner(&order)).await;
        let (released, up) = match released {
            Ok(r) => r,
            Err(e) => {
                rec.finish(Err(&e), Instant::now());
                return Err(e);
            }
        };
        let Some(up) = up else {
            // The target is up or on its way already.
            rec.finish(Ok(()), Instant::now());
            return Ok(Executed {
                released,
                bring_up: None,
            });
        };
        if !order.operator {
            let result = rec.scope(self.finish_up(&order.target, up)).await;
            rec.finish(result.as_ref().map(|_| ()), Instant::now());
            return result.map(|()| Executed {
                released,
                bring_up: None,
            });
        }
        let (tx, rx) = oneshot::channel();
        let target = order.target.clone();
        self.spawn(move |me| {
            Box::pin(async move {
                let result = rec.scope(me.finish_up(&target, up)).await;
                rec.finish(result.as_ref().map(|_| ()), Instant::now());
                if let Err(e) = &result
                    && let Some(r) = me.router()
                {
                    r.deployment_refused(target, e.clone()).await;
                }
                let _ = tx.send(result);
            })
        });
        Ok(Executed {
            released,
            bring_up: Some(rx),
        })
    }

    /// What a switch's record says of its target `id` (`switch_id`, `wave`).
    fn target_of(&self, id: &str, switch_id: &str, wave: usize) -> Target {
        self.read(|inner| {
            let d = inner.deps.get(id);
            Target {
                switch_id: switch_id.to_string(),
                deployment: d.map_or_else(|| id.to_string(), |d| d.name().to_string()),
                deployment_id: id.to_string(),
                instance: unit_instance(id),
                host_id: d.and_then(|d| d.host.clone()).unwrap_or_default(),
                gpus: d.map(|d| gpus_of(inner, d)).unwrap_or_default(),
                engine: d.map_or("unknown", |d| d.spec.engine.as_str()),
                wave: u64::try_from(wave).unwrap_or(u64::MAX),
            }
        })
    }

    /// Begins the record of a switch the router ordered (or failed: `switch_failed`): `wave`
    /// or `operator` when it releases victims, else `bring_up`; its admission window (none for
    /// an operator's) and its drain, as the router timed them, when it has victims.
    fn record_order(&self, order: &SwitchOrder) -> Recording {
        let reserved = self.read(|inner| {
            inner
                .reservations
                .get(&order.switch_id)
                .is_some_and(|r| !r.victims.is_empty())
        });
        let victims = reserved || !order.victims.is_empty();
        let cause = match (victims, order.operator) {
            (false, _) => SwitchCause::BringUp,
            (true, true) => SwitchCause::Operator,
            (true, false) => SwitchCause::Wave,
        };
        let wave = u64::try_from(order.wave).unwrap_or(u64::MAX);
        let planned = self.planned_of().remove(&order.switch_id);
        let rec = match planned {
            Some(p) => {
                p.rec.rebase(order.began, wave);
                p.rec
            }
            None => {
                let target = self.target_of(&order.target, &order.switch_id, order.wave);
                self.switches.begin(target, cause, order.began)
            }
        };
        if victims {
            let (instance, engine) = (rec.instance().to_string(), rec.engine());
            let closed = order.began + order.window;
            if !order.operator {
                rec.phase(
                    SwitchPhaseKind::AdmissionWindow,
                    &instance,
                    engine,
                    order.began,
                    closed,
                );
            }
            rec.phase(
                SwitchPhaseKind::Drain,
                &instance,
                engine,
                closed,
                closed + order.drain,
            );
        }
        rec
    }

    /// [`Server::take_down`] of `id` (reserved by `rid`) for `cause`, recorded as a switch of
    /// its own ([`Server::release_recorded`]).
    async fn take_down_recorded(
        &self,
        cause: SwitchCause,
        id: &str,
        rid: &str,
        down: Option<bool>,
        stop: bool,
    ) -> Result<Option<Released>, ApiError> {
        // The scaler's park is its own choice (one instance fewer): with no room to park, the
        // instance stops instead of serving on (and being drained again at the next delay).
        let no_room = if cause == SwitchCause::Scale {
            NoRoom::Stop
        } else {
            NoRoom::Refuse
        };
        let work = self.take_down(id, rid, down, stop, no_room);
        self.release_recorded(cause, id, rid, down, work).await
    }

    /// Runs `work`, the release of `id` (reserved by `rid`) that `cause` asked for, as a switch
    /// of its own: its record says the drain, the park or stop, and how it ended. Nothing to
    /// release (`down` is `None`): no record.
    async fn release_recorded<T>(
        &self,
        cause: SwitchCause,
        id: &str,
        rid: &str,
        down: Option<bool>,
        work: impl std::future::Future<Output = Result<T, ApiError>>,
    ) -> Result<T, ApiError> {
        if down.is_none() {
            return work.await;
        }
        let rec = self
            .switches
            .begin(self.target_of(id, rid, 0), cause, Instant::now());
        let result = rec.scope(work).await;
        rec.finish(result.as_ref().map(|_| ()), Instant::now());
        result
    }

    /// Releases the victims of `order`, then begins bringing the target up. The victims
    /// released, and how the target's bring-up began (`None`: it is up or on its way already).
    ///
    /// The victims are the switch's reservation's, in its order: the ready ones the router
    /// drained (`order.victims`, with their reports) park or stop; parked engines are stopped
    /// for what they still hold on the GPU; starts and wakes in progress (only an operator's
    /// plan names them) are ended and their engines stopped (a request that came for one
    /// meanwhile gets the retryable `unavailable`); one that became ready before it could be
    /// ended is drained here (through the router) and released like the others. A victim that
    /// could not be released fails an operator's order (`evict_failed`: the target is not
    /// brought up on memory its engine may still hold); a request's switch goes on.
    async fn execute_inner(
        &self,
        order: &SwitchOrder,
    ) -> Result<(Vec<Victim>, Option<Up>), ApiError> {
        let switch_id = order.switch_id.as_str();
        let (victims, stop_all) = self.read(|inner| {
            inner
                .reservations
                .get(switch_id)
                .map_or((Vec::new(), false), |r| (r.victims.clone(), r.stop))
        });
        let mut released = Vec::new();
        // Victims whose engine could not be released (ID, name, why).
        let mut not_released: Vec<(String, String, String)> = Vec::new();
        for v in &victims {
            let ours = |d: &Dep| d.reserved.as_deref() == Some(switch_id);
            let Some((name, iid, bringing_up)) = self.read(|inner| {
                let d = inner.deps.get(v).filter(|d| ours(d))?;
                Some((d.name().to_string(), d.instance_id(), d.bringing_up()))
            }) else {
                continue;
            };
            if bringing_up {
                let refusal = ApiError::DispatchClosed {
                    deployment: v.clone(),
                };
                self.end_bring_up(v, &refusal).await;
                let ended = self.read(|inner| {
                    inner.deps.get(v).map(|d| {
                        (
                            matches!(d.state, InstanceState::Stopped | InstanceState::Failed),
                            d.ended_stop_failed.clone(),
                        )
                    })
                });
                match ended {
                    None => continue,
                    Some((true, Some(why))) => {
                        tracing::warn!(victim = %v, error = %why, "its start or wake ended, but stopping its engine failed");
                        not_released.push((v.clone(), name, why));
                        continue;
                    }
                    Some((true, None)) => {
                        tracing::info!(victim = %v, "released: stopped (its start or wake ended)");
                        if let Some(rec) = switches::current() {
                            rec.victim(victim_entry(&name, v, true, VictimResult::Stopped, None));
                        }
                        released.push(Victim {
                            deployment_id: v.clone(),
                            name,
                            instance_id: iid,
                            released: Released::Stopped,
                        });
                        continue;
                    }
                    // It became ready before it could be ended: drained below.
                    Some((false, _)) => {}
                }
            }
            let drained = order.victims.iter().find(|(k, _)| unit_of_key(k) == *v);
            let state = self.read(|inner| {
                let d = inner.deps.get(v).filter(|d| ours(d))?;
                let generation = drained.is_none_or(|(k, _)| d.rec.generation == k.generation);
                Some((d.state, generation))
            });
            let put = match (state, drained) {
                (Some((InstanceState::Parked, _)), _) => Put::StopNoRoom,
                (Some((InstanceState::Ready | InstanceState::Closed, true)), Some((_, report))) => {
                    Put::victim(report.cut_before_output, stop_all)
                }
                (Some((InstanceState::Ready, _)), None) => {
                    // Not drained by the switch (it was starting when planned): drained now.
                    match self
                        .drain(std::slice::from_ref(v), InstanceState::Closed)
                        .await
                    {
                        Ok(reports) => Put::victim(
                            reports.get(v).is_some_and(|r| r.cut_before_output),
                            stop_all,
                        ),
                        Err(e) => {
                            tracing::warn!(victim = %v, error = %e, "draining a victim failed");
                            not_released.push((v.clone(), name, e.message()));
                            continue;
                        }
                    }
                }
                _ => continue,
            };
            match self.put_away(v, put, NoRoom::Stop).await {
                Ok(put) => {
                    tracing::info!(victim = %v, released = put.released.words(), room = ?put.room.iter().map(|v| &v.name).collect::<Vec<_>>(), "victim released");
                    released.push(Victim {
                        deployment_id: v.clone(),
                        name,
                        instance_id: iid,
                        released: put.released,
                    });
                    // Parked copies stopped to make room for this one's copy.
                    released.extend(put.room);
                }
                Err(e) => {
                    tracing::warn!(victim = %v, error = %e, "releasing a victim failed");
                    not_released.push((v.clone(), name, e.message()));
                }
            }
        }
        if let Some(rec) = switches::current() {
            for (id, name, why) in &not_released {
                rec.victim(victim_entry(
                    name,
                    id,
                    true,
                    VictimResult::Failed,
                    Some(SwitchError {
                        code: "engine_failed".into(),
                        message: why.clone(),
                    }),
                ));
            }
        }
        if order.operator {
            // A stop that failed fails the evict, as it fails `stop`: the victim shows
            // `failed` with the error, and the target is not started.
            let target = self
                .read(|inner| inner.deps.get(&order.target).map(|d| d.name().to_string()))
                .unwrap_or_else(|| order.target.clone());
            if let Some(e) = evict_failed(&target, &not_released) {
                let switch = switch_id.to_string();
                self.write(move |inner| inner.release_reservation(&switch))
                    .await;
                return Err(e);
            }
        }
        let (switch, target) = (order.switch_id.clone(), order.target.clone());
        let up = self
            .write(move |inner| inner.switch_target_up(&switch, &target, Instant::now()))
            .await?;
        Ok((released, up))
    }

    /// Waits until the engine of `key` reports no running and no waiting requests in a sample
    /// taken after the question (an aborted request can take the engine a moment to drop).
    /// `false` when its metrics cannot be read, when no fresh sample comes, or past
    /// [`IDLE_ENGINE_BOUND`]; the router bounds the wait by its drain bound anyway.
    async fn idle_engine(&self, key: &InstanceKey) -> bool {
        let asked = views::now_ms();
        let iid = instance_id_at(&key.deployment, key.index);
        let mut rx = self.closed.subscribe();
        let give_up = Instant::now() + IDLE_ENGINE_BOUND;
        let Some(agent) = self.read(|inner| inner.hosts.get(&key.host_id).map(|h| h.agent.clone()))
        else {
            return false;
        };
        loop {
            let Some(s) = agent.sample(&iid) else {
                return false;
            };
            match s.engine {
                None => return false,
                Some(e) if s.sampled_at_ms >= asked => {
                    let idle = e.running == Some(0) && e.waiting.unwrap_or(0) == 0;
                    if idle {
                        return true;
                    }
                    if e.running.is_none() {
                        return false;
                    }
                }
                Some(_) => {}
            }
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
                () = tokio::time::sleep_until(give_up) => return false,
                _ = rx.changed() => return false,
            }
        }
    }

    // ----- operator commands -----

    fn receipt(&self, action: &str, id: &str) -> Result<ActionReceipt, ApiError> {
        Ok(ActionReceipt {
            action: action.to_string(),
            deployment: self.view(id).ok_or_else(|| not_found(id))?,
            switch_id: None,
            victims: Vec::new(),
        })
    }

    /// Deploys `doc`: creates the deployment, or makes `doc` its next revision. It is measured
    /// and checked against the hosts first, so that a document that cannot work (no host could
    /// ever place it, where no other host can join) is refused and changes nothing: an existing
    /// deployment keeps its working revision.
    async fn do_deploy(&self, doc: DeploymentDoc) -> Result<DeployReceipt, ApiError> {
        let (id, outcome) = self.deploy_unsaved(doc).await?;
        if outcome != DeployOutcome::Unchanged {
            self.save_logged(&id).await;
        }
        Ok(DeployReceipt {
            outcome,
            deployment: self.view(&id).ok_or_else(|| not_found(&id))?,
        })
    }

    /// Deploys `docs` in order, each as [`ManagementApi::deploy`] does, and writes the records
    /// they change in one transaction at the end: a whole document (standalone) is one write.
    /// The whole document is checked first ([`Server::check_all`]): a refusal changes
    /// nothing, `Err` with the refused deployment's name.
    pub async fn deploy_all(&self, docs: Vec<DeploymentDoc>) -> Result<(), (String, ApiError)> {
        let checked = self.check_all(docs).await?;
        self.deploy_checked(checked).await;
        Ok(())
    }

    /// Measures each of `docs` and checks it against the hosts, as a deploy does before it
    /// changes anything, and changes nothing: the first refusal, with the refused deployment's
    /// name. What it answers is deployed by [`Server::deploy_checked`] without measuring again.
    pub async fn check_all(&self, docs: Vec<DeploymentDoc>) -> Result<Checked, (String, ApiError)> {
        let mut checked = Vec::with_capacity(docs.len());
        for (i, doc) in docs.into_iter().enumerate() {
            if i % 256 == 255 {
                // Unchanged ones await nothing: a caller's other branches (a signal) get
                // their turn.
                tokio::task::yield_now().await;
            }
            let name = doc.name.clone();
            checked.push(self.check(doc).await.map_err(|e| (name, e))?);
        }
        Ok(Checked(checked))
    }

    /// Deploys what [`Server::check_all`] checked, in order, and writes the records they change
    /// in one transaction.
    pub async fn deploy_checked(&self, checked: Checked) {
        for (i, one) in checked.0.into_iter().enumerate() {
            if i % 256 == 255 {
                tokio::task::yield_now().await;
            }
            self.apply_deploy(one).await;
        }
        self.flush_due().await;
    }

    /// [`Server::do_deploy`] but the write: a changed record is left in `State::dirty` for the
    /// next save.
    async fn deploy_unsaved(
        &self,
        doc: DeploymentDoc,
    ) -> Result<(String, DeployOutcome), ApiError> {
        let one = self.check(doc).await?;
        Ok(self.apply_deploy(one).await)
    }

    /// The part of a deploy that changes nothing: measured and checked against the hosts (a
    /// document no host can ever place, where no other host can join, is refused).
    async fn check(&self, doc: DeploymentDoc) -> Result<CheckedDoc, ApiError> {
        let existing = self.read(|inner| {
            inner
                .by_name(&doc.name)
                .map(|d| (d.rec.id.clone(), d.rec.doc == doc))
        });
        let id = match existing {
            Some((id, true)) => {
                return Ok(CheckedDoc {
                    doc,
                    id,
                    measured: None,
                    unchanged: true,
                });
            }
            Some((id, false)) => id,
            None => ulid::Ulid::new().to_string(),
        };
        let spec = InstanceSpec::from_doc(id.clone(), &doc);
        // No host known yet (a cluster before its first node agent): measured at the start.
        let measured = match self.agent_of(&id) {
            Ok(agent) => agent.measure(&spec).await.ok(),
            Err(_) => None,
        };
        if self.hosts_fixed.load(Ordering::Relaxed) {
            self.read(|inner| Self::some_host_fits(inner, &doc.name, &spec, measured.as_ref()))?;
        }
        Ok(CheckedDoc {
            doc,
            id,
            measured,
            unchanged: false,
        })
    }

    /// The part of a deploy that changes the state: creates the deployment or makes the
    /// checked document its next revision (the record is left in `State::dirty`).
    async fn apply_deploy(&self, one: CheckedDoc) -> (String, DeployOutcome) {
        let CheckedDoc {
            doc,
            id,
            measured,
            unchanged,
        } = one;
        if unchanged {
            return (id, DeployOutcome::Unchanged);
        }
        self.write(move |inner| {
            let known = inner.by_name.get(&doc.name).cloned();
            let (id, outcome) = if let Some(d) = known.and_then(|id| inner.deps.get_mut(&id)) {
                if d.rec.doc == doc {
                    return (d.rec.id.clone(), DeployOutcome::Unchanged);
                }
                d.rec.revision += 1;
                d.rec.doc = doc.clone();
                d.spec = InstanceSpec::from_doc(d.rec.id.clone(), &doc);
                d.renew_fixed();
                (d.rec.id.clone(), DeployOutcome::Updated)
            } else {
                let rec = DeploymentRecord {
                    id: id.clone(),
                    revision: 1,
                    doc: doc.clone(),
                    operator_stopped: false,
                    operator_started: false,
                    pending_start: false,
                    generation: 0,
                    first_answer: None,
                };
                inner.insert(Dep::new(rec));
                (id.clone(), DeployOutcome::Created)
            };
            inner.dirty.mark(&id);
            // A measurement still awaited does not replace one known (the same checkpoint).
            if let (Some(d), Some(m)) = (inner.deps.get_mut(&id), measured)
                && (!m.awaiting() || d.measurement.awaiting())
            {
                d.measurement = m;
            }
            (id, outcome)
        })
        .await
    }

    /// `does_not_fit` when the GPU memory `spec` needs (declared, or `measured`) is more than
    /// any host has: no host could ever place it. Unknown needs and no hosts pass.
    fn some_host_fits(
        inner: &State,
        name: &str,
        spec: &InstanceSpec,
        measured: Option<&Measurement>,
    ) -> Result<(), ApiError> {
        let (need, whence) = match (
            spec.resources.gpu_memory,
            measured.and_then(|m| m.gpu_memory),
        ) {
            (Some(declared), _) => (declared, "resources.gpu_memory"),
            (None, Some(m)) => (m.bytes, "its measured GPU memory"),
            (None, None) => return Ok(()),
        };
        let Some((host, largest)) = inner
            .hosts
            .iter()
            .map(|(id, h)| (id, h.capacity))
            .max_by_key(|(_, capacity)| *capacity)
        else {
            return Ok(());
        };
        if need <= largest {
            return Ok(());
        }
        Err(ApiError::DoesNotFit {
            deployment: name.to_string(),
            detail: format!(
                "{whence}: {} is more than the GPU memory of any host (the largest: {} on host {host}); no host can ever place it",
                placement::gib(need),
                placement::gib(largest)
            ),
        })
    }

    async fn do_start(&self, key: &str, req: StartRequest) -> Result<ActionReceipt, ApiError> {
        let id = self.find(key)?;
        self.read(|inner| inner.held_refusal())?;
        let (wait, evict) = (req.wait, req.evict);
        let next = self
            .on(&id, move |inner, id| {
                inner.start(id, wait, evict, Instant::now())
            })
            .await?;
        self.save_logged(&id).await;
        let mut receipt_victims = Vec::new();
        let mut switch_id = None;
        match next {
            StartNext::Nothing | StartNext::Pending => {}
            StartNext::Up(up) => {
                if req.wait {
                    self.finish_up(&id, up).await?;
                } else {
                    let target = id.clone();
                    self.spawn(move |me| {
                        Box::pin(async move {
                            if let Err(e) = me.finish_up(&target, up).await
                                && let Some(r) = me.router()
                            {
                                r.deployment_refused(target, e).await;
                            }
                        })
                    });
                }
            }
            StartNext::Evict => match self.operator_switch(&id).await? {
                OperatorStart::AlreadyComing => {}
                OperatorStart::Later => {
                    // Nothing can be released for it now: it waits for memory, as a start
                    // without --evict does.
                    let pending = self
                        .on(&id, |inner, id| {
                            let d = inner.deps.get_mut(id)?;
                            let idle = !d.busy && d.claim.is_none() && !d.occupies();
                            (idle && !d.rec.pending_start).then(|| d.rec.pending_start = true)
                        })
                        .await;
                    if pending.is_some() {
                        self.save_logged(&id).await;
                    }
                }
                OperatorStart::Switched {
                    switch_id: sw,
                    executed,
                } => {
                    if !executed.released.is_empty() {
                        switch_id = Some(sw);
                        receipt_victims = executed.released;
                    }
                    if req.wait
                        && let Some(bring_up) = executed.bring_up
                    {
                        bring_up
                            .await
                            .unwrap_or_else(|_| Err(internal("the start was given up")))?;
                    }
                }
            },
        }
        if evict {
            self.fill_replicas(&id, req.wait, &mut receipt_victims, &mut switch_id)
                .await?;
        }
        if req.wait {
            self.wait_ready(&id).await?;
        }
        let mut receipt = self.receipt("start", &id)?;
        receipt.switch_id = switch_id;
        receipt.victims = receipt_victims;
        Ok(receipt)
    }

    /// An operator's switch (`start --evict`): submitted to the router's coordinator, the one
    /// owner of switches, which runs it alone once the switches in progress have ended,
    /// protects the deployments with waiting requests, asks [`Server::plan_now`] for it,
    /// drains the ready victims and has
    /// [`Server::execute_order`] carry it out.
    ///
    /// NB: a server without a router (some tests) has no requests, waiting or in flight, and
    /// no other switch: the same plan is asked for and executed here directly, with nothing
    /// protected and nothing to drain.
    async fn operator_switch(&self, id: &str) -> OperatorResult {
        if let Some(router) = self.router() {
            return router.operator_start(id.to_string()).await;
        }
        let (switch_id, victims) = match self
            .plan_now(id, &BTreeSet::new(), PlanFor::Operator)
            .await?
        {
            Plan::AlreadyComing => return Ok(OperatorStart::AlreadyComing),
            Plan::Later => return Ok(OperatorStart::Later),
            Plan::BringUp { switch_id } => (switch_id, Vec::new()),
            Plan::Switch {
                switch_id, victims, ..
            } => (switch_id, victims),
        };
        let order = SwitchOrder {
            switch_id: switch_id.clone(),
            target: id.to_string(),
            victims: victims
                .into_iter()
                .map(|k| (k, DrainReport::default()))
                .collect(),
            window: Duration::ZERO,
            drain: Duration::ZERO,
            began: Instant::now(),
            wave: 0,
            operator: true,
        };
        let executed = self.execute_order(order).await?;
        Ok(OperatorStart::Switched {
            switch_id,
            executed,
        })
    }

    /// `start --evict` of a deployment with several instances: after the first, each other
    /// instance a start runs (`replicas`, or `scale.min`) gets room too, one operator's switch
    /// each (victims named as for the first; the receipt lists them all). A switch given back
    /// because another instance came up meanwhile is asked again (at most twice per instance);
    /// `Later` (nothing more can be released) ends it, and the rest come as room frees.
    async fn fill_replicas(
        &self,
        id: &str,
        wait: bool,
        victims: &mut Vec<Victim>,
        switch_id: &mut Option<String>,
    ) -> Result<(), ApiError> {
        let (wanted, _) = self.read(|inner| inner.filled(id));
        for _ in 0..wanted.saturating_mul(2) {
            let (wanted, up) = self.read(|inner| inner.filled(id));
            if wanted <= 1 || up >= wanted {
                break;
            }
            match self.operator_switch(id).await? {
                OperatorStart::AlreadyComing => {}
                OperatorStart::Later => break,
                OperatorStart::Switched {
                    switch_id: sw,
                    executed,
                } => {
                    if !executed.released.is_empty() {
                        switch_id.get_or_insert(sw);
                        victims.extend(executed.released);
                    }
                    if wait && let Some(bring_up) = executed.bring_up {
                        bring_up
                            .await
                            .unwrap_or_else(|_| Err(internal("the start was given up")))?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Waits until deployment `id` serves: one of its instances is ready (with several, the
    /// one the start brought up may not be the first: another may have been taken as a victim
    /// while a sibling serves); its failure once no instance is ready or on its way (failed,
    /// stopped, or parked again since).
    async fn wait_ready(&self, id: &str) -> Result<(), ApiError> {
        let mut rx = self.changes.subscribe();
        loop {
            let now = self.read(|inner| {
                inner.deps.get(id)?;
                let mut error: Option<String> = None;
                let mut settled = true;
                for d in inner.units_of(id) {
                    let busy = d.busy || d.rec.pending_start || d.claim.is_some();
                    match (d.state, busy) {
                        (InstanceState::Ready, _) => return Some(Ok(())),
                        (
                            InstanceState::Failed | InstanceState::Stopped | InstanceState::Parked,
                            false,
                        ) => {
                            if error.is_none() {
                                error.clone_from(&d.last_error);
                            }
                        }
                        _ => settled = false,
                    }
                }
                Some(Err(settled.then_some(error)))
            });
            match now {
                None => return Err(not_found(id)),
                Some(Ok(())) => return Ok(()),
                Some(Err(Some(err))) => {
                    return Err(ApiError::EngineFailed {
                        deployment: id.to_string(),
                        detail: err.unwrap_or_else(|| "it is not running".into()),
                    });
                }
                Some(Err(None)) => {}
            }
            if rx.changed().await.is_err() {
                return Err(internal("the server is shutting down"));
            }
        }
    }

    /// An operator's stop or delete begins: marks `id` operator-stopped (requests get
    /// `deployment_stopped`), fails its waiting requests with `refusal`, then
    /// [`Server::settle_down`].
    async fn begin_operator_stop(
        &self,
        id: &str,
        rid: &str,
        refusal: ApiError,
    ) -> Result<Option<bool>, ApiError> {
        self.on(id, |inner, id| {
            let d = inner.deps.get_mut(id).ok_or_else(|| not_found(id))?;
            d.rec.operator_stopped = true;
            d.rec.operator_started = false;
            d.rec.pending_start = false;
            // Its other instances take the stop at the end of the turn.
            inner.dirty.mark(id);
            Ok::<_, ApiError>(())
        })
        .await?;
        self.save_logged(id).await;
        if let Some(r) = self.router() {
            r.deployment_refused(id.to_string(), refusal.clone()).await;
        }
        self.settle_down(id, rid, refusal).await
    }

    /// Ends a start or a wake of `id` in progress (its engine is stopped at once, its caller
    /// and requests get `refusal`: see [`Server::end_bring_up`]), waits for another operation
    /// on it (a park, a switch it is part of) to end, then begins taking it down, reserved by
    /// `rid` (see [`State::begin_down`]).
    async fn settle_down(
        &self,
        id: &str,
        rid: &str,
        refusal: ApiError,
    ) -> Result<Option<bool>, ApiError> {
        let mut rx = self.changes.subscribe();
        loop {
            let settled = self.read(|inner| {
                inner.deps.get(id).map(|d| {
                    // A start or wake begun after the stop (a switch claimed it before) too.
                    if d.bringing_up() && d.end.borrow().is_none() {
                        d.end.send_replace(Some(refusal.clone()));
                    }
                    !d.busy && d.reserved.is_none() && d.claim.is_none()
                })
            });
            match settled {
                None => return Err(not_found(id)),
                Some(true) => {
                    let rid = rid.to_string();
                    match self
                        .on(id, move |inner, id| inner.begin_down(id, &rid))
                        .await
                    {
                        Err(ApiError::Conflict { .. }) => {}
                        other => return other,
                    }
                    rx.borrow_and_update();
                }
                Some(false) => {}
            }
            if rx.changed().await.is_err() {
                return Err(internal("the server is shutting down"));
            }
        }
    }

    /// A host drain (`drain`) or uncordon (see [`ManagementApi::drain_host`]): the drain
    /// cordons the host first (placement passes it by from then on), then stops every
    /// deployment bound to it, a few at a time, each as a stop does (a start or a wake in
    /// progress is ended, a ready one drained through the router, then stopped) but without
    /// the operator's stop: its requests are placed elsewhere, or refused while no host may
    /// take them. The host stays cordoned when a stop fails (the error names it).
    async fn do_drain_host(
        &self,
        host_id: &str,
        drain: bool,
    ) -> Result<HostDrainReceipt, ApiError> {
        self.read(|inner| inner.held_refusal())?;
        if !self.read(|inner| inner.hosts.contains_key(host_id)) {
            return Err(ApiError::NotFound {
                what: format!("host {host_id}"),
            });
        }
        let host = host_id.to_string();
        if !drain {
            self.write(move |inner| inner.cordoned.remove(&host)).await;
            tracing::info!(host = %host_id, "uncordoned: the host is in service again");
            // Starts that waited for memory may find it there.
            self.memory_freed();
            return Ok(HostDrainReceipt {
                action: "uncordon".into(),
                host_id: host_id.to_string(),
                cordoned: false,
                victims: Vec::new(),
            });
        }
        let bound = self
            .write(move |inner| {
                inner.cordoned.insert(host.clone());
                inner
                    .on_host(&host)
                    .filter(|d| d.bound_host() == Some(host.as_str()))
                    .map(|d| d.id().to_string())
                    .collect::<Vec<String>>()
            })
            .await;
        tracing::info!(host = %host_id, deployments = bound.len(), "draining the host: it takes nothing new, and what runs there stops");
        let outcomes: Vec<(String, Result<Option<Victim>, ApiError>)> =
            futures_util::stream::iter(bound)
                .map(|id| async move {
                    let outcome = self.drain_one(&id).await;
                    (id, outcome)
                })
                .buffer_unordered(DRAINS_AT_ONCE)
                .collect()
                .await;
        let mut victims = Vec::new();
        let mut failed = Vec::new();
        for (id, outcome) in outcomes {
            match outcome {
                Ok(Some(v)) => victims.push(v),
                Ok(None) | Err(ApiError::NotFound { .. }) => {}
                Err(e) => failed.push((id, e.message())),
            }
        }
        if let Some((id, why)) = failed.first() {
            return Err(ApiError::EngineFailed {
                deployment: id.clone(),
                detail: format!(
                    "the drain of host {host_id} could not stop it ({why}){}; the host stays cordoned, drain it again",
                    if failed.len() > 1 {
                        format!(" nor {} other deployment(s)", failed.len() - 1)
                    } else {
                        String::new()
                    }
                ),
            });
        }
        victims.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(HostDrainReceipt {
            action: "drain".into(),
            host_id: host_id.to_string(),
            cordoned: true,
            victims,
        })
    }

    /// Stops deployment `id` for a host drain (see [`Server::do_drain_host`]); how it was
    /// released, `None` when nothing ran.
    async fn drain_one(&self, id: &str) -> Result<Option<Victim>, ApiError> {
        let rid = self.fresh_id("drain");
        let refusal = ApiError::DispatchClosed {
            deployment: id.to_string(),
        };
        // `ran`: a start or wake in progress, which the drain ends.
        let (name, iid, ran) = self
            .read(|inner| {
                let d = inner.deps.get(id)?;
                Some((d.name().to_string(), d.instance_id(), d.bringing_up()))
            })
            .ok_or_else(|| not_found(id))?;
        let down = self.settle_down(id, &rid, refusal).await;
        let result = match down {
            Ok(down) => {
                self.take_down_recorded(SwitchCause::Drain, id, &rid, down, true)
                    .await
            }
            Err(e) => Err(e),
        };
        self.write(move |inner| inner.release_reservation(&rid))
            .await;
        let released = match result? {
            Some(r) => r,
            // A start or wake it ended stopped its engine, unless that stop failed.
            None if ran => {
                let stop_failed =
                    self.read(|inner| inner.deps.get(id).and_then(|d| d.ended_stop_failed.clone()));
                if let Some(why) = stop_failed {
                    return Err(ApiError::EngineFailed {
                        deployment: id.to_string(),
                        detail: format!(
                            "its start or wake ended, but stopping its engine failed: {why}"
                        ),
                    });
                }
                Released::Stopped
            }
            None => return Ok(None),
        };
        tracing::info!(deployment = %id, released = released.words(), "drained");
        Ok(Some(Victim {
            deployment_id: id.to_string(),
            name,
            instance_id: iid,
            released,
        }))
    }

    async fn do_stop(&self, key: &str) -> Result<ActionReceipt, ApiError> {
        let id = self.find(key)?;
        self.read(|inner| inner.command_refusal(&id))?;
        let rid = self.fresh_id("stop");
        let refusal = ApiError::DeploymentStopped {
            deployment: id.clone(),
        };
        let down = self.begin_operator_stop(&id, &rid, refusal.clone()).await?;
        // Every instance at once: a sibling left open while the first drains would take new
        // requests after the stop.
        let first = async {
            let result = self
                .take_down_recorded(SwitchCause::Release, &id, &rid, down, true)
                .await;
            let rid = rid.clone();
            self.write(move |inner| inner.release_reservation(&rid))
                .await;
            result
        };
        let (result, others) = tokio::join!(first, self.take_down_others(&id, refusal, true));
        result?;
        others?;
        self.receipt("stop", &id)
    }

    /// Takes down deployment `id`'s instances other than the first (ended when coming up,
    /// drained when ready, then stopped, or parked when `stop` is false), all at once, each
    /// recorded as a release; the first error, once every one has ended.
    async fn take_down_others(
        &self,
        id: &str,
        refusal: ApiError,
        stop: bool,
    ) -> Result<(), ApiError> {
        let units: Vec<String> = self.read(|inner| {
            inner
                .units_of(id)
                .filter(|u| u.index > 0)
                .map(|u| u.unit.clone())
                .collect()
        });
        let each = units.into_iter().map(|unit| {
            let refusal = refusal.clone();
            async move {
                let rid = self.fresh_id(if stop { "stop" } else { "park" });
                let down = self.settle_down(&unit, &rid, refusal).await?;
                let result = self
                    .take_down_recorded(SwitchCause::Release, &unit, &rid, down, stop)
                    .await;
                self.write(move |inner| inner.release_reservation(&rid))
                    .await;
                result.map(|_| ())
            }
        });
        futures_util::future::join_all(each)
            .await
            .into_iter()
            .collect::<Result<Vec<()>, ApiError>>()
            .map(|_| ())
    }

    /// Drains (when ready) and parks or stops `id`, as begun by [`State::begin_down`].
    async fn take_down(
        &self,
        id: &str,
        _rid: &str,
        down: Option<bool>,
        stop: bool,
        no_room: NoRoom,
    ) -> Result<Option<Released>, ApiError> {
        match down {
            None => Ok(None),
            Some(false) => self
                .put_away(id, Put::Stop, NoRoom::Refuse)
                .await
                .map(|p| Some(p.released)),
            Some(true) => {
                let shown = if stop {
                    InstanceState::Closed
                } else {
                    InstanceState::Parking
                };
                let reports = self.drain(&[id.to_string()], shown).await?;
                self.put_away_drained(id, stop, &reports, no_room)
                    .await
                    .map(Some)
            }
        }
    }

    /// Parks a drained ready `id` (or stops it: `stop`, or a request on it was cut before
    /// output, `reports`; or there is no room to park it and `no_room` says stop).
    async fn put_away_drained(
        &self,
        id: &str,
        stop: bool,
        reports: &HashMap<String, DrainReport>,
        no_room: NoRoom,
    ) -> Result<Released, ApiError> {
        let cut = reports.get(id).is_some_and(|r| r.cut_before_output);
        let put = if stop || cut { Put::Stop } else { Put::Park };
        self.put_away(id, put, no_room).await.map(|p| p.released)
    }

    /// The idle timers' [`Server::take_down`] (`down` from [`State::begin_down`]: a ready
    /// `id` is parked, a parked one stopped), once the router's coordinator has found it idle
    /// since `idle_since`, deciding on its own state, and released it. `Ok(false)`, nothing
    /// done, when it is in use (a request waits, runs, or came after `idle_since`).
    async fn take_down_if_idle(
        &self,
        id: &str,
        down: Option<bool>,
        idle_since: Instant,
    ) -> Result<bool, ApiError> {
        let Some(ready) = down else { return Ok(true) };
        let shown = ready.then_some(InstanceState::Parking);
        let ids = [id.to_string()];
        let asked = Instant::now();
        let Some(reports) = self
            .drain_as(&ids, shown, Ask::IfIdleSince(idle_since))
            .await?
        else {
            return Ok(false);
        };
        // A record only once the router has released it (nothing ran on it: its drain is
        // the router's answer): an idle timer that finds it in use records nothing.
        let rid = self.fresh_id("idle");
        let rec = self
            .switches
            .begin(self.target_of(id, &rid, 0), SwitchCause::Idle, asked);
        if ready {
            rec.phase(
                SwitchPhaseKind::Drain,
                rec.instance(),
                rec.engine(),
                asked,
                Instant::now(),
            );
        }
        let put = async {
            if ready {
                self.put_away_drained(id, false, &reports, NoRoom::Refuse)
                    .await
                    .map(|_| ())
            } else {
                self.put_away(id, Put::Stop, NoRoom::Refuse)
                    .await
                    .map(|_| ())
            }
        };
        let result = rec.scope(put).await;
        rec.finish(result.as_ref().map(|_| ()), Instant::now());
        result.map(|()| true)
    }

    async fn do_park(&self, key: &str) -> Result<ActionReceipt, ApiError> {
        let id = self.find(key)?;
        self.read(|inner| inner.command_refusal(&id))?;
        if self.read(|inner| inner.units_of(&id).nth(1).is_none()) {
            return self.park_unit(&id).await;
        }
        // Several instances: every ready one parks, and those on their way up once they are
        // ready; the deployment is marked parked by its operator (the scaler brings none back
        // until it is used again), in the same turn that reads which instances run, so that
        // none the scaler brings up meanwhile is missed. The operator's park also ends the
        // operator's start (as for one instance).
        let marked = self
            .on(&id, |inner, id| {
                let units: Vec<(String, InstanceState)> = inner
                    .units_of(id)
                    .map(|u| (u.unit.clone(), u.state))
                    .collect();
                if !units.iter().any(|(_, s)| *s == InstanceState::Ready) {
                    // None ready: as one instance, the one on its way if any (only a ready
                    // deployment parks), else the first (parked already: its receipt).
                    let coming = units.iter().find(|(_, s)| {
                        matches!(s, InstanceState::Starting | InstanceState::Waking)
                    });
                    return Err(coming.map_or_else(|| id.to_string(), |(u, _)| u.clone()));
                }
                if let Some(d) = inner.deps.get_mut(id) {
                    d.rec.operator_started = false;
                    inner.dirty.mark(id);
                    inner.operator_parked.insert(id.to_string());
                }
                Ok(units)
            })
            .await;
        let units = match marked {
            Ok(units) => units,
            Err(unit) => return self.park_unit(&unit).await,
        };
        let (ready, coming): (Vec<_>, Vec<_>) = units
            .into_iter()
            .filter(|(_, s)| {
                matches!(
                    s,
                    InstanceState::Ready | InstanceState::Starting | InstanceState::Waking
                )
            })
            .partition(|(_, s)| *s == InstanceState::Ready);
        let parks = ready.iter().map(|(u, _)| self.park_unit(u));
        for r in futures_util::future::join_all(parks).await {
            if let Err(e) = r {
                self.end_operator_park(&id).await;
                return Err(e);
            }
        }
        let asked: BTreeSet<String> = ready.into_iter().map(|(u, _)| u).collect();
        let coming: BTreeSet<String> = coming.into_iter().map(|(u, _)| u).collect();
        let dep = id.clone();
        self.spawn(move |me| {
            Box::pin(async move { me.follow_operator_park(&dep, asked, coming).await })
        });
        self.receipt("park", &id)
    }

    /// Follows an operator's park of deployment `dep` (several instances; see
    /// [`Server::do_park`]) until it has taken: parks each instance of `coming` once its start
    /// or wake has ended ready, and ends the operator's mark when a park does not take (an
    /// instance `asked` to park is ready again: its drain passed the bound, or its park was
    /// refused): the deployment is in use then, and the scaler must keep its instances. Ends
    /// at once when the mark is gone (a request or a start brought an instance up).
    async fn follow_operator_park(
        &self,
        dep: &str,
        mut asked: BTreeSet<String>,
        mut coming: BTreeSet<String>,
    ) {
        let mut rx = self.changes.subscribe();
        loop {
            rx.borrow_and_update();
            let now = self.read(|inner| {
                if !inner.operator_parked.contains(dep) {
                    return None;
                }
                let of = |unit: &String| {
                    inner
                        .deps
                        .get(unit)
                        .map(|d| (d.state, d.busy || d.reserved.is_some() || d.claim.is_some()))
                };
                let came: Vec<(String, bool)> = coming
                    .iter()
                    .filter_map(|u| {
                        let (state, held) = of(u).unwrap_or((InstanceState::Stopped, false));
                        (!held).then(|| (u.clone(), state == InstanceState::Ready))
                    })
                    .collect();
                let back = asked
                    .iter()
                    .any(|u| of(u).is_some_and(|(s, held)| s == InstanceState::Ready && !held));
                let settled = asked.iter().all(|u| of(u).is_none_or(|(_, held)| !held));
                Some((came, back, settled))
            });
            let Some((came, back, settled)) = now else {
                return;
            };
            if back {
                tracing::info!(deployment = %dep, "an instance did not park: in use again");
                self.end_operator_park(dep).await;
                return;
            }
            let mut asked_now = false;
            for (unit, ready) in came {
                coming.remove(&unit);
                if !ready {
                    continue;
                }
                if let Err(e) = self.park_unit(&unit).await {
                    tracing::warn!(instance = %unit_instance(&unit), error = %e, "park failed");
                    self.end_operator_park(dep).await;
                    return;
                }
                asked.insert(unit);
                asked_now = true;
            }
            // Done once every park has ended (and taken) and nothing else is on its way.
            if coming.is_empty() && settled && !asked_now {
                return;
            }
            if rx.changed().await.is_err() {
                return;
            }
        }
    }

    /// Ends deployment `dep`'s operator's park mark: the scaler keeps its instances again.
    async fn end_operator_park(&self, dep: &str) {
        let dep = dep.to_string();
        self.write(move |inner| inner.operator_parked.remove(&dep))
            .await;
    }

    /// [`Server::do_park`] of one instance (`id`: its unit).
    async fn park_unit(&self, id: &str) -> Result<ActionReceipt, ApiError> {
        let id = id.to_string();
        let spec = self
            .read(|inner| inner.deps.get(&id).map(|d| (d.spec.clone(), d.state)))
            .ok_or_else(|| not_found(&id))?;
        match spec.1 {
            InstanceState::Parked | InstanceState::Parking => return self.receipt("park", &id),
            InstanceState::Ready => {}
            _ => {
                let name = self.read(|inner| {
                    inner
                        .deps
                        .get(&id)
                        .map(|d| (d.name().to_string(), views::shown_state(d)))
                });
                let (name, state) = name.ok_or_else(|| not_found(&id))?;
                return Err(ApiError::Conflict {
                    detail: format!("deployment {name} is {state}; only a ready deployment parks"),
                });
            }
        }
        if let Err(e) = self.agent_of(&id)?.parkability(&spec.0).await
            && let Some(api) = e.to_api_error(&id)
        {
            return Err(api);
        }
        // Refused at once (and it serves on) when only explicit parked copies hold the room.
        self.make_parked_room(&id).await?;
        let rid = self.fresh_id("park");
        let r = rid.clone();
        let down = self.on(&id, move |inner, id| inner.park(id, &r)).await?;
        if down.is_none() {
            return self.receipt("park", &id);
        }
        self.save_logged(&id).await;
        let receipt = self.receipt("park", &id)?;
        let target = id.clone();
        self.spawn(move |me| {
            Box::pin(async move {
                let result = me
                    .take_down_recorded(SwitchCause::Release, &target, &rid, down, false)
                    .await;
                me.write(move |inner| inner.release_reservation(&rid)).await;
                if let Err(e) = result {
                    tracing::warn!(deployment = %target, error = %e, "park failed");
                }
            })
        });
        Ok(receipt)
    }

    async fn do_delete(&self, key: &str) -> Result<DeploymentView, ApiError> {
        let id = self.find(key)?;
        self.read(|inner| inner.command_refusal(&id))?;
        let rid = self.fresh_id("delete");
        let view = self.view(&id).ok_or_else(|| not_found(&id))?;
        let refusal = ApiError::ModelNotFound {
            model: view.name.clone(),
        };
        let down = self.begin_operator_stop(&id, &rid, refusal.clone()).await?;
        // Every instance at once (as a stop).
        let (result, others) = tokio::join!(
            self.take_down_recorded(SwitchCause::Release, &id, &rid, down, true),
            self.take_down_others(&id, refusal, true)
        );
        let result = match others {
            Ok(()) => result,
            Err(e) => result.and(Err(e)),
        };
        let removed = result.is_ok();
        self.on(&id, move |inner, id| {
            inner.release_reservation(&rid);
            if removed {
                inner.remove(id);
            }
        })
        .await;
        result?;
        self.config.metrics.forget_deployment(&id);
        self.save_logged(&id).await;
        Ok(view)
    }

    /// Measures the deployment and checks that it can park; when its checkpoint is still
    /// awaiting measurement and the GPU has room, starts it in the background without serving
    /// it (its first answer and footprint are recorded) and parks it (or stops it where it does
    /// not park). A request then wakes it.
    async fn do_preinitialize(&self, key: &str) -> Result<ActionReceipt, ApiError> {
        let id = self.find(key)?;
        self.read(|inner| inner.held_refusal())?;
        let spec = self
            .read(|inner| inner.deps.get(&id).map(|d| d.spec.clone()))
            .ok_or_else(|| not_found(&id))?;
        let agent = self.agent_of(&id)?;
        let measured = agent
            .measure(&spec)
            .await
            .map_err(|e| ApiError::EngineFailed {
                deployment: id.clone(),
                detail: e.to_string(),
            })?;
        if let Err(e) = agent.parkability(&spec).await
            && let Some(api) = e.to_api_error(&id)
        {
            return Err(api);
        }
        let begun = self
            .on(&id, move |inner, id| {
                inner.preinitialize(id, measured, Instant::now())
            })
            .await?;
        if begun {
            let target = id.clone();
            self.spawn(move |me| Box::pin(async move { me.preinitialize_run(&target).await }));
        }
        self.receipt("preinitialize", &id)
    }

    /// The background part of a preinitialize: start without announcing, then park or stop.
    async fn preinitialize_run(&self, id: &str) {
        let Some((iid, spec, key)) = self.read(|inner| {
            inner
                .deps
                .get(id)
                .map(|d| (d.instance_id(), d.launch_spec(), d.key(&inner.host_id)))
        }) else {
            return;
        };
        self.save_logged(id).await;
        let started = match self.agent_of(id) {
            Ok(agent) => match self
                .unless_ended(id, agent.as_ref(), &iid, agent.start(&iid, &spec))
                .await
            {
                Ok(started) => started.map_err(|e| e.to_string()),
                Err(ended) => {
                    let (stopped, why) = (ended.stopped.is_ok(), ended.refusal.message());
                    self.on(id, move |inner, id| {
                        if let Some(d) = inner.deps.get_mut(id) {
                            d.busy = false;
                            let why = format!("preinitialize: start ended: {why}");
                            if stopped {
                                d.state = InstanceState::Stopped;
                                d.last_error = Some(why);
                            } else {
                                d.fail(why);
                            }
                        }
                    })
                    .await;
                    self.announce_gone(key).await;
                    self.memory_freed();
                    return;
                }
            },
            Err(e) => Err(e.message()),
        };
        match started {
            Ok(started) => {
                self.on(id, move |inner, id| {
                    if let Some(d) = inner.deps.get_mut(id) {
                        d.addr = engine_addr(&started.base_url);
                        d.pid = Some(started.pid);
                        d.max_running = Some(started.max_running);
                        if !started.measurement.awaiting() {
                            d.measurement = started.measurement;
                        }
                        d.rec.first_answer = Some(started.first_answer.clone());
                        // Not `ready`: it never serves before it is parked.
                        d.state = InstanceState::Closed;
                    }
                })
                .await;
                self.save_logged(id).await;
                // Parked, or stopped when its copy finds no room.
                if let Err(e) = self.put_away(id, Put::Park, NoRoom::Stop).await {
                    tracing::warn!(deployment = %id, error = %e, "preinitialize: parking failed");
                }
            }
            Err(e) => {
                self.on(id, move |inner, id| {
                    if let Some(d) = inner.deps.get_mut(id) {
                        d.busy = false;
                        d.fail(format!("preinitialize: {e}"));
                    }
                })
                .await;
                self.announce_gone(key).await;
                self.memory_freed();
            }
        }
    }

    /// The load read (`GET /metrics/load`): every deployment, or the one `key` names. Built
    /// from snapshots: of the lifecycle (see [`Server::shots`]) and of the router (each
    /// deployment's published load, `CoordinatorHandle::load_shared`, read without a turn of
    /// its task); one deployment's read copies one deployment and looks up one router entry.
    fn do_load(&self, key: Option<&str>) -> Result<LoadReport, ApiError> {
        let router = self.router();
        let now = views::now_ms();
        let deployments = match key {
            Some(k) => {
                let (d, hosts) = self.shot(k).ok_or_else(|| not_found(k))?;
                let load = router.as_ref().and_then(|r| r.load_shared(d[0].id()));
                let cx = views::Ctx::new(&self.config, &hosts);
                vec![views::load_view(&d, load.as_deref(), &cx, now)]
            }
            None => {
                // The router's loads in ID order, joined with the lifecycle's deployments (also
                // in ID order) in one pass; each chunk's views are built as it is copied.
                let mut loads = router.as_ref().map(CoordinatorHandle::loads_in_order);
                let mut out = Vec::new();
                self.shot_chunks(|chunk, hosts, total| {
                    out.reserve_exact(total.saturating_sub(out.len()));
                    let cx = views::Ctx::new(&self.config, hosts);
                    out.extend(chunk.iter().map(|d| {
                        let load = loads.as_mut().and_then(|l| l.get(d[0].id()));
                        views::load_view(d, load.as_deref(), &cx, now)
                    }));
                });
                out
            }
        };
        Ok(LoadReport {
            observed_at_ms: now,
            stale_after_ms: capyctl_spec::api::STALE_AFTER_MS,
            deployments,
        })
    }

    /// What each of `hosts`' deployments hold (in the hosts' order), summed under the read lock from
    /// the by-host index a few hosts at a time.
    fn host_uses(&self, hosts: &Hosts) -> Vec<views::HostUse> {
        let all: Vec<(&String, &Arc<Host>)> = hosts.iter().collect();
        let mut used = Vec::with_capacity(all.len());
        for chunk in all.chunks(HOSTS_PER_HOLD) {
            let inner = self.owner.state();
            used.extend(
                chunk
                    .iter()
                    .map(|(id, h)| views::HostUse::of(h.capacity, inner.on_host(id))),
            );
        }
        used
    }
}

/// Each host (ID and entry) as owned values, for futures that outlive the borrow.
fn owned(hosts: &Hosts) -> Vec<(String, Arc<Host>)> {
    hosts
        .iter()
        .map(|(id, h)| (id.clone(), Arc::clone(h)))
        .collect()
}

/// The socket address of an engine's `base_url` (`http://<ip>:<port>`, `http://[<ipv6>]:<port>`);
/// `None` (logged) when it names no IP address and port.
pub(crate) fn engine_addr(base_url: &str) -> Option<SocketAddr> {
    let rest = base_url
        .strip_prefix("http://")
        .unwrap_or(base_url)
        .trim_end_matches('/');
    let addr = rest.parse::<SocketAddr>().ok();
    if addr.is_none() {
        tracing::warn!(
            base_url,
            "an engine's address is not an IP address and port; requests cannot reach it"
        );
    }
    addr
}

/// What the owner's task hands back: engine exits, and the timer's ticks.
impl owner::Ticks for Server {
    /// An engine exited by itself: the instance is failed and gone (see
    /// [`State::engine_exited`]); the router hears of it, and the starts waiting for memory
    /// try again.
    fn engine_exited(&self, state: &mut State, host: String, exit: EngineExit) {
        let Some(key) = state.engine_exited(&host, &exit) else {
            return;
        };
        tracing::warn!(instance = %exit.instance, status = ?exit.status, "engine exited unexpectedly");
        self.spawn(move |me| {
            Box::pin(async move {
                me.announce_gone(key).await;
                me.memory_freed();
            })
        });
    }

    /// Idle timers (once a router is attached), in a task of their own; a tick while the
    /// last one's run goes on does nothing.
    fn tick(&self) {
        if self.router().is_none() {
            return;
        }
        self.scale_soon();
        let Some(running) = Running::begin(&self.timers_running) else {
            return;
        };
        self.spawn(|me| {
            Box::pin(async move {
                let _running = running;
                me.idle_timers().await;
            })
        });
    }
}

/// A background run under way (the idle timers', the scaler's): its flag is set while this
/// lives and cleared when it is dropped, however the run ends. A run that panics (a rule, a
/// host agent) is dropped by its task like one that returns, so the next tick runs again.
struct Running(Arc<AtomicBool>);

impl Running {
    /// Sets `flag`; `None` when it was set already (a run is under way).
    fn begin(flag: &Arc<AtomicBool>) -> Option<Running> {
        (!flag.swap(true, Ordering::SeqCst)).then(|| Running(Arc::clone(flag)))
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

impl Server {
    /// Runs the scaler in a task of its own, unless a run is under way.
    fn scale_soon(&self) {
        if self.router().is_none() {
            return;
        }
        let Some(running) = Running::begin(&self.scaling) else {
            return;
        };
        self.spawn(|me| {
            Box::pin(async move {
                let _running = running;
                me.scale_run().await;
            })
        });
    }

    /// One run of the scaler (`scale.rs`) over the deployments with several instances: each
    /// decision (bring one more up into free room, take one down) is begun here and carried
    /// out in a task of its own, so that a start does not hold up the next run.
    async fn scale_run(&self) {
        // Instances past a lowered `replicas` that hold nothing any more (stopped below, or
        // failed) are dropped.
        let surplus = self.read(State::settled_surplus);
        if !surplus.is_empty() {
            self.write(move |inner| {
                for dep in &surplus {
                    inner.sync_units(dep);
                }
            })
            .await;
        }
        let now = Instant::now();
        let inputs = self.read(|inner| inner.scale_inputs(now));
        if inputs.is_empty() {
            self.below_since_of().clear();
            return;
        }
        let Some(router) = self.router() else { return };
        self.feed_engine_loads(&router);
        for input in inputs {
            let load = router.load_shared(&input.deployment);
            let (in_flight, waiting) = load.as_deref().map_or((0, 0), |l| (l.in_flight, l.waiting));
            let below_since = self.below_since_of().get(&input.deployment).copied();
            let answer = scale::decide(
                &scale::Input {
                    replicas: input.replicas,
                    scale: input.scale,
                    stopped: input.stopped,
                    units: &input.units,
                    in_flight,
                    waiting,
                    below_since,
                },
                now,
            );
            match answer.below_since {
                Some(t) => self.below_since_of().insert(input.deployment.clone(), t),
                None => self.below_since_of().remove(&input.deployment),
            };
            match answer.decision {
                scale::Decision::Nothing => {}
                scale::Decision::Up(units) => {
                    // The first that has room now (in one owner turn: no other change comes
                    // between the tries).
                    let up = self
                        .write(move |inner| {
                            let now = Instant::now();
                            units.into_iter().find_map(|unit| {
                                let up = inner.scale_up(&unit, now)?;
                                Some((unit, up))
                            })
                        })
                        .await;
                    let Some((unit, up)) = up else { continue };
                    tracing::info!(instance = %unit_instance(&unit), how = ?up, in_flight, waiting, "scale: one more instance");
                    self.spawn(move |me| {
                        Box::pin(async move {
                            let switch_id = me.fresh_id("scale");
                            let rec = me.switches.begin(
                                me.target_of(&unit, &switch_id, waiting),
                                SwitchCause::Scale,
                                Instant::now(),
                            );
                            let result = rec.scope(me.finish_up(&unit, up)).await;
                            rec.finish(result.as_ref().map(|_| ()), Instant::now());
                            if let Err(e) = result {
                                tracing::warn!(instance = %unit_instance(&unit), error = %e, "scale: the instance did not come up");
                            }
                        })
                    });
                }
                scale::Decision::Down { unit, stop } => {
                    let rid = self.fresh_id("scale");
                    let r = rid.clone();
                    let down = self
                        .on(&unit, move |inner, id| inner.begin_down(id, &r))
                        .await;
                    let Ok(down) = down else { continue };
                    tracing::info!(instance = %unit_instance(&unit), stop, in_flight, waiting, "scale: one fewer instance");
                    self.spawn(move |me| {
                        Box::pin(async move {
                            let result = me
                                .take_down_recorded(SwitchCause::Scale, &unit, &rid, down, stop)
                                .await;
                            me.write(move |inner| inner.release_reservation(&rid)).await;
                            if let Err(e) = result {
                                tracing::warn!(instance = %unit_instance(&unit), error = %e, "scale: the instance was not taken down");
                            }
                        })
                    });
                }
            }
        }
    }

    /// Tells the router each ready instance's engine waiting count, from its host's latest
    /// sample (with the sample's own time: the router counts a stale one as none), for the
    /// `least_loaded` choice among a deployment's instances.
    fn feed_engine_loads(&self, router: &CoordinatorHandle) {
        let feeds = self.read(State::engine_feeds);
        let (now, now_ms) = (Instant::now(), views::now_ms());
        for (key, agent, iid) in feeds {
            let Some(sample) = agent.sample(&iid) else {
                continue;
            };
            let Some(waiting) = sample.engine.and_then(|e| e.waiting) else {
                continue;
            };
            let age = Duration::from_millis(now_ms.saturating_sub(sample.sampled_at_ms));
            let at = now.checked_sub(age).unwrap_or(now);
            router.note_engine_load(key, usize::try_from(waiting).unwrap_or(usize::MAX), at);
        }
    }

    fn below_since_of(&self) -> MutexGuard<'_, HashMap<String, Instant>> {
        self.below_since
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Parks ready instances idle past `ready_idle_timeout` and stops parked ones idle past
    /// `parked_idle_timeout` (pressure decisions: a later request starts them again).
    async fn idle_timers(&self) {
        let LifecycleDefaults {
            ready_idle_timeout,
            parked_idle_timeout,
        } = self.config.lifecycle_defaults;
        // NB (a snapshot only narrows the candidates): the router's load says which deployments
        // are in use now, so that the timers do not ask about those; whether one is released
        // is decided by the router's coordinator on its own state (`release_if_idle`).
        let mut busy = BTreeSet::new();
        if let Some(r) = self.router() {
            for l in r.load().await {
                self.config.metrics.set_queue(
                    &l.deployment_id,
                    l.waiting as u64,
                    l.in_flight as u64,
                );
                if l.waiting > 0 || l.in_flight > 0 {
                    busy.insert(l.deployment_id);
                }
            }
        }
        if ready_idle_timeout.is_none() && parked_idle_timeout.is_none() {
            return;
        }
        let now = Instant::now();
        let timeouts = self.config.lifecycle_defaults;
        let due = self.read(|inner| inner.idle_due(&timeouts, &busy, now));
        for (id, ready) in due {
            // Checked before the drain, as an operator park is: when only explicit parked
            // copies hold host RAM the park is refused (`parked_capacity`) and the model keeps
            // serving, undisturbed; its timer starts over instead of closing it every tick.
            if ready && let Err(e) = self.make_parked_room(&id).await {
                tracing::info!(deployment = %id, error = %e, "idle timer: not parked");
                self.on(&id, |inner, id| {
                    if let Some(d) = inner.deps.get_mut(id) {
                        d.last_used = Instant::now();
                    }
                })
                .await;
                continue;
            }
            let rid = self.fresh_id("idle");
            // Decided again on the lifecycle's state it changes (the list above is a snapshot,
            // and a switch or a command may have moved the model since), and reserved; then
            // the router decides on its own state whether it is idle (`take_down_if_idle`).
            let r = rid.clone();
            let down = self
                .on(&id, move |inner, id| {
                    inner.begin_idle_down(id, ready, &timeouts, &r, Instant::now())
                })
                .await;
            let Some((down, idle_since)) = down else {
                continue;
            };
            // In its own task: engine exits and the next ticks are not held up by a drain.
            self.spawn(move |me| {
                Box::pin(async move {
                    let result = me.take_down_if_idle(&id, down, idle_since).await;
                    let failed = result.is_err();
                    me.on(&id, move |inner, id| {
                        inner.release_reservation(&rid);
                        if failed && let Some(d) = inner.deps.get_mut(id) {
                            d.last_used = Instant::now();
                        }
                    })
                    .await;
                    match result {
                        Ok(true) => tracing::info!(deployment = %id, ready, "idle timer"),
                        Ok(false) => {
                            tracing::debug!(deployment = %id, "idle timer: in use, not released");
                        }
                        Err(e) => {
                            tracing::warn!(deployment = %id, error = %e, "idle park or stop failed");
                        }
                    }
                })
            });
        }
    }
}

impl Lifecycle for Server {
    /// Through the name cache: the request path takes no lock of this server's (see
    /// [`NameCache`]).
    fn resolve(&self, model: &str) -> Option<DeploymentRef> {
        self.names.get(model, || {
            self.read(|inner| {
                named(inner, model).map(|d| Named {
                    deployment: DeploymentRef {
                        id: d.rec.id.clone(),
                        name: d.name().to_string(),
                        routing: d.rec.doc.routing(),
                    },
                    gone: Arc::clone(&d.presence.0),
                })
            })
        })
    }

    fn admissible(&self, deployment: &DeploymentId) -> Result<(), ApiError> {
        self.read(|inner| inner.admissible(deployment))
    }

    fn plan<'a>(
        &'a self,
        deployment: &'a DeploymentId,
        protected: &'a BTreeSet<DeploymentId>,
        who: PlanFor,
    ) -> BoxFuture<'a, Result<Plan, ApiError>> {
        Box::pin(self.plan_now(deployment, protected, who))
    }

    fn execute(&self, order: SwitchOrder) -> BoxFuture<'_, Result<Executed, ApiError>> {
        Box::pin(self.execute_order(order))
    }

    fn abandon(&self, switch_id: &str) {
        // A plan given back before it ran (not one that failed: its record has ended): its
        // victims serve on.
        if let Some(p) = self.planned_of().remove(switch_id) {
            for (id, name) in &p.victims {
                p.rec
                    .victim(victim_entry(name, id, false, VictimResult::Kept, None));
            }
            p.rec.abandon(Instant::now());
        }
        let switch_id = switch_id.to_string();
        self.owner
            .tell(move |inner| inner.release_reservation(&switch_id));
    }

    fn switch_draining(&self, switch_id: &str) {
        let now = Instant::now();
        if let Some(p) = self.planned_of().get_mut(switch_id) {
            if let Some(window) = p.open.take() {
                p.rec.end_phase(&window, now);
            }
            p.open = Some(
                p.rec
                    .begin_live_phase(SwitchPhaseKind::Drain, p.rec.engine(), now),
            );
        }
    }

    fn switch_failed(&self, failed: &SwitchOrder, error: &ApiError) {
        tracing::warn!(switch_id = %failed.switch_id, %error, "switch failed in the router");
        let rec = self.record_order(failed);
        // Its victims serve again.
        self.read(|inner| {
            for (k, _) in &failed.victims {
                let unit = unit_of_key(k);
                let name = inner
                    .deps
                    .get(&unit)
                    .map_or(k.deployment.as_str(), |d| d.name());
                rec.victim(victim_entry(name, &unit, false, VictimResult::Kept, None));
            }
        });
        rec.finish(Err(error), failed.began + failed.window + failed.drain);
    }

    fn engine_idle<'a>(&'a self, instance: &'a InstanceKey) -> BoxFuture<'a, bool> {
        Box::pin(self.idle_engine(instance))
    }
}

impl ManagementApi for Server {
    fn switches(
        &self,
        mut query: capyctl_spec::api::SwitchQuery,
    ) -> crate::api::BoxFuture<'_, Result<capyctl_spec::api::SwitchList, ApiError>> {
        // A deployment named by its name or ID matches its records by either (the records
        // of a deleted one by what was asked).
        if let Some(d) = &query.deployment
            && let Some(id) = self.read(|inner| inner.by_name_or_id(d).map(|d| d.rec.id.clone()))
        {
            query.deployment = Some(id);
        }
        Box::pin(std::future::ready(Ok(self.switches.list(&query))))
    }

    fn list(&self) -> crate::api::BoxFuture<'_, DeploymentList> {
        Box::pin(async move {
            let (shots, hosts) = self.shots();
            let cx = views::Ctx::new(&self.config, &hosts);
            let mut deployments: Vec<DeploymentView> = shots
                .iter()
                .map(|d| views::deployment_view(d, &cx))
                .collect();
            deployments.sort_by(|a, b| a.name.cmp(&b.name));
            DeploymentList { deployments }
        })
    }

    fn deploy(
        &self,
        doc: DeploymentDoc,
    ) -> crate::api::BoxFuture<'_, Result<DeployReceipt, ApiError>> {
        Box::pin(self.do_deploy(doc))
    }

    fn get<'a>(
        &'a self,
        name_or_id: &'a str,
    ) -> crate::api::BoxFuture<'a, Result<DeploymentView, ApiError>> {
        Box::pin(async move { self.view(name_or_id).ok_or_else(|| not_found(name_or_id)) })
    }

    fn delete<'a>(
        &'a self,
        name_or_id: &'a str,
    ) -> crate::api::BoxFuture<'a, Result<DeploymentView, ApiError>> {
        Box::pin(async move {
            let view = self.do_delete(name_or_id).await?;
            // Router entries go when their deployment goes: its load and counters.
            if let Some(r) = self.router() {
                r.forget(view.id.clone()).await;
            }
            Ok(view)
        })
    }

    fn start<'a>(
        &'a self,
        name_or_id: &'a str,
        request: StartRequest,
    ) -> crate::api::BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        Box::pin(self.do_start(name_or_id, request))
    }

    fn stop<'a>(
        &'a self,
        name_or_id: &'a str,
    ) -> crate::api::BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        Box::pin(self.do_stop(name_or_id))
    }

    fn park<'a>(
        &'a self,
        name_or_id: &'a str,
    ) -> crate::api::BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        Box::pin(self.do_park(name_or_id))
    }

    fn preinitialize<'a>(
        &'a self,
        name_or_id: &'a str,
    ) -> crate::api::BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        Box::pin(self.do_preinitialize(name_or_id))
    }

    fn engines(&self) -> crate::api::BoxFuture<'_, EngineList> {
        Box::pin(async move {
            let hosts = owned(&self.hosts_now());
            // Every host asked at once, a bounded number at a time; listed in host order.
            let per_host: Vec<Vec<EngineView>> = futures_util::stream::iter(hosts)
                .map(|(host_id, host)| async move {
                    host.agent
                        .engines()
                        .await
                        .into_iter()
                        .map(|e| EngineView {
                            command: host.settings.engine(e.engine).command.clone(),
                            engine: e.engine,
                            version: e.version,
                            deep_park: e.deep_park.to_string(),
                            host_id: host_id.clone(),
                        })
                        .collect()
                })
                .buffered(HOST_CALLS_AT_ONCE)
                .collect()
                .await;
            EngineList {
                engines: per_host.into_iter().flatten().collect(),
            }
        })
    }

    fn hosts(&self) -> crate::api::BoxFuture<'_, HostList> {
        Box::pin(async move {
            let hosts = self.hosts_now();
            // Every host asked at once, a bounded number at a time; listed in host order.
            let inventories: Vec<_> = futures_util::stream::iter(owned(&hosts))
                .map(|(id, host)| async move {
                    let inventory = host.agent.inventory().await.ok();
                    (id, host, inventory)
                })
                .buffered(HOST_CALLS_AT_ONCE)
                .collect()
                .await;
            let used = self.host_uses(&hosts);
            let cordoned = self.read(|inner| inner.cordoned.clone());
            HostList {
                hosts: inventories
                    .iter()
                    .zip(used)
                    .map(|((id, host, inv), used)| {
                        views::host_view(id, host, inv.as_ref(), used, cordoned.contains(id))
                    })
                    .collect(),
            }
        })
    }

    fn drain_host<'a>(
        &'a self,
        host_id: &'a str,
        drain: bool,
    ) -> crate::api::BoxFuture<'a, Result<HostDrainReceipt, ApiError>> {
        Box::pin(self.do_drain_host(host_id, drain))
    }

    fn load<'a>(
        &'a self,
        deployment: Option<&'a str>,
    ) -> crate::api::BoxFuture<'a, Result<LoadReport, ApiError>> {
        Box::pin(async move { self.do_load(deployment) })
    }

    fn ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    fn changes(&self) -> Option<watch::Receiver<u64>> {
        Some(self.changes.subscribe())
    }
}

/// The most names [`NameCache`] keeps as not found (names no deployment has, as clients sent
/// them): past it, those are forgotten.
const NOT_FOUND_KEPT: usize = 4096;

/// The model names the lifecycle knows, for the router's [`Lifecycle::resolve`] (each request
/// asks).
///
/// NB (the request path takes no lock of the lifecycle's): a name is resolved through this
/// cache (a read lock of its own); an entry stays good until its deployment is dropped (its
/// [`PresenceOf`] says so), and a name not found is looked up again only after the lifecycle's
/// state changed (`changes`). A request's use of its deployment is the router's to record
/// (`DeploymentLoad::last_used`), not the lifecycle's.
struct NameCache {
    names: RwLock<Names>,
}

struct Names {
    /// The lifecycle's change counter, as of the last time the names not found were forgotten.
    seen: watch::Receiver<u64>,
    /// By name: its deployment, or `None`: not found (as of `seen`).
    by_name: HashMap<String, Option<Named>>,
}

/// A name's deployment, and whether that deployment is gone.
#[derive(Clone)]
struct Named {
    deployment: DeploymentRef,
    /// Set when its deployment is dropped (deleted): an entry holding this is stale.
    gone: Arc<AtomicBool>,
}

impl Named {
    fn gone(&self) -> bool {
        self.gone.load(Ordering::Acquire)
    }
}

/// The deployment named `name` (by name only).
fn named<'a>(inner: &'a State, name: &str) -> Option<&'a Dep> {
    inner.by_name(name)
}

impl std::fmt::Debug for NameCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NameCache").finish_non_exhaustive()
    }
}

impl NameCache {
    fn new(seen: watch::Receiver<u64>) -> Self {
        NameCache {
            names: RwLock::new(Names {
                seen,
                by_name: HashMap::new(),
            }),
        }
    }

    /// The deployment `model` names; `look_up` reads it from the lifecycle's state (under its
    /// lock) when the cache cannot answer.
    fn get(&self, model: &str, look_up: impl FnOnce() -> Option<Named>) -> Option<DeploymentRef> {
        {
            let names = self.names.read().unwrap_or_else(PoisonError::into_inner);
            match names.by_name.get(model) {
                Some(Some(n)) if !n.gone() => return Some(n.deployment.clone()),
                Some(None) if !names.seen.has_changed().unwrap_or(true) => return None,
                _ => {}
            }
        }
        let mut names = self.names.write().unwrap_or_else(PoisonError::into_inner);
        if names.seen.has_changed().unwrap_or(true) {
            // Marked first: a change during the look-up below makes the next one look again.
            names.seen.borrow_and_update();
            names
                .by_name
                .retain(|_, n| n.as_ref().is_some_and(|n| !n.gone()));
        }
        let found = look_up();
        if found.is_none() && names.by_name.len() >= NOT_FOUND_KEPT {
            names.by_name.retain(|_, n| n.is_some());
        }
        names.by_name.insert(model.to_string(), found.clone());
        found.map(|n| n.deployment)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Arc;

    use super::engine_addr;
    use crate::api::ManagementApi;

    #[tokio::test]
    async fn after_a_restart_every_instance_knows_its_deployments_measurement() {
        let store = Arc::new(crate::store::MemoryStore::default());
        let open = || async {
            super::Server::open(
                Arc::new(capyctl_test_support::FakeHost::new().with_gpus(2)),
                store.clone(),
                super::LifecycleConfig::new("h"),
            )
            .await
            .unwrap()
        };
        let doc = capyctl_spec::documents::parse_deployment_str(
            "t.yaml",
            "name: r\nengine: vllm\nmodel: m\nresources: {gpu_memory: 6GiB}\nreplicas: 2\n",
        )
        .unwrap();
        let id = open().await.deploy(doc).await.unwrap().deployment.id;
        let server = open().await;
        let known: Vec<Option<u64>> = server.read(|inner| {
            inner
                .units_of(&id)
                .map(|d| d.measurement.gpu_memory.map(|m| m.bytes))
                .collect()
        });
        assert_eq!(known, [Some(6 << 30), Some(6 << 30)]);
    }

    #[test]
    fn an_engines_address_comes_from_its_base_url_loopback_or_pod_ip() {
        assert_eq!(
            engine_addr("http://127.0.0.1:41234"),
            Some(([127, 0, 0, 1], 41234).into())
        );
        assert_eq!(
            engine_addr("http://10.244.3.17:8000/"),
            Some(([10, 244, 3, 17], 8000).into())
        );
        assert_eq!(
            engine_addr("http://[fd00::17]:8000").map(|a| a.to_string()),
            Some("[fd00::17]:8000".to_string())
        );
        assert_eq!(engine_addr("http://engine.local:8000"), None);
    }
}
