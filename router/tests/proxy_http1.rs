//! The listener's own HTTP/1.1 server side, through raw sockets: pipelining, `Expect:
//! 100-continue`, HTTP/1.0 clients, chunked request bodies, and heads it refuses (with a 400
//! that says what is wrong, and the connection closed).

#![allow(clippy::unwrap_used)]

mod proxy_support;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;

use capyctl_router::proxy::{Proxy, ProxyConfig, serve};
use proxy_support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn chat(stream: bool) -> String {
    format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Hello"}}],"max_tokens":8,"stream":{stream}}}"#
    )
}

fn post_head(body: &str) -> String {
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
}

/// One answer as read off the wire.
#[derive(Debug)]
struct Answer {
    status: u16,
    /// Header names in lower case.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

/// A client connection that reads answers one at a time (framed by `Content-Length`,
/// chunked, or until close).
struct Raw {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Raw {
    async fn open(addr: SocketAddr) -> Raw {
        Raw {
            stream: TcpStream::connect(addr).await.unwrap(),
            buf: Vec::new(),
        }
    }

    async fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.unwrap();
    }

    /// Reads more; false at the end of the stream (or a reset).
    async fn fill(&mut self) -> bool {
        let mut chunk = [0u8; 16 * 1024];
        let n = tokio::time::timeout(PATIENCE, self.stream.read(&mut chunk))
            .await
            .expect("the listener answers")
            .unwrap_or(0);
        self.buf.extend_from_slice(&chunk[..n]);
        n > 0
    }

    async fn line(&mut self) -> String {
        loop {
            if let Some(end) = self.buf.windows(2).position(|w| w == b"\r\n") {
                let line = String::from_utf8(self.buf[..end].to_vec()).unwrap();
                self.buf.drain(..end + 2);
                return line;
            }
            assert!(self.fill().await, "closed in a line: {:?}", self.buf);
        }
    }

    async fn exactly(&mut self, n: usize) -> Vec<u8> {
        while self.buf.len() < n {
            assert!(self.fill().await, "closed in a body");
        }
        self.buf.drain(..n).collect()
    }

    async fn answer(&mut self) -> Answer {
        let status_line = self.line().await;
        let status = status_line
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("a status line: {status_line:?}"));
        let mut headers = Vec::new();
        loop {
            let line = self.line().await;
            if line.is_empty() {
                break;
            }
            let (name, value) = line.split_once(':').unwrap();
            headers.push((name.to_ascii_lowercase(), value.trim().to_string()));
        }
        let mut answer = Answer {
            status,
            headers,
            body: Vec::new(),
        };
        if status == 100 {
            return answer;
        }
        if let Some(length) = answer.header("content-length") {
            let length = length.parse().unwrap();
            answer.body = self.exactly(length).await;
        } else if answer.header("transfer-encoding") == Some("chunked") {
            loop {
                let size = usize::from_str_radix(&self.line().await, 16).unwrap();
                let data = self.exactly(size).await;
                assert_eq!(self.line().await, "");
                if size == 0 {
                    break;
                }
                answer.body.extend_from_slice(&data);
            }
        } else {
            while self.fill().await {}
            answer.body = std::mem::take(&mut self.buf);
        }
        answer
    }

    /// Whether the listener closed the connection (after what it sent was read).
    async fn closed(&mut self) -> bool {
        !self.fill().await && self.buf.is_empty()
    }
}

#[tokio::test]
async fn pipelined_requests_are_answered_in_their_order() {
    let sim = start_sim(&[]).await;
    let proxy = start_proxy(TestAdmission::new(sim), ProxyConfig::default()).await;
    let mut raw = Raw::open(proxy).await;
    let body = chat(false);
    let requests = format!(
        "GET /v1/models HTTP/1.1\r\nhost: t\r\n\r\n{}{body}GET /v1/nothing HTTP/1.1\r\nhost: t\r\n\r\n{}{body}",
        post_head(&body),
        post_head(&body),
    );
    raw.send(requests.as_bytes()).await;
    let models = raw.answer().await;
    assert_eq!(models.status, 200);
    assert_eq!(models.json()["object"], "list");
    // The listener's own answers carry a date, as the engine's do.
    assert!(models.header("date").is_some(), "{models:?}");
    let first = raw.answer().await;
    assert_eq!(first.status, 200);
    assert_eq!(first.json()["object"], "chat.completion");
    let missing = raw.answer().await;
    assert_eq!(missing.status, 404);
    assert_eq!(missing.json()["code"], "not_found");
    let second = raw.answer().await;
    assert_eq!(second.status, 200);
    assert_eq!(second.json()["object"], "chat.completion");
    assert!(second.header("connection").is_none(), "kept open");
}

#[tokio::test]
async fn expect_100_continue_is_answered_before_the_body_is_sent() {
    let sim = start_sim(&[]).await;
    let proxy = start_proxy(TestAdmission::new(sim), ProxyConfig::default()).await;
    let mut raw = Raw::open(proxy).await;
    let body = chat(false);
    let head = post_head(&body).replace("\r\n\r\n", "\r\nexpect: 100-continue\r\n\r\n");
    raw.send(head.as_bytes()).await;
    let go_on = raw.answer().await;
    assert_eq!(go_on.status, 100);
    raw.send(body.as_bytes()).await;
    let answer = raw.answer().await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.json()["object"], "chat.completion");
}

#[tokio::test]
async fn a_declared_body_over_the_bound_is_refused_before_it_is_sent() {
    let (proxy, record) = start_bounded_proxy(1024).await;
    let mut raw = Raw::open(proxy).await;
    raw.send(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 5000\r\nexpect: 100-continue\r\n\r\n",
    )
    .await;
    // No `100 Continue`: the refusal itself, and the connection ends.
    let answer = raw.answer().await;
    assert_eq!(answer.status, 413);
    assert_eq!(answer.json()["code"], "request_too_large");
    assert_eq!(answer.header("connection"), Some("close"));
    assert!(raw.closed().await);
    assert_eq!(record.entered.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_body_for_a_route_that_takes_none_is_not_asked_for() {
    let sim = start_sim(&[]).await;
    let proxy = start_proxy(TestAdmission::new(sim), ProxyConfig::default()).await;
    let mut raw = Raw::open(proxy).await;
    raw.send(
        b"POST /v1/nothing HTTP/1.1\r\nhost: t\r\ncontent-length: 5000\r\nexpect: 100-continue\r\n\r\n",
    )
    .await;
    // The 404 at once, no `100 Continue`; the body was never read, so the connection ends.
    let answer = raw.answer().await;
    assert_eq!(answer.status, 404);
    assert_eq!(answer.header("connection"), Some("close"));
    assert!(raw.closed().await);
}

#[tokio::test]
async fn empty_lines_between_requests_are_skipped() {
    let sim = start_sim(&[]).await;
    let proxy = start_proxy(TestAdmission::new(sim), ProxyConfig::default()).await;
    let mut raw = Raw::open(proxy).await;
    let body = chat(false);
    raw.send(format!("{}{body}\r\n", post_head(&body)).as_bytes())
        .await;
    assert_eq!(raw.answer().await.status, 200);
    raw.send(b"\r\nGET /v1/models HTTP/1.1\r\nhost: t\r\n\r\n")
        .await;
    assert_eq!(raw.answer().await.status, 200);
}

#[tokio::test]
async fn a_chunked_request_body_is_read_whole_however_it_arrives() {
    let sim = start_sim(&[]).await;
    let proxy = start_proxy(TestAdmission::new(sim), ProxyConfig::default()).await;
    let mut raw = Raw::open(proxy).await;
    let body = chat(false);
    let (a, b) = body.split_at(10);
    raw.send(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n",
    )
    .await;
    raw.send(format!("{:x};ext=1\r\n{a}\r\n", a.len()).as_bytes())
        .await;
    raw.send(format!("{:x}\r\n{b}\r\n0\r\nx-trailer: 1\r\n", b.len()).as_bytes())
        .await;
    raw.send(b"\r\n").await;
    let answer = raw.answer().await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.json()["object"], "chat.completion");
}

#[tokio::test]
async fn an_http_1_0_client_gets_its_answer_and_the_connection_closes() {
    let sim = start_sim(&[]).await;
    let proxy = start_proxy(TestAdmission::new(sim), ProxyConfig::default()).await;
    for streamed in [false, true] {
        let mut raw = Raw::open(proxy).await;
        let body = chat(streamed);
        let head = post_head(&body).replace("HTTP/1.1", "HTTP/1.0");
        raw.send(format!("{head}{body}").as_bytes()).await;
        let answer = raw.answer().await;
        assert_eq!(answer.status, 200, "{answer:?}");
        assert_eq!(answer.header("connection"), Some("close"));
        // Never chunked: HTTP/1.0 has no chunked coding; a stream runs until the close.
        assert!(answer.header("transfer-encoding").is_none(), "{answer:?}");
        if streamed {
            assert!(answer.body.ends_with(b"data: [DONE]\n\n"), "{answer:?}");
        } else {
            assert_eq!(answer.json()["object"], "chat.completion");
        }
        assert!(raw.closed().await);
    }
    // With keep-alive asked for, the connection stays for the next request.
    let mut raw = Raw::open(proxy).await;
    let body = chat(false);
    let head = post_head(&body)
        .replace("HTTP/1.1", "HTTP/1.0")
        .replace("\r\n\r\n", "\r\nconnection: keep-alive\r\n\r\n");
    raw.send(format!("{head}{body}").as_bytes()).await;
    let answer = raw.answer().await;
    assert_eq!(answer.header("connection"), Some("keep-alive"));
    raw.send(b"GET /v1/models HTTP/1.0\r\n\r\n").await;
    assert_eq!(raw.answer().await.status, 200);
}

#[tokio::test]
async fn a_head_that_cannot_be_read_is_a_400_that_says_why() {
    let sim = start_sim(&[]).await;
    let admission = TestAdmission::new(sim);
    let record = std::sync::Arc::clone(&admission.record);
    let proxy = start_proxy(admission, ProxyConfig::default()).await;
    let many: String = (0..101).map(|i| format!("x-h{i}: 1\r\n")).collect();
    let long = format!("x-long: {}\r\n", "a".repeat(70 * 1024));
    let cases = [
        (
            "transfer-encoding: chunked, chunked\r\n".to_string(),
            "chunked more than once",
        ),
        (
            "transfer-encoding: chunked\r\ncontent-length: 3\r\n".to_string(),
            "both Transfer-Encoding and Content-Length",
        ),
        (
            "content-length: 3\r\ncontent-length: 4\r\n".to_string(),
            "two different Content-Lengths",
        ),
        ("content-length: 3x\r\n".to_string(), "not a number"),
        (many, "more than 100 header lines"),
        (long, "longer than 64 KiB"),
        ("bad header\r\n".to_string(), "cannot be parsed"),
        ("host: u\r\n".to_string(), "more than one Host header"),
    ];
    let post = "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\n";
    let mut requests: Vec<(String, &str)> = cases
        .into_iter()
        .map(|(headers, says)| (format!("{post}{headers}\r\n"), says))
        .collect();
    requests.push((
        "POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 0\r\n\r\n".to_string(),
        "no Host header",
    ));
    requests.push((
        "POST /v1/chat/completions HTTP/1.0\r\ntransfer-encoding: chunked\r\n\r\n".to_string(),
        "HTTP/1.0 request cannot be chunked",
    ));
    for (request, says) in requests {
        let mut raw = Raw::open(proxy).await;
        raw.send(request.as_bytes()).await;
        let answer = raw.answer().await;
        assert_eq!(answer.status, 400, "{says}: {answer:?}");
        let body = answer.json();
        assert_eq!(body["code"], "invalid_request", "{says}");
        let message = body["message"].as_str().unwrap();
        assert!(message.contains(says), "{says}: {message}");
        assert_eq!(answer.header("connection"), Some("close"));
        assert!(raw.closed().await, "{says}: still open");
    }
    assert_eq!(record.entered.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn rfc_9112_refusals_a_coding_not_implemented_a_bad_chunk_size_a_long_target() {
    let sim = start_sim(&[]).await;
    let admission = TestAdmission::new(sim);
    let record = std::sync::Arc::clone(&admission.record);
    let proxy = start_proxy(admission, ProxyConfig::default()).await;
    let refused = |status: u16, code: &'static str, says: &'static str| (status, code, says);
    let post = "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\n";
    let long = "a".repeat(8 * 1024);
    let cases = [
        // RFC 9112 6.1: a transfer coding the server does not understand, before a final
        // chunked, is a 501.
        (
            format!("{post}transfer-encoding: gzip, chunked\r\n\r\n"),
            refused(
                501,
                "not_implemented",
                r#"transfer coding "gzip" is not implemented"#,
            ),
        ),
        (
            format!("{post}transfer-encoding: br\r\ntransfer-encoding: chunked\r\n\r\n"),
            refused(501, "not_implemented", r#"transfer coding "br""#),
        ),
        // RFC 9112 6.3: when chunked is not the final coding, the body's length cannot be
        // known: a 400, and the connection closed, whatever the codings are.
        (
            format!("{post}transfer-encoding: gzip\r\n\r\n"),
            refused(400, "invalid_request", "does not end in chunked"),
        ),
        (
            format!("{post}transfer-encoding: chunked, identity\r\n\r\n"),
            refused(400, "invalid_request", "does not end in chunked"),
        ),
        (
            format!("{post}transfer-encoding: xchunked\r\n\r\n"),
            refused(400, "invalid_request", "does not end in chunked"),
        ),
        (
            format!("{post}transfer-encoding: \"chunked\"\r\n\r\n"),
            refused(400, "invalid_request", "does not end in chunked"),
        ),
        (
            format!("{post}transfer-encoding: chunked\r\ntransfer-encoding: identity\r\n\r\n"),
            refused(400, "invalid_request", "does not end in chunked"),
        ),
        (
            format!("{post}transfer-encoding: chunked\r\ntransfer-encoding: br\r\n\r\n"),
            refused(400, "invalid_request", "does not end in chunked"),
        ),
        // RFC 9112 7.1: after the size, only an extension (`;`).
        (
            format!("{post}transfer-encoding: chunked\r\n\r\n5x\r\nhello\r\n0\r\n\r\n"),
            refused(400, "invalid_request", "a bad chunk size"),
        ),
        (
            format!("{post}transfer-encoding: chunked\r\n\r\n5 junk\r\nhello\r\n0\r\n\r\n"),
            refused(400, "invalid_request", "a bad chunk size"),
        ),
        // RFC 9112 3: a target over 8 KiB is a 414, whole or still arriving.
        (
            format!("GET /{long} HTTP/1.1\r\nhost: t\r\n\r\n"),
            refused(414, "uri_too_long", "longer than 8192 bytes"),
        ),
        (
            format!("POST /v1/chat/completions?q={long}"),
            refused(414, "uri_too_long", "longer than 8192 bytes"),
        ),
    ];
    for (request, (status, code, says)) in cases {
        let mut raw = Raw::open(proxy).await;
        raw.send(request.as_bytes()).await;
        let answer = raw.answer().await;
        assert_eq!(answer.status, status, "{says}: {answer:?}");
        let body = answer.json();
        assert_eq!(body["code"], code, "{says}");
        assert_eq!(body["retryable"], false, "{says}");
        let message = body["message"].as_str().unwrap();
        assert!(message.contains(says), "{says}: {message}");
        assert_eq!(answer.header("connection"), Some("close"), "{says}");
        assert!(raw.closed().await, "{says}: still open");
    }
    assert_eq!(record.entered.load(Ordering::SeqCst), 0);

    // At the bound itself: read, and answered as any request (here a 404 of the route), and
    // a chunk size with whitespace before its end or its extension is a size.
    let mut raw = Raw::open(proxy).await;
    let target = format!("/{}", "a".repeat(8 * 1024 - 1));
    raw.send(format!("GET {target} HTTP/1.1\r\nhost: t\r\n\r\n").as_bytes())
        .await;
    assert_eq!(raw.answer().await.status, 404);
    let body = chat(false);
    let (a, b) = body.split_at(10);
    raw.send(
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n{:x} \r\n{a}\r\n{:x}\t;x=1\r\n{b}\r\n0\r\n\r\n",
            a.len(),
            b.len()
        )
        .as_bytes(),
    )
    .await;
    let answer = raw.answer().await;
    assert_eq!(answer.status, 200, "{answer:?}");
}

/// A listener in front of `admission` whose bodies share a budget of `limit` bytes; the
/// listener itself, to read what its bodies hold.
async fn budget_proxy(admission: TestAdmission, limit: u64) -> (SocketAddr, Proxy<TestAdmission>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = ProxyConfig {
        max_buffered_bytes_total: limit,
        ..ProxyConfig::default()
    };
    let proxy = Proxy::new(admission, catalog, config);
    tokio::spawn(serve(listener, proxy.clone(), std::future::pending()));
    (addr, proxy)
}

/// Waits until the listener's bodies hold `bytes`.
async fn until_held(proxy: &Proxy<TestAdmission>, bytes: u64) {
    let end = tokio::time::Instant::now() + PATIENCE;
    while proxy.buffered_bytes() != bytes {
        assert!(
            tokio::time::Instant::now() < end,
            "bodies hold {} bytes, not {bytes}",
            proxy.buffered_bytes()
        );
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
}

const KIB: usize = 1024;

/// A chat body of exactly `len` bytes.
fn chat_of(len: usize) -> String {
    let empty = chat(false).replace("Hello", "");
    chat(false).replace("Hello", &"a".repeat(len - empty.len()))
}

/// A head declaring a body of `len` bytes.
fn head_of(len: usize, more: &str) -> String {
    format!("POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\n{more}content-length: {len}\r\n\r\n")
}

fn expect_refusal(answer: &Answer, status: u16, message: &str) {
    assert_eq!(answer.status, status, "{answer:?}");
    let body = answer.json();
    assert_eq!(
        body["code"],
        if status == 429 {
            "queue_full"
        } else {
            "request_too_large"
        }
    );
    assert_eq!(body["message"], message);
    assert_eq!(
        answer.header("retry-after"),
        (status == 429).then_some("1"),
        "{answer:?}"
    );
    assert_eq!(answer.header("connection"), Some("close"));
}

#[tokio::test]
async fn bodies_being_read_share_one_budget_and_the_ones_that_do_not_fit_are_refused_at_once() {
    let sim = start_sim(&[]).await;
    let admission = TestAdmission::new(sim);
    let record = std::sync::Arc::clone(&admission.record);
    let (addr, proxy) = budget_proxy(admission, 1024 * KIB as u64).await;
    let full = "waiting requests exceed the buffered-bytes bound";

    // Two clients send most of 400 KiB bodies, then stall: each holds its buffer, which has
    // grown to the declared length.
    let mut slow = Vec::new();
    for i in 1..=2 {
        let mut raw = Raw::open(addr).await;
        raw.send(head_of(400 * KIB, "").as_bytes()).await;
        raw.send(&chat_of(400 * KIB).as_bytes()[..300 * KIB]).await;
        until_held(&proxy, (i * 400 * KIB) as u64).await;
        slow.push(raw);
    }
    // A third does not fit: refused before `100 Continue`, without a byte of it read.
    let mut third = Raw::open(addr).await;
    third
        .send(head_of(400 * KIB, "expect: 100-continue\r\n").as_bytes())
        .await;
    expect_refusal(&third.answer().await, 429, full);
    assert!(third.closed().await);
    // One that could never fit, whatever the others do: 413.
    let mut huge = Raw::open(addr).await;
    huge.send(head_of(2048 * KIB, "").as_bytes()).await;
    expect_refusal(
        &huge.answer().await,
        413,
        "request body exceeds the buffered-bytes bound of 1048576 bytes",
    );
    // A chunked one holds its buffer as it grows, and is refused once that passes what is
    // left (224 KiB), while it is still being sent.
    let mut chunked = Raw::open(addr).await;
    chunked
        .send(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n",
        )
        .await;
    let piece = "a".repeat(32 * KIB);
    for _ in 0..8 {
        chunked
            .send(format!("{:x}\r\n{piece}\r\n", piece.len()).as_bytes())
            .await;
    }
    expect_refusal(&chunked.answer().await, 429, full);
    assert!(chunked.closed().await);
    until_held(&proxy, (800 * KIB) as u64).await;
    assert_eq!(record.entered.load(Ordering::SeqCst), 0);

    // The slow clients go away mid-body: everything is given back.
    drop(slow);
    until_held(&proxy, 0).await;
    // And a body as large as the bound alone fits again, is forwarded and then given back.
    let mut whole = Raw::open(addr).await;
    let body = chat_of(1024 * KIB);
    whole
        .send(format!("{}{body}", head_of(body.len(), "")).as_bytes())
        .await;
    let answer = whole.answer().await;
    assert!(![413, 429].contains(&answer.status), "{answer:?}");
    assert_eq!(record.entered.load(Ordering::SeqCst), 1);
    until_held(&proxy, 0).await;
}

/// A client that declares a large body and sends little or nothing of it holds only what it
/// sent: it cannot have every other body refused for as long as its deadline runs.
#[tokio::test]
async fn a_declared_body_holds_only_what_has_arrived() {
    let sim = start_sim(&[]).await;
    let admission = TestAdmission::new(sim);
    let record = std::sync::Arc::clone(&admission.record);
    let (addr, proxy) = budget_proxy(admission, 1024 * KIB as u64).await;
    let mut idle = Raw::open(addr).await;
    idle.send(head_of(1000 * KIB, "").as_bytes()).await;
    let mut trickle = Raw::open(addr).await;
    trickle.send(head_of(1000 * KIB, "").as_bytes()).await;
    trickle
        .send(&chat_of(1000 * KIB).as_bytes()[..20 * KIB])
        .await;
    until_held(&proxy, (32 * KIB) as u64).await;
    // Another body is read and forwarded meanwhile.
    let mut other = Raw::open(addr).await;
    let body = chat_of(600 * KIB);
    other
        .send(format!("{}{body}", head_of(body.len(), "")).as_bytes())
        .await;
    let answer = other.answer().await;
    assert!(![413, 429].contains(&answer.status), "{answer:?}");
    assert_eq!(record.entered.load(Ordering::SeqCst), 1);
    until_held(&proxy, (32 * KIB) as u64).await;
    drop((idle, trickle));
    until_held(&proxy, 0).await;
}

#[tokio::test]
async fn a_waiting_body_holds_its_part_of_the_budget_until_its_request_ends() {
    let sim = start_sim(&[]).await;
    let admission = TestAdmission::new(sim).with_mode(Mode::Never);
    let (addr, proxy) = budget_proxy(admission, 1024 * KIB as u64).await;
    // Read whole, and waiting for its admission (which never comes).
    let mut waiting = Raw::open(addr).await;
    let body = chat_of(700 * KIB);
    waiting
        .send(format!("{}{body}", head_of(body.len(), "")).as_bytes())
        .await;
    until_held(&proxy, (700 * KIB) as u64).await;
    // The same budget: a body that fits beside it is read, one that does not is refused.
    let mut refused = Raw::open(addr).await;
    refused.send(head_of(400 * KIB, "").as_bytes()).await;
    expect_refusal(
        &refused.answer().await,
        429,
        "waiting requests exceed the buffered-bytes bound",
    );
    // The waiting client hangs up: its body is given back.
    drop(waiting);
    until_held(&proxy, 0).await;
    let mut fits = Raw::open(addr).await;
    let body = chat_of(400 * KIB);
    fits.send(format!("{}{body}", head_of(body.len(), "")).as_bytes())
        .await;
    until_held(&proxy, (400 * KIB) as u64).await;
}

/// An engine that takes one request, sends its head (as it came) to the receiver, and
/// answers it with `answer`.
async fn recording_engine(
    answer: &'static str,
) -> (SocketAddr, tokio::sync::oneshot::Receiver<String>) {
    let engine = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = engine.local_addr().unwrap();
    let (head_tx, head_rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (mut socket, _) = engine.accept().await.unwrap();
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        let end = loop {
            if let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
                break end;
            }
            let n = socket.read(&mut buf).await.unwrap();
            assert!(n > 0, "the head is sent whole");
            seen.extend_from_slice(&buf[..n]);
        };
        let _ = head_tx.send(String::from_utf8(seen[..end + 2].to_vec()).unwrap());
        socket.write_all(answer.as_bytes()).await.unwrap();
        while socket.read(&mut buf).await.is_ok_and(|n| n > 0) {}
    });
    (addr, head_rx)
}

#[tokio::test]
async fn only_end_to_end_headers_pass_the_router_as_they_were_sent() {
    let (engine, head) = recording_engine(
        "HTTP/1.1 200 OK\r\n\
         Content-Type: application/json\r\n\
         X-Engine: e-1\r\n\
         Connection: keep-alive, X-Engine-Hop\r\n\
         X-Engine-Hop: 1\r\n\
         Keep-Alive: timeout=5\r\n\
         Date: Thu, 03 Dec 2026 00:00:00 GMT\r\n\
         Content-Length: 11\r\n\r\n{\"ok\":true}",
    )
    .await;
    let proxy = start_proxy(TestAdmission::new(engine), ProxyConfig::default()).await;
    let body = chat(false);
    let request = format!(
        "POST http://client.example/v1/chat/completions?trace=1 HTTP/1.1\r\n\
         Host: client.example\r\n\
         Content-Type: application/json\r\n\
         Authorization: Bearer k-1\r\n\
         Connection: keep-alive, X-Drop-Me\r\n\
         X-Drop-Me: 1\r\n\
         x-drop-me: 2\r\n\
         X-Request-Id:   r-1  \r\n\
         Keep-Alive: timeout=5\r\n\
         Proxy-Connection: keep-alive\r\n\
         TE: trailers\r\n\
         Trailer: x-t\r\n\
         Upgrade: h2c\r\n\
         Proxy-Authorization: Basic eA==\r\n\
         Expect: 100-continue\r\n\
         Content-Length: {}\r\n\
         X-Last: z\r\n\r\n{body}",
        body.len()
    );
    let mut raw = Raw::open(proxy).await;
    raw.send(request.as_bytes()).await;
    let mut answer = raw.answer().await;
    if answer.status == 100 {
        answer = raw.answer().await;
    }
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.body, b"{\"ok\":true}");
    let names: Vec<&str> = answer.headers.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        ["content-type", "x-engine", "date", "content-length"],
        "the engine's end-to-end headers, then the router's length; the engine's Date kept"
    );
    assert_eq!(answer.header("date"), Some("Thu, 03 Dec 2026 00:00:00 GMT"));
    assert_eq!(answer.header("content-length"), Some("11"));
    let head = head.await.unwrap();
    assert_eq!(
        head,
        format!(
            "POST /v1/chat/completions?trace=1 HTTP/1.1\r\n\
             host: {engine}\r\n\
             Content-Type: application/json\r\n\
             Authorization: Bearer k-1\r\n\
             X-Request-Id: r-1\r\n\
             X-Last: z\r\n\
             content-length: {}\r\n",
            body.len()
        ),
        "the request line in origin form, the engine's Host, the end-to-end headers in \
         their order and spelling, the router's own length; none of one hop, nor those \
         Connection names"
    );
}
