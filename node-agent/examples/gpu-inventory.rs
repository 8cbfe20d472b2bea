//! Prints the host's GPU inventory and host RAM, and the GPU memory NVML reports for one
//! process (`--pid N`, e.g. a python allocation started by `scripts/gpu-check.sh`).
//!
//! Build with `--features nvml` to read NVML; without it the inventory has no GPUs.

use std::sync::Arc;

use capyctl_node_agent::inventory::{GpuProbe, default_probe, inventory};
use capyctl_node_agent::measure::process_tree;
use capyctl_node_agent::spec::HostSettings;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let probe: Arc<dyn GpuProbe> = default_probe();
    let inv = inventory(&HostSettings::default(), probe.as_ref())?;
    println!("{}", serde_json::to_string_pretty(&inv)?);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--pid" {
            let pid: u32 = args.next().ok_or("--pid needs a value")?.parse()?;
            let tree = process_tree(pid);
            for p in &tree {
                println!(
                    "pid {p}: gpu memory {:?} bytes",
                    probe.process_gpu_memory(*p)
                );
            }
            let total: u64 = tree
                .iter()
                .filter_map(|p| probe.process_gpu_memory(*p))
                .sum();
            println!("pid {pid} and descendants: {total} bytes");
        }
    }
    Ok(())
}
