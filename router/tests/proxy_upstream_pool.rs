//! The listener's own connections to the engines: kept alive and reused, and an engine that
//! closes its connections costs no request.
#![allow(clippy::unwrap_used)]

mod proxy_support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use capyctl_router::proxy::ProxyConfig;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use proxy_support::{Conn, MODEL, TestAdmission, start_proxy};
use tokio::net::TcpListener;

/// An engine that answers `{"ok":true}` and counts the connections it accepted; with
/// `keep_alive: false` it closes each connection after one answer.
async fn start_engine(keep_alive: bool) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&accepted);
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            counter.fetch_add(1, Ordering::SeqCst);
            let service = hyper::service::service_fn(|request: http::Request<_>| async move {
                let _ = BodyExt::collect(request.into_body()).await;
                let mut response =
                    http::Response::new(Full::new(Bytes::from_static(b"{\"ok\":true}")));
                response.headers_mut().insert(
                    "content-type",
                    http::HeaderValue::from_static("application/json"),
                );
                Ok::<_, Infallible>(response)
            });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .keep_alive(keep_alive)
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (addr, accepted)
}

async fn ask(conn: &mut Conn) -> Bytes {
    let body = format!(r#"{{"model":"{MODEL}","prompt":"hi"}}"#);
    let response = conn.post("/v1/completions", &body).await;
    assert_eq!(response.status(), 200);
    response.into_body().collect().await.unwrap().to_bytes()
}

#[tokio::test]
async fn upstream_connection_is_kept_alive_and_reused() {
    let (engine, accepted) = start_engine(true).await;
    let router = start_proxy(TestAdmission::new(engine), ProxyConfig::default()).await;
    let mut conn = Conn::open(router).await;
    for _ in 0..5 {
        assert_eq!(ask(&mut conn).await, &b"{\"ok\":true}"[..]);
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn engine_closing_its_connections_costs_no_request() {
    let (engine, accepted) = start_engine(false).await;
    let router = start_proxy(TestAdmission::new(engine), ProxyConfig::default()).await;
    let mut conn = Conn::open(router).await;
    for _ in 0..5 {
        assert_eq!(ask(&mut conn).await, &b"{\"ok\":true}"[..]);
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 5);
}
