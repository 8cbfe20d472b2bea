//! Launch arguments: the engines' own flags, the simulation knobs, and what is left over.
//!
//! The engines' flags are parsed with clap, but a real engine takes hundreds of flags that
//! CapyCTL may pass through `extra_args`. So the arguments are first split (see
//! [`split_args`]): flags this flavour knows go to clap, any other `--flag [value]` is kept
//! verbatim in [`SimConfig::unknown_args`] and reported in `/sim/state`.

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser, ValueEnum};
use serde::Serialize;

/// Which engine the simulator speaks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Flavour {
    /// vLLM: `serve <model>`, sleep mode, `vllm:` metrics.
    Vllm,
    /// SGLang: `--model-path`, memory saver, `sglang:` metrics.
    Sglang,
    /// TensorFold: `--model`, no parking, role-only opening chunk.
    Tensorfold,
}

impl Flavour {
    /// The lowercase name, as in `--engine`.
    pub fn name(self) -> &'static str {
        match self {
            Flavour::Vllm => "vllm",
            Flavour::Sglang => "sglang",
            Flavour::Tensorfold => "tensorfold",
        }
    }

    /// The version string reported when `--sim-version` is not given.
    pub fn default_version(self) -> &'static str {
        match self {
            Flavour::Vllm => "0.32.0",
            Flavour::Sglang => "0.5.23",
            Flavour::Tensorfold => "1.0.0",
        }
    }

    /// How many requests the engine runs at once when its launch flag is absent.
    pub fn default_max_running(self) -> usize {
        match self {
            Flavour::Vllm => 256,
            Flavour::Sglang => 128,
            Flavour::Tensorfold => 8,
        }
    }

    fn default_port(self) -> u16 {
        match self {
            Flavour::Vllm | Flavour::Tensorfold => 8000,
            Flavour::Sglang => 30000,
        }
    }
}

impl fmt::Display for Flavour {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A fault the simulator can inject, at start (`ENGINE_SIM_FAULTS`) or via `POST /sim/faults`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// The next wake that brings weights back leaves them wrong: answers differ from then on,
    /// and a weight reload does not repair it. One-shot: cleared when it fires.
    WakeMismatch,
    /// `collective_rpc reload_weights` and `update_weights_from_disk` fail with 500.
    ReloadFails,
    /// A wake (`/wake_up`, `/resume_memory_occupation`) never answers and changes nothing.
    WakeHangs,
    /// Exit the process at once with a non-zero status.
    Crash,
    /// Exit the process in the middle of the next wake.
    CrashOnWake,
    /// Every stream sends one chunk larger than 64 KiB.
    OversizedChunks,
    /// vLLM and SGLang streams also begin with a role-only chunk sent before prefill.
    RoleChunk,
    /// SGLang's `/health` while generation is paused or memory released does not answer at
    /// once: like the real server's, it waits for a generated token, answering 200 once the
    /// engine serves again or 503 after [`PAUSED_HEALTH_TIMEOUT`].
    PausedHealthHangs,
    /// Parking claims success and does nothing: vLLM `/sleep`, SGLang `/pause_generation` and
    /// `/release_memory_occupation` answer 200 and the engine stays awake, serving.
    SleepIgnored,
    /// Waking claims success and does nothing: vLLM `/wake_up`, SGLang
    /// `/resume_memory_occupation` and `/continue_generation` answer 200 and the engine stays
    /// asleep.
    WakeIgnored,
    /// vLLM `/reset_prefix_cache` answers `{"success": false}` and resets nothing (as vLLM does
    /// while blocks are still held).
    PrefixCacheResetFails,
    /// Every LoRA adapter load fails after its load time, as a worker error does (vLLM 500,
    /// SGLang 400), and loads nothing.
    AdapterLoadFails,
    /// Every LoRA adapter load never answers and loads nothing (a stuck engine core).
    AdapterLoadHangs,
}

/// vLLM 0.32.0's contract extract (its flags among the rest), written from its source by
/// `node-agent/contracts/extract.py`.
const VLLM_CONTRACT: &str = include_str!("../../node-agent/contracts/vllm-0.32.0.txt");

/// How long SGLang's `/health` waits for its token before answering 503 (SGLang's
/// `SGLANG_HEALTH_CHECK_TIMEOUT`, 20 s by default), with the `paused_health_hangs` fault.
pub const PAUSED_HEALTH_TIMEOUT: Duration = Duration::from_secs(20);

impl Fault {
    /// Every fault, in the order of the docs.
    pub const ALL: [Fault; 13] = [
        Fault::WakeMismatch,
        Fault::ReloadFails,
        Fault::WakeHangs,
        Fault::Crash,
        Fault::CrashOnWake,
        Fault::OversizedChunks,
        Fault::RoleChunk,
        Fault::PausedHealthHangs,
        Fault::SleepIgnored,
        Fault::WakeIgnored,
        Fault::PrefixCacheResetFails,
        Fault::AdapterLoadFails,
        Fault::AdapterLoadHangs,
    ];

    /// The fault's name, as written in `ENGINE_SIM_FAULTS` and `/sim/faults`.
    pub fn name(self) -> &'static str {
        match self {
            Fault::WakeMismatch => "wake_mismatch",
            Fault::ReloadFails => "reload_fails",
            Fault::WakeHangs => "wake_hangs",
            Fault::Crash => "crash",
            Fault::CrashOnWake => "crash_on_wake",
            Fault::OversizedChunks => "oversized_chunks",
            Fault::RoleChunk => "role_chunk",
            Fault::PausedHealthHangs => "paused_health_hangs",
            Fault::SleepIgnored => "sleep_ignored",
            Fault::WakeIgnored => "wake_ignored",
            Fault::PrefixCacheResetFails => "prefix_cache_reset_fails",
            Fault::AdapterLoadFails => "adapter_load_fails",
            Fault::AdapterLoadHangs => "adapter_load_hangs",
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Fault {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        Fault::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = Fault::ALL.iter().map(|f| f.name()).collect();
                format!("unknown fault `{s}`; known faults: {}", names.join(", "))
            })
    }
}

/// Parses a comma-separated fault list (`crash_on_wake,reload_fails`); empty items are skipped.
pub fn parse_faults(s: &str) -> Result<BTreeSet<Fault>, String> {
    s.split(',')
        .filter(|item| !item.trim().is_empty())
        .map(Fault::from_str)
        .collect()
}

/// Parses a byte count: `1048576`, `8GiB`, `512Mi`, `1.5GB`, `64KiB`; a trailing `/s` is
/// accepted so bandwidths read naturally (`2GiB/s`). SI units (`K`, `KB`, `G`…) are powers of
/// 1000, binary units (`Ki`, `KiB`, `Gi`…) powers of 1024; case is ignored.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let t = t.strip_suffix("/s").unwrap_or(t).trim_end();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("`{s}` is not a byte size (examples: 1048576, 512MiB, 8GiB)"))?;
    let multiplier: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "ki" | "kib" => 1024.0,
        "mi" | "mib" => 1024.0 * 1024.0,
        "gi" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "ti" | "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        other => return Err(format!("`{s}`: unknown byte unit `{other}`")),
    };
    let bytes = number * multiplier;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("`{s}` is too large"));
    }
    Ok(bytes.round() as u64)
}

/// Parses a duration: `250ms`, `2s`, `1.5s`, `10us`, `1m`; a bare number is seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("`{s}` is not a duration (examples: 250ms, 2s, 1.5s)"))?;
    let seconds = match unit.trim() {
        "" | "s" => number,
        "ms" => number / 1e3,
        "us" | "µs" => number / 1e6,
        "ns" => number / 1e9,
        "m" | "min" => number * 60.0,
        "h" => number * 3600.0,
        other => return Err(format!("`{s}`: unknown duration unit `{other}`")),
    };
    Duration::try_from_secs_f64(seconds).map_err(|e| format!("`{s}`: {e}"))
}

fn parse_rate(s: &str) -> Result<f64, String> {
    let rate: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a token rate (tokens per second; 0 = unlimited)"))?;
    if rate.is_finite() && rate >= 0.0 {
        Ok(rate)
    } else {
        Err(format!("`{s}`: a token rate is a number >= 0"))
    }
}

/// The command line as clap sees it, after [`split_args`] removed the unknown flags.
#[derive(Parser, Debug)]
#[command(
    name = "engine-sim",
    version,
    about = "Simulates vLLM, SGLang or TensorFold: their HTTP APIs, sleep/wake and metrics",
    after_help = "Flags that the chosen engine does not know (e.g. `--max-model-len 8192`) are \
                  accepted, recorded and reported in GET /sim/state."
)]
struct SimArgs {
    /// Which engine to simulate; inferred when absent (`serve <model>` → vllm,
    /// `--model-path` → sglang, `--model` → tensorfold).
    #[arg(long, env = "ENGINE_SIM_ENGINE", value_enum)]
    engine: Option<Flavour>,

    /// Positional arguments: vLLM's `serve <model>`.
    #[arg(value_name = "ARGS")]
    positional: Vec<String>,

    /// The model (vLLM `--model`, TensorFold, SGLang alias of `--model-path`).
    #[arg(long)]
    model: Option<String>,

    /// SGLang: the model path.
    #[arg(long)]
    model_path: Option<String>,

    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,

    /// Port to listen on; 0 picks a free one (default: vllm/tensorfold 8000, sglang 30000).
    #[arg(long)]
    port: Option<u16>,

    /// The model name clients send; defaults to the model.
    #[arg(long)]
    served_model_name: Option<String>,

    /// vLLM: enable sleep mode (the sleep endpoints also need VLLM_SERVER_DEV_MODE=1).
    #[arg(long)]
    enable_sleep_mode: bool,

    /// vLLM: requests run at once (default 256).
    #[arg(long)]
    max_num_seqs: Option<usize>,

    /// SGLang: serve /metrics.
    #[arg(long)]
    enable_metrics: bool,

    /// SGLang: allow release/resume_memory_occupation.
    #[arg(long)]
    enable_memory_saver: bool,

    /// SGLang: keep released weights in host RAM (otherwise they are discarded).
    #[arg(long)]
    enable_weights_cpu_backup: bool,

    /// SGLang: requests run at once (default 128).
    #[arg(long)]
    max_running_requests: Option<usize>,

    /// SGLang: speculative decoding algorithm (releasing weights then corrupts the draft).
    #[arg(long)]
    speculative_algorithm: Option<String>,

    /// vLLM and SGLang: take LoRA adapters.
    #[arg(long)]
    enable_lora: bool,

    /// vLLM: LoRA adapters in one batch (default 1).
    #[arg(long)]
    max_loras: Option<usize>,

    /// vLLM and SGLang: the largest LoRA rank (default 16).
    #[arg(long)]
    max_lora_rank: Option<u64>,

    /// SGLang: LoRA adapters held at once; a load beyond is refused.
    #[arg(long)]
    max_loaded_loras: Option<usize>,

    /// vLLM: whether the adapter load/unload routes exist ("1" or "true" turns them on).
    #[arg(
        long = "sim-vllm-runtime-lora-updating",
        env = "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
        value_name = "0|1"
    )]
    vllm_runtime_lora: Option<String>,

    /// How long a LoRA adapter load takes (per adapter: `/sim/faults` `adapters`).
    #[arg(long = "sim-adapter-load-time", env = "ENGINE_SIM_ADAPTER_LOAD_TIME", default_value = "10ms", value_parser = parse_duration)]
    adapter_load_time: Duration,

    /// vLLM developer mode ("1" or "true" turns it on).
    #[arg(
        long = "sim-vllm-dev-mode",
        env = "VLLM_SERVER_DEV_MODE",
        value_name = "0|1"
    )]
    vllm_dev_mode: Option<String>,

    /// SGLang 0.5.6 and later: whether `/health` generates a token ("0" or "false" turns it
    /// off: `/health` then answers 200 without generating; `/health_generate` always
    /// generates).
    #[arg(
        long = "sim-sglang-health-endpoint-generation",
        env = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION",
        value_name = "0|1"
    )]
    sglang_health_endpoint_generation: Option<String>,

    /// Size of the weights (e.g. 8GiB or bytes); sets park and wake times.
    #[arg(long = "sim-weights-bytes", env = "ENGINE_SIM_WEIGHTS_BYTES", default_value = "8GiB", value_parser = parse_bytes)]
    weights_bytes: u64,

    /// GPU memory the engine holds while awake (default: twice the weights plus the residue).
    #[arg(long = "sim-gpu-memory-bytes", env = "ENGINE_SIM_GPU_MEMORY_BYTES", value_parser = parse_bytes)]
    gpu_memory_bytes: Option<u64>,

    /// GPU memory still held while asleep (CUDA graphs, pools) (default: min(512MiB, weights/4)).
    #[arg(long = "sim-sleep-residue-bytes", env = "ENGINE_SIM_SLEEP_RESIDUE_BYTES", value_parser = parse_bytes)]
    sleep_residue_bytes: Option<u64>,

    /// Bytes per second when copying weights between GPU and host RAM.
    #[arg(long = "sim-host-bandwidth", env = "ENGINE_SIM_HOST_BANDWIDTH", default_value = "16GiB", value_parser = parse_bytes)]
    host_bandwidth: u64,

    /// Bytes per second when reloading weights from disk.
    #[arg(long = "sim-disk-bandwidth", env = "ENGINE_SIM_DISK_BANDWIDTH", default_value = "2GiB", value_parser = parse_bytes)]
    disk_bandwidth: u64,

    /// Time from start until the engine is ready (/health 503 and requests refused until then).
    #[arg(long = "sim-startup-delay", env = "ENGINE_SIM_STARTUP_DELAY", default_value = "0s", value_parser = parse_duration)]
    startup_delay: Duration,

    /// Tokens per second per request; 0 = as fast as possible.
    #[arg(long = "sim-token-rate", env = "ENGINE_SIM_TOKEN_RATE", default_value = "0", value_parser = parse_rate)]
    token_rate: f64,

    /// Prefill time per prompt token (e.g. 1ms).
    #[arg(long = "sim-prefill-per-token", env = "ENGINE_SIM_PREFILL_PER_TOKEN", default_value = "0s", value_parser = parse_duration)]
    prefill_per_token: Duration,

    /// KV-cache capacity in tokens (the denominator of the KV usage metric).
    #[arg(
        long = "sim-kv-capacity-tokens",
        env = "ENGINE_SIM_KV_CAPACITY_TOKENS",
        default_value_t = 32768
    )]
    kv_capacity_tokens: u64,

    /// Version string to report (default: vllm 0.32.0, sglang 0.5.23, tensorfold 1.0.0); SGLang's
    /// routes and bodies follow it (see the README).
    #[arg(long = "sim-version", env = "ENGINE_SIM_VERSION")]
    version_string: Option<String>,

    /// Faults active at start, comma-separated (wake_mismatch, reload_fails, wake_hangs,
    /// crash, crash_on_wake, oversized_chunks, role_chunk, paused_health_hangs, sleep_ignored,
    /// wake_ignored).
    #[arg(long = "sim-faults", env = "ENGINE_SIM_FAULTS", default_value = "", value_parser = parse_faults)]
    faults: BTreeSet<Fault>,
}

/// The simulator's configuration: launch arguments parsed and checked.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// The engine simulated.
    pub flavour: Flavour,
    /// The model argument (checkpoint path or hub name).
    pub model: String,
    /// The name clients must send in `model`.
    pub served_model_name: String,
    /// Address to listen on (`--host`).
    pub host: String,
    /// Port to listen on (`--port`); 0 = a free port.
    pub port: u16,
    /// vLLM `--enable-sleep-mode`.
    pub enable_sleep_mode: bool,
    /// vLLM developer mode (`VLLM_SERVER_DEV_MODE=1`): the dev endpoints exist.
    pub vllm_dev_mode: bool,
    /// SGLang `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION` (default on): `/health` generates a
    /// token (0.5.6 and later; when off it answers 200 without generating).
    pub sglang_health_generates: bool,
    /// SGLang `--max-running-requests` as given (`null` in `/server_info` when absent: SGLang
    /// sizes itself).
    pub max_running_requests_arg: Option<usize>,
    /// SGLang `--enable-metrics` (vLLM and TensorFold always serve /metrics).
    pub enable_metrics: bool,
    /// SGLang `--enable-memory-saver`.
    pub enable_memory_saver: bool,
    /// SGLang `--enable-weights-cpu-backup`.
    pub enable_weights_cpu_backup: bool,
    /// SGLang `--speculative-algorithm`.
    pub speculative_algorithm: Option<String>,
    /// vLLM and SGLang `--enable-lora`: the engine takes LoRA adapters.
    pub enable_lora: bool,
    /// vLLM `VLLM_ALLOW_RUNTIME_LORA_UPDATING`: `/v1/load_lora_adapter` and
    /// `/v1/unload_lora_adapter` exist.
    pub vllm_runtime_lora: bool,
    /// vLLM `--max-loras` (default 1): adapters in one batch. vLLM 0.32 does not refuse
    /// loading more (its CPU cache holds `--max-cpu-loras`, by default as many; the others are
    /// read from disk again when named); kept for `/sim/state`.
    pub max_loras: usize,
    /// `--max-lora-rank` (vLLM default 16; SGLang infers it from `--lora-paths`, 16 here): a
    /// load of an adapter of a higher rank is refused.
    pub max_lora_rank: u64,
    /// SGLang `--max-loaded-loras`: a load beyond this many is refused (none without it).
    pub max_loaded_loras: Option<usize>,
    /// How long an adapter load takes, unless `/sim/faults` set one for that adapter.
    pub adapter_load_time: Duration,
    /// Requests the engine runs at once; more wait.
    pub max_running: usize,
    /// vLLM `--max-model-len` (kept in `unknown_args` too): a request asking for more
    /// `max_tokens` is refused with vLLM's 400; `None` when not given.
    pub max_model_len: Option<u64>,
    /// Size of the weights in bytes.
    pub weights_bytes: u64,
    /// GPU memory held while awake, in bytes (weights + KV pool + residue).
    pub gpu_memory_bytes: u64,
    /// GPU memory still held while everything is released, in bytes.
    pub sleep_residue_bytes: u64,
    /// GPU ↔ host RAM copy bandwidth, bytes per second.
    pub host_bandwidth: u64,
    /// Disk reload bandwidth, bytes per second.
    pub disk_bandwidth: u64,
    /// Time until the engine is ready.
    pub startup_delay: Duration,
    /// Tokens per second per request; 0 = unlimited.
    pub token_rate: f64,
    /// Prefill time per prompt token.
    pub prefill_per_token: Duration,
    /// KV-cache capacity in tokens.
    pub kv_capacity_tokens: u64,
    /// Version string reported by `/version`, `/server_info`.
    pub version: String,
    /// Faults active at start.
    pub faults: BTreeSet<Fault>,
    /// Arguments the engine did not know, verbatim, in order (e.g. `--max-model-len`, `8192`).
    pub unknown_args: Vec<String>,
}

/// Is long flag `name` one that `flavour` knows? Flags of other engines are unknown extras.
fn flag_applies(name: &str, flavour: Option<Flavour>) -> bool {
    let Some(flavour) = flavour else { return true };
    match name {
        "enable-sleep-mode" | "max-num-seqs" => flavour == Flavour::Vllm,
        "model-path"
        | "enable-metrics"
        | "enable-memory-saver"
        | "enable-weights-cpu-backup"
        | "max-running-requests"
        | "speculative-algorithm"
        | "max-loaded-loras" => flavour == Flavour::Sglang,
        "max-loras" => flavour == Flavour::Vllm,
        "enable-lora" | "max-lora-rank" => flavour != Flavour::Tensorfold,
        _ => true,
    }
}

fn looks_like_value(token: &str) -> bool {
    !token.starts_with('-') || token.parse::<f64>().is_ok()
}

/// Splits `args` (without the program name) into those for clap and the unknown ones.
///
/// A known long flag keeps its value (`--port 8000` or `--port=8000`); an unknown
/// `--flag` takes the next token as its value unless that token is itself a flag.
/// NB: an unknown boolean flag directly before a positional swallows it; CapyCTL puts the
/// positionals first, as the real engines' docs do.
pub fn split_args(args: &[String], flavour: Option<Flavour>) -> (Vec<String>, Vec<String>) {
    let command = SimArgs::command();
    let takes_value = |name: &str| -> Option<bool> {
        command
            .get_arguments()
            .find(|a| a.get_long() == Some(name))
            .map(|a| a.get_action().takes_values())
    };
    let mut known = Vec::new();
    let mut unknown = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let token = &args[i];
        i += 1;
        if matches!(token.as_str(), "-h" | "--help" | "-V" | "--version") {
            known.push(token.clone());
        } else if let Some(flag) = token.strip_prefix("--").filter(|f| !f.is_empty()) {
            let (name, has_inline_value) = match flag.split_once('=') {
                Some((name, _)) => (name, true),
                None => (flag, false),
            };
            match takes_value(name).filter(|_| flag_applies(name, flavour)) {
                Some(wants_value) => {
                    known.push(token.clone());
                    if wants_value && !has_inline_value && i < args.len() {
                        known.push(args[i].clone());
                        i += 1;
                    }
                }
                None => {
                    unknown.push(token.clone());
                    if !has_inline_value && i < args.len() && looks_like_value(&args[i]) {
                        unknown.push(args[i].clone());
                        i += 1;
                    }
                }
            }
        } else if token.starts_with('-') && token.len() > 1 && !looks_like_value(token) {
            unknown.push(token.clone());
            if i < args.len() && looks_like_value(&args[i]) {
                unknown.push(args[i].clone());
                i += 1;
            }
        } else {
            known.push(token.clone());
        }
    }
    (known, unknown)
}

fn try_clap(program: &str, known: Vec<String>) -> Result<SimArgs, clap::Error> {
    SimArgs::try_parse_from(std::iter::once(program.to_owned()).chain(known))
}

fn infer_flavour(args: &SimArgs) -> Option<Flavour> {
    if args.model_path.is_some() {
        Some(Flavour::Sglang)
    } else if args.positional.first().is_some_and(|p| p == "serve") && args.positional.len() > 1 {
        Some(Flavour::Vllm)
    } else if args.model.is_some() {
        Some(Flavour::Tensorfold)
    } else if args.positional.first().is_some_and(|p| p == "serve") {
        Some(Flavour::Vllm)
    } else {
        None
    }
}

/// The ranks vLLM 0.32 takes for `--max-lora-rank` (`MaxLoRARanks` in `vllm/config/lora.py`).
const VLLM_LORA_RANKS: [u64; 9] = [1, 8, 16, 32, 64, 128, 256, 320, 512];

fn invalid(message: String) -> clap::Error {
    SimArgs::command().error(ErrorKind::ValueValidation, message)
}

impl SimConfig {
    /// Parses the command line (`args` starts with the program name, like `std::env::args()`)
    /// and the `ENGINE_SIM_*` / `VLLM_SERVER_DEV_MODE` environment variables.
    pub fn try_parse_from<I, T>(args: I) -> Result<SimConfig, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<String>,
    {
        let mut args: Vec<String> = args.into_iter().map(Into::into).collect();
        let program = if args.is_empty() {
            "engine-sim".to_owned()
        } else {
            args.remove(0)
        };
        // Pass 1: every flag of every engine is known, to find the flavour.
        let (known, _) = split_args(&args, None);
        let first = try_clap(&program, known)?;
        let flavour = first
            .engine
            .or_else(|| infer_flavour(&first))
            .ok_or_else(|| {
                invalid(
                    "cannot tell which engine to simulate: pass --engine vllm|sglang|tensorfold, \
                 or vLLM's `serve <model>`, SGLang's `--model-path`, TensorFold's `--model`"
                        .to_owned(),
                )
            })?;
        // Pass 2: only this flavour's flags are known; the rest is recorded.
        let (known, mut unknown_args) = split_args(&args, Some(flavour));
        let a = try_clap(&program, known)?;

        let mut positional = a.positional.into_iter().peekable();
        if positional.peek().is_some_and(|p| p == "serve") {
            positional.next();
        }
        let model = match flavour {
            Flavour::Vllm => a.model.or_else(|| positional.next()),
            Flavour::Sglang => a.model_path.or(a.model),
            Flavour::Tensorfold => a.model.or_else(|| positional.next()),
        }
        .ok_or_else(|| {
            invalid(match flavour {
                Flavour::Vllm => "vLLM needs a model: `serve <model>`".to_owned(),
                Flavour::Sglang => "SGLang needs `--model-path <model>`".to_owned(),
                Flavour::Tensorfold => "TensorFold needs `--model <model>`".to_owned(),
            })
        })?;
        unknown_args.extend(positional);

        let max_running = match flavour {
            Flavour::Vllm => a.max_num_seqs,
            Flavour::Sglang => a.max_running_requests,
            Flavour::Tensorfold => None,
        }
        .unwrap_or(flavour.default_max_running());
        if max_running == 0 {
            return Err(invalid(
                "the maximum of running requests must be at least 1".into(),
            ));
        }
        if a.host_bandwidth == 0 || a.disk_bandwidth == 0 {
            return Err(invalid("bandwidths must be above 0 bytes/s".into()));
        }
        if a.kv_capacity_tokens == 0 {
            return Err(invalid(
                "--sim-kv-capacity-tokens must be at least 1".into(),
            ));
        }
        let sleep_residue_bytes = a
            .sleep_residue_bytes
            .unwrap_or((512 * 1024 * 1024).min(a.weights_bytes / 4));
        let floor = a.weights_bytes.saturating_add(sleep_residue_bytes);
        let gpu_memory_bytes = a.gpu_memory_bytes.unwrap_or(
            a.weights_bytes
                .saturating_mul(2)
                .saturating_add(sleep_residue_bytes),
        );
        if gpu_memory_bytes < floor {
            return Err(invalid(format!(
                "--sim-gpu-memory-bytes ({gpu_memory_bytes}) is smaller than the weights \
                 ({}) plus the sleep residue ({sleep_residue_bytes})",
                a.weights_bytes
            )));
        }
        let on = |v: &Option<String>| {
            v.as_deref()
                .is_some_and(|v| matches!(v.trim(), "1" | "true" | "True" | "TRUE"))
        };
        let vllm_dev_mode = on(&a.vllm_dev_mode);
        let vllm_runtime_lora = flavour == Flavour::Vllm && on(&a.vllm_runtime_lora);
        // (vLLM's parser refuses a rank outside its choices itself: `vllm_invalid_choice`.)
        let rank_zero = flavour != Flavour::Vllm && a.max_lora_rank == Some(0);
        if a.max_loras == Some(0) || rank_zero || a.max_loaded_loras == Some(0) {
            return Err(invalid(
                "--max-loras, --max-lora-rank and --max-loaded-loras must be at least 1".into(),
            ));
        }
        let sglang_health_generates = !a
            .sglang_health_endpoint_generation
            .is_some_and(|v| matches!(v.trim(), "0" | "false" | "False" | "FALSE"));
        let max_running_requests_arg = match flavour {
            Flavour::Sglang => a.max_running_requests,
            Flavour::Vllm | Flavour::Tensorfold => None,
        };

        let max_model_len = match flavour {
            Flavour::Vllm => unknown_args
                .iter()
                .enumerate()
                .filter_map(|(i, a)| match a.strip_prefix("--max-model-len") {
                    Some("") => unknown_args.get(i + 1).map(String::as_str),
                    Some(rest) => rest.strip_prefix('='),
                    None => None,
                })
                .next_back()
                .map(|v| {
                    v.parse::<u64>()
                        .map_err(|_| invalid(format!("--max-model-len `{v}`: a number of tokens")))
                })
                .transpose()?,
            Flavour::Sglang | Flavour::Tensorfold => None,
        };

        Ok(SimConfig {
            flavour,
            served_model_name: a.served_model_name.unwrap_or_else(|| model.clone()),
            model,
            host: a.host,
            port: a.port.unwrap_or(flavour.default_port()),
            enable_sleep_mode: a.enable_sleep_mode,
            vllm_dev_mode,
            sglang_health_generates,
            max_running_requests_arg,
            enable_metrics: a.enable_metrics,
            enable_memory_saver: a.enable_memory_saver,
            enable_weights_cpu_backup: a.enable_weights_cpu_backup,
            speculative_algorithm: a.speculative_algorithm,
            enable_lora: a.enable_lora,
            vllm_runtime_lora,
            max_loras: a.max_loras.unwrap_or(1),
            max_lora_rank: a.max_lora_rank.unwrap_or(16),
            max_loaded_loras: a.max_loaded_loras,
            adapter_load_time: a.adapter_load_time,
            max_running,
            max_model_len,
            weights_bytes: a.weights_bytes,
            gpu_memory_bytes,
            sleep_residue_bytes,
            host_bandwidth: a.host_bandwidth,
            disk_bandwidth: a.disk_bandwidth,
            startup_delay: a.startup_delay,
            token_rate: a.token_rate,
            prefill_per_token: a.prefill_per_token,
            kv_capacity_tokens: a.kv_capacity_tokens,
            version: a
                .version_string
                .unwrap_or_else(|| flavour.default_version().to_owned()),
            faults: a.faults,
            unknown_args,
        })
    }

    /// vLLM 0.32's argument parser's refusal of a `--max-lora-rank` outside its choices
    /// ([`VLLM_LORA_RANKS`]), the line after `vllm serve: error: `; `None` when it takes it or
    /// for the other flavours.
    pub fn vllm_invalid_choice(&self) -> Option<String> {
        (self.flavour == Flavour::Vllm && !VLLM_LORA_RANKS.contains(&self.max_lora_rank)).then(
            || {
                let choices: Vec<String> = VLLM_LORA_RANKS.iter().map(u64::to_string).collect();
                format!(
                    "argument --max-lora-rank: invalid choice: {} (choose from {})",
                    self.max_lora_rank,
                    choices.join(", ")
                )
            },
        )
    }

    /// The arguments `vllm serve` 0.32.0 would refuse as `unrecognized arguments` (flags it does
    /// not have, each with its value), in order; empty for the other flavours. Its flags are
    /// those of the contract extract `node-agent/contracts/vllm-0.32.0.txt` (from vLLM's own
    /// argument parser); `_` for `-` is accepted, as vLLM's parser does, abbreviations are not.
    pub fn vllm_unrecognized(&self) -> Vec<String> {
        if self.flavour != Flavour::Vllm {
            return Vec::new();
        }
        let known: BTreeSet<&str> = VLLM_CONTRACT
            .lines()
            .filter_map(|l| l.strip_prefix("flag\t"))
            .filter_map(|l| l.split('\t').next())
            .collect();
        let mut out = Vec::new();
        let mut args = self.unknown_args.iter().peekable();
        while let Some(arg) = args.next() {
            let Some(flag) = arg.strip_prefix("--") else {
                continue;
            };
            let name = format!(
                "--{}",
                flag.split('=').next().unwrap_or(flag).replace('_', "-")
            );
            if known.contains(name.as_str()) {
                continue;
            }
            out.push(arg.clone());
            if !arg.contains('=')
                && let Some(value) = args.next_if(|v| !v.starts_with("--"))
            {
                out.push(value.clone());
            }
        }
        out
    }

    /// Whether the reported version is `floor` or later (dotted numbers; a part that is not a
    /// number counts as 0, so `0.5.6rc1` is `0.5.6`).
    pub fn version_at_least(&self, floor: [u64; 3]) -> bool {
        let mut parts = self
            .version
            .trim_start_matches('v')
            .split(['.', '-', '+'])
            .map(|p| {
                p.chars()
                    .take_while(char::is_ascii_digit)
                    .collect::<String>()
                    .parse::<u64>()
                    .unwrap_or(0)
            });
        let have = [(); 3].map(|()| parts.next().unwrap_or(0));
        have >= floor
    }

    /// Like [`SimConfig::try_parse_from`], but prints the error (or `--help`) and exits, as
    /// clap's `Parser::parse_from` does.
    pub fn parse_from<I, T>(args: I) -> SimConfig
    where
        I: IntoIterator<Item = T>,
        T: Into<String>,
    {
        Self::try_parse_from(args).unwrap_or_else(|e| e.exit())
    }

    /// The time to move the weights between GPU and host RAM.
    pub fn host_copy_time(&self) -> Duration {
        Duration::from_secs_f64(self.weights_bytes as f64 / self.host_bandwidth as f64)
    }

    /// The time to reload the weights from disk.
    pub fn disk_reload_time(&self) -> Duration {
        Duration::from_secs_f64(self.weights_bytes as f64 / self.disk_bandwidth as f64)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn parse(args: &[&str]) -> SimConfig {
        SimConfig::try_parse_from(std::iter::once("engine-sim").chain(args.iter().copied()))
            .unwrap()
    }

    #[test]
    fn byte_sizes() {
        assert_eq!(parse_bytes("1048576").unwrap(), 1 << 20);
        assert_eq!(parse_bytes("8GiB").unwrap(), 8 << 30);
        assert_eq!(parse_bytes("512Mi").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("1.5GB").unwrap(), 1_500_000_000);
        assert_eq!(parse_bytes("2GiB/s").unwrap(), 2 << 30);
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("3 parsecs").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("soon").is_err());
    }

    #[test]
    fn vllm_args_as_capyctl_passes_them() {
        let c = parse(&[
            "--engine",
            "vllm",
            "serve",
            "Qwen3-4B",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--served-model-name",
            "chat-a",
            "--enable-sleep-mode",
            "--max-num-seqs",
            "8",
            "--max-model-len",
            "8192",
            "--trust-remote-code",
        ]);
        assert_eq!(c.flavour, Flavour::Vllm);
        assert_eq!(c.model, "Qwen3-4B");
        assert_eq!(c.served_model_name, "chat-a");
        assert_eq!(c.port, 0);
        assert!(c.enable_sleep_mode);
        assert_eq!(c.max_running, 8);
        assert_eq!(c.version, "0.32.0");
        assert_eq!(
            c.unknown_args,
            ["--max-model-len", "8192", "--trust-remote-code"]
        );
    }

    #[test]
    fn vllm_refuses_the_flags_vllm_does_not_have() {
        let c = parse(&[
            "serve",
            "m",
            "--max-model-len",
            "256",
            "--max_num_batched_tokens=512",
            "--no-such-flag",
            "3",
            "--enforce-eager",
            "--nope=1",
            "--sim-weights-bytes",
            "1MiB",
        ]);
        assert_eq!(c.vllm_unrecognized(), ["--no-such-flag", "3", "--nope=1"]);
        let s = parse(&["--model-path", "m", "--no-such-flag", "3"]);
        assert!(
            s.vllm_unrecognized().is_empty(),
            "SGLang's flags are not checked"
        );
    }

    #[test]
    fn lora_flags_as_capyctl_passes_them() {
        let v = parse(&[
            "serve",
            "m",
            "--enable-lora",
            "--max-loras",
            "4",
            "--max-lora-rank",
            "64",
            "--sim-vllm-runtime-lora-updating",
            "True",
        ]);
        assert!(v.enable_lora && v.vllm_runtime_lora);
        assert_eq!((v.max_loras, v.max_lora_rank), (4, 64));
        assert!(v.unknown_args.is_empty(), "{:?}", v.unknown_args);
        assert!(v.vllm_unrecognized().is_empty());
        // vLLM's defaults: one adapter per batch, rank 16, no load routes.
        let d = parse(&["serve", "m"]);
        assert!(!d.enable_lora && !d.vllm_runtime_lora);
        assert_eq!((d.max_loras, d.max_lora_rank), (1, 16));
        let s = parse(&[
            "--model-path",
            "m",
            "--enable-lora",
            "--max-lora-rank",
            "8",
            "--lora-target-modules",
            "all",
            "--max-loaded-loras",
            "3",
            "--max-loras-per-batch",
            "3",
        ]);
        assert!(s.enable_lora && !s.vllm_runtime_lora);
        assert_eq!((s.max_lora_rank, s.max_loaded_loras), (8, Some(3)));
        assert_eq!(
            s.unknown_args,
            ["--lora-target-modules", "all", "--max-loras-per-batch", "3"]
        );
        // TensorFold takes none: recorded as unknown.
        let t = parse(&["--model", "m", "--enable-lora"]);
        assert!(!t.enable_lora);
        assert_eq!(t.unknown_args, ["--enable-lora"]);
        assert!(
            SimConfig::try_parse_from(["engine-sim", "--model-path", "m", "--max-lora-rank", "0"])
                .is_err()
        );
        // vLLM's parser takes only its choices of rank.
        assert_eq!(v.vllm_invalid_choice(), None);
        assert_eq!(
            parse(&["serve", "m", "--max-lora-rank", "24"])
                .vllm_invalid_choice()
                .as_deref(),
            Some(
                "argument --max-lora-rank: invalid choice: 24 (choose from 1, 8, 16, 32, 64, \
                 128, 256, 320, 512)"
            )
        );
        assert!(
            parse(&["serve", "m", "--max-lora-rank", "0"])
                .vllm_invalid_choice()
                .is_some()
        );
        assert_eq!(s.vllm_invalid_choice(), None);
    }

    #[test]
    fn flavour_is_inferred() {
        assert_eq!(parse(&["serve", "m"]).flavour, Flavour::Vllm);
        let s = parse(&["--model-path", "m", "--enable-metrics", "--tp", "2"]);
        assert_eq!(s.flavour, Flavour::Sglang);
        assert_eq!(s.max_running, 128);
        assert_eq!(s.unknown_args, ["--tp", "2"]);
        let t = parse(&["--model", "m", "--port", "9"]);
        assert_eq!(t.flavour, Flavour::Tensorfold);
        assert_eq!(t.max_running, 8);
        assert_eq!(t.port, 9);
    }

    #[test]
    fn flags_of_another_engine_are_unknown() {
        let t = parse(&[
            "--engine",
            "tensorfold",
            "--model",
            "m",
            "--max-num-seqs",
            "4",
        ]);
        assert_eq!(t.max_running, 8);
        assert_eq!(t.unknown_args, ["--max-num-seqs", "4"]);
    }

    #[test]
    fn bad_input_is_refused() {
        let bad = |args: &[&str]| {
            SimConfig::try_parse_from(std::iter::once("engine-sim").chain(args.iter().copied()))
                .is_err()
        };
        assert!(bad(&[]));
        assert!(bad(&["--engine", "sglang", "--port", "1"]));
        assert!(bad(&["serve", "m", "--sim-faults", "meteor"]));
        assert!(bad(&[
            "serve",
            "m",
            "--sim-weights-bytes",
            "1GiB",
            "--sim-gpu-memory-bytes",
            "1MiB"
        ]));
        assert!(bad(&["serve", "m", "--sim-disk-bandwidth", "0"]));
    }
}
