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

/// The `CUDA_VISIBLE_DEVICES` the engine process `pid` runs with.
fn visible_devices(pid: u64) -> String {
    let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    env.split(|b| *b == 0)
        .filter_map(|kv| std::str::from_utf8(kv).ok())
        .find_map(|kv| kv.strip_prefix("CUDA_VISIBLE_DEVICES="))
        .unwrap_or_default()
        .to_string()
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
