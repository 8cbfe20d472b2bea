//! Shared by the `proxy_*` tests: the engine simulator in-process, a recording `Admission`, the
//! proxy on a real socket, and a raw HTTP/1.1 client whose connection a test can drop.

#![allow(clippy::unwrap_used, dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use capyctl_engine_sim::SimConfig;
use capyctl_interfaces::router::{DeploymentRef, InstanceKey, Upstream};
use capyctl_router::admission::{Admission, Permit};
use capyctl_router::proxy::{ModelEntry, Proxy, ProxyConfig, serve};
use capyctl_spec::errors::ApiError;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore};
use tokio::time::Instant;

/// The deployment ID the test admission uses.
pub const DEPLOYMENT: &str = "01M3R7A6YJW402N962HH17A66W";
/// The model name it resolves.
pub const MODEL: &str = "chat-a";

/// Generous bound for anything a test waits on.
pub const PATIENCE: Duration = Duration::from_secs(20);

/// Starts the engine simulator in-process; `extra` are more launch arguments.
pub async fn start_sim(extra: &[&str]) -> SocketAddr {
    let mut args = vec![
        "engine-sim",
        "serve",
        "Qwen3-4B",
        "--served-model-name",
        MODEL,
        "--port",
        "0",
    ];
    args.extend_from_slice(extra);
    let config = SimConfig::try_parse_from(args).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = capyctl_engine_sim::serve(listener, config).await;
    });
    addr
}

/// Starts a TensorFold simulator (`--model`, role-only opening chunk).
pub async fn start_tensorfold(extra: &[&str]) -> SocketAddr {
    let mut args = vec![
        "engine-sim",
        "--engine",
        "tensorfold",
        "--model",
        "Qwen3-4B",
        "--served-model-name",
        MODEL,
        "--port",
        "0",
    ];
    args.extend_from_slice(extra);
    let config = SimConfig::try_parse_from(args).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = capyctl_engine_sim::serve(listener, config).await;
    });
    addr
}

/// What happened to the permits the test admission handed out.
#[derive(Debug, Default)]
pub struct Record {
    /// Permits handed out.
    pub issued: AtomicUsize,
    /// Permits alive now.
    pub live: AtomicUsize,
    /// The most alive at once.
    pub peak: AtomicUsize,
    /// `first_output` calls.
    pub first_outputs: AtomicUsize,
    /// `cut` calls, and whether the permit had seen output then.
    pub cuts: Mutex<Vec<bool>>,
    /// `admit` calls begun.
    pub entered: AtomicUsize,
    /// Admit futures dropped before they resolved (the client went away while waiting).
    pub abandoned_waits: AtomicUsize,
    /// Told on every change.
    pub changed: Notify,
}

impl Record {
    /// Waits until `check` holds, or panics after [`PATIENCE`].
    pub async fn wait(&self, what: &str, check: impl Fn(&Record) -> bool) {
        let end = Instant::now() + PATIENCE;
        loop {
            let changed = self.changed.notified();
            if check(self) {
                return;
            }
            if tokio::time::timeout_at(end, changed).await.is_err() {
                panic!("timed out waiting for {what}: {self:?}");
            }
        }
    }

    /// Cuts so far.
    pub fn cut_count(&self) -> usize {
        self.cuts.lock().unwrap().len()
    }
}

/// How the test admission answers `admit`.
#[derive(Debug, Clone)]
pub enum Mode {
    /// Admit at once (or when one of `limit` permits is free).
    Admit,
    /// Fail with this error.
    Refuse(ApiError),
    /// Never admit; fail with `QueueDeadline` at the deadline.
    Hold,
    /// Never answer at all, not even at the deadline (an admission that breaks its contract).
    Never,
}

/// One deployment on one upstream.
#[derive(Clone)]
pub struct TestAdmission {
    upstream: Upstream,
    mode: Mode,
    limit: Option<Arc<Semaphore>>,
    /// What happened.
    pub record: Arc<Record>,
}

impl TestAdmission {
    /// Admits every request for [`MODEL`] to `addr`.
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            upstream: Upstream {
                key: InstanceKey {
                    deployment: DEPLOYMENT.to_string(),
                    index: 0,
                    host_id: "test".to_string(),
                    generation: 1,
                },
                addr,
            },
            mode: Mode::Admit,
            limit: None,
            record: Arc::new(Record::default()),
        }
    }

    /// Answers `admit` this way.
    pub fn with_mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// At most `n` permits at once; the rest wait.
    pub fn with_limit(mut self, n: usize) -> Self {
        self.limit = Some(Arc::new(Semaphore::new(n)));
        self
    }
}

/// Counts a wait that was dropped before it resolved.
struct WaitGuard(Arc<Record>, bool);

impl Drop for WaitGuard {
    fn drop(&mut self) {
        if !self.1 {
            self.0.abandoned_waits.fetch_add(1, Ordering::SeqCst);
            self.0.changed.notify_waiters();
        }
    }
}

/// The test permit: records what the proxy tells it.
pub struct TestPermit {
    upstream: Upstream,
    record: Arc<Record>,
    output: AtomicUsize,
    _slot: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Permit for TestPermit {
    fn upstream(&self) -> &Upstream {
        &self.upstream
    }

    fn first_output(&self) {
        self.output.fetch_add(1, Ordering::SeqCst);
        self.record.first_outputs.fetch_add(1, Ordering::SeqCst);
        self.record.changed.notify_waiters();
    }

    fn cut(&self) {
        let had_output = self.output.load(Ordering::SeqCst) > 0;
        self.record.cuts.lock().unwrap().push(had_output);
        self.record.changed.notify_waiters();
    }

    fn waited_at_bound(&self) -> Duration {
        Duration::ZERO
    }
}

impl Drop for TestPermit {
    fn drop(&mut self) {
        self.record.live.fetch_sub(1, Ordering::SeqCst);
        self.record.changed.notify_waiters();
    }
}

impl Admission for TestAdmission {
    type Permit = TestPermit;

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
        deployment: DeploymentRef,
        deadline: Instant,
    ) -> Result<TestPermit, ApiError> {
        self.record.entered.fetch_add(1, Ordering::SeqCst);
        self.record.changed.notify_waiters();
        let mut guard = WaitGuard(Arc::clone(&self.record), false);
        let slot = match (&self.mode, &self.limit) {
            (Mode::Refuse(err), _) => {
                guard.1 = true;
                return Err(err.clone());
            }
            (Mode::Never, _) => std::future::pending().await,
            (Mode::Hold, _) => {
                tokio::time::sleep_until(deadline).await;
                guard.1 = true;
                return Err(ApiError::QueueDeadline {
                    deployment: deployment.id,
                });
            }
            (Mode::Admit, None) => None,
            (Mode::Admit, Some(limit)) => {
                match tokio::time::timeout_at(deadline, Arc::clone(limit).acquire_owned()).await {
                    Ok(slot) => Some(slot.unwrap()),
                    Err(_) => {
                        guard.1 = true;
                        return Err(ApiError::InFlightDeadline {
                            deployment: deployment.id,
                        });
                    }
                }
            }
        };
        guard.1 = true;
        self.record.issued.fetch_add(1, Ordering::SeqCst);
        let live = self.record.live.fetch_add(1, Ordering::SeqCst) + 1;
        self.record.peak.fetch_max(live, Ordering::SeqCst);
        self.record.changed.notify_waiters();
        Ok(TestPermit {
            upstream: self.upstream.clone(),
            record: Arc::clone(&self.record),
            output: AtomicUsize::new(0),
            _slot: slot,
        })
    }
}

/// The catalogue the tests list.
pub fn catalog() -> Vec<ModelEntry> {
    vec![ModelEntry {
        id: MODEL.to_string(),
        deployment_id: DEPLOYMENT.to_string(),
        state: "ready".to_string(),
    }]
}

/// Serves a proxy in front of `admission` on a fresh port; runs until the test ends.
pub async fn start_proxy(admission: TestAdmission, config: ProxyConfig) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let proxy = Proxy::new(admission, catalog, config);
    tokio::spawn(serve(listener, proxy, std::future::pending()));
    addr
}

/// A proxy in front of a fresh simulator that takes request bodies of at most `limit` bytes,
/// with the record of its admission.
pub async fn start_bounded_proxy(limit: u64) -> (SocketAddr, Arc<Record>) {
    let sim = start_sim(&[]).await;
    let admission = TestAdmission::new(sim);
    let record = Arc::clone(&admission.record);
    let config = ProxyConfig {
        max_buffered_bytes_total: limit,
        ..ProxyConfig::default()
    };
    (start_proxy(admission, config).await, record)
}

/// Like [`start_proxy`], telling `observer` of every request.
pub async fn start_observed_proxy(
    admission: TestAdmission,
    config: ProxyConfig,
    observer: Arc<dyn capyctl_router::observe::RequestObserver>,
) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let proxy = Proxy::new(admission, catalog, config).with_observer(observer);
    tokio::spawn(serve(listener, proxy, std::future::pending()));
    addr
}

/// Like [`start_observed_proxy`], serving until `stop` is sent; the task ends once every
/// connection has ended (so every report has been made).
pub async fn start_observed_proxy_until(
    admission: TestAdmission,
    config: ProxyConfig,
    observer: Arc<dyn capyctl_router::observe::RequestObserver>,
    stop: tokio::sync::oneshot::Receiver<()>,
) -> (SocketAddr, tokio::task::JoinHandle<std::io::Result<()>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let proxy = Proxy::new(admission, catalog, config).with_observer(observer);
    let server = tokio::spawn(serve(listener, proxy, async move {
        let _ = stop.await;
    }));
    (addr, server)
}

/// Waits (at most [`PATIENCE`]) for a listener started by [`start_observed_proxy_until`] to
/// have stopped, with every connection ended.
pub async fn until_stopped(server: tokio::task::JoinHandle<std::io::Result<()>>) {
    tokio::time::timeout(PATIENCE, server)
        .await
        .expect("the listener stops")
        .unwrap()
        .unwrap();
}

/// An engine of raw bytes: takes one connection, reads the request head, writes `answer`
/// (as far as the connection takes it), then reads until the connection is closed; the
/// receiver hears when it was.
pub async fn raw_engine(answer: Vec<u8>) -> (SocketAddr, tokio::sync::oneshot::Receiver<()>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let engine = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = engine.local_addr().unwrap();
    let (closed_tx, closed_rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (mut socket, _) = engine.accept().await.unwrap();
        let mut buf = vec![0; 4096];
        let mut seen = Vec::new();
        while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = socket.read(&mut buf).await.unwrap();
            seen.extend_from_slice(&buf[..n]);
        }
        if socket.write_all(&answer).await.is_ok() {
            loop {
                match socket.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
        }
        let _ = closed_tx.send(());
    });
    (addr, closed_rx)
}

/// One HTTP/1.1 keep-alive connection; dropping it closes the socket.
pub struct Conn {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    task: tokio::task::JoinHandle<()>,
}

impl Conn {
    /// Connects to `addr`.
    pub async fn open(addr: SocketAddr) -> Conn {
        let stream = TcpStream::connect(addr).await.unwrap();
        stream.set_nodelay(true).unwrap();
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        let task = tokio::spawn(async move {
            let _ = conn.await;
        });
        Conn { sender, task }
    }

    /// Sends one request and returns the response head with its body unread.
    pub async fn send(&mut self, request: Request<Full<Bytes>>) -> http::Response<Incoming> {
        self.sender.ready().await.unwrap();
        self.sender.send_request(request).await.unwrap()
    }

    /// POSTs `body` to `path`.
    pub async fn post(&mut self, path: &str, body: &str) -> http::Response<Incoming> {
        let request = Request::post(path)
            .header("host", "test")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap();
        self.send(request).await
    }

    /// GETs `path`.
    pub async fn get(&mut self, path: &str) -> http::Response<Incoming> {
        let request = Request::get(path)
            .header("host", "test")
            .body(Full::new(Bytes::new()))
            .unwrap();
        self.send(request).await
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// POSTs on a fresh connection and reads the whole answer.
pub async fn post(
    addr: SocketAddr,
    path: &str,
    body: &str,
) -> (StatusCode, http::HeaderMap, Bytes) {
    let mut conn = Conn::open(addr).await;
    whole(conn.post(path, body).await).await
}

/// `response`'s status, headers and whole body (read within [`PATIENCE`]).
pub async fn whole(response: http::Response<Incoming>) -> (StatusCode, http::HeaderMap, Bytes) {
    let (head, body) = response.into_parts();
    let body = tokio::time::timeout(PATIENCE, body.collect())
        .await
        .unwrap()
        .unwrap()
        .to_bytes();
    (head.status, head.headers, body)
}

/// GETs on a fresh connection and reads the whole answer.
pub async fn get(addr: SocketAddr, path: &str) -> (StatusCode, Bytes) {
    let mut conn = Conn::open(addr).await;
    let response = conn.get(path).await;
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, body)
}

/// The simulator's `/sim/state`.
pub async fn sim_state(sim: SocketAddr) -> serde_json::Value {
    let (status, body) = get(sim, "/sim/state").await;
    assert_eq!(status, StatusCode::OK);
    serde_json::from_slice(&body).unwrap()
}

/// Waits until the simulator's counter `name` reaches `at_least`.
pub async fn wait_sim(sim: SocketAddr, name: &str, at_least: u64) -> serde_json::Value {
    let end = Instant::now() + PATIENCE;
    loop {
        let state = sim_state(sim).await;
        if state[name].as_u64().unwrap_or(0) >= at_least {
            return state;
        }
        assert!(
            Instant::now() < end,
            "timed out waiting for {name} >= {at_least}: {state}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The answer with its per-request fields (`id`'s number, `created`) blanked, so that answers
/// of the same request through different paths compare byte for byte.
pub fn normalise(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body).into_owned();
    let mut out = String::with_capacity(text.len());
    let mut rest = text.as_str();
    let markers = ["\"created\":", "chatcmpl-", "\"id\":\"cmpl-"];
    loop {
        let next = markers
            .iter()
            .filter_map(|m| rest.find(m).map(|at| (at, *m)))
            .min_by_key(|(at, _)| *at);
        let Some((at, marker)) = next else {
            out.push_str(rest);
            return out;
        };
        out.push_str(&rest[..at + marker.len()]);
        rest = &rest[at + marker.len()..];
        let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        out.push('N');
        rest = &rest[digits..];
    }
}
