//! The web page at `/ui/` (DESIGN 4.8): served without a token with its content types and
//! Content-Security-Policy; and in a real headless Chromium (Debian's, through chromedriver's
//! WebDriver API) against the real `capyctl start standalone` with the engine simulator: the
//! token from the fragment, the deployments, a switch's bars on the timeline, the new states,
//! a wrong token asking again. The screenshot it takes is the README's (`docs/ui.png`; written
//! there with `CAPYCTL_UI_SCREENSHOT=docs`).
#![allow(clippy::unwrap_used)]

mod support;
mod webdriver;

use std::time::Duration;

use serde_json::Value;
use support::{Capy, chat, document, request, temp_dir};
use webdriver::{Browser, Session, VIEWPORT, png_size};

/// A deployment for the simulator: 6 GiB of GPU (two do not fit on the 10 GiB GPU together)
/// and 256 MiB of weights copied at 64 MiB/s: a park or a wake takes some 4 s, long enough
/// for the page (polling every second) to see the switch in progress and requests wait.
fn slow_model(name: &str) -> String {
    format!(
        "name: {name}\nengine: vllm\nmodel: Qwen3-4B\n\
         resources: {{gpu_memory: 6GiB, weights_memory: 256MiB}}\n\
         env: {{ENGINE_SIM_WEIGHTS_BYTES: 256MiB, ENGINE_SIM_HOST_BANDWIDTH: 64MiB, ENGINE_SIM_TOKEN_RATE: \"20\"}}\n"
    )
}

const PATIENCE: Duration = Duration::from_secs(60);

/// `/ui/` and its files need no token and come with their content types, the CSP, `nosniff`
/// and `no-cache` with an ETag (304 when it matches); the API still refuses without a token.
#[test]
fn the_page_is_served_without_a_token_and_the_api_still_needs_one() {
    let dir = temp_dir("ui-assets");
    let capy = Capy::start(&dir, &document("", "", &[]));
    let get =
        |path: &str, headers: &[(&str, &str)]| request(capy.management, "GET", path, headers, b"");
    let mut bodies = Vec::new();
    for (path, content_type) in [
        ("/ui/", "text/html; charset=utf-8"),
        ("/ui/ui.js", "text/javascript; charset=utf-8"),
        ("/ui/ui.css", "text/css; charset=utf-8"),
        ("/ui/icon.svg", "image/svg+xml"),
    ] {
        let r = get(path, &[]);
        assert_eq!(r.status, 200, "{path}: {r:?}");
        assert_eq!(r.header("content-type"), Some(content_type), "{path}");
        let csp = r.header("content-security-policy").unwrap_or("");
        for directive in [
            "default-src 'none'",
            "script-src 'self'",
            "style-src 'self'",
            "connect-src 'self'",
            "frame-ancestors 'none'",
            "form-action 'none'",
        ] {
            assert!(
                csp.contains(directive),
                "{path}: CSP {csp:?} lacks {directive}"
            );
        }
        assert!(!csp.contains("unsafe"), "{path}: {csp}");
        assert_eq!(
            r.header("x-content-type-options"),
            Some("nosniff"),
            "{path}"
        );
        assert_eq!(r.header("cache-control"), Some("no-cache"), "{path}");
        let etag = r.header("etag").unwrap().to_string();
        let again = get(path, &[("if-none-match", &etag)]);
        assert_eq!(again.status, 304, "{path}: {again:?}");
        assert!(again.body.is_empty(), "{path}");
        bodies.push(r.body);
    }
    // The page loads its own files only: no CDN, nothing inline the CSP would block.
    let html = &bodies[0];
    assert!(html.contains(r#"<script src="ui.js""#), "{html}");
    assert!(
        html.contains(r#"<link rel="stylesheet" href="ui.css">"#),
        "{html}"
    );
    for body in &bodies {
        assert!(
            !body.contains("src=\"http") && !body.contains("href=\"http"),
            "{body}"
        );
        assert!(
            !body.contains("//cdn") && !body.contains("@import"),
            "{body}"
        );
    }

    // /ui without the slash is sent to /ui/ (relative, so that a proxy's prefix is kept).
    let r = get("/ui", &[]);
    assert_eq!(r.status, 308, "{r:?}");
    assert_eq!(r.header("location"), Some("ui/"));
    // No other file is served there.
    assert_eq!(get("/ui/secret", &[]).status, 404);

    // The API still needs the token.
    for path in [
        "/management/v1/deployments",
        "/management/v1/hosts",
        "/management/v1/metrics/load",
    ] {
        let r = get(path, &[]);
        assert_eq!(r.status, 401, "{path}: {r:?}");
        assert_eq!(r.json()["code"], "unauthorized", "{path}");
        let r = get(path, &[("authorization", "Bearer not-the-token")]);
        assert_eq!(r.status, 401, "{path}: {r:?}");
    }
    let r = capy.management_get("/management/v1/deployments");
    assert_eq!(r.status, 200, "{r:?}");
}

/// The latest switch record that served `name`, once it has ended, when the server keeps
/// switch records (`GET /management/v1/switches`); `None` when it answers 404 (no such route).
fn last_switch_of(capy: &Capy, name: &str) -> Option<Value> {
    let start = std::time::Instant::now();
    loop {
        let r = capy.management_get(&format!("/management/v1/switches?deployment={name}"));
        if r.status == 404
            && r.json()["message"]
                .as_str()
                .is_some_and(|m| m.contains("route"))
        {
            return None;
        }
        assert_eq!(r.status, 200, "{r:?}");
        let v = r.json();
        let last = v["switches"].as_array().and_then(|s| s.last()).cloned();
        let last = last.unwrap_or_else(|| panic!("no switch record for {name}: {v:#}"));
        if last["outcome"] != "in_progress" {
            return Some(last);
        }
        assert!(
            start.elapsed() < PATIENCE,
            "the switch never ended: {last:#}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Chromium opens `/ui/#token=...`; the page shows both deployments; requests for the parked
/// one switch; the timeline shows that switch's bars and the table the new states; a wrong
/// token brings the form back, and the right one typed in opens the page again.
#[test]
fn the_page_in_a_browser_shows_a_switch() {
    let Some(browser) = Browser::find_or_fail() else {
        return;
    };
    let dir = temp_dir("ui-browser");
    let capy = Capy::start(
        &dir,
        &document("", "", &[&slow_model("chat"), &slow_model("code")]),
    );
    capy.cli(&["start", "deployment", "chat", "--wait"]).ok();
    capy.cli(&["start", "deployment", "code", "--evict", "--wait"])
        .ok();
    assert_eq!(capy.status("chat")["state"], "parked");
    let token = capy.token();

    let session = Session::start(&browser, &dir.join("chromedriver.log"));
    let page = format!("http://{}/ui/", capy.management);
    session.open(&format!("{page}#token={token}"));
    session.wait_for(
        "the deployments: chat parked, code ready",
        PATIENCE,
        r#"return !!document.querySelector('#deployments tr[data-deployment="chat"][data-state="parked"]')
            && !!document.querySelector('#deployments tr[data-deployment="code"][data-state="ready"]');"#,
    );
    // The token left the address bar and lives in the tab's sessionStorage.
    let href = session.eval("return location.href;");
    assert_eq!(
        href,
        Value::String(page.clone()),
        "the #token= fragment is removed"
    );
    assert_eq!(
        session.eval("return sessionStorage.getItem('capyctl.admin_token');"),
        Value::String(token.clone())
    );
    assert_eq!(
        session.eval("return localStorage.length;"),
        Value::from(0),
        "nothing in localStorage"
    );
    // The hosts and the load are shown too.
    session.wait_for(
        "the host's GPU",
        PATIENCE,
        r#"return !!document.querySelector('[data-host="gpu-box"] .gpu meter');"#,
    );
    let load = session.eval(
        r#"return [...document.querySelectorAll('#deployments tr[data-deployment="code"] td[data-load]')]
             .map(td => td.textContent);"#,
    );
    let read = capy.management_get("/management/v1/metrics/load").json();
    let code = read["deployments"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == "code")
        .unwrap();
    let r = &code["router"];
    assert_eq!(
        load,
        serde_json::json!([
            format!("{} / {}", r["in_flight"], r["in_flight_limit"]),
            format!("{} / {}", r["waiting"], r["waiting_limit"]),
        ]),
        "in flight and waiting as the load read has them"
    );
    // A one-minute window, as a user would pick it (the switches are seconds long).
    session.eval(
        "const w = document.getElementById('window'); w.value = '60'; \
         w.dispatchEvent(new Event('change')); return true;",
    );

    // Requests for the parked model: a switch (code parked, chat woken).
    let inference = capy.inference;
    let requests: Vec<_> = (0..4)
        .map(|_| std::thread::spawn(move || chat(inference, "chat", false)))
        .collect();
    // While it runs, the page draws it in progress, up to now.
    let running = session.wait_for(
        "the switch in progress",
        PATIENCE,
        r#"const s = document.querySelector('#timeline rect.switch[data-deployment="chat"][data-outcome="in_progress"]');
           if (!s) return null;
           const now = Number(document.querySelector('#timeline line.now').getAttribute('x1'));
           const end = Number(s.getAttribute('x')) + Number(s.getAttribute('width'));
           const open = [...document.querySelectorAll(`#timeline rect.phase.in-progress[data-switch-id="${s.dataset.switchId}"]`)]
             .map(b => Number(b.getAttribute('x')) + Number(b.getAttribute('width')));
           return {now, end, open};"#,
    );
    let now = running["now"].as_f64().unwrap();
    assert!(
        (running["end"].as_f64().unwrap() - now).abs() <= 2.0,
        "the switch in progress ends at now: {running}"
    );
    let open = running["open"].as_array().unwrap();
    assert!(
        open.iter()
            .all(|e| (e.as_f64().unwrap() - now).abs() <= 1.0),
        "its phases in progress end at now: {running}"
    );
    for r in requests {
        let r = r.join().unwrap();
        assert_eq!(r.status, 200, "{r:?}");
    }
    session.wait_for(
        "the new states: chat ready, code parked",
        PATIENCE,
        r#"return !!document.querySelector('#deployments tr[data-deployment="chat"][data-state="ready"]')
            && !!document.querySelector('#deployments tr[data-deployment="code"][data-state="parked"]');"#,
    );

    match last_switch_of(&capy, "chat") {
        Some(record) => {
            let id = record["switch_id"].as_str().unwrap().to_string();
            let phases: Vec<String> = record["phases"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p["phase"].as_str().unwrap().to_string())
                .collect();
            assert!(phases.iter().any(|p| p == "park"), "{record:#}");
            assert!(phases.iter().any(|p| p == "wake"), "{record:#}");
            // The switch's outline, ended, and every phase of its record as a bar.
            let shown = session.wait_for(
                "the switch on the timeline",
                PATIENCE,
                &format!(
                    r#"const s = document.querySelector('#timeline rect.switch[data-switch-id="{id}"]');
                       if (!s || s.dataset.outcome === 'in_progress') return null;
                       const bars = [...document.querySelectorAll('#timeline rect.phase[data-switch-id="{id}"]')];
                       return {{outcome: s.dataset.outcome, title: s.querySelector('title').textContent,
                               bars: bars.map(b => [b.dataset.phase, b.dataset.deployment, b.dataset.victim,
                                                    Number(b.getAttribute('width'))])}};"#
                ),
            );
            assert_eq!(shown["outcome"], record["outcome"], "{shown:#}");
            let title = shown["title"].as_str().unwrap();
            assert_eq!(record["cause"], "wave", "{record:#}");
            assert_eq!(record["victims"][0]["deployment"], "code", "{record:#}");
            for part in [
                id.clone(),
                "cause wave".to_string(),
                format!("wave {}", record["wave"]),
                format!("outcome: {}", record["outcome"].as_str().unwrap()),
            ] {
                assert!(title.contains(&part), "{part:?} not in the title {title:?}");
            }
            let bars = shown["bars"].as_array().unwrap();
            let bar_phases: Vec<&str> = bars.iter().map(|b| b[0].as_str().unwrap()).collect();
            assert_eq!(bar_phases, phases, "{shown:#}");
            // The victim's park bar is code's, on its row; the wake is chat's.
            let park = bars.iter().find(|b| b[0] == "park").unwrap();
            assert_eq!(
                (&park[1], &park[2]),
                (&Value::from("code"), &Value::from("true"))
            );
            let wake = bars.iter().find(|b| b[0] == "wake").unwrap();
            assert_eq!(
                (&wake[1], &wake[2]),
                (&Value::from("chat"), &Value::from("false"))
            );
            assert!(
                bars.iter().all(|b| b[3].as_f64().unwrap() >= 2.0),
                "{shown:#}"
            );
            // And in the list under it.
            session.wait_for(
                "the switch in the list",
                PATIENCE,
                &format!(
                    r#"return !!document.querySelector('#switches tr[data-switch-id="{id}"]');"#
                ),
            );
        }
        None => {
            // This build has no switch records: the page says so and keeps working.
            eprintln!(
                "NOTE: no GET /management/v1/switches in this build; checked the page's notice"
            );
            session.wait_for(
                "the notice that there are no switch records",
                PATIENCE,
                r#"return document.getElementById('switches-note').textContent.includes('no switch records');"#,
            );
        }
    }

    // Nothing the page did was refused by its CSP or failed (the 401s come after this).
    let console = session.console();
    let bad: Vec<_> = console
        .iter()
        .filter(|(level, message)| level == "SEVERE" || message.contains("Content Security Policy"))
        .collect();
    assert!(bad.is_empty(), "the browser's console: {bad:#?}");

    // The screenshot of the README.
    let png = session.screenshot();
    assert_eq!(png_size(&png), Some(VIEWPORT), "a {VIEWPORT:?} PNG");
    std::fs::write(dir.join("ui.png"), &png).unwrap();
    if std::env::var("CAPYCTL_UI_SCREENSHOT").is_ok_and(|v| v == "docs") {
        let docs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/ui.png");
        std::fs::create_dir_all(docs.parent().unwrap()).unwrap();
        std::fs::write(&docs, &png).unwrap();
        eprintln!("wrote {}", docs.display());
    }

    // A wrong token: the form again, the token forgotten.
    session.open(&format!("{page}#token=not-the-token"));
    session.wait_for(
        "the token form after a 401",
        PATIENCE,
        r#"return !document.getElementById('login').hidden
            && document.getElementById('dashboard').hidden
            && document.getElementById('login-message').textContent.includes('401');"#,
    );
    assert_eq!(
        session.eval("return sessionStorage.getItem('capyctl.admin_token');"),
        Value::Null
    );
    // The right one typed into the form opens the page again.
    session.type_into("#token", &token);
    session.click("#token-form button[type=submit]");
    session.wait_for(
        "the deployments after the token was typed in",
        PATIENCE,
        r#"return document.getElementById('login').hidden
            && !!document.querySelector('#deployments tr[data-deployment="chat"][data-state="ready"]');"#,
    );
}
