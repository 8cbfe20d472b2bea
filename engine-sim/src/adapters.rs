//! LoRA adapters loaded and unloaded at run time, as vLLM 0.32 and SGLang 0.5.23 serve them.
//!
//! vLLM (`--enable-lora`, routes with `VLLM_ALLOW_RUNTIME_LORA_UPDATING`): `POST
//! /v1/load_lora_adapter {"lora_name","lora_path"[,"load_inplace"]}` and `POST
//! /v1/unload_lora_adapter {"lora_name"}`, with the statuses and bodies the real engine gave
//! on CPU (`tests/fixtures/vllm-0.32.0-lora/`, compared by `tests/real_vllm.rs`):
//! - loaded: 200, no content type, `Success: LoRA adapter 'NAME' added successfully.`;
//! - a field missing: FastAPI's 400 naming `body.lora_name` / `body.lora_path`; an empty one:
//!   400 `InvalidUserInput`; the base's name: 400 "conflicts with a served base model"; a
//!   name already loaded (without `load_inplace`): 400 "has already been loaded";
//! - without `--enable-lora`: 500 "…'LoRA is not enabled. Use --enable-lora to enable
//!   LoRA.'…"; a directory that does not exist or holds no `adapter_config.json`: 404
//!   `NotFoundError` "Loading lora NAME failed: No adapter found for PATH"; a rank above
//!   `--max-lora-rank`: 500 "…'LoRA rank R is greater than max_lora_rank M.'…";
//! - more adapters than `--max-loras`: accepted (they are GPU slots per batch; vLLM's CPU
//!   cache holds `--max-cpu-loras`, by default as many, and reads the others from disk again
//!   when a request names them; the simulator holds them all);
//! - unloaded: 200 `Success: LoRA adapter 'NAME' removed successfully.` (vLLM only takes the
//!   name off its list; nothing is freed in the engine); one not loaded: 404 "The lora
//!   adapter 'NAME' cannot be found.".
//!
//! SGLang: `POST /load_lora_adapter` and `/unload_lora_adapter` with the same fields, answering
//! `{"success", "error_message", "loaded_adapters"}`, 200 or 400 (its messages here are the
//! simulator's own); beyond `--max-loaded-loras`, a load succeeds and unloads the least
//! recently used adapter, as SGLang 0.5.23 does.
//!
//! A load takes `--sim-adapter-load-time`, or the adapter's own `load_time`; the faults
//! `adapter_load_fails` and `adapter_load_hangs`, or an adapter's own `fails`/`hangs`
//! (`/sim/faults` `adapters`), make it fail after its load time or never answer. Loads are
//! serialized (and SGLang's unloads with them); vLLM's unload holds only its name's lock, so
//! it waits only for a load of the same name.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tracing::info;

use crate::config::{Fault, Flavour, SimConfig};
use crate::engine::EngineSim;
use crate::openai::{api_error, validation_error};
use crate::state::LoadedAdapter;

/// Why a load or unload was refused: the status and the engine's reason.
struct Refused(StatusCode, &'static str, String);

/// vLLM's 500 for an error raised in its worker (`add_lora`).
fn worker_error(why: &str) -> Refused {
    Refused(
        StatusCode::INTERNAL_SERVER_ERROR,
        "InternalServerError",
        format!(
            "Call to add_lora method failed: Worker failed with error '{why}', please check the \
             stack trace above for the root cause"
        ),
    )
}

fn invalid_input(message: String) -> Refused {
    Refused(StatusCode::BAD_REQUEST, "InvalidUserInput", message)
}

/// The body's fields: `Err` is FastAPI's 400 for a body that is not an object with the
/// required string fields (vLLM) or SGLang's 400.
fn fields(body: &Bytes, required: &[&str]) -> Result<Value, Box<Response>> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        Box::new(validation_error(
            "body",
            format!("{{'type': 'json_invalid', 'loc': 'body', 'msg': 'JSON decode error: {e}'}}"),
        ))
    })?;
    let Some(obj) = value.as_object() else {
        return Err(Box::new(validation_error(
            "body",
            "{'type': 'model_attributes_type', 'loc': 'body', 'msg': 'Input should be a valid dictionary'}",
        )));
    };
    for name in required {
        match obj.get(*name) {
            Some(Value::String(_)) => {}
            None => {
                return Err(Box::new(validation_error(
                    &format!("body.{name}"),
                    format!(
                        "{{'type': 'missing', 'loc': 'body.{name}', 'msg': 'Field required', \
                         'input': '<dict of {} items>'}}",
                        obj.len()
                    ),
                )));
            }
            Some(other) => {
                return Err(Box::new(validation_error(
                    &format!("body.{name}"),
                    format!(
                        "{{'type': 'string_type', 'loc': 'body.{name}', 'msg': 'Input should be \
                         a valid string', 'input': {other}}}"
                    ),
                )));
            }
        }
    }
    Ok(value)
}

fn text(v: &Value, name: &str) -> String {
    v.get(name)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string()
}

/// The rank of the PEFT adapter in `dir` (`r` of its `adapter_config.json`); `Err` as vLLM
/// answers: 404 for no adapter there, a worker error for one it cannot read.
fn read_adapter(name: &str, dir: &str) -> Result<u64, Refused> {
    let not_found = || {
        Refused(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            format!("Loading lora {name} failed: No adapter found for {dir}"),
        )
    };
    let config = Path::new(dir).join("adapter_config.json");
    let text = std::fs::read_to_string(&config).map_err(|_| not_found())?;
    let value: Value = serde_json::from_str(&text)
        .map_err(|e| worker_error(&format!("{}: not JSON: {e}", config.display())))?;
    value
        .get("r")
        .and_then(Value::as_u64)
        .ok_or_else(|| worker_error(&format!("{}: no integer rank `r`", config.display())))
}

/// Loads adapter `name` from `path` (the engine's part, after the API server's checks).
async fn load(sim: &EngineSim, name: &str, path: &str) -> Result<(), Refused> {
    let c = sim.config();
    let (settings, fails, hangs) = sim.with_state(|s| {
        (
            s.adapter_settings.get(name).cloned().unwrap_or_default(),
            s.has_fault(Fault::AdapterLoadFails),
            s.has_fault(Fault::AdapterLoadHangs),
        )
    });
    if hangs || settings.hangs {
        info!(adapter = name, "adapter load hangs (fault)");
        std::future::pending::<()>().await;
    }
    if !c.enable_lora {
        return Err(worker_error(
            "LoRA is not enabled. Use --enable-lora to enable LoRA.",
        ));
    }
    let rank = read_adapter(name, path)?;
    if rank > c.max_lora_rank {
        return Err(worker_error(&format!(
            "LoRA rank {rank} is greater than max_lora_rank {}.",
            c.max_lora_rank
        )));
    }
    tokio::time::sleep(settings.load_time.unwrap_or(c.adapter_load_time)).await;
    if let Some(why) = settings.fails {
        return Err(worker_error(&why));
    }
    if fails {
        return Err(worker_error("engine-sim: fault adapter_load_fails"));
    }
    sim.with_state(|s| {
        let adapter = LoadedAdapter {
            name: name.to_string(),
            path: path.to_string(),
            rank,
            last_used: s.adapter_tick(),
        };
        match s.adapters.iter_mut().find(|a| a.name == name) {
            Some(a) => *a = adapter,
            None => s.adapters.push(adapter),
        }
    });
    info!(adapter = name, path, rank, "adapter loaded");
    Ok(())
}

/// vLLM's plain answer to a load or unload: 200 with no content type.
fn plain(text: String) -> Response {
    let mut r = Response::new(Body::from(text));
    *r.status_mut() = StatusCode::OK;
    r
}

/// `POST /v1/load_lora_adapter` (vLLM).
pub(crate) async fn vllm_load(State(sim): State<Arc<EngineSim>>, body: Bytes) -> Response {
    let req = match fields(&body, &["lora_name", "lora_path"]) {
        Ok(v) => v,
        Err(r) => return *r,
    };
    let (name, path) = (text(&req, "lora_name"), text(&req, "lora_path"));
    let in_place = req.get("load_inplace").and_then(Value::as_bool) == Some(true);
    run(
        Arc::clone(&sim),
        Serial::NameThenEngine(name.clone()),
        async move { vllm_load_locked(&sim, &name, &path, in_place).await },
    )
    .await
}

/// The locks an adapter operation holds.
enum Serial {
    /// The engine's one lock: every load (vLLM's engine core adds one adapter at a time), and
    /// SGLang's unloads (its `lora_update_lock`).
    Engine,
    /// vLLM's load: its name's lock (`lora_resolver_lock`), then the engine's.
    NameThenEngine(String),
    /// vLLM's unload: only its name's lock; vLLM drops the name from its list and answers,
    /// without the engine core, so a load that hangs holds only unloads of its own name.
    Name(String),
}

/// vLLM's locks per adapter name (`OpenAIServingModels.lora_resolver_lock`).
#[derive(Debug, Default)]
pub(crate) struct AdapterNames(std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>);

impl AdapterNames {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<tokio::sync::Mutex<()>>>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Holds the lock of `name` while `op` runs; its entry goes when no other call holds or
    /// waits for it (the map stays as small as the calls in flight).
    async fn hold<T>(&self, name: &str, op: impl std::future::Future<Output = T>) -> T {
        let lock = Arc::clone(self.map().entry(name.to_string()).or_default());
        let done = {
            let _held = lock.lock().await;
            op.await
        };
        let mut map = self.map();
        // Here and in the map: no other call holds or waits for it.
        if Arc::strong_count(&lock) == 2 {
            map.remove(name);
        }
        done
    }
}

/// Runs an adapter operation to its end in a task of its own, under the locks `serial` names:
/// a client that hangs up does not cut a load in half, and a load that hangs holds the next
/// ones, as in the engines.
async fn run(
    sim: Arc<EngineSim>,
    serial: Serial,
    op: impl std::future::Future<Output = Response> + Send + 'static,
) -> Response {
    let task = tokio::spawn(async move {
        match serial {
            Serial::Engine => {
                let _engine = sim.adapter_lock.lock().await;
                op.await
            }
            Serial::NameThenEngine(name) => {
                sim.adapter_names
                    .hold(&name, async {
                        let _engine = sim.adapter_lock.lock().await;
                        op.await
                    })
                    .await
            }
            Serial::Name(name) => sim.adapter_names.hold(&name, op).await,
        }
    });
    task.await.unwrap_or_else(|e| {
        api_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalServerError",
            format!("engine-sim: the adapter operation failed: {e}"),
        )
    })
}

async fn vllm_load_locked(sim: &EngineSim, name: &str, path: &str, in_place: bool) -> Response {
    let (name, path) = (name.to_string(), path.to_string());
    let checked = if name.is_empty() || path.is_empty() {
        Err(invalid_input(
            "Both 'lora_name' and 'lora_path' must be provided.".into(),
        ))
    } else if name == sim.config().served_model_name {
        Err(invalid_input(format!(
            "The lora adapter '{name}' conflicts with a served base model."
        )))
    } else if !in_place && sim.with_state(|s| s.adapter(&name).is_some()) {
        Err(invalid_input(format!(
            "The lora adapter '{name}' has already been loaded. If you want to load the adapter \
             in place, set 'load_inplace' to True."
        )))
    } else {
        Ok(())
    };
    let done = match checked {
        Ok(()) => load(sim, &name, &path).await,
        Err(e) => Err(e),
    };
    match done {
        Ok(()) => plain(format!(
            "Success: LoRA adapter '{name}' added successfully."
        )),
        Err(Refused(status, kind, message)) => api_error(status, kind, message),
    }
}

/// `POST /v1/unload_lora_adapter` (vLLM).
pub(crate) async fn vllm_unload(State(sim): State<Arc<EngineSim>>, body: Bytes) -> Response {
    let req = match fields(&body, &["lora_name"]) {
        Ok(v) => v,
        Err(r) => return *r,
    };
    let name = text(&req, "lora_name");
    run(Arc::clone(&sim), Serial::Name(name.clone()), async move {
        vllm_unload_locked(&sim, &name)
    })
    .await
}

fn vllm_unload_locked(sim: &EngineSim, name: &str) -> Response {
    if name.is_empty() {
        return api_error(
            StatusCode::BAD_REQUEST,
            "InvalidUserInput",
            "'lora_name' needs to be provided to unload a LoRA adapter.",
        );
    }
    if unload(sim, name) {
        plain(format!(
            "Success: LoRA adapter '{name}' removed successfully."
        ))
    } else {
        api_error(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            format!("The lora adapter '{name}' cannot be found."),
        )
    }
}

/// Drops adapter `name`; whether it was loaded.
fn unload(sim: &EngineSim, name: &str) -> bool {
    let gone = sim.with_state(|s| {
        let before = s.adapters.len();
        s.adapters.retain(|a| a.name != name);
        s.adapters.len() < before
    });
    if gone {
        info!(adapter = name, "adapter unloaded");
    }
    gone
}

/// SGLang's answer: `{"success", "error_message", "loaded_adapters": {name: path}}`, 200 or
/// 400.
fn sglang_answer(sim: &EngineSim, error: Option<String>) -> Response {
    let loaded: serde_json::Map<String, Value> = sim.with_state(|s| {
        s.adapters
            .iter()
            .map(|a| (a.name.clone(), json!(a.path)))
            .collect()
    });
    let status = if error.is_none() {
        StatusCode::OK
    } else {
        StatusCode::BAD_REQUEST
    };
    let body = json!({
        "success": error.is_none(),
        "error_message": error,
        "loaded_adapters": loaded,
    });
    (status, Json(body)).into_response()
}

/// `POST /load_lora_adapter` (SGLang).
pub(crate) async fn sglang_load(State(sim): State<Arc<EngineSim>>, body: Bytes) -> Response {
    let req = match fields(&body, &["lora_name", "lora_path"]) {
        Ok(v) => v,
        Err(r) => return *r,
    };
    let (name, path) = (text(&req, "lora_name"), text(&req, "lora_path"));
    run(Arc::clone(&sim), Serial::Engine, async move {
        sglang_load_locked(&sim, &name, &path).await
    })
    .await
}

/// SGLang 0.5.23 (`TokenizerControlMixin.load_lora_adapter`) refuses no load for
/// `--max-loaded-loras`: once one succeeds, it unloads its least recently used adapters (loaded
/// or named by a request longest ago; `_unload_lora_adapter_locked`) until it holds the
/// maximum again, and answers without them. (The simulator pins none and does not wait for
/// the requests running with an evicted adapter, as SGLang's `wait_for_unload` does.)
async fn sglang_load_locked(sim: &EngineSim, name: &str, path: &str) -> Response {
    let error = if sim.with_state(|s| s.adapter(name).is_some()) {
        Some(format!(
            "The LoRA adapter '{name}' is already loaded; unload it first."
        ))
    } else {
        load(sim, name, path)
            .await
            .err()
            .map(|Refused(_, _, message)| message)
    };
    if error.is_none()
        && let Some(max) = sim.config().max_loaded_loras
    {
        while let Some(lru) = sim.with_state(|s| {
            (s.adapters.len() > max)
                .then(|| {
                    s.adapters
                        .iter()
                        .filter(|a| a.name != name)
                        .min_by_key(|a| a.last_used)
                        .map(|a| a.name.clone())
                })
                .flatten()
        }) {
            info!(
                adapter = lru,
                "least recently used adapter unloaded (--max-loaded-loras)"
            );
            unload(sim, &lru);
        }
    }
    sglang_answer(sim, error)
}

/// `POST /unload_lora_adapter` (SGLang).
pub(crate) async fn sglang_unload(State(sim): State<Arc<EngineSim>>, body: Bytes) -> Response {
    let req = match fields(&body, &["lora_name"]) {
        Ok(v) => v,
        Err(r) => return *r,
    };
    let name = text(&req, "lora_name");
    run(Arc::clone(&sim), Serial::Engine, async move {
        let error =
            (!unload(&sim, &name)).then(|| format!("The LoRA adapter '{name}' is not loaded."));
        sglang_answer(&sim, error)
    })
    .await
}

/// Whether the flavour serves adapter routes: vLLM with `VLLM_ALLOW_RUNTIME_LORA_UPDATING`,
/// SGLang always (a load then needs `--enable-lora`), TensorFold never.
pub(crate) fn routes_exist(c: &SimConfig) -> bool {
    match c.flavour {
        Flavour::Vllm => c.vllm_runtime_lora,
        Flavour::Sglang => true,
        Flavour::Tensorfold => false,
    }
}
