//! Starting and signals, end to end with the real `capyctl start standalone`: `/readyz` only
//! once the document's deployments exist, SIGTERM at any moment of a start, SIGHUP reads the
//! document again, and `/metrics` lists every family before the first request.
#![allow(clippy::unwrap_used)]

mod support;

use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use support::{Capy, PATIENCE, Response, document, model, request, signal, temp_dir};

/// Deployments in the large document: enough that the tests see CapyCTL while it deploys them
/// (they fail rather than pass vacuously), few enough for CI. The document is one transaction,
/// so this is mostly the time to read the document and build the deployments.
const MANY: usize = 10_000;

/// A loopback address free a moment ago, for a listener the test must know before the banner.
fn free_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], capyctl_test_support::free_port()))
}

/// A standalone document with [`MANY`] deployments whose management listener is `management`.
fn many_deployments(management: SocketAddr) -> String {
    let models: Vec<String> = (0..MANY).map(|i| model(&format!("m{i:05}"), "")).collect();
    let refs: Vec<&str> = models.iter().map(String::as_str).collect();
    document("", "", &refs).replace(
        "management: \"127.0.0.1:0\"",
        &format!("management: \"{management}\""),
    )
}

/// `capyctl start standalone` on `doc`, without waiting for its banner.
fn spawn(dir: &std::path::Path, doc: &str) -> Child {
    let file = dir.join("standalone.yaml");
    std::fs::write(&file, doc).unwrap();
    Command::new(support::capyctl())
        .args(["start", "standalone", "--file"])
        .arg(&file)
        .arg("--data-dir")
        .arg(dir.join("data"))
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("capyctl.log")).unwrap())
        .spawn()
        .unwrap()
}

/// `GET path` on the management listener at `addr`; `None` while nothing listens there.
fn get(addr: SocketAddr, path: &str, token: Option<&str>) -> Option<Response> {
    TcpStream::connect(addr).ok()?;
    let auth = token.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    Some(request(addr, "GET", path, &headers, b""))
}

/// Waits (bounded) for `child` to exit; its exit code.
#[track_caller]
fn exits_within(child: &mut Child, bound: Duration) -> i32 {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.code().unwrap_or(-1);
        }
        if start.elapsed() > bound {
            let _ = child.kill();
            panic!("still running {bound:?} after the signal");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `/readyz` answers 503 while the document's deployments are being deployed, and 200 only once
/// every one of them exists.
#[test]
fn readyz_waits_for_the_documents_deployments() {
    let dir = temp_dir("readyz-deploy");
    let management = free_addr();
    let mut child = spawn(&dir, &many_deployments(management));
    let token_file = dir.join("data").join("admin-token");
    let start = Instant::now();
    let mut saw_not_ready = false;
    loop {
        assert!(start.elapsed() < PATIENCE * 3, "never ready");
        assert!(child.try_wait().unwrap().is_none(), "standalone exited");
        let Some(r) = get(management, "/readyz", None) else {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        if r.status == 503 {
            saw_not_ready = true;
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        assert_eq!(r.status, 200, "{r:?}");
        // Ready: every deployment of the document exists.
        let token = std::fs::read_to_string(&token_file).unwrap();
        let list = get(management, "/management/v1/deployments", Some(token.trim())).unwrap();
        let listed = list.json()["deployments"].as_array().unwrap().len();
        assert_eq!(
            listed, MANY,
            "/readyz said ready with {listed} of {MANY} deployed"
        );
        break;
    }
    assert!(saw_not_ready, "/readyz never said 503 while deploying");
    eprintln!("ready after {:?}", start.elapsed());
    signal(child.id(), "TERM");
    assert_eq!(exits_within(&mut child, PATIENCE), 0);
}

/// SIGTERM while the document's deployments are being deployed (`/readyz` still 503) ends
/// CapyCTL at once (exit 0), instead of after the whole document.
#[test]
fn sigterm_while_deploying_the_document_exits_at_once() {
    let dir = temp_dir("sigterm-deploy");
    let management = free_addr();
    let mut child = spawn(&dir, &many_deployments(management));
    let start = Instant::now();
    loop {
        assert!(start.elapsed() < PATIENCE, "never listened");
        assert!(child.try_wait().unwrap().is_none(), "standalone exited");
        match get(management, "/readyz", None) {
            Some(r) if r.status == 503 => break,
            Some(r) => panic!("ready before the signal: {MANY} deployments took no time? {r:?}"),
            None => std::thread::sleep(Duration::from_millis(10)),
        }
    }
    let signalled = Instant::now();
    signal(child.id(), "TERM");
    assert_eq!(exits_within(&mut child, Duration::from_secs(3)), 0);
    eprintln!("exited {:?} after SIGTERM", signalled.elapsed());
}

/// SIGHUP deploys the document again: a new deployment appears and a changed one gets a new
/// revision; a document that does not load changes nothing; CapyCTL keeps running throughout.
#[test]
fn sighup_deploys_the_document_again() {
    let dir = temp_dir("sighup");
    let capy = Capy::start(&dir, &document("", "", &[&model("chat-a", "")]));
    let log = dir.join("capyctl.log");
    let logged = |needle: &str, times: usize| support::logged(&log, needle, times);

    std::fs::write(
        &capy.file,
        document(
            "",
            "",
            &[
                &model("chat-a", "max_concurrent_requests: 4\n"),
                &model("chat-b", ""),
            ],
        ),
    )
    .unwrap();
    signal(capy.pid(), "HUP");
    capy.list_until(
        "NAME     STATE     READY   REVISION   HOSTS\n\
         chat-a   stopped   0/1     2          gpu-box\n\
         chat-b   stopped   0/1     1          gpu-box\n",
    );

    std::fs::write(&capy.file, "server:\n  bogus: 1\n").unwrap();
    signal(capy.pid(), "HUP");
    logged("nothing changed", 1);
    assert!(
        std::fs::read_to_string(&log)
            .unwrap()
            .contains("server.bogus"),
        "the log names the bad key"
    );
    assert_eq!(
        capy.list(),
        "NAME     STATE     READY   REVISION   HOSTS\n\
         chat-a   stopped   0/1     2          gpu-box\n\
         chat-b   stopped   0/1     1          gpu-box\n"
    );
    // Still serving after both.
    assert_eq!(support::chat(capy.inference, "chat-b", false).status, 200);
}

/// A scrape before the first request already lists every family (HELP and TYPE) and the
/// build-info gauge.
#[test]
fn metrics_are_listed_before_the_first_request() {
    let dir = temp_dir("metrics-first");
    let capy = Capy::start(&dir, &document("", "", &[&model("chat-a", "")]));
    let text = capy.management_get("/metrics").body;
    for (name, kind) in [
        ("capyctl_requests", "counter"),
        ("capyctl_request_wait_seconds", "histogram"),
        ("capyctl_switches", "counter"),
        ("capyctl_switch_phase_seconds", "histogram"),
        ("capyctl_parks", "counter"),
        ("capyctl_wakes", "counter"),
        ("capyctl_queue_waiting", "gauge"),
        ("capyctl_in_flight", "gauge"),
    ] {
        assert!(text.contains(&format!("# HELP {name} ")), "{name}:\n{text}");
        assert!(
            text.contains(&format!("# TYPE {name} {kind}\n")),
            "{name}:\n{text}"
        );
    }
    assert!(
        text.contains(&format!(
            "capyctl_build_info{{version=\"{}\"}} 1\n",
            env!("CARGO_PKG_VERSION")
        )),
        "{text}"
    );
}

/// A start that is refused changes nothing. A deployment larger than every GPU is refused
/// before any listener opens (the management port is taken here: the refusal is the
/// document's, not the bind's), naming the file and line of its size, as the document's other
/// errors do; and the fresh data directory is left with no state database, admin token or
/// switch records.
#[test]
fn a_refused_start_names_the_file_and_line_and_leaves_nothing_behind() {
    let dir = temp_dir("refused-start");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let big = model("big", "").replace("gpu_memory: 6GiB", "gpu_memory: 80GiB");
    let doc = document("", "", &[&model("small", ""), &big]).replace(
        "management: \"127.0.0.1:0\"",
        &format!("management: \"{}\"", taken.local_addr().unwrap()),
    );
    let file = dir.join("standalone.yaml");
    std::fs::write(&file, &doc).unwrap();
    let line = 1 + doc
        .lines()
        .position(|l| l.contains("gpu_memory: 80GiB"))
        .unwrap();
    let data = dir.join("data");
    let out = Command::new(support::capyctl())
        .args(["start", "standalone", "--file"])
        .arg(&file)
        .arg("--data-dir")
        .arg(&data)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{err}");
    let at = format!("standalone.yaml:{line}: deployments[1].resources.gpu_memory: ");
    let refusal = err
        .lines()
        .find(|l| l.contains(&at))
        .unwrap_or_else(|| panic!("no line names {at}:\n{err}"));
    assert!(
        refusal.contains("deployment big does not fit on any GPU")
            && refusal.contains("80.0 GiB is more than the GPU memory of any host"),
        "{refusal}"
    );
    assert!(!err.contains("standalone listening"), "{err}");
    let left: Vec<String> = std::fs::read_dir(&data)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    for file in ["state.redb", "admin-token", "switches.jsonl"] {
        assert!(!left.iter().any(|l| l == file), "{file} was left: {left:?}");
    }
    // The data directory's lock alone (taken before anything else is touched).
    assert!(left.iter().all(|l| l == "lock"), "{left:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
