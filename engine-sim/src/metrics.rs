//! `/metrics` in each engine's own Prometheus names, labelled `model_name`.
//!
//! | engine     | running                        | waiting                         | KV use (0..1)                      |
//! |------------|--------------------------------|---------------------------------|------------------------------------|
//! | vLLM       | `vllm:num_requests_running`    | `vllm:num_requests_waiting`     | `vllm:kv_cache_usage_perc`         |
//! | SGLang     | `sglang:num_running_reqs`      | `sglang:num_queue_reqs`         | `sglang:token_usage`               |
//! | TensorFold | `tensorfold_requests_running`  | `tensorfold_requests_waiting`   | `tensorfold_kv_cache_usage_ratio`  |
//!
//! Every engine also exports the simulator's own `engine_sim_*` series (see [`render`]).
//! SGLang serves `/metrics` only with `--enable-metrics`.

use std::fmt::Write;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::config::Flavour;
use crate::engine::{EngineSim, SimSnapshot};

/// The engine's names for (running, waiting, KV use) gauges.
pub fn engine_metric_names(flavour: Flavour) -> [&'static str; 3] {
    match flavour {
        Flavour::Vllm => [
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
        ],
        Flavour::Sglang => [
            "sglang:num_running_reqs",
            "sglang:num_queue_reqs",
            "sglang:token_usage",
        ],
        Flavour::Tensorfold => [
            "tensorfold_requests_running",
            "tensorfold_requests_waiting",
            "tensorfold_kv_cache_usage_ratio",
        ],
    }
}

fn escape(label: &str) -> String {
    label
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The Prometheus text for one snapshot.
pub fn render(s: &SimSnapshot) -> String {
    let label = format!("{{model_name=\"{}\"}}", escape(&s.served_model_name));
    // vLLM labels its series with the engine (data-parallel rank) too.
    let engine_label = match s.flavour {
        Flavour::Vllm => format!(
            "{{engine=\"0\",model_name=\"{}\"}}",
            escape(&s.served_model_name)
        ),
        Flavour::Sglang | Flavour::Tensorfold => label.clone(),
    };
    let [running, waiting, kv] = engine_metric_names(s.flavour);
    let c = &s.counters;
    let series: [(&str, &str, &str, String); 17] = [
        (
            running,
            "gauge",
            "Requests running now.",
            c.running.to_string(),
        ),
        (
            waiting,
            "gauge",
            "Requests waiting for a running slot.",
            c.waiting.to_string(),
        ),
        (
            kv,
            "gauge",
            "KV-cache usage, 0 to 1.",
            s.kv_cache_usage.to_string(),
        ),
        (
            "engine_sim_completed_total",
            "counter",
            "Requests answered to the end.",
            c.completed.to_string(),
        ),
        (
            "engine_sim_aborted_total",
            "counter",
            "Requests whose client went away.",
            c.aborted.to_string(),
        ),
        (
            "engine_sim_refused_asleep_total",
            "counter",
            "Requests refused while asleep, released or paused.",
            c.refused_asleep.to_string(),
        ),
        (
            "engine_sim_held_asleep_total",
            "counter",
            "Requests that waited while the engine was asleep, released or paused.",
            c.held_asleep.to_string(),
        ),
        (
            "engine_sim_interrupted_total",
            "counter",
            "Requests cut off by a sleep or pause.",
            c.interrupted.to_string(),
        ),
        (
            "engine_sim_sleeps_total",
            "counter",
            "Sleep or release calls.",
            c.sleeps.to_string(),
        ),
        (
            "engine_sim_wakes_total",
            "counter",
            "Wake or resume calls.",
            c.wakes.to_string(),
        ),
        (
            "engine_sim_reloads_total",
            "counter",
            "Weight reloads from disk.",
            c.reloads.to_string(),
        ),
        (
            "engine_sim_reload_failures_total",
            "counter",
            "Failed weight reloads.",
            c.reload_failures.to_string(),
        ),
        (
            "engine_sim_asleep",
            "gauge",
            "1 while anything is released.",
            u8::from(s.asleep).to_string(),
        ),
        (
            "engine_sim_gpu_memory_bytes",
            "gauge",
            "GPU memory held now.",
            s.gpu_memory_bytes.to_string(),
        ),
        (
            "engine_sim_host_memory_bytes",
            "gauge",
            "Host RAM holding a copy of the weights.",
            s.host_memory_bytes.to_string(),
        ),
        (
            "engine_sim_max_running",
            "gauge",
            "Requests the engine runs at once.",
            s.max_running.to_string(),
        ),
        (
            "engine_sim_weights_intact",
            "gauge",
            "1 while the weights are on the GPU and right.",
            u8::from(s.weights == crate::state::WeightsState::Intact).to_string(),
        ),
    ];
    let mut out = String::new();
    for (name, kind, help, value) in series {
        let label = if [running, waiting, kv].contains(&name) {
            &engine_label
        } else {
            &label
        };
        // Writing to a String cannot fail.
        let _ = write!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{label} {value}\n"
        );
    }
    out
}

/// `GET /metrics`.
pub(crate) async fn metrics(State(sim): State<Arc<EngineSim>>) -> Response {
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "text/plain; version=1.0.0; charset=utf-8",
        )],
        render(&sim.snapshot()),
    )
        .into_response()
}
