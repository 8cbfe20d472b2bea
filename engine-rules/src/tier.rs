//! How a model parks: the tier choice of the product page, as pure functions.
//!
//! - discrete card → host RAM ([`ParkTier::HostRam`]); deep when the copy does not fit in the
//!   room left in host RAM (free host memory minus the other parked copies);
//! - unified memory → deep;
//! - SGLang with `--speculative-algorithm` → KV cache only ([`ParkTier::KvOnly`]); `residency:
//!   host_backed` is refused for it;
//! - `residency` chooses: `host_backed` (discrete cards only; refused on unified memory),
//!   `deep`, `restart_only` (never parks);
//! - TensorFold never parks; decision models restart instead of parking in this release;
//! - models of the refusal table are refused (`capability_missing:deep_park`).
//!
//! NB (SGLang): a host-RAM park needs `--enable-weights-cpu-backup` at launch, and with it SGLang
//! always copies released weights to host RAM. So SGLang's tier is fixed at launch
//! ([`LaunchParking`]): launched with the backup it parks in host RAM, and when the copy no
//! longer fits at park time it is stopped (no room to park) rather than parked deep; launched
//! without it, it parks deep. vLLM chooses its sleep level at every park.
//!
//! NB (unknown size): a copy whose size is unknown does not fit. A hub model with nothing
//! declared (`resources`) and no local checkpoint to read has no known size at its first
//! start, so a first SGLang start goes without the backup and that engine parks deep for its
//! whole life. The agent learns the engine's GPU footprint at that start (where NVML reads it)
//! and keeps it, also in the pid record; the footprint stands in for the weights (an
//! overestimate: it includes the KV cache), so a later fresh start of the same deployment and
//! model keeps the backup and parks in host RAM when that fits. Declaring
//! `resources.weights_memory` gives the host-RAM tier from the first start.
//!
//! The room in host RAM ([`host_ram_room`]) is the free memory minus the copies of the other
//! parked instances and of the parks under way (whose copy is reserved when their tier is
//! chosen); unified memory is decided by the GPUs the engine uses (`CUDA_VISIBLE_DEVICES`), any
//! unified GPU when that is not set.
//!
//! The rule is written once: [`tier_rule`] says where a park goes before the room is looked
//! at (host RAM when the copy fits, or a fixed choice), and [`choose_tier`] adds the room. The
//! lifecycle reads [`tier_rule`], [`never_parks`] and [`host_ram_for_copies`] to stop older
//! parked copies for a new one's room (`capyctl-lifecycle`'s `parked_room`).

use capyctl_interfaces::error::AgentError;
use capyctl_interfaces::inventory::HostMemory;
use capyctl_interfaces::tier::{LaunchParking, NoParkReason, ParkChoice, ParkTier};
use capyctl_spec::engine_args::HOST_BACKED_SPECULATIVE;
use capyctl_spec::{EngineKind, Residency};

use crate::capability::RefusalRow;

/// Everything the tier choice depends on.
#[derive(Debug, Clone, Copy)]
pub struct TierInput {
    /// The engine.
    pub engine: EngineKind,
    /// The deployment's `residency`.
    pub residency: Option<Residency>,
    /// SGLang with `--speculative-algorithm` in `extra_args`.
    pub speculative: bool,
    /// A decision model (`decision:` set).
    pub decision_model: bool,
    /// The GPU shares memory with the host.
    pub unified_memory: bool,
    /// Size of the weights (the copy a host-RAM park makes); unknown = does not fit.
    pub weights_bytes: Option<u64>,
    /// Room in host RAM for the copy: free host memory minus the other parked copies.
    pub host_room: Option<u64>,
    /// The refusal table's row for this model, if any (see [`crate::capability::refusal_for`]).
    pub refusal: Option<&'static RefusalRow>,
    /// How the engine was launched; `None` before launch.
    pub launched: Option<LaunchParking>,
}

/// The tier choice before the copy's size and the room in host RAM are looked at: the one
/// place where the page's rule says which parks go to host RAM. [`choose_tier`] finishes it
/// with the room; the lifecycle reads it to know whether a park needs room in host RAM (and
/// makes that room, stopping older parked copies, before the park).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TierRule {
    /// This choice, whatever the room in host RAM.
    Fixed(ParkChoice),
    /// Host RAM when the copy is known and fits in the room left there; `otherwise` when not.
    HostRamIfFits {
        /// Deep (a discrete card's default), or stopped (no room to park) for `residency:
        /// host_backed` and for SGLang launched with its CPU backup (it cannot park deep).
        otherwise: ParkChoice,
    },
}

impl TierRule {
    /// The park goes to host RAM when its copy fits there.
    pub fn host_ram_if_fits(self) -> bool {
        matches!(self, TierRule::HostRamIfFits { .. })
    }

    /// The choice, given whether the copy fits in the room left in host RAM.
    pub fn with_room(self, fits: bool) -> ParkChoice {
        match self {
            TierRule::Fixed(choice) => choice,
            TierRule::HostRamIfFits { .. } if fits => ParkChoice::Park(ParkTier::HostRam),
            TierRule::HostRamIfFits { otherwise } => otherwise,
        }
    }
}

/// Why a model of `input` never parks, whatever the host and the room: `residency:
/// restart_only`, TensorFold, or a decision model. Reads only `residency`, `engine` and
/// `decision_model`.
pub fn never_parks(input: &TierInput) -> Option<NoParkReason> {
    if input.residency == Some(Residency::RestartOnly) {
        Some(NoParkReason::RestartOnly)
    } else if input.engine == EngineKind::Tensorfold {
        Some(NoParkReason::EngineDoesNotPark)
    } else if input.decision_model {
        Some(NoParkReason::DecisionModel)
    } else {
        None
    }
}

/// The tier rule of `input` (see the module doc and [`TierRule`]); reads neither
/// `weights_bytes` nor `host_room`. Errors: `residency` refused, or
/// `capability_missing:deep_park`.
pub fn tier_rule(input: &TierInput) -> Result<TierRule, AgentError> {
    use ParkChoice::{Park, Stop};
    use TierRule::{Fixed, HostRamIfFits};
    if let Some(reason) = never_parks(input) {
        return Ok(Fixed(Stop(reason)));
    }
    let speculative = input.speculative && input.engine == EngineKind::Sglang;
    if input.residency == Some(Residency::HostBacked) {
        if speculative {
            return Err(AgentError::ResidencyRefused {
                reason: format!("residency: {HOST_BACKED_SPECULATIVE}"),
            });
        }
        if input.unified_memory {
            return Err(AgentError::ResidencyRefused {
                reason: "residency: host_backed needs a discrete card; this GPU has unified memory"
                    .to_string(),
            });
        }
    }
    if let Some(row) = input.refusal {
        return Err(AgentError::CapabilityMissing { reason: row.reason });
    }
    if speculative {
        return Ok(Fixed(Park(ParkTier::KvOnly)));
    }
    let sglang_backup = match input.launched {
        Some(l) if input.engine == EngineKind::Sglang => Some(l.host_ram),
        _ => None,
    };
    let host_backed = input.residency == Some(Residency::HostBacked);
    Ok(
        if input.residency == Some(Residency::Deep) || input.unified_memory {
            // SGLang with the backup always copies: it cannot park deep.
            Fixed(match sglang_backup {
                Some(true) => Stop(NoParkReason::NoRoomToPark),
                _ => Park(ParkTier::Deep),
            })
        } else if sglang_backup == Some(false) {
            // Launched without the backup: its weights can only be dropped.
            Fixed(if host_backed {
                Stop(NoParkReason::NoRoomToPark)
            } else {
                Park(ParkTier::Deep)
            })
        } else {
            HostRamIfFits {
                otherwise: if host_backed || sglang_backup == Some(true) {
                    Stop(NoParkReason::NoRoomToPark)
                } else {
                    Park(ParkTier::Deep)
                },
            }
        },
    )
}

/// The tier choice (see the module doc): [`tier_rule`], with the copy fitting when its size is
/// known and at most the room left. Errors: `residency` refused, or
/// `capability_missing:deep_park`.
pub fn choose_tier(input: &TierInput) -> Result<ParkChoice, AgentError> {
    let fits = matches!((input.weights_bytes, input.host_room), (Some(w), Some(room)) if w <= room);
    Ok(tier_rule(input)?.with_room(fits))
}

/// Host RAM that parked copies may use, counting the `held` bytes of the copies already made
/// as free: the `host_memory` override (which the copies made are taken from; it is both the
/// total and the available figure), or `MemAvailable` (which already excludes the copies
/// made) plus `held`. What a copy larger than it never fits in, whatever is stopped.
pub fn host_ram_for_copies(memory: &HostMemory, held: u64) -> u64 {
    if memory.overridden {
        memory.total_bytes
    } else {
        memory.available_bytes.saturating_add(held)
    }
}

/// Room in host RAM for one more copy: [`host_ram_for_copies`] less the `held` bytes of the
/// copies already made and the `copying` bytes of the copies being made now (reserved when
/// their tier is chosen).
pub fn host_ram_room(memory: &HostMemory, held: u64, copying: u64) -> u64 {
    host_ram_for_copies(memory, held)
        .saturating_sub(held)
        .saturating_sub(copying)
}

/// How to launch the engine so that the tier chosen now is possible: whether it may park, and
/// (SGLang) whether to keep a CPU backup of the weights. A refused residency or a refusal-table
/// model launches unable to park; parking it is then refused with the error of
/// [`choose_tier`].
pub fn launch_parking(input: &TierInput) -> LaunchParking {
    let before_launch = TierInput {
        launched: None,
        ..*input
    };
    match choose_tier(&before_launch) {
        Ok(ParkChoice::Park(tier)) => LaunchParking {
            may_park: true,
            host_ram: tier == ParkTier::HostRam,
        },
        // `host_backed` without room now: it may still park once room appears (vLLM); SGLang's
        // backup is launched anyway so that `host_backed` is honoured when room appears.
        Ok(ParkChoice::Stop(NoParkReason::NoRoomToPark)) => LaunchParking {
            may_park: true,
            host_ram: true,
        },
        Ok(ParkChoice::Stop(_)) | Err(_) => LaunchParking::default(),
    }
}
