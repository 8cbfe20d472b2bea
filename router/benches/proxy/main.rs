//! The listener against a direct connection to the engine, side by side in one run.
//!
//! ```text
//! cargo bench -p capyctl-router --bench proxy                 # ~40 s: 1 and 32 clients
//! cargo bench -p capyctl-router --bench proxy -- --help       # the options
//! cargo bench -p capyctl-router --bench proxy -- --memory     # router RSS, 4096 requests waiting
//! cargo bench -p capyctl-router --bench proxy -- --nginx /usr/sbin/nginx  # nginx as a third side
//! cargo bench -p capyctl-router --bench proxy -- --seconds 2 --rounds 5 --admission trivial
//! cargo bench -p capyctl-router --bench proxy -- --replicas   # 1, 2, 4 instances (`proxy/replicas.rs`)
//! cargo bench -p capyctl-router --bench proxy -- --tenants 1000  # a third side: keys of 1,000 tenants
//! ```
//!
//! The engine simulator runs in-process at token rate 0 (as fast as it can), with the proxy in
//! front of it, each on its own tokio runtime (as if separate processes), and the load
//! generator on a third. Every case alternates direct and routed segments for several rounds
//! and prints medians: requests per second, p50 and p99 latency of whole answers, streamed
//! tokens per second, and the router/direct ratios with the p50 the router adds. Every client
//! keeps one keep-alive connection.
//!
//! The router side uses the real switch coordinator (`--admission coordinator`, the default)
//! with one ready instance, or a trivial admission that always admits (`--admission trivial`).

#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use capyctl_interfaces::router::{
    BoxFuture, DeploymentId, DeploymentRef, Executed, InstanceKey, Lifecycle, Plan, PlanFor,
    SwitchOrder, Upstream,
};
use capyctl_router::admission::{Admission, Permit};
use capyctl_router::config::RouterConfig;
use capyctl_router::coordinator::{Coordinator, CoordinatorHandle};
use capyctl_router::proxy::{ModelEntry, Proxy, ProxyConfig, serve};
use capyctl_spec::errors::ApiError;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use std::future::Future;
use tokio::net::{TcpListener, TcpStream};

use tokio::runtime::Handle;

mod replicas;

const MODEL: &str = "bench-model";
const PARKED: &str = "parked-model";
const DEPLOYMENT: &str = "01BENCH0000000000000000000";
const PARKED_DEPLOYMENT: &str = "01PARKED000000000000000000";
/// The tokens of every answer (`--tokens`; 16 unless given).
static TOKENS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(16);

fn tokens() -> u32 {
    TOKENS.load(Ordering::Relaxed)
}

const USAGE: &str = "\
The router against a direct connection to the engine, side by side (medians of alternating rounds).

usage: cargo bench -p capyctl-router --bench proxy -- [options]

  (no options)             1 and 32 clients, streamed and not, engine-sim and a canned upstream (~90 s)
  --seconds S              length of one segment per side (default 1.0)
  --rounds N               alternating rounds per case (default 5)
  --clients 1,32           concurrent clients, comma-separated
  --admission A            coordinator (default: the real switch coordinator) | trivial
  --no-observer            without the server's request observer and use tracking (default: with
                           equivalents of the operator's, as production runs)
  --upstream U             both (default) | sim | canned
  --router-threads N       worker threads of the runtime the router is started on (default 2; 0: a
                           current-thread runtime)
  --listener-threads N     the listener's own threads (ProxyConfig::listener_threads; default: the
                           router's default, one per CPU; 0: on the router's runtime)
  --sim-threads N          the engine's worker threads (default 2)
  --load-threads N         the load generator's worker threads (default 0: one current-thread runtime)
  --nginx PATH             also nginx (the binary at PATH, e.g. /usr/sbin/nginx) as a plain reverse
                           proxy with keep-alive to the same engine, as a third side of every case:
                           the reference measured in the same run
  --profile N              only N requests through the router (first --clients value, --stream for
                           streamed) and the router's CPU per request; for callgrind (with
                           --tenants N: the router with N tenants' keys)
  --stream                 for --profile
  --memory                 the router's RSS with --waiting requests waiting for a parked deployment
                           (the clients run in a child process)
  --waiting N              for --memory (default 4096)
  --tenants N              also a router whose listener has N tenants with keys and rates (one
                           tenant's key sent), as a third side beside the router without keys;
                           every side's requests then carry that `Authorization` header, and
                           both routers run as processes of their own (this binary again), so
                           that each one's CPU time is its process's alone; the keyed/plain CPU
                           ratio is over all rounds, with each round's ratio (the two routers'
                           segments are next to each other) for its spread, and again with the
                           two routers in the same segments, each client's requests sent to
                           one and the other in turn (its request-by-request line)
  --tokens N               the tokens of every answer (default 16)
  --no-token-rate          with --tenants: the tenants have no tokens_per_minute (their keys,
                           globs and request rate only: no usage asked for or taken out)
  --replicas [--help]      requests per second with 1, 2 and 4 instances of one deployment, each
                           against the same engines reached directly (its own options: see
                           --replicas --help)
  -h, --help               this text

Each case opens its clients' keep-alive connections once and warms them all together
(20 requests each) before its first round. Besides latency and throughput it prints the CPU time
(user and kernel, from /proc/self/task/*/schedstat) and the context switches of the router's
threads per request: figures that a loaded machine disturbs much less than wall-clock ones.";

#[derive(Clone, Copy, PartialEq, Eq)]
enum AdmissionKind {
    Coordinator,
    Trivial,
}

struct Args {
    seconds: f64,
    rounds: usize,
    clients: Vec<usize>,
    admission: AdmissionKind,
    observer: bool,
    memory: bool,
    waiting: usize,
    router_threads: usize,
    listener_threads: Option<usize>,
    sim_threads: usize,
    load_threads: usize,
    profile: Option<usize>,
    stream: bool,
    upstream: String,
    /// `--nginx PATH`: also run nginx as a plain reverse proxy, as a third side.
    nginx: Option<String>,
    /// `--memory-clients ADDR N`: the client side of `--memory` (a child process).
    memory_clients: Option<(SocketAddr, usize)>,
    /// `--tenants N`: a third side, the router with N tenants' keys.
    tenants: Option<usize>,
    /// `--no-token-rate`: those tenants without `tokens_per_minute`.
    no_token_rate: bool,
    /// `--router-child ENGINE N`: a router process of `--tenants` (N tenants, 0: no keys) in
    /// front of the engine at ENGINE; prints its address, runs until its stdin closes.
    router_child: Option<(SocketAddr, usize)>,
}

/// The `Authorization` header every request carries with `--tenants` (one tenant's key).
static AUTHORIZATION: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// The key the requests carry with `--tenants n`: one tenant's (the middle one's second).
fn bench_key(n: usize) -> String {
    format!("Bearer sk-bench-{:05}-bbbbbbbbbbbbbbbbbbbbbbbbbbbb", n / 2)
}

/// A table of `n` tenants as a production configuration would have them: two keys each, the
/// bench's model among their globs, and rates high enough never to refuse (`tokens`: with a
/// `tokens_per_minute`, for which streamed answers' usage is asked for and taken out).
fn bench_tenants(n: usize, tokens: bool) -> Arc<capyctl_router::tenants::Tenants> {
    use capyctl_interfaces::tenants::{Tenant, TenantRate, TenantTable};
    let table = Arc::new(capyctl_router::tenants::Tenants::new());
    let tenants = (0..n)
        .map(|i| Tenant {
            name: format!("tenant-{i:05}"),
            keys: vec![
                format!("sk-bench-{i:05}-aaaaaaaaaaaaaaaaaaaaaaaaaaaa"),
                format!("sk-bench-{i:05}-bbbbbbbbbbbbbbbbbbbbbbbbbbbb"),
            ],
            models: Some(vec!["chat-*".to_string(), "bench-*".to_string()]),
            rate: Some(TenantRate {
                requests_per_minute: Some(1_000_000),
                tokens_per_minute: tokens.then_some(10_000_000_000),
            }),
        })
        .collect();
    table.replace(tenants).unwrap();
    let _ = AUTHORIZATION.set(bench_key(n));
    table
}

/// A router of `--tenants` in a process of its own: this binary with `--router-child`, killed
/// when dropped (and ending by itself when this process ends: its stdin closes).
struct RouterProcess {
    child: std::process::Child,
    addr: SocketAddr,
}

impl RouterProcess {
    /// A router in front of `engine`, with the keys of `tenants` tenants (0: none).
    fn start(engine: SocketAddr, tenants: usize) -> Self {
        use std::io::BufRead as _;
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(std::env::args().skip(1))
            .args(["--router-child", &engine.to_string(), &tenants.to_string()])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("the router process printed {line:?}, not its address"));
        RouterProcess { child, addr }
    }

    fn meter(&self) -> Meter {
        Meter::Process(self.child.id())
    }
}

impl Drop for RouterProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The child of [`RouterProcess::start`]: the router (with `tenants` tenants' keys when not 0)
/// in front of `engine`, on its runtime `router` as in the bench's own process; prints its
/// address and serves until its stdin closes.
fn router_child(args: &Args, engine: SocketAddr, tenants: usize) {
    let rt = runtime("router", args.router_threads);
    let tenants = (tenants > 0).then(|| bench_tenants(tenants, !args.no_token_rate));
    let (addr, handle) = run(
        &rt,
        start_proxy_with(engine, Setup::of(args), RouterConfig::default(), tenants),
    );
    println!("{addr}");
    let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
    drop(handle);
}

fn args() -> Args {
    let mut args = Args {
        seconds: 1.0,
        rounds: 5,
        clients: vec![1, 32],
        admission: AdmissionKind::Coordinator,
        observer: true,
        memory: false,
        waiting: 4096,
        router_threads: 2,
        listener_threads: None,
        sim_threads: 2,
        load_threads: 0,
        profile: None,
        stream: false,
        upstream: "both".to_string(),
        nginx: None,
        memory_clients: None,
        tenants: None,
        no_token_rate: false,
        router_child: None,
    };
    let mut it = std::env::args().skip(1);
    let number = |it: &mut std::iter::Skip<std::env::Args>, default: usize| {
        it.next().and_then(|v| v.parse().ok()).unwrap_or(default)
    };
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--seconds" => args.seconds = it.next().and_then(|v| v.parse().ok()).unwrap_or(1.0),
            "--rounds" => args.rounds = number(&mut it, 5),
            "--clients" => {
                args.clients = it
                    .next()
                    .unwrap_or_default()
                    .split(',')
                    .filter_map(|c| c.parse().ok())
                    .collect();
            }
            "--admission" => {
                args.admission = match it.next().as_deref() {
                    Some("trivial") => AdmissionKind::Trivial,
                    _ => AdmissionKind::Coordinator,
                };
            }
            "--no-observer" => args.observer = false,
            "--no-token-rate" => args.no_token_rate = true,
            "--tokens" => TOKENS.store(
                number(&mut it, 16).clamp(1, 100_000) as u32,
                Ordering::Relaxed,
            ),
            "--memory" => args.memory = true,
            "--upstream" => args.upstream = it.next().unwrap_or_default(),
            "--router-threads" => args.router_threads = number(&mut it, 2),
            "--listener-threads" => args.listener_threads = Some(number(&mut it, 0)),
            "--sim-threads" => args.sim_threads = number(&mut it, 2),
            "--load-threads" => args.load_threads = number(&mut it, 0),
            "--profile" => args.profile = Some(number(&mut it, 1000)),
            "--stream" => args.stream = true,
            "--nginx" => args.nginx = it.next(),
            "--tenants" => args.tenants = Some(number(&mut it, 1000)),
            "--waiting" => args.waiting = number(&mut it, 4096),
            "--router-child" => {
                let addr = it.next().and_then(|v| v.parse().ok());
                let n = it.next().and_then(|v| v.parse().ok());
                args.router_child = addr.zip(n);
            }
            "--memory-clients" => {
                let addr = it.next().and_then(|v| v.parse().ok());
                let n = it.next().and_then(|v| v.parse().ok());
                args.memory_clients = addr.zip(n);
            }
            "--help" | "-h" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            // `cargo bench` passes `--bench`; ignore it and anything unknown.
            _ => {}
        }
    }
    args
}

fn listener_threads_note(args: &Args) -> String {
    match args.listener_threads {
        Some(0) => String::new(),
        Some(n) => format!(", listener on {n} thread(s) of its own"),
        None => ", listener threads: the default".to_string(),
    }
}

/// A runtime of `threads` workers, or with 0 a current-thread runtime on a thread of its own
/// (as a single-threaded server process would run).
fn runtime(name: &str, threads: usize) -> Handle {
    if threads == 0 {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let handle = rt.handle().clone();
        std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || rt.block_on(std::future::pending::<()>()))
            .unwrap();
        return handle;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name(name)
        .enable_all()
        .build()
        .unwrap();
    let handle = rt.handle().clone();
    // Lives as long as the process.
    std::mem::forget(rt);
    handle
}

/// Runs `future` on `handle`'s runtime and waits for it.
fn run<T: Send + 'static>(handle: &Handle, future: impl Future<Output = T> + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    handle.spawn(async move {
        let _ = tx.send(future.await);
    });
    rx.recv().unwrap()
}

fn upstream(addr: SocketAddr) -> Upstream {
    Upstream {
        key: InstanceKey {
            deployment: DEPLOYMENT.to_string(),
            index: 0,
            host_id: "bench".to_string(),
            generation: 1,
        },
        addr,
    }
}

/// Always admits to the one engine.
#[derive(Clone)]
struct Trivial(Arc<Upstream>);

struct TrivialPermit(Arc<Upstream>);

impl Permit for TrivialPermit {
    fn upstream(&self) -> &Upstream {
        &self.0
    }
    fn first_output(&self) {}
    fn cut(&self) {}
    fn waited_at_bound(&self) -> std::time::Duration {
        std::time::Duration::ZERO
    }
}

impl Admission for Trivial {
    type Permit = TrivialPermit;

    fn resolve(&self, model: &str) -> Option<DeploymentRef> {
        (model == MODEL).then(|| DeploymentRef {
            id: DEPLOYMENT.to_string(),
            name: MODEL.to_string(),
            routing: capyctl_spec::Routing::LeastLoaded,
            priority: 0,
        })
    }

    async fn admit(
        &self,
        _deployment: DeploymentRef,
        _deadline: tokio::time::Instant,
    ) -> Result<TrivialPermit, ApiError> {
        Ok(TrivialPermit(Arc::clone(&self.0)))
    }
}

/// One ready deployment, and one that never becomes ready (its requests wait).
struct BenchLifecycle;

impl Lifecycle for BenchLifecycle {
    fn resolve(&self, model: &str) -> Option<DeploymentRef> {
        match model {
            MODEL => Some(DeploymentRef {
                id: DEPLOYMENT.to_string(),
                name: MODEL.to_string(),
                routing: capyctl_spec::Routing::LeastLoaded,
                priority: 0,
            }),
            PARKED => Some(DeploymentRef {
                id: PARKED_DEPLOYMENT.to_string(),
                name: PARKED.to_string(),
                routing: capyctl_spec::Routing::LeastLoaded,
                priority: 0,
            }),
            _ => None,
        }
    }

    fn admissible(&self, _deployment: &DeploymentId) -> Result<(), ApiError> {
        Ok(())
    }

    fn plan<'a>(
        &'a self,
        _deployment: &'a DeploymentId,
        _protected: &'a BTreeSet<DeploymentId>,
        _who: PlanFor,
    ) -> BoxFuture<'a, Result<Plan, ApiError>> {
        Box::pin(async { Ok(Plan::AlreadyComing) })
    }

    fn execute(&self, _order: SwitchOrder) -> BoxFuture<'_, Result<Executed, ApiError>> {
        Box::pin(std::future::pending())
    }

    fn abandon(&self, _switch_id: &str) {}

    fn engine_idle<'a>(&'a self, _instance: &'a InstanceKey) -> BoxFuture<'a, bool> {
        Box::pin(async { true })
    }
}

fn catalog() -> Vec<ModelEntry> {
    vec![ModelEntry {
        id: MODEL.to_string(),
        deployment_id: DEPLOYMENT.to_string(),
        state: "ready".to_string(),
    }]
}

async fn start_sim() -> SocketAddr {
    start_sim_with(MODEL, &["--sim-token-rate", "0"]).await.0
}

/// The engine simulator serving `model`, with `extra` launch arguments, and its state.
async fn start_sim_with(
    model: &str,
    extra: &[&str],
) -> (SocketAddr, Arc<capyctl_engine_sim::EngineSim>) {
    let mut args = vec![
        "engine-sim",
        "serve",
        "Qwen3-4B",
        "--served-model-name",
        model,
        "--port",
        "0",
    ];
    args.extend_from_slice(extra);
    let config = capyctl_engine_sim::SimConfig::try_parse_from(args).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    // The simulator's own `serve` leaves Nagle on, which costs a streamed answer 40 ms per
    // delayed ACK; an engine (uvicorn) sets TCP_NODELAY.
    use axum::serve::ListenerExt;
    let listener = listener.tap_io(|stream| {
        let _ = stream.set_nodelay(true);
    });
    let sim = capyctl_engine_sim::EngineSim::new(config);
    let app = capyctl_engine_sim::app(Arc::clone(&sim));
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (addr, sim)
}

/// An upstream that answers at once with bytes shaped like the simulator's (a whole answer of
/// about 500 bytes; a stream of `--tokens` token events, the finish event and `[DONE]`, each
/// written on its own as an engine does; no usage chunk, even when asked for), with no timer
/// anywhere: what is left is the HTTP cost.
async fn start_canned() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let chunk = |content: &str, finish: &str| {
        Bytes::from(format!(
            "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1796237011,\"model\":\"{MODEL}\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{content}\"}},\"logprobs\":null,\"finish_reason\":{finish}}}]}}\n\n"
        ))
    };
    let mut events: Vec<Bytes> = (0..tokens())
        .map(|i| chunk(&format!(" word{i}"), "null"))
        .collect();
    events.push(chunk("", "\"length\""));
    events.push(Bytes::from_static(b"data: [DONE]\n\n"));
    let events = Arc::new(events);
    let whole = Arc::new(vec![Bytes::from(format!(
        "{{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion\",\"created\":1796237011,\"model\":\"{MODEL}\",\"choices\":[{{\"index\":0,\"message\":{{\"role\":\"assistant\",\"content\":\"{}\"}},\"logprobs\":null,\"finish_reason\":\"length\"}}],\"usage\":{{\"prompt_tokens\":12,\"completion_tokens\":{},\"total_tokens\":{}}}}}",
        (0..tokens())
            .map(|i| format!(" word{i}"))
            .collect::<String>(),
        tokens(),
        tokens() + 12,
    ))]);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            stream.set_nodelay(true).unwrap();
            let events = Arc::clone(&events);
            let whole = Arc::clone(&whole);
            let service =
                hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
                    let events = Arc::clone(&events);
                    let whole = Arc::clone(&whole);
                    async move {
                        let body = request.into_body().collect().await?.to_bytes();
                        let stream = body.windows(13).any(|w| w == b"\"stream\":true");
                        let (content_type, parts) = if stream {
                            ("text/event-stream", events)
                        } else {
                            ("application/json", whole)
                        };
                        let mut response = http::Response::new(Canned {
                            parts,
                            next: 0,
                            pause: false,
                        });
                        response
                            .headers_mut()
                            .insert("content-type", http::HeaderValue::from_static(content_type));
                        Ok::<_, hyper::Error>(response)
                    }
                });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

/// The canned answer, one part per write.
struct Canned {
    parts: Arc<Vec<Bytes>>,
    next: usize,
    /// Hands back once between parts, so that each part is written (flushed) on its own.
    pause: bool,
}

impl http_body::Body for Canned {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        let Some(part) = self.parts.get(self.next).cloned() else {
            return std::task::Poll::Ready(None);
        };
        if self.pause {
            self.pause = false;
            cx.waker().wake_by_ref();
            return std::task::Poll::Pending;
        }
        self.pause = true;
        self.next += 1;
        std::task::Poll::Ready(Some(Ok(http_body::Frame::data(part))))
    }

    fn is_end_stream(&self) -> bool {
        self.next >= self.parts.len()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        if self.parts.len() == 1 {
            http_body::SizeHint::with_exact(self.parts[0].len() as u64)
        } else {
            http_body::SizeHint::default()
        }
    }
}

/// How the router side is put together (copied into the router's runtime).
#[derive(Clone, Copy)]
struct Setup {
    kind: AdmissionKind,
    observer: bool,
    listener_threads: Option<usize>,
}

impl Setup {
    fn of(args: &Args) -> Self {
        Setup {
            kind: args.admission,
            observer: args.observer,
            listener_threads: args.listener_threads,
        }
    }
}

/// Starts the proxy (on the current runtime); returns its address and, with the coordinator,
/// its handle.
async fn start_proxy(
    sim: SocketAddr,
    setup: Setup,
    router_config: RouterConfig,
) -> (SocketAddr, Option<CoordinatorHandle>) {
    start_proxy_with(sim, setup, router_config, None).await
}

/// [`start_proxy`], its listener asking for the keys of `tenants` when given.
async fn start_proxy_with(
    sim: SocketAddr,
    setup: Setup,
    router_config: RouterConfig,
    tenants: Option<Arc<capyctl_router::tenants::Tenants>>,
) -> (SocketAddr, Option<CoordinatorHandle>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = ProxyConfig {
        request_deadline: router_config.request_deadline,
        max_buffered_bytes_total: ProxyConfig::default().max_buffered_bytes_total,
        ..ProxyConfig::default()
    };
    let config = with_listener_threads(config, setup.listener_threads);
    fn go_with<A: Admission>(
        listener: TcpListener,
        admission: A,
        config: ProxyConfig,
        observer: bool,
        tenants: Option<Arc<capyctl_router::tenants::Tenants>>,
    ) {
        let mut proxy = Proxy::new(admission, catalog, config);
        if let Some(tenants) = tenants {
            proxy = proxy.with_tenants(tenants);
        }
        if observer {
            proxy = proxy.with_observer(Arc::new(server_like::Metrics::default()));
        }
        tokio::spawn(serve(listener, proxy, std::future::pending()));
    }
    match setup.kind {
        AdmissionKind::Trivial => {
            go_with(
                listener,
                Trivial(Arc::new(upstream(sim))),
                config,
                setup.observer,
                tenants,
            );
            (addr, None)
        }
        AdmissionKind::Coordinator => {
            let lifecycle: Arc<dyn Lifecycle> = if setup.observer {
                Arc::new(server_like::Names::new())
            } else {
                Arc::new(BenchLifecycle)
            };
            let handle = Coordinator::spawn(lifecycle, router_config);
            handle.instance_ready(upstream(sim)).await;
            go_with(listener, handle.clone(), config, setup.observer, tenants);
            (addr, Some(handle))
        }
    }
}

fn with_listener_threads(mut config: ProxyConfig, threads: Option<usize>) -> ProxyConfig {
    if let Some(n) = threads {
        config.listener_threads = n;
    }
    config
}

/// What the server (`capyctl-operator`) adds to every request, rebuilt here because the bench
/// cannot depend on the operator (it depends on this crate): its lifecycle's `resolve` (the
/// name lookup through a cache, `NameCache` in `lifecycle/src/lib.rs`; the listener's
/// `Admission` is the coordinator's own, which records each request's use itself) and its
/// request observer (`Metrics`: a request counter by deployment, status and code, and the wait
/// histogram, through handles cached per deployment). Keep it in step with
/// `lifecycle/src/lib.rs` and `lifecycle/src/metrics.rs`.
mod server_like {
    use std::collections::{BTreeSet, HashMap};
    use std::sync::RwLock;
    use std::time::Duration;

    use tokio::sync::watch;

    use capyctl_interfaces::router::{
        BoxFuture, DeploymentId, DeploymentRef, Executed, InstanceKey, Lifecycle, Plan, PlanFor,
        SwitchOrder,
    };
    use capyctl_router::observe::{RequestEvent, RequestObserver};
    use capyctl_spec::errors::ApiError;
    use prometheus_client::encoding::EncodeLabelSet;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;
    use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

    /// The lifecycle as the request path sees it: `resolve` through its name cache (a read
    /// lock of its own, and the change counter that says when names not found are looked up
    /// again); the rest as [`super::BenchLifecycle`].
    pub struct Names {
        inner: super::BenchLifecycle,
        _changes: watch::Sender<u64>,
        names: RwLock<(watch::Receiver<u64>, HashMap<String, DeploymentRef>)>,
    }

    impl Names {
        pub fn new() -> Self {
            let (changes, seen) = watch::channel(0);
            let mut names = HashMap::new();
            for (name, id) in [
                (super::MODEL, super::DEPLOYMENT),
                (super::PARKED, super::PARKED_DEPLOYMENT),
            ] {
                let dref = DeploymentRef {
                    id: id.to_string(),
                    name: name.to_string(),
                    routing: capyctl_spec::Routing::LeastLoaded,
                    priority: 0,
                };
                names.insert(name.to_string(), dref);
            }
            Names {
                inner: super::BenchLifecycle,
                _changes: changes,
                names: RwLock::new((seen, names)),
            }
        }
    }

    impl Lifecycle for Names {
        fn resolve(&self, model: &str) -> Option<DeploymentRef> {
            let names = self.names.read().unwrap();
            // The server looks names up again when this says so (never, here).
            assert!(!names.0.has_changed().unwrap_or(true));
            names.1.get(model).cloned()
        }

        fn admissible(&self, deployment: &DeploymentId) -> Result<(), ApiError> {
            self.inner.admissible(deployment)
        }

        fn plan<'a>(
            &'a self,
            deployment: &'a DeploymentId,
            protected: &'a BTreeSet<DeploymentId>,
            who: PlanFor,
        ) -> BoxFuture<'a, Result<Plan, ApiError>> {
            self.inner.plan(deployment, protected, who)
        }

        fn execute(&self, order: SwitchOrder) -> BoxFuture<'_, Result<Executed, ApiError>> {
            self.inner.execute(order)
        }

        fn abandon(&self, switch_id: &str) {
            self.inner.abandon(switch_id);
        }

        fn engine_idle<'a>(&'a self, instance: &'a InstanceKey) -> BoxFuture<'a, bool> {
            self.inner.engine_idle(instance)
        }
    }

    #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
    struct RequestLabels {
        deployment: String,
        status: String,
        code: String,
    }

    #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
    struct DeploymentLabels {
        deployment: String,
    }

    struct Handles {
        wait: Histogram,
        outcomes: Vec<(u16, Box<str>, Counter)>,
    }

    /// `Metrics` as the request observer.
    pub struct Metrics {
        requests: Family<RequestLabels, Counter>,
        request_wait: Family<DeploymentLabels, Histogram, fn() -> Histogram>,
        handles: RwLock<HashMap<String, Handles>>,
        /// The ring of recent requests (`lifecycle/src/metrics.rs` keeps one too).
        recent: capyctl_lifecycle::recent::RecentRequests,
    }

    fn seconds_histogram() -> Histogram {
        Histogram::new(exponential_buckets(0.001, 2.0, 20))
    }

    impl Default for Metrics {
        fn default() -> Self {
            Metrics {
                requests: Family::default(),
                request_wait: Family::new_with_constructor(seconds_histogram as fn() -> Histogram),
                handles: RwLock::new(HashMap::new()),
                recent: capyctl_lifecycle::recent::RecentRequests::default(),
            }
        }
    }

    impl Metrics {
        fn record(&self, deployment: &str, status: u16, code: &str, waited: Duration) {
            {
                let handles = self.handles.read().unwrap();
                if let Some(h) = handles.get(deployment)
                    && let Some((_, _, counter)) = h
                        .outcomes
                        .iter()
                        .find(|(s, c, _)| *s == status && &**c == code)
                {
                    counter.inc();
                    h.wait.observe(waited.as_secs_f64());
                    return;
                }
            }
            let mut handles = self.handles.write().unwrap();
            let h = handles
                .entry(deployment.to_string())
                .or_insert_with(|| Handles {
                    wait: self
                        .request_wait
                        .get_or_create(&DeploymentLabels {
                            deployment: deployment.to_string(),
                        })
                        .clone(),
                    outcomes: Vec::new(),
                });
            let counter = match h
                .outcomes
                .iter()
                .find(|(s, c, _)| *s == status && &**c == code)
            {
                Some((_, _, counter)) => counter.clone(),
                None => {
                    let counter = self
                        .requests
                        .get_or_create(&RequestLabels {
                            deployment: deployment.to_string(),
                            status: status.to_string(),
                            code: code.to_string(),
                        })
                        .clone();
                    h.outcomes.push((status, code.into(), counter.clone()));
                    counter
                }
            };
            counter.inc();
            h.wait.observe(waited.as_secs_f64());
        }
    }

    impl RequestObserver for Metrics {
        fn finished(&self, event: &RequestEvent) {
            self.record(
                event.deployment_id.as_deref().unwrap_or("-"),
                event.status,
                event.code.unwrap_or("ok"),
                event.waited,
            );
            self.recent.record(event);
        }
    }
}

#[derive(Clone, Copy)]
struct Case {
    clients: usize,
    stream: bool,
}

fn body(model: &str, stream: bool) -> Bytes {
    Bytes::from(format!(
        r#"{{"model":"{model}","messages":[{{"role":"user","content":"Tell me about capybaras"}}],"max_tokens":{},"stream":{stream}}}"#,
        tokens()
    ))
}

#[derive(Default, Clone, Copy)]
struct Figures {
    rps: f64,
    p50_ms: f64,
    p99_ms: f64,
    tokens_per_s: f64,
    /// CPU time (user and kernel) of the proxy's threads (the router's, or nginx's processes)
    /// per request, in microseconds.
    proxy_cpu_us: f64,
    /// Context switches of the proxy's threads per request.
    proxy_switches: f64,
    /// CPU time of the engine's threads per request, in microseconds.
    engine_cpu_us: f64,
    /// The requests answered.
    requests: f64,
}

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

async fn connect(addr: SocketAddr) -> Sender {
    let stream = TcpStream::connect(addr).await.unwrap();
    stream.set_nodelay(true).unwrap();
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(async move {
        let _ = conn.await;
    });
    sender
}

async fn one(sender: &mut Sender, body: &Bytes) -> (Duration, u64) {
    let mut request = http::Request::post("/v1/chat/completions")
        .header("host", "bench")
        .header("content-type", "application/json");
    if let Some(key) = AUTHORIZATION.get() {
        request = request.header("authorization", key.as_str());
    }
    let request = request.body(Full::new(body.clone())).unwrap();
    let start = Instant::now();
    sender.ready().await.unwrap();
    let response = sender.send_request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let elapsed = start.elapsed();
    let events = bytes.windows(6).filter(|w| w == b"data: ").count() as u64;
    // A stream's events: one per token, the finish chunk and `[DONE]`.
    (elapsed, events.saturating_sub(2))
}

/// The clients of one case on one side: keep-alive connections opened once and warmed
/// together (so that the router's pool holds a connection per client before anything is
/// measured), then used by every round of the case.
async fn open_clients(addr: SocketAddr, case: Case) -> Vec<Sender> {
    let body = body(MODEL, case.stream);
    let mut senders = Vec::new();
    for _ in 0..case.clients {
        senders.push(connect(addr).await);
    }
    let tasks: Vec<_> = senders
        .into_iter()
        .map(|mut sender| {
            let body = body.clone();
            tokio::spawn(async move {
                for _ in 0..WARM_REQUESTS {
                    one(&mut sender, &body).await;
                }
                sender
            })
        })
        .collect();
    let mut senders = Vec::new();
    for task in tasks {
        senders.push(task.await.unwrap());
    }
    senders
}

/// Requests each client sends, all clients at once, before a case is measured.
const WARM_REQUESTS: usize = 20;

/// How a segment ends: after a time, or after a number of requests (split over the clients).
#[derive(Clone, Copy)]
enum Stop {
    After(Duration),
    Requests(usize),
}

/// Runs `case` on `senders` until `stop`; the senders come back for the next round.
async fn segment(senders: &mut Vec<Sender>, case: Case, stop: Stop, meter: &Meter) -> Figures {
    let body = body(MODEL, case.stream);
    let proxy_before = meter.read();
    let engine_before = Meter::Threads(&["engine-sim"]).read();
    let done = Arc::new(AtomicBool::new(false));
    let clients = senders.len();
    let start = Instant::now();
    let tasks: Vec<_> = senders
        .drain(..)
        .enumerate()
        .map(|(i, mut sender)| {
            let body = body.clone();
            let done = Arc::clone(&done);
            let quota = match stop {
                Stop::Requests(n) => n / clients + usize::from(i < n % clients),
                Stop::After(_) => usize::MAX,
            };
            tokio::spawn(async move {
                let mut latencies = Vec::with_capacity(1 << 14);
                let mut tokens = 0;
                while !done.load(Ordering::Relaxed) && latencies.len() < quota {
                    let (latency, t) = one(&mut sender, &body).await;
                    latencies.push(latency);
                    tokens += t;
                }
                (sender, latencies, tokens)
            })
        })
        .collect();
    if let Stop::After(d) = stop {
        tokio::time::sleep(d).await;
        done.store(true, Ordering::Relaxed);
    }
    let mut latencies = Vec::new();
    let mut tokens = 0;
    for task in tasks {
        let (sender, l, t) = task.await.unwrap();
        senders.push(sender);
        latencies.extend(l);
        tokens += t;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let proxy = meter.read().since(proxy_before);
    let engine = Meter::Threads(&["engine-sim"]).read().since(engine_before);
    latencies.sort_unstable();
    let at = |q: f64| {
        let i = ((latencies.len() as f64 - 1.0) * q).round() as usize;
        latencies.get(i).map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    };
    let n = latencies.len().max(1) as f64;
    Figures {
        rps: latencies.len() as f64 / elapsed,
        p50_ms: at(0.50),
        p99_ms: at(0.99),
        tokens_per_s: if case.stream {
            tokens as f64 / elapsed
        } else {
            0.0
        },
        proxy_cpu_us: proxy.cpu_ns as f64 / 1000.0 / n,
        proxy_switches: proxy.switches as f64 / n,
        engine_cpu_us: engine.cpu_ns as f64 / 1000.0 / n,
        requests: latencies.len() as f64,
    }
}

/// One client sends a direct and a routed request in turn (which goes first alternates) for
/// `length`: the median of the routed-minus-direct latency of each pair, and the difference of
/// the two sides' p50, in milliseconds.
async fn paired(
    direct: &mut Sender,
    routed: &mut Sender,
    case: Case,
    length: Duration,
) -> (f64, f64) {
    let body = body(MODEL, case.stream);
    let end = Instant::now() + length;
    let mut diffs = Vec::new();
    let mut d_all = Vec::new();
    let mut r_all = Vec::new();
    let mut i = 0u64;
    while Instant::now() < end {
        let (d, r) = if i.is_multiple_of(2) {
            let d = one(direct, &body).await.0;
            (d, one(routed, &body).await.0)
        } else {
            let r = one(routed, &body).await.0;
            (one(direct, &body).await.0, r)
        };
        i += 1;
        diffs.push((r.as_secs_f64() - d.as_secs_f64()) * 1000.0);
        d_all.push(d.as_secs_f64() * 1000.0);
        r_all.push(r.as_secs_f64() * 1000.0);
    }
    (median(diffs), median(r_all) - median(d_all))
}

/// The CPU time of the two routers of `--tenants` over one segment of [`interleaved`], and the
/// requests each answered.
struct Turns {
    /// CPU time of each router over the segment, in nanoseconds.
    plain_ns: u64,
    keyed_ns: u64,
    /// The requests each router answered.
    requests: u64,
}

/// The router without keys and the one with them side by side in one segment: each client
/// sends to one and then to the other in turn (which goes first alternates), for `length`, so
/// that both serve the same number of requests over the same stretch of time and what the
/// machine's other work does (its load, the CPUs' clocks and wake-ups) falls on both alike;
/// each one's CPU time (`meters`: the plain one's, the keyed one's) and the requests.
///
/// NB: the segments of `compare` alternate the two routers every `--seconds`, and whatever
/// changes on the machine between two segments is in their ratio; over one segment of this the
/// two routers' CPU times are taken across the same instants.
async fn interleaved(
    plain: &mut Vec<Sender>,
    keyed: &mut Vec<Sender>,
    case: Case,
    length: Duration,
    meters: (&Meter, &Meter),
) -> Turns {
    let body = body(MODEL, case.stream);
    let before = (meters.0.read(), meters.1.read());
    let done = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = plain
        .drain(..)
        .zip(keyed.drain(..))
        .map(|(mut p, mut k)| {
            let body = body.clone();
            let done = Arc::clone(&done);
            tokio::spawn(async move {
                let mut pairs = 0u64;
                while !done.load(Ordering::Relaxed) {
                    if pairs.is_multiple_of(2) {
                        one(&mut p, &body).await;
                        one(&mut k, &body).await;
                    } else {
                        one(&mut k, &body).await;
                        one(&mut p, &body).await;
                    }
                    pairs += 1;
                }
                (p, k, pairs)
            })
        })
        .collect();
    tokio::time::sleep(length).await;
    done.store(true, Ordering::Relaxed);
    let mut pairs = 0;
    for task in tasks {
        let (p, k, n) = task.await.unwrap();
        plain.push(p);
        keyed.push(k);
        pairs += n;
    }
    let after = (meters.0.read(), meters.1.read());
    Turns {
        plain_ns: after.0.since(before.0).cpu_ns,
        keyed_ns: after.1.since(before.1).cpu_ns,
        requests: pairs,
    }
}

/// The router's threads: the runtime the bench starts it on (`router`) and the listener's own
/// threads (`capyctl-proxy-N`).
const ROUTER_THREADS: &[&str] = &["router", "capyctl-proxy"];

/// CPU time and context switches of a set of threads, from `/proc/self/task`.
#[derive(Default, Clone, Copy)]
struct Cpu {
    cpu_ns: u64,
    switches: u64,
}

impl Cpu {
    fn since(self, before: Cpu) -> Cpu {
        Cpu {
            cpu_ns: self.cpu_ns.saturating_sub(before.cpu_ns),
            switches: self.switches.saturating_sub(before.switches),
        }
    }
}

/// Whose CPU time a segment counts as the proxy's.
enum Meter {
    /// Nobody's (a direct connection).
    Nothing,
    /// This process's threads whose name begins with one of these (the router).
    Threads(&'static [&'static str]),
    /// Every thread of this process and of its children (nginx's master and workers).
    Process(u32),
}

impl Meter {
    fn read(&self) -> Cpu {
        match self {
            Meter::Nothing => Cpu::default(),
            Meter::Threads(prefixes) => tasks_cpu("/proc/self".as_ref(), |comm| {
                prefixes.iter().any(|p| comm.starts_with(p))
            }),
            Meter::Process(pid) => {
                let mut total = Cpu::default();
                for pid in std::iter::once(*pid).chain(children(*pid)) {
                    let one = tasks_cpu(format!("/proc/{pid}").as_ref(), |_| true);
                    total.cpu_ns += one.cpu_ns;
                    total.switches += one.switches;
                }
                total
            }
        }
    }
}

/// The processes whose parent is `pid` (from every `/proc/N/stat`).
fn children(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|child| {
            // `pid (comm) state ppid ...`; comm may hold spaces, so split after the last `)`.
            std::fs::read_to_string(format!("/proc/{child}/stat"))
                .ok()
                .and_then(|stat| {
                    let rest = &stat[stat.rfind(')')? + 1..];
                    rest.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(pid)
        })
        .collect()
}

/// The CPU time (`schedstat`: nanoseconds on a CPU, user and kernel) and the context switches
/// of a process's threads (`<process>/task/*`) whose name `keep` accepts. Threads that ended
/// meanwhile are not counted (the runtimes' threads and nginx's workers live as long as the
/// run).
fn tasks_cpu(process: &std::path::Path, keep: impl Fn(&str) -> bool) -> Cpu {
    let mut total = Cpu::default();
    let Ok(tasks) = std::fs::read_dir(process.join("task")) else {
        return total;
    };
    for task in tasks.flatten() {
        let path = task.path();
        let comm = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
        if !keep(&comm) {
            continue;
        }
        let schedstat = std::fs::read_to_string(path.join("schedstat")).unwrap_or_default();
        total.cpu_ns += schedstat
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        let status = std::fs::read_to_string(path.join("status")).unwrap_or_default();
        total.switches += status
            .lines()
            .filter(|l| l.contains("ctxt_switches:"))
            .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .sum::<u64>();
    }
    total
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

fn medians(runs: &[Figures]) -> Figures {
    let m = |f: fn(&Figures) -> f64| median(runs.iter().map(f).collect());
    Figures {
        rps: m(|f| f.rps),
        p50_ms: m(|f| f.p50_ms),
        p99_ms: m(|f| f.p99_ms),
        tokens_per_s: m(|f| f.tokens_per_s),
        proxy_cpu_us: m(|f| f.proxy_cpu_us),
        proxy_switches: m(|f| f.proxy_switches),
        engine_cpu_us: m(|f| f.engine_cpu_us),
        requests: m(|f| f.requests),
    }
}

fn print_row(target: &str, f: &Figures) {
    println!(
        "    {target:<7} {:>10.0} req/s   p50 {:>7.3} ms   p99 {:>7.3} ms   {:>10.0} tok/s",
        f.rps, f.p50_ms, f.p99_ms, f.tokens_per_s
    );
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn main() {
    if std::env::args().any(|a| a == "--replicas") {
        replicas::main(std::env::args().skip(1));
        return;
    }
    let args = args();
    if let Some((router, waiting)) = args.memory_clients {
        memory_clients(router, waiting);
        return;
    }
    if let Some((engine, tenants)) = args.router_child {
        router_child(&args, engine, tenants);
        return;
    }
    let sim_rt = runtime("engine-sim", args.sim_threads);
    let proxy_rt = runtime("router", args.router_threads);
    let load_rt = runtime("load", args.load_threads);
    let sim = run(&sim_rt, start_sim());

    if args.memory {
        memory(&args, sim, &proxy_rt);
        return;
    }

    let mut upstreams = Vec::new();
    if args.upstream != "canned" {
        upstreams.push(("engine-sim at token rate 0", sim));
    }
    if args.upstream != "sim" {
        upstreams.push((
            "canned upstream (no engine work)",
            run(&sim_rt, start_canned()),
        ));
    }
    let threads = |n: usize| match n {
        0 => "a current-thread runtime".to_string(),
        n => format!("{n} worker threads"),
    };
    println!(
        "router benchmark: {} tokens per answer; engine on {}, load on {}, router started on {}{}; admission: {}, observer: {}; {} CPU(s)",
        tokens(),
        threads(args.sim_threads),
        threads(args.load_threads),
        threads(args.router_threads),
        listener_threads_note(&args),
        match args.admission {
            AdmissionKind::Coordinator => "coordinator",
            AdmissionKind::Trivial => "trivial",
        },
        if args.observer {
            "like the server's"
        } else {
            "none"
        },
        std::thread::available_parallelism().map_or(0, usize::from),
    );
    if let Some(n) = args.profile {
        let upstream = upstreams.first().map(|u| u.1).unwrap();
        let (router, _handle) = run(
            &proxy_rt,
            start_proxy_with(
                upstream,
                Setup::of(&args),
                RouterConfig::default(),
                args.tenants.map(|n| bench_tenants(n, !args.no_token_rate)),
            ),
        );
        let case = Case {
            clients: args.clients.first().copied().unwrap_or(1),
            stream: args.stream,
        };
        let f = run(&load_rt, async move {
            let mut senders = open_clients(router, case).await;
            segment(
                &mut senders,
                case,
                Stop::Requests(n),
                &Meter::Threads(ROUTER_THREADS),
            )
            .await
        });
        println!(
            "profile: {n} requests through the router, {} client(s), {}: {:.0} req/s, router {:.1} µs CPU and {:.2} context switches per request, engine {:.1} µs",
            case.clients,
            if case.stream {
                "streamed"
            } else {
                "not streamed"
            },
            f.rps,
            f.proxy_cpu_us,
            f.proxy_switches,
            f.engine_cpu_us,
        );
        return;
    }
    println!(
        "{} rounds of {:.1} s per side and case, alternating; medians",
        args.rounds, args.seconds
    );
    for (name, upstream) in upstreams {
        println!("== {name}");
        let mut cases = Vec::new();
        for &clients in &args.clients {
            for stream in [false, true] {
                cases.push(Case { clients, stream });
            }
        }
        let mut sides = vec![Side {
            name: "direct",
            addr: upstream,
            meter: Meter::Nothing,
        }];
        // With `--tenants`, both routers in processes of their own (each one's CPU is then its
        // process's alone); otherwise the router on this process's runtime `router`.
        let mut processes = Vec::new();
        // (The coordinator's handle keeps it running.)
        let _coordinator: Option<CoordinatorHandle> = match args.tenants {
            None => {
                let (router, handle) = run(
                    &proxy_rt,
                    start_proxy(upstream, Setup::of(&args), RouterConfig::default()),
                );
                sides.push(Side {
                    name: "router",
                    addr: router,
                    meter: Meter::Threads(ROUTER_THREADS),
                });
                handle
            }
            Some(n) => {
                let _ = AUTHORIZATION.set(bench_key(n));
                for (side, tenants) in [("router", 0), ("router+keys", n)] {
                    let process = RouterProcess::start(upstream, tenants);
                    sides.push(Side {
                        name: side,
                        addr: process.addr,
                        meter: process.meter(),
                    });
                    processes.push(process);
                }
                None
            }
        };
        let nginx = args.nginx.as_deref().map(|b| Nginx::start(b, upstream));
        if let Some(nginx) = &nginx {
            sides.push(Side {
                name: "nginx",
                addr: nginx.addr,
                meter: Meter::Process(nginx.child.id()),
            });
        }
        let rounds = args.rounds;
        let seconds = args.seconds;
        run(&load_rt, compare(sides, cases, rounds, seconds));
        drop(nginx);
        drop(processes);
    }
}

/// One way to the engine: directly, through the router, or through nginx.
struct Side {
    name: &'static str,
    addr: SocketAddr,
    meter: Meter,
}

/// Alternates the sides' segments of every case (the first side is the direct one; the order
/// is reversed from round to round) and prints the medians.
async fn compare(sides: Vec<Side>, cases: Vec<Case>, rounds: usize, seconds: f64) {
    let length = Stop::After(Duration::from_secs_f64(seconds));
    for case in cases {
        let mut clients = Vec::new();
        for side in &sides {
            clients.push(open_clients(side.addr, case).await);
        }
        let mut runs: Vec<Vec<Figures>> = sides.iter().map(|_| Vec::new()).collect();
        for round in 0..rounds {
            // Forwards, then backwards: neighbours stay next to each other (the two routers of
            // `--tenants`), and which of them goes first alternates.
            for k in 0..sides.len() {
                let i = if round.is_multiple_of(2) {
                    k
                } else {
                    sides.len() - 1 - k
                };
                let f = segment(&mut clients[i], case, length, &sides[i].meter).await;
                runs[i].push(f);
            }
        }
        // One client: also request by request, a direct one and a proxied one in turn, so that
        // what the machine's other work does to both is the same; the median of the per-pair
        // differences is what the proxy adds.
        let mut pairs: Vec<Vec<(f64, f64)>> = sides.iter().map(|_| Vec::new()).collect();
        if case.clients == 1 {
            let (direct, proxied) = clients.split_at_mut(1);
            for _ in 0..rounds {
                for (i, proxied) in proxied.iter_mut().enumerate() {
                    pairs[i + 1].push(
                        paired(
                            &mut direct[0][0],
                            &mut proxied[0],
                            case,
                            Duration::from_secs_f64(seconds),
                        )
                        .await,
                    );
                }
            }
        }
        // The two routers of `--tenants` in the same segments too, request by request (see
        // `interleaved`).
        let keyed_side = sides.iter().position(|s| s.name == "router+keys");
        let mut turns = Vec::new();
        if let Some(k) = keyed_side {
            for _ in 0..rounds {
                let (head, tail) = clients.split_at_mut(k);
                turns.push(
                    interleaved(
                        &mut head[1],
                        &mut tail[0],
                        case,
                        Duration::from_secs_f64(seconds),
                        (&sides[1].meter, &sides[k].meter),
                    )
                    .await,
                );
            }
        }
        let figures: Vec<Figures> = runs.iter().map(|r| medians(r)).collect();
        println!(
            "{} client(s), {}:",
            case.clients,
            if case.stream {
                "streamed"
            } else {
                "not streamed"
            }
        );
        for (side, f) in sides.iter().zip(&figures) {
            print_row(side.name, f);
        }
        let d = &figures[0];
        for (i, side) in sides.iter().enumerate().skip(1) {
            let r = &figures[i];
            let name = side.name;
            let tokens = if case.stream {
                format!("   tok/s ratio {:.3}", r.tokens_per_s / d.tokens_per_s)
            } else {
                String::new()
            };
            println!(
                "    {name}/direct: req/s {:.3}   added p50 {:.3} ms   added p99 {:.3} ms{tokens}",
                r.rps / d.rps,
                r.p50_ms - d.p50_ms,
                r.p99_ms - d.p99_ms
            );
            println!(
                "    CPU per request: {name} {:.1} µs ({:.2} context switches), engine {:.1} µs direct / {:.1} µs through {name}",
                r.proxy_cpu_us, r.proxy_switches, d.engine_cpu_us, r.engine_cpu_us
            );
            if !pairs[i].is_empty() {
                let added: Vec<f64> = pairs[i].iter().map(|p| p.0).collect();
                let p50s: Vec<f64> = pairs[i].iter().map(|p| p.1).collect();
                println!(
                    "    {name}, paired request by request: added {:.3} ms (median of per-pair differences; rounds {:.3}–{:.3}), added p50 {:.3} ms",
                    median(added.clone()),
                    added.iter().copied().fold(f64::INFINITY, f64::min),
                    added.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                    median(p50s),
                );
            }
        }
        if let Some(k) = keyed_side {
            let (r, keyed) = (&figures[1], &figures[k]);
            // The CPU per request over all rounds (all CPU time over all requests), and each
            // round's ratio of the two routers' segments, which run next to each other.
            let per_request = |runs: &[Figures]| {
                let cpu: f64 = runs.iter().map(|f| f.proxy_cpu_us * f.requests).sum();
                cpu / runs.iter().map(|f| f.requests).sum::<f64>().max(1.0)
            };
            let (plain_us, keyed_us) = (per_request(&runs[1]), per_request(&runs[k]));
            let each: Vec<f64> = runs[k]
                .iter()
                .zip(&runs[1])
                .map(|(a, b)| a.proxy_cpu_us / b.proxy_cpu_us)
                .collect();
            println!(
                "    router+keys/router: CPU per request {:.3} over all rounds ({keyed_us:.1} against {plain_us:.1} µs; each round's ratio: median {:.3}, {:.3}–{:.3})   req/s {:.3}   added p50 {:.3} ms",
                keyed_us / plain_us,
                median(each.clone()),
                each.iter().copied().fold(f64::INFINITY, f64::min),
                each.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                keyed.rps / r.rps,
                keyed.p50_ms - r.p50_ms,
            );
            // All CPU time over all requests (each router answered as many).
            let requests = turns.iter().map(|t| t.requests).sum::<u64>().max(1) as f64;
            let (plain_us, keyed_us) = (
                turns.iter().map(|t| t.plain_ns).sum::<u64>() as f64 / 1000.0 / requests,
                turns.iter().map(|t| t.keyed_ns).sum::<u64>() as f64 / 1000.0 / requests,
            );
            let each: Vec<f64> = turns
                .iter()
                .map(|t| t.keyed_ns as f64 / t.plain_ns.max(1) as f64)
                .collect();
            println!(
                "    router+keys/router, request by request: CPU per request {:.3} over all rounds ({:.1} against {:.1} µs; each round's ratio: median {:.3}, {:.3}–{:.3})",
                keyed_us / plain_us,
                keyed_us,
                plain_us,
                median(each.clone()),
                each.iter().copied().fold(f64::INFINITY, f64::min),
                each.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            );
        }
        if sides.len() > 2 {
            let r = &figures[1];
            for (side, n) in sides.iter().zip(&figures).skip(2) {
                if side.name == "router+keys" {
                    continue;
                }
                println!(
                    "    router/{}: req/s {:.3}   router CPU per request / {}'s {:.2}",
                    side.name,
                    r.rps / n.rps,
                    side.name,
                    r.proxy_cpu_us / n.proxy_cpu_us
                );
            }
        }
    }
}

/// nginx as a plain reverse proxy in front of `upstream` (HTTP/1.1 with keep-alive to it,
/// unbuffered so that streams pass as they come, no access log, connections not closed after
/// nginx's default 1000 requests), stopped when dropped.
struct Nginx {
    binary: String,
    child: std::process::Child,
    addr: SocketAddr,
    dir: std::path::PathBuf,
}

impl Nginx {
    fn start(binary: &str, upstream: SocketAddr) -> Nginx {
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let dir = std::env::temp_dir().join(format!("capyctl-bench-nginx-{}", addr.port()));
        std::fs::create_dir_all(&dir).unwrap();
        let d = dir.display();
        let conf = format!(
            "worker_processes auto;\n\
             error_log {d}/error.log warn;\n\
             pid {d}/nginx.pid;\n\
             events {{ worker_connections 4096; }}\n\
             http {{\n\
               access_log off;\n\
               keepalive_requests 100000000;\n\
               keepalive_timeout 600s;\n\
               client_body_temp_path {d}/body;\n\
               proxy_temp_path {d}/proxy;\n\
               fastcgi_temp_path {d}/fastcgi;\n\
               uwsgi_temp_path {d}/uwsgi;\n\
               scgi_temp_path {d}/scgi;\n\
               upstream engine {{ server {upstream}; keepalive 64; keepalive_requests 100000000; keepalive_timeout 600s; }}\n\
               server {{\n\
                 listen {addr};\n\
                 location / {{\n\
                   proxy_pass http://engine;\n\
                   proxy_http_version 1.1;\n\
                   proxy_set_header Connection \"\";\n\
                   proxy_buffering off;\n\
                 }}\n\
               }}\n\
             }}\n"
        );
        let conf_path = dir.join("nginx.conf");
        std::fs::write(&conf_path, conf).unwrap();
        let child = std::process::Command::new(binary)
            .arg("-p")
            .arg(&dir)
            .arg("-c")
            .arg(&conf_path)
            .args(["-g", "daemon off;"])
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {binary}: {e}"));
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(addr).is_err() {
            assert!(
                Instant::now() < deadline,
                "nginx did not listen on {addr} within 10 s (see {d}/error.log)"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Nginx {
            binary: binary.to_string(),
            child,
            addr,
            dir,
        }
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // `-s stop` (SIGTERM to the master) takes the workers down too; a SIGKILL would not.
        let stopped = std::process::Command::new(&self.binary)
            .arg("-p")
            .arg(&self.dir)
            .arg("-c")
            .arg(self.dir.join("nginx.conf"))
            .args(["-s", "stop"])
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !stopped {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// RSS with `args.waiting` requests waiting in the coordinator for a deployment that never
/// becomes ready. The clients run in a child process (this binary with `--memory-clients`), so
/// the growth measured here is the router's alone (the engine simulator, idle, shares the
/// process but does not grow).
fn memory(args: &Args, sim: SocketAddr, proxy_rt: &Handle) {
    let waiting = args.waiting;
    let config = RouterConfig {
        max_pending_per_deployment: waiting,
        max_pending_total: waiting,
        ..RouterConfig::default()
    };
    let (router, handle) = run(
        proxy_rt,
        start_proxy(
            sim,
            Setup {
                kind: AdmissionKind::Coordinator,
                observer: false,
                listener_threads: args.listener_threads,
            },
            config,
        ),
    );
    let handle = handle.unwrap();
    let before = rss_kib();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--memory-clients",
            &router.to_string(),
            &waiting.to_string(),
        ])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let now = run(proxy_rt, async move {
        loop {
            let now: usize = handle.load().await.iter().map(|d| d.waiting).sum();
            if now >= waiting || started.elapsed() > Duration::from_secs(60) {
                return now;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    let after = rss_kib();
    let _ = child.kill();
    let _ = child.wait();
    println!(
        "{now} requests waiting after {:.1} s",
        started.elapsed().as_secs_f64()
    );
    println!(
        "router RSS before {:.1} MiB, with {waiting} waiting {:.1} MiB: {:.1} MiB more, {:.1} KiB per waiting request (connection, request future, body; clients in another process)",
        before as f64 / 1024.0,
        after as f64 / 1024.0,
        (after.saturating_sub(before)) as f64 / 1024.0,
        (after.saturating_sub(before)) as f64 / waiting as f64
    );
}

/// The child of `--memory`: `waiting` clients, each on its own connection, each sending one
/// request for the parked deployment; then waits to be killed.
fn memory_clients(router: SocketAddr, waiting: usize) {
    let load_rt = runtime("load", 2);
    let body = body(PARKED, false);
    run(&load_rt, async move {
        for _ in 0..waiting {
            let body = body.clone();
            tokio::spawn(async move {
                let mut sender = connect(router).await;
                let request = http::Request::post("/v1/chat/completions")
                    .header("host", "bench")
                    .header("content-type", "application/json")
                    .body(Full::new(body))
                    .unwrap();
                let _ = sender.send_request(request).await;
            });
        }
        std::future::pending::<()>().await
    });
}
