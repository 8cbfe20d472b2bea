//! The node agent on Kubernetes.
//!
//! (Every call to the API server goes through `capyctl_crds::api_client`, the operator's too.)
//! - [`host`]: publishes this node's `Host` object (server-side apply, field manager
//!   [`host::FIELD_MANAGER`]) at start and whenever it changes, with a `Ready` condition in its
//!   status while the agent serves, owned by the node's `Node`;
//! - [`pods`]: [`PodRuntime`](pods::PodRuntime), the `--engine-runtime pod` engine runtime: the
//!   operator creates one engine Pod per running instance on this node, the agent drives the
//!   engine in it over HTTP on the Pod's IP.

pub mod host;
pub mod pods;
