//! The engine's command line and environment (DESIGN 4.2), and what it will run at once
//! (`max_running` of the load read), as pure functions.
//!
//! - vLLM: `<command> serve <model> --host 127.0.0.1 --port <p> --served-model-name <name>
//!   [--enable-sleep-mode] --max-num-seqs N <extra_args>`, with `VLLM_SERVER_DEV_MODE=1` when it
//!   may park. N is `max_concurrent_requests`, else CapyCTL's default 32 (the router's in-flight
//!   bound), and the default is left out when `extra_args` or the host's command already set it.
//! - SGLang: `<command> --model-path <model> --host 127.0.0.1 --port <p> --served-model-name
//!   <name> --enable-metrics [--enable-memory-saver] [--enable-weights-cpu-backup]
//!   [--max-running-requests N] <extra_args>`; without `max_concurrent_requests` SGLang sizes
//!   itself and reports it in `/server_info`.
//! - TensorFold: `<command> --model <model> --port <p> <extra_args>`; it has no flag for
//!   `max_concurrent_requests` and runs 8 at once, so a deployment declaring one is refused.
//!
//! Which figure the engine runs with, when several places set it (one rule for the launch and
//! for [`max_running`]): the deployment's `extra_args`, then its `max_concurrent_requests`,
//! then the host's command (`host.engines.<kind>.command`), then the defaults. The engines take
//! the last occurrence of a flag, and the arguments are in that order: the host's command
//! first, CapyCTL's own (`max_concurrent_requests`) after it, `extra_args` last. (The
//! deployment's two places together are refused: say which one you mean.)
//!
//! Environment: the host's `engines.<kind>.env`, then the deployment's `env`, then
//! `VLLM_SERVER_DEV_MODE=1` where parking needs it (CapyCTL's own wins, or parking breaks).

use std::collections::BTreeMap;

use capyctl_spec::EngineKind;
use serde::{Deserialize, Serialize};

use crate::error::AgentError;
use crate::spec::{EngineLaunch, InstanceSpec, flag_value, has_flag};
use crate::tier::LaunchParking;

/// CapyCTL's default of requests vLLM runs at once (the router's in-flight bound).
pub const VLLM_DEFAULT_MAX_RUNNING: u32 = 32;
/// TensorFold's own default of requests run at once.
pub const TENSORFOLD_DEFAULT_MAX_RUNNING: u32 = 8;

/// A process to start: program, arguments, extra environment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaunchCommand {
    /// The program (the first word of the host's command).
    pub program: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// Environment added to the agent's own.
    pub env: BTreeMap<String, String>,
}

impl LaunchCommand {
    /// Program and arguments, as `/proc/<pid>/cmdline` shows them.
    pub fn argv(&self) -> Vec<String> {
        std::iter::once(self.program.clone())
            .chain(self.args.iter().cloned())
            .collect()
    }
}

/// The flag that sets how many requests `engine` runs at once.
pub use capyctl_spec::documents::max_running_flag;

/// The engine's launch command for `spec` on loopback port `port`.
///
/// Refused: an empty host command, `max_concurrent_requests` together with the engine's own
/// flag in `extra_args` (the engine would take the last; say which one you mean), and
/// `max_concurrent_requests` on TensorFold (it has no such flag).
pub fn launch_command(
    spec: &InstanceSpec,
    engine: &EngineLaunch,
    port: u16,
    parking: LaunchParking,
) -> Result<LaunchCommand, AgentError> {
    let Some((program, leading)) = engine.command.split_first() else {
        return Err(AgentError::InvalidSpec {
            detail: format!("host.engines.{}.command is empty", spec.engine),
        });
    };
    let flag = max_running_flag(spec.engine);
    if let (None, Some(n)) = (flag, spec.max_concurrent_requests) {
        return Err(AgentError::InvalidSpec {
            detail: format!(
                "deployment {}: max_concurrent_requests: {n} cannot be passed to {}: it has no \
                 option for it and runs {TENSORFOLD_DEFAULT_MAX_RUNNING} requests at once; remove \
                 max_concurrent_requests",
                spec.name, spec.engine
            ),
        });
    }
    if let (Some(flag), Some(_)) = (flag, spec.max_concurrent_requests)
        && has_flag(&spec.extra_args, flag)
    {
        return Err(AgentError::InvalidSpec {
            detail: format!(
                "deployment {}: max_concurrent_requests and {flag} in extra_args both set how many requests run at once; keep one",
                spec.name
            ),
        });
    }
    let mut args: Vec<String> = leading.to_vec();
    let mut push = |a: &str| args.push(a.to_string());
    let port = port.to_string();
    let mut env = engine.env.clone();
    env.extend(spec.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    let set_elsewhere = |flag: &str| has_flag(&spec.extra_args, flag) || has_flag(leading, flag);
    match spec.engine {
        EngineKind::Vllm => {
            for a in ["serve", &spec.model, "--host", "127.0.0.1", "--port", &port] {
                push(a);
            }
            push("--served-model-name");
            push(&spec.name);
            if parking.may_park {
                push("--enable-sleep-mode");
                env.insert("VLLM_SERVER_DEV_MODE".to_string(), "1".to_string());
            }
            match spec.max_concurrent_requests {
                Some(n) => {
                    push("--max-num-seqs");
                    push(&n.to_string());
                }
                None if !set_elsewhere("--max-num-seqs") => {
                    push("--max-num-seqs");
                    push(&VLLM_DEFAULT_MAX_RUNNING.to_string());
                }
                None => {}
            }
        }
        EngineKind::Sglang => {
            for a in [
                "--model-path",
                &spec.model,
                "--host",
                "127.0.0.1",
                "--port",
                &port,
            ] {
                push(a);
            }
            push("--served-model-name");
            push(&spec.name);
            push("--enable-metrics");
            if parking.may_park {
                push("--enable-memory-saver");
                if parking.host_ram {
                    push("--enable-weights-cpu-backup");
                }
            }
            if let Some(n) = spec.max_concurrent_requests {
                push("--max-running-requests");
                push(&n.to_string());
            }
        }
        EngineKind::Tensorfold => {
            for a in ["--model", &spec.model, "--port", &port] {
                push(a);
            }
        }
    }
    // One instance over several GPUs (`gpus_per_instance`): the engine's tensor-parallel
    // option (the document refuses it for TensorFold, and in `extra_args`).
    if let Some(n) = spec.tensor_parallel
        && let Some(flag) = capyctl_spec::engine_args::tensor_parallel_flag(spec.engine)
    {
        args.push(flag.to_string());
        args.push(n.to_string());
    }
    args.extend(spec.extra_args.iter().cloned());
    Ok(LaunchCommand {
        program: program.clone(),
        args,
        env,
    })
}

/// Where a `max_running` figure comes from (product page, "Reading load").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MaxRunningSource {
    /// The engine's own figure (SGLang's `/server_info`).
    Engine,
    /// `max_concurrent_requests`.
    Declared,
    /// CapyCTL's default: 32 for vLLM, 8 for TensorFold.
    Default,
    /// A hybrid model's state cache holds fewer.
    StateCache,
    /// The option is in the deployment's `extra_args`.
    ExtraArgs,
    /// The option is in the host's engine command.
    HostFixed,
    /// The engine chooses at start and has not said.
    EngineDefault,
    /// The host sizes it at launch (the server does not know yet).
    OnHost,
}

impl MaxRunningSource {
    /// The name the load read shows (`engine`, `declared`, `default`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            MaxRunningSource::Engine => "engine",
            MaxRunningSource::Declared => "declared",
            MaxRunningSource::Default => "default",
            MaxRunningSource::StateCache => "state_cache",
            MaxRunningSource::ExtraArgs => "extra_args",
            MaxRunningSource::HostFixed => "host_fixed",
            MaxRunningSource::EngineDefault => "engine_default",
            MaxRunningSource::OnHost => "on_host",
        }
    }
}

impl std::fmt::Display for MaxRunningSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<MaxRunning> for capyctl_spec::api::MaxRunningView {
    fn from(m: MaxRunning) -> Self {
        Self {
            count: m.count,
            source: m.source.as_str().into(),
        }
    }
}

/// How many requests an engine runs at once; `count` is `None` when not known.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MaxRunning {
    /// The figure, when known.
    pub count: Option<u32>,
    /// Where it comes from.
    pub source: MaxRunningSource,
}

/// SGLang's option that sizes a hybrid model's state cache (Mamba / linear-attention states,
/// one per running request).
pub const SGLANG_STATE_CACHE_FLAG: &str = "--max-mamba-cache-size";

/// What [`max_running`] decides from.
#[derive(Debug, Clone, Copy)]
pub struct MaxRunningInput<'a> {
    /// The engine.
    pub engine: EngineKind,
    /// `max_concurrent_requests`.
    pub declared: Option<u32>,
    /// The deployment's `extra_args`.
    pub extra_args: &'a [String],
    /// The host's engine command (its leading arguments may fix the option).
    pub host_command: &'a [String],
    /// What the engine reported (SGLang `/server_info` `max_running_requests`).
    pub engine_reported: Option<u32>,
    /// The checkpoint is a hybrid model whose state cache may hold fewer requests
    /// ([`ModelFacts::hybrid_state`](crate::checkpoint::ModelFacts::hybrid_state)); false when
    /// not known (a hub name, or a caller that cannot read the checkpoint).
    pub hybrid_checkpoint: bool,
    /// The figure is decided by a remote host at launch and not known here (the server's view
    /// of a deployment a node agent runs; see [`max_running`]).
    pub sized_on_host: bool,
}

/// `max_running` {count, source}.
///
/// - `engine`: the engine's own figure, when it reports one (SGLang), wins: it already counts
///   what bounds the engine, its state cache included.
/// - Otherwise what CapyCTL passed or expects, in the order of the launch (module doc):
///   `extra_args`, `declared`, `host_fixed`, then `default` (vLLM 32, TensorFold 8) or
///   `engine_default` (SGLang sizes itself at start).
/// - `on_host` (count unknown) replaces `host_fixed`, `default` and `engine_default` when the
///   caller cannot see the host's launch inputs (`sized_on_host`: the server's view of a
///   deployment a remote node agent runs, whose command and checkpoint only the host reads);
///   the host's own figure comes with the started instance.
/// - `state_cache` (SGLang only): a hybrid model (the checkpoint says so, or
///   `--max-mamba-cache-size N` is in `extra_args` or the host's command) holds one state per
///   running request. With N known and smaller than what was passed, count is N; with N
///   unknown (SGLang sizes the state pool at start from its memory) count is unknown until the
///   engine reports its own figure. NB: vLLM keeps a hybrid model's states in its KV-cache
///   blocks, which bound it the way they bound any model (see the KV use and waiting count of
///   the load sample); it has no separate state-cache option, so its passed figure stands.
pub fn max_running(input: &MaxRunningInput<'_>) -> MaxRunning {
    use MaxRunningSource as S;
    if let Some(n) = input.engine_reported {
        return MaxRunning {
            count: Some(n),
            source: S::Engine,
        };
    }
    let flag = max_running_flag(input.engine);
    let parse = |args: &[String], flag: Option<&str>| -> Option<Option<u32>> {
        let flag = flag?;
        has_flag(args, flag).then(|| flag_value(args, flag).and_then(|v| v.parse().ok()))
    };
    let passed = if let Some(count) = parse(input.extra_args, flag) {
        MaxRunning {
            count,
            source: S::ExtraArgs,
        }
    } else if let (EngineKind::Vllm | EngineKind::Sglang, Some(n)) = (input.engine, input.declared)
    {
        MaxRunning {
            count: Some(n),
            source: S::Declared,
        }
    } else if input.sized_on_host && input.engine != EngineKind::Tensorfold {
        return MaxRunning {
            count: None,
            source: S::OnHost,
        };
    } else if let Some(count) = parse(input.host_command, flag) {
        MaxRunning {
            count,
            source: S::HostFixed,
        }
    } else {
        match input.engine {
            EngineKind::Vllm => MaxRunning {
                count: Some(VLLM_DEFAULT_MAX_RUNNING),
                source: S::Default,
            },
            EngineKind::Tensorfold => MaxRunning {
                count: Some(TENSORFOLD_DEFAULT_MAX_RUNNING),
                source: S::Default,
            },
            EngineKind::Sglang => MaxRunning {
                count: None,
                source: S::EngineDefault,
            },
        }
    };
    if input.engine != EngineKind::Sglang {
        return passed;
    }
    let slots = parse(input.extra_args, Some(SGLANG_STATE_CACHE_FLAG)).or_else(|| {
        (!input.sized_on_host)
            .then(|| parse(input.host_command, Some(SGLANG_STATE_CACHE_FLAG)))
            .flatten()
    });
    if !input.hybrid_checkpoint && slots.is_none() {
        return passed;
    }
    match (slots.flatten(), passed.count) {
        (Some(limit), Some(n)) if limit >= n => passed,
        (limit, _) => MaxRunning {
            count: limit,
            source: S::StateCache,
        },
    }
}
