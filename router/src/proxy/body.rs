//! The response bodies, and the request's charge on its permit.
//!
//! NB (who owns what):
//! - A request's permit lives in its [`Charge`], owned by one place at a time: the handler
//!   until the response head is ready, then the response body. The charge ends the request
//!   exactly once: `finish` (the engine's answer ended) or `cut`; dropped without either, the
//!   client went away (`client_gone`). It is released (dropped) the moment the request is
//!   over, so a body a stuck client never finishes never holds a permit past the cut.
//! - A non-streamed answer goes through [`DirectBody`], a streamed one (`text/event-stream`)
//!   through [`StreamBody`]. Both poll the engine's body themselves, in the client
//!   connection's task, when the server (`super::server`) asks for the next frame: nothing
//!   is copied through a channel, no task is spawned, and a client that does not take what
//!   was sent keeps the engine's bytes in the engine's socket (back-pressure).
//! - A streamed answer is held back until its first output by [`start_stream`], in the
//!   handler, so that a deadline before it is still a plain 503.
//! - A client that reads nothing cannot be seen from here (the server stops polling a body
//!   whose bytes the socket does not take): the connection watches its socket
//!   (`super::conn`) and closes it; the body, dropped, then reports `read_stall` instead of
//!   `client_gone`.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::time::{Instant, Sleep};

use super::Failure;
use super::conn::ConnWatch;
use super::sse::{EventScanner, Oversized, is_output};
use super::upstream::UpstreamBody;
use crate::admission::Permit;
use crate::observe::{self, RequestEvent, RequestObserver};

/// A request's report to the observer, made once: by [`Watch`] (the handler) or, once an
/// engine's answer is under way, by the request's [`Charge`].
pub(crate) struct Observation {
    observer: Arc<dyn RequestObserver>,
    event: RequestEvent,
    /// When the request began to wait for its admission (for `waited` if it ends meanwhile).
    asked: Option<Instant>,
    /// When it was admitted (for `served`).
    admitted: Option<Instant>,
}

impl Observation {
    fn emit(mut self, code: Option<&'static str>) {
        if let Some(asked) = self.asked.take() {
            self.event.waited = asked.elapsed();
        }
        if let Some(admitted) = self.admitted {
            self.event.served = admitted.elapsed();
        }
        self.event.code = code;
        self.observer.finished(&self.event);
    }
}

/// The handler's hold on the request's [`Observation`]; reports `499 client_gone` when dropped
/// still holding it (the client went away before an answer).
pub(crate) struct Watch(Option<Observation>);

impl Watch {
    pub(crate) fn new(observer: Option<&Arc<dyn RequestObserver>>) -> Self {
        Watch(observer.map(|observer| Observation {
            observer: Arc::clone(observer),
            event: RequestEvent {
                deployment_id: None,
                model: None,
                status: observe::STATUS_CLIENT_GONE,
                code: None,
                waited: Duration::ZERO,
                served: Duration::ZERO,
                streamed: false,
            },
            asked: None,
            admitted: None,
        }))
    }

    pub(crate) fn model(&mut self, model: &str) {
        if let Some(o) = &mut self.0 {
            o.event.model = Some(model.to_string());
        }
    }

    pub(crate) fn deployment(&mut self, id: &str) {
        if let Some(o) = &mut self.0 {
            o.event.deployment_id = Some(id.to_string());
        }
    }

    pub(crate) fn asking(&mut self) {
        if let Some(o) = &mut self.0 {
            o.asked = Some(Instant::now());
        }
    }

    pub(crate) fn answered(&mut self) {
        if let Some(o) = &mut self.0
            && let Some(asked) = o.asked.take()
        {
            let now = Instant::now();
            o.event.waited = now.saturating_duration_since(asked);
            o.admitted = Some(now);
        }
    }

    /// Reports now, with this status and code.
    pub(crate) fn end(&mut self, status: u16, code: Option<&'static str>) {
        if let Some(mut o) = self.0.take() {
            o.event.status = status;
            o.emit(code);
        }
    }

    /// Hands the report to the charge: it is made when the request ends.
    pub(crate) fn hand_to(&mut self, charge: &mut dyn Track, status: u16, streamed: bool) {
        if let Some(mut o) = self.0.take() {
            o.event.status = status;
            o.event.streamed = streamed;
            charge.observe(o);
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(o) = self.0.take() {
            o.emit(Some(observe::CLIENT_GONE));
        }
    }
}

/// At most this much already-sent data is gathered into one frame for the client.
const COALESCE_BYTES: usize = 16 * 1024;

/// What the handler and the bodies do with a request's permit (object-safe, so that the
/// bodies need not be generic over the permit).
pub(crate) trait Track: Send {
    /// The engine produced its first output (reported once).
    fn output(&mut self);
    /// The engine's answer ended normally; releases the permit.
    fn finish(&mut self);
    /// The request was cut short; releases the permit. `code`: why, for the observer.
    fn cut(&mut self, code: &'static str);
    /// Reports to the observer when the request ends (at once if it already has).
    fn observe(&mut self, observation: Observation);
}

/// One request's permit and how the request went. Every request ends exactly once: the first
/// of `finish` and `cut` wins, later calls do nothing; dropped before either, the client went
/// away.
pub(crate) struct Charge<P: Permit> {
    /// Taken out (and dropped) when the request ends.
    permit: Option<P>,
    /// The observer's report, once the handler handed it over.
    observation: Option<Observation>,
    /// `first_output` was reported.
    output: bool,
    /// `Some(code)` once the request ended.
    ended: Option<Option<&'static str>>,
}

impl<P: Permit> Charge<P> {
    /// A charge holding `permit`.
    pub(crate) fn new(permit: P) -> Self {
        Self {
            permit: Some(permit),
            observation: None,
            output: false,
            ended: None,
        }
    }

    fn end(&mut self, code: Option<&'static str>) {
        if self.ended.is_some() {
            return;
        }
        self.ended = Some(code);
        if let Some(permit) = self.permit.take() {
            if code.is_some() {
                permit.cut();
            }
            drop(permit);
        }
        if let Some(o) = self.observation.take() {
            o.emit(code);
        }
    }
}

impl<P: Permit> Track for Charge<P> {
    fn output(&mut self) {
        if !self.output {
            self.output = true;
            if let Some(permit) = &self.permit {
                permit.first_output();
            }
        }
    }

    fn finish(&mut self) {
        self.end(None);
    }

    fn cut(&mut self, code: &'static str) {
        self.end(Some(code));
    }

    fn observe(&mut self, observation: Observation) {
        match self.ended {
            Some(code) => observation.emit(code),
            None => self.observation = Some(observation),
        }
    }
}

impl<P: Permit> Drop for Charge<P> {
    fn drop(&mut self) {
        // Neither finished nor cut: whoever held it was dropped, because the client went away.
        self.end(Some(observe::CLIENT_GONE));
    }
}

/// The body of every answer the listener sends.
pub struct ProxyBody {
    kind: Kind,
    /// Reads the engine's usage as the body passes, for a tenant's tokens.
    tap: Option<Box<UsageTap>>,
}

/// The tail of an engine's answer, where its `usage` is (a non-streamed answer's object ends
/// with it; a stream that asked for it has it in its last chunk): when the body is dropped,
/// the tenant is charged the last `"total_tokens"` seen.
pub(crate) struct UsageTap {
    tenant: Arc<crate::tenants::TenantEntry>,
    /// The latest frames (shared, not copied): at least [`USAGE_TAIL`] bytes of them once the
    /// answer is that long, the last one in `last` (a non-streamed answer's usual only one:
    /// nothing allocated for it) and those before it in `earlier`.
    last: Option<Bytes>,
    earlier: std::collections::VecDeque<Bytes>,
    /// Their bytes.
    held: usize,
    /// Takes the usage the listener asked for out of a streamed answer (`None` when the
    /// client's answer is forwarded as it comes). While it is on it reads that usage itself,
    /// and no frame is kept here (what it sends has no usage left to read).
    strip: Option<super::usage::Strip>,
    /// The strip's output for a frame, still to give after the piece given last (the strip
    /// fills it only once every piece was given): the listener writes them with that piece, in
    /// the same write ([`ProxyBody::queued`]); another reader gets each as a frame.
    queued: super::usage::Sent,
}

/// The bytes of an answer's end that [`UsageTap`] reads.
const USAGE_TAIL: usize = 4096;

impl UsageTap {
    pub(crate) fn new(tenant: Arc<crate::tenants::TenantEntry>) -> Box<Self> {
        Box::new(Self {
            tenant,
            last: None,
            earlier: std::collections::VecDeque::new(),
            held: 0,
            strip: None,
            queued: super::usage::Sent::default(),
        })
    }

    /// The same tap, taking the usage chunk out of the stream with `strip` (the listener
    /// asked for it).
    pub(crate) fn stripping(mut self: Box<Self>, strip: super::usage::Strip) -> Box<Self> {
        self.strip = Some(strip);
        self
    }

    fn feed(&mut self, data: &Bytes) {
        self.held += data.len();
        let Some(before) = self.last.replace(data.clone()) else {
            return;
        };
        self.earlier.push_back(before);
        while self
            .earlier
            .front()
            .is_some_and(|f| self.held - f.len() >= USAGE_TAIL)
        {
            if let Some(f) = self.earlier.pop_front() {
                self.held -= f.len();
            }
        }
    }

    /// The [`total_tokens`] of the last [`USAGE_TAIL`] bytes (or fewer): read in place when
    /// one frame holds them (a non-streamed answer's usual one), else from a copy in one piece.
    fn tail_tokens(&self) -> Option<u64> {
        let last = self.last.as_ref()?;
        if self.earlier.is_empty() {
            return total_tokens(&last[last.len().saturating_sub(USAGE_TAIL)..]);
        }
        let mut out = Vec::with_capacity(self.held);
        for f in self.earlier.iter().chain([last]) {
            out.extend_from_slice(f);
        }
        let cut = out.len().saturating_sub(USAGE_TAIL);
        total_tokens(&out[cut..])
    }
}

/// The number after the last `"total_tokens":` of `tail`.
///
/// NB (cost): the key is found back from the end by its `_` (6 bytes in), with `memrchr`: an
/// answer's usage is at its end, its `total_tokens` the last or nearly the last key with a
/// `_`; a reverse `memmem` read the whole tail (about 480 instructions of a usual answer).
pub(crate) fn total_tokens(tail: &[u8]) -> Option<u64> {
    let at = last_total_tokens(tail)?;
    let rest = tail[at + TOTAL_TOKENS.len()..].trim_ascii_start();
    let rest = rest.strip_prefix(b":")?.trim_ascii_start();
    // The digits as `str::parse::<u64>` reads them (none, or past `u64`: no number), without
    // making a `str` of them first (about 100 instructions of every tenant's answer).
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 {
        return None;
    }
    rest[..digits].iter().try_fold(0u64, |n, d| {
        n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    })
}

/// The key [`total_tokens`] reads, quoted.
const TOTAL_TOKENS: &[u8] = b"\"total_tokens\"";

/// Where the last [`TOTAL_TOKENS`] of `tail` is.
fn last_total_tokens(tail: &[u8]) -> Option<usize> {
    memchr::memrchr_iter(b'_', tail)
        .filter_map(|underscore| underscore.checked_sub(6))
        .find(|&at| tail[at..].starts_with(TOTAL_TOKENS))
}

impl Drop for ProxyBody {
    fn drop(&mut self) {
        if let Some(tap) = self.tap.take()
            && let Some(tokens) = tap
                .strip
                .as_ref()
                .and_then(|s| s.tokens)
                .or_else(|| tap.tail_tokens())
        {
            tap.tenant.charge_tokens(tokens, Instant::now());
        }
    }
}

enum Kind {
    Full(Option<Bytes>),
    Direct(DirectBody),
    Stream(StreamBody),
}

impl ProxyBody {
    /// A body of fixed bytes.
    pub(crate) fn full(bytes: impl Into<Bytes>) -> Self {
        let bytes = bytes.into();
        Self {
            kind: Kind::Full((!bytes.is_empty()).then_some(bytes)),
            tap: None,
        }
    }

    pub(crate) fn direct(body: DirectBody) -> Self {
        Self {
            kind: Kind::Direct(body),
            tap: None,
        }
    }

    pub(crate) fn stream(body: StreamBody) -> Self {
        Self {
            kind: Kind::Stream(body),
            tap: None,
        }
    }

    /// The same body, its usage read for a tenant as it passes.
    pub(crate) fn tapped(mut self, tap: Option<Box<UsageTap>>) -> Self {
        if let Kind::Stream(body) = &mut self.kind
            && tap
                .as_ref()
                .and_then(|t| t.strip.as_ref())
                .is_some_and(super::usage::Strip::reads_events)
        {
            body.record_ends();
        }
        self.tap = tap;
        self
    }

    /// The pieces to be sent right after the frame given last (none unless a tenant's usage is
    /// taken out of a stream: [`super::usage::Sent`]): the listener writes them with that
    /// frame, in the same write and chunk ([`ProxyBody::queued_given`] once written); a reader
    /// of frames gets each as a frame.
    pub(crate) fn queued(&self) -> &[Bytes] {
        self.tap.as_ref().map_or(&[], |t| t.queued.rest())
    }

    /// The [`ProxyBody::queued`] pieces were written.
    pub(crate) fn queued_given(&mut self) {
        if let Some(tap) = &mut self.tap {
            tap.queued.given();
        }
    }

    /// Whether nothing follows the pieces [`ProxyBody::queued`] (the answer ends with them).
    pub(crate) fn ends_after_queued(&self) -> bool {
        self.tap
            .as_ref()
            .is_none_or(|t| t.strip.as_ref().is_none_or(|s| !s.holds()))
            && self.kind_ended()
    }

    /// Whether its own body (the engine's, or its bytes) has nothing more to give.
    fn kind_ended(&self) -> bool {
        match &self.kind {
            Kind::Full(bytes) => bytes.is_none(),
            Kind::Direct(body) => body.inner.as_ref().is_none_or(Body::is_end_stream),
            Kind::Stream(body) => body.over && body.due.is_none(),
        }
    }

    /// Reads the whole body (for tests and tools; the listener itself never does this).
    pub async fn into_bytes(self) -> io::Result<Bytes> {
        Ok(self.collect().await?.to_bytes())
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = self.get_mut();
        if let Some(next) = this.tap.as_mut().and_then(|t| t.queued.pop()) {
            return Poll::Ready(Some(Ok(Frame::data(next))));
        }
        loop {
            let polled = match &mut this.kind {
                Kind::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
                Kind::Direct(body) => body.poll(cx),
                Kind::Stream(body) => body.poll(cx),
            };
            let Some(tap) = this.tap.as_mut() else {
                return polled;
            };
            let Some(strip) = tap.strip.as_mut() else {
                if let Poll::Ready(Some(Ok(frame))) = &polled
                    && let Some(data) = frame.data_ref()
                {
                    tap.feed(data);
                }
                return polled;
            };
            let sent = &mut tap.queued;
            match polled {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        let ends = match &this.kind {
                            Kind::Stream(body) => body.frame_ends(),
                            _ => None,
                        };
                        strip.pass_with(data, ends, sent);
                    }
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
                },
                Poll::Ready(None) => {
                    strip.finish(sent);
                    if sent.is_empty() {
                        return Poll::Ready(None);
                    }
                }
                other => return other,
            }
            if strip.gave_up() {
                // What it passes has its usage still (or had it in what it held): read here.
                let pieces = std::mem::take(&mut tap.queued);
                for piece in pieces.rest() {
                    tap.feed(piece);
                }
                tap.queued = pieces;
            }
            let Some(first) = tap.queued.pop() else {
                // All of it held (or the usage chunk): the next frame now.
                continue;
            };
            return Poll::Ready(Some(Ok(Frame::data(first))));
        }
    }

    fn is_end_stream(&self) -> bool {
        self.queued().is_empty() && self.ends_after_queued()
    }

    fn size_hint(&self) -> SizeHint {
        if self.tap.as_ref().is_some_and(|t| t.strip.is_some()) {
            // Its length is not the engine's.
            return SizeHint::default();
        }
        match &self.kind {
            Kind::Full(bytes) => SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64)),
            Kind::Direct(body) => body
                .inner
                .as_ref()
                .map_or_else(|| SizeHint::with_exact(0), Body::size_hint),
            Kind::Stream(_) => SizeHint::default(),
        }
    }
}

/// The silence bound after the first output (`stream_idle_timeout`), armed only while the
/// engine keeps the body waiting, and moved (cheaply: only ever later) rather than re-created.
struct IdleTimer {
    idle: Duration,
    /// When the engine last sent something.
    last: Instant,
    timer: Option<Pin<Box<Sleep>>>,
}

impl IdleTimer {
    fn new(idle: Duration) -> Self {
        Self {
            idle,
            last: Instant::now(),
            timer: None,
        }
    }

    /// The engine sent something now.
    fn data(&mut self) {
        self.last = Instant::now();
    }

    /// The engine keeps the body waiting: ready once it has been silent for `idle`.
    fn poll_silent(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let deadline = self.last + self.idle;
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if timer.deadline() != deadline {
            timer.as_mut().reset(deadline);
        }
        timer.as_mut().poll(cx)
    }
}

/// A non-streamed answer: the engine's body, frame by frame, with the silence bound.
pub(crate) struct DirectBody {
    /// The engine's body; `None` once it ended or was given up (dropping it closes the
    /// engine's connection, which aborts its work).
    inner: Option<UpstreamBody>,
    /// `None` once the request ended.
    charge: Option<Box<dyn Track>>,
    idle: IdleTimer,
    /// Its client's connection, which tells whether it was closed for a read stall.
    conn: Option<Arc<ConnWatch>>,
}

impl DirectBody {
    pub(crate) fn new(
        inner: UpstreamBody,
        charge: Box<dyn Track>,
        idle: Duration,
        conn: Option<Arc<ConnWatch>>,
    ) -> Self {
        let mut body = Self {
            inner: Some(inner),
            charge: Some(charge),
            idle: IdleTimer::new(idle),
            conn,
        };
        body.finish_if_ended();
        body
    }

    /// Ends the request once the engine's body is complete, without waiting for a last poll
    /// that the server never makes once the body says it has ended.
    fn finish_if_ended(&mut self) {
        if self.inner.as_ref().is_some_and(Body::is_end_stream) {
            self.inner = None;
            if let Some(mut charge) = self.charge.take() {
                charge.finish();
            }
        }
    }

    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let Some(inner) = self.inner.as_mut() else {
            return Poll::Ready(None);
        };
        match Pin::new(inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                self.idle.data();
                self.finish_if_ended();
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(err))) => {
                self.give_up(observe::UPSTREAM_FAILED);
                Poll::Ready(Some(Err(io::Error::other(err))))
            }
            Poll::Ready(None) => {
                self.inner = None;
                if let Some(mut charge) = self.charge.take() {
                    charge.finish();
                }
                Poll::Ready(None)
            }
            Poll::Pending => match self.idle.poll_silent(cx) {
                Poll::Ready(()) => {
                    tracing::debug!("non-streamed answer silent past stream_idle_timeout");
                    self.give_up(observe::STREAM_IDLE_TIMEOUT);
                    Poll::Ready(Some(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the engine was silent past stream_idle_timeout",
                    ))))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }

    /// Drops the engine's body (the engine sees the disconnect) and cuts the request.
    fn give_up(&mut self, code: &'static str) {
        self.inner = None;
        if let Some(mut charge) = self.charge.take() {
            charge.cut(code);
        }
    }
}

impl Drop for DirectBody {
    fn drop(&mut self) {
        // Still charged: the client went away before the answer was complete, or its
        // connection was closed because it took nothing for `read_stall`.
        self.give_up(ConnWatch::cut_code(self.conn.as_ref()));
    }
}

/// What a streamed answer needs to know.
#[derive(Clone)]
pub(crate) struct StreamSettings {
    /// The request deadline (arrival + `request_deadline`): bounds the wait for first output.
    pub(crate) deadline: Instant,
    /// From arrival to `deadline`, and how much of it the request waited at its deployment's
    /// in-flight bound: which error a deadline before the first output is
    /// ([`crate::admission::deadline_error`]).
    pub(crate) waits: (Duration, Duration),
    /// `stream_idle_timeout`.
    pub(crate) idle: Duration,
    /// `max_piece`.
    pub(crate) max_piece: usize,
    /// The client's connection, watched for a reader that takes nothing (`None` without a
    /// socket, as in `Proxy::handle`).
    pub(crate) conn: Option<Arc<ConnWatch>>,
}

/// Why a streamed answer ended early, after its head was sent.
#[derive(Debug, Clone, Copy)]
enum Early {
    Idle,
    Oversized,
    UpstreamFailed,
}

impl Early {
    fn code(self) -> &'static str {
        match self {
            Early::Idle => observe::STREAM_IDLE_TIMEOUT,
            Early::Oversized => observe::PIECE_TOO_LARGE,
            Early::UpstreamFailed => observe::UPSTREAM_FAILED,
        }
    }

    /// The SSE error event that ends the stream.
    fn event(self, idle: Duration, max_piece: usize) -> Bytes {
        let code = self.code();
        let message = match self {
            Early::Idle => format!(
                "the engine sent nothing for {} ms (stream_idle_timeout); the answer was cut",
                idle.as_millis()
            ),
            Early::Oversized => format!(
                "a piece of the answer is larger than {max_piece} bytes; the answer was cut"
            ),
            Early::UpstreamFailed => "the engine's answer broke off".to_string(),
        };
        let body = serde_json::json!({
            "error": {"code": code, "message": message, "retryable": true}
        });
        Bytes::from(format!("data: {body}\n\n"))
    }
}

/// How a streamed answer began, for the handler that sends the response head.
pub(crate) enum Start {
    /// The first output came: stream, beginning with what was held back.
    Stream(StreamBody),
    /// The engine's answer ended before any output: these bytes are the whole body.
    Whole(Bytes),
    /// Nothing was sent yet, so the failure is an HTTP error.
    Fail(Failure),
    /// The first event was the engine's word that it does not have the adapter asked for
    /// (what it said; nothing was passed on): the request's charge, not ended, is handed back
    /// for the caller to end (see `lost`).
    Lost(String, Box<dyn Track>),
}

/// Reads a streamed answer until its first output, holding everything back (at most one
/// piece), so that a request deadline before it can still be answered 503; then hands the rest
/// to a [`StreamBody`]. With `adapter` (a request for that adapter on a base whose engine says
/// in its stream that it lacks one: SGLang), a first output that says so is not passed on
/// ([`Start::Lost`]).
pub(crate) async fn start_stream(
    mut upstream: UpstreamBody,
    mut charge: Box<dyn Track>,
    deployment: &str,
    settings: StreamSettings,
    adapter: Option<&str>,
) -> Start {
    let mut scanner = EventScanner::new(settings.max_piece);
    let timer = tokio::time::sleep_until(settings.deadline);
    tokio::pin!(timer);
    let mut held = BytesMut::new();
    let mut event_start = 0;
    let mut scanned = 0;
    loop {
        let next = tokio::select! {
            biased;
            frame = upstream.frame() => Some(frame),
            () = &mut timer => None,
        };
        let failure = match next {
            None => Failure::Api(crate::admission::deadline_error(
                deployment,
                settings.waits.1,
                settings.waits.0,
            )),
            Some(None) => {
                charge.finish();
                return Start::Whole(held.freeze());
            }
            Some(Some(Err(err))) => Failure::upstream(&err),
            Some(Some(Ok(frame))) => {
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                held.extend_from_slice(&data);
                let single = match first_output(&mut scanner, &held, &mut event_start, &mut scanned)
                {
                    Ok(Some(first)) => {
                        let said = adapter.and_then(|name| {
                            super::lost::stream_says_not_loaded(
                                held.get(first).unwrap_or_default(),
                                name,
                            )
                        });
                        if let Some(said) = said {
                            drop(upstream);
                            return Start::Lost(said, charge);
                        }
                        charge.output();
                        let body =
                            StreamBody::new(upstream, charge, scanner, held.freeze(), settings);
                        return Start::Stream(body);
                    }
                    // The event still coming is bounded by the scanner; the complete ones
                    // before it, none of them output, here.
                    Ok(None) if event_start <= settings.max_piece => continue,
                    // Many small pieces and still no output: held back as one piece.
                    Ok(None) => false,
                    Err(Oversized) => true,
                };
                // Too large to hold: the complete events so far, then the error event. A
                // single piece that large is no role chunk: the engine produced output.
                drop(upstream);
                if single {
                    charge.output();
                }
                charge.cut(observe::PIECE_TOO_LARGE);
                held.truncate(event_start);
                held.extend_from_slice(&Early::Oversized.event(settings.idle, settings.max_piece));
                return Start::Stream(StreamBody::ended(charge, held.freeze(), settings));
            }
        };
        drop(upstream);
        charge.cut(failure.code());
        return Start::Fail(failure);
    }
}

/// Scans the held bytes for complete events; once one of them is output, where it is in them.
fn first_output(
    scanner: &mut EventScanner,
    held: &[u8],
    event_start: &mut usize,
    scanned: &mut usize,
) -> Result<Option<std::ops::Range<usize>>, Oversized> {
    while let Some(end) = scanner.next_end(held, *scanned)? {
        let start = *event_start;
        let event = held.get(start..end).unwrap_or_default();
        *event_start = end;
        *scanned = end;
        if is_output(event) {
            // Keep measuring the rest of the frame.
            scanner.measure(held.get(end..).unwrap_or_default())?;
            return Ok(Some(start..end));
        }
    }
    *scanned = held.len();
    Ok(None)
}

/// A streamed answer after its first output: forwards the engine's pieces as the server asks
/// for them (what the engine already sent is gathered into one frame), and ends early, with an
/// SSE error event, on a piece past `max_piece`, a silence past `stream_idle_timeout` or an
/// engine that breaks off.
pub(crate) struct StreamBody {
    /// The engine's body; `None` once it ended or was given up.
    upstream: Option<UpstreamBody>,
    /// `None` once the request ended.
    charge: Option<Box<dyn Track>>,
    scanner: EventScanner,
    /// Bytes due before anything else: the held-back start; at the end, the error event.
    due: Option<Bytes>,
    /// Nothing more comes from the engine: `due` (if any) is the last frame.
    over: bool,
    idle: IdleTimer,
    max_piece: usize,
    /// Its client's connection, which tells whether it was closed for a read stall.
    conn: Option<Arc<ConnWatch>>,
    /// Where the events of the frame it last gave end in it, as its scanner found them, when
    /// they are asked for ([`StreamBody::record_ends`]: the usage strip of a single-choice
    /// stream reads its events by them instead of searching its bytes).
    ends: Option<Vec<usize>>,
    /// `ends` holds every event end of the frame it last gave (not of a frame held back
    /// from before the first output, nor of one cut short).
    ends_whole: bool,
    /// A frame of the engine's read but not gathered into the frame given last (no room for
    /// it there): the next one begins with it.
    carried: Option<Bytes>,
}

/// The event ends of one frame that [`StreamBody`] keeps at most (past them, the frame's are
/// not given: [`StreamBody::frame_ends`]).
const MAX_ENDS: usize = 512;

impl StreamBody {
    fn new(
        upstream: UpstreamBody,
        charge: Box<dyn Track>,
        scanner: EventScanner,
        first: Bytes,
        settings: StreamSettings,
    ) -> Self {
        Self {
            upstream: Some(upstream),
            charge: Some(charge),
            scanner,
            due: Some(first),
            over: false,
            idle: IdleTimer::new(settings.idle),
            max_piece: settings.max_piece,
            conn: settings.conn,
            ends: None,
            ends_whole: false,
            carried: None,
        }
    }

    /// A stream already over (cut before it began): `last` is all there is to send.
    fn ended(charge: Box<dyn Track>, last: Bytes, settings: StreamSettings) -> Self {
        Self {
            upstream: None,
            charge: Some(charge),
            scanner: EventScanner::new(settings.max_piece),
            due: Some(last),
            over: true,
            idle: IdleTimer::new(settings.idle),
            max_piece: settings.max_piece,
            conn: None,
            ends: None,
            ends_whole: false,
            carried: None,
        }
    }

    /// From now on, where the events of each frame end is kept ([`StreamBody::frame_ends`]).
    pub(crate) fn record_ends(&mut self) {
        self.ends
            .get_or_insert_with(|| Vec::with_capacity(MAX_ENDS / 8));
    }

    /// Where the events of the frame it gave last end in it (every one of them, in order), when
    /// asked for ([`StreamBody::record_ends`]) and known.
    pub(crate) fn frame_ends(&self) -> Option<&[usize]> {
        self.ends.as_deref().filter(|_| self.ends_whole)
    }

    /// Hands the observer's report to the request's charge.
    pub(crate) fn charge_mut(&mut self) -> Option<&mut (dyn Track + 'static)> {
        self.charge.as_deref_mut()
    }

    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        self.ends_whole = false;
        if let Some(due) = self.due.take() {
            return Poll::Ready(Some(Ok(Frame::data(due))));
        }
        if self.over {
            return Poll::Ready(None);
        }
        let Some(upstream) = self.upstream.as_mut() else {
            return Poll::Ready(None);
        };
        // Everything the engine already sent, up to `COALESCE_BYTES`: one frame, one write.
        let mut first: Option<Bytes> = None;
        let mut batch: Option<BytesMut> = None;
        let mut early = None;
        // The bytes gathered so far (where the next frame begins in the one given), and
        // whether every event end of them was kept.
        let mut gathered = 0;
        let mut ends_whole = true;
        if let Some(ends) = &mut self.ends {
            ends.clear();
        }
        let mut carried = self.carried.take();
        loop {
            let polled = match carried.take() {
                Some(data) => Poll::Ready(Some(Ok(Frame::data(data)))),
                None => Pin::new(&mut *upstream).poll_frame(cx),
            };
            match polled {
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    // A frame that the gathered ones' buffer (`COALESCE_BYTES`: what is
                    // gathered is given once it reaches that) has no room for is the next
                    // frame's start: that buffer is not grown (a copy of all it holds).
                    if first.is_some() && gathered + data.len() > COALESCE_BYTES {
                        self.carried = Some(data);
                        break;
                    }
                    let ends = self.ends.as_mut().map(|ends| (ends, MAX_ENDS));
                    match self.scanner.measure_ends(&data, gathered, ends) {
                        Ok(all) => ends_whole &= all,
                        Err(Oversized) => {
                            early = Some(Early::Oversized);
                            break;
                        }
                    }
                    let size = match (&mut first, &mut batch) {
                        (None, _) => {
                            let size = data.len();
                            first = Some(data);
                            size
                        }
                        (Some(head), None) => {
                            // Room for all that is gathered (never past `COALESCE_BYTES`).
                            let mut b = BytesMut::with_capacity(COALESCE_BYTES);
                            b.extend_from_slice(head);
                            b.extend_from_slice(&data);
                            let size = b.len();
                            batch = Some(b);
                            size
                        }
                        (Some(_), Some(b)) => {
                            b.extend_from_slice(&data);
                            b.len()
                        }
                    };
                    gathered = size;
                    if size >= COALESCE_BYTES {
                        break;
                    }
                }
                Poll::Ready(Some(Err(err))) => {
                    tracing::debug!(error = %err, "engine's streamed answer broke off");
                    early = Some(Early::UpstreamFailed);
                    break;
                }
                Poll::Ready(None) => {
                    self.upstream = None;
                    self.over = true;
                    if let Some(mut charge) = self.charge.take() {
                        charge.finish();
                    }
                    break;
                }
                Poll::Pending => {
                    if first.is_some() {
                        break;
                    }
                    return match self.idle.poll_silent(cx) {
                        Poll::Ready(()) => {
                            self.end_early(Early::Idle);
                            Poll::Ready(self.due.take().map(|b| Ok(Frame::data(b))))
                        }
                        Poll::Pending => Poll::Pending,
                    };
                }
            }
        }
        // Where the events of the frame given now end is known (one cut short gives its
        // frames before the piece past the bound, and then the error event: neither told).
        let cut = early.is_some();
        if let Some(early) = early {
            self.end_early(early);
        }
        let data = match (batch, first) {
            (Some(batch), _) => Some(batch.freeze()),
            (None, first) => first,
        };
        self.ends_whole = ends_whole && !cut && data.is_some();
        match data {
            Some(data) => {
                self.idle.data();
                Poll::Ready(Some(Ok(Frame::data(data))))
            }
            None => Poll::Ready(self.due.take().map(|b| Ok(Frame::data(b)))),
        }
    }

    /// Gives the engine's body up (the engine sees the disconnect), cuts the request, and puts
    /// the error event last.
    fn end_early(&mut self, why: Early) {
        tracing::debug!(reason = ?why, "streamed answer cut");
        self.upstream = None;
        self.over = true;
        if let Some(mut charge) = self.charge.take() {
            charge.cut(why.code());
        }
        self.due = Some(why.event(self.idle.idle, self.max_piece));
    }
}

impl Drop for StreamBody {
    fn drop(&mut self) {
        self.upstream = None;
        if let Some(mut charge) = self.charge.take() {
            // The client's connection went away before the end: closed by its client, or by
            // the connection because the client read nothing for `read_stall`.
            let code = ConnWatch::cut_code(self.conn.as_ref());
            tracing::debug!(code, "streamed answer cut before its end");
            charge.cut(code);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// The last `"total_tokens"`, found back by its `_`, is where a reverse `memmem` finds it:
    /// in answers with other keys with a `_` after it, keys overlapping it, and every text
    /// made from them by deleting a byte or adding or changing one.
    #[test]
    fn the_last_total_tokens_is_found_as_a_reverse_search_finds_it() {
        let base = concat!(
            r#"{"usage":{"prompt_tokens":3,"total_tokens":5,"completion_tokens":2},"#,
            r#""x":"total_tokens"total_tokens":7,"kv_transfer_params":null,"_":"_"}"#,
        );
        let mut cases = vec![base.to_string()];
        for at in 0..base.len() {
            for b in ["", "_", "\"", "t", "s"] {
                cases.push(format!("{}{b}{}", &base[..at], &base[at + 1..]));
                cases.push(format!("{}{b}{}", &base[..at], &base[at..]));
            }
        }
        let mut found = 0;
        for case in &cases {
            let at = last_total_tokens(case.as_bytes());
            assert_eq!(
                at,
                memchr::memmem::rfind(case.as_bytes(), TOTAL_TOKENS),
                "{case}"
            );
            found += usize::from(at.is_some());
        }
        assert!(found * 2 > cases.len());
        assert_eq!(total_tokens(base.as_bytes()), Some(7));
        assert_eq!(total_tokens(&base.as_bytes()[..60]), Some(5));
        assert_eq!(total_tokens(b"{\"total_tokens\" : 12}"), Some(12));
        assert_eq!(total_tokens(b"{\"total_tokens\":null}"), None);
    }

    /// The number after `"total_tokens":` is what `str::parse::<u64>` makes of its digits: none,
    /// leading zeros, `u64::MAX` and one past it, a fraction or an exponent after them.
    #[test]
    fn the_tokens_read_as_parse_reads_their_digits() {
        for value in [
            "",
            "0",
            "007",
            "21",
            "5.0",
            "12e3",
            "-3",
            "18446744073709551615",
            "18446744073709551616",
            "99999999999999999999999",
            "1x",
        ] {
            let digits: String = value.chars().take_while(char::is_ascii_digit).collect();
            let answer = total_tokens(format!("{{\"total_tokens\":{value}}}").as_bytes());
            assert_eq!(answer, digits.parse::<u64>().ok(), "{value}");
        }
    }

    /// Tenant `a` (key `k`), its tokens counted, in a table of its own.
    fn tenant_a() -> (crate::tenants::Tenants, Arc<crate::tenants::TenantEntry>) {
        use capyctl_interfaces::tenants::{Tenant, TenantRate};
        let tenants = crate::tenants::Tenants::new();
        tenants
            .install(vec![Tenant {
                name: "a".into(),
                keys: vec!["k".into()],
                models: None,
                rate: Some(TenantRate {
                    requests_per_minute: None,
                    tokens_per_minute: Some(1_000_000),
                }),
            }])
            .unwrap();
        let crate::tenants::Auth::Tenant(entry) =
            tenants.authenticate(b"authorization: Bearer k\r\n")
        else {
            panic!("the key is the tenant's");
        };
        (tenants, entry)
    }

    /// A stream whose usage the listener asked for: while the strip is on, the tenant is
    /// charged the usage it took out and the tap keeps no frame; once it gave up (an event
    /// past its bound), the usage chunk reaches the client and the tap reads it.
    #[tokio::test]
    async fn the_tokens_come_from_the_strip_while_it_is_on_else_from_the_tap() {
        use http_body_util::BodyExt;
        const STREAM: &str = concat!(
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"},\"finish_reason\":null}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2,\"total_tokens\":5}}\n\n",
            "data: [DONE]\n\n",
        );
        let usage = STREAM.split_inclusive("\n\n").nth(2).unwrap();
        let key = capyctl_interfaces::router::InstanceKey {
            deployment: "d".into(),
            index: 0,
            host_id: "h".into(),
            generation: 1,
        };
        let fingerprints = super::super::usage::Fingerprints::default();
        for (max_piece, sent) in [
            (64 * 1024, STREAM.replace(usage, "")),
            (16, STREAM.to_string()),
        ] {
            let (tenants, entry) = tenant_a();
            let strip = super::super::usage::Strip::new(
                max_piece,
                super::super::usage::Engine::new(&fingerprints, &key),
            );
            let mut body = ProxyBody::full(Bytes::from_static(STREAM.as_bytes()))
                .tapped(Some(UsageTap::new(entry).stripping(strip)));
            let mut out = Vec::new();
            while let Some(frame) = body.frame().await {
                out.extend_from_slice(frame.unwrap().data_ref().unwrap());
            }
            assert_eq!(String::from_utf8(out).unwrap(), sent);
            let kept = body.tap.as_ref().unwrap().last.is_some();
            assert_eq!(kept, max_piece == 16, "frames kept by the tap");
            drop(body);
            assert_eq!(tenants.report()[0].tokens, 5, "max_piece {max_piece}");
        }
    }

    /// The tap keeps enough of the answer's last frames, whatever their sizes and count: the
    /// tokens it reads are those of the answer's last [`USAGE_TAIL`] bytes.
    #[test]
    fn the_tap_reads_the_answers_last_bytes_whatever_its_frames() {
        let (_tenants, entry) = tenant_a();
        // Usages between fillers of every length up to 150 bytes: 3 to 40 of them a tail.
        let mut answer = Vec::new();
        for n in 0..200u64 {
            answer.extend_from_slice(format!("{{\"total_tokens\":{n}}}").as_bytes());
            answer.extend(std::iter::repeat_n(
                b'x',
                usize::try_from(n * 37 % 151).unwrap(),
            ));
        }
        let mut read = 0;
        for sizes in [
            &[1][..],
            &[7, 300],
            &[100],
            &[1000, 3],
            &[4095],
            &[4096],
            &[5000, 50],
        ] {
            for end in (0..answer.len()).step_by(997).chain([answer.len()]) {
                let mut tap = UsageTap::new(Arc::clone(&entry));
                let (mut at, mut turn) = (0, 0);
                while at < end {
                    let next = end.min(at + sizes[turn % sizes.len()]);
                    tap.feed(&Bytes::copy_from_slice(&answer[at..next]));
                    (at, turn) = (next, turn + 1);
                }
                let want = total_tokens(&answer[end.saturating_sub(USAGE_TAIL)..end]);
                assert_eq!(tap.tail_tokens(), want, "frames of {sizes:?}, {end} bytes");
                read += usize::from(want.is_some());
            }
        }
        assert!(read > 50);
    }
}
