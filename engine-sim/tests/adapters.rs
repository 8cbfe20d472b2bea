//! LoRA adapters in engine-sim beyond the recorded cases (`real_vllm.rs` compares those with
//! vLLM 0.32): a load time per adapter, the load faults (one that fails, one that hangs),
//! `/sim/state`, and SGLang's routes.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use hyper::StatusCode;
use serde_json::{Value, json};

use capyctl_engine_sim::testing::AdapterDirs;
use common::{Sim, start};

/// PEFT directories of rank 8 named `names`.
fn dirs(names: &[&str]) -> AdapterDirs {
    AdapterDirs::rank8("engine-sim-adapters", names).unwrap()
}

async fn vllm() -> Sim {
    start(&[
        "serve",
        "base",
        "--port",
        "0",
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--sim-vllm-runtime-lora-updating",
        "1",
        "--sim-adapter-load-time",
        "1ms",
    ])
    .await
}

async fn load(sim: &Sim, name: &str, path: &str) -> (StatusCode, String) {
    sim.post(
        "/v1/load_lora_adapter",
        json!({"lora_name": name, "lora_path": path}),
    )
    .await
}

fn names(state: &Value) -> Vec<String> {
    state["adapters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["name"].as_str().unwrap().to_string())
        .collect()
}

/// An adapter's own `load_time` holds its load at least that long (a lower bound only).
#[tokio::test]
async fn a_load_takes_its_adapters_load_time() {
    let dirs = dirs(&["slow", "quick"]);
    let sim = vllm().await;
    let (status, body) = sim
        .post(
            "/sim/faults",
            json!({"adapters": {"slow": {"load_time": "300ms"}}}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let began = Instant::now();
    assert_eq!(
        load(&sim, "slow", &dirs.path("slow")).await.0,
        StatusCode::OK
    );
    assert!(
        began.elapsed() >= Duration::from_millis(300),
        "{:?}",
        began.elapsed()
    );
    // (Not timed: only a lower bound is; the quick one's is the launch's 1 ms.)
    assert_eq!(
        load(&sim, "quick", &dirs.path("quick")).await.0,
        StatusCode::OK
    );
    let state = sim.state().await;
    assert_eq!(names(&state), ["slow", "quick"]);
    assert_eq!(state["adapters"][0]["rank"], 8);
    // Both answer, each its own way.
    let slow = sim.chat_text("slow", "hello").await;
    let quick = sim.chat_text("quick", "hello").await;
    let base = sim.chat_text("base", "hello").await;
    assert!(
        slow != quick && slow != base && quick != base,
        "{slow} / {quick} / {base}"
    );
    assert_eq!(sim.chat_text("slow", "hello").await, slow, "deterministic");
}

#[tokio::test]
async fn a_failing_load_loads_nothing_and_names_its_reason() {
    let dirs = dirs(&["bad", "good"]);
    let sim = vllm().await;
    sim.post(
        "/sim/faults",
        json!({"adapters": {"bad": {"fails": "CUDA out of memory"}}}),
    )
    .await;
    let (status, body) = load(&sim, "bad", &dirs.path("bad")).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body}");
    assert!(body.contains("CUDA out of memory"), "{body}");
    assert_eq!(
        load(&sim, "good", &dirs.path("good")).await.0,
        StatusCode::OK
    );
    assert_eq!(names(&sim.state().await), ["good"]);
    // The fault for every load, then cleared.
    sim.post(
        "/sim/faults",
        json!({"set": ["adapter_load_fails"], "adapters": {"bad": null}}),
    )
    .await;
    let (status, body) = load(&sim, "bad", &dirs.path("bad")).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body}");
    assert!(body.contains("adapter_load_fails"), "{body}");
    sim.post("/sim/faults", json!({"clear": ["adapter_load_fails"]}))
        .await;
    assert_eq!(load(&sim, "bad", &dirs.path("bad")).await.0, StatusCode::OK);
    assert_eq!(names(&sim.state().await), ["good", "bad"]);
}

#[tokio::test]
async fn a_hanging_load_never_answers_and_holds_the_next() {
    let dirs = dirs(&["stuck", "next", "other"]);
    let sim = vllm().await;
    assert_eq!(
        load(&sim, "other", &dirs.path("other")).await.0,
        StatusCode::OK
    );
    sim.post(
        "/sim/faults",
        json!({"adapters": {"stuck": {"hangs": true}}}),
    )
    .await;
    let hung = tokio::time::timeout(
        Duration::from_millis(300),
        load(&sim, "stuck", &dirs.path("stuck")),
    )
    .await;
    assert!(hung.is_err(), "the load answered: {hung:?}");
    // Loads are serialized behind it, as in vLLM's engine core; requests still run.
    let next = tokio::time::timeout(
        Duration::from_millis(300),
        load(&sim, "next", &dirs.path("next")),
    )
    .await;
    assert!(next.is_err(), "a load ran beside the stuck one: {next:?}");
    sim.chat_text("base", "hello").await;
    // vLLM's unload only drops the name (under that name's lock): another name's answers
    // beside the stuck load (the bound is generous: it only keeps a failure from hanging),
    // the stuck name's waits for its load.
    let unload =
        |name: &'static str| sim.post("/v1/unload_lora_adapter", json!({"lora_name": name}));
    let other = tokio::time::timeout(Duration::from_secs(30), unload("other")).await;
    assert_eq!(
        other.map(|(status, _)| status).ok(),
        Some(StatusCode::OK),
        "an unload waited behind another name's load"
    );
    let stuck = tokio::time::timeout(Duration::from_millis(300), unload("stuck")).await;
    assert!(
        stuck.is_err(),
        "the stuck name's unload answered: {stuck:?}"
    );
    assert!(names(&sim.state().await).is_empty());
}

/// SGLang: loads, lists (with the base as parent), runs a request through `lora_path` or
/// `model: "base:adapter"` (a bare adapter name in `model` runs the base), and
/// beyond `--max-loaded-loras` a load succeeds and unloads the least recently used adapter
/// (SGLang 0.5.23 refuses none: `load_lora_adapter` evicts by LRU).
#[tokio::test]
async fn sglang_loads_lists_and_unloads_adapters() {
    let dirs = dirs(&["a", "b", "c"]);
    let sim = start(&[
        "--model-path",
        "base",
        "--port",
        "0",
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--lora-target-modules",
        "all",
        "--max-loaded-loras",
        "2",
        "--max-loras-per-batch",
        "2",
        "--sim-adapter-load-time",
        "1ms",
    ])
    .await;
    let body = |name: &str| json!({"lora_name": name, "lora_path": dirs.path(name)});
    let ask = |lora: Value| json!({"model": "base", "prompt": "hello", "max_tokens": 4, "lora_path": lora});
    let loaded = |text: &str| -> Vec<String> {
        let v: Value = serde_json::from_str(text).unwrap();
        assert_eq!(v["success"], true, "{v}");
        v["loaded_adapters"]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect()
    };
    let (status, text) = sim.post("/load_lora_adapter", body("a")).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(loaded(&text), ["a"]);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["loaded_adapters"]["a"], dirs.path("a"));
    let (status, text) = sim.post("/load_lora_adapter", body("b")).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(loaded(&text), ["a", "b"]);
    // `a` runs a request: `b` is now the least recently used, and a third load unloads it.
    let (status, _) = sim.post("/v1/completions", ask(json!("a"))).await;
    assert_eq!(status, StatusCode::OK);
    let (status, text) = sim.post("/load_lora_adapter", body("c")).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(loaded(&text), ["a", "c"]);
    assert_eq!(names(&sim.state().await), ["a", "c"]);
    // An adapter it has not loaded: SGLang 0.5.23's 400, its error object at the top, naming
    // it and those loaded (least recently used first, as Python prints an OrderedDict's keys).
    let (status, refused) = sim.post("/v1/completions", ask(json!("b"))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        serde_json::from_str::<Value>(&refused).unwrap(),
        json!({
            "object": "error",
            "message": "The following requested LoRA adapters are not loaded: b\nLoaded adapters: odict_keys(['a', 'c']).",
            "type": "BadRequestError",
            "param": null,
            "code": 400,
        })
    );
    let (status, text) = sim
        .post("/unload_lora_adapter", json!({"lora_name": "c"}))
        .await;
    assert_eq!(status, StatusCode::OK, "{text}");
    // Listed with the base as parent; a request runs with it through `lora_path`.
    let (_, models) = sim.get("/v1/models").await;
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][1]["id"], "a");
    assert_eq!(models["data"][1]["parent"], "base");
    let (status, with) = sim.post("/v1/completions", ask(json!("a"))).await;
    assert_eq!(status, StatusCode::OK, "{with}");
    let (_, without) = sim.post("/v1/completions", ask(Value::Null)).await;
    let text = |b: &str| serde_json::from_str::<Value>(b).unwrap()["choices"][0]["text"].clone();
    assert_ne!(text(&with), text(&without));
    // SGLang 0.5.23 reads an adapter in `model` only as `base-model:adapter`, which wins over
    // `lora_path` (`b` is not loaded); a bare adapter name in `model` runs on the base, and
    // `model` is echoed as it came.
    let ask_as = |model: &str, lora: Value| json!({"model": model, "prompt": "hello", "max_tokens": 4, "lora_path": lora});
    let (status, colon) = sim
        .post("/v1/completions", ask_as("base:a", json!("b")))
        .await;
    assert_eq!(status, StatusCode::OK, "{colon}");
    assert_eq!(text(&colon), text(&with));
    let (status, colon) = sim
        .post("/v1/completions", ask_as("other:a", Value::Null))
        .await;
    assert_eq!(status, StatusCode::OK, "{colon}");
    assert_eq!(text(&colon), text(&with));
    let (status, bare) = sim.post("/v1/completions", ask_as("a", Value::Null)).await;
    assert_eq!(status, StatusCode::OK, "{bare}");
    assert_eq!(
        text(&bare),
        text(&without),
        "a bare adapter name runs the base"
    );
    assert_eq!(serde_json::from_str::<Value>(&bare).unwrap()["model"], "a");
    let (status, _) = sim.post("/v1/completions", ask(json!("b"))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, text) = sim
        .post("/unload_lora_adapter", json!({"lora_name": "a"}))
        .await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let (status, _) = sim
        .post("/unload_lora_adapter", json!({"lora_name": "a"}))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(names(&sim.state().await).is_empty());
}
