//! The listener's own server side of HTTP/1.1: one client connection's requests, one after
//! another, each read whole, answered by [`Proxy::respond`] and written back frame by frame.
//!
//! NB (why not hyper's server): hyper's server connection hands each request body through a
//! channel, arms and drops a boxed timer per request for its header read timeout, and parses
//! and encodes in general form; by callgrind's count it was about 37% of the user-space
//! instructions the listener spent per request (32 clients, not streamed). Here one read
//! buffer per connection holds the head and the body (the request's `Uri` and body are slices
//! of it; the header lines to forward are gathered as they came, no `HeaderMap` built), the
//! head timer is one per connection and only ever moved later, and an answer goes out in one
//! `writev` per frame (see `router/DESIGN.md`, "Speed").
//!
//! The rules (RFC 9112):
//! - **Head.** At most [`MAX_HEAD`] bytes and [`MAX_HEADERS`] lines, exactly one `Host` in
//!   HTTP/1.1, within `header_read_timeout` from when the connection begins to wait for it (a
//!   connection idle that long between requests is closed too; empty lines between requests
//!   are skipped). A head that cannot be read is answered `400 invalid_request` saying what
//!   is wrong, a request target over [`MAX_TARGET`] `414 uri_too_long` (as soon as the part
//!   that arrived is longer), and the connection is closed.
//! - **Body.** Chunked when `Transfer-Encoding` is `chunked` (chunked not the final coding is a
//!   400, RFC 9112 6.3; another coding before a final chunked is `501 not_implemented`, naming
//!   it; chunked twice, chunked together with
//!   `Content-Length`, or chunked in HTTP/1.0 is refused with 400; a chunk-size line with
//!   anything but whitespace and an extension after the size is a 400), else
//!   `Content-Length` (several must agree), else none. It is read whole before the request is
//!   answered, within the request deadline and the listener's one budget for the bodies it
//!   holds (see `budget`): a declared length that does not fit is refused before anything of
//!   it is read (413 over the bound alone, 429 when others hold the room), without a
//!   `100 Continue`; every body takes its buffer's room as it grows, and is refused the same
//!   way once that does not fit. `Expect: 100-continue` is answered when the body is
//!   waited for. Only the routes that forward read a body; elsewhere (404, 405,
//!   `/v1/models`), and with tenants for a request without a valid key (its 401 is decided
//!   from the head: [`Proxy::identify`]), it is not read, and no `100 Continue` is sent for
//!   it. A body not read to its end closes the connection after the answer (RFC 9112 9.6).
//! - **While answering.** Until the answer is complete, the socket is read for the client's
//!   end of stream, as hyper does: a client that closes its connection gives its request up
//!   (its answer, or the wait for it, is dropped, which cuts the request). Bytes of a next
//!   (pipelined) request stop that reading and wait for their turn.
//! - **Answer.** `Content-Length` when the body's size is known, else chunked (for an HTTP/1.0
//!   client: until the connection closes); a `Date`; `Connection: close` when the connection
//!   ends after it (the client asked, HTTP/1.0 without keep-alive, a body not read to its end,
//!   an answer shorter than its length, the listener stopping); no length on 1xx and 204. A
//!   body frame goes out as soon as the body yields it, and the next is asked for only once
//!   the socket took it, so a client that reads nothing holds the engine's answer back: while
//!   any answer is written (streamed or not, its final flush included) the connection is
//!   watched for a read stall (see `conn`), which closes it and cuts the request.
//! - **Closing** takes at most [`LINGER`] (a client that does not read cannot hold it).
//! - **Stopping.** A graceful stop closes a connection waiting for a request at once, and one
//!   in a request after its answer; one accepted that has not sent its first request yet
//!   gets [`FIRST_REQUEST_WHEN_STOPPING`] to send it, and its answer (closed without one, its
//!   client would see the request lost, not a connection refused that it may retry).

use std::future::{Future, poll_fn};
use std::io::{self, IoSlice, Write as _};
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use capyctl_spec::errors::ApiError;
use http::header;
use http::{Method, StatusCode, Uri, Version};
use http_body::Body;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::time::{Instant, Sleep};

use super::budget::{Budget, Gather, Hold, RequestBody};
use super::conn::{ConnWatch, StopWatch};
use super::upstream::{
    Chunk, FramingHeaders, KEEP_BUFFER, MAX_HEAD, MAX_HEADERS, Span, decode_chunked, gather_lines,
    note_spans, push_decimal, push_headers, take_lines, tokens,
};
use super::usage::PIECES;
use super::{
    Answer, AnswerHead, Failure, Proxy, ProxyBody, RequestHead, bodiless_status, forwarded,
};
use crate::admission::Admission;
use crate::tenants::Auth;

/// The longest request target read (RFC 9112 3: a server answers a longer one 414): 8 KiB,
/// the size of the buffer nginx reads a request line into by default. The OpenAI API's
/// targets are short paths; a longer one is a mistake or a probe.
const MAX_TARGET: usize = 8 * 1024;
/// What one read asks of the socket at least.
const READ_SIZE: usize = 8 * 1024;
/// Whose chunked body [`decode_chunked`] reads here.
pub(super) const REQUEST_BODY: &str = "the chunked request body";
/// How long closing a connection may take: writing the answer to a head that cannot be read,
/// shutting the connection down, and (when the client may still be sending what nobody read)
/// reading and dropping what it sends, at most [`LINGER_BYTES`], so that its answer is not
/// lost to a reset (the kernel resets a connection closed with unread bytes).
const LINGER: Duration = Duration::from_secs(1);
const LINGER_BYTES: usize = 1024 * 1024;
/// Room for a chunk-size line: 16 hex digits and CRLF.
const SIZE_LINE: usize = 18;

/// The slices one write of the answer takes at most: the head, a chunk's size line, a frame
/// and the pieces that follow it ([`PIECES`] in all), the chunk's end.
const SEND_SLICES: usize = 3 + PIECES;
/// The header lines a first parse of a request head has room for (the OpenAI SDKs send about
/// 17); [`MAX_HEADERS`] only when that is too few.
const SOME_HEADERS: usize = 32;
/// A request body larger than this leaves the read buffer it arrived in behind: the next
/// request then starts in a buffer of its own, rather than in what is left of a large one,
/// which its head and body (slices of the buffer) would keep whole while it waits.
const LARGE_BODY: usize = READ_SIZE;

/// How long a connection accepted just before the listener stops may take to send its first
/// request, which is then answered (see the module's notes, Stopping).
const FIRST_REQUEST_WHEN_STOPPING: Duration = Duration::from_secs(1);

/// Serves HTTP/1.1 on a client connection until it closes, the client goes away or `stop`
/// says so between requests.
pub(super) async fn serve<A: Admission, S>(
    io: S,
    proxy: Proxy<A>,
    watch: Arc<ConnWatch>,
    stop: &mut StopWatch,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let config = proxy.config();
    let request_deadline = config.request_deadline;
    let budget = Arc::clone(proxy.budget());
    let header_read_timeout = config.header_read_timeout;
    let mut conn = Server {
        io,
        buf: BytesMut::new(),
        out: Vec::new(),
        spans: Vec::new(),
        lines: BytesMut::new(),
        watch,
        head_timer: None,
        read_closed: false,
        had_request: false,
        stop_timer: None,
    };
    // With tenants, the key the last request was let in with.
    let mut known = crate::tenants::KnownKey::default();
    loop {
        let mut request = match conn.next_head(stop, header_read_timeout).await {
            Next::Head(request) => request,
            Next::Bad(error) => {
                tracing::debug!(%error, "a request head that is refused");
                let response = super::error_response(&error).into();
                let exchange = Exchange {
                    head: false,
                    version: Version::HTTP_11,
                    keep: false,
                };
                let written =
                    tokio::time::timeout(LINGER, conn.write_answer(response, &exchange, true));
                if matches!(written.await, Ok(Ok(_))) {
                    // The rest of what the client sent was not read.
                    conn.close(true).await;
                }
                return;
            }
            Next::Closed => {
                conn.close(false).await;
                return;
            }
        };
        let arrival = Instant::now();
        let deadline = arrival + request_deadline;
        // Made before the body is read, so that a request dropped meanwhile (the listener's
        // grace ran out) is still reported.
        let report = proxy.watch();
        // With tenants, from the head alone: a request without a valid key is answered 401
        // before anything of its body is read (or a `100 Continue` sent for it).
        let auth = proxy.identify(&mut request.head, &mut known);
        let body = if forwarded(&request.head) && !matches!(auth, Auth::Refused) {
            conn.read_body(&mut request, &budget, deadline).await
        } else {
            // Not read (a route that takes none, none at all, or a refused key): no
            // `100 Continue` for it, and the connection closes after the answer.
            request.unread = request.framing != Framing::Length(0);
            Ok(RequestBody::default())
        };
        let Incoming {
            head,
            version,
            keep,
            unread,
            ..
        } = request;
        let exchange = Exchange {
            head: head.method == Method::HEAD,
            version,
            keep: keep && !unread,
        };
        let watch = Some(Arc::clone(&conn.watch));
        // Pinned where it is made: the answer's future is large (about 2.5 KiB), and each move
        // of it is a copy.
        let answer =
            pin!(proxy.respond(report, head, auth, arrival, std::future::ready(body), watch,));
        let answered = conn.until_gone(answer).await;
        let Some(response) = answered else {
            tracing::debug!("the client went away before its answer");
            return;
        };
        match conn.write_answer(response, &exchange, stop.stopped()).await {
            Ok(true) => {}
            Ok(false) => {
                let pipelined = !conn.buf.is_empty();
                conn.close(unread || pipelined).await;
                return;
            }
            Err(err) => {
                tracing::debug!(error = %err, "client connection ended");
                return;
            }
        }
    }
}

/// A request's head as the server keeps it.
pub(super) struct Incoming {
    pub(super) head: RequestHead,
    pub(super) version: Version,
    pub(super) framing: Framing,
    /// The client keeps the connection open after this exchange.
    pub(super) keep: bool,
    /// `Expect: 100-continue`.
    expect_continue: bool,
    /// The body was not read to its end (refused, cut, late): the connection closes after
    /// the answer.
    unread: bool,
}

/// How a request body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Framing {
    Length(u64),
    Chunked,
}

/// What the answer's framing depends on.
struct Exchange {
    /// A `HEAD` request: the answer has no body.
    head: bool,
    version: Version,
    /// The connection may stay open after the answer.
    keep: bool,
}

/// What waiting for a request head came to.
// Moved once per request; boxing the head would cost an allocation per request instead.
#[allow(clippy::large_enum_variant)]
enum Next {
    Head(Incoming),
    /// A head that is refused: `400 invalid_request` saying what is wrong with it, `414` for
    /// a target over [`MAX_TARGET`], `501` for a transfer coding other than chunked.
    Bad(ApiError),
    /// The client closed the connection, was too slow, or the listener stops.
    Closed,
}

/// A parsed request line, with the head's length.
pub(super) struct Line {
    pub(super) used: usize,
    pub(super) method: Method,
    pub(super) target: (usize, usize),
    pub(super) version: Version,
}

/// One client connection.
struct Server<S> {
    io: S,
    /// Bytes read and not used yet.
    buf: BytesMut,
    /// The answer's head being written (kept for its capacity).
    out: Vec<u8>,
    /// The header lines of the head being parsed (kept for its capacity).
    spans: Vec<Span>,
    /// Where the header lines to forward are gathered (each request's are split off).
    lines: BytesMut,
    watch: Arc<ConnWatch>,
    /// `header_read_timeout` for the head waited for; made at the first wait, then moved.
    head_timer: Option<Pin<Box<Sleep>>>,
    /// The client's side has ended (or failed): nothing more comes.
    read_closed: bool,
    /// A request head was read on the connection.
    had_request: bool,
    /// Once the listener stops: how long a connection without a request yet waits for its
    /// first ([`FIRST_REQUEST_WHEN_STOPPING`]).
    stop_timer: Option<Pin<Box<Sleep>>>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Server<S> {
    /// Reads what the socket has into the buffer: the number of bytes (0: end of stream).
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.buf.capacity() - self.buf.len() < READ_SIZE / 4 {
            self.buf.reserve(READ_SIZE);
        }
        let polled = pin!(self.io.read_buf(&mut self.buf)).poll(cx);
        if matches!(polled, Poll::Ready(Ok(0) | Err(_))) {
            self.read_closed = true;
        }
        polled
    }

    /// Whether the client has gone: reads for its end of stream while nothing of a next
    /// request is buffered (what it reads is kept for that request).
    fn poll_gone(&mut self, cx: &mut Context<'_>) -> bool {
        if self.read_closed {
            return true;
        }
        self.skip_empty_lines();
        if !self.buf.is_empty() {
            return false;
        }
        matches!(self.poll_fill(cx), Poll::Ready(Ok(0) | Err(_)))
    }

    /// Drops the empty lines a client may send between requests (RFC 9112 2.2), so that they
    /// count as nothing buffered.
    fn skip_empty_lines(&mut self) {
        let blank = self
            .buf
            .iter()
            .take_while(|b| matches!(b, b'\r' | b'\n'))
            .count();
        if blank > 0 {
            let _ = self.buf.split_to(blank);
        }
    }

    /// Waits for the next request head.
    async fn next_head(&mut self, stop: &mut StopWatch, timeout: Duration) -> Next {
        let mut waiting = false;
        poll_fn(|cx| {
            loop {
                self.skip_empty_lines();
                if !self.buf.is_empty() {
                    match self.parse_head() {
                        Ok(Some(request)) => {
                            self.had_request = true;
                            return Poll::Ready(Next::Head(request));
                        }
                        Ok(None) => {}
                        Err(detail) => return Poll::Ready(Next::Bad(detail)),
                    }
                }
                if self.read_closed {
                    return Poll::Ready(Next::Closed);
                }
                match self.poll_fill(cx) {
                    Poll::Ready(Ok(n)) if n > 0 => continue,
                    Poll::Ready(_) => return Poll::Ready(Next::Closed),
                    Poll::Pending => {}
                }
                // Stopping, nothing of a request read: between requests the connection closes
                // at once; one just accepted waits a little for its first (its client sent it
                // to a listener that took the connection).
                if self.buf.is_empty() && stop.poll_stopped(cx) {
                    if self.had_request {
                        return Poll::Ready(Next::Closed);
                    }
                    let timer = self.stop_timer.get_or_insert_with(|| {
                        Box::pin(tokio::time::sleep(FIRST_REQUEST_WHEN_STOPPING))
                    });
                    if timer.as_mut().poll(cx).is_ready() {
                        return Poll::Ready(Next::Closed);
                    }
                }
                let timer = self
                    .head_timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
                if !waiting {
                    waiting = true;
                    // Only ever later while the connection is busy: a cheap move in tokio's
                    // timer wheel, not a new registration.
                    timer.as_mut().reset(Instant::now() + timeout);
                }
                if timer.as_mut().poll(cx).is_ready() {
                    tracing::debug!("no request head within header_read_timeout");
                    return Poll::Ready(Next::Closed);
                }
                return Poll::Pending;
            }
        })
        .await
    }

    /// Parses a complete head at the start of the buffer and takes it out; `None` if it is not
    /// complete yet.
    fn parse_head(&mut self) -> Result<Option<Incoming>, ApiError> {
        let Some(line) = parse_line(&self.buf, &mut self.spans)? else {
            return Ok(None);
        };
        let head = self.buf.split_to(line.used).freeze();
        incoming(&head, &line, &self.spans, &mut self.lines).map(Some)
    }

    /// Reads the request's body whole, within `deadline` and the listener's `budget` (see the
    /// module's notes).
    async fn read_body(
        &mut self,
        request: &mut Incoming,
        budget: &Arc<Budget>,
        deadline: Instant,
    ) -> Result<RequestBody, Failure> {
        let gather = match request.framing {
            Framing::Length(0) => return Ok(RequestBody::default()),
            // Refused before anything of it is read (or asked for) when it does not fit now;
            // it takes its room as it arrives, or at once when it came whole with its head.
            Framing::Length(n) => {
                let whole = self.buf.len() as u64 >= n;
                let fits = if whole {
                    let mut hold = Hold::new(budget);
                    hold.grow_to(n).map(|()| Err(hold))
                } else {
                    Gather::declared(budget, n).map(Ok)
                };
                match fits {
                    Err(refused) => {
                        request.unread = true;
                        return Err(Failure::Api(refused));
                    }
                    Ok(Err(hold)) => {
                        let body = self.buf.split_to(n as usize).freeze();
                        self.leave_large(body.len());
                        return Ok(RequestBody::new(body, hold));
                    }
                    Ok(Ok(gather)) => gather,
                }
            }
            Framing::Chunked => Gather::new(budget),
        };
        let read = async {
            if request.expect_continue {
                self.send(&[b"HTTP/1.1 100 Continue\r\n\r\n"])
                    .await
                    .map_err(|err| Failure::unreadable(&err))?;
                poll_fn(|cx| Pin::new(&mut self.io).poll_flush(cx))
                    .await
                    .map_err(|err| Failure::unreadable(&err))?;
            }
            match request.framing {
                Framing::Length(n) => self.read_length(n as usize, gather).await,
                Framing::Chunked => self.read_chunked(gather).await,
            }
        };
        let read = match tokio::time::timeout_at(deadline, read).await {
            Ok(read) => read,
            Err(_) => Err(Failure::body_late()),
        };
        if read.is_err() {
            request.unread = true;
        }
        read
    }

    /// Reads a body of `n` bytes into `body`, whose buffer takes its room in the budget as it
    /// grows (to `n` at the most); what follows it stays in the read buffer for the next
    /// request.
    async fn read_length(&mut self, n: usize, mut body: Gather) -> Result<RequestBody, Failure> {
        loop {
            let take = self.buf.len().min(n - body.len());
            if take > 0 {
                let piece = self.buf.split_to(take);
                body.push(&piece).map_err(Failure::Api)?;
            }
            if body.len() == n {
                self.leave_large(n);
                return Ok(body.finish());
            }
            match poll_fn(|cx| self.poll_fill(cx)).await {
                Ok(0) => return Err(Failure::unreadable(&ClosedEarly)),
                Ok(_) => {}
                Err(err) => return Err(Failure::unreadable(&err)),
            }
        }
    }

    /// After a body of `n` bytes, leaves the read buffer behind if the body was large (see
    /// [`LARGE_BODY`]).
    fn leave_large(&mut self, n: usize) {
        if n > LARGE_BODY {
            self.buf = BytesMut::from(&self.buf[..]);
        }
    }

    /// Reads a chunked body into `body`, whose buffer takes its room in the budget as it
    /// grows.
    async fn read_chunked(&mut self, mut body: Gather) -> Result<RequestBody, Failure> {
        let mut chunk = Chunk::Size;
        let mut read = 0;
        loop {
            match decode_chunked(&mut chunk, &mut self.buf, true, REQUEST_BODY) {
                Ok(Some(data)) => {
                    read += data.len();
                    body.push(&data).map_err(Failure::Api)?;
                    continue;
                }
                Ok(None) if chunk == Chunk::Done => {
                    self.leave_large(read);
                    return Ok(body.finish());
                }
                Ok(None) => {}
                Err(err) => return Err(Failure::unreadable(&err)),
            }
            match poll_fn(|cx| self.poll_fill(cx)).await {
                Ok(0) => return Err(Failure::unreadable(&ClosedEarly)),
                Ok(_) => {}
                Err(err) => return Err(Failure::unreadable(&err)),
            }
        }
    }

    /// Runs `answer` while watching for the client's end of stream: `None` if the client went
    /// away first (`answer` is dropped then).
    async fn until_gone<F: Future>(&mut self, mut answer: Pin<&mut F>) -> Option<F::Output> {
        poll_fn(|cx| {
            if let Poll::Ready(out) = answer.as_mut().poll(cx) {
                return Poll::Ready(Some(out));
            }
            if self.poll_gone(cx) {
                return Poll::Ready(None);
            }
            Poll::Pending
        })
        .await
    }

    /// Writes an answer: its head, then its body frame by frame. `Ok(true)`: the connection
    /// can take another request.
    async fn write_answer(
        &mut self,
        answer: Answer,
        exchange: &Exchange,
        stopping: bool,
    ) -> io::Result<bool> {
        let mut body = pin!(answer.body);
        let status = answer.status;
        let bodiless = exchange.head || bodiless_status(status);
        let size = body.size_hint().exact();
        let chunked = !bodiless && size.is_none() && exchange.version == Version::HTTP_11;
        let until_close = !bodiless && size.is_none() && !chunked;
        let mut keep = exchange.keep && !stopping && !until_close;

        let mut out = std::mem::take(&mut self.out);
        out.clear();
        // No length on an answer that cannot have one (RFC 9110 8.6).
        let length = size.filter(|_| !bodiless_status(status));
        encode_head(&mut out, status, &answer.head, length, chunked);
        if !keep {
            out.extend_from_slice(b"connection: close\r\n");
        } else if exchange.version == Version::HTTP_10 {
            out.extend_from_slice(b"connection: keep-alive\r\n");
        }
        out.extend_from_slice(b"\r\n");
        drop(answer.head);

        // Watched for a read stall until written, flush included (see `conn`).
        self.watch.answer_began();
        let written = self
            .write_body(&out, body.as_mut(), size, bodiless, chunked)
            .await;
        if out.capacity() <= KEEP_BUFFER {
            self.out = out;
        }
        let written = match written {
            Ok(written) => self.flush().await.map(|()| written),
            Err(err) => Err(err),
        };
        self.watch.answer_ended();
        let written = written?;
        if size.is_some_and(|size| !bodiless && written != size) {
            keep = false;
        }
        Ok(keep)
    }

    /// Writes `head` and the body's frames: the body bytes written.
    async fn write_body(
        &mut self,
        head: &[u8],
        mut body: Pin<&mut ProxyBody>,
        size: Option<u64>,
        bodiless: bool,
        chunked: bool,
    ) -> io::Result<u64> {
        if bodiless {
            self.send(&[head]).await?;
            return Ok(0);
        }
        let mut head = Some(head);
        let mut written = 0u64;
        let mut size_line = [0u8; SIZE_LINE];
        loop {
            let polled = if body.is_end_stream() {
                Poll::Ready(None)
            } else {
                poll_fn(|cx| Poll::Ready(body.as_mut().poll_frame(cx))).await
            };
            let frame = match polled {
                Poll::Ready(frame) => frame,
                Poll::Pending => {
                    // The body is not ready: what is written goes out now (the head, alone,
                    // if it has not; a TLS stream's last record).
                    if let Some(head) = head.take() {
                        self.send(&[head]).await?;
                    }
                    self.flush().await?;
                    self.until_gone(pin!(poll_fn(|cx| body.as_mut().poll_frame(cx))))
                        .await
                        .ok_or_else(|| io::Error::from(io::ErrorKind::ConnectionAborted))?
                }
            };
            let data = match frame {
                None => {
                    let end: &[u8] = if chunked { b"0\r\n\r\n" } else { b"" };
                    self.send(&[head.take().unwrap_or_default(), end]).await?;
                    return Ok(written);
                }
                Some(Err(err)) => return Err(err),
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) if !data.is_empty() => data,
                    // Trailers, or nothing: nothing to send.
                    _ => continue,
                },
            };
            // The pieces that follow the frame at once (a tenant's stream with its usage taken
            // out: `usage::Sent`), written with it: one write, one chunk.
            // (`poll_frame` gave the first of at most `PIECES`, so the rest fit in one write;
            // were there ever more, they would go as frames of their own.)
            let more = Some(body.queued())
                .filter(|q| q.len() < PIECES)
                .unwrap_or_default();
            let len = data.len() + more.iter().map(Bytes::len).sum::<usize>();
            if size.is_some_and(|size| written + len as u64 > size) {
                return Err(io::Error::other(
                    "the answer's body is longer than its length",
                ));
            }
            let mut bufs: [&[u8]; SEND_SLICES] = [&[]; SEND_SLICES];
            bufs[0] = head.take().unwrap_or_default();
            let mut n = 1;
            if chunked {
                let mut line = &mut size_line[..];
                write!(line, "{len:x}\r\n")?;
                let line_len = SIZE_LINE - line.len();
                bufs[n] = &size_line[..line_len];
                n += 1;
            }
            bufs[n] = &data;
            n += 1;
            for piece in more {
                bufs[n] = piece;
                n += 1;
            }
            let last = more.len() == body.queued().len() && body.ends_after_queued();
            if chunked {
                bufs[n] = if last { b"\r\n0\r\n\r\n" } else { b"\r\n" };
                n += 1;
            }
            self.send(&bufs[..n]).await?;
            if !more.is_empty() {
                body.as_mut().get_mut().queued_given();
            }
            written += len as u64;
            if body.is_end_stream() {
                return Ok(written);
            }
        }
    }

    /// Writes every byte of `bufs`, with as few writes as the socket allows, telling the
    /// connection's watch whether the socket takes them.
    async fn send(&mut self, bufs: &[&[u8]]) -> io::Result<()> {
        let mut storage = [IoSlice::new(&[]); SEND_SLICES];
        let count = bufs.len().min(storage.len());
        for (slot, buf) in storage.iter_mut().zip(bufs) {
            *slot = IoSlice::new(buf);
        }
        let mut slices = &mut storage[..count];
        IoSlice::advance_slices(&mut slices, 0);
        while !slices.is_empty() {
            let n = poll_fn(|cx| {
                let polled = Pin::new(&mut self.io).poll_write_vectored(cx, slices);
                match &polled {
                    Poll::Ready(Ok(n)) if *n > 0 => self.watch.taken(),
                    Poll::Pending => self.watch.refused(),
                    Poll::Ready(_) => {}
                }
                polled
            })
            .await?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            IoSlice::advance_slices(&mut slices, n);
        }
        Ok(())
    }

    /// Flushes what the stream holds (a TLS stream's records), telling the connection's
    /// watch whether the socket takes it.
    async fn flush(&mut self) -> io::Result<()> {
        poll_fn(|cx| {
            let polled = Pin::new(&mut self.io).poll_flush(cx);
            match &polled {
                Poll::Ready(Ok(())) => self.watch.taken(),
                Poll::Pending => self.watch.refused(),
                Poll::Ready(Err(_)) => {}
            }
            polled
        })
        .await
    }

    /// Ends the connection, within [`LINGER`]: shuts the writing side down and, when the
    /// client may still be sending what nobody read, reads and drops it.
    async fn close(&mut self, unread: bool) {
        let _ = tokio::time::timeout(LINGER, async {
            let shut = poll_fn(|cx| Pin::new(&mut self.io).poll_shutdown(cx)).await;
            if shut.is_err() || !unread || self.read_closed {
                return;
            }
            let mut dropped = 0;
            while dropped < LINGER_BYTES {
                self.buf.clear();
                match poll_fn(|cx| self.poll_fill(cx)).await {
                    Ok(n) if n > 0 => dropped += n,
                    _ => return,
                }
            }
        })
        .await;
    }
}

/// The client closed its connection in the middle of a request body.
#[derive(Debug)]
struct ClosedEarly;

impl std::fmt::Display for ClosedEarly {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the client closed the connection before the end of the body")
    }
}

/// Parses a request line and header lines at the start of `buf`, noting where the header
/// lines lie in `spans`; `None` if the head is not complete yet. Room for
/// [`SOME_HEADERS`] first, for [`MAX_HEADERS`] only when that is too few.
pub(super) fn parse_line(buf: &[u8], spans: &mut Vec<Span>) -> Result<Option<Line>, ApiError> {
    let mut few = [httparse::EMPTY_HEADER; SOME_HEADERS];
    let mut request = httparse::Request::new(&mut few);
    match request.parse(buf) {
        Err(httparse::Error::TooManyHeaders) => {
            let mut many = [httparse::EMPTY_HEADER; MAX_HEADERS];
            let mut request = httparse::Request::new(&mut many);
            let parsed = request.parse(buf);
            line_of(parsed, &request, buf, spans)
        }
        parsed => line_of(parsed, &request, buf, spans),
    }
}

/// The line `parse_line` parsed.
fn line_of(
    parsed: httparse::Result<usize>,
    request: &httparse::Request<'_, '_>,
    buf: &[u8],
    spans: &mut Vec<Span>,
) -> Result<Option<Line>, ApiError> {
    let too_long = || {
        bad(format!(
            "the request head is longer than {} KiB",
            MAX_HEAD / 1024
        ))
    };
    let used = match parsed {
        Ok(httparse::Status::Complete(used)) => used,
        Ok(httparse::Status::Partial) if buf.len() > MAX_TARGET && target_too_long(buf) => {
            return Err(ApiError::UriTooLong { limit: MAX_TARGET });
        }
        Ok(httparse::Status::Partial) if buf.len() >= MAX_HEAD => return Err(too_long()),
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => {
            return Err(bad(format!(
                "the request head has more than {MAX_HEADERS} header lines"
            )));
        }
        Err(err) => return Err(bad(format!("the request head cannot be parsed: {err}"))),
    };
    if used > MAX_HEAD {
        return Err(too_long());
    }
    let base = buf.as_ptr() as usize;
    let at = |part: &[u8]| {
        let start = part.as_ptr() as usize - base;
        (start, start + part.len())
    };
    let method = request.method.unwrap_or_default();
    let method = Method::from_bytes(method.as_bytes())
        .map_err(|_| bad(format!("the request method {method:?} is not valid")))?;
    let target = at(request.path.unwrap_or_default().as_bytes());
    if target.1 - target.0 > MAX_TARGET {
        return Err(ApiError::UriTooLong { limit: MAX_TARGET });
    }
    let version = if request.version == Some(0) {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    note_spans(buf, request.headers, spans);
    Ok(Some(Line {
        used,
        method,
        target,
        version,
    }))
}

/// Whether the request line at the start of `buf`, not complete yet, already has a target
/// longer than [`MAX_TARGET`] (so that a long one is answered 414 as soon as that is known,
/// rather than 400 once the head passes [`MAX_HEAD`]).
fn target_too_long(buf: &[u8]) -> bool {
    let line = memchr::memchr(b'\n', buf).map_or(buf, |end| &buf[..end]);
    let Some(start) = memchr::memchr(b' ', line) else {
        return false;
    };
    let target = &line[start + 1..];
    memchr::memchr(b' ', target).unwrap_or(target.len()) > MAX_TARGET
}

/// A `400 invalid_request` saying what is wrong with a request head.
fn bad(detail: String) -> ApiError {
    ApiError::InvalidRequest { detail }
}

/// The request's head from its bytes: its method, target (a slice of `head`) and the header
/// lines to forward (see [`gather_lines`]; gathered in `lines`, whose bytes are split off),
/// its body's framing and whether the connection stays open after it.
///
/// NB: the header lines are forwarded as they came, not built into a `HeaderMap` and encoded
/// again: that was about a tenth of the listener's user-space instructions per request (see
/// `router/DESIGN.md`, "Speed"). `httparse` has checked them already: a name is a token and a
/// value has no control character but tab, so no line can split the head sent on.
pub(super) fn incoming(
    head: &Bytes,
    line: &Line,
    spans: &[Span],
    lines: &mut BytesMut,
) -> Result<Incoming, ApiError> {
    let version = line.version;
    let uri = Uri::from_maybe_shared(head.slice(line.target.0..line.target.1))
        .map_err(|err| bad(format!("the request target is not valid: {err}")))?;
    let mut framing_headers = FramingHeaders::default();
    let mut expect_continue = false;
    let mut hosts = 0;
    for span in spans {
        let name = &head[span.name.0..span.name.1];
        let value = &head[span.value.0..span.value.1];
        framing_headers
            .note(name, value)
            .map_err(|what| bad(format!("the request {what}")))?;
        if name.eq_ignore_ascii_case(b"expect") {
            expect_continue = value.eq_ignore_ascii_case(b"100-continue");
        } else if name.eq_ignore_ascii_case(b"host") {
            hosts += 1;
        }
    }
    // Where the `Authorization` lines go among the lines, noted as they are written (a
    // tenant's key is read from there).
    let mut authorization = crate::tenants::AuthorizationLines::default();
    let mut at = 0;
    gather_lines(head, spans, lines, |name, value| {
        let end = at + name.len() + value.len() + 4;
        authorization.note(name, at..end);
        at = end;
    });
    let FramingHeaders {
        length,
        encoded,
        chunked,
        close,
        keep_alive,
    } = framing_headers;
    // RFC 9112 3.2: exactly one `Host` in HTTP/1.1.
    if version == Version::HTTP_11 && hosts != 1 {
        return Err(bad(if hosts == 0 {
            "the request has no Host header".to_string()
        } else {
            "the request has more than one Host header".to_string()
        }));
    }
    let framing = if encoded {
        // RFC 9112 6.3: when chunked is not the final coding, the body's length cannot be
        // known, whatever the codings are: 400 (and the connection is closed).
        if !chunked {
            return Err(bad(
                "the request has a Transfer-Encoding that does not end in chunked".to_string(),
            ));
        }
        transfer_codings(head, spans)?;
        if length.is_some() {
            return Err(bad(
                "the request has both Transfer-Encoding and Content-Length".to_string(),
            ));
        }
        if version == Version::HTTP_10 {
            return Err(bad("an HTTP/1.0 request cannot be chunked".to_string()));
        }
        Framing::Chunked
    } else {
        Framing::Length(length.unwrap_or(0))
    };
    Ok(Incoming {
        head: RequestHead {
            method: line.method.clone(),
            uri,
            lines: take_lines(lines),
            authorization: Some(authorization),
        },
        version,
        framing,
        keep: if version == Version::HTTP_11 {
            !close
        } else {
            keep_alive && !close
        },
        expect_continue: expect_continue && version == Version::HTTP_11,
        unread: false,
    })
}

/// Checks the `Transfer-Encoding` lines of a request whose final coding is chunked (the caller
/// answers 400 first when it is not: RFC 9112 6.3): chunked, once, is the only coding the
/// listener reads; another before it is `501 not_implemented` naming it (RFC 9112 6.1),
/// chunked twice a `400`.
fn transfer_codings(head: &[u8], spans: &[Span]) -> Result<(), ApiError> {
    let mut chunked = 0;
    for span in spans {
        if !head[span.name.0..span.name.1].eq_ignore_ascii_case(b"transfer-encoding") {
            continue;
        }
        for coding in tokens(&head[span.value.0..span.value.1]) {
            if !coding.eq_ignore_ascii_case(b"chunked") {
                return Err(ApiError::NotImplemented {
                    what: format!(
                        "the request's transfer coding {:?}",
                        String::from_utf8_lossy(coding)
                    ),
                });
            }
            chunked += 1;
        }
    }
    match chunked {
        1 => Ok(()),
        0 => Err(bad("the request has an empty Transfer-Encoding".to_string())),
        _ => Err(bad(
            "the request has chunked more than once in Transfer-Encoding".to_string(),
        )),
    }
}

/// Encodes an answer's status line and headers (without the closing empty line): the answer's
/// own end-to-end headers, then its framing and a `Date` when it has none.
fn encode_head(
    out: &mut Vec<u8>,
    status: StatusCode,
    head: &AnswerHead,
    size: Option<u64>,
    chunked: bool,
) {
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    // The framing is written below.
    push_headers(out, &head.headers, |name| {
        [&b"content-length"[..], b"transfer-encoding", b"connection"]
            .iter()
            .any(|framing| framing.eq_ignore_ascii_case(name))
    });
    if let Some(rates) = &head.rates {
        rates.each(|name, n, seconds| {
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(b": ");
            push_decimal(out, n);
            if seconds {
                out.push(b's');
            }
            out.extend_from_slice(b"\r\n");
        });
    }
    out.extend_from_slice(&head.lines);
    if let Some(size) = size {
        out.extend_from_slice(b"content-length: ");
        push_decimal(out, size);
        out.extend_from_slice(b"\r\n");
    } else if chunked {
        out.extend_from_slice(b"transfer-encoding: chunked\r\n");
    }
    if !head.dated && !head.headers.contains_key(header::DATE) {
        out.extend_from_slice(b"date: ");
        date(out);
        out.extend_from_slice(b"\r\n");
    }
}

/// Appends the time now as an HTTP date, formatted at most once a second per thread.
fn date(out: &mut Vec<u8>) {
    thread_local! {
        static DATE: std::cell::RefCell<(u64, String)> =
            const { std::cell::RefCell::new((u64::MAX, String::new())) };
    }
    let now = std::time::SystemTime::now();
    let secs = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    DATE.with(|date| {
        let mut date = date.borrow_mut();
        if date.0 != secs {
            *date = (secs, httpdate::fmt_http_date(now));
        }
        out.extend_from_slice(date.1.as_bytes());
    });
}
