//! What the host has: GPUs (UUID, total and free memory, unified or discrete) and host RAM,
//! each replaceable by the host document's `gpus` and `host_memory`, read through a
//! [`GpuProbe`]: NVML with the `nvml` feature ([`NvmlProbe`]), none without ([`NoGpus`]). The
//! same probe reads an engine's GPU footprint (per-process memory), which is the last source of
//! a measurement.
//!
//! The values ([`Inventory`], [`GpuInfo`], [`HostMemory`]) are `capyctl_interfaces::inventory`'s,
//! re-exported here.

use crate::error::AgentError;
use crate::spec::HostSettings;

pub use capyctl_interfaces::inventory::{GpuInfo, HostMemory, Inventory};

/// Reads GPUs and per-process GPU memory.
pub trait GpuProbe: Send + Sync {
    /// The GPUs of this host.
    fn gpus(&self) -> Result<Vec<GpuInfo>, AgentError>;
    /// GPU memory in bytes held by process `pid` over all GPUs; `None` when unknown.
    fn process_gpu_memory(&self, pid: u32) -> Option<u64>;
    /// `false` when [`GpuProbe::process_gpu_memory`] is `None` for every process, so that a
    /// footprint need not look for an engine's processes at all (a walk of `/proc`, on the
    /// park's path: [`crate::measure::footprint`]).
    fn reads_processes(&self) -> bool {
        true
    }
}

/// A probe for hosts without NVML: no GPUs, no footprint (measurements from a first start
/// stay "awaiting measurement").
#[derive(Debug, Clone, Copy, Default)]
pub struct NoGpus;

impl GpuProbe for NoGpus {
    fn gpus(&self) -> Result<Vec<GpuInfo>, AgentError> {
        Ok(Vec::new())
    }

    fn process_gpu_memory(&self, _pid: u32) -> Option<u64> {
        None
    }

    fn reads_processes(&self) -> bool {
        false
    }
}

/// The default probe: NVML with the `nvml` feature when it initialises, else [`NoGpus`].
///
/// NB: when NVML was built in but does not load, this also writes one line to stderr, not
/// only a log line: binaries call it once at start (standalone, the node agent), and a host
/// that silently has no GPU inventory cannot measure engines from their footprint.
pub fn default_probe() -> std::sync::Arc<dyn GpuProbe> {
    #[cfg(feature = "nvml")]
    {
        match NvmlProbe::new() {
            Ok(p) => return std::sync::Arc::new(p),
            Err(e) => {
                tracing::warn!(error = %e, "NVML unavailable; no GPU inventory");
                eprintln!("{}", nvml_unavailable(&e));
            }
        }
    }
    std::sync::Arc::new(NoGpus)
}

/// The line [`default_probe`] writes to stderr when NVML does not load.
#[cfg(feature = "nvml")]
pub fn nvml_unavailable(e: &AgentError) -> String {
    format!(
        "capyctl: warning: NVML could not be loaded ({e}); no GPU inventory and no per-process \
         GPU memory: engines are not measured from their footprint. Install the NVIDIA driver \
         (libnvidia-ml.so.1), or declare the GPUs in host.gpus"
    )
}

/// Parses `/proc/meminfo` text: (`MemTotal`, `MemAvailable`) in bytes.
pub fn parse_meminfo(text: &str) -> Option<(u64, u64)> {
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let rest = line.strip_prefix(name)?.trim_start_matches(':').trim();
        let mut parts = rest.split_whitespace();
        let n: u64 = parts.next()?.parse().ok()?;
        match parts.next() {
            Some("kB") => n.checked_mul(1024),
            None => Some(n),
            Some(_) => None,
        }
    };
    Some((field("MemTotal")?, field("MemAvailable")?))
}

/// Host RAM from `/proc/meminfo`, or the `host_memory` override (then available = total).
pub fn host_memory(settings: &HostSettings) -> Result<HostMemory, AgentError> {
    if let Some(bytes) = settings.host_memory {
        return Ok(HostMemory {
            total_bytes: bytes,
            available_bytes: bytes,
            overridden: true,
        });
    }
    let text = std::fs::read_to_string("/proc/meminfo")
        .map_err(|e| AgentError::io("read /proc/meminfo", e))?;
    let (total, available) = parse_meminfo(&text).ok_or_else(|| AgentError::Io {
        what: "read /proc/meminfo".into(),
        source: std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "no MemTotal / MemAvailable in kB",
        ),
    })?;
    Ok(HostMemory {
        total_bytes: total,
        available_bytes: available,
        overridden: false,
    })
}

/// The inventory: the probe's GPUs unless the host document declares `gpus`, and host RAM.
pub fn inventory(settings: &HostSettings, probe: &dyn GpuProbe) -> Result<Inventory, AgentError> {
    let (gpus, gpus_overridden) = match &settings.gpus {
        Some(declared) => (
            declared
                .iter()
                .zip(0u32..)
                .map(|(g, index)| GpuInfo {
                    index,
                    uuid: g.uuid.clone(),
                    name: None,
                    total_bytes: g.memory,
                    free_bytes: None,
                    unified: g.unified,
                })
                .collect(),
            true,
        ),
        None => (probe.gpus()?, false),
    };
    Ok(Inventory {
        gpus,
        gpus_overridden,
        host_memory: host_memory(settings)?,
    })
}

/// GPU names of boards whose memory is the host's (NVML reports no framebuffer of their own).
#[cfg(feature = "nvml")]
const UNIFIED_BOARDS: [&str; 4] = ["GB10", "Orin", "Thor", "Jetson"];

/// NVML: GPUs and per-process memory. Loads `libnvidia-ml` at run time.
#[cfg(feature = "nvml")]
pub struct NvmlProbe {
    nvml: nvml_wrapper::Nvml,
}

#[cfg(feature = "nvml")]
impl std::fmt::Debug for NvmlProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NvmlProbe")
    }
}

#[cfg(feature = "nvml")]
impl NvmlProbe {
    /// Initialises NVML.
    pub fn new() -> Result<Self, AgentError> {
        let nvml = nvml_wrapper::Nvml::init().map_err(|source| AgentError::Nvml {
            what: "init (is the NVIDIA driver installed?)".into(),
            source,
        })?;
        Ok(Self { nvml })
    }
}

#[cfg(feature = "nvml")]
impl NvmlProbe {
    /// How many GPUs NVML sees.
    fn device_count(&self) -> Result<u32, AgentError> {
        self.nvml.device_count().map_err(|source| AgentError::Nvml {
            what: "device count".into(),
            source,
        })
    }

    /// Every compute process NVML lists on every GPU, with the memory it uses there (`None`
    /// where NVML does not say); a GPU that cannot list its processes is skipped. A process on
    /// two GPUs is listed twice. NB: NVML lists host pids; inside a container with its own PID
    /// namespace they differ from the container's.
    pub fn compute_processes(&self) -> Result<Vec<(u32, Option<u64>)>, AgentError> {
        use nvml_wrapper::enums::device::UsedGpuMemory;
        let count = self.device_count()?;
        let mut list = Vec::new();
        for index in 0..count {
            let Ok(processes) = self
                .nvml
                .device_by_index(index)
                .and_then(|d| d.running_compute_processes())
            else {
                continue;
            };
            list.extend(processes.iter().map(|p| {
                let bytes = match p.used_gpu_memory {
                    UsedGpuMemory::Used(bytes) => Some(bytes),
                    UsedGpuMemory::Unavailable => None,
                };
                (p.pid, bytes)
            }));
        }
        Ok(list)
    }
}

#[cfg(feature = "nvml")]
impl GpuProbe for NvmlProbe {
    fn gpus(&self) -> Result<Vec<GpuInfo>, AgentError> {
        use nvml_wrapper::error::NvmlError;
        let count = self.device_count()?;
        let mut gpus = Vec::new();
        for index in 0..count {
            let device = self
                .nvml
                .device_by_index(index)
                .map_err(|source| AgentError::Nvml {
                    what: format!("GPU {index}"),
                    source,
                })?;
            let name = device.name().ok();
            let uuid = device.uuid().ok();
            let board_unified = name
                .as_deref()
                .is_some_and(|n| UNIFIED_BOARDS.iter().any(|b| n.contains(b)));
            let (total, free, unified) = match device.memory_info() {
                Ok(m) => (m.total, Some(m.free), board_unified),
                // Unified-memory boards have no framebuffer of their own.
                Err(NvmlError::NotSupported) => {
                    let host = std::fs::read_to_string("/proc/meminfo")
                        .ok()
                        .and_then(|t| parse_meminfo(&t));
                    (host.map(|h| h.0).unwrap_or(0), host.map(|h| h.1), true)
                }
                Err(source) => {
                    return Err(AgentError::Nvml {
                        what: format!("memory info of GPU {index}"),
                        source,
                    });
                }
            };
            gpus.push(GpuInfo {
                index,
                uuid,
                name,
                total_bytes: total,
                free_bytes: free,
                unified,
            });
        }
        Ok(gpus)
    }

    fn process_gpu_memory(&self, pid: u32) -> Option<u64> {
        let processes = self.compute_processes().ok()?;
        processes
            .iter()
            .filter(|(p, _)| *p == pid)
            .filter_map(|(_, bytes)| *bytes)
            .reduce(u64::saturating_add)
    }
}
