//! What the listener tells an observer (metrics, logs) about each request, once, when it ends.
//!
//! NB (when a request "ends"): an error answer ends when it is rendered; an answer forwarded
//! from an engine ends when the engine's answer is over or the request is cut (its permit is
//! released then); a client that hangs up before any answer ends its request at that moment.

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

/// One finished request, and the trait of whoever is told of it: the interfaces' (what the
/// lifecycle's metrics implement), re-exported here.
pub use capyctl_interfaces::router::{RequestEvent, RequestObserver};
