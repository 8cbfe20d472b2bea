//! How many requests an engine runs at once (`max_running` of the load read), as a pure
//! function, and CapyCTL's defaults, which the node agent's launch command passes
//! (`capyctl_node_agent::launch::launch_command`).
//!
//! Which figure the engine runs with, when several places set it (one rule for the launch and
//! for [`max_running`]): the deployment's `extra_args`, then its `max_concurrent_requests`,
//! then the host's command (`host.engines.<kind>.command`), then the defaults. The engines take
//! the last occurrence of a flag, and the arguments are in that order: the host's command
//! first, CapyCTL's own (`max_concurrent_requests`) after it, `extra_args` last. (The
//! deployment's two places together are refused: say which one you mean.)

use capyctl_interfaces::launch::{MaxRunning, MaxRunningSource};
use capyctl_spec::EngineKind;
use capyctl_spec::documents::max_running_flag;
use capyctl_spec::engine_args::{flag_value, has_flag};

/// CapyCTL's default of requests vLLM runs at once (the router's in-flight bound).
pub const VLLM_DEFAULT_MAX_RUNNING: u32 = 32;
/// TensorFold's own default of requests run at once.
pub const TENSORFOLD_DEFAULT_MAX_RUNNING: u32 = 8;

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
    /// ([`ModelFacts::hybrid_state`](crate::capability::ModelFacts::hybrid_state)); false when
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
