//! The held sums against the holders (a property test), the stop for want of room, the record
//! of requests, priorities.

use super::*;

/// A small deterministic generator (xorshift64*), for the property test below.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a, T>(&mut self, of: &'a [T]) -> &'a T {
        &of[self.below(of.len())]
    }

    fn odds(&mut self, in_: u64) -> bool {
        self.next().is_multiple_of(in_)
    }
}

#[tokio::test(start_paused = true)]
async fn the_held_sums_equal_the_holders_after_every_kind_of_transition() {
    let measured = |gib: u64| Measurement {
        weights: None,
        gpu_memory: Some(Measured {
            bytes: gib * GIB,
            source: MeasureSource::EngineFootprint,
        }),
    };
    for seed in 1..=24u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let t0 = Instant::now();
        let mut now = t0;
        // One host of one GPU (10 GiB), one of four GPUs (10 GiB each).
        let mut s = state(t0);
        s.add_host("box".into(), gpus_host(4, 10), &[]);
        s.insert(sized_dep("d", "chat-d", "", 3, t0));
        s.insert(sized_dep("r", "chat-r", "replicas: 2", 4, t0));
        s.insert(sized_dep("t", "chat-t", "gpus_per_instance: 2", 12, t0));
        s.insert(sized_dep(
            "w",
            "chat-w",
            "lifecycle:\n  warm: true\n",
            2,
            t0,
        ));
        let mut u = dep("u", "chat-u", "", t0);
        u.measurement = Measurement::default();
        s.insert(u);
        let deployments = ["a", "b", "c", "d", "r", "t", "w", "u"];
        let mut n = 0u32;
        for step in 0..250 {
            now += Duration::from_secs(rng.below(120) as u64);
            let units: Vec<String> = s.deps.keys().cloned().collect();
            let unit = rng.pick(&units).clone();
            let dep = rng.pick(&deployments).to_string();
            n += 1;
            let rid = format!("x-{n}");
            let what = match rng.below(12) {
                0 | 1 => {
                    // A request's (or an operator's) plan, given up or carried out.
                    let mut protected = none();
                    if rng.odds(4) {
                        protected.insert(rng.pick(&deployments).to_string());
                    }
                    let who = if rng.odds(3) {
                        PlanFor::Operator
                    } else {
                        PlanFor::Requests
                    };
                    let plan = s.plan(&dep, &protected, who, rid.clone(), &NoRequests, now);
                    if let Ok(Plan::BringUp { .. } | Plan::Switch { .. }) = plan {
                        let r = &s.reservations[&rid];
                        let target = r.target.clone().unwrap();
                        let victims = r.victims.clone();
                        if rng.odds(4) {
                            s.release_reservation(&rid);
                        } else {
                            for v in victims {
                                if s.deps[&v].bringing_up() {
                                    s.up_done(
                                        &v,
                                        Up::Start,
                                        UpDone::Ended {
                                            why: "ended".into(),
                                            stopped: Ok(()),
                                        },
                                        now,
                                    );
                                } else if s.begin_release(&v, rng.odds(3), false).is_some() {
                                    let done = match rng.below(4) {
                                        0 => DownDone::Parked {
                                            tier: ParkTier::HostRam,
                                            gpu_held: Some(rng.below(2) as u64 * GIB),
                                        },
                                        1 => DownDone::Stopped(Released::Stopped),
                                        2 => DownDone::Failed {
                                            error: "boom".into(),
                                            stopped: Ok(()),
                                        },
                                        // Its engine could not be stopped: still held.
                                        _ => DownDone::Failed {
                                            error: "boom".into(),
                                            stopped: Err("stuck".into()),
                                        },
                                    };
                                    s.down_done(&v, done, now);
                                }
                            }
                            let _ = s.switch_target_up(&rid, &target, &[], now);
                        }
                    }
                    "plan"
                }
                2..=4 => {
                    // A start or wake in progress ends.
                    let coming: Vec<String> = s
                        .deps
                        .values()
                        .filter(|d| d.bringing_up())
                        .map(|d| d.id().to_string())
                        .collect();
                    let unit = if coming.is_empty() {
                        unit
                    } else {
                        rng.pick(&coming).clone()
                    };
                    let up = if s.deps[&unit].state == InstanceState::Waking {
                        Up::Wake
                    } else {
                        Up::Start
                    };
                    if s.deps[&unit].bringing_up() {
                        let done = match rng.below(4) {
                            0 => UpDone::Failed {
                                error: held(),
                                ended: None,
                            },
                            1 if up == Up::Start => UpDone::Ready(Some(Started {
                                addr: Some(([127, 0, 0, 1], 9).into()),
                                pid: 7,
                                max_running: MaxRunning {
                                    count: Some(4),
                                    source: capyctl_interfaces::launch::MaxRunningSource::Declared,
                                },
                                // What it measured differs from what was declared.
                                measurement: measured(1 + rng.below(5) as u64),
                            })),
                            _ => UpDone::Ready(None),
                        };
                        s.up_done(&unit, up, done, now);
                    }
                    "up_done"
                }
                5 => {
                    let _ = s.start(&dep, true, false, now);
                    "start"
                }
                6 => {
                    // An operator's park or stop, or an idle timer's take-down.
                    if let Ok(Some(ready)) = s.begin_down(&unit, &rid, now) {
                        if ready {
                            s.show_draining(std::slice::from_ref(&unit), InstanceState::Closed);
                        }
                        if rng.odds(5) {
                            s.drain_refused(std::slice::from_ref(&unit), InstanceState::Closed);
                        } else if s.begin_release(&unit, rng.odds(2), rng.odds(2)).is_some() {
                            let done = if rng.odds(2) {
                                DownDone::Parked {
                                    tier: ParkTier::HostRam,
                                    gpu_held: Some(GIB / 2),
                                }
                            } else {
                                DownDone::Stopped(Released::StoppedNoRoomToPark)
                            };
                            s.down_done(&unit, done, now);
                        }
                    }
                    s.release_reservation(&rid);
                    "take down"
                }
                7 => {
                    let host = s.deps[&unit].host.clone().unwrap_or_default();
                    let exit = capyctl_interfaces::agent::EngineExit {
                        instance: unit_instance(&unit),
                        status: None,
                    };
                    s.engine_exited(&host, &exit, now);
                    "engine exit"
                }
                8 => {
                    // A host comes back with another capacity (or GPUs).
                    if rng.odds(2) {
                        let h = Host {
                            capacity: (8 + rng.below(6) as u64) * GIB,
                            ..host()
                        };
                        s.add_host("gpu-1".into(), h, &[]);
                    } else {
                        s.add_host("box".into(), gpus_host(4, 8 + rng.below(4) as u64), &[]);
                    }
                    "host back"
                }
                9 => {
                    // Deleted while it may run, and deployed again.
                    if let Some(old) = s.remove(&dep) {
                        s.insert(Dep::new(old.rec, now));
                    }
                    "delete"
                }
                10 => {
                    let _ = s.preinitialize(&dep, measured(3), now);
                    "preinitialize"
                }
                _ => {
                    if rng.odds(2) {
                        let _ = s.set_fence(now + Duration::from_secs(60), now);
                    } else {
                        s.end_fence(now);
                    }
                    "fence"
                }
            };
            s.sync_touched(now);
            held_sums_agree(&mut s, now, &format!("seed {seed} step {step} ({what})"));
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_stop_for_want_of_room_is_written_with_its_reason_in_one_rule() {
    let t0 = Instant::now();
    let mut s = state(t0);
    s.insert(dep("k", "chat-k", "residency: restart_only\n", t0));
    for id in ["a", "b", "k"] {
        ready(&mut s, id, t0);
    }
    let later = t0 + Duration::from_secs(5);
    // A model that parks, stopped for room: the release says so from its beginning, and its
    // outcome is written whole by one call (state and status together).
    let r = s.begin_release("a", true, true).unwrap();
    assert!(r.for_room);
    assert_eq!(s.deps["a"].state, InstanceState::Stopping);
    s.down_done("a", DownDone::Stopped(Released::StoppedNoRoomToPark), later);
    let a = &s.deps["a"];
    assert_eq!((a.state, a.busy), (InstanceState::Stopped, false));
    assert_eq!(
        a.last_error,
        Some(Released::StoppedNoRoomToPark.status_line())
    );
    // A parked copy stopped for room: it would have stayed parked, so it is said too.
    s.deps.get_mut("b").unwrap().state = InstanceState::Parked;
    assert!(s.begin_release("b", true, true).unwrap().for_room);
    // A model that never parks (restart_only) is only stopped: room is not why.
    assert!(!s.begin_release("k", true, true).unwrap().for_room);
    s.down_done("k", DownDone::Stopped(Released::Stopped), later);
    assert_eq!(s.deps["k"].last_error, None);
    // An operator's stop is not for room.
    s.deps.get_mut("b").unwrap().busy = false;
    assert!(!s.begin_release("b", true, false).unwrap().for_room);
}

/// A record of requests given to the rules (the router's, in the server).
#[derive(Default)]
struct Record {
    last: HashMap<String, Instant>,
    running: HashMap<(String, u32), usize>,
}

impl Requests for Record {
    fn last_use(&self, dep: &str) -> Option<Instant> {
        self.last.get(dep).copied()
    }

    fn in_flight(&self, dep: &str, index: u32) -> usize {
        self.running
            .get(&(dep.to_string(), index))
            .copied()
            .unwrap_or(0)
    }
}

#[tokio::test(start_paused = true)]
async fn the_rules_read_the_record_of_requests_they_are_given() {
    let t0 = Instant::now();
    let now = t0 + Duration::from_secs(600);
    let timeouts = LifecycleDefaults {
        ready_idle_timeout: Some(Duration::from_secs(300)),
        ..LifecycleDefaults::default()
    };
    let mut s = state(t0);
    // `a` and `b` ready, last changed at t0 and a second later: by their state alone both
    // are due, and `a` is the longer idle.
    ready(&mut s, "a", t0);
    ready(&mut s, "b", t0 + Duration::from_secs(1));
    let none_recorded = s.idle_due(&timeouts, &none(), &NoRequests, now);
    assert_eq!(none_recorded, [("a".into(), true), ("b".into(), true)]);
    // The record says `b` was used 10 s ago: its timer is not due, now or when decided again.
    let mut record = Record::default();
    record
        .last
        .insert("b".into(), now - Duration::from_secs(10));
    assert_eq!(
        s.idle_due(&timeouts, &none(), &record, now),
        [("a".into(), true)]
    );
    assert_eq!(
        s.begin_idle_down("b", true, &timeouts, "idle-1", &record, now),
        None,
        "decided again on the record given"
    );
    // The record says `a` was used 10 s ago: a plan for `c` names `b` first, the longer idle
    // by the record; with no record, `a`.
    let mut record = Record::default();
    record
        .last
        .insert("a".into(), now - Duration::from_secs(10));
    let plan = s
        .plan("c", &none(), PlanFor::Requests, "sw-1".into(), &record, now)
        .unwrap();
    assert!(matches!(plan, Plan::Switch { .. }), "{plan:?}");
    assert_eq!(
        s.reservations["sw-1"].victims[0], "b",
        "the longest idle by the record"
    );
    s.release_reservation("sw-1");
    let plan = s.request_plan("c", "sw-2".into(), now).unwrap();
    assert!(matches!(plan, Plan::Switch { .. }), "{plan:?}");
    assert_eq!(s.reservations["sw-2"].victims[0], "a", "by the state alone");
}

/// DESIGN 4.10: a deployment is never parked or stopped for one of lower priority; among the
/// victims that may go, lower priorities go first (then the page's order); a request only
/// higher priorities keep out is refused at once (`does_not_fit` naming the priority), not
/// left waiting; a start that names no victims still waits; idle timers work as before.
#[tokio::test(start_paused = true)]
async fn priorities_choose_the_victims_and_protect_the_room() {
    let t0 = Instant::now();
    let now = t0 + Duration::from_secs(60);
    let mut s = state(t0);
    let victims = |plan: Plan| match plan {
        Plan::Switch { victims, .. } => victims
            .into_iter()
            .map(|k| k.deployment)
            .collect::<Vec<_>>(),
        other => panic!("a switch: {other:?}"),
    };
    // `p` (priority 100, idle the longest) and `q` (priority 0) hold 6 of 10 GiB: `b` needs
    // 6, so one must go. The page's order would take `p`; its priority keeps it.
    s.insert(sized_dep("p", "chat-p", "priority: 100\n", 3, t0));
    s.insert(sized_dep("q", "chat-q", "", 3, t0));
    ready(&mut s, "p", t0);
    ready(&mut s, "q", t0 + Duration::from_secs(30));
    let plan = s.request_plan("b", "sw-1".into(), now).unwrap();
    assert_eq!(
        victims(plan),
        ["q"],
        "the lower priority, though p is older"
    );
    s.release_reservation("sw-1");
    // With `q` protected (requests wait for it), `p` still never goes for `b`; `q` may free
    // its memory later, so `b` waits.
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
    assert!(matches!(plan, Plan::Later), "{plan:?}");
    // A deployment of priority 100 (equal) may take `p`'s room, the lower `q` still first.
    s.deps.get_mut("b").unwrap().rec.doc = dep("b", "chat-b", "priority: 100\n", t0).rec.doc;
    let plan = s.request_plan("b", "sw-3".into(), now).unwrap();
    assert_eq!(victims(plan), ["q"]);
    s.release_reservation("sw-3");
    let plan = s
        .plan(
            "b",
            &protected,
            PlanFor::Requests,
            "sw-3b".into(),
            &NoRequests,
            now,
        )
        .unwrap();
    assert_eq!(victims(plan), ["p"], "equal priorities: p may go");
    s.release_reservation("sw-3b");

    // Only a higher priority holds the room: refused at once, naming it.
    let mut s = state(t0);
    s.insert(dep("prod", "chat-prod", "priority: 100\n", t0));
    ready(&mut s, "prod", t0);
    let err = s.request_plan("b", "sw-4".into(), now).unwrap_err();
    assert_eq!(err.code(), "does_not_fit", "{err:?}");
    assert_eq!(err.status(), 409);
    assert_eq!(
        err.message(),
        "deployment b does not fit on any GPU: it needs 6.0 GiB, and 6.0 GiB of the GPU's 10.0 GiB is held by deployments of a higher priority, which are never parked or stopped for a lower one (chat-prod: priority 100)"
    );
    assert!(s.reservations.is_empty() && s.deps["prod"].reserved.is_none());
    // A negative priority is below the default.
    s.deps.get_mut("prod").unwrap().rec.doc = dep("prod", "chat-prod", "", t0).rec.doc;
    s.deps.get_mut("b").unwrap().rec.doc = dep("b", "chat-b", "priority: -1\n", t0).rec.doc;
    let err = s.request_plan("b", "sw-6".into(), now).unwrap_err();
    assert!(err.to_string().contains("chat-prod: priority 0"), "{err}");
    // The higher priority takes the room of the lower one.
    s.deps.get_mut("b").unwrap().rec.doc = dep("b", "chat-b", "priority: 1\n", t0).rec.doc;
    let plan = s.request_plan("b", "sw-7".into(), now).unwrap();
    assert_eq!(victims(plan), ["prod"]);
    s.release_reservation("sw-7");

    // An operator's start without --evict names no victims: it waits for memory as before.
    s.deps.get_mut("prod").unwrap().rec.doc =
        dep("prod", "chat-prod", "priority: 100\n", t0).rec.doc;
    s.deps.get_mut("b").unwrap().rec.doc = dep("b", "chat-b", "", t0).rec.doc;
    assert!(matches!(
        s.start("b", false, false, now),
        Ok(StartNext::Pending)
    ));
    // The idle timer still parks `prod` when it is due.
    let timeouts = LifecycleDefaults {
        ready_idle_timeout: Some(Duration::from_secs(300)),
        parked_idle_timeout: None,
    };
    assert_eq!(
        s.idle_due(
            &timeouts,
            &none(),
            &NoRequests,
            t0 + Duration::from_secs(301)
        ),
        [("prod".to_string(), true)]
    );
}
