//! The real `engine-sim` binary, launched as CapyCTL launches engines: `--port 0`, the
//! listening line, knobs from the environment, full sleep/wake cycles, crashes.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use capyctl_engine_sim::CRASH_EXIT_CODE;
use common::{Sim, spawn_binary};
use hyper::StatusCode;
use serde_json::{Value, json};

/// Knobs as a deployment document's `env:` would set them.
const ENV: &[(&str, &str)] = &[
    ("ENGINE_SIM_WEIGHTS_BYTES", "8MiB"),
    ("ENGINE_SIM_HOST_BANDWIDTH", "160MiB"),
    ("ENGINE_SIM_DISK_BANDWIDTH", "80MiB"),
    ("ENGINE_SIM_VERSION", "0.31.1-sim"),
];

fn vllm_args(model: &str) -> Vec<&str> {
    vec![
        "--engine",
        "vllm",
        "serve",
        model,
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
    ]
}

async fn exit_code(sim: &mut Sim) -> Option<i32> {
    let status = tokio::time::timeout(Duration::from_secs(10), sim.child().wait())
        .await
        .expect("the process did not exit")
        .unwrap();
    status.code()
}

/// SIGTERM ends the simulator with exit code 0: handled, as the engines' servers handle it, not
/// left to the default action (in an engine Pod the simulator is PID 1, for which an unhandled
/// SIGTERM is ignored: every stop of an engine Pod waited out its grace period).
#[tokio::test]
async fn sigterm_ends_the_simulator_cleanly() {
    let mut sim = spawn_binary(&vllm_args("Qwen3-4B"), ENV).await;
    assert_eq!(sim.get("/health").await.0, StatusCode::OK);
    let pid = sim.child().id().unwrap().to_string();
    let kill = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(kill.success());
    assert_eq!(exit_code(&mut sim).await, Some(0));
}

#[tokio::test]
async fn vllm_binary_full_sleep_wake_cycles() {
    let env = [ENV, &[("VLLM_SERVER_DEV_MODE", "1")]].concat();
    let sim = spawn_binary(&vllm_args("Qwen3-4B"), &env).await;
    assert_eq!(sim.get("/health").await.0, StatusCode::OK);
    let s = sim.state().await;
    assert_eq!(s["flavour"], "vllm");
    assert_eq!(s["version"], "0.31.1-sim");
    assert_eq!(s["weights_bytes"], 8 << 20);
    assert_eq!(s["max_running"], 8);
    assert_eq!(s["unknown_args"], json!(["--max-model-len", "8192"]));
    let before = sim.chat_text("chat-a", "hello").await;

    // Host-RAM park and wake.
    sim.post_ok("/sleep?level=1").await;
    assert_eq!(sim.get("/is_sleeping").await.1, r#"{"is_sleeping":true}"#);
    // A request while asleep waits for the wake, as vLLM's does.
    let url = sim.url("/v1/chat/completions");
    let held = tokio::spawn(async move {
        common::call(
            hyper::Method::POST,
            &url,
            Some(common::chat("chat-a", "hello", false)),
        )
        .await
    });
    sim.wait_state("held", |s| s["held_asleep"] == 1).await;
    sim.post_ok("/wake_up").await;
    assert_eq!(held.await.unwrap().0, StatusCode::OK);
    assert_eq!(sim.get("/is_sleeping").await.1, r#"{"is_sleeping":false}"#);
    assert_eq!(sim.chat_text("chat-a", "hello").await, before);

    // Deep park and wake.
    sim.post_ok("/sleep?level=2").await;
    sim.post_ok("/wake_up?tags=weights").await;
    let (status, _) = sim
        .post("/collective_rpc", json!({"method": "reload_weights"}))
        .await;
    assert_eq!(status, StatusCode::OK);
    sim.post_ok("/wake_up?tags=kv_cache").await;
    sim.post_ok("/reset_prefix_cache").await;
    assert_eq!(sim.chat_text("chat-a", "hello").await, before);
    let s = sim.state().await;
    assert_eq!(
        (
            s["sleeps"].as_u64(),
            s["wakes"].as_u64(),
            s["reloads"].as_u64()
        ),
        (Some(2), Some(3), Some(1))
    );
}

#[tokio::test]
async fn sglang_binary_full_release_resume_cycle() {
    let args = [
        "--model-path",
        "/models/Qwen3-4B",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--served-model-name",
        "chat-b",
        "--enable-metrics",
        "--enable-memory-saver",
        "--enable-weights-cpu-backup",
        "--max-running-requests",
        "16",
    ];
    let sim = spawn_binary(&args, ENV).await;
    let (_, info) = sim.get("/server_info").await;
    let info: Value = serde_json::from_str(&info).unwrap();
    assert_eq!(info["max_running_requests"], 16);
    let before = sim.chat_text("chat-b", "hello").await;
    sim.pause().await;
    assert_eq!(
        sim.post("/release_memory_occupation", json!({})).await.0,
        StatusCode::OK
    );
    assert_eq!(sim.get("/health").await.0, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(sim.state().await["weights"], "host_ram");
    assert_eq!(
        sim.post("/resume_memory_occupation", json!({})).await.0,
        StatusCode::OK
    );
    sim.resume_generation().await;
    assert_eq!(sim.get("/health").await.0, StatusCode::OK);
    assert_eq!(sim.chat_text("chat-b", "hello").await, before);
    let (_, metrics) = sim.get("/metrics").await;
    assert!(metrics.contains("sglang:num_running_reqs{model_name=\"chat-b\"} 0"));
}

#[tokio::test]
async fn fault_crash_exits_at_once() {
    let env = [ENV, &[("VLLM_SERVER_DEV_MODE", "1")]].concat();
    let mut sim = spawn_binary(&vllm_args("m"), &env).await;
    let url = sim.url("/sim/faults");
    let answer = tokio::spawn(async move {
        common::call(hyper::Method::POST, &url, Some(json!({"set": ["crash"]}))).await
    });
    assert_eq!(exit_code(&mut sim).await, Some(CRASH_EXIT_CODE));
    assert!(answer.await.is_err(), "the request dies with the process");
}

#[tokio::test]
async fn fault_crash_on_wake_exits_during_the_wake() {
    let env = [
        ENV,
        &[
            ("VLLM_SERVER_DEV_MODE", "1"),
            ("ENGINE_SIM_FAULTS", "crash_on_wake"),
        ],
    ]
    .concat();
    let mut sim = spawn_binary(&vllm_args("m"), &env).await;
    assert_eq!(sim.state().await["faults"], json!(["crash_on_wake"]));
    sim.post_ok("/sleep?level=1").await;
    let url = sim.url("/wake_up");
    let wake = tokio::spawn(async move { common::call(hyper::Method::POST, &url, None).await });
    assert_eq!(exit_code(&mut sim).await, Some(CRASH_EXIT_CODE));
    assert!(wake.await.is_err(), "the wake never answers");
}

#[tokio::test]
async fn fault_crash_at_start_and_bad_arguments() {
    let env = [ENV, &[("ENGINE_SIM_FAULTS", "crash")]].concat();
    let mut sim = spawn_binary(&vllm_args("m"), &env).await;
    assert_eq!(exit_code(&mut sim).await, Some(CRASH_EXIT_CODE));

    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_engine-sim"))
        .args(["--engine", "sglang", "--port", "0"])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--model-path"));
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_engine-sim"))
        .args(["serve", "m", "--port", "0"])
        .env("ENGINE_SIM_WEIGHTS_BYTES", "heavy")
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("heavy"));
}

/// A `--max-lora-rank` outside vLLM's choices ends the vLLM simulator at start as vLLM's
/// argument parser does: status 2, its usage and error line on stderr.
#[tokio::test]
async fn vllm_refuses_a_lora_rank_outside_its_choices() {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_engine-sim"))
        .args([
            "serve",
            "m",
            "--port",
            "0",
            "--enable-lora",
            "--max-lora-rank",
            "24",
        ])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).lines().last(),
        Some(
            "vllm serve: error: argument --max-lora-rank: invalid choice: 24 (choose from 1, 8, \
             16, 32, 64, 128, 256, 320, 512)"
        )
    );
}
