//! The engine rules that both the lifecycle and the host agent take, as pure functions with
//! no I/O: the lifecycle plans with them (placement, the parked set's room, the load read) and
//! the node agent acts on them (launch, park). Each rule is written here once; the values they
//! decide on and answer with are `capyctl-interfaces`'.
//!
//! - [`tier`]: how a model parks (host RAM, deep, KV-only) or why it stops instead, and how
//!   much host RAM parked copies may use;
//! - [`capability`]: the refusal table (models an engine cannot wake correctly,
//!   `capability_missing:deep_park`) and the `engine list` rows it gives;
//! - [`max_running`]: how many requests an engine runs at once, and CapyCTL's defaults;
//! - [`parked`]: what a parked engine is estimated to hold in GPU memory;
//! - [`adapters`]: the request field that names a LoRA adapter to the engine, besides `model`.
//!
//! What only the node agent does (the launch command, measurement, checkpoint parsing, the
//! NVML and `/proc` probes) is the node agent's (`capyctl-node-agent`), which re-exports these
//! under the paths they always had there (`capyctl_node_agent::tier`, ...).

pub mod adapters;
pub mod capability;
pub mod max_running;
pub mod parked;
pub mod tier;
