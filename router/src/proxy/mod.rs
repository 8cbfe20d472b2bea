//! The OpenAI-compatible listener: routes each request by its body's `model`, waits for an
//! [`Admission`] permit, forwards the same bytes to the engine and streams the answer back.
//!
//! ```text
//! client ──► read body (≤ max_body_bytes) ──► `model` ──► resolve ──► admit (≤ deadline)
//!        ◄── answer, frame by frame ◄── DirectBody / pump+StreamBody ◄── upstream pool ◄──┘
//! ```
//!
//! Decisions (see also the module docs of `body`):
//! - The request deadline runs from arrival to the first output: reading the body, waiting for
//!   the permit, the engine's response head and, for a stream, its first real output. The
//!   opening chunk that only names the assistant role is held back, not forwarded: the response
//!   head goes out with the first real output, so a deadline that passes before it is always a
//!   plain `503 unavailable` (`QueueDeadline`), never a broken stream. Before the first output
//!   at most one piece (`max_piece`) is held; more is treated as an oversized piece.
//! - A non-streamed answer's first output is its response head (the engine sends it with the
//!   body); after it, `stream_idle_timeout` bounds each silence of the body.
//! - A streamed answer ends early, and the request is cut, when the client goes away, reads
//!   nothing for `read_stall` (its connection is then closed), a piece passes `max_piece`, or
//!   the engine is silent past `stream_idle_timeout`. The last two, and an engine that breaks
//!   off, end the stream with an SSE error event `data: {"error":{"code","message",
//!   "retryable"}}` (codes `piece_too_large`, `stream_idle_timeout`, `upstream_failed`).
//! - An engine that cannot be reached, or breaks off before any output, is answered
//!   `502 upstream_unavailable` (`ApiError::UpstreamUnavailable`). Every abnormal end calls
//!   `Permit::cut`.
//! - An observer ([`Proxy::with_observer`]) hears of every request once, when it ends (see
//!   [`crate::observe`]).
//! - NB: "reads nothing" is seen through back-pressure: the kernel's socket buffers and hyper's
//!   write buffer take some hundreds of KiB before the pump's channel fills, so a slow stream
//!   is noticed `read_stall` after those filled, not after the client's last read.

mod body;
mod sse;
mod upstream;

use std::borrow::Cow;
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use capyctl_crds::errors::ApiError;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, mpsc, oneshot, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

pub use body::ProxyBody;

use crate::admission::{Admission, Permit};
use crate::observe::{self, RequestObserver};
use body::{Charge, CutOnDrop, DirectBody, PumpSettings, Start, StreamBody, Track, Watch};

/// The listener's bounds. The lead maps the settings (`resource_policy.queue.*`) into it; the
/// fixed ones (`read_stall`, `max_piece`) are fields only so that tests can shorten them.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// From arrival to the first output (waiting, switch and prefill included):
    /// `request_deadline`, default 600 s (the server's; standalone's is 1800 s).
    pub request_deadline: Duration,
    /// Longest silence in an answer after its first output: `stream_idle_timeout`, 120 s.
    pub stream_idle_timeout: Duration,
    /// Largest request body: `max_buffered_bytes_total`, 64 MiB. Larger is answered 413.
    pub max_body_bytes: u64,
    /// A streamed answer whose client takes nothing for this long is cut: 10 s, fixed.
    pub read_stall: Duration,
    /// A streamed answer with a piece (SSE event) larger than this is cut: 64 KiB, fixed.
    pub max_piece: usize,
    /// Idle connections kept per engine instance; at least the 32 in-flight requests.
    pub upstream_idle_per_host: usize,
    /// How long [`serve`] lets answers in progress finish after the shutdown signal.
    pub shutdown_grace: Duration,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            request_deadline: Duration::from_secs(600),
            stream_idle_timeout: Duration::from_secs(120),
            max_body_bytes: 64 * 1024 * 1024,
            read_stall: Duration::from_secs(10),
            max_piece: 64 * 1024,
            upstream_idle_per_host: 64,
            shutdown_grace: Duration::from_secs(30),
        }
    }
}

/// One line of `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModelEntry {
    /// The name requests put in `model`.
    pub id: String,
    /// The deployment's ID.
    pub deployment_id: String,
    /// Its state as `capyctl list deployments` shows it (`ready`, `parked`, `stopped`, ...).
    pub state: String,
}

/// Lists every deployment with its state, for `GET /v1/models`. Any
/// `Fn() -> Vec<ModelEntry>` is one.
pub trait ModelCatalog: Send + Sync + 'static {
    /// Every deployment the listener serves, with its state now.
    fn models(&self) -> Vec<ModelEntry>;
}

impl<F> ModelCatalog for F
where
    F: Fn() -> Vec<ModelEntry> + Send + Sync + 'static,
{
    fn models(&self) -> Vec<ModelEntry> {
        self()
    }
}

/// The listener: cheap to clone (one `Arc`), shared by every connection.
pub struct Proxy<A: Admission> {
    shared: Arc<Shared<A>>,
    /// Told of every request when it ends.
    observer: Option<Arc<dyn RequestObserver>>,
}

impl<A: Admission> Clone for Proxy<A> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
            observer: self.observer.clone(),
        }
    }
}

/// What every request reads; nothing in it changes after construction.
struct Shared<A> {
    admission: A,
    catalog: Box<dyn ModelCatalog>,
    config: ProxyConfig,
    /// Keep-alive connections to the engines (`upstream_idle_per_host` idle per engine).
    pool: Arc<upstream::Pool>,
}

/// The routes of the inference API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    /// POST, forwarded by `model`.
    Forward,
    /// GET /v1/models.
    Models,
}

fn route(path: &str) -> Option<Route> {
    match path {
        "/v1/chat/completions" | "/v1/completions" | "/v1/embeddings" => Some(Route::Forward),
        "/v1/models" => Some(Route::Models),
        _ => None,
    }
}

impl<A: Admission> Proxy<A> {
    /// A listener that asks `admission` for permits and lists `catalog` on `GET /v1/models`.
    pub fn new(admission: A, catalog: impl ModelCatalog, config: ProxyConfig) -> Self {
        let pool = upstream::Pool::new(
            config.upstream_idle_per_host.max(32),
            upstream::IDLE_TIMEOUT,
        );
        Self {
            shared: Arc::new(Shared {
                admission,
                catalog: Box::new(catalog),
                config,
                pool,
            }),
            observer: None,
        }
    }

    /// Tells `observer` of every request, exactly once, when it ends.
    pub fn with_observer(mut self, observer: Arc<dyn RequestObserver>) -> Self {
        self.observer = Some(observer);
        self
    }

    /// The bounds in force.
    pub fn config(&self) -> &ProxyConfig {
        &self.shared.config
    }

    /// Answers one request, without a socket (the listener's `oneshot`). Streamed answers that
    /// stall cannot close a connection here; [`serve`] can.
    pub async fn handle<B>(&self, request: Request<B>) -> Response<ProxyBody>
    where
        B: Body<Data = Bytes> + Send,
        B::Error: std::fmt::Display,
    {
        self.handle_on(request, None).await
    }

    async fn handle_on<B>(
        &self,
        request: Request<B>,
        kill: Option<Arc<Notify>>,
    ) -> Response<ProxyBody>
    where
        B: Body<Data = Bytes> + Send,
        B::Error: std::fmt::Display,
    {
        let arrival = Instant::now();
        let mut watch = Watch::new(self.observer.as_ref());
        match self.answer(request, arrival, kill, &mut watch).await {
            Ok(response) => {
                // A fixed body (`/v1/models`, a stream that ended before output): over now.
                watch.end(response.status().as_u16(), None);
                response
            }
            Err(failure) => {
                watch.end(failure.status(), Some(failure.code()));
                failure.response()
            }
        }
    }

    async fn answer<B>(
        &self,
        request: Request<B>,
        arrival: Instant,
        kill: Option<Arc<Notify>>,
        watch: &mut Watch,
    ) -> Result<Response<ProxyBody>, Failure>
    where
        B: Body<Data = Bytes> + Send,
        B::Error: std::fmt::Display,
    {
        let shared = &*self.shared;
        let config = &shared.config;
        let (mut parts, body) = request.into_parts();
        match (route(parts.uri.path()), &parts.method) {
            (Some(Route::Forward), &Method::POST) => {}
            (Some(Route::Models), &Method::GET) => return Ok(self.models()),
            (Some(_), _) => return Err(Failure::MethodNotAllowed),
            (None, _) => {
                return Err(Failure::Api(ApiError::NotFound {
                    what: format!("route {} {}", parts.method, parts.uri.path()),
                }));
            }
        }

        let deadline = arrival + config.request_deadline;
        let body =
            match tokio::time::timeout_at(deadline, read_body(body, config.max_body_bytes)).await {
                Ok(body) => body?,
                Err(_) => {
                    return Err(Failure::Api(ApiError::InvalidRequest {
                        detail: "the body did not arrive within the request deadline".to_string(),
                    }));
                }
            };
        let model = model_of(&body)?;
        watch.model(&model);
        let Some(deployment) = shared.admission.resolve(&model) else {
            return Err(Failure::Api(ApiError::ModelNotFound {
                model: model.into_owned(),
            }));
        };
        drop(model);
        let deployment_id = deployment.id.clone();
        watch.deployment(&deployment_id);
        watch.asking();
        // The admission enforces the deadline itself (and tells which error applies); the
        // grace only keeps a request from hanging should it not.
        let admitted = tokio::time::timeout_at(
            deadline + ADMIT_GRACE,
            shared
                .admission
                .admit(deployment, body.len() as u64, deadline),
        )
        .await;
        watch.answered();
        let permit = match admitted {
            Ok(permit) => permit.map_err(Failure::Api)?,
            Err(_) => {
                return Err(Failure::Api(ApiError::QueueDeadline {
                    deployment: deployment_id,
                }));
            }
        };

        let addr = permit.upstream().addr;
        let uri = origin_form(&parts.uri);
        strip_hop_by_hop(&mut parts.headers);
        parts.headers.remove(header::HOST);
        parts.headers.remove(header::EXPECT);
        parts.uri = uri;
        parts.version = http::Version::HTTP_11;
        let forward = Request::from_parts(parts, Full::new(body));

        let charge: Arc<dyn Track> = Arc::new(Charge::new(permit));
        let guard = CutOnDrop(Some(Arc::clone(&charge)));
        // Boxed: this future is large and lives only from here on, so the request's future
        // stays small while it waits for its admission (4096 may wait).
        let sent = Box::pin(shared.pool.request(addr, forward));
        let response = match tokio::time::timeout_at(deadline, sent).await {
            Ok(Ok(response)) => response,
            Ok(Err(err)) => {
                tracing::debug!(error = %err, "engine unreachable");
                charge.cut(false, "upstream_unavailable");
                return Err(Failure::upstream(&err));
            }
            Err(_) => {
                charge.cut(false, "queue_deadline");
                return Err(Failure::Api(ApiError::QueueDeadline {
                    deployment: deployment_id,
                }));
            }
        };
        let (mut head, upstream) = response.into_parts();
        strip_hop_by_hop(&mut head.headers);

        if !is_event_stream(&head.headers) {
            let charge = guard.disarm();
            charge.output();
            watch.hand_to(&*charge, head.status.as_u16(), false);
            let body = DirectBody::new(upstream, charge, config.stream_idle_timeout);
            return Ok(Response::from_parts(head, ProxyBody::direct(body)));
        }

        head.headers.remove(header::CONTENT_LENGTH);
        let charge = guard.disarm();
        let (start_tx, start_rx) = oneshot::channel();
        let (tx, rx) = mpsc::channel(1);
        let settings = PumpSettings {
            deadline,
            deployment: deployment_id,
            idle: config.stream_idle_timeout,
            read_stall: config.read_stall,
            max_piece: config.max_piece,
            kill,
        };
        tokio::spawn(body::pump(
            upstream,
            Arc::clone(&charge),
            settings,
            start_tx,
            tx,
        ));
        match start_rx.await {
            Ok(Start::Stream(first)) => {
                watch.hand_to(&*charge, head.status.as_u16(), true);
                let body = StreamBody::new(first, rx, charge);
                Ok(Response::from_parts(head, ProxyBody::stream(body)))
            }
            Ok(Start::Whole(bytes)) => {
                head.headers
                    .insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
                Ok(Response::from_parts(head, ProxyBody::full(bytes)))
            }
            Ok(Start::Fail(failure)) => Err(failure),
            Err(_) => {
                charge.cut(false, observe::UPSTREAM_FAILED);
                Err(Failure::Api(ApiError::UpstreamUnavailable {
                    detail: "its answer was lost".to_string(),
                }))
            }
        }
    }

    fn models(&self) -> Response<ProxyBody> {
        #[derive(Serialize)]
        struct Line<'a> {
            id: &'a str,
            object: &'static str,
            created: u64,
            owned_by: &'static str,
            deployment_id: &'a str,
            state: &'a str,
        }
        #[derive(Serialize)]
        struct List<'a> {
            object: &'static str,
            data: Vec<Line<'a>>,
        }
        let models = self.shared.catalog.models();
        let list = List {
            object: "list",
            data: models
                .iter()
                .map(|m| Line {
                    id: &m.id,
                    object: "model",
                    created: 0,
                    owned_by: "capyctl",
                    deployment_id: &m.deployment_id,
                    state: &m.state,
                })
                .collect(),
        };
        let body = serde_json::to_vec(&list).unwrap_or_default();
        json_response(StatusCode::OK, body)
    }
}

/// How long past the request deadline the listener still waits for the admission's own answer.
const ADMIT_GRACE: Duration = Duration::from_secs(1);

/// Why a request is answered with an error.
#[derive(Debug)]
pub(crate) enum Failure {
    /// One of the catalogue's errors.
    Api(ApiError),
    /// A route of the API with the wrong method.
    MethodNotAllowed,
}

impl Failure {
    /// The engine could not be reached or broke off before any output.
    fn upstream(err: &dyn std::fmt::Display) -> Self {
        Failure::Api(ApiError::UpstreamUnavailable {
            detail: err.to_string(),
        })
    }

    /// The status it is answered with.
    fn status(&self) -> u16 {
        match self {
            Failure::Api(err) => err.status(),
            Failure::MethodNotAllowed => 405,
        }
    }

    /// Its code, for the body and the observer.
    pub(crate) fn code(&self) -> &'static str {
        match self {
            Failure::Api(err) => err.code(),
            Failure::MethodNotAllowed => observe::METHOD_NOT_ALLOWED,
        }
    }

    fn response(self) -> Response<ProxyBody> {
        match self {
            Failure::Api(err) => error_response(&err),
            Failure::MethodNotAllowed => render_error(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "this route takes POST (GET for /v1/models)",
                false,
                None,
            ),
        }
    }
}

/// The one rendering of a catalogue error: its status, the JSON body
/// `{"code","message","retryable"}` and, on every 429, `Retry-After: 1`.
pub fn error_response(err: &ApiError) -> Response<ProxyBody> {
    let status = StatusCode::from_u16(err.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    render_error(
        status,
        err.code(),
        &err.message(),
        err.retryable(),
        err.retry_after(),
    )
}

fn render_error(
    status: StatusCode,
    code: &str,
    message: &str,
    retryable: bool,
    retry_after: Option<u32>,
) -> Response<ProxyBody> {
    #[derive(Serialize)]
    struct ErrorBody<'a> {
        code: &'a str,
        message: &'a str,
        retryable: bool,
    }
    let body = serde_json::to_vec(&ErrorBody {
        code,
        message,
        retryable,
    })
    .unwrap_or_default();
    let mut response = json_response(status, body);
    if let Some(seconds) = retry_after {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    }
    response
}

fn json_response(status: StatusCode, body: Vec<u8>) -> Response<ProxyBody> {
    let mut response = Response::new(ProxyBody::full(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// Reads the request body, refusing one over `limit` bytes (413) before reading it when its
/// length is declared.
async fn read_body<B>(body: B, limit: u64) -> Result<Bytes, Failure>
where
    B: Body<Data = Bytes>,
    B::Error: std::fmt::Display,
{
    let too_large = || Failure::Api(ApiError::RequestTooLarge { limit });
    if body.size_hint().lower() > limit {
        return Err(too_large());
    }
    let mut body = std::pin::pin!(body);
    let mut first: Option<Bytes> = None;
    let mut more: Option<BytesMut> = None;
    let mut total: u64 = 0;
    while let Some(frame) = body.as_mut().frame().await {
        let frame = frame.map_err(|err| {
            Failure::Api(ApiError::InvalidRequest {
                detail: format!("the body could not be read: {err}"),
            })
        })?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        total += data.len() as u64;
        if total > limit {
            return Err(too_large());
        }
        match (&mut first, &mut more) {
            (None, _) => first = Some(data),
            (Some(head), None) => {
                let mut buf = BytesMut::with_capacity(head.len() + data.len());
                buf.extend_from_slice(head);
                buf.extend_from_slice(&data);
                more = Some(buf);
            }
            (Some(_), Some(buf)) => buf.extend_from_slice(&data),
        }
    }
    Ok(match more {
        Some(buf) => buf.freeze(),
        None => first.unwrap_or_default(),
    })
}

/// The body's `model`, parsed without building the rest of the document.
fn model_of(body: &[u8]) -> Result<Cow<'_, str>, Failure> {
    #[derive(Deserialize)]
    struct Head<'a> {
        #[serde(borrow)]
        model: Option<Cow<'a, str>>,
    }
    let invalid = |detail: String| Failure::Api(ApiError::InvalidRequest { detail });
    match body.iter().find(|b| !b.is_ascii_whitespace()) {
        None => {
            return Err(invalid(
                "the body is empty: expected a JSON object with a `model`".to_string(),
            ));
        }
        Some(b'{') => {}
        Some(_) => {
            return Err(invalid(
                "the body is not a JSON object: expected a JSON object with a `model`".to_string(),
            ));
        }
    }
    match serde_json::from_slice::<Head<'_>>(body) {
        Ok(Head { model: Some(model) }) if !model.is_empty() => Ok(model),
        Ok(Head { model: Some(_) }) => Err(invalid("the body's `model` is empty".to_string())),
        Ok(Head { model: None }) => Err(invalid("the body has no `model`".to_string())),
        Err(err) if err.is_data() => Err(invalid(format!(
            "the body's `model` must be a string: {err}"
        ))),
        Err(err) => Err(invalid(format!("the body is not valid JSON: {err}"))),
    }
}

/// The request's path and query (origin-form, as an HTTP/1.1 request line to the engine has it).
fn origin_form(original: &Uri) -> Uri {
    let mut parts = http::uri::Parts::default();
    parts.path_and_query = Some(
        original
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/")),
    );
    Uri::from_parts(parts).unwrap_or_else(|_| Uri::from_static("/"))
}

/// Headers of one hop only, never forwarded (RFC 9110 §7.6.1).
const HOP_BY_HOP: [HeaderName; 6] = [
    header::CONNECTION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHORIZATION,
];

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    if headers.is_empty() {
        return;
    }
    // Headers the `Connection` header names are hop-by-hop too.
    if let Some(connection) = headers.get(header::CONNECTION) {
        let named: Vec<HeaderName> = connection
            .to_str()
            .unwrap_or_default()
            .split(',')
            .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
            .collect();
        for name in named {
            headers.remove(name);
        }
    }
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
    headers.remove("keep-alive");
    headers.remove("proxy-connection");
}

fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.as_bytes().get(..17))
        .is_some_and(|v| v.eq_ignore_ascii_case(b"text/event-stream"))
}

/// Serves the listener on `listener` until `shutdown` resolves; then stops accepting, lets
/// answers in progress finish for at most `shutdown_grace`, and drops what is left.
pub async fn serve<A: Admission>(
    listener: TcpListener,
    proxy: Proxy<A>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let (stop_tx, stop_rx) = watch::channel(());
    let mut connections = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    connections.spawn(connection(stream, proxy.clone(), stop_rx.clone()));
                }
                Err(err) => {
                    // Out of file descriptors and the like: back off a little.
                    tracing::warn!(error = %err, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            },
        }
    }
    drop(listener);
    drop(stop_tx);
    let grace = proxy.shared.config.shutdown_grace;
    let drained = tokio::time::timeout(grace, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            connections = connections.len(),
            "answers still in progress after the shutdown grace; dropping them"
        );
        connections.shutdown().await;
    }
    Ok(())
}

/// One client connection: HTTP/1.1 with keep-alive. `kill` closes it at once (a stalled
/// streamed answer); a change on `stop` shuts it down gracefully.
async fn connection<A: Admission>(
    stream: TcpStream,
    proxy: Proxy<A>,
    mut stop: watch::Receiver<()>,
) {
    if let Err(err) = stream.set_nodelay(true) {
        tracing::debug!(error = %err, "TCP_NODELAY");
    }
    let kill = Arc::new(Notify::new());
    let service = {
        let kill = Arc::clone(&kill);
        hyper::service::service_fn(move |request: Request<Incoming>| {
            let proxy = proxy.clone();
            let kill = Arc::clone(&kill);
            async move { Ok::<_, Infallible>(proxy.handle_on(request, Some(kill)).await) }
        })
    };
    let conn =
        hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service);
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        result = conn.as_mut() => {
            if let Err(err) = result {
                tracing::debug!(error = %err, "client connection ended");
            }
            return;
        }
        () = kill.notified() => return,
        _ = stop.changed() => conn.as_mut().graceful_shutdown(),
    }
    tokio::select! {
        _ = conn.as_mut() => {}
        () = kill.notified() => {}
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn detail(result: Result<Cow<'_, str>, Failure>) -> String {
        match result {
            Err(Failure::Api(ApiError::InvalidRequest { detail })) => detail,
            other => panic!("expected invalid_request, got {other:?}"),
        }
    }

    #[test]
    fn model_is_read_without_the_rest() {
        let body = br#"{"messages":[{"role":"user","content":"hi \"x\""}],"model":"chat-a","stream":true}"#;
        assert_eq!(model_of(body).unwrap(), "chat-a");
        assert_eq!(model_of(br#" {"model":"a\u00e9"}"#).unwrap(), "a\u{e9}");
    }

    #[test]
    fn bad_bodies_say_what_is_wrong() {
        assert!(detail(model_of(b"")).contains("empty"));
        assert!(detail(model_of(b"[1]")).contains("not a JSON object"));
        assert!(detail(model_of(b"{\"model\":")).contains("not valid JSON"));
        assert!(detail(model_of(br#"{"prompt":"x"}"#)).contains("no `model`"));
        assert!(detail(model_of(br#"{"model":5}"#)).contains("must be a string"));
        assert!(detail(model_of(br#"{"model":""}"#)).contains("empty"));
    }

    #[test]
    fn hop_by_hop_headers_are_dropped() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-hop"),
        );
        headers.insert("x-hop", HeaderValue::from_static("1"));
        headers.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        headers.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer x"));
        strip_hop_by_hop(&mut headers);
        assert_eq!(headers.len(), 1);
        assert!(headers.contains_key(header::AUTHORIZATION));
    }

    #[test]
    fn a_429_says_retry_after() {
        let response = error_response(&ApiError::BufferedBytes);
        assert_eq!(response.status(), 429);
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        let response = error_response(&ApiError::DispatchClosed {
            deployment: "d".into(),
        });
        assert_eq!(response.status(), 503);
        assert!(!response.headers().contains_key(header::RETRY_AFTER));
    }
}
