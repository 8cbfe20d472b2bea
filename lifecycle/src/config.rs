//! The lifecycle's settings ([`LifecycleConfig`]) and a host as given to it ([`HostEntry`]).

use std::sync::Arc;
use std::time::Duration;

use capyctl_interfaces::HostAgent;
use capyctl_interfaces::spec::HostSettings;
use capyctl_spec::Activation;
use capyctl_spec::settings::LifecycleDefaults;

use crate::metrics::Metrics;

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
    /// `<data dir>/switches.jsonl`, [`switches::FILE`](crate::switches::FILE)); `None`: in memory only.
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

/// A host as given to [`Core::open_hosts`](crate::Core::open_hosts) and [`Core::upsert_host`](crate::Core::upsert_host).
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
