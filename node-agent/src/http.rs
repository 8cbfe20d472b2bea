//! A small pooled HTTP/1 client for engine control calls, with a timeout on every call and
//! errors that name the engine, the step and the URL.
//!
//! Each call is logged at debug level under the target [`ENGINE_CALL_TARGET`] with the engine's
//! time as the driver sees it: from the request's first byte written to the answer's last byte
//! read on the connection ([`Stamps`]), i.e. the engine and the loopback socket, without the
//! driver's own work before and after (building the request, the HTTP client's encoding and
//! hand-offs, parsing and judging the answer). `switch_share` reads those lines.

use std::io::IoSlice;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use capyctl_spec::EngineKind;
use http::{Method, Request, header};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::Uri;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::error::AgentError;

/// How much of an error body an error message keeps.
const BODY_IN_ERROR: usize = 300;
/// The largest answer read from an engine (its `/metrics` text is the largest, some hundred
/// KiB): an engine that sends more is answered an error rather than held in memory whole.
pub const MAX_ANSWER_BYTES: usize = 16 * 1024 * 1024;

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

/// A connection to an engine that notes its exchanges in [`Stamps`], handed to every answer
/// on it (hyper's `Connected::extra`).
#[derive(Debug)]
struct TimedIo {
    io: tokio::net::TcpStream,
    stamps: Arc<Stamps>,
}

impl Connection for TimedIo {
    fn connected(&self) -> Connected {
        self.io.connected().extra(Arc::clone(&self.stamps))
    }
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

/// [`HttpConnector`] whose connections are [`TimedIo`].
#[derive(Debug, Clone)]
struct TimedConnector(HttpConnector);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl tower::Service<Uri> for TimedConnector {
    type Response = TokioIo<TimedIo>;
    type Error = BoxError;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<TokioIo<TimedIo>, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.0.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        let connecting = self.0.call(dst);
        Box::pin(async move {
            let io = connecting.await?.into_inner();
            Ok(TokioIo::new(TimedIo {
                io,
                stamps: Arc::default(),
            }))
        })
    }
}

/// Wall-clock microseconds since the Unix epoch at `at`.
fn wall_us(at: Instant) -> u64 {
    let wall = SystemTime::now() - Instant::now().saturating_duration_since(at);
    wall.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// The pooled client. Cheap to clone; connections are reused across calls.
#[derive(Debug, Clone)]
pub struct EngineClient {
    client: Client<TimedConnector, Full<Bytes>>,
}

impl Default for EngineClient {
    fn default() -> Self {
        Self::new()
    }
}

impl EngineClient {
    /// A client keeping up to 8 idle connections per engine for 90 s.
    pub fn new() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(8)
            .build(TimedConnector(connector));
        Self { client }
    }

    /// Sends one request and returns the status and body, whatever the status.
    pub async fn send(
        &self,
        call: Call<'_>,
        method: Method,
        body: Option<&Value>,
    ) -> Result<(u16, Bytes), AgentError> {
        let mut builder = Request::builder().method(method).uri(call.url);
        let body = match body {
            Some(v) => {
                builder = builder.header(header::CONTENT_TYPE, "application/json");
                Full::new(Bytes::from(v.to_string()))
            }
            None => Full::new(Bytes::new()),
        };
        let request = builder.body(body).map_err(|e| AgentError::EngineAnswer {
            engine: call.engine,
            step: call.step,
            url: call.url.to_string(),
            detail: format!("cannot build the request: {e}"),
        })?;
        let exchange = async {
            let sent = Instant::now();
            let response = self.client.request(request).await.map_err(|source| {
                AgentError::EngineUnreachable {
                    engine: call.engine,
                    step: call.step,
                    url: call.url.to_string(),
                    source: Box::new(source),
                }
            })?;
            let status = response.status().as_u16();
            let stamps = response.extensions().get::<Arc<Stamps>>().cloned();
            // A body that breaks off is a connection lost mid-answer (the engine went away); one
            // over MAX_ANSWER_BYTES is not read further.
            let bytes = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
                .collect()
                .await
                .map_err(|source| {
                    if source.downcast_ref::<LengthLimitError>().is_some() {
                        AgentError::EngineAnswer {
                            engine: call.engine,
                            step: call.step,
                            url: call.url.to_string(),
                            detail: format!(
                                "the answer is longer than {} MiB",
                                MAX_ANSWER_BYTES >> 20
                            ),
                        }
                    } else {
                        AgentError::EngineUnreachable {
                            engine: call.engine,
                            step: call.step,
                            url: call.url.to_string(),
                            source,
                        }
                    }
                })?
                .to_bytes();
            if tracing::enabled!(target: ENGINE_CALL_TARGET, tracing::Level::DEBUG)
                && let Some((written, read)) = stamps.and_then(|s| s.exchange_since(sent))
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
            Ok((status, bytes))
        };
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
