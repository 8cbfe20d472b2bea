//! LoRA adapters end to end (DESIGN 4.9): the real `capyctl` standalone, real sockets, and the
//! engine simulator serving adapters the way vLLM does (`/v1/load_lora_adapter`,
//! `/v1/unload_lora_adapter`, answers under the adapter's name) and SGLang does (the adapter
//! named in `lora_path`); an adapter deleted while a request runs on it.
#![allow(clippy::unwrap_used)]

mod support;

use std::io::Read;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use support::{
    Capy, adapter_switches, assert_error, chat, document, model, open_stream, request, temp_dir,
};

/// A PEFT directory (`adapter_config.json` of rank `r`) under `dir`.
fn peft(dir: &Path, name: &str, r: u32) -> String {
    let at = dir.join("loras").join(name);
    std::fs::create_dir_all(&at).unwrap();
    std::fs::write(
        at.join("adapter_config.json"),
        format!(
            r#"{{"r": {r}, "lora_alpha": 16, "peft_type": "LORA", "target_modules": ["q_proj"]}}"#
        ),
    )
    .unwrap();
    at.display().to_string()
}

/// The documents of adapters `names` of base `base`, each a PEFT directory of rank 8 under
/// `dir`.
fn adapter_docs(dir: &Path, names: &[&str]) -> Vec<String> {
    names
        .iter()
        .map(|n| {
            format!(
                "name: {n}\nadapter: {{base: base, path: {}}}\n",
                peft(dir, n, 8)
            )
        })
        .collect()
}

#[test]
fn adapters_load_on_demand_and_survive_a_kill_of_capyctl() {
    let dir = temp_dir("adapters");
    let adapters = adapter_docs(&dir, &["a1", "a2", "a3"]);
    let base = model("base", "adapters: {max_loaded: 2, max_rank: 16}\n");
    let mut deployments = vec![base.as_str()];
    deployments.extend(adapters.iter().map(String::as_str));
    let doc = document("", "", &deployments);

    let capy = Capy::start(&dir, &doc);
    // A request for an adapter starts its base, loads it, and runs under its name.
    let r = chat(capy.inference, "a1", false);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.json()["model"], "a1");
    // Loaded before the request was forwarded.
    let list = capy.list();
    assert!(list.contains("a1 ") && list.contains("loaded"), "{list}");
    assert!(list.contains("unloaded"), "{list}");
    // Streamed too.
    assert_eq!(chat(capy.inference, "a2", true).status, 200);
    // Past max_loaded: the least recently used is unloaded first (records of cause adapter).
    assert_eq!(chat(capy.inference, "a3", false).status, 200);
    let switches = capy.cli(&["switches", "--json"]).ok();
    assert!(
        switches.contains("adapter_load") && switches.contains("adapter_unload"),
        "{switches}"
    );

    // A load the engine refuses: 503 adapter_load_failed naming it; the base serves on.
    let bad = dir.join("loras").join("not-peft");
    std::fs::create_dir_all(&bad).unwrap();
    capy.cli(&["deploy", "model", "--file", &{
        let f = dir.join("bad.yaml");
        std::fs::write(
            &f,
            format!(
                "name: bad\nadapter: {{base: base, path: {}}}\n",
                bad.display()
            ),
        )
        .unwrap();
        f.display().to_string()
    }])
    .ok();
    let r = chat(capy.inference, "bad", false);
    let message = assert_error(&r, 503, "adapter_load_failed", true);
    assert!(message.contains("adapter bad"), "{message}");
    assert_eq!(chat(capy.inference, "a3", false).status, 200);

    // kill -9 and a restart: the engine is adopted, its adapters are what it lists, the others
    // load again on demand; never the engine's 404.
    capy.kill();
    let capy = Capy::start(&dir, &doc);
    for name in ["a1", "a2", "a3"] {
        let r = chat(capy.inference, name, false);
        assert_eq!(r.status, 200, "{name}: {r:?}");
        assert_eq!(r.json()["model"], name);
    }
}

/// The models the engine itself lists (`GET /v1/models` on its port).
fn engine_models(capy: &Capy, base: &str) -> Vec<String> {
    let port = capy.status(base)["instances"][0]["port"].as_u64().unwrap();
    let engine = SocketAddr::from(([127, 0, 0, 1], u16::try_from(port).unwrap()));
    let r = request(engine, "GET", "/v1/models", &[], b"");
    assert_eq!(r.status, 200, "{r:?}");
    r.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn an_adapter_deleted_while_it_runs_is_unloaded_once_its_requests_end() {
    let dir = temp_dir("adapter-delete");
    // 20 tokens a second: a stream of 200 runs for about 10 s.
    let base = "name: base\nengine: vllm\nmodel: Qwen3-4B\nresources: {gpu_memory: 6GiB, weights_memory: 64MiB}\nenv: {ENGINE_SIM_WEIGHTS_BYTES: 64MiB, ENGINE_SIM_TOKEN_RATE: \"20\"}\nadapters: {max_loaded: 2, max_rank: 16}\n";
    let adapters = adapter_docs(&dir, &["a1", "a2"]);
    let doc = document("", "", &[base, &adapters[0], &adapters[1]]);
    let capy = Capy::start(&dir, &doc);
    for name in ["a1", "a2"] {
        let r = chat(capy.inference, name, false);
        assert_eq!(r.status, 200, "{name}: {r:?}");
    }
    assert!(engine_models(&capy, "base").contains(&"a1".to_string()));

    // A stream runs on a1 when it is deleted.
    let body = serde_json::json!({
        "model": "a1",
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 200,
        "stream": true,
    })
    .to_string();
    let (mut stream, seen) = open_stream(
        capy.inference,
        "/v1/chat/completions",
        &body,
        Duration::from_secs(60),
    );
    let began = Instant::now();
    capy.cli(&["delete", "deployment", "a1"]).ok();
    // New requests for it: the page's 404 at once.
    let r = chat(capy.inference, "a1", false);
    let message = assert_error(&r, 404, "model_not_found", false);
    assert!(message.contains("a1"), "{message}");
    // The engine keeps it while the stream runs (checked only while it surely does).
    let listed = engine_models(&capy, "base");
    if began.elapsed() < Duration::from_secs(5) {
        assert!(
            listed.contains(&"a1".to_string()),
            "unloaded under a running request: {listed:?}"
        );
        assert!(
            adapter_switches(&capy, "a1")
                .iter()
                .all(|(phases, _)| !phases.contains(&"adapter_unload".to_string()))
        );
    }
    // The running request finishes untouched.
    let mut rest = String::new();
    stream.read_to_string(&mut rest).unwrap();
    assert!(
        rest.contains("\"finish_reason\":\"length\"") && rest.contains("data: [DONE]"),
        "the stream was cut: {seen}{rest}"
    );
    assert!(!rest.contains("\"error\""), "{rest}");
    // Then the engine unloads it: a switch record of cause adapter, phase adapter_unload.
    let until = Instant::now() + Duration::from_secs(30);
    while engine_models(&capy, "base").contains(&"a1".to_string()) {
        assert!(Instant::now() < until, "a1 not unloaded from the engine");
        std::thread::sleep(Duration::from_millis(50));
    }
    let records = adapter_switches(&capy, "a1");
    assert!(
        records
            .iter()
            .any(|(phases, outcome)| phases == &["adapter_unload".to_string()] && outcome == "ok"),
        "{records:?}"
    );
    // The base serves its other adapter; the deleted one is gone from every list.
    let r = chat(capy.inference, "a2", false);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.json()["model"], "a2");
    assert!(!capy.list().contains("a1 "));
    let models = request(capy.inference, "GET", "/v1/models", &[], b"").json();
    assert!(
        models["data"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["id"] != "a1"),
        "{models}"
    );
    assert_error(
        &chat(capy.inference, "a1", false),
        404,
        "model_not_found",
        false,
    );
}

/// SGLang runs a bare adapter name in `model` on its base: CapyCTL names the adapter in
/// `lora_path` too (the simulator answers as SGLang 0.5.23 does: the answer depends on the
/// adapter, and `model` is echoed).
#[test]
fn an_adapter_on_sglang_runs_with_the_adapter_not_the_base() {
    let dir = temp_dir("adapter-sglang");
    let base = model("base", "adapters: {max_loaded: 1, max_rank: 16}\n")
        .replace("engine: vllm", "engine: sglang");
    let adapters = adapter_docs(&dir, &["s1"]);
    let doc = document("", "", &[&base, &adapters[0]]);
    let capy = Capy::start(&dir, &doc);
    let text = |r: &support::Response| r.json()["choices"][0]["message"]["content"].clone();
    let plain = chat(capy.inference, "base", false);
    assert_eq!(plain.status, 200, "{plain:?}");
    let adapted = chat(capy.inference, "s1", false);
    assert_eq!(adapted.status, 200, "{adapted:?}");
    assert_eq!(adapted.json()["model"], "s1");
    assert_ne!(
        text(&adapted),
        text(&plain),
        "the adapter's answer, not the base's"
    );
    // Streamed too, and again from the loaded adapter.
    let streamed = chat(capy.inference, "s1", true);
    assert_eq!(streamed.status, 200, "{streamed:?}");
    assert!(
        streamed.body.trim_end().ends_with("data: [DONE]"),
        "{streamed:?}"
    );
    assert_eq!(text(&chat(capy.inference, "s1", false)), text(&adapted));
    assert!(
        adapter_switches(&capy, "s1")
            .iter()
            .any(|(phases, outcome)| phases == &["adapter_load".to_string()] && outcome == "ok")
    );
}

/// An adapter the engine drops without CapyCTL (here: unloaded at the engine's own port) on
/// a base on `engine`: the next request for it gets `503 adapter_load_failed` saying what the
/// engine answered (`said`), never the engine's own answer; the one after loads it again.
fn an_adapter_the_engine_lost_loads_again(engine: &str, unload: &str, said: &str) {
    let dir = temp_dir(&format!("adapter-lost-{engine}"));
    let base = model("base", "adapters: {max_loaded: 2, max_rank: 16}\n")
        .replace("engine: vllm", &format!("engine: {engine}"));
    let adapters = adapter_docs(&dir, &["l1"]);
    let doc = document("", "", &[&base, &adapters[0]]);
    let capy = Capy::start(&dir, &doc);
    let first = chat(capy.inference, "l1", false);
    assert_eq!(first.status, 200, "{first:?}");

    let port = capy.status("base")["instances"][0]["port"]
        .as_u64()
        .unwrap();
    let at = SocketAddr::from(([127, 0, 0, 1], u16::try_from(port).unwrap()));
    let r = request(
        at,
        "POST",
        unload,
        &[("content-type", "application/json")],
        br#"{"lora_name":"l1"}"#,
    );
    assert_eq!(r.status, 200, "{r:?}");

    let r = chat(capy.inference, "l1", false);
    let message = assert_error(&r, 503, "adapter_load_failed", true);
    assert!(
        message.contains("adapter l1") && message.contains(said),
        "{message}"
    );
    let again = chat(capy.inference, "l1", false);
    assert_eq!(again.status, 200, "{again:?}");
    let text = |r: &support::Response| r.json()["choices"][0]["message"]["content"].clone();
    assert_eq!(text(&again), text(&first), "the adapter's answer again");
    let loads = adapter_switches(&capy, "l1")
        .iter()
        .filter(|(phases, outcome)| phases == &["adapter_load".to_string()] && outcome == "ok")
        .count();
    assert_eq!(loads, 2, "loaded again");
}

#[test]
fn an_adapter_vllm_lost_is_never_its_404_and_loads_again() {
    an_adapter_the_engine_lost_loads_again(
        "vllm",
        "/v1/unload_lora_adapter",
        "the engine answered as if it were not loaded (404)",
    );
}

/// SGLang answers an adapter it does not have `400` ("The following requested LoRA adapters
/// are not loaded: …"), which is not passed on either.
#[test]
fn an_adapter_sglang_lost_is_never_its_400_and_loads_again() {
    an_adapter_the_engine_lost_loads_again(
        "sglang",
        "/unload_lora_adapter",
        "the engine answered 400 \"The following requested LoRA adapters are not loaded: l1\"",
    );
}
