//! Tenants on the inference listener, through a real socket and the engine simulator: 401 for
//! a missing, unknown or misplaced key; 404 for a model the tenant may not use, as for an
//! unknown one; `/v1/models` filtered; 429 `rate_limited` with `Retry-After` and the
//! `x-ratelimit-*` headers; tokens counted from the engine's usage; the key not forwarded.

#![allow(clippy::unwrap_used)]

mod proxy_support;

use std::sync::Arc;

use bytes::Bytes;
use capyctl_interfaces::tenants::{Tenant, TenantRate, TenantTable};
use capyctl_router::proxy::{Proxy, ProxyConfig, serve};
use capyctl_router::tenants::Tenants;
use http::{Request, StatusCode};
use http_body_util::Full;
use proxy_support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

fn chat(model: &str, stream: bool) -> String {
    format!(
        r#"{{"model":"{model}","messages":[{{"role":"user","content":"Tell me about capybaras"}}],"max_tokens":8,"stream":{stream}}}"#
    )
}

fn tenant(name: &str, key: &str, models: Option<&[&str]>, rate: Option<TenantRate>) -> Tenant {
    Tenant {
        name: name.into(),
        keys: vec![key.into()],
        models: models.map(|m| m.iter().map(|s| (*s).to_string()).collect()),
        rate,
    }
}

async fn start(admission: TestAdmission, tenants: Arc<Tenants>) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let proxy = Proxy::new(admission, catalog, ProxyConfig::default()).with_tenants(tenants);
    tokio::spawn(serve(listener, proxy, std::future::pending()));
    addr
}

/// Sends `method path` with `headers`; the status, headers and body.
async fn send(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (StatusCode, http::HeaderMap, Bytes) {
    let mut conn = Conn::open(addr).await;
    let mut request = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "test")
        .header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = conn
        .send(
            request
                .body(Full::new(Bytes::from(body.to_string())))
                .unwrap(),
        )
        .await;
    proxy_support::whole(response).await
}

/// Waits until the tenant's tokens reach `tokens` (they are charged when the answer's body is
/// dropped, just after its last byte went out); `1`: any count.
async fn tokens_reach(tenants: &Tenants, tokens: u64) {
    let end = tokio::time::Instant::now() + PATIENCE;
    while tenants.report()[0].tokens < tokens {
        assert!(tokio::time::Instant::now() < end, "{:?}", tenants.report());
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    if tokens > 1 {
        assert_eq!(tenants.report()[0].tokens, tokens);
    }
}

fn code(body: &[u8]) -> String {
    let v: serde_json::Value = serde_json::from_slice(body).unwrap();
    v["code"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn without_a_valid_bearer_key_every_route_is_401() {
    let sim = start_sim(&[]).await;
    let tenants = Arc::new(Tenants::new());
    tenants
        .replace(vec![tenant("team-a", "sk-team-a", None, None)])
        .unwrap();
    let proxy = start(TestAdmission::new(sim), Arc::clone(&tenants)).await;
    let path = "/v1/chat/completions";
    let body = chat(MODEL, false);
    let refused: [(&str, Vec<(&str, &str)>); 6] = [
        ("/v1/chat/completions", vec![]),
        (
            "/v1/chat/completions",
            vec![("authorization", "Bearer sk-team-b")],
        ),
        ("/v1/chat/completions", vec![("authorization", "sk-team-a")]),
        ("/v1/chat/completions", vec![("x-api-key", "sk-team-a")]),
        (
            "/v1/chat/completions",
            vec![("api-key", "Bearer sk-team-a")],
        ),
        (
            "/v1/chat/completions?api_key=sk-team-a&key=sk-team-a",
            vec![],
        ),
    ];
    for (path, headers) in &refused {
        let (status, h, answer) = send(proxy, "POST", path, headers, &body).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{path} {headers:?}");
        assert_eq!(code(&answer), "unauthorized");
        assert_eq!(h["www-authenticate"], "Bearer");
        assert!(!String::from_utf8_lossy(&answer).contains("sk-"));
    }
    let (status, _, _) = send(proxy, "GET", "/v1/models", &[], "").await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    // Nothing reached the engine.
    assert_eq!(sim_state(sim).await["completed"].as_u64().unwrap_or(0), 0);
    let auth = [("authorization", "Bearer sk-team-a")];
    let (status, _, _) = send(proxy, "POST", path, &auth, &body).await;
    assert_eq!(status, StatusCode::OK);
    // Rotation: the new key works at once, the old one no more.
    tenants
        .replace(vec![tenant("team-a", "sk-team-a-2", None, None)])
        .unwrap();
    let (status, _, _) = send(proxy, "POST", path, &auth, &body).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let auth = [("authorization", "Bearer sk-team-a-2")];
    let (status, _, _) = send(proxy, "POST", path, &auth, &body).await;
    assert_eq!(status, StatusCode::OK);
    let report = tenants.report();
    assert_eq!(report[0].answers["200"], 2, "{report:?}");
}

/// Sends `head` alone on a new connection (a body it announces never comes) and reads what
/// comes back until the listener closes the connection.
async fn head_only(addr: std::net::SocketAddr, head: &str) -> String {
    String::from_utf8_lossy(&exchange(addr, head.as_bytes()).await).into_owned()
}

/// Sends `bytes` on a new connection and reads what comes back until the listener closes it.
async fn exchange(addr: std::net::SocketAddr, bytes: &[u8]) -> Vec<u8> {
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    socket.write_all(bytes).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(PATIENCE, socket.read_to_end(&mut answer))
        .await
        .expect("the answer and the connection's end")
        .unwrap();
    answer
}

/// A streamed chat request of one choice and `max_tokens`.
fn capybaras(max_tokens: u32) -> String {
    format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Capybaras?"}}],"max_tokens":{max_tokens},"stream":true}}"#
    )
}

/// The 401 is decided from the head: the body is not waited for (nor a `100 Continue` sent,
/// nor the budget consulted), and the connection closes after it since the body was not read.
#[tokio::test]
async fn a_refused_key_is_answered_from_the_head_before_any_body() {
    let sim = start_sim(&[]).await;
    let tenants = Arc::new(Tenants::new());
    tenants
        .replace(vec![tenant("team-a", "sk-team-a", None, None)])
        .unwrap();
    let proxy = start(TestAdmission::new(sim), tenants).await;
    let head = |auth: &str, extra: &str, length: u64| {
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n{auth}{extra}content-length: {length}\r\n\r\n"
        )
    };
    let over_budget = 2 * ProxyConfig::default().max_buffered_bytes_total;
    for auth in [
        "",
        "authorization: Bearer sk-team-b\r\n",
        "x-api-key: sk-team-a\r\n",
    ] {
        for (extra, length) in [
            ("", 1000),
            ("expect: 100-continue\r\n", 1000),
            ("", over_budget),
        ] {
            let answer = head_only(proxy, &head(auth, extra, length)).await;
            assert!(
                answer.starts_with("HTTP/1.1 401 "),
                "{auth}{extra}{length}: {answer}"
            );
            assert!(!answer.contains("100 Continue"), "{answer}");
            assert!(answer.contains("connection: close\r\n"), "{answer}");
            assert!(answer.contains(r#""code":"unauthorized""#), "{answer}");
        }
    }
    // The right key goes on to the body: refused by the budget for its announced length.
    let auth = "authorization: Bearer sk-team-a\r\n";
    let answer = head_only(proxy, &head(auth, "", over_budget)).await;
    assert!(answer.starts_with("HTTP/1.1 413 "), "{answer}");
}

#[tokio::test]
async fn a_model_the_tenant_may_not_use_is_answered_as_an_unknown_one() {
    let sim = start_sim(&[]).await;
    let tenants = Arc::new(Tenants::new());
    tenants
        .replace(vec![
            tenant("team-a", "sk-a", Some(&["chat-*"]), None),
            tenant("team-b", "sk-b", Some(&["support-bot", "other-*"]), None),
        ])
        .unwrap();
    let proxy = start(TestAdmission::new(sim), tenants).await;
    let path = "/v1/chat/completions";
    let a = [("authorization", "Bearer sk-a")];
    let b = [("authorization", "Bearer sk-b")];
    let (status, _, _) = send(proxy, "POST", path, &a, &chat(MODEL, false)).await;
    assert_eq!(status, StatusCode::OK);
    // team-b may not use chat-a (which exists) nor other-x (which does not): the same answer
    // but for the name it repeats.
    let (s1, _, hidden) = send(proxy, "POST", path, &b, &chat(MODEL, false)).await;
    let (s2, _, unknown) = send(proxy, "POST", path, &b, &chat("other-x", false)).await;
    assert_eq!((s1, s2), (StatusCode::NOT_FOUND, StatusCode::NOT_FOUND));
    assert_eq!(
        String::from_utf8_lossy(&hidden).replace(MODEL, "M"),
        String::from_utf8_lossy(&unknown).replace("other-x", "M")
    );
    // The models list: team-a sees chat-a, team-b nothing.
    let (status, _, list) = send(proxy, "GET", "/v1/models", &a, "").await;
    assert_eq!(status, StatusCode::OK);
    assert!(String::from_utf8_lossy(&list).contains(MODEL));
    let (_, _, list) = send(proxy, "GET", "/v1/models", &b, "").await;
    let list: serde_json::Value = serde_json::from_slice(&list).unwrap();
    assert_eq!(list["data"], serde_json::json!([]));
}

#[tokio::test]
async fn a_rate_passed_is_429_with_retry_after_and_the_rate_headers() {
    let sim = start_sim(&[]).await;
    let tenants = Arc::new(Tenants::new());
    let rate = TenantRate {
        requests_per_minute: Some(3),
        tokens_per_minute: Some(1_000_000),
    };
    tenants
        .replace(vec![tenant("team-a", "sk-a", None, Some(rate))])
        .unwrap();
    let proxy = start(TestAdmission::new(sim), Arc::clone(&tenants)).await;
    let a = [("authorization", "Bearer sk-a")];
    let path = "/v1/chat/completions";
    for left in [2, 1, 0] {
        let (status, h, _) = send(proxy, "POST", path, &a, &chat(MODEL, false)).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(h["x-ratelimit-limit-requests"], "3");
        assert_eq!(
            h["x-ratelimit-remaining-requests"],
            left.to_string().as_str()
        );
        assert_eq!(h["x-ratelimit-limit-tokens"], "1000000");
        assert!(h.contains_key("x-ratelimit-reset-requests"));
        assert!(h.contains_key("x-ratelimit-remaining-tokens"));
    }
    let (status, h, body) = send(proxy, "POST", path, &a, &chat(MODEL, false)).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(code(&body), "rate_limited");
    // One request comes back every 20 s: at most 20 s to wait (and at least 1).
    let retry: u64 = h["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=20).contains(&retry), "{retry}");
    assert_eq!(h["x-ratelimit-remaining-requests"], "0");
    let report = tenants.report();
    assert_eq!(report[0].answers["429"], 1);
    assert_eq!(report[0].answers["200"], 3);
    // The engine's usage was counted: three answers of the same prompt.
    let (_, _, direct) = post(sim, path, &chat(MODEL, false)).await;
    let direct: serde_json::Value = serde_json::from_slice(&direct).unwrap();
    let each = direct["usage"]["total_tokens"].as_u64().unwrap();
    assert!(each > 0);
    tokens_reach(&tenants, 3 * each).await;
}

#[tokio::test]
async fn a_streamed_answer_that_asked_for_usage_is_counted() {
    let sim = start_sim(&[]).await;
    let tenants = Arc::new(Tenants::new());
    tenants
        .replace(vec![tenant("team-a", "sk-a", None, None)])
        .unwrap();
    let proxy = start(TestAdmission::new(sim), Arc::clone(&tenants)).await;
    let body = format!(
        r#"{{"model":"{MODEL}","prompt":"Once upon a time","max_tokens":5,"stream":true,"stream_options":{{"include_usage":true}}}}"#
    );
    let (status, _, answer) = send(
        proxy,
        "POST",
        "/v1/completions",
        &[("authorization", "Bearer sk-a")],
        &body,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(answer.ends_with(b"data: [DONE]\n\n"));
    tokens_reach(&tenants, 1).await;
}

#[tokio::test]
async fn the_key_is_not_forwarded_to_the_engine() {
    // An engine that keeps the head it got and answers a fixed JSON.
    let engine = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = engine.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<String>();
    tokio::spawn(async move {
        let (mut socket, _) = engine.accept().await.unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = socket.read(&mut buf).await.unwrap();
            got.extend_from_slice(&buf[..n]);
        }
        let answer = b"{\"usage\":{\"total_tokens\":7}}";
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            answer.len()
        );
        socket.write_all(head.as_bytes()).await.unwrap();
        socket.write_all(answer).await.unwrap();
        let _ = tx.send(String::from_utf8_lossy(&got).into_owned());
        let _ = socket.read(&mut buf).await;
    });
    let tenants = Arc::new(Tenants::new());
    tenants
        .replace(vec![tenant("team-a", "sk-secret", None, None)])
        .unwrap();
    let proxy = start(TestAdmission::new(addr), Arc::clone(&tenants)).await;
    let (status, _, _) = send(
        proxy,
        "POST",
        "/v1/chat/completions",
        &[("authorization", "Bearer sk-secret"), ("x-trace", "1")],
        &chat(MODEL, false),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let head = rx.await.unwrap().to_ascii_lowercase();
    assert!(head.contains("x-trace: 1"), "{head}");
    assert!(!head.contains("authorization"), "{head}");
    assert!(!head.contains("sk-secret"), "{head}");
    tokens_reach(&tenants, 7).await;
}

/// A listener in front of `engine` with tenant team-a (key `sk-a`), whose tokens are rated
/// (so that its streamed requests are asked for their usage), and one without tenants.
async fn token_rated_and_plain(
    engine: std::net::SocketAddr,
) -> (Arc<Tenants>, std::net::SocketAddr, std::net::SocketAddr) {
    let tenants = Arc::new(Tenants::new());
    let rate = TenantRate {
        requests_per_minute: None,
        tokens_per_minute: Some(1_000_000),
    };
    tenants
        .replace(vec![tenant("team-a", "sk-a", None, Some(rate))])
        .unwrap();
    let proxy = start(TestAdmission::new(engine), Arc::clone(&tenants)).await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let plain = listener.local_addr().unwrap();
    let without = Proxy::new(TestAdmission::new(engine), catalog, ProxyConfig::default());
    tokio::spawn(serve(listener, without, std::future::pending()));
    (tenants, proxy, plain)
}

/// A tenant with `tokens_per_minute`: a streamed request that did not ask for usage is asked
/// for it on its behalf, counted, and its client receives the same bytes as without tenants.
#[tokio::test]
async fn a_streamed_answer_is_counted_without_changing_its_bytes() {
    let sim = start_sim(&[]).await;
    let (tenants, proxy, plain) = token_rated_and_plain(sim).await;
    let a = [("authorization", "Bearer sk-a")];
    let completion = format!(
        r#"{{"model":"{MODEL}","prompt":"Once upon a time","max_tokens":5,"stream":true}}"#
    );
    let continuous = format!(
        r#"{{"model":"{MODEL}","prompt":"Once upon a time","max_tokens":5,"stream":true,"stream_options":{{"continuous_usage_stats":true}}}}"#
    );
    let cases = [
        ("/v1/chat/completions", chat(MODEL, true)),
        ("/v1/completions", completion.clone()),
        ("/v1/completions", continuous),
    ];
    let mut counted = 0;
    for (path, body) in &cases {
        let (status, _, without) = send(plain, "POST", path, &[], body).await;
        assert_eq!(status, StatusCode::OK);
        let (status, _, with) = send(proxy, "POST", path, &a, body).await;
        assert_eq!(status, StatusCode::OK);
        assert!(!String::from_utf8_lossy(&with).contains("\"usage\""));
        assert_eq!(normalise(&with), normalise(&without), "{path} {body}");
        // vLLM's fingerprint on the finishing chunk, which it moves to the usage chunk when
        // asked for usage: put back where it was.
        assert!(String::from_utf8_lossy(&with).contains("\"system_fingerprint\""));
        // What the engine counts for it: the same request asking for usage itself.
        let asked = body.replacen(
            r#""stream":true"#,
            r#""stream":true,"stream_options":{"include_usage":true}"#,
            1,
        );
        let asked = asked.replacen(
            r#","stream_options":{"continuous_usage_stats":true}"#,
            "",
            1,
        );
        let (_, _, direct) = post(sim, path, &asked).await;
        let direct = String::from_utf8_lossy(&direct).into_owned();
        // (the engine does answer differently when asked: the test would see a leak)
        assert_ne!(normalise(direct.as_bytes()), normalise(&without));
        let usage = direct
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
            .find_map(|v| v["usage"]["total_tokens"].as_u64())
            .unwrap();
        counted += usage;
        tokens_reach(&tenants, counted).await;
    }
}

/// The events vLLM 0.32 streams for a chat request (`chat_completion/serving.py`) whose chunks
/// are `choices` (the choice's index, its text, its finish reason): without `include_usage`
/// each finishing chunk carries the `system_fingerprint`; with it none does, and a last chunk
/// with empty `choices` carries the usage (`prompt` tokens and one a chunk) and the
/// fingerprint.
fn vllm_events(
    id: &str,
    choices: &[(u32, String, Option<&str>)],
    prompt: usize,
    include_usage: bool,
) -> Vec<String> {
    let fingerprint = if include_usage {
        ""
    } else {
        r#","system_fingerprint":"vllm-0.32.0-1a2b3c4d""#
    };
    let mut events: Vec<String> = choices
        .iter()
        .map(|(i, text, finish)| {
            let (finish, fp) = match finish {
                Some(f) => (format!("\"{f}\""), fingerprint),
                None => ("null".to_string(), ""),
            };
            format!(
                r#"data: {{"id":"{id}","object":"chat.completion.chunk","created":1765000000,"model":"{MODEL}","choices":[{{"index":{i},"delta":{{"content":"{text}"}},"logprobs":null,"finish_reason":{finish},"stop_reason":null}}]{fp}}}"#
            ) + "\n\n"
        })
        .collect();
    if include_usage {
        let (completion, total) = (choices.len(), prompt + choices.len());
        events.push(format!(
            r#"data: {{"id":"{id}","object":"chat.completion.chunk","created":1765000000,"model":"{MODEL}","choices":[],"usage":{{"prompt_tokens":{prompt},"total_tokens":{total},"completion_tokens":{completion}}},"system_fingerprint":"vllm-0.32.0-1a2b3c4d"}}"#
        ) + "\n\n");
    }
    events.push("data: [DONE]\n\n".to_string());
    events
}

/// [`vllm_events`] of a request with `n: 2` whose choices finish apart.
fn vllm_n2_events(include_usage: bool) -> Vec<String> {
    let chunk = |i, text: &str, finish| (i, text.to_string(), finish);
    let choices = [
        chunk(0, "Capybaras", None),
        chunk(1, "They", None),
        chunk(0, " swim.", Some("stop")),
        chunk(1, " are", None),
        chunk(1, " rodents", None),
        chunk(1, ".", Some("length")),
    ];
    vllm_events("chatcmpl-n2", &choices, 7, include_usage)
}

/// [`vllm_events`] of a long single-choice stream (about 140 KiB).
fn vllm_long_events(include_usage: bool) -> Vec<String> {
    let tokens = 700;
    let choices: Vec<_> = (0..tokens)
        .map(|i| {
            let text = format!("{i}{}", " capybara".repeat(i % 9 + 1));
            (0, text, (i + 1 == tokens).then_some("length"))
        })
        .collect();
    vllm_events("chatcmpl-long", &choices, 7, include_usage)
}

/// An engine that answers every request on its keep-alive connections with [`vllm_n2_events`]
/// (as the request's `include_usage` says), one chunked frame per event.
async fn vllm_n2_engine() -> std::net::SocketAddr {
    vllm_engine(vllm_n2_events, false).await
}

/// An engine that answers every request on its keep-alive connections with `events` (as the
/// request's `include_usage` says), one chunked frame per event, each written by itself or
/// (`at_once`) all of them in one write.
async fn vllm_engine(events: fn(bool) -> Vec<String>, at_once: bool) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    let end = loop {
                        if let Some(at) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                            break at + 4;
                        }
                        match socket.read(&mut buf).await {
                            Ok(n) if n > 0 => got.extend_from_slice(&buf[..n]),
                            _ => return,
                        }
                    };
                    let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
                    let length: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .map_or(0, |v| v.trim().parse().unwrap());
                    while got.len() < end + length {
                        let n = socket.read(&mut buf).await.unwrap();
                        assert!(n > 0);
                        got.extend_from_slice(&buf[..n]);
                    }
                    let body: Vec<u8> = got.drain(..end + length).skip(end).collect();
                    let include_usage = String::from_utf8_lossy(&body)
                        .replace(' ', "")
                        .contains(r#""include_usage":true"#);
                    socket
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n")
                        .await
                        .unwrap();
                    let mut all = Vec::new();
                    for event in events(include_usage) {
                        let frame = format!("{:x}\r\n{event}\r\n", event.len());
                        if at_once {
                            all.extend_from_slice(frame.as_bytes());
                        } else {
                            socket.write_all(frame.as_bytes()).await.unwrap();
                        }
                    }
                    all.extend_from_slice(b"0\r\n\r\n");
                    socket.write_all(&all).await.unwrap();
                }
            });
        }
    });
    addr
}

/// `n` > 1: every choice's finishing chunk gets vLLM's fingerprint back, on the instance's
/// first stream (held until the usage chunk) and on the next ones (written in as it passes).
#[tokio::test]
async fn with_several_choices_a_streamed_answer_keeps_its_bytes() {
    let engine = vllm_n2_engine().await;
    let (tenants, proxy, plain) = token_rated_and_plain(engine).await;
    let body = format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Capybaras?"}}],"n":2,"max_tokens":4,"stream":true}}"#
    );
    let path = "/v1/chat/completions";
    let (status, _, without) = send(plain, "POST", path, &[], &body).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(without, vllm_n2_events(false).concat());
    let a = [("authorization", "Bearer sk-a")];
    for round in 1..=2 {
        let (status, _, with) = send(proxy, "POST", path, &a, &body).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            String::from_utf8_lossy(&with),
            String::from_utf8_lossy(&without),
            "round {round}"
        );
        tokens_reach(&tenants, 13 * round).await;
    }
}

/// A long single-choice stream that the engine sent before the listener read it (so that the
/// listener gathers it into frames of up to 16 KiB, an engine frame past that beginning the
/// next one) keeps its bytes through a tenant whose usage is asked for: the usage chunk taken
/// out and the fingerprint put back, on the instance's first stream and after, and its tokens
/// counted.
#[tokio::test]
async fn a_long_stream_already_sent_keeps_its_bytes() {
    let engine = vllm_engine(vllm_long_events, true).await;
    let (tenants, proxy, plain) = token_rated_and_plain(engine).await;
    let body = capybaras(700);
    let path = "/v1/chat/completions";
    let (status, _, without) = send(plain, "POST", path, &[], &body).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(without, vllm_long_events(false).concat());
    assert!(without.len() > 128 * 1024);
    let a = [("authorization", "Bearer sk-a")];
    for round in 1..=3 {
        let (status, _, with) = send(proxy, "POST", path, &a, &body).await;
        assert_eq!(status, StatusCode::OK);
        assert!(with == without, "round {round}");
        tokens_reach(&tenants, 707 * round).await;
    }
}

/// [`vllm_events`] of a short single-choice stream.
fn vllm_short_events(include_usage: bool) -> Vec<String> {
    let chunk = |text: &str, finish| (0, text.to_string(), finish);
    let choices = [
        chunk("Capybaras", None),
        chunk(" swim", None),
        chunk(".", Some("stop")),
    ];
    vllm_events("chatcmpl-short", &choices, 7, include_usage)
}

/// On the wire, through a raw socket: a tenant's stream whose frames the strip changes (the
/// engine sends the tokens, the finishing chunk, the usage chunk and `[DONE]` in one write: the
/// fingerprint written back and the usage chunk taken out of one frame, held on the instance's
/// first stream and written in as it passes on the next) goes out in chunks each as long as its
/// size line says, and ends with one last chunk; de-chunked, it is the engine's stream without
/// usage.
#[tokio::test]
async fn a_changed_frame_goes_out_in_chunks_of_their_own_size() {
    let engine = vllm_engine(vllm_short_events, true).await;
    let (tenants, proxy, _) = token_rated_and_plain(engine).await;
    let body = capybaras(3);
    for round in 1..=3 {
        let request = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\nauthorization: Bearer sk-a\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        let answer = exchange(proxy, request.as_bytes()).await;
        let end = answer.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
        let head = String::from_utf8_lossy(&answer[..end]).to_ascii_lowercase();
        assert!(head.starts_with("http/1.1 200"), "{head}");
        assert!(head.contains("transfer-encoding: chunked"), "{head}");
        let mut rest = &answer[end..];
        let mut chunks = Vec::new();
        loop {
            let line = rest.windows(2).position(|w| w == b"\r\n").unwrap();
            let size =
                usize::from_str_radix(std::str::from_utf8(&rest[..line]).unwrap(), 16).unwrap();
            rest = &rest[line + 2..];
            if size == 0 {
                assert_eq!(rest, b"\r\n", "round {round}: after the last chunk");
                break;
            }
            assert!(
                rest.len() >= size + 2,
                "round {round}: a chunk shorter than its size"
            );
            assert_eq!(&rest[size..size + 2], b"\r\n", "round {round}");
            chunks.push(&rest[..size]);
            rest = &rest[size + 2..];
        }
        assert_eq!(
            String::from_utf8_lossy(&chunks.concat()),
            vllm_short_events(false).concat(),
            "round {round}"
        );
        tokens_reach(&tenants, 10 * round).await;
    }
}
