//! The product page's sequences, end to end: the real `capyctl` binary (`start standalone` and
//! the commands), real sockets, the engine simulator as every engine. The tables are compared
//! byte for byte with the product page's.
#![allow(clippy::unwrap_used)]

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use support::{
    Capy, assert_error, chat, document, id_of, metric, metric_reaching, model, temp_dir,
};

const MY_MODEL_PARKED: &str = "NAME       STATE    READY   REVISION   HOSTS\n\
                               my-model   parked   0/1     1          gpu-box\n";
const MY_MODEL_READY: &str = "NAME       STATE   READY   REVISION   HOSTS\n\
                              my-model   ready   1/1     1          gpu-box\n";

/// "Park and wake": park runs in the background until `list deployments` shows parked; a
/// request wakes the model and is answered.
#[test]
fn park_and_wake() {
    let dir = temp_dir("park-and-wake");
    let capy = Capy::start(&dir, &document("", "", &[]));
    let file = dir.join("my-model.yaml");
    std::fs::write(&file, model("my-model", "")).unwrap();
    let out = capy
        .cli(&["deploy", "model", "--file", file.to_str().unwrap()])
        .ok();
    assert!(out.contains("deployment my-model (") && out.contains(") created, revision 1"));
    let out = capy
        .cli(&["start", "deployment", "my-model", "--wait"])
        .ok();
    assert!(out.contains("state ready, ready 1/1"), "{out}");
    assert_eq!(capy.list(), MY_MODEL_READY);

    let out = capy.cli(&["park", "deployment", "my-model"]).ok();
    assert!(out.starts_with("park deployment my-model ("), "{out}");
    capy.list_until(MY_MODEL_PARKED);
    let status = capy.status("my-model");
    assert_eq!(
        status["instances"][0]["parked_tier"], "host_ram",
        "{status:#}"
    );

    let r = chat(capy.inference, "my-model", false);
    assert_eq!(r.status, 200, "{r:?}");
    assert!(r.json()["choices"][0]["message"]["content"].is_string());
    assert_eq!(capy.list(), MY_MODEL_READY);
    assert_eq!(
        metric(
            &capy,
            r#"capyctl_wakes_total{tier="host_ram",outcome="ok"}"#
        ),
        1.0
    );
}

/// "Switch between models": `start --evict --wait` parks the idle model and names it in its
/// receipt; a request switches back; a start without `--evict` parks nothing.
#[test]
fn switch_between_models() {
    let dir = temp_dir("switch");
    let capy = Capy::start(&dir, &document("", "", &[&model("my-model", "")]));
    capy.cli(&["start", "deployment", "my-model", "--wait"])
        .ok();
    let my_id = id_of(&capy, "my-model");
    let my_instance = capy.status("my-model")["instances"][0]["instance_id"]
        .as_str()
        .unwrap()
        .to_string();
    let file = dir.join("other-model.yaml");
    std::fs::write(&file, model("other-model", "")).unwrap();
    capy.cli(&["deploy", "model", "--file", file.to_str().unwrap()])
        .ok();

    let receipt = capy
        .cli(&["start", "deployment", "other-model", "--evict", "--wait"])
        .ok();
    assert!(receipt.contains("state ready, ready 1/1"), "{receipt}");
    assert!(receipt.contains("\nswitch_id: "), "{receipt}");
    assert!(
        receipt.contains(&format!(
            "victims:\n  - deployment: {my_id} (my-model)\n    instance: {my_instance}\n    released: parked\n"
        )),
        "{receipt}"
    );
    let json = capy
        .cli(&["start", "deployment", "other-model", "--json"])
        .ok();
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["deployment"]["state"], "ready", "{v:#}");
    assert_eq!(
        capy.list(),
        "NAME          STATE    READY   REVISION   HOSTS\n\
         my-model      parked   0/1     1          gpu-box\n\
         other-model   ready    1/1     1          gpu-box\n"
    );

    let r = chat(capy.inference, "my-model", false);
    assert_eq!(r.status, 200, "{r:?}");
    capy.list_until(
        "NAME          STATE    READY   REVISION   HOSTS\n\
         my-model      ready    1/1     1          gpu-box\n\
         other-model   parked   0/1     1          gpu-box\n",
    );

    // Without --evict a start never parks anything: it waits for memory.
    let out = capy.cli(&["start", "deployment", "other-model"]).ok();
    assert!(out.contains("waiting_for_memory"), "{out}");
    assert_eq!(capy.status("my-model")["state"], "ready");
    assert_eq!(capy.status("other-model")["state"], "parked");
    // A start with --evict takes a waiting start over.
    let receipt = capy
        .cli(&["start", "deployment", "other-model", "--evict", "--wait"])
        .ok();
    assert!(receipt.contains("released: parked"), "{receipt}");
    // So does a request: my-model waits for memory, a request for it switches.
    let out = capy.cli(&["start", "deployment", "my-model"]).ok();
    assert!(out.contains("waiting_for_memory"), "{out}");
    let r = chat(capy.inference, "my-model", false);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(capy.status("my-model")["state"], "ready");
    assert_eq!(capy.status("other-model")["state"], "parked");
    // `--json` prints the API's receipt: victims and switch_id.
    let json = capy
        .cli(&[
            "start",
            "deployment",
            "other-model",
            "--evict",
            "--wait",
            "--json",
        ])
        .ok();
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["deployment"]["state"], "ready", "{v:#}");
    assert!(
        v["switch_id"]
            .as_str()
            .is_some_and(|s| s.starts_with("sw-")),
        "{v:#}"
    );
    assert_eq!(
        v["victims"],
        serde_json::json!([{
            "deployment_id": my_id,
            "name": "my-model",
            "instance_id": my_instance,
            "released": "parked",
        }]),
        "{v:#}"
    );
    // The hosts route of the real server: this host, its GPU and its engines.
    let hosts = capy.management_get("/management/v1/hosts");
    assert_eq!(hosts.status, 200, "{hosts:?}");
    let hosts = hosts.json();
    assert_eq!(hosts["hosts"][0]["id"], "gpu-box", "{hosts:#}");
    assert_eq!(
        hosts["hosts"][0]["gpus"][0]["memory"],
        10u64 << 30,
        "{hosts:#}"
    );
    assert_eq!(hosts["hosts"][0]["host_memory"], 1u64 << 30, "{hosts:#}");
    // my-model's 64 MiB copy is parked in host RAM.
    assert_eq!(
        hosts["hosts"][0]["host_memory_used"],
        64u64 << 20,
        "{hosts:#}"
    );
    assert_eq!(hosts["hosts"][0]["activation"], "on_demand", "{hosts:#}");
}

/// "Example: two apps, one GPU": App 1 keeps streaming from chat-a; App 2's three requests
/// for chat-b make one switch and are answered together; App 1's requests meanwhile are
/// answered, or refused with the drain's 503, or wait and switch back; nothing is cut off.
#[test]
fn two_apps_one_gpu() {
    let dir = temp_dir("two-apps");
    let slow = "env: {ENGINE_SIM_WEIGHTS_BYTES: 64MiB, ENGINE_SIM_TOKEN_RATE: \"40\"}\n";
    let doc = document(
        "",
        "",
        &[
            &model("chat-a", "").replace("env: {ENGINE_SIM_WEIGHTS_BYTES: 64MiB}\n", slow),
            &model("chat-b", ""),
        ],
    )
    .replace("admission_window: 100ms", "admission_window: 500ms");
    let capy = Arc::new(Capy::start(&dir, &doc));
    capy.cli(&["start", "deployment", "chat-a", "--wait"]).ok();
    let a_id = id_of(&capy, "chat-a");
    let switches_before = metric(&capy, r#"capyctl_switches_total{outcome="ok"}"#);

    // App 1: a stream from chat-a after another (8 tokens at 40/s: about 200 ms each).
    let stop = Arc::new(AtomicBool::new(false));
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let app1 = {
        let (capy, stop) = (capy.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut answers = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let sent = Instant::now();
                answers.push((sent, chat(capy.inference, "chat-a", true), Instant::now()));
                let _ = started_tx.send(());
            }
            answers
        })
    };
    // App 1 is going once its first answer is in.
    started_rx.recv().unwrap();

    // App 2: three requests for chat-b at once.
    let t0 = Instant::now();
    let barrier = Arc::new(Barrier::new(3));
    let app2: Vec<_> = (0..3)
        .map(|_| {
            let (capy, barrier) = (capy.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let r = chat(capy.inference, "chat-b", false);
                (r, Instant::now())
            })
        })
        .collect();
    let app2: Vec<_> = app2.into_iter().map(|t| t.join().unwrap()).collect();
    for (r, _) in &app2 {
        assert_eq!(r.status, 200, "{r:?}");
    }
    // One switch for the wave, its window the full 500 ms (App 1 kept chat-a busy).
    assert_eq!(
        metric_reaching(
            &capy,
            r#"capyctl_switches_total{outcome="ok"}"#,
            switches_before + 1.0
        ),
        switches_before + 1.0
    );
    let window = metric(
        &capy,
        r#"capyctl_switch_phase_seconds_sum{phase="admission_window",engine="vllm"}"#,
    );
    assert!((0.45..5.0).contains(&window), "window {window} s");
    // chat-a parks, chat-b starts cold.
    for phase in ["drain", "park", "start", "release"] {
        let count = metric(
            &capy,
            &format!(r#"capyctl_switch_phase_seconds_count{{phase="{phase}",engine="vllm"}}"#),
        );
        assert!(count >= 1.0, "{phase}: {count}");
    }
    // Released together: the three answers came within a short time of each other.
    let first = app2.iter().map(|(_, t)| *t).min().unwrap();
    let last = app2.iter().map(|(_, t)| *t).max().unwrap();
    assert!(last - first < Duration::from_secs(1), "{:?}", last - first);
    // chat-b did not wait for App 1's window to be extended by its own traffic: the window is
    // 500 ms from the switch's start; the switch (window, drain, park, wake) took seconds at
    // most.
    assert!(first - t0 >= Duration::from_millis(400), "{:?}", first - t0);

    stop.store(true, Ordering::Relaxed);
    let answers = app1.join().unwrap();
    let closed = format!("dispatch to deployment {a_id} is closed; retry shortly");
    let mut served_in_window = 0;
    for (sent, r, done) in &answers {
        match r.status {
            200 => {
                assert!(
                    r.body.trim_end().ends_with("data: [DONE]"),
                    "cut off: {r:?}"
                );
                if *sent > t0 && *done < first {
                    served_in_window += 1;
                }
            }
            503 => assert_eq!(assert_error(r, 503, "unavailable", true), closed),
            _ => panic!("App 1 got {r:?}"),
        }
    }
    assert!(
        served_in_window >= 1,
        "chat-a took no new request in the admission window: {answers:?}"
    );
    // App 1's requests after the switch began waiting for chat-a and switched back.
    capy.list_until(
        "NAME     STATE    READY   REVISION   HOSTS\n\
         chat-a   ready    1/1     1          gpu-box\n\
         chat-b   parked   0/1     1          gpu-box\n",
    );
}

/// "Only on your command": an explicit model is never started or woken by a request (409 with
/// the page's message), never parked to make room, and moves only when told.
#[test]
fn only_on_your_command() {
    let dir = temp_dir("explicit");
    let doc = document(
        "",
        "",
        &[
            &model("my-model", "lifecycle: {activation: explicit}\n"),
            &model("other-model", ""),
        ],
    );
    let capy = Capy::start(&dir, &doc);
    let id = id_of(&capy, "my-model");
    let r = chat(capy.inference, "my-model", false);
    let message = assert_error(&r, 409, "deployment_inactive", false);
    assert_eq!(
        message,
        format!(
            "deployment {id} is not running and its activation is explicit (lifecycle.activation: explicit); inference does not start or wake it; start it with `capyctl start deployment {id}`"
        )
    );
    assert_eq!(capy.status("my-model")["state"], "stopped");
    let status = capy
        .cli(&["status", "deployment", "my-model", "--json"])
        .ok();
    assert!(status.contains("\"activation\": \"explicit\""), "{status}");

    capy.cli(&["start", "deployment", "my-model", "--wait"])
        .ok();
    assert_eq!(chat(capy.inference, "my-model", false).status, 200);

    // other-model needs my-model's memory: neither a request nor --evict moves my-model.
    let refused = capy
        .cli(&["start", "deployment", "other-model", "--evict", "--wait"])
        .fails();
    assert!(
        refused.contains("my-model") || refused.contains(&id),
        "{refused}"
    );
    assert_eq!(capy.status("my-model")["state"], "ready");
    let r = chat(capy.inference, "other-model", false);
    let message = assert_error(&r, 409, "does_not_fit", false);
    assert!(message.contains("my-model"), "{message}");
    assert_eq!(capy.status("my-model")["state"], "ready");
    assert_eq!(chat(capy.inference, "my-model", false).status, 200);

    // Parked on command; a request still does not wake it.
    capy.cli(&["park", "deployment", "my-model"]).ok();
    capy.status_until("my-model", "parked", |s| s["state"] == "parked");
    let r = chat(capy.inference, "my-model", false);
    assert_error(&r, 409, "deployment_inactive", false);
    assert_eq!(capy.status("my-model")["state"], "parked");
}

/// "No waiting": with `max_pending_per_deployment: 0` (here through `--set`) a request for a
/// model that is not loaded is refused at once with 429 and Retry-After, and still starts it;
/// an operator-stopped or explicit model is answered 409.
#[test]
fn no_waiting() {
    let dir = temp_dir("no-waiting");
    let doc = document(
        "",
        "",
        &[
            &model("chat-a", ""),
            &model("chat-x", "lifecycle: {activation: explicit}\n"),
        ],
    );
    let capy = Capy::start_with(
        &dir,
        &doc,
        &[
            "--set",
            "host.resource_policy.queue.max_pending_per_deployment=0",
        ],
        &[],
    );
    let id = id_of(&capy, "chat-a");
    let asked = Instant::now();
    let r = chat(capy.inference, "chat-a", false);
    assert!(asked.elapsed() < Duration::from_secs(2), "it waited");
    let message = assert_error(&r, 429, "queue_full", true);
    assert_eq!(
        message,
        format!("deployment {id} is not servable now and lets no request wait; retry shortly")
    );
    assert_eq!(r.header("retry-after"), Some("1"));
    // Its start was asked for: a retry after the hint finds it loaded.
    capy.status_until("chat-a", "ready", |s| s["state"] == "ready");
    assert_eq!(chat(capy.inference, "chat-a", false).status, 200);

    capy.cli(&["stop", "deployment", "chat-a"]).ok();
    capy.status_until("chat-a", "stopped", |s| s["state"] == "stopped");
    let r = chat(capy.inference, "chat-a", false);
    assert_error(&r, 409, "deployment_stopped", false);
    let r = chat(capy.inference, "chat-x", false);
    assert_error(&r, 409, "deployment_inactive", false);
    assert_eq!(capy.status("chat-x")["state"], "stopped");
}

/// "Idle models": `ready_idle_timeout` parks an idle model, `parked_idle_timeout` then stops
/// it; an explicit model is never moved by the timers.
#[test]
fn idle_models() {
    let dir = temp_dir("idle");
    let doc = document(
        "",
        "  lifecycle_defaults:\n    ready_idle_timeout: 1s\n    parked_idle_timeout: 1s\n",
        &[
            &model("chat-a", "resources: {gpu_memory: 4GiB, weights_memory: 64MiB}\n")
                .replace("resources: {gpu_memory: 6GiB, weights_memory: 64MiB}\n", ""),
            &model(
                "chat-x",
                "lifecycle: {activation: explicit}\nresources: {gpu_memory: 4GiB, weights_memory: 64MiB}\n",
            )
            .replace("resources: {gpu_memory: 6GiB, weights_memory: 64MiB}\n", ""),
        ],
    );
    let capy = Capy::start(&dir, &doc);
    capy.cli(&["start", "deployment", "chat-x", "--wait"]).ok();
    capy.cli(&["start", "deployment", "chat-a", "--wait"]).ok();
    capy.status_until("chat-a", "parked by its idle timer", |s| {
        s["state"] == "parked"
    });
    capy.status_until("chat-a", "stopped by its idle timer", |s| {
        s["state"] == "stopped"
    });
    // A timer stop is a pressure stop: a request starts the model again.
    assert_eq!(chat(capy.inference, "chat-a", false).status, 200);
    // The explicit model stayed ready the whole time.
    assert_eq!(capy.status("chat-x")["state"], "ready");
}

/// The README's first session on `examples/standalone.yaml` (with this build's simulator, free
/// ports, and faster simulated copies): a request starts chat-a, one for chat-b switches, one
/// for chat-a switches back and wakes it.
#[test]
fn the_readme_session_on_the_example() {
    let dir = temp_dir("readme");
    let example = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/standalone.yaml"
    ))
    .unwrap();
    let doc = example
        .replace(
            "target/release/engine-sim",
            &support::engine_sim().display().to_string(),
        )
        .replace("127.0.0.1:8080", "127.0.0.1:0")
        .replace("127.0.0.1:7443", "127.0.0.1:0")
        .replace(
            "ENGINE_SIM_HOST_BANDWIDTH: 4GiB",
            "ENGINE_SIM_HOST_BANDWIDTH: 1TiB",
        )
        .replace(
            "ENGINE_SIM_TOKEN_RATE: \"20\"",
            "ENGINE_SIM_TOKEN_RATE: \"0\"",
        );
    assert_ne!(doc, example);
    let capy = Capy::start(&dir, &doc);
    assert!(
        capy.banner.contains("deployments: chat-a, chat-b"),
        "{}",
        capy.banner
    );
    assert_eq!(
        capy.list(),
        "NAME     STATE     READY   REVISION   HOSTS\n\
         chat-a   stopped   0/1     1          gpu-box\n\
         chat-b   stopped   0/1     1          gpu-box\n"
    );
    assert_eq!(chat(capy.inference, "chat-a", false).status, 200);
    assert_eq!(chat(capy.inference, "chat-b", false).status, 200);
    assert_eq!(
        capy.list(),
        "NAME     STATE    READY   REVISION   HOSTS\n\
         chat-a   parked   0/1     1          gpu-box\n\
         chat-b   ready    1/1     1          gpu-box\n"
    );
    assert_eq!(chat(capy.inference, "chat-a", false).status, 200);
    assert_eq!(
        capy.list(),
        "NAME     STATE    READY   REVISION   HOSTS\n\
         chat-a   ready    1/1     1          gpu-box\n\
         chat-b   parked   0/1     1          gpu-box\n"
    );
    // `start --evict --wait` parks chat-a, wakes chat-b, and its receipt names both.
    let receipt = capy
        .cli(&["start", "deployment", "chat-b", "--evict", "--wait"])
        .ok();
    let chat_a = capy.status("chat-a");
    let a_id = chat_a["id"].as_str().unwrap();
    assert!(
        receipt.starts_with("start deployment chat-b (")
            && receipt.contains("state ready, ready 1/1"),
        "{receipt}"
    );
    assert!(receipt.contains("\nswitch_id: sw-"), "{receipt}");
    assert!(
        receipt.contains(&format!(
            "victims:\n  - deployment: {a_id} (chat-a)\n    instance: {a_id}-0\n    released: parked\n"
        )),
        "{receipt}"
    );
    // `park` answers at once; `list` shows parked once the park has run.
    let parked = capy.cli(&["park", "deployment", "chat-b"]).ok();
    assert!(parked.starts_with("park deployment chat-b ("), "{parked}");
    capy.list_until(
        "NAME     STATE    READY   REVISION   HOSTS\n\
         chat-a   parked   0/1     1          gpu-box\n\
         chat-b   parked   0/1     1          gpu-box\n",
    );
    let file = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/my-model.yaml");
    let out = capy.cli(&["deploy", "model", "--file", file]).ok();
    assert!(out.contains("my-model"), "{out}");
    let engines = capy.cli(&["engine", "list"]).ok();
    assert!(
        engines.starts_with("ENGINE       VERSION   DEEP PARK"),
        "{engines}"
    );
}

/// "--wait waits for the checkpoint measurement, then for the model to be ready. Without it, a
/// newly deployed checkpoint can still be awaiting measurement and the start is refused."
#[test]
fn a_start_awaits_the_measurement_only_with_wait() {
    let dir = temp_dir("measurement");
    let capy = Capy::start(&dir, &document("", "", &[]));
    let file = dir.join("fresh.yaml");
    std::fs::write(
        &file,
        "name: fresh\nengine: vllm\nmodel: Qwen3-4B\nenv: {ENGINE_SIM_WEIGHTS_BYTES: 64MiB, ENGINE_SIM_GPU_MEMORY_BYTES: 2GiB}\n",
    )
    .unwrap();
    capy.cli(&["deploy", "model", "--file", file.to_str().unwrap()])
        .ok();
    assert_eq!(
        capy.list(),
        "NAME    STATE                  READY   REVISION   HOSTS\n\
         fresh   awaiting_measurement   0/1     1          gpu-box\n"
    );
    let line = capy.cli(&["start", "deployment", "fresh"]).fails();
    assert!(line.ends_with("(awaiting_measurement)"), "{line}");
    assert_eq!(capy.status("fresh")["state"], "awaiting_measurement");

    let out = capy.cli(&["start", "deployment", "fresh", "--wait"]).ok();
    assert!(out.contains("state ready, ready 1/1"), "{out}");
    // Without NVML (GPUs declared in the document) the engine's footprint cannot be read: the
    // model serves, placed as needing the whole GPU, and the condition says so.
    let status = capy.status("fresh");
    assert!(status["measurement"].is_null(), "{status:#}");
    let measured = &status["conditions"][1];
    assert_eq!(measured["type"], "Measured");
    assert_eq!(measured["status"], "False");
    assert!(
        measured["message"]
            .as_str()
            .unwrap()
            .contains("footprint could not be read"),
        "{measured}"
    );
    assert_eq!(chat(capy.inference, "fresh", false).status, 200);
}

/// "The host setting also takes --set ... or CAPYCTL_SET__HOST__LIFECYCLE__ACTIVATION on capyctl
/// start standalone": a host-wide explicit activation, from the command line or the
/// environment, makes every model explicit; a deployment cannot opt out.
#[test]
fn host_wide_explicit_activation_from_set_or_variable() {
    for (args, env) in [
        (
            &["--set", "host.lifecycle.activation=explicit"][..],
            &[][..],
        ),
        (
            &[][..],
            &[("CAPYCTL_SET__HOST__LIFECYCLE__ACTIVATION", "explicit")][..],
        ),
    ] {
        let dir = temp_dir("host-explicit");
        let doc = document(
            "",
            "",
            &[&model("chat-a", "lifecycle: {activation: on_demand}\n")],
        );
        let capy = Capy::start_with(&dir, &doc, args, env);
        let id = id_of(&capy, "chat-a");
        let r = chat(capy.inference, "chat-a", false);
        let message = assert_error(&r, 409, "deployment_inactive", false);
        assert!(
            message.starts_with(&format!("deployment {id} is not running")),
            "{message}"
        );
        assert_eq!(capy.status("chat-a")["activation"], "explicit");
        assert_eq!(capy.status("chat-a")["state"], "stopped");
        capy.cli(&["start", "deployment", "chat-a", "--wait"]).ok();
        assert_eq!(chat(capy.inference, "chat-a", false).status, 200);
    }
}

/// "`--wait` shows progress on a terminal (measurement, then starting)": on a terminal
/// (`script` gives the command one) the states go by on stderr; without one, only the receipt.
#[test]
fn start_wait_shows_progress_on_a_terminal() {
    let dir = temp_dir("progress");
    let capy = Capy::start(&dir, &document("", "", &[]));
    let file = dir.join("fresh.yaml");
    std::fs::write(
        &file,
        "name: fresh\nengine: vllm\nmodel: Qwen3-4B\nenv: {ENGINE_SIM_WEIGHTS_BYTES: 64MiB, ENGINE_SIM_GPU_MEMORY_BYTES: 2GiB, ENGINE_SIM_STARTUP_DELAY: 800ms}\n",
    )
    .unwrap();
    capy.cli(&["deploy", "model", "--file", file.to_str().unwrap()])
        .ok();
    let command = format!(
        "{} start deployment fresh --wait --server http://{}",
        support::capyctl().display(),
        capy.management
    );
    let out = std::process::Command::new("script")
        .args(["-qec", &command, "/dev/null"])
        .env("CAPYCTL_DATA_DIR", &capy.dir)
        .env_remove("CAPYCTL_ADMIN_TOKEN")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).replace("\r\n", "\n");
    assert!(out.status.success(), "{text}");
    let lines: Vec<&str> = text.lines().collect();
    let at = |needle: &str| {
        lines
            .iter()
            .position(|l| l.starts_with(needle))
            .unwrap_or_else(|| panic!("no line starting {needle:?} in:\n{text}"))
    };
    // The start begins at once (the engine's footprint is its measurement, and without NVML
    // it stays unknown): the terminal shows it starting, then the receipt.
    let starting = at("fresh: awaiting measurement; starting");
    let receipt = at("start deployment fresh (");
    assert!(starting < receipt, "{text}");
    assert!(lines[receipt].ends_with("state ready, ready 1/1"), "{text}");
}

/// A start that hangs (the simulator's start delay: its engine is not ready for 10 minutes),
/// whose request gave up at its deadline and that no operator asked for, is a victim like an
/// idle model: a request for another model that needs the GPU ends it and is served, without
/// an operator.
#[test]
fn a_hanging_start_nobody_waits_for_makes_way_for_another_models_request() {
    let dir = temp_dir("hanging-start-victim");
    let hanging = model("slow", "").replace(
        "ENGINE_SIM_WEIGHTS_BYTES: 64MiB}",
        "ENGINE_SIM_WEIGHTS_BYTES: 64MiB, ENGINE_SIM_STARTUP_DELAY: 600s}",
    );
    let doc = document(
        "      request_deadline: 5s\n",
        "",
        &[&hanging, &model("other", "")],
    );
    let capy = Capy::start(&dir, &doc);
    let gave_up = chat(capy.inference, "slow", false);
    assert_error(&gave_up, 503, "unavailable", true);
    assert_eq!(capy.status("slow")["state"], "starting");
    let asked = Instant::now();
    let served = chat(capy.inference, "other", false);
    assert_eq!(served.status, 200, "{served:?}");
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "{:?}",
        asked.elapsed()
    );
    assert_eq!(capy.status("slow")["state"], "stopped");
}
