//! CapyCTL's host agent: everything that touches an engine or the host's hardware.
//!
//! - [`launch`]: the engine's command line and environment, and `max_running`;
//! - [`tier`]: how a model parks (host RAM, deep, KV-only) or why it stops instead;
//! - [`capability`]: the models an engine cannot wake correctly (`capability_missing:deep_park`)
//!   and the `engine list` rows;
//! - [`driver`]: readiness, park and wake sequences, the check prompt, load scrapes;
//! - [`verify`]: the first answer, wake comparison and outcomes;
//! - [`measure`], [`checkpoint`], [`inventory`]: weights and GPU memory, GPUs and host RAM
//!   (the NVML and `/proc` probes);
//! - [`error`]: [`AgentError`], and the engine's own error line in a failed start;
//! - [`spec`]: what an instance is started from and the host's settings;
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
//! functions tested without processes; the rest is tested against the engine simulator. The
//! values the lifecycle shares (`capyctl-interfaces`) and the rules it takes too
//! (`capyctl-engine-rules`: tier, refusals, `max_running`, the parked estimate) are re-exported
//! in these modules under the paths they always had here.

pub mod agent;
pub mod capability;
pub mod checkpoint;
#[cfg(feature = "kubernetes")]
pub mod cli;
pub mod driver;
pub mod error;
#[doc(hidden)]
pub mod fuzz;
pub mod http;
pub mod inventory;
#[cfg(feature = "kubernetes")]
pub mod k8s;
pub mod launch;
pub mod load;
pub mod measure;
pub mod process;
pub mod recovery;
pub mod remote;
pub mod runtime;
pub mod sim_host;
pub mod spec;
pub mod tier;
pub mod verify;

pub use agent::{AgentConfig, EngineExit, HostAgent, LocalHostAgent};
pub use error::AgentError;
pub use remote::RemoteHostAgent;
pub use sim_host::SimHost;
