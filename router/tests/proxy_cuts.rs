//! Requests cut short: the client hangs up (streamed or not), stops reading, a piece is too
//! large, the engine stays silent, or the deadline passes before the first output. Each stops
//! the engine's work (the simulator's `aborted` counter) and calls `Permit::cut` once.

#![allow(clippy::unwrap_used)]

mod proxy_support;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use capyctl_router::proxy::ProxyConfig;
use http::StatusCode;
use http_body_util::BodyExt;
use proxy_support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn chat(stream: bool, max_tokens: u64) -> String {
    format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Tell me about capybaras"}}],"max_tokens":{max_tokens},"stream":{stream}}}"#
    )
}

/// A whole chat request as a client writes it on the wire.
fn raw_chat(stream: bool, max_tokens: u64) -> String {
    let body = chat(stream, max_tokens);
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

fn live(record: &Record) -> usize {
    record.live.load(Ordering::SeqCst)
}

#[tokio::test]
async fn a_client_hanging_up_mid_stream_stops_the_engine() {
    let sim = start_sim(&["--sim-token-rate", "50"]).await;
    let admission = TestAdmission::new(sim);
    let record = Arc::clone(&admission.record);
    let proxy = start_proxy(admission, ProxyConfig::default()).await;

    let mut conn = Conn::open(proxy).await;
    let response = conn.post("/v1/chat/completions", &chat(true, 5000)).await;
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert!(first.is_data());
    record
        .wait("first output", |r| {
            r.first_outputs.load(Ordering::SeqCst) == 1
        })
        .await;
    drop(body);
    drop(conn);

    record
        .wait("the cut", |r| r.cut_count() == 1 && live(r) == 0)
        .await;
    assert_eq!(*record.cuts.lock().unwrap(), [true], "cut after output");
    let state = wait_sim(sim, "aborted", 1).await;
    assert_eq!(state["running"], 0, "{state}");
}

#[tokio::test]
async fn a_client_hanging_up_before_a_whole_answer_stops_the_engine() {
    let sim = start_sim(&["--sim-token-rate", "20"]).await;
    let admission = TestAdmission::new(sim);
    let record = Arc::clone(&admission.record);
    let proxy = start_proxy(admission, ProxyConfig::default()).await;

    let client = tokio::spawn(async move {
        let mut conn = Conn::open(proxy).await;
        conn.post("/v1/chat/completions", &chat(false, 5000)).await
    });
    wait_sim(sim, "running", 1).await;
    client.abort();

    record
        .wait("the cut", |r| r.cut_count() == 1 && live(r) == 0)
        .await;
    assert_eq!(*record.cuts.lock().unwrap(), [false], "cut before output");
    let state = wait_sim(sim, "aborted", 1).await;
    assert_eq!(state["running"], 0, "{state}");
    assert_eq!(state["completed"], 0, "{state}");
}

#[tokio::test]
async fn a_client_that_stops_reading_is_cut_and_its_connection_closed() {
    // As fast as possible: the buffers between the engine and the client fill at once.
    let sim = start_sim(&[]).await;
    let admission = TestAdmission::new(sim);
    let record = Arc::clone(&admission.record);
    let config = ProxyConfig {
        read_stall: Duration::from_millis(200),
        ..ProxyConfig::default()
    };
    let proxy = start_proxy(admission, config).await;

    let mut stream = tokio::net::TcpStream::connect(proxy).await.unwrap();
    stream
        .write_all(raw_chat(true, 100_000_000).as_bytes())
        .await
        .unwrap();
    // Read nothing until the proxy gives up.
    record
        .wait("the stall cut", |r| r.cut_count() == 1 && live(r) == 0)
        .await;
    assert_eq!(*record.cuts.lock().unwrap(), [true]);
    wait_sim(sim, "aborted", 1).await;

    // The connection was closed: reading drains what was buffered, then ends.
    let drained = tokio::time::timeout(PATIENCE, async {
        let mut buf = vec![0; 1 << 16];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(drained.is_ok(), "the stalled connection stays open");
}

/// Connects with a small receive buffer (as a busy client's kernel might have), sends a
/// streamed chat request for `max_tokens` and reads until the first piece of the answer.
async fn stream_with_small_receive_buffer(
    proxy: std::net::SocketAddr,
    max_tokens: u64,
) -> tokio::net::TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(proxy).await.unwrap();
    stream
        .write_all(raw_chat(true, max_tokens).as_bytes())
        .await
        .unwrap();
    let mut seen = Vec::new();
    let mut buf = vec![0; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: ") {
        let n = tokio::time::timeout(PATIENCE, stream.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "closed before the first piece");
        seen.extend_from_slice(&buf[..n]);
    }
    assert!(
        seen.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&seen)
    );
    stream
}

/// The simulator at 20 tokens a second (about 3.5 KB/s of SSE) behind a listener whose
/// 10 s read-stall bound is scaled down to `read_stall`, keeping at most 1 KiB unsent per
/// client.
async fn realistic_stream_rig(
    read_stall: Duration,
) -> (std::net::SocketAddr, Arc<Record>, std::net::SocketAddr) {
    let sim = start_sim(&["--sim-token-rate", "20"]).await;
    let admission = TestAdmission::new(sim);
    let record = Arc::clone(&admission.record);
    let config = ProxyConfig {
        read_stall,
        client_unsent_limit: 1024,
        ..ProxyConfig::default()
    };
    let proxy = start_proxy(admission, config).await;
    (sim, record, proxy)
}

#[tokio::test]
async fn a_client_that_stops_reading_a_realistic_stream_is_cut_soon_after_the_stall_bound() {
    // At a real token rate the buffers between the engine and a client with a small, fixed
    // receive buffer fill in seconds, because the listener keeps little unsent. (A client
    // whose kernel grows its receive buffer takes in megabytes first: see `conn`'s notes.)
    let (sim, record, proxy) = realistic_stream_rig(Duration::from_secs(1)).await;
    let stream = stream_with_small_receive_buffer(proxy, 4000).await;
    // From here on the client reads nothing.
    let stopped = tokio::time::Instant::now();
    record
        .wait("the stall cut", |r| r.cut_count() == 1 && live(r) == 0)
        .await;
    let took = stopped.elapsed();
    assert_eq!(*record.cuts.lock().unwrap(), [true], "cut after output");
    // Not before the bound; and within the time the buffers take to fill (a few KiB at
    // 3.5 KB/s: about 2 s here) plus the bound, with room for a loaded machine.
    assert!(took >= Duration::from_secs(1), "{took:?}");
    assert!(took < Duration::from_secs(12), "{took:?}");
    let state = wait_sim(sim, "aborted", 1).await;
    assert_eq!(state["running"], 0, "{state}");
    drop(stream);
}

#[tokio::test]
async fn a_client_that_reads_slowly_but_steadily_is_not_cut() {
    // The client takes a piece every 300 ms while the engine sends 20 a second: its buffers
    // stay full, but the socket takes bytes within the stall bound each time. Not at each
    // read: with a 4 KiB receive buffer the client's kernel opens its window again only once
    // much of it is free (receiver-side silly-window avoidance), about every 2.2 s here
    // (measured); hence a bound of 5 s (10 s in service).
    let (sim, record, proxy) = realistic_stream_rig(Duration::from_secs(5)).await;
    let mut stream = stream_with_small_receive_buffer(proxy, 60).await;
    let mut seen = Vec::new();
    let mut buf = vec![0; 512];
    while !String::from_utf8_lossy(&seen).contains("data: [DONE]") {
        // A slow reader, not a synchronisation: what is read is checked below.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let n = tokio::time::timeout(PATIENCE, stream.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(
            n > 0,
            "the stream was cut: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    record.wait("released", |r| live(r) == 0).await;
    assert_eq!(record.cut_count(), 0);
    assert_eq!(sim_state(sim).await["completed"], 1);
}

#[tokio::test]
async fn an_oversized_piece_ends_the_stream() {
    let sim = start_sim(&[
        "--sim-token-rate",
        "1000",
        "--sim-faults",
        "oversized_chunks,role_chunk",
    ])
    .await;
    let admission = TestAdmission::new(sim);
    let record = Arc::clone(&admission.record);
    let proxy = start_proxy(admission, ProxyConfig::default()).await;

    let (status, headers, body) = post(proxy, "/v1/chat/completions", &chat(true, 5000)).await;
    assert_eq!(status, StatusCode::OK);
    // The engine's own (vLLM 0.32 and engine-sim: with its charset), passed through.
    assert_eq!(headers["content-type"], "text/event-stream; charset=utf-8");
    let text = String::from_utf8_lossy(&body);
    assert!(text.starts_with("data: "), "{text}");
    assert!(
        text.contains(r#""delta":{"role":"assistant"}"#),
        "the role chunk is kept: {text}"
    );
    assert!(text.ends_with("\n\n"), "{text}");
    let last = text.trim_end().rsplit("\n\n").next().unwrap();
    let event: serde_json::Value =
        serde_json::from_str(last.strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(event["error"]["code"], "piece_too_large", "{event}");
    assert!(
        body.len() < 64 * 1024,
        "the oversized piece is not forwarded"
    );

    record
        .wait("the cut", |r| r.cut_count() == 1 && live(r) == 0)
        .await;
    assert_eq!(
        *record.cuts.lock().unwrap(),
        [true],
        "a 64 KiB piece is output"
    );
    wait_sim(sim, "aborted", 1).await;
}

#[tokio::test]
async fn an_oversized_piece_after_the_role_chunk_is_output_however_it_is_framed() {
    // An engine that sends the opening role chunk, then one 72 KiB event in 16 KiB chunks of
    // the chunked coding: the listener sees it as frames of at most 16 KiB, whose sum passes
    // the 64 KiB bound before the event ends. That is one oversized piece (output: the model
    // parks), not many small pieces held back before any output (the model would stop).
    let role = b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"},\"index\":0}]}\n\n";
    let mut event = b"data: {\"choices\":[{\"delta\":{\"content\":\"".to_vec();
    event.resize(72 * 1024, b'a');
    event.extend_from_slice(b"\"},\"index\":0}]}\n\n");
    let mut answer =
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            .to_vec();
    for chunk in std::iter::once(&role[..]).chain(event.chunks(16 * 1024)) {
        answer.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        answer.extend_from_slice(chunk);
        answer.extend_from_slice(b"\r\n");
    }
    // Sent whole: however the bytes arrive, each chunk is a frame of its own.
    let (addr, _closed) = raw_engine(answer).await;
    let admission = TestAdmission::new(addr);
    let record = Arc::clone(&admission.record);
    let proxy = start_proxy(admission, ProxyConfig::default()).await;
    let (status, _, body) = post(proxy, "/v1/chat/completions", &chat(true, 5)).await;
    assert_eq!(status, StatusCode::OK);
    let text = String::from_utf8_lossy(&body);
    assert!(text.contains(r#""role":"assistant""#), "{text}");
    assert!(text.contains("piece_too_large"), "{text}");
    record
        .wait("the cut", |r| r.cut_count() == 1 && live(r) == 0)
        .await;
    assert_eq!(
        *record.cuts.lock().unwrap(),
        [true],
        "an oversized piece is output"
    );
}

#[tokio::test]
async fn an_oversized_piece_later_in_the_stream_ends_it_too() {
    let sim = start_sim(&[]).await;
    // Completions: no role in the first piece, so pieces differ only by their words.
    let request = format!(
        r#"{{"model":"{MODEL}","prompt":"Once upon a time","max_tokens":200,"stream":true}}"#
    );
    // The answer is deterministic: find the first piece longer than every one before it, and
    // set the bound just below it.
    let (_, _, direct) = post(sim, "/v1/completions", &request).await;
    let direct = String::from_utf8_lossy(&direct).into_owned();
    let sizes: Vec<usize> = direct.split_inclusive("\n\n").map(str::len).collect();
    let record_at = (1..sizes.len())
        .find(|&k| sizes[k] > *sizes[..k].iter().max().unwrap())
        .expect("some piece is longer than all before it");
    let max_piece = sizes[record_at] - 1;

    let admission = TestAdmission::new(sim);
    let record = Arc::clone(&admission.record);
    let config = ProxyConfig {
        max_piece,
        ..ProxyConfig::default()
    };
    let proxy = start_proxy(admission, config).await;
    let (status, _, body) = post(proxy, "/v1/completions", &request).await;
    assert_eq!(status, StatusCode::OK);
    let text = String::from_utf8_lossy(&body);
    let pieces: Vec<&str> = text.split_inclusive("\n\n").collect();
    assert_eq!(pieces.len(), record_at + 1, "{text}");
    assert!(pieces[record_at].contains("piece_too_large"), "{text}");
    let expected: String = direct.split_inclusive("\n\n").take(record_at).collect();
    let got: String = pieces[..record_at].concat();
    assert_eq!(normalise(got.as_bytes()), normalise(expected.as_bytes()));
    record
        .wait("the cut", |r| r.cut_count() == 1 && live(r) == 0)
        .await;
    assert_eq!(*record.cuts.lock().unwrap(), [true]);
}

#[tokio::test]
async fn the_role_chunk_is_not_first_output() {
    // TensorFold sends the role chunk before it reads the prompt; the prefill then outlasts
    // the request deadline.
    let sim =
        start_tensorfold(&["--sim-prefill-per-token", "200ms", "--sim-token-rate", "50"]).await;
    let admission = TestAdmission::new(sim);
    let record = Arc::clone(&admission.record);
    let config = ProxyConfig {
        request_deadline: Duration::from_millis(400),
        ..ProxyConfig::default()
    };
    let proxy = start_proxy(admission, config).await;

    let (status, headers, body) = post(proxy, "/v1/chat/completions", &chat(true, 50)).await;
    assert_eq!(
        status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        String::from_utf8_lossy(&body)
    );
    assert!(headers.get("retry-after").is_none());
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        body,
        serde_json::json!({
            "code": "unavailable",
            "message": format!("deployment {DEPLOYMENT} did not become servable within the queue deadline; retry shortly"),
            "retryable": true,
        })
    );
    record
        .wait("the cut", |r| r.cut_count() == 1 && live(r) == 0)
        .await;
    assert_eq!(*record.cuts.lock().unwrap(), [false], "cut before output");
    assert_eq!(record.first_outputs.load(Ordering::SeqCst), 0);
    wait_sim(sim, "aborted", 1).await;
}

#[tokio::test]
async fn a_role_chunk_is_forwarded_with_the_first_output() {
    let sim = start_tensorfold(&["--sim-token-rate", "100"]).await;
    let admission = TestAdmission::new(sim);
    let record = Arc::clone(&admission.record);
    let proxy = start_proxy(admission, ProxyConfig::default()).await;

    let (direct_status, _, direct) = post(sim, "/v1/chat/completions", &chat(true, 8)).await;
    assert_eq!(direct_status, StatusCode::OK);
    let (status, _, body) = post(proxy, "/v1/chat/completions", &chat(true, 8)).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        String::from_utf8_lossy(&body)
            .starts_with(r#"data: {"choices":[{"delta":{"role":"assistant"}"#)
            || String::from_utf8_lossy(&body).contains(r#""delta":{"role":"assistant"}"#),
        "{}",
        String::from_utf8_lossy(&body)
    );
    assert_eq!(normalise(&body), normalise(&direct));
    record.wait("released", |r| live(r) == 0).await;
    assert_eq!(record.first_outputs.load(Ordering::SeqCst), 1);
    assert_eq!(record.cut_count(), 0);
}

#[tokio::test]
async fn the_deadline_before_a_whole_answer_is_a_503() {
    let sim = start_sim(&["--sim-token-rate", "5"]).await;
    let admission = TestAdmission::new(sim);
    let record = Arc::clone(&admission.record);
    let config = ProxyConfig {
        request_deadline: Duration::from_millis(300),
        ..ProxyConfig::default()
    };
    let proxy = start_proxy(admission, config).await;
    let (status, _, body) = post(proxy, "/v1/chat/completions", &chat(false, 50)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["code"], "unavailable");
    assert!(body["message"].as_str().unwrap().contains("queue deadline"));
    record
        .wait("the cut", |r| r.cut_count() == 1 && live(r) == 0)
        .await;
    assert_eq!(*record.cuts.lock().unwrap(), [false]);
    wait_sim(sim, "aborted", 1).await;
}

#[tokio::test]
async fn silence_after_the_first_output_ends_the_stream() {
    // Two tokens a second: 500 ms between pieces, past a 150 ms silence bound.
    let sim = start_sim(&["--sim-token-rate", "2"]).await;
    let admission = TestAdmission::new(sim);
    let record = Arc::clone(&admission.record);
    let config = ProxyConfig {
        stream_idle_timeout: Duration::from_millis(150),
        ..ProxyConfig::default()
    };
    let proxy = start_proxy(admission, config).await;
    let (status, _, body) = post(proxy, "/v1/chat/completions", &chat(true, 20)).await;
    assert_eq!(status, StatusCode::OK);
    let text = String::from_utf8_lossy(&body);
    let last = text.trim_end().rsplit("\n\n").next().unwrap();
    assert!(last.contains("stream_idle_timeout"), "{text}");
    record
        .wait("the cut", |r| r.cut_count() == 1 && live(r) == 0)
        .await;
    assert_eq!(*record.cuts.lock().unwrap(), [true]);
    wait_sim(sim, "aborted", 1).await;
}

#[tokio::test]
async fn waiting_past_the_deadline_is_the_admissions_503() {
    let sim = start_sim(&[]).await;
    let admission = TestAdmission::new(sim).with_mode(Mode::Hold);
    let config = ProxyConfig {
        request_deadline: Duration::from_millis(200),
        ..ProxyConfig::default()
    };
    let proxy = start_proxy(admission, config).await;
    let (status, _, body) = post(proxy, "/v1/chat/completions", &chat(true, 5)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert!(body["message"].as_str().unwrap().contains("queue deadline"));
}

#[tokio::test]
async fn an_admission_that_never_answers_is_the_503_one_grace_after_the_deadline() {
    let sim = start_sim(&[]).await;
    let admission = TestAdmission::new(sim).with_mode(Mode::Never);
    let record = Arc::clone(&admission.record);
    let config = ProxyConfig {
        request_deadline: Duration::from_millis(200),
        ..ProxyConfig::default()
    };
    let proxy = start_proxy(admission, config).await;
    let began = tokio::time::Instant::now();
    let (status, headers, body) = post(proxy, "/v1/chat/completions", &chat(false, 5)).await;
    let took = began.elapsed();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(headers.get("retry-after").is_none());
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["code"], "unavailable");
    assert!(body["message"].as_str().unwrap().contains("queue deadline"));
    // The deadline (200 ms) and the listener's grace (1 s) passed; never much later.
    assert!(took >= Duration::from_millis(1200), "{took:?}");
    assert!(took < PATIENCE, "{took:?}");
    // The admission's wait was given up (dropped), not left behind.
    record
        .wait("the wait dropped", |r| {
            r.abandoned_waits.load(Ordering::SeqCst) == 1
        })
        .await;
}

#[tokio::test]
async fn a_non_streamed_body_silent_past_the_idle_bound_is_cut() {
    // An engine that sends the head and part of a non-streamed body, then nothing.
    let (addr, closed_rx) = raw_engine(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"partial\":"
            .to_vec(),
    )
    .await;
    let admission = TestAdmission::new(addr);
    let record = Arc::clone(&admission.record);
    let config = ProxyConfig {
        stream_idle_timeout: Duration::from_millis(200),
        ..ProxyConfig::default()
    };
    let proxy = start_proxy(admission, config).await;
    let mut conn = Conn::open(proxy).await;
    let response = conn.post("/v1/chat/completions", &chat(false, 5)).await;
    assert_eq!(response.status(), StatusCode::OK);
    let read = tokio::time::timeout(PATIENCE, response.into_body().collect()).await;
    assert!(
        matches!(read, Ok(Err(_))),
        "the client sees the answer broken off"
    );
    record
        .wait("the cut", |r| r.cut_count() == 1 && live(r) == 0)
        .await;
    assert_eq!(*record.cuts.lock().unwrap(), [true], "cut after output");
    tokio::time::timeout(PATIENCE, closed_rx)
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn a_client_hanging_up_while_it_waits_gives_up_its_place() {
    let sim = start_sim(&[]).await;
    let admission = TestAdmission::new(sim).with_mode(Mode::Hold);
    let record = Arc::clone(&admission.record);
    let proxy = start_proxy(admission, ProxyConfig::default()).await;
    let client = tokio::spawn(async move {
        let mut conn = Conn::open(proxy).await;
        conn.post("/v1/chat/completions", &chat(true, 5)).await
    });
    record
        .wait("waiting", |r| r.entered.load(Ordering::SeqCst) == 1)
        .await;
    client.abort();
    record
        .wait("the wait dropped", |r| {
            r.abandoned_waits.load(Ordering::SeqCst) == 1
        })
        .await;
}

#[tokio::test]
async fn never_more_than_the_permit_limit_at_the_engine() {
    let sim = start_sim(&["--sim-token-rate", "100"]).await;
    let admission = TestAdmission::new(sim).with_limit(32);
    let record = Arc::clone(&admission.record);
    let proxy = start_proxy(admission, ProxyConfig::default()).await;
    let mut clients = Vec::new();
    for i in 0..40 {
        clients.push(tokio::spawn(async move {
            post(proxy, "/v1/chat/completions", &chat(i % 2 == 0, 20)).await
        }));
    }
    for client in clients {
        let (status, _, _) = client.await.unwrap();
        assert_eq!(status, StatusCode::OK);
    }
    record.wait("released", |r| live(r) == 0).await;
    assert_eq!(record.issued.load(Ordering::SeqCst), 40);
    assert_eq!(record.peak.load(Ordering::SeqCst), 32);
    assert_eq!(record.cut_count(), 0);
    let state = sim_state(sim).await;
    assert_eq!(state["completed"], 40, "{state}");
}

#[tokio::test]
async fn a_client_that_reads_nothing_of_a_large_whole_answer_is_cut_too() {
    // An engine with an 8 MiB non-streamed answer, more than every buffer between it and a
    // client with a small receive buffer that reads nothing: the listener does not hold the
    // permit for as long as the client likes.
    let size = 8 * 1024 * 1024;
    let mut answer = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {size}\r\n\r\n"
    )
    .into_bytes();
    answer.resize(answer.len() + size, b' ');
    let (addr, closed_rx) = raw_engine(answer).await;
    let admission = TestAdmission::new(addr);
    let record = Arc::clone(&admission.record);
    let config = ProxyConfig {
        read_stall: Duration::from_secs(1),
        client_unsent_limit: 1024,
        ..ProxyConfig::default()
    };
    let proxy = start_proxy(admission, config).await;
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(proxy).await.unwrap();
    stream
        .write_all(raw_chat(false, 5).as_bytes())
        .await
        .unwrap();
    // From here on the client reads nothing.
    record
        .wait("the stall cut", |r| r.cut_count() == 1 && live(r) == 0)
        .await;
    assert_eq!(*record.cuts.lock().unwrap(), [true], "cut after output");
    tokio::time::timeout(PATIENCE, closed_rx)
        .await
        .expect("the engine's connection is closed")
        .unwrap();
    drop(stream);
}
