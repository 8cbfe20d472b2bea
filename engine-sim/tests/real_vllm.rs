//! engine-sim against what the real vLLM 0.32.0 answered (`fixtures/vllm-0.32.0/`, recorded by
//! its `record.py` from the CPU build serving a tiny local model): the same requests, in the
//! same order, must get the same status, the same content type, and bodies of the same shape —
//! the same JSON keys with values of the same JSON types (text and numbers may differ), the
//! same SSE framing (`data: ` events, a blank line after each, `[DONE]` last) with chunks of
//! the same shapes, the same error bodies, the same `vllm:` metric names with the same labels.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::path::PathBuf;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

use capyctl_engine_sim::testing::AdapterDirs;
use common::{Sim, start};

/// The cases, in the order they were recorded (the sleep cases depend on it).
const CASES: &[&str] = &[
    "health",
    "version",
    "models",
    "completions",
    "completions_stream",
    "completions_stream_usage",
    "completions_logprobs",
    "completions_stream_logprobs",
    "chat",
    "chat_stream",
    "chat_stream_usage",
    "chat_logprobs",
    "chat_stream_logprobs",
    "error_unknown_model_completions",
    "error_unknown_model_chat",
    "error_bad_json",
    "error_missing_messages",
    "error_missing_prompt",
    "error_max_tokens_too_large",
    "error_max_tokens_too_large_chat",
    "error_top_logprobs_without_logprobs",
    "error_not_found",
    "error_method",
    "metrics",
    "is_sleeping_awake",
    "sleep_level1",
    "is_sleeping_asleep",
    "wake_up",
    "sleep_level2",
    "wake_up_weights",
    "is_sleeping_partly",
    "collective_rpc_reload",
    "wake_up_kv_cache",
    "reset_prefix_cache",
    "is_sleeping_woken",
    "error_collective_rpc_no_method",
    "error_collective_rpc_bad_json",
    "error_sleep_bad_level",
    "completions_after_wake",
];

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vllm-0.32.0")
}

fn fixture(name: &str) -> Value {
    let path = fixtures().join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_json::from_str(&text).unwrap()
}

/// The recordings' launch of vLLM, less its environment.
const RECORDED_LAUNCH: &[&str] = &[
    "--engine",
    "vllm",
    "serve",
    "/root/.cache/capyctl-vllm/models/tiny-a",
    "--served-model-name",
    "tiny-a",
    "--max-model-len",
    "256",
    "--dtype",
    "float32",
    "--host",
    "127.0.0.1",
    "--port",
    "0",
];

/// vLLM as the recording launched it: `serve <model dir> --served-model-name tiny-a
/// --max-model-len 256 --dtype float32`, with `VLLM_SERVER_DEV_MODE=1`.
async fn sim() -> Sim {
    let mut args = RECORDED_LAUNCH.to_vec();
    args.extend(["--sim-vllm-dev-mode", "1", "--sim-weights-bytes", "1MiB"]);
    start(&args).await
}

struct Answer {
    status: u16,
    content_type: String,
    chunked: bool,
    body: String,
}

async fn send(sim: &Sim, request: &Value) -> Answer {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let method: Method = request["method"].as_str().unwrap().parse().unwrap();
    let body = match (&request["body"], &request["raw_body"]) {
        (Value::Null, Value::String(raw)) => Bytes::from(raw.clone()),
        (Value::Null, _) => Bytes::new(),
        (b, _) => Bytes::from(b.to_string()),
    };
    let mut builder = Request::builder()
        .method(method)
        .uri(sim.url(request["path"].as_str().unwrap()));
    if !body.is_empty() {
        builder = builder.header("content-type", "application/json");
    }
    let resp = client
        .request(builder.body(Full::new(body)).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_string())
    };
    let content_type = header("content-type").unwrap_or_default();
    let chunked = header("content-length").is_none();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    Answer {
        status,
        content_type,
        chunked,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

/// Where the shapes of `real` and `sim` differ, as `path: what` lines.
fn shape_diff(path: &str, real: &Value, sim: &Value, out: &mut Vec<String>) {
    let all_numbers = |m: &serde_json::Map<String, Value>| m.values().all(Value::is_number);
    match (real, sim) {
        // A map keyed by tokens (completions' `top_logprobs`): tokens differ, values are numbers.
        (Value::Object(r), Value::Object(s))
            if path.ends_with("top_logprobs[0]") && all_numbers(r) && all_numbers(s) => {}
        (Value::Object(r), Value::Object(s)) => {
            for (k, rv) in r {
                match s.get(k) {
                    None => out.push(format!("{path}.{k}: missing (real: {})", kind(rv))),
                    Some(sv) => shape_diff(&format!("{path}.{k}"), rv, sv, out),
                }
            }
            for k in s.keys().filter(|k| !r.contains_key(*k)) {
                out.push(format!("{path}.{k}: not in the real answer"));
            }
        }
        (Value::Array(r), Value::Array(s)) => {
            if let (Some(rf), Some(sf)) = (r.first(), s.first()) {
                shape_diff(&format!("{path}[0]"), rf, sf, out);
            } else if r.is_empty() != s.is_empty() {
                out.push(format!("{path}: {} items, real {}", s.len(), r.len()));
            }
        }
        (r, s) if kind(r) != kind(s) => {
            out.push(format!("{path}: {} (real: {})", kind(s), kind(r)));
        }
        _ => {}
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// An SSE body's `data:` payloads, or why its framing is not vLLM's.
fn sse(body: &str) -> Result<Vec<String>, String> {
    if !body.ends_with("\n\n") {
        return Err("the stream does not end with a blank line".into());
    }
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .map(str::to_string)
                .ok_or_else(|| format!("an event is not `data: …`: {e:?}"))
        })
        .collect()
}

/// The shapes of a stream's chunks: the first, the last before `[DONE]`, and the middle ones
/// (as a set: token counts differ).
fn stream_diff(real: &[String], sim: &[String], out: &mut Vec<String>) {
    let parse = |events: &[String]| -> Vec<Value> {
        events
            .iter()
            .filter(|e| *e != "[DONE]")
            .map(|e| serde_json::from_str(e).unwrap())
            .collect()
    };
    if real.last().map(String::as_str) != Some("[DONE]") {
        out.push("the recording does not end with [DONE]".into());
    }
    if sim.last().map(String::as_str) != Some("[DONE]") {
        out.push("the stream does not end with `data: [DONE]`".into());
    }
    let (r, s) = (parse(real), parse(sim));
    if r.len() < 2 || s.len() < 2 {
        out.push(format!("{} chunks, real {}", s.len(), r.len()));
        return;
    }
    shape_diff("first chunk", &r[0], &s[0], out);
    shape_diff("last chunk", &r[r.len() - 1], &s[s.len() - 1], out);
    let middle = |v: &[Value]| -> Vec<Value> { v[1..v.len() - 1].to_vec() };
    let (rm, sm) = (middle(&r), middle(&s));
    if let (Some(rf), Some(sf)) = (rm.first(), sm.first()) {
        shape_diff("middle chunk", rf, sf, out);
    }
}

fn compare(name: &str, real: &Value, got: &Answer) -> Vec<String> {
    let mut out = Vec::new();
    let real_status = real["status"].as_u64().unwrap() as u16;
    if got.status != real_status {
        out.push(format!(
            "status {} (real {real_status}): {}",
            got.status, got.body
        ));
        return out;
    }
    let real_type = real["headers"]["content-type"].as_str().unwrap_or("");
    if got.content_type != real_type {
        out.push(format!(
            "content-type {:?} (real {real_type:?})",
            got.content_type
        ));
    }
    let real_chunked = real["headers"].get("content-length").is_none();
    if got.chunked != real_chunked {
        out.push(format!("chunked {} (real {real_chunked})", got.chunked));
    }
    if let Some(events) = real.get("sse") {
        let real_events: Vec<String> = events
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e.as_str().unwrap().to_string())
            .collect();
        match sse(&got.body) {
            Ok(events) => stream_diff(&real_events, &events, &mut out),
            Err(e) => out.push(e),
        }
    } else if let Some(json) = real.get("json") {
        match serde_json::from_str::<Value>(&got.body) {
            Ok(v) => shape_diff("", json, &v, &mut out),
            Err(e) => out.push(format!("not JSON ({e}): {}", got.body)),
        }
    } else if let Some(lines) = real.get("prometheus") {
        let real: BTreeSet<String> = lines
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l.as_str().unwrap().to_string())
            .collect();
        // Every vLLM series the simulator exports is one the real engine has, with the same
        // labels (the simulator exports the ones CapyCTL reads, not all of them).
        for line in got.body.lines() {
            if line.starts_with("vllm:") {
                let series = line.rsplit_once(' ').map_or(line, |(s, _)| s);
                if !real.contains(series) {
                    out.push(format!("metric series {series} is not the real engine's"));
                }
            } else if line.starts_with("# TYPE vllm:") && !real.contains(line) {
                out.push(format!("{line} is not the real engine's"));
            }
        }
    } else {
        let text = real["text"].as_str().unwrap_or("");
        if text.is_empty() != got.body.is_empty() {
            out.push(format!("body {:?} (real {text:?})", got.body));
        }
    }
    out.into_iter().map(|d| format!("{name}: {d}")).collect()
}

#[tokio::test]
async fn engine_sim_answers_as_vllm_0_32_0_did() {
    let sim = sim().await;
    let mut differences = Vec::new();
    for name in CASES {
        let real = fixture(name);
        let got = send(&sim, &real["request"]).await;
        differences.extend(compare(name, &real, &got));
    }
    assert!(
        differences.is_empty(),
        "engine-sim differs from vLLM 0.32.0 in {} places:\n{}",
        differences.len(),
        differences.join("\n")
    );
}

/// An unknown flag: vLLM's argparse exits at once with status 2 and names it on its last
/// stderr line; so does engine-sim in vLLM's flavour. The flags vLLM has pass.
#[tokio::test]
async fn an_unknown_flag_is_refused_as_vllm_refuses_it() {
    let real = fixture("unknown_flag");
    let args: Vec<String> = real["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_engine-sim"))
        .args([
            "serve",
            "/models/tiny-a",
            "--max-model-len",
            "256",
            "--dtype",
        ])
        .args(["float32", "--port", "0"])
        .args(&args)
        .env_remove("ENGINE_SIM_FAULTS")
        .output()
        .await
        .unwrap();
    assert_eq!(
        out.status.code(),
        real["exit_status"].as_i64().map(|c| c as i32)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr.lines().last(),
        real["stderr_tail"]
            .as_array()
            .unwrap()
            .last()
            .unwrap()
            .as_str(),
        "{stderr}"
    );
    assert!(out.stdout.is_empty(), "it never listened");
}

/// A request sent while vLLM sleeps (level 1) is held by its paused scheduler and answered
/// after `/wake_up` (the recording: still pending 5 s after it was sent, answered after the
/// wake); engine-sim holds it the same way and answers in the same shape.
#[tokio::test]
async fn a_request_while_asleep_is_held_until_the_wake() {
    let real = fixture("completions_while_asleep");
    assert_eq!(real["pending_5s_after_sent"], true);
    assert_eq!(real["answered_after_wake"], true);
    let sim = std::sync::Arc::new(sim().await);
    let sleep = serde_json::json!({"method": "POST", "path": "/sleep?level=1"});
    assert_eq!(send(&sim, &sleep).await.status, 200);
    let request = serde_json::json!({
        "method": "POST", "path": "/v1/completions", "body": real["request"]["body"],
    });
    let asker = {
        let sim = std::sync::Arc::clone(&sim);
        tokio::spawn(async move { send(&sim, &request).await })
    };
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(!asker.is_finished(), "answered while asleep");
    let wake = serde_json::json!({"method": "POST", "path": "/wake_up"});
    assert_eq!(send(&sim, &wake).await.status, 200);
    let got = asker.await.unwrap();
    let differences = compare("completions_while_asleep", &real, &got);
    assert!(differences.is_empty(), "{}", differences.join("\n"));
}

/// vLLM refuses connections while it starts and answers `/health` and `/v1/models` together
/// once ready (the recording's timeline); so does engine-sim with a start-up delay.
#[tokio::test]
async fn start_up_refuses_connections_until_ready() {
    let real = fixture("startup");
    let timeline = real["timeline"].as_array().unwrap();
    let (first, last) = (&timeline[0], &timeline[timeline.len() - 1]);
    assert_eq!(first["health"], "ConnectionRefusedError");
    assert_eq!(first["v1_models"], "ConnectionRefusedError");
    assert_eq!(
        (last["health"].as_u64(), last["v1_models"].as_u64()),
        (Some(200), Some(200))
    );

    let sim = start(&["serve", "m", "--port", "0", "--sim-startup-delay", "3s"]).await;
    // The in-process simulator is handed a bound listener and closes it as it begins (a
    // connection made before that is taken, then reset): within the start-up delay, a
    // connection is refused. Polled, so that a busy machine's late start does not fail it.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_millis(2500);
    loop {
        match tokio::net::TcpStream::connect(sim.addr).await {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => break,
            other => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "no connection refused during the start-up delay: {other:?}"
                );
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        }
    }
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while tokio::net::TcpStream::connect(sim.addr).await.is_err() {
        assert!(tokio::time::Instant::now() < deadline, "never listened");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    for path in ["/health", "/v1/models"] {
        let got = send(&sim, &serde_json::json!({"method": "GET", "path": path})).await;
        assert_eq!(got.status, 200, "{path}");
    }
}

/// The LoRA cases (`fixtures/vllm-0.32.0-lora/`, recorded by its `record.py` from vLLM 0.32 on
/// CPU with `--enable-lora --max-loras 2 --max-lora-rank 8` and
/// `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`), in the order they were recorded: they build on
/// each other (loaded, listed, used, unloaded).
const ADAPTER_CASES: &[&str] = &[
    "adapters_models_none",
    "adapters_load_one",
    "adapters_load_one_again",
    "adapters_load_base_name",
    "adapters_load_missing_path",
    "adapters_load_not_peft",
    "adapters_load_rank_too_high",
    "adapters_load_no_path",
    "adapters_models_one",
    "adapters_completions_base",
    "adapters_completions_one",
    "adapters_chat_one",
    "adapters_completions_unknown",
    "adapters_load_two",
    "adapters_load_three",
    "adapters_models_three",
    "adapters_completions_three",
    "adapters_unload_one",
    "adapters_unload_one_again",
    "adapters_unload_no_name",
    "adapters_completions_unloaded",
    "adapters_models_end",
];

fn adapter_fixture(name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/vllm-0.32.0-lora")
        .join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_json::from_str(&text).unwrap()
}

/// The recording's `{ADAPTERS}`: `one` and `two` (PEFT, rank 8), `rank16` (rank 16),
/// `not-peft` (no `adapter_config.json`). Removed on drop.
fn adapter_dirs() -> AdapterDirs {
    AdapterDirs::new(
        "engine-sim-lora",
        &[
            ("one", Some(8)),
            ("two", Some(8)),
            ("rank16", Some(16)),
            ("not-peft", None),
        ],
    )
    .unwrap()
}

/// `request` with `{ADAPTERS}` made `dirs`' directory.
fn with_dirs(dirs: &AdapterDirs, request: &Value) -> Value {
    let text = request
        .to_string()
        .replace("{ADAPTERS}", dirs.root().to_str().unwrap());
    serde_json::from_str(&text).unwrap()
}

/// vLLM with adapters as the recording launched it.
async fn lora_sim(enable_lora: bool) -> Sim {
    let mut args = RECORDED_LAUNCH.to_vec();
    args.extend([
        "--sim-vllm-runtime-lora-updating",
        "True",
        "--sim-adapter-load-time",
        "1ms",
    ]);
    if enable_lora {
        args.extend(["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]);
    }
    start(&args).await
}

/// The text of a completion answer.
fn answer_text(body: &str) -> String {
    let v: Value = serde_json::from_str(body).unwrap();
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn engine_sim_serves_adapters_as_vllm_0_32_0_did() {
    let dirs = adapter_dirs();
    let sim = lora_sim(true).await;
    let mut differences = Vec::new();
    let mut texts = std::collections::BTreeMap::new();
    for name in ADAPTER_CASES {
        let real = adapter_fixture(name);
        let got = send(&sim, &with_dirs(&dirs, &real["request"])).await;
        differences.extend(compare(name, &real, &got));
        // The refusals' reasons are vLLM's own words (the path aside: vLLM wrote `<path>`
        // for its temporary directory).
        if let Some(message) = real["json"]["error"]["message"].as_str() {
            let got: Value = serde_json::from_str(&got.body).unwrap_or_default();
            let got = got["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let head = message.split("<path>").next().unwrap();
            if !got.starts_with(head) {
                differences.push(format!("{name}: message {got:?} (real {message:?})"));
            }
        }
        if name.contains("completions") && got.status == 200 {
            texts.insert(*name, answer_text(&got.body));
        }
        if let Some(text) = real["text"].as_str()
            && got.body != text
        {
            differences.push(format!("{name}: body {:?} (real {text:?})", got.body));
        }
    }
    assert!(
        differences.is_empty(),
        "engine-sim differs from vLLM 0.32.0 in {} places:\n{}",
        differences.len(),
        differences.join("\n")
    );
    // As the real engine: an adapter answers otherwise than the base, and two names of one
    // directory answer alike (the answer is the weights', not the name's).
    let real = |n: &str| {
        adapter_fixture(n)["json"]["choices"][0]["text"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_ne!(
        real("adapters_completions_base"),
        real("adapters_completions_one")
    );
    assert_ne!(
        texts["adapters_completions_base"],
        texts["adapters_completions_one"]
    );
    assert_ne!(
        texts["adapters_completions_one"],
        texts["adapters_completions_three"]
    );
    // `/v1/models` lists the adapters after the base, with their directory and the base as
    // parent, as the recording did.
    let models = |body: &str| -> Vec<(String, Value)> {
        let v: Value = serde_json::from_str(body).unwrap();
        v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| (m["id"].as_str().unwrap().to_string(), m["parent"].clone()))
            .collect()
    };
    let real_end = adapter_fixture("adapters_models_end");
    let got_end = send(&sim, &with_dirs(&dirs, &real_end["request"])).await;
    assert_eq!(models(&got_end.body), models(&real_end["json"].to_string()));
}

/// Without `--enable-lora` vLLM still has the routes (with the environment variable) and
/// refuses the load in its worker; without the variable it has no routes at all.
#[tokio::test]
async fn a_load_without_enable_lora_is_refused_as_vllm_refuses_it() {
    let dirs = adapter_dirs();
    let real = adapter_fixture("adapters_load_without_enable_lora");
    let sim = lora_sim(false).await;
    let got = send(&sim, &with_dirs(&dirs, &real["request"])).await;
    let differences = compare("adapters_load_without_enable_lora", &real, &got);
    assert!(differences.is_empty(), "{}", differences.join("\n"));
    assert!(got.body.contains("LoRA is not enabled"), "{}", got.body);

    let plain = start(&["serve", "m", "--port", "0", "--enable-lora"]).await;
    let got = send(&plain, &with_dirs(&dirs, &real["request"])).await;
    assert_eq!(got.status, 404, "{}", got.body);
    assert!(got.body.contains("Not Found"), "{}", got.body);
}
