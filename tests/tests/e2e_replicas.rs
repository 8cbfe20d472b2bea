//! Replicas end to end (DESIGN 4.7): the real `capyctl start standalone` on a box of four
//! simulated GPUs, the engine simulator as every engine, real sockets. A deployment with
//! `replicas: 4` comes up on every GPU (each engine given its own GPU through
//! `CUDA_VISIBLE_DEVICES`, read from the engine processes themselves); a second model that
//! needs a GPU takes one instance only, and the deployment keeps serving from the others.
#![allow(clippy::unwrap_used)]

mod support;

use std::collections::BTreeSet;

use serde_json::Value;
use support::{Capy, chat, document, model, temp_dir};

/// [`document`] with four 10 GiB GPUs instead of one.
fn four_gpus(deployments: &[&str]) -> String {
    document("", "", deployments).replace(
        "gpus: [{memory: 10GiB}]",
        "gpus: [{memory: 10GiB}, {memory: 10GiB}, {memory: 10GiB}, {memory: 10GiB}]",
    )
}

/// The instances of `status` in state `ready`.
fn ready(status: &Value) -> Vec<&Value> {
    status["instances"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["state"] == "ready")
        .collect()
}

/// The `CUDA_VISIBLE_DEVICES` the engine process `pid` runs with (NVML's numbering: its
/// `CUDA_DEVICE_ORDER` is `PCI_BUS_ID`).
fn visible_devices(pid: u64) -> String {
    let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let var = |name: &str| {
        env.split(|b| *b == 0)
            .filter_map(|kv| std::str::from_utf8(kv).ok())
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
            .unwrap_or_default()
            .to_string()
    };
    assert_eq!(var("CUDA_DEVICE_ORDER"), "PCI_BUS_ID", "engine {pid}");
    var("CUDA_VISIBLE_DEVICES")
}

#[test]
fn replicas_come_up_on_distinct_gpus_and_memory_pressure_takes_one_instance() {
    let dir = temp_dir("replicas");
    let doc = four_gpus(&[&model("chat-r", "replicas: 4"), &model("chat-b", "")]);
    let capy = Capy::start(&dir, &doc);
    assert!(
        capy.list().contains("0/4"),
        "READY is ready/replicas: {}",
        capy.list()
    );

    // One request brings the deployment into use: every replica follows, one per GPU.
    assert_eq!(chat(capy.inference, "chat-r", false).status, 200);
    let s = capy.status_until("chat-r", "had 4 ready instances", |s| ready(s).len() == 4);
    assert_eq!(s["ready"], "4/4", "{s:#}");
    let ids: BTreeSet<String> = ready(&s)
        .iter()
        .map(|i| i["instance_id"].as_str().unwrap().to_string())
        .collect();
    let id = s["id"].as_str().unwrap();
    assert_eq!(
        ids,
        (0..4).map(|i| format!("{id}-{i}")).collect::<BTreeSet<_>>(),
        "instance IDs are <deployment id>-<index>"
    );
    let gpus: BTreeSet<String> = ready(&s)
        .iter()
        .map(|i| visible_devices(i["pid"].as_u64().unwrap()))
        .collect();
    assert_eq!(
        gpus,
        ["0", "1", "2", "3"].map(String::from).into(),
        "each instance runs on a GPU of its own"
    );
    assert!(
        capy.list().contains("chat-r   ready     4/4"),
        "{}",
        capy.list()
    );

    // kill -9 and a restart on the same data directory: every instance's engine is adopted
    // as it is (same process, same GPU).
    let pids: BTreeSet<u64> = ready(&s)
        .iter()
        .map(|i| i["pid"].as_u64().unwrap())
        .collect();
    capy.kill();
    let capy = Capy::start(&dir, &doc);
    let s = capy.status_until("chat-r", "adopted 4 instances", |s| ready(s).len() == 4);
    let adopted: BTreeSet<u64> = ready(&s)
        .iter()
        .map(|i| i["pid"].as_u64().unwrap())
        .collect();
    assert_eq!(adopted, pids, "{s:#}");
    let again: BTreeSet<String> = ready(&s)
        .iter()
        .map(|i| visible_devices(i["pid"].as_u64().unwrap()))
        .collect();
    assert_eq!(again, gpus);

    // chat-b needs 6 GiB of a GPU: one instance of chat-r gives its GPU, the others serve on.
    assert_eq!(chat(capy.inference, "chat-b", false).status, 200);
    let s = capy.status_until("chat-r", "had 3 ready instances", |s| ready(s).len() == 3);
    assert_eq!(s["ready"], "3/4", "{s:#}");
    let b = capy.status("chat-b");
    assert_eq!(b["ready"], "1/1", "{b:#}");
    let b_gpu = visible_devices(ready(&b)[0]["pid"].as_u64().unwrap());
    let r_gpus: BTreeSet<String> = ready(&s)
        .iter()
        .map(|i| visible_devices(i["pid"].as_u64().unwrap()))
        .collect();
    assert!(
        !r_gpus.contains(&b_gpu) && r_gpus.len() == 3,
        "chat-b took the GPU of the instance that left: {b_gpu} vs {r_gpus:?}"
    );
    for _ in 0..4 {
        assert_eq!(chat(capy.inference, "chat-r", false).status, 200);
    }
    // The instance that gave way is parked (it comes back when room frees).
    assert!(
        s["instances"]
            .as_array()
            .unwrap()
            .iter()
            .any(|i| i["state"] == "parked"),
        "{s:#}"
    );
}

/// Whether process `pid` is alive (and not a zombie).
fn alive(pid: u64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        !s.rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z')
    })
}

/// Polls `pred` until it holds (within the suite's patience).
fn until(what: &str, mut pred: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !pred() {
        assert!(start.elapsed() < Duration::from_secs(60), "never {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

use std::time::Duration;

#[test]
fn a_crashed_instance_fails_alone_and_stop_and_park_take_every_instance() {
    let dir = temp_dir("replicas-fail");
    let doc = four_gpus(&[&model("chat-r", "replicas: 3")]);
    let capy = Capy::start(&dir, &doc);
    assert_eq!(chat(capy.inference, "chat-r", false).status, 200);
    let s = capy.status_until("chat-r", "had 3 ready instances", |s| ready(s).len() == 3);

    // One engine dies: only its instance fails; the deployment serves from the other two.
    let victim = ready(&s)[1].clone();
    support::signal(victim["pid"].as_u64().unwrap() as u32, "KILL");
    let s = capy.status_until("chat-r", "showed the crash", |s| {
        s["instances"]
            .as_array()
            .unwrap()
            .iter()
            .any(|i| i["instance_id"] == victim["instance_id"] && i["state"] == "failed")
    });
    assert_eq!(ready(&s).len(), 2, "{s:#}");
    assert_eq!(s["ready"], "2/3", "{s:#}");
    for _ in 0..6 {
        assert_eq!(chat(capy.inference, "chat-r", false).status, 200);
    }

    // A park parks every ready instance; a stop stops every engine.
    let pids: Vec<u64> = ready(&s)
        .iter()
        .map(|i| i["pid"].as_u64().unwrap())
        .collect();
    capy.cli(&["park", "deployment", "chat-r"]).ok();
    let s = capy.status_until("chat-r", "parked both", |s| {
        s["instances"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|i| i["state"] == "parked")
            .count()
            == 2
    });
    assert_eq!(s["ready"], "0/3", "{s:#}");
    capy.cli(&["stop", "deployment", "chat-r"]).ok();
    let s = capy.status("chat-r");
    assert!(
        s["instances"]
            .as_array()
            .unwrap()
            .iter()
            .all(|i| i["state"] == "stopped" || i["state"] == "failed"),
        "{s:#}"
    );
    until("every engine of chat-r exited", || {
        pids.iter().all(|p| !alive(*p))
    });
    support::assert_error(
        &chat(capy.inference, "chat-r", false),
        409,
        "deployment_stopped",
        false,
    );
}

#[test]
fn scale_brings_instances_up_on_load_and_parks_them_after_the_delay() {
    let dir = temp_dir("replicas-scale");
    // 20 tokens a second: a request of 40 tokens runs for 2 s.
    let doc = four_gpus(&[&model(
        "chat-s",
        "replicas: 3\nscale: {min: 1, target_in_flight: 1, scale_down_delay: 1s}",
    )
    .replace(
        "env: {ENGINE_SIM_WEIGHTS_BYTES: 64MiB}",
        "env: {ENGINE_SIM_WEIGHTS_BYTES: 64MiB, ENGINE_SIM_TOKEN_RATE: \"20\"}",
    )]);
    let capy = Capy::start(&dir, &doc);
    assert_eq!(chat(capy.inference, "chat-s", false).status, 200);
    // In use with no load: min (1) runs.
    let s = capy.status_until("chat-s", "had one ready instance", |s| ready(s).len() == 1);
    assert_eq!(s["ready"], "1/3", "{s:#}");

    // Three long requests at once: more than one per ready instance, so instances come, one
    // at a time, up to replicas.
    let addr = capy.inference;
    let long = || {
        std::thread::spawn(move || {
            let body = serde_json::json!({
                "model": "chat-s",
                "messages": [{"role": "user", "content": "Count slowly."}],
                "max_tokens": 120,
                "stream": true,
            });
            support::request(
                addr,
                "POST",
                "/v1/chat/completions",
                &[("content-type", "application/json")],
                body.to_string().as_bytes(),
            )
            .status
        })
    };
    let running: Vec<_> = (0..3).map(|_| long()).collect();
    let s = capy.status_until("chat-s", "scaled up", |s| ready(s).len() >= 2);
    assert!(ready(&s).len() >= 2, "{s:#}");
    for r in running {
        assert_eq!(r.join().unwrap(), 200);
    }
    // The load gone, one goes after each delay, down to min.
    let s = capy.status_until("chat-s", "scaled down to min", |s| ready(s).len() == 1);
    assert!(
        s["instances"]
            .as_array()
            .unwrap()
            .iter()
            .any(|i| i["state"] == "parked"),
        "scaled down instances park: {s:#}"
    );
    let records = capy.cli(&["switches", "--json"]).ok();
    assert!(
        records.lines().any(|l| l.contains("\"cause\":\"scale\"")),
        "scaling is recorded: {records}"
    );
}

/// `start --evict` of a deployment with several instances makes room for every one (DESIGN
/// 4.7): on four GPUs, three held by other models and one free, `start --evict --wait` of a
/// deployment of three replicas takes the free GPU and parks two of the others; the receipt
/// names both victims.
#[test]
fn start_evict_makes_room_for_every_replica() {
    let dir = temp_dir("replicas-evict");
    let doc = four_gpus(&[
        &model("chat-a", ""),
        &model("chat-b", ""),
        &model("chat-c", ""),
        &model("chat-r", "replicas: 3"),
    ]);
    let capy = Capy::start(&dir, &doc);
    for name in ["chat-a", "chat-b", "chat-c"] {
        assert_eq!(chat(capy.inference, name, false).status, 200, "{name}");
    }
    let receipt: Value = serde_json::from_str(
        &capy
            .cli(&[
                "start",
                "deployment",
                "chat-r",
                "--evict",
                "--wait",
                "--json",
            ])
            .ok(),
    )
    .unwrap();
    let s = capy.status_until("chat-r", "had 3 ready instances", |s| ready(s).len() == 3);
    assert_eq!(s["ready"], "3/3", "{s:#}");
    let victims = receipt["victims"].as_array().unwrap();
    assert_eq!(victims.len(), 2, "{receipt:#}");
    let parked = ["chat-a", "chat-b", "chat-c"]
        .iter()
        .filter(|n| capy.status(n)["state"] == "parked")
        .count();
    assert_eq!(parked, 2);
}
