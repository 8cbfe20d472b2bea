//! The management API's JSON bodies (`/management/v1`, DESIGN 4.5): what the server answers and
//! what the CLI reads. One set of types for both sides, so the two cannot drift.
//!
//! Errors are [`crate::errors::ApiError`]'s JSON (`{"code","message","retryable"}`).
//! Optional figures are absent (`null`) when unknown, never zero.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use crate::documents::DeploymentDoc;
use crate::{Activation, EngineKind, InstanceState, Residency};

/// The API's path prefix.
pub const PREFIX: &str = "/management/v1";

/// `stale_after_ms` of the load read: a sample older than this is not fresh.
pub const STALE_AFTER_MS: u64 = 3000;

/// A stale sample is kept this long, then dropped (milliseconds).
pub const STALE_SAMPLE_KEPT_MS: u64 = 30_000;

/// One instance of a deployment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InstanceView {
    /// The instance's ID (`<deployment id>-<index>`).
    pub instance_id: String,
    /// Its index within the deployment.
    pub index: u32,
    /// The host it runs on.
    pub host_id: String,
    /// Bumped on every fresh start.
    pub generation: u64,
    /// Its state.
    pub state: InstanceState,
    /// The parking tier while parked (`host_ram`, `deep`, `kv_only`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parked_tier: Option<String>,
    /// The engine's loopback port while it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// The engine's pid while it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    /// The last failure (`wake_mismatch: ...`, `engine exited with status 1`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// The measurement of a deployment's checkpoint, in bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MeasurementView {
    /// GPU memory an awake instance holds.
    pub gpu_memory: u64,
    /// The weights' size (what a host-RAM park copies).
    pub weights_memory: u64,
    /// `declared`, `measured` or `observed`.
    pub source: String,
}

/// A condition in the Kubernetes style (`Ready`, `Measured`, `Parkable`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConditionView {
    /// `Ready`, `Measured` or `Parkable`.
    #[serde(rename = "type")]
    pub kind: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// A machine-readable reason (`capability_missing:deep_park`).
    pub reason: String,
    /// A sentence for people.
    pub message: String,
}

/// A deployment, as `list deployments` and `status deployment` show it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeploymentView {
    /// The deployment's ID (a ULID).
    pub id: String,
    /// Its name (what requests put in `model`).
    pub name: String,
    /// STATE, derived from its instances.
    pub state: InstanceState,
    /// READY: ready instances over instances, `1/1`.
    pub ready: String,
    /// REVISION: bumped by a re-deploy of a changed document.
    pub revision: u64,
    /// HOSTS: the host its instance is bound to (running, parked, or on its way there); when it
    /// is bound to none, the one host there is, and none (`-`) among several hosts (placement
    /// chooses one when it starts).
    pub hosts: Vec<String>,
    /// `explicit` when the deployment or a host it may run on says so.
    pub activation: Activation,
    /// `lifecycle.warm`.
    pub warm: bool,
    /// `true` after an operator's stop (requests get 409 `deployment_stopped`).
    pub operator_stopped: bool,
    /// The engine.
    pub engine: EngineKind,
    /// The engine's model argument.
    pub model: String,
    /// The residency in force: declared, or chosen by CapyCTL once known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub residency: Option<Residency>,
    /// The measurement, once there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measurement: Option<MeasurementView>,
    /// Its instances.
    pub instances: Vec<InstanceView>,
    /// `Ready`, `Measured`, `Parkable`.
    #[serde(default)]
    pub conditions: Vec<ConditionView>,
    /// The document as deployed.
    pub spec: DeploymentDoc,
}

/// `GET /deployments`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeploymentList {
    /// Every deployment, by name.
    pub deployments: Vec<DeploymentView>,
}

/// What `POST /deployments` did with the document.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeployOutcome {
    /// A new deployment, revision 1.
    Created,
    /// The document changed: the revision was bumped.
    Updated,
    /// The same document again: nothing changed.
    Unchanged,
}

/// The answer to `POST /deployments`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeployReceipt {
    /// What happened.
    pub outcome: DeployOutcome,
    /// The deployment now.
    pub deployment: DeploymentView,
}

/// The body of `POST /deployments/{id}/start`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartRequest {
    /// Park (or stop) idle models to make room; without it a start waits for memory.
    #[serde(default)]
    pub evict: bool,
    /// Wait for the measurement and then for the model to be ready; without it a start of a
    /// checkpoint that awaits measurement is refused.
    #[serde(default)]
    pub wait: bool,
}

/// How a victim of a start or switch was released.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Released {
    /// Parked (its copy kept).
    Parked,
    /// Stopped: it does not park (restart_only, TensorFold, cut before output).
    Stopped,
    /// Stopped because there was no room to keep a parked copy.
    StoppedNoRoomToPark,
}

impl Released {
    /// The receipt's words: `parked`, `stopped`, `stopped (no room to park)`.
    pub fn words(self) -> &'static str {
        match self {
            Released::Parked => "parked",
            Released::Stopped => "stopped",
            Released::StoppedNoRoomToPark => "stopped (no room to park)",
        }
    }

    /// What the released instance's status says (`last_error`), e.g. `released: stopped (no
    /// room to park)`: events read the reason back from it.
    pub fn status_line(self) -> String {
        format!("released: {}", self.words())
    }
}

/// One instance a start released.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Victim {
    /// The victim's deployment ID.
    pub deployment_id: String,
    /// Its name.
    pub name: String,
    /// The instance's ID.
    pub instance_id: String,
    /// How it was released.
    pub released: Released,
}

/// The answer to `POST /deployments/{id}/start`, `stop`, `park`, `preinitialize`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ActionReceipt {
    /// `start`, `stop`, `park` or `preinitialize`.
    pub action: String,
    /// The deployment now (`parking` or `starting` when the action goes on in the background).
    pub deployment: DeploymentView,
    /// The switch's ID when the action released others (start --evict).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub switch_id: Option<String>,
    /// The instances released to make room.
    #[serde(default)]
    pub victims: Vec<Victim>,
}

/// One row of `engine list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineView {
    /// The engine.
    pub engine: EngineKind,
    /// Its version, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// The launch command.
    pub command: Vec<String>,
    /// DEEP PARK: `enabled`, or why not.
    pub deep_park: String,
    /// The host it is on.
    pub host_id: String,
}

/// `GET /engines`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineList {
    /// One row per engine and host.
    pub engines: Vec<EngineView>,
}

/// One GPU of a host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuView {
    /// Its index.
    pub index: u32,
    /// Its UUID, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// Memory in bytes.
    pub memory: u64,
    /// Unified memory.
    pub unified: bool,
    /// Bytes held by awake (or starting, waking) instances.
    pub used: u64,
}

/// A host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostView {
    /// The host's ID.
    pub id: String,
    /// Its GPUs.
    pub gpus: Vec<GpuView>,
    /// Host RAM in bytes.
    pub host_memory: u64,
    /// Host RAM held by parked copies.
    pub host_memory_used: u64,
    /// The host's `lifecycle.activation`.
    pub activation: Activation,
    /// Drained and taken out of service (`capyctl drain host`): nothing is placed on it until
    /// `capyctl uncordon host`.
    #[serde(default)]
    pub cordoned: bool,
    /// Why its node agent cannot be reached now (for how long, and the last error); absent
    /// while it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unreachable: Option<String>,
}

/// The answer to `POST /hosts/{id}/drain` and `POST /hosts/{id}/uncordon`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostDrainReceipt {
    /// `drain` or `uncordon`.
    pub action: String,
    /// The host's ID.
    pub host_id: String,
    /// Whether it is out of service now.
    pub cordoned: bool,
    /// The instances a drain stopped (deployment and instance IDs, `released: stopped`).
    #[serde(default)]
    pub victims: Vec<Victim>,
}

/// `GET /hosts`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostList {
    /// Every host.
    pub hosts: Vec<HostView>,
}

/// `GET /metrics/load`, exactly as on the product page ("Reading load").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadReport {
    /// When the read was taken (Unix milliseconds).
    pub observed_at_ms: u64,
    /// A sample older than this is not fresh ([`STALE_AFTER_MS`]).
    pub stale_after_ms: u64,
    /// One entry per deployment (or the one asked for).
    pub deployments: Vec<DeploymentLoadView>,
}

/// One deployment's load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeploymentLoadView {
    /// The deployment's ID.
    pub deployment_id: String,
    /// Its name.
    pub name: String,
    /// The router's side.
    pub router: RouterLoadView,
    /// How many requests the engine runs at once (the deployment's figure).
    pub max_running: MaxRunningView,
    /// Its instances.
    pub instances: Vec<InstanceLoadView>,
}

/// The router's figures of one deployment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouterLoadView {
    /// Requests being forwarded now.
    pub in_flight: u64,
    /// Their bound: 32 per ready instance (32 × ready instances).
    pub in_flight_limit: u64,
    /// Requests waiting in CapyCTL.
    pub waiting: u64,
    /// The waiting limit per deployment.
    pub waiting_limit: u64,
}

/// `max_running`: a count (absent when unknown) and where it comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MaxRunningView {
    /// The count; absent when not known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u32>,
    /// `engine`, `declared`, `default`, `state_cache`, `extra_args`, `host_fixed`,
    /// `engine_default`, `on_host`. (A `Cow`: the load read names a fixed word without a copy.)
    pub source: Cow<'static, str>,
}

/// One instance's load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InstanceLoadView {
    /// The LoRA adapters loaded in this instance now (a base's; DESIGN 4.9).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub adapters: Vec<String>,
    /// Its index.
    pub index: u32,
    /// Its host.
    pub host_id: String,
    /// Its generation.
    pub generation: u64,
    /// Its state.
    pub observed_state: InstanceState,
    /// Requests the router forwards to it now.
    pub router_in_flight: u64,
    /// The instance's figure.
    pub max_running: MaxRunningView,
    /// The latest sample; `null` when none is held.
    pub sample: Option<SampleView>,
}

/// A load sample.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampleView {
    /// When it was taken (Unix milliseconds).
    pub sampled_at_ms: u64,
    /// Its age at `observed_at_ms`.
    pub age_ms: u64,
    /// `age_ms < stale_after_ms`.
    pub fresh: bool,
    /// Requests CapyCTL forwards to the instance.
    pub ingress_in_flight: u64,
    /// The engine's figures; `null` when they could not be read.
    pub engine: Option<EngineLoadView>,
}

/// The engine's own figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineLoadView {
    /// Requests running.
    pub running: u64,
    /// Requests waiting in the engine.
    pub waiting: u64,
    /// KV-cache use in parts per million.
    pub kv_usage_ppm: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn released_words_are_the_receipts() {
        assert_eq!(
            Released::StoppedNoRoomToPark.words(),
            "stopped (no room to park)"
        );
        assert_eq!(
            serde_json::to_string(&Released::StoppedNoRoomToPark).ok(),
            Some("\"stopped_no_room_to_park\"".to_string())
        );
    }

    #[test]
    fn start_request_refuses_unknown_keys() {
        let err = serde_json::from_str::<StartRequest>(r#"{"evict":true,"force":1}"#)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("force"), "{err}");
        let ok: StartRequest = serde_json::from_str("{}").unwrap_or_default();
        assert_eq!(ok, StartRequest::default());
    }

    #[test]
    fn load_report_reads_the_product_pages_example() {
        let text = r#"{
          "observed_at_ms": 1791460000000,
          "stale_after_ms": 3000,
          "deployments": [{
            "deployment_id": "01K",
            "name": "chat-a",
            "router": {"in_flight": 3, "in_flight_limit": 32, "waiting": 0, "waiting_limit": 0},
            "max_running": {"count": 8, "source": "state_cache"},
            "instances": [{
              "index": 0, "host_id": "gpu-box", "generation": 7, "observed_state": "ready",
              "router_in_flight": 3,
              "max_running": {"count": 8, "source": "engine"},
              "sample": {
                "sampled_at_ms": 1791459999600, "age_ms": 400, "fresh": true,
                "ingress_in_flight": 3,
                "engine": {"running": 3, "waiting": 0, "kv_usage_ppm": 121000}
              }
            }]
          }]
        }"#;
        let report: LoadReport = serde_json::from_str(text).expect("the page's example parses");
        let back = serde_json::to_value(&report).expect("serializes");
        let orig: serde_json::Value = serde_json::from_str(text).expect("json");
        assert_eq!(back, orig);
    }
}

// ----- switch records (`GET /switches`, DESIGN 4.8) -----

/// The most records `GET /switches` answers at once (and its default `limit`).
pub const SWITCHES_PAGE_MAX: usize = 1000;

/// What started a switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SwitchCause {
    /// The router planned it for waiting requests.
    Wave,
    /// An operator's `start --evict`.
    Operator,
    /// An idle timer's park or stop.
    Idle,
    /// An operator's park, stop or delete.
    Release,
    /// A host drain's stop.
    Drain,
    /// A start or wake with no victims (a cold start, a wake into free room).
    BringUp,
    /// Replicas: one more instance of a deployment in use (its `replicas`, or `scale` on
    /// load), or one fewer (`scale` below its target, or `replicas` lowered).
    Scale,
    /// A LoRA adapter loaded into, or unloaded from, an instance of its base (DESIGN 4.9).
    Adapter,
}

impl SwitchCause {
    /// The word on the wire.
    pub fn word(self) -> &'static str {
        match self {
            SwitchCause::Wave => "wave",
            SwitchCause::Operator => "operator",
            SwitchCause::Idle => "idle",
            SwitchCause::Release => "release",
            SwitchCause::Drain => "drain",
            SwitchCause::BringUp => "bring_up",
            SwitchCause::Scale => "scale",
            SwitchCause::Adapter => "adapter",
        }
    }
}

/// How a switch ended (`in_progress` while it runs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SwitchOutcome {
    /// Still running.
    InProgress,
    /// Done: the target is ready (or the victims released).
    Ok,
    /// Failed: `error` says why.
    Failed,
    /// Given up before its end (nothing failed: e.g. the target came up by other means).
    Abandoned,
}

impl SwitchOutcome {
    /// The word on the wire.
    pub fn word(self) -> &'static str {
        match self {
            SwitchOutcome::InProgress => "in_progress",
            SwitchOutcome::Ok => "ok",
            SwitchOutcome::Failed => "failed",
            SwitchOutcome::Abandoned => "abandoned",
        }
    }
}

/// A phase of a switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SwitchPhaseKind {
    /// The admission window: the victims still take requests.
    AdmissionWindow,
    /// The victims take no new requests and finish their running ones.
    Drain,
    /// A victim parks.
    Park,
    /// A victim stops.
    Stop,
    /// The target wakes.
    Wake,
    /// The target starts.
    Start,
    /// The woken target's answer is checked.
    WakeCheck,
    /// From the target's instance ready to its waiters released (the router's open).
    Release,
    /// A LoRA adapter loads into an instance of its base.
    AdapterLoad,
    /// A LoRA adapter is unloaded from an instance of its base (room for another).
    AdapterUnload,
}

impl SwitchPhaseKind {
    /// The word on the wire (and the metrics' `phase` label).
    pub fn word(self) -> &'static str {
        match self {
            SwitchPhaseKind::AdmissionWindow => "admission_window",
            SwitchPhaseKind::Drain => "drain",
            SwitchPhaseKind::Park => "park",
            SwitchPhaseKind::Stop => "stop",
            SwitchPhaseKind::Wake => "wake",
            SwitchPhaseKind::Start => "start",
            SwitchPhaseKind::WakeCheck => "wake_check",
            SwitchPhaseKind::Release => "release",
            SwitchPhaseKind::AdapterLoad => "adapter_load",
            SwitchPhaseKind::AdapterUnload => "adapter_unload",
        }
    }
}

/// An adapter's state as the lists show it (DESIGN 4.9): `loaded` when an instance of its
/// base has it loaded, else `unloaded`.
pub fn adapter_state(loaded: bool) -> &'static str {
    if loaded { "loaded" } else { "unloaded" }
}

/// The state `capyctl list deployments` shows of `d`: an adapter's `loaded` / `unloaded`
/// ([`adapter_state`]: an adapter's view lists the instances that have it loaded), else its
/// instance state.
pub fn listed_state(d: &DeploymentView) -> String {
    match d.spec.adapter {
        Some(_) => adapter_state(!d.instances.is_empty()).to_string(),
        None => d.state.to_string(),
    }
}

/// A switch's error: the API error's code and message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwitchError {
    /// The error's code (`drain_timeout`, `wake_mismatch`, `interrupted`, ...).
    pub code: String,
    /// Its message.
    pub message: String,
}

/// What a switch asked of a victim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VictimAction {
    /// Park it.
    Park,
    /// Stop it.
    Stop,
}

/// What became of a victim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VictimResult {
    /// Parked.
    Parked,
    /// Stopped.
    Stopped,
    /// Kept (serves on: the switch was given up before it was released).
    Kept,
    /// Its park or stop failed.
    Failed,
}

/// A victim of a switch and what became of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwitchVictim {
    /// Its deployment's name.
    pub deployment: String,
    /// Its deployment's ID.
    pub deployment_id: String,
    /// Its instance.
    pub instance: String,
    /// Park or stop.
    pub action: VictimAction,
    /// What became of it.
    pub result: VictimResult,
    /// Why its release failed.
    #[serde(default)]
    pub error: Option<SwitchError>,
}

/// One phase of a switch, with its times (Unix milliseconds).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwitchPhase {
    /// Which phase.
    pub phase: SwitchPhaseKind,
    /// The victim's instance for `park`/`stop`, else the target's.
    pub instance: String,
    /// When it began.
    pub began_ms: u64,
    /// When it ended; `None` while it runs.
    #[serde(default)]
    pub ended_ms: Option<u64>,
}

/// One switch, phase by phase (`GET /switches`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwitchRecord {
    /// Increases by one per record, across restarts.
    pub seq: u64,
    /// The switch's ID (the one receipts carry).
    pub switch_id: String,
    /// The deployment it served (a release's: the one released).
    pub deployment: String,
    /// Its ID.
    pub deployment_id: String,
    /// Its instance (`<deployment id>-0`).
    pub instance: String,
    /// The host where the target went (empty when unknown).
    pub host_id: String,
    /// The GPUs it went to (empty when unknown).
    #[serde(default)]
    pub gpus: Vec<String>,
    /// What started it.
    pub cause: SwitchCause,
    /// The requests waiting for the target when it began.
    pub wave: u64,
    /// When it began (Unix milliseconds).
    pub began_ms: u64,
    /// When it ended; `None` while in progress.
    #[serde(default)]
    pub ended_ms: Option<u64>,
    /// How it ended.
    pub outcome: SwitchOutcome,
    /// Why it failed.
    #[serde(default)]
    pub error: Option<SwitchError>,
    /// Its victims, in the order they were released.
    #[serde(default)]
    pub victims: Vec<SwitchVictim>,
    /// Its phases, in the order they began.
    #[serde(default)]
    pub phases: Vec<SwitchPhase>,
}

/// `GET /switches`: records oldest first, and the highest `seq` answered (or `after`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwitchList {
    /// The records with `seq > after`, oldest first.
    pub switches: Vec<SwitchRecord>,
    /// The highest `seq` answered, or `after` when none: the next poll's `after`.
    pub next: u64,
}

/// The query of `GET /switches`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwitchQuery {
    /// Only the switches of this deployment (name or ID).
    #[serde(default)]
    pub deployment: Option<String>,
    /// Only records with a higher `seq`.
    #[serde(default)]
    pub after: Option<u64>,
    /// At most this many (default and maximum [`SWITCHES_PAGE_MAX`]).
    #[serde(default)]
    pub limit: Option<usize>,
}
