//! The traits between the lifecycle, the router and the host agents ([`HostAgent`],
//! [`router::Lifecycle`], [`router::Router`]), their values and one [`BoxFuture`], with nothing
//! of how either side runs (no HTTP, no command line, no TLS, no Kubernetes): the lifecycle
//! depends on this crate, not on the node agent or the router.
//!
//! - [`agent`]: the [`HostAgent`] trait the lifecycle calls, what its calls answer, and
//!   [`BoxFuture`];
//! - [`spec`]: what an instance is started from ([`spec::InstanceSpec`]) and the host's
//!   settings;
//! - [`inventory`]: GPUs and host RAM;
//! - [`measure`]: weights and GPU memory, and what a parked engine still holds;
//! - [`tier`]: where a park goes (host RAM, deep, KV-only) or why a model stops instead;
//! - [`launch`]: how many requests an engine runs at once (`max_running`) and whence;
//! - [`capability`]: the `engine list` rows;
//! - [`verify`]: the first answer and wake outcomes;
//! - [`load`]: load samples;
//! - [`error`]: the errors ([`AgentError`]);
//! - [`interned`]: the values' `&'static str` fields read back from the wire;
//! - [`router`]: the router's interface to the lifecycle ([`router::Lifecycle`]: what the
//!   router asks of it, and the plans, orders and instances they exchange);
//! - [`tenants`]: the inference listener's tenants and the table they are handed to.
//!
//! Values only, with their accessors and conversions: no decision and no probe. The rules the
//! lifecycle and the node agent both take (the tier rule and the refusal table, `max_running`,
//! the parked estimate) are `capyctl-engine-rules`'; what only the node agent does (the launch
//! command, measurement, checkpoint parsing, the NVML and `/proc` probes, wake checks, metrics
//! parsing) is `capyctl-node-agent`'s.

pub mod agent;
pub mod capability;
pub mod error;
pub mod interned;
pub mod inventory;
pub mod launch;
pub mod load;
pub mod measure;
pub mod router;
pub mod spec;
pub mod tenants;
pub mod tier;
pub mod verify;

pub use agent::HostAgent;

/// A boxed, sendable future: the one of every object-safe trait here ([`HostAgent`],
/// [`router::Lifecycle`]).
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;
pub use error::AgentError;
