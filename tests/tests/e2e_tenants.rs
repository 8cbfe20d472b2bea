//! Tenants end to end with the real `capyctl start standalone` and the engine simulator
//! (DESIGN 4.10): `server.inference_auth` keys, 401/404/429 with their headers, the models list
//! filtered, `capyctl tenants list` and `/metrics` (never a key), and SIGHUP rotating a key
//! file (a bad reload keeps the old keys).
#![allow(clippy::unwrap_used)]

mod support;

use std::time::{Duration, Instant};

use support::{Capy, PATIENCE, Response, assert_error, document, model, request, signal, temp_dir};

fn chat_as(capy: &Capy, key: Option<&str>, model: &str, path: &str) -> Response {
    let body = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 4,
    });
    let auth = key.map(|k| format!("Bearer {k}"));
    let mut headers = vec![("content-type", "application/json")];
    if let Some(auth) = &auth {
        headers.push(("authorization", auth));
    }
    request(
        capy.inference,
        "POST",
        path,
        &headers,
        body.to_string().as_bytes(),
    )
}

/// Waits until the standalone's log (beside its data directory) holds `needle` `times` times.
fn logged(capy_dir: &std::path::Path, needle: &str, times: usize) {
    support::logged(
        &capy_dir.parent().unwrap().join("capyctl.log"),
        needle,
        times,
    );
}

#[test]
fn keys_models_rates_listing_and_sighup_rotation() {
    let dir = temp_dir("tenants");
    let key_file = dir.join("team-b.key");
    std::fs::write(&key_file, "sk-team-b-1\n").unwrap();
    let auth = |key_file: &str| {
        format!(
            "  inference_auth:\n    tenants:\n      - name: team-a\n        keys: [\"sk-team-a\"]\n        models: [\"chat-*\"]\n        rate: {{requests_per_minute: 2}}\n      - name: team-b\n        key_files: [\"{key_file}\"]\n"
        )
    };
    let doc = |key_file: &str| {
        document(
            "",
            &auth(key_file),
            &[&model("chat-a", ""), &model("other", "")],
        )
    };
    let capy = Capy::start(&dir, &doc(&key_file.display().to_string()));
    let path = "/v1/chat/completions";

    // Without a valid key, however it is sent: 401, and nothing is started.
    for (key, path) in [
        (None, path),
        (Some("sk-wrong"), path),
        (None, "/v1/chat/completions?api_key=sk-team-a"),
    ] {
        let r = chat_as(&capy, key, "chat-a", path);
        assert_error(&r, 401, "unauthorized", false);
        assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    }
    let r = request(
        capy.inference,
        "POST",
        path,
        &[
            ("x-api-key", "sk-team-a"),
            ("content-type", "application/json"),
        ],
        br#"{"model":"chat-a"}"#,
    );
    assert_error(&r, 401, "unauthorized", false);
    let r = request(capy.inference, "GET", "/v1/models", &[], b"");
    assert_eq!(r.status, 401);

    // team-a: chat-a served; `other` exists but is not its: as unknown as `nope`.
    let r = chat_as(&capy, Some("sk-team-a"), "chat-a", path);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.header("x-ratelimit-limit-requests"), Some("2"));
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("1"));
    let hidden = chat_as(&capy, Some("sk-team-a"), "other", path);
    let unknown = chat_as(&capy, Some("sk-team-a"), "nope", path);
    assert_error(&hidden, 404, "model_not_found", false);
    assert_error(&unknown, 404, "model_not_found", false);
    assert_eq!(
        hidden.body.replace("other", "M"),
        unknown.body.replace("nope", "M")
    );
    let models = request(
        capy.inference,
        "GET",
        "/v1/models",
        &[("authorization", "Bearer sk-team-a")],
        b"",
    )
    .json();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["chat-a"]);

    // Its rate: the second request passes, the third is 429 with when to come back.
    assert_eq!(
        chat_as(&capy, Some("sk-team-a"), "chat-a", path).status,
        200
    );
    let r = chat_as(&capy, Some("sk-team-a"), "chat-a", path);
    assert_error(&r, 429, "rate_limited", true);
    let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=30).contains(&retry), "{r:?}");
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("0"));
    assert!(r.header("x-ratelimit-reset-requests").is_some());
    // team-b (every model, no rate) is not held back by team-a's rate.
    let r = chat_as(&capy, Some("sk-team-b-1"), "chat-a", path);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.header("x-ratelimit-limit-requests"), None);

    // Seeing it: never a key.
    let list = capy.cli(&["tenants", "list"]).ok();
    assert!(list.starts_with("TENANT"), "{list}");
    assert!(list.contains("team-a") && list.contains("chat-*") && list.contains("2 req/min"));
    assert!(list.contains("429:1"), "{list}");
    assert!(!list.contains("sk-"), "{list}");
    let json = capy.cli(&["tenants", "list", "--json"]).ok();
    assert!(!json.contains("sk-"), "{json}");
    let listed: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(listed["tenants"][1]["name"], "team-b");
    assert_eq!(listed["tenants"][1]["answers"]["200"], 1);
    assert!(
        listed["tenants"][0]["tokens"].as_u64().unwrap() > 0,
        "{listed}"
    );
    let metrics = capy.management_get("/metrics").body;
    assert!(
        metrics.contains("capyctl_tenant_requests_total{tenant=\"team-a\",code=\"429\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("capyctl_tenant_waiting{tenant=\"team-b\"} 0"));
    assert!(metrics.trim_end().ends_with("# EOF"));
    assert!(!metrics.contains("sk-"));

    // Rotation: a new key in team-b's file, SIGHUP: the new key works, the old one no more.
    std::fs::write(&key_file, "sk-team-b-2\n").unwrap();
    signal(capy.pid(), "HUP");
    logged(&capy.dir, "tenants replaced", 1);
    assert_eq!(
        chat_as(&capy, Some("sk-team-b-1"), "chat-a", path).status,
        401
    );
    assert_eq!(
        chat_as(&capy, Some("sk-team-b-2"), "chat-a", path).status,
        200
    );

    // A reload that cannot read a key file changes nothing and says what is wrong.
    std::fs::write(&capy.file, doc("/nonexistent/team-b.key")).unwrap();
    signal(capy.pid(), "HUP");
    logged(
        &capy.dir,
        "cannot read the key file /nonexistent/team-b.key",
        1,
    );
    assert_eq!(
        chat_as(&capy, Some("sk-team-b-2"), "chat-a", path).status,
        200
    );
    let log = std::fs::read_to_string(dir.join("capyctl.log")).unwrap();
    assert!(!log.contains("sk-team"), "a key was logged");
    assert_eq!(capy.terminate(), 0);
}

#[test]
fn a_document_with_a_repeated_key_does_not_start() {
    let dir = temp_dir("tenants-refused");
    let doc = document(
        "",
        "  inference_auth:\n    tenants:\n      - name: a\n        keys: [\"sk-1\"]\n      - name: b\n        keys: [\"sk-1\"]\n",
        &[],
    );
    let Err(out) = Capy::try_start(&dir, &doc, &[], &[]) else {
        panic!("started with a repeated key");
    };
    let line = out.fails();
    assert!(
        line.contains("standalone.yaml:10: server.inference_auth.tenants[1].keys[0]: this key is already a key of tenant a"),
        "{line}"
    );
    assert!(!line.contains("sk-1"));
}

/// Two tenants, one flooding (DESIGN 4.10, fair waiting): team-a sends 100 requests of about
/// a second each at once (32 run, the rest wait; the waiting limit of 64 refuses some), then
/// team-b sends one. The bound: team-b's request starts with the first slots that free up
/// (at most one request's length after it came) and its answer comes with team-a's second
/// wave, when about 32 of team-a's have finished (at most 48 allowed); first come first served
/// would have put it behind every waiting request of team-a, in the third wave (64 finished).
#[test]
fn a_flooding_tenant_does_not_keep_another_waiting_behind_it() {
    let dir = temp_dir("tenants-flood");
    let slow = "name: chat-a\nengine: vllm\nmodel: Qwen3-4B\nresources: {gpu_memory: 6GiB, weights_memory: 64MiB}\nenv: {ENGINE_SIM_WEIGHTS_BYTES: 64MiB, ENGINE_SIM_TOKEN_RATE: \"20\"}\n";
    let doc = document(
        "",
        "  inference_auth:\n    tenants:\n      - name: team-a\n        keys: [\"sk-a\"]\n      - name: team-b\n        keys: [\"sk-b\"]\n",
        &[slow],
    );
    let capy = std::sync::Arc::new(Capy::start(&dir, &doc));
    let body = serde_json::json!({
        "model": "chat-a",
        "prompt": "Once upon a time",
        "max_tokens": 20,
    })
    .to_string();
    let send = move |capy: &Capy, key: &str| {
        request(
            capy.inference,
            "POST",
            "/v1/completions",
            &[
                ("content-type", "application/json"),
                ("authorization", &format!("Bearer {key}")),
            ],
            body.as_bytes(),
        )
    };
    let send = std::sync::Arc::new(send);
    // Started, so that the flood waits for slots, not for a start.
    assert_eq!(send(&capy, "sk-b").status, 200);

    let finished = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let statuses = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let flood: Vec<_> = (0..100)
        .map(|_| {
            let (capy, send) = (capy.clone(), send.clone());
            let (finished, statuses) = (finished.clone(), statuses.clone());
            std::thread::spawn(move || {
                let r = send(&capy, "sk-a");
                if r.status == 200 {
                    finished.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
                statuses.lock().unwrap().push(r.status);
            })
        })
        .collect();
    // Until team-a's requests wait (the tenants' read shows them).
    let start = Instant::now();
    loop {
        let t = capy.management_get("/management/v1/tenants").json();
        if t["tenants"][0]["waiting"].as_i64().unwrap_or(0) >= 30 {
            break;
        }
        assert!(start.elapsed() < PATIENCE, "team-a never waited: {t}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let asked = Instant::now();
    let b = send(&capy, "sk-b");
    let waited = asked.elapsed();
    let a_done = finished.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(b.status, 200, "{b:?}");
    for t in flood {
        t.join().unwrap();
    }
    let statuses = statuses.lock().unwrap().clone();
    let served = statuses.iter().filter(|s| **s == 200).count();
    eprintln!(
        "team-b served in {waited:?} with {a_done} of team-a's {served} served before it ({} refused 429)",
        statuses.iter().filter(|s| **s == 429).count()
    );
    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 429),
        "{statuses:?}"
    );
    assert!(
        a_done <= 48,
        "team-b waited behind {a_done} of team-a's requests"
    );
    assert!(
        served > 64,
        "the flood was not large enough to show it: {served}"
    );
}
