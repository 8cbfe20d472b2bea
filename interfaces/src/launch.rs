//! What an engine runs at once, the values: [`MaxRunning`] and where its figure comes from
//! ([`MaxRunningSource`]). The rule is `capyctl_engine_rules::max_running`; the launch command
//! is the node agent's (`capyctl_node_agent::launch`).

use serde::{Deserialize, Serialize};

/// Where a `max_running` figure comes from (product page, "Reading load").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MaxRunningSource {
    /// The engine's own figure (SGLang's `/server_info`).
    Engine,
    /// `max_concurrent_requests`.
    Declared,
    /// CapyCTL's default: 32 for vLLM, 8 for TensorFold.
    Default,
    /// A hybrid model's state cache holds fewer.
    StateCache,
    /// The option is in the deployment's `extra_args`.
    ExtraArgs,
    /// The option is in the host's engine command.
    HostFixed,
    /// The engine chooses at start and has not said.
    EngineDefault,
    /// The host sizes it at launch (the server does not know yet).
    OnHost,
}

impl MaxRunningSource {
    /// The name the load read shows (`engine`, `declared`, `default`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            MaxRunningSource::Engine => "engine",
            MaxRunningSource::Declared => "declared",
            MaxRunningSource::Default => "default",
            MaxRunningSource::StateCache => "state_cache",
            MaxRunningSource::ExtraArgs => "extra_args",
            MaxRunningSource::HostFixed => "host_fixed",
            MaxRunningSource::EngineDefault => "engine_default",
            MaxRunningSource::OnHost => "on_host",
        }
    }
}

impl std::fmt::Display for MaxRunningSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<MaxRunning> for capyctl_spec::api::MaxRunningView {
    fn from(m: MaxRunning) -> Self {
        Self {
            count: m.count,
            source: m.source.as_str().into(),
        }
    }
}

/// How many requests an engine runs at once; `count` is `None` when not known.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MaxRunning {
    /// The figure, when known.
    pub count: Option<u32>,
    /// Where it comes from.
    pub source: MaxRunningSource,
}
