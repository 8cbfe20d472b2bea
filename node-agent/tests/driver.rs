//! The drivers against the engine simulator, in process: every tier's park and wake, every
//! wake outcome the simulator can show without exiting, load samples, readiness.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use capyctl_engine_sim::testing::AdapterDirs;
use capyctl_engine_sim::{SimConfig, serve};
use capyctl_node_agent::AgentError;
use capyctl_node_agent::agent::endpoint_of;
use capyctl_node_agent::driver::{Driver, DriverTimeouts, Endpoint};
use capyctl_node_agent::http::{Call, EngineClient};
use capyctl_node_agent::launch::launch_command;
use capyctl_node_agent::spec::{DecisionSpec, EngineLaunch, InstanceSpec};
use capyctl_node_agent::tier::{LaunchParking, ParkTier};
use capyctl_node_agent::verify::{FirstAnswer, WakeOutcome};
use capyctl_spec::EngineKind;
use http::Method;
use serde_json::{Value, json};

const WINDOW: Duration = Duration::from_secs(20);

fn driver() -> Driver {
    Driver::new(DriverTimeouts {
        step: Duration::from_secs(5),
        park: Duration::from_secs(20),
        check: Duration::from_secs(10),
        idle_probe: Duration::from_millis(500),
    })
}

/// Starts a simulator in this process from the launch command CapyCTL builds for `spec`.
async fn start(spec: &InstanceSpec, parking: LaunchParking, faults: &str) -> Endpoint {
    if faults.is_empty() {
        start_sim(spec, parking, &[]).await
    } else {
        start_sim(spec, parking, &["--sim-faults", faults]).await
    }
}

/// [`start`] with the simulator's own arguments `sim_args` (a version, a fault, an engine
/// environment variable as its flag).
async fn start_sim(spec: &InstanceSpec, parking: LaunchParking, sim_args: &[&str]) -> Endpoint {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let launch = EngineLaunch {
        command: vec!["engine-sim".into()],
        version: None,
        env: Default::default(),
    };
    let cmd = launch_command(spec, &launch, port, parking).unwrap();
    let mut argv = cmd.argv();
    // In process, the environment cannot be set per engine: pass it as the simulator's flag.
    if cmd.env.get("VLLM_SERVER_DEV_MODE").map(String::as_str) == Some("1") {
        argv.extend(["--sim-vllm-dev-mode".into(), "1".into()]);
    }
    if let Some(v) = cmd.env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") {
        argv.extend(["--sim-vllm-runtime-lora-updating".into(), v.clone()]);
    }
    argv.extend(["--sim-weights-bytes".into(), "64MiB".into()]);
    argv.extend(sim_args.iter().map(|a| a.to_string()));
    let config = SimConfig::try_parse_from(argv).unwrap();
    tokio::spawn(serve(listener, config));
    let ep = endpoint_of(spec, port);
    driver()
        .wait_ready(&ep, Duration::from_secs(10))
        .await
        .unwrap();
    ep
}

async fn sim_state(ep: &Endpoint) -> Value {
    let url = ep.url("/sim/state");
    let call = Call {
        engine: ep.engine,
        step: "sim state",
        url: &url,
        timeout: Duration::from_secs(5),
    };
    EngineClient::new()
        .expect_json(call, Method::GET, None)
        .await
        .unwrap()
}

async fn set_fault(ep: &Endpoint, fault: &str) {
    sim_faults(ep, json!({"set": [fault]})).await;
}

/// Posts `body` to the simulator's `/sim/faults`.
async fn sim_faults(ep: &Endpoint, body: Value) {
    let url = ep.url("/sim/faults");
    let call = Call {
        engine: ep.engine,
        step: "sim faults",
        url: &url,
        timeout: Duration::from_secs(5),
    };
    EngineClient::new()
        .expect_ok(call, Method::POST, Some(&body))
        .await
        .unwrap();
}

fn spec(engine: EngineKind) -> InstanceSpec {
    InstanceSpec::new("01KTEST", "chat-a", engine, "Qwen3-4B")
}

const BACKUP: LaunchParking = LaunchParking {
    may_park: true,
    host_ram: true,
};
const NO_BACKUP: LaunchParking = LaunchParking {
    may_park: true,
    host_ram: false,
};

/// First answer, park, check the simulator's state, wake, verify.
async fn round_trip(ep: &Endpoint, tier: ParkTier) -> (Value, WakeOutcome, Value) {
    let d = driver();
    let first = d
        .check_answer(ep, None, Duration::from_secs(5))
        .await
        .unwrap();
    d.park(ep, tier).await.unwrap();
    let parked = sim_state(ep).await;
    let outcome = d
        .wake_and_verify(ep, tier, None, Some(&first), WINDOW)
        .await
        .outcome;
    (parked, outcome, sim_state(ep).await)
}

/// First answer, a host-RAM park, then `fault` set and a wake within `window`.
async fn wake_with_fault(d: &Driver, ep: &Endpoint, fault: &str, window: Duration) -> WakeOutcome {
    let first = d
        .check_answer(ep, None, Duration::from_secs(5))
        .await
        .unwrap();
    d.park(ep, ParkTier::HostRam).await.unwrap();
    set_fault(ep, fault).await;
    d.wake_and_verify(ep, ParkTier::HostRam, None, Some(&first), window)
        .await
        .outcome
}

#[tokio::test]
async fn vllm_level_1_parks_in_host_ram() {
    let ep = start(&spec(EngineKind::Vllm), BACKUP, "").await;
    let (parked, outcome, after) = round_trip(&ep, ParkTier::HostRam).await;
    assert_eq!(parked["weights"], "host_ram");
    assert_eq!(parked["sleep_level"], 1);
    assert_eq!(outcome, WakeOutcome::Pass);
    assert_eq!(after["weights"], "intact");
    assert_eq!(after["asleep"], false);
    assert_eq!(after["reloads"], 0);
}

#[tokio::test]
async fn vllm_level_2_reloads_weights() {
    let ep = start(&spec(EngineKind::Vllm), BACKUP, "").await;
    let (parked, outcome, after) = round_trip(&ep, ParkTier::Deep).await;
    assert_eq!(parked["weights"], "discarded");
    assert_eq!(parked["sleep_level"], 2);
    assert_eq!(outcome, WakeOutcome::Pass);
    assert_eq!(after["weights"], "intact");
    assert_eq!(after["reloads"], 1);
    assert_eq!(after["cache_resets"], 1);
}

#[tokio::test]
async fn sglang_host_ram_with_cpu_backup() {
    let ep = start(&spec(EngineKind::Sglang), BACKUP, "").await;
    let (parked, outcome, after) = round_trip(&ep, ParkTier::HostRam).await;
    assert_eq!(parked["weights"], "host_ram");
    assert_eq!(parked["paused"], true);
    assert_eq!(outcome, WakeOutcome::Pass);
    assert_eq!(after["weights"], "intact");
    assert_eq!(after["paused"], false);
    assert_eq!(after["reloads"], 0);
}

#[tokio::test]
async fn sglang_deep_reloads_from_disk() {
    let ep = start(&spec(EngineKind::Sglang), NO_BACKUP, "").await;
    let (parked, outcome, after) = round_trip(&ep, ParkTier::Deep).await;
    assert_eq!(parked["weights"], "discarded");
    assert_eq!(outcome, WakeOutcome::Pass);
    assert_eq!(after["weights"], "intact");
    assert_eq!(after["reloads"], 1);
    assert_eq!(after["cache_resets"], 1);
    assert_eq!(after["loaded_model"], "Qwen3-4B");
}

#[tokio::test]
async fn sglang_speculative_parks_kv_only() {
    let mut sp = spec(EngineKind::Sglang);
    sp.extra_args = vec!["--speculative-algorithm".into(), "EAGLE".into()];
    let ep = start(&sp, NO_BACKUP, "").await;
    let (parked, outcome, after) = round_trip(&ep, ParkTier::KvOnly).await;
    assert_eq!(parked["weights"], "intact");
    assert_eq!(parked["released_tags"], json!(["kv_cache"]));
    assert_eq!(outcome, WakeOutcome::Pass);
    assert_eq!(after["weights"], "intact");
    assert_eq!(after["reloads"], 0);
    assert_eq!(after["corruption"], Value::Null);
}

#[tokio::test]
async fn changed_weights_are_a_mismatch() {
    let ep = start(&spec(EngineKind::Vllm), BACKUP, "").await;
    set_fault(&ep, "wake_mismatch").await;
    let (_, outcome, _) = round_trip(&ep, ParkTier::HostRam).await;
    assert!(matches!(outcome, WakeOutcome::Mismatch(_)), "{outcome:?}");
    assert_eq!(outcome.failure().unwrap().code(), "wake_mismatch");
}

#[tokio::test]
async fn a_failed_reload_is_reload_failed() {
    for (engine, parking) in [(EngineKind::Vllm, BACKUP), (EngineKind::Sglang, NO_BACKUP)] {
        let ep = start(&spec(engine), parking, "").await;
        set_fault(&ep, "reload_fails").await;
        let (_, outcome, _) = round_trip(&ep, ParkTier::Deep).await;
        let WakeOutcome::ReloadFailed(detail) = &outcome else {
            panic!("{engine}: {outcome:?}");
        };
        // The error names the engine, the step and the URL.
        assert!(detail.contains(engine.as_str()), "{detail}");
        assert!(detail.contains(&ep.base_url), "{detail}");
        let step = if engine == EngineKind::Vllm {
            "reload_weights"
        } else {
            "update_weights_from_disk"
        };
        assert!(detail.contains(step), "{detail}");
    }
}

#[tokio::test]
async fn a_hanging_wake_is_uncertain() {
    let ep = start(&spec(EngineKind::Sglang), BACKUP, "").await;
    let outcome = wake_with_fault(&driver(), &ep, "wake_hangs", Duration::from_millis(300)).await;
    assert!(matches!(outcome, WakeOutcome::Uncertain(_)), "{outcome:?}");
    assert_eq!(outcome.failure().unwrap().code(), "wake_uncertain");
}

#[tokio::test]
async fn tensorfold_does_not_park() {
    let ep = start(&spec(EngineKind::Tensorfold), LaunchParking::default(), "").await;
    let err = driver().park(&ep, ParkTier::Deep).await.unwrap_err();
    assert!(matches!(err, AgentError::Unsupported { .. }), "{err}");
    // Its first answer is still recorded (the check prompt works).
    let first = driver()
        .check_answer(&ep, None, Duration::from_secs(5))
        .await
        .unwrap();
    assert!(matches!(first, FirstAnswer::Text { text } if !text.is_empty()));
}

#[tokio::test]
async fn load_is_scraped_and_unknown_when_unreadable() {
    for engine in [EngineKind::Vllm, EngineKind::Sglang, EngineKind::Tensorfold] {
        let ep = start(&spec(engine), LaunchParking::default(), "").await;
        let load = driver().scrape(&ep, Duration::from_secs(2)).await.unwrap();
        assert_eq!(load.running, Some(0), "{engine}");
        assert_eq!(load.waiting, Some(0), "{engine}");
        assert_eq!(load.kv_usage_ppm, Some(0), "{engine}");
    }
    // Nothing listening: unknown, not zero.
    let closed = endpoint_of(&spec(EngineKind::Vllm), closed_port());
    assert_eq!(
        driver().scrape(&closed, Duration::from_millis(500)).await,
        None
    );
}

#[tokio::test]
async fn engine_facts_are_read() {
    let mut sp = spec(EngineKind::Sglang);
    sp.max_concurrent_requests = Some(12);
    let ep = start(&sp, LaunchParking::default(), "").await;
    assert_eq!(driver().sglang_max_running(&ep).await, Some(12));
    assert_eq!(driver().version(&ep).await.as_deref(), Some("0.5.23"));
    let ep = start(&spec(EngineKind::Vllm), LaunchParking::default(), "").await;
    assert_eq!(driver().version(&ep).await.as_deref(), Some("0.32.0"));
}

/// SGLang sized by itself: `/server_info` has `max_running_requests: null` at top level, and
/// the figure it runs with in `internal_states[0]` (0.5.9 and later).
#[tokio::test]
async fn sglang_sized_by_itself_reports_its_figure() {
    let ep = start(&spec(EngineKind::Sglang), LaunchParking::default(), "").await;
    assert_eq!(driver().sglang_max_running(&ep).await, Some(128));
}

/// SGLang before 0.5.6 has `/get_server_info` only: the version and the figure come from it.
#[tokio::test]
async fn sglang_before_0_5_6_answers_get_server_info() {
    let mut sp = spec(EngineKind::Sglang);
    sp.max_concurrent_requests = Some(12);
    let ep = start_sim(&sp, LaunchParking::default(), &["--sim-version", "0.5.5"]).await;
    assert_eq!(driver().version(&ep).await.as_deref(), Some("0.5.5"));
    assert_eq!(driver().sglang_max_running(&ep).await, Some(12));
}

/// The park and wake send the bodies SGLang 0.5.6 and later require, and older releases
/// accept them: both park and wake.
#[tokio::test]
async fn sglang_parks_and_wakes_on_every_version() {
    for version in ["0.5.5", "0.5.6", "0.5.23"] {
        let ep = start_sim(
            &spec(EngineKind::Sglang),
            BACKUP,
            &["--sim-version", version],
        )
        .await;
        let (parked, outcome, after) = round_trip(&ep, ParkTier::HostRam).await;
        assert_eq!(parked["paused"], true, "{version}");
        assert_eq!(outcome, WakeOutcome::Pass, "{version}");
        assert_eq!(after["paused"], false, "{version}");
    }
}

/// With `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION` off, `/health` answers 200 without
/// generating: the park is still confirmed, and a parked engine is still seen not generating.
#[tokio::test]
async fn sglang_without_health_generation_parks() {
    let ep = start_sim(
        &spec(EngineKind::Sglang),
        BACKUP,
        &["--sim-sglang-health-endpoint-generation", "0"],
    )
    .await;
    let d = driver();
    d.park(&ep, ParkTier::HostRam).await.unwrap();
    assert_eq!(
        d.engine_state(&ep, false).await,
        capyctl_node_agent::recovery::EngineState::NotGenerating
    );
    let outcome = d
        .wake_and_verify(&ep, ParkTier::HostRam, None, None, WINDOW)
        .await
        .outcome;
    assert!(
        matches!(&outcome, WakeOutcome::Uncertain(why) if why.contains("no first answer")),
        "the wake steps passed and only the comparison is missing: {outcome:?}"
    );
}

/// vLLM's `/reset_prefix_cache` answering `{"success": false}` fails the deep wake at that
/// step.
#[tokio::test]
async fn vllm_prefix_cache_not_reset_fails_the_wake() {
    let ep = start(&spec(EngineKind::Vllm), BACKUP, "").await;
    let d = driver();
    let first = d
        .check_answer(&ep, None, Duration::from_secs(5))
        .await
        .unwrap();
    d.park(&ep, ParkTier::Deep).await.unwrap();
    set_fault(&ep, "prefix_cache_reset_fails").await;
    let outcome = d
        .wake_and_verify(&ep, ParkTier::Deep, None, Some(&first), WINDOW)
        .await
        .outcome;
    assert!(
        matches!(&outcome, WakeOutcome::ReloadFailed(why) if why.contains("reset_prefix_cache")),
        "{outcome:?}"
    );
}

fn closed_port() -> u16 {
    capyctl_test_support::free_port()
}

#[tokio::test]
async fn readiness_is_bounded_and_says_where() {
    let ep = endpoint_of(&spec(EngineKind::Vllm), closed_port());
    let err = driver()
        .wait_ready(&ep, Duration::from_millis(300))
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, AgentError::EngineTimeout { .. }), "{text}");
    assert!(
        text.contains("vllm") && text.contains("/health") && text.contains(&ep.base_url),
        "{text}"
    );
}

fn decision() -> DecisionSpec {
    DecisionSpec {
        prompt: "Is the sky blue?".into(),
        options: vec!["yes".into(), "no".into()],
    }
}

/// A decision's first answer, park, wake and the decision compared.
async fn decision_round_trip(ep: &Endpoint, tier: ParkTier) -> (FirstAnswer, WakeOutcome) {
    let d = driver();
    let dm = decision();
    let first = d
        .check_answer(ep, Some(&dm), Duration::from_secs(5))
        .await
        .unwrap();
    d.park(ep, tier).await.unwrap();
    let outcome = d
        .wake_and_verify(ep, tier, Some(&dm), Some(&first), WINDOW)
        .await
        .outcome;
    (first, outcome)
}

#[tokio::test]
async fn a_decision_passes_after_a_good_wake() {
    for (engine, parking, tier) in [
        (EngineKind::Vllm, BACKUP, ParkTier::HostRam),
        (EngineKind::Vllm, BACKUP, ParkTier::Deep),
        (EngineKind::Sglang, NO_BACKUP, ParkTier::Deep),
    ] {
        let mut sp = spec(engine);
        sp.decision = Some(decision());
        let ep = start(&sp, parking, "").await;
        let (first, outcome) = decision_round_trip(&ep, tier).await;
        let FirstAnswer::Decision { answer } = &first else {
            panic!("{first:?}");
        };
        // The engine answered with an option and its log probabilities.
        let picked = answer.picked.as_deref().unwrap();
        assert!(picked == "yes" || picked == "no", "{answer:?}");
        let p = answer.probabilities.as_ref().unwrap();
        assert!(p["yes"] > 0.0 && p["no"] > 0.0, "{p:?}");
        assert!(p[picked] >= 0.6, "{p:?}");
        assert_eq!(outcome, WakeOutcome::Pass, "{engine} {tier:?}");
    }
}

#[tokio::test]
async fn a_decision_after_a_bad_wake_is_a_mismatch() {
    let mut sp = spec(EngineKind::Vllm);
    sp.decision = Some(decision());
    let ep = start(&sp, BACKUP, "").await;
    set_fault(&ep, "wake_mismatch").await;
    let (_, outcome) = decision_round_trip(&ep, ParkTier::HostRam).await;
    let WakeOutcome::Mismatch(why) = &outcome else {
        panic!("{outcome:?}");
    };
    assert!(why.contains("picked None"), "{why}");
    assert_eq!(outcome.failure().unwrap().code(), "wake_mismatch");
}

#[tokio::test]
async fn a_parked_sglang_whose_health_waits_is_parked_not_timed_out() {
    // Real SGLang's /health waits (20 s) for a token while paused; the park's confirmation
    // must not wait for it, nor take the wait for an error.
    for (parking, tier) in [(BACKUP, ParkTier::HostRam), (NO_BACKUP, ParkTier::Deep)] {
        let ep = start(&spec(EngineKind::Sglang), parking, "paused_health_hangs").await;
        let (parked, outcome, after) = round_trip(&ep, tier).await;
        assert_eq!(parked["paused"], true);
        assert_eq!(outcome, WakeOutcome::Pass, "{tier:?}");
        assert_eq!(after["weights"], "intact");
    }
}

#[tokio::test]
async fn an_engine_that_claims_to_park_but_does_not_is_caught() {
    for engine in [EngineKind::Vllm, EngineKind::Sglang] {
        let ep = start(&spec(engine), BACKUP, "sleep_ignored").await;
        let err = driver().park(&ep, ParkTier::HostRam).await.unwrap_err();
        let AgentError::EngineAnswer { step, detail, .. } = &err else {
            panic!("{engine}: {err}");
        };
        assert_eq!(*step, "confirm asleep", "{err}");
        let expected = if engine == EngineKind::Vllm {
            "is_sleeping is false"
        } else {
            "still generates"
        };
        assert!(detail.contains(expected), "{err}");
        assert_eq!(sim_state(&ep).await["weights"], "intact");
    }
}

#[tokio::test]
async fn an_engine_that_claims_to_wake_but_does_not_is_caught() {
    // vLLM's `/wake_up` says so itself (`"status": "sleeping"`, as the real one answers after a
    // partial wake): the wake fails at that step. SGLang's `/health_generate` does not answer.
    for (engine, step, says) in [
        (EngineKind::Vllm, "wake_up", "status \"sleeping\""),
        (EngineKind::Sglang, "confirm awake", "health_generate"),
    ] {
        let ep = start(&spec(engine), BACKUP, "").await;
        let outcome = wake_with_fault(&driver(), &ep, "wake_ignored", WINDOW).await;
        let WakeOutcome::ReloadFailed(detail) = &outcome else {
            panic!("{engine}: {outcome:?}");
        };
        assert!(
            detail.contains(&format!("{engine} {step} at ")) && detail.contains(says),
            "{engine}: {detail}"
        );
        assert_eq!(outcome.failure().unwrap().code(), "wake_reload_failed");
        assert_eq!(sim_state(&ep).await["weights"], "host_ram");
    }
}

/// A vLLM engine on 127.0.0.1 that answers `POST /wake_up` with `wake_answer` (a JSON body,
/// or an empty 200 when `None`) and `GET /is_sleeping` with `asleep`, and returns the request
/// lines it was sent, in order.
async fn fake_vllm(
    wake_answer: Option<&'static str>,
    asleep: bool,
) -> (Endpoint, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = std::sync::Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let log = std::sync::Arc::clone(&log);
            tokio::spawn(async move {
                let mut socket = BufReader::new(socket);
                loop {
                    // The driver's calls here have no body: a request ends at its empty line.
                    let mut first = String::new();
                    if socket.read_line(&mut first).await.unwrap_or(0) == 0 {
                        return;
                    }
                    let mut line = String::new();
                    while socket.read_line(&mut line).await.unwrap_or(0) > 2 {
                        line.clear();
                    }
                    let first = first.trim_end().to_string();
                    let body = if first.starts_with("POST /wake_up ") {
                        wake_answer.unwrap_or("").to_string()
                    } else if first.starts_with("GET /is_sleeping ") {
                        format!("{{\"is_sleeping\":{asleep}}}")
                    } else {
                        panic!("unexpected request {first}")
                    };
                    log.lock().unwrap().push(first);
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                         content-length: {}\r\n\r\n",
                        body.len()
                    );
                    let sent = socket.get_mut().write_all((head + &body).as_bytes()).await;
                    if sent.is_err() {
                        return;
                    }
                }
            });
        }
    });
    let ep = Endpoint {
        engine: EngineKind::Vllm,
        base_url: format!("http://127.0.0.1:{port}"),
        model_name: "chat-a".into(),
        model: "Qwen3-4B".into(),
    };
    (ep, seen)
}

#[tokio::test]
async fn a_vllm_wake_reads_its_answer_and_asks_is_sleeping_only_when_it_says_nothing() {
    const WAKE: &str = "POST /wake_up HTTP/1.1";
    const ASKED: &str = "GET /is_sleeping HTTP/1.1";
    for (answer, asleep, calls, failed) in [
        // vLLM 0.32's answers: no `/is_sleeping` after them.
        (
            Some(r#"{"status":"awake","tags":null}"#),
            true,
            &[WAKE][..],
            None,
        ),
        (
            Some(r#"{"status":"sleeping","tags":null}"#),
            false,
            &[WAKE][..],
            Some(("wake_up", "still asleep")),
        ),
        // An empty 200, as older releases answered: confirmed with `/is_sleeping`.
        (None, false, &[WAKE, ASKED][..], None),
        (
            None,
            true,
            &[WAKE, ASKED][..],
            Some(("confirm awake", "is_sleeping is true")),
        ),
    ] {
        let (ep, seen) = fake_vllm(answer, asleep).await;
        let deadline = tokio::time::Instant::now() + WINDOW;
        let woke = driver().wake_steps(&ep, ParkTier::HostRam, deadline).await;
        assert_eq!(*seen.lock().unwrap(), calls, "{answer:?}");
        match (failed, woke) {
            (None, Ok(())) => {}
            (
                Some((step, says)),
                Err(AgentError::EngineAnswer {
                    step: s, detail, ..
                }),
            ) => {
                assert_eq!(s, step, "{answer:?}: {detail}");
                assert!(detail.contains(says), "{answer:?}: {detail}");
            }
            (expected, got) => panic!("{answer:?}: expected {expected:?}, got {got:?}"),
        }
    }
}

#[tokio::test]
async fn a_steps_own_timeout_inside_the_window_says_which_step() {
    // The wake calls are ignored and /health waits: the confirmation's own timeout (300 ms)
    // fires long before the wake window (20 s) ends.
    let ep = start(&spec(EngineKind::Sglang), BACKUP, "paused_health_hangs").await;
    let d = Driver::new(DriverTimeouts {
        step: Duration::from_millis(300),
        ..driver().timeouts()
    });
    let outcome = wake_with_fault(&d, &ep, "wake_ignored", WINDOW).await;
    let WakeOutcome::Uncertain(detail) = &outcome else {
        panic!("{outcome:?}");
    };
    assert!(
        detail.contains("confirm awake")
            && detail.contains("no answer within 300 ms")
            && detail.contains("the step's own timeout"),
        "{detail}"
    );
    assert_eq!(outcome.failure().unwrap().code(), "wake_uncertain");
}

/// An engine whose answer has no end (chunks sent until the client goes) is answered an
/// error once the answer passes `MAX_ANSWER_BYTES`, rather than read into memory whole.
#[tokio::test]
async fn an_endless_answer_is_cut_at_the_bound() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let sent = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut head = [0u8; 1024];
        let _ = socket.read(&mut head).await.unwrap();
        socket
            .write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            .await
            .unwrap();
        let chunk = format!("{:x}\r\n{}\r\n", 64 * 1024, "x".repeat(64 * 1024));
        let mut sent = 0usize;
        while socket.write_all(chunk.as_bytes()).await.is_ok() {
            sent += 64 * 1024;
        }
        sent
    });
    let url = format!("http://127.0.0.1:{port}/metrics");
    let call = Call {
        engine: EngineKind::Vllm,
        step: "metrics",
        url: &url,
        timeout: Duration::from_secs(30),
    };
    let err = EngineClient::new()
        .expect_ok(call, Method::GET, None)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, AgentError::EngineAnswer { detail, .. } if detail.contains("longer than 16 MiB")),
        "{err}"
    );
    let sent = sent.await.unwrap();
    assert!(
        sent < 4 * capyctl_node_agent::http::MAX_ANSWER_BYTES,
        "{sent} bytes sent"
    );
}

/// PEFT adapter directories for the adapter tests: `one` (rank 8), `big` (rank 32),
/// `plain` (no `adapter_config.json`). Removed on drop.
fn adapter_dirs() -> AdapterDirs {
    AdapterDirs::new(
        "capyctl-driver-lora",
        &[("one", Some(8)), ("big", Some(32)), ("plain", None)],
    )
    .unwrap()
}

/// A base with `adapters: {max_loaded: 2, max_rank: 16}` takes adapters through the driver:
/// loaded and listed, a refusal carrying the engine's reason (a directory that is no PEFT
/// adapter, a rank above the base's), unloaded (again: not an error), on vLLM and SGLang,
/// each launched with CapyCTL's own flags.
#[tokio::test]
async fn adapters_load_list_and_unload_with_the_engines_reasons() {
    let dirs = adapter_dirs();
    let d = driver();
    for engine in [EngineKind::Vllm, EngineKind::Sglang] {
        let mut sp = spec(engine);
        sp.adapters = Some(capyctl_interfaces::spec::AdapterSlots {
            max_loaded: 2,
            max_rank: 16,
        });
        let ep = start_sim(&sp, LaunchParking::default(), &[]).await;
        assert!(d.adapters(&ep).await.unwrap().is_empty(), "{engine}");
        d.load_adapter(&ep, "support-bot", &dirs.path("one"))
            .await
            .unwrap_or_else(|e| panic!("{engine}: {e}"));
        assert_eq!(d.adapters(&ep).await.unwrap(), ["support-bot"], "{engine}");
        for (dir, reason) in [
            ("plain", "No adapter found for"),
            ("big", "LoRA rank 32 is greater than max_lora_rank 16"),
        ] {
            let err = d
                .load_adapter(&ep, "other", &dirs.path(dir))
                .await
                .unwrap_err();
            match &err {
                AgentError::EngineStatus {
                    status, body, step, ..
                } => {
                    let named = format!("adapter other ({}): ", dirs.path(dir));
                    assert!(body.starts_with(&named), "{engine} {dir}: {body}");
                    assert!(body.contains(reason), "{engine} {dir}: {body}");
                    assert!(!body.starts_with('{'), "the reason, not the JSON: {body}");
                    assert_eq!(*step, "load_lora_adapter");
                    assert!(*status >= 400, "{status}");
                }
                other => panic!("{engine} {dir}: {other}"),
            }
        }
        assert_eq!(d.adapters(&ep).await.unwrap(), ["support-bot"], "{engine}");
        d.unload_adapter(&ep, "support-bot").await.unwrap();
        d.unload_adapter(&ep, "support-bot").await.unwrap();
        assert!(d.adapters(&ep).await.unwrap().is_empty(), "{engine}");
    }
    // TensorFold takes none.
    let ep = start_sim(&spec(EngineKind::Tensorfold), LaunchParking::default(), &[]).await;
    assert!(matches!(
        d.adapters(&ep).await,
        Err(AgentError::Unsupported { .. })
    ));
}

/// A load the engine fails or never answers: the engine's reason, or the driver's timeout
/// naming the step (engine-sim's adapter faults).
#[tokio::test]
async fn a_failed_or_hanging_adapter_load_is_an_error_naming_it() {
    let dirs = adapter_dirs();
    let mut sp = spec(EngineKind::Vllm);
    sp.adapters = Some(capyctl_interfaces::spec::AdapterSlots {
        max_loaded: 1,
        max_rank: 8,
    });
    let ep = start_sim(&sp, LaunchParking::default(), &[]).await;
    set_fault(&ep, "adapter_load_fails").await;
    let err = driver()
        .load_adapter(&ep, "one", &dirs.path("one"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("adapter_load_fails"), "{err}");
    // A reason of 1 MiB (the engine's message whole) is cut short, after the adapter's name.
    let huge = "x".repeat(1 << 20);
    sim_faults(
        &ep,
        json!({"clear": ["adapter_load_fails"], "adapters": {"one": {"fails": huge}}}),
    )
    .await;
    match driver().load_adapter(&ep, "one", &dirs.path("one")).await {
        Err(AgentError::EngineStatus { status, body, .. }) => {
            assert_eq!(status, 500);
            let named = format!(
                "adapter one ({}): Call to add_lora method failed",
                dirs.path("one")
            );
            assert!(body.starts_with(&named), "{}", &body[..200]);
            assert!(
                body.len() < 2048 && body.ends_with('…'),
                "{} bytes",
                body.len()
            );
        }
        other => panic!("{other:?}"),
    }
    set_fault(&ep, "adapter_load_hangs").await;
    let quick = Driver::new(DriverTimeouts {
        check: Duration::from_millis(300),
        ..DriverTimeouts::default()
    });
    let err = quick
        .load_adapter(&ep, "one", &dirs.path("one"))
        .await
        .unwrap_err();
    assert!(
        matches!(
            &err,
            AgentError::EngineTimeout {
                step: "load_lora_adapter",
                ..
            }
        ),
        "{err}"
    );
}
