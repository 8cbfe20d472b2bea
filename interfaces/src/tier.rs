//! How a model parks, the values: the tier a park goes to ([`ParkTier`]), why a model stops
//! instead ([`NoParkReason`]), the choice ([`ParkChoice`]) and what an engine was launched able
//! to do ([`LaunchParking`]). The rule that chooses is `capyctl_engine_rules::tier`.

use serde::{Deserialize, Serialize};

/// Where a parked model's memory goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ParkTier {
    /// Weights copied to host RAM; a wake copies them back (vLLM level 1, SGLang with CPU backup).
    HostRam,
    /// Weights dropped; a wake reloads them from disk (vLLM level 2, SGLang without backup).
    Deep,
    /// Only the KV cache is given back; the weights stay in GPU memory and a wake reloads
    /// nothing (SGLang with speculative decoding).
    KvOnly,
}

/// Why a model is stopped instead of parked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NoParkReason {
    /// `residency: restart_only`.
    RestartOnly,
    /// TensorFold does not park.
    EngineDoesNotPark,
    /// Decision models restart instead of parking in this release.
    DecisionModel,
    /// The copy does not fit in host RAM and the model cannot park deep
    /// (`released: stopped (no room to park)`).
    NoRoomToPark,
}

impl NoParkReason {
    /// The words for a receipt or an event.
    pub fn describe(self) -> &'static str {
        match self {
            NoParkReason::RestartOnly => "residency: restart_only",
            NoParkReason::EngineDoesNotPark => "TensorFold does not park",
            NoParkReason::DecisionModel => "decision models restart instead of parking",
            NoParkReason::NoRoomToPark => "no room to park",
        }
    }
}

/// What happens to a model that must give back its GPU memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ParkChoice {
    /// It parks in this tier.
    Park(ParkTier),
    /// It is stopped.
    Stop(NoParkReason),
}

/// What the engine was launched able to do (SGLang's flags are fixed at launch).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LaunchParking {
    /// It may park at all: vLLM `--enable-sleep-mode` (+ `VLLM_SERVER_DEV_MODE=1`), SGLang
    /// `--enable-memory-saver`.
    pub may_park: bool,
    /// SGLang `--enable-weights-cpu-backup`: a host-RAM park is possible.
    pub host_ram: bool,
}
