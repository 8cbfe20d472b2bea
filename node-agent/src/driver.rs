//! Engine drivers: readiness, park and wake call sequences per engine and tier, the check
//! prompt, load scrapes and what the engine says about itself. Every step has a timeout and
//! fails with an error naming the engine, the step and the URL.
//!
//! Sequences (DESIGN 4.2):
//! - vLLM host RAM: `POST /sleep?level=1`, confirm `GET /is_sleeping` true; wake `POST
//!   /wake_up`.
//! - vLLM deep: `POST /sleep?level=2`, confirm; wake `POST /wake_up?tags=weights`, `POST
//!   /collective_rpc {"method":"reload_weights"}`, `POST /wake_up?tags=kv_cache`, `POST
//!   /reset_prefix_cache`, whose answer is `{"success": bool}` (a `false` fails the wake at that
//!   step; an empty answer, as older releases gave, counts as done).
//! - SGLang: `POST /pause_generation {"mode":"abort"}`, `POST /release_memory_occupation
//!   {"tags":[...]}` (`["kv_cache"]` alone for KV-only, else weights, kv_cache and cuda_graph),
//!   confirm that it no longer generates (below); wake `POST /resume_memory_occupation` (same
//!   tags), after a deep park `POST /update_weights_from_disk {"model_path": model}` and `POST
//!   /flush_cache`, then `POST /continue_generation {}`, confirm `GET /health_generate` 200.
//!   NB: the reload runs before `continue_generation`, so the engine never generates on
//!   dropped weights.
//!
//! NB (SGLang's pause body): since 0.5.6 `/pause_generation` and `/continue_generation` take a
//! JSON body (`PauseGenerationReqInput {mode}`, `ContinueGenerationReqInput`) and answer 400
//! to a POST without one; older releases ignore the body. The mode is `abort`, SGLang's
//! default: the router drained the instance before the park, so nothing should be running,
//! and anything that still is ends with an answer at once instead of being held inside a
//! parked engine. `retract` would keep such a request queued in the engine until the wake
//! (a wait nobody bounds, and the deep wake's `flush_cache` refuses to run while a request
//! waits); `in_place` keeps it in the running batch, and `release_memory_occupation` asserts
//! that the engine is idle.
//!
//! NB (SGLang's generation probe): `/health_generate` generates one token and, while generation
//! is paused, waits for it up to `SGLANG_HEALTH_CHECK_TIMEOUT` (20 s by default) before
//! answering 503; it answers 200 about a second after the call when the engine generates.
//! `/health` is not used for it: in the 0.4 releases it answered 200 without generating, and
//! since 0.5.6 it generates only while `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION` is on (RL
//! stacks turn it off). SGLang has no endpoint that says whether its memory is released. So a park is
//! confirmed by a short probe ([`DriverTimeouts::idle_probe`], 2 s): `/health_generate`
//! answering 200 within it means the engine still generates (the park did not take) and fails
//! the park; any other status, or no answer within the probe, means it no longer generates.
//! Then `/server_info` (before 0.5.6: `/get_server_info`), which does not generate, must
//! answer, so that a wedged or dead engine is not taken for a parked one. The release call's
//! own success is SGLang's word that the memory went.
//! - TensorFold does not park: it is stopped.
//!
//! NB (no `/is_sleeping` after a vLLM wake): DESIGN 4.2's wake is the calls above and nothing
//! more. vLLM 0.32's `/wake_up` answers once its engine core has woken, and says whether it is
//! whole: `{"status": "awake"|"sleeping", "tags": ...}` (`awake` once every tag is resident
//! and the scheduler resumed; `sleeping` after a partial wake). So the last wake call's answer
//! is read instead of asking `GET /is_sleeping` after it: `sleeping` fails the wake at that
//! step ([`AgentError::EngineAnswer`], a failed reload), `awake` ends it, and the check prompt
//! that follows every wake proves that the engine generates. That saves a round trip on every
//! switch (about 0.5 ms of uvicorn's own time). An answer without a `status` (releases that
//! answered an empty 200) is confirmed with `GET /is_sleeping` as before.
//!
//! Adapters (DESIGN 4.9), on a base launched with the engine's LoRA flags: vLLM `POST
//! /v1/load_lora_adapter {"lora_name","lora_path"}`, `POST /v1/unload_lora_adapter
//! {"lora_name"}`; SGLang `POST /load_lora_adapter`, `POST /unload_lora_adapter` with the same
//! fields; both list the loaded adapters in `GET /v1/models` as entries whose `parent` is the
//! served model. A refused load is [`AgentError::EngineStatus`] naming the adapter and its
//! path, with the engine's reason cut short ([`refusal_reason`]); vLLM 0.32 on CPU answered (recorded in
//! `engine-sim/tests/fixtures/vllm-0.32.0-lora/`): 404 `NotFoundError` "Loading lora X failed:
//! No adapter found for P" for a path that does not exist or holds no `adapter_config.json`,
//! 400 `InvalidUserInput` for a name already loaded, 500 "...LoRA rank R is greater than
//! max_lora_rank M." for a rank too high; it does not refuse adapters beyond `--max-loras`
//! (those are GPU slots per batch; its CPU cache holds `--max-cpu-loras`, by default as many,
//! so the others are dropped from the engine and read from disk again when a request names
//! them), and its unload only takes the name off the API server's list, freeing nothing in
//! the engine. SGLang 0.5.23 does not refuse a load beyond `--max-loaded-loras` either: it
//! unloads its least recently used adapter. So CapyCTL keeps to `max_loaded` itself. A request
//! runs with an adapter on vLLM when its `model` is the adapter's name; SGLang needs the name
//! in `lora_path` as well ([`adapter_request_field`]: a bare adapter name in `model` runs on
//! SGLang's base).
//!
//! Every call is one [`EngineCall`] of the tables below ([`VLLM_CALLS`], [`SGLANG_CALLS`],
//! [`TENSORFOLD_CALLS`]): method, path with its query, and body. `tests/contract.rs` checks each
//! against an extract of the engine's own source at the supported release
//! (`node-agent/contracts/`).

use std::time::Duration;

use capyctl_spec::EngineKind;
use http::Method;
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::error::AgentError;
use crate::http::{Call, EngineClient};
use crate::load::{EngineLoad, parse_metrics};
use crate::recovery::EngineState;
use crate::spec::DecisionSpec;
use crate::tier::ParkTier;
use crate::verify::{
    FirstAnswer, WakeOutcome, check_request, compare_answers, completion_text,
    decision_from_completion, decision_request, warm_up_request,
};

/// Where an engine answers and under which model name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// The engine.
    pub engine: EngineKind,
    /// `http://127.0.0.1:<port>`.
    pub base_url: String,
    /// The `model` requests name (the served model name; TensorFold: the model).
    pub model_name: String,
    /// The model argument (checkpoint path or hub name), for SGLang's reload.
    pub model: String,
}

impl Endpoint {
    /// The URL of `path` (which starts with `/`).
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base_url, path)
    }
}

/// Timeouts of the driver's steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DriverTimeouts {
    /// One quick call (health, is_sleeping, pause, flush, metrics).
    pub step: Duration,
    /// A park call (copying weights to host RAM takes time).
    pub park: Duration,
    /// A check or warm-up request.
    pub check: Duration,
    /// How long SGLang's `/health_generate` may take to show that a parked engine still
    /// generates (see the module doc); no answer within it counts as "no longer generates". At
    /// most `step`.
    pub idle_probe: Duration,
}

impl Default for DriverTimeouts {
    fn default() -> Self {
        Self {
            step: Duration::from_secs(10),
            park: Duration::from_secs(600),
            check: Duration::from_secs(120),
            idle_probe: Duration::from_secs(2),
        }
    }
}

/// Talks to engines over HTTP. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct Driver {
    client: EngineClient,
    timeouts: DriverTimeouts,
}

/// The HTTP method of an [`EngineCall`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    /// `GET`.
    Get,
    /// `POST`.
    Post,
}

impl Verb {
    /// As `http` spells it.
    pub fn method(self) -> Method {
        match self {
            Verb::Get => Method::GET,
            Verb::Post => Method::POST,
        }
    }

    /// `GET` or `POST`.
    pub fn as_str(self) -> &'static str {
        match self {
            Verb::Get => "GET",
            Verb::Post => "POST",
        }
    }
}

/// What an [`EngineCall`] sends as its body.
#[derive(Debug, Clone, Copy)]
pub enum CallBody {
    /// No body.
    Empty,
    /// A JSON body made from the endpoint (the only place the body is written).
    Json(fn(&Endpoint) -> Value),
    /// A completion request built by [`crate::verify`] (`check_request`, `decision_request`,
    /// `warm_up_request`).
    Completion,
    /// A JSON body naming a LoRA adapter, made from its name and path (the only place the
    /// adapter calls' bodies are written).
    Adapter(fn(&str, &str) -> Value),
}

/// One HTTP call CapyCTL makes to an engine: the engine's route, method, query and body, as
/// the driver sends them. The driver makes no engine call that is not in these tables, and
/// `tests/contract.rs` checks every one against the engine's source.
#[derive(Debug, Clone, Copy)]
pub struct EngineCall {
    /// The engine.
    pub engine: EngineKind,
    /// The step's name in errors (`sleep`, `pause_generation`, ...).
    pub step: &'static str,
    /// The method.
    pub verb: Verb,
    /// The path, with the query string CapyCTL sends (`/sleep?level=1`).
    pub target: &'static str,
    /// The body.
    pub body: CallBody,
}

impl EngineCall {
    /// The path without its query.
    pub fn path(&self) -> &'static str {
        self.target.split_once('?').map_or(self.target, |(p, _)| p)
    }

    /// The query's `name=value` pairs.
    pub fn query(&self) -> Vec<(&'static str, &'static str)> {
        self.target
            .split_once('?')
            .map(|(_, q)| {
                q.split('&')
                    .map(|kv| kv.split_once('=').unwrap_or((kv, "")))
                    .collect()
            })
            .unwrap_or_default()
    }
}

const fn entry(
    engine: EngineKind,
    step: &'static str,
    verb: Verb,
    target: &'static str,
    body: CallBody,
) -> EngineCall {
    EngineCall {
        engine,
        step,
        verb,
        target,
        body,
    }
}

use CallBody::{Adapter, Completion, Empty, Json};
use EngineKind::{Sglang, Tensorfold, Vllm};
use Verb::{Get, Post};

/// vLLM: readiness and the state after a restart.
pub const VLLM_HEALTH: EngineCall = entry(Vllm, "health", Get, "/health", Empty);
/// vLLM: whether it sleeps (`{"is_sleeping": bool}`).
pub const VLLM_IS_SLEEPING: EngineCall = entry(Vllm, "is_sleeping", Get, "/is_sleeping", Empty);
/// vLLM: the host-RAM park.
pub const VLLM_SLEEP_1: EngineCall = entry(Vllm, "sleep", Post, "/sleep?level=1", Empty);
/// vLLM: the deep park.
pub const VLLM_SLEEP_2: EngineCall = entry(Vllm, "sleep", Post, "/sleep?level=2", Empty);
/// vLLM: the host-RAM wake.
pub const VLLM_WAKE_UP: EngineCall = entry(Vllm, "wake_up", Post, "/wake_up", Empty);
/// vLLM deep wake: the weights' memory first.
pub const VLLM_WAKE_WEIGHTS: EngineCall = entry(
    Vllm,
    "wake_up weights",
    Post,
    "/wake_up?tags=weights",
    Empty,
);
/// vLLM deep wake: the weights reloaded from disk.
pub const VLLM_RELOAD_WEIGHTS: EngineCall = entry(
    Vllm,
    "reload_weights",
    Post,
    "/collective_rpc",
    Json(|_| json!({"method": "reload_weights"})),
);
/// vLLM deep wake: the KV cache.
pub const VLLM_WAKE_KV: EngineCall = entry(
    Vllm,
    "wake_up kv_cache",
    Post,
    "/wake_up?tags=kv_cache",
    Empty,
);
/// vLLM deep wake: the prefix cache emptied (`{"success": bool}`).
pub const VLLM_RESET_PREFIX_CACHE: EngineCall = entry(
    Vllm,
    "reset_prefix_cache",
    Post,
    "/reset_prefix_cache",
    Empty,
);
/// vLLM's version.
pub const VLLM_VERSION: EngineCall = entry(Vllm, "version", Get, "/version", Empty);
/// vLLM's load (Prometheus text).
pub const VLLM_METRICS: EngineCall = entry(Vllm, "metrics", Get, "/metrics", Empty);
/// vLLM: the check prompt, the decision and the warm-up.
pub const VLLM_COMPLETIONS: EngineCall =
    entry(Vllm, "completion", Post, "/v1/completions", Completion);

/// vLLM: load a LoRA adapter (exists with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`; the
/// engine needs `--enable-lora`). Answers 200 with a text line; refusals are vLLM's error
/// body with the reason in `error.message`.
pub const VLLM_LOAD_LORA: EngineCall = entry(
    Vllm,
    "load_lora_adapter",
    Post,
    "/v1/load_lora_adapter",
    Adapter(|name, path| json!({"lora_name": name, "lora_path": path})),
);
/// vLLM: unload a LoRA adapter (404 when it is not loaded).
pub const VLLM_UNLOAD_LORA: EngineCall = entry(
    Vllm,
    "unload_lora_adapter",
    Post,
    "/v1/unload_lora_adapter",
    Adapter(|name, _| json!({"lora_name": name})),
);
/// vLLM: the served models; the loaded adapters are the entries whose `parent` is the base.
pub const VLLM_MODELS: EngineCall = entry(Vllm, "models", Get, "/v1/models", Empty);

/// Every vLLM call.
pub const VLLM_CALLS: &[EngineCall] = &[
    VLLM_HEALTH,
    VLLM_IS_SLEEPING,
    VLLM_SLEEP_1,
    VLLM_SLEEP_2,
    VLLM_WAKE_UP,
    VLLM_WAKE_WEIGHTS,
    VLLM_RELOAD_WEIGHTS,
    VLLM_WAKE_KV,
    VLLM_RESET_PREFIX_CACHE,
    VLLM_VERSION,
    VLLM_METRICS,
    VLLM_COMPLETIONS,
    VLLM_LOAD_LORA,
    VLLM_UNLOAD_LORA,
    VLLM_MODELS,
];

const SGLANG_ALL_TAGS: [&str; 3] = ["weights", "kv_cache", "cuda_graph"];
const SGLANG_KV_TAGS: [&str; 1] = ["kv_cache"];

/// SGLang: readiness (503 while starting).
pub const SGLANG_HEALTH: EngineCall = entry(Sglang, "health", Get, "/health", Empty);
/// SGLang: whether it generates (one token, whatever `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`
/// says).
pub const SGLANG_HEALTH_GENERATE: EngineCall =
    entry(Sglang, "health_generate", Get, "/health_generate", Empty);
/// SGLang's server arguments and state (since 0.5.6).
pub const SGLANG_SERVER_INFO: EngineCall = entry(Sglang, "server_info", Get, "/server_info", Empty);
/// SGLang's server arguments and state, as releases before 0.5.6 name it.
pub const SGLANG_GET_SERVER_INFO: EngineCall =
    entry(Sglang, "get_server_info", Get, "/get_server_info", Empty);
/// SGLang park: stop generating (see the module doc for the mode).
pub const SGLANG_PAUSE: EngineCall = entry(
    Sglang,
    "pause_generation",
    Post,
    "/pause_generation",
    Json(|_| json!({"mode": "abort"})),
);
/// SGLang park: give back weights, KV cache and CUDA graphs.
pub const SGLANG_RELEASE_ALL: EngineCall = entry(
    Sglang,
    "release_memory_occupation",
    Post,
    "/release_memory_occupation",
    Json(|_| json!({"tags": SGLANG_ALL_TAGS})),
);
/// SGLang KV-only park: give back the KV cache.
pub const SGLANG_RELEASE_KV: EngineCall = entry(
    Sglang,
    "release_memory_occupation",
    Post,
    "/release_memory_occupation",
    Json(|_| json!({"tags": SGLANG_KV_TAGS})),
);
/// SGLang wake: take back what [`SGLANG_RELEASE_ALL`] gave.
pub const SGLANG_RESUME_ALL: EngineCall = entry(
    Sglang,
    "resume_memory_occupation",
    Post,
    "/resume_memory_occupation",
    Json(|_| json!({"tags": SGLANG_ALL_TAGS})),
);
/// SGLang wake: take back what [`SGLANG_RELEASE_KV`] gave.
pub const SGLANG_RESUME_KV: EngineCall = entry(
    Sglang,
    "resume_memory_occupation",
    Post,
    "/resume_memory_occupation",
    Json(|_| json!({"tags": SGLANG_KV_TAGS})),
);
/// SGLang deep wake: the weights reloaded from the model's checkpoint.
pub const SGLANG_UPDATE_WEIGHTS: EngineCall = entry(
    Sglang,
    "update_weights_from_disk",
    Post,
    "/update_weights_from_disk",
    Json(|ep| json!({"model_path": ep.model})),
);
/// SGLang deep wake: the radix cache emptied.
pub const SGLANG_FLUSH_CACHE: EngineCall =
    entry(Sglang, "flush_cache", Post, "/flush_cache", Empty);
/// SGLang wake: generate again.
pub const SGLANG_CONTINUE: EngineCall = entry(
    Sglang,
    "continue_generation",
    Post,
    "/continue_generation",
    Json(|_| json!({})),
);
/// SGLang's load (Prometheus text, with `--enable-metrics`).
pub const SGLANG_METRICS: EngineCall = entry(Sglang, "metrics", Get, "/metrics", Empty);
/// SGLang: the check prompt, the decision and the warm-up.
pub const SGLANG_COMPLETIONS: EngineCall =
    entry(Sglang, "completion", Post, "/v1/completions", Completion);

/// SGLang: load a LoRA adapter (the engine needs `--enable-lora`). Answers 200 with
/// `{"success": true, ...}`; a refusal is a 400 with `{"success": false, "error_message"}`.
pub const SGLANG_LOAD_LORA: EngineCall = entry(
    Sglang,
    "load_lora_adapter",
    Post,
    "/load_lora_adapter",
    Adapter(|name, path| json!({"lora_name": name, "lora_path": path})),
);
/// SGLang: unload a LoRA adapter.
pub const SGLANG_UNLOAD_LORA: EngineCall = entry(
    Sglang,
    "unload_lora_adapter",
    Post,
    "/unload_lora_adapter",
    Adapter(|name, _| json!({"lora_name": name})),
);
/// SGLang: the served models; the loaded adapters are the entries whose `parent` is the
/// base (as vLLM's).
pub const SGLANG_MODELS: EngineCall = entry(Sglang, "models", Get, "/v1/models", Empty);

/// Every SGLang call.
pub const SGLANG_CALLS: &[EngineCall] = &[
    SGLANG_HEALTH,
    SGLANG_HEALTH_GENERATE,
    SGLANG_SERVER_INFO,
    SGLANG_GET_SERVER_INFO,
    SGLANG_PAUSE,
    SGLANG_RELEASE_ALL,
    SGLANG_RELEASE_KV,
    SGLANG_RESUME_ALL,
    SGLANG_RESUME_KV,
    SGLANG_UPDATE_WEIGHTS,
    SGLANG_FLUSH_CACHE,
    SGLANG_CONTINUE,
    SGLANG_METRICS,
    SGLANG_COMPLETIONS,
    SGLANG_LOAD_LORA,
    SGLANG_UNLOAD_LORA,
    SGLANG_MODELS,
];

/// TensorFold: readiness.
pub const TENSORFOLD_HEALTH: EngineCall = entry(Tensorfold, "health", Get, "/health", Empty);
/// TensorFold's version.
pub const TENSORFOLD_VERSION: EngineCall = entry(Tensorfold, "version", Get, "/version", Empty);
/// TensorFold's load.
pub const TENSORFOLD_METRICS: EngineCall = entry(Tensorfold, "metrics", Get, "/metrics", Empty);
/// TensorFold: the check prompt, the decision and the warm-up.
pub const TENSORFOLD_COMPLETIONS: EngineCall = entry(
    Tensorfold,
    "completion",
    Post,
    "/v1/completions",
    Completion,
);

/// Every TensorFold call (no source of it is published, so no contract test reads these).
pub const TENSORFOLD_CALLS: &[EngineCall] = &[
    TENSORFOLD_HEALTH,
    TENSORFOLD_VERSION,
    TENSORFOLD_METRICS,
    TENSORFOLD_COMPLETIONS,
];

/// The calls of `engine`.
pub fn engine_calls(engine: EngineKind) -> &'static [EngineCall] {
    match engine {
        Vllm => VLLM_CALLS,
        Sglang => SGLANG_CALLS,
        Tensorfold => TENSORFOLD_CALLS,
    }
}

/// The field of an inference request's body that names its LoRA adapter besides `model`
/// (an engine rule the lifecycle routes with, written once in `capyctl-engine-rules`).
pub use capyctl_engine_rules::adapters::{SGLANG_ADAPTER_FIELD, adapter_request_field};

fn by_engine(
    engine: EngineKind,
    vllm: EngineCall,
    sglang: EngineCall,
    tf: EngineCall,
) -> EngineCall {
    match engine {
        Vllm => vllm,
        Sglang => sglang,
        Tensorfold => tf,
    }
}

fn health_call(engine: EngineKind) -> EngineCall {
    by_engine(engine, VLLM_HEALTH, SGLANG_HEALTH, TENSORFOLD_HEALTH)
}

fn completions_call(engine: EngineKind) -> EngineCall {
    by_engine(
        engine,
        VLLM_COMPLETIONS,
        SGLANG_COMPLETIONS,
        TENSORFOLD_COMPLETIONS,
    )
}

fn sglang_release(tier: ParkTier) -> EngineCall {
    match tier {
        ParkTier::KvOnly => SGLANG_RELEASE_KV,
        ParkTier::HostRam | ParkTier::Deep => SGLANG_RELEASE_ALL,
    }
}

fn sglang_resume(tier: ParkTier) -> EngineCall {
    match tier {
        ParkTier::KvOnly => SGLANG_RESUME_KV,
        ParkTier::HostRam | ParkTier::Deep => SGLANG_RESUME_ALL,
    }
}

impl Driver {
    /// A driver with these timeouts.
    pub fn new(timeouts: DriverTimeouts) -> Self {
        Self {
            client: EngineClient::new(),
            timeouts,
        }
    }

    /// The timeouts.
    pub fn timeouts(&self) -> DriverTimeouts {
        self.timeouts
    }

    fn call<'a>(&self, ep: &Endpoint, step: &'static str, url: &'a str, t: Duration) -> Call<'a> {
        Call {
            engine: ep.engine,
            step,
            url,
            timeout: t,
        }
    }

    /// The body `c` sends to `ep` (`None` for a body-less call; a completion's body is the
    /// caller's).
    fn body_of(c: &EngineCall, ep: &Endpoint) -> Option<Value> {
        match c.body {
            CallBody::Json(make) => Some(make(ep)),
            CallBody::Empty | CallBody::Completion | CallBody::Adapter(_) => None,
        }
    }

    /// Sends `c` (its own body) and returns the status and body, whatever the status.
    async fn send(
        &self,
        ep: &Endpoint,
        c: &EngineCall,
        timeout: Duration,
    ) -> Result<(u16, bytes::Bytes), AgentError> {
        let url = ep.url(c.target);
        let body = Self::body_of(c, ep);
        self.client
            .send(
                self.call(ep, c.step, &url, timeout),
                c.verb.method(),
                body.as_ref(),
            )
            .await
    }

    /// Sends `c` and insists on a 2xx status; returns the body.
    async fn send_ok(
        &self,
        ep: &Endpoint,
        c: &EngineCall,
        timeout: Duration,
    ) -> Result<bytes::Bytes, AgentError> {
        let url = ep.url(c.target);
        let body = Self::body_of(c, ep);
        self.client
            .expect_ok(
                self.call(ep, c.step, &url, timeout),
                c.verb.method(),
                body.as_ref(),
            )
            .await
    }

    /// Sends `c`, insists on a 2xx status and a JSON answer.
    async fn send_json(
        &self,
        ep: &Endpoint,
        c: &EngineCall,
        timeout: Duration,
    ) -> Result<Value, AgentError> {
        let url = ep.url(c.target);
        let body = Self::body_of(c, ep);
        self.client
            .expect_json(
                self.call(ep, c.step, &url, timeout),
                c.verb.method(),
                body.as_ref(),
            )
            .await
    }

    /// `GET /health` once: the status, or the error.
    pub async fn health(&self, ep: &Endpoint) -> Result<u16, AgentError> {
        let c = health_call(ep.engine);
        Ok(self.send(ep, &c, self.timeouts.step).await?.0)
    }

    /// Polls `GET /health` every 100 ms until it answers 200, for at most `bound`.
    pub async fn wait_ready(&self, ep: &Endpoint, bound: Duration) -> Result<(), AgentError> {
        let c = health_call(ep.engine);
        let deadline = Instant::now() + bound;
        let mut last = String::from("no answer yet");
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(AgentError::EngineTimeout {
                    engine: ep.engine,
                    step: "readiness (GET /health until 200)",
                    url: format!("{} (last: {last})", ep.url(c.target)),
                    after: bound,
                });
            }
            match self.send(ep, &c, remaining.min(self.timeouts.step)).await {
                Ok((200, _)) => return Ok(()),
                Ok((status, _)) => last = format!("status {status}"),
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(100).min(remaining)).await;
        }
    }

    /// vLLM `GET /is_sleeping`.
    async fn vllm_is_sleeping(&self, ep: &Endpoint, timeout: Duration) -> Result<bool, AgentError> {
        let v = self.send_json(ep, &VLLM_IS_SLEEPING, timeout).await?;
        is_sleeping_of(&v).ok_or_else(|| AgentError::EngineAnswer {
            engine: ep.engine,
            step: VLLM_IS_SLEEPING.step,
            url: ep.url(VLLM_IS_SLEEPING.target),
            detail: format!("no boolean `is_sleeping` in {v}"),
        })
    }

    /// vLLM is asleep after its sleep call: `GET /is_sleeping` is true.
    async fn confirm_vllm_asleep(&self, ep: &Endpoint, t: Duration) -> Result<(), AgentError> {
        if self.vllm_is_sleeping(ep, t).await? {
            Ok(())
        } else {
            Err(AgentError::EngineAnswer {
                engine: ep.engine,
                step: "confirm asleep",
                url: ep.url(VLLM_IS_SLEEPING.target),
                detail: "is_sleeping is false, expected true".into(),
            })
        }
    }

    /// vLLM's last wake call `c` (`/wake_up`, or `/wake_up?tags=kv_cache` after the weights):
    /// its answer's `status` must be `awake`; one without a `status` is confirmed with `GET
    /// /is_sleeping` (see the module doc).
    async fn vllm_wake_whole(
        &self,
        ep: &Endpoint,
        c: &EngineCall,
        (call, confirm): (Duration, Duration),
    ) -> Result<(), AgentError> {
        let body = self.send_ok(ep, c, call).await?;
        let answer = serde_json::from_slice::<Value>(&body).ok();
        match answer.as_ref().and_then(|a| a.get("status")?.as_str()) {
            Some("awake") => Ok(()),
            Some(status) => Err(AgentError::EngineAnswer {
                engine: ep.engine,
                step: c.step,
                url: ep.url(c.target),
                detail: format!(
                    "the engine answered status {status:?}, expected \"awake\": it is still \
                     asleep after its wake calls ({})",
                    crate::http::excerpt(&body)
                ),
            }),
            None => {
                if self.vllm_is_sleeping(ep, confirm).await? {
                    Err(AgentError::EngineAnswer {
                        engine: ep.engine,
                        step: "confirm awake",
                        url: ep.url(VLLM_IS_SLEEPING.target),
                        detail: format!(
                            "is_sleeping is true after {} answered without a status",
                            c.target
                        ),
                    })
                } else {
                    Ok(())
                }
            }
        }
    }

    /// vLLM `POST /reset_prefix_cache`: its `{"success": bool}` must not be false (an empty
    /// answer, as older releases gave, counts as done).
    async fn vllm_reset_prefix_cache(&self, ep: &Endpoint, t: Duration) -> Result<(), AgentError> {
        let c = VLLM_RESET_PREFIX_CACHE;
        let body = self.send_ok(ep, &c, t).await?;
        if body.iter().all(u8::is_ascii_whitespace) {
            return Ok(());
        }
        let failed = |detail: String| AgentError::EngineAnswer {
            engine: ep.engine,
            step: c.step,
            url: ep.url(c.target),
            detail,
        };
        let answer: Value = serde_json::from_slice(&body).map_err(|e| {
            failed(format!(
                "the answer is not JSON ({e}): {}",
                crate::http::excerpt(&body)
            ))
        })?;
        match answer.get("success").and_then(Value::as_bool) {
            Some(true) => Ok(()),
            Some(false) => Err(failed(format!(
                "the engine did not reset its prefix cache (blocks still held): {answer}"
            ))),
            None => Err(failed(format!("no boolean `success` in {answer}"))),
        }
    }

    /// SGLang: whether `/health_generate` answers 200 within `bound` (it generates a token).
    /// `false` for any other status or no answer within `bound`; an error when the engine
    /// cannot be reached (refused, or the connection broke).
    pub async fn sglang_generates(
        &self,
        ep: &Endpoint,
        bound: Duration,
    ) -> Result<bool, AgentError> {
        match self.send(ep, &SGLANG_HEALTH_GENERATE, bound).await {
            Ok((status, _)) => Ok(status == 200),
            Err(AgentError::EngineTimeout { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// SGLang's `/server_info` (before 0.5.6: `/get_server_info`), which answers without
    /// generating.
    async fn sglang_server_info(&self, ep: &Endpoint) -> Result<Value, AgentError> {
        let step = self.timeouts.step;
        match self.send_json(ep, &SGLANG_SERVER_INFO, step).await {
            Err(AgentError::EngineStatus { status: 404, .. }) => {
                self.send_json(ep, &SGLANG_GET_SERVER_INFO, step).await
            }
            other => other,
        }
    }

    /// SGLang no longer generates (a bounded `/health_generate` probe) and still answers
    /// without generating (`/server_info`): see the module doc.
    async fn confirm_sglang_parked(&self, ep: &Endpoint) -> Result<(), AgentError> {
        let probe = self.timeouts.idle_probe.min(self.timeouts.step);
        if self.sglang_generates(ep, probe).await? {
            return Err(AgentError::EngineAnswer {
                engine: ep.engine,
                step: "confirm asleep",
                url: ep.url(SGLANG_HEALTH_GENERATE.target),
                detail: "GET /health_generate answered 200: the engine still generates after \
                         pause_generation and release_memory_occupation"
                    .into(),
            });
        }
        self.sglang_server_info(ep).await.map(drop)
    }

    /// SGLang generates again: `/health_generate` answers 200 within `t`.
    async fn confirm_sglang_awake(&self, ep: &Endpoint, t: Duration) -> Result<(), AgentError> {
        let c = SGLANG_HEALTH_GENERATE;
        let step = "confirm awake";
        let url = ep.url(c.target);
        let (status, body) = self
            .client
            .send(self.call(ep, step, &url, t), c.verb.method(), None)
            .await?;
        if status == 200 {
            Ok(())
        } else {
            Err(AgentError::EngineAnswer {
                engine: ep.engine,
                step,
                url,
                detail: format!(
                    "GET /health_generate answered {status} ({}), expected 200",
                    crate::http::excerpt(&body)
                ),
            })
        }
    }

    /// Where an engine left behind says it is ([`crate::recovery`]), without making a parked
    /// engine generate: vLLM `GET /is_sleeping`, then, when it is not asleep (or was launched
    /// without sleep mode and has no such endpoint), `/health`; SGLang a `/health_generate`
    /// probe, bounded by the step timeout when it is expected awake (`expect_awake`) and by the
    /// short idle probe otherwise, then `/server_info` when it does not generate; TensorFold
    /// `/health`.
    pub async fn engine_state(&self, ep: &Endpoint, expect_awake: bool) -> EngineState {
        let health = || async {
            match self.health(ep).await {
                Ok(200) => EngineState::Awake,
                Ok(status) => EngineState::NoAnswer(format!(
                    "GET {} answered {status}",
                    ep.url(health_call(ep.engine).target)
                )),
                Err(e) => EngineState::NoAnswer(e.to_string()),
            }
        };
        match ep.engine {
            EngineKind::Vllm => match self.vllm_is_sleeping(ep, self.timeouts.step).await {
                Ok(true) => EngineState::Asleep,
                // Not asleep is not serving: it serves once `/health` says so. (vLLM 0.32 answers
                // nothing while it starts; an engine that answered `is_sleeping` before it was
                // ready, as engine-sim once did, is not taken for a serving one.)
                Ok(false) | Err(AgentError::EngineStatus { status: 404, .. }) => health().await,
                Err(e) => EngineState::NoAnswer(e.to_string()),
            },
            EngineKind::Sglang => {
                let bound = if expect_awake {
                    self.timeouts.step
                } else {
                    self.timeouts.idle_probe.min(self.timeouts.step)
                };
                match self.sglang_generates(ep, bound).await {
                    Ok(true) => EngineState::Awake,
                    Ok(false) => match self.sglang_server_info(ep).await {
                        Ok(_) => EngineState::NotGenerating,
                        Err(e) => EngineState::NoAnswer(e.to_string()),
                    },
                    Err(e) => EngineState::NoAnswer(e.to_string()),
                }
            }
            EngineKind::Tensorfold => health().await,
        }
    }

    /// Parks the engine in `tier` and checks that it really is asleep. Call it only after the
    /// drain (no request running).
    pub async fn park(&self, ep: &Endpoint, tier: ParkTier) -> Result<(), AgentError> {
        let (step, park) = (self.timeouts.step, self.timeouts.park);
        match (ep.engine, tier) {
            (EngineKind::Vllm, ParkTier::HostRam | ParkTier::Deep) => {
                let sleep = if tier == ParkTier::HostRam {
                    VLLM_SLEEP_1
                } else {
                    VLLM_SLEEP_2
                };
                self.send_ok(ep, &sleep, park).await?;
                self.confirm_vllm_asleep(ep, step).await
            }
            (EngineKind::Sglang, _) => {
                self.send_ok(ep, &SGLANG_PAUSE, step).await?;
                self.send_ok(ep, &sglang_release(tier), park).await?;
                self.confirm_sglang_parked(ep).await
            }
            (EngineKind::Vllm, ParkTier::KvOnly) => Err(AgentError::Unsupported {
                engine: ep.engine,
                what: "a KV-only park",
            }),
            (EngineKind::Tensorfold, _) => Err(AgentError::Unsupported {
                engine: ep.engine,
                what: "parking (it stops instead)",
            }),
        }
    }

    /// The wake calls of `tier`, each bounded by what is left until `deadline`, and the check
    /// that the engine is awake (vLLM: the last wake call's own answer, see the module doc;
    /// SGLang: `/health_generate`). Does not run the check prompt.
    pub async fn wake_steps(
        &self,
        ep: &Endpoint,
        tier: ParkTier,
        deadline: Instant,
    ) -> Result<(), AgentError> {
        let left = || deadline.saturating_duration_since(Instant::now());
        let quick = || left().min(self.timeouts.step);
        match (ep.engine, tier) {
            (EngineKind::Vllm, ParkTier::HostRam) => {
                self.vllm_wake_whole(ep, &VLLM_WAKE_UP, (left(), quick()))
                    .await
            }
            (EngineKind::Vllm, ParkTier::Deep) => {
                self.send_ok(ep, &VLLM_WAKE_WEIGHTS, left()).await?;
                self.send_ok(ep, &VLLM_RELOAD_WEIGHTS, left()).await?;
                self.vllm_wake_whole(ep, &VLLM_WAKE_KV, (left(), quick()))
                    .await?;
                self.vllm_reset_prefix_cache(ep, quick()).await
            }
            (EngineKind::Sglang, _) => {
                self.send_ok(ep, &sglang_resume(tier), left()).await?;
                if tier == ParkTier::Deep {
                    let c = SGLANG_UPDATE_WEIGHTS;
                    let answer = self.send_json(ep, &c, left()).await?;
                    if answer.get("success").and_then(Value::as_bool) == Some(false) {
                        return Err(AgentError::EngineAnswer {
                            engine: ep.engine,
                            step: c.step,
                            url: ep.url(c.target),
                            detail: format!("the reload failed: {answer}"),
                        });
                    }
                    self.send_ok(ep, &SGLANG_FLUSH_CACHE, quick()).await?;
                }
                self.send_ok(ep, &SGLANG_CONTINUE, quick()).await?;
                self.confirm_sglang_awake(ep, quick()).await
            }
            (EngineKind::Vllm, ParkTier::KvOnly) | (EngineKind::Tensorfold, _) => {
                Err(AgentError::Unsupported {
                    engine: ep.engine,
                    what: "this wake",
                })
            }
        }
    }

    async fn completion(
        &self,
        ep: &Endpoint,
        step: &'static str,
        body: &Value,
        timeout: Duration,
    ) -> Result<Value, AgentError> {
        let c = completions_call(ep.engine);
        let url = ep.url(c.target);
        self.client
            .expect_json(
                self.call(ep, step, &url, timeout),
                c.verb.method(),
                Some(body),
            )
            .await
    }

    /// Asks the check prompt (or the fixed decision) and returns the answer.
    pub async fn check_answer(
        &self,
        ep: &Endpoint,
        decision: Option<&DecisionSpec>,
        timeout: Duration,
    ) -> Result<FirstAnswer, AgentError> {
        match decision {
            Some(d) => {
                let answer = self
                    .completion(
                        ep,
                        "decision check",
                        &decision_request(&ep.model_name, d),
                        timeout,
                    )
                    .await?;
                Ok(FirstAnswer::Decision {
                    answer: decision_from_completion(&d.options, &answer),
                })
            }
            None => {
                let answer = self
                    .completion(ep, "check prompt", &check_request(&ep.model_name), timeout)
                    .await?;
                let text = completion_text(&answer).ok_or_else(|| AgentError::EngineAnswer {
                    engine: ep.engine,
                    step: "check prompt",
                    url: ep.url(completions_call(ep.engine).target),
                    detail: format!("no choices[0].text in {answer}"),
                })?;
                Ok(FirstAnswer::Text {
                    text: text.to_string(),
                })
            }
        }
    }

    /// The one-token warm-up.
    pub async fn warm_up(&self, ep: &Endpoint, timeout: Duration) -> Result<(), AgentError> {
        self.completion(ep, "warm-up", &warm_up_request(&ep.model_name), timeout)
            .await
            .map(drop)
    }

    /// Scrapes `/metrics`; `None` when it cannot be read or holds none of the engine's figures.
    pub async fn scrape(&self, ep: &Endpoint, timeout: Duration) -> Option<EngineLoad> {
        let c = by_engine(ep.engine, VLLM_METRICS, SGLANG_METRICS, TENSORFOLD_METRICS);
        let body = self.send_ok(ep, &c, timeout).await.ok()?;
        parse_metrics(ep.engine, &String::from_utf8_lossy(&body))
    }

    /// SGLang's own `max_running_requests` from `/server_info` (before 0.5.6:
    /// `/get_server_info`): see [`max_running_of`].
    pub async fn sglang_max_running(&self, ep: &Endpoint) -> Option<u32> {
        let info = self.sglang_server_info(ep).await.ok()?;
        max_running_of(&info)
    }

    /// The engine's version: vLLM `GET /version`, SGLang `/server_info`'s `version` (before
    /// 0.5.6: `/get_server_info`'s), TensorFold `GET /version`.
    pub async fn version(&self, ep: &Endpoint) -> Option<String> {
        let v = match ep.engine {
            EngineKind::Sglang => self.sglang_server_info(ep).await.ok()?,
            EngineKind::Vllm => self
                .send_json(ep, &VLLM_VERSION, self.timeouts.step)
                .await
                .ok()?,
            EngineKind::Tensorfold => self
                .send_json(ep, &TENSORFOLD_VERSION, self.timeouts.step)
                .await
                .ok()?,
        };
        version_of(&v)
    }

    /// The adapter calls of `ep`'s engine (load, unload, list); TensorFold has none.
    fn adapter_calls(ep: &Endpoint) -> Result<[EngineCall; 3], AgentError> {
        match ep.engine {
            Vllm => Ok([VLLM_LOAD_LORA, VLLM_UNLOAD_LORA, VLLM_MODELS]),
            Sglang => Ok([SGLANG_LOAD_LORA, SGLANG_UNLOAD_LORA, SGLANG_MODELS]),
            Tensorfold => Err(AgentError::Unsupported {
                engine: ep.engine,
                what: "LoRA adapters",
            }),
        }
    }

    /// Sends adapter call `c` for adapter `name` at `path`; the status and body.
    async fn send_adapter(
        &self,
        ep: &Endpoint,
        c: &EngineCall,
        (name, path): (&str, &str),
        timeout: Duration,
    ) -> Result<(u16, bytes::Bytes), AgentError> {
        let CallBody::Adapter(make) = c.body else {
            unreachable!("{} is not an adapter call", c.target)
        };
        let url = ep.url(c.target);
        self.client
            .send(
                self.call(ep, c.step, &url, timeout),
                c.verb.method(),
                Some(&make(name, path)),
            )
            .await
    }

    /// Loads LoRA adapter `name` from `path` into the engine (vLLM `POST
    /// /v1/load_lora_adapter`, SGLang `POST /load_lora_adapter`), within the check timeout
    /// (reading an adapter is reading weights). A refusal is [`AgentError::EngineStatus`]
    /// whose `body` is `adapter NAME (PATH): ` and the engine's reason ([`refusal_reason`]).
    pub async fn load_adapter(
        &self,
        ep: &Endpoint,
        name: &str,
        path: &str,
    ) -> Result<(), AgentError> {
        let [load, _, _] = Self::adapter_calls(ep)?;
        let (status, body) = self
            .send_adapter(ep, &load, (name, path), self.timeouts.check)
            .await?;
        if (200..300).contains(&status) {
            return Ok(());
        }
        Err(AgentError::EngineStatus {
            engine: ep.engine,
            step: load.step,
            url: ep.url(load.target),
            status,
            body: refusal_reason(&format!("adapter {name} ({path})"), &body),
        })
    }

    /// Unloads LoRA adapter `name` (vLLM `POST /v1/unload_lora_adapter`, SGLang `POST
    /// /unload_lora_adapter`). One the engine does not list is not an error: a refusal is
    /// checked against [`Driver::adapters`], and only an adapter still listed fails, with the
    /// engine's reason.
    pub async fn unload_adapter(&self, ep: &Endpoint, name: &str) -> Result<(), AgentError> {
        let [_, unload, _] = Self::adapter_calls(ep)?;
        let (status, body) = self
            .send_adapter(ep, &unload, (name, ""), self.timeouts.step)
            .await?;
        if (200..300).contains(&status) {
            return Ok(());
        }
        if !self.adapters(ep).await?.iter().any(|a| a == name) {
            return Ok(());
        }
        Err(AgentError::EngineStatus {
            engine: ep.engine,
            step: unload.step,
            url: ep.url(unload.target),
            status,
            body: refusal_reason(&format!("adapter {name}"), &body),
        })
    }

    /// The adapters the engine has loaded: the `/v1/models` entries whose `parent` is the
    /// served model (vLLM and SGLang list them so).
    pub async fn adapters(&self, ep: &Endpoint) -> Result<Vec<String>, AgentError> {
        let [_, _, list] = Self::adapter_calls(ep)?;
        let answer = self.send_json(ep, &list, self.timeouts.step).await?;
        adapters_of(&answer, &ep.model_name).ok_or_else(|| AgentError::EngineAnswer {
            engine: ep.engine,
            step: list.step,
            url: ep.url(list.target),
            detail: format!(
                "no `data` list of models in {}",
                crate::http::excerpt(answer.to_string().as_bytes())
            ),
        })
    }

    /// Wakes a parked engine and verifies it: the wake steps of `tier`, then the check prompt
    /// (or the fixed decision) compared with `first`, then the one-token warm-up, all within
    /// `window`. A failed step (an error answer, or an engine still asleep after its wake
    /// calls) is [`WakeOutcome::ReloadFailed`]; the whole running past the window, or a step
    /// not answering within its own timeout (its detail names the step and says it was the
    /// step's timeout), [`WakeOutcome::Uncertain`]; a check that cannot be asked
    /// [`WakeOutcome::Uncertain`]; a different answer [`WakeOutcome::Mismatch`]. (Whether the
    /// engine exited is for the caller, who owns the process, to add.)
    ///
    /// The attempt also tells whether the engine could no longer be reached (it may have
    /// exited: the caller finds out).
    pub async fn wake_and_verify(
        &self,
        ep: &Endpoint,
        tier: ParkTier,
        decision: Option<&DecisionSpec>,
        first: Option<&FirstAnswer>,
        window: Duration,
    ) -> WakeAttempt {
        let mut lost = false;
        let mut check_began = None;
        let outcome = self
            .wake_outcome(
                ep,
                (tier, decision, first),
                window,
                &mut lost,
                &mut check_began,
            )
            .await;
        WakeAttempt {
            outcome,
            engine_unreachable: lost,
            check_began,
        }
    }

    async fn wake_outcome(
        &self,
        ep: &Endpoint,
        (tier, decision, first): (ParkTier, Option<&DecisionSpec>, Option<&FirstAnswer>),
        window: Duration,
        lost: &mut bool,
        check_began: &mut Option<Instant>,
    ) -> WakeOutcome {
        let deadline = Instant::now() + window;
        let window_ms = window.as_millis();
        let uncertain = || {
            WakeOutcome::Uncertain(format!(
                "the wake did not finish within the wake window of {window_ms} ms"
            ))
        };
        // A step's own timeout that fired before the window ended is still uncertain (the
        // engine did not say whether its weights came back), but says which step it was.
        let timed_out = |e: &AgentError| {
            if Instant::now() >= deadline {
                uncertain()
            } else {
                WakeOutcome::Uncertain(format!(
                    "{e} (the step's own timeout, inside the wake window of {window_ms} ms)"
                ))
            }
        };
        match tokio::time::timeout_at(deadline, self.wake_steps(ep, tier, deadline)).await {
            Err(_) => return uncertain(),
            Ok(Err(e @ AgentError::EngineTimeout { .. })) => return timed_out(&e),
            Ok(Err(e)) => {
                *lost = matches!(e, AgentError::EngineUnreachable { .. });
                return WakeOutcome::ReloadFailed(e.to_string());
            }
            Ok(Ok(())) => {}
        }
        *check_began = Some(Instant::now());
        let check = async {
            let left = || {
                deadline
                    .saturating_duration_since(Instant::now())
                    .min(self.timeouts.check)
            };
            let now = self.check_answer(ep, decision, left()).await?;
            self.warm_up(ep, left()).await?;
            Ok::<_, AgentError>(now)
        };
        let now = match tokio::time::timeout_at(deadline, check).await {
            Err(_) => return uncertain(),
            Ok(Err(e @ AgentError::EngineTimeout { .. })) => return timed_out(&e),
            Ok(Err(e)) => {
                *lost = matches!(e, AgentError::EngineUnreachable { .. });
                return WakeOutcome::Uncertain(format!("the check after the wake failed: {e}"));
            }
            Ok(Ok(now)) => now,
        };
        let Some(first) = first else {
            return WakeOutcome::Uncertain("no first answer was recorded to compare with".into());
        };
        match compare_answers(first, &now) {
            Ok(()) => WakeOutcome::Pass,
            Err(why) => WakeOutcome::Mismatch(why),
        }
    }
}

/// What [`Driver::wake_and_verify`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WakeAttempt {
    /// How the wake went.
    pub outcome: WakeOutcome,
    /// It failed because the engine could not be reached (refused or broken connection).
    pub engine_unreachable: bool,
    /// When the wake check (the answer compared, the warm-up) began; `None` when the wake
    /// failed before it.
    pub check_began: Option<Instant>,
}

/// vLLM's `/is_sleeping` answer: its boolean `is_sleeping`.
pub(crate) fn is_sleeping_of(answer: &Value) -> Option<bool> {
    answer.get("is_sleeping").and_then(Value::as_bool)
}

/// SGLang's `max_running_requests` in a `/server_info` answer: the top-level server argument
/// when it is a number; when SGLang sized itself that argument is `null` (every server argument
/// is spread at top level, set or not), and the figure it runs with is
/// `internal_states[0].effective_max_running_requests_per_dp` (0.5.9 and later; one
/// data-parallel rank, as CapyCTL launches it), else `internal_states[0].max_running_requests`.
pub(crate) fn max_running_of(info: &Value) -> Option<u32> {
    [
        "/max_running_requests",
        "/internal_states/0/effective_max_running_requests_per_dp",
        "/internal_states/0/max_running_requests",
    ]
    .iter()
    .find_map(|at| info.pointer(at).and_then(Value::as_u64))
    .and_then(|n| u32::try_from(n).ok())
}

/// The `version` of a `/version` or `/server_info` answer.
pub(crate) fn version_of(answer: &Value) -> Option<String> {
    answer
        .get("version")
        .and_then(Value::as_str)
        .map(str::to_string)
}

/// The adapters in a `/v1/models` answer: the ids of the entries whose `parent` is `base`, in
/// the engine's order; `None` when the answer has no `data` list.
pub(crate) fn adapters_of(answer: &Value, base: &str) -> Option<Vec<String>> {
    let data = answer.get("data")?.as_array()?;
    Some(
        data.iter()
            .filter(|m| m.get("parent").and_then(Value::as_str) == Some(base))
            .filter_map(|m| m.get("id").and_then(Value::as_str).map(str::to_string))
            .collect(),
    )
}

/// The engine's reason in a refusal's body, after `adapter` (what was asked: `adapter NAME
/// (PATH)` or `adapter NAME`): vLLM's `error.message`, SGLang's `error_message` (or
/// `message`, as its 400 for a malformed body), else the body; cut short as every body in an
/// error is ([`crate::http::excerpt`]: a refusal may carry a stack trace or the whole file).
pub fn refusal_reason(adapter: &str, body: &[u8]) -> String {
    let found = serde_json::from_slice::<Value>(body).ok().and_then(|v| {
        ["/error/message", "/error_message", "/message", "/detail"]
            .iter()
            .find_map(|at| v.pointer(at).and_then(Value::as_str).map(str::to_string))
    });
    let reason = match found {
        Some(message) => crate::http::excerpt(message.as_bytes()),
        None => crate::http::excerpt(body),
    };
    format!("{adapter}: {reason}")
}
