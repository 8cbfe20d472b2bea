//! The OpenAI-compatible listener: routes each request by its body's `model`, waits for an
//! [`Admission`] permit, forwards the same bytes to the engine and streams the answer back.
//!
//! ```text
//! client ──► read body (budget) ──► `model` ──► resolve ──► admit (≤ deadline)
//!        ◄── answer, frame by frame ◄── DirectBody / StreamBody ◄── upstream pool ◄──┘
//! ```
//!
//! Decisions (see also the module docs of `body` and `conn`):
//! - The request deadline runs from arrival to the first output: reading the body, waiting for
//!   the permit, the engine's response head and, for a stream, its first real output. The
//!   opening chunk that only names the assistant role is held back, not forwarded: the response
//!   head goes out with the first real output, so a deadline that passes before it is always a
//!   plain `503 unavailable` (`QueueDeadline`), never a broken stream. Before the first output
//!   at most one piece (`max_piece`) is held; more is treated as an oversized piece.
//! - A non-streamed answer's first output is its response head (the engine sends it with the
//!   body); after it, `stream_idle_timeout` bounds each silence of the body.
//! - A streamed answer ends early, and the request is cut, when the client goes away, reads
//!   nothing for `read_stall` (its connection is then closed; see `conn` for what that can
//!   mean at the TCP level), a piece passes `max_piece`, or the engine is silent past
//!   `stream_idle_timeout`. The last two, and an engine that breaks off, end the stream with an
//!   SSE error event `data: {"error":{"code","message","retryable"}}` (codes
//!   `piece_too_large`, `stream_idle_timeout`, `upstream_failed`).
//! - An engine that cannot be reached (refused, or no connection within
//!   `upstream_connect_timeout`), or breaks off before any output, is answered
//!   `502 upstream_unavailable` (`ApiError::UpstreamUnavailable`). Every abnormal end calls
//!   `Permit::cut`.
//! - A client that sends its request head slower than `header_read_timeout` is disconnected
//!   (see `server`); its body is read whole before routing, bounded by the request deadline
//!   (400 when it does not arrive in time) and by the listener's one budget for the bodies it
//!   holds, `max_buffered_bytes_total` (413 for a body over it alone, 429 when others hold
//!   it; see `budget`).
//! - An observer ([`Proxy::with_observer`]) hears of every request once, when it ends (see
//!   [`crate::observe`]).
//! - A request that names a LoRA adapter (DESIGN 4.9; [`Proxy::with_adapters`]) is admitted
//!   as a request for its base (the name resolves to the base), then waits, within the same
//!   deadline, until its instance has the adapter loaded ([`Lifecycle::acquire_adapter`]);
//!   the lease ends with the request's permit. It is forwarded with its `model` as it came
//!   (the adapter's name, which vLLM serves), and with the adapter named in the field the
//!   base's engine reads besides (`AdapterRoute::request_field`: SGLang's `lora_path`). An
//!   engine that answers as if it had not loaded it (vLLM's 404, SGLang's 400 or first stream
//!   event naming it; see `lost`) is answered `503 adapter_load_failed` (never the engine's
//!   answer), and the next request loads it again.

mod body;
mod budget;
mod conn;
#[doc(hidden)]
pub mod fuzz;
mod lost;
mod server;
mod sse;
mod upstream;
mod usage;

use std::borrow::Cow;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use capyctl_spec::errors::ApiError;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body::Body;
use http_body_util::BodyExt;
use serde::Serialize;
use tokio::time::Instant;

pub use body::ProxyBody;
use budget::RequestBody;

use crate::coordinator::routing::{Fnv, PREFIX_BYTES};
pub use conn::{serve, serve_giving_back};

use crate::admission::{Admission, Permit};
use crate::observe::{self, RequestObserver};
use crate::tenants::{self, Auth, TenantEntry, Tenants};
use body::{Charge, DirectBody, Start, StreamSettings, Track, Watch};
use capyctl_interfaces::router::{Lifecycle, Upstream};
use conn::ConnWatch;

/// The listener's bounds. The lead maps the settings (`resource_policy.queue.*`) into it; the
/// fixed ones (`read_stall`, `max_piece`) are fields only so that tests can shorten them.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// From arrival to the first output (waiting, switch and prefill included):
    /// `request_deadline`, default 600 s (the server's; standalone's is 1800 s).
    pub request_deadline: Duration,
    /// Longest silence in an answer after its first output: `stream_idle_timeout`, 120 s.
    pub stream_idle_timeout: Duration,
    /// The bytes of all request bodies the listener holds at once, from their first byte
    /// until they are written to the engine (being read, waiting, being sent), over all its
    /// connections: `max_buffered_bytes_total`, 64 MiB. A body larger than that alone is
    /// answered `413 request_too_large`; one that does not fit beside the others `429
    /// queue_full` (see `budget`).
    pub max_buffered_bytes_total: u64,
    /// A streamed answer whose client takes nothing for this long is cut: 10 s, fixed.
    pub read_stall: Duration,
    /// A streamed answer with a piece (SSE event) larger than this is cut: 64 KiB, fixed.
    pub max_piece: usize,
    /// Idle connections kept per engine instance; at least the 32 in-flight requests.
    pub upstream_idle_per_host: usize,
    /// How long [`serve`] lets answers in progress finish after the shutdown signal.
    pub shutdown_grace: Duration,
    /// Threads of the listener's own, each with a current-thread runtime and an accept loop on
    /// the one listening socket (see [`serve`]); 0 serves on the caller's runtime. Default: one
    /// per CPU.
    pub listener_threads: usize,
    /// The most bytes the kernel keeps unsent on a client's connection (`TCP_NOTSENT_LOWAT`),
    /// so that a client that reads nothing is seen soon after its own receive buffer is full:
    /// 16 KiB; 0 leaves the kernel's default.
    pub client_unsent_limit: u32,
    /// How long a client may take to send a request's head (and how long a keep-alive
    /// connection may stay idle between requests): 30 s.
    pub header_read_timeout: Duration,
    /// How long connecting to an engine may take before the request is answered
    /// `502 upstream_unavailable`: 5 s.
    pub upstream_connect_timeout: Duration,
    /// TLS for the listener (`server.listen.tls`; see [`crate::tls::server_config`]): each
    /// connection's handshake runs in its own task, bounded by [`crate::tls::HANDSHAKE_TIMEOUT`].
    /// `None`: plain HTTP.
    pub tls: Option<Arc<rustls::ServerConfig>>,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            request_deadline: Duration::from_secs(600),
            stream_idle_timeout: Duration::from_secs(120),
            max_buffered_bytes_total: 64 * 1024 * 1024,
            read_stall: Duration::from_secs(10),
            max_piece: 64 * 1024,
            upstream_idle_per_host: 64,
            shutdown_grace: Duration::from_secs(30),
            listener_threads: std::thread::available_parallelism().map_or(1, usize::from),
            client_unsent_limit: 16 * 1024,
            header_read_timeout: Duration::from_secs(30),
            upstream_connect_timeout: Duration::from_secs(5),
            tls: None,
        }
    }
}

/// One line of `GET /v1/models` (the lifecycle lists them: the interfaces' value).
pub use capyctl_interfaces::router::ModelEntry;

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

/// The listener: cheap to clone (a few `Arc`s), shared by every connection.
pub struct Proxy<A: Admission> {
    shared: Arc<Shared<A>>,
    /// Keep-alive connections to the engines (`upstream_idle_per_host` idle per engine); one
    /// pool per listener thread, since a connection belongs to the runtime that opened it.
    pool: Arc<upstream::Pool>,
    /// Told of every request when it ends.
    observer: Option<Arc<dyn RequestObserver>>,
    /// Loads the adapters requests name (`None`: every name is a model's).
    adapters: Option<Arc<dyn Lifecycle>>,
    /// The tenants and their keys (see [`crate::tenants`]); `None`, or none configured: no
    /// key is asked for.
    tenants: Option<Arc<Tenants>>,
}

impl<A: Admission> Clone for Proxy<A> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
            pool: Arc::clone(&self.pool),
            observer: self.observer.clone(),
            adapters: self.adapters.clone(),
            tenants: self.tenants.clone(),
        }
    }
}

/// What every request reads; nothing in it changes after construction.
struct Shared<A> {
    admission: A,
    catalog: Box<dyn ModelCatalog>,
    config: ProxyConfig,
    /// The one budget of every body the listener holds (`max_buffered_bytes_total`).
    budget: Arc<budget::Budget>,
    /// The engines' `system_fingerprint`s, for the streams whose usage is taken out (`usage`).
    fingerprints: Arc<usage::Fingerprints>,
}

/// A permit with the adapter lease of its request, if any: both end when the request ends.
struct Leased<P> {
    permit: P,
    /// Held for its drop, with the permit's.
    _lease: Option<capyctl_interfaces::router::AdapterLease>,
}

impl<P: Permit> Permit for Leased<P> {
    fn upstream(&self) -> &Upstream {
        self.permit.upstream()
    }

    fn first_output(&self) {
        self.permit.first_output();
    }

    fn cut(&self) {
        self.permit.cut();
    }

    fn waited_at_bound(&self) -> Duration {
        self.permit.waited_at_bound()
    }
}

/// The routes of the inference API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    /// POST, forwarded by `model`.
    Forward,
    /// GET /v1/models.
    Models,
}

/// Whether a request is one the listener forwards (so that its body is read).
fn forwarded(head: &RequestHead) -> bool {
    head.method == Method::POST && route(head.uri.path()) == Some(Route::Forward)
}

/// An answer as the listener writes it.
pub(crate) struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) head: AnswerHead,
    pub(crate) body: ProxyBody,
}

/// An answer's headers: those the router sets and those the engine sent.
#[derive(Default)]
pub(crate) struct AnswerHead {
    /// The router's own (its error answers, `/v1/models`).
    pub(crate) headers: HeaderMap,
    /// The engine's header lines, passed on as it sent them (see `upstream::EngineHead`).
    pub(crate) lines: Bytes,
    /// The lines hold a `Date`.
    pub(crate) dated: bool,
    /// A tenant's `x-ratelimit-*` headers, written after `headers` (straight into the head
    /// the listener sends: no header map, no allocation).
    pub(crate) rates: Option<tenants::RateHeaders>,
}

impl From<Response<ProxyBody>> for Answer {
    fn from(response: Response<ProxyBody>) -> Self {
        let (parts, body) = response.into_parts();
        Answer {
            status: parts.status,
            head: AnswerHead {
                headers: parts.headers,
                ..AnswerHead::default()
            },
            body,
        }
    }
}

impl Answer {
    /// An engine's answer (`engine`) passed on with `body`.
    fn engine(engine: upstream::EngineHead, body: ProxyBody) -> Self {
        Answer {
            status: engine.status,
            head: AnswerHead {
                headers: HeaderMap::new(),
                lines: engine.lines,
                dated: engine.dated,
                rates: None,
            },
            body,
        }
    }

    /// As an `http` response (the oneshot [`Proxy::handle`]): the engine's header lines
    /// become headers, and a body of known size gets its `Content-Length` (but for statuses
    /// that have none, RFC 9110 8.6).
    fn into_response(self) -> Response<ProxyBody> {
        let mut headers = self.head.headers;
        if let Some(rates) = self.head.rates {
            rates.write(&mut headers);
        }
        for line in self.head.lines.split(|&b| b == b'\n') {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let Some(colon) = line.iter().position(|&b| b == b':') else {
                continue;
            };
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(&line[..colon]),
                HeaderValue::from_bytes(line[colon + 1..].trim_ascii()),
            ) {
                headers.append(name, value);
            }
        }
        if let Some(size) = self.body.size_hint().exact()
            && !headers.contains_key(header::CONTENT_LENGTH)
            && !bodiless_status(self.status)
        {
            headers.insert(header::CONTENT_LENGTH, HeaderValue::from(size));
        }
        let mut response = Response::new(self.body);
        *response.status_mut() = self.status;
        *response.headers_mut() = headers;
        response
    }
}

/// A status whose answers have no body and carry no `Content-Length` (1xx, 204; 304, whose
/// length would be the 200's), RFC 9110 8.6 and RFC 9112 6.3.
fn bodiless_status(status: StatusCode) -> bool {
    status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
}

/// A request's head as the listener forwards it to an engine.
pub(crate) struct RequestHead {
    pub(crate) method: Method,
    /// As the client sent it; the engine gets its path and query.
    pub(crate) uri: Uri,
    /// The client's end-to-end header lines, each `name: value\r\n`, in their order: not
    /// those of one hop (and those its `Connection` names), `Host`, `Expect`,
    /// `Content-Length` or `Transfer-Encoding`.
    pub(crate) lines: Bytes,
    /// Where its `Authorization` lines are in `lines`, as the listener noted them (`None`:
    /// not noted; [`Proxy::identify`] then looks for them).
    pub(crate) authorization: Option<tenants::AuthorizationLines>,
}

impl RequestHead {
    /// A request's head from its parts (the oneshot [`Proxy::handle`]; [`serve`] gathers the
    /// lines as it parses the head): the same lines as `upstream::gather_lines` keeps.
    fn from_parts(parts: http::request::Parts) -> Self {
        let headers = &parts.headers;
        let named: Vec<&[u8]> = headers
            .get_all(header::CONNECTION)
            .iter()
            .flat_map(|value| upstream::tokens(value.as_bytes()))
            .collect();
        let mut lines = Vec::new();
        upstream::push_headers(&mut lines, headers, |name| {
            upstream::not_forwarded(name) || named.iter().any(|n| n.eq_ignore_ascii_case(name))
        });
        RequestHead {
            method: parts.method,
            uri: parts.uri,
            lines: Bytes::from(lines),
            authorization: None,
        }
    }
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
        let pool = Self::new_pool(&config);
        Self {
            shared: Arc::new(Shared {
                admission,
                catalog: Box::new(catalog),
                budget: budget::Budget::new(config.max_buffered_bytes_total),
                fingerprints: Arc::default(),
                config,
            }),
            pool,
            observer: None,
            adapters: None,
            tenants: None,
        }
    }

    fn new_pool(config: &ProxyConfig) -> Arc<upstream::Pool> {
        upstream::Pool::new(
            config.upstream_idle_per_host.max(32),
            upstream::IDLE_TIMEOUT,
            config.upstream_connect_timeout,
        )
    }

    /// The same listener with a pool of engine connections of its own, for another thread.
    fn for_thread(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
            pool: Self::new_pool(&self.shared.config),
            observer: self.observer.clone(),
            adapters: self.adapters.clone(),
            tenants: self.tenants.clone(),
        }
    }

    /// Serves the LoRA adapters that `lifecycle` knows (its [`Lifecycle::adapter`] and
    /// [`Lifecycle::acquire_adapter`]): the lifecycle the admission resolves names with.
    pub fn with_adapters(mut self, lifecycle: Arc<dyn Lifecycle>) -> Self {
        self.adapters = Some(lifecycle);
        self
    }

    /// Asks every request for a key of one of `tenants` while any is configured (the table
    /// can be replaced at any time: [`Tenants::install`]).
    pub fn with_tenants(mut self, tenants: Arc<Tenants>) -> Self {
        self.tenants = Some(tenants);
        self
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

    /// The budget of the request bodies the listener holds.
    pub(crate) fn budget(&self) -> &Arc<budget::Budget> {
        &self.shared.budget
    }

    /// The bytes of request bodies the listener holds now (being read, waiting for their
    /// admission, being sent to an engine), out of `max_buffered_bytes_total`.
    pub fn buffered_bytes(&self) -> u64 {
        self.shared.budget.used()
    }

    /// Answers one request, without a socket (the listener's `oneshot`). A client that stops
    /// reading a streamed answer cannot be seen here; [`serve`] sees it.
    pub async fn handle<B>(&self, request: Request<B>) -> Response<ProxyBody>
    where
        B: Body<Data = Bytes> + Send,
        B::Error: std::fmt::Display,
    {
        let arrival = Instant::now();
        let (parts, body) = request.into_parts();
        let deadline = arrival + self.config().request_deadline;
        let budget = self.budget();
        let body = async move {
            tokio::time::timeout_at(deadline, read_body(body, budget))
                .await
                .unwrap_or_else(|_| Err(Failure::body_late()))
        };
        let mut head = RequestHead::from_parts(parts);
        let auth = self.identify(&mut head, &mut tenants::KnownKey::default());
        self.respond(self.watch(), head, auth, arrival, body, None)
            .await
            .into_response()
    }

    /// Who sent a request, from its head alone (before its body is read): with tenants, the
    /// tenant of its key, whose `Authorization` line is then taken out of `head` (the key is
    /// not the engine's), or [`Auth::Refused`], which [`Proxy::respond`] answers 401 without
    /// its body; `Auth::Off` without tenants.
    /// `known`: the key the connection's last request was let in with.
    pub(crate) fn identify(&self, head: &mut RequestHead, known: &mut tenants::KnownKey) -> Auth {
        let Some(tenants) = self.tenants.as_deref() else {
            return Auth::Off;
        };
        let (auth, lines) = tenants.identify(&head.lines, head.authorization.as_ref(), known);
        if let Some(lines) = lines {
            // Without the line: what was noted of it no longer applies.
            head.lines = lines;
            head.authorization = None;
        }
        auth
    }

    /// The observer's report of a request whose head just arrived: made once, by
    /// [`Proxy::respond`] or, should the request be dropped before, as `499 client_gone`.
    pub(crate) fn watch(&self) -> Watch {
        Watch::new(self.observer.as_ref())
    }

    /// Answers one request whose head arrived at `arrival`, from the sender `auth` that
    /// [`Proxy::identify`] found in its head; `body` reads its body (within the request
    /// deadline, and the listener's budget) and is not awaited for a refused key; `watch`
    /// reports it.
    pub(crate) async fn respond(
        &self,
        mut watch: Watch,
        head: RequestHead,
        auth: Auth,
        arrival: Instant,
        body: impl Future<Output = Result<RequestBody, Failure>> + Send,
        conn: Option<Arc<ConnWatch>>,
    ) -> Answer {
        // With tenants, the key first: a request without a valid one learns nothing else, and
        // its body is not read (a 401 costs the same whatever the key or the body).
        let tenant = match auth {
            Auth::Off => None,
            Auth::Tenant(tenant) => Some(tenant),
            Auth::Refused => {
                let failure = Failure::Api(ApiError::KeyRequired);
                watch.end(failure.status(), Some(failure.code()));
                let mut response = failure.response();
                response
                    .headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                return response.into();
            }
        };
        let mut answer = match self
            .answer(head, body, arrival, conn, &mut watch, tenant.as_ref())
            .await
        {
            Ok(answer) => {
                // A fixed body (`/v1/models`, a stream that ended before output): over now.
                watch.end(answer.status.as_u16(), None);
                answer
            }
            Err(failure) => {
                watch.end(failure.status(), Some(failure.code()));
                failure.response().into()
            }
        };
        if let Some(tenant) = &tenant {
            tenant.answered(answer.status.as_u16());
            answer.head.rates = tenant.rate_headers(Instant::now());
        }
        answer
    }

    async fn answer(
        &self,
        request: RequestHead,
        body: impl Future<Output = Result<RequestBody, Failure>>,
        arrival: Instant,
        conn: Option<Arc<ConnWatch>>,
        watch: &mut Watch,
        tenant: Option<&Arc<TenantEntry>>,
    ) -> Result<Answer, Failure> {
        let shared = &*self.shared;
        let config = &shared.config;
        match (route(request.uri.path()), &request.method) {
            (Some(Route::Forward), &Method::POST) => {}
            (Some(Route::Models), &Method::GET) => return Ok(self.models(tenant).into()),
            (Some(_), _) => return Err(Failure::MethodNotAllowed),
            (None, _) => {
                return Err(Failure::Api(ApiError::NotFound {
                    what: format!("route {} {}", request.method, request.uri.path()),
                }));
            }
        }

        let deadline = arrival + config.request_deadline;
        let mut body = body.await?;
        let model = model_of(&body)?;
        watch.model(&model);
        if let Some(tenant) = tenant {
            // Before the model is resolved: one it may not use is answered as an unknown one,
            // without looking it up.
            if !tenant.allows(&model) {
                return Err(Failure::Api(ApiError::ModelNotFound {
                    model: model.into_owned(),
                }));
            }
            tenant.admit(Instant::now()).map_err(Failure::Api)?;
        }
        let Some(deployment) = shared.admission.resolve(&model) else {
            return Err(Failure::Api(ApiError::ModelNotFound {
                model: model.into_owned(),
            }));
        };
        // A name that resolves to a deployment of another name may be an adapter's (its base).
        let adapter = match &self.adapters {
            Some(lifecycle) if deployment.name != *model => lifecycle
                .adapter(&model)
                .map(|route| (Arc::clone(lifecycle), route)),
            _ => None,
        };
        // The instances that have it loaded take it first (DESIGN 4.9).
        let prefer = adapter
            .as_ref()
            .map_or_else(Vec::new, |(lifecycle, route)| {
                lifecycle.adapter_loaded_on(&route.name)
            });
        drop(model);
        // The base's engine may need the adapter named in a field of its own (SGLang's
        // `lora_path`; see `AdapterRoute::request_field`).
        if let Some(named) = adapter
            .as_ref()
            .and_then(|(_, route)| route.name_in_body(&body))
        {
            body = body.with_bytes(Bytes::from(named));
        }
        // A tenant whose tokens are limited: a streamed request is asked for its usage, which
        // its answer's tap then takes back out (see `usage`).
        // `Some(single)`: asked, for a request of one choice when `single`.
        let mut strip = None;
        if tenant.is_some_and(|t| t.counts_tokens())
            && request.uri.path() != "/v1/embeddings"
            && let Some(asked) = usage::ask_usage(&body)
        {
            strip = Some(usage::single_choice(&body));
            body = body.with_bytes(Bytes::from(asked));
        }
        // Only a deployment routed by `prefix` pays for the prompt's scan.
        let prefix = if deployment.routing == capyctl_spec::Routing::Prefix {
            prompt_prefix(&body)
        } else {
            None
        };
        let deployment_id = deployment.id.clone();
        watch.deployment(&deployment_id);
        watch.asking();
        // Where the coordinator counts a waiter's time from, so that the deadline's error is
        // decided on the same span here (below) as there.
        let asked = Instant::now();
        let waiting = tenant.map(|t| t.waiting());
        // The admission enforces the deadline itself (and tells which error applies); the
        // grace only keeps a request from hanging should it not.
        let admitted = tokio::time::timeout_at(
            deadline + ADMIT_GRACE,
            shared.admission.admit_preferring(
                deployment,
                deadline,
                prefix,
                tenant.map(|t| t.name_arc()),
                prefer,
            ),
        )
        .await;
        drop(waiting);
        watch.answered();
        let permit = match admitted {
            Ok(permit) => permit.map_err(Failure::Api)?,
            Err(_) => {
                return Err(Failure::Api(ApiError::QueueDeadline {
                    deployment: deployment_id,
                }));
            }
        };

        let lease = match &adapter {
            None => None,
            Some((lifecycle, route)) => {
                let key = &permit.upstream().key;
                let acquired = tokio::time::timeout_at(
                    deadline + ADMIT_GRACE,
                    lifecycle.acquire_adapter(key, route, deadline),
                )
                .await;
                match acquired {
                    Ok(lease) => Some(lease.map_err(Failure::Api)?),
                    Err(_) => {
                        return Err(Failure::Api(ApiError::QueueDeadline {
                            deployment: deployment_id,
                        }));
                    }
                }
            }
        };
        // An adapter request's instance, should its engine answer as if it lacked the adapter.
        let adapter_on = adapter.as_ref().map(|_| permit.upstream().key.clone());
        // The usage taken out of the stream, with what is known of its engine's fingerprint.
        let strip = strip.map(|single| {
            let engine = usage::Engine::new(&shared.fingerprints, &permit.upstream().key);
            usage::Strip::new(config.max_piece, engine).single_choice(single)
        });
        let addr = permit.upstream().addr;
        // Which error a deadline before the first output is (one rule with the coordinator's,
        // on the same span: from the request's admission to its deadline).
        let waits = (
            deadline.saturating_duration_since(asked),
            permit.waited_at_bound(),
        );
        // Dropped without an end (the client went away meanwhile): cut, `client_gone`.
        let mut charge = Charge::new(Leased {
            permit,
            _lease: lease,
        });

        // Boxed: this future is large and lives only from here on, so the request's future
        // stays small while it waits for its admission (4096 may wait).
        let sent = Box::pin(self.pool.request(addr, &request, body));
        let (engine, mut upstream) = match tokio::time::timeout_at(deadline, sent).await {
            Ok(Ok(answered)) => answered,
            Ok(Err(err)) => {
                tracing::debug!(error = %err, "engine unreachable");
                charge.cut("upstream_unavailable");
                return Err(Failure::upstream(&err));
            }
            Err(_) => {
                let error = crate::admission::deadline_error(&deployment_id, waits.1, waits.0);
                charge.cut(error.metric_label());
                return Err(Failure::Api(error));
            }
        };
        let status = engine.status;
        // An adapter request's answer that says the engine does not have it (lost in a way
        // CapyCTL was not told of: vLLM's 404, SGLang's 400 naming it) is never passed on;
        // the next request loads it again. A 400 that may say so is read whole first, and
        // passed on below as it came when it does not (see `lost`).
        let mut read = None;
        if let (Some((lifecycle, route)), Some(key)) = (&adapter, &adapter_on) {
            if lost::worth_reading(route, &engine, &upstream) {
                match lost::read_whole(&mut upstream, config.stream_idle_timeout).await {
                    Ok(bytes) => read = Some(bytes),
                    Err((error, code)) => {
                        // The engine's head was its first output; its body broke off.
                        charge.output();
                        charge.cut(code);
                        return Err(Failure::Api(error));
                    }
                }
            }
            let body = read.as_deref().unwrap_or_default();
            if let Some(said) = lost::says_not_loaded(status, body, &route.name) {
                return Err(lost::answer(&**lifecycle, key, route, said, &mut charge));
            }
        }
        if let Some(bytes) = read {
            // Read whole above: over now, passed on byte for byte.
            drop(upstream);
            charge.output();
            charge.finish();
            let body = ProxyBody::full(bytes).tapped(tap(tenant));
            return Ok(Answer::engine(engine, body));
        }
        if !engine.event_stream {
            charge.output();
            let mut charge: Box<dyn Track> = Box::new(charge);
            watch.hand_to(&mut *charge, status.as_u16(), false);
            let body = DirectBody::new(upstream, charge, config.stream_idle_timeout, conn);
            let body = ProxyBody::direct(body).tapped(tap(tenant));
            return Ok(Answer::engine(engine, body));
        }

        let settings = StreamSettings {
            deadline,
            waits,
            idle: config.stream_idle_timeout,
            max_piece: config.max_piece,
            conn,
        };
        // SGLang may say so in its stream instead (a `200` whose first event is its error).
        let judge = adapter
            .as_ref()
            .filter(|(_, route)| lost::reads_in_body(route))
            .map(|(_, route)| route.name.as_str());
        let started =
            body::start_stream(upstream, Box::new(charge), &deployment_id, settings, judge);
        match started.await {
            Start::Stream(mut body) => {
                if let Some(charge) = body.charge_mut() {
                    watch.hand_to(charge, status.as_u16(), true);
                }
                let body = ProxyBody::stream(body).tapped(tap_stream(tenant, strip));
                Ok(Answer::engine(engine, body))
            }
            Start::Whole(bytes) => {
                let body = ProxyBody::full(bytes).tapped(tap_stream(tenant, strip));
                Ok(Answer::engine(engine, body))
            }
            Start::Fail(failure) => Err(failure),
            Start::Lost(said, mut charge) => match (&adapter, &adapter_on) {
                (Some((lifecycle, route)), Some(key)) => {
                    Err(lost::answer(&**lifecycle, key, route, said, &mut *charge))
                }
                // (Only an adapter request's stream is judged.)
                _ => Err(Failure::Api(ApiError::Internal {
                    detail: format!("a stream judged without an adapter: {said}"),
                })),
            },
        }
    }

    fn models(&self, tenant: Option<&Arc<TenantEntry>>) -> Response<ProxyBody> {
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
                .filter(|m| tenant.is_none_or(|t| t.allows(&m.id)))
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

/// The usage tap of a tenant's answer, for its tokens.
fn tap(tenant: Option<&Arc<TenantEntry>>) -> Option<Box<body::UsageTap>> {
    tenant.map(|t| body::UsageTap::new(Arc::clone(t)))
}

/// The usage tap of a tenant's streamed answer, taking out the usage the listener asked for
/// with `strip`.
fn tap_stream(
    tenant: Option<&Arc<TenantEntry>>,
    strip: Option<usage::Strip>,
) -> Option<Box<body::UsageTap>> {
    let tap = tap(tenant)?;
    Some(match strip {
        Some(strip) => tap.stripping(strip),
        None => tap,
    })
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
    /// A request body that could not be read (cut short, badly framed).
    pub(crate) fn unreadable(err: &dyn std::fmt::Display) -> Self {
        Failure::Api(ApiError::InvalidRequest {
            detail: format!("the body could not be read: {err}"),
        })
    }

    /// A request body still arriving at the request deadline.
    pub(crate) fn body_late() -> Self {
        Failure::Api(ApiError::InvalidRequest {
            detail: "the body did not arrive within the request deadline".to_string(),
        })
    }

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

/// Reads the request body within the listener's budget: a declared length that does not fit
/// now is refused before anything is read (413 over the bound, 429 when others hold it), and
/// what arrives is gathered with its buffer's room taken as it grows (see `budget`).
async fn read_body<B>(body: B, budget: &Arc<budget::Budget>) -> Result<RequestBody, Failure>
where
    B: Body<Data = Bytes>,
    B::Error: std::fmt::Display,
{
    let mut gathered = match body.size_hint().exact() {
        Some(declared) => budget::Gather::declared(budget, declared).map_err(Failure::Api)?,
        None => budget::Gather::new(budget),
    };
    let mut body = std::pin::pin!(body);
    while let Some(frame) = body.as_mut().frame().await {
        let frame = frame.map_err(|err| Failure::unreadable(&err))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        gathered.push(&data).map_err(Failure::Api)?;
    }
    Ok(gathered.finish())
}

/// The body's `model`: the value of the top-level object's `model` key, which must be there
/// once (one reading of `model`: the router routes by the one it reads, and an engine whose
/// JSON reader keeps the last of two would serve the other).
///
/// NB: a structural scan of the top-level object's keys, with no document built: values are
/// walked over (strings skipped with `memchr`, brackets balanced), so a `model` inside one is
/// not a key of the request. Past the first `model` the walk goes on only when another could
/// follow ([`another_model_key_may_follow`]); what the walk does not check (a bad literal or
/// number, what follows `model` in a body that has no second one, bytes after the object)
/// goes to the engine, which answers it with its own 400.
pub(super) fn model_of(body: &[u8]) -> Result<Cow<'_, str>, Failure> {
    let invalid = |detail: &str| {
        Failure::Api(ApiError::InvalidRequest {
            detail: detail.to_string(),
        })
    };
    let not_json = || invalid("the body is not valid JSON: expected a JSON object with a `model`");
    let mut scan = JsonScan { b: body, i: 0 };
    match scan.skip_ws() {
        None => {
            return Err(invalid(
                "the body is empty: expected a JSON object with a `model`",
            ));
        }
        Some(b'{') => scan.i += 1,
        Some(_) => {
            return Err(invalid(
                "the body is not a JSON object: expected a JSON object with a `model`",
            ));
        }
    }
    let mut model = None;
    let mut first = true;
    loop {
        match scan.skip_ws() {
            Some(b'}') if first => return Err(invalid("the body has no `model`")),
            Some(b'"') => {}
            _ => return Err(not_json()),
        }
        let key = scan.string().ok_or_else(not_json)?;
        if scan.skip_ws() != Some(b':') {
            return Err(not_json());
        }
        scan.i += 1;
        if is_model_key(key) {
            if model.is_some() {
                return Err(invalid(
                    "the body has `model` more than once: it must name one model (the router would route by the first and the engine read the last)",
                ));
            }
            let found = match scan.skip_ws() {
                Some(b'"') => {
                    let raw = scan.string().ok_or_else(not_json)?;
                    let model = json_string(raw).ok_or_else(not_json)?;
                    if model.is_empty() {
                        return Err(invalid("the body's `model` is empty"));
                    }
                    model
                }
                None => return Err(not_json()),
                Some(_) => return Err(invalid("the body's `model` must be a string")),
            };
            if !another_model_key_may_follow(&scan.b[scan.i..]) {
                return Ok(found);
            }
            model = Some(found);
        } else {
            scan.value().ok_or_else(not_json)?;
        }
        match scan.skip_ws() {
            Some(b',') => scan.i += 1,
            Some(b'}') => return model.ok_or_else(|| invalid("the body has no `model`")),
            _ => return Err(not_json()),
        }
        first = false;
    }
}

/// Whether `rest` (what follows a body's first `model`) can hold another `model` key: only if
/// it has `"model"`, or an escape `\u00..` (the only escapes that stand for a letter, as in
/// `"mod\u0065l"`). Most bodies have neither, and their scan stops at their `model` (what
/// follows is the engine's to read), as it did before duplicates were looked for: two SIMD
/// searches instead of a walk over the rest (about 1K instructions per request for the
/// benchmark's body, callgrind).
fn another_model_key_may_follow(rest: &[u8]) -> bool {
    static QUOTED: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
        std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"model\""));
    static ESCAPE: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
        std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\\u00"));
    QUOTED.find(rest).is_some() || ESCAPE.find(rest).is_some()
}

/// Whether a raw (still escaped) object key is `model`.
fn is_model_key(raw: &[u8]) -> bool {
    raw == b"model" || (raw.contains(&b'\\') && json_string(raw).is_some_and(|k| k == "model"))
}

/// A raw JSON string's text (between its quotes, still escaped); `None` if it is not valid.
fn json_string(raw: &[u8]) -> Option<Cow<'_, str>> {
    if !raw.contains(&b'\\') {
        return std::str::from_utf8(raw).ok().map(Cow::Borrowed);
    }
    let mut quoted = Vec::with_capacity(raw.len() + 2);
    quoted.push(b'"');
    quoted.extend_from_slice(raw);
    quoted.push(b'"');
    serde_json::from_slice::<String>(&quoted)
        .ok()
        .map(Cow::Owned)
}

/// The prefix key of a request's prompt, for a deployment routed by `prefix` (DESIGN 4.7): the
/// hash of the first [`PREFIX_BYTES`] bytes of its prompt text: the top-level `prompt`
/// (completions) or the `content` of each of the top-level `messages` in turn, concatenated
/// (chat). `None` when the body has neither (the request is routed least_loaded).
///
/// NB: the text is taken as the body writes it (string contents with their escapes, not
/// decoded; a `prompt` of token IDs or a `content` of parts as its raw JSON): the same prompt
/// written the same way gives the same key, which is all affinity needs, and nothing is
/// allocated. Keys are matched as written (an escaped key is not recognised). The scan stops
/// once it has its bytes; what it does not read is the engine's to check.
pub(super) fn prompt_prefix(body: &[u8]) -> Option<u64> {
    let mut scan = JsonScan { b: body, i: 0 };
    if scan.skip_ws()? != b'{' {
        return None;
    }
    scan.i += 1;
    let mut text = PrefixText {
        hash: Fnv::new(),
        left: PREFIX_BYTES,
        fed: false,
    };
    loop {
        let key = scan.key()?;
        match key {
            b"prompt" => text.value(&mut scan)?,
            b"messages" => text.messages(&mut scan)?,
            _ => scan.value()?,
        }
        if text.fed && (text.left == 0 || matches!(key, b"prompt" | b"messages")) {
            return Some(text.hash.finish());
        }
        match scan.skip_ws()? {
            b',' => scan.i += 1,
            _ => return None,
        }
    }
}

/// The prompt text [`prompt_prefix`] hashes, up to its budget.
struct PrefixText {
    hash: Fnv,
    /// Bytes still to take.
    left: usize,
    /// Something was taken.
    fed: bool,
}

impl PrefixText {
    fn feed(&mut self, bytes: &[u8]) {
        let take = &bytes[..bytes.len().min(self.left)];
        if !take.is_empty() {
            self.hash.write(take);
            self.left -= take.len();
            self.fed = true;
        }
    }

    /// One value's text: a string's contents, anything else as its raw JSON.
    fn value(&mut self, scan: &mut JsonScan<'_>) -> Option<()> {
        if scan.skip_ws()? == b'"' {
            let s = scan.string()?;
            self.feed(s);
        } else {
            let start = scan.i;
            scan.value()?;
            self.feed(scan.b.get(start..scan.i)?);
        }
        Some(())
    }

    /// The `content` of each message of a `messages` array, in turn.
    fn messages(&mut self, scan: &mut JsonScan<'_>) -> Option<()> {
        if scan.skip_ws()? != b'[' {
            return scan.value();
        }
        scan.i += 1;
        if scan.skip_ws()? == b']' {
            scan.i += 1;
            return Some(());
        }
        loop {
            if self.left == 0 {
                return Some(());
            }
            if scan.skip_ws()? == b'{' {
                scan.i += 1;
                let mut first = true;
                loop {
                    if first && scan.skip_ws()? == b'}' {
                        break;
                    }
                    if scan.key()? == b"content" {
                        self.value(scan)?;
                    } else {
                        scan.value()?;
                    }
                    match scan.skip_ws()? {
                        b',' => scan.i += 1,
                        b'}' => break,
                        _ => return None,
                    }
                    first = false;
                }
                scan.i += 1;
            } else {
                scan.value()?;
            }
            match scan.skip_ws()? {
                b',' => scan.i += 1,
                b']' => {
                    scan.i += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }
}

/// Just enough of JSON to walk over values without building them.
struct JsonScan<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> JsonScan<'a> {
    /// Skips whitespace; the next byte, not consumed.
    fn skip_ws(&mut self) -> Option<u8> {
        while let Some(&c) = self.b.get(self.i) {
            if !matches!(c, b' ' | b'\t' | b'\n' | b'\r') {
                return Some(c);
            }
            self.i += 1;
        }
        None
    }

    /// At a `"`: the string's raw bytes, and the position past its closing quote.
    fn string(&mut self) -> Option<&'a [u8]> {
        let start = self.i + 1;
        let mut at = start;
        loop {
            let rest = self.b.get(at..)?;
            let found = at + memchr::memchr2(b'"', b'\\', rest)?;
            if self.b.get(found) == Some(&b'\\') {
                at = found + 2;
                continue;
            }
            self.i = found + 1;
            return self.b.get(start..found);
        }
    }

    /// At an object's key: the key's raw bytes, and the position past its `:`.
    fn key(&mut self) -> Option<&'a [u8]> {
        if self.skip_ws()? != b'"' {
            return None;
        }
        let key = self.string()?;
        if self.skip_ws()? != b':' {
            return None;
        }
        self.i += 1;
        Some(key)
    }

    /// Skips one value (object, array, string or literal), checking only that brackets
    /// balance and strings end.
    fn value(&mut self) -> Option<()> {
        let mut depth = 0usize;
        loop {
            match self.skip_ws()? {
                b'"' => {
                    self.string()?;
                }
                b'{' | b'[' => {
                    depth += 1;
                    self.i += 1;
                }
                b'}' | b']' => {
                    depth = depth.checked_sub(1)?;
                    self.i += 1;
                }
                b',' | b':' if depth > 0 => self.i += 1,
                _ => {
                    let start = self.i;
                    while self.b.get(self.i).is_some_and(|c| {
                        !matches!(
                            c,
                            b',' | b':' | b'}' | b']' | b'"' | b' ' | b'\t' | b'\n' | b'\r'
                        )
                    }) {
                        self.i += 1;
                    }
                    if self.i == start {
                        return None;
                    }
                }
            }
            if depth == 0 {
                return Some(());
            }
        }
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
    fn the_prompt_prefix_is_the_first_bytes_of_the_prompt_text() {
        let key = |body: &str| prompt_prefix(body.as_bytes());
        let hash = |text: &str| {
            let mut h = Fnv::new();
            h.write(text.as_bytes());
            Some(h.finish())
        };
        // Completions: `prompt`, wherever it is among the keys.
        assert_eq!(
            key(r#"{"model":"m","prompt":"Hello there"}"#),
            hash("Hello there")
        );
        assert_eq!(
            key(r#"{"prompt" : "Hello there", "model":"m", "max_tokens": 3}"#),
            hash("Hello there")
        );
        // Chat: the contents concatenated, other keys of each message skipped.
        assert_eq!(
            key(
                r#"{"model":"m","messages":[{"role":"system","content":"Be brief. "},{"content":"Hi","role":"user","x":{"content":"no"}}]}"#
            ),
            hash("Be brief. Hi")
        );
        // Only the first PREFIX_BYTES bytes count: prompts that differ after them share a key.
        let long = "x".repeat(PREFIX_BYTES);
        let a = key(&format!(r#"{{"model":"m","prompt":"{long}tail one"}}"#));
        let b = key(&format!(r#"{{"model":"m","prompt":"{long}tail two"}}"#));
        assert_eq!(a, b);
        assert_eq!(a, hash(&long));
        let chat = |last: &str| {
            key(&format!(
                r#"{{"model":"m","messages":[{{"role":"system","content":"{long}"}},{{"role":"user","content":"{last}"}}]}}"#
            ))
        };
        assert_eq!(chat("one"), chat("two"));
        // Different prompts, different keys.
        assert_ne!(key(r#"{"prompt":"a"}"#), key(r#"{"prompt":"b"}"#));
        // Token IDs and content parts: their raw JSON.
        assert_eq!(key(r#"{"prompt":[1, 2,3]}"#), hash("[1, 2,3]"));
        assert_eq!(
            key(r#"{"messages":[{"content":[{"type":"text","text":"t"}]}]}"#),
            hash(r#"[{"type":"text","text":"t"}]"#)
        );
    }

    #[test]
    fn the_prompt_prefix_agrees_with_serde_json() {
        let long = "y".repeat(2 * PREFIX_BYTES);
        for body in [
            r#"{"model":"m","prompt":"Hello"}"#.to_string(),
            format!(r#"{{"prompt":"{long}","model":"m"}}"#),
            r#"{"messages":[{"content":"a"}],"prompt":"b"}"#.to_string(),
            r#"{"model":"m","prompt":["x", 1]}"#.to_string(),
        ] {
            fuzz::model(body.as_bytes());
        }
    }

    #[test]
    fn a_body_without_a_prompt_has_no_prefix_key() {
        for body in [
            r#"{"model":"m"}"#,
            r#"{"model":"m","prompt":""}"#,
            r#"{"model":"m","messages":[]}"#,
            r#"{"model":"m","messages":[{"role":"user"}]}"#,
            r#"{"model":"m","input":"not a prompt"}"#,
            r#"{"model":"m","prompt":"unterminated"#,
            r#"["prompt","x"]"#,
            "",
        ] {
            assert_eq!(prompt_prefix(body.as_bytes()), None, "{body}");
        }
    }

    #[test]
    fn model_is_read_without_the_rest() {
        let body = br#"{"messages":[{"role":"user","content":"hi \"x\" {[}"}],"n":-1.5e3,"ok":true,"x":null,"model":"chat-a","stream":true}"#;
        assert_eq!(model_of(body).unwrap(), "chat-a");
        assert_eq!(model_of(br#" {"model":"a\u00e9"}"#).unwrap(), "a\u{e9}");
        assert_eq!(model_of(br#"{"mod\u0065l" : "b"}"#).unwrap(), "b");
        assert_eq!(
            model_of(br#"{"x":{"model":"inner"},"model":"outer"}"#).unwrap(),
            "outer"
        );
        // Only the top-level object's keys count: `model` inside a message or an array is
        // not a second one.
        let nested = br#"{"model":"a","messages":[{"role":"user","content":"x","model":"b"}],"tools":[{"model":"c"}],"m":{"model":{"model":"d"}},"s":"\"model\":\"e\""}"#;
        assert_eq!(model_of(nested).unwrap(), "a");
    }

    #[test]
    fn only_a_body_that_may_hold_a_second_model_is_walked_past_its_first() {
        assert!(!another_model_key_may_follow(
            br#","messages":[{"content":"a \"b\" \n"}]}"#
        ));
        assert!(another_model_key_may_follow(br#","x":{"model":1}}"#));
        assert!(another_model_key_may_follow(br#","mod\u0065l":"b"}"#));
        // A broken rest with no second `model` is the engine's to read, as before.
        assert_eq!(model_of(br#"{"model":"a","x":[}"#).unwrap(), "a");
        // With a `\u00` escape in the content, the rest is walked (and a nested `model` is
        // still not a second one).
        let body = br#"{"model":"a","messages":[{"content":"caf\u00e9","model":"b"}]}"#;
        assert_eq!(model_of(body).unwrap(), "a");
    }

    #[test]
    fn a_second_model_is_refused() {
        for body in [
            &br#"{"model":"a","model":"b"}"#[..],
            br#"{"model":"a","messages":[],"model":"a"}"#,
            br#"{"model":"a","mod\u0065l":"b"}"#,
            br#"{"x":1,"model":"a","stream":true,"model":5}"#,
        ] {
            let detail = detail(model_of(body));
            assert!(detail.contains("`model` more than once"), "{detail}");
        }
    }

    #[test]
    fn bad_bodies_say_what_is_wrong() {
        assert!(detail(model_of(b"")).contains("empty"));
        assert!(detail(model_of(b"[1]")).contains("not a JSON object"));
        assert!(detail(model_of(b"{\"model\":")).contains("not valid JSON"));
        assert!(detail(model_of(br#"{"prompt":"x"}"#)).contains("no `model`"));
        assert!(detail(model_of(br#"{"model":5}"#)).contains("must be a string"));
        assert!(detail(model_of(br#"{"model":""}"#)).contains("empty"));
        assert!(detail(model_of(br#"{}"#)).contains("no `model`"));
        assert!(detail(model_of(br#"{"a":[1,2}"#)).contains("not valid JSON"));
        assert!(detail(model_of(br#"{"a":"unterminated"#)).contains("not valid JSON"));
        assert!(detail(model_of(br#"{"a" 1}"#)).contains("not valid JSON"));
        assert!(detail(model_of(br#"{"model":"\ud800"}"#)).contains("not valid JSON"));
    }

    #[test]
    fn a_request_from_parts_keeps_only_its_end_to_end_headers() {
        let request = Request::post("http://client.example/v1/completions?x=1")
            .header(header::HOST, "client.example")
            .header(header::CONNECTION, "keep-alive, X-Hop")
            .header("x-hop", "1")
            .header("keep-alive", "timeout=5")
            .header(header::TRANSFER_ENCODING, "chunked")
            .header(header::CONTENT_LENGTH, "9")
            .header(header::EXPECT, "100-continue")
            .header(header::TE, "trailers")
            .header(header::AUTHORIZATION, "Bearer x")
            .header(header::CONTENT_TYPE, "application/json")
            .body(())
            .unwrap();
        let head = RequestHead::from_parts(request.into_parts().0);
        assert_eq!(head.method, Method::POST);
        assert_eq!(head.uri.path(), "/v1/completions");
        assert_eq!(
            head.lines,
            "authorization: Bearer x\r\ncontent-type: application/json\r\n"
        );
    }

    #[test]
    fn an_engine_answer_as_an_http_response_has_the_engines_headers_and_its_length() {
        let answer = Answer {
            status: StatusCode::CREATED,
            head: AnswerHead {
                headers: HeaderMap::new(),
                lines: Bytes::from_static(b"Content-Type: text/plain\r\nx-a: 1\r\nx-a:  2 \r\n"),
                dated: false,
                rates: None,
            },
            body: ProxyBody::full(Bytes::from_static(b"abc")),
        };
        let response = answer.into_response();
        assert_eq!(response.status(), StatusCode::CREATED);
        let headers = response.headers();
        assert_eq!(headers[header::CONTENT_TYPE], "text/plain");
        let a: Vec<_> = headers.get_all("x-a").iter().collect();
        assert_eq!(a, ["1", "2"]);
        assert_eq!(headers[header::CONTENT_LENGTH], "3");
        assert_eq!(headers.len(), 4);

        for status in [StatusCode::NO_CONTENT, StatusCode::NOT_MODIFIED] {
            let answer = Answer {
                status,
                head: AnswerHead::default(),
                body: ProxyBody::full(Bytes::new()),
            };
            let response = answer.into_response();
            assert!(
                !response.headers().contains_key(header::CONTENT_LENGTH),
                "{status}"
            );
        }
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
