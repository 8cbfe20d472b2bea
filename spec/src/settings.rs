//! Effective, typed settings: what the router, the lifecycle and the host agent read.
//!
//! Documents (see [`crate::documents`]) hold what a user wrote, with every key optional; loading a
//! document resolves it into these types for a [`Mode`], filling in that mode's defaults and
//! checking the ranges. Every row of the product page's "Settings" table is here, with the
//! decisions DESIGN.md 4.2 adds.
//!
//! Bounds the product page leaves open (chosen here; each is also on its `*_BOUNDS` constant):
//! - `request_deadline`: 1 ms to 3600 s (the page gives only "up to 3600 s");
//! - `max_pending_total`: 0 to 65536 (0 lets no request wait at all);
//! - `max_buffered_bytes_total`: 1 KiB to 16 GiB;
//! - the standalone bounds are the host bounds (the page says so); only defaults differ by mode.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::kinds::{Activation, EngineKind};
use crate::units::{ByteSize, format_duration};

/// Which kind of process reads the settings; the defaults of some settings differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// `capyctl start standalone`: server and one host in one process.
    Standalone,
    /// A server (`server.yaml`) with host agents (`host.yaml`), e.g. under Kubernetes.
    ServerAndHosts,
}

/// Requests running at once per deployment (per model), fixed.
pub const IN_FLIGHT_PER_DEPLOYMENT: u32 = 32;
/// A streamed answer whose client reads nothing for this long is ended, fixed.
pub const STREAM_READ_STALL: Duration = Duration::from_secs(10);
/// A single piece of a streamed answer larger than this many bytes ends the stream, fixed.
pub const STREAM_MAX_PIECE: u64 = 64 * 1024;

/// An inclusive range of accepted values of one setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds<T> {
    /// The smallest accepted value.
    pub min: T,
    /// The largest accepted value.
    pub max: T,
}

impl<T: PartialOrd + Copy> Bounds<T> {
    /// Whether `value` lies within the bounds (both ends included).
    pub fn contains(&self, value: T) -> bool {
        self.min <= value && value <= self.max
    }

    /// `value`, or the nearest end when it lies outside the bounds.
    pub fn clamp(&self, value: T) -> T {
        if value < self.min {
            self.min
        } else if value > self.max {
            self.max
        } else {
            value
        }
    }
}

/// A bound as the product page writes it: whole seconds up to an hour in `s` (`600s`,
/// `3600s`), sub-second values in `ms`, longer ones canonically (`168h`).
fn format_bound(d: Duration) -> String {
    if d.subsec_millis() == 0 && d.as_secs() <= 3600 && d.as_secs() > 0 {
        format!("{}s", d.as_secs())
    } else {
        format_duration(d)
    }
}

impl fmt::Display for Bounds<Duration> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} to {}",
            format_bound(self.min),
            format_bound(self.max)
        )
    }
}

impl fmt::Display for Bounds<u32> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} to {}", self.min, self.max)
    }
}

impl fmt::Display for Bounds<ByteSize> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} to {}", self.min, self.max)
    }
}

const fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

const fn millis(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

/// `resource_policy.queue.admission_window`: 1 ms to 30 s, and not above the request deadline.
pub const ADMISSION_WINDOW_BOUNDS: Bounds<Duration> = Bounds {
    min: millis(1),
    max: secs(30),
};
/// `resource_policy.queue.request_deadline`: 1 ms (chosen) to 3600 s.
pub const REQUEST_DEADLINE_BOUNDS: Bounds<Duration> = Bounds {
    min: millis(1),
    max: secs(3600),
};
/// `resource_policy.queue.stream_idle_timeout`: 1 s to 3600 s.
pub const STREAM_IDLE_TIMEOUT_BOUNDS: Bounds<Duration> = Bounds {
    min: secs(1),
    max: secs(3600),
};
/// `resource_policy.queue.max_pending_per_deployment`: 0 to 4096.
pub const MAX_PENDING_PER_DEPLOYMENT_BOUNDS: Bounds<u32> = Bounds { min: 0, max: 4096 };
/// `resource_policy.queue.max_pending_total`: 0 to 65536 (chosen).
pub const MAX_PENDING_TOTAL_BOUNDS: Bounds<u32> = Bounds { min: 0, max: 65536 };
/// `resource_policy.queue.max_buffered_bytes_total`: 1 KiB to 16 GiB (chosen).
pub const MAX_BUFFERED_BYTES_TOTAL_BOUNDS: Bounds<ByteSize> = Bounds {
    min: ByteSize::kib(1),
    max: ByteSize::gib(16),
};
/// `switching.drain_timeout`: 1 s to 600 s.
pub const DRAIN_TIMEOUT_BOUNDS: Bounds<Duration> = Bounds {
    min: secs(1),
    max: secs(600),
};
/// `switching.wake_timeout`: 1 s to 3600 s.
pub const WAKE_TIMEOUT_BOUNDS: Bounds<Duration> = Bounds {
    min: secs(1),
    max: secs(3600),
};
/// `lifecycle_defaults.ready_idle_timeout` and `parked_idle_timeout`: 1 s to 7 days (168 h).
pub const IDLE_TIMEOUT_BOUNDS: Bounds<Duration> = Bounds {
    min: secs(1),
    max: secs(7 * 24 * 3600),
};
/// A deployment's `max_concurrent_requests`: 1 to 4096.
pub const MAX_CONCURRENT_REQUESTS_BOUNDS: Bounds<u32> = Bounds { min: 1, max: 4096 };
/// A deployment's `replicas`: 1 to 64.
pub const REPLICAS_BOUNDS: Bounds<u32> = Bounds { min: 1, max: 64 };
/// A deployment's `scale.min`: 0 to 64 (and not above `replicas`).
pub const SCALE_MIN_BOUNDS: Bounds<u32> = Bounds { min: 0, max: 64 };
/// A deployment's `scale.target_in_flight`: 1 to 32 (an instance runs at most
/// [`IN_FLIGHT_PER_INSTANCE`] requests).
pub const TARGET_IN_FLIGHT_BOUNDS: Bounds<u32> = Bounds { min: 1, max: 32 };
/// A deployment's `scale.scale_down_delay`: 1 s to 24 h.
pub const SCALE_DOWN_DELAY_BOUNDS: Bounds<Duration> = Bounds {
    min: secs(1),
    max: secs(24 * 3600),
};
/// A base deployment's `adapters.max_loaded`: 1 to 256 adapters loaded at once per instance.
pub const ADAPTERS_MAX_LOADED_BOUNDS: Bounds<u32> = Bounds { min: 1, max: 256 };
/// A base deployment's `adapters.max_rank`: 1 to 512 (vLLM's largest `--max-lora-rank`).
pub const ADAPTERS_MAX_RANK_BOUNDS: Bounds<u32> = Bounds { min: 1, max: 512 };
/// A deployment's `gpus_per_instance`: 1 to 16.
pub const GPUS_PER_INSTANCE_BOUNDS: Bounds<u32> = Bounds { min: 1, max: 16 };
/// Requests CapyCTL forwards to one instance at once (the product page's 32 per model, per
/// instance); the deployment's bound is this times its ready instances.
pub const IN_FLIGHT_PER_INSTANCE: usize = 32;
/// `scale.min` when a `scale:` leaves it out.
pub const DEFAULT_SCALE_MIN: u32 = 1;
/// `scale.target_in_flight` when a `scale:` leaves it out.
pub const DEFAULT_TARGET_IN_FLIGHT: u32 = 24;
/// `scale.scale_down_delay` when a `scale:` leaves it out.
pub const DEFAULT_SCALE_DOWN_DELAY: Duration = secs(60);

/// The queue settings of one host (`resource_policy.queue.*`), resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueSettings {
    /// How long the loaded model keeps taking new requests once a switch begins. Default 2 s.
    pub admission_window: Duration,
    /// How long a request may wait for its first output, switch and prefill included.
    /// Default 1800 s standalone, 600 s for server and hosts.
    pub request_deadline: Duration,
    /// Longest silence in a reply after its first output. Default 120 s.
    pub stream_idle_timeout: Duration,
    /// Waiting requests per deployment; 0 lets no request wait. Default 64.
    pub max_pending_per_deployment: u32,
    /// Waiting requests in total. Default 256.
    pub max_pending_total: u32,
    /// Bytes of waiting request bodies in total. Default 64 MiB.
    pub max_buffered_bytes_total: u64,
}

impl QueueSettings {
    /// The defaults of `mode`.
    pub const fn defaults(mode: Mode) -> Self {
        Self {
            admission_window: secs(2),
            request_deadline: match mode {
                Mode::Standalone => secs(1800),
                Mode::ServerAndHosts => secs(600),
            },
            stream_idle_timeout: secs(120),
            max_pending_per_deployment: 64,
            max_pending_total: 256,
            max_buffered_bytes_total: 64 * 1024 * 1024,
        }
    }
}

/// How switches run (`server.switching.*`), resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SwitchingSettings {
    /// How long the loaded model may take to finish its running requests. Default 30 s.
    pub drain_timeout: Duration,
    /// Past this a wake is `wake_uncertain`. Default 600 s.
    pub wake_timeout: Duration,
}

impl SwitchingSettings {
    /// The defaults (the same in both modes).
    pub const fn defaults() -> Self {
        Self {
            drain_timeout: secs(30),
            wake_timeout: secs(600),
        }
    }
}

impl Default for SwitchingSettings {
    fn default() -> Self {
        Self::defaults()
    }
}

/// Idle timers (`server.lifecycle_defaults.*`); both off (`None`) by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LifecycleDefaults {
    /// A ready model with no request for this long is parked (or stopped when it cannot park).
    pub ready_idle_timeout: Option<Duration>,
    /// A parked model with no request for this long is stopped.
    pub parked_idle_timeout: Option<Duration>,
}

/// TLS material of the listeners.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM certificate chain.
    pub cert: PathBuf,
    /// PEM private key.
    pub key: PathBuf,
}

/// The server's listeners (`server.listen.*`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenSettings {
    /// The OpenAI-compatible inference listener. Default `127.0.0.1:8080`.
    pub inference: SocketAddr,
    /// The management listener. Default `127.0.0.1:7443`.
    pub management: SocketAddr,
    /// TLS for both listeners; plain HTTP when absent.
    pub tls: Option<TlsFiles>,
}

impl Default for ListenSettings {
    fn default() -> Self {
        Self {
            inference: SocketAddr::from(([127, 0, 0, 1], 8080)),
            management: SocketAddr::from(([127, 0, 0, 1], 7443)),
            tls: None,
        }
    }
}

/// The server's settings (the server document, or `server:` of a standalone document), resolved.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ServerConfig {
    /// Listeners.
    pub listen: ListenSettings,
    /// Switch timing.
    pub switching: SwitchingSettings,
    /// Idle timers.
    pub lifecycle_defaults: LifecycleDefaults,
    /// A file holding the admin token; standalone generates one in its data directory when absent.
    pub admin_token_file: Option<PathBuf>,
    /// `inference_auth.tenants` (standalone), key files read; `None`: no keys.
    pub inference_auth: Option<Vec<TenantSettings>>,
}

/// One tenant of `server.inference_auth`, resolved (the rules: [`crate::tenants`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantSettings {
    /// Its name.
    pub name: String,
    /// Its keys, from `keys` then `key_files` (never shown by `Debug`).
    pub keys: Vec<crate::tenants::ApiKey>,
    /// Its model names or globs; `None`: every model.
    pub models: Option<Vec<String>>,
    /// `rate.requests_per_minute`.
    pub requests_per_minute: Option<u64>,
    /// `rate.tokens_per_minute`.
    pub tokens_per_minute: Option<u64>,
}

/// How to launch one engine kind (`host.engines.<kind>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineCommand {
    /// Program and leading arguments; CapyCTL appends its own arguments.
    pub command: Vec<String>,
    /// The engine's version when the operator declares it (capability checks are version-aware).
    pub version: Option<String>,
    /// Extra environment for every engine of this kind.
    pub env: BTreeMap<String, String>,
}

impl EngineCommand {
    /// The default launch command of `kind`.
    pub fn default_for(kind: EngineKind) -> Self {
        let command: &[&str] = match kind {
            EngineKind::Vllm => &["vllm"],
            EngineKind::Sglang => &["python3", "-m", "sglang.launch_server"],
            EngineKind::Tensorfold => &["tensorfold", "serve"],
        };
        Self {
            command: command.iter().map(|s| (*s).to_string()).collect(),
            version: None,
            env: BTreeMap::new(),
        }
    }
}

/// Launch commands of every engine kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineCommands {
    /// vLLM.
    pub vllm: EngineCommand,
    /// SGLang.
    pub sglang: EngineCommand,
    /// TensorFold.
    pub tensorfold: EngineCommand,
}

impl EngineCommands {
    /// The command of `kind`.
    pub fn get(&self, kind: EngineKind) -> &EngineCommand {
        match kind {
            EngineKind::Vllm => &self.vllm,
            EngineKind::Sglang => &self.sglang,
            EngineKind::Tensorfold => &self.tensorfold,
        }
    }
}

impl Default for EngineCommands {
    fn default() -> Self {
        Self {
            vllm: EngineCommand::default_for(EngineKind::Vllm),
            sglang: EngineCommand::default_for(EngineKind::Sglang),
            tensorfold: EngineCommand::default_for(EngineKind::Tensorfold),
        }
    }
}

/// A GPU declared in the host document, replacing what NVML reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuOverride {
    /// Memory of the GPU in bytes.
    pub memory: u64,
    /// Whether the GPU shares memory with the host (unified memory: models park deep).
    pub unified: bool,
    /// The GPU's UUID, when known.
    pub uuid: Option<String>,
}

/// One host's settings (the host document, or `host:` of a standalone document), resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostConfig {
    /// The host's ID. Default: the machine's hostname (`localhost` when unknown).
    pub id: String,
    /// Queue settings.
    pub queue: QueueSettings,
    /// `lifecycle.activation` for every model the host may run. Default `on_demand`.
    pub activation: Activation,
    /// Engine launch commands.
    pub engines: EngineCommands,
    /// GPUs replacing what NVML reports, when declared.
    pub gpus: Option<Vec<GpuOverride>>,
    /// Host memory in bytes replacing what `/proc/meminfo` reports, when declared.
    pub host_memory: Option<u64>,
}

impl HostConfig {
    /// The settings of a host whose document sets nothing.
    pub fn defaults(mode: Mode) -> Self {
        Self {
            id: default_host_id(),
            queue: QueueSettings::defaults(mode),
            activation: Activation::OnDemand,
            engines: EngineCommands::default(),
            gpus: None,
            host_memory: None,
        }
    }
}

/// Everything `capyctl start standalone` reads from its document, resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct StandaloneConfig {
    /// The server part.
    pub server: ServerConfig,
    /// The host part.
    pub host: HostConfig,
    /// Deployments deployed (not started) at start; names are unique.
    pub deployments: Vec<crate::documents::DeploymentDoc>,
}

/// The machine's hostname from `/proc/sys/kernel/hostname`, or `localhost` when unreadable or empty.
pub fn default_host_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

/// The waiting limits and request deadline that apply across several hosts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitingLimits {
    /// Waiting requests per deployment.
    pub max_pending_per_deployment: u32,
    /// Waiting requests in total.
    pub max_pending_total: u32,
    /// Bytes of waiting bodies in total.
    pub max_buffered_bytes_total: u64,
    /// How long a request may wait for its first output.
    pub request_deadline: Duration,
}

impl From<&QueueSettings> for WaitingLimits {
    fn from(q: &QueueSettings) -> Self {
        Self {
            max_pending_per_deployment: q.max_pending_per_deployment,
            max_pending_total: q.max_pending_total,
            max_buffered_bytes_total: q.max_buffered_bytes_total,
            request_deadline: q.request_deadline,
        }
    }
}

/// The multi-host rule: the waiting limits and the request deadline are the tightest (smallest)
/// any host sets, so one host at `max_pending_per_deployment: 0` makes it 0 for the server.
/// `None` when there are no hosts.
///
/// NB: the admission window is not merged; the one of the host where the switch happens applies
/// (read it from that host's [`QueueSettings`]).
pub fn tightest<'a>(hosts: impl IntoIterator<Item = &'a QueueSettings>) -> Option<WaitingLimits> {
    hosts
        .into_iter()
        .map(WaitingLimits::from)
        .reduce(|a, b| WaitingLimits {
            max_pending_per_deployment: a
                .max_pending_per_deployment
                .min(b.max_pending_per_deployment),
            max_pending_total: a.max_pending_total.min(b.max_pending_total),
            max_buffered_bytes_total: a.max_buffered_bytes_total.min(b.max_buffered_bytes_total),
            request_deadline: a.request_deadline.min(b.request_deadline),
        })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn tightest_takes_the_minimum_of_each_limit() {
        let a = QueueSettings::defaults(Mode::ServerAndHosts);
        let b = QueueSettings {
            max_pending_per_deployment: 0,
            max_buffered_bytes_total: 1 << 30,
            request_deadline: secs(60),
            admission_window: secs(30),
            ..a
        };
        let c = QueueSettings {
            max_pending_total: 10,
            ..a
        };
        let t = tightest([&a, &b, &c]).unwrap();
        assert_eq!(
            t,
            WaitingLimits {
                max_pending_per_deployment: 0,
                max_pending_total: 10,
                max_buffered_bytes_total: 64 * 1024 * 1024,
                request_deadline: secs(60),
            }
        );
        assert_eq!(tightest([&a]).unwrap(), WaitingLimits::from(&a));
        assert_eq!(tightest(std::iter::empty()), None);
    }

    #[test]
    fn bounds_print_with_units() {
        assert_eq!(ADMISSION_WINDOW_BOUNDS.to_string(), "1ms to 30s");
        assert_eq!(REQUEST_DEADLINE_BOUNDS.to_string(), "1ms to 3600s");
        assert_eq!(DRAIN_TIMEOUT_BOUNDS.to_string(), "1s to 600s");
        assert_eq!(IDLE_TIMEOUT_BOUNDS.to_string(), "1s to 168h");
        assert_eq!(MAX_BUFFERED_BYTES_TOTAL_BOUNDS.to_string(), "1KiB to 16GiB");
        assert_eq!(MAX_PENDING_PER_DEPLOYMENT_BOUNDS.to_string(), "0 to 4096");
    }

    #[test]
    fn host_id_defaults_to_something() {
        assert!(!default_host_id().is_empty());
    }
}
