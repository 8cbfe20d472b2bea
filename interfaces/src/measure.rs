//! Measurement: how many bytes the weights are and how much GPU memory the engine holds.
//!
//! Sources, in order: the deployment's declared `resources`; the checkpoint's safetensors
//! headers when the model is a local directory (weights only); the engine's GPU footprint after
//! a first start, summed over the engine's process tree (vLLM and SGLang hold GPU memory in
//! worker processes), read through a [`GpuProbe`]. A figure no source gives stays unknown: the
//! deployment is then awaiting measurement.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::checkpoint::checkpoint_size;
use crate::error::AgentError;
use crate::inventory::GpuProbe;
use crate::spec::InstanceSpec;

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

/// What can be measured before a start: declared resources, then the checkpoint's headers.
/// Blocking (reads files): call it from `spawn_blocking` in async code.
pub fn measure_before_start(spec: &InstanceSpec) -> Result<Measurement, AgentError> {
    let declared = |b: Option<u64>| {
        b.map(|bytes| Measured {
            bytes,
            source: MeasureSource::Declared,
        })
    };
    let mut m = Measurement {
        weights: declared(spec.resources.weights_memory),
        gpu_memory: declared(spec.resources.gpu_memory),
    };
    if m.weights.is_none() {
        let dir = Path::new(&spec.model);
        if dir.is_dir()
            && let Some(size) = checkpoint_size(dir)?
        {
            m.weights = Some(Measured {
                bytes: size.weights_bytes,
                source: MeasureSource::Checkpoint,
            });
        }
    }
    Ok(m)
}

/// The GPU memory process `pid` and its descendants hold, as `probe` reads it; `None` when it
/// reads nothing for any of them. Pid 0 is no process (an engine in a Pod): `None`. A probe
/// that reads no process (no NVML) answers `None` without the walk of `/proc` that finds the
/// descendants (every process's `stat`: about a millisecond on a host of 90 processes, and it
/// runs between a park's engine call and the switch's wake).
pub fn footprint(probe: &dyn GpuProbe, pid: u32) -> Option<u64> {
    if pid == 0 || !probe.reads_processes() {
        return None;
    }
    process_tree(pid)
        .into_iter()
        .filter_map(|p| probe.process_gpu_memory(p))
        .reduce(|a, b| a.saturating_add(b))
}

/// Adds the engine's footprint (process `pid` and its descendants) where GPU memory is unknown.
/// Pid 0 is no process (an engine in a Pod, `PodRuntime`): nothing is added.
pub fn add_footprint(m: Measurement, probe: &dyn GpuProbe, pid: u32) -> Measurement {
    if m.gpu_memory.is_some() {
        return m;
    }
    Measurement {
        gpu_memory: footprint(probe, pid).map(|bytes| Measured {
            bytes,
            source: MeasureSource::EngineFootprint,
        }),
        ..m
    }
}

/// Where a [`GpuHeld`] figure comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuHeldSource {
    /// The GPU probe's per-process reading of the engine's process tree (NVML).
    Observed,
    /// [`parked_estimate`]: no reading was available.
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

/// The most a parked engine is estimated to keep besides its weights: a CUDA context with its
/// graphs and allocator pools.
pub const PARKED_RESIDUE_CAP: u64 = 512 * 1024 * 1024;

/// What a parked engine is estimated to hold when nothing reads it: its residue (CUDA
/// context, CUDA graphs, allocator pools) on each of its `workers` GPUs (its tensor-parallel
/// size; 0 counts as 1), taken as a quarter of that GPU's share of the weights up to
/// [`PARKED_RESIDUE_CAP`], plus the weights themselves for a KV-only park (they stay on the
/// GPUs). `None` when the weights are unknown.
///
/// NB: the justification: a CUDA context alone takes a few hundred MiB per process on current
/// GPUs, and vLLM's and SGLang's sleeping engines keep it with their graphs and pools; small
/// models capture small graphs, hence the quarter of the weights below the cap. It is the
/// model the engine simulator follows (`ENGINE_SIM_SLEEP_RESIDUE_BYTES`). A tensor-parallel
/// engine runs one worker process per GPU, each with its own context, graphs and pools, hence
/// a residue per GPU. An observed reading, where NVML is there, is always preferred.
pub fn parked_estimate(
    weights_bytes: Option<u64>,
    weights_stay: bool,
    workers: u32,
) -> Option<u64> {
    let weights = weights_bytes?;
    let workers = u64::from(workers.max(1));
    let residue = (weights / workers / 4)
        .min(PARKED_RESIDUE_CAP)
        .saturating_mul(workers);
    Some(if weights_stay {
        residue.saturating_add(weights)
    } else {
        residue
    })
}

/// `pid` and all its descendants, from `/proc/*/stat`; just `pid` where `/proc` is unreadable.
pub fn process_tree(pid: u32) -> Vec<u32> {
    let mut parents: Vec<(u32, u32)> = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(p) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            if let Some(ppid) = std::fs::read_to_string(format!("/proc/{p}/stat"))
                .ok()
                .and_then(|s| parse_ppid(&s))
            {
                parents.push((p, ppid));
            }
        }
    }
    let mut tree = vec![pid];
    let mut i = 0;
    while i < tree.len() {
        let parent = tree[i];
        tree.extend(
            parents
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    tree
}

/// The parent pid from a `/proc/<pid>/stat` line (the field after the `(comm)` and the state).
pub fn parse_ppid(stat: &str) -> Option<u32> {
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn a_parked_engine_is_estimated_to_keep_a_residue_on_each_of_its_gpus() {
        // One GPU: a quarter of the weights, up to the cap; the weights too when they stay.
        assert_eq!(parked_estimate(Some(GIB), false, 1), Some(GIB / 4));
        assert_eq!(
            parked_estimate(Some(16 * GIB), false, 1),
            Some(PARKED_RESIDUE_CAP)
        );
        assert_eq!(
            parked_estimate(Some(16 * GIB), true, 1),
            Some(PARKED_RESIDUE_CAP + 16 * GIB)
        );
        // Tensor-parallel over 4: a worker per GPU, each with its own capped residue.
        assert_eq!(
            parked_estimate(Some(16 * GIB), false, 4),
            Some(4 * PARKED_RESIDUE_CAP)
        );
        // Small weights split over 2: a quarter of each GPU's share, twice.
        assert_eq!(parked_estimate(Some(GIB), false, 2), Some(GIB / 4));
        assert_eq!(
            parked_estimate(Some(GIB), false, 0),
            Some(GIB / 4),
            "0 counts as 1"
        );
        assert_eq!(parked_estimate(None, false, 2), None);
    }
}
