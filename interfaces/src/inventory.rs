//! What the host has, the values: GPUs (UUID, total and free memory, unified or discrete) and
//! host RAM, each replaceable by the host document's `gpus` and `host_memory`. They are read
//! by the node agent (`capyctl_node_agent::inventory`: NVML, `/proc/meminfo`).

use serde::{Deserialize, Serialize};

/// One GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// Its index on the host.
    pub index: u32,
    /// Its UUID, when known.
    pub uuid: Option<String>,
    /// Its name (`NVIDIA H200`), when known.
    pub name: Option<String>,
    /// Total memory in bytes.
    pub total_bytes: u64,
    /// Free memory in bytes, when known.
    pub free_bytes: Option<u64>,
    /// Memory shared with the host (models park deep).
    pub unified: bool,
}

/// Host RAM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostMemory {
    /// Total bytes (`MemTotal`, or the `host_memory` override).
    pub total_bytes: u64,
    /// Bytes free for new use (`MemAvailable`, or the override).
    pub available_bytes: u64,
    /// The figures come from the host document's `host_memory`.
    pub overridden: bool,
}

/// What the host has.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inventory {
    /// The GPUs.
    pub gpus: Vec<GpuInfo>,
    /// The GPUs come from the host document's `gpus`.
    pub gpus_overridden: bool,
    /// Host RAM.
    pub host_memory: HostMemory,
}

impl Inventory {
    /// Whether any GPU has unified memory; false without GPUs.
    pub fn unified_memory(&self) -> bool {
        self.gpus.iter().any(|g| g.unified)
    }

    /// Whether the GPUs an engine uses have unified memory, given its `CUDA_VISIBLE_DEVICES`
    /// (`visible`): true when any GPU it names is unified. GPUs are named by UUID (`GPU-…`, as
    /// NVML reports them) or by index. Without the variable, or when it names a GPU this
    /// inventory does not know, any unified GPU counts ([`Inventory::unified_memory`]): a deep
    /// park is right on either kind of card, a host-RAM park on unified memory is not.
    ///
    /// NB: an index is matched with NVML's (PCI bus) order, which is CUDA's with
    /// `CUDA_DEVICE_ORDER=PCI_BUS_ID`; on mixed machines name GPUs by UUID.
    pub fn unified_for(&self, visible: Option<&str>) -> bool {
        match self.gpus_named(visible) {
            Some(used) => used.iter().any(|g| g.unified),
            None => self.unified_memory(),
        }
    }

    /// The GPUs a `CUDA_VISIBLE_DEVICES` value (`visible`) names, by UUID or index (see
    /// [`Inventory::unified_for`]); `None` without the variable, or when it names a GPU this
    /// inventory does not know (the caller decides what that means).
    pub fn gpus_named(&self, visible: Option<&str>) -> Option<Vec<&GpuInfo>> {
        let visible = visible.map(str::trim).filter(|v| !v.is_empty())?;
        visible
            .split(',')
            .map(str::trim)
            .map(|name| match name.parse::<u32>() {
                Ok(index) => self.gpus.iter().find(|g| g.index == index),
                Err(_) => self.gpus.iter().find(|g| {
                    g.uuid
                        .as_deref()
                        .is_some_and(|u| u.eq_ignore_ascii_case(name))
                }),
            })
            .collect()
    }
}
