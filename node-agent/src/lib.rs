//! CapyCTL's host agent: everything that touches an engine or the host's hardware.
//!
//! - [`launch`]: the engine's command line and environment, and `max_running`;
//! - [`tier`]: how a model parks (host RAM, deep, KV-only) or why it stops instead;
//! - [`capability`]: the models an engine cannot wake correctly (`capability_missing:deep_park`)
//!   and the `engine list` rows;
//! - [`driver`]: readiness, park and wake sequences, the check prompt, load scrapes;
//! - [`verify`]: the first answer, wake comparison and outcomes;
//! - [`measure`], [`checkpoint`], [`inventory`]: weights and GPU memory, GPUs and host RAM;
//! - [`load`]: load samples from the engines' metrics;
//! - [`runtime`]: the [`EngineRuntime`](runtime::EngineRuntime) seam between the agent and how
//!   engines run;
//! - [`process`]: engines as child processes with pid records, adopted after a restart;
//! - [`recovery`]: what a restarted agent does with an engine left alive (adopt ready, adopt
//!   parked, or stop);
//! - [`agent`]: the [`HostAgent`] trait the lifecycle calls and [`LocalHostAgent`];
//! - [`remote`]: the node agent's HTTP server and [`RemoteHostAgent`], its client;
//! - [`sim_host`]: [`SimHost`], a host whose engines are simulated (`capyctl simulate` and the
//!   tests);
//! - `k8s`: the node agent on Kubernetes: its `Host` object and engine Pods;
//! - `cli`: the `capyctl-node-agent` program (also `capyctl start host`).
//!
//! `k8s` and `cli` come with the `kubernetes` feature (on by default); without it this crate is
//! the host agent as a library, with no kube in its dependency tree (the lifecycle uses it so).
//!
//! Pure decisions (launch arguments, tier, refusals, `max_running`, comparisons) are plain
//! functions tested without processes; the rest is tested against the engine simulator.

pub mod agent;
#[cfg(feature = "kubernetes")]
pub mod cli;
pub mod driver;
#[doc(hidden)]
pub mod fuzz;
pub mod http;
#[cfg(feature = "kubernetes")]
pub mod k8s;
pub mod load;
pub mod process;
pub mod recovery;
pub mod remote;
pub mod runtime;
pub mod sim_host;
pub mod verify;

pub use agent::{AgentConfig, EngineExit, HostAgent, LocalHostAgent};
// The values and pure decisions shared with the lifecycle (`capyctl-interfaces`), under the
// paths they always had here.
pub use capyctl_interfaces::{
    capability, checkpoint, error, inventory, launch, measure, spec, tier,
};
pub use error::AgentError;
pub use remote::RemoteHostAgent;
pub use sim_host::SimHost;
