//! [`RemoteHostAgent`]: a [`HostAgent`] on the other side of HTTP (a node agent's server).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use capyctl_spec::EngineKind;
use http::{Method, Request, StatusCode, Uri, header};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::{broadcast, watch};
use tokio::task::AbortHandle;

use super::wire::{
    AdapterLoad, AdaptersPage, AgentInfo, AgentTiming, ErrorBody, ExitsPage, SamplesPage,
};
use crate::agent::{
    AgentConfig, AgentHealth, BoxFuture, EngineExit, HostAgent, ParkResult, RecoveryReport,
    StartedInstance, WakeReport,
};
use crate::capability::{EngineInfo, engine_info};
use crate::error::AgentError;
use crate::http::excerpt;
use crate::inventory::Inventory;
use crate::load::LoadSample;
use crate::measure::Measurement;
use crate::spec::InstanceSpec;
use crate::tier::ParkChoice;
use crate::verify::WakeOutcome;

/// The timeout of each kind of call. [`RemoteTimeouts::for_timing`] derives them from the
/// agent's own timing plus [`RemoteTimeouts::MARGIN`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteTimeouts {
    /// Opening a connection.
    pub connect: Duration,
    /// Quick reads: info, inventory, engines, samples.
    pub quick: Duration,
    /// `measure` and `parkability` (they read checkpoint headers).
    pub measure: Duration,
    /// `start`: the engine's readiness, its first answer and a stop on failure.
    pub start: Duration,
    /// `park`: the park call, its confirmations, or a stop.
    pub park: Duration,
    /// `wake`: the wake window and a stop on failure.
    pub wake: Duration,
    /// `stop`: the stop grace.
    pub stop: Duration,
    /// `recover`: a health call and a stop per engine left behind.
    pub recover: Duration,
    /// `load_adapter` and `unload_adapter`: the engine reads the adapter (the agent bounds a
    /// load by its check timeout); listing is quick.
    pub adapter: Duration,
}

impl RemoteTimeouts {
    /// Added to the agent's own bounds: network, queueing, the agent's bookkeeping.
    pub const MARGIN: Duration = Duration::from_secs(30);

    /// The timeouts for an agent with `timing`.
    pub fn for_timing(t: &AgentTiming) -> Self {
        let m = Self::MARGIN;
        Self {
            connect: Duration::from_secs(5),
            quick: Duration::from_secs(10),
            measure: Duration::from_secs(120),
            start: t.ready_timeout + t.check * 2 + t.step * 4 + t.stop_grace + m,
            park: t.park + t.step * 6 + t.stop_grace + m,
            wake: t.wake_window + t.step * 2 + t.stop_grace + m,
            stop: t.stop_grace + t.step + m,
            recover: (t.step + t.stop_grace) * 8 + m,
            adapter: t.check + m,
        }
    }
}

impl Default for RemoteTimeouts {
    /// For an agent with [`AgentConfig::new`]'s timing.
    fn default() -> Self {
        Self::for_timing(&AgentTiming::from(&AgentConfig::new("")))
    }
}

/// Where the agent is and how to talk to it.
#[derive(Debug, Clone)]
pub struct RemoteConfig {
    /// `http://<node>:<port>` (a path prefix is kept; no trailing `/` needed).
    pub base_url: String,
    /// The shared agent token.
    pub token: String,
    /// The call timeouts until the agent's timing is known (and for good without
    /// `follow_agent_timing`).
    pub timeouts: RemoteTimeouts,
    /// Replace `timeouts` by [`RemoteTimeouts::for_timing`] of the agent's `GET /agent/v1/info`
    /// once it answers. Default `true`.
    pub follow_agent_timing: bool,
    /// Between two sample polls. Default 1 s.
    pub sample_poll: Duration,
    /// How long one exits long poll waits on the agent. Default 25 s.
    pub exits_wait: Duration,
    /// After a failed background poll, before the next. Default 1 s.
    pub retry_after: Duration,
}

impl RemoteConfig {
    /// The defaults for the agent at `base_url` with `token`.
    pub fn new(base_url: impl Into<String>, token: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into(),
            token: token.into(),
            timeouts: RemoteTimeouts::default(),
            follow_agent_timing: true,
            sample_poll: Duration::from_secs(1),
            exits_wait: Duration::from_secs(25),
            retry_after: Duration::from_secs(1),
        }
    }
}

/// The latest samples, as the poller last read them.
#[derive(Debug, Default)]
struct SampleCache {
    by_instance: HashMap<String, LoadSample>,
    /// Bumped whenever an instance is forgotten here (stop, exit, ...), so that a poll that was
    /// in flight meanwhile does not bring it back.
    forgets: u64,
}

struct Inner {
    base_url: String,
    /// `Bearer <token>`.
    authorization: http::HeaderValue,
    client: Client<HttpConnector, Full<Bytes>>,
    timeouts: Mutex<RemoteTimeouts>,
    config: RemoteConfig,
    samples: Mutex<SampleCache>,
    exits: broadcast::Sender<EngineExit>,
    /// `true` once the exits watcher holds a cursor (exits from then on reach subscribers).
    watching: watch::Sender<bool>,
    /// Resyncs (the agent came back as a new process, or exits were missed) and since when
    /// the exits watcher cannot reach it ([`HostAgent::subscribe_health`]).
    health: watch::Sender<AgentHealth>,
}

/// A [`HostAgent`] served by a node agent over HTTP (`capyctl-node-agent`, [`super::router`]).
///
/// Two background tasks run while it lives: one polls `GET /agent/v1/samples` every
/// [`RemoteConfig::sample_poll`] and keeps the latest sample per instance for
/// [`HostAgent::sample`] (dated on this host's clock from its age on the agent's:
/// [`SamplesPage::rebased`]; a sample the agent no longer holds goes, one that merely ages
/// while the agent is unreachable stays); the other long-polls
/// `GET /agent/v1/exits` and sends each exit to [`HostAgent::subscribe_exits`]. Connections are
/// kept alive and reused. Every error of a call names the agent's URL.
pub struct RemoteHostAgent {
    inner: Arc<Inner>,
    tasks: Vec<AbortHandle>,
}

impl std::fmt::Debug for RemoteHostAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteHostAgent")
            .field("base_url", &self.inner.base_url)
            .finish_non_exhaustive()
    }
}

impl Drop for RemoteHostAgent {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Percent-encodes a path segment (everything but unreserved characters).
fn segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The text of an error and its sources.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        text.push_str(": ");
        text.push_str(&s.to_string());
        next = s.source();
    }
    text
}

impl Inner {
    fn timeouts(&self) -> RemoteTimeouts {
        *self.timeouts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, SampleCache> {
        self.samples.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn forget(&self, instance: &str) {
        let mut c = self.cache();
        c.by_instance.remove(instance);
        c.forgets += 1;
    }

    /// One call: `method path` with an optional JSON body, bounded by `timeout`.
    async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
        timeout: Duration,
    ) -> Result<T, AgentError> {
        let url = format!("{}{path}", self.base_url);
        let mut builder = Request::builder()
            .method(method)
            .uri(&url)
            .header(header::AUTHORIZATION, self.authorization.clone())
            .header(header::ACCEPT, "application/json");
        let body = match body {
            Some(b) => {
                builder = builder.header(header::CONTENT_TYPE, "application/json");
                Full::new(Bytes::from(b))
            }
            None => Full::new(Bytes::new()),
        };
        let request = builder.body(body).map_err(|e| AgentError::AgentAnswer {
            url: url.clone(),
            detail: format!("cannot build the request: {e}"),
        })?;
        let exchange =
            async {
                let response = self.client.request(request).await.map_err(|e| {
                    AgentError::AgentUnreachable {
                        url: url.clone(),
                        detail: chain(&e),
                    }
                })?;
                let status = response.status();
                let bytes = response
                    .into_body()
                    .collect()
                    .await
                    .map_err(|e| AgentError::AgentUnreachable {
                        url: url.clone(),
                        detail: format!("the answer broke off: {}", chain(&e)),
                    })?
                    .to_bytes();
                Ok::<_, AgentError>((status, bytes))
            };
        let (status, bytes) = match tokio::time::timeout(timeout, exchange).await {
            Ok(r) => r?,
            Err(_) => {
                return Err(AgentError::AgentTimeout {
                    url,
                    after: timeout,
                });
            }
        };
        if status == StatusCode::UNAUTHORIZED {
            return Err(AgentError::AgentUnauthorized { url });
        }
        if !status.is_success() {
            return Err(match serde_json::from_slice::<ErrorBody>(&bytes) {
                Ok(body) => body.into_agent_error(),
                Err(_) => AgentError::AgentAnswer {
                    url,
                    detail: format!("answered {}: {}", status.as_u16(), excerpt(&bytes)),
                },
            });
        }
        serde_json::from_slice(&bytes).map_err(|e| AgentError::AgentAnswer {
            url,
            detail: format!(
                "the answer is not what was asked ({e}): {}",
                excerpt(&bytes)
            ),
        })
    }

    async fn get<T: DeserializeOwned>(
        &self,
        path: &str,
        timeout: Duration,
    ) -> Result<T, AgentError> {
        self.call(Method::GET, path, None, timeout).await
    }

    async fn info(&self) -> Result<AgentInfo, AgentError> {
        self.get("/agent/v1/info", self.timeouts().quick).await
    }

    /// Polls the samples until the agent is dropped; learns the agent's timing first.
    async fn poll_samples(self: Arc<Self>) {
        let mut tick = tokio::time::interval(self.config.sample_poll);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut timing_known = !self.config.follow_agent_timing;
        // NB: quiet until the agent has answered once: an agent never reached is the caller's
        // to report (its first call fails, naming the agent), not a warning of every poller.
        let mut failing = true;
        let mut reached = false;
        loop {
            tick.tick().await;
            if !timing_known && let Ok(info) = self.info().await {
                *self.timeouts.lock().unwrap_or_else(PoisonError::into_inner) =
                    RemoteTimeouts::for_timing(&info.timing);
                timing_known = true;
            }
            let forgets = self.cache().forgets;
            match self
                .get::<SamplesPage>("/agent/v1/samples", self.timeouts().quick)
                .await
            {
                Ok(page) => {
                    if failing && reached {
                        tracing::info!(url = %self.base_url, "node agent: samples again");
                    }
                    failing = false;
                    reached = true;
                    let samples = page.rebased(crate::process::now_ms());
                    let mut c = self.cache();
                    if c.forgets == forgets {
                        c.by_instance = samples.into_iter().collect();
                    } else {
                        // Something was forgotten while the poll was in flight: update only
                        // what is still held.
                        c.by_instance.retain(|id, _| samples.contains_key(id));
                        for (id, s) in samples {
                            if let Some(held) = c.by_instance.get_mut(&id) {
                                *held = s;
                            }
                        }
                    }
                }
                Err(e) => {
                    if !failing {
                        tracing::warn!(error = %e, "node agent: cannot read the samples");
                        failing = true;
                    }
                }
            }
        }
    }

    /// Long-polls the exits until the agent is dropped.
    async fn watch_exits(self: Arc<Self>) {
        let mut cursor: Option<(u64, u64)> = None;
        // Quiet until the agent has answered once (see `poll_samples`).
        let mut failing = true;
        loop {
            let path = match cursor {
                None => "/agent/v1/exits".to_string(),
                Some((epoch, next)) => format!(
                    "/agent/v1/exits?after={next}&epoch={epoch}&wait_ms={}",
                    self.config.exits_wait.as_millis()
                ),
            };
            let bound = self.config.exits_wait + self.timeouts().quick;
            match self.get::<ExitsPage>(&path, bound).await {
                Ok(page) => {
                    failing = false;
                    self.health
                        .send_if_modified(|h| h.unreachable.take().is_some());
                    // NB (a new life, or a gap): a node agent that restarted keeps no exit of
                    // its old life and drives no engine until a recovery, and missed exits
                    // are engines gone unnoticed. Either way the caller reconciles the host.
                    let restarted = cursor.is_some_and(|(epoch, _)| epoch != page.epoch);
                    if page.missed > 0 {
                        tracing::warn!(url = %self.base_url, missed = page.missed, "node agent: engine exits were missed");
                    }
                    if restarted {
                        tracing::warn!(url = %self.base_url, "node agent: it restarted; its host is reconciled again");
                    }
                    for e in page.exits {
                        self.forget(&e.exit.instance);
                        let _ = self.exits.send(e.exit);
                    }
                    cursor = Some((page.epoch, page.next));
                    self.watching.send_replace(true);
                    if restarted || page.missed > 0 {
                        self.health.send_modify(|h| h.resyncs += 1);
                    }
                }
                Err(e) => {
                    if !failing {
                        tracing::warn!(error = %e, "node agent: cannot watch the engine exits");
                        failing = true;
                    }
                    // The first failure makes it unreachable (a change subscribers hear); a
                    // later one only updates the error.
                    let why = e.to_string();
                    self.health.send_if_modified(|h| match &mut h.unreachable {
                        Some((_, last)) => {
                            *last = why;
                            false
                        }
                        None => {
                            h.unreachable = Some((std::time::Instant::now(), why));
                            true
                        }
                    });
                    tokio::time::sleep(self.config.retry_after).await;
                }
            }
        }
    }
}

impl RemoteHostAgent {
    /// A client of the agent of `config`; starts its two background tasks, so call it inside a
    /// Tokio runtime. Fails only on a URL that is not `http://host[:port][/prefix]` or a token
    /// that cannot go in a header; an agent that is not up yet is fine (calls fail, the
    /// background tasks retry).
    pub fn new(config: RemoteConfig) -> Result<Self, AgentError> {
        let base_url = config.base_url.trim_end_matches('/').to_string();
        let bad_url = |detail: String| AgentError::AgentUnreachable {
            url: config.base_url.clone(),
            detail,
        };
        let uri: Uri = base_url
            .parse()
            .map_err(|e| bad_url(format!("not a URL: {e}")))?;
        if uri.scheme_str() != Some("http") || uri.host().is_none() {
            return Err(bad_url("not an http://host:port URL".into()));
        }
        let authorization = http::HeaderValue::from_str(&format!("Bearer {}", config.token))
            .map_err(|_| AgentError::AgentAnswer {
                url: base_url.clone(),
                detail: "the agent token cannot go in a header".into(),
            })?;
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(config.timeouts.connect));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(8)
            .build(connector);
        let inner = Arc::new(Inner {
            base_url,
            authorization,
            client,
            timeouts: Mutex::new(config.timeouts),
            config,
            samples: Mutex::new(SampleCache::default()),
            exits: broadcast::channel(64).0,
            watching: watch::channel(false).0,
            health: watch::channel(AgentHealth::default()).0,
        });
        let tasks = vec![
            tokio::spawn(Arc::clone(&inner).poll_samples()).abort_handle(),
            tokio::spawn(Arc::clone(&inner).watch_exits()).abort_handle(),
        ];
        Ok(Self { inner, tasks })
    }

    /// The agent's base URL (without a trailing `/`).
    pub fn base_url(&self) -> &str {
        &self.inner.base_url
    }

    /// The call timeouts now in force.
    pub fn timeouts(&self) -> RemoteTimeouts {
        self.inner.timeouts()
    }

    /// `GET /agent/v1/info`: the agent's node, host ID, runtime, version and timing.
    pub async fn info(&self) -> Result<AgentInfo, AgentError> {
        self.inner.info().await
    }

    /// Waits until the exits watcher has reached the agent once: every engine exit from then on
    /// reaches [`HostAgent::subscribe_exits`] (an exit before it is not reported; a
    /// [`HostAgent::recover`] finds what is gone).
    pub async fn watching_exits(&self) {
        let mut rx = self.inner.watching.subscribe();
        let _ = rx.wait_for(|w| *w).await;
    }

    /// `GET /healthz` (no token needed).
    pub async fn health(&self) -> Result<(), AgentError> {
        self.inner
            .get::<serde_json::Value>("/healthz", self.timeouts().quick)
            .await
            .map(|_| ())
    }

    async fn post<T: DeserializeOwned>(
        &self,
        path: &str,
        body: Option<&(impl Serialize + Sync)>,
        timeout: Duration,
    ) -> Result<T, AgentError> {
        let body = body
            .map(serde_json::to_vec)
            .transpose()
            .map_err(|e| AgentError::Json {
                what: format!(
                    "node agent at {}: cannot write the request",
                    self.base_url()
                ),
                source: e,
            })?;
        self.inner.call(Method::POST, path, body, timeout).await
    }

    fn instance_path(instance: &str, op: &str) -> String {
        format!("/agent/v1/instances/{}/{op}", segment(instance))
    }
}

impl RemoteHostAgent {
    /// `POST …/wake`, within `window` (sent as `window_ms`) or the agent's own; the call is
    /// bounded by the longer of the two plus the margins.
    async fn wake_call(
        &self,
        instance: &str,
        window: Option<Duration>,
    ) -> Result<WakeReport, AgentError> {
        let mut path = Self::instance_path(instance, "wake");
        let mut bound = self.timeouts().wake;
        if let Some(w) = window {
            path.push_str(&format!("?window_ms={}", w.as_millis()));
            bound = bound.max(w + RemoteTimeouts::MARGIN * 2);
        }
        let r: WakeReport = self.post(&path, None::<&()>, bound).await?;
        if r.outcome != WakeOutcome::Pass {
            self.inner.forget(instance);
        }
        Ok(r)
    }
}

impl HostAgent for RemoteHostAgent {
    fn inventory(&self) -> BoxFuture<'_, Result<Inventory, AgentError>> {
        Box::pin(async move {
            self.inner
                .get("/agent/v1/inventory", self.timeouts().quick)
                .await
        })
    }

    fn engines(&self) -> BoxFuture<'_, Vec<EngineInfo>> {
        Box::pin(async move {
            match self
                .inner
                .get("/agent/v1/engines", self.timeouts().quick)
                .await
            {
                Ok(rows) => rows,
                Err(e) => {
                    tracing::warn!(error = %e, "node agent: cannot list the engines; versions unknown");
                    EngineKind::ALL
                        .iter()
                        .map(|k| engine_info(*k, None))
                        .collect()
                }
            }
        })
    }

    fn measure<'a>(
        &'a self,
        spec: &'a InstanceSpec,
    ) -> BoxFuture<'a, Result<Measurement, AgentError>> {
        Box::pin(async move {
            self.post("/agent/v1/measure", Some(spec), self.timeouts().measure)
                .await
        })
    }

    fn parkability<'a>(
        &'a self,
        spec: &'a InstanceSpec,
    ) -> BoxFuture<'a, Result<ParkChoice, AgentError>> {
        Box::pin(async move {
            self.post("/agent/v1/parkability", Some(spec), self.timeouts().measure)
                .await
        })
    }

    fn start<'a>(
        &'a self,
        instance: &'a str,
        spec: &'a InstanceSpec,
    ) -> BoxFuture<'a, Result<StartedInstance, AgentError>> {
        Box::pin(async move {
            self.post(
                &Self::instance_path(instance, "start"),
                Some(spec),
                self.timeouts().start,
            )
            .await
        })
    }

    fn park<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<ParkResult, AgentError>> {
        Box::pin(async move {
            let r: ParkResult = self
                .post(
                    &Self::instance_path(instance, "park"),
                    None::<&()>,
                    self.timeouts().park,
                )
                .await?;
            if matches!(r, ParkResult::Stopped { .. }) {
                self.inner.forget(instance);
            }
            Ok(r)
        })
    }

    fn wake<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<WakeReport, AgentError>> {
        Box::pin(self.wake_call(instance, None))
    }

    fn wake_within<'a>(
        &'a self,
        instance: &'a str,
        window: Duration,
    ) -> BoxFuture<'a, Result<WakeReport, AgentError>> {
        Box::pin(self.wake_call(instance, Some(window)))
    }

    fn stop<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<(), AgentError>> {
        Box::pin(async move {
            let _: serde_json::Value = self
                .post(
                    &Self::instance_path(instance, "stop"),
                    None::<&()>,
                    self.timeouts().stop,
                )
                .await?;
            self.inner.forget(instance);
            Ok(())
        })
    }

    fn sample(&self, instance: &str) -> Option<LoadSample> {
        self.inner.cache().by_instance.get(instance).copied()
    }

    fn load_adapter<'a>(
        &'a self,
        instance: &'a str,
        name: &'a str,
        path: &'a str,
    ) -> BoxFuture<'a, Result<(), AgentError>> {
        Box::pin(async move {
            let body = AdapterLoad {
                name: name.to_string(),
                path: path.to_string(),
            };
            let _: serde_json::Value = self
                .post(
                    &Self::instance_path(instance, "adapters"),
                    Some(&body),
                    self.timeouts().adapter,
                )
                .await?;
            Ok(())
        })
    }

    fn unload_adapter<'a>(
        &'a self,
        instance: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<(), AgentError>> {
        Box::pin(async move {
            let path = Self::instance_path(instance, &format!("adapters/{}/unload", segment(name)));
            let _: serde_json::Value = self
                .post(&path, None::<&()>, self.timeouts().adapter)
                .await?;
            Ok(())
        })
    }

    fn adapters<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<Vec<String>, AgentError>> {
        Box::pin(async move {
            let page: AdaptersPage = self
                .inner
                .get(
                    &Self::instance_path(instance, "adapters"),
                    self.timeouts().quick,
                )
                .await?;
            Ok(page.adapters)
        })
    }

    fn recover(&self) -> BoxFuture<'_, Result<RecoveryReport, AgentError>> {
        Box::pin(async move {
            self.post("/agent/v1/recover", None::<&()>, self.timeouts().recover)
                .await
        })
    }

    fn subscribe_exits(&self) -> broadcast::Receiver<EngineExit> {
        self.inner.exits.subscribe()
    }

    fn subscribe_health(&self) -> watch::Receiver<AgentHealth> {
        self.inner.health.subscribe()
    }

    fn unreachable(&self) -> Option<String> {
        let held = self.inner.health.borrow().unreachable.clone();
        held.map(|(since, why)| format!("no answer for {} s ({why})", since.elapsed().as_secs()))
    }

    fn samples(&self) -> BTreeMap<String, LoadSample> {
        self.inner
            .cache()
            .by_instance
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect()
    }
}
