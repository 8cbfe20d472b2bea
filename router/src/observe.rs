//! What the listener tells an observer (metrics, logs) about each request, once, when it ends.
//!
//! NB (when a request "ends"): an error answer ends when it is rendered; an answer forwarded
//! from an engine ends when the engine's answer is over or the request is cut (its permit is
//! released then); a client that hangs up before any answer ends its request at that moment.

use std::time::Duration;

/// `code` of a request whose client hung up before its answer was complete.
pub const CLIENT_GONE: &str = "client_gone";
/// `code` of a streamed answer cut because its client read nothing for 10 s.
pub const READ_STALL: &str = "read_stall";
/// `code` of an answer cut because a piece was larger than 64 KiB.
pub const PIECE_TOO_LARGE: &str = "piece_too_large";
/// `code` of an answer cut because the engine was silent past `stream_idle_timeout`.
pub const STREAM_IDLE_TIMEOUT: &str = "stream_idle_timeout";
/// `code` of an answer the engine broke off after it began.
pub const UPSTREAM_FAILED: &str = "upstream_failed";
/// `code` of a request on an inference route with the wrong method (405).
pub const METHOD_NOT_ALLOWED: &str = "method_not_allowed";
/// `status` of a request whose client hung up before the response head was sent (nginx's 499).
pub const STATUS_CLIENT_GONE: u16 = 499;

/// One finished request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestEvent {
    /// The deployment its `model` named; `None` if it never got that far (bad body, unknown
    /// model, another route).
    pub deployment_id: Option<String>,
    /// The body's `model`; `None` if it had none (or the route takes no body).
    pub model: Option<String>,
    /// The status sent to the client, or [`STATUS_CLIENT_GONE`] if the client hung up before
    /// any was sent.
    pub status: u16,
    /// Why it ended abnormally: a catalogue error's code (`ApiError::code`), or one of this
    /// module's constants; `None` for an answer that ended normally (whatever the engine's
    /// status).
    pub code: Option<&'static str>,
    /// How long it waited for its admission (queue, switch and the in-flight bound); zero if it
    /// never asked for one.
    pub waited: Duration,
    /// From its admission (its dispatch to the engine) to its end; zero if it was never
    /// admitted.
    pub served: Duration,
    /// Whether the answer was a stream (`text/event-stream`).
    pub streamed: bool,
}

/// Told about every request exactly once, when it ends. Called from the request's own task
/// (or from the body's `Drop`): keep it short and never block.
pub trait RequestObserver: Send + Sync + 'static {
    /// One request ended.
    fn finished(&self, event: &RequestEvent);
}
