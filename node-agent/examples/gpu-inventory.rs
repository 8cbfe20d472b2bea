//! Prints the host's GPU inventory and host RAM, and the GPU memory NVML reports for one
//! process and its descendants (`--pid N`, e.g. the allocation `scripts/gpu-check.sh` makes).
//!
//! Built with `--features nvml` it reads NVML directly and fails when NVML does not load;
//! without it the inventory has no GPUs.
//!
//! - `--require-gpu`: exit 1 when no GPU is found;
//! - `--pid N`: print what NVML reads for N and its descendants (and, when it reads nothing
//!   for them, every process NVML lists, to tell a PID namespace apart from a missing
//!   allocation);
//! - `--min-bytes B` (with `--pid`): exit 1 when that reading is below B bytes.

use std::process::ExitCode;
use std::sync::Arc;

use capyctl_node_agent::inventory::{GpuProbe, inventory};
use capyctl_node_agent::measure::process_tree;
use capyctl_node_agent::spec::HostSettings;

#[cfg(feature = "nvml")]
fn probe() -> Result<Arc<dyn GpuProbe>, String> {
    let nvml = capyctl_node_agent::inventory::NvmlProbe::new().map_err(|e| e.to_string())?;
    Ok(Arc::new(nvml))
}

#[cfg(not(feature = "nvml"))]
fn probe() -> Result<Arc<dyn GpuProbe>, String> {
    eprintln!("gpu-inventory: built without --features nvml: no GPU is read");
    Ok(Arc::new(capyctl_node_agent::inventory::NoGpus))
}

/// Every process NVML lists, with its memory (diagnosis only).
#[cfg(feature = "nvml")]
fn listed() -> String {
    match capyctl_node_agent::inventory::NvmlProbe::new().and_then(|p| p.compute_processes()) {
        Ok(list) if list.is_empty() => "none".into(),
        Ok(list) => list
            .iter()
            .map(|(pid, bytes)| format!("pid {pid}: {bytes:?} bytes"))
            .collect::<Vec<_>>()
            .join(", "),
        Err(e) => format!("cannot list them: {e}"),
    }
}

#[cfg(not(feature = "nvml"))]
fn listed() -> String {
    "none (built without NVML)".into()
}

fn run() -> Result<bool, String> {
    let mut require_gpu = false;
    let mut pid: Option<u32> = None;
    let mut min_bytes: Option<u64> = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
        match arg.as_str() {
            "--require-gpu" => require_gpu = true,
            "--pid" => {
                let v = value("--pid")?;
                pid = Some(v.parse().map_err(|e| format!("--pid {v}: {e}"))?);
            }
            "--min-bytes" => {
                let v = value("--min-bytes")?;
                min_bytes = Some(v.parse().map_err(|e| format!("--min-bytes {v}: {e}"))?);
            }
            other => return Err(format!("unknown argument {other}; see the file's doc")),
        }
    }
    let probe = probe().map_err(|e| format!("NVML did not load: {e}"))?;
    let inv = inventory(&HostSettings::default(), probe.as_ref()).map_err(|e| e.to_string())?;
    println!(
        "{}",
        serde_json::to_string_pretty(&inv).map_err(|e| e.to_string())?
    );
    let mut ok = true;
    if require_gpu && inv.gpus.is_empty() {
        eprintln!("gpu-inventory: NVML found no GPU");
        ok = false;
    }
    if let Some(pid) = pid {
        let tree = process_tree(pid);
        let mut total = None::<u64>;
        for p in &tree {
            let reading = probe.process_gpu_memory(*p);
            println!("pid {p}: gpu memory {reading:?} bytes");
            if let Some(b) = reading {
                total = Some(total.unwrap_or(0).saturating_add(b));
            }
        }
        match total {
            Some(total) => println!(
                "pid {pid} and descendants: {total} bytes ({} MiB)",
                total / (1024 * 1024)
            ),
            None => {
                println!("pid {pid} and descendants: no reading");
                println!("NVML lists: {}", listed());
            }
        }
        if let Some(min) = min_bytes
            && total.unwrap_or(0) < min
        {
            eprintln!(
                "gpu-inventory: pid {pid} holds {} bytes by NVML, expected at least {min}",
                total.unwrap_or(0)
            );
            ok = false;
        }
    }
    Ok(ok)
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("gpu-inventory: {e}");
            ExitCode::from(2)
        }
    }
}
