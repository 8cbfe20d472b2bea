//! One test per rule of "How requests wait and models switch", under the paused clock.
//!
//! Unless a test says otherwise: window 2 s, drain 30 s; the fake GPU fits one deployment,
//! parks in 1 s, wakes in 3 s; chat-a is ready from 0 s, chat-b and chat-c are parked.
#![allow(clippy::unwrap_used)]

mod coordinator_support;

use capyctl_interfaces::router::{DrainReport, Plan};
use capyctl_router::config::RouterConfig;
use capyctl_router::coordinator::testing::{ExecuteFault, FakeState, FakeTimings};
use capyctl_spec::errors::{ApiError, WakeFailure};
use coordinator_support::*;

// ----- rule 1: waiting, waves, hang-ups -----

#[tokio::test(start_paused = true)]
async fn rule_one_switch_per_wave() {
    let r = rig().await;
    let mut first: Vec<Req> = (0..3).map(|_| r.send(&r.b, hold(1.0))).collect();
    r.until(0.5).await;
    let mut later: Vec<Req> = (0..2).map(|_| r.send(&r.b, hold(1.0))).collect();
    r.until(5.999).await;
    assert!(
        first
            .iter_mut()
            .chain(later.iter_mut())
            .all(|q| q.waiting())
    );
    r.until(6.0).await;
    // Window to 2 s (chat-a opened at 0 s), park 1 s, wake 3 s: all five at 6 s together.
    for q in first.iter_mut().chain(later.iter_mut()) {
        assert_eq!(q.admitted_at(), secs(6.0));
    }
    assert_eq!(r.fake.plans().len(), 1);
    assert_eq!(r.fake.executes().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn rule_admissible_refusal_answers_at_once() {
    let r = rig().await;
    let stopped = ApiError::DeploymentStopped {
        deployment: B.into(),
    };
    r.fake.set_refusal(B, Some(stopped.clone()));
    let mut q = r.send(&r.b, hold(1.0));
    r.until(0.0).await;
    assert_eq!(q.refused(), (secs(0.0), stopped));
    assert!(r.fake.plans().is_empty(), "nothing started");
    let load = r.h.load().await;
    assert_eq!(
        load.iter().find(|l| l.deployment_id == B).unwrap().waiting,
        0
    );
}

#[tokio::test(start_paused = true)]
async fn rule_hang_up_gives_up_own_place_only() {
    let r = rig().await;
    let mut qs: Vec<Req> = (0..3).map(|_| r.send(&r.b, hold(1.0))).collect();
    r.until(1.0).await;
    qs[1].end();
    r.until(1.001).await;
    let load = r.h.load().await;
    assert_eq!(
        load.iter().find(|l| l.deployment_id == B).unwrap().waiting,
        2
    );
    r.until(6.0).await;
    assert_eq!(qs[0].admitted_at(), secs(6.0));
    assert_eq!(qs[2].admitted_at(), secs(6.0));
    assert_eq!(r.fake.executes().len(), 1, "the switch goes on");
    assert!(r.fake.abandons().is_empty());
}

#[tokio::test(start_paused = true)]
async fn rule_switch_goes_on_when_every_waiter_hangs_up() {
    let r = rig().await;
    let qs: Vec<Req> = (0..2).map(|_| r.send(&r.b, hold(1.0))).collect();
    r.until(0.5).await;
    qs.iter().for_each(Req::end);
    r.until(6.0).await;
    let ex = r.fake.executes();
    assert_eq!(ex.len(), 1);
    assert_eq!(r.since(ex[0].0), secs(2.0));
    assert_eq!(r.fake.state(B), Some(FakeState::Ready));
}

// ----- rule 2: the plan and the admission window -----

#[tokio::test(start_paused = true)]
async fn rule_window_counted_from_switch_begin() {
    let r = rig().await;
    // Busy until 2.5 s, so the window would not close early before 4.5 s.
    let _a0 = r.send(&r.a, hold(2.5));
    r.until(3.0).await;
    let _b = r.send(&r.b, hold(1.0));
    r.until(3.5).await;
    let mut a1 = r.send(&r.a, hold(0.2));
    r.until(4.9).await;
    let mut a2 = r.send(&r.a, hold(0.05));
    r.until(4.999).await;
    assert_eq!(a1.admitted_at(), secs(3.5));
    assert_eq!(a2.admitted_at(), secs(4.9));
    r.until(5.001).await;
    let mut a3 = r.send(&r.a, hold(0.05));
    r.until(5.002).await;
    // chat-a's traffic at 3.5 and 4.9 s did not extend the window: it closed at 5 s exactly,
    // with nothing running, so the execute (parking) began at 5 s and chat-a's next request
    // waits.
    assert!(a3.waiting());
    let ex = r.fake.executes();
    assert_eq!(ex.len(), 1);
    assert_eq!(r.since(ex[0].0), secs(5.0));
}

#[tokio::test(start_paused = true)]
async fn rule_the_order_carries_the_window_and_the_drain() {
    let r = rig().await;
    // chat-a busy until 4 s; chat-b asked for at 1 s: the window runs 1–3 s, the drain 3–4 s.
    let _a = r.send(&r.a, hold(4.0));
    r.until(1.0).await;
    let _b = r.send(&r.b, hold(1.0));
    r.until(4.5).await;
    let ex = r.fake.executes();
    assert_eq!(ex.len(), 1);
    assert_eq!(r.since(ex[0].0), secs(4.0));
    assert_eq!((ex[0].1.window, ex[0].1.drain), (secs(2.0), secs(1.0)));
}

#[tokio::test(start_paused = true)]
async fn rule_window_closes_early_when_victim_idle() {
    let r = rig().await;
    r.until(5.0).await;
    let mut b = r.send(&r.b, hold(1.0));
    r.until(5.0).await;
    let ex = r.fake.executes();
    assert_eq!(ex.len(), 1);
    assert_eq!(r.since(ex[0].0), secs(5.0), "an idle model yields at once");
    r.until(9.0).await;
    assert_eq!(b.admitted_at(), secs(9.0));
}

#[tokio::test(start_paused = true)]
async fn rule_window_early_close_after_one_idle_window() {
    let r = rig().await;
    let _a = r.send(&r.a, hold(4.5));
    r.until(5.0).await;
    let _b = r.send(&r.b, hold(1.0));
    r.until(7.0).await;
    let ex = r.fake.executes();
    // Last activity 4.5 s: one window length of silence ends at 6.5 s, before 5 + 2 = 7 s.
    assert_eq!(r.since(ex[0].0), secs(6.5));
}

#[tokio::test(start_paused = true)]
async fn rule_no_window_with_another_ready_instance() {
    let r = rig_with(RouterConfig::default(), FakeTimings::default(), 2).await;
    let a0 = r.fake.key(A, 0);
    let mut running = r.send(&r.a, hold(1.0));
    r.until(0.0).await;
    assert_eq!(running.answered().1.unwrap().key, a0);
    r.fake.script_plan(
        B,
        Ok(Plan::Switch {
            switch_id: "sw-x".into(),
            victims: vec![a0.clone()],
            window: None,
        }),
    );
    r.until(0.5).await;
    let _b = r.send(&r.b, hold(1.0));
    r.until(0.6).await;
    // chat-a's other instance takes its requests; the victim closed at once.
    let mut more = r.send(&r.a, hold(0.1));
    r.until(0.7).await;
    assert_eq!(more.answered().1.unwrap().key, r.fake.key(A, 1));
    r.until(1.0).await;
    let ex = r.fake.executes();
    assert_eq!(ex.len(), 1);
    assert_eq!(r.since(ex[0].0), secs(1.0), "drained at 1 s, no 2 s window");
    assert_eq!(ex[0].1.victims, vec![(a0, DrainReport::default())]);
}

#[tokio::test(start_paused = true)]
async fn rule_bring_up_executes_at_once() {
    let timings = FakeTimings {
        capacity: 2,
        ..FakeTimings::default()
    };
    let r = rig_with(RouterConfig::default(), timings, 1).await;
    let mut b = r.send(&r.b, hold(1.0));
    r.until(1.0).await;
    let mut a = r.send(&r.a, hold(1.0));
    r.until(3.0).await;
    let ex = r.fake.executes();
    assert_eq!(r.since(ex[0].0), secs(0.0));
    assert!(ex[0].1.victims.is_empty());
    assert_eq!(a.admitted_at(), secs(1.0), "nothing closes chat-a");
    assert_eq!(b.admitted_at(), secs(3.0), "wake only, no park");
}

#[tokio::test(start_paused = true)]
async fn rule_a_bring_up_does_not_hold_up_the_next_switch() {
    // Room for three: chat-b's wake (3 s) and chat-c's, asked for 1 s later, run side by side;
    // chat-c's is not planned only once chat-b's is over.
    let timings = FakeTimings {
        capacity: 3,
        ..FakeTimings::default()
    };
    let r = rig_with(RouterConfig::default(), timings, 1).await;
    let mut b = r.send(&r.b, hold(1.0));
    r.until(1.0).await;
    let mut c = r.send(&r.c, hold(1.0));
    r.until(5.0).await;
    let plans = r.fake.plans();
    assert_eq!(plans.len(), 2);
    assert_eq!((r.since(plans[1].0), plans[1].1.as_str()), (secs(1.0), C));
    let ex = r.fake.executes();
    assert_eq!(r.since(ex[1].0), secs(1.0));
    assert!(ex.iter().all(|(_, o)| o.victims.is_empty()));
    assert_eq!(b.admitted_at(), secs(3.0));
    assert_eq!(c.admitted_at(), secs(4.0));
}

#[tokio::test(start_paused = true)]
async fn rule_a_switch_that_needs_what_another_holds_waits_until_it_ends() {
    // chat-b's switch parks chat-a (window to 2 s). chat-c, asked for meanwhile, is planned
    // at once (switches on other GPUs would run beside it), but the one GPU is held by chat-b's
    // switch: `Later`, until chat-b's switch is over; its switch with victims begins then.
    let r = rig().await;
    let _a = r.send(&r.a, hold(1.5));
    let mut b = r.send(&r.b, hold(10.0));
    r.until(0.5).await;
    let mut c = r.send(&r.c, hold(1.0));
    r.until(6.5).await;
    let later = r.fake.later_plans();
    assert!(!later.is_empty());
    assert!(later.iter().all(|(t, d)| d == C && r.since(*t) < secs(6.0)));
    assert_eq!(
        r.since(later[0].0),
        secs(0.5),
        "planned beside chat-b's switch"
    );
    let plans = r.fake.plans_not_later();
    assert_eq!(plans.len(), 2);
    assert_eq!((r.since(plans[1].0), plans[1].1.as_str()), (secs(6.0), C));
    assert_eq!(
        r.fake.executes().len(),
        1,
        "chat-c's execute waits for its window"
    );
    assert_eq!(b.admitted_at(), secs(6.0));
    assert!(c.waiting());
}

#[tokio::test(start_paused = true)]
async fn rule_the_host_window_from_the_plan_applies() {
    let r = rig().await;
    r.fake.set_plan_window(Some(secs(5.0)));
    // chat-a busy until 4.5 s: with the router's 2 s window it would close at 2 s and drain
    // until 4.5 s; the host's 5 s window keeps chat-a open until 5 s.
    let _a = r.send(&r.a, hold(4.5));
    let _b = r.send(&r.b, hold(1.0));
    r.until(4.9).await;
    let mut late = r.send(&r.a, hold(0.05));
    r.until(6.0).await;
    assert_eq!(late.admitted_at(), secs(4.9), "still in the host's window");
    let ex = r.fake.executes();
    assert_eq!(ex.len(), 1);
    assert_eq!(r.since(ex[0].0), secs(5.0));
    assert_eq!(ex[0].1.window, secs(5.0));
}

// ----- a lifecycle that fails to answer -----

#[tokio::test(start_paused = true)]
async fn rule_a_hung_plan_is_given_up_at_the_drain_bound() {
    let r = rig_with(
        RouterConfig {
            drain_timeout: secs(10.0),
            ..RouterConfig::default()
        },
        FakeTimings::default(),
        1,
    )
    .await;
    r.fake.hang_plans();
    let mut b = r.send(&r.b, hold(1.0));
    r.until(10.0).await;
    let (at, e) = b.refused();
    assert_eq!(at, secs(10.0));
    assert_eq!(e.status(), 500);
    assert!(e.message().contains("plan"), "{e}");
    // The switch slot is free again: chat-c is planned at once.
    let _c = r.send(&r.c, hold(1.0));
    r.until(10.5).await;
    let plans = r.fake.plans();
    assert_eq!(plans.len(), 2);
    assert_eq!((r.since(plans[1].0), plans[1].1.as_str()), (secs(10.0), C));
}

#[tokio::test(start_paused = true)]
async fn rule_a_hung_execute_is_given_up_at_its_bound() {
    let r = rig_with(
        RouterConfig {
            execute_timeout: secs(60.0),
            ..RouterConfig::default()
        },
        FakeTimings::default(),
        1,
    )
    .await;
    r.fake.fault_execute(ExecuteFault::Hang);
    // Window 0–2 s (chat-a opened at 0 s), nothing to drain: the execute begins at 2 s.
    let mut b = r.send(&r.b, hold(1.0));
    r.until(61.9).await;
    assert!(b.waiting());
    r.until(62.0).await;
    let (at, e) = b.refused();
    assert_eq!(at, secs(62.0));
    assert_eq!(e.status(), 500);
    assert!(e.message().contains("execute"), "{e}");
    // Switching goes on: chat-c's request is planned at once.
    let _c = r.send(&r.c, hold(1.0));
    r.until(62.5).await;
    let plans = r.fake.plans();
    assert_eq!(plans.len(), 2);
    assert_eq!(r.since(plans[1].0), secs(62.0));
}

#[tokio::test(start_paused = true)]
async fn rule_a_panicking_execute_answers_the_wave_at_once() {
    let r = rig().await;
    r.fake.fault_execute(ExecuteFault::Panic);
    // Window 0–2 s, nothing to drain: the execute begins, and panics, at 2 s.
    let mut b = r.send(&r.b, hold(1.0));
    r.until(2.5).await;
    let (at, e) = b.refused();
    assert_eq!(at, secs(2.0));
    assert_eq!(e.status(), 500);
    let _c = r.send(&r.c, hold(1.0));
    r.until(3.0).await;
    assert_eq!(r.fake.plans().len(), 2, "switching goes on");
}

#[tokio::test(start_paused = true)]
async fn rule_later_plans_again_when_something_changes() {
    let r = rig().await;
    r.fake.script_plan(B, Ok(Plan::Later));
    let _a = r.send(&r.a, hold(3.0));
    let mut b = r.send(&r.b, hold(1.0));
    r.until(2.9).await;
    assert_eq!(
        r.fake.plans().len(),
        1,
        "no new plan until something changes"
    );
    // chat-a's request finishes at 3 s: plan again. Window to 5 s (last activity 3 s).
    r.until(9.0).await;
    let plans = r.fake.plans();
    assert_eq!(plans.len(), 2);
    assert_eq!(r.since(plans[0].0), secs(0.0));
    assert_eq!(r.since(plans[1].0), secs(3.0));
    assert_eq!(r.since(r.fake.executes()[0].0), secs(5.0));
    assert_eq!(b.admitted_at(), secs(9.0));
}

// ----- rule 3: the drain -----

#[tokio::test(start_paused = true)]
async fn rule_drain_answers_dispatch_closed() {
    let r = rig().await;
    let _a = r.send(&r.a, hold(10.0));
    let _b = r.send(&r.b, hold(1.0));
    r.until(2.5).await;
    let mut a = r.send(&r.a, hold(1.0));
    r.until(2.5).await;
    let (at, e) = a.refused();
    assert_eq!(at, secs(2.5));
    assert_eq!(e.status(), 503);
    assert_eq!(
        e.message(),
        format!("dispatch to deployment {A} is closed; retry shortly")
    );
}

#[tokio::test(start_paused = true)]
async fn rule_window_close_answers_slot_waiters_dispatch_closed() {
    let r = rig().await;
    let _b = r.send(&r.b, hold(1.0));
    r.until(1.0).await;
    let _running: Vec<Req> = (0..32).map(|_| r.send(&r.a, Hold::Forever)).collect();
    let mut waiter = r.send(&r.a, hold(1.0));
    r.until(1.5).await;
    assert!(
        waiter.waiting(),
        "waits for one of the 32 during the window"
    );
    r.until(2.0).await;
    let (at, e) = waiter.refused();
    assert_eq!(at, secs(2.0));
    assert_eq!(
        e,
        ApiError::DispatchClosed {
            deployment: A.into()
        }
    );
}

#[tokio::test(start_paused = true)]
async fn rule_drain_timeout_victims_serve_again() {
    let r = rig().await;
    let _a = r.send(&r.a, hold(100.0));
    let mut bs: Vec<Req> = (0..2).map(|_| r.send(&r.b, hold(1.0))).collect();
    r.until(31.999).await;
    assert!(bs.iter_mut().all(|q| q.waiting()));
    r.until(32.0).await;
    for q in bs.iter_mut() {
        let (at, e) = q.refused();
        assert_eq!(at, secs(32.0), "window 2 s + drain 30 s");
        assert_eq!(
            e,
            ApiError::DrainTimeout {
                deployment: B.into(),
                drain_ms: 30000,
                charged: 1
            }
        );
        assert_eq!(
            e.message(),
            format!(
                "switch to {B} failed: drain timeout after 30000 ms with 1 request(s) still charged; the victims serve again; retry shortly"
            )
        );
        assert!(e.retryable());
    }
    let abandons = r.fake.abandons();
    assert_eq!(abandons.len(), 1);
    assert_eq!(r.since(abandons[0].0), secs(32.0));
    // The failure is told with its phases: window 2 s, drain 30 s.
    let failed = r.fake.failed_switches();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].1.code(), "unavailable");
    assert_eq!((failed[0].2, failed[0].3), (secs(2.0), secs(30.0)));
    assert!(r.fake.executes().is_empty());
    // The victim serves again.
    r.until(33.0).await;
    let mut a = r.send(&r.a, hold(1.0));
    r.until(33.0).await;
    assert_eq!(a.admitted_at(), secs(33.0));
}

#[tokio::test(start_paused = true)]
async fn rule_cut_after_output_waits_for_engine_idle() {
    let r = rig().await;
    let _a = r.send(
        &r.a,
        Hold::Cut {
            after: secs(1.0),
            output: true,
        },
    );
    let _b = r.send(&r.b, hold(1.0));
    r.until(3.0).await;
    let idles = r.fake.engine_idles();
    assert_eq!(idles.len(), 1);
    assert_eq!(r.since(idles[0].0), secs(2.0), "asked once drained");
    let ex = r.fake.executes();
    assert_eq!(r.since(ex[0].0), secs(2.5), "after the engine said idle");
    assert_eq!(
        ex[0].1.victims,
        vec![(r.fake.key(A, 0), DrainReport::default())]
    );
}

#[tokio::test(start_paused = true)]
async fn rule_cut_before_output_reports_stop() {
    let r = rig().await;
    let _a = r.send(
        &r.a,
        Hold::Cut {
            after: secs(1.0),
            output: false,
        },
    );
    let _b = r.send(&r.b, hold(1.0));
    r.until(3.0).await;
    assert!(r.fake.engine_idles().is_empty(), "a stop settles it");
    let ex = r.fake.executes();
    assert_eq!(r.since(ex[0].0), secs(2.0));
    assert_eq!(
        ex[0].1.victims,
        vec![(
            r.fake.key(A, 0),
            DrainReport {
                cut_before_output: true
            }
        )]
    );
}

#[tokio::test(start_paused = true)]
async fn rule_engine_idle_unreadable_counts_as_cut_before_output() {
    let r = rig().await;
    r.fake.set_engine_idle(false);
    let _a = r.send(
        &r.a,
        Hold::Cut {
            after: secs(1.0),
            output: true,
        },
    );
    let _b = r.send(&r.b, hold(1.0));
    r.until(3.0).await;
    let ex = r.fake.executes();
    assert_eq!(r.since(ex[0].0), secs(2.5));
    assert!(ex[0].1.victims[0].1.cut_before_output);
}

// ----- rule 4: execute -----

#[tokio::test(start_paused = true)]
async fn rule_requests_wait_once_parking_began() {
    let r = rig().await;
    let _a = r.send(&r.a, hold(3.0));
    let _b = r.send(&r.b, hold(1.0));
    r.until(2.5).await;
    let mut closed = r.send(&r.a, hold(1.0));
    r.until(3.5).await;
    assert!(matches!(
        closed.refused().1,
        ApiError::DispatchClosed { .. }
    ));
    assert_eq!(r.since(r.fake.executes()[0].0), secs(3.0));
    let mut waits = r.send(&r.a, hold(1.0));
    r.until(12.999).await;
    assert!(waits.waiting());
    // chat-b ready at 7 s; its request runs to 8 s; window to 9 s; park 1 s + wake 3 s.
    r.until(13.0).await;
    assert_eq!(waits.admitted_at(), secs(13.0));
    let plans = r.fake.plans();
    assert_eq!(plans[1].1, A, "the waiting request became the next switch");
    assert_eq!(r.since(plans[1].0), secs(7.0));
}

#[tokio::test(start_paused = true)]
async fn rule_execute_error_fails_the_wave() {
    let r = rig().await;
    let e = ApiError::WakeFailed {
        deployment: B.into(),
        failure: WakeFailure::Mismatch,
    };
    r.fake.fail_execute(B, e.clone());
    let mut bs: Vec<Req> = (0..2).map(|_| r.send(&r.b, hold(1.0))).collect();
    r.until(6.0).await;
    for q in bs.iter_mut() {
        assert_eq!(q.refused(), (secs(6.0), e.clone()));
    }
}

// ----- rule 5: release together, up to 32 -----

#[tokio::test(start_paused = true)]
async fn rule_wave_released_together_up_to_32() {
    let r = rig().await;
    let mut bs: Vec<Req> = (0..40).map(|_| r.send(&r.b, hold(10.0))).collect();
    r.until(6.0).await;
    let (running, rest) = bs.split_at_mut(32);
    assert!(running.iter_mut().all(|q| q.admitted_at() == secs(6.0)));
    assert!(rest.iter_mut().all(|q| q.waiting()));
    let load = r.h.load().await;
    let lb = load.iter().find(|l| l.deployment_id == B).unwrap();
    assert_eq!((lb.in_flight, lb.in_flight_limit, lb.waiting), (32, 32, 8));
    r.until(16.0).await;
    assert!(rest.iter_mut().all(|q| q.admitted_at() == secs(16.0)));
}

#[tokio::test(start_paused = true)]
async fn rule_finished_slot_goes_to_oldest_waiter() {
    let r = rig().await;
    let running: Vec<Req> = (0..32).map(|_| r.send(&r.a, Hold::Forever)).collect();
    r.until(1.0).await;
    let mut w1 = r.send(&r.a, hold(100.0));
    r.until(2.0).await;
    let mut w2 = r.send(&r.a, hold(100.0));
    r.until(3.0).await;
    let mut w3 = r.send(&r.a, hold(100.0));
    r.until(4.0).await;
    running[5].end();
    r.until(4.0).await;
    assert_eq!(w1.admitted_at(), secs(4.0));
    assert!(w2.waiting() && w3.waiting());
    r.until(5.0).await;
    running[9].end();
    r.until(5.0).await;
    assert_eq!(w2.admitted_at(), secs(5.0));
    assert!(w3.waiting());
}

// ----- rule 6: several waiting, protection, residency -----

#[tokio::test(start_paused = true)]
async fn rule_longest_waiting_goes_next() {
    let r = rig().await;
    let _b = r.send(&r.b, hold(1.0));
    // chat-a parks from 2 s; chat-c is asked at 3 s, chat-a at 4 s.
    r.until(3.0).await;
    let mut c = r.send(&r.c, hold(1.0));
    r.until(4.0).await;
    let mut a = r.send(&r.a, hold(1.0));
    r.until(6.0).await;
    // NB: chat-c is also planned while chat-b's switch executes (switches run at once where
    // they can); the one GPU is held by that switch, so those plans answer `Later`.
    let plans = r.fake.plans_not_later();
    assert_eq!(plans.len(), 2);
    assert_eq!(r.since(plans[1].0), secs(6.0));
    assert_eq!(plans[1].1, C, "chat-c waited longer than chat-a");
    assert_eq!(plans[1].2, [A.to_string(), C.to_string()].into());
    // chat-b runs its request to 7 s, window to 8 s, then chat-c: ready at 12 s; then chat-a.
    r.until(12.0).await;
    assert_eq!(c.admitted_at(), secs(12.0));
    let plans = r.fake.plans_not_later();
    assert_eq!(plans[2].1, A);
    assert_eq!(r.since(plans[2].0), secs(12.0));
    r.until(18.0).await;
    assert_eq!(a.admitted_at(), secs(18.0));
}

#[tokio::test(start_paused = true)]
async fn rule_waiting_deployment_is_never_a_victim() {
    let timings = FakeTimings {
        capacity: 2,
        ..FakeTimings::default()
    };
    let r = rig_with(RouterConfig::default(), timings, 1).await;
    r.fake.set_state(C, FakeState::Ready);
    r.fake.announce(C).await;
    // chat-a: 32 running and one waiting for a slot; chat-c idle.
    let _running: Vec<Req> = (0..32).map(|_| r.send(&r.a, Hold::Forever)).collect();
    let _waiting = r.send(&r.a, hold(1.0));
    r.until(1.0).await;
    let _b = r.send(&r.b, hold(1.0));
    r.until(2.0).await;
    let plans = r.fake.plans();
    assert_eq!(plans[0].2, [A.to_string(), B.to_string()].into());
    let ex = r.fake.executes();
    // chat-c idle since 0 s: its window closes at 2 s.
    assert_eq!(r.since(ex[0].0), secs(2.0));
    assert_eq!(
        ex[0].1.victims[0].0,
        r.fake.key(C, 0),
        "chat-a is protected"
    );
}

#[tokio::test(start_paused = true)]
async fn rule_plan_naming_a_protected_victim_is_given_back() {
    let r = rig().await;
    let _running: Vec<Req> = (0..32).map(|_| r.send(&r.a, Hold::Forever)).collect();
    let _waiting = r.send(&r.a, hold(1.0));
    r.until(0.5).await;
    r.fake.script_plan(
        B,
        Ok(Plan::Switch {
            switch_id: "sw-bad".into(),
            victims: vec![r.fake.key(A, 0)],
            window: None,
        }),
    );
    let _b = r.send(&r.b, hold(1.0));
    r.until(1.0).await;
    let abandons = r.fake.abandons();
    assert_eq!(abandons[0].1, "sw-bad");
    assert_eq!(r.since(abandons[0].0), secs(0.5));
    // Planned again at once; the fake then finds no victim (chat-a is protected): `Later`.
    let plans = r.fake.plans();
    assert_eq!(plans.len(), 2);
    assert_eq!(r.since(plans[1].0), secs(0.5));
    assert!(r.fake.executes().is_empty());
}

#[tokio::test(start_paused = true)]
async fn rule_no_minimum_residency() {
    let r = rig().await;
    let _a = r.send(&r.a, hold(0.1));
    r.until(1.0).await;
    let mut b1 = r.send(&r.b, hold(0.1));
    // chat-a idle since 0.1 s: window closes at 2.1 s; park + wake: chat-b at 6.1 s.
    r.until(7.0).await;
    assert_eq!(b1.admitted_at(), secs(6.1));
    let mut a2 = r.send(&r.a, hold(0.1));
    // chat-b idle since 6.2 s: window closes at 8.2 s: chat-a at 12.2 s.
    r.until(13.0).await;
    assert_eq!(a2.admitted_at(), secs(12.2));
    let mut b3 = r.send(&r.b, hold(0.1));
    r.until(20.0).await;
    assert_eq!(b3.admitted_at(), secs(18.3));
    let targets: Vec<String> = r
        .fake
        .executes()
        .into_iter()
        .map(|(_, o)| o.target)
        .collect();
    assert_eq!(targets, [B, A, B]);
}
