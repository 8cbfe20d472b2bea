//! The OpenAI-compatible API: chat and text completions (streamed and not), embeddings, models.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::config::{Fault, Flavour};
use crate::engine::{EngineSim, Generation, Refusal, Stop, Token, run_instant};
use crate::text::{TokenLogprobs, count_tokens, embedding};

/// The `max_model_len` vLLM reports without `--max-model-len` (the model's own context).
const VLLM_MODEL_MAX_LEN: u64 = 32768;

/// Default `max_tokens`, as OpenAI's completions API.
const DEFAULT_MAX_TOKENS: u64 = 16;

/// Most top log probabilities a request may ask for (vLLM's default `--max-logprobs`).
const MAX_LOGPROBS: u64 = 20;

/// An error in the engines' OpenAI style: `{"error":{"message","type","param","code"}}`.
pub(crate) fn api_error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    api_error_on(status, kind, message, None)
}

/// [`api_error`] naming the request's field at fault in `param`, as vLLM does
/// (`"param": "max_tokens"`, `"body.messages"`).
pub(crate) fn api_error_on(
    status: StatusCode,
    kind: &str,
    message: impl Into<String>,
    param: Option<&str>,
) -> Response {
    let body = json!({
        "error": {
            "message": message.into(),
            "type": kind,
            "param": param,
            "code": status.as_u16(),
        }
    });
    (status, Json(body)).into_response()
}

/// vLLM's answer to a request FastAPI's validation refuses (a body that is not JSON, a missing
/// required field): 400, type `Bad Request`, the field's location in `param`.
pub(crate) fn validation_error(param: &str, message: impl Into<String>) -> Response {
    api_error_on(
        StatusCode::BAD_REQUEST,
        "Bad Request",
        format!("1 validation error:\n  {}", message.into()),
        Some(param),
    )
}

/// The `system_fingerprint` vLLM puts on an answer: `vllm-<version>-<8 hex>`.
fn system_fingerprint(sim: &EngineSim) -> String {
    format!("vllm-{}-00000000", sim.config().version)
}

fn unavailable(message: impl Into<String>) -> Response {
    api_error(
        StatusCode::SERVICE_UNAVAILABLE,
        "ServiceUnavailableError",
        message,
    )
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        match self {
            Refusal::Starting => unavailable("the engine is starting up and not ready yet"),
            Refusal::Asleep(why) => unavailable(why),
        }
    }
}

fn bad_request(message: impl Into<String>) -> Response {
    api_error(StatusCode::BAD_REQUEST, "BadRequestError", message)
}

/// A request refused for one field (`param` names it).
fn bad_field(param: &str, message: impl Into<String>) -> Response {
    api_error_on(
        StatusCode::BAD_REQUEST,
        "BadRequestError",
        message,
        Some(param),
    )
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// The fields of a completion request the simulator reads; others (temperature…) are ignored.
#[derive(Deserialize)]
struct GenerateRequest {
    model: Option<String>,
    messages: Option<Vec<Value>>,
    prompt: Option<Value>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    /// Chat: `true`/`false`; completions: how many top log probabilities (0 to 20).
    logprobs: Option<Value>,
    /// SGLang: the LoRA adapter (its name) the request runs with.
    lora_path: Option<Value>,
    /// Chat: how many top log probabilities with `logprobs: true` (0 to 20).
    top_logprobs: Option<Value>,
}

/// How many top log probabilities each token carries, `None` when none are asked for.
///
/// Chat: `logprobs: true` with `top_logprobs: N` (default 0: only the token's own); a
/// `top_logprobs` without `logprobs: true` is refused, as vLLM does. Completions:
/// `logprobs: N`, and each token's `top_logprobs` holds N entries (at least the token itself).
fn requested_logprobs(
    kind: Kind,
    req: &GenerateRequest,
) -> Result<Option<usize>, (&'static str, String)> {
    let count = |name: &'static str, v: &Value| -> Result<usize, (&'static str, String)> {
        match v.as_u64() {
            Some(n) if n <= MAX_LOGPROBS => Ok(usize::try_from(n).unwrap_or(0)),
            Some(n) => Err((
                name,
                format!(
                    "`{name}`: requested {n} log probabilities, more than the maximum of \
                     {MAX_LOGPROBS}"
                ),
            )),
            None => Err((
                name,
                format!("`{name}` must be an integer from 0 to {MAX_LOGPROBS}, got {v}"),
            )),
        }
    };
    let logprobs = req.logprobs.as_ref().filter(|v| !v.is_null());
    let top = req.top_logprobs.as_ref().filter(|v| !v.is_null());
    match kind {
        Kind::Chat => {
            let on = match logprobs {
                None => false,
                Some(Value::Bool(b)) => *b,
                Some(other) => {
                    return Err((
                        "logprobs",
                        format!("`logprobs` must be true or false, got {other}"),
                    ));
                }
            };
            match (on, top) {
                (true, Some(t)) => count("top_logprobs", t).map(Some),
                (true, None) => Ok(Some(0)),
                (false, Some(_)) => Err((
                    "top_logprobs",
                    "when using `top_logprobs`, `logprobs` must be set to true".into(),
                )),
                (false, None) => Ok(None),
            }
        }
        Kind::Text => match logprobs {
            None => Ok(None),
            Some(v) => count("logprobs", v).map(|n| Some(n.max(1))),
        },
    }
}

/// The bytes of a token, as OpenAI's chat log probabilities list them.
fn token_bytes(token: &str) -> Value {
    json!(token.as_bytes())
}

/// One token's entry of a chat answer's `logprobs.content`.
fn chat_logprob(text: &str, lp: &TokenLogprobs) -> Value {
    let top: Vec<Value> = lp
        .top
        .iter()
        .map(|(t, l)| json!({"token": t, "logprob": l, "bytes": token_bytes(t)}))
        .collect();
    json!({"token": text, "logprob": lp.logprob, "bytes": token_bytes(text), "top_logprobs": top})
}

/// A completion's `logprobs` for `tokens` (text, log probabilities, offset in the answer).
fn text_logprobs<'a>(tokens: impl Iterator<Item = (&'a str, &'a TokenLogprobs, usize)>) -> Value {
    let (mut texts, mut lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    for (text, lp, offset) in tokens {
        texts.push(json!(text));
        lps.push(json!(lp.logprob));
        let top: serde_json::Map<String, Value> =
            lp.top.iter().map(|(t, l)| (t.clone(), json!(l))).collect();
        tops.push(Value::Object(top));
        offsets.push(json!(offset));
    }
    json!({"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Text,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A request naming another model gets the engine's 404 (`"param": "model"`).
fn check_model(sim: &EngineSim, model: Option<&str>) -> Option<Response> {
    let served = &sim.config().served_model_name;
    match model {
        Some(m) if m != served => Some(api_error_on(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            format!("The model `{m}` does not exist. Valid aliases: {served}."),
            Some("model"),
        )),
        _ => None,
    }
}

/// The LoRA adapter a request runs with, as `(name, directory)`: vLLM takes an adapter's name
/// in `model` (the answer names it; an adapter not loaded is vLLM's 404 for an unknown model,
/// as recorded: "Valid aliases" names the base only). SGLang 0.5.23
/// (`OpenAIServingBase._resolve_lora_path`) does not look `model` up: an adapter named there
/// as `base-model:adapter` ([`sglang_model_adapter`]) wins, else the one in `lora_path`, else
/// the base runs, whatever `model` says; an adapter not loaded: 400. `Ok(None)`: the base
/// model.
fn requested_adapter(
    sim: &EngineSim,
    req: &GenerateRequest,
) -> Result<Option<(String, String)>, Box<Response>> {
    let find = |name: &str| {
        sim.with_state(|s| {
            s.use_adapter(name)
                .map(|a| (a.name.clone(), a.path.clone()))
        })
    };
    match sim.config().flavour {
        Flavour::Vllm => match req.model.as_deref() {
            Some(m) if m != sim.config().served_model_name => match find(m) {
                Some(a) => Ok(Some(a)),
                None => Err(Box::new(
                    check_model(sim, Some(m)).unwrap_or_else(|| bad_request(m)),
                )),
            },
            _ => Ok(None),
        },
        Flavour::Sglang => {
            let from_model = req
                .model
                .as_deref()
                .and_then(|m| sglang_model_adapter(m, &sim.config().served_model_name))
                .map(Value::String);
            match from_model.as_ref().or(req.lora_path.as_ref()) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(name)) => find(name)
                    .map(Some)
                    .ok_or_else(|| Box::new(sglang_not_loaded(sim, name))),
                Some(other) => Err(Box::new(bad_field(
                    "lora_path",
                    format!("one adapter name per request is simulated, not {other}"),
                ))),
            }
        }
        Flavour::Tensorfold => {
            check_model(sim, req.model.as_deref()).map_or(Ok(None), |r| Err(Box::new(r)))
        }
    }
}

/// SGLang 0.5.23's answer to a request for an adapter it has not loaded: the `ValueError` of
/// `LoRARegistry.acquire`, which the OpenAI route answers with `create_error_response`
/// ([`sglang_error`], 400 `BadRequestError`), naming the adapter and those loaded, least
/// recently used first (its registry's `OrderedDict`, shown as Python prints its keys).
fn sglang_not_loaded(sim: &EngineSim, name: &str) -> Response {
    let mut loaded = sim.with_state(|s| {
        s.adapters
            .iter()
            .map(|a| (a.last_used, a.name.clone()))
            .collect::<Vec<_>>()
    });
    loaded.sort();
    let keys: Vec<String> = loaded.iter().map(|(_, n)| python_str(n)).collect();
    sglang_error(
        StatusCode::BAD_REQUEST,
        "BadRequestError",
        format!(
            "The following requested LoRA adapters are not loaded: {name}\nLoaded adapters: odict_keys([{}]).",
            keys.join(", ")
        ),
    )
}

/// A string as Python's `repr` writes it (single quotes unless it holds one and no double).
fn python_str(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::from(quote);
    for c in s.chars() {
        if c == '\\' || c == quote {
            out.push('\\');
        }
        out.push(c);
    }
    out.push(quote);
    out
}

/// SGLang's error answer (`OpenAIServingBase.create_error_response`): the error object at the
/// top, not under `error` as vLLM's: `{"object":"error","message","type","param":null,"code"}`.
pub(crate) fn sglang_error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    let body = json!({
        "object": "error",
        "message": message.into(),
        "type": kind,
        "param": null,
        "code": status.as_u16(),
    });
    (status, Json(body)).into_response()
}

/// The adapter SGLang 0.5.23 reads in a request's `model` (`_parse_model_parameter`): none
/// without a colon or for the served model's own name; else the text after the served name and
/// a colon, or after the first colon, trimmed (none when empty).
fn sglang_model_adapter(model: &str, served: &str) -> Option<String> {
    if !model.contains(':') || model == served {
        return None;
    }
    let adapter = match model
        .strip_prefix(served)
        .and_then(|rest| rest.strip_prefix(':'))
    {
        Some(rest) => rest,
        None => model.split_once(':').map_or("", |(_, adapter)| adapter),
    };
    let adapter = adapter.trim();
    (!adapter.is_empty()).then(|| adapter.to_string())
}

fn content_text(content: &Value) -> Result<String, String> {
    match content {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => Ok(parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(" ")),
        _ => Err("message content must be a string or a list of parts".into()),
    }
}

/// The chat prompt as one text: `role: content` lines.
fn render_chat(messages: &[Value]) -> Result<String, String> {
    if messages.is_empty() {
        return Err("`messages` must not be empty".into());
    }
    let mut out = String::new();
    for m in messages {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or("every message needs a string `role`")?;
        let content = content_text(m.get("content").unwrap_or(&Value::Null))?;
        out.push_str(role);
        out.push_str(": ");
        out.push_str(&content);
        out.push('\n');
    }
    Ok(out)
}

/// The completion prompt: a string, a list of strings (joined) or token ids.
fn render_prompt(prompt: &Value) -> Result<String, String> {
    let item = |v: &Value| -> Result<String, String> {
        match v {
            Value::String(s) => Ok(s.clone()),
            Value::Number(n) => Ok(format!("<{n}>")),
            Value::Array(ids) => Ok(ids.iter().map(|i| format!("<{i}> ")).collect()),
            _ => Err("`prompt` must be a string, a list of strings or token ids".to_owned()),
        }
    };
    match prompt {
        Value::Array(items) => Ok(items
            .iter()
            .map(item)
            .collect::<Result<Vec<_>, _>>()?
            .join("\n")),
        other => item(other),
    }
}

async fn generate(sim: Arc<EngineSim>, body: Bytes, kind: Kind) -> Response {
    let req: GenerateRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) if e.is_syntax() || e.is_eof() => {
            return validation_error(
                &format!("body.{}", e.column()),
                format!(
                    "{{'type': 'json_invalid', 'loc': 'body.{}', 'msg': 'JSON decode error', \
                     'input': '<dict of 0 items>', 'ctx': {{'error': '{e}'}}}}",
                    e.column()
                ),
            );
        }
        Err(e) => return bad_request(format!("invalid body: {e}")),
    };
    if kind == Kind::Chat && req.messages.is_none() {
        return validation_error(
            "body.messages",
            "{'type': 'missing', 'loc': 'body.messages', 'msg': 'Field required'}",
        );
    }
    let adapter = match requested_adapter(&sim, &req) {
        Ok(a) => a,
        Err(r) => return *r,
    };
    let prompt = match kind {
        Kind::Chat => req
            .messages
            .as_deref()
            .ok_or_else(|| "`messages` is required".to_owned())
            .and_then(render_chat),
        Kind::Text => req
            .prompt
            .as_ref()
            .ok_or_else(|| {
                "Either prompt or prompt_embeds must be provided and non-empty.".to_owned()
            })
            .and_then(render_prompt),
    };
    let prompt = match prompt {
        Ok(p) => p,
        Err(e) => {
            let param = if kind == Kind::Chat {
                "messages"
            } else {
                "prompt"
            };
            return bad_field(param, format!("{e} (parameter={param})"));
        }
    };
    let top_logprobs = match requested_logprobs(kind, &req) {
        Ok(n) => n,
        Err((param, e)) => return bad_field(param, format!("{e} (parameter={param})")),
    };
    let max_tokens = req
        .max_completion_tokens
        .or(req.max_tokens)
        .unwrap_or(DEFAULT_MAX_TOKENS);
    if let Some(limit) = sim.config().max_model_len
        && max_tokens > limit
    {
        return bad_field(
            "max_tokens",
            format!(
                "max_tokens={max_tokens} cannot be greater than max_model_len={limit}. Please \
                 request fewer output tokens. (parameter=max_tokens, value={max_tokens})"
            ),
        );
    }
    if let Err(refusal) = sim.check_servable() {
        return refusal.into_response();
    }
    let answer = Answer {
        id: format!(
            "{}-{}",
            if kind == Kind::Chat {
                "chatcmpl"
            } else {
                "cmpl"
            },
            sim.next_id()
        ),
        created: unix_now(),
        model: match (&adapter, sim.config().flavour) {
            (Some((name, _)), Flavour::Vllm) => name.clone(),
            // SGLang echoes the request's `model` (its default: "default").
            (_, Flavour::Sglang) => req.model.clone().unwrap_or_else(|| "default".into()),
            _ => sim.config().served_model_name.clone(),
        },
        kind,
        vllm: (sim.config().flavour == Flavour::Vllm).then(|| system_fingerprint(&sim)),
    };
    let opening = sim.config().flavour == Flavour::Tensorfold
        || sim.with_state(|s| s.has_fault(Fault::RoleChunk));
    let generation = Generation::new(Arc::clone(&sim), prompt, max_tokens, top_logprobs)
        .with_adapter(adapter.map(|(_, path)| path));
    if req.stream.unwrap_or(false) {
        let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
        stream_answer(answer, generation, opening, include_usage)
    } else {
        whole_answer(answer, generation).await
    }
}

/// Fixed parts of one answer's JSON.
struct Answer {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
    /// vLLM's answers: its `system_fingerprint`, and the fields it always writes (`null` where
    /// the simulator has nothing to say: `stop_reason`, `token_ids`, `kv_transfer_params`…).
    vllm: Option<String>,
}

impl Answer {
    fn usage(&self, g: &Generation) -> Value {
        let mut usage = json!({
            "prompt_tokens": g.prompt_tokens,
            "completion_tokens": g.produced,
            "total_tokens": g.prompt_tokens + g.produced,
        });
        if self.vllm.is_some() {
            usage["prompt_tokens_details"] = Value::Null;
            usage["completion_tokens_details"] = Value::Null;
        }
        usage
    }

    fn chunk(&self, choice: Value) -> Bytes {
        self.chunk_with(choice, false)
    }

    /// A chunk; `last` puts vLLM's `system_fingerprint` on it (the stream's last chunk).
    fn chunk_with(&self, choice: Value, last: bool) -> Bytes {
        let object = match self.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Text => "text_completion",
        };
        let choices = if choice.is_null() {
            json!([])
        } else {
            json!([choice])
        };
        let mut chunk = json!({
            "id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": choices,
        });
        if let (Some(fingerprint), true) = (&self.vllm, last) {
            chunk["system_fingerprint"] = json!(fingerprint);
        }
        sse(&chunk)
    }

    /// vLLM's chat stream opens with the role and an empty content, sent with the first token.
    fn vllm_role_chunk(&self) -> Bytes {
        let object = "chat.completion.chunk";
        sse(&json!({
            "id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": [{
                "index": 0, "delta": {"role": "assistant", "content": ""},
                "logprobs": null, "finish_reason": null,
            }],
            "prompt_token_ids": null, "prompt_text": null,
        }))
    }

    /// A chunk carrying `text`; `role` adds the assistant role (chat's first chunk).
    fn text_chunk(&self, text: &str, role: bool, finish: Option<&str>) -> Bytes {
        self.chunk(self.text_choice(text, role, finish, Value::Null))
    }

    /// The chunk of one token, with its log probabilities when asked for; `offset` is where
    /// the token starts in the answer's text. `finish` ends the answer with it (vLLM sends the
    /// finish reason with the last token; `last` also ends the stream's chunks).
    fn token_chunk(
        &self,
        token: &Token,
        role: bool,
        offset: usize,
        finish: Option<&str>,
        last: bool,
    ) -> Bytes {
        let logprobs = match (&token.logprobs, self.kind) {
            (None, _) => Value::Null,
            (Some(lp), Kind::Chat) => json!({"content": [chat_logprob(&token.text, lp)]}),
            (Some(lp), Kind::Text) => text_logprobs(std::iter::once((&*token.text, lp, offset))),
        };
        self.chunk_with(self.text_choice(&token.text, role, finish, logprobs), last)
    }

    fn text_choice(&self, text: &str, role: bool, finish: Option<&str>, logprobs: Value) -> Value {
        let mut choice = match self.kind {
            Kind::Chat => {
                let mut delta = json!({});
                if role {
                    delta["role"] = json!("assistant");
                }
                if !text.is_empty() || finish.is_none() {
                    delta["content"] = json!(text);
                }
                json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
            Kind::Text => {
                json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish})
            }
        };
        if self.vllm.is_some() {
            choice["token_ids"] = Value::Null;
            if self.kind == Kind::Text || finish.is_some() {
                choice["stop_reason"] = Value::Null;
            }
            if self.kind == Kind::Text {
                choice["prompt_token_ids"] = Value::Null;
            }
        }
        choice
    }

    /// The opening chunk that only names the role (TensorFold; `role_chunk` fault).
    fn opening_chunk(&self) -> Bytes {
        match self.kind {
            Kind::Chat => self.chunk(json!({
                "index": 0, "delta": {"role": "assistant"}, "logprobs": null, "finish_reason": null,
            })),
            Kind::Text => self.text_chunk("", false, None),
        }
    }

    fn usage_chunk(&self, g: &Generation) -> Bytes {
        let object = match self.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Text => "text_completion",
        };
        // A stream's usage has no `*_details` (vLLM leaves them out there).
        let mut usage = self.usage(g);
        if let Some(u) = usage.as_object_mut() {
            u.retain(|k, _| !k.ends_with("_details"));
        }
        let mut chunk = json!({
            "id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": [], "usage": usage,
        });
        if let Some(fingerprint) = &self.vllm {
            chunk["system_fingerprint"] = json!(fingerprint);
        }
        sse(&chunk)
    }
}

fn sse(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

async fn whole_answer(answer: Answer, mut g: Generation) -> Response {
    if let Err(stop) = g.start().await {
        return unavailable(stop.message());
    }
    let mut text = String::new();
    // (token, log probabilities, offset in `text` in characters), when asked for.
    let mut logprobs: Vec<(String, TokenLogprobs, usize)> = Vec::new();
    let mut chars = 0;
    loop {
        match g.next_token().await {
            Ok(Some(t)) => {
                if let Some(lp) = t.logprobs {
                    logprobs.push((t.text.clone(), lp, chars));
                }
                chars += t.text.chars().count();
                text.push_str(&t.text);
            }
            Ok(None) => break,
            Err(stop) => return unavailable(stop.message()),
        }
    }
    g.complete();
    let asked = g.logprobs_asked();
    let choice = match answer.kind {
        Kind::Chat => {
            let lp = if asked {
                let content: Vec<Value> = logprobs
                    .iter()
                    .map(|(t, lp, _)| chat_logprob(t, lp))
                    .collect();
                json!({ "content": content })
            } else {
                Value::Null
            };
            json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": lp,
                "finish_reason": "length",
            })
        }
        Kind::Text => {
            let lp = if asked {
                text_logprobs(logprobs.iter().map(|(t, lp, o)| (t.as_str(), lp, *o)))
            } else {
                Value::Null
            };
            json!({"index": 0, "text": text, "logprobs": lp, "finish_reason": "length"})
        }
    };
    let object = match answer.kind {
        Kind::Chat => "chat.completion",
        Kind::Text => "text_completion",
    };
    let mut choice = choice;
    let mut whole = json!({
        "id": answer.id, "object": object, "created": answer.created, "model": answer.model,
        "usage": answer.usage(&g),
    });
    if let Some(fingerprint) = &answer.vllm {
        for key in ["routed_experts", "stop_reason", "token_ids"] {
            choice[key] = Value::Null;
        }
        for key in [
            "ec_transfer_params",
            "kv_transfer_params",
            "metrics",
            "service_tier",
        ] {
            whole[key] = Value::Null;
        }
        whole["system_fingerprint"] = json!(fingerprint);
        match answer.kind {
            Kind::Chat => {
                for key in [
                    "annotations",
                    "audio",
                    "function_call",
                    "reasoning",
                    "refusal",
                ] {
                    choice["message"][key] = Value::Null;
                }
                for key in ["prompt_logprobs", "prompt_text", "prompt_token_ids"] {
                    whole[key] = Value::Null;
                }
            }
            Kind::Text => {
                choice["prompt_logprobs"] = Value::Null;
                choice["prompt_token_ids"] = Value::Null;
            }
        }
    }
    whole["choices"] = json!([choice]);
    Json(whole).into_response()
}

enum Phase {
    Opening,
    Start,
    Tokens,
    Finish,
    Usage,
    Done,
    End,
}

struct Streaming {
    answer: Answer,
    g: Generation,
    phase: Phase,
    opening: bool,
    include_usage: bool,
    /// Characters of the answer streamed so far (completions' `text_offset`).
    offset: usize,
}

/// An SSE stream. It owns the [`Generation`], so when hyper drops the body (the client went
/// away), the request's ticket is dropped with it and the request is aborted.
fn stream_answer(answer: Answer, g: Generation, opening: bool, include_usage: bool) -> Response {
    let start = Streaming {
        answer,
        g,
        phase: Phase::Opening,
        opening,
        include_usage,
        offset: 0,
    };
    let chunks = stream::unfold(start, |mut st| async move {
        loop {
            let chunk = match st.phase {
                Phase::Opening => {
                    st.phase = Phase::Start;
                    if !st.opening {
                        continue;
                    }
                    st.answer.opening_chunk()
                }
                Phase::Start => match st.g.start().await {
                    Ok(()) => {
                        st.phase = Phase::Tokens;
                        continue;
                    }
                    Err(stop) => stop_chunk(&mut st, &stop),
                },
                Phase::Tokens => match st.g.next_token().await {
                    Ok(Some(t)) if st.answer.vllm.is_some() => {
                        // vLLM: the role chunk with the first token, the finish reason with
                        // the last, the fingerprint on the stream's last chunk.
                        let first = st.g.produced == 1;
                        let finish = st.g.exhausted().then_some("length");
                        if finish.is_some() {
                            st.phase = if st.include_usage {
                                Phase::Usage
                            } else {
                                Phase::Done
                            };
                        }
                        let last = finish.is_some() && !st.include_usage;
                        let mut chunk = Vec::new();
                        if first && st.answer.kind == Kind::Chat && !st.opening {
                            chunk.extend_from_slice(&st.answer.vllm_role_chunk());
                        }
                        chunk.extend_from_slice(
                            &st.answer.token_chunk(&t, false, st.offset, finish, last),
                        );
                        st.offset += t.text.chars().count();
                        Bytes::from(chunk)
                    }
                    Ok(Some(t)) => {
                        let role =
                            st.answer.kind == Kind::Chat && !st.opening && st.g.produced == 1;
                        let chunk = st.answer.token_chunk(&t, role, st.offset, None, false);
                        st.offset += t.text.chars().count();
                        chunk
                    }
                    Ok(None) => {
                        st.phase = Phase::Finish;
                        continue;
                    }
                    Err(stop) => stop_chunk(&mut st, &stop),
                },
                Phase::Finish => {
                    st.phase = if st.include_usage {
                        Phase::Usage
                    } else {
                        Phase::Done
                    };
                    st.answer.text_chunk("", false, Some("length"))
                }
                Phase::Usage => {
                    st.phase = Phase::Done;
                    st.answer.usage_chunk(&st.g)
                }
                Phase::Done => {
                    st.g.complete();
                    st.phase = Phase::End;
                    Bytes::from_static(b"data: [DONE]\n\n")
                }
                Phase::End => return None,
            };
            return Some((Ok::<_, Infallible>(chunk), st));
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(chunks))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// The error event of a stream cut short, then `[DONE]` (as vLLM does).
fn stop_chunk(st: &mut Streaming, stop: &Stop) -> Bytes {
    st.phase = Phase::End;
    let error = sse(&json!({
        "error": {"message": stop.message(), "type": "ServiceUnavailableError", "param": null, "code": 503}
    }));
    let mut out = error.to_vec();
    out.extend_from_slice(b"data: [DONE]\n\n");
    Bytes::from(out)
}

/// `POST /v1/chat/completions`.
pub(crate) async fn chat_completions(State(sim): State<Arc<EngineSim>>, body: Bytes) -> Response {
    generate(sim, body, Kind::Chat).await
}

/// `POST /v1/completions`.
pub(crate) async fn completions(State(sim): State<Arc<EngineSim>>, body: Bytes) -> Response {
    generate(sim, body, Kind::Text).await
}

#[derive(Deserialize)]
struct EmbeddingRequest {
    model: Option<String>,
    input: Value,
}

/// `POST /v1/embeddings`: one deterministic unit vector per input.
pub(crate) async fn embeddings(State(sim): State<Arc<EngineSim>>, body: Bytes) -> Response {
    let req: EmbeddingRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return bad_request(format!("invalid JSON body: {e}")),
    };
    if let Some(r) = check_model(&sim, req.model.as_deref()) {
        return r;
    }
    let inputs: Vec<String> = match &req.input {
        Value::String(s) => vec![s.clone()],
        Value::Array(items) if items.iter().all(Value::is_string) => items
            .iter()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect(),
        Value::Array(items) if items.iter().all(Value::is_number) => vec![req.input.to_string()],
        Value::Array(items) if items.iter().all(Value::is_array) => {
            items.iter().map(Value::to_string).collect()
        }
        _ => return bad_request("`input` must be a string, a list of strings or token ids"),
    };
    if inputs.is_empty() {
        return bad_request("`input` must not be empty");
    }
    if let Err(refusal) = sim.check_servable() {
        return refusal.into_response();
    }
    let tokens: u64 = inputs.iter().map(|i| count_tokens(i)).sum();
    let (model, salt) = match run_instant(Arc::clone(&sim), tokens).await {
        Ok(found) => found,
        Err(stop) => return unavailable(stop.message()),
    };
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, input)| {
            json!({"object": "embedding", "index": i, "embedding": embedding(&model, &salt, input)})
        })
        .collect();
    Json(json!({
        "object": "list",
        "data": data,
        "model": sim.config().served_model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
    .into_response()
}

/// `GET /v1/models`: the served model, then the LoRA adapters loaded.
pub(crate) async fn models(State(sim): State<Arc<EngineSim>>) -> Response {
    let c = sim.config();
    let created = unix_now();
    let mut card = json!({
        "id": c.served_model_name,
        "object": "model",
        "created": created,
        "owned_by": c.flavour.name(),
        "root": c.model,
        "parent": null,
    });
    match c.flavour {
        Flavour::Vllm => {
            card["max_model_len"] = json!(c.max_model_len.unwrap_or(VLLM_MODEL_MAX_LEN));
            card["permission"] = permission(&sim, created);
        }
        Flavour::Sglang | Flavour::Tensorfold => {
            card["max_running_requests"] = json!(c.max_running);
        }
    }
    let mut data = vec![card];
    let adapters = sim.with_state(|s| s.adapters.clone());
    for a in adapters {
        // As the engines list a loaded adapter: its directory as `root`, the base as
        // `parent`, no `max_model_len` of its own.
        let mut card = json!({
            "id": a.name,
            "object": "model",
            "created": created,
            "owned_by": c.flavour.name(),
            "root": a.path,
            "parent": c.served_model_name,
            "max_model_len": null,
        });
        if c.flavour == Flavour::Vllm {
            card["permission"] = permission(&sim, created);
        }
        data.push(card);
    }
    Json(json!({"object": "list", "data": data})).into_response()
}

/// vLLM's `permission` list of a model card.
fn permission(sim: &EngineSim, created: u64) -> Value {
    json!([{
        "id": format!("modelperm-{}", sim.next_id()),
        "object": "model_permission",
        "created": created,
        "allow_create_engine": false,
        "allow_sampling": true,
        "allow_logprobs": true,
        "allow_search_indices": false,
        "allow_view": true,
        "allow_fine_tuning": false,
        "organization": "*",
        "group": null,
        "is_blocking": false,
    }])
}
