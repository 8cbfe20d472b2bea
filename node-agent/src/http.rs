//! A small pooled HTTP/1 client for engine control calls, with a timeout on every call and
//! errors that name the engine, the step and the URL.
//!
//! Each call runs its connection in the calling task (hyper's `client::conn::http1`: the
//! request and the connection are polled together there), not in a task of the connection's
//! own as hyper's pooled client does: there, every request, answer head and body frame crossed
//! between two tasks, and each crossing waited for the other task to be scheduled. Idle
//! connections wait in a pool ([`Pool`]), polled by nobody: one the engine closed meanwhile
//! shows it when it is taken (its end of stream is read then) and is dropped; one idle longer
//! than [`IDLE_LIMIT`] (under the 5 s after which uvicorn, vLLM's and SGLang's server, closes
//! an idle connection) is not reused, so that a request is seldom written just as the engine
//! closes the connection. A request that a reused connection refuses before writing it (closed
//! just then) is sent once more on a fresh one; once written, it is never sent twice.
//!
//! Each call is logged at debug level under the target [`ENGINE_CALL_TARGET`] with the engine's
//! time as the driver sees it: from the request's first byte written to the answer's last byte
//! read on the connection ([`Stamps`]), i.e. the engine and the loopback socket, without the
//! driver's own work before and after (building the request, the HTTP client's encoding and
//! hand-offs, parsing and judging the answer). `switch_share` reads those lines.

use std::collections::HashMap;
use std::future::{Future, poll_fn};
use std::io::IoSlice;
use std::pin::{Pin, pin};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use capyctl_spec::EngineKind;
use http::uri::Authority;
use http::{Method, Request, header};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::Uri;
use hyper::client::conn::http1;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tower::ServiceExt as _;

use crate::error::AgentError;

/// How much of an error body an error message keeps.
const BODY_IN_ERROR: usize = 300;
/// The largest answer read from an engine (its `/metrics` text is the largest, some hundred
/// KiB): an engine that sends more is answered an error rather than held in memory whole.
pub const MAX_ANSWER_BYTES: usize = 16 * 1024 * 1024;
/// How long an idle connection is kept for the next call: under uvicorn's
/// `timeout_keep_alive` (5 s, counted from its last write), so that a connection is seldom
/// reused just as the engine closes it.
const IDLE_LIMIT: Duration = Duration::from_secs(4);
/// The most idle connections kept per engine address.
const MAX_IDLE_PER_ENGINE: usize = 8;

/// One engine call: which engine, which step, where.
#[derive(Debug, Clone, Copy)]
pub struct Call<'a> {
    /// The engine.
    pub engine: EngineKind,
    /// The step's name (`sleep`, `wake_up`, `reload_weights`, `health`, ...).
    pub step: &'static str,
    /// The URL.
    pub url: &'a str,
    /// The bound on the whole call, body included.
    pub timeout: Duration,
}

/// The tracing target of the per-call debug lines (see the module doc). Their fields:
/// `engine`, `step`, `url`, `status`, `written_at_us` and `read_at_us` (wall-clock
/// microseconds since the Unix epoch: the request's first byte written, the answer's last byte
/// read) and `engine_us` (their difference).
pub const ENGINE_CALL_TARGET: &str = "capyctl_node_agent::engine_call";

/// When the requests on one connection were written and their answers read (see the module
/// doc). HTTP/1.1 without pipelining: a write after a read (or the first one) begins the next
/// exchange.
#[derive(Debug, Default)]
pub struct Stamps(Mutex<Exchanges>);

#[derive(Debug, Default, Clone, Copy)]
struct Exchanges {
    /// The exchange before the current one: `(first byte written, last byte read)`.
    previous: Option<(Instant, Option<Instant>)>,
    /// The current one.
    current: Option<(Instant, Option<Instant>)>,
    /// The last thing done was a read (or nothing yet): the next write begins an exchange.
    read_last: bool,
}

impl Stamps {
    fn lock(&self) -> std::sync::MutexGuard<'_, Exchanges> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wrote(&self) {
        let mut x = self.lock();
        if x.read_last || x.current.is_none() {
            x.previous = x.current;
            x.current = Some((Instant::now(), None));
            x.read_last = false;
        }
    }

    fn read(&self) {
        let mut x = self.lock();
        if let Some((_, read)) = &mut x.current {
            *read = Some(Instant::now());
        }
        x.read_last = true;
    }

    /// The exchange of a call that began at `sent` (before its first byte could be written):
    /// the first on this connection written since then (the pool may have handed the
    /// connection to the next call already).
    fn exchange_since(&self, sent: Instant) -> Option<(Instant, Instant)> {
        let x = *self.lock();
        let whole = |e: Option<(Instant, Option<Instant>)>| match e {
            Some((w, Some(r))) if w >= sent && r >= w => Some((w, r)),
            _ => None,
        };
        whole(x.previous).or_else(|| whole(x.current))
    }
}

/// A connection to an engine that notes its exchanges in [`Stamps`].
#[derive(Debug)]
struct TimedIo {
    io: tokio::net::TcpStream,
    stamps: Arc<Stamps>,
}

impl AsyncRead for TimedIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.stamps.read();
        }
        polled
    }
}

impl AsyncWrite for TimedIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, data);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.stamps.wrote();
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, data);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.stamps.wrote();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One connection to an engine: the sending half and the connection itself, both polled by
/// the task that makes the call.
struct Conn {
    send: http1::SendRequest<Full<Bytes>>,
    conn: http1::Connection<TokioIo<TimedIo>, Full<Bytes>>,
    stamps: Arc<Stamps>,
    /// The connection ended (closed by either side, or failed): never reused.
    ended: bool,
    /// When it was put back idle.
    idle_since: Instant,
}

impl Conn {
    /// Polls the connection (it reads and writes only when polled); notes when it ends. Its
    /// errors reach the request in flight, if any, through hyper.
    fn poll_conn(&mut self, cx: &mut Context<'_>) {
        if !self.ended && Pin::new(&mut self.conn).poll(cx).is_ready() {
            self.ended = true;
        }
    }

    /// Runs `fut` (the request on this connection, its answer read) with the connection
    /// polled beside it, in this task.
    async fn drive<F: Future>(&mut self, fut: F) -> F::Output {
        let mut fut = pin!(fut);
        poll_fn(|cx| {
            self.poll_conn(cx);
            fut.as_mut().poll(cx)
        })
        .await
    }

    /// Whether the connection can take the next request now: it is open, and its last
    /// exchange is over (polled once more here, so that a close by the engine or the end of
    /// the last answer is seen).
    async fn usable(&mut self) -> bool {
        poll_fn(|cx| {
            self.poll_conn(cx);
            Poll::Ready(())
        })
        .await;
        !self.ended && self.send.is_ready()
    }
}

/// The idle connections, by engine address (see the module doc).
#[derive(Default)]
struct Pool {
    idle: Mutex<Idle>,
}

#[derive(Default)]
struct Idle {
    by_engine: HashMap<Authority, Vec<Conn>>,
    /// When connections past [`IDLE_LIMIT`] were last dropped for every address.
    swept: Option<Instant>,
}

impl Pool {
    fn lock(&self) -> std::sync::MutexGuard<'_, Idle> {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The most recently used idle connection to `engine` that is young enough; older ones are
    /// dropped.
    fn take(&self, engine: &Authority) -> Option<Conn> {
        let mut idle = self.lock();
        let conns = idle.by_engine.get_mut(engine)?;
        let taken = loop {
            match conns.pop() {
                Some(c) if c.idle_since.elapsed() < IDLE_LIMIT => break Some(c),
                Some(_) => {}
                None => break None,
            }
        };
        if conns.is_empty() {
            idle.by_engine.remove(engine);
        }
        taken
    }

    /// Keeps `conn` for the next call to `engine` (at most [`MAX_IDLE_PER_ENGINE`]), and drops
    /// the connections idle past [`IDLE_LIMIT`] to every address, at most once per limit.
    fn put(&self, engine: Authority, mut conn: Conn) {
        let now = Instant::now();
        conn.idle_since = now;
        let mut idle = self.lock();
        if idle
            .swept
            .is_none_or(|at| now.duration_since(at) >= IDLE_LIMIT)
        {
            idle.swept = Some(now);
            idle.by_engine.retain(|_, conns| {
                conns.retain(|c| now.duration_since(c.idle_since) < IDLE_LIMIT);
                !conns.is_empty()
            });
        }
        let conns = idle.by_engine.entry(engine).or_default();
        if conns.len() >= MAX_IDLE_PER_ENGINE {
            conns.remove(0);
        }
        conns.push(conn);
    }
}

/// Wall-clock microseconds since the Unix epoch at `at`.
fn wall_us(at: Instant) -> u64 {
    let wall = SystemTime::now() - Instant::now().saturating_duration_since(at);
    wall.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// The pooled client. Cheap to clone; connections are reused across calls.
#[derive(Clone)]
pub struct EngineClient {
    connector: HttpConnector,
    pool: Arc<Pool>,
}

impl std::fmt::Debug for EngineClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineClient").finish_non_exhaustive()
    }
}

impl Default for EngineClient {
    fn default() -> Self {
        Self::new()
    }
}

impl EngineClient {
    /// A client keeping up to 8 idle connections per engine for 4 s.
    pub fn new() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        Self {
            connector,
            pool: Arc::default(),
        }
    }

    /// A new connection to `uri`'s engine.
    async fn connect(&self, uri: &Uri) -> Result<Conn, BoxError> {
        let io = self
            .connector
            .clone()
            .oneshot(uri.clone())
            .await?
            .into_inner();
        let stamps = Arc::<Stamps>::default();
        let (send, conn) = http1::handshake(TokioIo::new(TimedIo {
            io,
            stamps: Arc::clone(&stamps),
        }))
        .await?;
        Ok(Conn {
            send,
            conn,
            stamps,
            ended: false,
            idle_since: Instant::now(),
        })
    }

    /// A connection to `engine`: an idle one that is still usable, else a new one (`true`
    /// when it was reused).
    async fn checkout(&self, engine: &Authority, uri: &Uri) -> Result<(Conn, bool), BoxError> {
        while let Some(mut conn) = self.pool.take(engine) {
            if conn.usable().await {
                return Ok((conn, true));
            }
        }
        Ok((self.connect(uri).await?, false))
    }

    /// Sends `request` (made by `make`) to `engine` and reads the answer whole; the
    /// connection goes back to the pool when it can take another request. A request that a
    /// reused connection refused before writing it is sent once more on a new connection.
    async fn exchange(
        &self,
        call: Call<'_>,
        engine: &Authority,
        uri: &Uri,
        make: impl Fn() -> Request<Full<Bytes>>,
    ) -> Result<(u16, Bytes), AgentError> {
        let unreachable = |source: BoxError| AgentError::EngineUnreachable {
            engine: call.engine,
            step: call.step,
            url: call.url.to_string(),
            source,
        };
        let (mut conn, mut reused) = self.checkout(engine, uri).await.map_err(unreachable)?;
        let sent = Instant::now();
        let response = loop {
            let answer = conn.send.send_request(make());
            match conn.drive(answer).await {
                Err(e) if reused && e.is_canceled() => {
                    conn = self.connect(uri).await.map_err(unreachable)?;
                    reused = false;
                }
                other => break other.map_err(|e| unreachable(Box::new(e)))?,
            }
        };
        let status = response.status().as_u16();
        // A body that breaks off is a connection lost mid-answer (the engine went away); one
        // over MAX_ANSWER_BYTES is not read further.
        let body = Limited::new(response.into_body(), MAX_ANSWER_BYTES).collect();
        let bytes = conn
            .drive(body)
            .await
            .map_err(|source| {
                if source.downcast_ref::<LengthLimitError>().is_some() {
                    AgentError::EngineAnswer {
                        engine: call.engine,
                        step: call.step,
                        url: call.url.to_string(),
                        detail: format!("the answer is longer than {} MiB", MAX_ANSWER_BYTES >> 20),
                    }
                } else {
                    unreachable(source)
                }
            })?
            .to_bytes();
        if tracing::enabled!(target: ENGINE_CALL_TARGET, tracing::Level::DEBUG)
            && let Some((written, read)) = conn.stamps.exchange_since(sent)
        {
            tracing::debug!(
                target: ENGINE_CALL_TARGET,
                engine = %call.engine,
                step = call.step,
                url = call.url,
                status,
                written_at_us = wall_us(written),
                read_at_us = wall_us(read),
                engine_us = u64::try_from((read - written).as_micros()).unwrap_or(u64::MAX),
                "engine call"
            );
        }
        if conn.usable().await {
            self.pool.put(engine.clone(), conn);
        }
        Ok((status, bytes))
    }

    /// Sends one request and returns the status and body, whatever the status.
    pub async fn send(
        &self,
        call: Call<'_>,
        method: Method,
        body: Option<&Value>,
    ) -> Result<(u16, Bytes), AgentError> {
        let bad_request = |detail: String| AgentError::EngineAnswer {
            engine: call.engine,
            step: call.step,
            url: call.url.to_string(),
            detail: format!("cannot build the request: {detail}"),
        };
        let uri: Uri = call
            .url
            .parse()
            .map_err(|e: http::uri::InvalidUri| bad_request(e.to_string()))?;
        let engine = match (uri.scheme_str(), uri.authority()) {
            (Some("http"), Some(a)) => a.clone(),
            _ => return Err(bad_request("not an http:// URL with a host".into())),
        };
        let target = uri.path_and_query().map_or("/", |p| p.as_str()).to_string();
        let body = body.map(|v| Bytes::from(v.to_string()));
        let mut builder = Request::builder()
            .method(method)
            .uri(target)
            .header(header::HOST, engine.as_str());
        if body.is_some() {
            builder = builder.header(header::CONTENT_TYPE, "application/json");
        }
        let (head, ()) = builder
            .body(())
            .map_err(|e| bad_request(e.to_string()))?
            .into_parts();
        let body = body.unwrap_or_default();
        // Made again for a request sent once more.
        let make = || Request::from_parts(head.clone(), Full::new(body.clone()));
        let exchange = self.exchange(call, &engine, &uri, make);
        match tokio::time::timeout(call.timeout, exchange).await {
            Ok(result) => result,
            Err(_) => Err(AgentError::EngineTimeout {
                engine: call.engine,
                step: call.step,
                url: call.url.to_string(),
                after: call.timeout,
            }),
        }
    }

    /// Sends one request and insists on a 2xx status; returns the body.
    pub async fn expect_ok(
        &self,
        call: Call<'_>,
        method: Method,
        body: Option<&Value>,
    ) -> Result<Bytes, AgentError> {
        let (status, bytes) = self.send(call, method, body).await?;
        if (200..300).contains(&status) {
            Ok(bytes)
        } else {
            Err(AgentError::EngineStatus {
                engine: call.engine,
                step: call.step,
                url: call.url.to_string(),
                status,
                body: excerpt(&bytes),
            })
        }
    }

    /// Like [`EngineClient::expect_ok`], and parses the body as JSON.
    pub async fn expect_json(
        &self,
        call: Call<'_>,
        method: Method,
        body: Option<&Value>,
    ) -> Result<Value, AgentError> {
        let bytes = self.expect_ok(call, method, body).await?;
        serde_json::from_slice(&bytes).map_err(|e| AgentError::EngineAnswer {
            engine: call.engine,
            step: call.step,
            url: call.url.to_string(),
            detail: format!("the answer is not JSON ({e}): {}", excerpt(&bytes)),
        })
    }
}

/// The start of a body, as text, for an error message.
pub fn excerpt(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let text = text.trim();
    match text.char_indices().nth(BODY_IN_ERROR) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_string(),
    }
}
