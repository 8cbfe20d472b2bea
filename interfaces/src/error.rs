//! The host agent's one error type. How a failed start names the engine's own error line is
//! the node agent's (`capyctl_node_agent::error`).

use std::path::PathBuf;
use std::time::Duration;

use capyctl_spec::EngineKind;
use capyctl_spec::errors::{ApiError, WakeFailure};

/// `; its output is in <log>` when the engine's log is known.
fn log_hint(log: &Option<String>) -> String {
    match log {
        Some(log) => format!("; the engine's output is in {log}"),
        None => String::new(),
    }
}

/// Everything that can go wrong in the host agent. Engine errors name the engine, the step and
/// the URL, so one line tells an operator what failed where.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The engine could not be reached (connection refused, reset, closed).
    #[error("{engine} {step} at {url}: cannot reach the engine")]
    EngineUnreachable {
        /// The engine.
        engine: EngineKind,
        /// The step (e.g. `sleep`, `wake_up`, `reload_weights`).
        step: &'static str,
        /// The URL called.
        url: String,
        /// The client's error (hyper's; text only when the error came over the wire from a
        /// remote node agent).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The engine answered with a non-success status.
    #[error("{engine} {step} at {url}: the engine answered {status}: {body}")]
    EngineStatus {
        /// The engine.
        engine: EngineKind,
        /// The step.
        step: &'static str,
        /// The URL called.
        url: String,
        /// The HTTP status.
        status: u16,
        /// The start of the answer's body.
        body: String,
    },
    /// The engine did not answer within the step's timeout.
    #[error("{engine} {step} at {url}: no answer within {} ms", after.as_millis())]
    EngineTimeout {
        /// The engine.
        engine: EngineKind,
        /// The step.
        step: &'static str,
        /// The URL called.
        url: String,
        /// The timeout.
        after: Duration,
    },
    /// The engine answered, but not what the step expects (bad JSON, still asleep, ...).
    #[error("{engine} {step} at {url}: {detail}")]
    EngineAnswer {
        /// The engine.
        engine: EngineKind,
        /// The step.
        step: &'static str,
        /// The URL called.
        url: String,
        /// What was wrong with the answer.
        detail: String,
    },
    /// The engine's process ended.
    #[error("{engine} engine of instance {instance} exited: {status}{}", log_hint(.log))]
    EngineExited {
        /// The engine.
        engine: EngineKind,
        /// The instance.
        instance: String,
        /// The exit status, as text.
        status: String,
        /// Where the engine's output is (`<data dir>/engines/<instance>.log` for a child
        /// process), when the runtime keeps it.
        log: Option<String>,
    },
    /// A started engine did not become ready or give its first answer; it has been stopped.
    #[error("{engine} engine of instance {instance} did not become ready: {source}{}", log_hint(.log))]
    EngineNotReady {
        /// The engine.
        engine: EngineKind,
        /// The instance.
        instance: String,
        /// Where the engine's output is, when the runtime keeps it.
        log: Option<String>,
        /// What failed (readiness, the first answer).
        #[source]
        source: Box<AgentError>,
    },
    /// The engine cannot wake this model correctly (`capability_missing:deep_park`).
    #[error("cannot park: {reason}; declare residency: restart_only")]
    CapabilityMissing {
        /// The refusal table's reason.
        reason: &'static str,
    },
    /// The deployment's `residency` cannot be honoured here.
    #[error("residency refused: {reason}")]
    ResidencyRefused {
        /// Why.
        reason: String,
    },
    /// The deployment asks for something inconsistent.
    #[error("invalid deployment: {detail}")]
    InvalidSpec {
        /// What is wrong.
        detail: String,
    },
    /// The engine does not support an operation (TensorFold parking).
    #[error("{engine} does not support {what}")]
    Unsupported {
        /// The engine.
        engine: EngineKind,
        /// The operation.
        what: &'static str,
    },
    /// A wake failed its checks; the instance was stopped.
    #[error("wake failed ({}): {detail}", failure.code())]
    WakeFailed {
        /// Which failure.
        failure: WakeFailure,
        /// What happened.
        detail: String,
    },
    /// No instance with this ID is known to the agent.
    #[error("unknown instance {instance}")]
    UnknownInstance {
        /// The instance ID.
        instance: String,
    },
    /// A start, a wake or an adapter call that a stop of the same instance ended: the engine
    /// was stopped.
    #[error("instance {instance}: its {what} was ended by a stop; the engine was stopped")]
    Cancelled {
        /// The instance's ID.
        instance: String,
        /// `start`, `wake`, `adapter load`, `adapter unload` or `adapter list`.
        what: &'static str,
    },
    /// The instance is not in a state that allows the operation.
    #[error("instance {instance}: {detail}")]
    WrongState {
        /// The instance ID.
        instance: String,
        /// Why.
        detail: String,
    },
    /// A checkpoint file could not be understood.
    #[error("checkpoint {}: {detail}", path.display())]
    Checkpoint {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// A file or process operation failed.
    #[error("{what}")]
    Io {
        /// What was being done, naming the path or command.
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// JSON could not be read or written.
    #[error("{what}")]
    Json {
        /// What was being read, naming the file.
        what: String,
        /// The parser's error.
        #[source]
        source: serde_json::Error,
    },
    /// A remote node agent could not be reached (connection refused, reset, DNS).
    #[error("node agent at {url}: cannot reach it: {detail}")]
    AgentUnreachable {
        /// The URL called.
        url: String,
        /// The client's error, as text.
        detail: String,
    },
    /// A remote node agent did not answer within the call's timeout.
    #[error("node agent at {url}: no answer within {} ms", after.as_millis())]
    AgentTimeout {
        /// The URL called.
        url: String,
        /// The timeout.
        after: Duration,
    },
    /// A remote node agent refused the agent token (401).
    #[error("node agent at {url}: the agent token was refused (401 unauthorized)")]
    AgentUnauthorized {
        /// The URL called.
        url: String,
    },
    /// A remote node agent answered, but not what the call expects.
    #[error("node agent at {url}: {detail}")]
    AgentAnswer {
        /// The URL called.
        url: String,
        /// What was wrong with the answer.
        detail: String,
    },
    /// An error a remote node agent sent that this build does not know (another version):
    /// its code and message as sent.
    #[error("{message}")]
    Remote {
        /// The error's code.
        code: String,
        /// Its message.
        message: String,
        /// Whether the agent says a retry may succeed.
        retryable: bool,
    },
    /// NVML failed.
    #[cfg(feature = "nvml")]
    #[error("NVML: {what}")]
    Nvml {
        /// What was asked.
        what: String,
        /// NVML's error.
        #[source]
        source: nvml_wrapper::error::NvmlError,
    },
}

impl AgentError {
    /// A short, stable label for metrics and event reasons.
    pub fn metric_label(&self) -> &'static str {
        match self {
            AgentError::EngineUnreachable { .. } => "engine_unreachable",
            AgentError::EngineStatus { .. } => "engine_status",
            AgentError::EngineTimeout { .. } => "engine_timeout",
            AgentError::EngineAnswer { .. } => "engine_answer",
            AgentError::EngineExited { .. } => "engine_exited",
            AgentError::EngineNotReady { .. } => "engine_not_ready",
            AgentError::CapabilityMissing { .. } => "capability_missing_deep_park",
            AgentError::ResidencyRefused { .. } => "residency_refused",
            AgentError::InvalidSpec { .. } => "invalid_spec",
            AgentError::Unsupported { .. } => "unsupported",
            AgentError::WakeFailed { failure, .. } => failure.code(),
            AgentError::UnknownInstance { .. } => "unknown_instance",
            AgentError::WrongState { .. } => "wrong_state",
            AgentError::Cancelled { .. } => "cancelled",
            AgentError::Checkpoint { .. } => "checkpoint",
            AgentError::Io { .. } => "io",
            AgentError::Json { .. } => "json",
            AgentError::AgentUnreachable { .. } => "agent_unreachable",
            AgentError::AgentTimeout { .. } => "agent_timeout",
            AgentError::AgentUnauthorized { .. } => "agent_unauthorized",
            AgentError::AgentAnswer { .. } => "agent_answer",
            AgentError::Remote { .. } => "remote",
            #[cfg(feature = "nvml")]
            AgentError::Nvml { .. } => "nvml",
        }
    }

    /// The client-facing error of the catalogue for `deployment`, where there is one
    /// (`capability_missing:deep_park`, the three wake failures).
    pub fn to_api_error(&self, deployment: &str) -> Option<ApiError> {
        match self {
            AgentError::CapabilityMissing { reason } => Some(ApiError::CapabilityMissingDeepPark {
                deployment: deployment.to_string(),
                reason: (*reason).to_string(),
            }),
            AgentError::WakeFailed { failure, .. } => Some(ApiError::WakeFailed {
                deployment: deployment.to_string(),
                failure: *failure,
            }),
            _ => None,
        }
    }

    /// Whether the same call may succeed later without anything changing on the caller's side
    /// (an engine or agent that did not answer, or answered too late).
    pub fn retryable(&self) -> bool {
        match self {
            AgentError::EngineUnreachable { .. }
            | AgentError::EngineTimeout { .. }
            | AgentError::AgentUnreachable { .. }
            | AgentError::AgentTimeout { .. } => true,
            AgentError::Remote { retryable, .. } => *retryable,
            AgentError::EngineNotReady { source, .. } => source.retryable(),
            _ => false,
        }
    }

    /// An I/O error while doing `what`.
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        AgentError::Io {
            what: what.into(),
            source,
        }
    }
}
