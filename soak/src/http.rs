//! A small HTTP/1.1 client over a raw TCP socket, so that the soak controls every byte: it can
//! hang up at any moment, stop reading (a stalled reader), and see exactly what the server sent,
//! including anything after the end of an answer (an answer ended twice).
//!
//! One request per connection, with `Connection: close` or without (then the connection stays
//! open after the answer); the answer's end is found from its framing (`Content-Length` or the
//! last chunk), then the socket is read a little longer for extra bytes.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// What the client does besides reading the answer.
#[derive(Clone, Copy, Debug)]
pub enum Client {
    /// Reads the whole answer.
    Reads,
    /// Hangs up this long after sending, unless output came first (before output, or while
    /// the request waits for a switch).
    HangsUpAfter(Duration),
    /// Hangs up right after the first output (mid-stream, or mid-answer when not streamed).
    HangsUpMidAnswer,
    /// Stops reading for this long after the first output, then reads on.
    Stalls(Duration),
}

/// How an exchange ended, seen from the client.
#[derive(Debug)]
pub enum Raw {
    /// No connection (CapyCTL down).
    ConnectFailed(String),
    /// The client hung up as planned; `output` when it had seen output.
    HungUp {
        /// Whether any output had arrived.
        output: bool,
    },
    /// The answer's framing was complete; `extra` is what the server sent after it.
    Complete {
        /// The response as received, head and body (chunked coding still on).
        bytes: Vec<u8>,
        /// Bytes after the end of the answer.
        extra: Vec<u8>,
    },
    /// The server closed (or reset) before the answer's framing was complete.
    Broken {
        /// What arrived.
        bytes: Vec<u8>,
        /// The read error, when it was not a plain close.
        error: Option<String>,
    },
}

/// A parsed response.
#[derive(Debug, Default)]
pub struct Response {
    /// The status code.
    pub status: u16,
    /// Header names in lowercase, values trimmed.
    pub headers: Vec<(String, String)>,
    /// The body with the chunked coding removed (as much as arrived).
    pub body: Vec<u8>,
    /// Whether the framing ended (Content-Length reached, last chunk seen).
    pub complete: bool,
}

impl Response {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Parses what arrived; `None` while the head is incomplete. The second value is the length of
/// the response once its framing is complete (bytes past it are extra).
pub fn parse(bytes: &[u8]) -> Option<(Response, Option<usize>)> {
    let head_end = bytes.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = String::from_utf8_lossy(&bytes[..head_end]);
    let mut lines = head.split("\r\n");
    let status: u16 = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let mut r = Response {
        status,
        headers,
        ..Response::default()
    };
    let rest = &bytes[head_end..];
    let chunked = r
        .header("transfer-encoding")
        .is_some_and(|v| v.eq_ignore_ascii_case("chunked"));
    if chunked {
        let (body, end) = dechunk(rest);
        r.body = body;
        r.complete = end.is_some();
        Some((r, end.map(|e| head_end + e)))
    } else if let Some(len) = r
        .header("content-length")
        .and_then(|v| v.parse::<usize>().ok())
    {
        let have = rest.len().min(len);
        r.body = rest[..have].to_vec();
        r.complete = have == len;
        let end = r.complete.then_some(head_end + len);
        Some((r, end))
    } else {
        // Close-delimited: complete only at the close (the caller decides).
        r.body = rest.to_vec();
        Some((r, None))
    }
}

/// The data of a chunked body so far, and the offset just past its last chunk once it arrived.
fn dechunk(mut rest: &[u8]) -> (Vec<u8>, Option<usize>) {
    let total = rest.len();
    let mut out = Vec::new();
    loop {
        let Some(line_end) = rest.windows(2).position(|w| w == b"\r\n") else {
            return (out, None);
        };
        let line = String::from_utf8_lossy(&rest[..line_end]);
        let size = line.split(';').next().unwrap_or("").trim();
        let Ok(size) = usize::from_str_radix(size, 16) else {
            return (out, None);
        };
        let data = &rest[line_end + 2..];
        if size == 0 {
            // The last chunk, then an empty line (after trailers, if any).
            if data.starts_with(b"\r\n") {
                return (out, Some(total - data.len() + 2));
            }
            let t = data.windows(4).position(|w| w == b"\r\n\r\n");
            return (out, t.map(|t| total - data.len() + t + 4));
        }
        if data.len() < size + 2 {
            out.extend_from_slice(&data[..data.len().min(size)]);
            return (out, None);
        }
        out.extend_from_slice(&data[..size]);
        rest = &data[size + 2..];
    }
}

/// Whether a response so far carries output: a 200 with any body byte (a streamed answer's head
/// goes out with its first real output).
fn has_output(bytes: &[u8]) -> bool {
    parse(bytes).is_some_and(|(r, _)| r.status == 200 && !r.body.is_empty())
}

/// Sends one POST with `body` to `addr` and reads the answer as `client` says. The caller
/// bounds the whole exchange with its deadline.
pub async fn exchange(
    addr: SocketAddr,
    path: &str,
    body: &[u8],
    client: Client,
    close: bool,
) -> Raw {
    let mut stream = match TcpStream::connect(addr).await {
        Ok(s) => s,
        Err(e) => return Raw::ConnectFailed(e.to_string()),
    };
    let _ = stream.set_nodelay(true);
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{}\r\n",
        body.len(),
        if close { "Connection: close\r\n" } else { "" }
    );
    let mut request = head.into_bytes();
    request.extend_from_slice(body);
    if let Err(e) = stream.write_all(&request).await {
        return Raw::Broken {
            bytes: Vec::new(),
            error: Some(format!("write: {e}")),
        };
    }
    let hang_up_at = match client {
        Client::HangsUpAfter(d) => Some(tokio::time::Instant::now() + d),
        _ => None,
    };
    let mut bytes = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    let mut stalled = false;
    loop {
        let output = has_output(&bytes);
        if output {
            match client {
                Client::HangsUpMidAnswer => return Raw::HungUp { output: true },
                Client::Stalls(d) if !stalled => {
                    stalled = true;
                    tokio::time::sleep(d).await;
                }
                _ => {}
            }
        }
        if let Some((_, Some(end))) = parse(&bytes) {
            // Complete: anything more, within a moment, is an answer ended twice.
            let mut extra = bytes.split_off(end);
            let more = tokio::time::timeout(Duration::from_millis(300), async {
                let mut tail = Vec::new();
                let _ = stream.read_to_end(&mut tail).await;
                tail
            })
            .await
            .unwrap_or_default();
            extra.extend_from_slice(&more);
            return Raw::Complete { bytes, extra };
        }
        let read = match hang_up_at {
            Some(at) if !output => match tokio::time::timeout_at(at, stream.read(&mut buf)).await {
                Ok(r) => r,
                Err(_) => return Raw::HungUp { output: false },
            },
            _ => stream.read(&mut buf).await,
        };
        match read {
            Ok(0) => {
                // A close-delimited answer ends at the close.
                if let Some((r, None)) = parse(&bytes)
                    && r.header("content-length").is_none()
                    && r.header("transfer-encoding").is_none()
                {
                    return Raw::Complete {
                        bytes,
                        extra: Vec::new(),
                    };
                }
                return Raw::Broken { bytes, error: None };
            }
            Ok(n) => bytes.extend_from_slice(&buf[..n]),
            Err(e) => {
                return Raw::Broken {
                    bytes,
                    error: Some(e.to_string()),
                };
            }
        }
    }
}

/// What a streamed body says: the text of its chunks, how many `[DONE]`s, the error events'
/// codes, and whether anything came after the first `[DONE]`.
#[derive(Debug, Default)]
pub struct Sse {
    /// The text of every chunk, in order.
    pub text: String,
    /// `data: [DONE]` events.
    pub done: usize,
    /// The `code` of every error event.
    pub errors: Vec<String>,
    /// Events after the first `[DONE]`.
    pub after_done: usize,
    /// Lines that are neither JSON nor `[DONE]`.
    pub garbage: usize,
}

/// Reads the SSE events of a streamed body (`data: ...` lines).
pub fn sse(body: &[u8]) -> Sse {
    let mut s = Sse::default();
    let text = String::from_utf8_lossy(body);
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data:") else {
            continue;
        };
        let data = data.trim();
        if s.done > 0 {
            s.after_done += 1;
        }
        if data == "[DONE]" {
            s.done += 1;
            continue;
        }
        let Ok(v) = serde_json::from_str::<serde_json::Value>(data) else {
            s.garbage += 1;
            continue;
        };
        if let Some(e) = v.get("error") {
            s.errors.push(
                e.get("code")
                    .and_then(|c| c.as_str())
                    .unwrap_or("?")
                    .to_owned(),
            );
            continue;
        }
        if let Some(choice) = v.get("choices").and_then(|c| c.get(0)) {
            let piece = choice
                .get("delta")
                .and_then(|d| d.get("content"))
                .or_else(|| choice.get("text"))
                .and_then(|t| t.as_str());
            if let Some(piece) = piece {
                s.text.push_str(piece);
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn chunked_framing_and_extra() {
        let r = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\nHTTP";
        let (resp, end) = parse(r).unwrap();
        assert_eq!(resp.body, b"hello");
        assert!(resp.complete);
        assert_eq!(&r[end.unwrap()..], b"HTTP");
        let (resp, end) = parse(&r[..r.len() - 8]).unwrap();
        assert!(!resp.complete && end.is_none());
    }

    #[test]
    fn content_length_framing() {
        let r = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 2\r\n\r\n{}";
        let (resp, end) = parse(r).unwrap();
        assert_eq!(
            (resp.status, resp.complete, end),
            (503, true, Some(r.len()))
        );
        assert!(parse(b"HTTP/1.1 200 OK\r\n").is_none());
    }

    #[test]
    fn sse_events() {
        let body = b"data: {\"choices\":[{\"delta\":{\"content\":\"a b\"}}]}\n\ndata: {\"error\":{\"code\":\"upstream_failed\"}}\n\ndata: [DONE]\n\ndata: [DONE]\n\n";
        let s = sse(body);
        assert_eq!(s.text, "a b");
        assert_eq!(s.errors, ["upstream_failed"]);
        assert_eq!((s.done, s.after_done), (2, 1));
    }
}
