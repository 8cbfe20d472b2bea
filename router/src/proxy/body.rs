//! The response bodies, the request's charge on its permit, and the task that pumps a streamed
//! answer from the engine to the client.
//!
//! NB (who owns what):
//! - A non-streamed answer goes through [`DirectBody`], which polls the engine's body itself:
//!   nothing is copied, no task is spawned.
//! - A streamed answer (`text/event-stream`) is read by [`pump`], a task of its own, and handed
//!   to [`StreamBody`] through a channel of depth 1. The depth-1 channel is what lets the pump
//!   see a client that stopped reading: a piece the body has not taken within `read_stall`
//!   means the client read nothing for that long.
//! - The permit lives in a [`Charge`], shared by the handler, the pump and the body. It is
//!   released (dropped) the moment the request is over: the engine's answer ended, or the
//!   request was cut. A body a stuck client never finishes therefore never holds a permit.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::time::{Instant, Sleep};

use super::Failure;
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
}

impl Observation {
    fn emit(mut self, code: Option<&'static str>) {
        if let Some(asked) = self.asked.take() {
            self.event.waited = asked.elapsed();
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
                streamed: false,
            },
            asked: None,
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
            o.event.waited = asked.elapsed();
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
    pub(crate) fn hand_to(&mut self, charge: &dyn Track, status: u16, streamed: bool) {
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

/// At most this much already-sent data is gathered into one hand-over to the body.
const COALESCE_BYTES: usize = 16 * 1024;

/// What the handler, the pump and the bodies do with a request's permit.
pub(crate) trait Track: Send + Sync {
    /// The engine produced its first output (reported once).
    fn output(&self);
    /// The engine's answer ended normally; releases the permit.
    fn finish(&self);
    /// The request was cut short; releases the permit. `abort`: the client's connection must
    /// see an error rather than a clean end. `code`: why, for the observer.
    fn cut(&self, abort: bool, code: &'static str);
    /// Reports to the observer when the request ends (at once if it already has).
    fn observe(&self, observation: Observation);
    /// Whether the request was cut with `abort`.
    fn aborted(&self) -> bool;
}

const OUTPUT: u8 = 1;
const ENDED: u8 = 2;
const ABORT: u8 = 4;

/// One request's permit and how the request went. Every request ends exactly once: the first
/// of `finish` and `cut` wins, later calls do nothing.
pub(crate) struct Charge<P> {
    /// The permit (taken out, dropped, when the request ends), the observer's report and how
    /// the request ended.
    inner: Mutex<Inner<P>>,
    /// `OUTPUT`, `ENDED`, `ABORT` bits.
    flags: AtomicU8,
}

struct Inner<P> {
    permit: Option<P>,
    observation: Option<Observation>,
    /// `Some(code)` once the request ended.
    ended: Option<Option<&'static str>>,
}

impl<P: Permit> Charge<P> {
    /// A charge holding `permit`.
    pub(crate) fn new(permit: P) -> Self {
        Self {
            inner: Mutex::new(Inner {
                permit: Some(permit),
                observation: None,
                ended: None,
            }),
            flags: AtomicU8::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner<P>> {
        match self.inner.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// Takes the permit and the report out, recording how the request ended.
    fn take(&self, code: Option<&'static str>) -> (Option<P>, Option<Observation>) {
        let mut inner = self.lock();
        inner.ended = Some(code);
        (inner.permit.take(), inner.observation.take())
    }

    /// Sets `bits` together with `ENDED` unless the request already ended; true if it had not.
    fn end(&self, bits: u8) -> bool {
        self.flags
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |f| {
                (f & ENDED == 0).then_some(f | ENDED | bits)
            })
            .is_ok()
    }
}

impl<P: Permit> Track for Charge<P> {
    fn output(&self) {
        if self.flags.load(Ordering::Acquire) & (OUTPUT | ENDED) != 0 {
            return;
        }
        if self.flags.fetch_or(OUTPUT, Ordering::AcqRel) & OUTPUT == 0
            && let Some(permit) = self.lock().permit.as_ref()
        {
            permit.first_output();
        }
    }

    fn finish(&self) {
        if self.end(0) {
            let (permit, observation) = self.take(None);
            drop(permit);
            if let Some(o) = observation {
                o.emit(None);
            }
        }
    }

    fn cut(&self, abort: bool, code: &'static str) {
        if self.end(if abort { ABORT } else { 0 }) {
            let (permit, observation) = self.take(Some(code));
            if let Some(permit) = permit {
                permit.cut();
            }
            if let Some(o) = observation {
                o.emit(Some(code));
            }
        }
    }

    fn observe(&self, observation: Observation) {
        let mut inner = self.lock();
        match inner.ended {
            Some(code) => {
                drop(inner);
                observation.emit(code);
            }
            None => inner.observation = Some(observation),
        }
    }

    fn aborted(&self) -> bool {
        self.flags.load(Ordering::Acquire) & ABORT != 0
    }
}

/// Cuts the request when dropped while armed: the handler was dropped (the client went away)
/// while it waited for the engine.
pub(crate) struct CutOnDrop(pub(crate) Option<Arc<dyn Track>>);

impl CutOnDrop {
    /// Hands the charge on; the guard no longer cuts.
    pub(crate) fn disarm(mut self) -> Arc<dyn Track> {
        // The constructor always puts a charge in, and only `disarm` (which consumes the
        // guard) takes it out.
        match self.0.take() {
            Some(charge) => charge,
            None => unreachable!("CutOnDrop disarmed twice"),
        }
    }
}

impl Drop for CutOnDrop {
    fn drop(&mut self) {
        if let Some(charge) = self.0.take() {
            charge.cut(true, observe::CLIENT_GONE);
        }
    }
}

/// The body of every answer the listener sends.
pub struct ProxyBody {
    kind: Kind,
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
        }
    }

    pub(crate) fn direct(body: DirectBody) -> Self {
        Self {
            kind: Kind::Direct(body),
        }
    }

    pub(crate) fn stream(body: StreamBody) -> Self {
        Self {
            kind: Kind::Stream(body),
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
        match &mut self.get_mut().kind {
            Kind::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            Kind::Direct(body) => body.poll(cx),
            Kind::Stream(body) => body.poll(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full(bytes) => bytes.is_none(),
            Kind::Direct(body) => body.inner.as_ref().is_none_or(Body::is_end_stream),
            Kind::Stream(_) => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
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

/// A non-streamed answer: the engine's body, frame by frame, with the silence bound.
pub(crate) struct DirectBody {
    /// The engine's body; `None` once it ended or was given up.
    inner: Option<UpstreamBody>,
    /// `None` once the request ended.
    charge: Option<Arc<dyn Track>>,
    /// `stream_idle_timeout`.
    idle: Duration,
    /// Created the first time the engine keeps the body waiting.
    timer: Option<Pin<Box<Sleep>>>,
    /// Whether `timer` runs for the current silence.
    armed: bool,
}

impl DirectBody {
    pub(crate) fn new(inner: UpstreamBody, charge: Arc<dyn Track>, idle: Duration) -> Self {
        let mut body = Self {
            inner: Some(inner),
            charge: Some(charge),
            idle,
            timer: None,
            armed: false,
        };
        body.finish_if_ended();
        body
    }

    /// Ends the request once the engine's body is complete, without waiting for a last poll
    /// that hyper may never make.
    fn finish_if_ended(&mut self) {
        if self.inner.as_ref().is_some_and(Body::is_end_stream) {
            self.inner = None;
            if let Some(charge) = self.charge.take() {
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
                self.armed = false;
                self.finish_if_ended();
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(err))) => {
                self.give_up(observe::UPSTREAM_FAILED);
                Poll::Ready(Some(Err(io::Error::other(err))))
            }
            Poll::Ready(None) => {
                self.inner = None;
                if let Some(charge) = self.charge.take() {
                    charge.finish();
                }
                Poll::Ready(None)
            }
            Poll::Pending => {
                let deadline = Instant::now() + self.idle;
                let timer = self
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                if !self.armed {
                    timer.as_mut().reset(deadline);
                    self.armed = true;
                }
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => {
                        tracing::debug!("non-streamed answer silent past stream_idle_timeout");
                        self.give_up(observe::STREAM_IDLE_TIMEOUT);
                        Poll::Ready(Some(Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "the engine was silent past stream_idle_timeout",
                        ))))
                    }
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    /// Drops the engine's body (the engine sees the disconnect) and cuts the request.
    fn give_up(&mut self, code: &'static str) {
        self.inner = None;
        if let Some(charge) = self.charge.take() {
            charge.cut(true, code);
        }
    }
}

impl Drop for DirectBody {
    fn drop(&mut self) {
        // Still charged: the client went away before the answer was complete.
        self.give_up(observe::CLIENT_GONE);
    }
}

/// A streamed answer, fed by [`pump`].
pub(crate) struct StreamBody {
    /// What the pump held back until the first output (the role chunk and the first output).
    first: Option<Bytes>,
    /// Pieces from the pump; closed when the pump is done.
    rx: mpsc::Receiver<Bytes>,
    /// Tells whether the end is clean or an abort.
    charge: Arc<dyn Track>,
}

impl StreamBody {
    pub(crate) fn new(first: Bytes, rx: mpsc::Receiver<Bytes>, charge: Arc<dyn Track>) -> Self {
        Self {
            first: Some(first),
            rx,
            charge,
        }
    }

    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        if let Some(first) = self.first.take() {
            return Poll::Ready(Some(Ok(Frame::data(first))));
        }
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(piece)) => Poll::Ready(Some(Ok(Frame::data(piece)))),
            Poll::Ready(None) if self.charge.aborted() => Poll::Ready(Some(Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "the streamed answer was cut",
            )))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// How the pump began the answer, for the handler waiting to send the response head.
pub(crate) enum Start {
    /// The first output came: stream, beginning with these bytes.
    Stream(Bytes),
    /// The engine's answer ended before any output: send these bytes as the whole body.
    Whole(Bytes),
    /// Nothing was sent yet, so the failure is an HTTP error.
    Fail(Failure),
}

/// What the pump needs to know.
pub(crate) struct PumpSettings {
    /// The request deadline (arrival + `request_deadline`): bounds the wait for first output.
    pub(crate) deadline: Instant,
    /// The deployment's ID, for the deadline's message.
    pub(crate) deployment: String,
    /// `stream_idle_timeout`.
    pub(crate) idle: Duration,
    /// `read_stall`.
    pub(crate) read_stall: Duration,
    /// `max_piece`.
    pub(crate) max_piece: usize,
    /// Closes the client's connection (a stalled client is not reading, so an error in the
    /// body would never reach hyper).
    pub(crate) kill: Option<Arc<Notify>>,
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

    fn event(self, settings: &PumpSettings) -> Bytes {
        let code = self.code();
        let message = match self {
            Early::Idle => format!(
                "the engine sent nothing for {} ms (stream_idle_timeout); the answer was cut",
                settings.idle.as_millis()
            ),
            Early::Oversized => format!(
                "a piece of the answer is larger than {} bytes; the answer was cut",
                settings.max_piece
            ),
            Early::UpstreamFailed => "the engine's answer broke off".to_string(),
        };
        let body = serde_json::json!({
            "error": {"code": code, "message": message, "retryable": true}
        });
        Bytes::from(format!("data: {body}\n\n"))
    }
}

/// Reads a streamed answer from the engine: holds it back until the first output (so a request
/// deadline before it can still be answered 503), then forwards piece by piece, enforcing the
/// silence bound, the piece bound and the read stall.
pub(crate) async fn pump(
    mut upstream: UpstreamBody,
    charge: Arc<dyn Track>,
    settings: PumpSettings,
    mut start: oneshot::Sender<Start>,
    tx: mpsc::Sender<Bytes>,
) {
    let mut scanner = EventScanner::new(settings.max_piece);
    let timer = tokio::time::sleep_until(settings.deadline);
    tokio::pin!(timer);

    // Until the first output: hold everything back (at most one piece).
    let mut held = BytesMut::new();
    let mut event_start = 0;
    let mut scanned = 0;
    let head = loop {
        let next = tokio::select! {
            biased;
            () = start.closed() => {
                // The client went away while waiting for the first output.
                drop(upstream);
                charge.cut(true, observe::CLIENT_GONE);
                return;
            }
            () = &mut timer => None,
            frame = upstream.frame() => Some(frame),
        };
        let failure = match next {
            None => Failure::Api(capyctl_crds::errors::ApiError::QueueDeadline {
                deployment: settings.deployment.clone(),
            }),
            Some(None) => {
                charge.finish();
                let _ = start.send(Start::Whole(held.freeze()));
                return;
            }
            Some(Some(Err(err))) => Failure::upstream(&err),
            Some(Some(Ok(frame))) => {
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                held.extend_from_slice(&data);
                let single = match first_output(&mut scanner, &held, &mut event_start, &mut scanned)
                {
                    Ok(true) => break held.freeze(),
                    Ok(false) if held.len() <= settings.max_piece => continue,
                    // Many small pieces and still no output: held back as one piece.
                    Ok(false) => false,
                    Err(Oversized) => true,
                };
                // Too large to hold: the complete events so far, then the error event. A
                // single piece that large is no role chunk: the engine produced output.
                drop(upstream);
                if single {
                    charge.output();
                }
                charge.cut(false, observe::PIECE_TOO_LARGE);
                held.truncate(event_start);
                held.extend_from_slice(&Early::Oversized.event(&settings));
                let _ = start.send(Start::Stream(held.freeze()));
                return;
            }
        };
        drop(upstream);
        charge.cut(false, failure.code());
        let _ = start.send(Start::Fail(failure));
        return;
    };
    charge.output();
    if start.send(Start::Stream(head)).is_err() {
        drop(upstream);
        charge.cut(true, observe::CLIENT_GONE);
        return;
    }

    // After the first output: forward each frame as it comes.
    let mut ended = false;
    let early = loop {
        timer.as_mut().reset(Instant::now() + settings.idle);
        let next = tokio::select! {
            biased;
            () = tx.closed() => {
                drop(upstream);
                charge.cut(true, observe::CLIENT_GONE);
                return;
            }
            () = &mut timer => break Early::Idle,
            frame = upstream.frame() => frame,
        };
        let mut data = match next {
            None => {
                charge.finish();
                return;
            }
            Some(Err(err)) => {
                tracing::debug!(error = %err, "engine's streamed answer broke off");
                break Early::UpstreamFailed;
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => data,
                Err(_) => continue,
            },
        };
        if scanner.measure(&data).is_err() {
            break Early::Oversized;
        }
        // Take along what the engine already sent (a fast engine, a loaded router): one hand-over
        // and one write for several pieces. Nothing waits for more.
        let mut after = None;
        let mut batch: Option<BytesMut> = None;
        while data.len() + batch.as_ref().map_or(0, BytesMut::len) < COALESCE_BYTES {
            match upstream.frame().now_or_never() {
                None => break,
                Some(Some(Ok(frame))) => {
                    let Ok(more) = frame.into_data() else {
                        continue;
                    };
                    if scanner.measure(&more).is_err() {
                        after = Some(Early::Oversized);
                        break;
                    }
                    let batch = batch.get_or_insert_with(|| {
                        let mut b = BytesMut::with_capacity(COALESCE_BYTES);
                        b.extend_from_slice(&data);
                        b
                    });
                    batch.extend_from_slice(&more);
                }
                Some(Some(Err(err))) => {
                    tracing::debug!(error = %err, "engine's streamed answer broke off");
                    after = Some(Early::UpstreamFailed);
                    break;
                }
                Some(None) => {
                    ended = true;
                    break;
                }
            }
        }
        if let Some(batch) = batch {
            data = batch.freeze();
        }
        let sent = send(&tx, data, settings.read_stall).await;
        if sent.is_ok() {
            if ended {
                charge.finish();
                return;
            }
            if let Some(early) = after {
                break early;
            }
            continue;
        }
        if let Err(why) = sent {
            drop(upstream);
            charge.cut(
                true,
                if why == SendFailed::Stalled {
                    observe::READ_STALL
                } else {
                    observe::CLIENT_GONE
                },
            );
            if why == SendFailed::Stalled {
                tracing::debug!("client read nothing for read_stall; streamed answer cut");
                kill(&settings);
            }
            return;
        }
    };
    tracing::debug!(reason = ?early, "streamed answer cut");
    drop(upstream);
    charge.cut(false, early.code());
    if send(&tx, early.event(&settings), settings.read_stall).await == Err(SendFailed::Stalled) {
        kill(&settings);
    }
}

/// Scans the held bytes for complete events; true once one of them is output.
fn first_output(
    scanner: &mut EventScanner,
    held: &[u8],
    event_start: &mut usize,
    scanned: &mut usize,
) -> Result<bool, Oversized> {
    while let Some(end) = scanner.next_end(held, *scanned)? {
        let event = held.get(*event_start..end).unwrap_or_default();
        *event_start = end;
        *scanned = end;
        if is_output(event) {
            // Keep measuring the rest of the frame.
            scanner.measure(held.get(end..).unwrap_or_default())?;
            return Ok(true);
        }
    }
    *scanned = held.len();
    Ok(false)
}

#[derive(Debug, PartialEq, Eq)]
enum SendFailed {
    /// The body is gone (the client went away).
    Closed,
    /// The body did not take the previous piece within `read_stall`.
    Stalled,
}

/// Hands one piece to the body, waiting at most `read_stall` for it to take the previous one.
async fn send(
    tx: &mpsc::Sender<Bytes>,
    piece: Bytes,
    read_stall: Duration,
) -> Result<(), SendFailed> {
    match tx.try_send(piece) {
        Ok(()) => Ok(()),
        Err(mpsc::error::TrySendError::Closed(_)) => Err(SendFailed::Closed),
        Err(mpsc::error::TrySendError::Full(piece)) => {
            match tokio::time::timeout(read_stall, tx.send(piece)).await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(_)) => Err(SendFailed::Closed),
                Err(_) => Err(SendFailed::Stalled),
            }
        }
    }
}

fn kill(settings: &PumpSettings) {
    if let Some(kill) = &settings.kill {
        kill.notify_one();
    }
}
