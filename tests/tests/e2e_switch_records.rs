//! Switch records end to end (DESIGN 4.8): the real `capyctl` binary (`start standalone`, then
//! `capyctl switches`), real sockets, the engine simulator as every engine. Two models on one
//! GPU that holds one: a request for each makes a cold start and a switch, which
//! `capyctl switches` shows phase by phase, `GET /management/v1/switches?after=` pages, and
//! `/metrics` counts; the records survive a restart; `--follow` prints a new switch once it
//! has ended.
#![allow(clippy::unwrap_used)]

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use support::{Capy, capyctl, chat, document, id_of, metric, model, temp_dir};

/// The records `capyctl switches --json` prints (one JSON object a line).
fn records(capy: &Capy, args: &[&str]) -> Vec<Value> {
    let mut all = vec!["switches", "--json"];
    all.extend_from_slice(args);
    capy.cli(&all)
        .ok()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The last record of `deployment` with `cause`, once it has ended (a switch's record ends a
/// moment after the router has let its requests through).
fn ended(capy: &Capy, deployment: &str, cause: &str) -> Value {
    let until = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let found = records(capy, &[]).into_iter().rev().find(|r| {
            r["deployment"] == deployment && r["cause"] == cause && r["outcome"] != "in_progress"
        });
        if let Some(r) = found {
            return r;
        }
        assert!(
            std::time::Instant::now() < until,
            "no ended {cause} record of {deployment}: {:#?}",
            records(capy, &[])
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn phases(r: &Value) -> Vec<String> {
    r["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["phase"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn a_switch_is_recorded_phase_by_phase_and_kept_across_a_restart() {
    let dir = temp_dir("switch-records");
    let doc = document("", "", &[&model("chat-a", ""), &model("chat-b", "")]);
    let capy = Capy::start(&dir, &doc);
    let (a_id, b_id) = (id_of(&capy, "chat-a"), id_of(&capy, "chat-b"));

    // A cold start of chat-a, then a switch to chat-b (chat-a parks, chat-b starts).
    assert_eq!(chat(capy.inference, "chat-a", false).status, 200);
    assert_eq!(chat(capy.inference, "chat-b", false).status, 200);

    let up = ended(&capy, "chat-a", "bring_up");
    assert_eq!(up["outcome"], "ok", "{up:#}");
    assert_eq!(up["victims"], serde_json::json!([]), "{up:#}");
    assert_eq!(phases(&up), ["start", "release"], "{up:#}");

    let sw = ended(&capy, "chat-b", "wave");
    assert_eq!(sw["outcome"], "ok", "{sw:#}");
    assert_eq!(sw["error"], Value::Null, "{sw:#}");
    assert_eq!(sw["deployment_id"], b_id.as_str());
    assert_eq!(sw["instance"], format!("{b_id}-0"));
    assert_eq!(sw["host_id"], "gpu-box");
    assert_eq!(sw["wave"], 1);
    assert!(
        sw["switch_id"].as_str().unwrap().starts_with("sw-"),
        "{sw:#}"
    );
    assert_eq!(
        phases(&sw),
        ["admission_window", "drain", "park", "start", "release"],
        "{sw:#}"
    );
    assert_eq!(
        sw["victims"],
        serde_json::json!([{
            "deployment": "chat-a", "deployment_id": a_id, "instance": format!("{a_id}-0"),
            "action": "park", "result": "parked", "error": null,
        }]),
        "{sw:#}"
    );
    // The phases follow each other within the switch's span.
    let (began, ended_ms) = (
        sw["began_ms"].as_u64().unwrap(),
        sw["ended_ms"].as_u64().unwrap(),
    );
    let mut at = began;
    for p in sw["phases"].as_array().unwrap() {
        let (b, e) = (
            p["began_ms"].as_u64().unwrap(),
            p["ended_ms"].as_u64().unwrap(),
        );
        assert!(at <= b && b <= e && e <= ended_ms, "{sw:#}");
        at = e;
    }
    assert_eq!(sw["phases"][2]["instance"], format!("{a_id}-0"), "{sw:#}");
    assert_eq!(sw["phases"][3]["instance"], format!("{b_id}-0"), "{sw:#}");

    // The table: one row per switch.
    let table = capy.cli(&["switches"]).ok();
    let mut lines = table.lines();
    let header = lines.next().unwrap();
    for column in [
        "TIME",
        "DEPLOYMENT",
        "CAUSE",
        "WAVE",
        "VICTIMS",
        "PHASES",
        "OUTCOME",
    ] {
        assert!(header.contains(column), "{table}");
    }
    let row = lines
        .find(|l| l.contains(" wave ") && l.contains("chat-b"))
        .unwrap_or_else(|| panic!("no row of the switch: {table}"));
    assert!(row.contains("chat-a parked"), "{row}");
    assert!(
        row.contains("window ") && row.contains(" park ") && row.contains(" start "),
        "{row}"
    );
    assert!(row.trim_end().ends_with(" ok"), "{row}");

    // Filtered by deployment; paged by `after`.
    let only_b = records(&capy, &["--deployment", "chat-b"]);
    assert!(!only_b.is_empty());
    assert!(
        only_b.iter().all(|r| r["deployment"] == "chat-b"),
        "{only_b:#?}"
    );
    let all = records(&capy, &[]);
    let seqs: Vec<u64> = all.iter().map(|r| r["seq"].as_u64().unwrap()).collect();
    let first = seqs[0];
    assert_eq!(seqs, (first..first + seqs.len() as u64).collect::<Vec<_>>());
    let page = capy
        .management_get(&format!("/management/v1/switches?after={first}&limit=1"))
        .json();
    assert_eq!(page["switches"].as_array().unwrap().len(), 1, "{page:#}");
    assert_eq!(page["switches"][0]["seq"], first + 1);
    assert_eq!(page["next"], first + 1);
    let last = *seqs.last().unwrap();
    let none = capy
        .management_get(&format!("/management/v1/switches?after={last}"))
        .json();
    assert_eq!(none, serde_json::json!({"switches": [], "next": last}));
    let bad = capy.management_get("/management/v1/switches?limit=0");
    assert_eq!(bad.status, 400, "{bad:?}");

    // The histograms, by phase and engine.
    for phase in ["admission_window", "drain", "park", "start", "release"] {
        let count = metric(
            &capy,
            &format!(r#"capyctl_switch_phase_seconds_count{{phase="{phase}",engine="vllm"}}"#),
        );
        assert!(count >= 1.0, "{phase}: {count}");
    }

    // A restart keeps the records, and numbering goes on from them.
    assert_eq!(capy.terminate(), 0);
    let capy = Capy::start(&dir, &doc);
    let again = records(&capy, &[]);
    assert_eq!(again[..all.len()], all[..], "the records after a restart");

    // --follow prints a new switch once it has ended.
    let mut follow = Command::new(capyctl())
        .args(["switches", "--follow", "--json", "--deployment", "chat-a"])
        .arg("--server")
        .arg(format!("http://{}", capy.management))
        .env("CAPYCTL_DATA_DIR", &capy.dir)
        .env_remove("CAPYCTL_ADMIN_TOKEN")
        .env_remove("CAPYCTL_SERVER")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = follow.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let _ = tx.send(serde_json::from_str::<Value>(&line).unwrap());
        }
    });
    // What was there already comes first: chat-a's cold start.
    let old = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(old["seq"], up["seq"], "{old:#}");
    // A request for chat-a is a new record.
    assert_eq!(chat(capy.inference, "chat-a", false).status, 200);
    let new = loop {
        let r = rx.recv_timeout(Duration::from_secs(20)).unwrap();
        if r["seq"].as_u64().unwrap() > last {
            break r;
        }
    };
    assert_eq!(new["deployment"], "chat-a", "{new:#}");
    assert_ne!(new["outcome"], "in_progress", "{new:#}");
    assert_eq!(new["outcome"], "ok", "{new:#}");
    // A clean shutdown stopped the engines: chat-a starts into free room.
    assert_eq!(new["cause"], "bring_up", "{new:#}");
    assert_eq!(phases(&new), ["start", "release"], "{new:#}");
    follow.kill().unwrap();
    follow.wait().unwrap();
}
