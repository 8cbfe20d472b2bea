//! The YAML documents of DESIGN.md 4.2 (deployment, host, server, standalone) and their loaders.
//!
//! Each `*Doc` type is what a user writes: every key optional unless the document needs it, and
//! unknown keys refused. Ranges are checked while deserializing, so an error carries the line of
//! the bad value. The loaders then apply [`Overrides`] (with the same validation) and resolve the
//! document into the effective settings of [`crate::settings`] for its [`Mode`]: a standalone
//! document gets the standalone defaults, host and server documents the server-and-hosts ones.
//!
//! Every failure is a [`DocumentError`] whose text names the file and line (or the override),
//! the key path and the problem, e.g.
//! `my-model.yaml:3: resdency: unknown key; expected one of name, engine, model, ...`.

mod check;
pub(crate) mod depth;
mod error;
mod locate;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_yaml_ng::Value;

pub use check::is_dns_label;
pub use depth::MAX_DEPTH;
pub use error::{DocumentError, Origin, Problem};
pub use error::{KeyPath, Seg};

use crate::engine_args;
use crate::kinds::{Activation, EngineKind, Residency, Routing};
use crate::overrides::Overrides;
use crate::settings::{
    EngineCommand, EngineCommands, GpuOverride, HostConfig, LifecycleDefaults, ListenSettings,
    Mode, QueueSettings, ServerConfig, StandaloneConfig, SwitchingSettings, TenantSettings,
    TlsFiles,
};
use crate::tenants::{self, ApiKey, KeyAt, TenantView};
use crate::units::{ByteSize, DurationSetting, format_duration};

// ---------------------------------------------------------------------------------------------
// Deployment document
// ---------------------------------------------------------------------------------------------

/// A deployment document (`capyctl deploy model --file my-model.yaml`): a named model on one
/// engine. Also the body of `POST /management/v1/deployments`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeploymentDoc {
    /// The deployment's name: a DNS-1123 label (1 to 63 of `a-z`, `0-9`, `-`). Requests name
    /// it in their `model` field.
    #[serde(deserialize_with = "check::dns_label")]
    pub name: String,
    /// The engine: `vllm`, `sglang` or `tensorfold`. Required, except in an adapter's
    /// document (`adapter:`), which runs on its base's engine: there it may be left out (the
    /// stored record then carries the base's) or must be the base's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<EngineKind>,
    /// The engine's model argument: a hub name or a local checkpoint path; not empty. Required
    /// except in an adapter's document, as `engine`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::non_empty_opt"
    )]
    pub model: Option<String>,
    /// Where parked weights go; unset lets CapyCTL pick from the hardware.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub residency: Option<Residency>,
    /// Requests the engine runs at once (passed to the engine), 1 to 4096.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::max_concurrent_requests"
    )]
    pub max_concurrent_requests: Option<u32>,
    /// Arguments appended to the engine's command line.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extra_args: Vec<String>,
    /// Environment of the engine process.
    #[serde(
        default,
        skip_serializing_if = "BTreeMap::is_empty",
        deserialize_with = "check::env"
    )]
    pub env: BTreeMap<String, String>,
    /// Memory the deployment needs; measured when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourcesDoc>,
    /// Activation and warmth.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lifecycle: Option<DeploymentLifecycleDoc>,
    /// Makes this a decision model: a fixed prompt answered by one of the options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision: Option<DecisionDoc>,
    /// Instances that run while the model is in use, each on its own GPU (or GPUs), 1 to 64.
    /// Default 1.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::replicas"
    )]
    pub replicas: Option<u32>,
    /// Autoscaling between `scale.min` and `replicas` on the requests in flight per ready
    /// instance. Without it every instance runs while the model is in use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale: Option<ScaleDoc>,
    /// GPUs each instance spans, 1 to 16 (above 1 the engine's tensor-parallel option is
    /// passed). Default 1.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::gpus_per_instance"
    )]
    pub gpus_per_instance: Option<u32>,
    /// How requests are spread over the ready instances. Default `least_loaded`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing: Option<Routing>,
    /// How much the deployment matters beside the others (DESIGN 4.10), any `i32`. Default 0.
    /// It is never parked or stopped to make room for a deployment of lower priority.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::priority"
    )]
    pub priority: Option<i32>,
    /// Makes this a base that LoRA adapters can be loaded into (DESIGN 4.9): its engine is
    /// started with the engine's own adapter options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapters: Option<AdaptersDoc>,
    /// Makes this deployment a LoRA adapter of another deployment (its base), loaded into the
    /// base's instances on demand (DESIGN 4.9).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapter: Option<AdapterDoc>,
}

/// `adapters:` of a base deployment document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdaptersDoc {
    /// Adapters loaded at once in each instance (vLLM `--max-loras`), 1 to 256.
    #[serde(deserialize_with = "check::max_loaded")]
    pub max_loaded: u32,
    /// The largest LoRA rank an adapter of this base may have (vLLM `--max-lora-rank`), 1 to
    /// 512.
    #[serde(deserialize_with = "check::max_rank")]
    pub max_rank: u32,
    /// On Kubernetes: the volume the base's engine Pod mounts read-only at
    /// [`ADAPTERS_MOUNT_PATH`] for the adapters' files (a Kubernetes volume's source, as the
    /// Pod spec writes it); the adapters' `path` is then under that mount path.
    /// Standalone leaves it out: the engine reads the paths on the host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<serde_json::Value>,
}

/// `adapter:` of an adapter's deployment document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdapterDoc {
    /// The base deployment's name; it must exist and allow adapters (`adapters:`).
    #[serde(deserialize_with = "check::dns_label")]
    pub base: String,
    /// The adapter's files: a PEFT directory (`adapter_config.json` and the weights) that the
    /// base's engine can read.
    #[serde(deserialize_with = "check::non_empty")]
    pub path: String,
}

/// Where the engine Pod of a base on Kubernetes mounts its `adapters.volume` (read-only): an
/// adapter's `path` is then a directory under it (`/capyctl/adapters/support-bot`).
pub const ADAPTERS_MOUNT_PATH: &str = "/capyctl/adapters";

/// The keys an adapter's document may hold besides `name` and `adapter` (`engine` and `model`
/// only as its base's): everything else is its base's.
pub const ADAPTER_KEYS: &[&str] = &["name", "adapter", "engine", "model"];

/// `scale:` of a deployment document.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScaleDoc {
    /// Instances kept running while the model is in use, 0 to `replicas`. Default 1.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::scale_min"
    )]
    pub min: Option<u32>,
    /// One more instance is woken or started when the requests in flight per ready instance
    /// pass this, 1 to 32. Default 24.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::target_in_flight"
    )]
    pub target_in_flight: Option<u32>,
    /// How long the load stays below the target before one instance is parked, 1 s to 24 h.
    /// Default 60 s.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::scale_down_delay"
    )]
    pub scale_down_delay: Option<DurationSetting>,
}

/// A deployment's autoscaling, resolved ([`DeploymentDoc::scale`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scale {
    /// Instances kept running while the model is in use.
    pub min: u32,
    /// In-flight requests per ready instance above which one more comes up.
    pub target_in_flight: u32,
    /// How long the load stays below the target before one instance goes.
    pub scale_down_delay: Duration,
}

/// `resources:` of a deployment document.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResourcesDoc {
    /// GPU memory the deployment needs when loaded (more than 0).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::nonzero_bytes_opt"
    )]
    pub gpu_memory: Option<ByteSize>,
    /// Size of the weights (what a host-RAM park copies), more than 0.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::nonzero_bytes_opt"
    )]
    pub weights_memory: Option<ByteSize>,
}

/// `lifecycle:` of a deployment document.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeploymentLifecycleDoc {
    /// `explicit`: only operator commands move the model. Default `on_demand`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation: Option<Activation>,
    /// `true` keeps the model loaded (never parked or stopped for room or idleness); requests
    /// still start or wake it. Default `false`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm: Option<bool>,
}

/// `decision:` of a deployment document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecisionDoc {
    /// The fixed prompt; not empty.
    #[serde(deserialize_with = "check::non_empty")]
    pub prompt: String,
    /// The answers to choose from: at least 2, distinct, none empty.
    #[serde(deserialize_with = "check::options")]
    pub options: Vec<String>,
}

impl DeploymentDoc {
    /// The engine of a deployed document: every one has it (a model's document needs it, an
    /// adapter's deploy writes its base's). `vllm` only for an adapter's document not deployed
    /// yet, whose engine is its base's.
    pub fn engine_kind(&self) -> EngineKind {
        self.engine.unwrap_or(EngineKind::Vllm)
    }

    /// The engine's model argument of a deployed document (as [`DeploymentDoc::engine_kind`];
    /// empty only for an adapter's document not deployed yet).
    pub fn model_arg(&self) -> &str {
        self.model.as_deref().unwrap_or("")
    }

    /// The base an adapter's document names, `None` for a model's.
    pub fn base(&self) -> Option<&str> {
        self.adapter.as_ref().map(|a| a.base.as_str())
    }

    /// The activation the deployment itself declares (`on_demand` when unset). A host's
    /// `explicit` still wins; see [`crate::Activation`].
    pub fn activation(&self) -> Activation {
        self.lifecycle
            .and_then(|l| l.activation)
            .unwrap_or_default()
    }

    /// Whether `lifecycle.warm` is set.
    pub fn warm(&self) -> bool {
        self.lifecycle.and_then(|l| l.warm).unwrap_or(false)
    }

    /// `replicas` (1 when unset).
    pub fn replicas(&self) -> u32 {
        self.replicas.unwrap_or(1)
    }

    /// `gpus_per_instance` (1 when unset).
    pub fn gpus_per_instance(&self) -> u32 {
        self.gpus_per_instance.unwrap_or(1)
    }

    /// `routing` (`least_loaded` when unset).
    pub fn routing(&self) -> Routing {
        self.routing.unwrap_or_default()
    }

    /// `priority` (0 when unset).
    pub fn priority(&self) -> i32 {
        self.priority.unwrap_or(0)
    }

    /// `scale` with its defaults, or `None` without autoscaling.
    pub fn scale(&self) -> Option<Scale> {
        self.scale.map(|s| Scale {
            min: s.min.unwrap_or(crate::settings::DEFAULT_SCALE_MIN),
            target_in_flight: s
                .target_in_flight
                .unwrap_or(crate::settings::DEFAULT_TARGET_IN_FLIGHT),
            scale_down_delay: s.scale_down_delay.map_or(
                crate::settings::DEFAULT_SCALE_DOWN_DELAY,
                DurationSetting::as_duration,
            ),
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Host document
// ---------------------------------------------------------------------------------------------

/// A host document (`capyctl start host --file host.yaml`), also `host:` of a standalone document.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostDoc {
    /// The host's ID. Default: the machine's hostname.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::host_id"
    )]
    pub id: Option<String>,
    /// Queue settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_policy: Option<ResourcePolicyDoc>,
    /// Activation for every model the host may run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lifecycle: Option<HostLifecycleDoc>,
    /// Engine launch commands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engines: Option<EnginesDoc>,
    /// GPUs replacing what NVML reports (an empty list: no GPU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus: Option<Vec<GpuDoc>>,
    /// Host memory replacing what `/proc/meminfo` reports (more than 0).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::nonzero_bytes_opt"
    )]
    pub host_memory: Option<ByteSize>,
}

/// `resource_policy:` of a host document.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResourcePolicyDoc {
    /// How requests wait.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<QueueDoc>,
}

/// `resource_policy.queue:` of a host document; see [`QueueSettings`] for defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueDoc {
    /// 1 ms to 30 s, not above the request deadline. Default 2 s.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::admission_window"
    )]
    pub admission_window: Option<DurationSetting>,
    /// 1 ms to 3600 s. Default 1800 s standalone, 600 s for server and hosts.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::request_deadline"
    )]
    pub request_deadline: Option<DurationSetting>,
    /// 1 s to 3600 s. Default 120 s.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::stream_idle_timeout"
    )]
    pub stream_idle_timeout: Option<DurationSetting>,
    /// 0 to 4096. Default 64.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::max_pending_per_deployment"
    )]
    pub max_pending_per_deployment: Option<u32>,
    /// 0 to 65536. Default 256.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::max_pending_total"
    )]
    pub max_pending_total: Option<u32>,
    /// 1 KiB to 16 GiB. Default 64 MiB.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::max_buffered_bytes_total"
    )]
    pub max_buffered_bytes_total: Option<ByteSize>,
}

/// `lifecycle:` of a host document.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostLifecycleDoc {
    /// `explicit` makes every model on this host explicit. Default `on_demand`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation: Option<Activation>,
}

/// `engines:` of a host document.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnginesDoc {
    /// vLLM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vllm: Option<EngineDoc>,
    /// SGLang.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sglang: Option<EngineDoc>,
    /// TensorFold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensorfold: Option<EngineDoc>,
}

/// `engines.<kind>:` of a host document.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineDoc {
    /// Program and leading arguments (a list, the program first); CapyCTL appends its own.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::command"
    )]
    pub command: Option<Vec<String>>,
    /// The engine's version, when declared.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::non_empty_opt"
    )]
    pub version: Option<String>,
    /// Extra environment for every engine of this kind.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::env_opt"
    )]
    pub env: Option<BTreeMap<String, String>>,
}

/// One entry of `gpus:` in a host document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuDoc {
    /// The GPU's memory (more than 0).
    #[serde(deserialize_with = "check::nonzero_bytes")]
    pub memory: ByteSize,
    /// Unified memory (shared with the host). Default `false`.
    #[serde(default)]
    pub unified: bool,
    /// The GPU's UUID, when known.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::non_empty_opt"
    )]
    pub uuid: Option<String>,
}

// ---------------------------------------------------------------------------------------------
// Server document
// ---------------------------------------------------------------------------------------------

/// A server document (`capyctl-operator --file server.yaml`), also `server:` of a standalone
/// document.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerDoc {
    /// Listeners.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listen: Option<ListenDoc>,
    /// Switch timing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub switching: Option<SwitchingDoc>,
    /// Idle timers (both off by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lifecycle_defaults: Option<LifecycleDefaultsDoc>,
    /// A file holding the admin token.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::path_opt"
    )]
    pub admin_token_file: Option<PathBuf>,
    /// API keys and tenants of the inference listener (standalone only; on Kubernetes,
    /// `Tenant` objects): off when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inference_auth: Option<InferenceAuthDoc>,
}

/// `inference_auth:` of a standalone document's `server:`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InferenceAuthDoc {
    /// The tenants; at least one (remove `inference_auth` for no keys).
    pub tenants: Vec<TenantDoc>,
}

/// One tenant of `inference_auth.tenants` (the rules: [`crate::tenants`]).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantDoc {
    /// Its name (metrics, the load read, `capyctl tenants list`): a DNS-1123 label.
    pub name: String,
    /// Its API keys (several allow a rotation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keys: Option<Vec<ApiKey>>,
    /// Files holding one key each (surrounding whitespace ignored), read at the start and on
    /// each SIGHUP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_files: Option<Vec<PathBuf>>,
    /// Model names or globs it may use; every model when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub models: Option<Vec<String>>,
    /// Its rates; not limited when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<RateDoc>,
}

impl std::fmt::Debug for TenantDoc {
    // Keys are never shown.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TenantDoc")
            .field("name", &self.name)
            .field("keys", &self.keys.as_ref().map(Vec::len))
            .field("key_files", &self.key_files)
            .field("models", &self.models)
            .field("rate", &self.rate)
            .finish()
    }
}

/// `rate:` of a tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateDoc {
    /// 1 to 1,000,000; not limited when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_minute: Option<u64>,
    /// Prompt and completion tokens, as the engine counts them, 1 to 10^10; not limited when
    /// absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_minute: Option<u64>,
}

/// `listen:` of a server document.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenDoc {
    /// Inference listener address. Default `127.0.0.1:8080`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::socket_addr"
    )]
    pub inference: Option<SocketAddr>,
    /// Management listener address. Default `127.0.0.1:7443`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::socket_addr"
    )]
    pub management: Option<SocketAddr>,
    /// TLS for both listeners; plain HTTP when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsDoc>,
}

/// `listen.tls:` of a server document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsDoc {
    /// PEM certificate chain file.
    #[serde(deserialize_with = "check::path")]
    pub cert: PathBuf,
    /// PEM private key file.
    #[serde(deserialize_with = "check::path")]
    pub key: PathBuf,
}

/// `switching:` of a server document.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SwitchingDoc {
    /// 1 s to 600 s. Default 30 s.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::drain_timeout"
    )]
    pub drain_timeout: Option<DurationSetting>,
    /// 1 s to 3600 s. Default 600 s.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::wake_timeout"
    )]
    pub wake_timeout: Option<DurationSetting>,
}

/// `lifecycle_defaults:` of a server document.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LifecycleDefaultsDoc {
    /// 1 s to 7 days; off when absent.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::idle_timeout"
    )]
    pub ready_idle_timeout: Option<DurationSetting>,
    /// 1 s to 7 days; off when absent.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "check::idle_timeout"
    )]
    pub parked_idle_timeout: Option<DurationSetting>,
}

// ---------------------------------------------------------------------------------------------
// Standalone document
// ---------------------------------------------------------------------------------------------

/// A standalone document (`capyctl start standalone --file standalone.yaml`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StandaloneDoc {
    /// The server part.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<ServerDoc>,
    /// The host part.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<HostDoc>,
    /// Deployments deployed (not started) at start; names must be unique.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deployments: Option<Vec<DeploymentDoc>>,
}

// ---------------------------------------------------------------------------------------------
// Resolution: documents into effective settings
// ---------------------------------------------------------------------------------------------

/// Where a document came from, to name the origin of errors found after deserialization.
struct Source<'a> {
    file: &'a str,
    text: Option<&'a str>,
    overrides: &'a Overrides,
}

impl Source<'_> {
    /// The override that set `path` (or a key above or below it), the last one winning;
    /// otherwise the file with the line of `path`.
    fn origin(&self, path: &KeyPath) -> Origin {
        if !path.0.is_empty() {
            let hit = self.overrides.entries().iter().rev().find(|o| {
                let key = KeyPath(o.key.iter().cloned().map(Seg::Key).collect());
                key.is_prefix_of(path) || path.is_prefix_of(&key)
            });
            if let Some(o) = hit {
                return Origin::Override(o.source.clone());
            }
        }
        Origin::File {
            name: self.file.to_string(),
            line: self.text.and_then(|t| locate::find_line(t, path)),
        }
    }

    fn error(&self, path: KeyPath, problem: Problem) -> DocumentError {
        // A key that is missing has no line of its own: its mapping's, as serde's error has.
        let at = match problem {
            Problem::MissingKey => KeyPath(path.0[..path.0.len().saturating_sub(1)].to_vec()),
            _ => path.clone(),
        };
        let mut origin = self.origin(&at);
        if let (true, Some(text), Origin::File { line, .. }) =
            (at.0.is_empty(), self.text, &mut origin)
        {
            // The document's own mapping: where it begins.
            *line = text
                .lines()
                .position(|l| {
                    let l = l.trim();
                    !(l.is_empty() || l.starts_with('#') || l == "---")
                })
                .map(|i| i + 1);
        }
        DocumentError {
            origin,
            path: path.display(),
            problem,
        }
    }
}

fn resolve_queue(
    doc: Option<&QueueDoc>,
    mode: Mode,
    at: &KeyPath,
    src: &Source<'_>,
) -> Result<QueueSettings, DocumentError> {
    let mut q = QueueSettings::defaults(mode);
    let Some(d) = doc else { return Ok(q) };
    if let Some(v) = d.admission_window {
        q.admission_window = v.as_duration();
    }
    if let Some(v) = d.request_deadline {
        q.request_deadline = v.as_duration();
    }
    if let Some(v) = d.stream_idle_timeout {
        q.stream_idle_timeout = v.as_duration();
    }
    if let Some(v) = d.max_pending_per_deployment {
        q.max_pending_per_deployment = v;
    }
    if let Some(v) = d.max_pending_total {
        q.max_pending_total = v;
    }
    if let Some(v) = d.max_buffered_bytes_total {
        q.max_buffered_bytes_total = v.as_u64();
    }
    if q.admission_window > q.request_deadline {
        let window = at.child("admission_window");
        let deadline = at.child("request_deadline");
        let (aw, rd) = (
            format_duration(q.admission_window),
            format_duration(q.request_deadline),
        );
        return Err(if d.admission_window.is_some() {
            let name = deadline.display().unwrap_or_default();
            src.error(
                window,
                Problem::Conflict(format!(
                    "{aw} is above the request deadline ({rd}); the admission window must not be above {name}"
                )),
            )
        } else {
            let name = window.display().unwrap_or_default();
            src.error(
                deadline,
                Problem::Conflict(format!(
                    "{rd} is below the admission window ({aw}, the default of {name}); the request deadline must not be below the admission window"
                )),
            )
        });
    }
    Ok(q)
}

fn resolve_engine(kind: EngineKind, doc: Option<&EngineDoc>) -> EngineCommand {
    let mut e = EngineCommand::default_for(kind);
    if let Some(d) = doc {
        if let Some(c) = &d.command {
            e.command = c.clone();
        }
        e.version = d.version.clone();
        e.env = d.env.clone().unwrap_or_default();
    }
    e
}

fn resolve_host(
    doc: &HostDoc,
    mode: Mode,
    at: &KeyPath,
    src: &Source<'_>,
) -> Result<HostConfig, DocumentError> {
    let queue = resolve_queue(
        doc.resource_policy.as_ref().and_then(|r| r.queue.as_ref()),
        mode,
        &at.child("resource_policy").child("queue"),
        src,
    )?;
    let engines = doc.engines.as_ref();
    Ok(HostConfig {
        id: doc
            .id
            .clone()
            .unwrap_or_else(crate::settings::default_host_id),
        queue,
        activation: doc.lifecycle.and_then(|l| l.activation).unwrap_or_default(),
        engines: EngineCommands {
            vllm: resolve_engine(EngineKind::Vllm, engines.and_then(|e| e.vllm.as_ref())),
            sglang: resolve_engine(EngineKind::Sglang, engines.and_then(|e| e.sglang.as_ref())),
            tensorfold: resolve_engine(
                EngineKind::Tensorfold,
                engines.and_then(|e| e.tensorfold.as_ref()),
            ),
        },
        gpus: doc.gpus.as_ref().map(|g| {
            g.iter()
                .map(|g| GpuOverride {
                    memory: g.memory.as_u64(),
                    unified: g.unified,
                    uuid: g.uuid.clone(),
                })
                .collect()
        }),
        host_memory: doc.host_memory.map(ByteSize::as_u64),
    })
}

fn resolve_server(doc: &ServerDoc) -> ServerConfig {
    let defaults = ListenSettings::default();
    let listen = doc.listen.as_ref();
    let switching = doc.switching.unwrap_or_default();
    let idle = doc.lifecycle_defaults.unwrap_or_default();
    ServerConfig {
        listen: ListenSettings {
            inference: listen
                .and_then(|l| l.inference)
                .unwrap_or(defaults.inference),
            management: listen
                .and_then(|l| l.management)
                .unwrap_or(defaults.management),
            tls: listen.and_then(|l| l.tls.as_ref()).map(|t| TlsFiles {
                cert: t.cert.clone(),
                key: t.key.clone(),
            }),
        },
        switching: SwitchingSettings {
            drain_timeout: switching
                .drain_timeout
                .map_or(SwitchingSettings::defaults().drain_timeout, |d| {
                    d.as_duration()
                }),
            wake_timeout: switching
                .wake_timeout
                .map_or(SwitchingSettings::defaults().wake_timeout, |d| {
                    d.as_duration()
                }),
        },
        lifecycle_defaults: LifecycleDefaults {
            ready_idle_timeout: idle.ready_idle_timeout.map(DurationSetting::as_duration),
            parked_idle_timeout: idle.parked_idle_timeout.map(DurationSetting::as_duration),
        },
        admin_token_file: doc.admin_token_file.clone(),
        inference_auth: None,
    }
}

/// `server.inference_auth` of a standalone document: its key files read, checked whole
/// ([`tenants::check`]); `None` when absent.
fn resolve_tenants(
    doc: Option<&InferenceAuthDoc>,
    src: &Source<'_>,
) -> Result<Option<Vec<TenantSettings>>, DocumentError> {
    let Some(auth) = doc else {
        return Ok(None);
    };
    let base = KeyPath::keys(&["server", "inference_auth", "tenants"]);
    if auth.tenants.is_empty() {
        return Err(src.error(
            base,
            Problem::BadValue(
                "no tenants: list at least one, or remove inference_auth to serve without keys"
                    .to_string(),
            ),
        ));
    }
    let mut resolved = Vec::with_capacity(auth.tenants.len());
    for (i, t) in auth.tenants.iter().enumerate() {
        let mut keys: Vec<ApiKey> = t.keys.clone().unwrap_or_default();
        for (j, path) in t.key_files.iter().flatten().enumerate() {
            let text = std::fs::read_to_string(path).map_err(|e| {
                src.error(
                    base.index(i).child("key_files").index(j),
                    Problem::BadValue(format!("cannot read the key file {}: {e}", path.display())),
                )
            })?;
            keys.push(ApiKey(text.trim().to_string()));
        }
        resolved.push(TenantSettings {
            name: t.name.clone(),
            keys,
            models: t.models.clone(),
            requests_per_minute: t.rate.and_then(|r| r.requests_per_minute),
            tokens_per_minute: t.rate.and_then(|r| r.tokens_per_minute),
        });
    }
    let in_doc = listed_keys(&auth.tenants);
    let views: Vec<TenantView<'_>> = resolved
        .iter()
        .zip(&in_doc)
        .map(|(t, &listed)| TenantView {
            name: &t.name,
            keys: t
                .keys
                .iter()
                .enumerate()
                .map(|(j, k)| KeyAt {
                    list: if j < listed { "keys" } else { "key_files" },
                    index: if j < listed { j } else { j - listed },
                    key: &k.0,
                })
                .collect(),
            models: t.models.as_deref(),
            requests_per_minute: t.requests_per_minute,
            tokens_per_minute: t.tokens_per_minute,
        })
        .collect();
    tenants::check(&views).map_err(|(path, why)| {
        let mut at = base.clone();
        at.0.extend(path.0);
        src.error(at, Problem::BadValue(why))
    })?;
    Ok(Some(resolved))
}

/// How many keys each tenant lists in `keys` (those from `key_files` follow them).
fn listed_keys(tenants: &[TenantDoc]) -> Vec<usize> {
    tenants
        .iter()
        .map(|t| t.keys.as_ref().map_or(0, Vec::len))
        .collect()
}

fn resolve_standalone(
    doc: &StandaloneDoc,
    src: &Source<'_>,
) -> Result<StandaloneConfig, DocumentError> {
    let mut server = resolve_server(&doc.server.clone().unwrap_or_default());
    server.inference_auth = resolve_tenants(
        doc.server.as_ref().and_then(|s| s.inference_auth.as_ref()),
        src,
    )?;
    let host = resolve_host(
        &doc.host.clone().unwrap_or_default(),
        Mode::Standalone,
        &KeyPath::keys(&["host"]),
        src,
    )?;
    let deployments = doc.deployments.clone().unwrap_or_default();
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, d) in deployments.iter().enumerate() {
        if let Err((path, problem)) = check_deployment(d) {
            let mut at = KeyPath::keys(&["deployments"]).index(i);
            at.0.extend(path.0);
            return Err(src.error(at, problem));
        }
        if let Some(first) = seen.insert(d.name.as_str(), i) {
            return Err(src.error(
                KeyPath::keys(&["deployments"]).index(i).child("name"),
                Problem::Conflict(format!(
                    "`{}` is already the name of deployments[{first}]; deployment names must be unique",
                    d.name
                )),
            ));
        }
    }
    Ok(StandaloneConfig {
        server,
        host,
        deployments,
    })
}

impl HostDoc {
    /// The effective settings of this document for `mode` (`ServerAndHosts` for a host
    /// document, `Standalone` for `host:` of a standalone one).
    pub fn resolve(&self, mode: Mode) -> Result<HostConfig, DocumentError> {
        let src = Source {
            file: "host document",
            text: None,
            overrides: &Overrides::none(),
        };
        resolve_host(self, mode, &KeyPath::default(), &src)
    }
}

impl ServerDoc {
    /// The effective settings of this document (the same in both modes).
    pub fn resolve(&self) -> ServerConfig {
        resolve_server(self)
    }
}

impl StandaloneDoc {
    /// The effective settings of this document.
    pub fn resolve(&self) -> Result<StandaloneConfig, DocumentError> {
        let src = Source {
            file: "standalone document",
            text: None,
            overrides: &Overrides::none(),
        };
        resolve_standalone(self, &src)
    }
}

// ---------------------------------------------------------------------------------------------
// Parsing
// ---------------------------------------------------------------------------------------------

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "empty",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Sequence(_) => "a list",
        Value::Mapping(_) => "a mapping",
        Value::Tagged(_) => "a tagged value",
    }
}

/// Turns a path-tracked deserialization error into a [`DocumentError`]. `yaml_line` is the line
/// serde_yaml_ng reported, when the error came from the text.
/// Whether an override sets `path` (or a key above it).
fn overridden(overrides: &Overrides, path: &KeyPath) -> bool {
    !path.0.is_empty()
        && overrides.entries().iter().any(|o| {
            o.key.len() <= path.0.len()
                && o.key
                    .iter()
                    .zip(&path.0)
                    .all(|(k, seg)| matches!(seg, Seg::Key(s) if s == k))
        })
}

fn tracked_error(
    path: &serde_path_to_error::Path,
    message: &str,
    yaml_line: Option<usize>,
    src: &Source<'_>,
) -> DocumentError {
    let raw = KeyPath::from_serde(path);
    let classified = error::classify(message);
    let full = match &classified.missing {
        Some(field) => raw.child(field),
        None => raw.clone(),
    };
    let origin = match (yaml_line, src.origin(&raw)) {
        (Some(line), Origin::File { name, .. }) => Origin::File {
            name,
            line: Some(line),
        },
        (_, origin) => origin,
    };
    DocumentError {
        origin,
        path: full.display(),
        problem: classified.problem,
    }
}

/// Refuses a text nested deeper than [`MAX_DEPTH`], naming the line, before a parser reads it
/// (see [`depth`]: parsing such a text takes long).
fn check_depth(file: &str, text: &str) -> Result<(), DocumentError> {
    depth::check(text)
        .map_err(|line| DocumentError::file(file, Some(line), Problem::TooDeep(MAX_DEPTH)))
}

/// Whether `text` nests at most [`MAX_DEPTH`] collections deep, for YAML read outside the
/// document loaders (override values).
pub(crate) fn within_depth(text: &str) -> bool {
    depth::check(text).is_ok()
}

/// Reads `text` (nesting, syntax, not empty, a mapping), deserializes it with line-accurate
/// errors, then applies `overrides` and deserializes again.
fn parse_with<T: DeserializeOwned>(
    file: &str,
    text: Option<&str>,
    overrides: &Overrides,
) -> Result<T, DocumentError> {
    let no_overrides = Overrides::none();
    let mut value = match text {
        Some(text) => {
            check_depth(file, text)?;
            let value: Value = serde_yaml_ng::from_str(text).map_err(|e| {
                let (msg, line) = error::yaml_message(&e);
                DocumentError::file(file, line, Problem::Syntax(msg))
            })?;
            match &value {
                Value::Null => return Err(DocumentError::file(file, None, Problem::Empty)),
                Value::Mapping(_) => {}
                other => {
                    return Err(DocumentError::file(
                        file,
                        Some(1),
                        Problem::NotAMapping(kind_of(other)),
                    ));
                }
            }
            let src = Source {
                file,
                text: Some(text),
                overrides: &no_overrides,
            };
            let read_text = || -> Result<T, serde_path_to_error::Error<serde_yaml_ng::Error>> {
                serde_path_to_error::deserialize(serde_yaml_ng::Deserializer::from_str(text))
            };
            let refused = |e: &serde_path_to_error::Error<serde_yaml_ng::Error>| {
                let (msg, line) = error::yaml_message(e.inner());
                tracked_error(e.path(), &msg, line, &src)
            };
            if overrides.is_empty() {
                // NB (a document of 100,000 deployments): the typed document is read from the
                // value just parsed, not from the text again (a second parse of the text took
                // half the time, and its events as much memory again as the value). Where that
                // read refuses (a value the text's deserializer reads otherwise, e.g. a plain
                // `123` asked as a string), the text is read as before, which decides, and
                // names the line of what it refuses. NB: read from a borrowed value, its
                // strings copied, not taken: taken, the document's strings stayed where the
                // parse had put them, among its events, and the allocator kept all of that
                // peak (RSS after the start 532 MB instead of 336, no faster).
                if let Ok(typed) = T::deserialize(&value) {
                    return Ok(typed);
                }
                return read_text().map_err(|e| refused(&e));
            }
            // The document alone first, for errors with their line. A value an override
            // replaces is not refused here: the override wins over it (and is checked below).
            match read_text() {
                Err(e) if !overridden(overrides, &KeyPath::from_serde(e.path())) => {
                    return Err(refused(&e));
                }
                Ok(_) | Err(_) => {}
            }
            value
        }
        None => Value::Mapping(Default::default()),
    };
    value.apply_merge().map_err(|e| {
        let (msg, line) = error::yaml_message(&e);
        DocumentError::file(file, line, Problem::Syntax(msg))
    })?;
    overrides.apply(&mut value)?;
    let src = Source {
        file,
        text,
        overrides,
    };
    serde_path_to_error::deserialize(value)
        .map_err(|e| tracked_error(e.path(), &e.inner().to_string(), None, &src))
}

fn read(path: &Path) -> Result<(String, String), DocumentError> {
    let name = path.display().to_string();
    match std::fs::read_to_string(path) {
        Ok(text) => Ok((name, text)),
        Err(e) => Err(DocumentError::file(&name, None, Problem::Read(e))),
    }
}

/// Parses a deployment document. `file` names it in errors.
pub fn parse_deployment_str(file: &str, text: &str) -> Result<DeploymentDoc, DocumentError> {
    let no_overrides = Overrides::none();
    let doc: DeploymentDoc = parse_with(file, Some(text), &no_overrides)?;
    check_deployment(&doc).map_err(|(path, problem)| {
        Source {
            file,
            text: Some(text),
            overrides: &no_overrides,
        }
        .error(path, problem)
    })?;
    Ok(doc)
}

/// The engine option that sets how many requests run at once, when the engine has one.
pub fn max_running_flag(engine: EngineKind) -> Option<&'static str> {
    match engine {
        EngineKind::Vllm => Some("--max-num-seqs"),
        EngineKind::Sglang => Some("--max-running-requests"),
        EngineKind::Tensorfold => None,
    }
}

/// The rules of a deployment document across its keys (after each key's own), for every way
/// a deployment comes in (a file, `deployments:` of a standalone document, the management API,
/// a Kubernetes spec):
/// - a `max_concurrent_requests` needs an engine option to pass it as (TensorFold has none)
///   and must not be said twice (the option also in `extra_args`);
/// - `extra_args` must not set a flag CapyCTL passes the engine itself
///   ([`engine_args::owned_flag`]: where it listens, the model, its served name, parking);
/// - `residency: host_backed` is refused for SGLang with speculative decoding
///   ([`engine_args::speculative`]);
/// - `resources.weights_memory` is part of `resources.gpu_memory`, so not above it.
fn check_deployment(doc: &DeploymentDoc) -> Result<(), (KeyPath, Problem)> {
    let Some(engine) = check_adapters(doc)? else {
        // An adapter's document: the rest is its base's.
        return Ok(());
    };
    check_max_concurrent_requests(doc, engine)?;
    check_replicas(doc, engine)?;
    if let Some((i, owned)) = engine_args::owned_flag(engine, &doc.extra_args) {
        return Err((
            KeyPath::keys(&["extra_args"]).index(i),
            Problem::Conflict(format!(
                "`{}`: CapyCTL sets {} itself ({}); remove it from extra_args",
                doc.extra_args[i], owned.flag, owned.sets
            )),
        ));
    }
    if doc.residency == Some(Residency::HostBacked)
        && engine_args::speculative(engine, &doc.extra_args)
    {
        return Err((
            KeyPath::keys(&["residency"]),
            Problem::Conflict(format!(
                "{}; remove residency (CapyCTL then parks only the KV cache) or set deep or restart_only",
                engine_args::HOST_BACKED_SPECULATIVE
            )),
        ));
    }
    if let Some(ResourcesDoc {
        gpu_memory: Some(gpu),
        weights_memory: Some(weights),
    }) = doc.resources
        && weights > gpu
    {
        return Err((
            KeyPath::keys(&["resources", "weights_memory"]),
            Problem::Conflict(format!(
                "{weights} is above resources.gpu_memory ({gpu}): the weights are part of the GPU memory the loaded model holds; raise gpu_memory or correct weights_memory"
            )),
        ));
    }
    Ok(())
}

/// The rules of `adapters:` and `adapter:` (DESIGN 4.9) that need no other deployment: the
/// engine of a model's document (`Some`), or `None` for an adapter's document, which holds
/// nothing but its name, `adapter:` and (as its base's) `engine` and `model`. A model's
/// document needs `engine` and `model`; `adapters:` needs an engine that loads adapters
/// ([`adapter_support`]). The rules that read the base (it exists, allows adapters, is no
/// adapter itself, the engine and model are its, the files, the rank) are the deploy's
/// ([`check_adapter_of`]).
fn check_adapters(doc: &DeploymentDoc) -> Result<Option<EngineKind>, (KeyPath, Problem)> {
    if doc.adapter.is_none() {
        let Some(engine) = doc.engine else {
            return Err((KeyPath::keys(&["engine"]), Problem::MissingKey));
        };
        if doc.model.is_none() {
            return Err((KeyPath::keys(&["model"]), Problem::MissingKey));
        }
        if doc.adapters.is_some()
            && let Err(why) = adapter_support(engine)
        {
            return Err((
                KeyPath::keys(&["adapters"]),
                Problem::Conflict(format!("{why}; remove adapters or choose vllm or sglang")),
            ));
        }
        if let Some(volume) = doc.adapters.as_ref().and_then(|a| a.volume.as_ref()) {
            let has_source = volume
                .as_object()
                .is_some_and(|o| o.keys().any(|k| k != "name"));
            if !has_source {
                return Err((
                    KeyPath::keys(&["adapters", "volume"]),
                    Problem::BadValue(
                        "not a Pod volume: give its source as a Pod spec writes it, such as {persistentVolumeClaim: {claimName: loras}} (its name is CapyCTL's)".into(),
                    ),
                ));
            }
        }
        return Ok(Some(engine));
    }
    let set = |key: &'static str, is_set: bool| is_set.then_some(key);
    let others = [
        set("residency", doc.residency.is_some()),
        set(
            "max_concurrent_requests",
            doc.max_concurrent_requests.is_some(),
        ),
        set("extra_args", !doc.extra_args.is_empty()),
        set("env", !doc.env.is_empty()),
        set("resources", doc.resources.is_some()),
        set("lifecycle", doc.lifecycle.is_some()),
        set("decision", doc.decision.is_some()),
        set("replicas", doc.replicas.is_some()),
        set("scale", doc.scale.is_some()),
        set("gpus_per_instance", doc.gpus_per_instance.is_some()),
        set("routing", doc.routing.is_some()),
    ];
    if doc.adapters.is_some() {
        return Err((
            KeyPath::keys(&["adapters"]),
            Problem::Conflict(
                "an adapter cannot take adapters of its own (an adapter of an adapter); remove adapters, or adapter to make this a base".into(),
            ),
        ));
    }
    if let Some(key) = others.into_iter().flatten().next() {
        return Err((
            KeyPath::keys(&[key]),
            Problem::Conflict(format!(
                "an adapter runs in its base's engine with the base's {key}; remove {key} (an adapter's document holds name, adapter and, as its base's, engine and model)"
            )),
        ));
    }
    Ok(None)
}

/// Whether `engine` loads LoRA adapters into a running engine, or why not.
pub fn adapter_support(engine: EngineKind) -> Result<(), String> {
    match engine {
        EngineKind::Vllm | EngineKind::Sglang => Ok(()),
        EngineKind::Tensorfold => {
            Err("tensorfold cannot load LoRA adapters into a running engine".into())
        }
    }
}

/// The base deployment as an adapter's deploy reads it ([`check_adapter_of`]).
#[derive(Debug, Clone, Copy)]
pub struct BaseOf<'a> {
    /// The base's document.
    pub doc: &'a DeploymentDoc,
    /// Where the adapter's files can be looked at: `true` where CapyCTL runs on the host whose
    /// engines read `adapter.path` (standalone); `false` on Kubernetes (a path on a node, or in
    /// a volume the base's Pod mounts), where only the engine's load can tell.
    pub files_visible: bool,
}

/// The rules of an adapter's document that read its base (DESIGN 4.9), at deploy, changing
/// nothing: the base (`None`: no deployment of that name) exists, allows adapters and is no
/// adapter itself; `engine` and `model`, when given, are the base's; where the files are
/// visible, `adapter.path` is a directory and the rank its `adapter_config.json` gives
/// (`r`) is not above the base's `adapters.max_rank`; where they are not (Kubernetes),
/// `adapter.path` is an absolute path inside the base's engine Pod, under
/// [`ADAPTERS_MOUNT_PATH`] exactly when the base has `adapters.volume`.
pub fn check_adapter_of(
    doc: &DeploymentDoc,
    base: Option<BaseOf<'_>>,
) -> Result<(), (KeyPath, Problem)> {
    let Some(adapter) = &doc.adapter else {
        return Ok(());
    };
    let key = |k: &str| KeyPath::keys(&["adapter", k]);
    let Some(BaseOf {
        doc: base,
        files_visible,
    }) = base
    else {
        return Err((
            key("base"),
            Problem::BadValue(format!(
                "`{}`: no deployment has that name; deploy the base model (with adapters:) first",
                adapter.base
            )),
        ));
    };
    if base.adapter.is_some() {
        return Err((
            key("base"),
            Problem::BadValue(format!(
                "`{}` is itself an adapter (an adapter of an adapter); name the base model it is loaded into",
                adapter.base
            )),
        ));
    }
    let Some(slots) = &base.adapters else {
        return Err((
            key("base"),
            Problem::BadValue(format!(
                "`{}` does not allow adapters; add adapters: {{max_loaded, max_rank}} to its document",
                adapter.base
            )),
        ));
    };
    if let Some(engine) = doc.engine
        && Some(engine) != base.engine
    {
        return Err((
            KeyPath::keys(&["engine"]),
            Problem::Conflict(format!(
                "{engine}: an adapter runs on its base's engine; remove engine (the base `{}` runs {})",
                adapter.base,
                base.engine.map_or("none", EngineKind::as_str)
            )),
        ));
    }
    if let Some(model) = &doc.model
        && Some(model) != base.model.as_ref()
    {
        return Err((
            KeyPath::keys(&["model"]),
            Problem::Conflict(format!(
                "`{model}`: an adapter is loaded into its base's model; remove model (the base `{}` runs `{}`)",
                adapter.base,
                base.model.as_deref().unwrap_or("")
            )),
        ));
    }
    if !files_visible {
        return check_pod_path(&adapter.path, slots.volume.is_some(), &adapter.base)
            .map_err(|why| (key("path"), Problem::BadValue(why)));
    }
    let dir = Path::new(&adapter.path);
    if !dir.is_dir() {
        let what = if dir.exists() {
            "is not a directory"
        } else {
            "does not exist"
        };
        return Err((
            key("path"),
            Problem::BadValue(format!(
                "`{}` {what}; an adapter's path is a PEFT directory (adapter_config.json and the weights) that the engine can read",
                adapter.path
            )),
        ));
    }
    if let Some(rank) = adapter_rank(dir)
        && rank > slots.max_rank
    {
        return Err((
            key("path"),
            Problem::OutOfRange(format!(
                "the adapter's rank {rank} (r in adapter_config.json) is above its base's adapters.max_rank ({}); raise the base's max_rank or use an adapter of a lower rank",
                slots.max_rank
            )),
        ));
    }
    Ok(())
}

/// Where the files are not visible (Kubernetes), `adapter.path` is the directory as the base's
/// engine reads it inside its Pod: an absolute path with no `..`; under
/// [`ADAPTERS_MOUNT_PATH`] when the base has `adapters.volume` (mounted there), and not under it
/// when the base has none (nothing is mounted there). `Err` says why, naming the base.
fn check_pod_path(path: &str, volume: bool, base: &str) -> Result<(), String> {
    use std::path::Component;
    let p = Path::new(path);
    let plain = p
        .components()
        .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
    if !p.is_absolute() || !plain {
        return Err(format!(
            "`{path}` is not an absolute path without `..`; an adapter's path is where the base's engine reads it inside its Pod (under {ADAPTERS_MOUNT_PATH}/ with the base's adapters.volume)"
        ));
    }
    let inside = p.starts_with(ADAPTERS_MOUNT_PATH) && p != Path::new(ADAPTERS_MOUNT_PATH);
    match (volume, inside) {
        (true, false) => Err(format!(
            "`{path}` is outside the base `{base}`'s adapters.volume, which its engine Pod mounts at {ADAPTERS_MOUNT_PATH}: give the directory under it ({ADAPTERS_MOUNT_PATH}/<directory in the volume>)"
        )),
        (false, true) => Err(format!(
            "`{path}`: the base `{base}` has no adapters.volume, so nothing is mounted at {ADAPTERS_MOUNT_PATH}; give the base a volume, or a path its engine Pod can read"
        )),
        _ => Ok(()),
    }
}

/// The LoRA rank (`r`) that a PEFT directory's `adapter_config.json` gives, when it can be read.
pub fn adapter_rank(dir: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(dir.join("adapter_config.json")).ok()?;
    let value: serde_json::Value = serde_json::from_str(&text).ok()?;
    value.get("r")?.as_u64().and_then(|r| u32::try_from(r).ok())
}

/// `scale.min` is not above `replicas`, and an instance spans several GPUs only on an engine
/// with a tensor-parallel option.
fn check_replicas(doc: &DeploymentDoc, engine: EngineKind) -> Result<(), (KeyPath, Problem)> {
    if let Some(min) = doc.scale.and_then(|s| s.min)
        && min > doc.replicas()
    {
        return Err((
            KeyPath::keys(&["scale", "min"]),
            Problem::Conflict(format!(
                "{min} is above replicas ({}): the deployment scales between scale.min and replicas; raise replicas or lower scale.min",
                doc.replicas()
            )),
        ));
    }
    let gpus = doc.gpus_per_instance();
    if gpus > 1 && engine_args::tensor_parallel_flag(engine).is_none() {
        return Err((
            KeyPath::keys(&["gpus_per_instance"]),
            Problem::Conflict(format!(
                "{gpus} cannot be passed to {engine}: it has no tensor-parallel option, so an instance runs on one GPU; remove gpus_per_instance"
            )),
        ));
    }
    Ok(())
}

fn check_max_concurrent_requests(
    doc: &DeploymentDoc,
    engine: EngineKind,
) -> Result<(), (KeyPath, Problem)> {
    let Some(n) = doc.max_concurrent_requests else {
        return Ok(());
    };
    match max_running_flag(engine) {
        None => Err((
            KeyPath::keys(&["max_concurrent_requests"]),
            Problem::Conflict(format!(
                "{n} cannot be passed to {engine}: it has no option for how many requests run at once; remove max_concurrent_requests"
            )),
        )),
        Some(flag) => match engine_args::flag_position(&doc.extra_args, flag) {
            Some(i) => Err((
                KeyPath::keys(&["extra_args"]).index(i),
                Problem::Conflict(format!(
                    "{flag} here and max_concurrent_requests both set how many requests run at once; keep one"
                )),
            )),
            None => Ok(()),
        },
    }
}

/// Reads and parses a deployment document.
pub fn load_deployment_file(path: impl AsRef<Path>) -> Result<DeploymentDoc, DocumentError> {
    let (name, text) = read(path.as_ref())?;
    parse_deployment_str(&name, &text)
}

/// Parses a host document with overrides into the server-and-hosts settings of a host.
pub fn parse_host_str(
    file: &str,
    text: &str,
    overrides: &Overrides,
) -> Result<HostConfig, DocumentError> {
    let doc: HostDoc = parse_with(file, Some(text), overrides)?;
    let src = Source {
        file,
        text: Some(text),
        overrides,
    };
    resolve_host(&doc, Mode::ServerAndHosts, &KeyPath::default(), &src)
}

/// Reads and parses a host document with overrides.
pub fn load_host_file(
    path: impl AsRef<Path>,
    overrides: &Overrides,
) -> Result<HostConfig, DocumentError> {
    let (name, text) = read(path.as_ref())?;
    parse_host_str(&name, &text, overrides)
}

/// A server document (the operator's) takes no `inference_auth`: its tenants are `Tenant`
/// objects.
fn refuse_inference_auth(
    doc: &ServerDoc,
    file: &str,
    text: Option<&str>,
    overrides: &Overrides,
) -> Result<(), DocumentError> {
    if doc.inference_auth.is_none() {
        return Ok(());
    }
    let src = Source {
        file,
        text,
        overrides,
    };
    Err(src.error(
        KeyPath::keys(&["inference_auth"]),
        Problem::Conflict(
            "on Kubernetes the inference listener's tenants are `Tenant` objects; inference_auth belongs to a standalone document's server:".to_string(),
        ),
    ))
}

/// Parses a server document with overrides.
pub fn parse_server_str(
    file: &str,
    text: &str,
    overrides: &Overrides,
) -> Result<ServerConfig, DocumentError> {
    let doc: ServerDoc = parse_with(file, Some(text), overrides)?;
    refuse_inference_auth(&doc, file, Some(text), overrides)?;
    Ok(resolve_server(&doc))
}

/// Reads and parses a server document with overrides.
pub fn load_server_file(
    path: impl AsRef<Path>,
    overrides: &Overrides,
) -> Result<ServerConfig, DocumentError> {
    let (name, text) = read(path.as_ref())?;
    parse_server_str(&name, &text, overrides)
}

/// The server settings when no server document is given (`capyctl-operator` without `--file`):
/// the defaults with the overrides applied.
pub fn server_from_overrides(overrides: &Overrides) -> Result<ServerConfig, DocumentError> {
    let doc: ServerDoc = parse_with("server settings", None, overrides)?;
    refuse_inference_auth(&doc, "server settings", None, overrides)?;
    Ok(resolve_server(&doc))
}

/// Parses a standalone document with overrides into the standalone settings.
pub fn parse_standalone_str(
    file: &str,
    text: &str,
    overrides: &Overrides,
) -> Result<StandaloneConfig, DocumentError> {
    let doc: StandaloneDoc = parse_with(file, Some(text), overrides)?;
    let src = Source {
        file,
        text: Some(text),
        overrides,
    };
    resolve_standalone(&doc, &src)
}

/// Reads and parses a standalone document with overrides.
pub fn load_standalone_file(
    path: impl AsRef<Path>,
    overrides: &Overrides,
) -> Result<StandaloneConfig, DocumentError> {
    let (name, text) = read(path.as_ref())?;
    parse_standalone_str(&name, &text, overrides)
}

/// The standalone settings when no document is given (`capyctl start standalone` without
/// `--file`): the standalone defaults with the overrides applied.
pub fn standalone_from_overrides(overrides: &Overrides) -> Result<StandaloneConfig, DocumentError> {
    let doc: StandaloneDoc = parse_with("standalone settings", None, overrides)?;
    let src = Source {
        file: "standalone settings",
        text: None,
        overrides,
    };
    resolve_standalone(&doc, &src)
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// Parses a deployment document sent as JSON (`POST /management/v1/deployments`), with every
/// rule of a deployment document; `file` names it in errors. A refusal names the key path
/// (`resources.gpu_memory: ...`) and the problem as for a YAML file, without a line (the value
/// is read again as YAML from a re-written text, whose lines are not the client's), except a
/// refusal of the nesting, which names the client's line.
pub fn parse_deployment_json(file: &str, text: &str) -> Result<DeploymentDoc, DocumentError> {
    check_depth(file, text)?;
    let no_line = |e: DocumentError| DocumentError {
        origin: Origin::File {
            name: file.to_string(),
            line: None,
        },
        ..e
    };
    let json_err = match serde_json::from_str::<DeploymentDoc>(text) {
        Ok(doc) => {
            // The rules across keys, which serde alone does not apply.
            return check_deployment(&doc)
                .map(|()| doc)
                .map_err(|(path, problem)| DocumentError {
                    origin: Origin::File {
                        name: file.to_string(),
                        line: None,
                    },
                    path: path.display(),
                    problem,
                });
        }
        Err(e) => e,
    };
    let value: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| DocumentError::file(file, None, Problem::Json(e.to_string())))?;
    if !value.is_object() {
        return Err(DocumentError::file(
            file,
            None,
            Problem::NotAnObject(json_kind(&value)),
        ));
    }
    // JSON is YAML: the pretty form (spaces, no tabs) goes through the same parser as a file,
    // whose error names the key path.
    let plain = || DocumentError::file(file, None, Problem::BadValue(json_err.to_string()));
    let Ok(pretty) = serde_json::to_string_pretty(&value) else {
        return Err(plain());
    };
    match parse_deployment_str(file, &pretty) {
        Err(e) => Err(no_line(e)),
        Ok(_) => Err(plain()),
    }
}

/// Reads a deployment document held as JSON (the management API, a Kubernetes spec turned into
/// document form), returning the raw key path of a refusal for the caller to rename.
pub fn deployment_from_json(value: serde_json::Value) -> Result<DeploymentDoc, (KeyPath, Problem)> {
    let doc: DeploymentDoc = serde_path_to_error::deserialize(value).map_err(|e| {
        let raw = KeyPath::from_serde(e.path());
        let c = error::classify(&e.inner().to_string());
        let path = match c.missing {
            Some(f) => raw.child(&f),
            None => raw,
        };
        (path, c.problem)
    })?;
    check_deployment(&doc)?;
    Ok(doc)
}

/// The line of `path` in block-style YAML `text`, for callers that validate after parsing.
pub fn line_of(text: &str, path: &KeyPath) -> Option<usize> {
    locate::find_line(text, path)
}

/// Shared by the Kubernetes manifest loader: syntax, emptiness and mapping checks, then a
/// line-accurate typed parse.
pub fn parse_plain<T: DeserializeOwned>(file: &str, text: &str) -> Result<T, DocumentError> {
    parse_with(file, Some(text), &Overrides::none())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// The typed document is read from the parsed value; where that read refuses and the text's
    /// deserializer accepts (a plain number asked as a string), the text decides, as before,
    /// and a refusal still names its line.
    #[test]
    fn the_text_decides_where_the_value_refuses() {
        let doc = parse_deployment_str("t.yaml", "name: 123\nengine: vllm\nmodel: 1.5\n").unwrap();
        assert_eq!(
            (doc.name.as_str(), doc.model.as_deref()),
            ("123", Some("1.5"))
        );
        let e = parse_deployment_str(
            "t.yaml",
            "name: a\nengine: vllm\nmodel: m\nreplicas: many\n",
        )
        .unwrap_err();
        assert!(e.to_string().contains("t.yaml:4"), "{e}");
        assert!(e.to_string().contains("replicas"), "{e}");
    }
}
