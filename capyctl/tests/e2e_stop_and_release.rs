//! A victim stopped for want of room to keep it parked, end to end: the real `capyctl` binary
//! (`start standalone` and the commands), real sockets, the engine simulator as every engine.
#![allow(clippy::unwrap_used)]

mod support;

use support::{Capy, document, model, temp_dir};

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
