//! `capyctl simulate` against reality: a standalone with the engine simulator serves a fixed
//! trace of alternating waves for two models on a GPU that holds one; the trace it recorded
//! (`capyctl switches --export-trace`) is replayed by `capyctl simulate` with the same
//! document, and the simulated waits of the requests that waited are within 10% of the
//! measured ones (median and mean, per model).
#![allow(clippy::unwrap_used)]

mod support;

use std::time::{Duration, Instant};

use support::{Capy, document, request, temp_dir};

/// A deployment whose engine-sim parks and wakes in about 2 s (2 GiB of weights at 1 GiB/s)
/// and answers 20 tokens a second (the wake's check prompt and warm-up: 17 tokens, 0.85 s).
fn slow_model(name: &str) -> String {
    format!(
        "name: {name}\nengine: vllm\nmodel: Qwen3-4B\nresources: {{gpu_memory: 6GiB, weights_memory: 2GiB}}\n\
         env: {{ENGINE_SIM_WEIGHTS_BYTES: 2GiB, ENGINE_SIM_HOST_BANDWIDTH: 1GiB, ENGINE_SIM_TOKEN_RATE: \"20\"}}\n"
    )
}

/// One request of the trace the test drives: when (from the start), for which model, how many
/// tokens (20 a second).
const TRACE: [(u64, &str, u32); 20] = [
    // b is ready: nobody waits.
    (0, "sim-b", 20),
    (0, "sim-b", 30),
    (0, "sim-b", 20),
    (300, "sim-b", 20),
    // a's wave: b parks (2 s), a wakes (2 s and its check); one joins the wave late.
    (12_000, "sim-a", 20),
    (12_000, "sim-a", 30),
    (12_000, "sim-a", 20),
    (13_500, "sim-a", 20),
    (24_000, "sim-b", 20),
    (24_000, "sim-b", 30),
    (24_000, "sim-b", 20),
    (25_500, "sim-b", 20),
    (36_000, "sim-a", 30),
    (36_000, "sim-a", 20),
    (36_000, "sim-a", 20),
    (37_500, "sim-a", 20),
    (48_000, "sim-b", 20),
    (48_000, "sim-b", 20),
    (48_000, "sim-b", 30),
    (49_500, "sim-b", 20),
];

/// Median (nearest rank) and mean, in milliseconds.
fn p50_and_mean(mut v: Vec<u64>) -> (u64, u64) {
    assert!(!v.is_empty());
    v.sort_unstable();
    let p50 = v[v.len().div_ceil(2) - 1];
    (p50, v.iter().sum::<u64>() / v.len() as u64)
}

#[test]
fn simulated_waits_are_within_ten_percent_of_the_measured_ones() {
    let dir = temp_dir("simulate");
    let doc = document("", "", &[&slow_model("sim-a"), &slow_model("sim-b")])
        .replace("host_memory: 1GiB", "host_memory: 8GiB")
        .replace("admission_window: 100ms", "admission_window: 1s");
    let capy = Capy::start(&dir, &doc);
    // As the simulation begins: each started once, in document order (a parked, b ready).
    capy.cli(&["start", "deployment", "sim-a", "--wait"]).ok();
    capy.cli(&["start", "deployment", "sim-b", "--evict", "--wait"])
        .ok();
    assert_eq!(capy.status("sim-a")["state"], "parked");

    let start = Instant::now();
    let threads: Vec<_> = TRACE
        .iter()
        .map(|&(at, model, tokens)| {
            let addr = capy.inference;
            std::thread::spawn(move || {
                let due = start + Duration::from_millis(at);
                std::thread::sleep(due.saturating_duration_since(Instant::now()));
                let body = serde_json::json!({
                    "model": model,
                    "messages": [{"role": "user", "content": "Tell me about capybaras."}],
                    "max_tokens": tokens,
                });
                let r = request(
                    addr,
                    "POST",
                    "/v1/chat/completions",
                    &[("content-type", "application/json")],
                    body.to_string().as_bytes(),
                );
                assert_eq!(r.status, 200, "{model} at {at} ms: {r:?}");
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }

    let trace = dir.join("recorded.jsonl");
    capy.cli(&["switches", "--export-trace", trace.to_str().unwrap()])
        .ok();
    let recorded: Vec<serde_json::Value> = std::fs::read_to_string(&trace)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(recorded.len(), TRACE.len(), "{recorded:#?}");
    assert!(
        recorded.iter().all(|r| r["outcome"] == "ok"),
        "{recorded:#?}"
    );

    // Once with the engine times the document gives (weights over the host bandwidth), once
    // with those the server measured (its switch records, `--measured`).
    let file = capy.file.to_str().unwrap();
    let trace = trace.to_str().unwrap();
    let from_document = [
        "simulate",
        "--trace",
        trace,
        "--file",
        file,
        "--set",
        "simulate.host_bandwidth=1GiB/s",
        "--set",
        "simulate.token_rate=20",
        "--json",
    ];
    let measured = [
        "simulate",
        "--trace",
        trace,
        "--file",
        file,
        "--measured",
        "--set",
        "simulate.token_rate=20",
        "--json",
    ];
    for (how, args) in [
        ("document", &from_document[..]),
        ("measured", &measured[..]),
    ] {
        let out = capy.cli(args).ok();
        let reports: serde_json::Value = serde_json::from_str(&out).unwrap();
        let models = reports[0]["models"].as_array().unwrap();
        for model in ["sim-a", "sim-b"] {
            let measured: Vec<u64> = recorded
                .iter()
                .filter(|r| r["model"] == model)
                .map(|r| r["waited_ms"].as_u64().unwrap())
                .filter(|w| *w >= 100)
                .collect();
            let simulated = models.iter().find(|m| m["model"] == model).unwrap();
            assert_eq!(
                simulated["waited"].as_u64().unwrap(),
                measured.len() as u64,
                "{how}, {model}: measured {measured:?}, simulated {simulated:#}"
            );
            let (p50, mean) = p50_and_mean(measured.clone());
            let within = |sim: &serde_json::Value, real: u64, what: &str| {
                let sim = sim.as_u64().unwrap();
                let off = sim.abs_diff(real) as f64 / real as f64;
                eprintln!(
                    "{how}, {model} {what}: measured {real} ms, simulated {sim} ms ({:.1}% off)",
                    off * 100.0
                );
                assert!(
                    off <= 0.10,
                    "{how}, {model} {what}: measured {real} ms, simulated {sim} ms; measured {measured:?}, simulated {simulated:#}"
                );
            };
            within(&simulated["waited_p50_ms"], p50, "p50");
            within(&simulated["waited_mean_ms"], mean, "mean");
        }
    }
}
