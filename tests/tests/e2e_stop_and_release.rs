//! Ending a start or a wake in progress, and a victim stopped for want of room in host RAM, end
//! to end: the real `capyctl` binary (`start standalone` and the commands), real sockets, the
//! engine simulator as every engine.
#![allow(clippy::unwrap_used)]

mod support;

use std::time::{Duration, Instant};

use capyctl_test_support::alive;
use support::{Capy, assert_error, chat, document, model, temp_dir};

/// What a command that ends a start in progress may take at most (the engine's ready timeout
/// is 1800 s, its stop grace 10 s; engine-sim ends on SIGTERM at once).
const PROMPT: Duration = Duration::from_secs(8);

/// The engine's pid of `name` while it starts: `status` shows it starting, and the agent's
/// record (`<data dir>/engines/<instance>.json`) names the process it launched.
fn starting_pid(capy: &Capy, name: &str) -> u64 {
    let s = capy.status_until(name, "showed a start", |s| s["state"] == "starting");
    let instance = s["instances"][0]["instance_id"]
        .as_str()
        .unwrap()
        .to_string();
    let record = capy.dir.join("engines").join(format!("{instance}.json"));
    let start = Instant::now();
    loop {
        if let Some(pid) = std::fs::read_to_string(&record)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| v["pid"].as_u64())
        {
            return pid;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no engine record at {}",
            record.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits (bounded) for `pid` to be gone.
#[track_caller]
fn gone_within(pid: u64, bound: Duration) {
    let start = Instant::now();
    while alive(pid) {
        assert!(
            start.elapsed() < bound,
            "engine {pid} still runs after {bound:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `start deployment NAME --evict --wait --json`: its receipt, which says it is ready.
#[track_caller]
fn start_evict_ready(capy: &Capy, name: &str) -> serde_json::Value {
    let json = capy
        .cli(&["start", "deployment", name, "--evict", "--wait", "--json"])
        .ok();
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["deployment"]["state"], "ready", "{v:#}");
    v
}

/// "When there is no room to keep a parked copy, CapyCTL stops the idle model instead and says
/// so": a victim that must keep its copy in host RAM (`residency: host_backed`) with no room
/// for it there is stopped, and the receipt (text and JSON) and its status say why.
#[test]
fn a_victim_without_room_for_its_copy_is_stopped_and_says_so() {
    let dir = temp_dir("no-room");
    // 32 MiB of host RAM: the 64 MiB copy never fits.
    let doc = document(
        "",
        "",
        &[
            &model("my-model", "residency: host_backed\n"),
            &model("other-model", ""),
        ],
    )
    .replace("host_memory: 1GiB", "host_memory: 32MiB");
    let capy = Capy::start(&dir, &doc);
    capy.cli(&["start", "deployment", "my-model", "--wait"])
        .ok();
    let receipt = capy
        .cli(&["start", "deployment", "other-model", "--evict", "--wait"])
        .ok();
    assert!(
        receipt.contains("    released: stopped (no room to park)\n"),
        "{receipt}"
    );
    let status = capy.status("my-model");
    assert_eq!(status["state"], "stopped", "{status:#}");
    assert_eq!(
        status["instances"][0]["last_error"], "released: stopped (no room to park)",
        "{status:#}"
    );
    // And the JSON receipt, once more the other way round.
    let v = start_evict_ready(&capy, "my-model");
    // other-model has no residency: its copy too large for host RAM parks deep.
    assert_eq!(v["victims"][0]["name"], "other-model", "{v:#}");
    assert_eq!(v["victims"][0]["released"], "parked", "{v:#}");

    // No room on the GPU to keep it parked either: a model that needs the whole GPU but for
    // less than other-model's parked residue (16 MiB) stops it, and says so.
    let big = dir.join("big-model.yaml");
    std::fs::write(
        &big,
        model("big-model", "").replace("gpu_memory: 6GiB", "gpu_memory: 10232MiB"),
    )
    .unwrap();
    capy.cli(&["deploy", "model", "--file", big.to_str().unwrap()])
        .ok();
    let v = start_evict_ready(&capy, "big-model");
    let released: Vec<(String, String)> = v["victims"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| {
            (
                v["name"].as_str().unwrap().to_string(),
                v["released"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    for name in ["my-model", "other-model"] {
        assert!(
            released.contains(&(name.to_string(), "stopped_no_room_to_park".to_string())),
            "{name}: {v:#}"
        );
        let status = capy.status(name);
        assert_eq!(
            status["instances"][0]["last_error"], "released: stopped (no room to park)",
            "{status:#}"
        );
    }
}

/// Item 5 of issue 16: `capyctl stop` while the engine hangs in its start answers at once, the
/// engine process is gone, and a request that waited for the start gets `deployment_stopped`.
#[test]
fn stop_ends_a_start_that_hangs() {
    let dir = temp_dir("stop-hung-start");
    let hangs = "env: {ENGINE_SIM_WEIGHTS_BYTES: 64MiB, ENGINE_SIM_STARTUP_DELAY: 3600s}\n";
    let doc = document(
        "",
        "",
        &[&model("my-model", "").replace("env: {ENGINE_SIM_WEIGHTS_BYTES: 64MiB}\n", hangs)],
    );
    let capy = Capy::start(&dir, &doc);
    // A request waits for the start.
    let inference = capy.inference;
    let waiting = std::thread::spawn(move || chat(inference, "my-model", false));
    let pid = starting_pid(&capy, "my-model");
    let began = Instant::now();
    let out = capy.cli(&["stop", "deployment", "my-model"]).ok();
    let took = began.elapsed();
    assert!(took < PROMPT, "stop took {took:?}: {out}");
    assert!(out.contains("state stopped"), "{out}");
    gone_within(pid, Duration::from_secs(2));
    let r = waiting.join().unwrap();
    assert_error(&r, 409, "deployment_stopped", false);
    assert_eq!(capy.status("my-model")["state"], "stopped");
    // It starts again on the operator's word (and hangs again: stopped once more).
    capy.cli(&["start", "deployment", "my-model"]).ok();
    let pid = starting_pid(&capy, "my-model");
    let began = Instant::now();
    capy.cli(&["delete", "deployment", "my-model"]).ok();
    assert!(
        began.elapsed() < PROMPT,
        "delete took {:?}",
        began.elapsed()
    );
    gone_within(pid, Duration::from_secs(2));
}

/// `start --evict` of a model that needs the memory of one whose start hangs (no request
/// waiting for it) ends that start: the engine is stopped and named a victim, and the
/// evicting start goes on.
#[test]
fn start_evict_ends_a_start_that_hangs() {
    let dir = temp_dir("evict-hung-start");
    let hangs = "env: {ENGINE_SIM_WEIGHTS_BYTES: 64MiB, ENGINE_SIM_STARTUP_DELAY: 3600s}\n";
    let doc = document(
        "",
        "",
        &[
            &model("my-model", "").replace("env: {ENGINE_SIM_WEIGHTS_BYTES: 64MiB}\n", hangs),
            &model("other-model", ""),
        ],
    );
    let capy = Capy::start(&dir, &doc);
    capy.cli(&["start", "deployment", "my-model"]).ok();
    let pid = starting_pid(&capy, "my-model");
    let began = Instant::now();
    let receipt = capy
        .cli(&["start", "deployment", "other-model", "--evict", "--wait"])
        .ok();
    assert!(began.elapsed() < PROMPT + PROMPT, "{receipt}");
    assert!(receipt.contains("state ready, ready 1/1"), "{receipt}");
    assert!(
        receipt.contains("(my-model)\n") && receipt.contains("    released: stopped\n"),
        "{receipt}"
    );
    gone_within(pid, Duration::from_secs(2));
    let s = capy.status("my-model");
    assert_eq!(s["state"], "stopped", "{s:#}");
    assert_eq!(capy.status("other-model")["state"], "ready");
}

/// Issue 16, item 7: a document needing more GPU memory than the host has is refused at
/// deploy, naming the key and the host's GPU memory; refused as an update, the working
/// revision stays.
#[test]
fn a_deployment_no_host_can_place_is_refused_at_deploy() {
    let dir = temp_dir("too-large");
    let capy = Capy::start(&dir, &document("", "", &[&model("my-model", "")]));
    let file = dir.join("my-model.yaml");
    std::fs::write(
        &file,
        model("my-model", "").replace("gpu_memory: 6GiB", "gpu_memory: 12GiB"),
    )
    .unwrap();
    let err = capy
        .cli(&["deploy", "model", "--file", file.to_str().unwrap()])
        .fails();
    assert!(
        err.contains("resources.gpu_memory: 12.0 GiB")
            && err.contains("the largest: 10.0 GiB on host gpu-box")
            && err.ends_with("(does_not_fit)"),
        "{err}"
    );
    let status = capy.status("my-model");
    assert_eq!(status["revision"], 1, "{status:#}");
    assert_eq!(
        status["spec"]["resources"]["gpu_memory"], "6GiB",
        "{status:#}"
    );
}

/// A host drain, end to end: `capyctl drain host` stops what runs there (an explicit model
/// too, whose engine process goes away), a request then is refused at once naming the
/// drained host, and `capyctl uncordon host` puts it back in service.
#[test]
fn a_drained_host_stops_its_engines_and_serves_again_once_uncordoned() {
    let dir = temp_dir("drain");
    let doc = document(
        "",
        "",
        &[
            &model("chat-a", ""),
            &model("chat-x", "lifecycle: {activation: explicit}\n"),
        ],
    );
    let capy = Capy::start(&dir, &doc);
    capy.cli(&["start", "deployment", "chat-x", "--wait"]).ok();
    let pid = capy.status("chat-x")["instances"][0]["pid"]
        .as_u64()
        .unwrap();
    assert!(alive(pid));

    let receipt = capy.cli(&["drain", "host", "gpu-box"]).ok();
    assert!(
        receipt.starts_with("drained host gpu-box: out of service, 1 instance(s) stopped\n"),
        "{receipt}"
    );
    assert!(receipt.contains("(chat-x)\n"), "{receipt}");
    assert!(receipt.contains("    released: stopped\n"), "{receipt}");
    gone_within(pid, PROMPT);
    assert_eq!(capy.status("chat-x")["state"], "stopped");
    let r = chat(capy.inference, "chat-a", false);
    let message = assert_error(&r, 409, "does_not_fit", false);
    assert!(
        message.contains("host gpu-box is drained") && message.contains("uncordon"),
        "{message}"
    );
    let hosts = capy.management_get("/management/v1/hosts").json();
    assert_eq!(hosts["hosts"][0]["cordoned"], true, "{hosts:#}");

    let back = capy.cli(&["uncordon", "host", "gpu-box"]).ok();
    assert_eq!(back, "uncordoned host gpu-box: in service\n");
    assert_eq!(chat(capy.inference, "chat-a", false).status, 200);
    let e = capy.cli(&["drain", "host", "gpu-z"]).fails();
    assert!(e.contains("host gpu-z not found"), "{e}");
}
