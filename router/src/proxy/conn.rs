//! Client connections: the accept loops, each connection's HTTP/1.1 server, and the watch on
//! its socket that ends an answer whose client reads nothing.
//!
//! NB (threads): with `listener_threads` > 0, [`serve`] runs that many loops, each on a
//! current-thread runtime of its own (one per CPU by default). The first accepts, and hands
//! each connection to the loop with the fewest open connections (itself included): keep-alive
//! clients spread evenly, where loops that each took whatever connection they woke for first
//! split 32 clients about 20 to 12 and the busier thread set the pace. Everything a connection
//! does (its requests, its engine connections, its streamed answers) then happens on that one
//! thread, with no hand-over between threads. Each loop has its own pool of engine
//! connections. The coordinator stays on the caller's runtime; a request reaches it only when
//! it cannot take a lent slot (see `router/DESIGN.md`).
//!
//! NB (what "reads nothing" can mean): a server cannot see whether a client's program read
//! anything, only whether its TCP connection takes more bytes. The client's kernel takes them
//! into its receive buffer (tens of KiB to a few MiB) whether the program reads or not; then
//! the bytes wait in this side's send buffer, which `TCP_NOTSENT_LOWAT` keeps small
//! ([`super::ProxyConfig::client_unsent_limit`]); only then does a write find no room. A
//! streamed answer is cut once its connection has had bytes waiting that the socket did not
//! take for `read_stall` without a break ([`ConnWatch`]), which is `read_stall` after the
//! client stopped reading plus the time the engine takes to fill those buffers.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::{Proxy, upstream};
use crate::admission::Admission;

/// What a client connection's socket says about its reader, shared by the socket's writer
/// (`server`) and the streamed answers on the connection, and read by the connection's task
/// after each poll of the connection: once a stream's bytes were refused for `read_stall`
/// without a break, the task closes the connection.
///
/// NB: everything that changes it runs inside the connection's own poll (the server writes and
/// polls the bodies there), so the task sees a new blocked episode right after the poll that
/// began it, and needs no wake-up of its own.
pub(crate) struct ConnWatch {
    base: Instant,
    /// Since when a write found no room: nanoseconds since `base`, plus one; 0 while the
    /// socket takes what is written.
    blocked_since: AtomicU64,
    /// Answers being written on the connection.
    writing: AtomicUsize,
    /// The connection was closed for a read stall.
    stalled: AtomicBool,
}

impl ConnWatch {
    pub(super) fn new() -> Arc<Self> {
        Arc::new(ConnWatch {
            base: Instant::now(),
            blocked_since: AtomicU64::new(0),
            writing: AtomicUsize::new(0),
            stalled: AtomicBool::new(false),
        })
    }

    fn now(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_nanos())
            .unwrap_or(u64::MAX - 1)
            .saturating_add(1)
    }

    /// A write found no room.
    pub(super) fn refused(&self) {
        if self.blocked_since.load(Ordering::Relaxed) == 0 {
            self.blocked_since.store(self.now(), Ordering::Relaxed);
        }
    }

    /// A write was taken.
    pub(super) fn taken(&self) {
        if self.blocked_since.load(Ordering::Relaxed) != 0 {
            self.blocked_since.store(0, Ordering::Relaxed);
        }
    }

    /// An answer begins to be written on the connection (its stall, if the socket is already
    /// full, counts from now).
    pub(crate) fn answer_began(&self) {
        self.writing.fetch_add(1, Ordering::Relaxed);
        if self.blocked_since.load(Ordering::Relaxed) != 0 {
            self.blocked_since.store(self.now(), Ordering::Relaxed);
        }
    }

    /// The answer being written on the connection ended (written, or given up).
    pub(crate) fn answer_ended(&self) {
        self.writing.fetch_sub(1, Ordering::Relaxed);
    }

    /// Why an answer on `conn` was given up before its end: `read_stall` if the connection was
    /// closed because its client read nothing for that long, else `client_gone`.
    pub(crate) fn cut_code(conn: Option<&Arc<ConnWatch>>) -> &'static str {
        if conn.is_some_and(|c| c.stalled.load(Ordering::Acquire)) {
            crate::observe::READ_STALL
        } else {
            crate::observe::CLIENT_GONE
        }
    }

    /// When the current stall of an answer being written reaches `read_stall`: the blocked
    /// episode (its start, as stored) and that instant; `None` while nothing is refused.
    fn stall_at(&self, read_stall: Duration) -> Option<(u64, Instant)> {
        let since = self.blocked_since.load(Ordering::Relaxed);
        if since == 0 || self.writing.load(Ordering::Relaxed) == 0 {
            return None;
        }
        Some((
            since,
            self.base + Duration::from_nanos(since - 1) + read_stall,
        ))
    }
}

/// A graceful stop for every connection of an accept loop, cheap to poll: one atomic load,
/// and a lock only when a connection's task (its waker) changes.
#[derive(Default)]
struct StopSignal {
    stopped: AtomicBool,
    wakers: std::sync::Mutex<std::collections::HashMap<u64, Waker>>,
    next: AtomicU64,
}

impl StopSignal {
    fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
        let wakers = std::mem::take(&mut *self.lock());
        for waker in wakers.into_values() {
            waker.wake();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<u64, Waker>> {
        self.wakers.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn watch(self: &Arc<Self>) -> StopWatch {
        StopWatch {
            signal: Arc::clone(self),
            id: self.next.fetch_add(1, Ordering::Relaxed),
            registered: None,
        }
    }
}

/// One connection's view of the [`StopSignal`].
pub(super) struct StopWatch {
    signal: Arc<StopSignal>,
    id: u64,
    /// The waker last registered.
    registered: Option<Waker>,
}

impl StopWatch {
    /// Whether the listener stops (without waiting for it).
    pub(super) fn stopped(&self) -> bool {
        self.signal.stopped.load(Ordering::Acquire)
    }

    /// Whether the listener stops; if not, the task is woken when it does.
    pub(super) fn poll_stopped(&mut self, cx: &mut Context<'_>) -> bool {
        if self.signal.stopped.load(Ordering::Acquire) {
            return true;
        }
        if !self
            .registered
            .as_ref()
            .is_some_and(|w| w.will_wake(cx.waker()))
        {
            self.signal.lock().insert(self.id, cx.waker().clone());
            self.registered = Some(cx.waker().clone());
            return self.signal.stopped.load(Ordering::Acquire);
        }
        false
    }
}

impl Drop for StopWatch {
    fn drop(&mut self) {
        if self.registered.is_some() {
            self.signal.lock().remove(&self.id);
        }
    }
}

/// Serves the listener on `listener` until `shutdown` resolves; then stops accepting, lets
/// answers in progress finish for at most `shutdown_grace`, and drops what is left.
///
/// With [`super::ProxyConfig::listener_threads`] > 0 the connections are served on that many
/// threads of the listener's own (see the module's notes); dropping the returned future
/// stops them at once.
pub async fn serve<A: Admission>(
    listener: TcpListener,
    proxy: Proxy<A>,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    serve_listener(listener, proxy, shutdown, None).await
}

/// [`serve`], giving the listening socket itself back through `give_back` the moment the
/// listener stops accepting (before the answers in progress finish), instead of closing it:
/// whoever takes it accepts the connections from then on, those already waiting in its
/// backlog included, so that none is refused or reset in between (a stopping operator leader
/// answers them 503 on the same port: `operator/src/handover.rs`). If `give_back`'s receiver
/// is gone, the socket is closed, as by [`serve`].
pub async fn serve_giving_back<A: Admission>(
    listener: TcpListener,
    proxy: Proxy<A>,
    shutdown: impl Future<Output = ()>,
    give_back: oneshot::Sender<std::net::TcpListener>,
) -> io::Result<()> {
    serve_listener(listener, proxy, shutdown, Some(give_back)).await
}

async fn serve_listener<A: Admission>(
    listener: TcpListener,
    proxy: Proxy<A>,
    shutdown: impl Future<Output = ()>,
    mut give_back: Option<oneshot::Sender<std::net::TcpListener>>,
) -> io::Result<()> {
    let threads = proxy.config().listener_threads;
    if threads == 0 {
        let source = Source::Listener {
            listener,
            handed: Vec::new(),
            open: Arc::new([]),
        };
        return serve_here(
            source,
            give_back,
            0,
            proxy,
            shutdown,
            std::future::pending(),
        )
        .await;
    }
    let mut listener = Some(listener.into_std()?);
    let open: Arc<[AtomicUsize]> = (0..threads).map(|_| AtomicUsize::new(0)).collect();
    let (senders, mut receivers): (Vec<_>, Vec<_>) = (0..threads)
        .map(|_| {
            let (tx, rx) = mpsc::unbounded_channel::<std::net::TcpStream>();
            (tx, Some(rx))
        })
        .unzip();
    // `true`: stop gracefully. Dropped (this future was): stop at once.
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut done = Vec::with_capacity(threads);
    for (i, receiver) in receivers.iter_mut().enumerate() {
        // The first thread accepts; the others are handed their connections.
        let accepting = listener
            .take()
            .map(|listener| (listener, senders.clone(), give_back.take()));
        let receiver = receiver.take();
        let open = Arc::clone(&open);
        let proxy = proxy.for_thread();
        let mut graceful = stop_rx.clone();
        let mut abort = stop_rx.clone();
        let (tx, rx) = oneshot::channel();
        std::thread::Builder::new()
            .name(format!("capyctl-proxy-{i}"))
            .spawn(move || {
                let served = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .and_then(|runtime| {
                        runtime.block_on(async move {
                            let (source, give_back) = match (accepting, receiver) {
                                (Some((listener, handed, give_back)), _) => (
                                    Source::Listener {
                                        listener: TcpListener::from_std(listener)?,
                                        handed,
                                        open,
                                    },
                                    give_back,
                                ),
                                (None, Some(receiver)) => (Source::Handed(receiver, open), None),
                                (None, None) => unreachable!("every thread has a receiver"),
                            };
                            let shutdown = async move {
                                let _ = graceful.wait_for(|stop| *stop).await;
                            };
                            let abort = async move { while abort.changed().await.is_ok() {} };
                            serve_here(source, give_back, i, proxy, shutdown, abort).await
                        })
                    });
                let _ = tx.send(served);
            })?;
        done.push(rx);
    }
    drop(senders);
    shutdown.await;
    let _ = stop_tx.send(true);
    let mut result = Ok(());
    for rx in done {
        match rx.await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => result = Err(err),
            Err(_) => result = Err(io::Error::other("a listener thread ended unexpectedly")),
        }
    }
    result
}

/// Where an accept loop's connections come from.
enum Source {
    /// The listening socket: each connection goes to the loop with the fewest open connections
    /// (the lowest-numbered on a tie), this one or another (`handed`, by loop; empty when this
    /// loop is the only one).
    Listener {
        listener: TcpListener,
        handed: Vec<mpsc::UnboundedSender<std::net::TcpStream>>,
        /// Open connections, by loop: counted up here when one is handed out, down by the
        /// loop that served it when it ends.
        open: Arc<[AtomicUsize]>,
    },
    /// Connections handed over by the loop that accepts.
    Handed(
        mpsc::UnboundedReceiver<std::net::TcpStream>,
        Arc<[AtomicUsize]>,
    ),
}

impl Source {
    /// The next connection for loop `me`; `Ok(None)` once no more will come.
    async fn next(&mut self, me: usize) -> io::Result<Option<TcpStream>> {
        match self {
            Source::Handed(receiver, _) => match receiver.recv().await {
                Some(stream) => TcpStream::from_std(stream).map(Some),
                None => Ok(None),
            },
            Source::Listener {
                listener,
                handed,
                open,
            } => loop {
                let (stream, _) = listener.accept().await?;
                let Some(to) = open
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, n)| n.load(Ordering::Relaxed))
                    .map(|(i, _)| i)
                else {
                    return Ok(Some(stream));
                };
                open[to].fetch_add(1, Ordering::Relaxed);
                if to == me {
                    return Ok(Some(stream));
                }
                // Taken out of this loop's reactor, registered in the other's when received.
                let handed_over = stream
                    .into_std()
                    .and_then(|stream| handed[to].send(stream).map_err(io::Error::other));
                if let Err(err) = handed_over {
                    open[to].fetch_sub(1, Ordering::Relaxed);
                    tracing::warn!(error = %err, "handing a connection to a listener thread failed");
                }
            },
        }
    }

    /// No more connections are accepted: the listening socket (if this loop has it) goes to
    /// `give_back`, or is closed. A loop that is handed its connections gets back its
    /// receiver, for those handed over before the accepting loop stopped.
    fn close(
        self,
        give_back: Option<oneshot::Sender<std::net::TcpListener>>,
    ) -> Option<mpsc::UnboundedReceiver<std::net::TcpStream>> {
        match (self, give_back) {
            (Source::Handed(receiver, _), _) => Some(receiver),
            (Source::Listener { listener, .. }, Some(give_back)) => {
                match listener.into_std() {
                    Ok(listener) => {
                        let _ = give_back.send(listener);
                    }
                    Err(err) => {
                        tracing::warn!(error = %err, "giving the listening socket back failed")
                    }
                }
                None
            }
            (Source::Listener { .. }, None) => None,
        }
    }

    /// A connection of loop `me` ended.
    fn ended(&self, me: usize) {
        let (Source::Listener { open, .. } | Source::Handed(_, open)) = self;
        if let Some(n) = open.get(me) {
            n.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// One accept loop, on the current runtime, the `me`th of the listener's. `abort` ends
/// everything at once. On `shutdown` the listening socket goes to `give_back` (if given).
async fn serve_here<A: Admission>(
    mut source: Source,
    give_back: Option<oneshot::Sender<std::net::TcpListener>>,
    me: usize,
    proxy: Proxy<A>,
    shutdown: impl Future<Output = ()>,
    abort: impl Future<Output = ()>,
) -> io::Result<()> {
    let stop = Arc::new(StopSignal::default());
    let _floor = TimerFloor::start(Arc::downgrade(&proxy.pool));
    let mut connections = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    let mut abort = std::pin::pin!(abort);
    let mut more = true;
    loop {
        tokio::select! {
            biased;
            () = &mut abort => return Ok(()),
            () = &mut shutdown => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => source.ended(me),
            accepted = source.next(me), if more => match accepted {
                Ok(Some(stream)) => {
                    connections.spawn(connection(stream, proxy.clone(), stop.watch()));
                }
                Ok(None) => more = false,
                Err(err) => {
                    // Out of file descriptors and the like: back off a little.
                    tracing::warn!(error = %err, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            },
        }
    }
    if let Some(mut handed) = source.close(give_back) {
        // The connections the accepting loop handed over until it stopped (it drops its
        // senders then) are served too, not dropped unanswered.
        loop {
            tokio::select! {
                biased;
                () = &mut abort => return Ok(()),
                stream = handed.recv() => match stream.map(TcpStream::from_std) {
                    Some(Ok(stream)) => {
                        connections.spawn(connection(stream, proxy.clone(), stop.watch()));
                    }
                    Some(Err(err)) => tracing::warn!(error = %err, "registering a connection failed"),
                    None => break,
                },
            }
        }
    }
    stop.stop();
    let grace = proxy.config().shutdown_grace;
    let drained = tokio::select! {
        biased;
        () = &mut abort => return Ok(()),
        drained = tokio::time::timeout(grace, async {
            while connections.join_next().await.is_some() {}
        }) => drained,
    };
    if drained.is_err() {
        tracing::warn!(
            connections = connections.len(),
            "answers still in progress after the shutdown grace; dropping them"
        );
        connections.shutdown().await;
    }
    Ok(())
}

/// A timer that fires every second on the accept loop's runtime, for as long as the loop runs;
/// on its ticks the loop's pool drops the engine connections idle past its timeout
/// ([`upstream::Pool::sweep`], at most once per idle timeout).
///
/// NB (why): tokio's timer wakes its driver (a write to the runtime's eventfd and one more
/// `epoll_wait`) whenever a timer is registered that fires before everything the driver
/// already waits for, or while it waits for none. Every request registers a timer (the request
/// deadline while it waits for the engine), so without a floor each request paid for that
/// wake-up; with a timer never more than a second away, a timer of 30 s or 600 s is never the
/// earliest.
pub(super) struct TimerFloor(tokio::task::JoinHandle<()>);

impl TimerFloor {
    pub(super) fn start(pool: Weak<upstream::Pool>) -> Self {
        TimerFloor(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if let Some(pool) = pool.upgrade() {
                    pool.sweep(None);
                }
            }
        }))
    }
}

impl Drop for TimerFloor {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One client connection: HTTP/1.1 with keep-alive, closed at once when a streamed answer's
/// client reads nothing for `read_stall`, shut down gracefully once `stop` says so.
async fn connection<A: Admission>(stream: TcpStream, proxy: Proxy<A>, stop: StopWatch) {
    let config = proxy.config();
    if let Err(err) = stream.set_nodelay(true) {
        tracing::debug!(error = %err, "TCP_NODELAY");
    }
    if config.client_unsent_limit > 0
        && let Err(err) =
            socket2::SockRef::from(&stream).set_tcp_notsent_lowat(config.client_unsent_limit)
    {
        tracing::debug!(error = %err, "TCP_NOTSENT_LOWAT");
    }
    match config.tls.clone() {
        None => serve_stream(stream, proxy, stop).await,
        // Boxed: a TLS connection's state (rustls' buffers) is large, and inline it would make
        // every plain connection's future as large (measured: 4 KiB more per waiting request).
        Some(tls) => Box::pin(serve_tls(stream, tls, proxy, stop)).await,
    }
}

/// [`serve_stream`] after a TLS handshake bounded by [`crate::tls::HANDSHAKE_TIMEOUT`].
async fn serve_tls<A: Admission>(
    stream: TcpStream,
    tls: Arc<rustls::ServerConfig>,
    proxy: Proxy<A>,
    stop: StopWatch,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    if let Some(stream) = crate::tls::handshake(&acceptor, stream).await {
        serve_stream(stream, proxy, stop).await;
    }
}

/// Serves HTTP/1.1 on a client connection's stream (see [`connection`] and `server`).
async fn serve_stream<A: Admission, S>(stream: S, proxy: Proxy<A>, mut stop: StopWatch)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let read_stall = proxy.config().read_stall;
    let watch = ConnWatch::new();
    let conn = super::server::serve(stream, proxy, Arc::clone(&watch), &mut stop);
    let mut conn = std::pin::pin!(conn);
    // The read-stall timer of the current blocked episode (its start, as stored).
    let mut stall: Option<(u64, Pin<Box<tokio::time::Sleep>>)> = None;
    std::future::poll_fn(|cx| {
        if conn.as_mut().poll(cx).is_ready() {
            return Poll::Ready(());
        }
        let Some((since, at)) = watch.stall_at(read_stall) else {
            stall = None;
            return Poll::Pending;
        };
        let timer = match &mut stall {
            Some((episode, timer)) if *episode == since => timer,
            _ => {
                &mut stall
                    .insert((since, Box::pin(tokio::time::sleep_until(at))))
                    .1
            }
        };
        if timer.as_mut().poll(cx).is_ready() {
            // Closing the connection drops the answer's body, which reports the cut.
            watch.stalled.store(true, Ordering::Release);
            return Poll::Ready(());
        }
        Poll::Pending
    })
    .await;
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[tokio::test]
    async fn each_connection_goes_to_the_loop_with_the_fewest_open() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (to_other, mut other) = mpsc::unbounded_channel();
        let (to_self, _) = mpsc::unbounded_channel();
        let open: Arc<[AtomicUsize]> = (0..2).map(|_| AtomicUsize::new(0)).collect();
        let mut source = Source::Listener {
            listener,
            handed: vec![to_self, to_other],
            open: Arc::clone(&open),
        };
        let counts = || -> Vec<usize> { open.iter().map(|n| n.load(Ordering::Relaxed)).collect() };
        let mut clients = Vec::new();
        for _ in 0..4 {
            clients.push(TcpStream::connect(addr).await.unwrap());
        }
        // A tie goes to the lowest-numbered loop: this one (0), then the other, then this.
        let first = source.next(0).await.unwrap().unwrap();
        assert_eq!(counts(), [1, 0]);
        let third = source.next(0).await.unwrap().unwrap();
        assert_eq!(counts(), [2, 1]);
        let second = other.try_recv().unwrap();
        assert_ne!(first.peer_addr().unwrap(), third.peer_addr().unwrap());
        assert_ne!(second.peer_addr().unwrap(), third.peer_addr().unwrap());
        // Two of this loop's connections end: the next one is this loop's again.
        source.ended(0);
        source.ended(0);
        assert_eq!(counts(), [0, 1]);
        let _fourth = source.next(0).await.unwrap().unwrap();
        assert_eq!(counts(), [1, 1]);
        assert!(other.try_recv().is_err());

        // The loop that is handed connections counts its own down.
        let handed = Source::Handed(other, Arc::clone(&open));
        handed.ended(1);
        assert_eq!(counts(), [1, 0]);
    }
}
