//! Helpers shared by the integration tests: start a simulator (in-process or the real
//! binary), talk HTTP to it over real sockets, poll its state.
#![allow(dead_code, clippy::unwrap_used)]

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use capyctl_engine_sim::{SimConfig, serve};

/// A running simulator.
pub struct Sim {
    pub addr: SocketAddr,
    /// `http://127.0.0.1:PORT`
    pub base: String,
    task: Option<JoinHandle<()>>,
    child: Option<tokio::process::Child>,
}

impl Drop for Sim {
    fn drop(&mut self) {
        if let Some(t) = &self.task {
            t.abort();
        }
    }
}

/// Starts an in-process simulator with these launch arguments (no program name).
pub async fn start(args: &[&str]) -> Sim {
    let config =
        SimConfig::try_parse_from(std::iter::once("engine-sim").chain(args.iter().copied()))
            .unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        serve(listener, config).await.unwrap();
    });
    Sim {
        addr,
        base: format!("http://{addr}"),
        task: Some(task),
        child: None,
    }
}

/// Spawns the real `engine-sim` binary and reads its listening line.
pub async fn spawn_binary(args: &[&str], env: &[(&str, &str)]) -> Sim {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_engine-sim"));
    cmd.args(args)
        .env_remove("ENGINE_SIM_FAULTS")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut line = String::new();
    tokio::time::timeout(
        Duration::from_secs(10),
        BufReader::new(stdout).read_line(&mut line),
    )
    .await
    .expect("no listening line within 10 s")
    .unwrap();
    let addr: SocketAddr = line
        .trim()
        .strip_prefix("engine-sim listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .parse()
        .unwrap();
    Sim {
        addr,
        base: format!("http://{addr}"),
        task: None,
        child: Some(child),
    }
}

impl Sim {
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub async fn get(&self, path: &str) -> (StatusCode, String) {
        call(Method::GET, &self.url(path), None).await
    }

    pub async fn post(&self, path: &str, body: Value) -> (StatusCode, String) {
        call(Method::POST, &self.url(path), Some(body)).await
    }

    /// POST without a body (control endpoints).
    pub async fn post_empty(&self, path: &str) -> (StatusCode, String) {
        call(Method::POST, &self.url(path), None).await
    }

    /// POST that must answer 200.
    pub async fn post_ok(&self, path: &str) {
        let (status, body) = self.post_empty(path).await;
        assert_eq!(status, StatusCode::OK, "POST {path}: {body}");
    }

    /// SGLang `POST /pause_generation {"mode":"abort"}`, which must answer 200 (0.5.6 and
    /// later refuse it without a body).
    pub async fn pause(&self) {
        let (status, body) = self
            .post("/pause_generation", serde_json::json!({"mode": "abort"}))
            .await;
        assert_eq!(status, StatusCode::OK, "POST /pause_generation: {body}");
    }

    /// SGLang `POST /continue_generation {}`, which must answer 200.
    pub async fn resume_generation(&self) {
        let (status, body) = self
            .post("/continue_generation", serde_json::json!({}))
            .await;
        assert_eq!(status, StatusCode::OK, "POST /continue_generation: {body}");
    }

    pub async fn state(&self) -> Value {
        let (status, body) = self.get("/sim/state").await;
        assert_eq!(status, StatusCode::OK);
        serde_json::from_str(&body).unwrap()
    }

    /// Polls `/sim/state` (bounded: 10 s) until `pred` holds; returns that state.
    pub async fn wait_state(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        for _ in 0..1000 {
            let s = self.state().await;
            if pred(&s) {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("state never reached: {what}; last: {}", self.state().await);
    }

    /// The whole (non-streamed) chat answer's text; panics unless 200.
    pub async fn chat_text(&self, model: &str, prompt: &str) -> String {
        let (status, body) = self
            .post("/v1/chat/completions", chat(model, prompt, false))
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    pub fn child(&mut self) -> &mut tokio::process::Child {
        self.child.as_mut().unwrap()
    }
}

/// A chat request body.
pub fn chat(model: &str, prompt: &str, stream: bool) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "stream": stream,
    })
}

pub async fn call(method: Method, url: &str, body: Option<Value>) -> (StatusCode, String) {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let body = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
    let req = Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json")
        .body(Full::new(body))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}

/// The `data:` payloads of an SSE body.
pub fn sse_events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not SSE: {e:?}"))
                .to_owned()
        })
        .collect()
}

/// The text of chat or completion stream chunks, concatenated.
pub fn stream_text(events: &[String]) -> String {
    events
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
        .filter_map(|v| {
            let c = &v["choices"][0];
            c["delta"]["content"]
                .as_str()
                .or(c["text"].as_str())
                .map(str::to_owned)
        })
        .collect()
}

/// A streamed response on its own connection, read chunk by chunk; dropping or
/// [`OpenStream::disconnect`] closes the socket.
pub struct OpenStream {
    pub status: StatusCode,
    body: Incoming,
    buf: String,
    conn: JoinHandle<()>,
    _send: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
}

impl OpenStream {
    pub async fn open(addr: SocketAddr, path: &str, body: Value) -> OpenStream {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
            .await
            .unwrap();
        let conn = tokio::spawn(async move {
            let _ = conn.await;
        });
        let req = Request::builder()
            .method(Method::POST)
            .uri(path)
            .header("host", addr.to_string())
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap();
        let resp = send.send_request(req).await.unwrap();
        OpenStream {
            status: resp.status(),
            body: resp.into_body(),
            buf: String::new(),
            conn,
            _send: send,
        }
    }

    /// The next SSE event's payload, `None` at the end of the body.
    pub async fn next_event(&mut self) -> Option<String> {
        loop {
            if let Some(pos) = self.buf.find("\n\n") {
                let event: String = self.buf.drain(..pos + 2).collect();
                return Some(event.trim_end().strip_prefix("data: ").unwrap().to_owned());
            }
            match self.body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.push_str(std::str::from_utf8(&data).unwrap());
                    }
                }
                _ => return None,
            }
        }
    }

    /// Closes the connection at once.
    pub fn disconnect(self) {
        self.conn.abort();
    }
}

/// Sends a request on a raw socket and returns the socket without reading: dropping it
/// hangs up on a request the server is still working on.
pub async fn raw_request(addr: SocketAddr, path: &str, body: Value) -> TcpStream {
    use tokio::io::AsyncWriteExt;
    let body = body.to_string();
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    tcp.write_all(body.as_bytes()).await.unwrap();
    tcp
}
