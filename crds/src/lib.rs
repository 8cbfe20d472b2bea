//! Kubernetes custom resources of group `capyctl.io`, version `v1alpha1` (DESIGN.md 4.6), and
//! the CRD YAML generated from them (`cargo run -p capyctl-crds --bin crdgen`); with feature
//! `client`, [`api_client`]: the one client of the API server the operator and the node agent
//! build (a timeout and an observer on every call).
//!
//! - [`Deployment`] (namespaced, short names `cdeploy` and `cdep`): the deployment document in
//!   camelCase without `name` (`metadata.name` is the name), with a status the server writes.
//! - [`Host`] (cluster-scoped, one per GPU node, written by its node agent): what the host has
//!   and the resource policy it applies.
//! - [`tenant::Tenant`] (namespaced, short name `ctenant`): a tenant of the inference listener,
//!   its API keys in Secrets (DESIGN 4.10).
//!
//! Spec types deserialize leniently (types only) so that a controller can still read, and report
//! on, an object that breaks a rule; [`DeploymentSpec::to_document`] runs the full validation of
//! a deployment document and names the bad field as `spec.<field>`. The CRD schema carries the
//! simple bounds too, and a CEL rule for `scale.min` over `replicas` (which `kubectl scale` can
//! break), so the API server refuses most bad objects up front.

#[doc(hidden)]
pub mod fuzz;
pub mod tenant;

#[cfg(feature = "client")]
pub mod api_client;

use std::collections::BTreeMap;
use std::path::Path;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, CustomResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use capyctl_spec::api::{DeploymentView, adapter_state};
use capyctl_spec::documents::{DeploymentDoc, DocumentError, KeyPath, Origin, Problem, Seg};
use capyctl_spec::settings::{
    ADMISSION_WINDOW_BOUNDS, MAX_BUFFERED_BYTES_TOTAL_BOUNDS, MAX_PENDING_PER_DEPLOYMENT_BOUNDS,
    MAX_PENDING_TOTAL_BOUNDS, QueueSettings, REQUEST_DEADLINE_BOUNDS, STREAM_IDLE_TIMEOUT_BOUNDS,
};
use capyctl_spec::units::{ByteSize, DurationSetting};
use capyctl_spec::{Activation, EngineKind, InstanceState, Residency, Routing};

/// The API group.
pub const GROUP: &str = "capyctl.io";
/// The API version.
pub const VERSION: &str = "v1alpha1";
/// `apiVersion` of every CapyCTL object.
pub const API_VERSION: &str = "capyctl.io/v1alpha1";

/// The CRD's CEL rule (`x-kubernetes-validations` of `spec`): `scale.min` is not above
/// `replicas`, as in a deployment document.
pub const SCALE_MIN_RULE: &str = "!has(self.scale) || !has(self.scale.min) || self.scale.min <= (has(self.replicas) ? self.replicas : 1)";
/// `spec.replicas` of a `Deployment` that does not say (the schema's default, which the API
/// server fills in): the deployment document's unset `replicas`.
pub const DEFAULT_REPLICAS: u32 = 1;

/// Condition types and reasons written in `status.conditions`.
pub mod conditions {
    /// The deployment has a ready instance.
    pub const READY: &str = "Ready";
    /// The checkpoint's memory is known (declared or measured).
    pub const MEASURED: &str = "Measured";
    /// The deployment may park (else it stops instead).
    pub const PARKABLE: &str = "Parkable";
    /// The host is up and reporting.
    pub const HOST_READY: &str = "Ready";
    /// Reason of `Parkable=False`: the engine cannot wake this model correctly.
    pub const REASON_CAPABILITY_MISSING_DEEP_PARK: &str = "capability_missing:deep_park";
    /// Reason of `Parkable=False`: the deployment declares `residency: restart_only`.
    pub const REASON_RESTART_ONLY: &str = "restart_only";
}

/// Lets an optional enum field keep its own description in the CRD schema (kube hoists the
/// enum's schema, description included, over the field's).
fn field_description_wins(schema: &mut schemars::Schema) {
    if let Some(any_of) = schema.get_mut("anyOf").and_then(|v| v.as_array_mut()) {
        for branch in any_of {
            if let Some(obj) = branch.as_object_mut() {
                obj.remove("description");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Deployment
// ---------------------------------------------------------------------------------------------

/// A model on one engine, run by CapyCTL. The spec is the deployment document in camelCase;
/// `metadata.name` is the deployment's name (a DNS-1123 label).
// NB: clippy reads the repeated `type_ = ...` of the printer columns as duplicated attributes.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "capyctl.io",
    version = "v1alpha1",
    kind = "Deployment",
    plural = "deployments",
    singular = "deployment",
    namespaced,
    status = "DeploymentStatus",
    derive = "PartialEq",
    shortname = "cdeploy",
    shortname = "cdep",
    category = "capyctl",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas"
    ),
    printcolumn(
        name = "State",
        type_ = "string",
        json_path = ".status.state",
        description = "The deployment's state, derived from its instances"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.ready",
        description = "Ready instances / replicas"
    ),
    printcolumn(
        name = "Revision",
        type_ = "integer",
        json_path = ".status.revision",
        description = "The deployment's revision"
    ),
    printcolumn(
        name = "Hosts",
        type_ = "string",
        json_path = ".status.hosts",
        description = "The hosts of the deployment (where it runs or is parked; every host it may run on while it is on none)"
    ),
    printcolumn(
        name = "Priority",
        type_ = "integer",
        json_path = ".spec.priority",
        description = "The deployment's priority (empty: 0); never parked or stopped for a lower one"
    ),
    doc = "A CapyCTL deployment: a named model on one engine, parked, woken and switched by CapyCTL."
)]
// The rule across keys that `kubectl scale` can break (below scale.min), checked by the API
// server too, so that the scale is refused at once rather than by the operator afterwards.
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": SCALE_MIN_RULE,
    "message": "scale.min is above replicas: the deployment scales between scale.min and replicas; raise replicas or lower scale.min",
    "fieldPath": ".scale.min",
    "reason": "FieldValueInvalid",
}]))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeploymentSpec {
    /// The inference engine: vllm, sglang or tensorfold. Required, except for an adapter
    /// (spec.adapter), which runs on its base's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = field_description_wins)]
    pub engine: Option<EngineKind>,
    /// The engine's model argument: a hub name or a local checkpoint path. Required, except
    /// for an adapter (spec.adapter).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub model: Option<String>,
    /// Where parked weights go: host_backed (host RAM, discrete cards only), deep (dropped,
    /// reloaded from disk) or restart_only (never park, stop instead). Unset: CapyCTL picks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = field_description_wins)]
    pub residency: Option<Residency>,
    /// Requests the engine runs at once (passed to the engine), 1 to 4096.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 4096))]
    pub max_concurrent_requests: Option<u32>,
    /// Arguments appended to the engine's command line.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extra_args: Vec<String>,
    /// Environment variables of the engine process.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Memory the deployment needs; measured when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourcesSpec>,
    /// Who may start, stop, park and wake the model, and whether it stays loaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lifecycle: Option<LifecycleSpec>,
    /// Makes this a decision model: a fixed prompt answered by one of the options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision: Option<DecisionSpec>,
    /// Instances that run while the model is in use, each on its own GPU (or GPUs) and on
    /// different nodes where they can, 1 to 64 (default 1). The scale subresource's replicas:
    /// `kubectl scale cdep NAME --replicas=3`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 64), extend("default" = 1))]
    pub replicas: Option<u32>,
    /// Autoscaling between scale.min and replicas on the requests in flight per ready
    /// instance. Without it every instance runs while the model is in use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale: Option<ScaleSpec>,
    /// GPUs each instance spans, 1 to 16 (default 1); above 1 the engine's tensor-parallel
    /// option is passed (vLLM and SGLang only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 16))]
    pub gpus_per_instance: Option<u32>,
    /// How requests are spread over the ready instances: least_loaded (default) or prefix
    /// (prompts that share a prefix go to one instance while its load stays within a bound).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = field_description_wins)]
    pub routing: Option<Routing>,
    /// How much the deployment matters beside the others, a 32-bit integer (default 0): it is
    /// never parked or stopped to make room for a deployment of lower priority, lower ones go
    /// first among the victims, and its waiting requests are switched to first.
    // NB: i64 so that an object out of range is still read and reported (`spec.priority`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = -2147483648, max = 2147483647))]
    pub priority: Option<i64>,
    /// Makes this a base that LoRA adapters (Deployments with spec.adapter naming it) are
    /// loaded into on demand.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapters: Option<AdaptersSpec>,
    /// Makes this Deployment a LoRA adapter of another Deployment (its base): it holds only
    /// this (engine and model are its base's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapter: Option<AdapterSpec>,
}

/// The adapters a base deployment takes.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AdaptersSpec {
    /// Adapters loaded at once in each instance, 1 to 256.
    #[schemars(range(min = 1, max = 256))]
    pub max_loaded: u32,
    /// The largest LoRA rank an adapter of this base may have, 1 to 512.
    #[schemars(range(min = 1, max = 512))]
    pub max_rank: u32,
    /// A volume (its source as a Pod spec writes it, e.g. a persistentVolumeClaim) that the
    /// base's engine Pods mount read-only at /capyctl/adapters; the adapters' paths are then
    /// under it. Without it nothing is mounted for them: their paths must be readable in the
    /// Pod as it is (e.g. under the model cache).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
    pub volume: Option<serde_json::Value>,
}

/// What makes a Deployment a LoRA adapter.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AdapterSpec {
    /// The base Deployment's name (in the same namespace); it must have spec.adapters.
    #[schemars(length(min = 1))]
    pub base: String,
    /// The adapter's PEFT directory as the base's engine sees it: an absolute path inside
    /// its Pod (under /capyctl/adapters with the base's spec.adapters.volume).
    #[schemars(length(min = 1))]
    pub path: String,
}

/// Autoscaling of a deployment between `min` and `replicas` instances.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ScaleSpec {
    /// Instances kept running while the model is in use, 0 to replicas (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 64))]
    pub min: Option<u32>,
    /// One more instance is woken or started when the requests in flight per ready instance
    /// pass this, 1 to 32 (default 24).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 32))]
    pub target_in_flight: Option<u32>,
    /// How long the load stays below the target before one instance is parked, 1s to 24h
    /// (default 60s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_down_delay: Option<DurationSetting>,
}

/// Memory a deployment needs.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ResourcesSpec {
    /// GPU memory the deployment needs when loaded, e.g. 40GiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_memory: Option<ByteSize>,
    /// Size of the weights (what a host-RAM park copies), e.g. 8GiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights_memory: Option<ByteSize>,
}

/// Activation and warmth of a deployment.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LifecycleSpec {
    /// on_demand (default): requests and memory pressure move the model; explicit: only
    /// operator commands do.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = field_description_wins)]
    pub activation: Option<Activation>,
    /// true keeps the model loaded; requests still start or wake it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm: Option<bool>,
}

/// A decision model's fixed prompt and options.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DecisionSpec {
    /// The fixed prompt.
    #[schemars(length(min = 1))]
    pub prompt: String,
    /// The answers to choose from: at least 2, distinct.
    #[schemars(length(min = 2), extend("x-kubernetes-list-type" = "set"))]
    pub options: Vec<String>,
}

/// What the server reports about a deployment.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeploymentStatus {
    /// The deployment's ID (a ULID).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deployment_id: Option<String>,
    /// The deployment's state (STATE of capyctl list deployments): derived from its
    /// instances (stopped, starting, ready, parked, ...); for an adapter (spec.adapter) loaded
    /// when an instance of its base has it loaded, else unloaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = state_words)]
    pub state: Option<String>,
    /// Ready instances over replicas, e.g. 1/3 (READY of capyctl list deployments).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<String>,
    /// The replicas of the revision that runs (the scale subresource's status replicas).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u32>,
    /// Instances that are ready (serving requests).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_replicas: Option<u32>,
    /// The deployment's revision; it grows with every change of the spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<u64>,
    /// The HOSTS column of `capyctl list deployments`: comma-separated, `-` for none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hosts: Option<String>,
    /// The deployment's instances.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub instances: Vec<InstanceStatus>,
    /// The checkpoint measurement.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measurement: Option<MeasurementStatus>,
    /// Conditions: Ready, Measured, Parkable (reasons such as capability_missing:deep_park).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// CapyCTL's own record of the deployment (operator stop or start, the instance
    /// generation, the first answer wakes are checked against, the document of the revision
    /// that runs), as JSON; a new leader restores it. Not for users.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lifecycle_record: Option<String>,
}

/// One engine process of a deployment on one host.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InstanceStatus {
    /// The instance's index within the deployment.
    pub index: u32,
    /// The host it runs on.
    pub host_id: String,
    /// Grows each time the instance's engine process is replaced.
    pub generation: u64,
    /// The instance's state.
    pub state: InstanceState,
    /// How the instance parks on its host (host_backed or deep), once chosen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = field_description_wins)]
    pub residency: Option<Residency>,
    /// Why the instance is in its state, when that needs saying (e.g. a failure).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Progress of a checkpoint measurement.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum MeasurementState {
    /// Not measured yet.
    Pending,
    /// Being measured.
    Measuring,
    /// Known.
    Measured,
    /// The measurement failed.
    Failed,
}

/// Where a deployment's memory figures come from.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum MeasurementSource {
    /// From spec.resources.
    Declared,
    /// Measured by a host.
    Measured,
}

/// The checkpoint measurement of a deployment.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MeasurementStatus {
    /// pending, measuring, measured or failed.
    pub state: MeasurementState,
    /// Size of the weights in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights_bytes: Option<u64>,
    /// GPU memory the loaded deployment needs, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_memory_bytes: Option<u64>,
    /// declared (from spec.resources) or measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = field_description_wins)]
    pub source: Option<MeasurementSource>,
    /// Why the measurement failed, when it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// The words `status.state` takes: every instance state, and an adapter's `loaded` and
/// `unloaded` ([`capyctl_spec::api::listed_state`], what the operator writes there).
pub fn deployment_states() -> Vec<&'static str> {
    InstanceState::ALL
        .iter()
        .map(|s| s.as_str())
        .chain([adapter_state(true), adapter_state(false)])
        .collect()
}

/// `status.state`'s schema: a string of [`deployment_states`].
fn state_words(schema: &mut schemars::Schema) {
    schema.insert("enum".to_string(), deployment_states().into());
}

/// The instances of deployment `v` that are ready, and the replicas of the revision that runs
/// (its document's `replicas`): `status.readyReplicas` and `status.replicas`, and READY
/// (`ready/replicas`) of the object and of `capyctl list deployments`.
pub fn ready_replicas(v: &DeploymentView) -> (u32, u32) {
    let ready = v
        .instances
        .iter()
        .filter(|i| i.state == InstanceState::Ready)
        .count();
    (u32::try_from(ready).unwrap_or(u32::MAX), v.spec.replicas())
}

impl From<&DeploymentDoc> for DeploymentSpec {
    fn from(d: &DeploymentDoc) -> Self {
        Self {
            engine: d.engine,
            model: d.model.clone(),
            residency: d.residency,
            max_concurrent_requests: d.max_concurrent_requests,
            extra_args: d.extra_args.clone(),
            env: d.env.clone(),
            resources: d.resources.map(|r| ResourcesSpec {
                gpu_memory: r.gpu_memory,
                weights_memory: r.weights_memory,
            }),
            lifecycle: d.lifecycle.map(|l| LifecycleSpec {
                activation: l.activation,
                warm: l.warm,
            }),
            decision: d.decision.as_ref().map(|x| DecisionSpec {
                prompt: x.prompt.clone(),
                options: x.options.clone(),
            }),
            replicas: d.replicas,
            scale: d.scale.map(|s| ScaleSpec {
                min: s.min,
                target_in_flight: s.target_in_flight,
                scale_down_delay: s.scale_down_delay,
            }),
            gpus_per_instance: d.gpus_per_instance,
            routing: d.routing,
            priority: d.priority.map(i64::from),
            adapters: d.adapters.as_ref().map(|a| AdaptersSpec {
                max_loaded: a.max_loaded,
                max_rank: a.max_rank,
                volume: a.volume.clone(),
            }),
            adapter: d.adapter.as_ref().map(|a| AdapterSpec {
                base: a.base.clone(),
                path: a.path.clone(),
            }),
        }
    }
}

fn camel(snake: &str) -> String {
    let mut out = String::with_capacity(snake.len());
    let mut upper = false;
    for c in snake.chars() {
        if c == '_' {
            upper = true;
        } else if upper {
            out.extend(c.to_uppercase());
            upper = false;
        } else {
            out.push(c);
        }
    }
    out
}

/// A key path of the deployment document renamed to the object's: `name` → `metadata.name`,
/// `max_concurrent_requests` → `spec.maxConcurrentRequests`, `env.MY_VAR` → `spec.env.MY_VAR`.
fn object_path(doc_path: &KeyPath) -> KeyPath {
    let mut segs = doc_path.0.iter();
    let mut out = Vec::new();
    match segs.next() {
        Some(Seg::Key(k)) if k == "name" => {
            out.push(Seg::Key("metadata".into()));
            out.push(Seg::Key("name".into()));
        }
        Some(Seg::Key(k)) => {
            out.push(Seg::Key("spec".into()));
            out.push(Seg::Key(camel(k)));
            let under_env = k == "env";
            for s in segs {
                out.push(match s {
                    Seg::Key(k) if !under_env => Seg::Key(camel(k)),
                    other => other.clone(),
                });
            }
        }
        Some(other) => out.push(other.clone()),
        None => {}
    }
    KeyPath(out)
}

impl DeploymentSpec {
    /// The deployment document of this spec named `name`, after every rule of a deployment
    /// document (name, ranges, options). A refusal names `metadata.name` or `spec.<field>`;
    /// `origin` says where the object came from (e.g. `Deployment default/my-model`).
    pub fn to_document(&self, name: &str, origin: Origin) -> Result<DeploymentDoc, DocumentError> {
        self.to_document_at(name, &|_| origin.clone())
    }

    fn to_document_at(
        &self,
        name: &str,
        origin_of: &dyn Fn(&KeyPath) -> Origin,
    ) -> Result<DeploymentDoc, DocumentError> {
        let value = serde_json::json!({
            "name": name,
            "engine": self.engine,
            "model": self.model,
            "residency": self.residency,
            "max_concurrent_requests": self.max_concurrent_requests,
            "extra_args": self.extra_args,
            "env": self.env,
            "resources": self.resources.map(|r| serde_json::json!({
                "gpu_memory": r.gpu_memory,
                "weights_memory": r.weights_memory,
            })),
            "lifecycle": self.lifecycle.map(|l| serde_json::json!({
                "activation": l.activation,
                "warm": l.warm,
            })),
            "decision": self.decision.as_ref().map(|d| serde_json::json!({
                "prompt": d.prompt,
                "options": d.options,
            })),
            // The API server fills in the schema's default (1), which is the document's
            // unset: an object it defaulted gives the same document as before (no new
            // revision), and `replicas: 1` the same as no `replicas`.
            "replicas": self.replicas.filter(|&n| n != DEFAULT_REPLICAS),
            "scale": self.scale.map(|s| serde_json::json!({
                "min": s.min,
                "target_in_flight": s.target_in_flight,
                "scale_down_delay": s.scale_down_delay,
            })),
            "gpus_per_instance": self.gpus_per_instance,
            "routing": self.routing,
            "priority": self.priority,
            "adapters": self.adapters.as_ref().map(|a| serde_json::json!({
                "max_loaded": a.max_loaded,
                "max_rank": a.max_rank,
                "volume": a.volume,
            })),
            "adapter": self.adapter.as_ref().map(|a| serde_json::json!({
                "base": a.base,
                "path": a.path,
            })),
        });
        capyctl_spec::documents::deployment_from_json(value).map_err(|(path, problem)| {
            let path = object_path(&path);
            DocumentError {
                origin: origin_of(&path),
                path: path.display(),
                problem,
            }
        })
    }
}

impl Deployment {
    /// A `Deployment` object of a deployment document.
    pub fn from_document(doc: &DeploymentDoc) -> Self {
        Deployment::new(&doc.name, DeploymentSpec::from(doc))
    }

    /// The deployment document of this object, validated (see [`DeploymentSpec::to_document`]).
    pub fn to_document(&self) -> Result<DeploymentDoc, DocumentError> {
        let name = self.metadata.name.clone().unwrap_or_default();
        let origin = Origin::Object(match &self.metadata.namespace {
            Some(ns) => format!("Deployment {ns}/{name}"),
            None => format!("Deployment {name}"),
        });
        self.spec.to_document(&name, origin)
    }
}

/// Parses a `Deployment` manifest (`apiVersion: capyctl.io/v1alpha1`, `kind: Deployment`) and
/// validates its spec like a deployment document; errors name the file, the line and
/// `spec.<field>`.
pub fn parse_deployment_manifest_str(file: &str, text: &str) -> Result<Deployment, DocumentError> {
    let value: serde_yaml_ng::Value = capyctl_spec::documents::parse_plain(file, text)?;
    let err = |path: &[&str], problem: Problem| {
        let path = KeyPath::keys(path);
        DocumentError {
            origin: Origin::File {
                name: file.to_string(),
                line: capyctl_spec::documents::line_of(text, &path),
            },
            path: path.display(),
            problem,
        }
    };
    for (key, want) in [("apiVersion", API_VERSION), ("kind", "Deployment")] {
        match value.get(key).and_then(serde_yaml_ng::Value::as_str) {
            Some(v) if v == want => {}
            Some(v) => {
                return Err(err(
                    &[key],
                    Problem::BadValue(format!("`{v}` is not valid; expected {want}")),
                ));
            }
            None => return Err(err(&[key], Problem::MissingKey)),
        }
    }
    let object: Deployment = capyctl_spec::documents::parse_plain(file, text)?;
    let Some(name) = object.metadata.name.clone() else {
        return Err(err(&["metadata", "name"], Problem::MissingKey));
    };
    object.spec.to_document_at(&name, &|path| Origin::File {
        name: file.to_string(),
        line: capyctl_spec::documents::line_of(text, path),
    })?;
    Ok(object)
}

/// Reads and parses a `Deployment` manifest.
pub fn load_deployment_manifest_file(path: impl AsRef<Path>) -> Result<Deployment, DocumentError> {
    let path = path.as_ref();
    let name = path.display().to_string();
    let text = std::fs::read_to_string(path)
        .map_err(|e| DocumentError::file(&name, None, Problem::Read(e)))?;
    parse_deployment_manifest_str(&name, &text)
}

// ---------------------------------------------------------------------------------------------
// Host
// ---------------------------------------------------------------------------------------------

/// A GPU host as its node agent reports it: GPUs, host memory, engines and the resource policy
/// it applies. Cluster-scoped; one per node labelled capyctl.io/gpu-host=true.
// NB: clippy reads the repeated `type_ = ...` of the printer columns as duplicated attributes.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "capyctl.io",
    version = "v1alpha1",
    kind = "Host",
    plural = "hosts",
    singular = "host",
    status = "HostStatus",
    derive = "PartialEq",
    shortname = "chost",
    category = "capyctl",
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status",
        description = "Whether the node agent is up and reporting"
    ),
    printcolumn(
        name = "Activation",
        type_ = "string",
        json_path = ".spec.lifecycle.activation",
        description = "on_demand or explicit for every model on the host"
    ),
    printcolumn(
        name = "Host Memory",
        type_ = "string",
        json_path = ".spec.hostMemory",
        description = "Host RAM"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    doc = "A CapyCTL GPU host, written by its node agent."
)]
#[serde(rename_all = "camelCase")]
pub struct HostSpec {
    /// The host's GPUs.
    #[serde(default)]
    pub gpus: Vec<GpuSpec>,
    /// Host RAM, e.g. 64GiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_memory: Option<ByteSize>,
    /// The engines the host can run, with their versions and whether they can deep park.
    #[serde(default)]
    pub engines: Vec<EngineSpec>,
    /// How requests wait on this host.
    #[serde(default)]
    pub resource_policy: ResourcePolicySpec,
    /// Activation for every model the host may run.
    #[serde(default)]
    pub lifecycle: HostLifecycleSpec,
}

/// One GPU of a host.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuSpec {
    /// The GPU's UUID, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// The GPU's memory, e.g. 80GiB.
    pub memory: ByteSize,
    /// Whether the GPU shares memory with the host (unified memory: models park deep).
    #[serde(default)]
    pub unified: bool,
}

/// One engine kind on a host.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EngineSpec {
    /// vllm, sglang or tensorfold.
    pub engine: EngineKind,
    /// The engine's version, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// DEEP PARK of capyctl engine list: enabled, or why not.
    pub deep_park: String,
}

/// The resource policy of a host.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResourcePolicySpec {
    /// How requests wait.
    #[serde(default)]
    pub queue: QueueSpec,
}

/// The queue settings a host applies (its resolved resource_policy.queue).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct QueueSpec {
    /// How long the loaded model keeps taking requests once a switch begins, e.g. 2s.
    pub admission_window: DurationSetting,
    /// How long a request may wait for its first output, e.g. 600s.
    pub request_deadline: DurationSetting,
    /// Longest silence in a reply after its first output, e.g. 120s.
    pub stream_idle_timeout: DurationSetting,
    /// Waiting requests per deployment; 0 lets no request wait.
    pub max_pending_per_deployment: u32,
    /// Waiting requests in total.
    pub max_pending_total: u32,
    /// Bytes of waiting request bodies in total, e.g. 64MiB.
    pub max_buffered_bytes_total: ByteSize,
}

impl Default for QueueSpec {
    fn default() -> Self {
        (&QueueSettings::defaults(capyctl_spec::settings::Mode::ServerAndHosts)).into()
    }
}

impl From<&QueueSettings> for QueueSpec {
    fn from(q: &QueueSettings) -> Self {
        Self {
            admission_window: q.admission_window.into(),
            request_deadline: q.request_deadline.into(),
            stream_idle_timeout: q.stream_idle_timeout.into(),
            max_pending_per_deployment: q.max_pending_per_deployment,
            max_pending_total: q.max_pending_total,
            max_buffered_bytes_total: q.max_buffered_bytes_total.into(),
        }
    }
}

/// The settings a published `Host` says, each brought within its range (and the admission
/// window not above the request deadline), as a host document's are: the CRD's schema bounds
/// neither the durations nor the sizes, so an object edited by hand can hold any.
impl From<&QueueSpec> for QueueSettings {
    fn from(q: &QueueSpec) -> Self {
        let request_deadline = REQUEST_DEADLINE_BOUNDS.clamp(q.request_deadline.as_duration());
        Self {
            admission_window: ADMISSION_WINDOW_BOUNDS
                .clamp(q.admission_window.as_duration())
                .min(request_deadline),
            request_deadline,
            stream_idle_timeout: STREAM_IDLE_TIMEOUT_BOUNDS
                .clamp(q.stream_idle_timeout.as_duration()),
            max_pending_per_deployment: MAX_PENDING_PER_DEPLOYMENT_BOUNDS
                .clamp(q.max_pending_per_deployment),
            max_pending_total: MAX_PENDING_TOTAL_BOUNDS.clamp(q.max_pending_total),
            max_buffered_bytes_total: MAX_BUFFERED_BYTES_TOTAL_BOUNDS
                .clamp(q.max_buffered_bytes_total)
                .as_u64(),
        }
    }
}

/// The lifecycle policy of a host.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HostLifecycleSpec {
    /// on_demand or explicit (every model on the host is then explicit).
    #[serde(default)]
    pub activation: Activation,
}

/// What is observed about a host.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HostStatus {
    /// Conditions: Ready (the node agent is up and reporting).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

// ---------------------------------------------------------------------------------------------
// CRD YAML
// ---------------------------------------------------------------------------------------------

/// The command that regenerates the CRD files.
pub const CRDGEN_COMMAND: &str = "cargo run -p capyctl-crds --bin crdgen";

/// The CRD files: `(file name, YAML text)`, for `charts/capyctl/crds/`.
pub fn crd_files() -> Result<Vec<(&'static str, String)>, serde_yaml_ng::Error> {
    Ok(vec![
        ("deployments.capyctl.io.yaml", crd_yaml(&Deployment::crd())?),
        ("hosts.capyctl.io.yaml", crd_yaml(&Host::crd())?),
        ("tenants.capyctl.io.yaml", crd_yaml(&tenant::Tenant::crd())?),
    ])
}

/// One CRD as YAML, with a header saying it is generated.
pub fn crd_yaml(crd: &CustomResourceDefinition) -> Result<String, serde_yaml_ng::Error> {
    Ok(format!(
        "# Generated from the Rust types in crds/src/lib.rs by `{CRDGEN_COMMAND}`; do not edit.\n{}",
        serde_yaml_ng::to_string(crd)?
    ))
}

/// The folder of the CRD files in this repository.
pub fn chart_crd_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/capyctl/crds")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// Found by the `crd` fuzz target: the queue policy the operator takes from a `Host` was
    /// whatever the object said (`admissionWindow: 99999999h`, `maxBufferedBytesTotal: 0B`),
    /// past every range a host document is held to.
    #[test]
    fn a_hosts_queue_policy_is_brought_within_its_ranges() {
        let spec =
            |queue: serde_json::Value| -> QueueSpec { serde_json::from_value(queue).unwrap() };
        let wild = spec(serde_json::json!({
            "admissionWindow": "99999999h",
            "requestDeadline": "0s",
            "streamIdleTimeout": "18446744073709551615ms",
            "maxPendingPerDeployment": 4_000_000_000u32,
            "maxPendingTotal": 4_000_000_000u32,
            "maxBufferedBytesTotal": "0B",
        }));
        let q = QueueSettings::from(&wild);
        assert_eq!(q.request_deadline, REQUEST_DEADLINE_BOUNDS.min);
        assert_eq!(q.admission_window, REQUEST_DEADLINE_BOUNDS.min);
        assert_eq!(q.stream_idle_timeout, STREAM_IDLE_TIMEOUT_BOUNDS.max);
        assert_eq!(
            q.max_pending_per_deployment,
            MAX_PENDING_PER_DEPLOYMENT_BOUNDS.max
        );
        assert_eq!(q.max_pending_total, MAX_PENDING_TOTAL_BOUNDS.max);
        assert_eq!(
            q.max_buffered_bytes_total,
            MAX_BUFFERED_BYTES_TOTAL_BOUNDS.min.as_u64()
        );
        // A policy within its ranges is taken as it is.
        let defaults = QueueSettings::defaults(capyctl_spec::settings::Mode::ServerAndHosts);
        assert_eq!(QueueSettings::from(&QueueSpec::from(&defaults)), defaults);
    }
}
