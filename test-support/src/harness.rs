//! The lifecycle's test harness (the lifecycle's, the standalone's and the operator's tests): a
//! server with the real coordinator and listener over real sockets, its hosts in-process agents
//! whose engines are the `engine-sim` binary.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use capyctl_lifecycle::store::RedbStore;
use capyctl_lifecycle::{Core, HostEntry, LifecycleConfig};
use capyctl_node_agent::LocalHostAgent;
use capyctl_node_agent::agent::AgentConfig;
use capyctl_node_agent::inventory::NoGpus;
use capyctl_node_agent::spec::{GpuOverride, HostSettings};
use capyctl_router::config::RouterConfig;
use capyctl_router::coordinator::CoordinatorHandle;
use capyctl_router::proxy::ProxyConfig;
use capyctl_server::assembly::{Assembly, Inference, assemble};
use capyctl_spec::Activation;
use capyctl_spec::documents::{DeploymentDoc, parse_deployment_str};
use capyctl_spec::settings::LifecycleDefaults;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

// What the harness's users call beside it.
pub use crate::http::{management, post_json, try_get_json, try_post_json};
pub use crate::{engine_sim_binary, temp_dir};

/// A mebibyte.
pub const MIB: u64 = 1024 * 1024;
/// A gibibyte.
pub const GIB: u64 = 1024 * MIB;

/// The host: one GPU of `gpu` bytes, `host_memory` of host RAM, every engine the simulator.
pub fn host_settings(gpu: u64, host_memory: u64) -> HostSettings {
    let bin = engine_sim_binary();
    let mut s = HostSettings::all_engines(vec![bin.to_string_lossy().into_owned()]);
    s.gpus = Some(vec![GpuOverride {
        memory: gpu,
        unified: false,
        uuid: None,
    }]);
    s.host_memory = Some(host_memory);
    s
}

/// A simulator deployment of 6 GiB on the GPU and 64 MiB of weights, plus `extra` YAML lines.
pub fn doc(name: &str, extra: &str) -> DeploymentDoc {
    let text = format!(
        "name: {name}\nengine: vllm\nmodel: Qwen3-4B\nresources: {{gpu_memory: 6GiB, weights_memory: 64MiB}}\nenv: {{ENGINE_SIM_WEIGHTS_BYTES: 64MiB}}\n{extra}"
    );
    parse_deployment_str("test.yaml", &text).unwrap()
}

/// What a test server is built with.
#[derive(Debug, Clone)]
pub struct Opts {
    /// Each host's one GPU, in bytes.
    pub gpu: u64,
    /// Each host's RAM, in bytes.
    pub host_memory: u64,
    /// The hosts' activation.
    pub activation: Activation,
    /// The lifecycle's defaults.
    pub lifecycle_defaults: LifecycleDefaults,
    /// How often the idle timers run.
    pub timer_tick: Duration,
}

impl Default for Opts {
    fn default() -> Self {
        Self {
            gpu: 10 * GIB,
            host_memory: GIB,
            activation: Activation::OnDemand,
            lifecycle_defaults: LifecycleDefaults::default(),
            timer_tick: Duration::from_millis(50),
        }
    }
}

/// A server with the real coordinator and the real listener on a loopback port.
pub struct Harness {
    /// The lifecycle server.
    pub server: Arc<Core>,
    /// The server's metrics.
    pub metrics: Arc<capyctl_lifecycle::metrics::Metrics>,
    /// The first host's agent.
    pub agent: Arc<LocalHostAgent>,
    /// Every host's agent, by host ID.
    pub agents: Vec<(String, Arc<LocalHostAgent>)>,
    /// The router's coordinator.
    pub router: CoordinatorHandle,
    /// The inference listener's address.
    pub addr: SocketAddr,
    /// The data directory.
    pub dir: PathBuf,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

/// The router's configuration in tests: a 100 ms admission window, 10 s drains, 60 s deadlines.
pub fn router_config() -> RouterConfig {
    RouterConfig {
        admission_window: Duration::from_millis(100),
        drain_timeout: Duration::from_secs(10),
        request_deadline: Duration::from_secs(60),
        ..RouterConfig::default()
    }
}

impl Harness {
    /// A server over one host, `gpu-box`, on `dir`.
    pub async fn new(dir: &Path, opts: Opts) -> Harness {
        Self::with_hosts(dir, opts, &["gpu-box"]).await
    }

    /// A host agent for host `id` on `dir` (its engines and records).
    pub fn host_agent(dir: &Path, opts: &Opts) -> Arc<LocalHostAgent> {
        let mut config = AgentConfig::new(dir);
        config.ready_timeout = Duration::from_secs(30);
        config.wake_window = Duration::from_secs(30);
        config.stop_grace = Duration::from_secs(5);
        config.sample_interval = Duration::from_millis(100);
        let settings = host_settings(opts.gpu, opts.host_memory);
        Arc::new(LocalHostAgent::new(config, settings, Arc::new(NoGpus)).unwrap())
    }

    /// A server over one host per ID, each with `opts`' GPU and host RAM (the first on `dir`,
    /// the others on `dir/<id>`).
    pub async fn with_hosts(dir: &Path, opts: Opts, ids: &[&str]) -> Harness {
        let settings = host_settings(opts.gpu, opts.host_memory);
        let agents: Vec<(String, Arc<LocalHostAgent>)> = ids
            .iter()
            .enumerate()
            .map(|(i, id)| {
                let at = if i == 0 {
                    dir.to_path_buf()
                } else {
                    dir.join(id)
                };
                (id.to_string(), Self::host_agent(&at, &opts))
            })
            .collect();
        let agent = agents[0].1.clone();
        let store = Arc::new(RedbStore::open(dir).unwrap());
        let mut lc = LifecycleConfig::new(ids[0]);
        lc.host_activation = opts.activation;
        lc.lifecycle_defaults = opts.lifecycle_defaults;
        lc.host_settings = settings.clone();
        lc.timer_tick = opts.timer_tick;
        let metrics = lc.metrics.clone();
        let hosts = agents
            .iter()
            .map(|(id, a)| HostEntry {
                id: id.clone(),
                agent: a.clone(),
                activation: opts.activation,
                settings: settings.clone(),
                admission_window: None,
                remote: false,
            })
            .collect();
        let server = Core::open_hosts(hosts, store, lc).await.unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, rx) = watch::channel(false);
        let inference = Inference {
            listener,
            config: ProxyConfig {
                request_deadline: Duration::from_secs(60),
                ..ProxyConfig::default()
            },
            observer: None,
            stop: rx,
            give_back: None,
            tenants: Default::default(),
        };
        let Assembly { router, inference } =
            assemble(&server, server.clone(), router_config(), Some(inference)).await;
        let task = inference.expect("an inference listener was given");
        Harness {
            server,
            metrics,
            agent,
            agents,
            router,
            addr,
            dir: dir.to_path_buf(),
            stop,
            task,
        }
    }

    /// Stops the listener and the server's background work; engines keep running (as after a
    /// kill), so that the next server on the same directory adopts them.
    pub async fn close(self) {
        self.stop.send_replace(true);
        let _ = self.task.await;
        self.server.close();
    }

    /// Closes, stops every engine and removes the data directory.
    pub async fn shutdown(self) {
        let agents: Vec<_> = self.agents.iter().map(|(_, a)| a.clone()).collect();
        let dir = self.dir.clone();
        self.close().await;
        for agent in agents {
            agent.stop_all().await;
        }
        let _ = std::fs::remove_dir_all(dir);
    }

    /// An operator start (`capyctl start deployment NAME [--evict] [--wait]`).
    pub async fn start(
        &self,
        name: &str,
        evict: bool,
        wait: bool,
    ) -> Result<capyctl_spec::api::ActionReceipt, capyctl_spec::errors::ApiError> {
        use capyctl_lifecycle::api::ManagementApi;
        let request = capyctl_spec::api::StartRequest { evict, wait };
        self.server.start(name, request).await
    }

    /// A chat request for `model` through the listener: its status and answer.
    pub async fn chat(&self, model: &str) -> (u16, serde_json::Value) {
        post_json(
            self.addr,
            "/v1/chat/completions",
            serde_json::json!({
                "model": model,
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 4,
            }),
        )
        .await
    }
}
