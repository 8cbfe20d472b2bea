//! The host agent's interface: [`HostAgent`], what the lifecycle asks of a host, and what its
//! calls answer. Its implementations are the node agent's (`LocalHostAgent` on this machine,
//! `RemoteHostAgent` over HTTP) and `SimHost` (`capyctl simulate`, the tests).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, watch};

use crate::capability::EngineInfo;
use crate::error::AgentError;
use crate::inventory::Inventory;
use crate::launch::MaxRunning;
use crate::load::LoadSample;
use crate::measure::{GpuHeld, Measurement};
use crate::spec::InstanceSpec;
use crate::tier::{LaunchParking, NoParkReason, ParkChoice, ParkTier};
use crate::verify::{FirstAnswer, WakeOutcome};

/// The one boxed future (keeps [`HostAgent`] object-safe).
pub use crate::BoxFuture;

/// An instance that became ready.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StartedInstance {
    /// The instance's ID.
    pub instance: String,
    /// The engine's pid.
    pub pid: u32,
    /// Its loopback port.
    pub port: u16,
    /// `http://127.0.0.1:<port>`: where requests go.
    pub base_url: String,
    /// The engine's version, as it reports it.
    pub version: Option<String>,
    /// The measurement, with the engine's footprint where it was unknown.
    pub measurement: Measurement,
    /// The first answer.
    pub first_answer: FirstAnswer,
    /// How many requests it runs at once.
    pub max_running: MaxRunning,
    /// How it was launched for parking.
    pub parking: LaunchParking,
}

/// What a park did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "result")]
pub enum ParkResult {
    /// Parked in `tier`.
    Parked {
        /// The tier.
        tier: ParkTier,
        /// The GPU memory the parked engine still holds (CUDA context, graphs, pools; the
        /// weights too for a KV-only park): the probe's reading of the engine's processes,
        /// else an estimate (`capyctl_engine_rules::parked::parked_estimate`); `None` when
        /// neither is known.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        gpu_held: Option<GpuHeld>,
    },
    /// Stopped instead (`released: stopped (no room to park)` for [`NoParkReason::NoRoomToPark`]).
    Stopped {
        /// Why.
        reason: NoParkReason,
    },
}

impl ParkResult {
    /// The tier it parked in; `None` when it was stopped.
    pub fn tier(&self) -> Option<ParkTier> {
        match self {
            ParkResult::Parked { tier, .. } => Some(*tier),
            ParkResult::Stopped { .. } => None,
        }
    }

    /// The GPU memory the parked engine still holds, when parked and known.
    pub fn gpu_held(&self) -> Option<GpuHeld> {
        match self {
            ParkResult::Parked { gpu_held, .. } => *gpu_held,
            ParkResult::Stopped { .. } => None,
        }
    }
}

/// How a wake went. On any failure the engine has been stopped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WakeReport {
    /// The outcome.
    pub outcome: WakeOutcome,
    /// How long it took.
    pub took: Duration,
    /// How long its last part, the wake check (the answer compared with the first one, the
    /// warm-up), took; `None` when it did not get there or the agent does not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checked: Option<Duration>,
}

impl WakeReport {
    /// `Ok` for a pass; the `wake_*` error otherwise.
    pub fn into_result(self) -> Result<(), AgentError> {
        match self.outcome.failure() {
            None => Ok(()),
            Some(failure) => Err(AgentError::WakeFailed {
                failure,
                detail: self.outcome.detail().to_string(),
            }),
        }
    }
}

/// An engine a previous run left behind, adopted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdoptedInstance {
    /// The instance's ID.
    pub instance: String,
    /// The deployment it runs.
    pub spec: InstanceSpec,
    /// `http://127.0.0.1:<port>`.
    pub base_url: String,
    /// The pid.
    pub pid: u32,
    /// Parked in this tier, or awake.
    pub parked: Option<ParkTier>,
    /// While parked: the GPU memory it still holds, as recorded at its park.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_held: Option<GpuHeld>,
}

/// What a recovery did. `adopted` also lists the engines the agent already drove before the
/// call (a second recovery, by a restarted caller, learns every live engine).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RecoveryReport {
    /// Adopted engines.
    pub adopted: Vec<AdoptedInstance>,
    /// Instances whose engine was alive but not adopted: it did not answer, or was not where
    /// its record says (the node agent's `recovery`): stopped.
    pub stopped: Vec<String>,
    /// Instances whose engine was gone: record removed.
    pub gone: Vec<String>,
}

/// An engine that exited without the agent stopping it (a crash, an OOM kill, a signal from
/// elsewhere) while no wake was in progress. The agent has already forgotten the instance: its
/// record is removed, its sample gone, and a later call naming it answers `unknown instance`.
/// The lifecycle marks the instance failed; the next request starts it fresh.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineExit {
    /// The instance whose engine exited.
    pub instance: String,
    /// The exit status as the operating system tells it (`exit status: 70`, `signal: 9
    /// (SIGKILL)`); an adopted engine, not this process's child, only says `exited (adopted
    /// process)`. `None` when nothing is known.
    pub status: Option<String>,
}

/// What a host agent says of itself ([`HostAgent::subscribe_health`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentHealth {
    /// Bumped each time the agent may have lost track of engines it reported: a node agent
    /// over HTTP that came back as a new process (the exits of its old life are gone, and it
    /// drives no engine until a [`HostAgent::recover`]), or exits that were missed.
    pub resyncs: u64,
    /// Since when, and why (the last error), the agent cannot be reached; `None` while it
    /// answers.
    pub unreachable: Option<(std::time::Instant, String)>,
}

/// What the lifecycle asks of a host. One call at a time per instance, except
/// [`HostAgent::stop`], which may come while a start or a wake of the same instance is in
/// progress: it ends that operation (see its doc).
pub trait HostAgent: Send + Sync {
    /// GPUs and host RAM.
    fn inventory(&self) -> BoxFuture<'_, Result<Inventory, AgentError>>;
    /// The `engine list` rows.
    fn engines(&self) -> BoxFuture<'_, Vec<EngineInfo>>;
    /// Measures a deployment before a start (declared resources, checkpoint headers, or the
    /// footprint an earlier start of the same deployment and model showed on this host).
    fn measure<'a>(
        &'a self,
        spec: &'a InstanceSpec,
    ) -> BoxFuture<'a, Result<Measurement, AgentError>>;
    /// How the deployment would give back its memory now (the `Parkable` condition); errors
    /// are the refusals (`capability_missing:deep_park`, a refused residency).
    fn parkability<'a>(
        &'a self,
        spec: &'a InstanceSpec,
    ) -> BoxFuture<'a, Result<ParkChoice, AgentError>>;
    /// Starts an engine for `instance` and waits until it is ready and has its first answer.
    fn start<'a>(
        &'a self,
        instance: &'a str,
        spec: &'a InstanceSpec,
    ) -> BoxFuture<'a, Result<StartedInstance, AgentError>>;
    /// Parks (or, where it does not park, stops) an instance. Call it after the drain.
    fn park<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<ParkResult, AgentError>>;
    /// Wakes a parked instance and verifies it before anything is released.
    fn wake<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<WakeReport, AgentError>>;
    /// [`HostAgent::wake`] within the caller's wake window (the server's
    /// `server.switching.wake_timeout`) instead of the agent's own: past it the wake is
    /// `wake_uncertain` and the engine is stopped. The default, for agents without a window of
    /// their own to replace, is [`HostAgent::wake`].
    fn wake_within<'a>(
        &'a self,
        instance: &'a str,
        window: Duration,
    ) -> BoxFuture<'a, Result<WakeReport, AgentError>> {
        let _ = window;
        self.wake(instance)
    }
    /// Stops an instance. A start or a wake of it in progress is ended first: the agent stops
    /// its engine (the process group, or the Pod), that call answers
    /// [`AgentError::Cancelled`], and this one answers once the engine is gone. Over HTTP the
    /// same holds: the node agent serves a stop while the start's call is still open.
    fn stop<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<(), AgentError>>;
    /// The latest load sample; `None` when none is held.
    fn sample(&self, instance: &str) -> Option<LoadSample>;
    /// Adopts or stops engines a previous run left behind.
    fn recover(&self) -> BoxFuture<'_, Result<RecoveryReport, AgentError>>;
    /// Engines that exit by themselves from now on, one [`EngineExit`] each (see its doc). An
    /// exit during a wake is not sent: the wake's report carries it. The default, for agents
    /// that cannot watch their engines, is a receiver that never gets an event (its `recv`
    /// answers `Closed` at once).
    fn subscribe_exits(&self) -> broadcast::Receiver<EngineExit> {
        let (_, rx) = broadcast::channel(1);
        rx
    }
    /// The latest load sample of every instance that has one, by instance ID (what a remote
    /// node agent serves its client). The default, for agents that cannot list their
    /// instances, is empty.
    fn samples(&self) -> BTreeMap<String, LoadSample> {
        BTreeMap::new()
    }
    /// What the agent says of itself, as it changes ([`AgentHealth`]): a caller reconciles
    /// the host again when `resyncs` grows, and shows the host unreachable while it is. The
    /// default, for agents in this process, never changes (its sender is dropped: `changed`
    /// answers an error at once, which means "never").
    fn subscribe_health(&self) -> watch::Receiver<AgentHealth> {
        watch::channel(AgentHealth::default()).1
    }
    /// Loads LoRA adapter `name` from `path` (a PEFT directory the engine can read) into the
    /// ready instance's engine (vLLM `POST /v1/load_lora_adapter`, SGLang
    /// `POST /load_lora_adapter`); answers once the engine has it. A load the engine refuses is
    /// [`AgentError::EngineStatus`] carrying the engine's reason. The instance must have been
    /// started with [`InstanceSpec::adapters`](crate::spec::InstanceSpec::adapters). One call
    /// at a time per instance (the lifecycle serializes them). The default, for agents that
    /// drive no adapters, is [`AgentError::Unsupported`].
    fn load_adapter<'a>(
        &'a self,
        instance: &'a str,
        name: &'a str,
        path: &'a str,
    ) -> BoxFuture<'a, Result<(), AgentError>> {
        let _ = (name, path);
        Box::pin(async move { Err(self.no_adapters(instance)) })
    }
    /// Unloads LoRA adapter `name` from the instance's engine (vLLM
    /// `POST /v1/unload_lora_adapter`, SGLang `POST /unload_lora_adapter`). Unloading one the
    /// engine does not have is not an error. The default is [`AgentError::Unsupported`].
    fn unload_adapter<'a>(
        &'a self,
        instance: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<(), AgentError>> {
        let _ = name;
        Box::pin(async move { Err(self.no_adapters(instance)) })
    }
    /// The adapters the instance's engine has loaded now, by name, as the engine itself lists
    /// them (vLLM: the `/v1/models` entries whose `parent` is the base); after a wake or a
    /// restart this is what is really there. The default is [`AgentError::Unsupported`].
    fn adapters<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<Vec<String>, AgentError>> {
        Box::pin(async move { Err(self.no_adapters(instance)) })
    }
    /// The error of the adapter calls' defaults.
    #[doc(hidden)]
    fn no_adapters(&self, instance: &str) -> AgentError {
        let _ = instance;
        AgentError::Unsupported {
            engine: capyctl_spec::EngineKind::Vllm,
            what: "adapters on this host agent",
        }
    }
    /// `Some(why)` while the agent cannot be reached (a node agent over HTTP whose calls have
    /// failed for some time: what it last answered stands, and may be stale); `None` when it
    /// answers, and always for agents in this process.
    fn unreachable(&self) -> Option<String> {
        None
    }
}
