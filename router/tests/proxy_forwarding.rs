//! The listener forwards by `model` and answers byte for byte what the engine answers; its own
//! errors have the catalogue's status, body and headers.

#![allow(clippy::unwrap_used)]

mod proxy_support;

use capyctl_router::proxy::ProxyConfig;
use capyctl_spec::errors::ApiError;
use http::StatusCode;
use proxy_support::*;

fn chat(stream: bool) -> String {
    format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Tell me about capybaras"}}],"max_tokens":24,"stream":{stream}}}"#
    )
}

fn completion(stream: bool) -> String {
    format!(
        r#"{{"model":"{MODEL}","prompt":"Once upon a time","max_tokens":16,"stream":{stream}}}"#
    )
}

fn embedding() -> String {
    format!(r#"{{"model":"{MODEL}","input":["a capybara","two capybaras"]}}"#)
}

#[tokio::test]
async fn answers_are_the_engines_byte_for_byte() {
    let sim = start_sim(&[]).await;
    let admission = TestAdmission::new(sim);
    let record = std::sync::Arc::clone(&admission.record);
    let proxy = start_proxy(admission, ProxyConfig::default()).await;

    let cases = [
        ("/v1/chat/completions", chat(false), false),
        ("/v1/chat/completions", chat(true), true),
        ("/v1/completions", completion(false), false),
        ("/v1/completions", completion(true), true),
        ("/v1/embeddings", embedding(), false),
    ];
    for (path, body, streamed) in &cases {
        let (direct_status, direct_headers, direct) = post(sim, path, body).await;
        let (status, headers, routed) = post(proxy, path, body).await;
        assert_eq!(status, direct_status, "{path}");
        assert_eq!(status, StatusCode::OK, "{path}");
        assert_eq!(
            headers.get("content-type"),
            direct_headers.get("content-type"),
            "{path}"
        );
        if *streamed {
            assert!(routed.ends_with(b"data: [DONE]\n\n"), "{path}");
        }
        assert_eq!(normalise(&routed), normalise(&direct), "{path} {body}");
        if path.contains("embeddings") {
            assert_eq!(routed, direct, "embeddings are deterministic to the byte");
        }
    }
    record
        .wait("every permit released", |r| {
            r.live.load(std::sync::atomic::Ordering::SeqCst) == 0
        })
        .await;
    assert_eq!(
        record.issued.load(std::sync::atomic::Ordering::SeqCst),
        cases.len()
    );
    assert_eq!(
        record
            .first_outputs
            .load(std::sync::atomic::Ordering::SeqCst),
        cases.len()
    );
    assert_eq!(record.cut_count(), 0);
    let state = sim_state(sim).await;
    assert_eq!(state["aborted"], 0, "{state}");
}

/// An engine that has sent a long stream before the listener reads any of it: the listener
/// gathers what waits into frames of up to 16 KiB, and a chunk of the engine's that would take
/// one past that begins the next one instead. Every byte passes, in order, whatever the
/// engine's chunks (small, splitting events, or larger than 16 KiB).
#[tokio::test]
async fn a_long_stream_already_sent_passes_whole_in_any_chunks() {
    let mut stream =
        b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"},\"index\":0}]}\n\n".to_vec();
    for i in 0..1500 {
        let text = "capybara ".repeat(i % 13);
        stream.extend_from_slice(
            format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"{i} {text}\"}},\"index\":0}}]}}\n\n")
                .as_bytes(),
        );
    }
    stream.extend_from_slice(b"data: [DONE]\n\n");
    let mut answer =
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            .to_vec();
    // Chunks of 1 byte to 20 KiB, in a fixed order.
    let sizes = [
        1, 700, 5_000, 96, 20_000, 3_333, 16_384, 15_000, 2_047, 9_000,
    ];
    let (mut at, mut n) = (0, 0);
    while at < stream.len() {
        let end = stream.len().min(at + sizes[n % sizes.len()]);
        answer.extend_from_slice(format!("{:x}\r\n", end - at).as_bytes());
        answer.extend_from_slice(&stream[at..end]);
        answer.extend_from_slice(b"\r\n");
        (at, n) = (end, n + 1);
    }
    answer.extend_from_slice(b"0\r\n\r\n");
    assert!(stream.len() > 100 * 1024);
    let (addr, _closed) = raw_engine(answer).await;
    let proxy = start_proxy(TestAdmission::new(addr), ProxyConfig::default()).await;
    let (status, _, body) = post(proxy, "/v1/chat/completions", &chat(true)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body.len(), stream.len());
    assert!(body == stream, "the stream passes byte for byte");
}

#[tokio::test]
async fn one_keep_alive_connection_carries_many_requests() {
    let sim = start_sim(&[]).await;
    let proxy = start_proxy(TestAdmission::new(sim), ProxyConfig::default()).await;
    let mut conn = Conn::open(proxy).await;
    for i in 0..20 {
        let body = if i % 2 == 0 { chat(false) } else { chat(true) };
        let response = conn.post("/v1/chat/completions", &body).await;
        assert_eq!(response.status(), StatusCode::OK);
        let bytes = http_body_util::BodyExt::collect(response.into_body())
            .await
            .unwrap()
            .to_bytes();
        assert!(!bytes.is_empty());
    }
}

#[tokio::test]
async fn models_lists_every_deployment_with_its_state() {
    let sim = start_sim(&[]).await;
    let proxy = start_proxy(TestAdmission::new(sim), ProxyConfig::default()).await;
    let (status, body) = get(proxy, "/v1/models").await;
    assert_eq!(status, StatusCode::OK);
    let list: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(list["object"], "list");
    assert_eq!(list["data"][0]["id"], MODEL);
    assert_eq!(list["data"][0]["object"], "model");
    assert_eq!(list["data"][0]["deployment_id"], DEPLOYMENT);
    assert_eq!(list["data"][0]["state"], "ready");
}

fn error_body(body: &[u8]) -> serde_json::Value {
    let value: serde_json::Value = serde_json::from_slice(body).unwrap();
    let keys: Vec<&String> = value.as_object().unwrap().keys().collect();
    assert_eq!(keys, ["code", "message", "retryable"], "{value}");
    value
}

#[tokio::test]
async fn bad_requests_get_their_catalogue_errors() {
    let (proxy, record) = start_bounded_proxy(1024).await;

    let (status, _, body) = post(proxy, "/v1/chat/completions", "not json").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let body = error_body(&body);
    assert_eq!(body["code"], "invalid_request");
    assert_eq!(body["retryable"], false);
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("not a JSON object"),
        "{body}"
    );

    let (status, _, body) = post(proxy, "/v1/chat/completions", r#"{"model":"#).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        error_body(&body)["message"]
            .as_str()
            .unwrap()
            .contains("not valid JSON")
    );

    let (status, _, body) = post(proxy, "/v1/completions", r#"{"prompt":"hi"}"#).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let body = error_body(&body);
    assert_eq!(body["message"], "the body has no `model`");

    let (status, _, body) = post(proxy, "/v1/embeddings", r#"{"model":["x"]}"#).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        error_body(&body)["message"]
            .as_str()
            .unwrap()
            .contains("must be a string")
    );

    let (status, _, body) = post(proxy, "/v1/chat/completions", r#"{"model":"chat-z"}"#).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let body = error_body(&body);
    assert_eq!(
        body,
        serde_json::json!({"code":"model_not_found","message":"model chat-z is not deployed","retryable":false})
    );

    let big = format!(r#"{{"model":"{MODEL}","prompt":"{}"}}"#, "x".repeat(2000));
    let (status, _, body) = post(proxy, "/v1/completions", &big).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    let body = error_body(&body);
    assert_eq!(body["code"], "request_too_large");
    assert_eq!(
        body["message"],
        "request body exceeds the buffered-bytes bound of 1024 bytes"
    );

    let (status, _, body) = post(proxy, "/v1/nothing", "{}").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(error_body(&body)["code"], "not_found");

    let (status, _) = get(proxy, "/v1/chat/completions").await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);

    assert_eq!(record.issued.load(std::sync::atomic::Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_chunked_body_over_the_bound_is_refused_too() {
    let (proxy, _) = start_bounded_proxy(1024).await;
    // No content-length: the bound is found while reading.
    let stream = tokio::net::TcpStream::connect(proxy).await.unwrap();
    let (mut read, mut write) = stream.into_split();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let chunk = "x".repeat(600);
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{chunk}\r\n{:x}\r\n{chunk}\r\n0\r\n\r\n",
        chunk.len(),
        chunk.len()
    );
    write.write_all(request.as_bytes()).await.unwrap();
    let mut answer = vec![0; 4096];
    let n = read.read(&mut answer).await.unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("request_too_large"), "{answer}");
}

#[tokio::test]
async fn admission_errors_render_with_retry_after_on_429() {
    let sim = start_sim(&[]).await;
    let refused = ApiError::TooManyWaiting {
        deployment: DEPLOYMENT.to_string(),
    };
    let proxy = start_proxy(
        TestAdmission::new(sim).with_mode(Mode::Refuse(refused.clone())),
        ProxyConfig::default(),
    )
    .await;
    let (status, headers, body) = post(proxy, "/v1/chat/completions", &chat(false)).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(headers["retry-after"], "1");
    assert_eq!(headers["content-type"], "application/json");
    assert_eq!(error_body(&body), refused.body());

    let closed = ApiError::DispatchClosed {
        deployment: DEPLOYMENT.to_string(),
    };
    let proxy = start_proxy(
        TestAdmission::new(sim).with_mode(Mode::Refuse(closed.clone())),
        ProxyConfig::default(),
    )
    .await;
    let (status, headers, body) = post(proxy, "/v1/chat/completions", &chat(true)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(headers.get("retry-after").is_none());
    let body = error_body(&body);
    assert_eq!(body, closed.body());
    assert_eq!(body["retryable"], true);
}

#[tokio::test]
async fn an_unreachable_engine_is_a_retryable_502_and_a_cut() {
    // A port nothing listens on.
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = free.local_addr().unwrap();
    drop(free);
    let admission = TestAdmission::new(addr);
    let record = std::sync::Arc::clone(&admission.record);
    let proxy = start_proxy(admission, ProxyConfig::default()).await;
    let (status, _, body) = post(proxy, "/v1/chat/completions", &chat(false)).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    let body = error_body(&body);
    assert_eq!(body["code"], "upstream_unavailable");
    assert_eq!(body["retryable"], true);
    assert_eq!(record.cut_count(), 1);
    assert_eq!(record.live.load(std::sync::atomic::Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_black_holed_engine_is_a_502_at_the_connect_bound() {
    // An engine whose accept queue is full: the kernel drops further connection attempts, so
    // a connect neither succeeds nor fails (as with a host that does not answer).
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let engine = socket.listen(1).unwrap();
    let addr = engine.local_addr().unwrap();
    let mut fillers = Vec::new();
    loop {
        match tokio::time::timeout(
            std::time::Duration::from_millis(200),
            tokio::net::TcpStream::connect(addr),
        )
        .await
        {
            Ok(Ok(stream)) => fillers.push(stream),
            Ok(Err(err)) => panic!("connect failed: {err}"),
            Err(_) => break,
        }
        assert!(fillers.len() < 64, "the accept queue never filled");
    }
    let admission = TestAdmission::new(addr);
    let record = std::sync::Arc::clone(&admission.record);
    let config = ProxyConfig {
        upstream_connect_timeout: std::time::Duration::from_millis(300),
        request_deadline: std::time::Duration::from_secs(60),
        ..ProxyConfig::default()
    };
    let proxy = start_proxy(admission, config).await;
    let began = tokio::time::Instant::now();
    let (status, _, body) = post(proxy, "/v1/chat/completions", &chat(false)).await;
    let took = began.elapsed();
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    let body = error_body(&body);
    assert_eq!(body["code"], "upstream_unavailable");
    assert_eq!(body["retryable"], true);
    assert!(
        body["message"].as_str().unwrap().contains("within 300 ms"),
        "{body}"
    );
    assert!(took >= std::time::Duration::from_millis(300), "{took:?}");
    assert!(took < std::time::Duration::from_secs(30), "{took:?}");
    assert_eq!(*record.cuts.lock().unwrap(), [false], "cut before output");
    assert_eq!(record.live.load(std::sync::atomic::Ordering::SeqCst), 0);
    drop(engine);
}

#[tokio::test]
async fn a_client_that_never_finishes_its_request_head_is_disconnected() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let sim = start_sim(&[]).await;
    let admission = TestAdmission::new(sim);
    let record = std::sync::Arc::clone(&admission.record);
    let config = ProxyConfig {
        header_read_timeout: std::time::Duration::from_millis(300),
        ..ProxyConfig::default()
    };
    let proxy = start_proxy(admission, config).await;
    // Taken before the connection: the listener's timer starts when it accepts it, which may
    // be before `connect` returns here.
    let began = tokio::time::Instant::now();
    let mut stream = tokio::net::TcpStream::connect(proxy).await.unwrap();
    stream
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\n")
        .await
        .unwrap();
    // Nothing more: the listener gives up on the head and closes the connection.
    let closed = tokio::time::timeout(PATIENCE, async {
        let mut buf = [0u8; 1024];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the connection stays open");
    assert!(
        began.elapsed() >= std::time::Duration::from_millis(300),
        "{:?}",
        began.elapsed()
    );
    assert_eq!(record.entered.load(std::sync::atomic::Ordering::SeqCst), 0);
}
