//! The coordinator's refusals as a client sees them: the real coordinator (on the scripted
//! fake lifecycle) behind the real listener, through a socket. Every 429 carries
//! `Retry-After: 1`; a 409 carries none.

#![allow(clippy::unwrap_used)]

mod proxy_support;

use std::sync::Arc;
use std::time::Duration;

use capyctl_crds::errors::ApiError;
use capyctl_router::config::RouterConfig;
use capyctl_router::coordinator::CoordinatorHandle;
use capyctl_router::coordinator::testing::{FakeLifecycle, FakeState, FakeTimings};
use capyctl_router::proxy::{ModelEntry, Proxy, ProxyConfig, serve};
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
