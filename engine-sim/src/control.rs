//! Engine control endpoints: health, version, vLLM sleep mode, SGLang memory saver, and the
//! simulator's own `/sim/state` and `/sim/faults`.

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Value, json};
use tracing::{info, warn};

use crate::config::{Fault, Flavour, PAUSED_HEALTH_TIMEOUT};
use crate::engine::{EngineSim, crash};
use crate::openai::api_error;
use crate::state::{ControlError, Tag};

impl IntoResponse for ControlError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        api_error(status, "ControlError", self.message)
    }
}

fn query_values<'a>(query: &'a Option<String>, key: &str) -> Vec<&'a str> {
    query
        .as_deref()
        .unwrap_or("")
        .split('&')
        .filter_map(|pair| pair.split_once('=').or(Some((pair, ""))))
        .filter(|(k, _)| *k == key)
        .map(|(_, v)| v)
        .collect()
}

fn parse_tags<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<Vec<Tag>, ControlError> {
    names
        .into_iter()
        .map(|n| n.replace("%2C", ",").replace("%2c", ","))
        .collect::<Vec<_>>()
        .iter()
        .flat_map(|n| n.split(','))
        .filter(|n| !n.is_empty())
        .map(|n| {
            Tag::parse(n).ok_or_else(|| ControlError {
                status: 400,
                message: format!("unknown tag `{n}`; known tags: weights, kv_cache, cuda_graph"),
            })
        })
        .collect()
}

fn ok_empty() -> Response {
    StatusCode::OK.into_response()
}

fn done(result: Result<(), ControlError>) -> Response {
    match result {
        Ok(()) => ok_empty(),
        Err(e) => e.into_response(),
    }
}

/// SGLang 0.5.6 and later: `/pause_generation` and `/continue_generation` take a JSON body
/// (`PauseGenerationReqInput`, `ContinueGenerationReqInput`: FastAPI answers 400 to a POST
/// without one), `/server_info` exists, and `/health` generates only while
/// `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION` is on. Read in 0.5.5, 0.5.6 and 0.5.23.
pub(crate) const SGLANG_BODIES_SINCE: [u64; 3] = [0, 5, 6];
/// SGLang 0.5.9 and later report the figure they size themselves to in
/// `internal_states[].effective_max_running_requests_per_dp` (absent in 0.5.6).
const SGLANG_EFFECTIVE_MAX_RUNNING_SINCE: [u64; 3] = [0, 5, 9];

/// `GET /health`. vLLM and TensorFold: 200 once started (vLLM also while asleep). SGLang: as
/// [`health_generate`], except that from 0.5.6 with `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`
/// off it answers 200 once started without generating (paused or released alike).
pub(crate) async fn health(State(sim): State<Arc<EngineSim>>) -> Response {
    let c = sim.config();
    if c.flavour == Flavour::Sglang
        && sim.started()
        && !c.sglang_health_generates
        && c.version_at_least(SGLANG_BODIES_SINCE)
    {
        return ok_empty();
    }
    health_generate(State(sim)).await
}

/// `GET /health_generate` (SGLang), and `/health` otherwise. vLLM and TensorFold: 200 once
/// started. SGLang: 503 while memory is released or generation is paused (its check generates
/// a token); with the `paused_health_hangs` fault it waits for that token as the real server
/// does: 200 as soon as the engine serves again, 503 after [`PAUSED_HEALTH_TIMEOUT`].
pub(crate) async fn health_generate(State(sim): State<Arc<EngineSim>>) -> Response {
    if !sim.started() {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    if sim.config().flavour != Flavour::Sglang {
        return ok_empty();
    }
    let Err(why) = sim.with_state(|s| s.servable()) else {
        return ok_empty();
    };
    if !sim.with_state(|s| s.has_fault(Fault::PausedHealthHangs)) {
        return (StatusCode::SERVICE_UNAVAILABLE, why).into_response();
    }
    warn!("fault paused_health_hangs: /health waits for a token while generation is paused");
    let deadline = tokio::time::Instant::now() + PAUSED_HEALTH_TIMEOUT;
    while tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        if sim.with_state(|s| s.servable()).is_ok() {
            return ok_empty();
        }
    }
    (StatusCode::SERVICE_UNAVAILABLE, why).into_response()
}

/// True (and logged) when `fault` makes this control call answer 200 and do nothing.
fn ignored(sim: &EngineSim, fault: Fault, what: &str) -> bool {
    let on = sim.with_state(|s| s.has_fault(fault));
    if on {
        warn!(fault = %fault, "{what} answers 200 and does nothing");
    }
    on
}

/// `GET /version` (vLLM).
pub(crate) async fn version(State(sim): State<Arc<EngineSim>>) -> Response {
    Json(json!({"version": sim.config().version})).into_response()
}

// ----- vLLM -----

/// vLLM's answer to a request FastAPI's validation or a handler refuses: 400, type
/// `Bad Request`.
fn vllm_bad_request(message: String, param: Option<&str>) -> Response {
    crate::openai::api_error_on(StatusCode::BAD_REQUEST, "Bad Request", message, param)
}

/// `POST /sleep?level=0|1|2` → `{"status":"sleeping","level":N}` (vLLM validates the level:
/// an integer from 0 to 2).
pub(crate) async fn vllm_sleep(
    State(sim): State<Arc<EngineSim>>,
    RawQuery(q): RawQuery,
) -> Response {
    let level = match query_values(&q, "level").first() {
        None => 1,
        Some(v) => match v.parse::<u8>() {
            Ok(l) if l <= 2 => l,
            Ok(_) => {
                return vllm_bad_request(
                    format!(
                        "1 validation error:\n  {{'type': 'less_than_equal', 'loc': \
                         'query.level', 'msg': 'Input should be less than or equal to 2', \
                         'input': '{v}', 'ctx': {{'le': 2}}}}"
                    ),
                    Some("query.level"),
                );
            }
            Err(_) => {
                return vllm_bad_request(
                    format!(
                        "1 validation error:\n  {{'type': 'int_parsing', 'loc': \
                         'query.level', 'msg': 'Input should be a valid integer, unable to \
                         parse string as an integer', 'input': '{v}'}}"
                    ),
                    Some("query.level"),
                );
            }
        },
    };
    let answer = Json(json!({"status": "sleeping", "level": level})).into_response();
    if ignored(&sim, Fault::SleepIgnored, "sleep") {
        return answer;
    }
    match sim
        .control("sleep", move |s, c| s.begin_vllm_sleep(level, c))
        .await
    {
        Ok(()) => answer,
        Err(e) => e.into_response(),
    }
}

/// `POST /wake_up[?tags=weights|kv_cache]` → `{"status":"awake"|"sleeping","tags":…}`
/// (`sleeping` while a tag is still asleep; `tags` as given, `null` for all).
pub(crate) async fn vllm_wake_up(
    State(sim): State<Arc<EngineSim>>,
    RawQuery(q): RawQuery,
) -> Response {
    let asked: Vec<String> = query_values(&q, "tags")
        .iter()
        .map(|t| t.to_string())
        .collect();
    let mut tags = match parse_tags(asked.iter().map(String::as_str)) {
        Ok(t) => t,
        Err(e) => return e.into_response(),
    };
    if tags.is_empty() {
        tags = vec![Tag::Weights, Tag::KvCache];
    }
    let named = if asked.is_empty() {
        Value::Null
    } else {
        json!(asked)
    };
    let answer = |sim: &EngineSim| {
        let status = if sim.with_state(|s| s.is_sleeping()) {
            "sleeping"
        } else {
            "awake"
        };
        Json(json!({"status": status, "tags": named})).into_response()
    };
    sim.hang_if_wake_hangs().await;
    if ignored(&sim, Fault::WakeIgnored, "wake_up") {
        return answer(&sim);
    }
    match sim
        .control("wake_up", move |s, c| Ok(s.begin_wake(&tags, c)))
        .await
    {
        Ok(()) => answer(&sim),
        Err(e) => e.into_response(),
    }
}

/// `GET /is_sleeping`.
pub(crate) async fn vllm_is_sleeping(State(sim): State<Arc<EngineSim>>) -> Response {
    Json(json!({"is_sleeping": sim.with_state(|s| s.is_sleeping())})).into_response()
}

#[derive(Deserialize)]
struct CollectiveRpc {
    method: String,
}

/// `POST /collective_rpc {"method":"reload_weights"}`.
pub(crate) async fn vllm_collective_rpc(
    State(sim): State<Arc<EngineSim>>,
    body: Bytes,
) -> Response {
    let value: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return vllm_bad_request(format!("JSON decode error: {e}"), None),
    };
    if !value.is_object() {
        return vllm_bad_request("Request body must be a JSON object".into(), None);
    }
    let rpc: CollectiveRpc = match serde_json::from_value(value) {
        Ok(r) => r,
        Err(_) => {
            return vllm_bad_request("Missing 'method' in request body".into(), None);
        }
    };
    if rpc.method != "reload_weights" {
        return ControlError {
            status: 400,
            message: format!(
                "unsupported collective_rpc method `{}` (the simulator knows reload_weights)",
                rpc.method
            ),
        }
        .into_response();
    }
    match sim
        .control("reload_weights", |s, c| s.begin_reload(None, c))
        .await
    {
        Ok(()) => Json(json!({"results": [null]})).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /reset_prefix_cache` → `{"success": bool}` (false with the
/// `prefix_cache_reset_fails` fault, as vLLM answers while blocks are still held).
pub(crate) async fn vllm_reset_prefix_cache(State(sim): State<Arc<EngineSim>>) -> Response {
    let success = sim.with_state(|s| {
        let success = !s.has_fault(Fault::PrefixCacheResetFails);
        if success {
            s.counters.cache_resets += 1;
        }
        success
    });
    if !success {
        warn!("fault prefix_cache_reset_fails: the prefix cache is not reset");
    }
    Json(json!({"success": success})).into_response()
}

// ----- SGLang -----

/// `GET /server_info` (0.5.6 and later) and `GET /get_server_info`: every server argument at
/// top level, `max_running_requests` among them (`null` when SGLang sizes itself), and
/// `internal_states` with the figure it runs with (0.5.9 and later).
pub(crate) async fn sglang_server_info(State(sim): State<Arc<EngineSim>>) -> Response {
    let c = sim.config();
    let loaded = sim.with_state(|s| s.loaded_model().to_owned());
    let mut internal = json!({"max_running_requests": c.max_running_requests_arg});
    if c.version_at_least(SGLANG_EFFECTIVE_MAX_RUNNING_SINCE) {
        internal["effective_max_running_requests_per_dp"] = json!(c.max_running);
    }
    Json(json!({
        "model_path": loaded,
        "served_model_name": c.served_model_name,
        "host": c.host,
        "port": c.port,
        "version": c.version,
        "max_running_requests": c.max_running_requests_arg,
        "speculative_algorithm": c.speculative_algorithm,
        "enable_memory_saver": c.enable_memory_saver,
        "enable_weights_cpu_backup": c.enable_weights_cpu_backup,
        "enable_metrics": c.enable_metrics,
        "internal_states": [internal],
    }))
    .into_response()
}

/// `GET /get_model_info`.
pub(crate) async fn sglang_model_info(State(sim): State<Arc<EngineSim>>) -> Response {
    let loaded = sim.with_state(|s| s.loaded_model().to_owned());
    Json(json!({"model_path": loaded, "is_generation": true})).into_response()
}

/// SGLang's answer to a request that fails validation (its handler turns FastAPI's 422 into
/// 400): `{"object":"error","message",...,"type":"Bad Request","param":null,"code":400}`.
fn sglang_bad_request(message: String) -> Response {
    crate::openai::sglang_error(StatusCode::BAD_REQUEST, "Bad Request", message)
}

/// The JSON object a body-taking SGLang control call requires (0.5.6 and later), or the
/// message of SGLang's 400 ([`sglang_bad_request`]): a POST without a body is `Field required`.
fn sglang_body_object(body: &Bytes) -> Result<serde_json::Map<String, Value>, String> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(
            "1 validation error:\n  {'type': 'missing', 'loc': ('body',), 'msg': 'Field \
             required', 'input': None}"
                .into(),
        );
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(other) => Err(format!(
            "1 validation error: the body must be a JSON object, not {other}"
        )),
        Err(e) => Err(format!("1 validation error: JSON decode error: {e}")),
    }
}

/// `POST /pause_generation` (0.5.6 and later: `{"mode": "abort"|"retract"|"in_place"}`, a body
/// required): new requests are refused, running ones are cut off (mode `abort`, SGLang's
/// default). `retract` and `in_place` keep running requests inside the engine; the simulator
/// does not model them and answers 501.
pub(crate) async fn sglang_pause(State(sim): State<Arc<EngineSim>>, body: Bytes) -> Response {
    if sim.config().version_at_least(SGLANG_BODIES_SINCE) {
        let req = match sglang_body_object(&body) {
            Ok(r) => r,
            Err(why) => return sglang_bad_request(why),
        };
        match req.get("mode").map(|m| m.as_str()) {
            None | Some(Some("abort")) => {}
            Some(Some(mode @ ("retract" | "in_place"))) => {
                return api_error(
                    StatusCode::NOT_IMPLEMENTED,
                    "NotImplementedError",
                    format!("engine-sim models pause mode `abort` only, not `{mode}`"),
                );
            }
            Some(other) => {
                return sglang_bad_request(format!(
                    "1 validation error: mode: Input should be 'abort', 'retract' or \
                     'in_place', not {}",
                    other.map_or_else(|| req["mode"].to_string(), str::to_string)
                ));
            }
        }
    }
    if ignored(&sim, Fault::SleepIgnored, "pause_generation") {
        return sglang_status_ok("Generation paused successfully.");
    }
    sim.with_state(|s| s.set_paused(true));
    info!("generation paused");
    sglang_status_ok("Generation paused successfully.")
}

/// `POST /continue_generation` (0.5.6 and later: `ContinueGenerationReqInput`, a body
/// required; `{}` takes its defaults).
pub(crate) async fn sglang_continue(State(sim): State<Arc<EngineSim>>, body: Bytes) -> Response {
    if sim.config().version_at_least(SGLANG_BODIES_SINCE)
        && let Err(why) = sglang_body_object(&body)
    {
        return sglang_bad_request(why);
    }
    if ignored(&sim, Fault::WakeIgnored, "continue_generation") {
        return sglang_status_ok("Generation continued successfully.");
    }
    sim.with_state(|s| s.set_paused(false));
    info!("generation continued");
    sglang_status_ok("Generation continued successfully.")
}

fn sglang_status_ok(message: &str) -> Response {
    Json(json!({"message": message, "status": "ok"})).into_response()
}

/// The `tags` of a memory request (`ReleaseMemoryOccupationReqInput`,
/// `ResumeMemoryOccupationReqInput`: a JSON body is required in every release read, 0.5.3 to
/// 0.5.23); absent or `null` means all.
fn body_tags(body: &Bytes) -> Result<Vec<Tag>, BadTags> {
    let bad = |m: String| {
        BadTags::Tags(ControlError {
            status: 400,
            message: m,
        })
    };
    let value = Value::Object(sglang_body_object(body).map_err(BadTags::Body)?);
    match value.get("tags") {
        None | Some(Value::Null) => Ok(vec![Tag::Weights, Tag::KvCache, Tag::CudaGraph]),
        Some(Value::Array(names)) => {
            let names: Option<Vec<&str>> = names.iter().map(Value::as_str).collect();
            parse_tags(names.ok_or_else(|| bad("`tags` must be a list of strings".into()))?)
                .map_err(BadTags::Tags)
        }
        Some(_) => Err(bad("`tags` must be a list of strings".into())),
    }
}

/// Why a memory request's body is refused: no JSON object (SGLang's validation 400), or tags
/// it does not know.
enum BadTags {
    Body(String),
    Tags(ControlError),
}

impl IntoResponse for BadTags {
    fn into_response(self) -> Response {
        match self {
            BadTags::Body(why) => sglang_bad_request(why),
            BadTags::Tags(e) => e.into_response(),
        }
    }
}

/// `POST /release_memory_occupation {"tags":[...]}`.
pub(crate) async fn sglang_release(State(sim): State<Arc<EngineSim>>, body: Bytes) -> Response {
    let tags = match body_tags(&body) {
        Ok(t) => t,
        Err(e) => return e.into_response(),
    };
    if ignored(&sim, Fault::SleepIgnored, "release_memory_occupation") {
        return ok_empty();
    }
    done(
        sim.control("release_memory_occupation", move |s, c| {
            s.begin_sglang_release(&tags, c)
        })
        .await,
    )
}

/// `POST /resume_memory_occupation {"tags":[...]}`.
pub(crate) async fn sglang_resume(State(sim): State<Arc<EngineSim>>, body: Bytes) -> Response {
    let tags = match body_tags(&body) {
        Ok(t) => t,
        Err(e) => return e.into_response(),
    };
    sim.hang_if_wake_hangs().await;
    if ignored(&sim, Fault::WakeIgnored, "resume_memory_occupation") {
        return ok_empty();
    }
    done(
        sim.control("resume_memory_occupation", move |s, c| {
            Ok(s.begin_wake(&tags, c))
        })
        .await,
    )
}

#[derive(Deserialize)]
struct UpdateWeights {
    model_path: String,
}

/// `POST /update_weights_from_disk {"model_path":...}` → `{"success","message"}`.
pub(crate) async fn sglang_update_weights(
    State(sim): State<Arc<EngineSim>>,
    body: Bytes,
) -> Response {
    let answer = |status: StatusCode, success: bool, message: String| {
        (
            status,
            Json(json!({"success": success, "message": message, "num_paused_requests": 0})),
        )
            .into_response()
    };
    let req: UpdateWeights = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return answer(StatusCode::BAD_REQUEST, false, format!("invalid body: {e}")),
    };
    let path = req.model_path.clone();
    match sim
        .control("update_weights_from_disk", move |s, c| {
            s.begin_reload(Some(path), c)
        })
        .await
    {
        Ok(()) => answer(
            StatusCode::OK,
            true,
            format!("Succeeded to update model weights from {}.", req.model_path),
        ),
        Err(e) => answer(
            StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            false,
            e.message,
        ),
    }
}

/// `GET|POST /flush_cache`.
pub(crate) async fn sglang_flush_cache(State(sim): State<Arc<EngineSim>>) -> Response {
    sim.with_state(|s| s.counters.cache_resets += 1);
    (StatusCode::OK, "Cache flushed.\n").into_response()
}

// ----- simulator -----

/// `GET /sim/state`.
pub(crate) async fn sim_state(State(sim): State<Arc<EngineSim>>) -> Response {
    Json(sim.snapshot()).into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FaultChange {
    #[serde(default)]
    set: Vec<String>,
    #[serde(default)]
    clear: Vec<String>,
    #[serde(default)]
    clear_all: bool,
    /// Per LoRA adapter name: its load time and faults (`null` forgets them).
    #[serde(default)]
    adapters: std::collections::BTreeMap<String, Option<crate::state::AdapterSettings>>,
}

/// `POST /sim/faults {"set":[...],"clear":[...],"clear_all":bool,"adapters":{name: {...}|null}}`
/// → `{"faults":[...],"adapters":{...}}` (`adapters`: per LoRA adapter, `load_time`, `fails`,
/// `hangs`; `clear_all` forgets them too).
/// Setting `crash` exits the process at once.
pub(crate) async fn sim_faults(State(sim): State<Arc<EngineSim>>, body: Bytes) -> Response {
    let bad = |m: String| api_error(StatusCode::BAD_REQUEST, "BadRequestError", m);
    let change: FaultChange = match serde_json::from_slice(&body) {
        Ok(c) => c,
        Err(e) => {
            return bad(format!(
                "invalid body: {e}; expected {{\"set\":[..],\"clear\":[..],\"clear_all\":bool}}"
            ));
        }
    };
    let parse = |names: &[String]| -> Result<Vec<Fault>, String> {
        names.iter().map(|n| n.parse()).collect()
    };
    let (set, clear) = match (parse(&change.set), parse(&change.clear)) {
        (Ok(s), Ok(c)) => (s, c),
        (Err(e), _) | (_, Err(e)) => return bad(e),
    };
    if set.contains(&Fault::Crash) {
        crash("fault crash set via /sim/faults");
    }
    let (faults, adapters) = sim.with_state(|s| {
        s.change_faults(&set, &clear, change.clear_all);
        if change.clear_all {
            s.adapter_settings.clear();
        }
        for (name, settings) in change.adapters {
            match settings {
                Some(a) => s.adapter_settings.insert(name, a),
                None => s.adapter_settings.remove(&name),
            };
        }
        (
            s.faults().iter().copied().collect::<Vec<Fault>>(),
            s.adapter_settings.clone(),
        )
    });
    info!(?faults, ?adapters, "faults changed");
    Json(json!({"faults": faults, "adapters": adapters})).into_response()
}

/// A route taken with another method: FastAPI's 405 (axum adds the `allow` header).
pub(crate) async fn method_not_allowed() -> Response {
    (
        StatusCode::METHOD_NOT_ALLOWED,
        Json(json!({"detail": "Method Not Allowed"})),
    )
        .into_response()
}

/// Anything else: FastAPI's 404.
pub(crate) async fn not_found() -> Response {
    (StatusCode::NOT_FOUND, Json(json!({"detail": "Not Found"}))).into_response()
}
