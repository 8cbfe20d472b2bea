//! The error catalogue: every error a client or an operator can get from CapyCTL, as typed values.
//!
//! Each variant renders the exact status, `code`, `message` and `retryable` of the product page
//! ("Errors while waiting", "Only on your command") or, where the page names a code without a
//! message, the message CapyCTL chose (see the variant's doc). The JSON body is always
//! `{"code": ..., "message": ..., "retryable": ...}`; every 429 also carries `Retry-After: 1`
//! (a tenant's `rate_limited`: the seconds until it would be admitted).
//!
//! `<deployment id>` in the messages is the deployment's ID (a ULID), not its name.

use std::fmt;

/// The seconds every 429 tells the client to wait (`Retry-After: 1`).
pub const RETRY_AFTER_SECONDS: u32 = 1;

/// Why a wake failed its check; each stops the instance, and the next request loads it fresh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WakeFailure {
    /// The answer to the check prompt (or the fixed decision) differs from the first answer.
    Mismatch,
    /// The engine failed to reload its weights.
    ReloadFailed,
    /// The wake did not finish within the wake window (`server.switching.wake_timeout`).
    Uncertain,
}

impl WakeFailure {
    /// The error code (`wake_mismatch`, `wake_reload_failed`, `wake_uncertain`).
    pub fn code(self) -> &'static str {
        match self {
            WakeFailure::Mismatch => "wake_mismatch",
            WakeFailure::ReloadFailed => "wake_reload_failed",
            WakeFailure::Uncertain => "wake_uncertain",
        }
    }

    fn what(self) -> &'static str {
        match self {
            WakeFailure::Mismatch => {
                "its answer to the check prompt differs from its first answer, so its weights did not come back intact"
            }
            WakeFailure::ReloadFailed => "the engine failed to reload its weights",
            WakeFailure::Uncertain => "the wake did not finish within the wake window",
        }
    }
}

/// An error CapyCTL answers with. Construct it, then render it with [`ApiError::status`] and
/// [`ApiError::body`] (or [`ApiError::to_json`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApiError {
    /// 503: the request waited the whole request deadline.
    QueueDeadline {
        /// The deployment's ID.
        deployment: String,
    },
    /// 503: the loaded model did not finish its running requests within the drain bound.
    DrainTimeout {
        /// The ID of the deployment the switch was for.
        deployment: String,
        /// The drain bound in milliseconds.
        drain_ms: u64,
        /// Requests still charged to the victims when the bound passed.
        charged: usize,
    },
    /// 503: the model is finishing its work before it parks.
    DispatchClosed {
        /// The deployment's ID.
        deployment: String,
    },
    /// 429: a waiting-request limit (per deployment or in total) is reached.
    TooManyWaiting {
        /// The deployment's ID.
        deployment: String,
    },
    /// 429: the waiting bodies would pass the byte limit.
    BufferedBytes,
    /// 429: 32 requests kept running for the whole request deadline.
    InFlightDeadline {
        /// The deployment's ID.
        deployment: String,
    },
    /// 429: 32 requests are running and the waiting limit per model is 0.
    InFlightNoWait {
        /// The deployment's ID.
        deployment: String,
    },
    /// 429: the model is parked, stopped or switching and the waiting limit per model is 0.
    NotServableNoWait {
        /// The deployment's ID.
        deployment: String,
    },
    /// 409 `deployment_stopped`: an operator stopped the deployment; a request does not start it.
    DeploymentStopped {
        /// The deployment's ID.
        deployment: String,
    },
    /// 409 `deployment_inactive`: the deployment is not running and its activation is explicit.
    DeploymentInactive {
        /// The deployment's ID.
        deployment: String,
    },
    /// 409 `capability_missing:deep_park`: the engine cannot wake this model correctly.
    CapabilityMissingDeepPark {
        /// The deployment's ID (or name, before it has one).
        deployment: String,
        /// Why, from the refusals table (e.g. "gpt-oss on vLLM").
        reason: String,
    },
    /// 409 `parked_capacity`: a park needs room in the parked set that only explicit
    /// deployments hold; the deployment serves again.
    ParkedCapacity {
        /// The deployment that was to park.
        deployment: String,
    },
    /// 503 `wake_mismatch` / `wake_reload_failed` / `wake_uncertain`: a wake failed its check;
    /// the instance was stopped and the next request loads it fresh.
    WakeFailed {
        /// The deployment's ID.
        deployment: String,
        /// What went wrong.
        failure: WakeFailure,
    },
    /// 404 `model_not_found`: no deployment serves the requested model name.
    ModelNotFound {
        /// The `model` the request named.
        model: String,
    },
    /// 400 `invalid_request`: the request is malformed (not JSON, no `model`, ...).
    InvalidRequest {
        /// What is wrong, and where.
        detail: String,
    },
    /// 404 `not_found`: a management route names something that does not exist.
    NotFound {
        /// What was looked for, e.g. `deployment 01K...`.
        what: String,
    },
    /// 413 `request_too_large`: the body is larger than the buffered-bytes bound.
    RequestTooLarge {
        /// The bound in bytes.
        limit: u64,
    },
    /// 414 `uri_too_long`: the request target (path and query) is longer than the listener
    /// reads (RFC 9112 3).
    UriTooLong {
        /// The bound in bytes.
        limit: usize,
    },
    /// 501 `not_implemented`: the request asks for something the listener does not implement,
    /// e.g. a transfer coding other than chunked (RFC 9112 6.1).
    NotImplemented {
        /// What is asked for, as a phrase (e.g. `the transfer coding gzip`).
        what: String,
    },
    /// 401 `unauthorized`: the management API needs `Authorization: Bearer <admin token>`.
    Unauthorized,
    /// 401 `unauthorized`: with tenants configured, the inference API needs `Authorization:
    /// Bearer <key>` with a tenant's key (the same answer for a missing, malformed or unknown
    /// key).
    KeyRequired,
    /// 429 `rate_limited`: a tenant passed its rate (`requests_per_minute` or
    /// `tokens_per_minute`); `Retry-After` is the seconds until it would be admitted.
    RateLimited {
        /// The tenant's name.
        tenant: String,
        /// `requests` or `tokens`.
        what: &'static str,
        /// Its rate per minute.
        limit: u64,
        /// Seconds until a request would be admitted (at least 1).
        retry_after: u32,
    },
    /// 409 `awaiting_measurement`: a start without `--wait` of a checkpoint not measured yet.
    AwaitingMeasurement {
        /// The deployment's ID.
        deployment: String,
    },
    /// 409 `does_not_fit`: the deployment needs more GPU memory than any host has, even empty.
    DoesNotFit {
        /// The deployment's ID.
        deployment: String,
        /// What it needs and what there is.
        detail: String,
    },
    /// 409 `conflict`: the command does not apply to the deployment in its state now.
    Conflict {
        /// What is in the way, as a sentence.
        detail: String,
    },
    /// 503 `engine_failed`: the engine did not start (or exited); the next request or start
    /// tries again.
    EngineFailed {
        /// The deployment's ID.
        deployment: String,
        /// What the host agent reported.
        detail: String,
    },
    /// 502 `upstream_unavailable`: the engine failed while answering a forwarded request.
    UpstreamUnavailable {
        /// What the connection to the engine reported.
        detail: String,
    },
    /// 503 `unavailable` (the page's code for "not now, retry shortly") with CapyCTL's own
    /// words and a `Retry-After`: on Kubernetes, a leader that cannot reach the API server
    /// serves its ready models but switches nothing (hold-over), and a new leader does not
    /// park or stop what it adopted from one that may still serve it (fence).
    Unavailable {
        /// Why, as a sentence.
        detail: String,
        /// The `Retry-After` seconds.
        retry_after: u32,
    },
    /// 503 `adapter_load_failed`: the base's engine did not load the LoRA adapter a request
    /// named (DESIGN 4.9); nothing else changed (the base serves its other adapters).
    AdapterLoadFailed {
        /// The adapter's name.
        adapter: String,
        /// The engine's (or the host agent's) reason.
        reason: String,
    },
    /// 500 `internal`: CapyCTL itself failed (e.g. it could not write its state file).
    Internal {
        /// What failed.
        detail: String,
    },
}

impl ApiError {
    /// The HTTP status code.
    pub fn status(&self) -> u16 {
        match self {
            ApiError::QueueDeadline { .. }
            | ApiError::DrainTimeout { .. }
            | ApiError::DispatchClosed { .. }
            | ApiError::WakeFailed { .. }
            | ApiError::Unavailable { .. }
            | ApiError::AdapterLoadFailed { .. }
            | ApiError::EngineFailed { .. } => 503,
            ApiError::TooManyWaiting { .. }
            | ApiError::BufferedBytes
            | ApiError::InFlightDeadline { .. }
            | ApiError::InFlightNoWait { .. }
            | ApiError::NotServableNoWait { .. }
            | ApiError::RateLimited { .. } => 429,
            ApiError::DeploymentStopped { .. }
            | ApiError::DeploymentInactive { .. }
            | ApiError::CapabilityMissingDeepPark { .. }
            | ApiError::ParkedCapacity { .. }
            | ApiError::AwaitingMeasurement { .. }
            | ApiError::DoesNotFit { .. }
            | ApiError::Conflict { .. } => 409,
            ApiError::UpstreamUnavailable { .. } => 502,
            ApiError::Internal { .. } => 500,
            ApiError::ModelNotFound { .. } | ApiError::NotFound { .. } => 404,
            ApiError::InvalidRequest { .. } => 400,
            ApiError::RequestTooLarge { .. } => 413,
            ApiError::UriTooLong { .. } => 414,
            ApiError::NotImplemented { .. } => 501,
            ApiError::Unauthorized | ApiError::KeyRequired => 401,
        }
    }

    /// The error code of the JSON body.
    pub fn code(&self) -> &'static str {
        match self {
            ApiError::QueueDeadline { .. }
            | ApiError::DrainTimeout { .. }
            | ApiError::DispatchClosed { .. }
            | ApiError::Unavailable { .. } => "unavailable",
            ApiError::TooManyWaiting { .. }
            | ApiError::BufferedBytes
            | ApiError::InFlightDeadline { .. }
            | ApiError::InFlightNoWait { .. }
            | ApiError::NotServableNoWait { .. } => "queue_full",
            ApiError::DeploymentStopped { .. } => "deployment_stopped",
            ApiError::DeploymentInactive { .. } => "deployment_inactive",
            ApiError::CapabilityMissingDeepPark { .. } => "capability_missing:deep_park",
            ApiError::ParkedCapacity { .. } => "parked_capacity",
            ApiError::WakeFailed { failure, .. } => failure.code(),
            ApiError::ModelNotFound { .. } => "model_not_found",
            ApiError::InvalidRequest { .. } => "invalid_request",
            ApiError::NotFound { .. } => "not_found",
            ApiError::RequestTooLarge { .. } => "request_too_large",
            ApiError::UriTooLong { .. } => "uri_too_long",
            ApiError::NotImplemented { .. } => "not_implemented",
            ApiError::Unauthorized | ApiError::KeyRequired => "unauthorized",
            ApiError::RateLimited { .. } => "rate_limited",
            ApiError::AwaitingMeasurement { .. } => "awaiting_measurement",
            ApiError::DoesNotFit { .. } => "does_not_fit",
            ApiError::Conflict { .. } => "conflict",
            ApiError::EngineFailed { .. } => "engine_failed",
            ApiError::UpstreamUnavailable { .. } => "upstream_unavailable",
            ApiError::AdapterLoadFailed { .. } => "adapter_load_failed",
            ApiError::Internal { .. } => "internal",
        }
    }

    /// Whether a retry may succeed: true for every 503, 502 and 429, false otherwise.
    pub fn retryable(&self) -> bool {
        matches!(self.status(), 503 | 502 | 429)
    }

    /// The `Retry-After` header's seconds: 1 on every 429 but a tenant's rate, the
    /// hold-over's or fence's own on [`ApiError::Unavailable`], the seconds until admitted on
    /// [`ApiError::RateLimited`], none otherwise.
    pub fn retry_after(&self) -> Option<u32> {
        if let ApiError::Unavailable { retry_after, .. }
        | ApiError::RateLimited { retry_after, .. } = self
        {
            return Some(*retry_after);
        }
        (self.status() == 429).then_some(RETRY_AFTER_SECONDS)
    }

    /// The human message, exactly as the product page writes it where it writes one.
    pub fn message(&self) -> String {
        match self {
            ApiError::QueueDeadline { deployment } => format!(
                "deployment {deployment} did not become servable within the queue deadline; retry shortly"
            ),
            ApiError::DrainTimeout {
                deployment,
                drain_ms,
                charged,
            } => format!(
                "switch to {deployment} failed: drain timeout after {drain_ms} ms with {charged} request(s) still charged; the victims serve again; retry shortly"
            ),
            ApiError::DispatchClosed { deployment } => {
                format!("dispatch to deployment {deployment} is closed; retry shortly")
            }
            ApiError::TooManyWaiting { deployment } => {
                format!("too many requests are waiting for deployment {deployment}")
            }
            ApiError::BufferedBytes => {
                "waiting requests exceed the buffered-bytes bound".to_string()
            }
            ApiError::InFlightDeadline { deployment } => format!(
                "deployment {deployment} stayed at its in-flight bound for the queue deadline"
            ),
            ApiError::InFlightNoWait { deployment } => format!(
                "deployment {deployment} is at its in-flight bound and lets no request wait; retry shortly"
            ),
            ApiError::NotServableNoWait { deployment } => format!(
                "deployment {deployment} is not servable now and lets no request wait; retry shortly"
            ),
            ApiError::DeploymentStopped { deployment } => format!(
                "deployment {deployment} was stopped by an operator; inference does not start it; start it with `capyctl start deployment {deployment}`"
            ),
            ApiError::DeploymentInactive { deployment } => format!(
                "deployment {deployment} is not running and its activation is explicit (lifecycle.activation: explicit); inference does not start or wake it; start it with `capyctl start deployment {deployment}`"
            ),
            ApiError::CapabilityMissingDeepPark { deployment, reason } => format!(
                "deployment {deployment} cannot be parked: {reason}; declare residency: restart_only"
            ),
            ApiError::ParkedCapacity { deployment } => format!(
                "no room to keep deployment {deployment} parked: the parked models that hold the room are explicit or of a higher priority, and are never stopped to make it; deployment {deployment} serves again"
            ),
            ApiError::WakeFailed {
                deployment,
                failure,
            } => format!(
                "wake of deployment {deployment} failed ({}): {}; the instance was stopped and the next request loads it fresh; retry shortly",
                failure.code(),
                failure.what()
            ),
            ApiError::ModelNotFound { model } => {
                format!("model {model} is not deployed")
            }
            ApiError::InvalidRequest { detail } => detail.clone(),
            ApiError::NotFound { what } => format!("{what} not found"),
            ApiError::RequestTooLarge { limit } => {
                format!("request body exceeds the buffered-bytes bound of {limit} bytes")
            }
            ApiError::UriTooLong { limit } => {
                format!("the request target is longer than {limit} bytes")
            }
            ApiError::NotImplemented { what } => format!("{what} is not implemented"),
            ApiError::Unauthorized => {
                "the management API needs `Authorization: Bearer <admin token>`".to_string()
            }
            ApiError::KeyRequired => {
                "the inference API needs `Authorization: Bearer <API key>` with a valid key"
                    .to_string()
            }
            ApiError::RateLimited {
                tenant,
                what,
                limit,
                retry_after,
            } => format!(
                "tenant {tenant} passed its rate of {limit} {what} per minute; retry in {retry_after} s"
            ),
            ApiError::AwaitingMeasurement { deployment } => format!(
                "deployment {deployment} is awaiting the measurement of its checkpoint; start it with `capyctl start deployment {deployment} --wait`"
            ),
            ApiError::DoesNotFit { deployment, detail } => {
                format!("deployment {deployment} does not fit on any GPU: {detail}")
            }
            ApiError::Conflict { detail } => detail.clone(),
            ApiError::EngineFailed { deployment, detail } => format!(
                "the engine of deployment {deployment} failed: {detail}; the next request or start tries again; retry shortly"
            ),
            ApiError::UpstreamUnavailable { detail } => {
                format!("the engine could not answer: {detail}")
            }
            ApiError::Unavailable { detail, .. } => detail.clone(),
            ApiError::AdapterLoadFailed { adapter, reason } => format!(
                "adapter {adapter} could not be loaded into its base: {reason}; retry shortly"
            ),
            ApiError::Internal { detail } => format!("internal error: {detail}"),
        }
    }

    /// The JSON body: `{"code", "message", "retryable"}`.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "code": self.code(),
            "message": self.message(),
            "retryable": self.retryable(),
        })
    }

    /// The JSON body as text, ready to send.
    pub fn to_json(&self) -> String {
        self.body().to_string()
    }

    /// A short, stable label for metrics and event reasons (the code, with `:` as `_`).
    pub fn metric_label(&self) -> &'static str {
        match self {
            ApiError::QueueDeadline { .. } => "queue_deadline",
            ApiError::DrainTimeout { .. } => "drain_timeout",
            ApiError::DispatchClosed { .. } => "dispatch_closed",
            ApiError::TooManyWaiting { .. } => "too_many_waiting",
            ApiError::BufferedBytes => "buffered_bytes",
            ApiError::InFlightDeadline { .. } => "in_flight_deadline",
            ApiError::InFlightNoWait { .. } => "in_flight_no_wait",
            ApiError::NotServableNoWait { .. } => "not_servable_no_wait",
            ApiError::DeploymentStopped { .. } => "deployment_stopped",
            ApiError::DeploymentInactive { .. } => "deployment_inactive",
            ApiError::CapabilityMissingDeepPark { .. } => "capability_missing_deep_park",
            ApiError::ParkedCapacity { .. } => "parked_capacity",
            ApiError::WakeFailed { failure, .. } => failure.code(),
            ApiError::ModelNotFound { .. } => "model_not_found",
            ApiError::InvalidRequest { .. } => "invalid_request",
            ApiError::NotFound { .. } => "not_found",
            ApiError::RequestTooLarge { .. } => "request_too_large",
            ApiError::UriTooLong { .. } => "uri_too_long",
            ApiError::NotImplemented { .. } => "not_implemented",
            ApiError::Unauthorized | ApiError::KeyRequired => "unauthorized",
            ApiError::RateLimited { .. } => "rate_limited",
            ApiError::AwaitingMeasurement { .. } => "awaiting_measurement",
            ApiError::DoesNotFit { .. } => "does_not_fit",
            ApiError::Conflict { .. } => "conflict",
            ApiError::EngineFailed { .. } => "engine_failed",
            ApiError::UpstreamUnavailable { .. } => "upstream_unavailable",
            ApiError::Unavailable { .. } => "unavailable",
            ApiError::AdapterLoadFailed { .. } => "adapter_load_failed",
            ApiError::Internal { .. } => "internal",
        }
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: {}", self.status(), self.code(), self.message())
    }
}

impl std::error::Error for ApiError {}

#[cfg(test)]
mod tests {
    //! One test per message, each compared to the product page's text (where it has one).
    #![allow(clippy::unwrap_used)]

    use super::*;

    const ID: &str = "01M3R7A6YJW402N962HH17A66W";

    fn id() -> String {
        ID.to_string()
    }

    /// Checks status, code, retryable, message and the rendered body of one error.
    fn check(err: ApiError, status: u16, code: &str, message: &str) {
        assert_eq!(err.status(), status, "{err:?}");
        assert_eq!(err.code(), code, "{err:?}");
        assert_eq!(err.message(), message, "{err:?}");
        let retryable = matches!(status, 429 | 503);
        assert_eq!(err.retryable(), retryable);
        assert_eq!(err.retry_after(), (status == 429).then_some(1));
        let body: serde_json::Value = serde_json::from_str(&err.to_json()).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"code": code, "message": message, "retryable": retryable})
        );
    }

    #[test]
    fn errors_the_page_leaves_open() {
        let e = ApiError::AwaitingMeasurement { deployment: id() };
        assert_eq!(
            (e.status(), e.code(), e.retryable()),
            (409, "awaiting_measurement", false)
        );
        assert!(e.message().contains("--wait"), "{}", e.message());
        let e = ApiError::UpstreamUnavailable {
            detail: "connection reset".into(),
        };
        assert_eq!(
            (e.status(), e.code(), e.retryable()),
            (502, "upstream_unavailable", true)
        );
        assert_eq!(e.message(), "the engine could not answer: connection reset");
        let e = ApiError::EngineFailed {
            deployment: id(),
            detail: "exit status 1".into(),
        };
        assert_eq!(
            (e.status(), e.code(), e.retryable()),
            (503, "engine_failed", true)
        );
        let e = ApiError::Conflict {
            detail: "deployment x is parking".into(),
        };
        assert_eq!(
            (e.status(), e.message().as_str()),
            (409, "deployment x is parking")
        );
        let e = ApiError::DoesNotFit {
            deployment: id(),
            detail: "needs 90 GiB, the GPU has 80 GiB".into(),
        };
        assert_eq!((e.status(), e.code()), (409, "does_not_fit"));
        let e = ApiError::Internal {
            detail: "state file: disk full".into(),
        };
        assert_eq!(
            (e.status(), e.code(), e.retryable()),
            (500, "internal", false)
        );
    }

    #[test]
    fn adapter_load_failed_names_the_adapter_and_the_engines_reason() {
        check(
            ApiError::AdapterLoadFailed {
                adapter: "support-bot".into(),
                reason: "No adapter found for /models/x".into(),
            },
            503,
            "adapter_load_failed",
            "adapter support-bot could not be loaded into its base: No adapter found for /models/x; retry shortly",
        );
    }

    #[test]
    fn tenant_errors() {
        let e = ApiError::KeyRequired;
        assert_eq!(
            (e.status(), e.code(), e.retryable()),
            (401, "unauthorized", false)
        );
        assert_eq!(e.retry_after(), None);
        let e = ApiError::RateLimited {
            tenant: "team-a".into(),
            what: "requests",
            limit: 60,
            retry_after: 7,
        };
        assert_eq!(
            (e.status(), e.code(), e.retryable()),
            (429, "rate_limited", true)
        );
        assert_eq!(e.retry_after(), Some(7));
        assert_eq!(
            e.message(),
            "tenant team-a passed its rate of 60 requests per minute; retry in 7 s"
        );
    }

    #[test]
    fn queue_deadline_message() {
        check(
            ApiError::QueueDeadline { deployment: id() },
            503,
            "unavailable",
            "deployment 01M3R7A6YJW402N962HH17A66W did not become servable within the queue deadline; retry shortly",
        );
    }

    #[test]
    fn drain_timeout_message() {
        check(
            ApiError::DrainTimeout {
                deployment: id(),
                drain_ms: 30000,
                charged: 2,
            },
            503,
            "unavailable",
            "switch to 01M3R7A6YJW402N962HH17A66W failed: drain timeout after 30000 ms with 2 request(s) still charged; the victims serve again; retry shortly",
        );
    }

    #[test]
    fn dispatch_closed_message() {
        check(
            ApiError::DispatchClosed { deployment: id() },
            503,
            "unavailable",
            "dispatch to deployment 01M3R7A6YJW402N962HH17A66W is closed; retry shortly",
        );
    }

    #[test]
    fn too_many_waiting_message() {
        check(
            ApiError::TooManyWaiting { deployment: id() },
            429,
            "queue_full",
            "too many requests are waiting for deployment 01M3R7A6YJW402N962HH17A66W",
        );
    }

    #[test]
    fn buffered_bytes_message() {
        check(
            ApiError::BufferedBytes,
            429,
            "queue_full",
            "waiting requests exceed the buffered-bytes bound",
        );
    }

    #[test]
    fn in_flight_deadline_message() {
        check(
            ApiError::InFlightDeadline { deployment: id() },
            429,
            "queue_full",
            "deployment 01M3R7A6YJW402N962HH17A66W stayed at its in-flight bound for the queue deadline",
        );
    }

    #[test]
    fn in_flight_no_wait_message() {
        check(
            ApiError::InFlightNoWait { deployment: id() },
            429,
            "queue_full",
            "deployment 01M3R7A6YJW402N962HH17A66W is at its in-flight bound and lets no request wait; retry shortly",
        );
    }

    #[test]
    fn not_servable_no_wait_message() {
        check(
            ApiError::NotServableNoWait { deployment: id() },
            429,
            "queue_full",
            "deployment 01M3R7A6YJW402N962HH17A66W is not servable now and lets no request wait; retry shortly",
        );
    }

    #[test]
    fn deployment_inactive_message() {
        // The product page's body, to the letter ("Only on your command").
        let page = r#"{"code":"deployment_inactive","message":"deployment 01M3R7A6YJW402N962HH17A66W is not running and its activation is explicit (lifecycle.activation: explicit); inference does not start or wake it; start it with `capyctl start deployment 01M3R7A6YJW402N962HH17A66W`"}"#;
        let page: serde_json::Value = serde_json::from_str(page).unwrap();
        let err = ApiError::DeploymentInactive { deployment: id() };
        check(
            err.clone(),
            409,
            "deployment_inactive",
            page["message"].as_str().unwrap(),
        );
        assert_eq!(err.body()["code"], page["code"]);
    }

    #[test]
    fn deployment_stopped_message() {
        check(
            ApiError::DeploymentStopped { deployment: id() },
            409,
            "deployment_stopped",
            "deployment 01M3R7A6YJW402N962HH17A66W was stopped by an operator; inference does not start it; start it with `capyctl start deployment 01M3R7A6YJW402N962HH17A66W`",
        );
    }

    #[test]
    fn capability_missing_message() {
        check(
            ApiError::CapabilityMissingDeepPark {
                deployment: id(),
                reason: "gpt-oss on vLLM cannot be woken correctly".into(),
            },
            409,
            "capability_missing:deep_park",
            "deployment 01M3R7A6YJW402N962HH17A66W cannot be parked: gpt-oss on vLLM cannot be woken correctly; declare residency: restart_only",
        );
    }

    #[test]
    fn parked_capacity_message() {
        check(
            ApiError::ParkedCapacity { deployment: id() },
            409,
            "parked_capacity",
            "no room to keep deployment 01M3R7A6YJW402N962HH17A66W parked: the parked models that hold the room are explicit or of a higher priority, and are never stopped to make it; deployment 01M3R7A6YJW402N962HH17A66W serves again",
        );
    }

    #[test]
    fn wake_failure_messages() {
        let cases = [
            (
                WakeFailure::Mismatch,
                "wake_mismatch",
                "its answer to the check prompt differs from its first answer, so its weights did not come back intact",
            ),
            (
                WakeFailure::ReloadFailed,
                "wake_reload_failed",
                "the engine failed to reload its weights",
            ),
            (
                WakeFailure::Uncertain,
                "wake_uncertain",
                "the wake did not finish within the wake window",
            ),
        ];
        for (failure, code, what) in cases {
            check(
                ApiError::WakeFailed {
                    deployment: id(),
                    failure,
                },
                503,
                code,
                &format!(
                    "wake of deployment {ID} failed ({code}): {what}; the instance was stopped and the next request loads it fresh; retry shortly"
                ),
            );
        }
    }

    #[test]
    fn model_not_found_message() {
        check(
            ApiError::ModelNotFound {
                model: "chat-z".into(),
            },
            404,
            "model_not_found",
            "model chat-z is not deployed",
        );
    }

    #[test]
    fn invalid_request_message() {
        check(
            ApiError::InvalidRequest {
                detail: "the body has no `model`".into(),
            },
            400,
            "invalid_request",
            "the body has no `model`",
        );
    }

    #[test]
    fn not_found_message() {
        check(
            ApiError::NotFound {
                what: format!("deployment {ID}"),
            },
            404,
            "not_found",
            "deployment 01M3R7A6YJW402N962HH17A66W not found",
        );
    }

    #[test]
    fn request_too_large_message() {
        check(
            ApiError::RequestTooLarge { limit: 67108864 },
            413,
            "request_too_large",
            "request body exceeds the buffered-bytes bound of 67108864 bytes",
        );
    }

    #[test]
    fn uri_too_long_message() {
        check(
            ApiError::UriTooLong { limit: 8192 },
            414,
            "uri_too_long",
            "the request target is longer than 8192 bytes",
        );
    }

    #[test]
    fn not_implemented_message() {
        check(
            ApiError::NotImplemented {
                what: "the transfer coding gzip".into(),
            },
            501,
            "not_implemented",
            "the transfer coding gzip is not implemented",
        );
    }

    #[test]
    fn unauthorized_message() {
        check(
            ApiError::Unauthorized,
            401,
            "unauthorized",
            "the management API needs `Authorization: Bearer <admin token>`",
        );
    }

    #[test]
    fn every_429_says_retry_after_one_second() {
        let all = [
            ApiError::TooManyWaiting { deployment: id() },
            ApiError::BufferedBytes,
            ApiError::InFlightDeadline { deployment: id() },
            ApiError::InFlightNoWait { deployment: id() },
            ApiError::NotServableNoWait { deployment: id() },
        ];
        for err in all {
            assert_eq!(err.status(), 429);
            assert_eq!(err.retry_after(), Some(RETRY_AFTER_SECONDS));
        }
        assert_eq!(
            ApiError::DispatchClosed { deployment: id() }.retry_after(),
            None
        );
    }

    #[test]
    fn unavailable_says_its_words_and_its_retry_after() {
        let err = ApiError::Unavailable {
            detail: "the Kubernetes API server cannot be reached; retry shortly".into(),
            retry_after: 2,
        };
        assert_eq!(
            (err.status(), err.code(), err.retryable()),
            (503, "unavailable", true)
        );
        assert_eq!(err.retry_after(), Some(2));
        assert_eq!(
            err.body(),
            serde_json::json!({"code": "unavailable",
                "message": "the Kubernetes API server cannot be reached; retry shortly",
                "retryable": true})
        );
    }
}
