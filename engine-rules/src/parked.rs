//! What a parked engine holds in GPU memory when nothing reads it: the estimate the node agent
//! reports with a park where NVML does not read the engine's processes
//! ([`GpuHeldSource::Estimated`](capyctl_interfaces::measure::GpuHeldSource::Estimated)), and
//! the lifecycle counts, when it plans, for what a model would still hold once parked.

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
