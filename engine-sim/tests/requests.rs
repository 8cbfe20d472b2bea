//! Request handling over real sockets: the running bound and waiting count, clients that go
//! away (streamed or not, before or after the first token), the token rate, prefill and
//! TensorFold's opening chunk.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{OpenStream, chat, raw_request, start};
use hyper::StatusCode;
use serde_json::{Value, json};

#[tokio::test]
async fn max_running_bound_makes_the_rest_wait() {
    let sim = start(&[
        "serve",
        "m",
        "--max-num-seqs",
        "2",
        "--sim-token-rate",
        "40",
        "--sim-kv-capacity-tokens",
        "100",
    ])
    .await;
    let mut req = chat("m", "four words of prompt", false);
    req["max_tokens"] = json!(20);
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let base = sim.base.clone();
        let body = req.clone();
        tasks.push(tokio::spawn(async move {
            common::call(
                hyper::Method::POST,
                &format!("{base}/v1/chat/completions"),
                Some(body),
            )
            .await
        }));
    }
    let s = sim
        .wait_state("2 running, 2 waiting", |s| {
            s["running"] == 2 && s["waiting"] == 2
        })
        .await;
    assert!(s["kv_cache_usage"].as_f64().unwrap() > 0.0);
    let (_, metrics) = sim.get("/metrics").await;
    assert!(
        metrics.contains("vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 2"),
        "{metrics}"
    );
    assert!(
        metrics.contains("vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2"),
        "{metrics}"
    );
    let mut answers = Vec::new();
    for t in tasks {
        let (status, body) = t.await.unwrap();
        assert_eq!(status, StatusCode::OK);
        answers.push(body);
    }
    let s = sim.state().await;
    assert_eq!(
        (
            s["completed"].as_u64(),
            s["running"].as_u64(),
            s["waiting"].as_u64()
        ),
        (Some(4), Some(0), Some(0))
    );
    assert_eq!(s["kv_cache_usage"], 0.0);
}

#[tokio::test]
async fn client_going_away_aborts_streamed_and_whole_requests() {
    let sim = start(&[
        "serve",
        "m",
        "--max-num-seqs",
        "1",
        "--sim-token-rate",
        "50",
    ])
    .await;
    let mut long = chat("m", "tell me a long story", true);
    long["max_tokens"] = json!(1000);

    // Streamed, after the first token.
    let mut stream = OpenStream::open(sim.addr, "/v1/chat/completions", long.clone()).await;
    assert_eq!(stream.status, StatusCode::OK);
    let first: Value = serde_json::from_str(&stream.next_event().await.unwrap()).unwrap();
    assert!(first["choices"][0]["delta"]["content"].is_string());
    sim.wait_state("1 running", |s| s["running"] == 1).await;

    // Streamed, while waiting for the only slot (before any token).
    let waiting = OpenStream::open(sim.addr, "/v1/chat/completions", long.clone()).await;
    sim.wait_state("1 waiting", |s| s["waiting"] == 1).await;
    waiting.disconnect();
    let s = sim
        .wait_state("waiter aborted", |s| s["aborted"] == 1 && s["waiting"] == 0)
        .await;
    assert_eq!(s["running"], 1);

    stream.disconnect();
    sim.wait_state("streamer aborted", |s| {
        s["aborted"] == 2 && s["running"] == 0
    })
    .await;

    // Not streamed: the client hangs up before the answer.
    long["stream"] = json!(false);
    let socket = raw_request(sim.addr, "/v1/chat/completions", long).await;
    sim.wait_state("whole request running", |s| s["running"] == 1)
        .await;
    drop(socket);
    let s = sim
        .wait_state("whole request aborted", |s| {
            s["aborted"] == 3 && s["running"] == 0
        })
        .await;
    assert_eq!(s["completed"], 0);

    // The slot is free again.
    assert_eq!(sim.chat_text("m", "short").await.split(' ').count(), 16);
    let (_, metrics) = sim.get("/metrics").await;
    assert!(
        metrics.contains("engine_sim_aborted_total{model_name=\"m\"} 3"),
        "{metrics}"
    );
}

#[tokio::test]
async fn token_rate_is_respected() {
    let sim = start(&["serve", "m", "--sim-token-rate", "100"]).await;
    let mut req = chat("m", "hi", true);
    req["max_tokens"] = json!(20);
    let began = Instant::now();
    let (status, body) = sim.post("/v1/chat/completions", req).await;
    let took = began.elapsed();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(common::sse_events(&body).len(), 20 + 2);
    assert!(
        took >= Duration::from_millis(180),
        "20 tokens at 100/s took {took:?}"
    );
    assert!(
        took < Duration::from_secs(3),
        "20 tokens at 100/s took {took:?}"
    );

    let fast = start(&["serve", "m"]).await;
    let mut req = chat("m", "hi", false);
    req["max_tokens"] = json!(2000);
    let began = Instant::now();
    let (status, _) = fast.post("/v1/chat/completions", req).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        began.elapsed() < Duration::from_secs(3),
        "rate 0 is as fast as possible"
    );
}

#[tokio::test]
async fn tensorfold_sends_the_role_chunk_before_prefill() {
    let sim = start(&[
        "--model",
        "tf-model",
        "--port",
        "0",
        "--sim-prefill-per-token",
        "40ms",
        "--max-batch-size",
        "3",
    ])
    .await;
    let s = sim.state().await;
    assert_eq!(s["flavour"], "tensorfold");
    assert_eq!(s["max_running"], 8);
    assert_eq!(s["unknown_args"], json!(["--max-batch-size", "3"]));
    // Prompt "user: a b c d e" = 6 tokens → 240 ms of prefill.
    let began = Instant::now();
    let mut stream = OpenStream::open(
        sim.addr,
        "/v1/chat/completions",
        chat("tf-model", "a b c d e", true),
    )
    .await;
    let opening: Value = serde_json::from_str(&stream.next_event().await.unwrap()).unwrap();
    let opening_at = began.elapsed();
    assert_eq!(opening["choices"][0]["delta"], json!({"role": "assistant"}));
    let content: Value = serde_json::from_str(&stream.next_event().await.unwrap()).unwrap();
    let content_at = began.elapsed();
    assert!(content["choices"][0]["delta"]["content"].is_string());
    assert!(content["choices"][0]["delta"].get("role").is_none());
    assert!(
        opening_at < Duration::from_millis(200),
        "opening chunk after {opening_at:?}"
    );
    assert!(
        content_at >= Duration::from_millis(240),
        "first token after {content_at:?}"
    );
    while stream.next_event().await.is_some() {}

    // Completions open with an empty-text chunk.
    let (_, body) = sim
        .post(
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 2, "stream": true}),
        )
        .await;
    let first: Value = serde_json::from_str(&common::sse_events(&body)[0]).unwrap();
    assert_eq!(first["choices"][0]["text"], "");

    // No sleep endpoints; TensorFold metric names.
    for path in [
        "/sleep?level=1",
        "/wake_up",
        "/release_memory_occupation",
        "/collective_rpc",
    ] {
        assert_eq!(
            sim.post_empty(path).await.0,
            StatusCode::NOT_FOUND,
            "{path}"
        );
    }
    assert_eq!(sim.get("/health").await.0, StatusCode::OK);
    let (status, metrics) = sim.get("/metrics").await;
    assert_eq!(status, StatusCode::OK);
    for name in [
        "tensorfold_requests_running{model_name=\"tf-model\"} 0",
        "tensorfold_requests_waiting{model_name=\"tf-model\"} 0",
        "tensorfold_kv_cache_usage_ratio{model_name=\"tf-model\"} 0",
    ] {
        assert!(metrics.contains(name), "{name} missing in {metrics}");
    }
}
