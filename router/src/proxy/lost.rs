//! An engine's answer that says it does not have the adapter a request named (DESIGN 4.9): the
//! engine dropped it in a way CapyCTL was not told of. The listener never passes such an
//! answer on: it answers `503 adapter_load_failed`, and the next request loads it again.
//!
//! - vLLM 0.32 answers an adapter it does not serve as any unknown model: `404`, known from the
//!   status alone.
//! - SGLang 0.5.23 answers `400`, as it answers any bad request, so its body tells:
//!   `LoRARegistry.acquire` raises `ValueError("The following requested LoRA adapters are not
//!   loaded: {name}\nLoaded adapters: {odict_keys}.")`, which the OpenAI route's handler
//!   answers with `create_error_response(str(e))`: `{"object":"error","message":...,
//!   "type":"BadRequestError","param":null,"code":400}` with a `Content-Length`.
//!
//!   Asked for a stream, SGLang releases that wrote its streams' errors as events answer
//!   `200` and then that error as the stream's first event (`data: {"object":"error",...}`,
//!   then `data: [DONE]`); later ones raise it before the stream starts (the `400` above).
//!
//! Only a non-streamed 400 of at most [`MAX_READ`] bytes, announced by its `Content-Length`,
//! on a base whose engine reads the adapter from `lora_path` (SGLang), is read before it is
//! passed on; every other answer goes on as it comes, unread. The read is bounded by
//! `stream_idle_timeout` for each silence, as the body's passing on would be. A stream's first
//! event is held back before anything is passed on in any case (`body::start_stream`), and
//! judged there ([`stream_says_not_loaded`]) for such a base.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use capyctl_interfaces::router::AdapterRoute;
use capyctl_spec::errors::ApiError;
use http::StatusCode;
use http_body::Body;
use http_body_util::BodyExt;
use serde::Deserialize;

use super::Failure;
use super::body::Track;
use super::sse::{Data, data_of};
use super::upstream::{EngineHead, UpstreamBody};
use crate::observe;
use capyctl_interfaces::router::{InstanceKey, Lifecycle};

/// The most bytes of an engine's 400 the listener reads to see whether it is SGLang's word
/// that it lacks the adapter (SGLang's is a few hundred bytes with a few adapters loaded).
pub(super) const MAX_READ: u64 = 4096;

/// The start of the message of SGLang 0.5.23's `400` for an adapter it has not loaded,
/// followed by the adapter's name and a newline (`LoRARegistry.acquire`).
const SGLANG_NOT_LOADED: &str = "The following requested LoRA adapters are not loaded: ";

/// Whether the engine's answer to a request for the adapter of `route` has to be read (whole,
/// before anything is passed on) to know whether it says the engine lacks the adapter: a
/// non-streamed 400 of a known length of at most [`MAX_READ`] bytes from an engine that reads
/// the adapter from `lora_path` (SGLang).
pub(super) fn worth_reading(
    route: &AdapterRoute,
    engine: &EngineHead,
    body: &UpstreamBody,
) -> bool {
    reads_in_body(route)
        && engine.status == StatusCode::BAD_REQUEST
        && !engine.event_stream
        && body.size_hint().exact().is_some_and(|n| n <= MAX_READ)
}

/// Whether the base's engine reads the adapter from `lora_path` (SGLang), and so says in its
/// answer's body, not its status, that it lacks it.
pub(super) fn reads_in_body(route: &AdapterRoute) -> bool {
    route.request_field == Some("lora_path")
}

/// The answer to a request for the adapter of `route` whose engine (of `instance`) said it does
/// not have it (`said`): the next request loads it again; this one is cut with `503
/// adapter_load_failed` saying what the engine answered.
pub(super) fn answer(
    lifecycle: &dyn Lifecycle,
    instance: &InstanceKey,
    route: &AdapterRoute,
    said: String,
    charge: &mut dyn Track,
) -> Failure {
    lifecycle.adapter_lost(instance, &route.name);
    let error = ApiError::AdapterLoadFailed {
        adapter: route.name.clone(),
        reason: format!("{said}; the next request loads it again"),
    };
    charge.cut(error.metric_label());
    Failure::Api(error)
}

/// What a stream's first event (`event`, one whole SSE event) says, when it is SGLang's error
/// saying it does not have the adapter `adapter` (see the module's notes). `None`: an event to
/// pass on.
pub(super) fn stream_says_not_loaded(event: &[u8], adapter: &str) -> Option<String> {
    let (Data::One(data) | Data::Several(data)) = data_of(event) else {
        return None;
    };
    let named = not_loaded_in(data)?;
    (named == adapter).then(|| format!("the engine's stream said \"{SGLANG_NOT_LOADED}{named}\""))
}

/// The adapter an SGLang error body (`{"message": ...}`) says is not loaded.
fn not_loaded_in(body: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    struct ErrorBody {
        message: String,
    }
    let ErrorBody { message } = serde_json::from_slice(body).ok()?;
    let named = message.strip_prefix(SGLANG_NOT_LOADED)?;
    Some(
        named
            .split('\n')
            .next()
            .unwrap_or_default()
            .trim()
            .to_string(),
    )
}

/// What the engine's answer `body` (of `status`) says, when it says that the engine does not
/// have the adapter `adapter`: vLLM's 404, SGLang's 400 naming it (see the module's notes).
/// `None`: an answer to pass on.
pub(super) fn says_not_loaded(status: StatusCode, body: &[u8], adapter: &str) -> Option<String> {
    if status == StatusCode::NOT_FOUND {
        return Some("the engine answered as if it were not loaded (404)".to_string());
    }
    if status != StatusCode::BAD_REQUEST {
        return None;
    }
    let named = not_loaded_in(body)?;
    (named == adapter).then(|| format!("the engine answered 400 \"{SGLANG_NOT_LOADED}{named}\""))
}

/// Reads the engine's `body` whole (only called for one of at most [`MAX_READ`] bytes), each
/// silence bounded by `idle`. An engine that breaks off or is silent too long: the error to
/// answer (nothing was passed on yet) and why the request was cut, for the observer.
pub(super) async fn read_whole(
    body: &mut UpstreamBody,
    idle: Duration,
) -> Result<Bytes, (ApiError, &'static str)> {
    let mut read = BytesMut::new();
    loop {
        match tokio::time::timeout(idle, body.frame()).await {
            Ok(None) => return Ok(read.freeze()),
            Ok(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data() {
                    read.extend_from_slice(&data);
                }
            }
            Ok(Some(Err(err))) => {
                return Err((
                    ApiError::UpstreamUnavailable {
                        detail: format!("its answer broke off: {err}"),
                    },
                    observe::UPSTREAM_FAILED,
                ));
            }
            Err(_) => {
                return Err((
                    ApiError::UpstreamUnavailable {
                        detail: format!(
                            "it sent nothing of its answer's body for {} ms (stream_idle_timeout)",
                            idle.as_millis()
                        ),
                    },
                    observe::STREAM_IDLE_TIMEOUT,
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SGLang 0.5.23's body for an adapter it has not loaded, as its handler writes it.
    fn sglang(name: &str) -> String {
        serde_json::json!({
            "object": "error",
            "message": format!("{SGLANG_NOT_LOADED}{name}\nLoaded adapters: odict_keys(['other']).",),
            "type": "BadRequestError",
            "param": null,
            "code": 400,
        })
        .to_string()
    }

    #[test]
    fn sglangs_400_for_this_adapter_says_it_is_not_loaded() {
        let said = says_not_loaded(StatusCode::BAD_REQUEST, sglang("a1").as_bytes(), "a1");
        assert_eq!(
            said.as_deref(),
            Some(
                "the engine answered 400 \"The following requested LoRA adapters are not loaded: a1\""
            )
        );
    }

    #[test]
    fn another_400_or_another_adapter_or_another_status_is_passed_on() {
        let bad = StatusCode::BAD_REQUEST;
        // Another adapter's name, one that only begins the same, or the text not at the start.
        assert_eq!(says_not_loaded(bad, sglang("a10").as_bytes(), "a1"), None);
        assert_eq!(says_not_loaded(bad, sglang("a1").as_bytes(), "a10"), None);
        let elsewhere = serde_json::json!({"message": format!("x {SGLANG_NOT_LOADED}a1")});
        assert_eq!(
            says_not_loaded(bad, elsewhere.to_string().as_bytes(), "a1"),
            None
        );
        // Another 400, a body that is not JSON, the same text under another status.
        let other = br#"{"object":"error","message":"max_tokens must be at least 1","code":400}"#;
        assert_eq!(says_not_loaded(bad, other, "a1"), None);
        assert_eq!(says_not_loaded(bad, b"not loaded: a1", "a1"), None);
        let status = StatusCode::UNPROCESSABLE_ENTITY;
        assert_eq!(says_not_loaded(status, sglang("a1").as_bytes(), "a1"), None);
        // vLLM's 404 whatever its body.
        assert!(says_not_loaded(StatusCode::NOT_FOUND, b"", "a1").is_some());
    }

    /// A stream's first event that is SGLang's error for this adapter says so (with or
    /// without the space after `data:`, with CRLF lines); any other event does not.
    #[test]
    fn a_streams_first_event_says_so_only_when_it_is_sglangs_error_for_this_adapter() {
        let event = format!("data: {}\n\n", sglang("a1"));
        assert_eq!(
            stream_says_not_loaded(event.as_bytes(), "a1").as_deref(),
            Some(
                "the engine's stream said \"The following requested LoRA adapters are not loaded: a1\""
            )
        );
        let crlf = format!("event: error\r\ndata:{}\r\n\r\n", sglang("a1"));
        assert!(stream_says_not_loaded(crlf.as_bytes(), "a1").is_some());
        assert_eq!(stream_says_not_loaded(event.as_bytes(), "a10"), None);
        let chunk = r#"data: {"choices":[{"index":0,"delta":{"content":"The following requested LoRA adapters are not loaded: a1"}}]}"#;
        assert_eq!(
            stream_says_not_loaded(format!("{chunk}\n\n").as_bytes(), "a1"),
            None
        );
        assert_eq!(stream_says_not_loaded(b": keep-alive\n\n", "a1"), None);
        assert_eq!(stream_says_not_loaded(b"data: not json\n\n", "a1"), None);
    }
}
