//! The listener against a direct connection to the engine, side by side in one run.
//!
//! ```text
//! cargo bench -p capyctl-router --bench proxy                 # ~40 s: 1 and 32 clients
//! cargo bench -p capyctl-router --bench proxy -- --help       # the options
//! cargo bench -p capyctl-router --bench proxy -- --memory     # router RSS, 4096 requests waiting
//! cargo bench -p capyctl-router --bench proxy -- --seconds 2 --rounds 5 --admission trivial
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
use capyctl_crds::errors::ApiError;
use capyctl_router::admission::{Admission, Permit};
use capyctl_router::config::RouterConfig;
use capyctl_router::coordinator::{Coordinator, CoordinatorHandle};
use capyctl_router::lifecycle::{
    BoxFuture, DeploymentId, DeploymentRef, InstanceKey, Lifecycle, Plan, SwitchOrder, Upstream,
};
use capyctl_router::proxy::{ModelEntry, Proxy, ProxyConfig, serve};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use std::future::Future;
use tokio::net::{TcpListener, TcpStream};

use tokio::runtime::Handle;

const MODEL: &str = "bench-model";
const PARKED: &str = "parked-model";
const DEPLOYMENT: &str = "01BENCH0000000000000000000";
const PARKED_DEPLOYMENT: &str = "01PARKED000000000000000000";
const TOKENS: u32 = 16;

const USAGE: &str = "\
The router against a direct connection to the engine, side by side (medians of alternating rounds).

usage: cargo bench -p capyctl-router --bench proxy -- [options]

  (no options)             1 and 32 clients, streamed and not, engine-sim and a canned upstream (~40 s)
  --seconds S              length of one segment per side (default 0.8)
  --rounds N               alternating rounds per case (default 3)
  --clients 1,32           concurrent clients, comma-separated
  --admission A            coordinator (default: the real switch coordinator) | trivial
  --upstream U             both (default) | sim | canned
  --router-threads N       the router's worker threads (default 2; 0: a current-thread runtime)
  --memory                 the router's RSS with --waiting requests waiting for a parked deployment
                           (the clients run in a child process)
  --waiting N              for --memory (default 4096)
  -h, --help               this text";

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
    memory: bool,
    waiting: usize,
    router_threads: usize,
    upstream: String,
    /// `--memory-clients ADDR N`: the client side of `--memory` (a child process).
    memory_clients: Option<(SocketAddr, usize)>,
}

fn args() -> Args {
    let mut args = Args {
        seconds: 0.8,
        rounds: 3,
        clients: vec![1, 32],
        admission: AdmissionKind::Coordinator,
        memory: false,
        waiting: 4096,
        router_threads: 2,
        upstream: "both".to_string(),
        memory_clients: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--seconds" => args.seconds = it.next().and_then(|v| v.parse().ok()).unwrap_or(1.0),
            "--rounds" => args.rounds = it.next().and_then(|v| v.parse().ok()).unwrap_or(3),
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
            "--memory" => args.memory = true,
            "--upstream" => args.upstream = it.next().unwrap_or_default(),
            "--router-threads" => {
                args.router_threads = it.next().and_then(|v| v.parse().ok()).unwrap_or(2);
            }
            "--waiting" => args.waiting = it.next().and_then(|v| v.parse().ok()).unwrap_or(4096),
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
}

impl Admission for Trivial {
    type Permit = TrivialPermit;

    fn resolve(&self, model: &str) -> Option<DeploymentRef> {
        (model == MODEL).then(|| DeploymentRef {
            id: DEPLOYMENT.to_string(),
            name: MODEL.to_string(),
        })
    }

    async fn admit(
        &self,
        _deployment: DeploymentRef,
        _body_bytes: u64,
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
            }),
            PARKED => Some(DeploymentRef {
                id: PARKED_DEPLOYMENT.to_string(),
                name: PARKED.to_string(),
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
    ) -> BoxFuture<'a, Result<Plan, ApiError>> {
        Box::pin(async { Ok(Plan::AlreadyComing) })
    }

    fn execute(&self, _order: SwitchOrder) -> BoxFuture<'_, Result<(), ApiError>> {
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
    let config = capyctl_engine_sim::SimConfig::try_parse_from([
        "engine-sim",
        "serve",
        "Qwen3-4B",
        "--served-model-name",
        MODEL,
        "--port",
        "0",
        "--sim-token-rate",
        "0",
    ])
    .unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    // The simulator's own `serve` leaves Nagle on, which costs a streamed answer 40 ms per
    // delayed ACK; an engine (uvicorn) sets TCP_NODELAY.
    use axum::serve::ListenerExt;
    let listener = listener.tap_io(|stream| {
        let _ = stream.set_nodelay(true);
    });
    let app = capyctl_engine_sim::app(capyctl_engine_sim::EngineSim::new(config));
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    addr
}

/// An upstream that answers at once with bytes shaped like the simulator's (a whole answer of
/// about 500 bytes; a stream of 16 token events, the finish event and `[DONE]`, each written
/// on its own as an engine does), with no timer anywhere: what is left is the HTTP cost.
async fn start_canned() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let chunk = |content: &str, finish: &str| {
        Bytes::from(format!(
            "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1796237011,\"model\":\"{MODEL}\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{content}\"}},\"logprobs\":null,\"finish_reason\":{finish}}}]}}\n\n"
        ))
    };
    let mut events: Vec<Bytes> = (0..TOKENS)
        .map(|i| chunk(&format!(" word{i}"), "null"))
        .collect();
    events.push(chunk("", "\"length\""));
    events.push(Bytes::from_static(b"data: [DONE]\n\n"));
    let events = Arc::new(events);
    let whole = Arc::new(vec![Bytes::from(format!(
        "{{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion\",\"created\":1796237011,\"model\":\"{MODEL}\",\"choices\":[{{\"index\":0,\"message\":{{\"role\":\"assistant\",\"content\":\"{}\"}},\"logprobs\":null,\"finish_reason\":\"length\"}}],\"usage\":{{\"prompt_tokens\":12,\"completion_tokens\":16,\"total_tokens\":28}}}}",
        (0..TOKENS).map(|i| format!(" word{i}")).collect::<String>()
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

/// Starts the proxy (on the current runtime); returns its address and, with the coordinator,
/// its handle.
async fn start_proxy(
    sim: SocketAddr,
    kind: AdmissionKind,
    router_config: RouterConfig,
) -> (SocketAddr, Option<CoordinatorHandle>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = ProxyConfig {
        request_deadline: router_config.request_deadline,
        max_body_bytes: router_config.max_buffered_bytes_total,
        ..ProxyConfig::default()
    };
    match kind {
        AdmissionKind::Trivial => {
            let proxy = Proxy::new(Trivial(Arc::new(upstream(sim))), catalog, config);
            tokio::spawn(serve(listener, proxy, std::future::pending()));
            (addr, None)
        }
        AdmissionKind::Coordinator => {
            let handle = Coordinator::spawn(Arc::new(BenchLifecycle), router_config);
            handle.instance_ready(upstream(sim)).await;
            let proxy = Proxy::new(handle.clone(), catalog, config);
            tokio::spawn(serve(listener, proxy, std::future::pending()));
            (addr, Some(handle))
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
        r#"{{"model":"{model}","messages":[{{"role":"user","content":"Tell me about capybaras"}}],"max_tokens":{TOKENS},"stream":{stream}}}"#
    ))
}

#[derive(Default, Clone, Copy)]
struct Figures {
    rps: f64,
    p50_ms: f64,
    p99_ms: f64,
    tokens_per_s: f64,
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
    let request = http::Request::post("/v1/chat/completions")
        .header("host", "bench")
        .header("content-type", "application/json")
        .body(Full::new(body.clone()))
        .unwrap();
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

/// Runs `case` against `addr` for `seconds` on fresh keep-alive connections.
async fn segment(addr: SocketAddr, case: Case, seconds: f64) -> Figures {
    let body = body(MODEL, case.stream);
    let mut senders = Vec::new();
    for _ in 0..case.clients {
        senders.push(connect(addr).await);
    }
    // Warm the connections (and the router's pool).
    for sender in &mut senders {
        one(sender, &body).await;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let tasks: Vec<_> = senders
        .into_iter()
        .map(|mut sender| {
            let body = body.clone();
            let stop = Arc::clone(&stop);
            tokio::spawn(async move {
                let mut latencies = Vec::with_capacity(1 << 14);
                let mut tokens = 0;
                while !stop.load(Ordering::Relaxed) {
                    let (latency, t) = one(&mut sender, &body).await;
                    latencies.push(latency);
                    tokens += t;
                }
                (latencies, tokens)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let mut latencies = Vec::new();
    let mut tokens = 0;
    for task in tasks {
        let (l, t) = task.await.unwrap();
        latencies.extend(l);
        tokens += t;
    }
    let elapsed = start.elapsed().as_secs_f64();
    latencies.sort_unstable();
    let at = |q: f64| {
        let i = ((latencies.len() as f64 - 1.0) * q).round() as usize;
        latencies.get(i).map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    };
    Figures {
        rps: latencies.len() as f64 / elapsed,
        p50_ms: at(0.50),
        p99_ms: at(0.99),
        tokens_per_s: if case.stream {
            tokens as f64 / elapsed
        } else {
            0.0
        },
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

fn medians(runs: &[Figures]) -> Figures {
    Figures {
        rps: median(runs.iter().map(|f| f.rps).collect()),
        p50_ms: median(runs.iter().map(|f| f.p50_ms).collect()),
        p99_ms: median(runs.iter().map(|f| f.p99_ms).collect()),
        tokens_per_s: median(runs.iter().map(|f| f.tokens_per_s).collect()),
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
    let args = args();
    if let Some((router, waiting)) = args.memory_clients {
        memory_clients(router, waiting);
        return;
    }
    let sim_rt = runtime("engine-sim", 2);
    let proxy_rt = runtime("router", args.router_threads);
    let load_rt = runtime("load", 2);
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
    println!(
        "router benchmark: {TOKENS} tokens per answer, {} rounds of {:.1} s per side, router on {}, admission: {}",
        args.rounds,
        args.seconds,
        match args.router_threads {
            0 => "a current-thread runtime".to_string(),
            n => format!("{n} worker threads"),
        },
        match args.admission {
            AdmissionKind::Coordinator => "coordinator",
            AdmissionKind::Trivial => "trivial",
        }
    );
    for (name, upstream) in upstreams {
        let (router, _handle) = run(
            &proxy_rt,
            start_proxy(upstream, args.admission, RouterConfig::default()),
        );
        println!("== {name}");
        let mut cases = Vec::new();
        for &clients in &args.clients {
            for stream in [false, true] {
                cases.push(Case { clients, stream });
            }
        }
        let rounds = args.rounds;
        let seconds = args.seconds;
        run(&load_rt, compare(upstream, router, cases, rounds, seconds));
    }
}

/// Alternates direct and routed segments of every case and prints the medians.
async fn compare(
    direct_addr: SocketAddr,
    router: SocketAddr,
    cases: Vec<Case>,
    rounds: usize,
    seconds: f64,
) {
    // Warm-up: both paths, every connection pool.
    for case in &cases {
        segment(direct_addr, *case, 0.1).await;
        segment(router, *case, 0.1).await;
    }
    for case in cases {
        let mut direct = Vec::new();
        let mut routed = Vec::new();
        for round in 0..rounds {
            // Alternate which side goes first.
            if round % 2 == 0 {
                direct.push(segment(direct_addr, case, seconds).await);
                routed.push(segment(router, case, seconds).await);
            } else {
                routed.push(segment(router, case, seconds).await);
                direct.push(segment(direct_addr, case, seconds).await);
            }
        }
        let d = medians(&direct);
        let r = medians(&routed);
        println!(
            "{} client(s), {}:",
            case.clients,
            if case.stream {
                "streamed"
            } else {
                "not streamed"
            }
        );
        print_row("direct", &d);
        print_row("router", &r);
        let tokens = if case.stream {
            format!("   tok/s ratio {:.3}", r.tokens_per_s / d.tokens_per_s)
        } else {
            String::new()
        };
        println!(
            "    router/direct: req/s {:.3}   added p50 {:.3} ms   added p99 {:.3} ms{tokens}",
            r.rps / d.rps,
            r.p50_ms - d.p50_ms,
            r.p99_ms - d.p99_ms
        );
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
        start_proxy(sim, AdmissionKind::Coordinator, config),
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
