//! The host agent over HTTP, through real sockets: a [`RemoteHostAgent`] against the node
//! agent's server wrapping a [`LocalHostAgent`] whose engines are the `engine-sim` binary; the
//! error body round trip of every [`AgentError`] variant; and the real `capyctl-node-agent`
//! binary (health, an authed call, SIGTERM stopping its engines, refusals at start).
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use capyctl_engine_sim::testing::AdapterDirs;
use capyctl_node_agent::agent::{AgentConfig, EngineExit};
use capyctl_node_agent::inventory::NoGpus;
use capyctl_node_agent::load::LoadSample;
use capyctl_node_agent::process::alive;
use capyctl_node_agent::remote::wire::{AgentInfo, AgentTiming, ErrorBody};
use capyctl_node_agent::remote::{RemoteConfig, RemoteHostAgent, RemoteTimeouts, ServerOptions};
use capyctl_node_agent::spec::{GpuOverride, HostSettings, InstanceSpec};
use capyctl_node_agent::tier::ParkTier;
use capyctl_node_agent::verify::WakeOutcome;
use capyctl_node_agent::{AgentError, HostAgent, LocalHostAgent};
use capyctl_spec::EngineKind;
use capyctl_spec::errors::WakeFailure;
use http::{Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::sync::oneshot;

const MIB: u64 = 1024 * 1024;
const TOKEN: &str = "s3cret-agent-token";

fn settings() -> HostSettings {
    let bin = common::engine_sim_binary();
    let mut s = HostSettings::all_engines(vec![bin.to_string_lossy().into_owned()]);
    s.gpus = Some(vec![GpuOverride {
        memory: 80 * 1024 * MIB,
        unified: false,
        uuid: None,
    }]);
    s.host_memory = Some(1024 * MIB);
    s
}

fn agent_config(dir: &Path) -> AgentConfig {
    let mut config = AgentConfig::new(dir);
    config.ready_timeout = Duration::from_secs(20);
    config.wake_window = Duration::from_secs(20);
    config.stop_grace = Duration::from_secs(5);
    config.sample_interval = Duration::from_millis(100);
    config
}

fn spec(engine: EngineKind) -> InstanceSpec {
    let mut s = InstanceSpec::new("01KREMOTE", "chat-a", engine, "Qwen3-4B");
    s.env
        .insert("ENGINE_SIM_WEIGHTS_BYTES".into(), "64MiB".into());
    s.resources.weights_memory = Some(64 * MIB);
    s
}

/// A server over a local agent on a loopback port; dropping it stops the server.
struct Served {
    url: String,
    local: Arc<LocalHostAgent>,
    _stop: oneshot::Sender<()>,
}

async fn served(dir: &Path) -> Served {
    served_at(dir, "127.0.0.1:0").await
}

/// [`served`] on `addr` (a port of an earlier server, for a restart).
async fn served_at(dir: &Path, addr: &str) -> Served {
    let config = agent_config(dir);
    let local = Arc::new(LocalHostAgent::new(config, settings(), Arc::new(NoGpus)).unwrap());
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let options = ServerOptions {
        token: TOKEN.into(),
        info: AgentInfo {
            node_name: "node-a".into(),
            host_id: "host-a".into(),
            engine_runtime: "process".into(),
            version: "test".into(),
            timing: AgentTiming::from(local.config()),
        },
    };
    let (tx, rx) = oneshot::channel::<()>();
    let agent: Arc<dyn HostAgent> = local.clone();
    tokio::spawn(capyctl_node_agent::remote::serve(
        listener,
        agent,
        options,
        async move {
            let _ = rx.await;
        },
    ));
    Served {
        url: format!("http://{addr}"),
        local,
        _stop: tx,
    }
}

fn remote(url: &str, token: &str) -> RemoteHostAgent {
    let mut config = RemoteConfig::new(url, token);
    config.sample_poll = Duration::from_millis(200);
    config.retry_after = Duration::from_millis(100);
    config.exits_wait = Duration::from_secs(5);
    RemoteHostAgent::new(config).unwrap()
}

/// Waits (bounded) until `f` holds, checking every 20 ms.
async fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn raw_get(url: &str, token: Option<&str>) -> (StatusCode, serde_json::Value) {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let mut req = Request::get(url);
    if let Some(t) = token {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let resp = client
        .request(req.body(Full::new(Bytes::new())).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&body).unwrap())
}

#[tokio::test]
async fn start_sample_park_wake_stop_over_http() {
    let dir = common::temp_dir("remote-cycle");
    let s = served(&dir).await;
    let r = remote(&s.url, TOKEN);

    let info = r.info().await.unwrap();
    assert_eq!(info.node_name, "node-a");
    assert_eq!(info.timing.wake_window, Duration::from_secs(20));
    // The poller adopts the agent's own timing (plus the margin).
    let expected = RemoteTimeouts::for_timing(&info.timing);
    eventually("the agent's timing", || {
        (r.timeouts() == expected).then_some(())
    })
    .await;
    assert_eq!(
        expected.wake,
        Duration::from_secs(20)
            + Duration::from_secs(20)
            + Duration::from_secs(5)
            + RemoteTimeouts::MARGIN
    );

    let inv = r.inventory().await.unwrap();
    assert_eq!(inv, s.local.inventory().await.unwrap());

    let started = r.start("i-1", &spec(EngineKind::Vllm)).await.unwrap();
    assert_eq!(started.instance, "i-1");
    assert_eq!(Some(started.pid), s.local.pid("i-1"));
    assert_eq!(started.version.as_deref(), Some("0.32.0"));
    assert!(started.parking.may_park);

    // The sample comes through the poller, as the agent took it.
    let sample: LoadSample = eventually("a sample", || r.sample("i-1")).await;
    assert_eq!(sample.engine.unwrap().running, Some(0));
    assert!(r.samples().contains_key("i-1"));

    assert_eq!(r.park("i-1").await.unwrap().tier(), Some(ParkTier::HostRam));
    assert_eq!(s.local.parked_tier("i-1"), Some(ParkTier::HostRam));
    let report = r.wake("i-1").await.unwrap();
    assert_eq!(report.outcome, WakeOutcome::Pass);
    assert_eq!(s.local.parked_tier("i-1"), None);

    let engines = r.engines().await;
    let vllm = engines
        .iter()
        .find(|e| e.engine == EngineKind::Vllm)
        .unwrap();
    assert_eq!(vllm.version.as_deref(), Some("0.32.0"));
    assert_eq!(engines, s.local.engines().await);

    // A new caller (an operator that restarted or failed over) learns the live engine.
    let parked = r.park("i-1").await.unwrap();
    assert_eq!(parked.tier(), Some(ParkTier::HostRam));
    let second = remote(&s.url, TOKEN);
    let report = second.recover().await.unwrap();
    assert_eq!(report.adopted.len(), 1, "{report:?}");
    assert_eq!(report.adopted[0].instance, "i-1");
    assert_eq!(report.adopted[0].pid, started.pid);
    assert_eq!(report.adopted[0].parked, Some(ParkTier::HostRam));
    assert_eq!(report.adopted[0].base_url, started.base_url);
    assert!(report.gone.is_empty() && report.stopped.is_empty());
    drop(second);

    r.stop("i-1").await.unwrap();
    assert!(!alive(started.pid));
    assert!(r.sample("i-1").is_none());
    assert!(s.local.pid("i-1").is_none());
    let _ = std::fs::remove_dir_all(dir);
}

/// Issue 16, item 5, across the wire: a stop while the start's call is still open ends the
/// start on the node agent (the engine is stopped), and the start's caller gets `cancelled`.
#[tokio::test]
async fn a_stop_over_http_ends_a_start_in_progress() {
    let dir = common::temp_dir("remote-stop-start");
    let s = served(&dir).await;
    let r = Arc::new(remote(&s.url, TOKEN));
    let mut hangs = spec(EngineKind::Vllm);
    hangs
        .env
        .insert("ENGINE_SIM_STARTUP_DELAY".into(), "3600s".into());
    let starting = {
        let r = r.clone();
        tokio::spawn(async move { r.start("i-1", &hangs).await })
    };
    let pid = eventually("the engine is launched", || s.local.pid("i-1")).await;
    let began = Instant::now();
    r.stop("i-1").await.unwrap();
    assert!(
        began.elapsed() < Duration::from_secs(5),
        "{:?}",
        began.elapsed()
    );
    assert!(!alive(pid));
    let e = starting.await.unwrap().unwrap_err();
    assert!(
        matches!(e, AgentError::Cancelled { what: "start", .. }),
        "{e:?}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn an_engine_killed_is_reported_on_the_remote_side() {
    let dir = common::temp_dir("remote-exit");
    let s = served(&dir).await;
    let r = remote(&s.url, TOKEN);
    let mut exits = r.subscribe_exits();
    r.watching_exits().await;

    let started = r.start("i-crash", &spec(EngineKind::Sglang)).await.unwrap();
    eventually("a sample", || r.sample("i-crash")).await;
    let killed_at = Instant::now();
    Command::new("kill")
        .args(["-9", &started.pid.to_string()])
        .status()
        .unwrap();
    let exit = tokio::time::timeout(Duration::from_secs(10), exits.recv())
        .await
        .expect("no exit within 10 s")
        .unwrap();
    let latency = killed_at.elapsed();
    assert_eq!(
        exit,
        EngineExit {
            instance: "i-crash".into(),
            status: Some("signal: 9 (SIGKILL)".into())
        }
    );
    assert!(
        latency < Duration::from_secs(1),
        "exit seen after {latency:?}"
    );
    eprintln!("exit reported remotely {latency:?} after the kill");
    // Forgotten on both sides.
    assert!(r.sample("i-crash").is_none());
    assert!(matches!(
        r.park("i-crash").await,
        Err(AgentError::UnknownInstance { .. })
    ));
    let _ = std::fs::remove_dir_all(dir);
}

/// A node agent that stops answering is reported unreachable (why, and for how long); when it
/// comes back as a new process at the same address, the client says so once (`resyncs`), at
/// once rather than after its long poll, and the agent is reachable again.
#[tokio::test]
async fn an_agent_gone_is_unreachable_and_its_new_life_asks_for_a_resync() {
    let dir = common::temp_dir("remote-restart");
    let s = served(&dir).await;
    let r = remote(&s.url, TOKEN);
    let mut health = r.subscribe_health();
    r.watching_exits().await;
    assert_eq!(r.unreachable(), None);
    assert_eq!(health.borrow_and_update().resyncs, 0);

    let addr = s.url.trim_start_matches("http://").to_string();
    drop(s);
    let why = eventually("reported unreachable", || r.unreachable()).await;
    assert!(why.starts_with("no answer for "), "{why}");
    assert!(why.contains(&addr), "{why}");
    assert!(health.has_changed().unwrap(), "the change is told");
    assert_eq!(health.borrow_and_update().resyncs, 0, "no resync yet");

    // The exits' long poll is 5 s here: the new life is seen well before one runs out.
    let back = Instant::now();
    let s = served_at(&dir, &addr).await;
    eventually("a resync asked", || {
        (health.borrow().resyncs == 1 && r.unreachable().is_none()).then_some(())
    })
    .await;
    assert!(
        back.elapsed() < Duration::from_secs(4),
        "{:?}",
        back.elapsed()
    );
    drop(s);
    let _ = std::fs::remove_dir_all(dir);
}

/// The caller's wake window replaces the agent's own (20 s here): a wake that hangs is
/// `wake_uncertain` once the caller's 1 s has passed, and its engine is stopped.
#[tokio::test]
async fn a_wake_within_the_callers_window_ends_a_hanging_wake_at_that_window() {
    let dir = common::temp_dir("remote-wake-window");
    let s = served(&dir).await;
    let r = remote(&s.url, TOKEN);
    let mut hangs = spec(EngineKind::Vllm);
    hangs
        .env
        .insert("ENGINE_SIM_FAULTS".into(), "wake_hangs".into());
    let started = r.start("i-hang", &hangs).await.unwrap();
    assert_eq!(
        r.park("i-hang").await.unwrap().tier(),
        Some(ParkTier::HostRam)
    );
    let asked = Instant::now();
    let report = r
        .wake_within("i-hang", Duration::from_secs(1))
        .await
        .unwrap();
    let took = asked.elapsed();
    assert!(
        matches!(report.outcome, WakeOutcome::Uncertain(_)),
        "{report:?}"
    );
    assert!(
        took < Duration::from_secs(10),
        "the agent's own window ran: {took:?}"
    );
    eventually("the engine stopped", || (!alive(started.pid)).then_some(())).await;
    assert!(s.local.pid("i-hang").is_none());
    let _ = std::fs::remove_dir_all(dir);
}

/// A caller that restarted while its wake was in progress: the new caller's recovery ends that
/// wake and stops its engine (reported `stopped`, not adopted as parked), so that the model is
/// started afresh once, not a second engine beside one still waking.
#[tokio::test]
async fn a_recovery_ends_a_wake_its_caller_left_in_progress() {
    let dir = common::temp_dir("remote-recover-waking");
    let s = served(&dir).await;
    let r = Arc::new(remote(&s.url, TOKEN));
    let mut hangs = spec(EngineKind::Vllm);
    hangs
        .env
        .insert("ENGINE_SIM_FAULTS".into(), "wake_hangs".into());
    let started = r.start("i-waking", &hangs).await.unwrap();
    assert_eq!(
        r.park("i-waking").await.unwrap().tier(),
        Some(ParkTier::HostRam)
    );
    let waking = {
        let r = Arc::clone(&r);
        tokio::spawn(async move { r.wake("i-waking").await })
    };
    eventually("the wake in progress", || {
        s.local.in_progress("i-waking").then_some(())
    })
    .await;
    // The caller "restarts": a new client recovers.
    let second = remote(&s.url, TOKEN);
    let report = second.recover().await.unwrap();
    assert_eq!(report.stopped, ["i-waking"], "{report:?}");
    assert!(report.adopted.is_empty(), "{report:?}");
    assert!(matches!(
        waking.await.unwrap(),
        Err(AgentError::Cancelled { .. })
    ));
    eventually("the engine stopped", || (!alive(started.pid)).then_some(())).await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_wrong_token_is_refused() {
    let dir = common::temp_dir("remote-token");
    let s = served(&dir).await;

    let (status, body) = raw_get(&format!("{}/agent/v1/inventory", s.url), Some("nope")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(body["code"], "unauthorized");
    assert_eq!(body["retryable"], false);
    let (status, _) = raw_get(&format!("{}/agent/v1/samples", s.url), None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, body) = raw_get(&format!("{}/healthz", s.url), None).await;
    assert_eq!(
        (status, body["status"].as_str()),
        (StatusCode::OK, Some("ok"))
    );
    let (status, body) = raw_get(&format!("{}/agent/v1/samples", s.url), Some(TOKEN)).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body["samples"].is_object());
    // The agent's clock, for the caller to date the samples on its own.
    let agent_now = body["now_ms"].as_u64().unwrap();
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    assert!(
        agent_now.abs_diff(before) < 60_000,
        "{agent_now} vs {before}"
    );

    let r = remote(&s.url, "nope");
    let err = r.inventory().await.unwrap_err();
    assert!(
        matches!(&err, AgentError::AgentUnauthorized { url } if url == &format!("{}/agent/v1/inventory", s.url)),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!(
            "node agent at {}/agent/v1/inventory: the agent token was refused (401 unauthorized)",
            s.url
        )
    );
    r.health().await.unwrap();
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn agent_errors_cross_the_wire_as_the_same_variant() {
    let dir = common::temp_dir("remote-errors");
    let s = served(&dir).await;
    let r = remote(&s.url, TOKEN);

    // A capability refusal.
    let mut gpt = spec(EngineKind::Vllm);
    gpt.model = "openai/gpt-oss-20b".into();
    let local = s.local.parkability(&gpt).await.unwrap_err();
    let there = r.parkability(&gpt).await.unwrap_err();
    assert!(
        matches!(there, AgentError::CapabilityMissing { .. }),
        "{there:?}"
    );
    assert_eq!(there.to_string(), local.to_string());
    assert_eq!(
        there.to_api_error("01KREMOTE").unwrap().code(),
        "capability_missing:deep_park"
    );

    // An unknown instance.
    let local = s.local.park("ghost").await.unwrap_err();
    let there = r.park("ghost").await.unwrap_err();
    assert!(
        matches!(&there, AgentError::UnknownInstance { instance } if instance == "ghost"),
        "{there:?}"
    );
    assert_eq!(there.to_string(), local.to_string());
    // Wrong state, and an odd instance ID in the path.
    let there = r.wake("a b/c").await.unwrap_err();
    assert!(
        matches!(&there, AgentError::UnknownInstance { instance } if instance == "a b/c"),
        "{there:?}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn an_unreachable_agent_is_a_clear_error() {
    let port = capyctl_test_support::free_port();
    let url = format!("http://127.0.0.1:{port}");
    let r = remote(&url, TOKEN);
    let err = r.inventory().await.unwrap_err();
    assert!(
        matches!(&err, AgentError::AgentUnreachable { .. }),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(
        text.starts_with(&format!(
            "node agent at {url}/agent/v1/inventory: cannot reach it: "
        )),
        "{text}"
    );
    assert!(err.retryable());
    assert!(r.sample("x").is_none());
    assert!(matches!(
        RemoteHostAgent::new(RemoteConfig::new("ftp://x", TOKEN)),
        Err(AgentError::AgentUnreachable { .. })
    ));
}

#[test]
fn every_error_round_trips_through_its_body() {
    let errors = vec![
        AgentError::EngineUnreachable {
            engine: EngineKind::Vllm,
            step: "collective_rpc",
            url: "http://127.0.0.1:1/collective_rpc".into(),
            source: "connection refused".into(),
        },
        AgentError::EngineStatus {
            engine: EngineKind::Vllm,
            step: "sleep",
            url: "http://127.0.0.1:1/sleep".into(),
            status: 500,
            body: "boom".into(),
        },
        AgentError::EngineTimeout {
            engine: EngineKind::Sglang,
            step: "wake_up",
            url: "http://127.0.0.1:1/x".into(),
            after: Duration::from_millis(1500),
        },
        AgentError::EngineAnswer {
            engine: EngineKind::Tensorfold,
            step: "health",
            url: "u".into(),
            detail: "bad".into(),
        },
        AgentError::EngineExited {
            engine: EngineKind::Vllm,
            instance: "i".into(),
            status: "exit status: 70".into(),
            log: Some("/data/engines/i.log".into()),
        },
        AgentError::EngineNotReady {
            engine: EngineKind::Sglang,
            instance: "i".into(),
            log: Some("/data/engines/i.log".into()),
            source: Box::new(AgentError::EngineTimeout {
                engine: EngineKind::Sglang,
                step: "readiness (GET /health until 200)",
                url: "http://127.0.0.1:1/health".into(),
                after: Duration::from_secs(1800),
            }),
        },
        AgentError::CapabilityMissing {
            reason: "gpt-oss on vLLM and SGLang cannot be woken correctly by its engine",
        },
        AgentError::ResidencyRefused { reason: "r".into() },
        AgentError::InvalidSpec { detail: "d".into() },
        AgentError::Unsupported {
            engine: EngineKind::Tensorfold,
            what: "parking",
        },
        AgentError::WakeFailed {
            failure: WakeFailure::Mismatch,
            detail: "answers differ".into(),
        },
        AgentError::UnknownInstance {
            instance: "i".into(),
        },
        AgentError::WrongState {
            instance: "i".into(),
            detail: "already parked".into(),
        },
        AgentError::Cancelled {
            instance: "i".into(),
            what: "start",
        },
        AgentError::Checkpoint {
            path: PathBuf::from("/m/model.safetensors"),
            detail: "short header".into(),
        },
        AgentError::Io {
            what: "read /x".into(),
            source: std::io::Error::from_raw_os_error(2),
        },
        AgentError::Json {
            what: "pid record /x".into(),
            source: serde_json::from_str::<u8>("x").unwrap_err(),
        },
        AgentError::AgentUnreachable {
            url: "http://n:7444".into(),
            detail: "refused".into(),
        },
        AgentError::AgentTimeout {
            url: "http://n:7444".into(),
            after: Duration::from_secs(3),
        },
        AgentError::AgentUnauthorized {
            url: "http://n:7444".into(),
        },
        AgentError::AgentAnswer {
            url: "http://n:7444".into(),
            detail: "d".into(),
        },
        AgentError::Remote {
            code: "new_code".into(),
            message: "something new".into(),
            retryable: true,
        },
    ];
    for e in errors {
        let text = serde_json::to_string(&ErrorBody::of(&e)).unwrap();
        let body: ErrorBody = serde_json::from_str(&text).unwrap();
        assert_eq!(body.code, e.metric_label());
        assert_eq!(body.message, e.to_string());
        let back = body.into_agent_error();
        assert_eq!(back.to_string(), e.to_string(), "{text}");
        assert_eq!(back.metric_label(), e.metric_label(), "{text}");
        assert_eq!(
            std::mem::discriminant(&back),
            std::mem::discriminant(&e),
            "{text}"
        );
        assert_eq!(back.retryable(), e.retryable());
    }
    // An error without fields (another version, the 401) keeps its code and message.
    let back = ErrorBody {
        code: "unauthorized".into(),
        message: "the agent token is missing or wrong".into(),
        retryable: false,
        error: None,
    }
    .into_agent_error();
    assert_eq!(back.to_string(), "the agent token is missing or wrong");
}

// ---- the binary ----

fn binary() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_capyctl-node-agent"));
    c.env_remove("CAPYCTL_AGENT_TOKEN")
        .env_remove("CAPYCTL_AGENT_TOKEN_FILE")
        .env_remove("CAPYCTL_AGENT_LISTEN")
        .env_remove("NODE_NAME")
        .env_remove("CAPYCTL_PUBLISH_HOST")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("KUBERNETES_SERVICE_PORT")
        .env("RUST_LOG", "warn");
    c
}

fn host_document(dir: &Path) -> PathBuf {
    let bin = common::engine_sim_binary();
    let bin = bin.display();
    let path = dir.join("host.yaml");
    std::fs::write(
        &path,
        format!(
            "id: box-1\ngpus:\n  - memory: 80GiB\n    unified: false\nhost_memory: 1GiB\nengines:\n  vllm:\n    command: [\"{bin}\"]\n  sglang:\n    command: [\"{bin}\"]\n  tensorfold:\n    command: [\"{bin}\"]\n"
        ),
    )
    .unwrap();
    path
}

use capyctl_test_support::free_port;

/// Waits (bounded) for the child's exit status.
fn wait_exit(child: &mut std::process::Child, within: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the node agent did not exit within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test]
async fn the_binary_serves_and_stops_its_engines_on_sigterm() {
    let dir = common::temp_dir("remote-binary");
    let doc = host_document(&dir);
    let token_file = dir.join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let port = free_port();
    let mut child = binary()
        .args(["--file"])
        .arg(&doc)
        .args(["--node-name", "node-7", "--engine-runtime", "process"])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .arg("--data-dir")
        .arg(dir.join("data"))
        .args(["--set", "id=box-2"])
        .env("CAPYCTL_AGENT_TOKEN_FILE", &token_file)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let url = format!("http://127.0.0.1:{port}");
    let r = remote(&url, TOKEN);
    let deadline = Instant::now() + Duration::from_secs(20);
    while r.health().await.is_err() {
        assert!(child.try_wait().unwrap().is_none(), "the agent exited");
        assert!(Instant::now() < deadline, "no /healthz within 20 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let info = r.info().await.unwrap();
    assert_eq!(info.node_name, "node-7");
    assert_eq!(info.host_id, "box-2");
    assert_eq!(info.engine_runtime, "process");
    let inv = r.inventory().await.unwrap();
    assert_eq!(inv.host_memory.total_bytes, 1024 * MIB);

    let started = r.start("b-1", &spec(EngineKind::Vllm)).await.unwrap();
    assert!(alive(started.pid));

    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let status = wait_exit(&mut child, Duration::from_secs(30));
    assert_eq!(status.code(), Some(0), "{status:?}");
    assert!(!alive(started.pid), "the engine outlived the agent");
    assert!(matches!(
        r.inventory().await,
        Err(AgentError::AgentUnreachable { .. })
    ));
    let _ = std::fs::remove_dir_all(dir);
}

fn refused(extra: &[&str], env: &[(&str, &str)]) -> String {
    let dir = common::temp_dir("remote-refuse");
    let doc = host_document(&dir);
    let mut c = binary();
    c.arg("--file")
        .arg(&doc)
        .args(["--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.join("data"))
        .args(extra);
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    assert!(!out.status.success(), "{out:?}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    let _ = std::fs::remove_dir_all(dir);
    stderr.trim_end().to_string()
}

#[test]
fn the_binary_refuses_the_pod_runtime_without_a_cluster_and_a_missing_token() {
    let no_cluster = [
        ("CAPYCTL_AGENT_TOKEN", TOKEN),
        ("KUBECONFIG", "/nonexistent/capyctl/kubeconfig"),
        ("HOME", "/nonexistent/capyctl"),
    ];
    let line = refused(&["--engine-runtime", "pod"], &no_cluster);
    assert!(
        line.starts_with(
            "capyctl-node-agent: --engine-runtime pod needs a Kubernetes API server: no in-cluster configuration and no usable kubeconfig"
        ),
        "{line}"
    );
    let line = refused(
        &["--engine-runtime", "process", "--publish-host"],
        &no_cluster,
    );
    assert!(
        line.starts_with("capyctl-node-agent: --publish-host needs a Kubernetes API server"),
        "{line}"
    );
    let line = refused(&["--engine-runtime", "process"], &[]);
    assert_eq!(
        line,
        "capyctl-node-agent: no agent token: set CAPYCTL_AGENT_TOKEN_FILE (a file holding it) or CAPYCTL_AGENT_TOKEN"
    );
}

/// Adapters over the node agent's HTTP API (DESIGN 4.9): an instance started with
/// `adapters` (its engine launched with the LoRA flags and `VLLM_ALLOW_RUNTIME_LORA_UPDATING`)
/// loads, lists and unloads them; a refused load is the engine's own error with its reason,
/// the same variant on this side; a parked instance, one without `adapters` and an unknown
/// one are refused as such; the routes need the token.
#[tokio::test]
async fn adapters_load_list_and_unload_over_http() {
    let dir = common::temp_dir("remote-adapters");
    let loras = AdapterDirs::new(
        "node-agent-remote-adapters",
        &[("support-bot", Some(8)), ("plain", None)],
    )
    .unwrap();
    let (adapter, not_peft) = (loras.path("support-bot"), loras.path("plain"));
    let s = served(&dir).await;
    let r = remote(&s.url, TOKEN);

    let mut base = spec(EngineKind::Vllm);
    base.adapters = Some(capyctl_interfaces::spec::AdapterSlots {
        max_loaded: 2,
        max_rank: 8,
    });
    r.start("i-1", &base).await.unwrap();
    assert!(r.adapters("i-1").await.unwrap().is_empty());
    r.load_adapter("i-1", "support-bot", &adapter)
        .await
        .unwrap();
    assert_eq!(r.adapters("i-1").await.unwrap(), ["support-bot"]);
    assert_eq!(s.local.adapters("i-1").await.unwrap(), ["support-bot"]);

    let err = r.load_adapter("i-1", "plain", &not_peft).await.unwrap_err();
    match &err {
        AgentError::EngineStatus { status, body, .. } => {
            assert_eq!(*status, 404);
            assert!(
                body.starts_with(&format!(
                    "adapter plain ({}): Loading lora plain failed: No adapter found for",
                    not_peft
                )),
                "{body}"
            );
        }
        other => panic!("{other:?}"),
    }
    let (status, body) = raw_get(&format!("{}/agent/v1/instances/i-1/adapters", s.url), None).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (StatusCode::UNAUTHORIZED, Some("unauthorized"))
    );

    // Parked: refused until it wakes (a parked vLLM would hold the call).
    r.park("i-1").await.unwrap();
    let err = r.adapters("i-1").await.unwrap_err();
    assert!(matches!(err, AgentError::WrongState { .. }), "{err:?}");
    assert_eq!(r.wake("i-1").await.unwrap().outcome, WakeOutcome::Pass);
    assert_eq!(r.adapters("i-1").await.unwrap(), ["support-bot"]);

    r.unload_adapter("i-1", "support-bot").await.unwrap();
    r.unload_adapter("i-1", "support-bot").await.unwrap();
    assert!(r.adapters("i-1").await.unwrap().is_empty());

    // Without `adapters`, and an instance the agent does not run.
    r.start("i-2", &spec(EngineKind::Vllm)).await.unwrap();
    let err = r
        .load_adapter("i-2", "support-bot", &adapter)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, AgentError::InvalidSpec { detail } if detail.contains("without adapters")),
        "{err:?}"
    );
    let err = r.adapters("i-9").await.unwrap_err();
    assert!(matches!(err, AgentError::UnknownInstance { .. }), "{err:?}");

    r.stop("i-1").await.unwrap();
    r.stop("i-2").await.unwrap();
    let _ = std::fs::remove_dir_all(dir);
}
