//! The router's own connections to the engines: HTTP/1.1 keep-alive connections per upstream
//! address, reused last-in first-out, each read and written by the task that uses it, with a
//! client-side HTTP/1.1 codec of its own ([`Conn`], [`UpstreamBody`]).
//!
//! NB (why not hyper's client): hyper's client connection hands every request, response head
//! and body frame across channels between the sending half and the connection future (a
//! dispatch queue, a callback, a body channel), and builds and parses in general form what is
//! here one known shape: a buffered POST out, a response head and a body with a length, chunked
//! or until close. By callgrind's count that was about 14.5K of the 45K user-space
//! instructions the listener spent per request (32 clients, not streamed); this codec does the
//! same with a single `writev` and one read buffer per connection (see `router/DESIGN.md`,
//! "Speed"). The request's own task reads the engine's socket: the engine's answer wakes the
//! task that forwards it to the client, and nothing else runs.
//!
//! - The request goes out with `Host`, the client's end-to-end header lines as the server
//!   side gathered them ([`RequestHead`]: hop-by-hop ones, `Host`, `Expect`, `Content-Length`
//!   and `Transfer-Encoding` never) and its own `Content-Length`. Those lines were parsed by
//!   `httparse` (or encoded from `http`'s header types), neither of which lets CR or LF into a
//!   name or value, so nothing a client sends can split the head.
//! - The answer's length follows RFC 9112 6.3: none for 1xx (skipped), 204 and 304; chunked
//!   when `Transfer-Encoding` ends in `chunked` (extensions and trailers read and dropped);
//!   else `Content-Length` (several must agree); else until the engine closes.
//! - A connection goes back to the pool only when its answer was read to the end, the engine
//!   did not ask to close it (`Connection: close`, HTTP/1.0, until-close bodies) and nothing
//!   follows the answer; an answer given up (client gone, deadline, oversized piece) drops it,
//!   which closes the socket: the engine sees the disconnect and aborts the request.
//! - An idle connection is not read; one the engine closed meanwhile shows it on checkout (a
//!   read that finds the end of stream, or bytes nobody asked for) and is dropped, but for a
//!   close in the last moments before a connection idle under [`PEEK_AFTER`] is reused (see
//!   [`Conn::usable`]). A request that a reused connection refuses while it is written (closed
//!   just then) is sent again on a fresh one; once written, it is never sent twice. When the
//!   write fails because the engine answered and closed before reading the request whole (a
//!   body it refuses), that answer is the request's, not a failure.
//! - At most `max_idle` idle connections per address; idle longer than `idle_timeout` they are
//!   dropped at the next checkout, and by a sweep at most once per `idle_timeout` (on a connect,
//!   and on the listener thread's one-second tick, so that a quiet listener holds no connection
//!   long after the engine closed its end); addresses nobody asks for any more go with them.
//! - A connect that takes longer than `connect_timeout` fails (an engine that is black-holed
//!   must not hold a permit until the request deadline).
//!   The listener's timeout is [`IDLE_TIMEOUT`], below the 5 s after which vLLM's and SGLang's
//!   server (uvicorn) closes an idle connection, so that a connection is seldom reused just
//!   as the engine closes it (uvicorn counts from its last write, the pool from our last read).
//!   Should it happen after the request was written, the request fails (502
//!   `upstream_unavailable`, retryable) rather than risk reaching the engine twice.

use std::collections::HashMap;
use std::future::{Future, poll_fn};
use std::io;
use std::net::SocketAddr;
use std::pin::{Pin, pin};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{HeaderMap, HeaderValue};
use http::{StatusCode, Version};
use http_body::{Body, Frame, SizeHint};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::RequestHead;
use super::budget::RequestBody;
use crate::fast_hash::FastHash;

/// An idle connection's socket is peeked at before reuse once it has been idle this long (see
/// [`Conn::usable`]).
const PEEK_AFTER: Duration = Duration::from_millis(5);

/// How long an answer the engine sent before it stopped reading the request may take to be
/// read, once writing the request failed (the connection is broken then: its reads end at
/// once; this only bounds the unexpected).
const EARLY_ANSWER_WAIT: Duration = Duration::from_secs(1);

/// How long an idle connection is kept: under uvicorn's `timeout_keep_alive` (5 s).
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(4);

/// The longest response head read from an engine.
pub(super) const MAX_HEAD: usize = 64 * 1024;
/// The most header lines in a response head.
pub(super) const MAX_HEADERS: usize = 100;
/// The header lines a first parse has room for.
const FEW_HEADERS: usize = 16;
/// The longest chunk-size line (size, extensions).
const MAX_CHUNK_LINE: usize = 4096;
/// The longest trailer line of a chunked answer.
const MAX_TRAILERS: usize = 64 * 1024;
/// Whose chunked body [`decode_chunked`] reads here.
const ANSWER: &str = "the engine's chunked answer";
/// What one read asks of the socket at least.
const READ_SIZE: usize = 16 * 1024;

/// What went wrong reaching an engine.
pub(crate) type UpstreamError = Box<dyn std::error::Error + Send + Sync>;

fn invalid(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

fn closed_early() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "the engine closed the connection before the end of its answer",
    )
}

/// One connection to an engine, with the bytes read from it and not used yet.
pub(crate) struct Conn {
    io: TcpStream,
    buf: BytesMut,
    addr: SocketAddr,
    /// The header lines of the response head being parsed (kept for its capacity).
    spans: Vec<Span>,
    /// The request head being written (kept for its capacity).
    head: Vec<u8>,
    /// Where the header lines of each answer are gathered (and split off).
    lines: BytesMut,
}

impl Conn {
    /// Reads what the socket has into the buffer: the number of bytes (0: end of stream).
    ///
    /// Through `AsyncRead`: a read that leaves room in the buffer tells tokio the socket is
    /// drained, so that [`Conn::usable`] finds a connection reused at once not readable without
    /// a system call (`try_read` would leave it readable, and the probe would cost a
    /// `recvfrom` per request).
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.buf.capacity() - self.buf.len() < READ_SIZE / 4 {
            self.buf.reserve(READ_SIZE);
        }
        pin!(self.io.read_buf(&mut self.buf)).poll(cx)
    }

    /// Whether a connection idle for `idle` can take a request: the engine has not closed it
    /// and sent nothing since its last answer.
    ///
    /// NB: a connection idle for less than [`PEEK_AFTER`] is read only when the runtime has
    /// seen it become readable since its last read (tokio's readiness), which costs no system
    /// call; a close that arrived since the runtime last polled its events is missed then, and
    /// a request written to that connection fails (502, retryable: an engine closing a
    /// connection it just answered on is stopping). One idle longer is peeked at whatever the
    /// runtime has seen, as every connection was before: an engine's idle timeout (uvicorn's
    /// 5 s) closes connections long idle, and that close is always seen.
    fn usable(&mut self, idle: Duration) -> bool {
        if !self.buf.is_empty() {
            return false;
        }
        let probed = if idle >= PEEK_AFTER {
            let mut probe = [std::mem::MaybeUninit::<u8>::uninit(); 1];
            socket2::SockRef::from(&self.io).peek(&mut probe)
        } else {
            let mut probe = [0u8; 1];
            self.io.try_read(&mut probe)
        };
        matches!(probed, Err(err) if err.kind() == io::ErrorKind::WouldBlock)
    }

    /// Writes the head and the body, with as few `writev`s as the socket allows.
    async fn write(&mut self, head: &[u8], body: &[u8]) -> io::Result<()> {
        let (mut head, mut body) = (head, body);
        while !head.is_empty() || !body.is_empty() {
            let slices = [io::IoSlice::new(head), io::IoSlice::new(body)];
            let n = poll_fn(|cx| {
                loop {
                    ready!(self.io.poll_write_ready(cx))?;
                    match self.io.try_write_vectored(&slices) {
                        // The readiness is cleared now: the next poll registers the waker.
                        Err(err) if err.kind() == io::ErrorKind::WouldBlock => continue,
                        other => return Poll::Ready(other),
                    }
                }
            })
            .await;
            let n = match n {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => n,
                Err(err) => return Err(err),
            };
            let from_head = n.min(head.len());
            head = &head[from_head..];
            body = &body[n - from_head..];
        }
        Ok(())
    }

    /// Reads the response head (skipping 1xx answers): its parts, how its body is framed, and
    /// whether the engine keeps the connection open after it.
    async fn read_head(&mut self) -> io::Result<Head> {
        loop {
            let taken = take_head(&mut self.buf, &mut self.spans, &mut self.lines)?;
            let Some((engine, framing, keep)) = taken else {
                if self.buf.len() >= MAX_HEAD {
                    return Err(invalid(format!(
                        "the engine's response head is longer than {MAX_HEAD} bytes"
                    )));
                }
                if poll_fn(|cx| self.poll_fill(cx)).await? == 0 {
                    return Err(closed_early());
                }
                continue;
            };
            if engine.status.is_informational() {
                continue;
            }
            return Ok((engine, framing, keep));
        }
    }
}

/// A parsed response head: what goes on to the client, the body's framing and whether the
/// connection stays open after the answer.
pub(super) type Head = (EngineHead, Framing, bool);

/// An engine's response head, as the listener passes it on.
#[derive(Debug)]
pub(crate) struct EngineHead {
    pub(crate) status: StatusCode,
    /// The engine's end-to-end header lines, each `name: value\r\n` as it sent them (see
    /// [`gather_lines`]): not the framing, nor those of one hop.
    pub(crate) lines: Bytes,
    /// A `Content-Type` of `text/event-stream`: the answer is a stream of events.
    pub(crate) event_stream: bool,
    /// The lines hold a `Date`.
    pub(crate) dated: bool,
}

/// Where a header's name and value lie in a head's bytes.
#[derive(Debug, Clone, Copy)]
pub(super) struct Span {
    pub(super) name: (usize, usize),
    pub(super) value: (usize, usize),
}

/// Notes in `spans` where the `headers` parsed from `buf` lie in it.
pub(super) fn note_spans(buf: &[u8], headers: &[httparse::Header<'_>], spans: &mut Vec<Span>) {
    let base = buf.as_ptr() as usize;
    let at = |part: &[u8]| {
        let start = part.as_ptr() as usize - base;
        (start, start + part.len())
    };
    spans.clear();
    spans.extend(headers.iter().map(|h| Span {
        name: at(h.name.as_bytes()),
        value: at(h.value),
    }));
}

/// Takes a complete response head off the start of `buf`, its header lines to pass on
/// gathered in `lines` (and split off); `None` if it is not complete yet.
pub(super) fn take_head(
    buf: &mut BytesMut,
    spans: &mut Vec<Span>,
    lines: &mut BytesMut,
) -> io::Result<Option<Head>> {
    let Some((used, code, version)) = parse_head(buf, spans)? else {
        return Ok(None);
    };
    let taken = head_of(&buf[..used], code, version, spans, lines);
    buf.advance(used);
    taken.map(Some)
}

/// Parses a complete response head at the start of `buf`, noting where its header lines lie
/// in `spans`: the bytes it takes, its status code and version; `None` if it is not complete
/// yet. Room for a few header lines first (engines send about six), for [`MAX_HEADERS`] only
/// when that is too few.
fn parse_head(buf: &[u8], spans: &mut Vec<Span>) -> io::Result<Option<(usize, u16, Version)>> {
    if buf.is_empty() {
        return Ok(None);
    }
    let mut few = [httparse::EMPTY_HEADER; FEW_HEADERS];
    let mut response = httparse::Response::new(&mut few);
    match response.parse(buf) {
        Err(httparse::Error::TooManyHeaders) => {
            let mut many = [httparse::EMPTY_HEADER; MAX_HEADERS];
            let mut response = httparse::Response::new(&mut many);
            let parsed = response.parse(buf);
            status_of(parsed, &response, buf, spans)
        }
        parsed => status_of(parsed, &response, buf, spans),
    }
}

/// The status line `parse_head` parsed.
fn status_of(
    parsed: httparse::Result<usize>,
    response: &httparse::Response<'_, '_>,
    buf: &[u8],
    spans: &mut Vec<Span>,
) -> io::Result<Option<(usize, u16, Version)>> {
    let used = match parsed {
        Ok(httparse::Status::Complete(used)) => used,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(err) => return Err(invalid(format!("the engine's response head: {err}"))),
    };
    let version = if response.version == Some(0) {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    note_spans(buf, response.headers, spans);
    Ok(Some((used, response.code.unwrap_or(0), version)))
}

/// The response's head from its bytes: what goes on to the client (its header lines gathered
/// in `lines`), its body's framing and whether the connection stays open after it.
///
/// NB: the lines are passed on as the engine sent them, not built into a `HeaderMap` and
/// encoded again (see `router/DESIGN.md`, "Speed"); `httparse` has checked them (a name is a
/// token, a value has no control character but tab).
fn head_of(
    head: &[u8],
    code: u16,
    version: Version,
    spans: &[Span],
    lines: &mut BytesMut,
) -> io::Result<Head> {
    let status = StatusCode::from_u16(code)
        .map_err(|_| invalid(format!("the engine's response status {code}")))?;
    let mut framing_headers = FramingHeaders::default();
    for span in spans {
        framing_headers
            .note(
                &head[span.name.0..span.name.1],
                &head[span.value.0..span.value.1],
            )
            .map_err(|what| invalid(format!("the engine's answer {what}")))?;
    }
    // Read from the lines the client gets (not from one a `Connection` header names away).
    let (mut content_type, mut dated) = (None, false);
    gather_lines(head, spans, lines, |name, value| {
        if name.eq_ignore_ascii_case(b"content-type") {
            content_type.get_or_insert(value);
        } else if name.eq_ignore_ascii_case(b"date") {
            dated = true;
        }
    });
    let event_stream = content_type
        .and_then(|v| v.get(..17))
        .is_some_and(|v| v.eq_ignore_ascii_case(b"text/event-stream"));
    let FramingHeaders {
        length,
        encoded,
        chunked,
        close,
        keep_alive,
    } = framing_headers;
    let mut keep = version == Version::HTTP_11 || keep_alive;
    let framing = if super::bodiless_status(status) {
        Framing::Length(0)
    } else if encoded {
        if chunked {
            Framing::Chunked(Chunk::Size)
        } else {
            Framing::UntilClose
        }
    } else {
        match length {
            Some(n) => Framing::Length(n),
            None => Framing::UntilClose,
        }
    };
    if close
        || matches!(framing, Framing::UntilClose)
        || (encoded && (length.is_some() || version == Version::HTTP_10))
    {
        keep = false;
    }
    let engine = EngineHead {
        status,
        lines: take_lines(lines),
        event_stream,
        dated,
    };
    Ok((engine, framing, keep))
}

/// The most a connection keeps, between messages, of a buffer it reuses (a head being written,
/// header lines being gathered): one a large head made grow past it is let go.
pub(super) const KEEP_BUFFER: usize = 16 * 1024;

/// Splits off the header lines gathered in `lines`, and lets its buffer go if it grew past
/// [`KEEP_BUFFER`].
pub(super) fn take_lines(lines: &mut BytesMut) -> Bytes {
    let taken = lines.split().freeze();
    if lines.capacity() > KEEP_BUFFER {
        *lines = BytesMut::new();
    }
    taken
}

/// Gathers into `out` the header lines of `head` (where `spans` says they lie) that go on to
/// the next hop, each `name: value\r\n` (the value as `httparse` gave it, without the
/// whitespace around it): not those of one hop nor those a `Connection` header names
/// (RFC 9110 7.6.1), and not those the router sets itself (see [`not_forwarded`]). `kept`
/// hears of each line gathered.
pub(super) fn gather_lines<'h>(
    head: &'h [u8],
    spans: &[Span],
    out: &mut BytesMut,
    mut kept: impl FnMut(&'h [u8], &'h [u8]),
) {
    let name_of = |span: &Span| &head[span.name.0..span.name.1];
    let value_of = |span: &Span| &head[span.value.0..span.value.1];
    let connection = |span: &&Span| name_of(span).eq_ignore_ascii_case(b"connection");
    // Mostly `Connection` names no header, or only `close` or `keep-alive`.
    let names_any = spans.iter().filter(connection).any(|span| {
        tokens(value_of(span)).any(|token| {
            !token.eq_ignore_ascii_case(b"close") && !token.eq_ignore_ascii_case(b"keep-alive")
        })
    });
    let named = |name: &[u8]| {
        names_any
            && spans
                .iter()
                .filter(connection)
                .any(|span| tokens(value_of(span)).any(|token| token.eq_ignore_ascii_case(name)))
    };
    out.clear();
    for span in spans {
        let name = name_of(span);
        if not_forwarded(name) || named(name) {
            continue;
        }
        let value = value_of(span);
        kept(name, value);
        out.extend_from_slice(name);
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    }
}

/// The headers the router never passes on: those of one hop (RFC 9110 7.6.1), the framing,
/// which it sets itself, and `Host` and `Expect` (a request's; it sets the one and answers the
/// other).
pub(super) fn not_forwarded(name: &[u8]) -> bool {
    const NAMES: [&[u8]; 11] = [
        b"host",
        b"expect",
        b"content-length",
        b"transfer-encoding",
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"upgrade",
        b"proxy-authorization",
    ];
    NAMES
        .iter()
        .any(|known| known.len() == name.len() && known.eq_ignore_ascii_case(name))
}

/// The comma-separated tokens of a header value, trimmed, empty ones left out.
pub(super) fn tokens(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value
        .split(|&b| b == b',')
        .map(<[u8]>::trim_ascii)
        .filter(|token| !token.is_empty())
}

/// How an answer's body ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Framing {
    /// This many bytes are left.
    Length(u64),
    /// Chunked, at this point of the encoding.
    Chunked(Chunk),
    /// When the engine closes the connection.
    UntilClose,
}

impl Framing {
    /// Whether the body has been read to its end (an until-close body ends with the close).
    fn complete(self) -> bool {
        matches!(self, Framing::Length(0) | Framing::Chunked(Chunk::Done))
    }
}

/// What a message's framing headers say (RFC 9112 6), gathered header by header; the same
/// for a request (`super::server`) and an answer (here).
#[derive(Debug, Default)]
pub(super) struct FramingHeaders {
    /// `Content-Length` (several must agree).
    pub(super) length: Option<u64>,
    /// A `Transfer-Encoding` is there.
    pub(super) encoded: bool,
    /// The last `Transfer-Encoding` ends in `chunked`.
    pub(super) chunked: bool,
    /// `Connection: close`.
    pub(super) close: bool,
    /// `Connection: keep-alive`.
    pub(super) keep_alive: bool,
}

impl FramingHeaders {
    /// Notes one header; what is wrong (to follow "the request" or "the engine's answer") when
    /// a `Content-Length` is not a number or disagrees with an earlier one.
    pub(super) fn note(&mut self, name: &[u8], value: &[u8]) -> Result<(), &'static str> {
        if name.eq_ignore_ascii_case(b"content-length") {
            let n = std::str::from_utf8(value)
                .ok()
                .map(str::trim)
                .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|v| v.parse::<u64>().ok())
                .ok_or("has a Content-Length that is not a number")?;
            if self.length.is_some_and(|l| l != n) {
                return Err("has two different Content-Lengths");
            }
            self.length = Some(n);
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            self.encoded = true;
            self.chunked = value
                .rsplit(|&b| b == b',')
                .next()
                .is_some_and(|last| last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        } else if name.eq_ignore_ascii_case(b"connection") {
            for token in tokens(value) {
                self.close |= token.eq_ignore_ascii_case(b"close");
                self.keep_alive |= token.eq_ignore_ascii_case(b"keep-alive");
            }
        }
        Ok(())
    }
}

/// Where a chunked body's decoding stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Chunk {
    /// At a chunk-size line.
    Size,
    /// Inside a chunk's data, this many bytes left.
    Data(u64),
    /// At the CRLF after a chunk's data.
    DataEnd,
    /// In the trailer section, after the last chunk.
    Trailers,
    /// The body has ended.
    Done,
}

/// One step of chunked decoding over `buf`: the data that is there, if the encoding is at
/// some (and `data` asks for it); advances `chunk` over sizes, CRLFs and trailers. `Ok(None)`
/// with `chunk` not `Done`: more bytes are needed, or data is next and was not asked for.
/// Errors begin with `what` (whose body it is).
pub(super) fn decode_chunked(
    chunk: &mut Chunk,
    buf: &mut BytesMut,
    data: bool,
    what: &str,
) -> io::Result<Option<Bytes>> {
    loop {
        match *chunk {
            Chunk::Done => return Ok(None),
            Chunk::Data(left) => {
                if buf.is_empty() || !data {
                    return Ok(None);
                }
                let n = (buf.len() as u64).min(left) as usize;
                let data = buf.split_to(n).freeze();
                *chunk = if left == n as u64 {
                    Chunk::DataEnd
                } else {
                    Chunk::Data(left - n as u64)
                };
                return Ok(Some(data));
            }
            Chunk::DataEnd => {
                if buf.len() < 2 {
                    return Ok(None);
                }
                if &buf[..2] != b"\r\n" {
                    return Err(invalid(format!("{what}: no CRLF after a chunk")));
                }
                buf.advance(2);
                *chunk = Chunk::Size;
            }
            Chunk::Size => {
                // NB: the bound holds for a line that came whole too, so that whether a line is
                // refused does not depend on how its bytes arrived.
                let end = memchr::memchr(b'\n', buf);
                if end.unwrap_or(buf.len()) > MAX_CHUNK_LINE {
                    return Err(invalid(format!("{what}: a chunk-size line too long")));
                }
                let Some(end) = end else {
                    return Ok(None);
                };
                let line = &buf[..end];
                let line = line.strip_suffix(b"\r").unwrap_or(line);
                let digits = line
                    .iter()
                    .position(|b| !b.is_ascii_hexdigit())
                    .unwrap_or(line.len());
                // After the size only whitespace, then an extension (RFC 9112 7.1: BWS before
                // `;`), or nothing: "5x" or "5 x" is not a size.
                let rest = &line[digits..];
                let blank = rest
                    .iter()
                    .take_while(|b| matches!(b, b' ' | b'\t'))
                    .count();
                let rest = &rest[blank..];
                if digits == 0 || digits > 15 || !(rest.is_empty() || rest[0] == b';') {
                    return Err(invalid(format!("{what}: a bad chunk size")));
                }
                let size = std::str::from_utf8(&line[..digits])
                    .ok()
                    .and_then(|d| u64::from_str_radix(d, 16).ok())
                    .ok_or_else(|| invalid(format!("{what}: a bad chunk size")))?;
                buf.advance(end + 1);
                *chunk = if size == 0 {
                    Chunk::Trailers
                } else {
                    Chunk::Data(size)
                };
            }
            Chunk::Trailers => {
                // Trailer lines up to an empty line; dropped.
                let end = memchr::memchr(b'\n', buf);
                if end.unwrap_or(buf.len()) > MAX_TRAILERS {
                    return Err(invalid(format!("{what}: trailers too long")));
                }
                let Some(end) = end else {
                    return Ok(None);
                };
                let empty = end == 0 || (end == 1 && buf[0] == b'\r');
                buf.advance(end + 1);
                if empty {
                    *chunk = Chunk::Done;
                }
            }
        }
    }
}

/// Appends `headers` as header lines, but for those `skip` names.
pub(super) fn push_headers(out: &mut Vec<u8>, headers: &HeaderMap, skip: impl Fn(&[u8]) -> bool) {
    for (name, value) in headers {
        if skip(name.as_str().as_bytes()) {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
}

/// Encodes a request head into `head`: request line (origin-form: the target's path and
/// query), `Host`, the client's header lines, `Content-Length`.
pub(super) fn encode_head(
    head: &mut Vec<u8>,
    request: &RequestHead,
    host: &HeaderValue,
    length: usize,
) {
    let target = request
        .uri
        .path_and_query()
        .map_or("/", http::uri::PathAndQuery::as_str);
    head.clear();
    head.reserve(128 + target.len() + request.lines.len());
    head.extend_from_slice(request.method.as_str().as_bytes());
    head.push(b' ');
    head.extend_from_slice(target.as_bytes());
    head.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    head.extend_from_slice(host.as_bytes());
    head.extend_from_slice(b"\r\n");
    head.extend_from_slice(&request.lines);
    head.extend_from_slice(b"content-length: ");
    push_decimal(head, length as u64);
    head.extend_from_slice(b"\r\n\r\n");
}

/// Appends `n` in decimal: what `write!` does, without the formatting machinery (a few hundred
/// instructions per head; `itoa` writes two digits a step, as the lifecycle's JSON does).
pub(super) fn push_decimal(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

/// The idle connections of one engine address, and its `Host` header.
struct Idle {
    conns: Vec<(Box<Conn>, Instant)>,
    host: HeaderValue,
}

/// An idle connection taken from the pool, and how long it was idle.
type IdleConn = (Box<Conn>, Duration);

/// The idle connections.
pub(crate) struct Pool {
    idle: Mutex<Lists>,
    max_idle: usize,
    idle_timeout: Duration,
    connect_timeout: Duration,
}

struct Lists {
    by_addr: HashMap<SocketAddr, Idle, FastHash>,
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
                by_addr: HashMap::default(),
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
    /// that is still fresh, and how long it was idle.
    fn take_idle(
        &self,
        addr: SocketAddr,
    ) -> Result<(HeaderValue, Option<IdleConn>), UpstreamError> {
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
        let idle_for = now.saturating_duration_since(since);
        if idle_for > self.idle_timeout {
            // The rest are older still.
            idle.conns.clear();
            return Ok((host, None));
        }
        Ok((host, Some((conn, idle_for))))
    }

    /// Puts a connection whose answer was read to the end, and that the engine keeps open,
    /// back.
    fn put(&self, conn: Box<Conn>) {
        if !conn.buf.is_empty() {
            // Bytes after the answer: nothing they could belong to.
            return;
        }
        let mut lists = self.lock();
        // The address may have been swept while all its connections were in use.
        let idle = match lists.by_addr.entry(conn.addr) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let Ok(host) = HeaderValue::from_str(&conn.addr.to_string()) else {
                    return;
                };
                e.insert(Idle {
                    conns: Vec::new(),
                    host,
                })
            }
        };
        if idle.conns.len() < self.max_idle {
            idle.conns.push((conn, Instant::now()));
        }
    }

    /// Drops the idle connections past the idle timeout, everywhere, and the addresses left
    /// with none but `keep` (at most once per idle timeout).
    pub(super) fn sweep(&self, keep: Option<SocketAddr>) {
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
            !idle.conns.is_empty() || Some(*addr) == keep
        });
    }

    async fn connect(&self, addr: SocketAddr) -> Result<Box<Conn>, UpstreamError> {
        let io = match tokio::time::timeout(self.connect_timeout, TcpStream::connect(addr)).await {
            Ok(stream) => stream?,
            Err(_) => {
                return Err(format!(
                    "no connection to the engine at {addr} within {} ms",
                    self.connect_timeout.as_millis()
                )
                .into());
            }
        };
        if let Err(err) = io.set_nodelay(true) {
            tracing::debug!(error = %err, "TCP_NODELAY");
        }
        Ok(Box::new(Conn {
            io,
            buf: BytesMut::with_capacity(READ_SIZE),
            addr,
            spans: Vec::new(),
            head: Vec::new(),
            lines: BytesMut::new(),
        }))
    }

    /// A connection to `addr` (an idle one that is still usable, or a new one), whether it
    /// was reused, and `addr`'s `Host` header.
    async fn checkout(
        &self,
        addr: SocketAddr,
    ) -> Result<(Box<Conn>, bool, HeaderValue), UpstreamError> {
        loop {
            let (host, idle) = self.take_idle(addr)?;
            match idle {
                Some((mut conn, idle_for)) => {
                    if conn.usable(idle_for) {
                        return Ok((conn, true, host));
                    }
                }
                None => {
                    self.sweep(Some(addr));
                    return Ok((self.connect(addr).await?, false, host));
                }
            }
        }
    }

    /// Sends a request (`request`'s method, its target's path and query, `Host` and
    /// `Content-Length` set here, its header lines) with `body` to `addr` and reads the
    /// response head. The body is dropped (its part of the listener's budget given back) once
    /// it is written, before the answer is waited for. The answer's body keeps the connection.
    pub(crate) async fn request(
        self: &Arc<Self>,
        addr: SocketAddr,
        request: &RequestHead,
        body: RequestBody,
    ) -> Result<(EngineHead, UpstreamBody), UpstreamError> {
        let (mut conn, mut reused, host) = self.checkout(addr).await?;
        let mut head = std::mem::take(&mut conn.head);
        encode_head(&mut head, request, &host, body.len());
        let mut body = Some(body);
        let (engine, framing, keep) = loop {
            let written = match &body {
                Some(bytes) => conn.write(&head, bytes).await,
                None => Ok(()),
            };
            let err = match written {
                Ok(()) => {
                    drop(body.take());
                    break conn.read_head().await?;
                }
                Err(err) => err,
            };
            // The engine may have answered before it stopped reading (refusing a body it did
            // not want, then closing): that answer is the request's.
            if let Ok(Ok((engine, framing, _))) =
                tokio::time::timeout(EARLY_ANSWER_WAIT, conn.read_head()).await
            {
                tracing::debug!(error = %err, "the engine answered before it read the request whole");
                break (engine, framing, false);
            }
            if !reused {
                return Err(err.into());
            }
            // A reused connection the engine closed just then: the request did not get
            // through whole, so once more, on a fresh one.
            tracing::debug!(error = %err, "engine connection closed; sending on a fresh one");
            conn = self.connect(addr).await?;
            reused = false;
        };
        if head.capacity() <= KEEP_BUFFER {
            conn.head = head;
        }
        let mut body = UpstreamBody {
            conn: Some(conn),
            framing,
            keep,
            pool: Arc::clone(self),
        };
        body.advance();
        Ok((engine, body))
    }
}

/// An engine's response body, holding (and reading) its connection; the connection goes back
/// to the pool when the body has been read to the end (and the engine keeps it open), and is
/// closed when the body is dropped before that.
pub(crate) struct UpstreamBody {
    /// `None` once the body ended (given back or closed) or failed. Boxed: the body lives in
    /// the response future while it streams.
    conn: Option<Box<Conn>>,
    framing: Framing,
    /// Whether the engine keeps the connection open after this answer.
    keep: bool,
    pool: Arc<Pool>,
}

impl UpstreamBody {
    /// Whether the body has ended.
    fn ended(&self) -> bool {
        self.framing.complete() || self.conn.is_none()
    }

    /// Moves a chunked body over what needs no more data (CRLFs, the last chunk, trailers)
    /// and gives the connection back once the body has ended, so that the end is seen
    /// without one more poll.
    fn advance(&mut self) {
        if let (Framing::Chunked(chunk), Some(conn)) = (&mut self.framing, self.conn.as_mut())
            && decode_chunked(chunk, &mut conn.buf, false, ANSWER).is_err()
        {
            // Reported when the body is read next.
            return;
        }
        if self.framing.complete()
            && let Some(conn) = self.conn.take()
            && self.keep
        {
            self.pool.put(conn);
        }
    }

    /// The next frame, with the connection at hand.
    fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<io::Result<Bytes>>> {
        loop {
            if self.framing.complete() {
                self.advance();
                return Poll::Ready(None);
            }
            let Some(conn) = self.conn.as_mut() else {
                return Poll::Ready(None);
            };
            match &mut self.framing {
                Framing::Length(left) => {
                    if !conn.buf.is_empty() {
                        let n = (conn.buf.len() as u64).min(*left) as usize;
                        *left -= n as u64;
                        let data = conn.buf.split_to(n).freeze();
                        self.advance();
                        return Poll::Ready(Some(Ok(data)));
                    }
                }
                Framing::Chunked(chunk) => {
                    if let Some(data) = decode_chunked(chunk, &mut conn.buf, true, ANSWER)? {
                        self.advance();
                        return Poll::Ready(Some(Ok(data)));
                    }
                    if *chunk == Chunk::Done {
                        continue;
                    }
                }
                Framing::UntilClose => {
                    if !conn.buf.is_empty() {
                        return Poll::Ready(Some(Ok(conn.buf.split().freeze())));
                    }
                }
            }
            if ready!(conn.poll_fill(cx))? == 0 {
                if self.framing == Framing::UntilClose {
                    self.conn = None;
                    return Poll::Ready(None);
                }
                return Poll::Ready(Some(Err(closed_early())));
            }
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = self.get_mut();
        match ready!(this.poll_data(cx)) {
            Some(Ok(data)) => Poll::Ready(Some(Ok(Frame::data(data)))),
            Some(Err(err)) => {
                // The connection is in no known state: closed.
                this.conn = None;
                Poll::Ready(Some(Err(err)))
            }
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended()
    }

    fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Length(n) => SizeHint::with_exact(n),
            _ => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::atomic::{AtomicUsize, Ordering};

    use http::Request;
    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    fn parse(text: &str) -> io::Result<Option<(usize, EngineHead, Framing, bool)>> {
        let mut buf = BytesMut::from(text);
        let taken = take_head(&mut buf, &mut Vec::new(), &mut BytesMut::new())?;
        Ok(taken.map(|(engine, framing, keep)| (text.len() - buf.len(), engine, framing, keep)))
    }

    fn lines(engine: &EngineHead) -> &str {
        std::str::from_utf8(&engine.lines).unwrap()
    }

    #[test]
    fn a_head_is_parsed_only_when_complete() {
        let head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{\"ok\":true}";
        for cut in 0..head.len() - 11 {
            assert!(parse(&head[..cut]).unwrap().is_none(), "{cut}");
        }
        let (used, engine, framing, keep) = parse(head).unwrap().unwrap();
        assert_eq!(used, head.len() - 11);
        assert_eq!(engine.status, StatusCode::OK);
        assert_eq!(lines(&engine), "content-type: application/json\r\n");
        assert!(!engine.event_stream && !engine.dated);
        assert_eq!(framing, Framing::Length(11));
        assert!(keep);
    }

    #[test]
    fn the_lines_the_client_gets_decide_whether_a_stream_and_dated() {
        let head = |lines: &str| {
            parse(&format!(
                "HTTP/1.1 200 OK\r\n{lines}content-length: 0\r\n\r\n"
            ))
            .unwrap()
            .unwrap()
            .1
        };
        let stream = head("Content-Type: text/event-stream; charset=utf-8\r\nDate: d\r\n");
        assert!(stream.event_stream && stream.dated);
        // Named by `Connection`, so not passed on: neither counts.
        let hop = head(
            "Connection: Date, content-type\r\nContent-Type: text/event-stream\r\nDate: d\r\nX-A: 1\r\n",
        );
        assert!(!hop.event_stream && !hop.dated);
        assert_eq!(lines(&hop), "X-A: 1\r\n");
        // The first `Content-Type` decides, as `HeaderMap::get` did.
        let first = head("Content-Type: application/json\r\nContent-Type: text/event-stream\r\n");
        assert!(!first.event_stream);
    }

    #[test]
    fn the_body_length_follows_rfc_9112() {
        let chunked = Framing::Chunked(Chunk::Size);
        let cases = [
            (
                "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n",
                chunked,
                true,
            ),
            (
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, Chunked\r\n",
                chunked,
                true,
            ),
            // Both: the encoding wins, and the connection is not trusted again.
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n",
                chunked,
                false,
            ),
            (
                "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n",
                Framing::UntilClose,
                false,
            ),
            ("HTTP/1.1 200 OK\r\n", Framing::UntilClose, false),
            ("HTTP/1.1 204 No Content\r\n", Framing::Length(0), true),
            (
                "HTTP/1.1 304 Not Modified\r\ncontent-length: 7\r\n",
                Framing::Length(0),
                true,
            ),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 3\r\n",
                Framing::Length(3),
                true,
            ),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 3\r\nconnection: close\r\n",
                Framing::Length(3),
                false,
            ),
            (
                "HTTP/1.0 200 OK\r\ncontent-length: 3\r\n",
                Framing::Length(3),
                false,
            ),
            (
                "HTTP/1.0 200 OK\r\ncontent-length: 3\r\nconnection: keep-alive\r\n",
                Framing::Length(3),
                true,
            ),
            (
                "HTTP/1.0 200 OK\r\ncontent-length: 3\r\nconnection: close, keep-alive\r\n",
                Framing::Length(3),
                false,
            ),
            (
                "HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ntransfer-encoding: chunked\r\n",
                chunked,
                false,
            ),
        ];
        for (head, framing, keep) in cases {
            let (_, _, got, kept) = parse(&format!("{head}\r\n")).unwrap().unwrap();
            assert_eq!((got, kept), (framing, keep), "{head}");
        }
    }

    #[test]
    fn a_head_with_many_lines_is_read_up_to_the_bound() {
        let lines_of = |n: usize| {
            (0..n)
                .map(|i| format!("x-h{i}: {i}\r\n"))
                .collect::<String>()
        };
        let head = format!(
            "HTTP/1.1 200 OK\r\n{}content-length: 0\r\n\r\n",
            lines_of(60)
        );
        let (_, engine, framing, _) = parse(&head).unwrap().unwrap();
        assert_eq!(lines(&engine), lines_of(60), "all but the length");
        assert_eq!(framing, Framing::Length(0));
        let head = format!("HTTP/1.1 200 OK\r\n{}\r\n", lines_of(MAX_HEADERS + 1));
        assert!(
            parse(&head)
                .unwrap_err()
                .to_string()
                .contains("too many headers")
        );
    }

    #[test]
    fn a_bad_head_is_an_error_that_says_what() {
        let err = |head: &str| parse(head).unwrap_err().to_string();
        assert!(
            err("HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\n")
                .contains("two different Content-Lengths")
        );
        for length in ["-1", "+5", "", "0x10", "1 2"] {
            let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {length}\r\n\r\n");
            assert!(err(&head).contains("not a number"), "{length:?}");
        }
        assert!(err("HTTP/1.1 2000 OK\r\n\r\n").contains("response head"));
        assert!(err("HTTQ/1.1 200 OK\r\n\r\n").contains("response head"));
    }

    /// Decodes `encoded` fed in pieces of `step` bytes: the data and whether it ended.
    fn decode_in_steps(encoded: &[u8], step: usize) -> io::Result<(Vec<u8>, bool)> {
        let mut chunk = Chunk::Size;
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        for piece in encoded.chunks(step) {
            buf.extend_from_slice(piece);
            while let Some(data) = decode_chunked(&mut chunk, &mut buf, true, ANSWER)? {
                out.extend_from_slice(&data);
            }
        }
        Ok((out, chunk == Chunk::Done && buf.is_empty()))
    }

    #[test]
    fn chunked_bodies_decode_however_they_are_split() {
        let encoded =
            b"5\r\nhello\r\n1;name=value\r\n \r\nB \r\ndata: world\r\n0\r\ntrailer: x\r\n\r\n";
        for step in 1..=encoded.len() {
            let (data, ended) = decode_in_steps(encoded, step).unwrap();
            assert_eq!(data, b"hello data: world", "step {step}");
            assert!(ended, "step {step}");
        }
        let (data, ended) = decode_in_steps(b"3\r\nabc\r\n0\r\n", 4).unwrap();
        assert_eq!(data, b"abc");
        assert!(!ended, "the last CRLF has not come");
    }

    #[test]
    fn a_bad_chunked_body_is_an_error() {
        for bad in [
            &b"x\r\nabc\r\n"[..],
            b"3\r\nabcd\r\n",
            b"10000000000000000\r\n",
            b"-3\r\nabc\r\n",
            // Junk after the size that is not an extension.
            b"3x\r\nabc\r\n",
            b"3 x\r\nabc\r\n",
            b"3\t,\r\nabc\r\n",
            b"3\x0c\r\nabc\r\n",
        ] {
            assert!(decode_in_steps(bad, bad.len()).is_err(), "{bad:?}");
        }
        let long = vec![b'1'; MAX_CHUNK_LINE + 2];
        assert!(decode_in_steps(&long, long.len()).is_err());
    }

    /// Found by the `request` fuzz target: a chunk-size line (or a trailer line) over its bound
    /// was refused when it arrived in pieces, and read when it came whole with its LF.
    #[test]
    fn a_long_line_is_refused_however_it_arrives() {
        let ext = "x".repeat(MAX_CHUNK_LINE);
        let size_line = format!("2;e={ext}\r\n{{}}\r\n0\r\n\r\n");
        let trailer = format!("2\r\n{{}}\r\n0\r\nt: {}\r\n\r\n", "y".repeat(MAX_TRAILERS));
        for encoded in [size_line, trailer] {
            for step in [1, 1000, encoded.len()] {
                assert!(
                    decode_in_steps(encoded.as_bytes(), step).is_err(),
                    "step {step}"
                );
            }
        }
        // At the bound, a line is read however it arrives.
        let ext = "x".repeat(MAX_CHUNK_LINE - 5);
        let at_bound = format!("2;e={ext}\r\n{{}}\r\n0\r\n\r\n");
        for step in [1, 1000, at_bound.len()] {
            assert_eq!(
                decode_in_steps(at_bound.as_bytes(), step).unwrap(),
                (b"{}".to_vec(), true)
            );
        }
    }

    #[test]
    fn decimals_are_written_as_write_writes_them() {
        let each_length = (0..20).map(|digits| 10u64.pow(digits));
        let around =
            each_length.flat_map(|p| [p - 1, p, p + 1, p.saturating_mul(5).saturating_add(3)]);
        for n in [0, 7, 10, 99, 1000, 4_294_967_296, u64::MAX]
            .into_iter()
            .chain(around)
        {
            let mut out = b"x".to_vec();
            push_decimal(&mut out, n);
            assert_eq!(out, format!("x{n}").into_bytes());
        }
    }

    #[test]
    fn the_request_head_carries_host_the_end_to_end_headers_and_its_own_length() {
        let request = Request::post("/v1/completions?x=1")
            .header("content-type", "application/json")
            .header("x-request-id", "abc")
            .header("content-length", "999")
            .header("transfer-encoding", "chunked")
            .header("host", "client.example")
            .header("connection", "keep-alive")
            .body(())
            .unwrap();
        let (parts, ()) = request.into_parts();
        let mut head = Vec::new();
        encode_head(
            &mut head,
            &RequestHead::from_parts(parts),
            &HeaderValue::from_static("127.0.0.1:8000"),
            42,
        );
        assert_eq!(
            String::from_utf8(head).unwrap(),
            "POST /v1/completions?x=1 HTTP/1.1\r\nhost: 127.0.0.1:8000\r\ncontent-type: application/json\r\nx-request-id: abc\r\ncontent-length: 42\r\n\r\n"
        );
    }

    /// An engine that answers every request on a connection with the next of `answers`
    /// (each written in pieces of `step` bytes), and closes the connection after the answers
    /// marked so; counts the connections.
    async fn engine(
        answers: Vec<(&'static str, bool)>,
        step: usize,
    ) -> (SocketAddr, Arc<AtomicUsize>, Arc<Mutex<Vec<String>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let (count, seen) = (Arc::clone(&accepted), Arc::clone(&requests));
        let answers = Arc::new(Mutex::new(answers.into_iter()));
        tokio::spawn(async move {
            loop {
                let (mut stream, _) = listener.accept().await.unwrap();
                count.fetch_add(1, Ordering::SeqCst);
                let (answers, seen) = (Arc::clone(&answers), Arc::clone(&seen));
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    loop {
                        // One request: the head, then its Content-Length.
                        let request = loop {
                            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                                let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                                let length: usize = head
                                    .lines()
                                    .find_map(|l| l.strip_prefix("content-length: "))
                                    .map_or(0, |v| v.parse().unwrap());
                                if buf.len() >= end + 4 + length {
                                    let whole = buf.drain(..end + 4 + length).collect::<Vec<_>>();
                                    break String::from_utf8(whole).unwrap();
                                }
                            }
                            let mut more = [0u8; 4096];
                            match stream.read(&mut more).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&more[..n]),
                            }
                        };
                        seen.lock().unwrap().push(request);
                        let Some((answer, close)) = answers.lock().unwrap().next() else {
                            return;
                        };
                        for piece in answer.as_bytes().chunks(step) {
                            if stream.write_all(piece).await.is_err() {
                                return;
                            }
                            stream.flush().await.unwrap();
                        }
                        if close {
                            return;
                        }
                    }
                });
            }
        });
        (addr, accepted, requests)
    }

    fn pool() -> Arc<Pool> {
        Pool::new(8, IDLE_TIMEOUT, Duration::from_secs(5))
    }

    /// Sends `request` through `pool` to `addr`.
    async fn send(
        pool: &Arc<Pool>,
        addr: SocketAddr,
        request: Request<Bytes>,
    ) -> Result<(EngineHead, UpstreamBody), UpstreamError> {
        let (parts, body) = request.into_parts();
        pool.request(addr, &RequestHead::from_parts(parts), body.into())
            .await
    }

    async fn ask(pool: &Arc<Pool>, addr: SocketAddr) -> Result<(StatusCode, Bytes), String> {
        let request = Request::post("/v1/completions")
            .header("content-type", "application/json")
            .body(Bytes::from_static(b"{\"model\":\"m\"}"))
            .unwrap();
        let response = send(pool, addr, request).await.map_err(|e| e.to_string())?;
        let status = response.0.status;
        let body = response.1.collect().await.map_err(|e| e.to_string())?;
        Ok((status, body.to_bytes()))
    }

    const CHUNKED: &str = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: a\n\n\r\n9\r\ndata: b\n\n\r\n0\r\nx-trailer: 1\r\n\r\n";
    const LENGTH: &str = "HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\n{\"ok\":true}";

    #[tokio::test]
    async fn answers_in_small_pieces_are_read_whole_and_the_connection_is_reused() {
        let (addr, accepted, requests) =
            engine(vec![(CHUNKED, false), (LENGTH, false), (CHUNKED, false)], 3).await;
        let pool = pool();
        assert_eq!(
            ask(&pool, addr).await.unwrap(),
            (
                StatusCode::OK,
                Bytes::from_static(b"data: a\n\ndata: b\n\n")
            )
        );
        assert_eq!(
            ask(&pool, addr).await.unwrap().1,
            Bytes::from_static(b"{\"ok\":true}")
        );
        assert_eq!(
            ask(&pool, addr).await.unwrap().1,
            Bytes::from_static(b"data: a\n\ndata: b\n\n")
        );
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        let requests = requests.lock().unwrap();
        assert_eq!(
            requests[0],
            format!(
                "POST /v1/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: 13\r\n\r\n{{\"model\":\"m\"}}"
            )
        );
    }

    #[tokio::test]
    async fn a_body_larger_than_the_socket_buffers_is_written_whole() {
        let (addr, _, requests) = engine(vec![(LENGTH, false)], 64).await;
        let body = Bytes::from(vec![b'x'; 16 << 20]);
        let request = Request::post("/v1/completions").body(body).unwrap();
        let response = send(&pool(), addr, request).await.unwrap();
        let answer = response.1.collect().await.unwrap().to_bytes();
        assert_eq!(answer, Bytes::from_static(b"{\"ok\":true}"));
        let requests = requests.lock().unwrap();
        let received = &requests[0];
        assert!(received.ends_with(&"x".repeat(1 << 20)));
        assert!(received.contains(&format!("content-length: {}\r\n", 16 << 20)));
        assert_eq!(
            received.len() - received.find("\r\n\r\n").unwrap() - 4,
            16 << 20
        );
    }

    /// An engine on a thread of its own (it runs whether the test's runtime does or not):
    /// takes one connection, reads the request head, then hands the socket to `then`.
    fn thread_engine(then: impl FnOnce(std::net::TcpStream) + Send + 'static) -> SocketAddr {
        use std::io::Read as _;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut socket, _) = listener.accept().unwrap();
            let mut seen = Vec::new();
            let mut buf = [0u8; 4096];
            while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = socket.read(&mut buf).unwrap();
                seen.extend_from_slice(&buf[..n]);
            }
            then(socket);
        });
        addr
    }

    #[tokio::test]
    async fn an_engine_that_refuses_a_large_body_unread_is_answered_with_its_refusal() {
        use std::io::Write as _;
        // An engine that reads the head only, refuses, and closes with the body unread (its
        // kernel resets the connection then, and our write of the body fails).
        let addr = thread_engine(|mut socket| {
            socket
                .write_all(b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 7\r\n\r\ntoo big")
                .unwrap();
        });
        let body = Bytes::from(vec![b'x'; 64 << 20]);
        let request = Request::post("/v1/embeddings").body(body).unwrap();
        let pool = pool();
        let (engine, body) = send(&pool, addr, request).await.unwrap();
        assert_eq!(engine.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(
            body.collect().await.unwrap().to_bytes(),
            Bytes::from_static(b"too big")
        );
        assert_eq!(
            pool.lock().by_addr.get(&addr).map_or(0, |i| i.conns.len()),
            0,
            "a broken connection is not kept"
        );
    }

    #[tokio::test]
    async fn the_end_is_seen_with_the_last_byte_and_the_connection_is_back_at_once() {
        const WHOLE: &str =
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n";
        const EMPTY: &str = "HTTP/1.1 204 No Content\r\n\r\n";
        // Each answer in one write, so the whole of it is read with its head.
        let (addr, accepted, _) = engine(vec![(WHOLE, false), (EMPTY, false)], 4096).await;
        let pool = pool();
        let idle = |pool: &Arc<Pool>| pool.lock().by_addr.get(&addr).map_or(0, |i| i.conns.len());

        let request = || Request::post("/v1/completions").body(Bytes::new()).unwrap();
        let mut body = send(&pool, addr, request()).await.unwrap().1;
        assert!(!body.is_end_stream());
        let frame = body.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), Bytes::from_static(b"abc"));
        assert!(
            body.is_end_stream(),
            "ended with its last data, no further poll"
        );
        assert_eq!(
            idle(&pool),
            1,
            "the connection is back before the body is dropped"
        );
        drop(body);

        let body = send(&pool, addr, request()).await.unwrap().1;
        assert!(body.is_end_stream(), "a 204 has no body");
        assert_eq!(idle(&pool), 1);
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_body_dropped_halfway_closes_its_connection() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (closed_tx, closed_rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 4096];
            let _ = stream.read(&mut buf).await.unwrap();
            stream
                .write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhel")
                .await
                .unwrap();
            // What the engine sees next: the end of the connection.
            let n = stream.read(&mut buf).await.unwrap_or(0);
            let _ = closed_tx.send(n);
        });
        let pool = pool();
        let request = Request::post("/v1/completions").body(Bytes::new()).unwrap();
        let mut body = send(&pool, addr, request).await.unwrap().1;
        let frame = body.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), Bytes::from_static(b"hel"));
        drop(body);
        assert_eq!(
            closed_rx.await.unwrap(),
            0,
            "the engine sees the disconnect"
        );
        assert_eq!(pool.lock().by_addr[&addr].conns.len(), 0);
    }

    #[tokio::test]
    async fn an_informational_answer_is_skipped() {
        let (addr, _, _) = engine(
            vec![(
                "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
                false,
            )],
            5,
        )
        .await;
        assert_eq!(
            ask(&pool(), addr).await.unwrap(),
            (StatusCode::OK, Bytes::from_static(b"ok"))
        );
    }

    #[tokio::test]
    async fn a_body_until_close_is_read_to_the_close_and_the_connection_not_reused() {
        let (addr, accepted, _) = engine(
            vec![
                ("HTTP/1.1 200 OK\r\n\r\nall of it", true),
                (
                    "HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 4\r\n\r\nmore",
                    true,
                ),
                (LENGTH, false),
            ],
            4,
        )
        .await;
        let pool = pool();
        assert_eq!(
            ask(&pool, addr).await.unwrap().1,
            Bytes::from_static(b"all of it")
        );
        assert_eq!(
            ask(&pool, addr).await.unwrap().1,
            Bytes::from_static(b"more")
        );
        assert_eq!(
            ask(&pool, addr).await.unwrap().1,
            Bytes::from_static(b"{\"ok\":true}")
        );
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn an_answer_cut_short_is_an_error() {
        let (addr, _, _) = engine(
            vec![
                ("HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf", true),
                (
                    "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhel",
                    true,
                ),
                ("HTTP/1.1 200 O", true),
            ],
            64,
        )
        .await;
        let pool = pool();
        for _ in 0..3 {
            let err = ask(&pool, addr).await.unwrap_err();
            assert!(err.contains("before the end of its answer"), "{err}");
        }
    }

    #[tokio::test]
    async fn the_listener_tick_closes_connections_idle_past_the_timeout_with_no_traffic() {
        let (addr, _, _) = engine(vec![(LENGTH, false)], 64).await;
        let pool = pool();
        assert!(ask(&pool, addr).await.is_ok());
        let held = |pool: &Arc<Pool>| {
            let lists = pool.lock();
            (
                lists.by_addr.len(),
                lists.by_addr.values().map(|i| i.conns.len()).sum::<usize>(),
            )
        };
        assert_eq!(held(&pool), (1, 1));
        tokio::time::pause();
        let _tick = super::super::conn::TimerFloor::start(Arc::downgrade(&pool));
        // Not yet past the timeout: kept for the next request.
        tokio::time::sleep(IDLE_TIMEOUT - Duration::from_secs(1)).await;
        assert_eq!(held(&pool), (1, 1));
        // Past it, with no request since: the tick's sweep closed it and forgot the address.
        tokio::time::sleep(IDLE_TIMEOUT + Duration::from_secs(2)).await;
        assert_eq!(held(&pool), (0, 0));
    }

    #[tokio::test]
    async fn an_idle_connection_the_engine_closed_costs_no_request() {
        // The engine closes after each answer, though it says it keeps the connection.
        let (addr, accepted, _) = engine(vec![(LENGTH, true), (LENGTH, true)], 64).await;
        let pool = pool();
        assert!(ask(&pool, addr).await.is_ok());
        // Until the close shows on the idle connection (the runtime's I/O driver sees it).
        let still_usable = |pool: &Arc<Pool>| {
            let mut lists = pool.lock();
            let conns = &mut lists.by_addr.get_mut(&addr).unwrap().conns;
            !conns.is_empty()
                && conns
                    .iter_mut()
                    .all(|(conn, _)| conn.usable(Duration::ZERO))
        };
        while still_usable(&pool) {
            tokio::task::yield_now().await;
        }
        assert!(ask(&pool, addr).await.is_ok());
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_close_the_runtime_has_not_seen_yet_is_found_on_a_connection_idle_a_while() {
        use std::io::Write as _;
        // An engine that answers one request, then closes when told.
        let (close_tx, close_rx) = std::sync::mpsc::channel::<()>();
        let (closed_tx, closed_rx) = std::sync::mpsc::channel::<()>();
        let addr = thread_engine(move |mut socket| {
            socket.write_all(LENGTH.as_bytes()).unwrap();
            close_rx.recv().unwrap();
            drop(socket);
            closed_tx.send(()).unwrap();
        });
        let pool = pool();
        assert!(ask(&pool, addr).await.is_ok());
        // From here on the runtime does not run: its I/O driver cannot see the close.
        close_tx.send(()).unwrap();
        closed_rx.recv().unwrap();
        std::thread::sleep(PEEK_AFTER + Duration::from_millis(5));
        let (_, idle) = pool.take_idle(addr).unwrap();
        let (mut conn, idle_for) = idle.unwrap();
        assert!(idle_for >= PEEK_AFTER);
        assert!(
            conn.usable(Duration::ZERO),
            "tokio's readiness has not seen the close (else this test shows nothing)"
        );
        assert!(
            !conn.usable(idle_for),
            "a connection idle a while is peeked at: the close is found"
        );
    }

    #[tokio::test]
    async fn bytes_after_an_answer_keep_its_connection_from_reuse() {
        let (addr, accepted, _) = engine(
            vec![
                ("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokEXTRA", false),
                (LENGTH, false),
            ],
            64,
        )
        .await;
        let pool = pool();
        assert_eq!(ask(&pool, addr).await.unwrap().1, Bytes::from_static(b"ok"));
        assert_eq!(
            ask(&pool, addr).await.unwrap().1,
            Bytes::from_static(b"{\"ok\":true}")
        );
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_response_head_too_long_is_refused() {
        let long: &'static str = Box::leak(
            format!(
                "HTTP/1.1 200 OK\r\n{}\r\n\r\n",
                "x-pad: ".to_string() + &"a".repeat(MAX_HEAD)
            )
            .into_boxed_str(),
        );
        let (addr, _, _) = engine(vec![(long, false)], 8192).await;
        let err = ask(&pool(), addr).await.unwrap_err();
        assert!(err.contains("longer than 65536 bytes"), "{err}");
    }
}
