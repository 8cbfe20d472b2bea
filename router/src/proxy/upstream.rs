//! The router's own connections to the engines: HTTP/1.1 keep-alive connections per upstream
//! address, reused last-in first-out, each driven by the task that uses it.
//!
//! NB (why not hyper-util's pooled client): that client spawns a task per connection and hands
//! every request, response head and body frame across it, a task wake-up each (and a thread
//! hop on a multi-threaded runtime). Here the request's own task polls the connection (the
//! [`Connection`] future) together with the response: the engine's socket wakes the task that
//! forwards to the client, and nothing else runs.
//!
//! - A connection goes back to the pool only when its answer was read to the end; an answer
//!   given up (client gone, deadline, oversized piece) drops it, which closes the socket: the
//!   engine sees the disconnect and aborts the request.
//! - An idle connection is not polled; one the engine closed meanwhile shows it on checkout
//!   (polling it reads the end of stream) and is dropped. A request refused by a connection
//!   before it was written (closed just then) is sent again on a fresh one.
//! - At most `max_idle` idle connections per address; idle longer than `idle_timeout` they are
//!   dropped at the next checkout (and addresses nobody asks for any more on a connect, at most
//!   once per `idle_timeout`).
//! - A connect that takes longer than `connect_timeout` fails (an engine that is black-holed
//!   must not hold a permit until the request deadline).
//!   The listener's timeout is [`IDLE_TIMEOUT`], below the 5 s after which vLLM's and SGLang's
//!   server (uvicorn) closes an idle connection: a connection is never reused just as the
//!   engine closes it.

use std::collections::HashMap;
use std::future::{Future, poll_fn};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, Connection, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;

/// How long an idle connection is kept: under uvicorn's `timeout_keep_alive` (5 s).
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(4);

/// What went wrong reaching an engine.
pub(crate) type UpstreamError = Box<dyn std::error::Error + Send + Sync>;

type Driver = Connection<TokioIo<TcpStream>, Full<Bytes>>;

/// One connection to an engine: the sending half and the connection future that does the I/O.
pub(crate) struct Conn {
    sender: SendRequest<Full<Bytes>>,
    /// `None` once the connection future ended (closed).
    driver: Option<Pin<Box<Driver>>>,
    addr: SocketAddr,
}

impl Conn {
    /// Polls the connection's I/O; false once it is closed.
    fn drive(&mut self, cx: &mut Context<'_>) -> bool {
        if let Some(driver) = self.driver.as_mut() {
            match driver.as_mut().poll(cx) {
                Poll::Pending => return true,
                Poll::Ready(result) => {
                    if let Err(err) = result {
                        tracing::debug!(error = %err, "engine connection ended");
                    }
                    self.driver = None;
                }
            }
        }
        false
    }

    /// Waits until the connection can take a request; an error if it is closed.
    async fn ready(&mut self) -> Result<(), UpstreamError> {
        poll_fn(|cx| {
            let open = self.drive(cx);
            match self.sender.poll_ready(cx) {
                Poll::Ready(Ok(())) => Poll::Ready(Ok(())),
                Poll::Ready(Err(err)) => Poll::Ready(Err(err.into())),
                Poll::Pending if !open => Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionReset,
                    "the engine closed the connection",
                )
                .into())),
                Poll::Pending => Poll::Pending,
            }
        })
        .await
    }
}

/// The idle connections of one engine address, and its `Host` header.
struct Idle {
    conns: Vec<(Conn, Instant)>,
    host: HeaderValue,
}

/// The idle connections.
pub(crate) struct Pool {
    idle: Mutex<Lists>,
    max_idle: usize,
    idle_timeout: Duration,
    connect_timeout: Duration,
}

struct Lists {
    by_addr: HashMap<SocketAddr, Idle>,
    /// The last sweep over every address.
    swept: Instant,
}

impl Pool {
    pub(crate) fn new(
        max_idle: usize,
        idle_timeout: Duration,
        connect_timeout: Duration,
    ) -> Arc<Self> {
        Arc::new(Pool {
            idle: Mutex::new(Lists {
                by_addr: HashMap::new(),
                swept: Instant::now(),
            }),
            max_idle,
            idle_timeout,
            connect_timeout,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Lists> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `addr`'s `Host` header and, if there is one, its most recently used idle connection
    /// that is still fresh.
    fn take_idle(&self, addr: SocketAddr) -> Result<(HeaderValue, Option<Conn>), UpstreamError> {
        let now = Instant::now();
        let mut lists = self.lock();
        let idle = match lists.by_addr.entry(addr) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(Idle {
                conns: Vec::new(),
                host: HeaderValue::from_str(&addr.to_string())?,
            }),
        };
        let host = idle.host.clone();
        let Some((conn, since)) = idle.conns.pop() else {
            return Ok((host, None));
        };
        if now.saturating_duration_since(since) > self.idle_timeout {
            // The rest are older still.
            idle.conns.clear();
            return Ok((host, None));
        }
        Ok((host, Some(conn)))
    }

    /// Puts a connection whose answer was read to the end back.
    fn put(&self, conn: Conn) {
        if conn.driver.is_none() || conn.sender.is_closed() {
            return;
        }
        let mut lists = self.lock();
        if let Some(idle) = lists.by_addr.get_mut(&conn.addr)
            && idle.conns.len() < self.max_idle
        {
            idle.conns.push((conn, Instant::now()));
        }
    }

    /// Drops the idle connections past the idle timeout, everywhere, and the addresses left
    /// with none (at most once per idle timeout).
    fn sweep(&self, keep: SocketAddr) {
        let now = Instant::now();
        let timeout = self.idle_timeout;
        let mut lists = self.lock();
        if now.saturating_duration_since(lists.swept) < timeout {
            return;
        }
        lists.swept = now;
        lists.by_addr.retain(|addr, idle| {
            idle.conns
                .retain(|(_, since)| now.saturating_duration_since(*since) <= timeout);
            !idle.conns.is_empty() || *addr == keep
        });
    }

    async fn connect(&self, addr: SocketAddr) -> Result<Conn, UpstreamError> {
        let stream =
            match tokio::time::timeout(self.connect_timeout, TcpStream::connect(addr)).await {
                Ok(stream) => stream?,
                Err(_) => {
                    return Err(format!(
                        "no connection to the engine at {addr} within {} ms",
                        self.connect_timeout.as_millis()
                    )
                    .into());
                }
            };
        if let Err(err) = stream.set_nodelay(true) {
            tracing::debug!(error = %err, "TCP_NODELAY");
        }
        let (sender, driver) = http1::handshake(TokioIo::new(stream)).await?;
        Ok(Conn {
            sender,
            driver: Some(Box::pin(driver)),
            addr,
        })
    }

    /// A connection to `addr` ready for a request (an idle one, or a new one), and `addr`'s
    /// `Host` header.
    async fn checkout(&self, addr: SocketAddr) -> Result<(Conn, bool, HeaderValue), UpstreamError> {
        loop {
            let (host, idle) = self.take_idle(addr)?;
            match idle {
                Some(mut conn) => {
                    if conn.ready().await.is_ok() {
                        return Ok((conn, true, host));
                    }
                }
                None => {
                    self.sweep(addr);
                    let mut conn = self.connect(addr).await?;
                    conn.ready().await?;
                    return Ok((conn, false, host));
                }
            }
        }
    }

    /// Sends `request` (origin-form URI; `Host` is set here) to `addr` and waits for the
    /// response head, polling the connection meanwhile. The body keeps the connection.
    pub(crate) async fn request(
        self: &Arc<Self>,
        addr: SocketAddr,
        mut request: Request<Full<Bytes>>,
    ) -> Result<Response<UpstreamBody>, UpstreamError> {
        let (mut conn, reused, host) = self.checkout(addr).await?;
        request.headers_mut().insert(header::HOST, host);
        let mut sent = Box::pin(conn.sender.try_send_request(request));
        let result = poll_fn(|cx| {
            conn.drive(cx);
            sent.as_mut().poll(cx)
        })
        .await;
        drop(sent);
        let response = match result {
            Ok(response) => response,
            Err(mut err) => match err.take_message() {
                // Not written: the connection closed just then. Once more, on a fresh one.
                Some(request) if reused => {
                    drop(conn);
                    let mut fresh = self.connect(addr).await?;
                    fresh.ready().await?;
                    conn = fresh;
                    let mut sent = Box::pin(conn.sender.send_request(request));
                    poll_fn(|cx| {
                        conn.drive(cx);
                        sent.as_mut().poll(cx)
                    })
                    .await?
                }
                _ => return Err(err.into_error().into()),
            },
        };
        let (head, body) = response.into_parts();
        let mut body = UpstreamBody {
            body,
            conn: Some(conn),
            pool: Arc::clone(self),
        };
        body.give_back_if_ended();
        Ok(Response::from_parts(head, body))
    }
}

/// An engine's response body, holding (and driving) its connection; the connection goes back
/// to the pool when the body has been read to the end, and is closed when the body is dropped
/// before that.
pub(crate) struct UpstreamBody {
    body: Incoming,
    conn: Option<Conn>,
    pool: Arc<Pool>,
}

impl UpstreamBody {
    fn give_back_if_ended(&mut self) {
        if self.body.is_end_stream()
            && let Some(conn) = self.conn.take()
        {
            self.pool.put(conn);
        }
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        // Read to the end without a last poll (hyper stops at `is_end_stream`): reusable.
        self.give_back_if_ended();
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        if let Some(conn) = this.conn.as_mut() {
            conn.drive(cx);
        }
        let polled = Pin::new(&mut this.body).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(_))) => this.give_back_if_ended(),
            Poll::Ready(None) => {
                if let Some(conn) = this.conn.take() {
                    this.pool.put(conn);
                }
            }
            Poll::Ready(Some(Err(_))) => this.conn = None,
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
