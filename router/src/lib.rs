//! CapyCTL's data plane: the OpenAI-compatible listener, the per-deployment waiting queues and
//! the switch coordinator (admission window, drain, waves, limits and deadlines).
//!
//! The router never talks to an engine's control API; it asks the lifecycle through
//! [`capyctl_interfaces::router::Lifecycle`] and forwards traffic to the instances the
//! lifecycle opens.

pub mod admission;
pub mod config;
pub mod coordinator;
mod fast_hash;
pub mod observe;
pub mod proxy;
pub mod tenants;
pub mod tls;
