//! vLLM sleep mode over real sockets: level 1 and level 2 cycles, partial wakes, reloads,
//! refusing while asleep, the dev-mode gate, and every fault.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{OpenStream, Sim, chat, sse_events, start};
use hyper::StatusCode;
use serde_json::{Value, json};

/// 8 MiB of weights: 50 ms to or from host RAM, 200 ms from disk.
const VLLM: &[&str] = &[
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
    "--sim-vllm-dev-mode",
    "1",
    "--sim-weights-bytes",
    "8MiB",
    "--sim-gpu-memory-bytes",
    "20MiB",
    "--sim-sleep-residue-bytes",
    "1MiB",
    "--sim-host-bandwidth",
    "160MiB",
    "--sim-disk-bandwidth",
    "40MiB",
];
const HOST_COPY: Duration = Duration::from_millis(50);
const DISK_RELOAD: Duration = Duration::from_millis(200);
const PROMPT: &str = "what is the capital of capybara land";

async fn timed_post(sim: &Sim, path: &str) -> Duration {
    let began = Instant::now();
    sim.post_ok(path).await;
    began.elapsed()
}

async fn is_sleeping(sim: &Sim) -> bool {
    let (status, body) = sim.get("/is_sleeping").await;
    assert_eq!(status, StatusCode::OK);
    serde_json::from_str::<Value>(&body).unwrap()["is_sleeping"]
        .as_bool()
        .unwrap()
}

async fn set_faults(sim: &Sim, change: Value) -> Value {
    let (status, body) = sim.post("/sim/faults", change).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    serde_json::from_str(&body).unwrap()
}

#[tokio::test]
async fn level1_cycle_keeps_answers_and_holds_requests_while_asleep() {
    let sim = start(VLLM).await;
    let before = sim.chat_text("chat-a", PROMPT).await;
    let awake = sim.state().await;
    assert_eq!(awake["gpu_memory_bytes"], 20 << 20);

    let took = timed_post(&sim, "/sleep?level=1").await;
    assert!(
        took >= HOST_COPY.mul_f64(0.9),
        "level 1 sleep took {took:?}"
    );
    assert!(is_sleeping(&sim).await);
    let s = sim.state().await;
    assert_eq!(s["weights"], "host_ram");
    assert_eq!(s["sleep_level"], 1);
    assert_eq!(
        s["gpu_memory_bytes"],
        1 << 20,
        "only the residue stays on the GPU"
    );
    assert_eq!(s["host_memory_bytes"], 8 << 20);
    assert_eq!(s["released_tags"], json!(["weights", "kv_cache"]));
    assert_eq!(
        sim.get("/health").await.0,
        StatusCode::OK,
        "vLLM is healthy while asleep"
    );

    // Held until the wake, streamed or not, as vLLM 0.32 holds them (its scheduler is paused),
    // and counted loudly.
    let held: Vec<_> = [
        ("/v1/chat/completions", chat("chat-a", PROMPT, false)),
        ("/v1/chat/completions", chat("chat-a", PROMPT, true)),
        ("/v1/embeddings", json!({"input": "x"})),
    ]
    .into_iter()
    .map(|(path, body)| {
        let url = sim.url(path);
        tokio::spawn(async move { common::call(hyper::Method::POST, &url, Some(body)).await })
    })
    .collect();
    sim.wait_state("three held", |s| s["held_asleep"] == 3)
        .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        held.iter().all(|h| !h.is_finished()),
        "answered while asleep"
    );
    let (_, metrics) = sim.get("/metrics").await;
    assert!(
        metrics.contains("engine_sim_held_asleep_total{model_name=\"chat-a\"} 3"),
        "{metrics}"
    );

    let took = timed_post(&sim, "/wake_up").await;
    assert!(took >= HOST_COPY.mul_f64(0.9), "wake took {took:?}");
    assert!(!is_sleeping(&sim).await);
    let mut answers = Vec::new();
    for h in held {
        let (status, body) = h.await.unwrap();
        assert_eq!(status, StatusCode::OK, "{body}");
        answers.push(body);
    }
    let first: Value = serde_json::from_str(&answers[0]).unwrap();
    assert_eq!(first["choices"][0]["message"]["content"], before.as_str());
    assert_eq!(sim.chat_text("chat-a", PROMPT).await, before);
    let s = sim.state().await;
    assert_eq!(s["weights"], "intact");
    assert_eq!(s["gpu_memory_bytes"], 20 << 20);
    assert_eq!(
        (
            s["sleeps"].as_u64(),
            s["wakes"].as_u64(),
            s["held_asleep"].as_u64(),
            s["refused_asleep"].as_u64()
        ),
        (Some(1), Some(1), Some(3), Some(0))
    );
}

#[tokio::test]
async fn level2_cycle_with_reload_keeps_answers() {
    let sim = start(VLLM).await;
    let before = sim.chat_text("chat-a", PROMPT).await;
    sim.post_ok("/sleep?level=2").await;
    let s = sim.state().await;
    assert_eq!(s["weights"], "discarded");
    assert_eq!(s["host_memory_bytes"], 0);

    // CapyCTL's deep wake: weights, reload, kv cache, prefix cache.
    sim.post_ok("/wake_up?tags=weights").await;
    assert!(is_sleeping(&sim).await, "kv_cache is still asleep");
    assert_eq!(sim.state().await["released_tags"], json!(["kv_cache"]));
    let began = Instant::now();
    let (status, body) = sim
        .post("/collective_rpc", json!({"method": "reload_weights"}))
        .await;
    let took = began.elapsed();
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(took >= DISK_RELOAD.mul_f64(0.9), "reload took {took:?}");
    sim.post_ok("/wake_up?tags=kv_cache").await;
    sim.post_ok("/reset_prefix_cache").await;
    assert!(!is_sleeping(&sim).await);
    assert_eq!(sim.chat_text("chat-a", PROMPT).await, before);
    let s = sim.state().await;
    assert_eq!(s["weights"], "intact");
    assert_eq!(
        (s["reloads"].as_u64(), s["cache_resets"].as_u64()),
        (Some(1), Some(1))
    );
}

#[tokio::test]
async fn level2_woken_without_reload_answers_garbage_until_reloaded() {
    let sim = start(VLLM).await;
    let before = sim.chat_text("chat-a", PROMPT).await;
    sim.post_ok("/sleep?level=2").await;
    // A reload while the weights are asleep is refused.
    let (status, _) = sim
        .post("/collective_rpc", json!({"method": "reload_weights"}))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    sim.post_ok("/wake_up").await;
    assert!(!is_sleeping(&sim).await);
    assert_eq!(sim.state().await["weights"], "corrupted");
    assert_ne!(
        sim.chat_text("chat-a", PROMPT).await,
        before,
        "garbage weights, other words"
    );
    let (status, _) = sim
        .post("/collective_rpc", json!({"method": "reload_weights"}))
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(sim.chat_text("chat-a", PROMPT).await, before);
}

#[tokio::test]
async fn sleep_endpoints_need_dev_mode() {
    let no_dev = start(&["serve", "m", "--enable-sleep-mode"]).await;
    let no_sleep = start(&[
        "serve",
        "m",
        "--sim-vllm-dev-mode",
        "1",
        "--sim-weights-bytes",
        "1MiB",
    ])
    .await;
    for path in ["/sleep?level=1", "/wake_up"] {
        assert_eq!(
            no_dev.post_empty(path).await.0,
            StatusCode::NOT_FOUND,
            "{path}"
        );
    }
    assert_eq!(no_dev.get("/is_sleeping").await.0, StatusCode::NOT_FOUND);
    // vLLM 0.32 registers them with the dev mode alone (its CPU build refuses
    // --enable-sleep-mode and still answers them).
    assert_eq!(no_sleep.get("/is_sleeping").await.0, StatusCode::OK);
    assert_eq!(
        no_dev
            .post("/collective_rpc", json!({"method": "reload_weights"}))
            .await
            .0,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        no_sleep
            .post("/collective_rpc", json!({"method": "reload_weights"}))
            .await
            .0,
        StatusCode::OK
    );
    let sim = start(VLLM).await;
    assert_eq!(
        sim.post_empty("/sleep?level=3").await.0,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        sim.post_empty("/wake_up?tags=everything").await.0,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        sim.post("/collective_rpc", json!({"method": "explode"}))
            .await
            .0,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(sim.state().await["sleeps"], 0);
}

#[tokio::test]
async fn sleeping_under_a_running_stream_interrupts_it() {
    let sim = start(&[VLLM, &["--sim-token-rate", "50"]].concat()).await;
    let mut req = chat("chat-a", PROMPT, true);
    req["max_tokens"] = json!(1000);
    let mut stream = OpenStream::open(sim.addr, "/v1/chat/completions", req).await;
    assert!(stream.next_event().await.is_some());
    sim.post_ok("/sleep?level=1").await;
    let mut last = String::new();
    while let Some(e) = stream.next_event().await {
        if e != "[DONE]" {
            last = e;
        }
    }
    let error: Value = serde_json::from_str(&last).unwrap();
    assert_eq!(error["error"]["code"], 503, "{last}");
    let s = sim.state().await;
    assert_eq!(
        (s["interrupted"].as_u64(), s["running"].as_u64()),
        (Some(1), Some(0))
    );
}

#[tokio::test]
async fn fault_wake_mismatch_changes_answers_after_the_next_wake() {
    let sim = start(VLLM).await;
    let before = sim.chat_text("chat-a", PROMPT).await;
    let faults = set_faults(&sim, json!({"set": ["wake_mismatch"]})).await;
    assert_eq!(faults["faults"], json!(["wake_mismatch"]));
    assert_eq!(
        sim.chat_text("chat-a", PROMPT).await,
        before,
        "only after a wake"
    );
    sim.post_ok("/sleep?level=1").await;
    sim.post_ok("/wake_up").await;
    assert_ne!(sim.chat_text("chat-a", PROMPT).await, before);
    let s = sim.state().await;
    assert_eq!(s["weights"], "corrupted");
    assert_eq!(s["corruption"], "wake_mismatch");
    assert_eq!(s["faults"], json!([]), "one-shot");
    // A reload does not repair it.
    sim.post("/collective_rpc", json!({"method": "reload_weights"}))
        .await;
    assert_ne!(sim.chat_text("chat-a", PROMPT).await, before);
}

#[tokio::test]
async fn fault_reload_fails() {
    let sim = start(&[VLLM, &["--sim-faults", "reload_fails"]].concat()).await;
    sim.post_ok("/sleep?level=2").await;
    sim.post_ok("/wake_up?tags=weights").await;
    let (status, body) = sim
        .post("/collective_rpc", json!({"method": "reload_weights"}))
        .await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(
        v["error"]["message"].as_str().unwrap().contains("reload"),
        "{body}"
    );
    let s = sim.state().await;
    assert_eq!(
        (s["reload_failures"].as_u64(), s["weights"].as_str()),
        (Some(1), Some("corrupted"))
    );
    set_faults(&sim, json!({"clear": ["reload_fails"]})).await;
    let (status, _) = sim
        .post("/collective_rpc", json!({"method": "reload_weights"}))
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(sim.state().await["weights"], "intact");
}

#[tokio::test]
async fn fault_wake_hangs_holds_the_connection() {
    let sim = start(VLLM).await;
    sim.post_ok("/sleep?level=1").await;
    set_faults(&sim, json!({"set": ["wake_hangs"]})).await;
    let hung = tokio::time::timeout(Duration::from_millis(300), sim.post_empty("/wake_up")).await;
    assert!(hung.is_err(), "the wake answered: {hung:?}");
    assert!(is_sleeping(&sim).await);
    set_faults(&sim, json!({"clear_all": true})).await;
    sim.post_ok("/wake_up").await;
    assert!(!is_sleeping(&sim).await);
}

#[tokio::test]
async fn faults_sleep_ignored_and_wake_ignored_claim_success() {
    let sim = start(VLLM).await;
    set_faults(&sim, json!({"set": ["sleep_ignored"]})).await;
    sim.post_ok("/sleep?level=1").await;
    assert!(!is_sleeping(&sim).await, "the sleep was ignored");
    assert_eq!(sim.state().await["weights"], "intact");
    set_faults(
        &sim,
        json!({"set": ["wake_ignored"], "clear": ["sleep_ignored"]}),
    )
    .await;
    sim.post_ok("/sleep?level=1").await;
    // It claims success (200) but, as vLLM 0.32's answer does, says it is still sleeping: the
    // driver reads that instead of asking `/is_sleeping` after a wake.
    let (status, body) = sim.post_empty("/wake_up").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["status"],
        "sleeping",
        "{body}"
    );
    assert!(is_sleeping(&sim).await, "the wake was ignored");
    assert_eq!(sim.state().await["weights"], "host_ram");
    set_faults(&sim, json!({"clear": ["wake_ignored"]})).await;
    let (_, body) = sim.post_empty("/wake_up").await;
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["status"],
        "awake",
        "{body}"
    );
}

#[tokio::test]
async fn fault_oversized_chunks_and_role_chunk() {
    let sim = start(VLLM).await;
    set_faults(&sim, json!({"set": ["oversized_chunks", "role_chunk"]})).await;
    let (status, body) = sim
        .post("/v1/chat/completions", chat("chat-a", PROMPT, true))
        .await;
    assert_eq!(status, StatusCode::OK);
    let events = sse_events(&body);
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["choices"][0]["delta"], json!({"role": "assistant"}));
    assert!(
        events[1].len() > 64 * 1024,
        "chunk of {} bytes",
        events[1].len()
    );
    assert!(events[2..].iter().all(|e| e.len() < 1024));
    assert_eq!(events.last().unwrap(), "[DONE]");

    let (status, body) = sim
        .post("/sim/faults", json!({"set": ["meteor_strike"]}))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        body.contains("wake_mismatch"),
        "lists the known faults: {body}"
    );
    assert_eq!(
        sim.post("/sim/faults", json!({"sett": []})).await.0,
        StatusCode::BAD_REQUEST
    );
    let faults = set_faults(&sim, json!({"clear": ["oversized_chunks"]})).await;
    assert_eq!(faults["faults"], json!(["role_chunk"]));
}

#[tokio::test]
async fn vllm_metrics_names_and_kv_usage() {
    let sim = start(
        &[
            VLLM,
            &["--sim-token-rate", "50", "--sim-kv-capacity-tokens", "100"],
        ]
        .concat(),
    )
    .await;
    let mut req = chat(
        "chat-a",
        "one two three four five six seven eight nine",
        true,
    );
    req["max_tokens"] = json!(1000);
    let mut stream = OpenStream::open(sim.addr, "/v1/chat/completions", req).await;
    stream.next_event().await;
    let (status, metrics) = sim.get("/metrics").await;
    assert_eq!(status, StatusCode::OK);
    assert!(metrics.contains("# TYPE vllm:num_requests_running gauge"));
    assert!(
        metrics.contains("vllm:num_requests_running{engine=\"0\",model_name=\"chat-a\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("vllm:num_requests_waiting{engine=\"0\",model_name=\"chat-a\"} 0"));
    let kv: f64 = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix("vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"chat-a\"} ")
        })
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (0.1..=1.0).contains(&kv),
        "10 prompt tokens + 1 of 100: {kv}"
    );
    stream.disconnect();
    sim.wait_state("aborted", |s| s["aborted"] == 1).await;
}

/// `/reset_prefix_cache` answers `{"success": bool}` as vLLM 0.32 does; with the
/// `prefix_cache_reset_fails` fault it is `false` and nothing is reset.
#[tokio::test]
async fn reset_prefix_cache_says_whether_it_reset() {
    let sim = start(VLLM).await;
    let (status, body) = sim.post_empty("/reset_prefix_cache").await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::OK, r#"{"success":true}"#)
    );
    set_faults(&sim, json!({"set": ["prefix_cache_reset_fails"]})).await;
    let (status, body) = sim.post_empty("/reset_prefix_cache").await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::OK, r#"{"success":false}"#)
    );
    assert_eq!(sim.state().await["cache_resets"], 1);
}
