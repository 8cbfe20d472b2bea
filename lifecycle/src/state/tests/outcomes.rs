//! The outcome rules (releases, preinitialize, failed stops), the by-host index, last use and
//! the scaler.

use super::*;

fn on(inner: &State, host: &str) -> Vec<String> {
    inner.on_host(host).map(|d| d.id().to_string()).collect()
}

#[test]
fn the_by_host_index_follows_binds_moves_and_removals() {
    let mut inner = State::default();
    inner.insert(dep("a", "chat-a", "", Instant::now()));
    inner.insert(dep("b", "chat-b", "", Instant::now()));
    inner.insert(dep("c", "chat-c", "", Instant::now()));
    inner.set_host("b", Some("gpu-1".into()));
    inner.set_host("a", Some("gpu-1".into()));
    inner.set_host("c", Some("gpu-2".into()));
    assert_eq!(on(&inner, "gpu-1"), ["a", "b"], "by ID");
    assert_eq!(on(&inner, "gpu-2"), ["c"]);
    inner.set_host("a", Some("gpu-2".into()));
    assert_eq!(on(&inner, "gpu-1"), ["b"]);
    assert_eq!(on(&inner, "gpu-2"), ["a", "c"]);
    inner.remove("c");
    assert_eq!(on(&inner, "gpu-2"), ["a"]);
    inner.set_host("b", None);
    assert_eq!(on(&inner, "gpu-1"), Vec::<String>::new());
    assert!(
        !inner.by_host.contains_key("gpu-1"),
        "an empty host's set goes"
    );
    assert_eq!(on(&inner, "gpu-9"), Vec::<String>::new());
}

#[tokio::test(start_paused = true)]
async fn the_last_use_is_the_routers_record_of_requests_or_a_later_state_change() {
    use capyctl_router::admission::Admission;
    use capyctl_router::config::RouterConfig;
    use capyctl_router::coordinator::testing::{FakeLifecycle, FakeState, FakeTimings};
    use tokio::time::{Instant, advance};

    let fake = FakeLifecycle::new(FakeTimings::default());
    let a = fake.add("a", "chat-a", FakeState::Ready, 1);
    let router = fake.spawn(RouterConfig::default());
    fake.announce("a").await;
    let mut inner = State::default();
    inner.insert(dep("a", "chat-a", "", Instant::now()));
    let changed = inner.deps["a"].last_used;
    // The server's handle on the record, as the rules are given it.
    let uses = RouterUses::default();
    let used_at = |inner: &State| State::used_at(&inner.deps["a"], &uses);
    assert_eq!(used_at(&inner), changed, "no router yet");
    uses.attach(Arc::new(router.last_uses()));
    assert_eq!(used_at(&inner), changed, "no request yet");

    // A request's start and end, as the router records them (on its lane: no turn of its
    // task), are the deployment's last use.
    advance(Duration::from_secs(5)).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let permit = router.admit(a, deadline).await.unwrap();
    assert_eq!(used_at(&inner), changed + Duration::from_secs(5));
    advance(Duration::from_secs(1)).await;
    drop(permit);
    assert_eq!(used_at(&inner), changed + Duration::from_secs(6));
    // A later state change that counts as use wins when it is the later one.
    advance(Duration::from_secs(1)).await;
    inner.deps.get_mut("a").unwrap().last_used = Instant::now();
    assert_eq!(used_at(&inner), changed + Duration::from_secs(7));
    // Dropped, a deployment says so to the name cache entries that still hold it.
    let gone = Arc::clone(&inner.deps["a"].presence.0);
    assert!(!gone.load(Ordering::Acquire));
    inner.remove("a");
    assert!(gone.load(Ordering::Acquire));
}

/// Begins a park of ready `id` as a release does, and answers it with `done` at `at`.
fn released(s: &mut State, id: &str, done: DownDone, at: Instant) {
    let r = s.begin_release(id, false, false).unwrap();
    assert!(!r.parked);
    assert_eq!(s.deps[id].state, InstanceState::Parking);
    assert!(s.deps[id].busy);
    s.down_done(id, done, at);
}

/// A park that failed, whose engine could not be stopped either, leaves the instance failed
/// (its status says both) with its engine kept: the books count its memory, so another model
/// is not brought up on it, until a stop succeeds (an operator's stop tries again: failing
/// again, it still holds it) or its engine is seen gone (it exited; its host came back
/// without it). A park that failed and stopped its engine holds nothing.
#[tokio::test(start_paused = true)]
async fn an_engine_that_could_not_be_stopped_holds_its_memory_until_stopped_or_gone() {
    let t0 = Instant::now();
    let kept = |s: &mut State, id: &str| {
        ready(s, id, t0);
        released(
            s,
            id,
            DownDone::Failed {
                error: "park timed out".into(),
                stopped: Err("connection refused".into()),
            },
            t0,
        );
    };
    let mut s = state(t0);
    kept(&mut s, "a");
    let a = &s.deps["a"];
    assert_eq!(a.state, InstanceState::Failed);
    assert_eq!(
        a.last_error.as_deref(),
        Some(
            "park or stop failed: park timed out, and stopping the engine failed: \
             connection refused"
        )
    );
    assert!(a.keeps_engine());
    held_sums_agree(&mut s, t0, "kept");
    assert_eq!(s.gpu_held.on("gpu-1", None, ""), 6 * GIB);
    // b (6 GiB) does not fit beside it (10 GiB), and a is no victim: b's requests wait.
    let plan = s.request_plan("b", "sw-1".into(), t0).unwrap();
    assert!(matches!(plan, Plan::Later), "{plan:?}");
    // A stop tries again; it fails again: still held.
    assert_eq!(s.begin_down("a", "stop-1", t0), Ok(Some(false)));
    let r = s.begin_release("a", true, false).unwrap();
    assert!(r.kept && !r.parked);
    assert_eq!(s.deps["a"].state, InstanceState::Stopping);
    s.down_done(
        "a",
        DownDone::Failed {
            error: "connection refused".into(),
            stopped: Err("connection refused".into()),
        },
        t0,
    );
    s.release_reservation("stop-1");
    assert_eq!(
        s.deps["a"].last_error.as_deref(),
        Some("park or stop failed: connection refused")
    );
    held_sums_agree(&mut s, t0, "stop failed again");
    assert_eq!(s.gpu_held.on("gpu-1", None, ""), 6 * GIB);
    assert!(matches!(
        s.request_plan("b", "sw-2".into(), t0).unwrap(),
        Plan::Later
    ));
    // The stop succeeds: its memory is free, b comes up.
    assert_eq!(s.begin_down("a", "stop-2", t0), Ok(Some(false)));
    s.begin_release("a", true, false).unwrap();
    s.down_done("a", DownDone::Stopped(Released::Stopped), t0);
    s.release_reservation("stop-2");
    assert_eq!(s.deps["a"].state, InstanceState::Stopped);
    assert_eq!(s.deps["a"].ended_stop_failed, None);
    held_sums_agree(&mut s, t0, "stopped");
    assert_eq!(s.gpu_held.on("gpu-1", None, ""), 0);
    let plan = s.request_plan("b", "sw-3".into(), t0).unwrap();
    assert!(matches!(plan, Plan::BringUp { .. }), "{plan:?}");
    // Its engine exits after all: gone, its memory free.
    let mut s = state(t0);
    kept(&mut s, "a");
    let exit = EngineExit {
        instance: instance_id("a"),
        status: Some("signal 9".into()),
    };
    assert!(s.engine_exited("gpu-1", &exit, t0).is_some());
    assert!(!s.deps["a"].keeps_engine());
    assert_eq!(s.deps["a"].state, InstanceState::Failed);
    held_sums_agree(&mut s, t0, "exited");
    assert_eq!(s.gpu_held.on("gpu-1", None, ""), 0);
    assert!(matches!(
        s.request_plan("b", "sw-1".into(), t0).unwrap(),
        Plan::BringUp { .. }
    ));
    // Its host comes back without it: gone.
    let mut s = state(t0);
    kept(&mut s, "a");
    s.add_host("gpu-1".into(), host(), &[]);
    assert!(!s.deps["a"].keeps_engine());
    held_sums_agree(&mut s, t0, "lost");
    assert_eq!(s.gpu_held.on("gpu-1", None, ""), 0);
    // A park that failed and stopped its engine holds nothing.
    let mut s = state(t0);
    ready(&mut s, "a", t0);
    released(
        &mut s,
        "a",
        DownDone::Failed {
            error: "park timed out".into(),
            stopped: Ok(()),
        },
        t0,
    );
    assert_eq!(
        s.deps["a"].last_error.as_deref(),
        Some("park or stop failed: park timed out")
    );
    held_sums_agree(&mut s, t0, "park failed, engine stopped");
    assert_eq!(s.gpu_held.on("gpu-1", None, ""), 0);
    // Nothing to stop then.
    assert_eq!(s.begin_down("a", "stop-1", t0), Ok(None));
}

#[tokio::test(start_paused = true)]
async fn a_releases_outcome_is_written_once_at_the_time_given() {
    let t0 = Instant::now();
    let mut s = state(t0);
    for id in ["a", "b", "c"] {
        ready(&mut s, id, t0);
    }
    let later = t0 + Duration::from_secs(90);
    // Parked: its tier and what it still holds of the GPU, its last use the outcome's time
    // (the clock is not read: it stands at t0).
    released(
        &mut s,
        "a",
        DownDone::Parked {
            tier: ParkTier::HostRam,
            gpu_held: Some(GIB),
        },
        later,
    );
    let a = &s.deps["a"];
    assert_eq!(a.state, InstanceState::Parked);
    assert!(!a.busy);
    assert_eq!((a.tier, a.parked_gpu), (Some(ParkTier::HostRam), Some(GIB)));
    assert_eq!(a.last_used, later);
    // Stopped for want of room to park: said so in its status.
    released(
        &mut s,
        "b",
        DownDone::Stopped(Released::StoppedNoRoomToPark),
        later,
    );
    let b = &s.deps["b"];
    assert_eq!(b.state, InstanceState::Stopped);
    assert_eq!((b.addr, b.tier), (None, None));
    assert_eq!(
        b.last_error,
        Some(Released::StoppedNoRoomToPark.status_line())
    );
    // Failed: the scaler's back-off counts from the outcome's time, not the clock's.
    released(
        &mut s,
        "c",
        DownDone::Failed {
            error: "boom".into(),
            stopped: Ok(()),
        },
        later,
    );
    let c = &s.deps["c"];
    assert_eq!(c.state, InstanceState::Failed);
    assert_eq!(c.last_error.as_deref(), Some("park or stop failed: boom"));
    assert!(c.backing_off(later + FAILED_BACKOFF - Duration::from_secs(1)));
    assert!(!c.backing_off(later + FAILED_BACKOFF));
    // A drain refused: what is still shown drained serves again, nothing else changes.
    ready(&mut s, "b", t0);
    assert_eq!(
        s.show_draining(&["b".into(), "gone".into()], InstanceState::Closed)
            .len(),
        1
    );
    s.drain_refused(&["a".into(), "b".into()], InstanceState::Closed);
    assert_eq!(s.deps["b"].state, InstanceState::Ready);
    assert_eq!(s.deps["a"].state, InstanceState::Parked);
}

#[tokio::test(start_paused = true)]
async fn a_preinitialize_writes_its_start_through_up_done_and_keeps_its_last_use() {
    let t0 = Instant::now();
    let mut s = state(t0);
    let later = t0 + Duration::from_secs(30);
    let started = || Started {
        addr: Some(([127, 0, 0, 1], 9).into()),
        pid: 7,
        max_running: MaxRunning {
            count: Some(4),
            source: capyctl_interfaces::launch::MaxRunningSource::Declared,
        },
        measurement: Measurement::default(),
    };
    for id in ["a", "b", "c"] {
        let d = s.deps.get_mut(id).unwrap();
        d.busy = true;
        d.state = InstanceState::Starting;
    }
    // Started, not ready: closed and still busy (its park follows), never announced.
    let answered = s.up_done(
        "a",
        Up::Start,
        UpDone::Closed {
            started: started(),
            first_answer: capyctl_interfaces::verify::FirstAnswer::Text { text: "ok".into() },
        },
        later,
    );
    assert_eq!(answered, None);
    let a = &s.deps["a"];
    assert_eq!(a.state, InstanceState::Closed);
    assert!(a.busy);
    assert_eq!((a.pid, a.last_used), (Some(7), t0));
    assert!(a.rec.first_answer.is_some());
    // Its start failed (or no agent): failed with the status given, back-off from `later`.
    let gone = s.up_done(
        "b",
        Up::Start,
        UpDone::Gone("preinitialize: no".into()),
        later,
    );
    assert!(matches!(gone, Some(Err(_))));
    let b = &s.deps["b"];
    assert_eq!(b.state, InstanceState::Failed);
    assert!(!b.busy);
    assert_eq!(b.last_error.as_deref(), Some("preinitialize: no"));
    assert_eq!((b.failed_at, b.last_used), (Some(later), t0));
    // Ended and its engine stopped: stopped, no back-off.
    s.up_done(
        "c",
        Up::Start,
        UpDone::Ended {
            why: "ended".into(),
            stopped: Ok(()),
        },
        later,
    );
    let c = &s.deps["c"];
    assert_eq!((c.state, c.busy), (InstanceState::Stopped, false));
    assert_eq!(c.last_error.as_deref(), Some("ended"));
    // Ended, but its engine's stop failed: failed, its last use kept, and the stop's error
    // kept for the drain or stop that ended it (which then reports the engine not stopped).
    let b = s.deps.get_mut("b").unwrap();
    (b.busy, b.state) = (true, InstanceState::Starting);
    s.up_done(
        "b",
        Up::Start,
        UpDone::Ended {
            why: "ended".into(),
            stopped: Err("connection refused".into()),
        },
        later,
    );
    let b = &s.deps["b"];
    assert_eq!((b.state, b.busy), (InstanceState::Failed, false));
    assert_eq!(
        b.last_error.as_deref(),
        Some("ended, but stopping the engine failed: connection refused")
    );
    assert_eq!(b.ended_stop_failed.as_deref(), Some("connection refused"));
    assert_eq!(b.last_used, t0);
    // A start that is ready is used at the outcome's time.
    let d = s.deps.get_mut("c").unwrap();
    d.busy = true;
    d.state = InstanceState::Starting;
    assert!(matches!(
        s.up_done("c", Up::Start, UpDone::Ready(Some(started())), later),
        Some(Ok(_))
    ));
    assert_eq!(
        (s.deps["c"].state, s.deps["c"].last_used),
        (InstanceState::Ready, later)
    );
}

#[tokio::test(start_paused = true)]
async fn an_idle_timer_that_could_not_act_starts_over_from_the_time_given() {
    let t0 = Instant::now();
    let mut s = state(t0);
    ready(&mut s, "a", t0);
    let later = t0 + Duration::from_secs(600);
    let (down, _) = s
        .begin_idle_down(
            "a",
            true,
            &LifecycleDefaults {
                ready_idle_timeout: Some(Duration::from_secs(60)),
                parked_idle_timeout: None,
            },
            "idle-1",
            &NoRequests,
            later,
        )
        .unwrap();
    assert_eq!(down, Some(true));
    assert_eq!(s.deps["a"].reserved.as_deref(), Some("idle-1"));
    // Released by the router: the reservation ends, and the release is no use: the last use
    // stays the one before.
    s.idle_down_done("a", "idle-1", false, later);
    assert_eq!(s.deps["a"].reserved, None);
    assert_eq!(s.deps["a"].last_used, t0);
    // Failed: its timer starts over from the time given.
    s.idle_down_done("a", "idle-2", true, later);
    assert_eq!(s.deps["a"].last_used, later);
    s.touch("b", later);
    assert_eq!(s.deps["b"].last_used, later);
}

#[tokio::test(start_paused = true)]
async fn an_engine_exit_and_a_fence_read_the_time_given_not_the_clock() {
    let t0 = Instant::now();
    let mut s = state(t0);
    ready(&mut s, "a", t0);
    ready(&mut s, "b", t0);
    let later = t0 + Duration::from_secs(45);
    let exit = EngineExit {
        instance: "a-0".into(),
        status: Some("signal 9".into()),
    };
    assert!(s.engine_exited("gpu-1", &exit, later).is_some());
    let a = &s.deps["a"];
    assert_eq!((a.last_used, a.failed_at), (later, Some(later)));
    // Fenced until t0 + 60 s: at t0 + 45 s the refusal says 16 s more (the clock says 61).
    s.set_fence(t0 + Duration::from_secs(60), t0);
    let e = s.command_refusal("b", later).unwrap_err();
    assert!(e.message().contains("for another 16 s"), "{}", e.message());
    // A deploy writes its record as of the time given.
    let doc = capyctl_spec::documents::parse_deployment_str(
        "t.yaml",
        "name: chat-n\nengine: vllm\nmodel: m\n",
    )
    .unwrap();
    let (id, outcome) = s.apply_deploy(doc.clone(), "n".into(), None, later);
    assert_eq!((id.as_str(), outcome), ("n", DeployOutcome::Created));
    assert_eq!(s.deps["n"].last_used, later);
    assert!(s.dirty.has("n"));
    let (_, again) = s.apply_deploy(doc, "other".into(), None, later);
    assert_eq!(again, DeployOutcome::Unchanged);
}

#[tokio::test(start_paused = true)]
async fn the_operators_marks_are_rules_of_one_turn() {
    let now = Instant::now();
    let mut s = state(now);
    ready(&mut s, "a", now);
    // A stop: stopped by its operator, no start pending, the record marked for the save.
    s.deps.get_mut("b").unwrap().rec.pending_start = true;
    s.operator_stop("b").unwrap();
    let b = &s.deps["b"].rec;
    assert!(b.operator_stopped && !b.operator_started && !b.pending_start);
    assert!(s.dirty.has("b"));
    assert_eq!(s.operator_stop("nope").unwrap_err().code(), "not_found");
    // A park of a deployment none of whose instances is ready is one instance's: nothing
    // marked; with one ready, the deployment is marked parked by its operator.
    assert_eq!(s.operator_park("c"), Err("c".to_string()));
    assert!(!s.operator_parked.contains("c"));
    let units = s.operator_park("a").unwrap();
    assert_eq!(units, [("a".to_string(), InstanceState::Ready)]);
    assert!(s.operator_parked.contains("a"));
    assert!(s.end_operator_park("a"));
    assert!(!s.end_operator_park("a"));
    // A start that nothing can be released for waits for memory, once.
    assert!(s.wait_for_memory("c"));
    assert!(s.deps["c"].rec.pending_start);
    assert!(!s.wait_for_memory("c"), "already waiting");
    assert!(!s.wait_for_memory("a"), "it runs");
    // A host drain: cordoned, what is bound there named; uncordoned again.
    assert_eq!(s.cordon("gpu-1"), ["a".to_string()]);
    assert!(s.cordoned.contains("gpu-1"));
    assert!(s.uncordon("gpu-1"));
    assert!(s.cordoned.is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_hold_gives_up_the_claimed_targets_and_a_drained_order_gives_its_victims_back() {
    let now = Instant::now();
    let mut s = state(now);
    ready(&mut s, "a", now);
    ready(&mut s, "b", now);
    // A plan for `c` claims it and reserves a victim.
    let plan = s.request_plan("c", "sw-1".into(), now).unwrap();
    let Plan::Switch { victims, .. } = plan else {
        panic!("a switch: {plan:?}")
    };
    assert_eq!(s.deps["c"].claim.as_deref(), Some("sw-1"));
    // Held: the claimed target is given up (its requests get the refusal).
    assert_eq!(s.hold(held()), ["c".to_string()]);
    // The drained order is given back: the reservation ends, the victims still ready (of
    // the generation drained) are named to announce again; one of another generation is not.
    let mut stale = victims[0].clone();
    stale.generation += 1;
    let back = s.give_back_held_order("sw-1", vec![victims[0].clone(), stale]);
    assert_eq!(back.len(), 1);
    assert_eq!(back[0].0, victims[0]);
    assert_eq!(s.deps["c"].claim, None);
    assert!(s.deps.values().all(|d| d.reserved.is_none()));
}

#[tokio::test(start_paused = true)]
async fn the_scaler_takes_the_first_unit_with_room_in_one_turn() {
    let now = Instant::now();
    let mut s = one_host("box", 2, 10);
    s.insert(dep("r", "chat-r", "replicas: 3", now));
    bring_up(&mut s, "r", now);
    bring_up(&mut s, "r-1", now);
    // Both GPUs are taken by its siblings: the third has no room; `nope` is no unit.
    assert_eq!(
        s.scale_up_first(vec!["nope".into(), "r-2".into()], &NoRequests, now),
        None
    );
    // One sibling stops: the third comes up there, started by the scaler (not an operator).
    let d = s.deps.get_mut("r-1").unwrap();
    d.state = InstanceState::Stopped;
    s.set_host("r-1", None);
    let (unit, up) = s
        .scale_up_first(vec!["nope".into(), "r-2".into()], &NoRequests, now)
        .unwrap();
    assert_eq!((unit.as_str(), up), ("r-2", Up::Start));
    assert!(s.deps["r-2"].busy && !s.deps["r-2"].operator_up);
    assert_eq!(s.deps["r-2"].last_used, now);
}

/// An instance past `replicas` whose engine could not be stopped is not dropped with the
/// surplus: dropped, its engine's memory would be counted free while the engine may still hold
/// it (the GPU over-booked). It stays, failed and counted, until its engine is seen gone; then
/// it holds nothing and goes.
#[tokio::test(start_paused = true)]
async fn a_surplus_instance_whose_engine_could_not_be_stopped_stays_until_it_is_gone() {
    let t0 = Instant::now();
    let mut s = one_host("box", 2, 10);
    s.insert(dep("r", "chat-r", "replicas: 2", t0));
    bring_up(&mut s, "r", t0);
    bring_up(&mut s, "r-1", t0);
    released(
        &mut s,
        "r-1",
        DownDone::Failed {
            error: "park timed out".into(),
            stopped: Err("connection refused".into()),
        },
        t0,
    );
    assert!(s.deps["r-1"].keeps_engine());
    held_sums_agree(&mut s, t0, "kept");
    assert_eq!(s.gpu_held.on("box", None, ""), 12 * GIB);
    // replicas lowered to 1: r-1 is surplus, but its engine may hold its GPU.
    let mut d = s.deps["r"].rec.clone();
    Arc::make_mut(&mut d.doc).replicas = Some(1);
    d.revision = 2;
    s.deps.get_mut("r").unwrap().rec = d;
    s.deps.get_mut("r").unwrap().renew_fixed();
    s.sync_units("r", t0);
    assert_eq!(s.unit_ids("r"), ["r", "r-1"]);
    assert!(s.settled_surplus().is_empty());
    held_sums_agree(&mut s, t0, "surplus kept");
    assert_eq!(s.gpu_held.on("box", None, ""), 12 * GIB);
    // Its engine exits after all: it holds nothing, the surplus goes.
    let exit = EngineExit {
        instance: s.deps["r-1"].instance_id().to_string(),
        status: Some("signal 9".into()),
    };
    assert!(s.engine_exited("box", &exit, t0).is_some());
    assert_eq!(s.settled_surplus(), ["r"]);
    s.sync_units("r", t0);
    assert_eq!(s.unit_ids("r"), ["r"]);
    held_sums_agree(&mut s, t0, "surplus gone");
    assert_eq!(s.gpu_held.on("box", None, ""), 6 * GIB);
}
