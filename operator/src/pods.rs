//! The engine Pod of an instance: one Pod per running instance, on the GPU node the lifecycle
//! chose (`nodeName`, no scheduler), owned by its `Deployment` CR (a controller
//! `ownerReference` with `blockOwnerDeletion`, so the garbage collector removes it with the CR).
//!
//! - the engine's command line and environment are the node agent's
//!   ([`launch_command`], DESIGN.md 4.2), with one change: the engine listens on `0.0.0.0`
//!   instead of `127.0.0.1`, since the router and the node agent reach it on the Pod's IP (the
//!   chart's NetworkPolicy lets only them in); the port is [`EnginePodSettings::engine_port`];
//! - the image is the engine kind's of the settings (`engine-pods.yaml`, rendered by the chart
//!   from `enginePods`, `gpu` and `modelCache`, read from `CAPYCTL_ENGINE_PODS_FILE`);
//! - the engine's command and environment come from the host document's
//!   `host.engines.<kind>` (`command`, `env`), which the chart renders for the node agents and
//!   the operator alike (`CAPYCTL_HOST_FILE`), then the deployment's `env`;
//! - GPU access, [`GpuSharing::RuntimeClass`] by default: the NVIDIA runtime class with
//!   `NVIDIA_VISIBLE_DEVICES` set by CapyCTL to the node's GPUs as its `Host` object lists them
//!   (their UUIDs; their indices when a GPU has none; `all` while the node has published
//!   none, or with [`VisibleDevices::All`]). CapyCTL is then the GPU memory accountant of the
//!   node, and a parked and a running engine share a GPU. [`GpuSharing::DevicePlugin`]
//!   requests `nvidia.com/gpu` instead (a parked engine keeps its GPU allocated);
//! - CPU and memory requests and limits ([`EngineResources`], the chart's
//!   `enginePods.resources`), so that no engine Pod is BestEffort (the first evicted under
//!   memory pressure); an engine launched to park in host RAM asks besides for the host-RAM
//!   copy of its weights when their size is known ([`EnginePod::host_ram_copy`]);
//! - annotations that let a node agent that lost its records rebuild them
//!   ([`capyctl_node_agent::k8s::pods::ANNOTATION_SPEC`] and the others);
//! - the model cache (a hostPath, `HF_HOME` pointing at it unless the deployment sets it) and a
//!   memory-backed `/dev/shm`;
//! - for a base with `adapters.volume` (DESIGN 4.9), that volume, read-only at
//!   [`ADAPTERS_MOUNT_PATH`] (`/capyctl/adapters`), where its adapters' `path`s are. Without one
//!   no adapter files are mounted: a Pod's volumes are fixed when it is created, while adapters
//!   are deployed and deleted as it runs, so per-adapter hostPaths would miss every adapter
//!   deployed after the Pod started; the paths must then be readable in the Pod as it is (the
//!   model cache's hostPath, or the image);
//! - `restartPolicy: Never`: the lifecycle decides restarts (an exited engine is `failed`; the
//!   next request starts a new generation, a new Pod).

use std::collections::BTreeMap;
use std::path::Path;

use capyctl_crds::Deployment;
use capyctl_node_agent::k8s::pods::{ANNOTATION_LAUNCH_PARKING, ANNOTATION_SPEC};
use capyctl_node_agent::launch::launch_command;
use capyctl_node_agent::spec::{EngineLaunch, InstanceSpec};
use capyctl_node_agent::tier::LaunchParking;
use capyctl_spec::EngineKind;
use capyctl_spec::documents::ADAPTERS_MOUNT_PATH;
use k8s_openapi::api::core::v1::{
    Container, ContainerPort, EmptyDirVolumeSource, EnvVar, HostPathVolumeSource,
    LocalObjectReference, Pod, PodSpec, ResourceRequirements, Toleration, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::{Resource, ResourceExt};
use serde::{Deserialize, Serialize};

/// Label of every engine Pod: its CR's name.
pub const LABEL_DEPLOYMENT: &str = "capyctl.io/deployment";
/// Label of an engine Pod whose CR is in another namespace than the Pod (see
/// [`engine_pod_in`]): the CR's namespace.
pub const LABEL_DEPLOYMENT_NAMESPACE: &str = "capyctl.io/deployment-namespace";
/// Label of every engine Pod: the deployment's ID.
pub const LABEL_DEPLOYMENT_ID: &str = "capyctl.io/deployment-id";
/// Label of every engine Pod: the instance's ID.
pub const LABEL_INSTANCE: &str = "capyctl.io/instance";
/// Label of every engine Pod: the instance's generation.
pub const LABEL_GENERATION: &str = "capyctl.io/generation";
/// The engine container's name.
pub const CONTAINER: &str = "engine";
/// The extended resource of the NVIDIA device plugin.
pub const NVIDIA_GPU: &str = "nvidia.com/gpu";

/// How the engines of a node get at its GPUs (`gpu.sharing` of the chart).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum GpuSharing {
    /// The NVIDIA runtime class with `NVIDIA_VISIBLE_DEVICES` set by CapyCTL (the default).
    #[default]
    RuntimeClass,
    /// `nvidia.com/gpu` from the device plugin.
    DevicePlugin,
}

/// Which GPUs `NVIDIA_VISIBLE_DEVICES` names with [`GpuSharing::RuntimeClass`]
/// (`gpu.visibleDevices` of the chart).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum VisibleDevices {
    /// The node's GPUs as its `Host` object lists them (the default).
    #[default]
    Host,
    /// `all`: every GPU the runtime sees.
    All,
}

/// CPU and memory of an engine Pod's container (`enginePods.resources` of the chart).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EngineResources {
    /// Requests (`cpu`, `memory`, ...), Kubernetes quantities.
    #[serde(default)]
    pub requests: BTreeMap<String, String>,
    /// Limits (`cpu`, `memory`, ...), Kubernetes quantities; none by default.
    #[serde(default)]
    pub limits: BTreeMap<String, String>,
    /// Add the host-RAM copy of the weights to the memory request of an engine launched to
    /// park in host RAM, when the weights' size is known. Default true.
    #[serde(default = "default_true")]
    pub host_ram_copy_in_request: bool,
}

fn default_true() -> bool {
    true
}

impl Default for EngineResources {
    /// The chart's defaults: 1 CPU and 4 GiB requested, no limits.
    fn default() -> Self {
        Self {
            requests: BTreeMap::from([
                ("cpu".to_string(), "1".to_string()),
                ("memory".to_string(), "4Gi".to_string()),
            ]),
            limits: BTreeMap::new(),
            host_ram_copy_in_request: true,
        }
    }
}

/// The bytes of a Kubernetes memory quantity (`4Gi`, `512M`, `1e9`, `1073741824`); `None` for
/// one it does not read (fractions of a byte, `m`).
pub fn quantity_bytes(q: &str) -> Option<u64> {
    let q = q.trim();
    let split = q
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(q.len());
    let (number, suffix) = q.split_at(split);
    let factor: f64 = match suffix {
        "" => 1.0,
        "Ki" => 1024.0,
        "Mi" => 1024.0_f64.powi(2),
        "Gi" => 1024.0_f64.powi(3),
        "Ti" => 1024.0_f64.powi(4),
        "Pi" => 1024.0_f64.powi(5),
        "Ei" => 1024.0_f64.powi(6),
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        "E" => 1e18,
        s if s.starts_with(['e', 'E']) => 10f64.powi(s[1..].parse::<i32>().ok()?),
        _ => return None,
    };
    let n: f64 = number.parse().ok()?;
    let bytes = (n * factor).ceil();
    (bytes.is_finite() && bytes >= 0.0 && bytes < u64::MAX as f64).then_some(bytes as u64)
}

/// An engine kind's image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EngineImage {
    /// `repository:tag`.
    pub image: String,
    /// `IfNotPresent`, `Always` or `Never`.
    #[serde(default = "default_pull_policy")]
    pub pull_policy: String,
}

fn default_pull_policy() -> String {
    "IfNotPresent".to_string()
}

/// The model cache: a directory of each GPU node mounted in every engine Pod.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ModelCache {
    /// The directory on the node.
    pub host_path: String,
    /// The hostPath type (`DirectoryOrCreate`, `Directory`, ...).
    #[serde(default = "default_host_path_type", rename = "type")]
    pub type_: String,
    /// Where it is mounted (and `HF_HOME`).
    pub mount_path: String,
}

fn default_host_path_type() -> String {
    "DirectoryOrCreate".to_string()
}

fn default_runtime_class() -> String {
    "nvidia".to_string()
}

fn default_shm() -> String {
    "16Gi".to_string()
}

fn default_port() -> u16 {
    8000
}

/// How engine Pods are built: the chart's `engine-pods.yaml`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EnginePodSettings {
    /// The image of each engine kind.
    pub images: BTreeMap<EngineKind, EngineImage>,
    /// Labels of every engine Pod (the NetworkPolicy selects them).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// How the engines get at the GPUs.
    #[serde(default)]
    pub gpu_sharing: GpuSharing,
    /// The runtime class with [`GpuSharing::RuntimeClass`]; `""` = the node's default runtime.
    #[serde(default = "default_runtime_class")]
    pub runtime_class_name: String,
    /// The model cache; none = no cache volume.
    #[serde(default)]
    pub model_cache: Option<ModelCache>,
    /// Size of `/dev/shm` (a Kubernetes quantity).
    #[serde(default = "default_shm")]
    pub shm_size: String,
    /// Priority class of engine Pods; `""` = none.
    #[serde(default)]
    pub priority_class_name: String,
    /// Tolerations of engine Pods.
    #[serde(default)]
    pub tolerations: Vec<Toleration>,
    /// Pull secrets of engine Pods.
    #[serde(default)]
    pub image_pull_secrets: Vec<LocalObjectReference>,
    /// The port the engine listens on inside its Pod. Default 8000.
    #[serde(default = "default_port")]
    pub engine_port: u16,
    /// Which GPUs `NVIDIA_VISIBLE_DEVICES` names.
    #[serde(default)]
    pub visible_devices: VisibleDevices,
    /// CPU and memory of the engine container.
    #[serde(default)]
    pub resources: EngineResources,
}

impl Default for EnginePodSettings {
    /// The chart's defaults.
    fn default() -> Self {
        let image = |i: &str| EngineImage {
            image: i.to_string(),
            pull_policy: default_pull_policy(),
        };
        Self {
            images: BTreeMap::from([
                (EngineKind::Vllm, image("vllm/vllm-openai:v0.31.0")),
                (EngineKind::Sglang, image("lmsysorg/sglang:latest")),
                (
                    EngineKind::Tensorfold,
                    image("tensorfold/tensorfold:latest"),
                ),
            ]),
            labels: BTreeMap::from([(
                "app.kubernetes.io/component".to_string(),
                "engine".to_string(),
            )]),
            gpu_sharing: GpuSharing::RuntimeClass,
            runtime_class_name: default_runtime_class(),
            model_cache: Some(ModelCache {
                host_path: "/var/lib/capyctl/models".to_string(),
                type_: default_host_path_type(),
                mount_path: "/var/lib/capyctl/models".to_string(),
            }),
            shm_size: default_shm(),
            priority_class_name: String::new(),
            tolerations: Vec::new(),
            image_pull_secrets: Vec::new(),
            engine_port: default_port(),
            visible_devices: VisibleDevices::Host,
            resources: EngineResources::default(),
        }
    }
}

/// What can go wrong reading the settings or building a Pod.
#[derive(Debug, thiserror::Error)]
pub enum PodError {
    /// The settings file could not be read.
    #[error("{file}: {source}")]
    Read {
        /// The file.
        file: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The settings are not valid.
    #[error("{file}: {detail}")]
    Settings {
        /// The file.
        file: String,
        /// What is wrong (with the key path).
        detail: String,
    },
    /// No image for this engine kind.
    #[error("no image for engine {0} in the engine Pod settings (images.{0})")]
    NoImage(EngineKind),
    /// The owner CR has no name or UID (it was not read from the API server).
    #[error("the Deployment object has no name or uid; an engine Pod needs its owner's")]
    NoOwner,
    /// `adapters.volume` is not a Pod volume this builds.
    #[error(
        "spec.adapters.volume: not a Pod volume ({0}); give its source as a Pod spec writes it, such as {{persistentVolumeClaim: {{claimName: loras}}}}"
    )]
    AdaptersVolume(String),
    /// The launch command is refused (DESIGN.md 4.2 rules).
    #[error("{0}")]
    Launch(#[from] capyctl_node_agent::AgentError),
}

impl EnginePodSettings {
    /// Parses `engine-pods.yaml`; errors name the file and the key.
    pub fn from_yaml(file: &str, text: &str) -> Result<Self, PodError> {
        let de = serde_yaml_ng::Deserializer::from_str(text);
        let settings: Self =
            serde_path_to_error::deserialize(de).map_err(|e| PodError::Settings {
                file: file.to_string(),
                detail: e.to_string(),
            })?;
        settings.check(file)?;
        Ok(settings)
    }

    /// Checks what parsing cannot: every resource quantity is one Kubernetes takes, and
    /// the memory ones are readable here.
    pub fn check(&self, file: &str) -> Result<(), PodError> {
        let r = &self.resources;
        for (kind, map) in [("requests", &r.requests), ("limits", &r.limits)] {
            for (name, q) in map {
                let ok = if name == "memory" {
                    quantity_bytes(q).is_some()
                } else {
                    !q.trim().is_empty()
                };
                if !ok {
                    return Err(PodError::Settings {
                        file: file.to_string(),
                        detail: format!(
                            "resources.{kind}.{name}: `{q}` is not a quantity such as 4Gi"
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    /// Reads `engine-pods.yaml`.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, PodError> {
        let path = path.as_ref();
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| PodError::Read {
            file: file.clone(),
            source,
        })?;
        Self::from_yaml(&file, &text)
    }
}

/// Everything one engine Pod is built from.
#[derive(Debug, Clone, Copy)]
pub struct EnginePod<'a> {
    /// The CR that owns the Pod (read from the API server: it has a UID).
    pub owner: &'a Deployment,
    /// The instance's ID (`<deployment id>-<index>`).
    pub instance_id: &'a str,
    /// The instance's generation (a fresh start is a new Pod).
    pub generation: u64,
    /// The deployment as the host agent runs it.
    pub spec: &'a InstanceSpec,
    /// The host's command for the engine kind (`host.engines.<kind>`).
    pub engine: &'a EngineLaunch,
    /// How the engine is launched for parking (the node agent's choice).
    pub parking: LaunchParking,
    /// The GPU node.
    pub node_name: &'a str,
    /// The GPUs the instance may use (UUIDs or indices) for `NVIDIA_VISIBLE_DEVICES`; empty =
    /// every GPU of the node.
    pub gpus: &'a [String],
    /// Bytes of the weights' host-RAM copy, when the engine is launched to park in host RAM and
    /// their size is known: added to the memory request.
    pub host_ram_copy: Option<u64>,
}

/// The GPUs of a node for `NVIDIA_VISIBLE_DEVICES`, from its `Host` object: every UUID when
/// each GPU has one, else the indices; empty (= `all`) without a `Host` or GPUs.
pub fn visible_gpus(host: Option<&capyctl_crds::Host>) -> Vec<String> {
    let gpus = host.map(|h| h.spec.gpus.as_slice()).unwrap_or_default();
    let uuids: Option<Vec<String>> = gpus.iter().map(|g| g.uuid.clone()).collect();
    match uuids {
        Some(u) if !u.is_empty() => u,
        _ => (0..gpus.len()).map(|i| i.to_string()).collect(),
    }
}

/// The container's resources: the settings' requests and limits, the memory request grown by
/// the host-RAM copy, a memory limit never below the request, and `nvidia.com/gpu` with
/// [`GpuSharing::DevicePlugin`].
fn container_resources(
    input: &EnginePod<'_>,
    settings: &EnginePodSettings,
) -> ResourceRequirements {
    let r = &settings.resources;
    let mut requests: BTreeMap<String, Quantity> = r
        .requests
        .iter()
        .map(|(k, v)| (k.clone(), Quantity(v.clone())))
        .collect();
    let mut limits: BTreeMap<String, Quantity> = r
        .limits
        .iter()
        .map(|(k, v)| (k.clone(), Quantity(v.clone())))
        .collect();
    if let (true, Some(copy)) = (r.host_ram_copy_in_request, input.host_ram_copy) {
        let base = r
            .requests
            .get("memory")
            .and_then(|q| quantity_bytes(q))
            .unwrap_or(0);
        requests.insert(
            "memory".to_string(),
            Quantity(base.saturating_add(copy).to_string()),
        );
    }
    let request = requests.get("memory").and_then(|q| quantity_bytes(&q.0));
    let limit = limits.get("memory").and_then(|q| quantity_bytes(&q.0));
    if let (Some(req), Some(lim)) = (request, limit)
        && lim < req
    {
        limits.insert("memory".to_string(), Quantity(req.to_string()));
    }
    if settings.gpu_sharing == GpuSharing::DevicePlugin {
        let count = input.gpus.len().max(1).to_string();
        limits.insert(NVIDIA_GPU.to_string(), Quantity(count));
    }
    ResourceRequirements {
        requests: (!requests.is_empty()).then_some(requests),
        limits: (!limits.is_empty()).then_some(limits),
        ..ResourceRequirements::default()
    }
}

/// The name of the engine Pod's volume of `adapters.volume`.
pub const ADAPTERS_VOLUME: &str = "adapters";

/// The Pod volume of a base's `adapters.volume` (its source; the name is [`ADAPTERS_VOLUME`]),
/// refused when it gives no source Kubernetes knows (the API server would default a volume
/// without one to an empty `emptyDir`, hiding the mistake).
fn adapters_volume(source: &serde_json::Value) -> Result<Volume, PodError> {
    let mut value = source.clone();
    let object = value
        .as_object_mut()
        .ok_or_else(|| PodError::AdaptersVolume("not a mapping".to_string()))?;
    object.insert("name".to_string(), ADAPTERS_VOLUME.into());
    let volume: Volume =
        serde_json::from_value(value).map_err(|e| PodError::AdaptersVolume(e.to_string()))?;
    let known = serde_json::to_value(&volume)
        .ok()
        .and_then(|v| v.as_object().map(|o| o.keys().any(|k| k != "name")))
        .unwrap_or(false);
    if !known {
        return Err(PodError::AdaptersVolume(
            "it names no volume source Kubernetes knows".to_string(),
        ));
    }
    Ok(volume)
}

/// The Pod's name: `<cr name>-<instance index>-g<generation>` (a new generation never waits
/// for the old Pod's name to be free).
pub fn pod_name(cr_name: &str, instance_id: &str, generation: u64) -> String {
    let index = instance_id.rsplit('-').next().unwrap_or("0");
    format!("{cr_name}-{index}-g{generation}")
}

/// The engine Pod of `input` (see the module doc), in its CR's namespace.
pub fn engine_pod(input: &EnginePod<'_>, settings: &EnginePodSettings) -> Result<Pod, PodError> {
    let namespace = input.owner.namespace().unwrap_or_default();
    engine_pod_in(input, settings, &namespace)
}

/// The engine Pod of `input` in `namespace` (the operator's). A Pod cannot be owned by an
/// object of another namespace (the garbage collector would take the owner for missing and
/// delete the Pod): a CR of another watched namespace does not own its engine Pods, which
/// carry its namespace in [`LABEL_DEPLOYMENT_NAMESPACE`] instead and go when the CR's
/// finalizer deletes the deployment.
pub fn engine_pod_in(
    input: &EnginePod<'_>,
    settings: &EnginePodSettings,
    namespace: &str,
) -> Result<Pod, PodError> {
    let owner = input.owner;
    let image = settings
        .images
        .get(&input.spec.engine)
        .ok_or(PodError::NoImage(input.spec.engine))?;
    let mut owner_ref = owner.controller_owner_ref(&()).ok_or(PodError::NoOwner)?;
    if owner_ref.uid.is_empty() {
        return Err(PodError::NoOwner);
    }
    owner_ref.block_owner_deletion = Some(true);

    let launch = launch_command(
        input.spec,
        input.engine,
        settings.engine_port,
        input.parking,
    )?;
    let mut args = launch.args.clone();
    if let Some(i) = args
        .windows(2)
        .position(|w| w[0] == "--host" && w[1] == "127.0.0.1")
    {
        args[i + 1] = "0.0.0.0".to_string();
    }
    let command: Vec<String> = std::iter::once(launch.program.clone())
        .chain(args)
        .collect();

    let mut env = launch.env.clone();
    if let Some(cache) = &settings.model_cache {
        env.entry("HF_HOME".to_string())
            .or_insert_with(|| cache.mount_path.clone());
    }
    let mut runtime_class_name = None;
    match settings.gpu_sharing {
        GpuSharing::RuntimeClass => {
            let devices =
                if input.gpus.is_empty() || settings.visible_devices == VisibleDevices::All {
                    "all".to_string()
                } else {
                    input.gpus.join(",")
                };
            // CapyCTL's own: the GPUs it accounts for, whatever the deployment's env says.
            env.insert("NVIDIA_VISIBLE_DEVICES".to_string(), devices);
            env.entry("NVIDIA_DRIVER_CAPABILITIES".to_string())
                .or_insert_with(|| "compute,utility".to_string());
            if !settings.runtime_class_name.is_empty() {
                runtime_class_name = Some(settings.runtime_class_name.clone());
            }
        }
        GpuSharing::DevicePlugin => {}
    }
    let resources = Some(container_resources(input, settings));

    let mut volumes = vec![Volume {
        name: "shm".to_string(),
        empty_dir: Some(EmptyDirVolumeSource {
            medium: Some("Memory".to_string()),
            size_limit: Some(Quantity(settings.shm_size.clone())),
        }),
        ..Volume::default()
    }];
    let mut mounts = vec![VolumeMount {
        name: "shm".to_string(),
        mount_path: "/dev/shm".to_string(),
        ..VolumeMount::default()
    }];
    if let Some(cache) = &settings.model_cache {
        volumes.push(Volume {
            name: "model-cache".to_string(),
            host_path: Some(HostPathVolumeSource {
                path: cache.host_path.clone(),
                type_: Some(cache.type_.clone()),
            }),
            ..Volume::default()
        });
        mounts.push(VolumeMount {
            name: "model-cache".to_string(),
            mount_path: cache.mount_path.clone(),
            ..VolumeMount::default()
        });
    }
    if let Some(source) = &input.spec.adapters_volume {
        volumes.push(adapters_volume(source)?);
        mounts.push(VolumeMount {
            name: ADAPTERS_VOLUME.to_string(),
            mount_path: ADAPTERS_MOUNT_PATH.to_string(),
            read_only: Some(true),
            ..VolumeMount::default()
        });
    }

    let cr_name = owner.name_any();
    let deployment_id = &input.spec.deployment_id;
    let mut labels = settings.labels.clone();
    labels.insert(LABEL_DEPLOYMENT.to_string(), cr_name.clone());
    let owner_namespace = owner.namespace().unwrap_or_default();
    let owner_references = if owner_namespace == namespace {
        Some(vec![owner_ref])
    } else {
        labels.insert(LABEL_DEPLOYMENT_NAMESPACE.to_string(), owner_namespace);
        None
    };
    labels.insert(LABEL_DEPLOYMENT_ID.to_string(), deployment_id.clone());
    labels.insert(LABEL_INSTANCE.to_string(), input.instance_id.to_string());
    labels.insert(LABEL_GENERATION.to_string(), input.generation.to_string());

    let json = |what: &str, v: Result<String, serde_json::Error>| {
        v.map_err(|e| PodError::Settings {
            file: "the engine Pod".to_string(),
            detail: format!("{what}: {e}"),
        })
    };
    let annotations = BTreeMap::from([
        (
            ANNOTATION_SPEC.to_string(),
            json("the instance spec", serde_json::to_string(input.spec))?,
        ),
        (
            ANNOTATION_LAUNCH_PARKING.to_string(),
            json("the launch parking", serde_json::to_string(&input.parking))?,
        ),
    ]);

    Ok(Pod {
        metadata: ObjectMeta {
            name: Some(pod_name(&cr_name, input.instance_id, input.generation)),
            namespace: Some(namespace.to_string()),
            labels: Some(labels),
            annotations: Some(annotations),
            owner_references,
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name: Some(input.node_name.to_string()),
            restart_policy: Some("Never".to_string()),
            runtime_class_name,
            priority_class_name: (!settings.priority_class_name.is_empty())
                .then(|| settings.priority_class_name.clone()),
            tolerations: (!settings.tolerations.is_empty()).then(|| settings.tolerations.clone()),
            image_pull_secrets: (!settings.image_pull_secrets.is_empty())
                .then(|| settings.image_pull_secrets.clone()),
            enable_service_links: Some(false),
            automount_service_account_token: Some(false),
            termination_grace_period_seconds: Some(30),
            volumes: Some(volumes),
            containers: vec![Container {
                name: CONTAINER.to_string(),
                image: Some(image.image.clone()),
                image_pull_policy: Some(image.pull_policy.clone()),
                command: Some(command),
                env: Some(
                    env.into_iter()
                        .map(|(name, value)| EnvVar {
                            name,
                            value: Some(value),
                            value_from: None,
                        })
                        .collect(),
                ),
                ports: Some(vec![ContainerPort {
                    name: Some("http".to_string()),
                    container_port: i32::from(settings.engine_port),
                    protocol: Some("TCP".to_string()),
                    ..ContainerPort::default()
                }]),
                resources,
                volume_mounts: Some(mounts),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        status: None,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn owner() -> Deployment {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "capyctl.io/v1alpha1",
            "kind": "Deployment",
            "metadata": {"name": "chat-a", "namespace": "capyctl", "uid": "6f1c0d5e-0000-4000-8000-000000000001"},
            "spec": {"engine": "vllm", "model": "Qwen3-4B", "maxConcurrentRequests": 8,
                     "extraArgs": ["--max-model-len", "8192"], "env": {"HF_TOKEN": "x"}},
        }))
        .unwrap()
    }

    fn spec(o: &Deployment) -> InstanceSpec {
        InstanceSpec::from_doc("01KDEP", &o.to_document().unwrap())
    }

    fn build(settings: &EnginePodSettings, gpus: &[String]) -> Pod {
        build_with(
            settings,
            gpus,
            &EngineLaunch::default_for(EngineKind::Vllm),
            None,
        )
    }

    fn build_with(
        settings: &EnginePodSettings,
        gpus: &[String],
        engine: &EngineLaunch,
        host_ram_copy: Option<u64>,
    ) -> Pod {
        let o = owner();
        let s = spec(&o);
        engine_pod(
            &EnginePod {
                owner: &o,
                instance_id: "01KDEP-0",
                generation: 3,
                spec: &s,
                engine,
                parking: LaunchParking {
                    may_park: true,
                    host_ram: true,
                },
                node_name: "gpu-node-1",
                gpus,
                host_ram_copy,
            },
            settings,
        )
        .unwrap()
    }

    fn env_of(pod: &Pod) -> BTreeMap<String, String> {
        pod.spec.as_ref().unwrap().containers[0]
            .env
            .clone()
            .unwrap()
            .into_iter()
            .map(|e| (e.name, e.value.unwrap_or_default()))
            .collect()
    }

    /// The engine Pod of a base whose `spec.adapters` is `adapters`.
    fn base_pod(adapters: serde_json::Value) -> Result<Pod, PodError> {
        let mut o = owner();
        let mut cr = serde_json::to_value(&o).unwrap();
        cr["spec"]["adapters"] = adapters;
        o = serde_json::from_value(cr).unwrap();
        let s = spec(&o);
        engine_pod(
            &EnginePod {
                owner: &o,
                instance_id: "01KDEP-0",
                generation: 1,
                spec: &s,
                engine: &EngineLaunch::default_for(EngineKind::Vllm),
                parking: LaunchParking::default(),
                node_name: "gpu-node-1",
                gpus: &[],
                host_ram_copy: None,
            },
            &EnginePodSettings::default(),
        )
    }

    #[test]
    fn a_base_mounts_its_adapters_volume_read_only_at_the_fixed_path() {
        let pod = base_pod(serde_json::json!({"maxLoaded": 2, "maxRank": 16,
            "volume": {"name": "mine", "persistentVolumeClaim": {"claimName": "loras", "readOnly": true}}}))
        .unwrap();
        let spec = pod.spec.unwrap();
        let volume = spec
            .volumes
            .unwrap()
            .into_iter()
            .find(|v| v.name == ADAPTERS_VOLUME)
            .unwrap();
        let claim = volume.persistent_volume_claim.unwrap();
        assert_eq!(claim.claim_name, "loras");
        assert_eq!(claim.read_only, Some(true));
        let mount = spec.containers[0]
            .volume_mounts
            .clone()
            .unwrap()
            .into_iter()
            .find(|m| m.name == ADAPTERS_VOLUME)
            .unwrap();
        assert_eq!(mount.mount_path, "/capyctl/adapters");
        assert_eq!(mount.read_only, Some(true));

        // Without a volume nothing is mounted for the adapters.
        let pod = base_pod(serde_json::json!({"maxLoaded": 2, "maxRank": 16})).unwrap();
        let spec = pod.spec.unwrap();
        assert!(
            spec.volumes
                .unwrap()
                .iter()
                .all(|v| v.name != ADAPTERS_VOLUME)
        );
        let mounts = spec.containers[0].volume_mounts.clone().unwrap();
        assert!(mounts.iter().all(|m| m.mount_path != "/capyctl/adapters"));

        // A volume with no source Kubernetes knows is refused, naming the key.
        let e = base_pod(serde_json::json!({"maxLoaded": 2, "maxRank": 16,
            "volume": {"persistentVolumeClam": {"claimName": "loras"}}}))
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("spec.adapters.volume: not a Pod volume (it names no volume source"),
            "{e}"
        );
    }

    #[test]
    fn a_cr_of_another_namespace_does_not_own_its_pod_but_is_named_by_a_label() {
        let o = owner();
        let s = spec(&o);
        let input = EnginePod {
            owner: &o,
            instance_id: "01KDEP-0",
            generation: 1,
            spec: &s,
            engine: &EngineLaunch::default_for(EngineKind::Vllm),
            parking: LaunchParking {
                may_park: true,
                host_ram: false,
            },
            node_name: "gpu-node-1",
            gpus: &[],
            host_ram_copy: None,
        };
        let settings = EnginePodSettings::default();
        // The operator's namespace is another one: no owner reference (the garbage collector
        // would delete the Pod), the CR's namespace in a label.
        let pod = engine_pod_in(&input, &settings, "capyctl-system").unwrap();
        assert_eq!(pod.metadata.namespace.as_deref(), Some("capyctl-system"));
        assert!(pod.metadata.owner_references.is_none());
        let labels = pod.metadata.labels.as_ref().unwrap();
        assert_eq!(labels[LABEL_DEPLOYMENT_NAMESPACE], "capyctl");
        assert_eq!(labels[LABEL_DEPLOYMENT], "chat-a");
        // The same namespace: owned, no label.
        let pod = engine_pod_in(&input, &settings, "capyctl").unwrap();
        assert_eq!(pod.metadata.owner_references.as_ref().unwrap().len(), 1);
        assert!(
            !pod.metadata
                .labels
                .as_ref()
                .unwrap()
                .contains_key(LABEL_DEPLOYMENT_NAMESPACE)
        );
    }

    #[test]
    fn the_pod_runs_the_engines_command_on_the_chosen_node_owned_by_its_cr() {
        let pod = build(&EnginePodSettings::default(), &["GPU-1234".to_string()]);
        let meta = &pod.metadata;
        assert_eq!(meta.name.as_deref(), Some("chat-a-0-g3"));
        assert_eq!(meta.namespace.as_deref(), Some("capyctl"));
        let owner = &meta.owner_references.as_ref().unwrap()[0];
        assert_eq!(owner.kind, "Deployment");
        assert_eq!(owner.api_version, "capyctl.io/v1alpha1");
        assert_eq!(owner.name, "chat-a");
        assert_eq!(owner.uid, "6f1c0d5e-0000-4000-8000-000000000001");
        assert_eq!(owner.controller, Some(true));
        assert_eq!(owner.block_owner_deletion, Some(true));
        let labels = meta.labels.as_ref().unwrap();
        assert_eq!(labels[LABEL_DEPLOYMENT], "chat-a");
        assert_eq!(labels[LABEL_INSTANCE], "01KDEP-0");
        assert_eq!(labels[LABEL_GENERATION], "3");
        assert_eq!(labels["app.kubernetes.io/component"], "engine");

        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(spec.node_name.as_deref(), Some("gpu-node-1"));
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        assert_eq!(spec.runtime_class_name.as_deref(), Some("nvidia"));
        let c = &spec.containers[0];
        assert_eq!(c.image.as_deref(), Some("vllm/vllm-openai:v0.31.0"));
        let command = c.command.clone().unwrap();
        assert_eq!(
            command,
            [
                "vllm",
                "serve",
                "Qwen3-4B",
                "--host",
                "0.0.0.0",
                "--port",
                "8000",
                "--served-model-name",
                "chat-a",
                "--enable-sleep-mode",
                "--max-num-seqs",
                "8",
                "--max-model-len",
                "8192"
            ]
        );
        assert_eq!(c.ports.as_ref().unwrap()[0].container_port, 8000);
        let resources = c.resources.clone().unwrap();
        assert!(
            !resources
                .limits
                .unwrap_or_default()
                .contains_key(NVIDIA_GPU),
            "no device plugin request when sharing"
        );
        // Not BestEffort: CPU and memory are requested.
        let requests = resources.requests.unwrap();
        assert_eq!(requests["cpu"], Quantity("1".into()));
        assert_eq!(requests["memory"], Quantity("4Gi".into()));
        // What a node agent needs to rebuild a lost record.
        let annotations = meta.annotations.as_ref().unwrap();
        let spec_back: InstanceSpec = serde_json::from_str(&annotations[ANNOTATION_SPEC]).unwrap();
        assert_eq!(spec_back.name, "chat-a");
        assert_eq!(
            annotations[ANNOTATION_LAUNCH_PARKING],
            r#"{"may_park":true,"host_ram":true}"#
        );
        let env = env_of(&pod);
        assert_eq!(env["VLLM_SERVER_DEV_MODE"], "1");
        assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], "GPU-1234");
        assert_eq!(env["HF_TOKEN"], "x");
        assert_eq!(env["HF_HOME"], "/var/lib/capyctl/models");
    }

    #[test]
    fn the_hosts_engine_command_and_env_reach_the_pod() {
        // host.engines.vllm of the chart's host document.
        let engine = EngineLaunch {
            command: vec!["/opt/sim/engine-sim".into(), "vllm".into()],
            version: Some("0.31.0".into()),
            env: BTreeMap::from([
                ("VLLM_LOGGING_LEVEL".to_string(), "DEBUG".to_string()),
                // The deployment's own env wins over the host's.
                ("HF_TOKEN".to_string(), "from-host".to_string()),
            ]),
        };
        let pod = build_with(&EnginePodSettings::default(), &[], &engine, None);
        let c = &pod.spec.as_ref().unwrap().containers[0];
        let command = c.command.clone().unwrap();
        assert_eq!(command[..3], ["/opt/sim/engine-sim", "vllm", "serve"]);
        let env = env_of(&pod);
        assert_eq!(env["VLLM_LOGGING_LEVEL"], "DEBUG");
        assert_eq!(env["HF_TOKEN"], "x");
    }

    #[test]
    fn the_host_ram_copy_is_requested_and_a_limit_never_below_the_request() {
        let mut settings = EnginePodSettings::default();
        settings.resources.limits = BTreeMap::from([("memory".to_string(), "8Gi".to_string())]);
        let engine = EngineLaunch::default_for(EngineKind::Vllm);
        let pod = build_with(&settings, &[], &engine, Some(16 << 30));
        let r = pod.spec.as_ref().unwrap().containers[0]
            .resources
            .clone()
            .unwrap();
        let requests = r.requests.unwrap();
        // 4 GiB for the engine, 16 GiB for the weights' copy in host RAM.
        assert_eq!(requests["memory"], Quantity((20u64 << 30).to_string()));
        assert_eq!(requests["cpu"], Quantity("1".into()));
        // The 8 GiB limit would refuse the Pod: raised to the request.
        assert_eq!(
            r.limits.unwrap()["memory"],
            Quantity((20u64 << 30).to_string())
        );
        // Unknown weights, or the copy turned off: the settings' request as is.
        settings.resources.host_ram_copy_in_request = false;
        let pod = build_with(&settings, &[], &engine, Some(16 << 30));
        let r = pod.spec.unwrap().containers[0].resources.clone().unwrap();
        assert_eq!(r.requests.unwrap()["memory"], Quantity("4Gi".into()));
        assert_eq!(r.limits.unwrap()["memory"], Quantity("8Gi".into()));
    }

    #[test]
    fn nvidia_visible_devices_are_the_nodes_gpus_from_its_host() {
        let host = |gpus: serde_json::Value| -> capyctl_crds::Host {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "capyctl.io/v1alpha1", "kind": "Host",
                "metadata": {"name": "gpu-node-1"},
                "spec": {"gpus": gpus},
            }))
            .unwrap()
        };
        let two = host(serde_json::json!([
            {"uuid": "GPU-a", "memory": "80GiB"}, {"uuid": "GPU-b", "memory": "80GiB"}]));
        assert_eq!(visible_gpus(Some(&two)), ["GPU-a", "GPU-b"]);
        let no_uuid = host(serde_json::json!([
            {"uuid": "GPU-a", "memory": "80GiB"}, {"memory": "80GiB"}]));
        assert_eq!(visible_gpus(Some(&no_uuid)), ["0", "1"]);
        assert!(visible_gpus(None).is_empty());
        let gpus = visible_gpus(Some(&two));
        let pod = build(&EnginePodSettings::default(), &gpus);
        assert_eq!(env_of(&pod)["NVIDIA_VISIBLE_DEVICES"], "GPU-a,GPU-b");
        // Configurable: every GPU the runtime sees.
        let all = EnginePodSettings {
            visible_devices: VisibleDevices::All,
            ..EnginePodSettings::default()
        };
        assert_eq!(env_of(&build(&all, &gpus))["NVIDIA_VISIBLE_DEVICES"], "all");
    }

    #[test]
    fn memory_quantities_are_read_as_bytes() {
        assert_eq!(quantity_bytes("4Gi"), Some(4 << 30));
        assert_eq!(quantity_bytes("512Mi"), Some(512 << 20));
        assert_eq!(quantity_bytes("1G"), Some(1_000_000_000));
        assert_eq!(quantity_bytes("1.5Gi"), Some(3 << 29));
        assert_eq!(quantity_bytes("1e9"), Some(1_000_000_000));
        assert_eq!(quantity_bytes("1073741824"), Some(1 << 30));
        assert_eq!(quantity_bytes("100m"), None);
        assert_eq!(quantity_bytes("lots"), None);
        let err = EnginePodSettings::from_yaml(
            "engine-pods.yaml",
            "images: {}\nresources: {requests: {memory: lots}}\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("engine-pods.yaml") && err.contains("resources.requests.memory"),
            "{err}"
        );
    }

    #[test]
    fn the_model_cache_and_shm_are_mounted() {
        let pod = build(&EnginePodSettings::default(), &[]);
        let spec = pod.spec.as_ref().unwrap();
        let volumes = spec.volumes.as_ref().unwrap();
        let cache = volumes.iter().find(|v| v.name == "model-cache").unwrap();
        let hp = cache.host_path.as_ref().unwrap();
        assert_eq!(hp.path, "/var/lib/capyctl/models");
        assert_eq!(hp.type_.as_deref(), Some("DirectoryOrCreate"));
        let shm = volumes.iter().find(|v| v.name == "shm").unwrap();
        assert_eq!(
            shm.empty_dir.as_ref().unwrap().medium.as_deref(),
            Some("Memory")
        );
        let mounts = spec.containers[0].volume_mounts.as_ref().unwrap();
        assert!(mounts.iter().any(|m| m.mount_path == "/dev/shm"));
        assert!(
            mounts
                .iter()
                .any(|m| m.mount_path == "/var/lib/capyctl/models")
        );
        // No GPUs named: every GPU of the node.
        assert_eq!(env_of(&pod)["NVIDIA_VISIBLE_DEVICES"], "all");
    }

    #[test]
    fn the_device_plugin_mode_requests_gpus_and_sets_no_devices() {
        let settings = EnginePodSettings {
            gpu_sharing: GpuSharing::DevicePlugin,
            model_cache: None,
            ..EnginePodSettings::default()
        };
        let pod = build(&settings, &["0".to_string(), "1".to_string()]);
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(spec.runtime_class_name, None);
        let resources = spec.containers[0].resources.as_ref().unwrap();
        let limits = resources.limits.clone().unwrap();
        assert_eq!(limits[NVIDIA_GPU], Quantity("2".into()));
        assert_eq!(
            resources.requests.clone().unwrap()["memory"],
            Quantity("4Gi".into())
        );
        let env = env_of(&pod);
        assert!(!env.contains_key("NVIDIA_VISIBLE_DEVICES"));
        assert!(!env.contains_key("HF_HOME"));
        assert!(
            spec.volumes
                .as_ref()
                .unwrap()
                .iter()
                .all(|v| v.name != "model-cache")
        );
    }

    #[test]
    fn an_owner_without_uid_is_refused() {
        let mut o = owner();
        o.metadata.uid = None;
        let s = spec(&o);
        let engine = EngineLaunch::default_for(EngineKind::Vllm);
        let err = engine_pod(
            &EnginePod {
                owner: &o,
                instance_id: "01KDEP-0",
                generation: 1,
                spec: &s,
                engine: &engine,
                parking: LaunchParking::default(),
                node_name: "n",
                gpus: &[],
                host_ram_copy: None,
            },
            &EnginePodSettings::default(),
        )
        .unwrap_err();
        assert!(matches!(err, PodError::NoOwner), "{err}");
    }

    #[test]
    fn the_charts_engine_pods_document_parses() {
        let text = r#"
# How capyctl-operator builds engine Pods, rendered by the chart.
images:
  vllm:
    image: "vllm/vllm-openai:v0.31.0"
    pullPolicy: IfNotPresent
  sglang:
    image: "lmsysorg/sglang:latest"
    pullPolicy: Always
  tensorfold:
    image: "tensorfold/tensorfold:latest"
    pullPolicy: IfNotPresent
labels:
  app.kubernetes.io/name: capyctl
  app.kubernetes.io/instance: rel
  app.kubernetes.io/component: engine
gpuSharing: runtimeClass
runtimeClassName: ""
visibleDevices: host
resources:
  requests:
    cpu: "1"
    memory: 4Gi
  limits:
    memory: 64Gi
  hostRamCopyInRequest: true
modelCache:
  hostPath: "/data/models"
  type: "Directory"
  mountPath: "/models"
shmSize: "8Gi"
priorityClassName: ""
tolerations:
  - effect: NoSchedule
    key: nvidia.com/gpu
    operator: Exists
imagePullSecrets:
  - name: my-registry
"#;
        let s = EnginePodSettings::from_yaml("engine-pods.yaml", text).unwrap();
        assert_eq!(s.images[&EngineKind::Sglang].pull_policy, "Always");
        assert_eq!(s.runtime_class_name, "");
        assert_eq!(s.model_cache.as_ref().unwrap().mount_path, "/models");
        assert_eq!(s.tolerations[0].key.as_deref(), Some("nvidia.com/gpu"));
        assert_eq!(s.image_pull_secrets[0].name, "my-registry");
        assert_eq!(s.visible_devices, VisibleDevices::Host);
        assert_eq!(s.resources.limits["memory"], "64Gi");
        let pod = build(&s, &[]);
        let spec = pod.spec.as_ref().unwrap();
        // "" = the node's default runtime.
        assert_eq!(spec.runtime_class_name, None);
        assert_eq!(spec.tolerations.as_ref().unwrap().len(), 1);
        assert_eq!(env_of(&pod)["HF_HOME"], "/models");

        let err = EnginePodSettings::from_yaml("engine-pods.yaml", "images: {}\nshm: 1Gi\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("engine-pods.yaml") && err.contains("shm"),
            "{err}"
        );
    }

    #[test]
    fn a_tensorfold_pod_has_no_host_flag_to_rewrite() {
        let o: Deployment = serde_json::from_value(serde_json::json!({
            "apiVersion": "capyctl.io/v1alpha1",
            "kind": "Deployment",
            "metadata": {"name": "tf", "namespace": "capyctl", "uid": "u-1"},
            "spec": {"engine": "tensorfold", "model": "m"},
        }))
        .unwrap();
        let s = InstanceSpec::from_doc("01KTF", &o.to_document().unwrap());
        let engine = EngineLaunch::default_for(EngineKind::Tensorfold);
        let pod = engine_pod(
            &EnginePod {
                owner: &o,
                instance_id: "01KTF-0",
                generation: 1,
                spec: &s,
                engine: &engine,
                parking: LaunchParking::default(),
                node_name: "n",
                gpus: &[],
                host_ram_copy: None,
            },
            &EnginePodSettings::default(),
        )
        .unwrap();
        let c = &pod.spec.unwrap().containers[0];
        assert_eq!(
            c.command.clone().unwrap(),
            ["tensorfold", "serve", "--model", "m", "--port", "8000"]
        );
        assert_eq!(c.image.as_deref(), Some("tensorfold/tensorfold:latest"));
    }
}
