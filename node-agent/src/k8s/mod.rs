//! The node agent on Kubernetes.
//!
//! - [`host`]: publishes this node's `Host` object (server-side apply, field manager
//!   [`host::FIELD_MANAGER`]) at start and whenever it changes;
//! - [`pods`]: [`PodRuntime`](pods::PodRuntime), the `--engine-runtime pod` engine runtime: the
//!   operator creates one engine Pod per running instance on this node, the agent drives the
//!   engine in it over HTTP on the Pod's IP.

pub mod host;
pub mod pods;
