//! How a model parks (host RAM, deep, KV-only) or why it stops instead: the tier rules
//! (`capyctl_engine_rules::tier`, which the lifecycle reads too) and their values
//! (`capyctl_interfaces::tier`), re-exported under the paths they always had here.

pub use capyctl_engine_rules::tier::{
    TierInput, TierRule, choose_tier, host_ram_for_copies, host_ram_room, launch_parking,
    never_parks, tier_rule,
};
pub use capyctl_interfaces::tier::{LaunchParking, NoParkReason, ParkChoice, ParkTier};
