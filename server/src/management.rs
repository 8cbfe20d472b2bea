//! The management listener (DESIGN 4.3, 4.5): `/management/v1` over [`ManagementApi`], the
//! admin token ([`load_or_create_token`]), health and Prometheus metrics.
//!
//! Routes (every one under [`PREFIX`] needs `Authorization: Bearer <admin token>`, or the token
//! in `X-CapyCTL-Token` where `Authorization` cannot carry it (the Kubernetes API server's
//! service proxy strips it), else 401 `unauthorized`; the token is compared in constant time):
//!
//! | route | answer |
//! |---|---|
//! | `GET /management/v1/deployments` | 200 `DeploymentList` |
//! | `POST /management/v1/deployments` | 201 `DeployReceipt` when created, 200 when updated or unchanged |
//! | `GET /management/v1/deployments/{name-or-id}` | 200 `DeploymentView` |
//! | `DELETE /management/v1/deployments/{name-or-id}` | 200 `DeploymentView` (as it was) |
//! | `POST /management/v1/deployments/{name-or-id}/start` | 200 `ActionReceipt`; optional body `StartRequest` |
//! | `POST /management/v1/deployments/{name-or-id}/{stop,park,preinitialize}` | 200 `ActionReceipt` |
//! | `GET /management/v1/engines` | 200 `EngineList` |
//! | `GET /management/v1/hosts` | 200 `HostList` |
//! | `POST /management/v1/hosts/{id}/{drain,uncordon}` | 200 `HostDrainReceipt` |
//! | `GET /management/v1/metrics/load[?deployment=ID]` | 200 `LoadReport` |
//! | `GET /management/v1/switches/trace` | 200 JSON lines: the recent requests as a trace (`capyctl simulate`'s format) |
//! | `GET /management/v1/switches[?deployment=NAME-or-ID][&after=SEQ][&limit=N]` | 200 `SwitchList` (DESIGN 4.8) |
//! | `GET /management/v1/tenants` | 200 [`TenantList`]: the inference listener's tenants, their models, rates and use (never a key) |
//! | `GET /healthz` | 200 `ok` (no token) |
//! | `GET /readyz` | 200 `ready` once [`ManagementApi::ready`], else 503 (no token) |
//! | `GET /metrics` | 200 OpenMetrics text of [`Metrics`] and the tenants' counters (no token) |
//! | `GET /ui/` and its files | the web page ([`ui`]; no token: the page asks for it) |
//!
//! Errors are [`ApiError`] JSON (`{"code","message","retryable"}`) with its status, and
//! `Retry-After` on a 429. An unknown route is 404 `not_found`, a known route with another
//! method 405 `method_not_allowed` (JSON too, with `Allow`).
//!
//! The deployment document of `POST /deployments` is YAML when the `Content-Type` is
//! `application/yaml`, `application/x-yaml`, `text/yaml` or `text/x-yaml` (or ends in `+yaml`),
//! JSON when it is `application/json` (or ends in `+json`); without a `Content-Type` a body
//! starting with `{` is JSON and any other YAML. A bad document is 400 `invalid_request` naming
//! the key (and for YAML the line), e.g. `request body:3: resdency: unknown key; expected one of
//! ...`, and changes nothing.
//!
//! NB: `/metrics` takes no token so that Prometheus can scrape it without the admin secret; it
//! shows counts and durations labelled by deployment ID, never documents or the token. The
//! listener is on loopback by default; put it behind a NetworkPolicy where it is not.

#[doc(hidden)]
pub mod fuzz;
mod token;
pub mod ui;

use std::future::{Future, IntoFuture};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::rejection::PathRejection;
use axum::extract::{OriginalUri, Path, RawQuery, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use capyctl_spec::api::{DeployOutcome, PREFIX, SWITCHES_PAGE_MAX, StartRequest, SwitchQuery};
use capyctl_spec::auth;
use capyctl_spec::documents::{DeploymentDoc, parse_deployment_json, parse_deployment_str};
use capyctl_spec::errors::ApiError;
use http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde::Serialize;

use capyctl_router::tenants::{TenantReport, Tenants};
use capyctl_router::tls::TlsIncoming;

use capyctl_lifecycle::api::{JsonParts, ManagementApi};
use capyctl_lifecycle::metrics::{self, Metrics};

pub use token::{TOKEN_BYTES, TOKEN_FILE, TokenError, load_or_create_token, token_path};

/// The largest deployment document `POST /deployments` takes (1 MiB); a larger body is 413.
pub const MAX_DOCUMENT_BYTES: usize = 1 << 20;

/// The largest body `POST .../start` takes (64 KiB).
pub const MAX_START_BODY_BYTES: usize = 64 << 10;

/// How long [`serve`] lets requests in progress finish after the shutdown signal before it
/// returns anyway (a `start --wait` can take minutes; a shutdown should not).
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// The name the errors give a request's document.
const BODY_NAME: &str = "request body";

/// What the listener needs besides the API.
#[derive(Debug, Clone)]
pub struct ManagementOptions {
    /// The admin token every `/management/v1` request must carry as `Bearer`.
    pub token: String,
    /// The metrics `GET /metrics` serves.
    pub metrics: Arc<Metrics>,
    /// The inference listener's tenants, for `GET /management/v1/tenants` and their counters
    /// in `/metrics`; `None`: none.
    pub tenants: Option<Arc<Tenants>>,
}

/// Shared by every handler (read-only).
#[derive(Clone)]
struct AppState {
    api: Arc<dyn ManagementApi>,
    token: Arc<str>,
    metrics: Arc<Metrics>,
    tenants: Option<Arc<Tenants>>,
}

/// The management app: every route of the module's table. Serve it with [`serve`], or drive
/// it in tests with `tower::ServiceExt::oneshot` (`server/tests/management_app.rs`, over a
/// real lifecycle).
pub fn router(api: Arc<dyn ManagementApi>, options: ManagementOptions) -> Router {
    let state = AppState {
        api,
        token: Arc::from(options.token),
        metrics: options.metrics,
        tenants: options.tenants,
    };
    let v1 = Router::new()
        .route("/deployments", get(list).post(deploy))
        .route("/deployments/{name_or_id}", get(get_one).delete(delete))
        .route("/deployments/{name_or_id}/start", post(start))
        .route("/deployments/{name_or_id}/stop", post(stop))
        .route("/deployments/{name_or_id}/park", post(park))
        .route(
            "/deployments/{name_or_id}/preinitialize",
            post(preinitialize),
        )
        .route("/engines", get(engines))
        .route("/hosts", get(hosts))
        .route("/hosts/{id}/drain", post(drain_host))
        .route("/hosts/{id}/uncordon", post(uncordon_host))
        .route("/metrics/load", get(load))
        .route("/tenants", get(tenants))
        .route("/switches/trace", get(request_trace))
        .route("/switches", get(switches))
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(state.clone(), require_token));
    Router::new()
        .nest(PREFIX, v1)
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(prometheus))
        .merge(ui::routes())
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(not_found)
        .with_state(state)
}

/// Serves [`router`] on `listener` until `shutdown` completes; then lets requests in progress
/// finish for up to [`SHUTDOWN_GRACE`] and returns. An error of the listener itself is returned.
///
/// NB: connections still busy after the grace are left to the runtime's shutdown.
pub async fn serve(
    listener: tokio::net::TcpListener,
    api: Arc<dyn ManagementApi>,
    options: ManagementOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_on(listener, router(api, options), shutdown).await
}

/// [`serve`] over TLS (`server.listen.tls`): the connections of `incoming`, handshakes done.
pub async fn serve_tls(
    incoming: TlsIncoming,
    api: Arc<dyn ManagementApi>,
    options: ManagementOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_on(TlsListener(incoming), router(api, options), shutdown).await
}

/// [`serve`], or [`serve_tls`] when `tls` is given (`server.listen.tls`).
pub async fn serve_listener(
    listener: tokio::net::TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    api: Arc<dyn ManagementApi>,
    options: ManagementOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    match tls {
        None => serve(listener, api, options, shutdown).await,
        Some(tls) => {
            serve_tls(
                TlsIncoming::new(listener, tls, |_| {})?,
                api,
                options,
                shutdown,
            )
            .await
        }
    }
}

/// axum's view of a [`TlsIncoming`].
struct TlsListener(TlsIncoming);

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.0.accept().await {
            Some(accepted) => accepted,
            // The accept loop ended (the listener is being dropped): nothing more comes.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.0.local_addr())
    }
}

async fn serve_on<L: axum::serve::Listener>(
    listener: L,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()>
where
    L::Addr: std::fmt::Debug,
{
    let (fired_tx, mut fired_rx) = tokio::sync::watch::channel(false);
    let signal = async move {
        shutdown.await;
        let _ = fired_tx.send(true);
    };
    let server = axum::serve(listener, app)
        .with_graceful_shutdown(signal)
        .into_future();
    let grace = async move {
        if fired_rx.wait_for(|fired| *fired).await.is_err() {
            // The signal was dropped without firing: the server runs until it ends.
            std::future::pending::<()>().await;
        }
        tokio::time::sleep(SHUTDOWN_GRACE).await;
    };
    tokio::select! {
        result = server => result,
        () = grace => {
            tracing::warn!(
                grace_s = SHUTDOWN_GRACE.as_secs(),
                "management listener: requests still in progress after the shutdown grace; leaving them"
            );
            Ok(())
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Responses
// ---------------------------------------------------------------------------------------------

fn json<T: Serialize>(status: StatusCode, body: &T) -> Response {
    json_sized(status, body, 128)
}

/// [`json`] into a buffer of `capacity` bytes to begin with (a large answer, sized beforehand,
/// is written without the buffer growing and being copied on the way).
fn json_sized<T: Serialize>(status: StatusCode, body: &T, capacity: usize) -> Response {
    let mut bytes = Vec::with_capacity(capacity);
    match serde_json::to_writer(&mut bytes, body).map(|()| bytes) {
        Ok(bytes) => (
            status,
            [(header::CONTENT_TYPE, "application/json")],
            Bytes::from(bytes),
        )
            .into_response(),
        Err(e) => error(ApiError::Internal {
            detail: format!("cannot serialize the answer: {e}"),
        }),
    }
}

fn error(err: ApiError) -> Response {
    let status = StatusCode::from_u16(err.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        err.to_json(),
    )
        .into_response();
    if let Some(seconds) = err.retry_after() {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    }
    response
}

fn answer<T: Serialize>(status: StatusCode, result: Result<T, ApiError>) -> Response {
    match result {
        Ok(body) => json(status, &body),
        Err(e) => error(e),
    }
}

fn invalid(detail: impl Into<String>) -> Response {
    error(ApiError::InvalidRequest {
        detail: detail.into(),
    })
}

fn bad_path(rejection: PathRejection) -> Response {
    invalid(format!("bad path: {}", rejection.body_text()))
}

async fn not_found(method: Method, OriginalUri(uri): OriginalUri) -> Response {
    error(ApiError::NotFound {
        what: format!("route {method} {}", uri.path()),
    })
}

async fn method_not_allowed(method: Method, OriginalUri(uri): OriginalUri) -> Response {
    let body = serde_json::json!({
        "code": "method_not_allowed",
        "message": format!("method {method} is not allowed on {}; see the Allow header", uri.path()),
        "retryable": false,
    });
    json(StatusCode::METHOD_NOT_ALLOWED, &body)
}

// ---------------------------------------------------------------------------------------------
// The token
// ---------------------------------------------------------------------------------------------

async fn require_token(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let headers = request.headers();
    let token = state.token.as_bytes();
    let authorized =
        auth::bearer_matches(
            headers.get(header::AUTHORIZATION).map(|v| v.as_bytes()),
            token,
        ) || auth::header_matches(headers.get(auth::TOKEN_HEADER).map(|v| v.as_bytes()), token);
    if !authorized {
        tracing::debug!(method = %request.method(), path = request.uri().path(), "management: refused without the admin token");
        return error(ApiError::Unauthorized);
    }
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    let response = next.run(request).await;
    tracing::debug!(%method, path, status = response.status().as_u16(), "management request");
    response
}

// ---------------------------------------------------------------------------------------------
// Bodies
// ---------------------------------------------------------------------------------------------

/// Reads the whole body up to `limit` bytes: 413 past it, 400 when it cannot be read.
async fn read_body(body: Body, limit: usize) -> Result<Bytes, ApiError> {
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            Err(ApiError::RequestTooLarge {
                limit: u64::try_from(limit).unwrap_or(u64::MAX),
            })
        }
        Err(e) => Err(ApiError::InvalidRequest {
            detail: format!("cannot read the request body: {e}"),
        }),
    }
}

/// How a document body is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Json,
    Yaml,
}

fn document_format(headers: &HeaderMap, body: &[u8]) -> Result<Format, ApiError> {
    let Some(value) = headers.get(header::CONTENT_TYPE) else {
        let first = body.iter().find(|b| !b.is_ascii_whitespace());
        return Ok(if first == Some(&b'{') {
            Format::Json
        } else {
            Format::Yaml
        });
    };
    let text = value.to_str().unwrap_or("");
    let media = text
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    match media.as_str() {
        "application/json" => Ok(Format::Json),
        "application/yaml" | "application/x-yaml" | "text/yaml" | "text/x-yaml" => Ok(Format::Yaml),
        m if m.ends_with("+json") => Ok(Format::Json),
        m if m.ends_with("+yaml") => Ok(Format::Yaml),
        _ => Err(ApiError::InvalidRequest {
            detail: format!(
                "Content-Type {text:?} is not accepted for a deployment document; send application/json or application/yaml"
            ),
        }),
    }
}

/// A deployment document from JSON, with every rule of a YAML one (see
/// [`parse_deployment_json`]).
fn parse_json_document(text: &str) -> Result<DeploymentDoc, String> {
    parse_deployment_json(BODY_NAME, text).map_err(|e| e.to_string())
}

fn parse_document(format: Format, body: &[u8]) -> Result<DeploymentDoc, String> {
    let text = std::str::from_utf8(body).map_err(|e| format!("{BODY_NAME} is not UTF-8: {e}"))?;
    if text.trim().is_empty() {
        return Err(format!(
            "{BODY_NAME} is empty; expected a deployment document (name, engine, model, ...)"
        ));
    }
    match format {
        Format::Json => parse_json_document(text),
        Format::Yaml => parse_deployment_str(BODY_NAME, text).map_err(|e| e.to_string()),
    }
}

// ---------------------------------------------------------------------------------------------
// Handlers
// ---------------------------------------------------------------------------------------------

/// Runs a command in a task of its own, so that it ends even when its client hangs up: the
/// lifecycle's commands reserve instances and mark them busy across their awaits, and are not
/// written to be dropped half-way.
async fn to_the_end<T: Send + 'static>(
    command: impl Future<Output = Result<T, ApiError>> + Send + 'static,
) -> Result<T, ApiError> {
    match tokio::spawn(command).await {
        Ok(result) => result,
        Err(e) => Err(ApiError::Internal {
            detail: format!("the command ended abnormally: {e}"),
        }),
    }
}

async fn list(State(s): State<AppState>) -> Response {
    match s.api.list_parts().await {
        Ok(parts) => in_parts(parts),
        Err(e) => error(e),
    }
}

/// A body the API writes a part at a time (`list_parts`): the first part's error is the
/// answer; a body of one part is sent whole (with its length), a longer one chunked, each
/// part written when the connection takes it (so no answer of every part is held). An error
/// from a later part ends the body unfinished (see `JsonParts`).
fn in_parts(mut parts: JsonParts) -> Response {
    let first = match parts.next() {
        Some(Ok(first)) => first,
        Some(Err(e)) => return error(e),
        None => Bytes::new(),
    };
    let body = match parts.next() {
        None => Body::from(first),
        Some(second) => Body::from_stream(futures_util::stream::iter(
            [Ok(first), second].into_iter().chain(parts),
        )),
    };
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response()
}

/// A body the API encoded itself (`load_json`): 200 with it, or the error.
fn encoded(body: Result<Body, ApiError>) -> Response {
    match body {
        Ok(body) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response(),
        Err(e) => error(e),
    }
}

async fn deploy(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let bytes = match read_body(body, MAX_DOCUMENT_BYTES).await {
        Ok(b) => b,
        Err(e) => return error(e),
    };
    let format = match document_format(&headers, &bytes) {
        Ok(f) => f,
        Err(e) => return error(e),
    };
    let doc = match parse_document(format, &bytes) {
        Ok(doc) => doc,
        Err(detail) => return invalid(detail),
    };
    let api = s.api.clone();
    match to_the_end(async move { api.deploy(doc).await }).await {
        Ok(receipt) => {
            let status = match receipt.outcome {
                DeployOutcome::Created => StatusCode::CREATED,
                DeployOutcome::Updated | DeployOutcome::Unchanged => StatusCode::OK,
            };
            json(status, &receipt)
        }
        Err(e) => error(e),
    }
}

async fn get_one(State(s): State<AppState>, name: Result<Path<String>, PathRejection>) -> Response {
    match name {
        Ok(Path(name)) => answer(StatusCode::OK, s.api.get(&name).await),
        Err(r) => bad_path(r),
    }
}

async fn delete(State(s): State<AppState>, name: Result<Path<String>, PathRejection>) -> Response {
    match name {
        Ok(Path(name)) => {
            let api = s.api.clone();
            answer(
                StatusCode::OK,
                to_the_end(async move { api.delete(&name).await }).await,
            )
        }
        Err(r) => bad_path(r),
    }
}

async fn start(
    State(s): State<AppState>,
    name: Result<Path<String>, PathRejection>,
    body: Body,
) -> Response {
    let name = match name {
        Ok(Path(name)) => name,
        Err(r) => return bad_path(r),
    };
    let bytes = match read_body(body, MAX_START_BODY_BYTES).await {
        Ok(b) => b,
        Err(e) => return error(e),
    };
    let request = if bytes.trim_ascii().is_empty() {
        StartRequest::default()
    } else {
        match serde_json::from_slice::<StartRequest>(&bytes) {
            Ok(r) => r,
            Err(e) => {
                return invalid(format!(
                    "{BODY_NAME} of start: {e}; expected {{\"evict\": bool, \"wait\": bool}}"
                ));
            }
        }
    };
    let api = s.api.clone();
    answer(
        StatusCode::OK,
        to_the_end(async move { api.start(&name, request).await }).await,
    )
}

async fn stop(State(s): State<AppState>, name: Result<Path<String>, PathRejection>) -> Response {
    match name {
        Ok(Path(name)) => {
            let api = s.api.clone();
            answer(
                StatusCode::OK,
                to_the_end(async move { api.stop(&name).await }).await,
            )
        }
        Err(r) => bad_path(r),
    }
}

async fn park(State(s): State<AppState>, name: Result<Path<String>, PathRejection>) -> Response {
    match name {
        Ok(Path(name)) => {
            let api = s.api.clone();
            answer(
                StatusCode::OK,
                to_the_end(async move { api.park(&name).await }).await,
            )
        }
        Err(r) => bad_path(r),
    }
}

async fn preinitialize(
    State(s): State<AppState>,
    name: Result<Path<String>, PathRejection>,
) -> Response {
    match name {
        Ok(Path(name)) => {
            let api = s.api.clone();
            answer(
                StatusCode::OK,
                to_the_end(async move { api.preinitialize(&name).await }).await,
            )
        }
        Err(r) => bad_path(r),
    }
}

async fn engines(State(s): State<AppState>) -> Response {
    json(StatusCode::OK, &s.api.engines().await)
}

async fn hosts(State(s): State<AppState>) -> Response {
    json(StatusCode::OK, &s.api.hosts().await)
}

async fn drain_host(
    State(s): State<AppState>,
    id: Result<Path<String>, PathRejection>,
) -> Response {
    host_action(s, id, true).await
}

async fn uncordon_host(
    State(s): State<AppState>,
    id: Result<Path<String>, PathRejection>,
) -> Response {
    host_action(s, id, false).await
}

/// A drain (`drain`) or an uncordon of a host, run to its end whatever the client does.
async fn host_action(
    s: AppState,
    id: Result<Path<String>, PathRejection>,
    drain: bool,
) -> Response {
    match id {
        Ok(Path(id)) => {
            let api = s.api.clone();
            answer(
                StatusCode::OK,
                to_the_end(async move { api.drain_host(&id, drain).await }).await,
            )
        }
        Err(r) => bad_path(r),
    }
}

/// The `deployment` of `?deployment=ID`, refusing other keys, repeats and an empty value.
fn load_query(raw: Option<&str>) -> Result<Option<String>, String> {
    let Some(raw) = raw.filter(|q| !q.is_empty()) else {
        return Ok(None);
    };
    let pairs: Vec<(String, String)> = query_pairs(raw)?;
    let mut deployment = None;
    for (key, value) in pairs {
        if key != "deployment" {
            return Err(format!(
                "unknown query parameter `{key}`; expected `deployment`"
            ));
        }
        if deployment.is_some() {
            return Err("query parameter `deployment` is given twice".to_string());
        }
        if value.is_empty() {
            return Err("query parameter `deployment` is empty; give a deployment ID".to_string());
        }
        deployment = Some(value);
    }
    Ok(deployment)
}

/// The query of `GET /switches`: `deployment`, `after` (a number), `limit` (1 to
/// [`SWITCHES_PAGE_MAX`]), each at most once.
fn switches_query(raw: Option<&str>) -> Result<SwitchQuery, String> {
    let mut query = SwitchQuery::default();
    let Some(raw) = raw.filter(|q| !q.is_empty()) else {
        return Ok(query);
    };
    let twice = |key: &str| format!("query parameter `{key}` is given twice");
    let number = |key: &str, value: &str| {
        value
            .parse::<u64>()
            .map_err(|_| format!("query parameter `{key}` is `{value}`; expected a whole number"))
    };
    for (key, value) in query_pairs(raw)? {
        match key.as_str() {
            "deployment" => {
                if value.is_empty() {
                    return Err(
                        "query parameter `deployment` is empty; give a deployment's name or ID"
                            .to_string(),
                    );
                }
                if query.deployment.replace(value).is_some() {
                    return Err(twice("deployment"));
                }
            }
            "after" => {
                if query.after.replace(number("after", &value)?).is_some() {
                    return Err(twice("after"));
                }
            }
            "limit" => {
                let limit = number("limit", &value)?;
                if limit == 0 || limit > SWITCHES_PAGE_MAX as u64 {
                    return Err(format!(
                        "query parameter `limit` is {limit}; expected 1 to {SWITCHES_PAGE_MAX}"
                    ));
                }
                if query
                    .limit
                    .replace(usize::try_from(limit).unwrap_or(SWITCHES_PAGE_MAX))
                    .is_some()
                {
                    return Err(twice("limit"));
                }
            }
            _ => {
                return Err(format!(
                    "unknown query parameter `{key}`; expected `deployment`, `after` or `limit`"
                ));
            }
        }
    }
    Ok(query)
}

/// Splits and percent-decodes a query string (`+` is a space).
fn query_pairs(raw: &str) -> Result<Vec<(String, String)>, String> {
    raw.split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            Ok((percent_decode(k)?, percent_decode(v)?))
        })
        .collect()
}

fn percent_decode(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        match b {
            b'+' => out.push(b' '),
            b'%' => {
                // Two hex digits (`u8::from_str_radix` alone also takes `+5` and `-0`).
                let hex = bytes
                    .get(i + 1..i + 3)
                    .filter(|h| h.iter().all(u8::is_ascii_hexdigit))
                    .and_then(|h| std::str::from_utf8(h).ok())
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| format!("bad percent-encoding in the query: {s:?}"))?;
                out.push(hex);
                i += 2;
            }
            _ => out.push(b),
        }
        i += 1;
    }
    String::from_utf8(out).map_err(|_| format!("the query is not UTF-8 once decoded: {s:?}"))
}

async fn load(State(s): State<AppState>, RawQuery(raw): RawQuery) -> Response {
    match load_query(raw.as_deref()) {
        Ok(deployment) => {
            let json = s.api.load_json(deployment.as_deref()).await;
            encoded(json.map(|json| load_body(json, s.tenants.as_deref())))
        }
        Err(detail) => invalid(detail),
    }
}

/// One tenant's figures in the load read.
#[derive(Serialize)]
struct TenantLoad<'a> {
    name: &'a str,
    /// Answers by HTTP status.
    answers: &'a std::collections::BTreeMap<String, u64>,
    tokens: u64,
    waiting: i64,
}

/// The load read's answer: `json` and, when any tenant is configured, a last top-level
/// `tenants` array (each tenant's answers by status, tokens and requests waiting, read where
/// `GET /management/v1/tenants` reads them) put before its closing brace. `json` itself is
/// not copied: the body is its bytes before the brace, the array and the rest ([`Parts`], its
/// length known), so the lifecycle's buffer goes back to it once sent.
///
/// NB: added here, in the management layer, because the lifecycle that encodes the load read
/// does not see the inference listener's tenants (they belong to the router's listener).
fn load_body(json: Bytes, tenants: Option<&Tenants>) -> Body {
    Body::new(load_parts(json, tenants))
}

/// [`load_body`]'s parts: `json` alone without tenants.
fn load_parts(json: Bytes, tenants: Option<&Tenants>) -> Parts {
    match tenants_at(&json, tenants) {
        None => Parts::of([json]),
        Some((close, array)) => {
            Parts::of([json.slice(..close), Bytes::from(array), json.slice(close..)])
        }
    }
}

/// Where in the load read's `json` the tenants' array goes (before its last `}`) and the
/// array with its key (`,"tenants":[...]`, without the comma after an empty object), when
/// any tenant is configured.
fn tenants_at(json: &[u8], tenants: Option<&Tenants>) -> Option<(usize, Vec<u8>)> {
    let report = tenants.map(Tenants::report).unwrap_or_default();
    if report.is_empty() {
        return None;
    }
    let close = json.iter().rposition(|&b| b == b'}')?;
    let list: Vec<TenantLoad<'_>> = report
        .iter()
        .map(|t| TenantLoad {
            name: &t.name,
            answers: &t.answers,
            tokens: t.tokens,
            waiting: t.waiting,
        })
        .collect();
    let empty_object = json[..close]
        .iter()
        .rev()
        .find(|b| !b.is_ascii_whitespace())
        == Some(&b'{');
    let mut array = if empty_object {
        b"\"tenants\":".to_vec()
    } else {
        b",\"tenants\":".to_vec()
    };
    serde_json::to_writer(&mut array, &list).ok()?;
    Some((close, array))
}

/// [`load_body`]'s bytes in one vector (the tests read them so).
#[cfg(test)]
fn with_tenants(json: Vec<u8>, tenants: Option<&Tenants>) -> Vec<u8> {
    let parts = load_parts(Bytes::from(json), tenants).parts;
    parts.iter().flat_map(|p| p.iter().copied()).collect()
}

/// A body of a few parts sent one after the other, its whole length known (so it goes with a
/// `Content-Length`, as one part would).
struct Parts {
    parts: std::collections::VecDeque<Bytes>,
    left: u64,
}

impl Parts {
    fn of<const N: usize>(parts: [Bytes; N]) -> Self {
        let left = parts.iter().map(|p| p.len() as u64).sum();
        Parts {
            parts: parts.into_iter().filter(|p| !p.is_empty()).collect(),
            left,
        }
    }
}

impl http_body::Body for Parts {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        let part = self.parts.pop_front();
        if let Some(p) = &part {
            self.left -= p.len() as u64;
        }
        std::task::Poll::Ready(part.map(|p| Ok(http_body::Frame::data(p))))
    }

    fn is_end_stream(&self) -> bool {
        self.parts.is_empty()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.left)
    }
}

async fn switches(State(s): State<AppState>, RawQuery(raw): RawQuery) -> Response {
    match switches_query(raw.as_deref()) {
        Ok(query) => match s.api.switches(query).await {
            Ok(list) => {
                let capacity = 1024 * list.switches.len() + 64;
                json_sized(StatusCode::OK, &list, capacity)
            }
            Err(e) => error(e),
        },
        Err(detail) => invalid(detail),
    }
}

async fn healthz() -> Response {
    (StatusCode::OK, [(header::CONTENT_TYPE, "text/plain")], "ok").into_response()
}

async fn readyz(State(s): State<AppState>) -> Response {
    if s.api.ready() {
        (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "text/plain")],
            "ready",
        )
            .into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::CONTENT_TYPE, "text/plain")],
            "not ready: the server is still starting",
        )
            .into_response()
    }
}

/// The last requests that named a model (at most 10,000), oldest first, as a trace: one JSON
/// object a line, `at_ms` from the first one's arrival (see
/// [`capyctl_lifecycle::recent::TraceLine`]).
async fn request_trace(State(s): State<AppState>) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/jsonl")],
        s.metrics.recent_requests().trace_lines(),
    )
        .into_response()
}

async fn prometheus(State(s): State<AppState>) -> Response {
    let mut text = s.metrics.encode();
    if let Some(tenants) = &s.tenants {
        tenant_metrics(&mut text, &tenants.report());
    }
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, metrics::CONTENT_TYPE)],
        text,
    )
        .into_response()
}

/// `GET /management/v1/tenants`: every tenant with its models, rates and use (never a key).
async fn tenants(State(s): State<AppState>) -> Response {
    let list = TenantList {
        tenants: s.tenants.as_ref().map(|t| t.report()).unwrap_or_default(),
    };
    json_sized(StatusCode::OK, &list, 256 * list.tenants.len() + 32)
}

/// The body of `GET /management/v1/tenants`.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct TenantList {
    /// In the order configured; empty: no keys are asked for.
    pub tenants: Vec<TenantReport>,
}

/// Adds each tenant's counters to the OpenMetrics `text`, before its `# EOF`:
/// `capyctl_tenant_requests_total{tenant,code}`, `capyctl_tenant_tokens_total{tenant}` and
/// `capyctl_tenant_waiting{tenant}`. (Tenant names are DNS labels: nothing to escape.)
fn tenant_metrics(text: &mut String, tenants: &[TenantReport]) {
    use std::fmt::Write as _;
    if tenants.is_empty() {
        return;
    }
    let eof = text.rfind("# EOF").unwrap_or(text.len());
    let tail = text.split_off(eof);
    let mut add = |line: std::fmt::Arguments<'_>| {
        let _ = writeln!(text, "{line}");
    };
    add(format_args!(
        "# HELP capyctl_tenant_requests Answers to a tenant's requests, by HTTP status."
    ));
    add(format_args!("# TYPE capyctl_tenant_requests counter"));
    for t in tenants {
        for (code, n) in &t.answers {
            add(format_args!(
                "capyctl_tenant_requests_total{{tenant=\"{}\",code=\"{code}\"}} {n}",
                t.name
            ));
        }
    }
    add(format_args!(
        "# HELP capyctl_tenant_tokens Tokens of a tenant's answers, from the engines' usage."
    ));
    add(format_args!("# TYPE capyctl_tenant_tokens counter"));
    for t in tenants {
        add(format_args!(
            "capyctl_tenant_tokens_total{{tenant=\"{}\"}} {}",
            t.name, t.tokens
        ));
    }
    add(format_args!(
        "# HELP capyctl_tenant_waiting A tenant's requests waiting for their admission now."
    ));
    add(format_args!("# TYPE capyctl_tenant_waiting gauge"));
    for t in tenants {
        add(format_args!(
            "capyctl_tenant_waiting{{tenant=\"{}\"}} {}",
            t.name, t.waiting
        ));
    }
    text.push_str(&tail);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn switches_query_reads_deployment_after_and_limit() {
        assert_eq!(switches_query(None), Ok(SwitchQuery::default()));
        assert_eq!(
            switches_query(Some("deployment=chat&after=41&limit=5")),
            Ok(SwitchQuery {
                deployment: Some("chat".into()),
                after: Some(41),
                limit: Some(5),
            })
        );
        for (bad, says) in [
            ("after=-1", "whole number"),
            ("limit=0", "1 to 1000"),
            ("limit=1001", "1 to 1000"),
            ("after=1&after=2", "twice"),
            ("deployment=", "empty"),
            ("deploy=chat", "deploy"),
        ] {
            assert!(
                switches_query(Some(bad)).is_err_and(|e| e.contains(says)),
                "{bad}"
            );
        }
    }

    /// One tenant, `team-a`, with one key and no limits.
    fn install_team_a(tenants: &Tenants) {
        tenants
            .install(vec![capyctl_interfaces::tenants::Tenant {
                name: "team-a".into(),
                keys: vec!["sk-a".into()],
                models: None,
                rate: None,
            }])
            .unwrap();
    }

    #[test]
    fn the_load_read_is_unchanged_without_tenants_and_ends_with_them_with() {
        let json = br#"{"observed_at_ms":1,"stale_after_ms":3000,"deployments":[]}"#.to_vec();
        assert_eq!(with_tenants(json.clone(), None), json);
        let tenants = Tenants::new();
        assert_eq!(with_tenants(json.clone(), Some(&tenants)), json);
        install_team_a(&tenants);
        assert_eq!(
            String::from_utf8(with_tenants(json, Some(&tenants))).unwrap(),
            r#"{"observed_at_ms":1,"stale_after_ms":3000,"deployments":[],"tenants":[{"name":"team-a","answers":{},"tokens":0,"waiting":0}]}"#
        );
        assert_eq!(
            with_tenants(b"{}".to_vec(), Some(&tenants)),
            br#"{"tenants":[{"name":"team-a","answers":{},"tokens":0,"waiting":0}]}"#
        );
    }

    /// The body the listener sends is [`with_tenants`]'s bytes, with its length known (a
    /// `Content-Length`), and without tenants the lifecycle's own bytes, not copied.
    #[tokio::test]
    async fn the_load_body_is_the_spliced_bytes_with_their_length() {
        let json = Bytes::from_static(br#"{"observed_at_ms":1,"deployments":[]}"#);
        let tenants = Tenants::new();
        let plain = load_body(json.clone(), Some(&tenants));
        assert_eq!(
            http_body::Body::size_hint(&plain).exact(),
            Some(json.len() as u64)
        );
        assert_eq!(plain.collect().await.unwrap().to_bytes(), json);
        install_team_a(&tenants);
        let spliced = with_tenants(json.to_vec(), Some(&tenants));
        assert_ne!(spliced, json.to_vec());
        let body = load_body(json, Some(&tenants));
        assert_eq!(
            http_body::Body::size_hint(&body).exact(),
            Some(spliced.len() as u64)
        );
        assert_eq!(body.collect().await.unwrap().to_bytes(), spliced);
    }

    #[test]
    fn load_query_refuses_unknown_repeated_and_empty() {
        assert_eq!(load_query(None), Ok(None));
        assert_eq!(load_query(Some("deployment=01K")), Ok(Some("01K".into())));
        assert_eq!(load_query(Some("deployment=a%2Db")), Ok(Some("a-b".into())));
        assert!(load_query(Some("deploymnt=01K")).is_err_and(|e| e.contains("deploymnt")));
        assert!(load_query(Some("deployment=a&deployment=b")).is_err_and(|e| e.contains("twice")));
        assert!(load_query(Some("deployment=")).is_err_and(|e| e.contains("empty")));
        assert!(load_query(Some("deployment=%zz")).is_err_and(|e| e.contains("percent")));
    }

    /// Found by the `management` fuzz target: `%+5` and `%-0` decoded (to 0x05 and 0x00), as
    /// `u8::from_str_radix` takes a sign.
    #[test]
    fn a_percent_escape_is_two_hex_digits() {
        for bad in ["a%+5", "%-0", "%+b%41", "%4", "%"] {
            assert!(percent_decode(bad).is_err(), "{bad}");
        }
        assert_eq!(percent_decode("%41%2d+%e2%82%ac"), Ok("A- €".to_string()));
    }

    #[test]
    fn json_errors_name_the_key_path() {
        let e = parse_json_document(
            r#"{"name":"m","engine":"vllm","model":"x","resources":{"gpu_memory":"40GiB","weights_mem":"1GiB"}}"#,
        )
        .expect_err("unknown key");
        assert!(
            e.starts_with("request body: resources.weights_mem: unknown key"),
            "{e}"
        );
        let e = parse_json_document(r#"{"name":"m","engine":"vllm"}"#).expect_err("missing");
        assert!(e.contains("model"), "{e}");
        let e = parse_json_document(r#"{"name":"m","#).expect_err("syntax");
        assert!(e.contains("not valid JSON"), "{e}");
        let e = parse_json_document("[1]").expect_err("array");
        assert!(e.contains("an array, not a JSON object"), "{e}");
    }
}
