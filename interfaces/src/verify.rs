//! Wake verification's values: the first answer an instance gave (the check prompt's text, or
//! a decision model's decision) and how a wake ended. How they are asked for and compared is
//! the node agent's (`capyctl_node_agent::verify`).

use std::collections::BTreeMap;

use capyctl_spec::errors::WakeFailure;
use serde::{Deserialize, Serialize};

/// A decision model's answer to its fixed decision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecisionAnswer {
    /// The option picked; `None` when the answer names no option.
    pub picked: Option<String>,
    /// Each option's probability, when the engine returned log probabilities.
    pub probabilities: Option<BTreeMap<String, f64>>,
}

/// The answer recorded when an instance first becomes ready.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum FirstAnswer {
    /// The check prompt's text.
    Text {
        /// The text.
        text: String,
    },
    /// A decision model's decision.
    Decision {
        /// The decision.
        answer: DecisionAnswer,
    },
}

/// How a wake ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "outcome", content = "detail")]
pub enum WakeOutcome {
    /// The engine is awake and answered the check as it first did.
    Pass,
    /// The check's answer differs (`wake_mismatch`).
    Mismatch(String),
    /// A wake or reload step failed (`wake_reload_failed`).
    ReloadFailed(String),
    /// The wake did not finish within the wake window, or could not be checked
    /// (`wake_uncertain`).
    Uncertain(String),
    /// The engine process exited during the wake. Reported to clients as
    /// `wake_reload_failed`: the weights did not come back, and the next request loads the
    /// model fresh.
    EngineExited(String),
}

impl WakeOutcome {
    /// The catalogue's failure, `None` for a pass.
    pub fn failure(&self) -> Option<WakeFailure> {
        match self {
            WakeOutcome::Pass => None,
            WakeOutcome::Mismatch(_) => Some(WakeFailure::Mismatch),
            WakeOutcome::ReloadFailed(_) | WakeOutcome::EngineExited(_) => {
                Some(WakeFailure::ReloadFailed)
            }
            WakeOutcome::Uncertain(_) => Some(WakeFailure::Uncertain),
        }
    }

    /// What happened, for logs and errors.
    pub fn detail(&self) -> &str {
        match self {
            WakeOutcome::Pass => "passed",
            WakeOutcome::Mismatch(d)
            | WakeOutcome::ReloadFailed(d)
            | WakeOutcome::Uncertain(d)
            | WakeOutcome::EngineExited(d) => d,
        }
    }
}
