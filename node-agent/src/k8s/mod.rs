//! The node agent on Kubernetes.
//!
//! - [`api`]: the timeout and the observer on every call to the API server (also used by the
//!   operator);
//! - [`host`]: publishes this node's `Host` object (server-side apply, field manager
//!   [`host::FIELD_MANAGER`]) at start and whenever it changes, with a `Ready` condition in its
//!   status while the agent serves, owned by the node's `Node`;
//! - [`pods`]: [`PodRuntime`](pods::PodRuntime), the `--engine-runtime pod` engine runtime: the
//!   operator creates one engine Pod per running instance on this node, the agent drives the
//!   engine in it over HTTP on the Pod's IP.

pub mod api;
pub mod host;
pub mod pods;
