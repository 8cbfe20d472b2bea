//! The local host agent with the real `engine-sim` binary as child processes: start, sample,
//! park, wake, stop, every wake failure, an engine crash during a wake, tiers from the host's
//! memory and GPUs, what a parked engine still holds, and crash recovery (adopt a live engine,
//! clean the record of a dead one; more in `recovery.rs`).
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use capyctl_engine_sim::testing::AdapterDirs;
use capyctl_node_agent::agent::{AgentConfig, EngineExit, ParkResult};
use capyctl_node_agent::inventory::NoGpus;
use capyctl_node_agent::launch::MaxRunningSource;
use capyctl_node_agent::measure::{GpuHeld, GpuHeldSource};
use capyctl_node_agent::process::{ProcessRuntime, alive};
use capyctl_node_agent::spec::{DecisionSpec, GpuOverride, InstanceSpec};
use capyctl_node_agent::tier::{NoParkReason, ParkChoice, ParkTier};
use capyctl_node_agent::verify::WakeOutcome;
use capyctl_node_agent::{AgentError, HostAgent, LocalHostAgent};
use capyctl_spec::EngineKind;
use capyctl_spec::Residency;
use common::agents::{
    MIB, agent, agent_with_probe, assert_no_records, sample_arrives, set_fault, settings, spec,
};
use tokio::sync::broadcast::error::{RecvError, TryRecvError};

#[tokio::test]
async fn start_sample_park_wake_stop() {
    let dir = common::temp_dir("cycle");
    let a = agent(&dir, 1024 * MIB, false);
    let started = a
        .start("i-vllm", &spec(EngineKind::Vllm, ""))
        .await
        .unwrap();
    assert_eq!(started.max_running.count, Some(32));
    assert_eq!(started.max_running.source, MaxRunningSource::Default);
    assert_eq!(started.version.as_deref(), Some("0.32.0"));
    assert!(started.parking.may_park);
    let sample = sample_arrives(&a, "i-vllm").await;
    assert_eq!(sample.engine.unwrap().running, Some(0));

    assert_eq!(
        a.park("i-vllm").await.unwrap().tier(),
        Some(ParkTier::HostRam)
    );
    let report = a.wake("i-vllm").await.unwrap();
    assert_eq!(report.outcome, WakeOutcome::Pass);
    report.into_result().unwrap();

    let pid = started.pid;
    a.stop("i-vllm").await.unwrap();
    assert!(!alive(pid));
    assert_no_records(&dir);
    assert!(a.sample("i-vllm").is_none());

    let engines = a.engines().await;
    let vllm = engines
        .iter()
        .find(|e| e.engine == EngineKind::Vllm)
        .unwrap();
    assert_eq!(vllm.version.as_deref(), Some("0.32.0"));
    assert_eq!(vllm.deep_park.to_string(), "enabled");
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn tiers_follow_the_host() {
    let dir = common::temp_dir("tiers");
    // No room for a 64 MiB copy: vLLM parks deep; SGLang launches without the CPU backup.
    let small = agent(&dir, 16 * MIB, false);
    small.start("v", &spec(EngineKind::Vllm, "")).await.unwrap();
    assert_eq!(small.park("v").await.unwrap().tier(), Some(ParkTier::Deep));
    assert_eq!(small.wake("v").await.unwrap().outcome, WakeOutcome::Pass);
    let sg = small
        .start("s", &spec(EngineKind::Sglang, ""))
        .await
        .unwrap();
    assert!(!sg.parking.host_ram);
    assert_eq!(sg.max_running.source, MaxRunningSource::Engine);
    assert_eq!(small.park("s").await.unwrap().tier(), Some(ParkTier::Deep));
    assert_eq!(small.wake("s").await.unwrap().outcome, WakeOutcome::Pass);
    // TensorFold, restart_only and decision models stop.
    small
        .start("t", &spec(EngineKind::Tensorfold, ""))
        .await
        .unwrap();
    assert_eq!(
        small.park("t").await.unwrap(),
        ParkResult::Stopped {
            reason: NoParkReason::EngineDoesNotPark
        }
    );
    let mut ro = spec(EngineKind::Vllm, "");
    ro.residency = Some(Residency::RestartOnly);
    small.start("r", &ro).await.unwrap();
    assert_eq!(
        small.park("r").await.unwrap(),
        ParkResult::Stopped {
            reason: NoParkReason::RestartOnly
        }
    );
    let mut dm = spec(EngineKind::Vllm, "");
    dm.decision = Some(DecisionSpec {
        prompt: "Is the sky blue?".into(),
        options: vec!["yes".into(), "no".into()],
    });
    small.start("d", &dm).await.unwrap();
    assert_eq!(
        small.park("d").await.unwrap(),
        ParkResult::Stopped {
            reason: NoParkReason::DecisionModel
        }
    );
    small.stop_all().await;

    // Unified memory: deep.
    let unified = agent(&dir, 1024 * MIB, true);
    unified
        .start("u", &spec(EngineKind::Sglang, ""))
        .await
        .unwrap();
    assert_eq!(
        unified.park("u").await.unwrap().tier(),
        Some(ParkTier::Deep)
    );
    unified.stop_all().await;

    // A refusal-table model: parking refused with capability_missing:deep_park.
    let roomy = agent(&dir, 1024 * MIB, false);
    let mut gpt = spec(EngineKind::Vllm, "");
    gpt.model = "openai/gpt-oss-20b".into();
    let err = roomy.parkability(&gpt).await.unwrap_err();
    assert_eq!(
        err.to_api_error("01KAGENT").unwrap().code(),
        "capability_missing:deep_park"
    );
    roomy.start("g", &gpt).await.unwrap();
    let err = roomy.park("g").await.unwrap_err();
    assert!(matches!(err, AgentError::CapabilityMissing { .. }), "{err}");
    assert_eq!(
        err.to_api_error("01KAGENT").unwrap().code(),
        "capability_missing:deep_park"
    );
    // Refused, not parked: the engine still serves until the lifecycle stops it.
    assert_eq!(roomy.parked_tier("g"), None);
    roomy.stop_all().await;
    assert_no_records(&dir);
    let _ = std::fs::remove_dir_all(dir);
}

/// A process that takes the engine's port while the engine loads (an engine binds its port only
/// once loaded) and answers there as an engine would is not taken for the engine: the start
/// waits for the engine's own listener and fails naming the holder, leaving nothing running.
#[tokio::test]
async fn a_process_that_takes_the_engines_port_is_not_taken_for_the_engine() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = common::temp_dir("port-race");
    let mut config = common::agents::config(&dir);
    config.ready_timeout = Duration::from_secs(3);
    let a = Arc::new(
        LocalHostAgent::new(config, settings(1024 * MIB, false), Arc::new(NoGpus)).unwrap(),
    );
    let mut s = spec(EngineKind::Vllm, "");
    // The engine does not bind its port within the test.
    s.env
        .insert("ENGINE_SIM_STARTUP_DELAY".into(), "60s".into());
    let starting = {
        let a = Arc::clone(&a);
        tokio::spawn(async move { a.start("race", &s).await })
    };
    // The simulator, like vLLM, gives its port back during start-up ("engine-sim serving" is
    // logged just before): from then on the port is free and the impostor takes it.
    let records = ProcessRuntime::new(&dir).unwrap();
    let log = dir.join("engines").join("race.log");
    let (port, impostor) = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let port = records.records().unwrap().first().map(|r| r.port);
            let serving =
                std::fs::read_to_string(&log).is_ok_and(|l| l.contains("engine-sim serving"));
            if let (Some(port), true) = (port, serving)
                && let Ok(l) = tokio::net::TcpListener::bind(("127.0.0.1", port)).await
            {
                return (port, l);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the engine is spawned and gives its port back during its start-up");
    // The impostor answers every request 200 with what an engine's check answer looks like.
    let serving = tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = impostor.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let body = r#"{"id":"cmpl-1","object":"text_completion","model":"chat-a","choices":[{"index":0,"text":" five, six","finish_reason":"length"}],"version":"0.32.0"}"#;
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(answer.as_bytes()).await;
            });
        }
    });
    let err = starting.await.unwrap().unwrap_err();
    serving.abort();
    let text = err.to_string();
    assert!(text.contains("did not become ready"), "{text}");
    assert!(
        text.contains(&format!(
            "port {port} answered, but it is held by pid {}",
            std::process::id()
        )),
        "the error names the process that holds the port: {text}"
    );
    assert_no_records(&dir);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_failed_start_names_the_engines_log() {
    let dir = common::temp_dir("start-log");
    let log = dir.join("engines").join("bad.log");
    // The engine exits before it is ready.
    let a = agent(&dir, 1024 * MIB, false);
    let err = a
        .start("bad", &spec(EngineKind::Vllm, "crash"))
        .await
        .unwrap_err();
    assert!(matches!(err, AgentError::EngineExited { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("exit status: 70") && text.contains(&log.display().to_string()),
        "{text}"
    );
    // The log holds why, and the error quotes it.
    let output = std::fs::read_to_string(&log).unwrap();
    assert!(output.contains("simulated crash"), "{output}");
    // The last line that names an error: engine-sim's own ERROR log line of the crash.
    assert!(
        text.contains("its last error: ") && text.contains("engine-sim crashing (simulated)"),
        "{text}"
    );

    // A flag the engine does not have: it exits at once (vLLM: status 2), and the error names
    // the engine's own line.
    let mut unknown = spec(EngineKind::Vllm, "");
    unknown.extra_args = vec!["--no-such-flag".into(), "3".into()];
    let err = a.start("flag", &unknown).await.unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("exit status: 2")
            && text
                .contains("its last error: vllm: error: unrecognized arguments: --no-such-flag 3"),
        "{text}"
    );

    // The engine never becomes ready within the bound: stopped, and the error says where its
    // output is.
    let mut config = AgentConfig::new(&dir);
    config.ready_timeout = Duration::from_millis(500);
    let slow = LocalHostAgent::new(config, settings(1024 * MIB, false), Arc::new(NoGpus)).unwrap();
    let mut sp = spec(EngineKind::Sglang, "");
    sp.env
        .insert("ENGINE_SIM_STARTUP_DELAY".into(), "60s".into());
    let err = slow.start("slow", &sp).await.unwrap_err();
    assert!(matches!(err, AgentError::EngineNotReady { .. }), "{err}");
    assert_eq!(err.metric_label(), "engine_not_ready");
    let text = err.to_string();
    let slow_log = dir.join("engines").join("slow.log");
    assert!(
        text.contains("/health") && text.contains(&slow_log.display().to_string()),
        "{text}"
    );
    assert_no_records(&dir);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn an_engine_crash_during_a_wake_fails_the_wake() {
    let dir = common::temp_dir("crash");
    let a = agent(&dir, 1024 * MIB, false);
    let started = a
        .start("c", &spec(EngineKind::Vllm, "crash_on_wake"))
        .await
        .unwrap();
    assert_eq!(a.park("c").await.unwrap().tier(), Some(ParkTier::HostRam));
    let report = a.wake("c").await.unwrap();
    assert!(
        matches!(report.outcome, WakeOutcome::EngineExited(_)),
        "{:?}",
        report.outcome
    );
    assert_eq!(
        report.into_result().unwrap_err().metric_label(),
        "wake_reload_failed"
    );
    assert!(!alive(started.pid));
    assert!(a.sample("c").is_none());
    assert_no_records(&dir);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_restarted_agent_adopts_live_engines_and_cleans_dead_ones() {
    let dir = common::temp_dir("recover");
    let first = agent(&dir, 1024 * MIB, false);
    let live = first
        .start("live", &spec(EngineKind::Vllm, ""))
        .await
        .unwrap();
    let dead = first
        .start("dead", &spec(EngineKind::Sglang, ""))
        .await
        .unwrap();
    assert_eq!(
        first.park("live").await.unwrap().tier(),
        Some(ParkTier::HostRam)
    );
    drop(first); // CapyCTL "crashes": nothing is stopped.
    assert!(alive(live.pid) && alive(dead.pid));

    std::process::Command::new("kill")
        .args(["-9", &dead.pid.to_string()])
        .status()
        .unwrap();
    for _ in 0..100 {
        if !alive(dead.pid) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let second = agent(&dir, 1024 * MIB, false);
    let report = second.recover().await.unwrap();
    assert_eq!(report.adopted.len(), 1, "{report:?}");
    assert_eq!(report.adopted[0].instance, "live");
    assert_eq!(report.adopted[0].parked, Some(ParkTier::HostRam));
    assert_eq!(report.gone, vec!["dead".to_string()]);
    // The adopted engine is driven as before: woken (checked against the recorded first
    // answer), sampled, stopped.
    assert_eq!(
        second.wake("live").await.unwrap().outcome,
        WakeOutcome::Pass
    );
    sample_arrives(&second, "live").await;
    second.stop("live").await.unwrap();
    assert!(!alive(live.pid));
    assert_no_records(&dir);
    let _ = std::fs::remove_dir_all(dir);
}

/// The next exit event, bounded so that a missing event fails the test instead of hanging it.
async fn next_exit(rx: &mut tokio::sync::broadcast::Receiver<EngineExit>) -> EngineExit {
    tokio::time::timeout(Duration::from_secs(20), rx.recv())
        .await
        .expect("no exit event within 20 s")
        .unwrap()
}

#[tokio::test]
async fn an_engine_that_exits_by_itself_is_reported_once_and_forgotten() {
    let dir = common::temp_dir("exits");
    let a = agent(&dir, 1024 * MIB, false);
    let mut exits = a.subscribe_exits();
    let mut second_subscriber = a.subscribe_exits();
    let ready = a.start("awake", &spec(EngineKind::Vllm, "")).await.unwrap();
    let parked = a
        .start("parked", &spec(EngineKind::Sglang, ""))
        .await
        .unwrap();
    a.park("parked").await.unwrap();
    sample_arrives(&a, "awake").await;

    // A ready engine crashes.
    set_fault(&a, "awake", "crash").await;
    let exit = next_exit(&mut exits).await;
    assert_eq!(
        exit,
        EngineExit {
            instance: "awake".into(),
            status: Some("exit status: 70".into())
        }
    );
    assert_eq!(next_exit(&mut second_subscriber).await, exit);
    assert!(!alive(ready.pid));
    assert!(a.sample("awake").is_none());
    assert!(a.pid("awake").is_none());
    assert!(matches!(
        a.stop("awake").await,
        Err(AgentError::UnknownInstance { .. })
    ));
    assert!(matches!(
        a.park("awake").await,
        Err(AgentError::UnknownInstance { .. })
    ));
    // The same ID can be started again.
    let again = a.start("awake", &spec(EngineKind::Vllm, "")).await.unwrap();

    // A parked engine killed from outside (an OOM kill).
    std::process::Command::new("kill")
        .args(["-9", &parked.pid.to_string()])
        .status()
        .unwrap();
    assert_eq!(
        next_exit(&mut exits).await,
        EngineExit {
            instance: "parked".into(),
            status: Some("signal: 9 (SIGKILL)".into())
        }
    );
    assert!(matches!(
        a.wake("parked").await,
        Err(AgentError::UnknownInstance { .. })
    ));
    let records = ProcessRuntime::new(&dir).unwrap().records().unwrap();
    assert_eq!(
        records
            .iter()
            .map(|r| r.instance.as_str())
            .collect::<Vec<_>>(),
        ["awake"]
    );
    assert_eq!(records[0].pid, again.pid);

    // Exactly one event each: nothing more is queued, and a stop sends nothing.
    a.stop("awake").await.unwrap();
    assert!(!alive(again.pid));
    assert!(matches!(exits.try_recv(), Err(TryRecvError::Empty)));
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn exits_during_a_wake_or_a_stop_are_not_reported() {
    let dir = common::temp_dir("exit-wake");
    let a = agent(&dir, 1024 * MIB, false);
    let mut exits = a.subscribe_exits();
    a.start("c", &spec(EngineKind::Vllm, "crash_on_wake"))
        .await
        .unwrap();
    a.park("c").await.unwrap();
    let report = a.wake("c").await.unwrap();
    assert!(matches!(report.outcome, WakeOutcome::EngineExited(_)));
    // Parked then stopped instead (TensorFold does not park), and stopped by the lifecycle.
    a.start("t", &spec(EngineKind::Tensorfold, ""))
        .await
        .unwrap();
    assert!(matches!(
        a.park("t").await.unwrap(),
        ParkResult::Stopped { .. }
    ));
    a.start("s", &spec(EngineKind::Vllm, "")).await.unwrap();
    a.stop("s").await.unwrap();
    // The failed wake and the stops removed their instances before returning, so no event can
    // still be on its way.
    assert!(matches!(exits.try_recv(), Err(TryRecvError::Empty)));
    drop(a);
    // The agent is gone: the channel closes.
    let closed = tokio::time::timeout(Duration::from_secs(10), exits.recv()).await;
    assert!(matches!(closed, Ok(Err(RecvError::Closed))), "{closed:?}");
    let _ = std::fs::remove_dir_all(dir);
}

/// An agent that cannot watch its engines: the default `subscribe_exits`.
struct Blind;

impl HostAgent for Blind {
    fn inventory(
        &self,
    ) -> capyctl_node_agent::agent::BoxFuture<
        '_,
        Result<capyctl_node_agent::inventory::Inventory, AgentError>,
    > {
        unimplemented!()
    }
    fn engines(
        &self,
    ) -> capyctl_node_agent::agent::BoxFuture<'_, Vec<capyctl_node_agent::capability::EngineInfo>>
    {
        unimplemented!()
    }
    fn measure<'a>(
        &'a self,
        _: &'a InstanceSpec,
    ) -> capyctl_node_agent::agent::BoxFuture<
        'a,
        Result<capyctl_node_agent::measure::Measurement, AgentError>,
    > {
        unimplemented!()
    }
    fn parkability<'a>(
        &'a self,
        _: &'a InstanceSpec,
    ) -> capyctl_node_agent::agent::BoxFuture<
        'a,
        Result<capyctl_node_agent::tier::ParkChoice, AgentError>,
    > {
        unimplemented!()
    }
    fn start<'a>(
        &'a self,
        _: &'a str,
        _: &'a InstanceSpec,
    ) -> capyctl_node_agent::agent::BoxFuture<
        'a,
        Result<capyctl_node_agent::agent::StartedInstance, AgentError>,
    > {
        unimplemented!()
    }
    fn park<'a>(
        &'a self,
        _: &'a str,
    ) -> capyctl_node_agent::agent::BoxFuture<'a, Result<ParkResult, AgentError>> {
        unimplemented!()
    }
    fn wake<'a>(
        &'a self,
        _: &'a str,
    ) -> capyctl_node_agent::agent::BoxFuture<
        'a,
        Result<capyctl_node_agent::agent::WakeReport, AgentError>,
    > {
        unimplemented!()
    }
    fn stop<'a>(
        &'a self,
        _: &'a str,
    ) -> capyctl_node_agent::agent::BoxFuture<'a, Result<(), AgentError>> {
        unimplemented!()
    }
    fn sample(&self, _: &str) -> Option<capyctl_node_agent::load::LoadSample> {
        None
    }
    fn recover(
        &self,
    ) -> capyctl_node_agent::agent::BoxFuture<
        '_,
        Result<capyctl_node_agent::agent::RecoveryReport, AgentError>,
    > {
        unimplemented!()
    }
}

#[tokio::test]
async fn the_default_exit_subscription_is_closed() {
    let agent: Arc<dyn HostAgent> = Arc::new(Blind);
    let mut rx = agent.subscribe_exits();
    assert!(matches!(rx.recv().await, Err(RecvError::Closed)));
}

/// Polls the agent's sample (bounded: 10 s) until `pred` holds.
async fn sample_where(
    agent: &LocalHostAgent,
    id: &str,
    what: &str,
    pred: impl Fn(&capyctl_node_agent::load::LoadSample) -> bool,
) -> capyctl_node_agent::load::LoadSample {
    for _ in 0..200 {
        if let Some(s) = agent.sample(id).filter(|s| pred(s)) {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no sample {what} for {id}; last: {:?}", agent.sample(id));
}

fn signal(pid: u32, sig: &str) {
    let status = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

#[tokio::test]
async fn an_engine_that_stops_answering_has_unknown_load_not_zero() {
    let dir = common::temp_dir("unreadable");
    let a = agent(&dir, 1024 * MIB, false);
    let started = a
        .start("frozen", &spec(EngineKind::Vllm, ""))
        .await
        .unwrap();
    let before = sample_where(&a, "frozen", "with figures", |s| s.engine.is_some()).await;
    // The engine hangs (stopped, not gone): samples keep coming, with no figures.
    signal(started.pid, "-STOP");
    let frozen = sample_where(&a, "frozen", "without figures", |s| {
        s.engine.is_none() && s.sampled_at_ms > before.sampled_at_ms
    })
    .await;
    assert!(frozen.took >= Duration::from_millis(200), "{frozen:?}");
    signal(started.pid, "-CONT");
    sample_where(&a, "frozen", "with figures again", |s| {
        s.engine.is_some() && s.sampled_at_ms > frozen.sampled_at_ms
    })
    .await;
    a.stop("frozen").await.unwrap();
    assert!(a.sample("frozen").is_none());
    let _ = std::fs::remove_dir_all(dir);
}

/// Runs `op` to its end while reading the agent's sample of `id` every 10 ms; the result, and
/// the dates (`sampled_at_ms`) of every sample seen meanwhile.
async fn dates_seen_during<T>(
    agent: &LocalHostAgent,
    id: &str,
    op: impl std::future::Future<Output = T>,
) -> (T, Vec<u64>) {
    tokio::pin!(op);
    let mut seen = Vec::new();
    loop {
        tokio::select! {
            out = &mut op => return (out, seen),
            () = tokio::time::sleep(Duration::from_millis(10)) => {
                if let Some(s) = agent.sample(id) {
                    seen.push(s.sampled_at_ms);
                }
            }
        }
    }
}

/// The load sampler leaves an engine alone while it parks or wakes (those calls are on a
/// switch's path; a scrape of vLLM holds its event loop meanwhile): no scrape begins between
/// the start and the end of either, and samples resume after.
#[tokio::test]
async fn no_load_scrape_begins_while_an_engine_parks_or_wakes() {
    let dir = common::temp_dir("no-scrape");
    let a = agent(&dir, 1024 * MIB, false);
    let mut slow = spec(EngineKind::Vllm, "");
    // 64 MiB at 128 MiB/s: a park and a wake take about 0.5 s each, five sample intervals.
    slow.env
        .insert("ENGINE_SIM_HOST_BANDWIDTH".into(), "128MiB".into());
    a.start("slow", &slow).await.unwrap();
    let mut last = sample_arrives(&a, "slow").await.sampled_at_ms;
    for step in ["park", "wake"] {
        let began = ProcessRuntime::now_ms();
        let (done, seen) = match step {
            "park" => {
                let (r, seen) = dates_seen_during(&a, "slow", a.park("slow")).await;
                (r.map(|p| p.tier().is_some()).unwrap(), seen)
            }
            _ => {
                let (r, seen) = dates_seen_during(&a, "slow", a.wake("slow")).await;
                (r.unwrap().outcome == WakeOutcome::Pass, seen)
            }
        };
        let ended = ProcessRuntime::now_ms();
        assert!(done, "{step}");
        assert!(ended - began >= 400, "the {step} took {} ms", ended - began);
        // A scrape that began before the agent marked the engine (a few ms after `began`)
        // may still land; none may begin later.
        let mut during: Vec<u64> = seen
            .iter()
            .copied()
            .filter(|&at| at > began + 50 && at < ended)
            .collect();
        during.dedup();
        assert!(
            during.is_empty(),
            "scrapes began during the {step} ({began}..{ended} ms): {during:?}"
        );
        last = sample_where(&a, "slow", "after the step", |s| {
            s.sampled_at_ms >= ended && s.sampled_at_ms > last
        })
        .await
        .sampled_at_ms;
    }
    a.stop("slow").await.unwrap();
    let _ = std::fs::remove_dir_all(dir);
}

/// Reads every engine process as holding `0` bytes of GPU memory (an NVML stand-in).
struct FixedProbe(u64);

impl capyctl_node_agent::inventory::GpuProbe for FixedProbe {
    fn gpus(&self) -> Result<Vec<capyctl_node_agent::inventory::GpuInfo>, AgentError> {
        Ok(Vec::new())
    }

    fn process_gpu_memory(&self, _pid: u32) -> Option<u64> {
        Some(self.0)
    }
}

#[tokio::test]
async fn a_park_reports_what_the_engine_still_holds_on_the_gpu() {
    let dir = common::temp_dir("gpu-held");
    // No reading: the estimate, a quarter of the 64 MiB weights (the residue of CUDA context,
    // graphs and pools), plus the weights themselves when only the KV cache is given back.
    let a = agent(&dir, 1024 * MIB, false);
    a.start("v", &spec(EngineKind::Vllm, "")).await.unwrap();
    let parked = a.park("v").await.unwrap();
    let estimated = GpuHeld {
        bytes: 16 * MIB,
        source: GpuHeldSource::Estimated,
    };
    assert_eq!(parked.gpu_held(), Some(estimated));
    assert_eq!(a.parked_gpu_held("v"), Some(estimated));
    let mut speculative = spec(EngineKind::Sglang, "");
    speculative.extra_args = vec!["--speculative-algorithm".into(), "EAGLE".into()];
    a.start("k", &speculative).await.unwrap();
    let parked = a.park("k").await.unwrap();
    assert_eq!(parked.tier(), Some(ParkTier::KvOnly));
    assert_eq!(parked.gpu_held().unwrap().bytes, 80 * MIB);
    // Awake again: nothing to account for beyond the instance's own memory.
    assert_eq!(a.wake("v").await.unwrap().outcome, WakeOutcome::Pass);
    assert_eq!(a.parked_gpu_held("v"), None);
    a.stop_all().await;

    // A probe that reads the engine's processes: the reading.
    let observed = agent_with_probe(&dir, 1024 * MIB, false, Arc::new(FixedProbe(300 * MIB)));
    observed
        .start("o", &spec(EngineKind::Vllm, ""))
        .await
        .unwrap();
    let parked = observed.park("o").await.unwrap();
    assert_eq!(
        parked.gpu_held(),
        Some(GpuHeld {
            bytes: 300 * MIB,
            source: GpuHeldSource::Observed
        })
    );
    observed.stop_all().await;
    assert_no_records(&dir);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn sglang_parks_in_host_ram_once_its_footprint_is_known() {
    let dir = common::temp_dir("learned");
    let a = agent_with_probe(&dir, 1024 * MIB, false, Arc::new(FixedProbe(64 * MIB)));
    // A hub model, nothing declared: its size is unknown at the first start, so SGLang starts
    // without the CPU backup and parks deep.
    let mut hub = spec(EngineKind::Sglang, "");
    hub.resources.weights_memory = None;
    assert!(a.measure(&hub).await.unwrap().awaiting());
    let first = a.start("s1", &hub).await.unwrap();
    assert!(first.parking.may_park && !first.parking.host_ram);
    assert_eq!(first.measurement.gpu_memory.unwrap().bytes, 64 * MIB);
    assert_eq!(a.park("s1").await.unwrap().tier(), Some(ParkTier::Deep));
    a.stop("s1").await.unwrap();
    // The footprint is known now: no longer awaiting measurement, and a fresh start keeps
    // the backup and parks in host RAM.
    assert_eq!(
        a.measure(&hub).await.unwrap().gpu_memory.unwrap().bytes,
        64 * MIB
    );
    let second = a.start("s2", &hub).await.unwrap();
    assert!(second.parking.host_ram);
    assert_eq!(a.park("s2").await.unwrap().tier(), Some(ParkTier::HostRam));
    assert_eq!(a.wake("s2").await.unwrap().outcome, WakeOutcome::Pass);
    a.stop_all().await;
    assert_no_records(&dir);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn host_ram_room_counts_the_other_parked_copies_and_parks_in_flight() {
    let dir = common::temp_dir("room");
    // Room for one 64 MiB copy, not two.
    let a = agent(&dir, 100 * MIB, false);
    for id in ["a", "b", "c", "d"] {
        a.start(id, &spec(EngineKind::Vllm, "")).await.unwrap();
    }
    // One after the other: the second no longer fits beside the first copy.
    assert_eq!(a.park("a").await.unwrap().tier(), Some(ParkTier::HostRam));
    assert_eq!(a.park("b").await.unwrap().tier(), Some(ParkTier::Deep));
    // Once the copy is woken back, its room is free again.
    assert_eq!(a.wake("a").await.unwrap().outcome, WakeOutcome::Pass);
    // Two at once: the first choice reserves the copy's room, so only one gets it.
    let (c, d) = tokio::join!(a.park("c"), a.park("d"));
    let mut tiers = vec![c.unwrap().tier(), d.unwrap().tier()];
    tiers.sort_by_key(|t| format!("{t:?}"));
    assert_eq!(tiers, [Some(ParkTier::Deep), Some(ParkTier::HostRam)]);
    a.stop_all().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn the_gpu_an_engine_uses_decides_unified_memory() {
    let dir = common::temp_dir("unified-per-gpu");
    let mut s = settings(1024 * MIB, false);
    s.gpus = Some(vec![
        GpuOverride {
            memory: 80 * 1024 * MIB,
            unified: false,
            uuid: Some("GPU-discrete".into()),
        },
        GpuOverride {
            memory: 128 * 1024 * MIB,
            unified: true,
            uuid: Some("GPU-unified".into()),
        },
    ]);
    let a = LocalHostAgent::new(common::agents::config(&dir), s, Arc::new(NoGpus)).unwrap();
    for (visible, tier) in [
        ("0", ParkTier::HostRam),
        ("GPU-discrete", ParkTier::HostRam),
        ("1", ParkTier::Deep),
        ("0,1", ParkTier::Deep),
    ] {
        let mut sp = spec(EngineKind::Vllm, "");
        sp.env.insert("CUDA_VISIBLE_DEVICES".into(), visible.into());
        assert_eq!(
            a.parkability(&sp).await.unwrap(),
            ParkChoice::Park(tier),
            "CUDA_VISIBLE_DEVICES={visible}"
        );
    }
    let mut on_unified = spec(EngineKind::Vllm, "");
    on_unified
        .env
        .insert("CUDA_VISIBLE_DEVICES".into(), "1".into());
    a.start("u", &on_unified).await.unwrap();
    assert_eq!(a.park("u").await.unwrap().tier(), Some(ParkTier::Deep));
    a.stop_all().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn failed_wakes_leave_the_instance_stopped() {
    let dir = common::temp_dir("wake-failures");
    // A failed reload (a deep park: no room for the copy) and a wake that never finishes
    // (within a 1 s window), and an engine that says it woke but did not.
    let mut config = common::agents::config(&dir);
    config.wake_window = Duration::from_secs(1);
    let a = LocalHostAgent::new(config, settings(16 * MIB, false), Arc::new(NoGpus)).unwrap();
    for (id, engine, fault, code) in [
        ("r", EngineKind::Vllm, "reload_fails", "wake_reload_failed"),
        ("h", EngineKind::Sglang, "wake_hangs", "wake_uncertain"),
        ("i", EngineKind::Vllm, "wake_ignored", "wake_reload_failed"),
    ] {
        let started = a.start(id, &spec(engine, "")).await.unwrap();
        assert!(a.park(id).await.unwrap().tier().is_some());
        set_fault(&a, id, fault).await;
        let report = a.wake(id).await.unwrap();
        assert_eq!(
            report.into_result().unwrap_err().metric_label(),
            code,
            "{fault}"
        );
        // Stopped: the process is gone, the record removed, the instance unknown.
        assert!(!alive(started.pid), "{fault}");
        assert!(a.sample(id).is_none());
        assert!(matches!(
            a.stop(id).await,
            Err(AgentError::UnknownInstance { .. })
        ));
        assert_no_records(&dir);
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn an_engine_that_claims_to_park_but_does_not_fails_the_park() {
    let dir = common::temp_dir("park-ignored");
    let a = agent(&dir, 1024 * MIB, false);
    for engine in [EngineKind::Vllm, EngineKind::Sglang] {
        a.start("x", &spec(engine, "sleep_ignored")).await.unwrap();
        let err = a.park("x").await.unwrap_err();
        assert!(
            err.to_string().contains("confirm asleep"),
            "{engine}: {err}"
        );
        // Not taken for parked: the lifecycle stops it.
        assert_eq!(a.parked_tier("x"), None);
        a.stop("x").await.unwrap();
        assert_no_records(&dir);
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Polls `f` every 20 ms until it holds (bounded: 20 s).
async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(std::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Issue 16, item 5: a stop during a start that never becomes ready (the engine hangs in its
/// start-up) and during a wake that never ends stops the engine at once; the start or wake
/// answers `cancelled`, and nothing is left behind.
#[tokio::test]
async fn a_stop_ends_a_start_or_a_wake_in_progress() {
    let dir = common::temp_dir("stop-ends");
    let a = Arc::new(agent(&dir, 1024 * MIB, false));
    let mut hangs = spec(EngineKind::Vllm, "");
    hangs
        .env
        .insert("ENGINE_SIM_STARTUP_DELAY".into(), "3600s".into());
    let starting = {
        let (a, hangs) = (a.clone(), hangs.clone());
        tokio::spawn(async move { a.start("s", &hangs).await })
    };
    until("the engine is launched", || a.pid("s").is_some()).await;
    let pid = a.pid("s").unwrap();
    let began = std::time::Instant::now();
    a.stop("s").await.unwrap();
    // The stop grace is 5 s; the engine ends on SIGTERM at once.
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
    assert_no_records(&dir);

    // A wake that never answers.
    let started = a.start("w", &spec(EngineKind::Sglang, "")).await.unwrap();
    assert!(a.park("w").await.unwrap().tier().is_some());
    set_fault(&a, "w", "wake_hangs").await;
    let waking = {
        let a = a.clone();
        tokio::spawn(async move { a.wake("w").await })
    };
    until("the wake is under way", || {
        common::agents::record(&dir, "w").transition.is_some()
    })
    .await;
    let began = std::time::Instant::now();
    a.stop("w").await.unwrap();
    assert!(
        began.elapsed() < Duration::from_secs(5),
        "{:?}",
        began.elapsed()
    );
    assert!(!alive(started.pid));
    let e = waking.await.unwrap().unwrap_err();
    assert!(
        matches!(e, AgentError::Cancelled { what: "wake", .. }),
        "{e:?}"
    );
    assert!(a.sample("w").is_none());
    assert_no_records(&dir);
    let _ = std::fs::remove_dir_all(dir);
}

/// Adapter calls and a park or a stop of the same instance (DESIGN 4.9): a park begun while a
/// load hangs in the engine waits for that load to end (here its timeout) before it reaches
/// the engine, and a load begun during the park is refused as such; a stop ends a hanging
/// load with `Cancelled` and stops the engine.
#[tokio::test]
async fn adapter_calls_do_not_race_a_park_or_a_stop() {
    let dir = common::temp_dir("adapters-park");
    let loras = AdapterDirs::rank8("node-agent-adapters-park", &["one"]).unwrap();
    let lora = &loras.path("one");
    let mut config = common::agents::config(&dir);
    config.timeouts.check = Duration::from_secs(3);
    let a = LocalHostAgent::new(config, settings(1024 * MIB, false), Arc::new(NoGpus)).unwrap();
    let mut sp = spec(EngineKind::Vllm, "");
    sp.adapters = Some(capyctl_interfaces::spec::AdapterSlots {
        max_loaded: 2,
        max_rank: 8,
    });
    a.start("i-1", &sp).await.unwrap();
    set_fault(&a, "i-1", "adapter_load_hangs").await;

    let load_ended = std::cell::Cell::new(false);
    let load = async {
        let loaded = a.load_adapter("i-1", "one", lora).await;
        load_ended.set(true);
        loaded
    };
    // `join!` polls the load first: it holds the instance when the park begins.
    let park = async {
        let park = a.park("i-1");
        tokio::pin!(park);
        tokio::select! {
            biased;
            done = &mut park => panic!("the park ended at once: {done:?}"),
            () = std::future::ready(()) => {}
        }
        let refused = a.load_adapter("i-1", "two", lora).await.unwrap_err();
        assert!(
            matches!(&refused, AgentError::WrongState { detail, .. } if detail.contains("parking")),
            "{refused:?}"
        );
        let parked = park.await;
        assert!(load_ended.get(), "the park reached the engine mid-load");
        parked
    };
    let (loaded, parked) = tokio::join!(load, park);
    assert!(
        matches!(&loaded, Err(AgentError::EngineTimeout { .. })),
        "{loaded:?}"
    );
    assert_eq!(parked.unwrap().tier(), Some(ParkTier::HostRam));
    let refused = a.adapters("i-1").await.unwrap_err();
    assert!(
        matches!(refused, AgentError::WrongState { .. }),
        "{refused:?}"
    );
    assert_eq!(a.wake("i-1").await.unwrap().outcome, WakeOutcome::Pass);

    // A stop while a load hangs: the load is ended, the engine stopped.
    let pid = a.pid("i-1").unwrap();
    let (loaded, stopped) = tokio::join!(a.load_adapter("i-1", "one", lora), a.stop("i-1"));
    assert!(
        matches!(
            &loaded,
            Err(AgentError::Cancelled {
                what: "adapter load",
                ..
            })
        ),
        "{loaded:?}"
    );
    stopped.unwrap();
    assert!(!alive(pid));
    assert_no_records(&dir);
    let _ = std::fs::remove_dir_all(dir);
}
