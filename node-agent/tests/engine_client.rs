//! The engine client's connections (`capyctl_node_agent::http`): kept and reused between calls,
//! and replaced when the engine closed them, against a plain TCP server that counts them.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use capyctl_node_agent::http::{Call, EngineClient};
use capyctl_spec::EngineKind;
use http::Method;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// How the server ends each answer's connection.
#[derive(Clone, Copy, PartialEq, Eq)]
enum After {
    /// Keeps the connection for the next request.
    KeepAlive,
    /// Closes it after the answer, without saying so (as uvicorn does once an idle connection
    /// passes its keep-alive timeout), and reports the close.
    SilentClose,
    /// Answers `Connection: close` and closes it.
    Close,
}

/// A server on 127.0.0.1 answering every request `200` with its request line as the body,
/// `after` each answer; it counts the connections it accepted.
async fn server(after: After) -> (u16, Arc<AtomicUsize>, mpsc::UnboundedReceiver<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = Arc::new(AtomicUsize::new(0));
    let (closed_tx, closed) = mpsc::unbounded_channel();
    let count = Arc::clone(&accepted);
    tokio::spawn(async move {
        loop {
            let (socket, _) = listener.accept().await.unwrap();
            count.fetch_add(1, Ordering::SeqCst);
            let closed_tx = closed_tx.clone();
            tokio::spawn(async move {
                serve(socket, after).await;
                let _ = closed_tx.send(());
            });
        }
    });
    (port, accepted, closed)
}

async fn serve(mut socket: TcpStream, after: After) {
    let mut buf = Vec::new();
    loop {
        // Requests without a body: the head ends the request.
        let end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 1024];
            match socket.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head: Vec<u8> = buf.drain(..end).collect();
        let line = String::from_utf8_lossy(&head)
            .lines()
            .next()
            .unwrap_or_default()
            .to_string();
        let close = if after == After::Close {
            "connection: close\r\n"
        } else {
            ""
        };
        let answer = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n{close}\r\n{line}",
            line.len()
        );
        if socket.write_all(answer.as_bytes()).await.is_err() || after != After::KeepAlive {
            return;
        }
    }
}

async fn get(client: &EngineClient, port: u16, path: &str) -> (u16, String) {
    let url = format!("http://127.0.0.1:{port}{path}");
    let call = Call {
        engine: EngineKind::Vllm,
        step: "test call",
        url: &url,
        timeout: Duration::from_secs(10),
    };
    let (status, body) = client.send(call, Method::GET, None).await.unwrap();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

#[tokio::test]
async fn calls_reuse_one_connection() {
    let (port, accepted, _) = server(After::KeepAlive).await;
    let client = EngineClient::new();
    for path in ["/health", "/is_sleeping", "/health?x=1"] {
        assert_eq!(
            get(&client, port, path).await,
            (200, format!("GET {path} HTTP/1.1"))
        );
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
    // A clone shares the connections.
    assert_eq!(get(&client.clone(), port, "/x").await.0, 200);
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_connection_the_engine_closed_while_idle_is_replaced() {
    let (port, accepted, mut closed) = server(After::SilentClose).await;
    let client = EngineClient::new();
    for n in 1..=3 {
        assert_eq!(get(&client, port, "/health").await.0, 200);
        // The engine closed the idle connection: the next call finds it closed and opens a
        // new one instead of failing.
        closed.recv().await.unwrap();
        assert_eq!(accepted.load(Ordering::SeqCst), n);
    }
}

#[tokio::test]
async fn an_answer_that_closes_its_connection_is_read_whole() {
    let (port, accepted, _) = server(After::Close).await;
    let client = EngineClient::new();
    for n in 1..=3 {
        assert_eq!(
            get(&client, port, "/metrics").await,
            (200, "GET /metrics HTTP/1.1".to_string())
        );
        assert_eq!(accepted.load(Ordering::SeqCst), n);
    }
}

#[tokio::test]
async fn a_url_that_is_not_http_is_refused_by_name() {
    let client = EngineClient::new();
    let call = Call {
        engine: EngineKind::Vllm,
        step: "test call",
        url: "https://127.0.0.1:1/health",
        timeout: Duration::from_secs(10),
    };
    let err = client.send(call, Method::GET, None).await.unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("https://127.0.0.1:1/health") && text.contains("not an http:// URL"),
        "{text}"
    );
}
