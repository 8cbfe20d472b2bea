//! What the lifecycle, the router and the host agents share, with nothing of how either runs (no HTTP, no
//! command line, no TLS, no Kubernetes): the lifecycle depends on this crate, not on the node
//! agent.
//!
//! - [`agent`]: the [`HostAgent`] trait the lifecycle calls, what its calls answer, and
//!   [`BoxFuture`];
//! - [`spec`]: what an instance is started from ([`spec::InstanceSpec`]) and the host's
//!   settings;
//! - [`inventory`]: GPUs and host RAM (and the NVML probe, feature `nvml`);
//! - [`measure`], [`checkpoint`]: weights and GPU memory;
//! - [`tier`]: how a model parks (host RAM, deep, KV-only) or why it stops instead;
//! - [`launch`]: the engine's command line and its request bound (`max_running`);
//! - [`capability`]: what an engine can do, and the models it cannot wake correctly;
//! - [`verify`]: the first answer and wake outcomes;
//! - [`load`]: load samples;
//! - [`error`]: the errors ([`AgentError`]);
//! - [`interned`]: the values' `&'static str` fields read back from the wire;
//! - [`router`]: the router's interface to the lifecycle ([`router::Lifecycle`]: what the
//!   router asks of it, and the plans, orders and instances they exchange).
//!
//! The pure decisions (tier choice, the bound, measurement) live beside the values they decide
//! on: the lifecycle takes the same ones when it plans (placement, the parked set's room).

pub mod agent;
pub mod capability;
pub mod checkpoint;
pub mod error;
pub mod interned;
pub mod inventory;
pub mod launch;
pub mod load;
pub mod measure;
pub mod router;
pub mod spec;
pub mod tier;
pub mod verify;

pub use agent::HostAgent;

/// A boxed, sendable future: the one of every object-safe trait here ([`HostAgent`],
/// [`router::Lifecycle`]).
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;
pub use error::AgentError;
