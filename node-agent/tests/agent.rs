//! The local host agent with the real `engine-sim` binary as child processes: start, sample,
//! park, wake, stop, an engine crash during a wake, tiers from the host's memory, and crash
//! recovery (adopt a live engine, clean the record of a dead one).
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use capyctl_crds::EngineKind;
use capyctl_crds::Residency;
use capyctl_node_agent::agent::{AgentConfig, EngineExit, ParkResult};
use capyctl_node_agent::http::{Call, EngineClient};
use capyctl_node_agent::inventory::NoGpus;
use capyctl_node_agent::launch::MaxRunningSource;
use capyctl_node_agent::process::{ProcessRuntime, alive};
use capyctl_node_agent::spec::{DecisionSpec, GpuOverride, HostSettings, InstanceSpec};
use capyctl_node_agent::tier::{NoParkReason, ParkTier};
use capyctl_node_agent::verify::WakeOutcome;
use capyctl_node_agent::{AgentError, HostAgent, LocalHostAgent};
use tokio::sync::broadcast::error::{RecvError, TryRecvError};

const MIB: u64 = 1024 * 1024;

fn settings(host_memory: u64, unified: bool) -> HostSettings {
    let bin = common::engine_sim_binary();
    let mut s = HostSettings::all_engines(vec![bin.to_string_lossy().into_owned()]);
    s.gpus = Some(vec![GpuOverride {
        memory: 80 * 1024 * MIB,
        unified,
        uuid: None,
    }]);
    s.host_memory = Some(host_memory);
    s
}

fn agent(dir: &std::path::Path, host_memory: u64, unified: bool) -> LocalHostAgent {
    let mut config = AgentConfig::new(dir);
    config.ready_timeout = Duration::from_secs(20);
    config.wake_window = Duration::from_secs(20);
    config.stop_grace = Duration::from_secs(5);
    config.sample_interval = Duration::from_millis(100);
    LocalHostAgent::new(config, settings(host_memory, unified), Arc::new(NoGpus)).unwrap()
}

fn spec(engine: EngineKind, faults: &str) -> InstanceSpec {
    let mut s = InstanceSpec::new("01KAGENT", "chat-a", engine, "Qwen3-4B");
    s.env
        .insert("ENGINE_SIM_WEIGHTS_BYTES".into(), "64MiB".into());
    if !faults.is_empty() {
        s.env.insert("ENGINE_SIM_FAULTS".into(), faults.into());
    }
    s.resources.weights_memory = Some(64 * MIB);
    s
}

/// No pid record is left in `dir`.
fn assert_no_records(dir: &std::path::Path) {
    let left = ProcessRuntime::new(dir).unwrap().records().unwrap();
    assert!(left.is_empty(), "records left: {left:?}");
}

async fn sample_arrives(agent: &LocalHostAgent, id: &str) -> capyctl_node_agent::load::LoadSample {
    for _ in 0..100 {
        if let Some(s) = agent.sample(id) {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no load sample for {id}");
}

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
    assert_eq!(started.version.as_deref(), Some("0.31.0"));
    assert!(started.parking.may_park);
    let sample = sample_arrives(&a, "i-vllm").await;
    assert_eq!(sample.engine.unwrap().running, Some(0));

    assert_eq!(
        a.park("i-vllm").await.unwrap(),
        ParkResult::Parked {
            tier: ParkTier::HostRam
        }
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
    assert_eq!(vllm.version.as_deref(), Some("0.31.0"));
    assert_eq!(vllm.deep_park.to_string(), "enabled");
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn tiers_follow_the_host() {
    let dir = common::temp_dir("tiers");
    // No room for a 64 MiB copy: vLLM parks deep; SGLang launches without the CPU backup.
    let small = agent(&dir, 16 * MIB, false);
    small.start("v", &spec(EngineKind::Vllm, "")).await.unwrap();
    assert_eq!(
        small.park("v").await.unwrap(),
        ParkResult::Parked {
            tier: ParkTier::Deep
        }
    );
    assert_eq!(small.wake("v").await.unwrap().outcome, WakeOutcome::Pass);
    let sg = small
        .start("s", &spec(EngineKind::Sglang, ""))
        .await
        .unwrap();
    assert!(!sg.parking.host_ram);
    assert_eq!(sg.max_running.source, MaxRunningSource::Engine);
    assert_eq!(
        small.park("s").await.unwrap(),
        ParkResult::Parked {
            tier: ParkTier::Deep
        }
    );
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
        unified.park("u").await.unwrap(),
        ParkResult::Parked {
            tier: ParkTier::Deep
        }
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
    assert!(roomy.park("g").await.is_err());
    roomy.stop_all().await;
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
    // The log holds why.
    let output = std::fs::read_to_string(&log).unwrap();
    assert!(output.contains("simulated crash"), "{output}");

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
    assert_eq!(
        a.park("c").await.unwrap(),
        ParkResult::Parked {
            tier: ParkTier::HostRam
        }
    );
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
        first.park("live").await.unwrap(),
        ParkResult::Parked {
            tier: ParkTier::HostRam
        }
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

/// Sets `fault` on the simulator behind `instance` (`crash` exits it before it answers).
async fn set_fault(agent: &LocalHostAgent, instance: &str, fault: &str) {
    let ep = agent.endpoint(instance).unwrap();
    let url = ep.url("/sim/faults");
    let call = Call {
        engine: ep.engine,
        step: "sim faults",
        url: &url,
        timeout: Duration::from_secs(5),
    };
    let body = serde_json::json!({ "set": [fault] });
    let _ = EngineClient::new()
        .send(call, http::Method::POST, Some(&body))
        .await;
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
