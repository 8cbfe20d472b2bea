//! `cargo bench -p capyctl-server --bench adapters`: CapyCTL's own share of LoRA adapter loads
//! (DESIGN 4.9, issue 31).
//!
//! A real standalone CapyCTL runs in this process with one base (`adapters: {max_loaded: M}`)
//! and M + 1 adapters, its engine the engine simulator (this binary run as `--engine-wrapper`,
//! `common::wrapper`: the `capyctl_engine_sim` library with the arguments and environment the
//! host agent gives `engine-sim`), whose adapter loads take `--load-ms`. Every request goes
//! through the inference listener (real sockets) and asks for one token (`max_tokens: 1`), so
//! its answer is its first token. Requests cycle over the M + 1 adapters, `--requests` times: the
//! first M find room (a load); every later one finds its adapter unloaded and every slot taken by
//! an idle adapter (the least recently used is unloaded, then its own loaded).
//!
//! The engine's time is timed inside the engine, as in `switch_share`: a layer in front of
//! the simulator's routes stamps each request on arrival (after HTTP parsing) and when its
//! answer is complete, and appends the call to a file. For each request, **own** =
//! the client's time to the first token less every engine call that began and ended within it
//! (the adapter list, unload, load and the answer; its load samples, `GET /metrics`, excluded):
//! socket transfer and HTTP parsing on both sides count as CapyCTL's, which errs against
//! CapyCTL. Printed: own for the first request (it also reads the engine's list of adapters,
//! once per instance), for loads into a free slot, for unload-then-load; and **switches/s**,
//! the later requests per second, against what the engine's own time alone would allow.
//!
//! Goal (issue 31): own share under 2 ms per load. Options: `--load-ms N` (50), `--max-loaded
//! M` (4), `--requests N` (200).

use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

mod common;

use capyctl_server::standalone::Standalone;
use capyctl_spec::documents::parse_standalone_str;
use capyctl_spec::overrides::Overrides;
use common::{HttpClient, http, now_us, read_calls};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

struct Opts {
    load_ms: u64,
    max_loaded: u32,
    requests: usize,
}

fn parse_args(args: &[String]) -> Result<Opts, String> {
    let mut o = Opts {
        load_ms: 50,
        max_loaded: 4,
        requests: 200,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut num = |flag: &str| -> Result<u64, String> {
            let v = it.next().ok_or_else(|| format!("{flag} needs a number"))?;
            v.parse()
                .map_err(|e| format!("{flag} {v}: not a number ({e})"))
        };
        match flag.as_str() {
            "--load-ms" => o.load_ms = num(flag)?,
            "--max-loaded" => {
                o.max_loaded = u32::try_from(num(flag)?).map_err(|e| format!("{flag}: {e}"))?;
            }
            "--requests" => o.requests = usize::try_from(num(flag)?).unwrap_or(usize::MAX),
            // cargo bench passes --bench.
            "--bench" => {}
            other => return Err(format!("unknown option {other}")),
        }
    }
    if o.max_loaded == 0 {
        return Err("--max-loaded must be at least 1".into());
    }
    Ok(o)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--engine-wrapper") {
        return common::wrapper::main(&args[2..]);
    }
    let o = match parse_args(&args[1..]) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("adapters bench: {e}");
            return ExitCode::from(2);
        }
    };
    common::run_to_end("adapters bench", run(o))
}

fn config_text(exe: &Path, calls: &Path, files: &Path, o: &Opts) -> String {
    let q = |s: &str| serde_json::Value::String(s.to_string()).to_string();
    let mut text = format!(
        r#"
server:
  listen:
    inference: "127.0.0.1:0"
    management: "127.0.0.1:0"
host:
  id: bench-box
  gpus: [{{memory: 10GiB}}]
  host_memory: 4GiB
  engines:
    vllm: {{command: [{exe}, "--engine-wrapper", {calls}]}}
deployments:
  - name: base
    engine: vllm
    model: Qwen3-4B
    resources: {{gpu_memory: 6GiB}}
    adapters: {{max_loaded: {m}, max_rank: 16}}
    env: {{ENGINE_SIM_ADAPTER_LOAD_TIME: "{load}ms", ENGINE_SIM_STARTUP_DELAY: 0s}}
"#,
        exe = q(&exe.to_string_lossy()),
        calls = q(&calls.to_string_lossy()),
        m = o.max_loaded,
        load = o.load_ms,
    );
    for i in 0..=o.max_loaded {
        let path = files.join(format!("a{i}"));
        text.push_str(&format!(
            "  - name: a{i}\n    adapter: {{base: base, path: {}}}\n",
            q(&path.to_string_lossy())
        ));
    }
    text
}

/// One POST that must answer 200, timed.
async fn timed(client: &HttpClient, url: String, body: String) -> Result<Duration, String> {
    let began = Instant::now();
    let (status, bytes) = http(client, "POST", url.clone(), None, Some(body)).await?;
    let took = began.elapsed();
    if status != 200 {
        return Err(format!(
            "{url}: {status} {}",
            String::from_utf8_lossy(&bytes)
        ));
    }
    Ok(took)
}

fn one_token(model: &str) -> String {
    serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 1,
    })
    .to_string()
}

async fn run(o: Opts) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let dir = std::env::temp_dir().join(format!("capyctl-adapters-bench-{}", std::process::id()));
    let files = dir.join("loras");
    for i in 0..=o.max_loaded {
        let a = files.join(format!("a{i}"));
        std::fs::create_dir_all(&a).map_err(|e| format!("{}: {e}", a.display()))?;
        std::fs::write(
            a.join("adapter_config.json"),
            r#"{"r": 8, "peft_type": "LORA"}"#,
        )
        .map_err(|e| format!("{}: {e}", a.display()))?;
    }
    let text = config_text(&exe, &dir.join("calls"), &files, &o);
    let config = parse_standalone_str("adapters.yaml", &text, &Overrides::none())
        .map_err(|e| format!("the benchmark's document: {e}"))?;
    let s = Standalone::start(config, dir.join("data"))
        .await
        .map_err(|e| format!("standalone: {e}"))?;
    let result = measure(&s, &dir.join("calls"), &o).await;
    s.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn measure(s: &Standalone, calls: &Path, o: &Opts) -> Result<(), String> {
    let client: HttpClient = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let inference = format!("http://{}/v1/chat/completions", s.inference_addr());
    // The base comes up (a start) and answers.
    for _ in 0..3 {
        timed(&client, inference.clone(), one_token("base")).await?;
    }
    let port = s
        .server()
        .view("base")
        .and_then(|v| v.instances.first().and_then(|i| i.port))
        .ok_or("the base has no engine port")?;
    // The engine's time within `[t0, t1]` (µs): its calls that began and ended there, but its
    // load samples (`GET /metrics`, off the request's path).
    let engine_us = |(t0, t1): (u64, u64)| -> u64 {
        read_calls(calls, port)
            .iter()
            .filter(|c| c.start >= t0 && c.end <= t1 && !c.is_background())
            .map(common::Call::us)
            .sum()
    };
    // Requests cycle over max_loaded + 1 adapters: each one finds its adapter unloaded.
    let k = o.max_loaded as usize + 1;
    let (mut first, mut cold, mut switched) = (None, Vec::new(), Vec::new());
    let (mut engine_total, mut wall) = (0u64, Duration::ZERO);
    for i in 0..o.requests.max(k) {
        let model = format!("a{}", i % k);
        let t0 = now_us();
        let took = timed(&client, inference.clone(), one_token(&model)).await?;
        let t1 = now_us();
        let engine = engine_us((t0, t1));
        let own = t1.saturating_sub(t0).saturating_sub(engine) as f64 / 1e3;
        if i == 0 {
            first = Some(own);
        } else if i < o.max_loaded as usize {
            cold.push(own);
        } else {
            wall += took;
            engine_total += engine;
            switched.push(own);
        }
    }
    let switches = switched.len();
    if let Some(first) = first {
        println!(
            "own share, the instance's first adapter request (its list, then a load): {first:.2} ms"
        );
    }
    println!(
        "own share, a load into a free slot ({} requests): {}",
        cold.len(),
        figures(&mut cold)
    );
    println!(
        "own share, an unload then a load ({switches} requests): {}",
        figures(&mut switched)
    );
    let per_s = switches as f64 / wall.as_secs_f64().max(1e-9);
    let ceiling = switches as f64 / (engine_total as f64 / 1e6).max(1e-9);
    println!(
        "adapter switches on one instance (max_loaded {}, {k} adapters in turn, load {} ms): {per_s:.1}/s; the engine's own time alone would allow {ceiling:.1}/s ({:.3} of it)",
        o.max_loaded,
        o.load_ms,
        per_s / ceiling
    );
    let median = |v: &[f64]| v.get(v.len() / 2).copied().unwrap_or(0.0);
    let worst = median(&cold).max(median(&switched));
    println!(
        "goal: own share under 2 ms per load: median {worst:.2} ms ({})",
        if worst < 2.0 { "met" } else { "NOT met" }
    );
    Ok(())
}

/// `median … p90 … max …` (ms) of `v`, sorted in place.
fn figures(v: &mut [f64]) -> String {
    if v.is_empty() {
        return "none".into();
    }
    v.sort_by(f64::total_cmp);
    let at = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    format!(
        "median {:.2} ms, p90 {:.2} ms, max {:.2} ms",
        at(0.5),
        at(0.9),
        at(1.0)
    )
}
