//! What crosses the wire between the node agent's server and [`RemoteHostAgent`]: the error
//! body, which carries every [`AgentError`] so that the client rebuilds the same variant with
//! the same message, and the bodies of the samples, exits and info routes.
//!
//! [`RemoteHostAgent`]: super::RemoteHostAgent

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use capyctl_spec::EngineKind;
use capyctl_spec::errors::WakeFailure;
use serde::{Deserialize, Serialize};

use crate::agent::{AgentConfig, EngineExit};
use crate::error::AgentError;
use crate::load::LoadSample;

// The interned strings of the wire (also `EngineInfo::refused_models`'s).
pub use capyctl_interfaces::interned::{intern, static_strs};

/// The error body of every failed call: `{"code", "message", "retryable", "error"}`. `code` is
/// [`AgentError::metric_label`], `message` the error's text; `error` the variant and its fields,
/// from which the client rebuilds the same [`AgentError`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// A short, stable code (`unknown_instance`, `capability_missing_deep_park`, ...).
    pub code: String,
    /// The error's text, as the agent displays it.
    pub message: String,
    /// Whether a retry may succeed.
    pub retryable: bool,
    /// The variant and its fields; absent in errors that are not an [`AgentError`] (401).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorFields>,
}

/// An [`AgentError`]'s variant and fields; sources go as text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[allow(missing_docs)]
pub enum ErrorFields {
    EngineUnreachable {
        engine: EngineKind,
        step: String,
        url: String,
        source: String,
    },
    EngineStatus {
        engine: EngineKind,
        step: String,
        url: String,
        status: u16,
        body: String,
    },
    EngineTimeout {
        engine: EngineKind,
        step: String,
        url: String,
        after: Duration,
    },
    EngineAnswer {
        engine: EngineKind,
        step: String,
        url: String,
        detail: String,
    },
    EngineExited {
        engine: EngineKind,
        instance: String,
        status: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        log: Option<String>,
    },
    EngineNotReady {
        engine: EngineKind,
        instance: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        log: Option<String>,
        source: Box<ErrorBody>,
    },
    CapabilityMissing {
        reason: String,
    },
    ResidencyRefused {
        reason: String,
    },
    InvalidSpec {
        detail: String,
    },
    Unsupported {
        engine: EngineKind,
        what: String,
    },
    WakeFailed {
        failure: String,
        detail: String,
    },
    UnknownInstance {
        instance: String,
    },
    WrongState {
        instance: String,
        detail: String,
    },
    Cancelled {
        instance: String,
        what: String,
    },
    Checkpoint {
        path: PathBuf,
        detail: String,
    },
    Io {
        what: String,
        source: String,
        /// The OS error number, when the error had one (rebuilt as the same OS error).
        os_error: Option<i32>,
    },
    Json {
        what: String,
        source: String,
    },
    Nvml {
        what: String,
        source: String,
    },
    AgentUnreachable {
        url: String,
        detail: String,
    },
    AgentTimeout {
        url: String,
        after: Duration,
    },
    AgentUnauthorized {
        url: String,
    },
    AgentAnswer {
        url: String,
        detail: String,
    },
    Remote {
        code: String,
        message: String,
        retryable: bool,
    },
}

/// The HTTP status the server answers `e` with.
pub fn status_of(e: &AgentError) -> u16 {
    match e {
        AgentError::UnknownInstance { .. } => 404,
        AgentError::WrongState { .. } | AgentError::Cancelled { .. } => 409,
        AgentError::CapabilityMissing { .. }
        | AgentError::ResidencyRefused { .. }
        | AgentError::InvalidSpec { .. }
        | AgentError::Unsupported { .. } => 422,
        AgentError::EngineUnreachable { .. }
        | AgentError::EngineStatus { .. }
        | AgentError::EngineAnswer { .. }
        | AgentError::EngineExited { .. }
        | AgentError::WakeFailed { .. }
        | AgentError::AgentUnreachable { .. }
        | AgentError::AgentUnauthorized { .. }
        | AgentError::AgentAnswer { .. } => 502,
        AgentError::EngineTimeout { .. } | AgentError::AgentTimeout { .. } => 504,
        AgentError::EngineNotReady { source, .. } => status_of(source),
        AgentError::Remote {
            retryable: true, ..
        } => 503,
        _ => 500,
    }
}

/// The text of an error's source chain (`a: b: c`).
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

impl ErrorBody {
    /// The body of `e`.
    pub fn of(e: &AgentError) -> Self {
        let fields = match e {
            AgentError::EngineUnreachable {
                engine,
                step,
                url,
                source,
            } => ErrorFields::EngineUnreachable {
                engine: *engine,
                step: (*step).to_string(),
                url: url.clone(),
                source: chain(source.as_ref()),
            },
            AgentError::EngineStatus {
                engine,
                step,
                url,
                status,
                body,
            } => ErrorFields::EngineStatus {
                engine: *engine,
                step: (*step).to_string(),
                url: url.clone(),
                status: *status,
                body: body.clone(),
            },
            AgentError::EngineTimeout {
                engine,
                step,
                url,
                after,
            } => ErrorFields::EngineTimeout {
                engine: *engine,
                step: (*step).to_string(),
                url: url.clone(),
                after: *after,
            },
            AgentError::EngineAnswer {
                engine,
                step,
                url,
                detail,
            } => ErrorFields::EngineAnswer {
                engine: *engine,
                step: (*step).to_string(),
                url: url.clone(),
                detail: detail.clone(),
            },
            AgentError::EngineExited {
                engine,
                instance,
                status,
                log,
            } => ErrorFields::EngineExited {
                engine: *engine,
                instance: instance.clone(),
                status: status.clone(),
                log: log.clone(),
            },
            AgentError::EngineNotReady {
                engine,
                instance,
                log,
                source,
            } => ErrorFields::EngineNotReady {
                engine: *engine,
                instance: instance.clone(),
                log: log.clone(),
                source: Box::new(ErrorBody::of(source)),
            },
            AgentError::CapabilityMissing { reason } => ErrorFields::CapabilityMissing {
                reason: (*reason).to_string(),
            },
            AgentError::ResidencyRefused { reason } => ErrorFields::ResidencyRefused {
                reason: reason.clone(),
            },
            AgentError::InvalidSpec { detail } => ErrorFields::InvalidSpec {
                detail: detail.clone(),
            },
            AgentError::Unsupported { engine, what } => ErrorFields::Unsupported {
                engine: *engine,
                what: (*what).to_string(),
            },
            AgentError::WakeFailed { failure, detail } => ErrorFields::WakeFailed {
                failure: failure.code().to_string(),
                detail: detail.clone(),
            },
            AgentError::UnknownInstance { instance } => ErrorFields::UnknownInstance {
                instance: instance.clone(),
            },
            AgentError::Cancelled { instance, what } => ErrorFields::Cancelled {
                instance: instance.clone(),
                what: (*what).to_string(),
            },
            AgentError::WrongState { instance, detail } => ErrorFields::WrongState {
                instance: instance.clone(),
                detail: detail.clone(),
            },
            AgentError::Checkpoint { path, detail } => ErrorFields::Checkpoint {
                path: path.clone(),
                detail: detail.clone(),
            },
            AgentError::Io { what, source } => ErrorFields::Io {
                what: what.clone(),
                source: chain(source),
                os_error: source.raw_os_error(),
            },
            AgentError::Json { what, source } => ErrorFields::Json {
                what: what.clone(),
                source: chain(source),
            },
            #[cfg(feature = "nvml")]
            AgentError::Nvml { what, source } => ErrorFields::Nvml {
                what: what.clone(),
                source: chain(source),
            },
            AgentError::AgentUnreachable { url, detail } => ErrorFields::AgentUnreachable {
                url: url.clone(),
                detail: detail.clone(),
            },
            AgentError::AgentTimeout { url, after } => ErrorFields::AgentTimeout {
                url: url.clone(),
                after: *after,
            },
            AgentError::AgentUnauthorized { url } => {
                ErrorFields::AgentUnauthorized { url: url.clone() }
            }
            AgentError::AgentAnswer { url, detail } => ErrorFields::AgentAnswer {
                url: url.clone(),
                detail: detail.clone(),
            },
            AgentError::Remote {
                code,
                message,
                retryable,
            } => ErrorFields::Remote {
                code: code.clone(),
                message: message.clone(),
                retryable: *retryable,
            },
        };
        Self {
            code: e.metric_label().to_string(),
            message: e.to_string(),
            retryable: e.retryable(),
            error: Some(fields),
        }
    }

    /// The [`AgentError`] this body carries; [`AgentError::Remote`] with its code and message
    /// when it carries none this build knows.
    pub fn into_agent_error(self) -> AgentError {
        let remote = |code: String, message: String, retryable: bool| AgentError::Remote {
            code,
            message,
            retryable,
        };
        let Some(fields) = self.error else {
            return remote(self.code, self.message, self.retryable);
        };
        match fields {
            ErrorFields::EngineUnreachable {
                engine,
                step,
                url,
                source,
            } => AgentError::EngineUnreachable {
                engine,
                step: intern(&step),
                url,
                source: source.into(),
            },
            ErrorFields::EngineStatus {
                engine,
                step,
                url,
                status,
                body,
            } => AgentError::EngineStatus {
                engine,
                step: intern(&step),
                url,
                status,
                body,
            },
            ErrorFields::EngineTimeout {
                engine,
                step,
                url,
                after,
            } => AgentError::EngineTimeout {
                engine,
                step: intern(&step),
                url,
                after,
            },
            ErrorFields::EngineAnswer {
                engine,
                step,
                url,
                detail,
            } => AgentError::EngineAnswer {
                engine,
                step: intern(&step),
                url,
                detail,
            },
            ErrorFields::EngineExited {
                engine,
                instance,
                status,
                log,
            } => AgentError::EngineExited {
                engine,
                instance,
                status,
                log,
            },
            ErrorFields::EngineNotReady {
                engine,
                instance,
                log,
                source,
            } => AgentError::EngineNotReady {
                engine,
                instance,
                log,
                source: Box::new(source.into_agent_error()),
            },
            ErrorFields::CapabilityMissing { reason } => AgentError::CapabilityMissing {
                reason: intern(&reason),
            },
            ErrorFields::ResidencyRefused { reason } => AgentError::ResidencyRefused { reason },
            ErrorFields::InvalidSpec { detail } => AgentError::InvalidSpec { detail },
            ErrorFields::Unsupported { engine, what } => AgentError::Unsupported {
                engine,
                what: intern(&what),
            },
            ErrorFields::WakeFailed { failure, detail } => match wake_failure(&failure) {
                Some(failure) => AgentError::WakeFailed { failure, detail },
                None => remote(self.code, self.message, self.retryable),
            },
            ErrorFields::UnknownInstance { instance } => AgentError::UnknownInstance { instance },
            ErrorFields::Cancelled { instance, what } => AgentError::Cancelled {
                instance,
                what: intern(&what),
            },
            ErrorFields::WrongState { instance, detail } => {
                AgentError::WrongState { instance, detail }
            }
            ErrorFields::Checkpoint { path, detail } => AgentError::Checkpoint { path, detail },
            ErrorFields::Io {
                what,
                source,
                os_error,
            } => AgentError::Io {
                what,
                source: match os_error {
                    Some(code) => std::io::Error::from_raw_os_error(code),
                    None => std::io::Error::other(source),
                },
            },
            ErrorFields::Json { what, source } => AgentError::Json {
                what,
                source: <serde_json::Error as serde::de::Error>::custom(source),
            },
            #[cfg(feature = "nvml")]
            ErrorFields::Nvml { what, .. } => AgentError::Nvml {
                what,
                source: nvml_wrapper::error::NvmlError::Unknown,
            },
            #[cfg(not(feature = "nvml"))]
            ErrorFields::Nvml { .. } => remote(self.code, self.message, self.retryable),
            ErrorFields::AgentUnreachable { url, detail } => {
                AgentError::AgentUnreachable { url, detail }
            }
            ErrorFields::AgentTimeout { url, after } => AgentError::AgentTimeout { url, after },
            ErrorFields::AgentUnauthorized { url } => AgentError::AgentUnauthorized { url },
            ErrorFields::AgentAnswer { url, detail } => AgentError::AgentAnswer { url, detail },
            ErrorFields::Remote {
                code,
                message,
                retryable,
            } => remote(code, message, retryable),
        }
    }
}

/// The failure of a `wake_*` code.
fn wake_failure(code: &str) -> Option<WakeFailure> {
    [
        WakeFailure::Mismatch,
        WakeFailure::ReloadFailed,
        WakeFailure::Uncertain,
    ]
    .into_iter()
    .find(|f| f.code() == code)
}

/// `POST /agent/v1/instances/{id}/adapters`: the LoRA adapter to load into the instance's
/// engine (DESIGN 4.9).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdapterLoad {
    /// The adapter's name (the deployment's; requests give it in `model`).
    pub name: String,
    /// Its PEFT directory, as the engine reads it.
    pub path: String,
}

/// `GET /agent/v1/instances/{id}/adapters`: the adapters the instance's engine lists now.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdaptersPage {
    /// Their names, in the engine's order.
    pub adapters: Vec<String>,
}

/// `GET /agent/v1/samples`: the latest sample of every instance the agent runs.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SamplesPage {
    /// By instance ID.
    pub samples: BTreeMap<String, LoadSample>,
    /// The agent's clock when it answered (Unix milliseconds; 0, or absent, from an agent
    /// before it): the caller takes each sample's age from it and dates the sample on its
    /// own clock ([`SamplesPage::rebased`]), so that hosts whose clocks are apart neither age
    /// nor freshen each other's samples.
    #[serde(default)]
    pub now_ms: u64,
}

impl SamplesPage {
    /// The samples dated on the caller's clock: each `sampled_at_ms` is `local_now_ms` less
    /// the sample's age on the agent's clock (the time the answer took counts as age). As
    /// they came when the agent did not say its clock.
    pub fn rebased(self, local_now_ms: u64) -> BTreeMap<String, LoadSample> {
        let agent_now = self.now_ms;
        let mut samples = self.samples;
        if agent_now != 0 {
            for s in samples.values_mut() {
                s.sampled_at_ms = local_now_ms.saturating_sub(s.age_ms(agent_now));
            }
        }
        samples
    }
}

/// One exit in [`ExitsPage`], with its sequence number.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NumberedExit {
    /// Its sequence number (0, 1, ... in this server's life).
    pub seq: u64,
    /// The exit.
    #[serde(flatten)]
    pub exit: EngineExit,
}

/// `GET /agent/v1/exits`: the exits after the caller's cursor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitsPage {
    /// This server's life (changes when the agent restarts; a cursor of another life starts
    /// from the oldest exit held).
    pub epoch: u64,
    /// The cursor of the next call (`after`).
    pub next: u64,
    /// The exits, oldest first.
    pub exits: Vec<NumberedExit>,
    /// How many exits after the cursor are no longer held (the caller fell too far behind).
    pub missed: u64,
}

/// The agent's timing, so that a client's timeouts follow the agent's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentTiming {
    /// How long an engine may take to become ready.
    pub ready_timeout: Duration,
    /// The wake window.
    pub wake_window: Duration,
    /// Between SIGTERM and SIGKILL when stopping an engine.
    pub stop_grace: Duration,
    /// Between two load samples.
    pub sample_interval: Duration,
    /// One quick engine call.
    pub step: Duration,
    /// One park call.
    pub park: Duration,
    /// One check or warm-up request.
    pub check: Duration,
}

impl From<&AgentConfig> for AgentTiming {
    fn from(c: &AgentConfig) -> Self {
        Self {
            ready_timeout: c.ready_timeout,
            wake_window: c.wake_window,
            stop_grace: c.stop_grace,
            sample_interval: c.sample_interval,
            step: c.timeouts.step,
            park: c.timeouts.park,
            check: c.timeouts.check,
        }
    }
}

/// `GET /agent/v1/info`: who the agent is and its timing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentInfo {
    /// The node (Kubernetes node name, or the host's ID).
    pub node_name: String,
    /// `host.id` of the host document.
    pub host_id: String,
    /// `process` or `pod`.
    pub engine_runtime: String,
    /// The agent's version.
    pub version: String,
    /// Its timing.
    pub timing: AgentTiming,
}
