//! What an engine can do: the refusal table, the models an engine cannot wake correctly
//! (`capability_missing:deep_park`; `capyctl_engine_rules::capability`, which the tier rules
//! read too), and the `capyctl engine list` rows (`capyctl_interfaces::capability`'s values),
//! re-exported under the paths they always had here.

pub use capyctl_engine_rules::capability::{
    ModelMatch, REFUSALS, RefusalRow, engine_info, refusal_for,
};
pub use capyctl_interfaces::capability::{DeepPark, EngineInfo};
