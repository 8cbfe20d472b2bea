//! The lifecycle against the real `engine-sim` binary, with the router's real coordinator and
//! listener over real sockets. The GPU is declared 10 GiB and every deployment 6 GiB, so two
//! never fit together.
#![allow(clippy::unwrap_used)]

use capyctl_test_support::harness as support;

use std::time::Duration;

use capyctl_lifecycle::api::ManagementApi;
use capyctl_node_agent::HostAgent;
use capyctl_spec::api::{DeployOutcome, Released, StartRequest};
use capyctl_spec::{Activation, InstanceState};
use support::{Harness, Opts, doc, temp_dir};

const T: Duration = Duration::from_secs(30);

async fn state_becomes(h: &Harness, name: &str, state: InstanceState) {
    if let Err(last) = h.server.wait_for_state(name, &[state], T).await {
        panic!("{name} never became {state}: {last:?}");
    }
}

#[tokio::test]
async fn deploy_request_starts_park_then_request_wakes() {
    let dir = temp_dir("cycle");
    let h = Harness::new(&dir, Opts::default()).await;
    let r = h.server.deploy(doc("chat-a", "")).await.unwrap();
    assert_eq!(r.outcome, DeployOutcome::Created);
    assert_eq!(r.deployment.revision, 1);
    assert_eq!(r.deployment.state, InstanceState::Stopped);
    let again = h.server.deploy(doc("chat-a", "")).await.unwrap();
    assert_eq!(again.outcome, DeployOutcome::Unchanged);
    assert_eq!(again.deployment.id, r.deployment.id);

    let (status, body) = h.chat("chat-a").await;
    assert_eq!(status, 200, "{body}");
    let v = h.server.get("chat-a").await.unwrap();
    assert_eq!((v.state, v.ready.as_str()), (InstanceState::Ready, "1/1"));
    assert_eq!(v.instances[0].generation, 1);
    assert_eq!(v.instances[0].instance_id, format!("{}-0", v.id));
    assert_eq!(v.hosts, vec!["gpu-box".to_string()]);

    let receipt = h.server.park("chat-a").await.unwrap();
    assert_eq!(receipt.action, "park");
    assert_eq!(receipt.deployment.state, InstanceState::Parking);
    state_becomes(&h, "chat-a", InstanceState::Parked).await;
    let v = h.server.get(&r.deployment.id).await.unwrap();
    assert_eq!(v.ready, "0/1");
    assert_eq!(v.instances[0].parked_tier.as_deref(), Some("host_ram"));

    let (status, body) = h.chat("chat-a").await;
    assert_eq!(status, 200, "{body}");
    let v = h.server.get("chat-a").await.unwrap();
    assert_eq!(v.state, InstanceState::Ready);
    assert_eq!(v.instances[0].generation, 1, "woken, not restarted");
    h.shutdown().await;
}

#[tokio::test]
async fn a_request_switches_the_gpu_and_parks_the_idle_model() {
    let dir = temp_dir("switch");
    let h = Harness::new(&dir, Opts::default()).await;
    h.server.deploy(doc("chat-a", "")).await.unwrap();
    h.server.deploy(doc("chat-b", "")).await.unwrap();
    assert_eq!(h.chat("chat-a").await.0, 200);
    let (status, body) = h.chat("chat-b").await;
    assert_eq!(status, 200, "{body}");
    let a = h.server.get("chat-a").await.unwrap();
    let b = h.server.get("chat-b").await.unwrap();
    assert_eq!(
        (a.state, b.state),
        (InstanceState::Parked, InstanceState::Ready)
    );
    // And back: chat-b parks, chat-a wakes.
    assert_eq!(h.chat("chat-a").await.0, 200);
    let a = h.server.get("chat-a").await.unwrap();
    let b = h.server.get("chat-b").await.unwrap();
    assert_eq!(
        (a.state, b.state),
        (InstanceState::Ready, InstanceState::Parked)
    );
    assert_eq!(a.instances[0].generation, 1);
    h.shutdown().await;
}

#[tokio::test]
async fn start_without_evict_waits_for_memory_and_with_evict_names_victims() {
    let dir = temp_dir("evict");
    let h = Harness::new(&dir, Opts::default()).await;
    h.server.deploy(doc("chat-a", "")).await.unwrap();
    let b = h.server.deploy(doc("chat-b", "")).await.unwrap().deployment;
    h.start("chat-a", false, true).await.unwrap();

    // Without --evict: nothing is parked; the start waits for memory.
    let r = h
        .server
        .start("chat-b", StartRequest::default())
        .await
        .unwrap();
    assert!(r.victims.is_empty() && r.switch_id.is_none());
    assert_eq!(r.deployment.state, InstanceState::Stopped);
    let ready = r
        .deployment
        .conditions
        .iter()
        .find(|c| c.kind == "Ready")
        .unwrap();
    assert_eq!(ready.reason, "waiting_for_memory");
    assert_eq!(
        h.server.get("chat-a").await.unwrap().state,
        InstanceState::Ready
    );
    // Once chat-a is parked, the waiting start goes on by itself.
    h.server.park("chat-a").await.unwrap();
    state_becomes(&h, "chat-b", InstanceState::Ready).await;
    assert_eq!(
        h.server.get("chat-a").await.unwrap().state,
        InstanceState::Parked
    );

    // With --evict: chat-b is parked to make room, and the receipt says so.
    let r = h.start("chat-a", true, true).await.unwrap();
    assert_eq!(r.deployment.state, InstanceState::Ready);
    assert!(r.switch_id.is_some());
    assert_eq!(r.victims.len(), 1);
    assert_eq!(r.victims[0].deployment_id, b.id);
    assert_eq!(r.victims[0].name, "chat-b");
    assert_eq!(r.victims[0].instance_id, format!("{}-0", b.id));
    assert_eq!(r.victims[0].released, Released::Parked);
    assert_eq!(
        h.server.get("chat-b").await.unwrap().state,
        InstanceState::Parked
    );
    h.shutdown().await;
}

#[tokio::test]
async fn explicit_models_are_refused_by_requests_and_never_victims() {
    let dir = temp_dir("explicit");
    let h = Harness::new(&dir, Opts::default()).await;
    let c = h
        .server
        .deploy(doc("chat-c", "lifecycle: {activation: explicit}\n"))
        .await
        .unwrap()
        .deployment;
    assert_eq!(c.activation, Activation::Explicit);
    h.server.deploy(doc("chat-a", "")).await.unwrap();

    let (status, body) = h.chat("chat-c").await;
    assert_eq!(status, 409);
    assert_eq!(body["code"], "deployment_inactive");
    assert_eq!(
        body["message"],
        format!(
            "deployment {0} is not running and its activation is explicit (lifecycle.activation: explicit); inference does not start or wake it; start it with `capyctl start deployment {0}`",
            c.id
        )
    );
    assert_eq!(
        h.server.get("chat-c").await.unwrap().state,
        InstanceState::Stopped
    );

    h.start("chat-c", false, true).await.unwrap();
    assert_eq!(h.chat("chat-c").await.0, 200);

    // chat-a needs the memory chat-c holds: refused for capacity, chat-c keeps serving.
    let (status, body) = h.chat("chat-a").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (409, Some("does_not_fit")),
        "{body}"
    );
    let err = h.start("chat-a", true, true).await.unwrap_err();
    assert_eq!(err.code(), "does_not_fit");
    assert_eq!(
        h.server.get("chat-c").await.unwrap().state,
        InstanceState::Ready
    );

    // Parked by the operator: requests still do not wake it.
    h.server.park("chat-c").await.unwrap();
    state_becomes(&h, "chat-c", InstanceState::Parked).await;
    let (status, body) = h.chat("chat-c").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (409, Some("deployment_inactive"))
    );
    h.shutdown().await;
}

/// An explicit model that an operator parks is on its way out: a request that needs its memory
/// waits for the park and is served, instead of being refused for capacity.
#[tokio::test]
async fn a_request_waits_for_an_explicit_model_the_operator_is_parking() {
    let dir = temp_dir("explicit-leaving");
    let h = Harness::new(&dir, Opts::default()).await;
    // 64 MiB at 32 MiB/s: the park takes about 2 s.
    let slow = capyctl_spec::documents::parse_deployment_str(
        "chat-c.yaml",
        "name: chat-c\nengine: vllm\nmodel: Qwen3-4B\nresources: {gpu_memory: 6GiB, weights_memory: 64MiB}\nenv: {ENGINE_SIM_WEIGHTS_BYTES: 64MiB, ENGINE_SIM_HOST_BANDWIDTH: 32MiB}\nlifecycle: {activation: explicit}\n",
    )
    .unwrap();
    h.server.deploy(slow).await.unwrap();
    h.server.deploy(doc("chat-a", "")).await.unwrap();
    h.start("chat-c", false, true).await.unwrap();
    let (status, body) = h.chat("chat-a").await;
    assert_eq!((status, body["code"].as_str()), (409, Some("does_not_fit")));

    let receipt = h.server.park("chat-c").await.unwrap();
    assert_eq!(receipt.deployment.state, InstanceState::Parking);
    let (status, body) = h.chat("chat-a").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        h.server.get("chat-c").await.unwrap().state,
        InstanceState::Parked
    );
    h.shutdown().await;
}

#[tokio::test]
async fn an_operator_stop_refuses_requests_a_pressure_stop_does_not() {
    let dir = temp_dir("stops");
    let h = Harness::new(&dir, Opts::default()).await;
    let a = h
        .server
        .deploy(doc("chat-a", "residency: restart_only\n"))
        .await
        .unwrap()
        .deployment;
    h.server.deploy(doc("chat-b", "")).await.unwrap();
    assert_eq!(h.chat("chat-a").await.0, 200);

    // Pressure: chat-b's request stops chat-a (restart_only does not park) ...
    assert_eq!(h.chat("chat-b").await.0, 200);
    let v = h.server.get("chat-a").await.unwrap();
    assert_eq!(v.state, InstanceState::Stopped);
    assert!(!v.operator_stopped);
    // ... and a later request starts it again (a fresh generation).
    assert_eq!(h.chat("chat-a").await.0, 200);
    assert_eq!(
        h.server.get("chat-a").await.unwrap().instances[0].generation,
        2
    );

    // An operator stop: requests get 409 deployment_stopped until a start.
    let r = h.server.stop("chat-a").await.unwrap();
    assert_eq!(r.deployment.state, InstanceState::Stopped);
    assert!(r.deployment.operator_stopped);
    let (status, body) = h.chat("chat-a").await;
    assert_eq!(status, 409);
    assert_eq!(body["code"], "deployment_stopped");
    assert_eq!(
        body["message"],
        format!(
            "deployment {0} was stopped by an operator; inference does not start it; start it with `capyctl start deployment {0}`",
            a.id
        )
    );
    h.start("chat-a", true, true).await.unwrap();
    assert_eq!(h.chat("chat-a").await.0, 200);
    h.shutdown().await;
}

#[tokio::test]
async fn a_changed_document_bumps_the_revision() {
    let dir = temp_dir("revisions");
    let h = Harness::new(&dir, Opts::default()).await;
    let first = h.server.deploy(doc("chat-a", "")).await.unwrap();
    let changed = h
        .server
        .deploy(doc("chat-a", "max_concurrent_requests: 8\n"))
        .await
        .unwrap();
    assert_eq!(changed.outcome, DeployOutcome::Updated);
    assert_eq!(changed.deployment.revision, 2);
    assert_eq!(changed.deployment.id, first.deployment.id);
    let same = h
        .server
        .deploy(doc("chat-a", "max_concurrent_requests: 8\n"))
        .await
        .unwrap();
    assert_eq!(
        (same.outcome, same.deployment.revision),
        (DeployOutcome::Unchanged, 2)
    );
    let list = h.server.list().await;
    assert_eq!(list.deployments.len(), 1);
    assert_eq!(list.deployments[0].spec.max_concurrent_requests, Some(8));
    let deleted = h.server.delete("chat-a").await.unwrap();
    assert_eq!(deleted.revision, 2);
    assert_eq!(
        h.server.get("chat-a").await.unwrap_err().code(),
        "not_found"
    );
    assert_eq!(h.chat("chat-a").await.0, 404);
    h.shutdown().await;
}

#[tokio::test]
async fn state_and_engines_survive_a_restart() {
    let dir = temp_dir("restart");
    let h = Harness::new(&dir, Opts::default()).await;
    let a = h.server.deploy(doc("chat-a", "")).await.unwrap().deployment;
    h.server.deploy(doc("chat-b", "")).await.unwrap();
    h.server
        .deploy(doc("chat-b", "max_concurrent_requests: 4\n"))
        .await
        .unwrap();
    assert_eq!(h.chat("chat-a").await.0, 200);
    h.server.stop("chat-b").await.unwrap();
    let pid = h.server.get("chat-a").await.unwrap().instances[0]
        .pid
        .unwrap();
    // As after a kill: nothing is stopped.
    h.close().await;

    let h = Harness::new(&dir, Opts::default()).await;
    let v = h.server.get("chat-a").await.unwrap();
    assert_eq!(v.id, a.id);
    assert_eq!(v.state, InstanceState::Ready, "the engine was adopted");
    assert_eq!(v.instances[0].pid, Some(pid));
    assert_eq!(v.instances[0].generation, 1);
    assert_eq!(h.chat("chat-a").await.0, 200);
    assert_eq!(
        h.agent.pid(&format!("{}-0", a.id)),
        Some(pid),
        "not restarted"
    );
    let b = h.server.get("chat-b").await.unwrap();
    assert_eq!(b.revision, 2);
    assert!(b.operator_stopped);
    assert_eq!(h.chat("chat-b").await.1["code"], "deployment_stopped");
    h.shutdown().await;
}

/// Crash-only: an operator start that waits for memory is an operator decision, and a restart
/// keeps it: once memory frees after the restart, the model starts.
#[tokio::test]
async fn a_start_waiting_for_memory_survives_a_restart() {
    let dir = temp_dir("pending-restart");
    let h = Harness::new(&dir, Opts::default()).await;
    h.server.deploy(doc("chat-a", "")).await.unwrap();
    h.server.deploy(doc("chat-b", "")).await.unwrap();
    assert_eq!(h.chat("chat-a").await.0, 200);
    let r = h
        .server
        .start("chat-b", StartRequest::default())
        .await
        .unwrap();
    assert!(r.victims.is_empty());
    let waiting = |v: &capyctl_spec::api::DeploymentView| {
        v.conditions
            .iter()
            .any(|c| c.kind == "Ready" && c.reason == "waiting_for_memory")
    };
    assert!(waiting(&r.deployment), "{:?}", r.deployment.conditions);
    // As after a kill: nothing is stopped.
    h.close().await;

    let h = Harness::new(&dir, Opts::default()).await;
    let b = h.server.get("chat-b").await.unwrap();
    assert_eq!(b.state, InstanceState::Stopped);
    assert!(
        waiting(&b),
        "the pending start came back: {:?}",
        b.conditions
    );
    assert_eq!(
        h.server.get("chat-a").await.unwrap().state,
        InstanceState::Ready
    );
    h.server.park("chat-a").await.unwrap();
    state_becomes(&h, "chat-b", InstanceState::Ready).await;
    // Taken: a second restart does not start it again.
    h.server.stop("chat-b").await.unwrap();
    h.close().await;
    let h = Harness::new(&dir, Opts::default()).await;
    let b = h.server.get("chat-b").await.unwrap();
    assert!(!waiting(&b), "{:?}", b.conditions);
    assert_eq!(b.state, InstanceState::Stopped);
    h.shutdown().await;
}

/// A request that takes over a start waiting for memory takes the pending start with it: parked
/// later and restarted, the model is not woken again by a start that already happened.
#[tokio::test]
async fn a_pending_start_a_request_took_over_is_not_repeated_after_a_restart() {
    let dir = temp_dir("pending-taken");
    let h = Harness::new(&dir, Opts::default()).await;
    h.server.deploy(doc("chat-a", "")).await.unwrap();
    h.server.deploy(doc("chat-b", "")).await.unwrap();
    // chat-b parked, chat-a ready.
    assert_eq!(h.chat("chat-b").await.0, 200);
    assert_eq!(h.chat("chat-a").await.0, 200);
    h.server
        .start("chat-b", StartRequest::default())
        .await
        .unwrap();
    // The request switches: chat-a parks, chat-b wakes; the pending start is done. Then a
    // request for chat-a parks chat-b again (nothing an operator did: no command saved).
    assert_eq!(h.chat("chat-b").await.0, 200);
    assert_eq!(h.chat("chat-a").await.0, 200);
    assert_eq!(
        h.server.get("chat-b").await.unwrap().state,
        InstanceState::Parked
    );
    h.close().await;

    let h = Harness::new(&dir, Opts::default()).await;
    let b = h.server.get("chat-b").await.unwrap();
    assert_eq!(b.state, InstanceState::Parked);
    assert!(
        !b.conditions
            .iter()
            .any(|c| c.reason == "waiting_for_memory"),
        "{:?}",
        b.conditions
    );
    // Nothing wakes it: it is still parked after the restart's pending starts were tried
    // (a wake would show within the bound).
    let woke = h
        .server
        .wait_for_state(
            "chat-b",
            &[InstanceState::Waking, InstanceState::Ready],
            Duration::from_millis(500),
        )
        .await;
    assert!(woke.is_err(), "{woke:?}");
    h.shutdown().await;
}

#[tokio::test]
async fn idle_timers_park_then_stop_and_a_request_starts_again() {
    let dir = temp_dir("idle");
    let opts = Opts {
        lifecycle_defaults: capyctl_spec::settings::LifecycleDefaults {
            ready_idle_timeout: Some(Duration::from_millis(300)),
            parked_idle_timeout: Some(Duration::from_millis(300)),
        },
        gpu: 20 * support::GIB,
        ..Opts::default()
    };
    let h = Harness::new(&dir, opts).await;
    h.server.deploy(doc("chat-a", "")).await.unwrap();
    h.server
        .deploy(doc("chat-w", "lifecycle: {warm: true}\n"))
        .await
        .unwrap();
    assert_eq!(h.chat("chat-w").await.0, 200);
    assert_eq!(h.chat("chat-a").await.0, 200);
    state_becomes(&h, "chat-a", InstanceState::Parked).await;
    state_becomes(&h, "chat-a", InstanceState::Stopped).await;
    let v = h.server.get("chat-a").await.unwrap();
    assert!(!v.operator_stopped, "a timer stop is a pressure stop");
    let w = h.server.get("chat-w").await.unwrap();
    assert_eq!(
        w.state,
        InstanceState::Ready,
        "warm models are never moved by the timers"
    );
    assert_eq!(h.chat("chat-a").await.0, 200);
    h.shutdown().await;
}

/// The idle timer counts from the last request as the router records it (the lifecycle keeps no
/// copy): a model asked every 200 ms is never parked by a 2 s timer; once left alone, it is.
#[tokio::test]
async fn a_model_in_use_is_not_parked_by_its_idle_timer() {
    let dir = temp_dir("idle-in-use");
    let opts = Opts {
        lifecycle_defaults: capyctl_spec::settings::LifecycleDefaults {
            ready_idle_timeout: Some(Duration::from_secs(2)),
            parked_idle_timeout: None,
        },
        ..Opts::default()
    };
    let h = Harness::new(&dir, opts).await;
    h.server.deploy(doc("chat-a", "")).await.unwrap();
    assert_eq!(h.chat("chat-a").await.0, 200);
    // Every state it passes through while it is asked (a park would show `parking`, and the
    // next request would wake it).
    let server = h.server.clone();
    let parked = tokio::spawn(async move {
        let down = [InstanceState::Parking, InstanceState::Parked];
        server
            .wait_for_state("chat-a", &down, Duration::from_secs(5))
            .await
    });
    let began = std::time::Instant::now();
    while began.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(h.chat("chat-a").await.0, 200);
    }
    let seen = parked.await.unwrap();
    assert!(seen.is_err(), "in use, never parked: {seen:?}");
    state_becomes(&h, "chat-a", InstanceState::Parked).await;
    h.shutdown().await;
}

#[tokio::test]
async fn the_load_read_has_router_and_sample_halves() {
    let dir = temp_dir("load");
    let h = Harness::new(&dir, Opts::default()).await;
    let a = h.server.deploy(doc("chat-a", "")).await.unwrap().deployment;
    assert_eq!(h.chat("chat-a").await.0, 200);
    // A sample taken after the request ended (one taken while it ran says running 1).
    let mut report = h.server.load(Some(&a.id)).await.unwrap();
    for _ in 0..50 {
        let sample = report.deployments[0].instances[0].sample.as_ref();
        if sample.is_some_and(|s| s.engine.is_some_and(|e| e.running == 0)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        report = h.server.load(Some(&a.id)).await.unwrap();
    }
    assert_eq!(report.stale_after_ms, 3000);
    let d = &report.deployments[0];
    assert_eq!(
        (d.deployment_id.as_str(), d.name.as_str()),
        (a.id.as_str(), "chat-a")
    );
    assert_eq!(d.router.in_flight_limit, 32);
    assert_eq!(d.max_running.count, Some(32));
    assert_eq!(d.max_running.source, "default");
    let i = &d.instances[0];
    assert_eq!((i.host_id.as_str(), i.generation), ("gpu-box", 1));
    assert_eq!(i.observed_state, InstanceState::Ready);
    let s = i
        .sample
        .as_ref()
        .expect("a sample arrives about every 100 ms");
    assert!(s.fresh && s.age_ms < 3000);
    assert_eq!(s.engine.map(|e| e.running), Some(0));
    assert_eq!(h.server.load(None).await.unwrap().deployments.len(), 1);
    let err = h.server.load(Some("01NOPE")).await.unwrap_err();
    assert_eq!((err.status(), err.code()), (404, "not_found"));
    h.shutdown().await;
}

/// "A request does not restart an explicit model whose engine exited either; start it again."
#[tokio::test]
async fn an_explicit_model_whose_engine_exited_waits_for_a_start() {
    let dir = temp_dir("crash-explicit");
    let h = Harness::new(&dir, Opts::default()).await;
    let x = h
        .server
        .deploy(doc("chat-x", "lifecycle: {activation: explicit}\n"))
        .await
        .unwrap()
        .deployment;
    h.start("chat-x", false, true).await.unwrap();
    assert_eq!(h.chat("chat-x").await.0, 200);
    let port = h.server.get("chat-x").await.unwrap().instances[0]
        .port
        .unwrap();
    let _ = support::try_post_json(
        std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        "/sim/faults",
        serde_json::json!({"set": ["crash"]}),
    )
    .await;
    state_becomes(&h, "chat-x", InstanceState::Failed).await;
    let (status, body) = h.chat("chat-x").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (409, Some("deployment_inactive")),
        "{body}"
    );
    let v = h.server.get("chat-x").await.unwrap();
    assert_eq!(v.state, InstanceState::Failed);
    assert_eq!(v.instances[0].generation, 1, "not restarted by the request");
    // Started again on command: a fresh generation that serves.
    h.start(&x.id, false, true).await.unwrap();
    assert_eq!(h.chat("chat-x").await.0, 200);
    assert_eq!(
        h.server.get("chat-x").await.unwrap().instances[0].generation,
        2
    );
    h.shutdown().await;
}

/// `lifecycle.warm: true` keeps a model loaded like explicit activation (never a victim of a
/// request's switch or of `--evict`), but requests still start or wake it.
#[tokio::test]
async fn a_warm_model_is_never_a_victim_but_requests_start_and_wake_it() {
    let dir = temp_dir("warm");
    let h = Harness::new(&dir, Opts::default()).await;
    h.server
        .deploy(doc("chat-w", "lifecycle: {warm: true}\n"))
        .await
        .unwrap();
    h.server.deploy(doc("chat-b", "")).await.unwrap();
    // A request starts it (explicit would refuse).
    assert_eq!(h.chat("chat-w").await.0, 200);
    // Neither a request nor --evict parks it for another model.
    let (status, body) = h.chat("chat-b").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (409, Some("does_not_fit")),
        "{body}"
    );
    let err = h.start("chat-b", true, true).await.unwrap_err();
    assert_eq!(err.code(), "does_not_fit");
    assert_eq!(
        h.server.get("chat-w").await.unwrap().state,
        InstanceState::Ready
    );
    // An operator may park it; a request wakes it again.
    h.server.park("chat-w").await.unwrap();
    state_becomes(&h, "chat-w", InstanceState::Parked).await;
    assert_eq!(h.chat("chat-w").await.0, 200);
    assert_eq!(
        h.server.get("chat-w").await.unwrap().state,
        InstanceState::Ready
    );
    h.shutdown().await;
}

#[tokio::test]
async fn an_engine_that_exits_is_restarted_by_the_next_request() {
    let dir = temp_dir("crash");
    let h = Harness::new(&dir, Opts::default()).await;
    h.server.deploy(doc("chat-a", "")).await.unwrap();
    assert_eq!(h.chat("chat-a").await.0, 200);
    let port = h.server.get("chat-a").await.unwrap().instances[0]
        .port
        .unwrap();
    // The engine exits while answering: the answer may be cut.
    let _ = support::try_post_json(
        std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        "/sim/faults",
        serde_json::json!({"set": ["crash"]}),
    )
    .await;
    state_becomes(&h, "chat-a", InstanceState::Failed).await;
    let v = h.server.get("chat-a").await.unwrap();
    assert!(
        v.instances[0]
            .last_error
            .as_deref()
            .unwrap_or("")
            .contains("exited"),
        "{v:?}"
    );
    assert_eq!(h.chat("chat-a").await.0, 200);
    assert_eq!(
        h.server.get("chat-a").await.unwrap().instances[0].generation,
        2
    );
    let engines = h.server.engines().await;
    assert_eq!(engines.engines.len(), 3);
    assert!(h.agent.inventory().await.is_ok());
    h.shutdown().await;
}

#[tokio::test]
async fn a_switch_lets_a_running_answer_finish() {
    let dir = temp_dir("drain");
    let h = Harness::new(&dir, Opts::default()).await;
    h.server
        .deploy(doc("chat-a", "extra_args: []\n").clone())
        .await
        .unwrap();
    // chat-a streams slowly: 10 tokens at 20 tokens/s.
    let slow = doc("chat-s", "");
    let mut slow = slow;
    slow.env.insert("ENGINE_SIM_TOKEN_RATE".into(), "20".into());
    h.server.deploy(slow).await.unwrap();
    h.server.deploy(doc("chat-b", "")).await.unwrap();
    assert_eq!(h.chat("chat-s").await.0, 200);
    let addr = h.addr;
    let streamed = tokio::spawn(async move {
        support::post_json(
            addr,
            "/v1/chat/completions",
            serde_json::json!({
                "model": "chat-s", "stream": true, "max_tokens": 10,
                "messages": [{"role": "user", "content": "hello"}],
            }),
        )
        .await
    });
    // Wait until the stream runs in the engine, then ask for the other model.
    let mut running = false;
    for _ in 0..250 {
        let load = h.server.load(Some("chat-s")).await.unwrap();
        if load.deployments[0].router.in_flight == 1 {
            running = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(running, "the streamed answer never started");
    let (status, body) = h.chat("chat-b").await;
    assert_eq!(status, 200, "{body}");
    let (status, text) = streamed.await.unwrap();
    assert_eq!(status, 200);
    let text = text.as_str().unwrap_or_default().to_string();
    assert!(
        text.trim_end().ends_with("data: [DONE]"),
        "the stream was cut: {text}"
    );
    assert_eq!(
        h.server.get("chat-s").await.unwrap().state,
        InstanceState::Parked
    );
    h.shutdown().await;
}

/// "When there is no room to keep a parked copy, CapyCTL stops the idle model instead and says
/// so": a `start --evict` whose victim's copy needs the room of an older parked copy names
/// that copy in its receipt, `released: stopped (no room to park)`.
#[tokio::test]
async fn an_evict_receipt_names_the_parked_copies_stopped_for_room() {
    let dir = temp_dir("room-receipt");
    // One 6 GiB model on the GPU at a time; host RAM for one 64 MiB copy.
    let opts = Opts {
        host_memory: 100 * support::MIB,
        ..Opts::default()
    };
    let h = Harness::new(&dir, opts).await;
    let a = h.server.deploy(doc("chat-a", "")).await.unwrap().deployment;
    let b = h.server.deploy(doc("chat-b", "")).await.unwrap().deployment;
    h.server.deploy(doc("chat-c", "")).await.unwrap();
    assert_eq!(h.chat("chat-a").await.0, 200);
    assert_eq!(h.chat("chat-b").await.0, 200);
    assert_eq!(
        h.server.get("chat-a").await.unwrap().state,
        InstanceState::Parked
    );
    let switches = |text: &str| -> u64 {
        let line = text
            .lines()
            .find(|l| l.starts_with("capyctl_switches_total{outcome=\"ok\"}"))
            .unwrap_or("x 0");
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    // chat-b's switch has ended (its record is saved after its requests are served).
    let give_up = std::time::Instant::now() + Duration::from_secs(10);
    while switches(&h.metrics.encode()) < 2 {
        assert!(
            std::time::Instant::now() < give_up,
            "chat-b's switch never ended"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let before = switches(&h.metrics.encode());
    let r = h.start("chat-c", true, true).await.unwrap();
    assert_eq!(r.deployment.state, InstanceState::Ready);
    // Counted as a switch, and the stopped copy as a park that stopped for want of room.
    let text = h.metrics.encode();
    assert_eq!(switches(&text), before + 1, "{text}");
    assert!(
        text.contains(r#"capyctl_parks_total{tier="none",outcome="stopped_no_room_to_park"} 1"#),
        "{text}"
    );
    let got: Vec<(&str, &str, Released)> = r
        .victims
        .iter()
        .map(|v| (v.deployment_id.as_str(), v.instance_id.as_str(), v.released))
        .collect();
    let (a_iid, b_iid) = (format!("{}-0", a.id), format!("{}-0", b.id));
    assert_eq!(
        got,
        vec![
            (b.id.as_str(), b_iid.as_str(), Released::Parked),
            (a.id.as_str(), a_iid.as_str(), Released::StoppedNoRoomToPark),
        ]
    );
    assert_eq!(
        h.server.get("chat-a").await.unwrap().state,
        InstanceState::Stopped
    );
    assert_eq!(
        h.server.get("chat-b").await.unwrap().state,
        InstanceState::Parked
    );
    // A pressure stop: a request starts chat-a again.
    assert_eq!(h.chat("chat-a").await.0, 200);
    h.shutdown().await;
}

/// "A sleeping engine still holds some GPU memory: account for it." Each parked engine here
/// keeps 512 MiB (the agent's estimate for 2 GiB of weights without NVML): a switch parks as
/// many idle models as that takes, and stops parked engines for their residue only when
/// parking the ready ones is not enough.
#[tokio::test]
async fn parked_engines_hold_gpu_memory_and_placement_counts_it() {
    let dir = temp_dir("residue");
    let opts = Opts {
        host_memory: 16 * support::GIB,
        ..Opts::default()
    };
    let h = Harness::new(&dir, opts).await;
    let model = |name: &str, gpu: &str| {
        capyctl_spec::documents::parse_deployment_str(
            "m.yaml",
            &format!(
                "name: {name}\nengine: vllm\nmodel: Qwen3-4B\nresources: {{gpu_memory: {gpu}, weights_memory: 2GiB}}\nenv: {{ENGINE_SIM_WEIGHTS_BYTES: 2GiB}}\n"
            ),
        )
        .unwrap()
    };
    for (name, gpu) in [
        ("a", "5GiB"),
        ("b", "5GiB"),
        ("c", "5GiB"),
        ("d", "9728MiB"),
        ("e", "9830MiB"),
        ("f", "9984MiB"),
    ] {
        h.server.deploy(model(name, gpu)).await.unwrap();
    }
    assert_eq!(h.chat("a").await.0, 200);
    assert_eq!(h.chat("b").await.0, 200);
    // c needs 5 GiB; parking a frees only 4.5 (it keeps 0.5): b parks too.
    assert_eq!(h.chat("c").await.0, 200);
    for name in ["a", "b"] {
        let v = h.server.get(name).await.unwrap();
        assert_eq!(
            v.state,
            InstanceState::Parked,
            "{name}: {:?}",
            v.instances[0].last_error
        );
    }
    let hosts = h.server.hosts().await;
    assert_eq!(
        hosts.hosts[0].gpus[0].used,
        6 * support::GIB,
        "c, and two residues"
    );
    // d needs 9.5 GiB: parking c leaves 8.5 free; a's and b's residues go too (stopped).
    assert_eq!(h.chat("d").await.0, 200);
    assert_eq!(
        h.server.get("c").await.unwrap().state,
        InstanceState::Parked
    );
    for name in ["a", "b"] {
        assert_eq!(
            h.server.get(name).await.unwrap().state,
            InstanceState::Stopped,
            "{name}"
        );
    }
    let hosts = h.server.hosts().await;
    assert_eq!(
        hosts.hosts[0].gpus[0].used,
        19 * support::GIB / 2 + support::GIB / 2,
        "d, and c's residue"
    );
    // e (9.6 GiB) under --evict: parking d would leave its residue and c's in the way (9.5
    // free); only stopping d, and c's parked engine, makes room. The receipt names both.
    let r = h.start("e", true, true).await.unwrap();
    assert_eq!(r.deployment.state, InstanceState::Ready);
    let got: Vec<(&str, Released)> = r
        .victims
        .iter()
        .map(|v| (v.name.as_str(), v.released))
        .collect();
    // Both stopped for want of room to keep them parked, and said so.
    assert_eq!(
        got,
        [
            ("d", Released::StoppedNoRoomToPark),
            ("c", Released::StoppedNoRoomToPark)
        ]
    );
    for name in ["c", "d"] {
        let v = h.server.get(name).await.unwrap();
        assert_eq!(v.state, InstanceState::Stopped, "{name}");
        assert_eq!(
            v.instances[0].last_error.as_deref(),
            Some("released: stopped (no room to park)"),
            "{name}"
        );
    }
    // f (9.75 GiB) by a request: e must stop rather than park (its residue would leave 9.5).
    assert_eq!(h.chat("f").await.0, 200);
    let e = h.server.get("e").await.unwrap();
    assert_eq!(e.state, InstanceState::Stopped);
    assert_eq!(
        e.instances[0].last_error.as_deref(),
        Some("released: stopped (no room to park)")
    );
    h.shutdown().await;
}

/// Host RAM for one 64 MiB copy only; room on the GPU for two models.
fn room_for_one_copy() -> Opts {
    Opts {
        host_memory: 100 * support::MIB,
        gpu: 20 * support::GIB,
        ..Opts::default()
    }
}

/// The scaler's park is its own choice: with no room in host RAM for the instance's copy (an
/// explicit parked copy holds it, and is never stopped for room), the instance it takes away
/// stops instead, `released: stopped (no room to park)`. It was put back ready, to be drained
/// again at every `scale_down_delay`.
#[tokio::test]
async fn a_scale_down_with_no_room_to_park_stops_the_instance() {
    use capyctl_router::admission::Admission;
    let dir = temp_dir("scale-no-room");
    let h = Harness::new(&dir, room_for_one_copy()).await;
    h.server
        .deploy(doc("chat-c", "lifecycle: {activation: explicit}\n"))
        .await
        .unwrap();
    h.start("chat-c", false, true).await.unwrap();
    h.server.park("chat-c").await.unwrap();
    state_becomes(&h, "chat-c", InstanceState::Parked).await;
    h.server
        .deploy(doc(
            "chat-r",
            "replicas: 2\nscale: {min: 1, target_in_flight: 1, scale_down_delay: 1s}\n",
        ))
        .await
        .unwrap();
    assert_eq!(h.chat("chat-r").await.0, 200);
    let instances = || async {
        let v = h.server.get("chat-r").await.unwrap();
        v.instances
            .iter()
            .map(|i| (i.state, i.last_error.clone()))
            .collect::<Vec<_>>()
    };
    // Two requests held on the one instance: past the target, the scaler starts the second.
    let r = h.router.resolve("chat-r").unwrap();
    let deadline = tokio::time::Instant::now() + T;
    let held = vec![
        h.router.admit(r.clone(), deadline).await.unwrap(),
        h.router.admit(r, deadline).await.unwrap(),
    ];
    let give_up = tokio::time::Instant::now() + T;
    let second_becomes = |state: InstanceState| {
        let instances = &instances;
        async move {
            while instances().await[1].0 != state {
                assert!(
                    tokio::time::Instant::now() < give_up,
                    "{:?}",
                    instances().await
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    second_becomes(InstanceState::Ready).await;
    // The load goes; after the delay the second is taken away, and with no room to park it,
    // stopped.
    drop(held);
    second_becomes(InstanceState::Stopped).await;
    let now = instances().await;
    assert_eq!(
        now[1].1.as_deref(),
        Some("released: stopped (no room to park)")
    );
    assert_eq!(now[0].0, InstanceState::Ready);
    assert_eq!(
        h.server.get("chat-c").await.unwrap().state,
        InstanceState::Parked,
        "an explicit copy is never stopped for room"
    );
    h.shutdown().await;
}

#[tokio::test]
async fn parked_copies_make_room_except_explicit_ones() {
    let dir = temp_dir("parked-room");
    let h = Harness::new(&dir, room_for_one_copy()).await;
    h.server.deploy(doc("chat-a", "")).await.unwrap();
    h.server.deploy(doc("chat-b", "")).await.unwrap();
    h.server
        .deploy(doc("chat-c", "lifecycle: {activation: explicit}\n"))
        .await
        .unwrap();
    assert_eq!(h.chat("chat-a").await.0, 200);
    assert_eq!(h.chat("chat-b").await.0, 200);
    h.server.park("chat-a").await.unwrap();
    state_becomes(&h, "chat-a", InstanceState::Parked).await;
    // chat-b's copy needs the room chat-a's holds: chat-a is stopped for it.
    h.server.park("chat-b").await.unwrap();
    state_becomes(&h, "chat-b", InstanceState::Parked).await;
    let a = h.server.get("chat-a").await.unwrap();
    assert_eq!(a.state, InstanceState::Stopped);
    assert_eq!(
        a.instances[0].last_error.as_deref(),
        Some("released: stopped (no room to park)")
    );
    // An explicit parked copy is never stopped for room: the park is refused, chat-a serves.
    h.server.stop("chat-b").await.unwrap();
    h.start("chat-c", false, true).await.unwrap();
    h.server.park("chat-c").await.unwrap();
    state_becomes(&h, "chat-c", InstanceState::Parked).await;
    assert_eq!(h.chat("chat-a").await.0, 200);
    let err = h.server.park("chat-a").await.unwrap_err();
    assert_eq!((err.status(), err.code()), (409, "parked_capacity"));
    assert_eq!(
        h.server.get("chat-a").await.unwrap().state,
        InstanceState::Ready
    );
    assert_eq!(
        h.server.get("chat-c").await.unwrap().state,
        InstanceState::Parked
    );
    assert_eq!(h.chat("chat-a").await.0, 200);
    // A request for chat-d (16 GiB) needs chat-a's GPU memory, and chat-a's copy finds no
    // room: chat-a is stopped instead of parked and says so; chat-d is served; chat-c stays
    // parked.
    let big = capyctl_spec::documents::parse_deployment_str(
        "chat-d.yaml",
        "name: chat-d\nengine: vllm\nmodel: Qwen3-4B\nresources: {gpu_memory: 16GiB, weights_memory: 64MiB}\nenv: {ENGINE_SIM_WEIGHTS_BYTES: 64MiB}\n",
    )
    .unwrap();
    h.server.deploy(big).await.unwrap();
    let (status, body) = h.chat("chat-d").await;
    assert_eq!(status, 200, "{body}");
    let a = h.server.get("chat-a").await.unwrap();
    assert_eq!(a.state, InstanceState::Stopped);
    assert_eq!(
        a.instances[0].last_error.as_deref(),
        Some("released: stopped (no room to park)")
    );
    assert_eq!(
        h.server.get("chat-c").await.unwrap().state,
        InstanceState::Parked
    );
    h.shutdown().await;
}

#[tokio::test]
async fn refusals_of_start_and_park() {
    let dir = temp_dir("refusals");
    let h = Harness::new(&dir, Opts::default()).await;
    let text = "name: chat-m\nengine: vllm\nmodel: Qwen3-4B\n";
    let m = capyctl_spec::documents::parse_deployment_str("m.yaml", text).unwrap();
    let m = h.server.deploy(m).await.unwrap().deployment;
    assert_eq!(m.state, InstanceState::AwaitingMeasurement);
    let err = h
        .server
        .start("chat-m", StartRequest::default())
        .await
        .unwrap_err();
    assert_eq!((err.status(), err.code()), (409, "awaiting_measurement"));
    assert_eq!(
        h.server
            .start("nope", StartRequest::default())
            .await
            .unwrap_err()
            .code(),
        "not_found"
    );

    let g = doc("chat-g", "").clone();
    let mut g = g;
    g.model = Some("openai/gpt-oss-20b".into());
    h.server.deploy(g).await.unwrap();
    assert_eq!(h.chat("chat-g").await.0, 200);
    let err = h.server.park("chat-g").await.unwrap_err();
    assert_eq!(err.code(), "capability_missing:deep_park");
    assert_eq!(
        h.server.get("chat-g").await.unwrap().state,
        InstanceState::Ready
    );
    // As a switch's victim it is stopped instead of parked.
    h.server.deploy(doc("chat-b", "")).await.unwrap();
    assert_eq!(h.chat("chat-b").await.0, 200);
    assert_eq!(
        h.server.get("chat-g").await.unwrap().state,
        InstanceState::Stopped
    );
    let err = h.server.park("chat-g").await.unwrap_err();
    assert_eq!(err.code(), "conflict");
    h.shutdown().await;
}

#[tokio::test]
async fn a_wake_that_fails_its_check_stops_the_model_and_the_next_request_starts_it() {
    let dir = temp_dir("wake-mismatch");
    let h = Harness::new(&dir, Opts::default()).await;
    h.server.deploy(doc("chat-a", "")).await.unwrap();
    assert_eq!(h.chat("chat-a").await.0, 200);
    let port = h.server.get("chat-a").await.unwrap().instances[0]
        .port
        .unwrap();
    let (status, _) = support::post_json(
        std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        "/sim/faults",
        serde_json::json!({"set": ["wake_mismatch"]}),
    )
    .await;
    assert_eq!(status, 200);
    h.server.park("chat-a").await.unwrap();
    state_becomes(&h, "chat-a", InstanceState::Parked).await;
    let (status, body) = h.chat("chat-a").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (503, Some("wake_mismatch")),
        "{body}"
    );
    assert_eq!(
        h.server.get("chat-a").await.unwrap().state,
        InstanceState::Failed
    );
    assert_eq!(h.chat("chat-a").await.0, 200);
    assert_eq!(
        h.server.get("chat-a").await.unwrap().instances[0].generation,
        2
    );
    h.shutdown().await;
}

#[tokio::test]
async fn a_host_wide_explicit_activation_refuses_requests_and_stop_ends_a_start() {
    let dir = temp_dir("host-explicit");
    let opts = Opts {
        activation: Activation::Explicit,
        ..Opts::default()
    };
    let h = Harness::new(&dir, opts).await;
    let a = h.server.deploy(doc("chat-a", "")).await.unwrap().deployment;
    assert_eq!(
        a.activation,
        Activation::Explicit,
        "a deployment cannot opt out"
    );
    let (status, body) = h.chat("chat-a").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (409, Some("deployment_inactive"))
    );
    // A start in the background, then a stop at once: the stop ends the start.
    let r = h
        .server
        .start("chat-a", StartRequest::default())
        .await
        .unwrap();
    assert_eq!(r.deployment.state, InstanceState::Starting);
    let r = h.server.stop("chat-a").await.unwrap();
    assert_eq!(r.deployment.state, InstanceState::Stopped);
    assert!(r.deployment.operator_stopped);
    let hosts = h.server.hosts().await;
    assert_eq!(hosts.hosts[0].id, "gpu-box");
    assert_eq!(hosts.hosts[0].gpus[0].memory, 10 * support::GIB);
    assert_eq!(hosts.hosts[0].gpus[0].used, 0);
    assert_eq!(hosts.hosts[0].activation, Activation::Explicit);
    h.shutdown().await;
}

#[tokio::test]
async fn preinitialize_measures_and_parks_without_serving() {
    let dir = temp_dir("preinit");
    let h = Harness::new(&dir, Opts::default()).await;
    let text =
        "name: chat-m\nengine: vllm\nmodel: Qwen3-4B\nenv: {ENGINE_SIM_WEIGHTS_BYTES: 64MiB}\n";
    let m = capyctl_spec::documents::parse_deployment_str("m.yaml", text).unwrap();
    h.server.deploy(m).await.unwrap();
    let r = h.server.preinitialize("chat-m").await.unwrap();
    assert_eq!(r.action, "preinitialize");
    assert_eq!(r.deployment.state, InstanceState::Starting);
    state_becomes(&h, "chat-m", InstanceState::Parked).await;
    let load = h.server.load(Some("chat-m")).await.unwrap();
    assert_eq!(load.deployments[0].router.in_flight, 0);
    // A request wakes it (generation 1: the preinitialized engine).
    assert_eq!(h.chat("chat-m").await.0, 200);
    let v = h.server.get("chat-m").await.unwrap();
    assert_eq!(
        (v.state, v.instances[0].generation),
        (InstanceState::Ready, 1)
    );
    h.shutdown().await;
}

#[tokio::test]
async fn the_listener_resolves_names_deployed_and_deleted_after_it_started() {
    use capyctl_router::admission::Admission;
    let dir = temp_dir("names");
    let h = Harness::new(&dir, Opts::default()).await;
    let admission = h.router.clone();
    let a = h.server.deploy(doc("chat-a", "")).await.unwrap();
    assert_eq!(admission.resolve("chat-a").unwrap().id, a.deployment.id);
    assert!(admission.resolve("chat-b").is_none());
    // Deployed after the names were first read: found at once.
    let b = h.server.deploy(doc("chat-b", "")).await.unwrap();
    assert_eq!(admission.resolve("chat-b").unwrap().id, b.deployment.id);
    // Deleted: gone at once.
    h.server.delete("chat-a").await.unwrap();
    assert!(admission.resolve("chat-a").is_none());
    assert_eq!(admission.resolve("chat-b").unwrap().name, "chat-b");
    h.close().await;
}

/// A new revision that changes what the router reads of a deployment (its `routing`) is what
/// the next request resolves to, not the name cache's copy of the first revision.
#[tokio::test]
async fn a_redeploy_changes_what_the_next_request_resolves() {
    use capyctl_interfaces::router::Lifecycle as _;
    use capyctl_spec::Routing;
    let dir = temp_dir("redeploy-routing");
    let h = Harness::new(&dir, Opts::default()).await;
    h.server.deploy(doc("chat-p", "")).await.unwrap();
    assert_eq!(
        h.server.resolve("chat-p").unwrap().routing,
        Routing::LeastLoaded
    );
    let r = h
        .server
        .deploy(doc("chat-p", "routing: prefix\n"))
        .await
        .unwrap();
    assert_eq!(r.outcome, DeployOutcome::Updated);
    assert_eq!(h.server.resolve("chat-p").unwrap().routing, Routing::Prefix);
    h.shutdown().await;
}
