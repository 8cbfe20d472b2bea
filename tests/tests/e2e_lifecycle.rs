//! Settings precedence, kill-and-restart, and the CLI's errors, end to end with the real
//! `capyctl` binary, real sockets and the engine simulator.
#![allow(clippy::unwrap_used)]

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use capyctl_test_support::alive;
use support::{Capy, Out, assert_error, chat, document, id_of, model, temp_dir};

fn waiting_limit(capy: &Capy) -> u64 {
    let load = capy.management_get("/management/v1/metrics/load").json();
    load["deployments"][0]["router"]["waiting_limit"]
        .as_u64()
        .unwrap()
}

/// `--set` wins over `CAPYCTL_SET__…`, and both over the document; a bad value is refused at
/// start with the key and the range, and nothing starts.
#[test]
fn settings_precedence() {
    let dir = temp_dir("precedence");
    let doc = document(
        "      max_pending_per_deployment: 5\n",
        "",
        &[&model("chat-a", "")],
    )
    .replace("id: gpu-box", "id: doc-box");
    let env = [
        (
            "CAPYCTL_SET__HOST__RESOURCE_POLICY__QUEUE__MAX_PENDING_PER_DEPLOYMENT",
            "3",
        ),
        ("CAPYCTL_SET__HOST__ID", "env-box"),
    ];

    let capy = Capy::start(&dir, &doc);
    assert_eq!(waiting_limit(&capy), 5);
    assert!(capy.list().contains("   doc-box\n"));
    drop(capy);

    let capy = Capy::start_with(&dir, &doc, &[], &env);
    assert_eq!(waiting_limit(&capy), 3);
    assert!(capy.list().contains("   env-box\n"));
    drop(capy);

    let capy = Capy::start_with(
        &dir,
        &doc,
        &[
            "--set",
            "host.resource_policy.queue.max_pending_per_deployment=2",
            "--set",
            "host.id=set-box",
        ],
        &env,
    );
    assert_eq!(waiting_limit(&capy), 2);
    assert!(capy.list().contains("   set-box\n"));
    drop(capy);

    let refused = Capy::try_start(
        &dir,
        &doc,
        &[
            "--set",
            "host.resource_policy.queue.max_pending_per_deployment=5000",
        ],
        &[],
    )
    .err()
    .expect("5000 is out of range");
    let line = refused.fails();
    assert!(
        line.contains("host.resource_policy.queue.max_pending_per_deployment")
            && line.contains("5000")
            && line.contains("0 to 4096"),
        "{line}"
    );
}

/// Kill `capyctl start standalone` at any moment and start it again: deployments, revisions,
/// operator decisions, first answers and the token are back, and the engines it left are
/// adopted, parked ones included. A clean stop (SIGTERM) then stops them.
#[test]
fn kill_and_restart_loses_nothing() {
    let dir = temp_dir("restart");
    let doc = document("", "", &[&model("chat-a", "")]);
    let capy = Capy::start(&dir, &doc);
    let token = capy.token();
    capy.cli(&["start", "deployment", "chat-a", "--wait"]).ok();
    let file = dir.join("chat-b.yaml");
    std::fs::write(&file, model("chat-b", "")).unwrap();
    capy.cli(&["deploy", "model", "--file", file.to_str().unwrap()])
        .ok();
    std::fs::write(
        &file,
        model("chat-b", "extra_args: [\"--max-model-len\", \"4096\"]\n"),
    )
    .unwrap();
    let out = capy
        .cli(&["deploy", "model", "--file", file.to_str().unwrap()])
        .ok();
    assert!(out.contains("updated, revision 2"), "{out}");
    capy.cli(&["stop", "deployment", "chat-b"]).ok();
    let a_id = id_of(&capy, "chat-a");
    let b_id = id_of(&capy, "chat-b");
    let pid = capy.status("chat-a")["instances"][0]["pid"]
        .as_u64()
        .unwrap();
    let table = "NAME     STATE     READY   REVISION   HOSTS\n\
                 chat-a   ready     1/1     1          gpu-box\n\
                 chat-b   stopped   0/1     2          gpu-box\n";
    assert_eq!(capy.list(), table);

    capy.kill();
    assert!(alive(pid), "the engine went with capyctl");

    let capy = Capy::start(&dir, &doc);
    assert_eq!(capy.token(), token);
    assert_eq!(capy.list(), table);
    assert_eq!(id_of(&capy, "chat-a"), a_id);
    assert_eq!(
        capy.status("chat-a")["instances"][0]["pid"].as_u64(),
        Some(pid),
        "the engine was not adopted"
    );
    assert_eq!(chat(capy.inference, "chat-a", false).status, 200);
    let r = chat(capy.inference, "chat-b", false);
    assert_error(&r, 409, "deployment_stopped", false);
    assert_eq!(
        capy.status("chat-b")["spec"]["extra_args"][1],
        "4096",
        "the second revision's document"
    );
    assert_eq!(id_of(&capy, "chat-b"), b_id);

    // Killed while parked: the parked engine is adopted and a request wakes it, checked
    // against the first answer recorded before both restarts.
    capy.cli(&["park", "deployment", "chat-a"]).ok();
    capy.status_until("chat-a", "parked", |s| s["state"] == "parked");
    capy.kill();
    assert!(alive(pid));
    let capy = Capy::start(&dir, &doc);
    assert_eq!(capy.status("chat-a")["state"], "parked");
    let r = chat(capy.inference, "chat-a", false);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(
        capy.status("chat-a")["instances"][0]["pid"].as_u64(),
        Some(pid)
    );

    assert_eq!(capy.terminate(), 0);
    let gone = std::time::Instant::now();
    while alive(pid) {
        assert!(
            gone.elapsed() < support::PATIENCE,
            "engine {pid} outlived a clean stop"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

fn capyctl(args: &[&str], env: &[(&str, &str)]) -> Out {
    let mut c = Command::new(support::capyctl());
    c.args(args)
        .env_remove("CAPYCTL_SERVER")
        .env_remove("CAPYCTL_ADMIN_TOKEN")
        .env_remove("CAPYCTL_DATA_DIR");
    for (k, v) in env {
        c.env(k, v);
    }
    let o = c.output().unwrap();
    Out {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8(o.stdout).unwrap(),
        stderr: String::from_utf8(o.stderr).unwrap(),
    }
}

/// Every failure is one line and a non-zero exit, and a refused document changes nothing.
#[test]
fn cli_errors_are_one_line() {
    let dir = temp_dir("cli-errors");
    let capy = Capy::start(&dir, &document("", "", &[&model("chat-a", "")]));
    let server = format!("http://{}", capy.management);

    let line = capyctl(
        &["list", "deployments", "--server", "http://127.0.0.1:1"],
        &[("CAPYCTL_ADMIN_TOKEN", "x")],
    )
    .fails();
    assert!(
        line.contains("cannot reach the CapyCTL server at http://127.0.0.1:1"),
        "{line}"
    );

    let line = capyctl(
        &[
            "list",
            "deployments",
            "--server",
            &server,
            "--token",
            "wrong",
        ],
        &[],
    )
    .fails();
    assert!(line.ends_with("(unauthorized)"), "{line}");

    // The token from CAPYCTL_ADMIN_TOKEN, --json anywhere.
    let out = capyctl(
        &["--json", "list", "deployments", "--server", &server],
        &[("CAPYCTL_ADMIN_TOKEN", &capy.token())],
    )
    .ok();
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["deployments"][0]["name"], "chat-a");

    let empty = temp_dir("no-token");
    let line = capyctl(
        &["list", "deployments", "--server", &server],
        &[("CAPYCTL_DATA_DIR", empty.to_str().unwrap())],
    )
    .fails();
    assert!(line.contains("no admin token"), "{line}");

    let line = capy.cli(&["status", "deployment", "nope"]).fails();
    assert_eq!(line, "capyctl: deployment nope not found (not_found)");
    let line = capy.cli(&["park", "deployment", "nope"]).fails();
    assert!(line.ends_with("(not_found)"), "{line}");

    let bad = dir.join("bad.yaml");
    std::fs::write(
        &bad,
        "name: chat-a\nengine: vllm\nmodel: Qwen3-4B\nresidency: sometimes\n",
    )
    .unwrap();
    let line = capy
        .cli(&["deploy", "model", "--file", bad.to_str().unwrap()])
        .fails();
    assert!(
        line.contains("bad.yaml:4") && line.contains("residency"),
        "{line}"
    );
    assert_eq!(capy.status("chat-a")["revision"], 1);

    let line = capyctl(
        &["list", "deployments", "--server", "ftp://x"],
        &[("CAPYCTL_ADMIN_TOKEN", "x")],
    )
    .fails();
    assert!(line.contains("--server ftp://x"), "{line}");
}

/// `capyctl completion <shell>` prints a script naming the commands.
#[test]
fn shell_completions() {
    for shell in ["bash", "zsh", "fish"] {
        let out = capyctl(&["completion", shell], &[]).ok();
        assert!(out.contains("capyctl"), "{shell}");
        assert!(
            out.contains("deployments") && out.contains("preinitialize"),
            "{shell}"
        );
    }
    let line = capyctl(&["completion", "cmd"], &[]);
    assert_ne!(line.code, 0);
}

/// `preinitialize` prepares a model whose checkpoint awaits measurement without serving it
/// (started, first answer recorded, parked); `delete` stops its engine and forgets it; a
/// refusal (`capability_missing:deep_park`) comes back from `preinitialize` as one line.
#[test]
fn preinitialize_and_delete() {
    let dir = temp_dir("preinit");
    let capy = Capy::start(&dir, &document("", "", &[]));
    let file = dir.join("fresh.yaml");
    std::fs::write(
        &file,
        "name: fresh\nengine: vllm\nmodel: Qwen3-4B\nenv: {ENGINE_SIM_WEIGHTS_BYTES: 64MiB}\n",
    )
    .unwrap();
    capy.cli(&["deploy", "model", "--file", file.to_str().unwrap()])
        .ok();
    let out = capy.cli(&["preinitialize", "deployment", "fresh"]).ok();
    assert!(out.starts_with("preinitialize deployment fresh ("), "{out}");
    let status = capy.status_until("fresh", "prepared and parked", |s| s["state"] == "parked");
    let pid = status["instances"][0]["pid"].as_u64().unwrap();
    assert!(alive(pid));
    // A request wakes it (checked against the first answer preinitialize recorded).
    assert_eq!(chat(capy.inference, "fresh", false).status, 200);

    let out = capy.cli(&["delete", "deployment", "fresh"]).ok();
    assert!(out.starts_with("deleted deployment fresh ("), "{out}");
    assert_eq!(capy.list(), "NAME   STATE   READY   REVISION   HOSTS\n");
    let gone = std::time::Instant::now();
    while alive(pid) {
        assert!(
            gone.elapsed() < support::PATIENCE,
            "engine {pid} outlived its delete"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let r = chat(capy.inference, "fresh", false);
    assert_error(&r, 404, "model_not_found", false);

    let gpt = dir.join("gpt.yaml");
    std::fs::write(&gpt, "name: gpt\nengine: vllm\nmodel: openai/gpt-oss-20b\nresources: {gpu_memory: 6GiB, weights_memory: 64MiB}\n").unwrap();
    capy.cli(&["deploy", "model", "--file", gpt.to_str().unwrap()])
        .ok();
    let line = capy.cli(&["preinitialize", "deployment", "gpt"]).fails();
    assert!(line.contains("capability_missing"), "{line}");
}

/// `capyctl start host --file host.yaml` (DESIGN.md 4.1): a host agent, the same program as
/// `capyctl-node-agent`: it serves the agent API with the shared token, runs engines as child
/// processes outside Kubernetes, and a SIGTERM stops it cleanly.
#[test]
fn start_host_runs_a_host_agent() {
    let dir = temp_dir("start-host");
    let bin = support::engine_sim().display().to_string();
    let doc = dir.join("host.yaml");
    std::fs::write(
        &doc,
        format!(
            "id: box-7\ngpus: [{{memory: 24GiB}}]\nhost_memory: 8GiB\nengines:\n  vllm: {{command: [\"{bin}\"]}}\n"
        ),
    )
    .unwrap();
    let port = capyctl_test_support::free_port();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut child = std::process::Command::new(support::capyctl())
        .args(["start", "host", "--file"])
        .arg(&doc)
        .args(["--listen", &addr.to_string(), "--data-dir"])
        .arg(dir.join("data"))
        .env("CAPYCTL_AGENT_TOKEN", "host-token")
        .env_remove("CAPYCTL_AGENT_TOKEN_FILE")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("CAPYCTL_ENGINE_RUNTIME")
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let info = loop {
        if std::net::TcpStream::connect(addr).is_ok() {
            break support::request(
                addr,
                "GET",
                "/agent/v1/info",
                &[("authorization", "Bearer host-token")],
                b"",
            );
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the host agent never listened"
        );
        assert!(child.try_wait().unwrap().is_none(), "it exited early");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(info.status, 200, "{info:?}");
    let v = info.json();
    assert_eq!(v["host_id"], "box-7", "{v:#}");
    assert_eq!(v["engine_runtime"], "process", "{v:#}");
    let refused = support::request(
        addr,
        "GET",
        "/agent/v1/info",
        &[("authorization", "Bearer wrong")],
        b"",
    );
    assert_eq!(refused.status, 401, "{refused:?}");
    support::signal(child.id(), "TERM");
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
}

/// The test CA, server certificate and key (`spec/tests/fixtures/tls/README.md`).
fn tls_fixture(name: &str) -> String {
    format!(
        "{}/../spec/tests/fixtures/tls/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// `POST /v1/chat/completions` over HTTPS, the server verified against the test CA: status and
/// body.
fn chat_over_tls(addr: std::net::SocketAddr, model: &str, stream: bool) -> (u16, String) {
    use http_body_util::{BodyExt, Full};
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;

    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(tls_fixture("ca.crt")).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_only()
        .enable_http1()
        .build();
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build::<_, Full<bytes::Bytes>>(connector);
    let body = serde_json::json!({
        "model": model,
        "stream": stream,
        "messages": [{"role": "user", "content": "hello"}],
    })
    .to_string();
    let request = http::Request::post(format!("https://{addr}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(bytes::Bytes::from(body)))
        .unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let answer = client.request(request).await.unwrap();
        let status = answer.status().as_u16();
        let body = answer.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8(body.to_vec()).unwrap())
    })
}

/// `server.listen.tls`: both listeners speak HTTPS; the CLI reaches the management listener
/// with `--ca-file` and refuses it, in one line, without; inference is answered, streamed and
/// not; an unreadable key is refused at start, naming the file, and nothing starts.
#[test]
fn tls_listeners() {
    let dir = temp_dir("tls");
    let tls = format!(
        "    tls:\n      cert: \"{}\"\n      key: \"{}\"\n",
        tls_fixture("server.crt"),
        tls_fixture("server.key")
    );
    let capy = Capy::start(&dir, &document("", &tls, &[&model("chat-a", "")]));
    assert!(
        capy.banner
            .contains(&format!("inference https://{}", capy.inference))
            && capy
                .banner
                .contains(&format!("management https://{}", capy.management)),
        "{}",
        capy.banner
    );
    let server = format!("https://{}", capy.management);
    let data_dir = capy.dir.to_str().unwrap().to_string();
    let out = capyctl(
        &[
            "list",
            "deployments",
            "--server",
            &server,
            "--ca-file",
            &tls_fixture("ca.crt"),
        ],
        &[("CAPYCTL_DATA_DIR", &data_dir)],
    )
    .ok();
    assert!(out.contains("chat-a"), "{out}");
    // The test CA is in no system store: without --ca-file the certificate is not trusted.
    let line = capyctl(
        &["list", "deployments", "--server", &server],
        &[("CAPYCTL_DATA_DIR", &data_dir)],
    )
    .fails();
    assert!(line.contains(&server), "{line}");
    // Plain HTTP on the TLS listener is not served.
    let plain = capyctl(
        &[
            "list",
            "deployments",
            "--server",
            &format!("http://{}", capy.management),
        ],
        &[("CAPYCTL_DATA_DIR", &data_dir)],
    );
    assert_ne!(plain.code, 0, "{plain:?}");

    let (status, body) = chat_over_tls(capy.inference, "chat-a", false);
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(v["choices"][0]["message"]["content"].is_string(), "{body}");
    let (status, body) = chat_over_tls(capy.inference, "chat-a", true);
    assert_eq!(status, 200, "{body}");
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    drop(capy);

    let bad = temp_dir("tls-bad-key");
    let missing = bad.join("missing.key");
    let doc = document(
        "",
        &format!(
            "    tls:\n      cert: \"{}\"\n      key: \"{}\"\n",
            tls_fixture("server.crt"),
            missing.display()
        ),
        &[],
    );
    let out = Capy::try_start(&bad, &doc, &[], &[]).err().unwrap();
    let line = out.fails();
    assert!(
        line.contains("server.listen.tls: cannot read private key")
            && line.contains(&missing.display().to_string()),
        "{line}"
    );
    // Nothing started: no lock, no token, no state, no engine (at most the empty directory).
    let left: Vec<_> = std::fs::read_dir(bad.join("data"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "{left:?}");
}
