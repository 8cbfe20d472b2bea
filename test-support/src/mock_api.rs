//! One scripted mock Kubernetes API server for the unit tests, on `tower_test::mock::pair`.
//!
//! A test builds a [`MockApi`] and a client ([`MockApi::client`], or [`MockApi::pair`] for a
//! service to wrap in its own layers), then either hands it a whole script of [`Exchange`]s to
//! answer in order in a task ([`MockApi::serve`]), or answers the calls one at a time between
//! its own steps ([`MockApi::answer`]). Each exchange names the method and path it expects
//! (optionally query pairs and body fields) and what it answers: a status and a JSON body, a
//! watch's events, an answer computed from the call, or no answer at all (a hung call). A call
//! that is not the one expected fails the test with a message naming both. What was asked is
//! kept ([`Seen`]) for the test's own assertions.
//!
//! For a program that needs a real URL (a binary with a kubeconfig), [`MockApi::listen`] puts
//! the same mock behind a loopback HTTP listener; [`MockApi::serve_with`] answers every call
//! with a function, for a fake that keeps state between calls.

use std::convert::Infallible;
use std::fmt;
use std::net::SocketAddr;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response};
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use kube::Client;
use kube::client::Body;
use tokio::task::JoinHandle;
use tower_test::mock::{self, Handle, Mock, SendResponse};

/// The client side of the mock: a `tower::Service` of HTTP requests, for [`kube::Client::new`]
/// (wrapped in the caller's layers if it wants).
pub type MockService = Mock<Request<Body>, Response<Body>>;

/// How a call is answered once taken off the mock.
type Reply = SendResponse<Response<Body>>;

/// A function answering a call from what was asked.
pub type AnswerFn = Box<dyn FnOnce(&Seen) -> (u16, serde_json::Value) + Send>;

/// What an [`Exchange`] answers.
pub enum Answer {
    /// This status with this JSON body.
    Json {
        /// The HTTP status.
        status: u16,
        /// The JSON body.
        body: serde_json::Value,
    },
    /// This status with these bytes as they are, as `application/json` (a body a test wrote
    /// as text).
    Raw {
        /// The HTTP status.
        status: u16,
        /// The body.
        body: Bytes,
    },
    /// A watch stream: 200 with one `{"type": ..., "object": ...}` line per event, then its end
    /// (the client watches again).
    Events(Vec<(String, serde_json::Value)>),
    /// A status and JSON body computed from the call (an apply that answers its body, say).
    With(AnswerFn),
    /// No answer: the call hangs while the [`MockApi`] lives (a watch with nothing to say, a
    /// server that does not answer in time).
    Hang,
}

impl fmt::Debug for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Json { status, body } => write!(f, "{status} {body}"),
            Self::Raw { status, body } => {
                write!(f, "{status} {}", String::from_utf8_lossy(body))
            }
            Self::Events(events) => write!(f, "a watch of {} event(s)", events.len()),
            Self::With(_) => f.write_str("an answer computed from the call"),
            Self::Hang => f.write_str("no answer"),
        }
    }
}

/// A check on a call besides its method and path.
#[derive(Debug, Clone)]
enum Check {
    /// The query has `key=value` (decoded).
    Query(String, String),
    /// The query has no `key`.
    NoQuery(String),
    /// The JSON body has `value` at this JSON pointer.
    Body(String, serde_json::Value),
}

/// One expected call and its answer.
#[derive(Debug)]
pub struct Exchange {
    /// The method expected.
    pub method: Method,
    /// The path expected (without the query).
    pub path: String,
    /// `path` is a prefix of the call's path (a name the client makes up).
    pub prefix: bool,
    checks: Vec<Check>,
    /// What it answers.
    pub answer: Answer,
}

impl Exchange {
    /// `method path` answered `status` with the JSON `body`.
    pub fn new(method: Method, path: &str, status: u16, body: serde_json::Value) -> Self {
        Self::answering(method, path, Answer::Json { status, body })
    }

    /// `method path` answered 200 with the JSON `body`.
    pub fn ok(method: Method, path: &str, body: serde_json::Value) -> Self {
        Self::new(method, path, 200, body)
    }

    /// A call whose path begins with `prefix`, answered 200 with `body`.
    pub fn ok_under(method: Method, prefix: &str, body: serde_json::Value) -> Self {
        Self {
            prefix: true,
            ..Self::ok(method, prefix, body)
        }
    }

    /// `method path` answered with `answer`.
    pub fn answering(method: Method, path: &str, answer: Answer) -> Self {
        Self {
            method,
            path: path.to_string(),
            prefix: false,
            checks: Vec::new(),
            answer,
        }
    }

    /// A watch call (`GET path?watch=true`) answered with these events (`ADDED`, `MODIFIED`,
    /// `DELETED`, each with its object), after which the stream ends.
    pub fn watch(path: &str, events: &[(&str, serde_json::Value)]) -> Self {
        let events = events
            .iter()
            .map(|(kind, object)| ((*kind).to_string(), object.clone()))
            .collect();
        Self::answering(Method::GET, path, Answer::Events(events)).query("watch", "true")
    }

    /// `method path`, never answered while the [`MockApi`] lives.
    pub fn hang(method: Method, path: &str) -> Self {
        Self::answering(method, path, Answer::Hang)
    }

    /// `method path`, answered by `answer` from the call.
    pub fn with(
        method: Method,
        path: &str,
        answer: impl FnOnce(&Seen) -> (u16, serde_json::Value) + Send + 'static,
    ) -> Self {
        Self::answering(method, path, Answer::With(Box::new(answer)))
    }

    /// Expects the query pair `key=value` (compared decoded).
    #[must_use]
    pub fn query(mut self, key: &str, value: &str) -> Self {
        self.checks
            .push(Check::Query(key.to_string(), value.to_string()));
        self
    }

    /// Expects no query parameter `key`.
    #[must_use]
    pub fn no_query(mut self, key: &str) -> Self {
        self.checks.push(Check::NoQuery(key.to_string()));
        self
    }

    /// Expects `value` at the JSON `pointer` of the body (`/metadata/name`).
    #[must_use]
    pub fn body(mut self, pointer: &str, value: serde_json::Value) -> Self {
        self.checks.push(Check::Body(pointer.to_string(), value));
        self
    }

    /// Why `call` is not this exchange; `None` when it is.
    fn mismatch(&self, call: &Seen) -> Option<String> {
        let path_ok = if self.prefix {
            call.path.starts_with(&self.path)
        } else {
            call.path == self.path
        };
        if call.method != self.method || !path_ok {
            return Some("another method or path".into());
        }
        self.checks.iter().find_map(|check| match check {
            Check::Query(key, value) => match call.query_value(key) {
                Some(v) if &v == value => None,
                got => Some(format!("query {key}={value} expected, got {got:?}")),
            },
            Check::NoQuery(key) => call
                .query_value(key)
                .map(|v| format!("no query {key} expected, got {key}={v}")),
            Check::Body(pointer, value) => match call.body.pointer(pointer) {
                Some(v) if v == value => None,
                got => Some(format!("body {pointer} = {value} expected, got {got:?}")),
            },
        })
    }
}

impl fmt::Display for Exchange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.method, self.path)?;
        if self.prefix {
            f.write_str("...")?;
        }
        for check in &self.checks {
            match check {
                Check::Query(k, v) => write!(f, " [?{k}={v}]")?,
                Check::NoQuery(k) => write!(f, " [no ?{k}]")?,
                Check::Body(p, v) => write!(f, " [body {p} = {v}]")?,
            }
        }
        Ok(())
    }
}

/// A call as the mock saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    /// Its method.
    pub method: Method,
    /// Its path, without the query.
    pub path: String,
    /// Its query, as sent (percent-encoded); empty when there was none.
    pub query: String,
    /// Its `content-type`.
    pub content_type: Option<String>,
    /// Its headers.
    pub headers: HeaderMap,
    /// Its JSON body; `Null` when there was none, a string when it was not JSON.
    pub body: serde_json::Value,
    /// Its body as it came.
    pub raw_body: Bytes,
}

impl Seen {
    /// The query's pairs, decoded, in order.
    pub fn query_pairs(&self) -> Vec<(String, String)> {
        self.query
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|p| {
                let (k, v) = p.split_once('=').unwrap_or((p, ""));
                (percent_decode(k), percent_decode(v))
            })
            .collect()
    }

    /// The decoded value of the query parameter `key`, if any.
    pub fn query_value(&self, key: &str) -> Option<String> {
        self.query_pairs()
            .into_iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
    }

    /// The header `name`, if any and text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The body as JSON text (`""` when there was none).
    pub fn body_text(&self) -> String {
        match &self.body {
            serde_json::Value::Null => String::new(),
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        }
    }
}

impl fmt::Display for Seen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.method, self.path)?;
        if !self.query.is_empty() {
            write!(f, "?{}", self.query)?;
        }
        if !self.body.is_null() {
            write!(f, " with body {}", self.body)?;
        }
        Ok(())
    }
}

/// `%XX` and `+` decoded (what a query holds).
fn percent_decode(s: &str) -> String {
    let hex = |b: u8| (b as char).to_digit(16);
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push((h * 16 + l) as u8);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A `Status` error body as the API server sends it.
pub fn status_body(code: u16, reason: &str, message: &str) -> serde_json::Value {
    serde_json::json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    })
}

/// The server side of the mock API: takes the client's calls and answers them.
pub struct MockApi {
    handle: Handle<Request<Body>, Response<Body>>,
    /// Calls answered [`Answer::Hang`]: kept unanswered while this lives.
    held: Vec<Reply>,
    /// How many calls were answered.
    answered: usize,
}

impl fmt::Debug for MockApi {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MockApi")
            .field("answered", &self.answered)
            .field("held", &self.held.len())
            .finish()
    }
}

impl MockApi {
    /// A service for a client (to wrap in layers before [`kube::Client::new`]) and the mock
    /// that answers it.
    pub fn pair() -> (MockService, Self) {
        let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
        (service, Self::from_handle(handle))
    }

    /// A client with `default_namespace` whose calls go to the returned mock.
    pub fn client(default_namespace: &str) -> (Client, Self) {
        let (service, api) = Self::pair();
        (Client::new(service, default_namespace), api)
    }

    /// The mock answering the calls of `handle`'s service.
    pub fn from_handle(handle: Handle<Request<Body>, Response<Body>>) -> Self {
        Self {
            handle,
            held: Vec::new(),
            answered: 0,
        }
    }

    /// The next call and its reply; `None` when every client is gone.
    pub async fn next_call(&mut self) -> Option<(Seen, Reply)> {
        let (request, reply) = self.handle.next_request().await?;
        let (parts, body) = request.into_parts();
        let bytes = body
            .collect_bytes()
            .await
            .unwrap_or_else(|e| panic!("the mock API server could not read a body: {e}"));
        let body = if bytes.is_empty() {
            serde_json::Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap_or_else(|_| {
                serde_json::Value::String(String::from_utf8_lossy(&bytes).into_owned())
            })
        };
        let seen = Seen {
            method: parts.method,
            path: parts.uri.path().to_string(),
            query: parts.uri.query().unwrap_or_default().to_string(),
            content_type: parts
                .headers
                .get(http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string),
            headers: parts.headers,
            body,
            raw_body: bytes,
        };
        Some((seen, reply))
    }

    /// Takes the next call, checks that it is `expected` and answers it; what was asked.
    ///
    /// # Panics
    /// When no call comes (every client is gone) or the call is not `expected`: the message
    /// names the call and what was expected.
    pub async fn answer(&mut self, expected: Exchange) -> Seen {
        let n = self.answered + 1;
        let Some((seen, reply)) = self.next_call().await else {
            panic!(
                "mock API server: call {n} expected {expected}, but no call came (the client is gone)"
            );
        };
        if let Some(why) = expected.mismatch(&seen) {
            panic!("mock API server: unexpected call {n}: {seen}; expected {expected} ({why})");
        }
        self.respond(&seen, reply, expected.answer);
        seen
    }

    /// Answers `reply` to `seen` with `answer`.
    fn respond(&mut self, seen: &Seen, reply: Reply, answer: Answer) {
        self.answered += 1;
        let json = |status: u16, body: &serde_json::Value| {
            Response::builder()
                .status(status)
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(Body::from(body.to_string().into_bytes()))
                .unwrap_or_else(|e| panic!("mock API server: status {status}: {e}"))
        };
        let response = match answer {
            Answer::Json { status, body } => json(status, &body),
            Answer::Raw { status, body } => Response::builder()
                .status(status)
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(Body::from(body))
                .unwrap_or_else(|e| panic!("mock API server: status {status}: {e}")),
            Answer::With(f) => {
                let (status, body) = f(seen);
                json(status, &body)
            }
            Answer::Events(events) => {
                let mut text = String::new();
                for (kind, object) in events {
                    text.push_str(&serde_json::json!({"type": kind, "object": object}).to_string());
                    text.push('\n');
                }
                Response::builder()
                    .status(200)
                    .header(http::header::CONTENT_TYPE, "application/json")
                    .body(Body::from(text.into_bytes()))
                    .unwrap_or_else(|e| panic!("mock API server: a watch answer: {e}"))
            }
            Answer::Hang => {
                self.held.push(reply);
                return;
            }
        };
        reply.send_response(response);
    }

    /// Answers `script` in order in a task; the task's result is every call seen. It panics
    /// (failing the test that joins it) when a call is not the next one expected, or when the
    /// client goes before the script's end. Calls held ([`Answer::Hang`]) fail when the script
    /// ends.
    pub fn serve(mut self, script: Vec<Exchange>) -> JoinHandle<Vec<Seen>> {
        tokio::spawn(async move {
            let mut seen = Vec::with_capacity(script.len());
            for expected in script {
                seen.push(self.answer(expected).await);
            }
            seen
        })
    }

    /// Answers every call with `answer` in a task, until every client is gone; the task's
    /// result is every call seen. For a fake that keeps state between calls.
    pub fn serve_with(
        mut self,
        mut answer: impl FnMut(&Seen) -> Answer + Send + 'static,
    ) -> JoinHandle<Vec<Seen>> {
        tokio::spawn(async move {
            let mut seen = Vec::new();
            while let Some((call, reply)) = self.next_call().await {
                let a = answer(&call);
                self.respond(&call, reply, a);
                seen.push(call);
            }
            seen
        })
    }

    /// Answers exactly `calls` calls with `answer` in a task; the task's result is every call
    /// seen. It panics (failing the test that joins it) when the client goes before.
    pub fn serve_calls(
        mut self,
        calls: usize,
        mut answer: impl FnMut(&Seen) -> Answer + Send + 'static,
    ) -> JoinHandle<Vec<Seen>> {
        tokio::spawn(async move {
            let mut seen = Vec::with_capacity(calls);
            for n in 1..=calls {
                let Some((call, reply)) = self.next_call().await else {
                    panic!(
                        "mock API server: call {n} of {calls} expected, but no call came (the client is gone)"
                    );
                };
                let a = answer(&call);
                self.respond(&call, reply, a);
                seen.push(call);
            }
            seen
        })
    }

    /// The mock behind a loopback HTTP/1 listener (for a program that reads a kubeconfig):
    /// its URL (`http://127.0.0.1:PORT`) and the mock. The listener runs until the runtime
    /// ends; a call it cannot hand to the mock is answered 502.
    pub async fn listen() -> (String, Self) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("mock API server: cannot bind a loopback port: {e}"));
        let addr: SocketAddr = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("mock API server: no local address: {e}"));
        let (service, api) = Self::pair();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let service = service.clone();
                tokio::spawn(async move {
                    let handler = hyper::service::service_fn(move |request| {
                        forward(service.clone(), request)
                    });
                    let io = hyper_util::rt::TokioIo::new(stream);
                    // A client that goes away mid-call is no failure of the mock.
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(io, handler)
                        .await;
                });
            }
        });
        (format!("http://{addr}"), api)
    }
}

/// A listener's call handed to the mock, and its answer back.
async fn forward(
    mut service: MockService,
    request: Request<hyper::body::Incoming>,
) -> Result<Response<UnsyncBoxBody<Bytes, kube::Error>>, Infallible> {
    use tower::ServiceExt;

    let bad_gateway = |why: String| {
        let mut response = Response::new(
            http_body_util::Full::new(Bytes::from(why))
                .map_err(|never| match never {})
                .boxed_unsync(),
        );
        *response.status_mut() = http::StatusCode::BAD_GATEWAY;
        Ok(response)
    };
    let (parts, body) = request.into_parts();
    let bytes = match body.collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return bad_gateway(format!("mock API server: reading the body: {e}")),
    };
    let request = Request::from_parts(parts, Body::from(bytes));
    let service = match service.ready().await {
        Ok(s) => s,
        Err(e) => return bad_gateway(format!("mock API server: {e}")),
    };
    match tower::Service::call(service, request).await {
        Ok(response) => Ok(response.map(BodyExt::boxed_unsync)),
        Err(e) => bad_gateway(format!("mock API server: {e}")),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use k8s_openapi::api::core::v1::Pod;
    use kube::Api;
    use kube::api::{ListParams, Patch, PatchParams};
    use serde_json::json;

    use super::*;

    const PODS: &str = "/api/v1/namespaces/ns/pods";

    fn pod(name: &str) -> serde_json::Value {
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "ns"}})
    }

    fn list() -> serde_json::Value {
        json!({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "3"}, "items": [pod("a")]})
    }

    #[tokio::test]
    async fn a_script_is_answered_in_order_and_its_calls_are_kept() {
        let (client, api) = MockApi::client("ns");
        let server = api.serve(vec![
            Exchange::ok(Method::GET, PODS, list()).query("labelSelector", "app=x"),
            Exchange::new(
                Method::GET,
                &format!("{PODS}/b"),
                404,
                status_body(404, "NotFound", "pods \"b\" not found"),
            ),
            Exchange::with(Method::PATCH, &format!("{PODS}/c"), |seen| {
                (200, seen.body.clone())
            })
            .query("fieldManager", "me")
            .body("/metadata/name", json!("c")),
        ]);
        let pods: Api<Pod> = Api::default_namespaced(client);
        let listed = pods
            .list(&ListParams::default().labels("app=x"))
            .await
            .unwrap();
        assert_eq!(listed.items.len(), 1);
        assert!(pods.get_opt("b").await.unwrap().is_none());
        let patched = pods
            .patch("c", &PatchParams::apply("me"), &Patch::Apply(pod("c")))
            .await
            .unwrap();
        assert_eq!(patched.metadata.name.as_deref(), Some("c"));
        let seen = server.await.unwrap();
        assert_eq!(seen.len(), 3);
        assert_eq!(
            seen[0].query_value("labelSelector").as_deref(),
            Some("app=x")
        );
        assert_eq!(
            seen[2].content_type.as_deref(),
            Some("application/apply-patch+yaml")
        );
        assert_eq!(seen[2].to_string().split_whitespace().next(), Some("PATCH"));
    }

    #[tokio::test]
    async fn an_unexpected_call_fails_naming_it_and_what_was_expected() {
        let (client, api) = MockApi::client("ns");
        let server = api.serve(vec![Exchange::ok(Method::GET, "/api/v1/nodes", list())]);
        let pods: Api<Pod> = Api::default_namespaced(client);
        assert!(pods.get("a").await.is_err());
        let panic = server.await.unwrap_err().into_panic();
        let message = panic.downcast_ref::<String>().unwrap();
        assert_eq!(
            message,
            "mock API server: unexpected call 1: GET /api/v1/namespaces/ns/pods/a; \
             expected GET /api/v1/nodes (another method or path)"
        );
    }

    #[tokio::test]
    async fn a_query_check_names_what_differs() {
        let (client, api) = MockApi::client("ns");
        let server = api.serve(vec![
            Exchange::ok(Method::GET, PODS, list()).query("labelSelector", "app=y"),
        ]);
        let pods: Api<Pod> = Api::default_namespaced(client);
        assert!(
            pods.list(&ListParams::default().labels("app=x"))
                .await
                .is_err()
        );
        let panic = server.await.unwrap_err().into_panic();
        let message = panic.downcast_ref::<String>().unwrap();
        assert!(
            message.ends_with(
                "expected GET /api/v1/namespaces/ns/pods [?labelSelector=app=y] \
                 (query labelSelector=app=y expected, got Some(\"app=x\"))"
            ),
            "{message}"
        );
    }

    #[tokio::test]
    async fn a_missing_call_fails_naming_what_was_expected() {
        let (client, api) = MockApi::client("ns");
        let server = api.serve(vec![Exchange::ok(Method::GET, PODS, list())]);
        drop(client);
        let panic = server.await.unwrap_err().into_panic();
        let message = panic.downcast_ref::<String>().unwrap();
        assert_eq!(
            message,
            "mock API server: call 1 expected GET /api/v1/namespaces/ns/pods, but no call came \
             (the client is gone)"
        );
    }

    #[tokio::test]
    async fn watches_send_their_events_and_a_hung_call_waits() {
        use futures_util::StreamExt;

        let (client, mut api) = MockApi::client("ns");
        let pods: Api<Pod> = Api::default_namespaced(client);
        let watch = tokio::spawn(async move {
            let stream = pods
                .watch(&kube::api::WatchParams::default(), "3")
                .await
                .unwrap();
            stream
                .map(|e| match e.unwrap() {
                    kube::api::WatchEvent::Added(p) => {
                        format!("added {}", p.metadata.name.unwrap())
                    }
                    kube::api::WatchEvent::Deleted(p) => {
                        format!("deleted {}", p.metadata.name.unwrap())
                    }
                    other => format!("{other:?}"),
                })
                .collect::<Vec<_>>()
                .await
        });
        let seen = api
            .answer(Exchange::watch(
                PODS,
                &[("ADDED", pod("a")), ("DELETED", pod("a"))],
            ))
            .await;
        assert_eq!(seen.query_value("resourceVersion").as_deref(), Some("3"));
        assert_eq!(watch.await.unwrap(), ["added a", "deleted a"]);
    }

    #[tokio::test]
    async fn the_loopback_listener_serves_the_same_mock() {
        let (url, api) = MockApi::listen().await;
        let server = api.serve(vec![
            Exchange::ok(Method::GET, PODS, list()),
            Exchange::hang(Method::GET, &format!("{PODS}/slow")),
        ]);
        let config = kube::Config::new(url.parse().unwrap());
        let client = Client::try_from(config).unwrap();
        let pods: Api<Pod> = Api::namespaced(client, "ns");
        assert_eq!(
            pods.list(&ListParams::default()).await.unwrap().items.len(),
            1
        );
        // The held call is let go of (failed) when the script ends.
        assert!(pods.get("slow").await.is_err());
        let seen = server.await.unwrap();
        assert_eq!(seen[1].path, format!("{PODS}/slow"));
    }

    #[test]
    fn queries_are_decoded() {
        let seen = Seen {
            method: Method::GET,
            path: "/".into(),
            query: "fieldSelector=spec.nodeName%3Dgpu-1&labelSelector=a%2Fb&x=1+2&bad=%zz&end=%4"
                .into(),
            content_type: None,
            headers: HeaderMap::new(),
            body: serde_json::Value::Null,
            raw_body: Bytes::new(),
        };
        assert_eq!(
            seen.query_pairs(),
            [
                (
                    "fieldSelector".to_string(),
                    "spec.nodeName=gpu-1".to_string()
                ),
                ("labelSelector".into(), "a/b".into()),
                ("x".into(), "1 2".into()),
                ("bad".into(), "%zz".into()),
                ("end".into(), "%4".into()),
            ]
        );
        assert_eq!(seen.query_value("missing"), None);
    }
}
