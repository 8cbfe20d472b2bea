//! `engine-sim`: a real program that speaks the HTTP APIs CapyCTL uses from vLLM, SGLang and
//! TensorFold, so CapyCTL can be tested end to end without a GPU.
//!
//! It answers deterministically (words picked by a sha2 hash of model, weights state, prompt
//! and token index, with log probabilities when asked, and a decision prompt's options while
//! the weights are intact), streams at a set token rate, runs at most its engine's number of requests
//! at once (the rest wait), aborts a request whose client went away, and simulates parking:
//! vLLM's sleep mode (levels 1 and 2, partial wakes, `reload_weights`) and SGLang's memory
//! saver (release/resume with or without a CPU backup, speculative decoding losing its draft
//! model), with times computed from the weights' size and the host-RAM and disk bandwidths,
//! and serves LoRA adapters loaded at run time as vLLM and SGLang do.
//! Faults can be injected at start (`ENGINE_SIM_FAULTS`) or later (`POST /sim/faults`), and
//! `GET /sim/state` tells a test everything. See `README.md` beside this crate for usage.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use capyctl_engine_sim::{SimConfig, serve};
//! let config = SimConfig::try_parse_from(["engine-sim", "serve", "Qwen3-4B", "--port", "0"])?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! serve(listener, config).await
//! # }
//! ```

mod adapters;
mod config;
mod control;
mod engine;
pub mod metrics;
mod openai;
mod state;
pub mod testing;
mod text;

use std::sync::Arc;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::serve::ListenerExt;

pub use config::{
    Fault, Flavour, PAUSED_HEALTH_TIMEOUT, SimConfig, parse_bytes, parse_duration, parse_faults,
};
pub use engine::{CRASH_EXIT_CODE, EngineSim, SimSnapshot};
pub use state::{AdapterSettings, Corruption, Counters, LoadedAdapter, Tag, WeightsState};
/// The answers' words, so that a client can check an answer (the soak does).
pub use text::{INTACT, Words};

/// Largest request body accepted.
const BODY_LIMIT: usize = 64 * 1024 * 1024;

/// The HTTP application of one simulated engine: the routes its flavour and flags provide.
///
/// vLLM's dev routes (`/sleep`, `/wake_up`, `/is_sleeping`, `/collective_rpc`,
/// `/reset_prefix_cache`) exist with `VLLM_SERVER_DEV_MODE=1`, as in vLLM 0.32.
/// SGLang's `/metrics` exists only with `--enable-metrics`. vLLM's LoRA routes exist with
/// `VLLM_ALLOW_RUNTIME_LORA_UPDATING`, SGLang's always (see `adapters`). Anything else answers
/// 404.
pub fn app(sim: Arc<EngineSim>) -> Router {
    let c = sim.config();
    let mut router = Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/embeddings", post(openai::embeddings))
        .route("/v1/models", get(openai::models))
        .route("/health", get(control::health))
        .route("/sim/state", get(control::sim_state))
        .route("/sim/faults", post(control::sim_faults));
    if adapters::routes_exist(c) {
        router = match c.flavour {
            Flavour::Vllm => router
                .route("/v1/load_lora_adapter", post(adapters::vllm_load))
                .route("/v1/unload_lora_adapter", post(adapters::vllm_unload)),
            Flavour::Sglang | Flavour::Tensorfold => router
                .route("/load_lora_adapter", post(adapters::sglang_load))
                .route("/unload_lora_adapter", post(adapters::sglang_unload)),
        };
    }
    match c.flavour {
        Flavour::Vllm => {
            router = router
                .route("/version", get(control::version))
                .route("/metrics", get(metrics::metrics));
            // vLLM 0.32 registers all its dev routes with VLLM_SERVER_DEV_MODE, with or without
            // --enable-sleep-mode.
            if c.vllm_dev_mode {
                router = router
                    .route("/collective_rpc", post(control::vllm_collective_rpc))
                    .route(
                        "/reset_prefix_cache",
                        post(control::vllm_reset_prefix_cache),
                    )
                    .route("/sleep", post(control::vllm_sleep))
                    .route("/wake_up", post(control::vllm_wake_up))
                    .route("/is_sleeping", get(control::vllm_is_sleeping));
            }
        }
        Flavour::Sglang => {
            if c.version_at_least(control::SGLANG_BODIES_SINCE) {
                router = router.route("/server_info", get(control::sglang_server_info));
            }
            router = router
                .route("/health_generate", get(control::health_generate))
                .route("/get_server_info", get(control::sglang_server_info))
                .route("/get_model_info", get(control::sglang_model_info))
                .route("/pause_generation", post(control::sglang_pause))
                .route("/continue_generation", post(control::sglang_continue))
                .route("/release_memory_occupation", post(control::sglang_release))
                .route("/resume_memory_occupation", post(control::sglang_resume))
                .route(
                    "/update_weights_from_disk",
                    post(control::sglang_update_weights),
                )
                .route(
                    "/flush_cache",
                    get(control::sglang_flush_cache).post(control::sglang_flush_cache),
                );
            if c.enable_metrics {
                router = router.route("/metrics", get(metrics::metrics));
            }
        }
        Flavour::Tensorfold => {
            router = router.route("/metrics", get(metrics::metrics));
        }
    }
    router
        .fallback(control::not_found)
        .method_not_allowed_fallback(control::method_not_allowed)
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(sim)
}

/// Serves one simulated engine on `listener` until the process ends. Accepted connections
/// get `TCP_NODELAY`. In vLLM's flavour the listener is closed during start-up
/// (`--sim-startup-delay`) and bound again at the same address when it ends, as vLLM refuses
/// connections until it is ready.
///
/// NB: the `crash` and `crash_on_wake` faults exit the whole process (status
/// [`CRASH_EXIT_CODE`]); in-process tests must not use them.
pub async fn serve(listener: tokio::net::TcpListener, config: SimConfig) -> anyhow::Result<()> {
    if config.faults.contains(&Fault::Crash) {
        engine::crash("fault crash set at start (ENGINE_SIM_FAULTS)");
    }
    tracing::info!(
        flavour = %config.flavour,
        model = %config.model,
        served_model_name = %config.served_model_name,
        max_running = config.max_running,
        unknown_args = ?config.unknown_args,
        "engine-sim serving"
    );
    let sim = EngineSim::new(config);
    let mut listener = listener;
    if sim.config().flavour == Flavour::Vllm && !sim.started() {
        // vLLM opens its HTTP port only once the engine is ready: during start-up a connection
        // is refused (recorded from vLLM 0.32.0), where SGLang answers /health 503. The port is
        // given back and taken again when start-up ends.
        let addr = listener.local_addr()?;
        drop(listener);
        sim.wait_started().await;
        listener = tokio::net::TcpListener::bind(addr).await?;
    }
    // Small SSE chunks go out at once, not after Nagle's delay (as the engines' servers do).
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!(error = %e, "cannot set TCP_NODELAY on an accepted connection");
        }
    });
    axum::serve(listener, app(sim)).await?;
    Ok(())
}
