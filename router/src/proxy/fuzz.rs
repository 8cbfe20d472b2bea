//! Fuzz targets of the listener's parsers of outside input (see `fuzz/` and `fuzz-targets/`):
//! each takes arbitrary bytes, runs the parser the listener runs on them, and panics only when
//! an invariant fails. Not part of the router's API.
//!
//! - [`request`]: a client connection's bytes through the HTTP/1.1 request reader (head,
//!   framing, chunked body, pipelined requests), and each request read re-encoded as the
//!   router forwards it;
//! - [`model`]: the body's `model` scan, against `serde_json`;
//! - [`response`]: an engine's answer through the response head reader and its body's framing;
//! - [`sse`]: an engine's event stream through the event scanner, cut into frames anywhere,
//!   and each event's output test against its reading by `serde_json::Value`.

use bytes::{Bytes, BytesMut};
use http::{HeaderValue, Version};

use super::server::{self, Framing, Incoming};
use super::sse::{EventScanner, Oversized, is_output};
use super::upstream::{self, Chunk};

/// The request reader's largest head, for the checks.
const MAX_HEAD: usize = upstream::MAX_HEAD;

/// Drops the empty lines a client may send between requests, as the reader does.
fn skip_empty_lines(buf: &mut BytesMut) {
    let blank = buf
        .iter()
        .take_while(|b| matches!(b, b'\r' | b'\n'))
        .count();
    let _ = buf.split_to(blank);
}

/// A client connection's bytes through the request reader: every request it reads whole
/// (head and body), until the bytes end, a head or body is refused, or the connection would
/// close. Checks that a complete head is not complete one byte earlier, that the header lines
/// forwarded hold no framing, hop-by-hop or `Host` line and are well formed, that a chunked
/// body decodes the same however its bytes arrive, and that a request the router forwards,
/// re-encoded as it sends it to the engine, reads back the same (method, target, lines, body),
/// with nothing left over.
pub fn request(data: &[u8]) {
    let mut buf = BytesMut::from(data);
    let mut spans = Vec::new();
    let mut lines = BytesMut::new();
    loop {
        skip_empty_lines(&mut buf);
        if buf.is_empty() {
            return;
        }
        let Ok(Some(line)) = server::parse_line(&buf, &mut spans) else {
            return;
        };
        assert!(line.used <= buf.len() && line.used <= MAX_HEAD);
        let mut shorter = Vec::new();
        assert!(
            !matches!(
                server::parse_line(&buf[..line.used - 1], &mut shorter),
                Ok(Some(_))
            ),
            "a head is complete before its end"
        );
        let head = buf.split_to(line.used).freeze();
        let Ok(request) = server::incoming(&head, &line, &spans, &mut lines) else {
            return;
        };
        check_lines(&request.head.lines);
        // The `Authorization` line as the listener noted it is the one a search finds.
        let noted = request.head.authorization.as_ref().expect("noted");
        assert_eq!(
            noted.bearer(&request.head.lines),
            crate::tenants::bearer_line(&request.head.lines),
            "{noted:?}"
        );
        let body = match request.framing {
            Framing::Length(n) => {
                if (buf.len() as u64) < n {
                    return;
                }
                buf.split_to(n as usize).freeze()
            }
            Framing::Chunked => {
                let whole = chunked_whole(&buf);
                assert_eq!(
                    whole,
                    chunked_in_pieces(&buf),
                    "a chunked body decodes differently when its bytes arrive in pieces"
                );
                match whole {
                    Decoded::Body(body, used) => {
                        let _ = buf.split_to(used);
                        body
                    }
                    Decoded::More | Decoded::Refused => return,
                }
            }
        };
        if super::forwarded(&request.head) {
            forwarded_reads_back(&request, &body);
        }
        if !request.keep {
            return;
        }
    }
}

/// Checks gathered header lines: each `name: value\r\n`, a name that is a token and not one
/// the router sets or that belongs to one hop, a value without CR or LF.
fn check_lines(lines: &[u8]) {
    let mut rest = lines;
    while !rest.is_empty() {
        let end = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .expect("a gathered line ends in CRLF");
        let line = &rest[..end];
        assert!(!line.contains(&b'\n') && !line.contains(&b'\r'));
        let colon = line
            .windows(2)
            .position(|w| w == b": ")
            .expect("a gathered line is name: value");
        let name = &line[..colon];
        assert!(!name.is_empty() && name.iter().all(|b| b.is_ascii_graphic() && *b != b':'));
        assert!(
            !upstream::not_forwarded(name),
            "the line {:?} is gathered to be forwarded",
            String::from_utf8_lossy(name)
        );
        rest = &rest[end + 2..];
    }
}

/// How a chunked body decoded.
#[derive(Debug, PartialEq, Eq)]
enum Decoded {
    /// Whole: the body and the bytes its encoding took.
    Body(Bytes, usize),
    /// Not complete in the bytes there are.
    More,
    /// Refused.
    Refused,
}

/// Decodes a chunked body from all of `bytes` at once.
fn chunked_whole(bytes: &[u8]) -> Decoded {
    let mut buf = BytesMut::from(bytes);
    let mut chunk = Chunk::Size;
    let mut body = BytesMut::new();
    match decode_until_stuck(&mut chunk, &mut buf, &mut body) {
        Err(()) => Decoded::Refused,
        Ok(()) if chunk == Chunk::Done => Decoded::Body(body.freeze(), bytes.len() - buf.len()),
        Ok(()) => Decoded::More,
    }
}

/// Decodes a chunked body from `bytes` arriving in pieces (of sizes 1, 2, 3, 5, 8, ... cycling),
/// as reads from a socket bring it.
fn chunked_in_pieces(bytes: &[u8]) -> Decoded {
    const SIZES: [usize; 8] = [1, 2, 3, 5, 8, 13, 4096, 1];
    let mut buf = BytesMut::new();
    let mut chunk = Chunk::Size;
    let mut body = BytesMut::new();
    let mut fed = 0;
    let mut turn = 0;
    while fed < bytes.len() {
        let n = SIZES[turn % SIZES.len()].min(bytes.len() - fed);
        turn += 1;
        buf.extend_from_slice(&bytes[fed..fed + n]);
        fed += n;
        if decode_until_stuck(&mut chunk, &mut buf, &mut body).is_err() {
            return Decoded::Refused;
        }
        if chunk == Chunk::Done {
            return Decoded::Body(body.freeze(), fed - buf.len());
        }
    }
    Decoded::More
}

/// Runs the chunked decoder over `buf` until it needs more bytes or the body ends.
fn decode_until_stuck(
    chunk: &mut Chunk,
    buf: &mut BytesMut,
    body: &mut BytesMut,
) -> Result<(), ()> {
    loop {
        match upstream::decode_chunked(chunk, buf, true, server::REQUEST_BODY) {
            Ok(Some(data)) => {
                assert!(!data.is_empty());
                body.extend_from_slice(&data);
            }
            Ok(None) => return Ok(()),
            Err(_) => return Err(()),
        }
    }
}

/// Encodes `request` with `body` as the router sends it to an engine, reads it back with the
/// request reader and checks that it is the same request, taking exactly the bytes sent.
///
/// NB: the router adds `host` and `content-length` to the client's lines, so a head at the
/// reader's own bounds ([`upstream::MAX_HEADERS`] lines, [`MAX_HEAD`] bytes) is forwarded
/// longer than the reader takes (the engine's server has bounds of its own): such a head is
/// not read back.
fn forwarded_reads_back(request: &Incoming, body: &[u8]) {
    let mut sent = Vec::new();
    upstream::encode_head(
        &mut sent,
        &request.head,
        &HeaderValue::from_static("127.0.0.1:8000"),
        body.len(),
    );
    let head_len = sent.len();
    let lines = request.head.lines.iter().filter(|&&b| b == b'\n').count();
    if lines + 2 > upstream::MAX_HEADERS || head_len > MAX_HEAD {
        return;
    }
    sent.extend_from_slice(body);
    let mut spans = Vec::new();
    let line = match server::parse_line(&sent, &mut spans) {
        Ok(Some(line)) => line,
        Ok(None) => panic!(
            "the forwarded head {:?} is not complete",
            String::from_utf8_lossy(&sent[..head_len])
        ),
        Err(err) => panic!(
            "the forwarded head {:?} does not read back: {err}",
            String::from_utf8_lossy(&sent[..head_len])
        ),
    };
    assert_eq!(
        line.used, head_len,
        "the forwarded head is read to another end"
    );
    let head = Bytes::copy_from_slice(&sent[..head_len]);
    let mut lines = BytesMut::new();
    let again = server::incoming(&head, &line, &spans, &mut lines).unwrap_or_else(|err| {
        panic!(
            "the forwarded head {:?} is refused: {err}",
            String::from_utf8_lossy(&head)
        )
    });
    assert_eq!(again.head.method, request.head.method);
    let target = request
        .head
        .uri
        .path_and_query()
        .map_or("/", http::uri::PathAndQuery::as_str);
    assert_eq!(again.head.uri.to_string(), target);
    assert_eq!(again.head.lines, request.head.lines);
    assert_eq!(again.version, Version::HTTP_11);
    assert_eq!(again.framing, Framing::Length(body.len() as u64));
}

/// The body's `model` scan against `serde_json`: a model found is not empty, and is the
/// top-level `model` string of a body `serde_json` reads; a body `serde_json` reads as an
/// object with one `model` key, a string not empty, has that model found. Also the prompt's
/// prefix key ([`prompt_prefix`]), the other scan of the same body: see there.
pub fn model(data: &[u8]) {
    prompt_prefix(data);
    let found = super::model_of(data);
    if let Ok(model) = &found {
        assert!(!model.is_empty());
    }
    let Ok(keys) = serde_json::from_slice::<TopKeys>(data) else {
        return;
    };
    let models: Vec<&serde_json::Value> = keys
        .0
        .iter()
        .filter(|(key, _)| key == "model")
        .map(|(_, value)| value)
        .collect();
    match (models.as_slice(), &found) {
        ([serde_json::Value::String(want)], Ok(model)) => assert_eq!(model, want),
        ([serde_json::Value::String(want)], Err(_)) if !want.is_empty() => {
            panic!("the body's model {want:?} is not found")
        }
        (_, Ok(model)) => panic!("the model {model:?} is found in a body without one model"),
        _ => {}
    }
}

/// The prompt's prefix key against `serde_json`: for a body with no escape that `serde_json`
/// reads as an object whose first `prompt` or `messages` key is a `prompt` string not empty,
/// the key is the hash of that string's first `PREFIX_BYTES` bytes.
fn prompt_prefix(data: &[u8]) {
    let found = super::prompt_prefix(data);
    if data.contains(&b'\\') {
        return;
    }
    let Ok(keys) = serde_json::from_slice::<TopKeys>(data) else {
        return;
    };
    let first = keys
        .0
        .iter()
        .find(|(key, _)| key == "prompt" || key == "messages");
    if let Some((key, serde_json::Value::String(prompt))) = first
        && key == "prompt"
        && !prompt.is_empty()
    {
        let bytes = prompt.as_bytes();
        let mut want = crate::coordinator::routing::Fnv::new();
        want.write(&bytes[..bytes.len().min(crate::coordinator::routing::PREFIX_BYTES)]);
        assert_eq!(found, Some(want.finish()), "prompt {prompt:?}");
    }
}

/// A JSON object's top-level keys and values, every one (a repeated key too), in order.
struct TopKeys(Vec<(String, serde_json::Value)>);

impl<'de> serde::Deserialize<'de> for TopKeys {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = TopKeys;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<TopKeys, A::Error> {
                let mut keys = Vec::new();
                while let Some(entry) = map.next_entry::<String, serde_json::Value>()? {
                    keys.push(entry);
                }
                Ok(TopKeys(keys))
            }
        }
        deserializer.deserialize_map(Visit)
    }
}

/// An engine's answer through the response reader: heads (1xx skipped) and the body as its
/// framing says. Checks that the lines passed on hold no framing or hop-by-hop line, and runs
/// an event-stream answer's body through the event scanner ([`sse`]'s checks).
pub fn response(data: &[u8]) {
    let mut buf = BytesMut::from(data);
    let mut spans = Vec::new();
    let mut lines = BytesMut::new();
    let (engine, framing, _keep) = loop {
        match upstream::take_head(&mut buf, &mut spans, &mut lines) {
            Ok(Some(head)) if head.0.status.is_informational() => continue,
            Ok(Some(head)) => break head,
            Ok(None) | Err(_) => return,
        }
    };
    check_lines(&engine.lines);
    let body = match framing {
        upstream::Framing::Length(n) => {
            let n = usize::try_from(n).unwrap_or(usize::MAX).min(buf.len());
            buf.split_to(n).freeze()
        }
        upstream::Framing::Chunked(_) => match chunked_whole(&buf) {
            Decoded::Body(body, _) => body,
            Decoded::More | Decoded::Refused => return,
        },
        upstream::Framing::UntilClose => buf.freeze(),
    };
    if engine.event_stream {
        scan_events(&body, 4096);
    }
}

/// An engine's event stream: the first byte sets the piece bound (64 to 16 384 bytes), the
/// rest is the stream (see [`scan_events`]).
pub fn sse(data: &[u8]) {
    let Some((&bound, stream)) = data.split_first() else {
        return;
    };
    scan_events(stream, 64 << (bound % 9));
}

/// Scans `stream` for events with a piece bound of `max_piece`, whole and cut into frames of
/// several sizes: the same events (or the same oversized piece) are found however it is cut;
/// no event found is over the bound; and each event's output test agrees with its reading by
/// `serde_json::Value` on the event's data written canonically.
fn scan_events(stream: &[u8], max_piece: usize) {
    let whole = events(stream, &[stream.len().max(1)], max_piece);
    for sizes in [&[1usize][..], &[7, 1, 300], &[4096, 3]] {
        assert_eq!(
            whole,
            events(stream, sizes, max_piece),
            "the events differ when the stream is cut into frames of {sizes:?}"
        );
    }
    let (found, _) = &whole;
    let mut start = 0;
    for &end in found {
        let event = &stream[start..end];
        assert!(event.len() <= max_piece, "an event is over the piece bound");
        let output = is_output(event);
        if let Some(data) = single_data(event) {
            let canonical = serde_json::from_slice::<serde_json::Value>(data)
                .ok()
                .and_then(|value| serde_json::to_vec(&value).ok());
            if let Some(canonical) = canonical {
                let mut again = b"data: ".to_vec();
                again.extend_from_slice(&canonical);
                again.extend_from_slice(b"\n\n");
                assert_eq!(
                    is_output(&again),
                    is_output_by_value(&canonical),
                    "is_output disagrees with serde_json::Value on {:?}",
                    String::from_utf8_lossy(&again)
                );
            }
        } else {
            // No data, or several data lines.
            let datas = event
                .split(|&b| b == b'\n')
                .filter(|line| line.starts_with(b"data:"))
                .count();
            assert_eq!(output, datas > 1);
        }
        start = end;
    }
}

/// The one `data:` line of an event (its value), if it has exactly one.
fn single_data(event: &[u8]) -> Option<&[u8]> {
    let mut data = event
        .split(|&b| b == b'\n')
        .map(|line| line.strip_suffix(b"\r").unwrap_or(line))
        .filter_map(|line| line.strip_prefix(b"data:"))
        .map(|rest| rest.strip_prefix(b" ").unwrap_or(rest));
    let first = data.next()?;
    data.next().is_none().then_some(first)
}

/// The ends of the events found in `stream` cut into frames of `sizes` (cycling), and whether
/// a piece was over the bound.
fn events(stream: &[u8], sizes: &[usize], max_piece: usize) -> (Vec<usize>, Option<Oversized>) {
    let mut scanner = EventScanner::new(max_piece);
    let mut ends = Vec::new();
    let mut at = 0;
    let mut turn = 0;
    while at < stream.len() {
        let n = sizes[turn % sizes.len()].min(stream.len() - at);
        turn += 1;
        let frame = &stream[at..at + n];
        let mut from = 0;
        loop {
            match scanner.next_end(frame, from) {
                Ok(Some(end)) => {
                    assert!(end > from && end <= frame.len());
                    ends.push(at + end);
                    from = end;
                }
                Ok(None) => break,
                Err(oversized) => return (ends, Some(oversized)),
            }
        }
        at += n;
    }
    (ends, None)
}

/// The reading of `is_output` before it had types of its own: the oracle for it on whatever
/// a chunk's JSON can be (`data` is the event's one data value).
pub(crate) fn is_output_by_value(data: &[u8]) -> bool {
    fn empty(value: &serde_json::Value) -> bool {
        match value {
            serde_json::Value::Null => true,
            serde_json::Value::String(s) => s.is_empty(),
            serde_json::Value::Array(a) => a.is_empty(),
            _ => false,
        }
    }
    fn role_only(choice: &serde_json::Value) -> bool {
        let Some(choice) = choice.as_object() else {
            return false;
        };
        if !choice
            .get("finish_reason")
            .is_none_or(serde_json::Value::is_null)
        {
            return false;
        }
        if choice.get("text").is_some_and(|t| !empty(t)) {
            return false;
        }
        match choice.get("delta") {
            None => true,
            Some(serde_json::Value::Object(delta)) => delta
                .iter()
                .all(|(key, value)| key == "role" || empty(value)),
            Some(_) => false,
        }
    }
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
        return true;
    };
    let Some(choices) = value.get("choices").and_then(|c| c.as_array()) else {
        return true;
    };
    !choices.iter().all(role_only)
}
