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

    sim.pause().await;
    // Held while paused (SGLang's tokenizer waits for continue_generation), answered after.
    let url = sim.url("/v1/chat/completions");
    let held = tokio::spawn(async move {
        common::call(
            hyper::Method::POST,
            &url,
            Some(chat("chat-b", PROMPT, false)),
        )
        .await
    });
    sim.wait_state("held", |s| s["held_asleep"] == 1).await;
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
    assert!(!held.is_finished(), "answered while paused");
    sim.resume_generation().await;
    let (status, body) = held.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["choices"][0]["message"]["content"], before.as_str());
    assert_eq!(sim.get("/health").await.0, StatusCode::OK);
    assert_eq!(sim.chat_text("chat-b", PROMPT).await, before);
    let s = sim.state().await;
    assert_eq!(
        (
            s["weights"].as_str(),
            s["held_asleep"].as_u64(),
            s["refused_asleep"].as_u64()
        ),
        (Some("intact"), Some(1), Some(0))
    );
}

#[tokio::test]
async fn release_without_cpu_backup_needs_update_weights_from_disk() {
    let sim = start(&sglang(&[])).await;
    let before = sim.chat_text("chat-b", PROMPT).await;
    sim.pause().await;
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
    sim.resume_generation().await;
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
    sim.pause().await;
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
    sim.resume_generation().await;
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
        assert_eq!(v["version"], "0.5.23");
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
    sim.pause().await;
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
    sim.resume_generation().await;
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
    sim.pause().await;
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
    sim.pause().await;
    post_json_ok(&sim, "/release_memory_occupation", json!({})).await;
    post_json_ok(&sim, "/resume_memory_occupation", json!({})).await;
    sim.resume_generation().await;
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

/// SGLang 0.5.6 and later refuse a body-less `/pause_generation` and `/continue_generation`
/// with FastAPI's 400, as the real server does; older releases take one without a body.
#[tokio::test]
async fn pause_and_continue_need_a_body_from_0_5_6() {
    let sim = start(&sglang(&[])).await;
    for path in ["/pause_generation", "/continue_generation"] {
        let (status, body) = sim.post_empty(path).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "POST {path}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            (v["object"].as_str(), v["code"].as_u64(), v["type"].as_str()),
            (Some("error"), Some(400), Some("Bad Request")),
            "{body}"
        );
        assert!(v["message"].as_str().unwrap().contains("Field required"));
    }
    assert_eq!(
        sim.state().await["paused"],
        false,
        "a refused pause changes nothing"
    );
    let (status, body) = sim
        .post("/pause_generation", json!({"mode": "later"}))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let answer = post_json_ok(&sim, "/pause_generation", json!({"mode": "abort"})).await;
    assert_eq!(
        serde_json::from_str::<Value>(&answer).unwrap()["status"],
        "ok"
    );
    assert_eq!(sim.state().await["paused"], true);
    post_json_ok(&sim, "/continue_generation", json!({})).await;
    assert_eq!(sim.state().await["paused"], false);
    assert_eq!(sim.get("/server_info").await.0, StatusCode::OK);

    // The memory calls require their body in every release read (0.5.3 to 0.5.23).
    for path in ["/release_memory_occupation", "/resume_memory_occupation"] {
        let (status, body) = sim.post_empty(path).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "POST {path}: {body}");
        assert!(body.contains("Field required"), "{body}");
    }

    let old = start(&sglang(&["--sim-version", "0.5.5"])).await;
    old.post_ok("/pause_generation").await;
    assert_eq!(old.state().await["paused"], true);
    old.post_ok("/continue_generation").await;
    assert_eq!(old.state().await["paused"], false);
    assert_eq!(
        old.get("/server_info").await.0,
        StatusCode::NOT_FOUND,
        "/server_info came in 0.5.6"
    );
    assert_eq!(old.get("/get_server_info").await.0, StatusCode::OK);
}

/// With `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION` off (0.5.6 and later), `/health` answers 200
/// without generating, paused or not; `/health_generate` still generates.
#[tokio::test]
async fn health_without_generation_answers_while_paused() {
    let sim = start(&sglang(&["--sim-sglang-health-endpoint-generation", "0"])).await;
    sim.pause().await;
    assert_eq!(sim.get("/health").await.0, StatusCode::OK);
    assert_eq!(
        sim.get("/health_generate").await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    sim.resume_generation().await;
    assert_eq!(sim.get("/health_generate").await.0, StatusCode::OK);

    let old = start(&sglang(&[
        "--sim-sglang-health-endpoint-generation",
        "0",
        "--sim-version",
        "0.5.5",
    ]))
    .await;
    old.post_ok("/pause_generation").await;
    assert_eq!(
        old.get("/health").await.0,
        StatusCode::SERVICE_UNAVAILABLE,
        "0.5.5 has no such switch: its /health generates"
    );
}

/// Without `--max-running-requests`, `/server_info` has it as `null` at top level (every
/// server argument is there, set or not); 0.5.9 and later say the figure SGLang sized itself
/// to in `internal_states[0].effective_max_running_requests_per_dp`.
#[tokio::test]
async fn server_info_without_max_running_requests() {
    let sim = start(&sglang(&[])).await;
    let (_, body) = sim.get("/server_info").await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(v["max_running_requests"].is_null(), "{body}");
    assert!(v["internal_states"][0]["max_running_requests"].is_null());
    assert_eq!(
        v["internal_states"][0]["effective_max_running_requests_per_dp"],
        128
    );
    let old = start(&sglang(&["--sim-version", "0.5.6"])).await;
    let (_, body) = old.get("/server_info").await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(v["max_running_requests"].is_null());
    assert!(
        v["internal_states"][0]
            .get("effective_max_running_requests_per_dp")
            .is_none(),
        "{body}"
    );
}
