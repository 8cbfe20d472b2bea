//! Shared helpers of the lifecycle and standalone tests: the `engine-sim` binary, a server with
//! the real coordinator and listener over real sockets, and a small HTTP client.
#![allow(dead_code, clippy::unwrap_used)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use capyctl_lifecycle::store::RedbStore;
use capyctl_lifecycle::{HostEntry, LifecycleConfig, Server};
use capyctl_node_agent::LocalHostAgent;
use capyctl_node_agent::agent::AgentConfig;
use capyctl_node_agent::inventory::NoGpus;
use capyctl_node_agent::spec::{GpuOverride, HostSettings};
use capyctl_router::config::RouterConfig;
use capyctl_router::coordinator::CoordinatorHandle;
use capyctl_router::proxy::{self, ProxyConfig};
use capyctl_spec::Activation;
use capyctl_spec::documents::{DeploymentDoc, parse_deployment_str};
use capyctl_spec::settings::LifecycleDefaults;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub const MIB: u64 = 1024 * 1024;
pub const GIB: u64 = 1024 * MIB;

/// A fresh, empty temporary directory (the shared test-support's).
pub fn temp_dir(name: &str) -> PathBuf {
    capyctl_test_support::temp_dir(&format!("operator-{name}"))
}

/// The newest modification time under `dir` (the shared test-support's).
fn newest_source(dir: &Path) -> SystemTime {
    capyctl_test_support::newest_source(dir)
}

/// The `engine-sim` binary, built when missing or older than its sources (the shared
/// test-support's).
pub fn engine_sim_binary() -> PathBuf {
    capyctl_test_support::engine_sim_binary()
}

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
    pub gpu: u64,
    pub host_memory: u64,
    pub activation: Activation,
    pub lifecycle_defaults: LifecycleDefaults,
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
    pub server: Arc<Server>,
    /// The server's metrics.
    pub metrics: Arc<capyctl_lifecycle::metrics::Metrics>,
    /// The first host's agent.
    pub agent: Arc<LocalHostAgent>,
    /// Every host's agent, by host ID.
    pub agents: Vec<(String, Arc<LocalHostAgent>)>,
    pub router: CoordinatorHandle,
    pub addr: SocketAddr,
    pub dir: PathBuf,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

pub fn router_config() -> RouterConfig {
    RouterConfig {
        admission_window: Duration::from_millis(100),
        drain_timeout: Duration::from_secs(10),
        request_deadline: Duration::from_secs(60),
        ..RouterConfig::default()
    }
}

impl Harness {
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
        let server = Server::open_hosts(hosts, store, lc).await.unwrap();
        let router = server.spawn_router(server.clone(), router_config()).await;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let proxy = server.proxy(
            router.clone(),
            ProxyConfig {
                request_deadline: Duration::from_secs(60),
                ..ProxyConfig::default()
            },
        );
        let (stop, mut rx) = watch::channel(false);
        let task = tokio::spawn(async move {
            let shutdown = async move {
                let _ = rx.wait_for(|s| *s).await;
            };
            proxy::serve(listener, proxy, shutdown).await.unwrap();
        });
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

/// POSTs `body` to `http://addr/path`; the status and the JSON answer.
pub async fn post_json(
    addr: SocketAddr,
    path: &str,
    body: serde_json::Value,
) -> (u16, serde_json::Value) {
    try_post_json(addr, path, body).await.unwrap()
}

/// `POST http://addr/path` with a JSON body: the status and the JSON answer (a string when it
/// is not JSON).
pub async fn try_post_json(
    addr: SocketAddr,
    path: &str,
    body: serde_json::Value,
) -> Result<(u16, serde_json::Value), hyper_util::client::legacy::Error> {
    let req = http::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    try_request(req).await
}

/// `GET http://addr/path`: the status and the JSON answer (a string when it is not JSON).
pub async fn try_get_json(
    addr: SocketAddr,
    path: &str,
) -> Result<(u16, serde_json::Value), hyper_util::client::legacy::Error> {
    let req = http::Request::get(format!("http://{addr}{path}"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    try_request(req).await
}

async fn try_request(
    req: http::Request<Full<Bytes>>,
) -> Result<(u16, serde_json::Value), hyper_util::client::legacy::Error> {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let resp = client.request(req).await?;
    let status = resp.status().as_u16();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let json = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| serde_json::Value::String(String::from_utf8_lossy(&bytes).into()));
    Ok((status, json))
}

/// A management request: `method` on `http://addr/path` with the admin token and an optional
/// JSON body; the status and the JSON answer.
pub async fn management(
    method: &str,
    addr: SocketAddr,
    path: &str,
    token: &str,
    body: Option<serde_json::Value>,
) -> (u16, serde_json::Value) {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let mut req = http::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("authorization", format!("Bearer {token}"));
    if body.is_some() {
        req = req.header("content-type", "application/json");
    }
    let req = req
        .body(Full::new(Bytes::from(
            body.map(|b| b.to_string()).unwrap_or_default(),
        )))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let json = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| serde_json::Value::String(String::from_utf8_lossy(&bytes).into()));
    (status, json)
}
