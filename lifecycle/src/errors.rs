//! What can go wrong opening the server ([`CoreError`]), and the API errors the server's methods
//! share.

use capyctl_spec::errors::ApiError;

use crate::store::StoreError;
use crate::switches;

/// What can go wrong opening the server.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    /// The state could not be loaded.
    #[error("loading the state: {0}")]
    Store(#[from] StoreError),
    /// The host agent failed (inventory, recovery).
    #[error("host agent: {0}")]
    Agent(#[from] capyctl_interfaces::AgentError),
    /// The switch records could not be read or written.
    #[error("{0}")]
    Switches(#[from] switches::SwitchLogError),
}

impl CoreError {
    /// A short, stable label for metrics and event reasons.
    pub fn metric_label(&self) -> &'static str {
        match self {
            CoreError::Store(e) => e.metric_label(),
            CoreError::Agent(e) => e.metric_label(),
            CoreError::Switches(_) => "switch_records",
        }
    }
}

pub(crate) fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::Internal {
        detail: e.to_string(),
    }
}

pub(crate) fn not_found(key: &str) -> ApiError {
    ApiError::NotFound {
        what: format!("deployment {key}"),
    }
}
