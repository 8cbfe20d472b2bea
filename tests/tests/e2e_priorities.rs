//! Priorities (DESIGN 4.10) end to end: the real `capyctl` binary (`start standalone` and the
//! commands), real sockets, the engine simulator as every engine.
#![allow(clippy::unwrap_used)]

mod support;

use std::time::{Duration, Instant};

use support::{Capy, assert_error, chat, document, model, temp_dir};

/// A production model (priority 100) holds the GPU; a burst for a test model (priority 0)
/// that could only get room by parking it is answered at once with 409 `does_not_fit` naming
/// the priority, while the production model keeps serving every request of its own, never
/// parked. A model of a higher priority still takes the room.
#[test]
fn a_lower_priority_burst_cannot_park_the_production_model() {
    let dir = temp_dir("priorities");
    // A request deadline of 30 s: "at once" is well before it.
    let capy = Capy::start(
        &dir,
        &document(
            "      request_deadline: 30s\n",
            "",
            &[
                &model("prod", "priority: 100\n"),
                &model("test", ""),
                &model("urgent", "priority: 200\n"),
            ],
        ),
    );
    capy.cli(&["start", "deployment", "prod", "--wait"]).ok();
    let generation = capy.status("prod")["instances"][0]["generation"].clone();
    // `list deployments` shows PRIORITY once a deployment sets one; `status` shows it.
    let list = capy.list();
    assert!(list.starts_with("NAME  "), "{list}");
    assert!(list.lines().next().unwrap().ends_with("PRIORITY"), "{list}");
    assert!(
        list.lines()
            .any(|l| l.starts_with("prod ") && l.contains(" ready ") && l.ends_with(" 100")),
        "{list}"
    );
    let status = capy.cli(&["status", "deployment", "prod"]).ok();
    assert!(status.contains("\npriority:"), "{status}");
    assert!(
        status
            .lines()
            .any(|l| l.starts_with("priority:") && l.ends_with(" 100"))
    );

    // 16 requests for the test model and 16 for prod, all at once.
    let inference = capy.inference;
    let burst: Vec<_> = (0..16)
        .map(|_| {
            std::thread::spawn(move || {
                let began = Instant::now();
                let r = chat(inference, "test", false);
                (r, began.elapsed())
            })
        })
        .collect();
    let served: Vec<_> = (0..16)
        .map(|_| std::thread::spawn(move || chat(inference, "prod", false)))
        .collect();
    for t in burst {
        let (r, took) = t.join().unwrap();
        let message = assert_error(&r, 409, "does_not_fit", false);
        assert!(
            message.contains("held by deployments of a higher priority")
                && message.contains("prod: priority 100"),
            "{message}"
        );
        assert!(
            took < Duration::from_secs(10),
            "answered at once, not at the 30 s deadline: {took:?}"
        );
    }
    for t in served {
        let r = t.join().unwrap();
        assert_eq!(r.status, 200, "{r:?}");
    }
    // prod was never parked: the same engine, still ready; test never started.
    let s = capy.status("prod");
    assert_eq!(s["state"], "ready", "{s:#}");
    assert_eq!(s["instances"][0]["generation"], generation, "{s:#}");
    let t = capy.status("test");
    assert_ne!(t["state"], "ready", "{t:#}");
    assert_eq!(chat(inference, "prod", false).status, 200);

    // A higher priority (200) may take prod's room: prod parks, urgent serves.
    let r = chat(inference, "urgent", false);
    assert_eq!(r.status, 200, "{r:?}");
    capy.status_until("prod", "parked", |s| s["state"] == "parked");
    assert_eq!(capy.status("urgent")["state"], "ready");
}
