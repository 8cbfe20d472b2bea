//! The engine's command line and environment (DESIGN 4.2), as a pure function. How many
//! requests it runs at once (`max_running`), CapyCTL's defaults and which of the places that
//! set the figure counts are `capyctl_engine_rules::max_running`'s, re-exported here.
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
//! - A base with `adapters: {max_loaded, max_rank}` (DESIGN 4.9) gets the engine's LoRA flags
//!   after those ([`capyctl_spec::engine_args::adapter_flags`]): vLLM `--enable-lora
//!   --max-loras <max_loaded> --max-lora-rank <rank>` (the next rank vLLM takes at or above
//!   `max_rank`: 1, 8, 16, 32, 64, 128, 256, 320 or 512) with
//!   `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`; SGLang `--enable-lora --max-lora-rank <max_rank>
//!   --lora-target-modules all --max-loaded-loras <max_loaded> --max-loras-per-batch
//!   <max_loaded>`; TensorFold takes none, and such a spec is refused.
//!
//! Environment: the host's `engines.<kind>.env`, then the deployment's `env`, then
//! `VLLM_SERVER_DEV_MODE=1` where parking needs it (CapyCTL's own wins, or parking breaks).

use std::collections::BTreeMap;

use capyctl_spec::EngineKind;
use serde::{Deserialize, Serialize};

use crate::error::AgentError;
use crate::spec::{EngineLaunch, InstanceSpec, has_flag};
use crate::tier::LaunchParking;

// The values (`capyctl-interfaces`) and the rule of how many run at once
// (`capyctl-engine-rules`), under the paths they always had here.
pub use capyctl_engine_rules::max_running::{
    MaxRunningInput, SGLANG_STATE_CACHE_FLAG, TENSORFOLD_DEFAULT_MAX_RUNNING,
    VLLM_DEFAULT_MAX_RUNNING, max_running,
};
pub use capyctl_interfaces::launch::{MaxRunning, MaxRunningSource};

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
    // A base that takes adapters (`adapters:`, DESIGN 4.9): the engine's LoRA flags, and for
    // vLLM the switch that registers its load/unload routes (CapyCTL's own wins).
    if let Some(slots) = spec.adapters {
        capyctl_spec::engine_args::check_adapter_slots(
            spec.engine,
            slots.max_loaded,
            slots.max_rank,
        )
        .map_err(|why| AgentError::InvalidSpec {
            detail: format!("deployment {}: {why}", spec.name),
        })?;
        let flags =
            capyctl_spec::engine_args::adapter_flags(spec.engine, slots.max_loaded, slots.max_rank);
        if flags.is_empty() {
            return Err(AgentError::InvalidSpec {
                detail: format!(
                    "deployment {}: adapters: {} takes no LoRA adapters; remove adapters",
                    spec.name, spec.engine
                ),
            });
        }
        for (flag, value) in flags {
            args.push(flag.to_string());
            args.extend(value);
        }
        if spec.engine == EngineKind::Vllm {
            env.insert(
                capyctl_spec::engine_args::VLLM_RUNTIME_LORA_ENV.to_string(),
                "True".to_string(),
            );
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
