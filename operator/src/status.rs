//! The `Deployment` CR's `status`, computed from the lifecycle's [`DeploymentView`].
//!
//! - [`deployment_status`] is a pure function: the view, the CR's `metadata.generation` the
//!   lifecycle runs, what is known of parking ([`Parkability`]) and the status written before
//!   (whose conditions keep their `lastTransitionTime` while their `status` stays the same).
//! - [`needs_write`] says whether the status in the API server differs from the computed one:
//!   an unchanged status is never written again.
//! - [`apply_status`] writes it by server-side apply on the `status` subresource, with the one
//!   field manager [`FIELD_MANAGER`] (forced: CapyCTL owns `status`).
//!
//! READY (`status.ready`) is `ready/replicas`: `status.readyReplicas`, the view's instances in
//! state `ready`, over `status.replicas`, the `replicas` of the document that runs (what the
//! scale subresource reads; a `kubectl scale` the lifecycle refused leaves it as it runs).
//!
//! Conditions: `Ready` and `Measured` come from the view; `Parkable` from the view when the
//! lifecycle reports it, else from [`Parkability`] (the host agent's answer, or what the
//! document alone says: `restart_only`, TensorFold, decision models). A spec the lifecycle
//! refused adds `Accepted=False` (reason `invalid_spec`) and keeps `observedGeneration` at the
//! generation that is still running.
//!
//! STATE (`status.state`) is what `capyctl list deployments` shows
//! ([`capyctl_spec::api::listed_state`]): the view's state, or for an adapter (`spec.adapter`)
//! `loaded` while an instance of its base has it loaded, else `unloaded`; an adapter's READY is
//! the list's too (its base's instances that have it loaded, over theirs), and it has no
//! `replicas`, `measurement` nor `Parkable` condition (it is loaded into its base, which has
//! those).

use capyctl_crds::{
    Deployment, DeploymentStatus, InstanceStatus, MeasurementSource, MeasurementState,
    MeasurementStatus, conditions,
};
use capyctl_node_agent::AgentError;
use capyctl_node_agent::tier::{NoParkReason, ParkChoice, ParkTier};
use capyctl_spec::api::{
    ConditionView, DeploymentView, InstanceView, MeasurementView, listed_state,
};
use capyctl_spec::documents::DeploymentDoc;
use capyctl_spec::{EngineKind, Residency};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::{Patch, PatchParams};

use super::FIELD_MANAGER;

/// Condition type added when the lifecycle refused the CR's spec.
pub const ACCEPTED: &str = "Accepted";
/// Reason of `Accepted=False`.
pub const REASON_INVALID_SPEC: &str = "invalid_spec";

/// What is known of how a deployment gives back its GPU memory (the `Parkable` condition).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parkability {
    /// Nothing known yet (no host has answered).
    Unknown,
    /// It parks, in this tier (`host_ram`, `deep`, `kv_only`).
    Parks(&'static str),
    /// It is stopped instead of parked.
    Stops {
        /// A stable reason (`restart_only`, `engine_does_not_park`, ...).
        reason: &'static str,
        /// Why, for people.
        message: String,
    },
    /// The host refuses to park it (`capability_missing:deep_park`, `residency_refused`).
    Refused {
        /// A stable reason.
        reason: &'static str,
        /// Why, for people.
        message: String,
    },
}

fn tier_words(t: ParkTier) -> &'static str {
    match t {
        ParkTier::HostRam => "host_ram",
        ParkTier::Deep => "deep",
        ParkTier::KvOnly => "kv_only",
    }
}

fn stop_reason(r: NoParkReason) -> &'static str {
    match r {
        NoParkReason::RestartOnly => conditions::REASON_RESTART_ONLY,
        NoParkReason::EngineDoesNotPark => "engine_does_not_park",
        NoParkReason::DecisionModel => "decision_model",
        NoParkReason::NoRoomToPark => "no_room_to_park",
    }
}

impl Parkability {
    /// What the host agent's `parkability` answered.
    pub fn from_agent(answer: &Result<ParkChoice, AgentError>) -> Self {
        match answer {
            Ok(ParkChoice::Park(t)) => Parkability::Parks(tier_words(*t)),
            Ok(ParkChoice::Stop(r)) => Parkability::Stops {
                reason: stop_reason(*r),
                message: format!("stopped instead of parked: {}", r.describe()),
            },
            Err(e @ AgentError::CapabilityMissing { .. }) => Parkability::Refused {
                reason: conditions::REASON_CAPABILITY_MISSING_DEEP_PARK,
                message: e.to_string(),
            },
            Err(e @ AgentError::ResidencyRefused { .. }) => Parkability::Refused {
                reason: "residency_refused",
                message: e.to_string(),
            },
            Err(_) => Parkability::Unknown,
        }
    }

    /// What the document alone says (no host asked): `restart_only`, TensorFold and decision
    /// models stop instead of parking; anything else is not known until a host answers.
    pub fn from_doc(doc: &DeploymentDoc) -> Self {
        let stop = |r: NoParkReason| Parkability::Stops {
            reason: stop_reason(r),
            message: format!("stopped instead of parked: {}", r.describe()),
        };
        if doc.residency == Some(Residency::RestartOnly) {
            stop(NoParkReason::RestartOnly)
        } else if doc.engine == Some(EngineKind::Tensorfold) {
            stop(NoParkReason::EngineDoesNotPark)
        } else if doc.decision.is_some() {
            stop(NoParkReason::DecisionModel)
        } else {
            Parkability::Unknown
        }
    }

    fn condition(&self) -> ConditionView {
        let (status, reason, message) = match self {
            Parkability::Unknown => (
                "Unknown",
                "not_checked",
                "no host has said yet how this model parks".to_string(),
            ),
            Parkability::Parks(tier) => ("True", *tier, format!("parks in {tier}")),
            Parkability::Stops { reason, message } | Parkability::Refused { reason, message } => {
                ("False", *reason, message.clone())
            }
        };
        ConditionView {
            kind: conditions::PARKABLE.to_string(),
            status: status.to_string(),
            reason: reason.to_string(),
            message,
        }
    }
}

/// Everything the status is computed from.
#[derive(Debug, Clone, Copy)]
pub struct StatusInput<'a> {
    /// The lifecycle's view of the deployment; `None` when it has none (a spec refused before
    /// it was ever deployed).
    pub view: Option<&'a DeploymentView>,
    /// The CR's `metadata.generation` the lifecycle runs (its `observedGeneration`).
    pub observed_generation: Option<i64>,
    /// How the deployment parks, when the view does not say.
    pub parkability: &'a Parkability,
    /// Why the lifecycle refused the CR's current spec, if it did.
    pub refused: Option<&'a str>,
    /// The status written before (conditions keep their transition times).
    pub previous: Option<&'a DeploymentStatus>,
    /// Now (a condition whose `status` changes gets it as `lastTransitionTime`).
    pub now: Timestamp,
    /// The lifecycle's record to keep in `lifecycleRecord` (see `CrStore::lifecycle_record`);
    /// `None` keeps the previous one.
    pub lifecycle_record: Option<&'a str>,
}

fn residency_of(i: &InstanceView) -> Option<Residency> {
    match i.parked_tier.as_deref() {
        Some("host_ram") => Some(Residency::HostBacked),
        Some("deep") => Some(Residency::Deep),
        _ => None,
    }
}

fn instance_status(i: &InstanceView) -> InstanceStatus {
    InstanceStatus {
        index: i.index,
        host_id: i.host_id.clone(),
        generation: i.generation,
        state: i.state,
        residency: residency_of(i),
        message: i.last_error.clone(),
    }
}

fn measurement_status(
    m: Option<&MeasurementView>,
    measured: Option<&ConditionView>,
) -> MeasurementStatus {
    match m {
        Some(m) => MeasurementStatus {
            state: MeasurementState::Measured,
            weights_bytes: Some(m.weights_memory),
            gpu_memory_bytes: Some(m.gpu_memory),
            source: Some(if m.source == "declared" {
                MeasurementSource::Declared
            } else {
                MeasurementSource::Measured
            }),
            message: None,
        },
        None => {
            let failed = measured.is_some_and(|c| c.reason == "failed");
            MeasurementStatus {
                state: if failed {
                    MeasurementState::Failed
                } else {
                    MeasurementState::Pending
                },
                weights_bytes: None,
                gpu_memory_bytes: None,
                source: None,
                message: measured.filter(|_| failed).map(|c| c.message.clone()),
            }
        }
    }
}

/// A condition of the view as the CR shows it, keeping the previous `lastTransitionTime`
/// while its `status` is the same.
fn k8s_condition(
    c: &ConditionView,
    previous: Option<&DeploymentStatus>,
    generation: Option<i64>,
    now: Timestamp,
) -> Condition {
    let before = previous.and_then(|p| p.conditions.iter().find(|x| x.type_ == c.kind));
    let last_transition_time = match before {
        Some(b) if b.status == c.status => b.last_transition_time.clone(),
        _ => Time(now),
    };
    Condition {
        type_: c.kind.clone(),
        status: c.status.clone(),
        // The API server wants a reason of letters, digits, `_`, `,` and `:`, starting with a
        // letter; the lifecycle's reasons are already so, an empty one is not.
        reason: if c.reason.is_empty() {
            "unknown".to_string()
        } else {
            c.reason.clone()
        },
        message: c.message.clone(),
        observed_generation: generation,
        last_transition_time,
    }
}

/// The status of a CR (see the module doc).
pub fn deployment_status(input: StatusInput<'_>) -> DeploymentStatus {
    let mut views: Vec<ConditionView> = Vec::new();
    let mut status = DeploymentStatus {
        observed_generation: input.observed_generation,
        lifecycle_record: input
            .lifecycle_record
            .map(str::to_string)
            .or_else(|| input.previous.and_then(|p| p.lifecycle_record.clone())),
        ..DeploymentStatus::default()
    };
    if let Some(v) = input.view {
        status.deployment_id = Some(v.id.clone());
        // As `capyctl list deployments` shows it: an adapter's `loaded` / `unloaded`.
        status.state = Some(listed_state(v));
        if v.spec.adapter.is_some() {
            // READY as listed: its base's instances that have it loaded, over theirs. It has
            // no replicas of its own (its base's are the scale's).
            status.ready = Some(v.ready.clone());
        } else {
            let (ready, replicas) = capyctl_crds::ready_replicas(v);
            status.ready = Some(format!("{ready}/{replicas}"));
            status.replicas = Some(replicas);
            status.ready_replicas = Some(ready);
        }
        status.revision = Some(v.revision);
        // As `capyctl list deployments` prints it: `-` for none.
        status.hosts = Some(if v.hosts.is_empty() {
            "-".to_string()
        } else {
            v.hosts.join(",")
        });
        status.instances = v.instances.iter().map(instance_status).collect();
        // An adapter is loaded into its base's engine: it has no checkpoint of its own to
        // measure, and it never parks (its base does).
        if v.spec.adapter.is_none() {
            let measured = v.conditions.iter().find(|c| c.kind == conditions::MEASURED);
            status.measurement = Some(measurement_status(v.measurement.as_ref(), measured));
        }
        views.extend(v.conditions.iter().cloned());
    }
    let adapter = input.view.is_some_and(|v| v.spec.adapter.is_some());
    if !adapter && !views.iter().any(|c| c.kind == conditions::PARKABLE) {
        views.push(input.parkability.condition());
    }
    if let Some(why) = input.refused {
        views.push(ConditionView {
            kind: ACCEPTED.to_string(),
            status: "False".to_string(),
            reason: REASON_INVALID_SPEC.to_string(),
            message: why.to_string(),
        });
    }
    status.conditions = views
        .iter()
        .map(|c| k8s_condition(c, input.previous, input.observed_generation, input.now))
        .collect();
    status
}

/// The status of an object whose name another namespace's object holds
/// ([`super::watch`]): nothing of the lifecycle's (no ID, state, record: that deployment is
/// the holder's), `Accepted=False` with reason [`super::watch::REASON_NAME_TAKEN`] and
/// `message`, and the `observedGeneration` it had.
pub fn name_taken_status(
    previous: Option<&DeploymentStatus>,
    message: &str,
    now: Timestamp,
) -> DeploymentStatus {
    let accepted = ConditionView {
        kind: ACCEPTED.to_string(),
        status: "False".to_string(),
        reason: super::watch::REASON_NAME_TAKEN.to_string(),
        message: message.to_string(),
    };
    let observed_generation = previous.and_then(|p| p.observed_generation);
    DeploymentStatus {
        observed_generation,
        conditions: vec![k8s_condition(&accepted, previous, observed_generation, now)],
        ..DeploymentStatus::default()
    }
}

/// Whether `desired` differs from the status the API server holds (`current`): only then is
/// it written.
pub fn needs_write(current: Option<&DeploymentStatus>, desired: &DeploymentStatus) -> bool {
    match current {
        Some(c) => c != desired,
        None => *desired != DeploymentStatus::default(),
    }
}

/// The server-side apply body of a status: `apiVersion`, `kind` and `status` only.
pub fn apply_body(status: &DeploymentStatus) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": capyctl_crds::API_VERSION,
        "kind": "Deployment",
        "status": status,
    })
}

/// Writes `status` on CR `name` by server-side apply on the status subresource, field manager
/// [`FIELD_MANAGER`], forced.
pub async fn apply_status(
    api: &Api<Deployment>,
    name: &str,
    status: &DeploymentStatus,
) -> Result<Deployment, kube::Error> {
    let params = PatchParams::apply(FIELD_MANAGER).force();
    api.patch_status(name, &params, &Patch::Apply(apply_body(status)))
        .await
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use capyctl_spec::api::InstanceView;
    use capyctl_spec::{Activation, InstanceState};

    use super::*;

    fn doc(text: &str) -> DeploymentDoc {
        capyctl_spec::documents::parse_deployment_str("t.yaml", text).unwrap()
    }

    fn cond(kind: &str, status: &str, reason: &str) -> ConditionView {
        ConditionView {
            kind: kind.into(),
            status: status.into(),
            reason: reason.into(),
            message: format!("{kind} is {status}"),
        }
    }

    fn view(state: InstanceState, ready: bool) -> DeploymentView {
        let spec = doc("name: chat-a\nengine: vllm\nmodel: Qwen3-4B\n");
        DeploymentView {
            id: "01KDEP".into(),
            name: "chat-a".into(),
            state,
            ready: format!("{}/1", u8::from(ready)),
            revision: 2,
            hosts: vec!["gpu-1".into()],
            activation: Activation::OnDemand,
            warm: false,
            operator_stopped: false,
            engine: EngineKind::Vllm,
            model: "Qwen3-4B".into(),
            residency: None,
            measurement: Some(MeasurementView {
                gpu_memory: 6 << 30,
                weights_memory: 4 << 30,
                source: "declared".into(),
            }),
            instances: vec![InstanceView {
                instance_id: "01KDEP-0".into(),
                index: 0,
                host_id: "gpu-1".into(),
                generation: 3,
                state,
                parked_tier: (state == InstanceState::Parked).then(|| "host_ram".to_string()),
                port: Some(8000),
                pid: Some(42),
                last_error: None,
            }],
            conditions: vec![
                cond(
                    "Ready",
                    if ready { "True" } else { "False" },
                    if ready { "ready" } else { "not_running" },
                ),
                cond("Measured", "True", "measured"),
            ],
            spec,
        }
    }

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).unwrap()
    }

    fn input<'a>(
        v: Option<&'a DeploymentView>,
        p: &'a Parkability,
        previous: Option<&'a DeploymentStatus>,
        now: Timestamp,
    ) -> StatusInput<'a> {
        StatusInput {
            view: v,
            observed_generation: Some(4),
            parkability: p,
            refused: None,
            previous,
            now,
            lifecycle_record: None,
        }
    }

    #[test]
    fn the_view_becomes_the_status_with_its_printer_columns() {
        let v = view(InstanceState::Ready, true);
        let s = deployment_status(input(
            Some(&v),
            &Parkability::Parks("host_ram"),
            None,
            at(0),
        ));
        assert_eq!(s.deployment_id.as_deref(), Some("01KDEP"));
        assert_eq!(s.state.as_deref(), Some("ready"));
        assert_eq!(s.ready.as_deref(), Some("1/1"));
        assert_eq!((s.replicas, s.ready_replicas), (Some(1), Some(1)));
        assert_eq!(s.revision, Some(2));
        assert_eq!(s.hosts.as_deref(), Some("gpu-1"));
        assert_eq!(s.observed_generation, Some(4));
        assert_eq!(s.instances.len(), 1);
        assert_eq!(s.instances[0].generation, 3);
        assert_eq!(s.instances[0].host_id, "gpu-1");
        let m = s.measurement.as_ref().unwrap();
        assert_eq!(m.state, MeasurementState::Measured);
        assert_eq!(m.gpu_memory_bytes, Some(6 << 30));
        assert_eq!(m.source, Some(MeasurementSource::Declared));
        let types: Vec<&str> = s.conditions.iter().map(|c| c.type_.as_str()).collect();
        assert_eq!(types, ["Ready", "Measured", "Parkable"]);
        assert!(
            s.conditions
                .iter()
                .all(|c| c.observed_generation == Some(4))
        );
        let parkable = &s.conditions[2];
        assert_eq!(
            (parkable.status.as_str(), parkable.reason.as_str()),
            ("True", "host_ram")
        );
        // The JSON is the CRD's camelCase.
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json["deploymentId"], "01KDEP");
        assert_eq!(json["observedGeneration"], 4);
        assert_eq!(json["instances"][0]["hostId"], "gpu-1");

        // No host: `-`, as `capyctl list deployments` prints it.
        let mut none = v.clone();
        none.hosts.clear();
        let s = deployment_status(input(Some(&none), &Parkability::Unknown, None, at(0)));
        assert_eq!(s.hosts.as_deref(), Some("-"));
    }

    /// An adapter's view as the lifecycle gives it: `ready` with the instances of its base that
    /// have it loaded, `stopped` with none (`capyctl_lifecycle`'s adapter view).
    fn adapter_view(loaded: bool) -> DeploymentView {
        let mut v = view(
            if loaded {
                InstanceState::Ready
            } else {
                InstanceState::Stopped
            },
            loaded,
        );
        v.name = "support-bot".into();
        // Its base has two instances; one has it loaded.
        v.ready = format!("{}/2", u8::from(loaded));
        v.spec = doc(
            "name: support-bot\nadapter: {base: chat-a, path: /capyctl/adapters/support-bot}\n",
        );
        v.measurement = None;
        v.conditions = vec![cond(
            "Ready",
            if loaded { "True" } else { "False" },
            if loaded { "loaded" } else { "unloaded" },
        )];
        if !loaded {
            v.instances.clear();
        }
        v
    }

    #[test]
    fn an_adapter_is_loaded_or_unloaded_as_the_list_shows_it() {
        for (loaded, word) in [(true, "loaded"), (false, "unloaded")] {
            let v = adapter_view(loaded);
            let s = deployment_status(input(Some(&v), &Parkability::Unknown, None, at(0)));
            assert_eq!(s.state.as_deref(), Some(word));
            assert_eq!(s.state, Some(capyctl_spec::api::listed_state(&v)));
            // READY as listed (the base's instances with it over theirs), no replicas of its
            // own; nothing of a checkpoint or of parking: the base has those.
            assert_eq!(s.ready.as_deref(), Some(v.ready.as_str()));
            assert_eq!((s.replicas, s.ready_replicas), (None, None));
            assert_eq!(s.measurement, None);
            let types: Vec<&str> = s.conditions.iter().map(|c| c.type_.as_str()).collect();
            assert_eq!(types, ["Ready"], "{word}");
            assert_eq!(s.conditions[0].reason, word);
            // The API server takes the word: the CRD's schema lists it.
            assert!(capyctl_crds::deployment_states().contains(&word));
        }
        // A base (or any other deployment) keeps its instance state.
        let v = view(InstanceState::Stopped, false);
        let s = deployment_status(input(Some(&v), &Parkability::Unknown, None, at(0)));
        assert_eq!(s.state.as_deref(), Some("stopped"));
    }

    #[test]
    fn a_parked_instance_shows_its_residency() {
        let v = view(InstanceState::Parked, false);
        let s = deployment_status(input(Some(&v), &Parkability::Unknown, None, at(0)));
        assert_eq!(s.state.as_deref(), Some("parked"));
        assert_eq!(s.ready.as_deref(), Some("0/1"));
        assert_eq!(s.instances[0].residency, Some(Residency::HostBacked));
    }

    #[test]
    fn ready_counts_the_ready_instances_over_the_replicas() {
        let mut v = view(InstanceState::Ready, true);
        v.spec = doc("name: chat-a\nengine: vllm\nmodel: Qwen3-4B\nreplicas: 3\n");
        // One instance of three (a lifecycle that has started only one so far).
        let s = deployment_status(input(Some(&v), &Parkability::Unknown, None, at(0)));
        assert_eq!(
            (s.ready.as_deref(), s.replicas, s.ready_replicas),
            (Some("1/3"), Some(3), Some(1))
        );
        // Three instances: two ready, one parked; every instance is counted, not the first.
        let mut parked = v.instances[0].clone();
        parked.index = 0;
        parked.state = InstanceState::Parked;
        let mut ready = v.instances[0].clone();
        ready.index = 1;
        let mut also_ready = ready.clone();
        also_ready.index = 2;
        v.instances = vec![parked, ready, also_ready];
        let s = deployment_status(input(Some(&v), &Parkability::Unknown, None, at(0)));
        assert_eq!(
            (s.ready.as_deref(), s.replicas, s.ready_replicas),
            (Some("2/3"), Some(3), Some(2))
        );
        assert_eq!(s.instances.len(), 3);
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json["replicas"], 3);
        assert_eq!(json["readyReplicas"], 2);
        // Nothing ready: 0, written (the scale subresource and kubectl read integers).
        for i in &mut v.instances {
            i.state = InstanceState::Stopped;
        }
        let s = deployment_status(input(Some(&v), &Parkability::Unknown, None, at(0)));
        assert_eq!(
            (s.ready.as_deref(), s.replicas, s.ready_replicas),
            (Some("0/3"), Some(3), Some(0))
        );
        assert_eq!(serde_json::to_value(&s).unwrap()["readyReplicas"], 0);
        // A changed replicas (kubectl scale) is a status to write.
        let mut scaled = v.clone();
        scaled.spec = doc("name: chat-a\nengine: vllm\nmodel: Qwen3-4B\nreplicas: 5\n");
        let after = deployment_status(input(Some(&scaled), &Parkability::Unknown, Some(&s), at(1)));
        assert_eq!(after.replicas, Some(5));
        assert!(needs_write(Some(&s), &after));
        // No view (a spec refused before it ever ran): no replicas to say.
        let p = Parkability::Unknown;
        let none = deployment_status(input(None, &p, None, at(0)));
        assert_eq!((none.replicas, none.ready_replicas), (None, None));
    }

    #[test]
    fn capability_missing_makes_parkable_false_with_its_reason() {
        let answer: Result<ParkChoice, AgentError> = Err(AgentError::CapabilityMissing {
            reason: "hybrid state caches do not survive a deep park",
        });
        let p = Parkability::from_agent(&answer);
        let v = view(InstanceState::Ready, true);
        let s = deployment_status(input(Some(&v), &p, None, at(0)));
        let c = s.conditions.iter().find(|c| c.type_ == "Parkable").unwrap();
        assert_eq!(c.status, "False");
        assert_eq!(c.reason, "capability_missing:deep_park");
        assert!(c.message.contains("hybrid state caches"), "{}", c.message);
    }

    #[test]
    fn the_document_alone_says_restart_only_and_tensorfold_stop() {
        let d = doc("name: a\nengine: vllm\nmodel: m\nresidency: restart_only\n");
        assert!(matches!(
            Parkability::from_doc(&d),
            Parkability::Stops {
                reason: "restart_only",
                ..
            }
        ));
        let d = doc("name: a\nengine: tensorfold\nmodel: m\n");
        assert!(matches!(
            Parkability::from_doc(&d),
            Parkability::Stops {
                reason: "engine_does_not_park",
                ..
            }
        ));
        let d = doc("name: a\nengine: sglang\nmodel: m\n");
        assert_eq!(Parkability::from_doc(&d), Parkability::Unknown);
        let c = Parkability::Unknown.condition();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("Unknown", "not_checked")
        );
    }

    #[test]
    fn a_parkable_condition_of_the_view_wins() {
        let mut v = view(InstanceState::Ready, true);
        v.conditions
            .push(cond("Parkable", "False", "capability_missing:deep_park"));
        let s = deployment_status(input(Some(&v), &Parkability::Parks("deep"), None, at(0)));
        let parkable: Vec<&Condition> = s
            .conditions
            .iter()
            .filter(|c| c.type_ == "Parkable")
            .collect();
        assert_eq!(parkable.len(), 1);
        assert_eq!(parkable[0].reason, "capability_missing:deep_park");
    }

    #[test]
    fn transition_times_stay_while_the_status_stays() {
        let v = view(InstanceState::Ready, true);
        let p = Parkability::Parks("host_ram");
        let first = deployment_status(input(Some(&v), &p, None, at(0)));
        // Later, same facts: the same status, so nothing to write.
        let again = deployment_status(input(Some(&v), &p, Some(&first), at(60)));
        assert_eq!(again, first);
        assert!(!needs_write(Some(&first), &again));
        // The instance parks: Ready flips (new time), Measured does not (old time).
        let parked = view(InstanceState::Parked, false);
        let later = deployment_status(input(Some(&parked), &p, Some(&first), at(120)));
        assert!(needs_write(Some(&first), &later));
        let ready = later
            .conditions
            .iter()
            .find(|c| c.type_ == "Ready")
            .unwrap();
        let measured = later
            .conditions
            .iter()
            .find(|c| c.type_ == "Measured")
            .unwrap();
        assert_eq!(ready.last_transition_time, Time(at(120)));
        assert_eq!(measured.last_transition_time, Time(at(0)));
    }

    #[test]
    fn a_refused_spec_says_so_without_a_view() {
        let p = Parkability::Unknown;
        let s = deployment_status(StatusInput {
            view: None,
            observed_generation: None,
            parkability: &p,
            refused: Some("Deployment default/a: spec.maxConcurrentRequests: 0 is out of range"),
            previous: None,
            now: at(0),
            lifecycle_record: None,
        });
        assert_eq!(s.deployment_id, None);
        let c = s.conditions.iter().find(|c| c.type_ == ACCEPTED).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", REASON_INVALID_SPEC)
        );
        assert!(c.message.contains("maxConcurrentRequests"));
    }

    #[test]
    fn a_name_taken_elsewhere_says_whose_and_keeps_nothing_of_the_lifecycle() {
        let previous = DeploymentStatus {
            deployment_id: Some("01KOLD".into()),
            revision: Some(3),
            observed_generation: Some(2),
            lifecycle_record: Some("{}".into()),
            ..Default::default()
        };
        let s = name_taken_status(Some(&previous), "taken by team-a/chat", at(5));
        assert_eq!(s.deployment_id, None);
        assert_eq!(s.revision, None);
        assert_eq!(s.lifecycle_record, None);
        assert_eq!(s.observed_generation, Some(2));
        let c = &s.conditions[0];
        assert_eq!(
            (c.type_.as_str(), c.status.as_str(), c.reason.as_str()),
            (ACCEPTED, "False", "name_taken")
        );
        assert_eq!(c.message, "taken by team-a/chat");
        // The same again keeps its transition time: nothing to write.
        let again = name_taken_status(Some(&s), "taken by team-a/chat", at(60));
        assert!(!needs_write(Some(&s), &again));
    }

    #[test]
    fn needs_write_is_false_only_for_an_equal_status() {
        assert!(!needs_write(None, &DeploymentStatus::default()));
        let s = DeploymentStatus {
            revision: Some(1),
            ..Default::default()
        };
        assert!(needs_write(None, &s));
        assert!(needs_write(Some(&DeploymentStatus::default()), &s));
        assert!(!needs_write(Some(&s.clone()), &s));
    }

    #[test]
    fn the_apply_body_names_the_kind_and_holds_only_status() {
        let s = DeploymentStatus {
            revision: Some(1),
            ..Default::default()
        };
        let body = apply_body(&s);
        assert_eq!(body["apiVersion"], "capyctl.io/v1alpha1");
        assert_eq!(body["kind"], "Deployment");
        assert_eq!(body["status"]["revision"], 1);
        assert!(body.get("spec").is_none());
    }
}
