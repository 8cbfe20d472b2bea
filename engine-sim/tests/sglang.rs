//! SGLang's memory saver over real sockets: release/resume with and without the CPU backup,
//! reloads from disk, speculative decoding losing its draft model, pause/continue, health,
//! server info, metrics.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{Sim, chat, start};
use hyper::StatusCode;
use serde_json::{Value, json};

const MODEL: &str = "/models/Qwen3-4B";
const PROMPT: &str = "name three rivers";

/// SGLang as CapyCTL launches it, 8 MiB of weights: 50 ms to or from host RAM.
fn sglang(extra: &[&'static str]) -> Vec<&'static str> {
    let mut args = vec![
        "--engine",
        "sglang",
        "--model-path",
        MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--served-model-name",
        "chat-b",
        "--enable-metrics",
        "--enable-memory-saver",
        "--sim-weights-bytes",
        "8MiB",
        "--sim-host-bandwidth",
        "160MiB",
        "--sim-disk-bandwidth",
        "80MiB",
    ];
    args.extend_from_slice(extra);
    args
}

async fn post_json_ok(sim: &Sim, path: &str, body: Value) -> String {
    let (status, answer) = sim.post(path, body).await;
    assert_eq!(status, StatusCode::OK, "POST {path}: {answer}");
    answer
}

#[tokio::test]
async fn release_and_resume_with_cpu_backup_keeps_answers() {
    let sim = start(&sglang(&["--enable-weights-cpu-backup"])).await;
    let before = sim.chat_text("chat-b", PROMPT).await;
    assert_eq!(sim.get("/health").await.0, StatusCode::OK);

    sim.post_ok("/pause_generation").await;
    let (status, body) = sim
        .post("/v1/chat/completions", chat("chat-b", PROMPT, false))
        .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(body.contains("paused"), "{body}");
    let began = Instant::now();
    post_json_ok(&sim, "/release_memory_occupation", json!({})).await;
    assert!(began.elapsed() >= Duration::from_millis(45));
    let s = sim.state().await;
    assert_eq!(s["weights"], "host_ram");
    assert_eq!(
        s["released_tags"],
        json!(["weights", "kv_cache", "cuda_graph"])
    );
    assert!(s["gpu_memory_bytes"].as_u64() < s["gpu_memory_awake_bytes"].as_u64());
    assert_eq!(
        sim.get("/health").await.0,
        StatusCode::SERVICE_UNAVAILABLE,
        "SGLang is unhealthy while released"
    );

    post_json_ok(&sim, "/resume_memory_occupation", json!({})).await;
    assert_eq!(
        sim.get("/health").await.0,
        StatusCode::SERVICE_UNAVAILABLE,
        "still paused"
    );
    sim.post_ok("/continue_generation").await;
    assert_eq!(sim.get("/health").await.0, StatusCode::OK);
    assert_eq!(sim.chat_text("chat-b", PROMPT).await, before);
    let s = sim.state().await;
    assert_eq!(
        (s["weights"].as_str(), s["refused_asleep"].as_u64()),
        (Some("intact"), Some(1))
    );
}

#[tokio::test]
async fn release_without_cpu_backup_needs_update_weights_from_disk() {
    let sim = start(&sglang(&[])).await;
    let before = sim.chat_text("chat-b", PROMPT).await;
    sim.post_ok("/pause_generation").await;
    post_json_ok(
        &sim,
        "/release_memory_occupation",
        json!({"tags": ["weights", "kv_cache"]}),
    )
    .await;
    assert_eq!(sim.state().await["weights"], "discarded");
    assert_eq!(sim.state().await["host_memory_bytes"], 0);
    post_json_ok(
        &sim,
        "/resume_memory_occupation",
        json!({"tags": ["weights", "kv_cache"]}),
    )
    .await;
    sim.post_ok("/continue_generation").await;
    assert_eq!(sim.state().await["weights"], "corrupted");
    assert_ne!(
        sim.chat_text("chat-b", PROMPT).await,
        before,
        "resumed without a reload: garbage"
    );

    let began = Instant::now();
    let answer = post_json_ok(
        &sim,
        "/update_weights_from_disk",
        json!({"model_path": MODEL}),
    )
    .await;
    assert!(
        began.elapsed() >= Duration::from_millis(90),
        "8 MiB at 80 MiB/s"
    );
    let v: Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(v["success"], true);
    post_json_ok(&sim, "/flush_cache", json!({})).await;
    assert_eq!(sim.chat_text("chat-b", PROMPT).await, before);
    assert_eq!(sim.state().await["weights"], "intact");
}

#[tokio::test]
async fn speculative_decoding_survives_kv_release_but_not_weight_release() {
    let sim = start(&sglang(&[
        "--enable-weights-cpu-backup",
        "--speculative-algorithm",
        "EAGLE",
    ]))
    .await;
    let before = sim.chat_text("chat-b", PROMPT).await;

    // CapyCTL's speculative park: only the KV cache.
    sim.post_ok("/pause_generation").await;
    post_json_ok(
        &sim,
        "/release_memory_occupation",
        json!({"tags": ["kv_cache"]}),
    )
    .await;
    let s = sim.state().await;
    assert_eq!(
        (s["weights"].as_str(), s["released_tags"].clone()),
        (Some("intact"), json!(["kv_cache"]))
    );
    post_json_ok(
        &sim,
        "/resume_memory_occupation",
        json!({"tags": ["kv_cache"]}),
    )
    .await;
    sim.post_ok("/continue_generation").await;
    assert_eq!(sim.chat_text("chat-b", PROMPT).await, before);

    // Releasing the weights loses the draft model, and a reload does not bring it back.
    post_json_ok(&sim, "/release_memory_occupation", json!({})).await;
    post_json_ok(&sim, "/resume_memory_occupation", json!({})).await;
    post_json_ok(
        &sim,
        "/update_weights_from_disk",
        json!({"model_path": MODEL}),
    )
    .await;
    let s = sim.state().await;
    assert_eq!(
        (s["weights"].as_str(), s["corruption"].as_str()),
        (Some("corrupted"), Some("speculative_draft"))
    );
    assert_ne!(sim.chat_text("chat-b", PROMPT).await, before);
}

#[tokio::test]
async fn memory_saver_is_required_and_reload_can_fail() {
    let plain = start(&["--model-path", MODEL, "--sim-weights-bytes", "1MiB"]).await;
    let (status, _) = plain.post("/release_memory_occupation", json!({})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(plain.state().await["weights"], "intact");
    assert_eq!(
        plain.get("/metrics").await.0,
        StatusCode::NOT_FOUND,
        "metrics need --enable-metrics"
    );
    let (status, _) = plain
        .post("/release_memory_occupation", json!({"tags": ["gpu"]}))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    let sim = start(&sglang(&["--sim-faults", "reload_fails"])).await;
    let (status, body) = sim
        .post("/update_weights_from_disk", json!({"model_path": MODEL}))
        .await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["success"], false);
    assert!(v["message"].as_str().unwrap().contains("reload"));
    let (status, _) = sim.post("/update_weights_from_disk", json!({})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn server_info_and_metrics() {
    let sim = start(&sglang(&[
        "--max-running-requests",
        "24",
        "--speculative-algorithm",
        "EAGLE",
        "--tp-size",
        "2",
    ]))
    .await;
    for path in ["/server_info", "/get_server_info"] {
        let (status, body) = sim.get(path).await;
        assert_eq!(status, StatusCode::OK);
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["max_running_requests"], 24);
        assert_eq!(v["version"], "0.5.9");
        assert_eq!(v["model_path"], MODEL);
        assert_eq!(v["speculative_algorithm"], "EAGLE");
    }
    assert_eq!(sim.state().await["unknown_args"], json!(["--tp-size", "2"]));
    let (status, metrics) = sim.get("/metrics").await;
    assert_eq!(status, StatusCode::OK);
    for name in [
        "sglang:num_running_reqs{model_name=\"chat-b\"} 0",
        "sglang:num_queue_reqs{model_name=\"chat-b\"} 0",
        "sglang:token_usage{model_name=\"chat-b\"} 0",
        "engine_sim_aborted_total{model_name=\"chat-b\"} 0",
    ] {
        assert!(metrics.contains(name), "{name} missing in {metrics}");
    }
    assert_eq!(
        sim.get("/version").await.0,
        StatusCode::NOT_FOUND,
        "vLLM-only endpoint"
    );
    assert_eq!(
        sim.post_empty("/sleep?level=1").await.0,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn fault_paused_health_hangs_until_it_serves_again() {
    let sim = start(&sglang(&[
        "--enable-weights-cpu-backup",
        "--sim-faults",
        "paused_health_hangs",
    ]))
    .await;
    assert_eq!(sim.get("/health").await.0, StatusCode::OK);
    sim.post_ok("/pause_generation").await;
    post_json_ok(&sim, "/release_memory_occupation", json!({})).await;
    // Like the real server's, the health check waits for a token instead of answering.
    let health = sim.get("/health");
    tokio::pin!(health);
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut health)
            .await
            .is_err(),
        "a paused SGLang answered /health at once"
    );
    // Non-generating endpoints still answer.
    assert_eq!(sim.get("/server_info").await.0, StatusCode::OK);
    post_json_ok(&sim, "/resume_memory_occupation", json!({})).await;
    sim.post_ok("/continue_generation").await;
    // The waiting check gets its token now.
    let (status, _) = tokio::time::timeout(Duration::from_secs(5), health)
        .await
        .expect("the health check did not answer once the engine served again");
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn faults_sleep_ignored_and_wake_ignored_claim_success() {
    let sim = start(&sglang(&["--enable-weights-cpu-backup"])).await;
    set_faults(&sim, json!({"set": ["sleep_ignored"]})).await;
    sim.post_ok("/pause_generation").await;
    post_json_ok(&sim, "/release_memory_occupation", json!({})).await;
    let s = sim.state().await;
    assert_eq!(
        (s["weights"].as_str(), s["paused"].as_bool()),
        (Some("intact"), Some(false))
    );
    assert_eq!(sim.get("/health").await.0, StatusCode::OK, "still serving");

    set_faults(
        &sim,
        json!({"set": ["wake_ignored"], "clear": ["sleep_ignored"]}),
    )
    .await;
    sim.post_ok("/pause_generation").await;
    post_json_ok(&sim, "/release_memory_occupation", json!({})).await;
    post_json_ok(&sim, "/resume_memory_occupation", json!({})).await;
    sim.post_ok("/continue_generation").await;
    let s = sim.state().await;
    assert_eq!(
        (s["weights"].as_str(), s["paused"].as_bool()),
        (Some("host_ram"), Some(true))
    );
    assert_eq!(sim.get("/health").await.0, StatusCode::SERVICE_UNAVAILABLE);
}

async fn set_faults(sim: &Sim, change: Value) {
    let (status, body) = sim.post("/sim/faults", change).await;
    assert_eq!(status, StatusCode::OK, "{body}");
}
