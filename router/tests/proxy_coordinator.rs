//! The coordinator's refusals as a client sees them: the real coordinator (on the scripted
//! fake lifecycle) behind the real listener, through a socket. Every 429 carries
//! `Retry-After: 1`; a 409 carries none.

#![allow(clippy::unwrap_used)]

mod proxy_support;

use std::sync::Arc;
use std::time::Duration;

use capyctl_router::config::RouterConfig;
use capyctl_router::coordinator::CoordinatorHandle;
use capyctl_router::coordinator::testing::{FakeLifecycle, FakeState, FakeTimings};
use capyctl_router::proxy::{ModelEntry, Proxy, ProxyConfig, serve};
use capyctl_spec::errors::ApiError;
use http::StatusCode;
use proxy_support::post;
use tokio::net::TcpListener;

const B: &str = "01KBBBBBBBBBBBBBBBBBBBBBBB";
const C: &str = "01KCCCCCCCCCCCCCCCCCCCCCCC";

/// chat-b and chat-c parked, on a fake GPU whose wakes take an hour (nothing becomes ready
/// while a test runs); the listener in front of the coordinator on a fresh port.
async fn start(
    config: RouterConfig,
) -> (std::net::SocketAddr, Arc<FakeLifecycle>, CoordinatorHandle) {
    let hour = Duration::from_secs(3600);
    let fake = FakeLifecycle::new(FakeTimings {
        capacity: 2,
        park_delay: hour,
        wake_delay: hour,
        start_delay: hour,
        ..FakeTimings::default()
    });
    fake.add(B, "chat-b", FakeState::Parked, 1);
    fake.add(C, "chat-c", FakeState::Parked, 1);
    let handle = fake.spawn(config);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let proxy = Proxy::new(
        handle.clone(),
        Vec::<ModelEntry>::new,
        ProxyConfig::default(),
    );
    tokio::spawn(serve(listener, proxy, std::future::pending()));
    (addr, fake, handle)
}

fn chat(model: &str) -> String {
    format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":4}}"#)
}

fn expect((status, headers, body): (StatusCode, http::HeaderMap, bytes::Bytes), error: &ApiError) {
    assert_eq!(status.as_u16(), error.status());
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        body,
        serde_json::json!({
            "code": error.code(),
            "message": error.message(),
            "retryable": error.retryable(),
        })
    );
    assert_eq!(
        headers
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_string()),
        error.retry_after().map(|s| s.to_string())
    );
}

#[tokio::test]
async fn no_wait_refusals_through_the_socket() {
    let (proxy, fake, _h) = start(RouterConfig {
        max_pending_per_deployment: 0,
        ..RouterConfig::default()
    })
    .await;
    // Parked: 429 with Retry-After: 1, and its wake is asked for.
    let answer = post(proxy, "/v1/chat/completions", &chat("chat-b")).await;
    assert_eq!(answer.1["retry-after"], "1");
    expect(
        answer,
        &ApiError::NotServableNoWait {
            deployment: B.into(),
        },
    );
    assert_eq!(fake.plans().len(), 1);
    // Stopped by an operator: 409, no Retry-After, nothing asked for.
    fake.set_refusal(
        C,
        Some(ApiError::DeploymentStopped {
            deployment: C.into(),
        }),
    );
    let answer = post(proxy, "/v1/chat/completions", &chat("chat-c")).await;
    assert!(answer.1.get("retry-after").is_none());
    expect(
        answer,
        &ApiError::DeploymentStopped {
            deployment: C.into(),
        },
    );
    assert_eq!(fake.plans().len(), 1);
}

#[tokio::test]
async fn waiting_limits_through_the_socket() {
    let (proxy, _fake, h) = start(RouterConfig {
        max_pending_per_deployment: 1,
        ..RouterConfig::default()
    })
    .await;
    // One waits for chat-b's wake (an hour away); the next finds the limit reached.
    let waiting =
        tokio::spawn(async move { post(proxy, "/v1/chat/completions", &chat("chat-b")).await });
    let end = tokio::time::Instant::now() + proxy_support::PATIENCE;
    while h.load().await.iter().map(|l| l.waiting).sum::<usize>() < 1 {
        assert!(tokio::time::Instant::now() < end, "never waited");
        tokio::task::yield_now().await;
    }
    let answer = post(proxy, "/v1/chat/completions", &chat("chat-b")).await;
    assert_eq!(answer.1["retry-after"], "1");
    expect(
        answer,
        &ApiError::TooManyWaiting {
            deployment: B.into(),
        },
    );
    waiting.abort();
}

const A: &str = "01KAAAAAAAAAAAAAAAAAAAAAAA";

/// How a slot-holding engine answers the requests it takes.
#[derive(Clone, Copy)]
enum Holding {
    /// A stream whose output goes on (an event every 50 ms) until the client leaves.
    Streams,
    /// Nothing at all: no head, no output.
    Silence,
}

/// An engine that reads each request whole and then holds it as `holding` says.
async fn holding_engine(holding: Holding) -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let engine = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = engine.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (mut socket, _) = engine.accept().await.unwrap();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    let n = socket.read(&mut chunk).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    if buf.windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
                match holding {
                    Holding::Silence => {
                        let _ = socket.read(&mut chunk).await;
                        std::future::pending::<()>().await;
                    }
                    Holding::Streams => {
                        let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
                        if socket.write_all(head.as_bytes()).await.is_err() {
                            return;
                        }
                        let event =
                            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"x\"}}]}\n\n";
                        loop {
                            let frame = format!("{:x}\r\n{event}\r\n", event.len());
                            if socket.write_all(frame.as_bytes()).await.is_err() {
                                return;
                            }
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                }
            });
        }
    });
    addr
}

/// Opens a connection and sends one request for chat-a; the stream to read its answer from.
async fn send_chat(proxy: std::net::SocketAddr, stream: bool) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let body = format!(
        r#"{{"model":"chat-a","messages":[{{"role":"user","content":"hi"}}],"stream":{stream}}}"#
    );
    let mut s = tokio::net::TcpStream::connect(proxy).await.unwrap();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(request.as_bytes()).await.unwrap();
    s
}

/// Reads what arrives until the head is whole, and the body when it has a length: the status
/// and everything read.
async fn read_head(s: &mut tokio::net::TcpStream) -> (u16, String) {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = s.read(&mut chunk).await.unwrap();
        assert!(n > 0, "closed: {}", String::from_utf8_lossy(&buf));
        buf.extend_from_slice(&chunk[..n]);
        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let text = String::from_utf8_lossy(&buf).to_string();
        let length = text[..end]
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .map_or(0, |l| l.trim().parse::<usize>().unwrap());
        if buf.len() >= end + 4 + length {
            let status = text[9..12].parse().unwrap();
            return (status, text);
        }
    }
}

/// chat-a ready on an engine that holds what it takes as `holding` says; 32 requests take its
/// slots, then one more waits for a slot: its answer. Request deadline 2 s.
async fn slot_wait_case(holding: Holding) -> (u16, String) {
    let engine = holding_engine(holding).await;
    let fake = FakeLifecycle::new(FakeTimings::default());
    fake.add(A, "chat-a", FakeState::Ready, 1);
    let handle = fake.spawn(RouterConfig::default());
    handle
        .instance_ready(capyctl_interfaces::router::Upstream {
            key: fake.key(A, 0),
            addr: engine,
        })
        .await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy = listener.local_addr().unwrap();
    let config = ProxyConfig {
        request_deadline: Duration::from_secs(2),
        ..ProxyConfig::default()
    };
    tokio::spawn(serve(
        listener,
        Proxy::new(handle.clone(), Vec::<ModelEntry>::new, config),
        std::future::pending(),
    ));
    let mut running = Vec::new();
    for _ in 0..32 {
        running.push(send_chat(proxy, true).await);
    }
    if matches!(holding, Holding::Streams) {
        for s in &mut running {
            assert_eq!(read_head(s).await.0, 200);
        }
    }
    let end = tokio::time::Instant::now() + proxy_support::PATIENCE;
    while handle
        .load()
        .await
        .iter()
        .map(|l| l.in_flight)
        .sum::<usize>()
        < 32
    {
        assert!(tokio::time::Instant::now() < end, "never 32 running");
        tokio::task::yield_now().await;
    }
    let mut late = send_chat(proxy, false).await;
    read_head(&mut late).await
}

fn expect_in_flight_deadline((status, head): (u16, String)) {
    let error = ApiError::InFlightDeadline {
        deployment: A.into(),
    };
    assert_eq!(status, 429, "{head}");
    assert!(head.contains("retry-after: 1\r\n"), "{head}");
    assert!(head.contains(&error.to_json()), "{head}");
}

/// 32 streams whose output goes on: the 33rd request waits for a slot until its deadline.
#[tokio::test]
async fn waiting_for_a_slot_the_whole_deadline_is_429_in_flight_deadline() {
    expect_in_flight_deadline(slot_wait_case(Holding::Streams).await);
}

/// 32 requests the engine never answers reach their own deadlines a moment before the 33rd's,
/// which then gets a slot and reaches its deadline at the engine: it waited at the bound all
/// but that moment, and is answered as such (it was 503 "did not become servable").
#[tokio::test]
async fn a_slot_freed_a_moment_before_the_deadline_is_still_429_in_flight_deadline() {
    expect_in_flight_deadline(slot_wait_case(Holding::Silence).await);
}
