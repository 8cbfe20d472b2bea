//! The one assembly of lifecycle, router and inference listener, which standalone
//! ([`crate::standalone`]), the operator (`capyctl-operator`'s `lead`), `capyctl simulate`, the
//! tests' harness and the benches all build the same way:
//!
//! 1. the settings, from the documents: the router's ([`router_config`]: the host's queue and
//!    the server's drain), the inference listener's ([`proxy_config`]) and the lifecycle's
//!    ([`lifecycle_config`]);
//! 2. the lifecycle, opened by the caller over its hosts and store (standalone's fixed hosts,
//!    the operator's node agents, the simulator's simulated host);
//! 3. [`assemble`]: the router's coordinator over the lifecycle (the server itself, or a
//!    wrapper of it such as the operator's observer), attached to the server (it announces
//!    the instances it adopted and starts its timers), and, when given an [`Inference`]
//!    listener ([`bind`]), the listener's [`Proxy`] over the coordinator, its catalog the
//!    server's models, served until its stop.
//!
//! The lifecycle never builds the router: it knows it only through what
//! [`Core::attach_router`] is given.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use capyctl_interfaces::router::Lifecycle;
use capyctl_interfaces::spec::HostSettings;
use capyctl_lifecycle::metrics::Metrics;
use capyctl_lifecycle::{Core, LifecycleConfig};
use capyctl_router::config::RouterConfig;
use capyctl_router::coordinator::{Coordinator, CoordinatorHandle};
use capyctl_router::observe::RequestObserver;
use capyctl_router::proxy::{self, Proxy, ProxyConfig};
use capyctl_router::tenants::Tenants;
use capyctl_spec::Activation;
use capyctl_spec::settings::{QueueSettings, ServerConfig};
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

/// A listener that could not be bound (or whose address could not be read).
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {addr} ({what}): {source}")]
pub struct BindError {
    /// `server.listen.inference` or `server.listen.management`.
    pub what: &'static str,
    /// The address.
    pub addr: SocketAddr,
    /// The OS error.
    #[source]
    pub source: std::io::Error,
}

/// Binds the listener `what` (the document's key, for the error) on `addr`; with the address
/// it listens on (the port chosen for port 0).
pub async fn bind(
    what: &'static str,
    addr: SocketAddr,
) -> Result<(TcpListener, SocketAddr), BindError> {
    let failed = |source| BindError { what, addr, source };
    let listener = TcpListener::bind(addr).await.map_err(failed)?;
    let local = listener.local_addr().map_err(failed)?;
    Ok((listener, local))
}

/// The router's settings from the server document and the host's queue settings (on
/// Kubernetes, the tightest of every host's: the operator's `merged_queue`).
pub fn router_config(server: &ServerConfig, queue: &QueueSettings) -> RouterConfig {
    RouterConfig {
        admission_window: queue.admission_window,
        drain_timeout: server.switching.drain_timeout,
        request_deadline: queue.request_deadline,
        stream_idle_timeout: queue.stream_idle_timeout,
        max_pending_per_deployment: queue.max_pending_per_deployment as usize,
        max_pending_total: queue.max_pending_total as usize,
        execute_timeout: execute_timeout(server),
        ..RouterConfig::default()
    }
}

/// The router's bound on a switch's execution, which only catches a lifecycle that never
/// answers: a cold start's ready timeout plus a wake window and a drain, for the parks before
/// it, and a minute to spare (the request deadline bounds what a request waits anyway).
pub fn execute_timeout(server: &ServerConfig) -> Duration {
    capyctl_node_agent::agent::DEFAULT_READY_TIMEOUT
        + server.switching.wake_timeout
        + server.switching.drain_timeout
        + Duration::from_secs(60)
}

/// The inference listener's settings from the host's queue settings. (TLS is read apart:
/// `capyctl_router::tls::listen_config`, and given with the [`Inference`] listener.)
pub fn proxy_config(queue: &QueueSettings) -> ProxyConfig {
    ProxyConfig {
        request_deadline: queue.request_deadline,
        stream_idle_timeout: queue.stream_idle_timeout,
        max_buffered_bytes_total: queue.max_buffered_bytes_total,
        ..ProxyConfig::default()
    }
}

/// The first host of an assembly as the lifecycle's settings name it: standalone's own host,
/// the operator's first node agent.
#[derive(Debug, Clone)]
pub struct FirstHost {
    /// Its `host.id`.
    pub id: String,
    /// Its `lifecycle.activation`.
    pub activation: Activation,
    /// Its engine commands.
    pub settings: HostSettings,
}

/// The lifecycle's settings from the server document, the first host and the router's queue
/// settings, counting into `metrics`, its switch records kept in `switch_log` (`None`: in
/// memory only).
pub fn lifecycle_config(
    server: &ServerConfig,
    first: FirstHost,
    queue: &QueueSettings,
    metrics: Arc<Metrics>,
    switch_log: Option<PathBuf>,
) -> LifecycleConfig {
    LifecycleConfig {
        host_id: first.id,
        host_activation: first.activation,
        lifecycle_defaults: server.lifecycle_defaults,
        host_settings: first.settings,
        waiting_limit: queue.max_pending_per_deployment,
        timer_tick: Duration::from_secs(1),
        metrics,
        switch_log,
        // The server document's wake window governs every host's wakes (the node agents get
        // it with each wake).
        wake_window: Some(server.switching.wake_timeout),
    }
}

/// The inference listener of an assembly.
pub struct Inference {
    /// Bound already ([`bind`]).
    pub listener: TcpListener,
    /// Its settings ([`proxy_config`], with the listeners' TLS).
    pub config: ProxyConfig,
    /// Told of every request when it ends (the lifecycle's metrics); `None`: nobody.
    pub observer: Option<Arc<dyn RequestObserver>>,
    /// `true` stops it: it accepts no more and finishes the answers in progress for its
    /// shutdown grace.
    pub stop: watch::Receiver<bool>,
    /// Where the listening socket goes when it stops accepting, instead of being closed (a
    /// stopping operator leader answers on it: `capyctl-operator`'s `handover`); `None`:
    /// closed.
    pub give_back: Option<oneshot::Sender<std::net::TcpListener>>,
    /// The tenants and their keys the listener asks for (DESIGN 4.10). Whoever reads tenants
    /// keeps a clone and feeds it through [`capyctl_interfaces::tenants::TenantTable::replace`]
    /// (standalone: the document, again on SIGHUP; the operator: `Tenant` objects). Fill it
    /// before the assembly: with none configured, no key is asked for.
    pub tenants: Arc<Tenants>,
}

impl std::fmt::Debug for Inference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inference")
            .field("listener", &self.listener)
            .finish_non_exhaustive()
    }
}

/// What [`assemble`] built.
#[derive(Debug)]
pub struct Assembly {
    /// The router's coordinator, attached to the server.
    pub router: CoordinatorHandle,
    /// The inference listener's task, when one was given; it ends once its stop said `true`
    /// and its grace is over.
    pub inference: Option<JoinHandle<()>>,
}

/// Builds the router over the opened lifecycle `server` and attaches it; then serves
/// `inference` (when given) through a [`Proxy`] over that router. `lifecycle` is what the
/// router asks (resolve, plans, switches): `server` itself, or a wrapper of it.
pub async fn assemble(
    server: &Arc<Core>,
    lifecycle: Arc<dyn Lifecycle>,
    router: RouterConfig,
    inference: Option<Inference>,
) -> Assembly {
    let adapters = Arc::clone(&lifecycle);
    let router = Coordinator::spawn(lifecycle, router);
    server.attach_router(Arc::new(router.clone())).await;
    let inference = inference.map(|inference| {
        // The catalog (`GET /v1/models`) is the server's models; none once the server is gone.
        let weak = Arc::downgrade(server);
        let catalog = move || weak.upgrade().map(|s| s.models()).unwrap_or_default();
        // Requests that name an adapter load it through the same lifecycle (DESIGN 4.9).
        let mut proxy = Proxy::new(router.clone(), catalog, inference.config)
            .with_adapters(adapters)
            .with_tenants(inference.tenants);
        if let Some(observer) = inference.observer {
            proxy = proxy.with_observer(observer);
        }
        let (listener, mut stop) = (inference.listener, inference.stop);
        let give_back = inference.give_back;
        tokio::spawn(async move {
            let shutdown = async move {
                let _ = stop.wait_for(|s| *s).await;
            };
            let served = match give_back {
                Some(give_back) => {
                    proxy::serve_giving_back(listener, proxy, shutdown, give_back).await
                }
                None => proxy::serve(listener, proxy, shutdown).await,
            };
            if let Err(e) = served {
                tracing::error!(error = %e, "the inference listener failed");
            }
        })
    });
    Assembly { router, inference }
}
