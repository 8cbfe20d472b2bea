//! What the agent is asked to run: a deployment's launch-relevant fields and the host's engine
//! commands.
//!
//! NB: these are the agent's own input types, kept small on purpose (only what launching, parking
//! and checking need, with sizes in plain bytes). They are built from the `capyctl-crds` types:
//! [`InstanceSpec::from_doc`] from a [`DeploymentDoc`](capyctl_spec::documents::DeploymentDoc)
//! and `HostSettings::from(&HostConfig)` from the resolved host settings. The same types go over
//! the wire to a remote node agent later, so they do not follow every change of the documents.

use std::collections::BTreeMap;

use capyctl_spec::{EngineKind, Residency};
use serde::{Deserialize, Serialize};

/// A decision model's fixed decision (`decision: {prompt, options}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecisionSpec {
    /// The prompt the decision is asked with.
    pub prompt: String,
    /// The options the model picks from.
    pub options: Vec<String>,
}

/// Resources declared in the deployment (`resources: {gpu_memory, weights_memory}`), in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeclaredResources {
    /// GPU memory the engine holds while awake.
    pub gpu_memory: Option<u64>,
    /// Size of the weights (what a host-RAM park copies).
    pub weights_memory: Option<u64>,
}

/// One deployment, as the host agent needs it to launch, park and check an instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceSpec {
    /// The deployment's ID (a ULID).
    pub deployment_id: String,
    /// The deployment's name: the model name clients send (`--served-model-name`).
    pub name: String,
    /// The engine.
    pub engine: EngineKind,
    /// The engine's model argument: a hub name or a local checkpoint path.
    pub model: String,
    /// `residency`, when set.
    pub residency: Option<Residency>,
    /// `max_concurrent_requests`, when set.
    pub max_concurrent_requests: Option<u32>,
    /// `extra_args`, appended after CapyCTL's arguments.
    pub extra_args: Vec<String>,
    /// `env`, added to the engine's environment.
    pub env: BTreeMap<String, String>,
    /// `resources`.
    pub resources: DeclaredResources,
    /// `decision`, for a decision model.
    pub decision: Option<DecisionSpec>,
    /// `gpus_per_instance` above 1: the engine's tensor-parallel option is passed with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensor_parallel: Option<u32>,
    /// `adapters:` of a base deployment (DESIGN 4.9): the engine is started with its own LoRA
    /// flags (vLLM `--enable-lora --max-loras --max-lora-rank`, SGLang likewise) so that
    /// [`HostAgent::load_adapter`](crate::agent::HostAgent::load_adapter) works on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapters: Option<AdapterSlots>,
    /// `adapters.volume` of a base on Kubernetes: the Pod volume (its source, as a Pod spec
    /// writes it) that the engine Pod mounts read-only at
    /// [`ADAPTERS_MOUNT_PATH`](capyctl_spec::documents::ADAPTERS_MOUNT_PATH).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapters_volume: Option<serde_json::Value>,
}

/// How many LoRA adapters one instance holds at once, and the largest rank it takes
/// (`adapters: {max_loaded, max_rank}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdapterSlots {
    /// Adapters loaded at once per instance (vLLM `--max-loras`).
    pub max_loaded: u32,
    /// The largest LoRA rank an adapter may have (vLLM `--max-lora-rank`).
    pub max_rank: u32,
}

impl InstanceSpec {
    /// A spec with only the required fields set.
    pub fn new(
        deployment_id: impl Into<String>,
        name: impl Into<String>,
        engine: EngineKind,
        model: impl Into<String>,
    ) -> Self {
        Self {
            deployment_id: deployment_id.into(),
            name: name.into(),
            engine,
            model: model.into(),
            residency: None,
            max_concurrent_requests: None,
            extra_args: Vec::new(),
            env: BTreeMap::new(),
            resources: DeclaredResources::default(),
            decision: None,
            tensor_parallel: None,
            adapters: None,
            adapters_volume: None,
        }
    }

    /// The spec of deployment `deployment_id` from its document. `lifecycle` is not copied: it
    /// is the lifecycle's business, not the agent's.
    pub fn from_doc(
        deployment_id: impl Into<String>,
        doc: &capyctl_spec::documents::DeploymentDoc,
    ) -> Self {
        Self {
            deployment_id: deployment_id.into(),
            name: doc.name.clone(),
            engine: doc.engine_kind(),
            model: doc.model_arg().to_string(),
            residency: doc.residency,
            max_concurrent_requests: doc.max_concurrent_requests,
            extra_args: doc.extra_args.clone(),
            env: doc.env.clone(),
            resources: doc
                .resources
                .map(|r| DeclaredResources {
                    gpu_memory: r.gpu_memory.map(|b| b.as_u64()),
                    weights_memory: r.weights_memory.map(|b| b.as_u64()),
                })
                .unwrap_or_default(),
            decision: doc.decision.as_ref().map(|d| DecisionSpec {
                prompt: d.prompt.clone(),
                options: d.options.clone(),
            }),
            tensor_parallel: tensor_parallel(doc),
            adapters: doc.adapters.as_ref().map(|a| AdapterSlots {
                max_loaded: a.max_loaded,
                max_rank: a.max_rank,
            }),
            adapters_volume: doc.adapters.as_ref().and_then(|a| a.volume.clone()),
        }
    }

    /// Whether `extra_args` turns on SGLang's speculative decoding (`--speculative-algorithm`).
    pub fn speculative(&self) -> bool {
        capyctl_spec::engine_args::speculative(self.engine, &self.extra_args)
    }
}

/// The tensor-parallel size of `doc`'s engine ([`InstanceSpec::tensor_parallel`]):
/// `gpus_per_instance` above 1.
pub fn tensor_parallel(doc: &capyctl_spec::documents::DeploymentDoc) -> Option<u32> {
    doc.gpus_per_instance.filter(|n| *n > 1)
}

/// How to launch one engine kind (`host.engines.<kind>`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineLaunch {
    /// Program and leading arguments; CapyCTL appends its own.
    pub command: Vec<String>,
    /// The engine's version when the operator declares it.
    pub version: Option<String>,
    /// Environment for every engine of this kind.
    pub env: BTreeMap<String, String>,
}

impl EngineLaunch {
    /// The default command of `kind` (DESIGN 4.2), as the host settings define it.
    pub fn default_for(kind: EngineKind) -> Self {
        capyctl_spec::settings::EngineCommand::default_for(kind).into()
    }
}

impl From<capyctl_spec::settings::EngineCommand> for EngineLaunch {
    fn from(c: capyctl_spec::settings::EngineCommand) -> Self {
        Self {
            command: c.command,
            version: c.version,
            env: c.env,
        }
    }
}

/// A GPU declared in the host document, replacing what NVML reports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuOverride {
    /// Memory in bytes.
    pub memory: u64,
    /// Unified memory (shared with the host).
    pub unified: bool,
    /// The GPU's UUID, when known.
    pub uuid: Option<String>,
}

impl From<&capyctl_spec::settings::GpuOverride> for GpuOverride {
    fn from(g: &capyctl_spec::settings::GpuOverride) -> Self {
        Self {
            memory: g.memory,
            unified: g.unified,
            uuid: g.uuid.clone(),
        }
    }
}

/// The host settings the agent reads, built from the resolved host settings with
/// `HostSettings::from(&HostConfig)` (engines, `gpus`, `host_memory`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostSettings {
    /// vLLM's launch command.
    pub vllm: EngineLaunch,
    /// SGLang's launch command.
    pub sglang: EngineLaunch,
    /// TensorFold's launch command.
    pub tensorfold: EngineLaunch,
    /// GPUs replacing what NVML reports (`host.gpus`).
    pub gpus: Option<Vec<GpuOverride>>,
    /// Host memory in bytes replacing `/proc/meminfo` (`host.host_memory`).
    pub host_memory: Option<u64>,
}

impl HostSettings {
    /// The launch command of `kind`.
    pub fn engine(&self, kind: EngineKind) -> &EngineLaunch {
        match kind {
            EngineKind::Vllm => &self.vllm,
            EngineKind::Sglang => &self.sglang,
            EngineKind::Tensorfold => &self.tensorfold,
        }
    }

    /// Every engine launched with the same command (tests point all three at the simulator).
    pub fn all_engines(command: Vec<String>) -> Self {
        let launch = EngineLaunch {
            command,
            version: None,
            env: BTreeMap::new(),
        };
        Self {
            vllm: launch.clone(),
            sglang: launch.clone(),
            tensorfold: launch,
            gpus: None,
            host_memory: None,
        }
    }
}

impl Default for HostSettings {
    fn default() -> Self {
        Self {
            vllm: EngineLaunch::default_for(EngineKind::Vllm),
            sglang: EngineLaunch::default_for(EngineKind::Sglang),
            tensorfold: EngineLaunch::default_for(EngineKind::Tensorfold),
            gpus: None,
            host_memory: None,
        }
    }
}

impl From<&capyctl_spec::settings::HostConfig> for HostSettings {
    /// The engines' launch commands, `gpus` and `host_memory` of a host; the rest of the host
    /// settings (queue, activation, ID) belong to the router and the lifecycle.
    fn from(h: &capyctl_spec::settings::HostConfig) -> Self {
        Self {
            vllm: h.engines.vllm.clone().into(),
            sglang: h.engines.sglang.clone().into(),
            tensorfold: h.engines.tensorfold.clone().into(),
            gpus: h
                .gpus
                .as_ref()
                .map(|g| g.iter().map(GpuOverride::from).collect()),
            host_memory: h.host_memory,
        }
    }
}
