//! Measurement: how many bytes the weights are and how much GPU memory the engine holds.
//!
//! Sources, in order: the deployment's declared `resources`; the checkpoint's safetensors
//! headers when the model is a local directory (weights only); the engine's GPU footprint after
//! a first start, summed over the engine's process tree (vLLM and SGLang hold GPU memory in
//! worker processes), read through a [`GpuProbe`]. A figure no source gives stays unknown: the
//! deployment is then awaiting measurement.
//!
//! The values ([`Measurement`], [`GpuHeld`]) are `capyctl_interfaces::measure`'s, and the
//! estimate of what a parked engine holds is `capyctl_engine_rules::parked`'s, both re-exported
//! here.

use std::path::Path;

use crate::checkpoint::checkpoint_size;
use crate::error::AgentError;
use crate::inventory::GpuProbe;
use crate::spec::InstanceSpec;

pub use capyctl_engine_rules::parked::{PARKED_RESIDUE_CAP, parked_estimate};
pub use capyctl_interfaces::measure::{
    GpuHeld, GpuHeldSource, MeasureSource, Measured, Measurement,
};

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
