//! `serve` shuts down gracefully: it stops accepting, lets answers in progress finish, and
//! returns; past the grace it drops what is left.

#![allow(clippy::unwrap_used)]

mod proxy_support;

use std::time::Duration;

use capyctl_router::proxy::{Proxy, ProxyConfig, serve};
use http::StatusCode;
use http_body_util::BodyExt;
use proxy_support::*;
use tokio::net::TcpListener;

fn chat(max_tokens: u64) -> String {
    format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":{max_tokens},"stream":true}}"#
    )
}

async fn start(
    sim: std::net::SocketAddr,
    grace: Duration,
) -> (
    std::net::SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<std::io::Result<()>>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = ProxyConfig {
        shutdown_grace: grace,
        ..ProxyConfig::default()
    };
    let proxy = Proxy::new(TestAdmission::new(sim), catalog, config);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve(listener, proxy, async move {
        let _ = stopped.await;
    }));
    (addr, stop, server)
}

#[tokio::test]
async fn answers_in_progress_finish_after_the_signal() {
    let sim = start_sim(&["--sim-token-rate", "40"]).await;
    let (proxy, stop, server) = start(sim, PATIENCE).await;
    let mut conn = Conn::open(proxy).await;
    let response = conn.post("/v1/chat/completions", &chat(20)).await;
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    stop.send(()).unwrap();
    let rest = body.collect().await.unwrap().to_bytes();
    assert!(rest.ends_with(b"data: [DONE]\n\n"), "{first:?} {rest:?}");
    until_stopped(server).await;
    assert!(
        tokio::net::TcpStream::connect(proxy).await.is_err(),
        "still accepting"
    );
}

#[tokio::test]
async fn the_grace_bounds_the_shutdown() {
    let sim = start_sim(&["--sim-token-rate", "2"]).await;
    let (proxy, stop, server) = start(sim, Duration::from_millis(100)).await;
    let mut conn = Conn::open(proxy).await;
    let response = conn.post("/v1/chat/completions", &chat(1000)).await;
    assert_eq!(response.status(), StatusCode::OK);
    stop.send(()).unwrap();
    until_stopped(server).await;
    // The answer was dropped: the engine sees its client go away.
    wait_sim(sim, "aborted", 1).await;
    drop(response);
}
