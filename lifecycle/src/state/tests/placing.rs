//! Placement and victims: replicas, evictions, fences, holds, idle timers and the bring-ups
//! they start.

use super::*;

#[tokio::test(start_paused = true)]
async fn replicas_are_units_on_distinct_gpus_and_never_each_others_victims() {
    let now = Instant::now();
    let mut s = one_host("box", 4, 10);
    s.insert(dep("r", "chat-r", "replicas: 3", now));
    s.insert(dep("b", "chat-b", "", now));
    // One unit per replica, keyed `r`, `r-1`, `r-2`; one deployment to the views.
    assert_eq!(s.unit_ids("r"), ["r", "r-1", "r-2"]);
    assert_eq!(s.deps["r-2"].instance_id(), "r-2");
    assert_eq!(s.deps["r"].instance_id(), "r-0");
    // Each on a GPU of its own (6 of 10 GiB: two would fit no GPU anyway; with 3 GiB they
    // would, and still go apart).
    let mut used = BTreeSet::new();
    for unit in ["r", "r-1", "r-2"] {
        let (host, gpus) = bring_up(&mut s, unit, now);
        assert_eq!(host.as_deref(), Some("box"));
        assert_eq!(gpus.len(), 1);
        assert!(used.insert(gpus[0]), "{unit} on a GPU of its own: {gpus:?}");
        let env = s.deps[unit].launch_spec().env;
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], gpus[0].to_string());
        assert_eq!(env["CUDA_DEVICE_ORDER"], "PCI_BUS_ID", "NVML's numbering");
    }
    // A fourth (replicas raised) finds the free GPU only.
    let mut d = s.deps["r"].rec.clone();
    Arc::make_mut(&mut d.doc).replicas = Some(4);
    d.revision = 2;
    s.deps.get_mut("r").unwrap().rec = d;
    s.deps.get_mut("r").unwrap().renew_fixed();
    s.sync_units("r", Instant::now());
    let (_, gpus) = bring_up(&mut s, "r-3", now);
    assert!(!used.contains(&gpus[0]));
    // Every GPU now holds an instance of r: chat-b names one instance (the longest idle),
    // never two; r's own plan never names its siblings.
    s.deps.get_mut("r-1").unwrap().last_used = now - Duration::from_secs(60);
    let plan = s.request_plan("b", "sw-1".into(), now).unwrap();
    match plan {
        Plan::Switch { victims, .. } => {
            assert_eq!(victims.len(), 1, "{victims:?}");
            assert_eq!((victims[0].deployment.as_str(), victims[0].index), ("r", 1));
        }
        other => panic!("{other:?}"),
    }
    // Lowering replicas leaves the running units to the scaler; stopped ones go at once.
    s.release_reservation("sw-1");
    s.deps.get_mut("r-3").unwrap().state = InstanceState::Stopped;
    let mut d = s.deps["r"].rec.clone();
    Arc::make_mut(&mut d.doc).replicas = Some(2);
    d.revision = 3;
    s.deps.get_mut("r").unwrap().rec = d;
    s.deps.get_mut("r").unwrap().renew_fixed();
    s.sync_units("r", Instant::now());
    assert_eq!(s.unit_ids("r"), ["r", "r-1", "r-2"]);
    s.remove("r");
    assert!(s.unit_ids("r").is_empty());
    assert!(s.replicated.is_empty());
}

#[tokio::test(start_paused = true)]
async fn an_operators_evict_fills_every_replica() {
    let now = Instant::now();
    let mut s = one_host("box", 4, 10);
    for id in ["a", "b", "c"] {
        s.insert(dep(id, &format!("chat-{id}"), "", now));
        bring_up(&mut s, id, now);
    }
    s.insert(dep("r", "chat-r", "replicas: 3", now));
    bring_up(&mut s, "r", now);
    assert_eq!(s.filled("r"), (3, 1));
    assert_eq!(s.unit_to_fill("r").as_deref(), Some("r-1"));
    let mut protected = none();
    protected.insert("r".to_string());
    let plan = s
        .plan(
            "r",
            &protected,
            PlanFor::Operator,
            "sw-1".into(),
            &NoRequests,
            now,
        )
        .unwrap();
    match plan {
        Plan::Switch { victims, .. } => assert_eq!(victims.len(), 1, "{victims:?}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(s.deps["r-1"].claim.as_deref(), Some("sw-1"));
    // Requests' plans do not fill: one instance is up.
    assert_eq!(
        s.request_plan("r", "sw-2".into(), now).unwrap(),
        Plan::AlreadyComing
    );
}

#[tokio::test(start_paused = true)]
async fn instances_prefer_hosts_without_a_sibling_and_span_gpus_per_instance() {
    let now = Instant::now();
    let mut s = one_host("a", 1, 40);
    s.add_host("b".into(), gpus_host(1, 40), &[]);
    s.insert(dep("r", "chat-r", "replicas: 2", now));
    let (first, _) = bring_up(&mut s, "r", now);
    let (second, _) = bring_up(&mut s, "r-1", now);
    assert_ne!(first, second, "the second instance goes to the other host");

    // gpus_per_instance: 2 on a host of 4 GPUs: two GPUs, each with half the memory.
    let mut s = one_host("box", 4, 10);
    s.insert(sized_dep(
        "t",
        "chat-t",
        "replicas: 2\ngpus_per_instance: 2",
        16,
        now,
    ));
    assert_eq!(s.deps["t-1"].spec().tensor_parallel, Some(2));
    let (_, g0) = bring_up(&mut s, "t", now);
    let (_, g1) = bring_up(&mut s, "t-1", now);
    assert_eq!((g0.len(), g1.len()), (2, 2));
    assert!(g0.iter().all(|g| !g1.contains(g)), "{g0:?} {g1:?}");
    // More GPUs than the host has: never (on a host of one GPU too: its engine would
    // start tensor-parallel on one).
    for (gpus, gib, want) in [(2, 10, 3), (1, 40, 2)] {
        let mut s = one_host("h", gpus, gib);
        s.insert(dep(
            "w",
            "chat-w",
            &format!("gpus_per_instance: {want}"),
            now,
        ));
        let (_, fit) = s.place_target("w", &none(), Victims::Idle, &NoRequests, now);
        assert_eq!(
            fit,
            Fit::Never(format!(
                "it needs {want} GPUs (gpus_per_instance) and the host has {gpus}"
            ))
        );
    }
}

#[tokio::test(start_paused = true)]
async fn an_instance_over_several_gpus_names_no_victim_another_one_already_makes_room_for() {
    let start = Instant::now();
    tokio::time::advance(Duration::from_secs(600)).await;
    let now = Instant::now();
    let mut s = one_host("box", 2, 10);
    // v spans both GPUs (7 GiB on each); x (2 GiB) shares one of them, idle longer.
    s.insert(sized_dep("v", "chat-v", "gpus_per_instance: 2", 14, start));
    s.insert(sized_dep("x", "chat-x", "", 2, start));
    let (_, gv) = bring_up(&mut s, "v", start);
    let (_, gx) = bring_up(&mut s, "x", start);
    assert_eq!((gv.len(), gx.len()), (2, 1));
    s.deps.get_mut("v").unwrap().last_used = now - Duration::from_secs(50);
    s.deps.get_mut("x").unwrap().last_used = now - Duration::from_secs(500);
    // t needs 4 GiB on each GPU. On x's GPU alone x goes first (the longest idle), and is
    // not enough, so v too; on the other, v. Yet v, released, frees 7 GiB on both: x is
    // not needed, and is no victim (it was, when each GPU chose alone).
    s.insert(sized_dep("t", "chat-t", "gpus_per_instance: 2", 8, now));
    let (_, fit) = s.place_target("t", &none(), Victims::Idle, &NoRequests, now);
    assert_eq!(fit, Fit::After(vec!["v".into()]));
}

#[tokio::test(start_paused = true)]
async fn the_scaler_starts_a_stopped_instance_where_a_parked_one_has_no_room() {
    let now = Instant::now();
    let mut s = one_host("box", 3, 10);
    s.insert(dep("r", "chat-r", "replicas: 3", now));
    s.insert(dep("b", "chat-b", "", now));
    bring_up(&mut s, "r", now);
    let (_, g1) = bring_up(&mut s, "r-1", now);
    let d = s.deps.get_mut("r-1").unwrap();
    d.state = InstanceState::Parked;
    d.parked_gpu = Some(GIB);
    // Another model takes the parked instance's GPU (the fullest that fits).
    let (_, gb) = bring_up(&mut s, "b", now);
    assert_eq!(gb, g1);
    // The parked instance can wake only there: no room, so the scaler's next candidate,
    // the stopped one, is started on the free GPU (`Core::scale_run` tries them in
    // the order `scale::decide` gives).
    assert_eq!(s.scale_up("r-1", &NoRequests, now), None);
    assert!(s.scale_up("r-2", &NoRequests, now).is_some());
    assert!(
        !s.deps["r-2"].gpus.contains(&g1[0]),
        "{:?}",
        s.deps["r-2"].gpus
    );
}

#[tokio::test(start_paused = true)]
async fn the_scaler_waits_out_the_back_off_of_an_engine_that_failed_not_one_its_host_lost() {
    let long_ago = Instant::now();
    tokio::time::advance(Duration::from_secs(600)).await;
    let mut s = one_host("box", 3, 10);
    s.insert(dep("r", "chat-r", "replicas: 3", long_ago));
    for unit in ["r", "r-1", "r-2"] {
        bring_up(&mut s, unit, long_ago);
        s.deps.get_mut(unit).unwrap().last_used = long_ago;
    }
    let held = |s: &State, unit: &str| {
        let now = Instant::now();
        s.scale_inputs(&NoRequests, now)[0]
            .units
            .iter()
            .find(|u| u.unit == unit)
            .unwrap()
            .held
    };
    // r-1's engine exits, unused for ten minutes: the back-off counts from the exit.
    let exit = capyctl_interfaces::agent::EngineExit {
        instance: "r-1".into(),
        status: Some("signal 9".into()),
    };
    assert!(s.engine_exited("box", &exit, Instant::now()).is_some());
    assert!(held(&s, "r-1"), "within the back-off");
    tokio::time::advance(FAILED_BACKOFF - Duration::from_secs(1)).await;
    assert!(held(&s, "r-1"), "still within it");
    tokio::time::advance(Duration::from_secs(1)).await;
    assert!(!held(&s, "r-1"), "past it");
    // The host comes back (its agent restarted) without its engines: r-2 failed, but not
    // on its own, so the scaler may bring it back at once, used a moment ago or not.
    s.deps.get_mut("r-2").unwrap().last_used = Instant::now();
    let lost = s.add_host("box".into(), gpus_host(3, 10), &[]).lost;
    assert!(lost.iter().any(|k| k.index == 2), "{lost:?}");
    assert_eq!(s.deps["r-2"].state, InstanceState::Failed);
    assert!(!held(&s, "r-2"), "a lost engine is no failure of its own");
}

#[tokio::test(start_paused = true)]
async fn a_parked_instance_keeps_its_gpu_from_its_siblings_with_no_residue_known() {
    let now = Instant::now();
    let mut s = one_host("box", 3, 10);
    s.insert(dep("r", "chat-r", "replicas: 3", now));
    let (_, g0) = bring_up(&mut s, "r", now);
    let (_, g1) = bring_up(&mut s, "r-1", now);
    // r-1 parks, and what its engine keeps on the GPU is not known (no NVML reading):
    // it holds nothing placement counts, yet it can only wake on that GPU.
    let d = s.deps.get_mut("r-1").unwrap();
    d.state = InstanceState::Parked;
    d.parked_gpu = None;
    assert!(!s.deps["r-1"].holds_gpu());
    let (_, g2) = bring_up(&mut s, "r-2", now);
    assert!(
        !g2.contains(&g1[0]) && !g2.contains(&g0[0]),
        "r-2 on a GPU of its own: {g0:?} {g1:?} {g2:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn held_switches_refuse_every_change_but_ready_models_serve_on() {
    let now = Instant::now();
    let mut s = state(now);
    ready(&mut s, "a", now);
    let mut c = *s.deps.remove("c").unwrap();
    c.rec.pending_start = true;
    s.insert(c);
    s.hold(held());
    // A request for a model that is not ready is refused at once, with the cause.
    let e = s.admissible("b").unwrap_err();
    assert_eq!(
        (e.status(), e.code(), e.retry_after()),
        (503, "unavailable", Some(2))
    );
    assert!(
        e.message().contains("API server cannot be reached"),
        "{}",
        e.message()
    );
    // The ready one is admissible (its requests are forwarded, not switched).
    assert!(s.admissible("a").is_ok());
    // Plans fail with it (requests and an operator's --evict): nothing reserved.
    for who in [PlanFor::Requests, PlanFor::Operator] {
        let e = s
            .plan("b", &none(), who, "sw-1".into(), &NoRequests, now)
            .unwrap_err();
        assert_eq!(e.code(), "unavailable");
    }
    assert_eq!(s.deps["a"].reserved, None);
    assert_eq!(s.deps["b"].claim, None);
    // Operator commands: start, preinitialize, park/stop (begin_down) refused.
    assert_eq!(
        s.start("b", true, false, now).unwrap_err().code(),
        "unavailable"
    );
    assert_eq!(
        s.park("a", "park-1", Instant::now()).unwrap_err().code(),
        "unavailable"
    );
    assert_eq!(
        s.begin_down("a", "stop-1", Instant::now())
            .unwrap_err()
            .code(),
        "unavailable"
    );
    assert_eq!(s.deps["a"].state, InstanceState::Ready);
    assert_eq!(s.deps["a"].reserved, None);
    // No idle timer, no pending start.
    let timers = LifecycleDefaults {
        ready_idle_timeout: Some(Duration::from_secs(1)),
        ..LifecycleDefaults::default()
    };
    let later = now + Duration::from_secs(60);
    assert!(s.idle_due(&timers, &none(), &NoRequests, later).is_empty());
    assert!(s.start_pending("c", later).is_none());
    // An engine exit is still recorded.
    let exit = EngineExit {
        instance: instance_id("a"),
        status: Some("signal 9".into()),
    };
    assert!(s.engine_exited("gpu-1", &exit, Instant::now()).is_some());
    assert_eq!(s.deps["a"].state, InstanceState::Failed);
    // Resumed: switching again.
    s.resume();
    assert!(s.admissible("b").is_ok());
    let plan = s.request_plan("b", "sw-2".into(), later).unwrap();
    assert!(matches!(plan, Plan::BringUp { .. }), "{plan:?}");
    assert_eq!(
        s.idle_due(&timers, &none(), &NoRequests, later).len(),
        0,
        "a failed"
    );
}

#[tokio::test(start_paused = true)]
async fn a_fenced_ready_instance_is_no_victim_until_the_fence_ends() {
    let now = Instant::now();
    let mut s = state(now);
    ready(&mut s, "a", now);
    let until = now + Duration::from_secs(90);
    assert_eq!(s.set_fence(until, now), ["chat-a"]);
    // `b` needs `a`'s memory: it waits (`Later`), never `does_not_fit`.
    let plan = s.request_plan("b", "sw-1".into(), now).unwrap();
    assert!(matches!(plan, Plan::Later), "{plan:?}");
    let plan = s
        .plan(
            "b",
            &none(),
            PlanFor::Operator,
            "sw-2".into(),
            &NoRequests,
            now,
        )
        .unwrap();
    assert!(matches!(plan, Plan::Later), "{plan:?}");
    // No operator park or stop of it, naming the fence; no idle timer.
    let e = s.park("a", "park-1", Instant::now()).unwrap_err();
    assert_eq!((e.status(), e.code()), (503, "unavailable"));
    assert!(e.message().contains("previous leader"), "{}", e.message());
    assert_eq!(e.retry_after(), Some(91));
    assert_eq!(s.deps["a"].state, InstanceState::Ready);
    let timers = LifecycleDefaults {
        ready_idle_timeout: Some(Duration::from_secs(1)),
        ..LifecycleDefaults::default()
    };
    assert!(
        s.idle_due(&timers, &none(), &NoRequests, now + Duration::from_secs(60))
            .is_empty()
    );
    // Not yet over 1 s before its end.
    assert!(!s.end_fence(until - Duration::from_secs(1)));
    assert!(s.fenced("a"));
    // Its end: `a` is the victim as usual.
    assert!(s.end_fence(until));
    let plan = s.request_plan("b", "sw-3".into(), until).unwrap();
    let Plan::Switch { victims, .. } = plan else {
        panic!("a switch: {plan:?}");
    };
    assert_eq!(victims[0].deployment, "a");
    // A fence that ends before it begins (a hold-over of 0) fences nothing.
    assert!(s.set_fence(until, until).is_empty());
    assert!(s.fence.is_none());
}

#[tokio::test(start_paused = true)]
async fn a_host_that_joins_during_the_fence_has_what_it_holds_ready_fenced_too() {
    let now = Instant::now();
    let mut s = state(now);
    ready(&mut s, "a", now);
    s.set_fence(now + Duration::from_secs(90), now);
    let adopted = capyctl_interfaces::agent::AdoptedInstance {
        instance: instance_id("b"),
        spec: s.deps["b"].spec(),
        base_url: "http://127.0.0.1:9".into(),
        pid: 4242,
        parked: None,
        gpu_held: None,
    };
    s.add_host("gpu-2".into(), host(), &[adopted]);
    assert_eq!(s.deps["b"].state, InstanceState::Ready);
    assert!(s.fenced("b"));
    assert_eq!(
        s.begin_down("b", "stop-1", Instant::now())
            .unwrap_err()
            .code(),
        "unavailable"
    );
}

#[tokio::test(start_paused = true)]
async fn a_plan_reserves_its_victim_so_a_second_plan_waits_instead_of_naming_it_again() {
    let now = Instant::now();
    let mut s = state(now);
    ready(&mut s, "a", now);
    let plan = s.request_plan("b", "sw-1".into(), now).unwrap();
    let Plan::Switch {
        switch_id, victims, ..
    } = plan
    else {
        panic!("a switch: {plan:?}");
    };
    assert_eq!(switch_id, "sw-1");
    assert_eq!(victims.len(), 1);
    assert_eq!(victims[0].deployment, "a");
    assert_eq!(s.deps["a"].reserved.as_deref(), Some("sw-1"));
    assert_eq!(s.deps["b"].claim.as_deref(), Some("sw-1"));
    // `a` is reserved and `b` claims the rest: `c` waits for memory.
    let later = s.request_plan("c", "sw-2".into(), now).unwrap();
    assert!(matches!(later, Plan::Later), "{later:?}");
    assert_eq!(s.deps["a"].reserved.as_deref(), Some("sw-1"));
    // `b` already has its switch.
    let again = s.request_plan("b", "sw-3".into(), now).unwrap();
    assert!(matches!(again, Plan::AlreadyComing), "{again:?}");
    // Given back, the victim serves on and the target is no longer claimed.
    s.release_reservation("sw-1");
    assert_eq!(s.deps["a"].reserved, None);
    assert_eq!(s.deps["b"].claim, None);
    // A switch given up does not bring its target up.
    let err = s.switch_target_up("sw-1", "b", &[], now).unwrap_err();
    assert_eq!(err.code(), "conflict");
}

/// A victim the switch could not release keeps the target down while it still holds its
/// memory (it serves again after its drain timed out, or its ended start's engine could not
/// be stopped): the switch fails with its error, a drain timeout naming the target as the
/// router's does. One that gave its memory back (its park failed and its engine was stopped)
/// lets the target come up.
#[tokio::test(start_paused = true)]
async fn a_target_comes_up_only_once_its_victims_no_longer_hold_their_memory() {
    let now = Instant::now();
    let timed_out = ApiError::DrainTimeout {
        deployment: "a".into(),
        drain_ms: 5000,
        charged: 1,
    };
    // Drained, its drain timed out: it serves again.
    let mut s = state(now);
    ready(&mut s, "a", now);
    assert!(matches!(
        s.request_plan("b", "sw-1".into(), now).unwrap(),
        Plan::Switch { .. }
    ));
    let kept = [("a".to_string(), timed_out.clone())];
    let err = s.switch_target_up("sw-1", "b", &kept, now).unwrap_err();
    assert_eq!(
        err,
        ApiError::DrainTimeout {
            deployment: "b".into(),
            drain_ms: 5000,
            charged: 1,
        }
    );
    assert_eq!(s.deps["b"].state, InstanceState::Stopped);
    assert!(!s.deps["b"].busy);
    assert_eq!(s.deps["b"].claim, None);
    assert_eq!(s.deps["a"].reserved, None);
    // Its ended start's engine could not be stopped: it may hold its memory still.
    let mut s = state(now);
    ready(&mut s, "a", now);
    s.request_plan("b", "sw-1".into(), now).unwrap();
    let d = s.deps.get_mut("a").unwrap();
    d.fail(
        "start ended, but stopping the engine failed: boom".into(),
        now,
    );
    d.ended_stop_failed = Some("boom".into());
    let failed = ApiError::EngineFailed {
        deployment: "a".into(),
        detail: "boom".into(),
    };
    let kept = [("a".to_string(), failed.clone())];
    let err = s.switch_target_up("sw-1", "b", &kept, now).unwrap_err();
    assert_eq!(err, failed);
    // Its park failed and its engine was stopped: the target comes up.
    let mut s = state(now);
    ready(&mut s, "a", now);
    s.request_plan("b", "sw-1".into(), now).unwrap();
    s.deps
        .get_mut("a")
        .unwrap()
        .fail("park or stop failed: boom".into(), now);
    let kept = [("a".to_string(), failed)];
    assert!(matches!(
        s.switch_target_up("sw-1", "b", &kept, now),
        Ok(Some(Up::Start))
    ));
    assert_eq!(s.deps["b"].state, InstanceState::Starting);
}

#[tokio::test(start_paused = true)]
async fn the_longest_idle_is_the_victim_never_a_protected_or_warm_one() {
    let t0 = Instant::now();
    let now = t0 + Duration::from_secs(60);
    let mut s = state(t0);
    // `p` and `q` (3 GiB each) hold 6 of 10 GiB; `b` needs 6: one of them must go (parked,
    // it still holds its residue, 512 MiB).
    for id in ["p", "q"] {
        s.insert(sized_dep(id, &format!("chat-{id}"), "", 3, t0));
    }
    ready(&mut s, "p", t0 + Duration::from_secs(30));
    ready(&mut s, "q", t0 + Duration::from_secs(10));
    let victims = |plan: Plan| match plan {
        Plan::Switch { victims, .. } => victims
            .into_iter()
            .map(|k| k.deployment)
            .collect::<Vec<_>>(),
        other => panic!("a switch: {other:?}"),
    };
    let plan = s.request_plan("b", "sw-1".into(), now).unwrap();
    assert_eq!(victims(plan), ["q"], "idle for 50 s, p for 30 s");
    s.release_reservation("sw-1");
    // Requests wait for `q`: `p` goes instead.
    let protected = BTreeSet::from(["q".to_string()]);
    let plan = s
        .plan(
            "b",
            &protected,
            PlanFor::Requests,
            "sw-2".into(),
            &NoRequests,
            now,
        )
        .unwrap();
    assert_eq!(victims(plan), ["p"]);
    s.release_reservation("sw-2");
    // A warm model is pinned: with `q` protected and `p` warm, nothing can be released,
    // and nothing ever can while they hold the GPU.
    s.deps.get_mut("p").unwrap().rec.doc =
        dep("p", "chat-p", "lifecycle:\n  warm: true\n", t0).rec.doc;
    let plan = s
        .plan(
            "b",
            &protected,
            PlanFor::Requests,
            "sw-3".into(),
            &NoRequests,
            now,
        )
        .unwrap();
    assert!(matches!(plan, Plan::Later), "q is only protected: {plan:?}");
    s.deps.get_mut("q").unwrap().rec.doc =
        dep("q", "chat-q", "lifecycle:\n  warm: true\n", t0).rec.doc;
    let err = s.request_plan("b", "sw-4".into(), now).unwrap_err();
    assert_eq!(err.code(), "does_not_fit", "{err:?}");
}

#[tokio::test(start_paused = true)]
async fn placement_reads_only_what_may_hold_the_gpu_and_lets_go_of_what_no_longer_does() {
    let now = Instant::now();
    let mut s = state(now);
    ready(&mut s, "a", now);
    ready(&mut s, "b", now);
    let holding = |s: &State| -> Vec<String> {
        s.holding
            .get("gpu-1")
            .into_iter()
            .flatten()
            .map(|id| id.to_string())
            .collect()
    };
    assert_eq!(holding(&s), ["a", "b"]);
    // `a` stops (no GPU memory any more), `b` parks with nothing left on the GPU: both
    // stay bound to gpu-1 (b's copy is there) but hold nothing.
    s.deps.get_mut("a").unwrap().state = InstanceState::Stopped;
    s.deps.get_mut("b").unwrap().state = InstanceState::Parked;
    let plan = s.request_plan("c", "sw-1".into(), now).unwrap();
    assert!(matches!(plan, Plan::BringUp { .. }), "{plan:?}");
    assert_eq!(holding(&s), ["c"], "let go of a and b; c is claimed");
    let on: Vec<&str> = s.on_host("gpu-1").map(|d| d.id()).collect();
    assert_eq!(on, ["a", "b", "c"], "the by-host index still has them all");
    // Woken, `b` is bound again: a holder again.
    s.release_reservation("sw-1");
    s.deps.get_mut("c").unwrap().state = InstanceState::Stopped;
    let plan = s.request_plan("b", "sw-2".into(), now).unwrap();
    assert!(matches!(plan, Plan::BringUp { .. }), "{plan:?}");
    assert_eq!(holding(&s), ["b"]);
}

#[tokio::test(start_paused = true)]
async fn a_cordoned_host_takes_nothing_and_what_is_bound_there_waits() {
    let now = Instant::now();
    let mut s = state(now);
    ready(&mut s, "a", now);
    s.deps.get_mut("a").unwrap().state = InstanceState::Parked;
    s.cordoned.insert("gpu-1".into());
    let plan = s.request_plan("a", "sw-1".into(), now).unwrap();
    assert!(
        matches!(plan, Plan::Later),
        "bound there: waits for the drain {plan:?}"
    );
    let err = s.request_plan("b", "sw-2".into(), now).unwrap_err();
    assert_eq!(err.code(), "does_not_fit");
    assert!(
        err.message().ends_with(
            "host gpu-1 is drained and out of service; `capyctl uncordon host` puts host gpu-1 back"
        ),
        "{}",
        err.message()
    );
    s.cordoned.clear();
    let plan = s.request_plan("b", "sw-3".into(), now).unwrap();
    assert!(
        matches!(plan, Plan::Switch { .. } | Plan::BringUp { .. }),
        "{plan:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn requests_may_not_bring_up_an_explicit_model_but_an_operators_switch_may() {
    let now = Instant::now();
    let mut s = state(now);
    s.insert(dep(
        "x",
        "chat-x",
        "lifecycle:\n  activation: explicit\n",
        now,
    ));
    let err = s.request_plan("x", "sw-1".into(), now).unwrap_err();
    assert_eq!(err.code(), "deployment_inactive");
    let plan = s
        .plan(
            "x",
            &none(),
            PlanFor::Operator,
            "sw-2".into(),
            &NoRequests,
            now,
        )
        .unwrap();
    assert!(matches!(plan, Plan::BringUp { .. }), "{plan:?}");
    s.deps.get_mut("b").unwrap().rec.operator_stopped = true;
    assert_eq!(s.admissible("b").unwrap_err().code(), "deployment_stopped");
}

#[tokio::test(start_paused = true)]
async fn idle_timers_are_due_by_the_last_use_and_are_decided_again_before_they_act() {
    let t0 = Instant::now();
    let mut s = state(t0);
    let timeouts = LifecycleDefaults {
        ready_idle_timeout: Some(Duration::from_secs(300)),
        parked_idle_timeout: Some(Duration::from_secs(3600)),
    };
    ready(&mut s, "a", t0);
    ready(&mut s, "b", t0 + Duration::from_secs(200));
    s.deps.get_mut("c").unwrap().state = InstanceState::Parked;
    let now = t0 + Duration::from_secs(301);
    assert_eq!(
        s.idle_due(&timeouts, &none(), &NoRequests, now),
        [("a".to_string(), true)],
        "b was used 101 s ago; c is parked for less than an hour"
    );
    let in_use = BTreeSet::from(["a".to_string()]);
    assert!(
        s.idle_due(&timeouts, &in_use, &NoRequests, now).is_empty(),
        "in use"
    );
    assert_eq!(
        s.idle_due(
            &timeouts,
            &none(),
            &NoRequests,
            t0 + Duration::from_secs(3600)
        ),
        [
            ("a".to_string(), true),
            ("b".to_string(), true),
            ("c".to_string(), false)
        ]
    );
    // Used again since the list was made: not taken down.
    s.deps.get_mut("a").unwrap().last_used = now;
    assert_eq!(
        s.begin_idle_down("a", true, &timeouts, "idle-1", &NoRequests, now),
        None
    );
    // Due: reserved, and the router is told the instant to check.
    let later = now + Duration::from_secs(300);
    let (down, since) = s
        .begin_idle_down("a", true, &timeouts, "idle-2", &NoRequests, later)
        .unwrap();
    assert_eq!(down, Some(true), "ready: drained first");
    assert_eq!(since, now);
    assert_eq!(s.deps["a"].reserved.as_deref(), Some("idle-2"));
    // A reserved one is nobody else's candidate.
    assert!(
        !s.idle_due(&timeouts, &none(), &NoRequests, later)
            .iter()
            .any(|(id, _)| id == "a")
    );
}

#[tokio::test(start_paused = true)]
async fn an_engine_exit_fails_an_idle_instance_on_its_host_only() {
    let now = Instant::now();
    let mut s = state(now);
    ready(&mut s, "a", now);
    ready(&mut s, "b", now);
    let exit = |instance: &str| EngineExit {
        instance: instance.to_string(),
        status: Some("signal 9".into()),
    };
    assert_eq!(
        s.engine_exited("gpu-2", &exit("a-0"), Instant::now()),
        None,
        "not its host"
    );
    s.deps.get_mut("b").unwrap().busy = true;
    assert_eq!(
        s.engine_exited("gpu-1", &exit("b-0"), Instant::now()),
        None,
        "its operation sees it"
    );
    let key = s
        .engine_exited("gpu-1", &exit("a-0"), Instant::now())
        .unwrap();
    assert_eq!(
        (key.deployment.as_str(), key.host_id.as_str()),
        ("a", "gpu-1")
    );
    let a = &s.deps["a"];
    assert_eq!(a.state, InstanceState::Failed);
    assert_eq!(a.addr, None);
    assert_eq!(a.last_error.as_deref(), Some("the engine exited: signal 9"));
    assert_eq!(
        s.engine_exited("gpu-1", &exit("a-0"), Instant::now()),
        None,
        "once"
    );
}

#[tokio::test(start_paused = true)]
async fn a_start_without_evict_waits_for_memory_and_begins_once_it_is_free() {
    let now = Instant::now();
    let mut s = state(now);
    ready(&mut s, "a", now);
    let next = s.start("b", false, false, now).unwrap();
    assert!(matches!(next, StartNext::Pending), "{next:?}");
    assert!(s.deps["b"].rec.pending_start);
    assert!(s.deps["b"].rec.operator_started);
    assert_eq!(s.start_pending("b", now), None, "a still holds the GPU");
    s.deps.get_mut("a").unwrap().state = InstanceState::Stopped;
    assert_eq!(s.start_pending("b", now), Some(Up::Start));
    let b = &s.deps["b"];
    assert_eq!(b.state, InstanceState::Starting);
    assert!(b.busy && !b.rec.pending_start);
    assert_eq!(b.rec.generation, 1);
    assert!(s.dirty.has("b"), "the taken start and generation are saved");
    // With --evict the start is the coordinator's switch.
    assert!(matches!(
        s.start("c", false, true, now).unwrap(),
        StartNext::Evict
    ));
}

#[tokio::test(start_paused = true)]
async fn an_ended_bring_up_is_stopped_or_failed_with_its_reason() {
    let now = Instant::now();
    let mut s = state(now);
    s.set_host("a", Some("gpu-1".into()));
    assert_eq!(s.begin_up("a", false, now), Some(Up::Start));
    let refusal = ApiError::DeploymentStopped {
        deployment: "a".into(),
    };
    let gone = s
        .up_done(
            "a",
            Up::Start,
            UpDone::Failed {
                error: refusal.clone(),
                ended: Some(Ok(())),
            },
            now,
        )
        .unwrap();
    assert!(gone.is_err(), "the router is told it is gone");
    assert_eq!(s.deps["a"].state, InstanceState::Stopped);
    assert!(
        s.deps["a"]
            .last_error
            .as_deref()
            .unwrap()
            .starts_with("start ended and engine stopped")
    );
    assert_eq!(s.begin_up("a", false, now), Some(Up::Start));
    s.up_done(
        "a",
        Up::Start,
        UpDone::Failed {
            error: refusal,
            ended: Some(Err("connection refused".into())),
        },
        now,
    );
    let a = &s.deps["a"];
    assert_eq!(a.state, InstanceState::Failed);
    assert_eq!(a.ended_stop_failed.as_deref(), Some("connection refused"));
}
