//! Measurement's values: how many bytes the weights are and how much GPU memory the engine
//! holds ([`Measurement`]: declared, read from the checkpoint or observed), and what a parked
//! engine still holds ([`GpuHeld`]). How they are measured is the node agent's
//! (`capyctl_node_agent::measure`); what a parked engine is estimated to hold is
//! `capyctl_engine_rules::parked`'s.

use serde::{Deserialize, Serialize};

/// Where a measured figure came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MeasureSource {
    /// The deployment's `resources`.
    Declared,
    /// The checkpoint's safetensors headers.
    Checkpoint,
    /// The engine's GPU footprint after a start.
    EngineFootprint,
}

impl MeasureSource {
    /// The management API's name: `declared`, `measured` (checkpoint headers) or `observed`
    /// (the engine's footprint).
    pub fn api_name(self) -> &'static str {
        match self {
            MeasureSource::Declared => "declared",
            MeasureSource::Checkpoint => "measured",
            MeasureSource::EngineFootprint => "observed",
        }
    }
}

/// One measured figure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Measured {
    /// Bytes.
    pub bytes: u64,
    /// Where from.
    pub source: MeasureSource,
}

/// A deployment's measurement; a `None` figure is not known yet.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Measurement {
    /// Bytes of the weights (what a host-RAM park copies).
    pub weights: Option<Measured>,
    /// GPU memory the engine holds while awake.
    pub gpu_memory: Option<Measured>,
}

impl Measurement {
    /// Whether the deployment is still awaiting measurement (no figure known).
    pub fn awaiting(&self) -> bool {
        self.weights.is_none() && self.gpu_memory.is_none()
    }

    /// The weights' bytes, when known (the GPU footprint stands in for them when only it is).
    pub fn weights_bytes(&self) -> Option<u64> {
        self.weights.or(self.gpu_memory).map(|m| m.bytes)
    }

    /// The management API's view, once the GPU memory is known (the weights fall back to it
    /// as in [`Measurement::weights_bytes`]); `source` is the latest-coming source of the two
    /// figures (declared, then measured, then observed).
    pub fn view(&self) -> Option<capyctl_spec::api::MeasurementView> {
        let gpu = self.gpu_memory?;
        let weights = self.weights.unwrap_or(gpu);
        let rank = |s: MeasureSource| match s {
            MeasureSource::Declared => 0,
            MeasureSource::Checkpoint => 1,
            MeasureSource::EngineFootprint => 2,
        };
        let source = if rank(weights.source) >= rank(gpu.source) {
            weights.source
        } else {
            gpu.source
        };
        Some(capyctl_spec::api::MeasurementView {
            gpu_memory: gpu.bytes,
            weights_memory: weights.bytes,
            source: source.api_name().to_string(),
        })
    }
}

/// Where a [`GpuHeld`] figure comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuHeldSource {
    /// The GPU probe's per-process reading of the engine's process tree (NVML).
    Observed,
    /// `capyctl_engine_rules::parked::parked_estimate`: no reading was available.
    Estimated,
}

/// GPU memory a parked engine still holds (DESIGN 4.2: "a sleeping engine still holds some GPU
/// memory: account for it").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuHeld {
    /// Bytes.
    pub bytes: u64,
    /// Read or estimated.
    pub source: GpuHeldSource,
}
