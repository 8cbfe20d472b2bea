//! The node agent's HTTP server: every [`HostAgent`] method under `/agent/v1` (see the route
//! table in [`super`]).

use std::collections::VecDeque;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use tokio::net::TcpListener;
use tokio::sync::{broadcast, watch};

use super::wire::{
    AdapterLoad, AdaptersPage, AgentInfo, ErrorBody, ExitsPage, NumberedExit, SamplesPage,
    status_of,
};
use crate::agent::{EngineExit, HostAgent};
use crate::error::AgentError;
use crate::spec::InstanceSpec;

/// How many exits the server holds for clients that reconnect.
const EXITS_HELD: usize = 1024;
/// The longest a client may make `GET /agent/v1/exits` wait.
pub const EXITS_WAIT_MAX: Duration = Duration::from_secs(60);
/// The wait of `GET /agent/v1/exits` when the client names none.
pub const EXITS_WAIT_DEFAULT: Duration = Duration::from_secs(25);

/// What the server needs besides the agent.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// The token every `/agent/v1` request must carry as `Authorization: Bearer`.
    pub token: String,
    /// What `GET /agent/v1/info` answers.
    pub info: AgentInfo,
}

/// Exits with sequence numbers, for long polls.
struct ExitLog {
    /// This server's life: its start time in nanoseconds.
    epoch: u64,
    held: Mutex<LogInner>,
    /// The `next` sequence number, after every change.
    changed: watch::Sender<u64>,
}

struct LogInner {
    next: u64,
    held: VecDeque<NumberedExit>,
}

impl ExitLog {
    fn new() -> Self {
        let epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
            .unwrap_or(1);
        Self {
            epoch,
            held: Mutex::new(LogInner {
                next: 0,
                held: VecDeque::new(),
            }),
            changed: watch::channel(0).0,
        }
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, LogInner> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn push(&self, exit: EngineExit) {
        let next = {
            let mut log = self.inner();
            let seq = log.next;
            log.next += 1;
            log.held.push_back(NumberedExit { seq, exit });
            while log.held.len() > EXITS_HELD {
                log.held.pop_front();
            }
            log.next
        };
        self.changed.send_replace(next);
    }

    /// `n` exits the server itself missed (its subscription lagged).
    fn skip(&self, n: u64) {
        let next = {
            let mut log = self.inner();
            log.next += n;
            log.next
        };
        self.changed.send_replace(next);
    }

    fn page(&self, after: u64) -> ExitsPage {
        let log = self.inner();
        let after = after.min(log.next);
        let exits: Vec<NumberedExit> = log
            .held
            .iter()
            .filter(|e| e.seq >= after)
            .cloned()
            .collect();
        ExitsPage {
            epoch: self.epoch,
            next: log.next,
            missed: (log.next - after).saturating_sub(exits.len() as u64),
            exits,
        }
    }

    /// Feeds the log from the agent's exits until the agent is gone.
    async fn follow(self: Arc<Self>, mut rx: broadcast::Receiver<EngineExit>) {
        loop {
            match rx.recv().await {
                Ok(exit) => self.push(exit),
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    tracing::warn!(
                        missed = n,
                        "node agent server: fell behind the engine exits"
                    );
                    self.skip(n);
                }
                Err(broadcast::error::RecvError::Closed) => return,
            }
        }
    }
}

#[derive(Clone)]
struct AppState {
    agent: Arc<dyn HostAgent>,
    token: Arc<str>,
    info: Arc<AgentInfo>,
    exits: Arc<ExitLog>,
    /// `true` once the server is shutting down (ends long polls).
    closing: watch::Receiver<bool>,
}

/// The server's routes over `agent`. Spawns the task that numbers the agent's exits, so call
/// it inside a Tokio runtime; exits are held from this call on.
pub fn router(agent: Arc<dyn HostAgent>, options: ServerOptions) -> Router {
    let (tx, rx) = watch::channel(false);
    // Never closing: the sender lives as long as the state.
    let keep = Arc::new(tx);
    build(agent, options, rx).layer(axum::Extension(keep))
}

fn build(
    agent: Arc<dyn HostAgent>,
    options: ServerOptions,
    closing: watch::Receiver<bool>,
) -> Router {
    let exits = Arc::new(ExitLog::new());
    tokio::spawn(Arc::clone(&exits).follow(agent.subscribe_exits()));
    let state = AppState {
        agent,
        token: options.token.into(),
        info: Arc::new(options.info),
        exits,
        closing,
    };
    let v1 = Router::new()
        .route("/info", get(info))
        .route("/inventory", get(inventory))
        .route("/engines", get(engines))
        .route("/measure", post(measure))
        .route("/parkability", post(parkability))
        .route("/recover", post(recover))
        .route("/samples", get(samples))
        .route("/exits", get(exits_poll))
        .route("/instances/{instance}/start", post(start))
        .route("/instances/{instance}/park", post(park))
        .route("/instances/{instance}/wake", post(wake))
        .route("/instances/{instance}/stop", post(stop))
        .route("/instances/{instance}/sample", get(sample))
        .route(
            "/instances/{instance}/adapters",
            get(adapters).post(load_adapter),
        )
        .route(
            "/instances/{instance}/adapters/{name}/unload",
            post(unload_adapter),
        )
        .route_layer(middleware::from_fn_with_state(state.clone(), authorize));
    Router::new()
        .route("/healthz", get(healthz))
        .nest("/agent/v1", v1)
        .with_state(state)
}

/// Serves `agent` on `listener` until `shutdown` resolves; then long polls answer at once and
/// the server waits for the calls in flight.
pub async fn serve(
    listener: TcpListener,
    agent: Arc<dyn HostAgent>,
    options: ServerOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let (tx, rx) = watch::channel(false);
    let app = build(agent, options, rx);
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            shutdown.await;
            let _ = tx.send(true);
        })
        .await
}

/// An error answer: the status of the error and its [`ErrorBody`].
struct Failure(u16, Box<ErrorBody>);

impl From<AgentError> for Failure {
    fn from(e: AgentError) -> Self {
        Failure(status_of(&e), Box::new(ErrorBody::of(&e)))
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.0).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, axum::Json(*self.1)).into_response()
    }
}

type Reply<T> = Result<axum::Json<T>, Failure>;

async fn authorize(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let authorized = capyctl_spec::auth::bearer_matches(
        request
            .headers()
            .get(header::AUTHORIZATION)
            .map(|v| v.as_bytes()),
        state.token.as_bytes(),
    );
    if !authorized {
        tracing::debug!(
            path = request.uri().path(),
            "node agent: refused without the agent token"
        );
        return Failure(
            401,
            Box::new(ErrorBody {
                code: "unauthorized".into(),
                message: "the agent token is missing or wrong".into(),
                retryable: false,
                error: None,
            }),
        )
        .into_response();
    }
    next.run(request).await
}

fn parse<T: DeserializeOwned>(body: &Bytes, what: &str) -> Result<T, Failure> {
    serde_json::from_slice(body).map_err(|source| {
        let e = AgentError::Json {
            what: format!("the request's body is not {what}: {source}"),
            source,
        };
        Failure(400, Box::new(ErrorBody::of(&e)))
    })
}

/// Runs `op` to its end in a task of its own, so that a caller going away (a timeout) does not
/// cut an engine operation in half.
async fn run<T: Send + 'static>(
    op: impl Future<Output = Result<T, AgentError>> + Send + 'static,
) -> Reply<T> {
    match tokio::spawn(op).await {
        Ok(r) => r.map(axum::Json).map_err(Failure::from),
        Err(e) => Err(AgentError::io(
            "the operation's task failed",
            std::io::Error::other(e.to_string()),
        )
        .into()),
    }
}

async fn healthz() -> axum::Json<serde_json::Value> {
    axum::Json(serde_json::json!({"status": "ok"}))
}

async fn info(State(s): State<AppState>) -> axum::Json<AgentInfo> {
    axum::Json((*s.info).clone())
}

async fn inventory(State(s): State<AppState>) -> Reply<crate::inventory::Inventory> {
    run(async move { s.agent.inventory().await }).await
}

async fn engines(State(s): State<AppState>) -> axum::Json<Vec<crate::capability::EngineInfo>> {
    axum::Json(s.agent.engines().await)
}

async fn measure(State(s): State<AppState>, body: Bytes) -> Reply<crate::measure::Measurement> {
    let spec: InstanceSpec = parse(&body, "a deployment spec")?;
    run(async move { s.agent.measure(&spec).await }).await
}

async fn parkability(State(s): State<AppState>, body: Bytes) -> Reply<crate::tier::ParkChoice> {
    let spec: InstanceSpec = parse(&body, "a deployment spec")?;
    run(async move { s.agent.parkability(&spec).await }).await
}

async fn recover(State(s): State<AppState>) -> Reply<crate::agent::RecoveryReport> {
    run(async move { s.agent.recover().await }).await
}

async fn samples(State(s): State<AppState>) -> axum::Json<SamplesPage> {
    axum::Json(SamplesPage {
        samples: s.agent.samples(),
        now_ms: crate::process::now_ms(),
    })
}

async fn sample(
    State(s): State<AppState>,
    Path(instance): Path<String>,
) -> Reply<crate::load::LoadSample> {
    s.agent
        .sample(&instance)
        .map(axum::Json)
        .ok_or_else(|| AgentError::UnknownInstance { instance }.into())
}

async fn start(
    State(s): State<AppState>,
    Path(instance): Path<String>,
    body: Bytes,
) -> Reply<crate::agent::StartedInstance> {
    let spec: InstanceSpec = parse(&body, "a deployment spec")?;
    run(async move { s.agent.start(&instance, &spec).await }).await
}

async fn park(
    State(s): State<AppState>,
    Path(instance): Path<String>,
) -> Reply<crate::agent::ParkResult> {
    run(async move { s.agent.park(&instance).await }).await
}

/// `POST /agent/v1/instances/{id}/wake` parameters: the caller's wake window
/// (`window_ms`, 1 s to 3600 s as `server.switching.wake_timeout`; the agent's own without it).
#[derive(Debug, Deserialize)]
struct WakeQuery {
    window_ms: Option<u64>,
}

async fn wake(
    State(s): State<AppState>,
    Path(instance): Path<String>,
    Query(q): Query<WakeQuery>,
) -> Reply<crate::agent::WakeReport> {
    run(async move {
        match q.window_ms {
            Some(ms) => {
                let window = Duration::from_millis(ms.clamp(1_000, 3_600_000));
                s.agent.wake_within(&instance, window).await
            }
            None => s.agent.wake(&instance).await,
        }
    })
    .await
}

async fn stop(State(s): State<AppState>, Path(instance): Path<String>) -> Reply<serde_json::Value> {
    run(async move {
        s.agent.stop(&instance).await?;
        Ok(serde_json::json!({"instance": instance, "stopped": true}))
    })
    .await
}

async fn load_adapter(
    State(s): State<AppState>,
    Path(instance): Path<String>,
    body: Bytes,
) -> Reply<serde_json::Value> {
    let AdapterLoad { name, path } = parse(&body, "an adapter to load ({name, path})")?;
    run(async move {
        s.agent.load_adapter(&instance, &name, &path).await?;
        Ok(serde_json::json!({"instance": instance, "adapter": name, "loaded": true}))
    })
    .await
}

async fn unload_adapter(
    State(s): State<AppState>,
    Path((instance, name)): Path<(String, String)>,
) -> Reply<serde_json::Value> {
    run(async move {
        s.agent.unload_adapter(&instance, &name).await?;
        Ok(serde_json::json!({"instance": instance, "adapter": name, "loaded": false}))
    })
    .await
}

async fn adapters(State(s): State<AppState>, Path(instance): Path<String>) -> Reply<AdaptersPage> {
    run(async move {
        let adapters = s.agent.adapters(&instance).await?;
        Ok(AdaptersPage { adapters })
    })
    .await
}

/// `GET /agent/v1/exits` parameters.
#[derive(Debug, Deserialize)]
struct ExitsQuery {
    after: Option<u64>,
    epoch: Option<u64>,
    wait_ms: Option<u64>,
}

async fn exits_poll(
    State(s): State<AppState>,
    Query(q): Query<ExitsQuery>,
) -> axum::Json<ExitsPage> {
    let Some(after) = q.after else {
        // No cursor: where "from now on" starts.
        let mut page = s.exits.page(u64::MAX);
        page.missed = 0;
        return axum::Json(page);
    };
    // NB (a cursor of another life): answered at once, with this life's exits from its
    // start, so that the client learns of the new epoch without waiting out the long poll
    // (a restarted agent is a host to reconcile again, see the client).
    if q.epoch != Some(s.exits.epoch) {
        return axum::Json(s.exits.page(0));
    }
    let wait = q
        .wait_ms
        .map_or(EXITS_WAIT_DEFAULT, Duration::from_millis)
        .min(EXITS_WAIT_MAX);
    let mut changed = s.exits.changed.subscribe();
    let mut closing = s.closing.clone();
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let page = s.exits.page(after);
        if !page.exits.is_empty() || page.missed > 0 || *closing.borrow() {
            return axum::Json(page);
        }
        tokio::select! {
            r = changed.changed() => if r.is_err() { return axum::Json(page) },
            _ = closing.wait_for(|c| *c) => return axum::Json(s.exits.page(after)),
            () = tokio::time::sleep_until(deadline) => return axum::Json(page),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exit(i: &str) -> EngineExit {
        EngineExit {
            instance: i.into(),
            status: None,
        }
    }

    #[test]
    fn the_exit_log_pages_from_a_cursor_and_counts_what_it_lost() {
        let log = ExitLog::new();
        assert_eq!(log.page(u64::MAX).next, 0);
        log.push(exit("a"));
        log.push(exit("b"));
        let page = log.page(1);
        assert_eq!(page.next, 2);
        assert_eq!(page.missed, 0);
        assert_eq!(
            page.exits
                .iter()
                .map(|e| (e.seq, e.exit.instance.as_str()))
                .collect::<Vec<_>>(),
            [(1, "b")]
        );
        assert!(log.page(2).exits.is_empty());
        // A cursor beyond the end (another life) reads nothing and loses nothing.
        let page = log.page(99);
        assert_eq!((page.exits.len(), page.missed), (0, 0));
        // The server's own lag: numbered, not held, counted as missed.
        log.skip(3);
        log.push(exit("c"));
        let page = log.page(2);
        assert_eq!(page.next, 6);
        assert_eq!(page.missed, 3);
        assert_eq!(page.exits.len(), 1);
        // Past the held window, the oldest go.
        for _ in 0..EXITS_HELD {
            log.push(exit("x"));
        }
        let page = log.page(0);
        assert_eq!(page.exits.len(), EXITS_HELD);
        // a, b, the 3 lost and c are no longer held.
        assert_eq!((page.next, page.missed), (6 + EXITS_HELD as u64, 6));
    }
}
