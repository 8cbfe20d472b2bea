//! CapyCTL's server: the lifecycle and placement of deployments and instances, the management
//! API, and the standalone assembly (server and one host in one process).
//!
//! - [`api`]: [`api::ManagementApi`], what the management listener asks of the server; the
//!   lifecycle implements it, management tests use a fake.
//! - [`lifecycle`]: the one writer of deployment and instance state; it implements the router's
//!   `Lifecycle`, drives hosts through the node agent's `HostAgent`, and persists through a
//!   [`store::Store`].
//! - [`store`]: where the state lives (a database, `state.redb`, in standalone; CR status on
//!   Kubernetes).
//! - [`management`]: the `/management/v1` listener, its token, health and Prometheus metrics;
//!   [`metrics`]: the metrics themselves.
//! - [`standalone`]: `capyctl start standalone`.
//! - [`k8s`]: the Kubernetes adapter (`capyctl-operator`): CR status, leader election on a
//!   Lease, the reconciler with its finalizer and Events, engine Pods, the CR-backed store.
//!
//! The lifecycle does not know whether it runs under Kubernetes: the store and the host agent
//! are traits. `operator/DESIGN.md` describes the states, who writes what, how a switch flows
//! between router and lifecycle, and persistence and recovery.

pub mod api;
pub mod k8s;
pub mod lifecycle;
pub mod management;
pub mod metrics;
pub mod standalone;
pub mod store;
