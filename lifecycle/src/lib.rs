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
//! [`Core`]'s state (every deployment and its instances, one per replica, each on one host)
//! has one writer, the owner task (`owner.rs`), which runs the rules of `state.rs` (and
//! `state/`) one call at a time; reads take a read lock, no turn of the task. An engine operation (start, park,
//! wake, stop) is a call that marks the instance busy (`starting`, `parking`, ...), the host
//! agent's call on the caller's task, and a call that writes the outcome; a busy or reserved
//! instance is never touched by anything else. A plan the router asks for reserves its victims
//! (and claims the target) in one call, so two plans or an operator command never name the
//! same victim.
//!
//! The server implements the router's [`Lifecycle`] and [`ManagementApi`]; it tells the router
//! about instances through the [`Router`] given to [`Core::attach_router`] (the assembly,
//! `capyctl_server::assembly`, builds the router's coordinator), and releases ready instances it
//! parks or stops itself with [`Router::release`], so that running requests always finish first
//! (its idle timers with [`Router::release_if_idle`]: the router decides, on its own state, that
//! nothing waits, runs or came since). A request's last use is the router's record
//! ([`Router::last_uses`]), which `State::used_at` reads.
//!
//! This file holds the module list, the re-exports and the [`Core`] struct; `Core`'s methods
//! live in the files named for what they do (the file map is in `lifecycle/DESIGN.md`, "Files").
//!
//! [`Lifecycle`]: capyctl_interfaces::router::Lifecycle
//! [`ManagementApi`]: api::ManagementApi

pub mod adapters;
pub mod api;
mod bring_up;
mod config;
mod deploy;
mod errors;
mod gpus;
mod holdover;
mod hosts;
mod ids;
mod lists;
mod management;
pub mod metrics;
mod names;
mod owner;
mod park;
mod parked_room;
mod placement;
mod plumbing;
mod preinitialize;
mod reads;
pub mod recent;
mod release;
mod router_api;
mod router_link;
mod scale;
mod start;
mod state;
mod stop;
pub mod store;
mod switch_orders;
pub mod switches;
mod timers;
mod views;
mod writer;

pub use config::{HostEntry, LifecycleConfig};
pub use deploy::Checked;
pub use errors::CoreError;
pub use ids::{instance_id, instance_id_at, split_instance_id};

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, Weak};

use capyctl_interfaces::agent::EngineExit;
use capyctl_interfaces::router::Router;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::names::NameCache;
use crate::store::Store;
use crate::switch_orders::Planned;
use crate::switches::SwitchLog;

/// The lifecycle's core: every deployment and instance, their placement on the hosts, and
/// the one owner task that changes them (named apart from the `capyctl-server` crate, which
/// assembles it with the router and the listeners). Shared as `Arc<Core>`.
pub struct Core {
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
    /// A scaler's run is under way (`Core::scale_run`); cleared as `timers_running` is.
    scaling: Arc<AtomicBool>,
    /// Per deployment, since when its load has allowed one fewer instance (the scaler's).
    below_since: Mutex<HashMap<String, Instant>>,
    /// The task forwarding each host's engine exits (replaced with its agent).
    host_exits: Mutex<HashMap<String, tokio::task::AbortHandle>>,
    /// Serialises the commits (`writer.rs`); taken on the blocking pool, or by `close`.
    persist: Arc<Mutex<()>>,
    /// The router, once attached; taken by `close`.
    router: Mutex<Option<Arc<dyn Router>>>,
    /// The router's record of requests (set when it is attached): what the rules that read
    /// it are given (`state::Requests`).
    uses: state::RouterUses,
    /// Bumped after every turn of the owner (waiters of `--wait` and tests watch it).
    changes: Arc<watch::Sender<u64>>,
    /// Model names → deployments, for the router's `resolve` without this server's lock.
    names: NameCache,
    /// Set by `close`: background tasks end.
    closed: watch::Sender<bool>,
    /// `/readyz`.
    ready: AtomicBool,
    /// No host joins after the open (standalone, [`Core::open`]): a deployment no host can
    /// place is refused at deploy. Hosts may join otherwise ([`Core::upsert_host`]: a
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
    me: Weak<Core>,
    /// The adapters loaded on each instance of a base, and their loads (DESIGN 4.9).
    adapters: Arc<adapters::Adapters>,
    /// The full load read's answer buffer, kept for the next read (`reads::AnswerBuffer`).
    load_buffer: Arc<reads::AnswerBuffer>,
}

impl std::fmt::Debug for Core {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Core")
            .field("host_id", &self.config.host_id)
            .finish_non_exhaustive()
    }
}
