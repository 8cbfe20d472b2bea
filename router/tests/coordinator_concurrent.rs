//! Switches at the same time (`router/DESIGN.md`, "Several switches at once"; contract 4.7):
//! switches on different GPUs or hosts run side by side, one that needs what another holds
//! waits (`Later`) and plans again when one ends, and a victim whose deployment keeps another
//! open instance has no admission window.
//!
//! Unless a test says otherwise: window 2 s, drain 30 s; park 1 s, wake 3 s; chat-a is ready
//! from 0 s, chat-b and chat-c are parked.
#![allow(clippy::unwrap_used)]

mod coordinator_support;

use capyctl_interfaces::router::{DeploymentRef, Plan};
use capyctl_router::config::RouterConfig;
use capyctl_router::coordinator::testing::{FakeState, FakeTimings};
use capyctl_spec::errors::ApiError;
use coordinator_support::*;

/// `chat-d`'s ID.
const D: &str = "01KDDDDDDDDDDDDDDDDDDDDDDD";
/// `chat-e`'s ID.
const E: &str = "01KEEEEEEEEEEEEEEEEEEEEEEE";
/// `chat-f`'s ID.
const F: &str = "01KFFFFFFFFFFFFFFFFFFFFFFF";

/// Two GPUs (room for two deployments): chat-a and chat-d ready on them, chat-b, chat-c and
/// chat-e parked. The fake's natural plans name disjoint victims (a plan never names one
/// another plan reserved): chat-b's switch takes chat-a, chat-c's takes chat-d.
async fn two_gpus() -> (Rig, DeploymentRef, DeploymentRef) {
    let timings = FakeTimings {
        capacity: 2,
        ..FakeTimings::default()
    };
    let r = rig_with(RouterConfig::default(), timings, 1).await;
    let d = r.fake.add(D, "chat-d", FakeState::Ready, 1);
    let e = r.fake.add(E, "chat-e", FakeState::Parked, 1);
    r.fake.announce(D).await;
    quiesce().await;
    (r, d, e)
}

/// At 0 s: chat-a runs a request for 1.5 s and chat-d one for `d_runs` seconds; a request
/// for chat-b and one for chat-c (1 s each) begin their switches. Those two and the running
/// ones (which must stay alive).
fn two_waves(r: &Rig, d: &DeploymentRef, d_runs: f64) -> (Req, Req, [Req; 2]) {
    let running = [r.send(&r.a, hold(1.5)), r.send(d, hold(d_runs))];
    (r.send(&r.b, hold(1.0)), r.send(&r.c, hold(1.0)), running)
}

#[tokio::test(start_paused = true)]
async fn two_switches_on_different_gpus_run_at_once() {
    let (r, d, _) = two_gpus().await;
    // chat-a and chat-d each run a request until 1.5 s: both windows close at 2 s.
    let (mut b, mut c, _running) = two_waves(&r, &d, 1.5);
    r.until(2.0).await;
    let plans = r.fake.plans_not_later();
    assert_eq!(plans.len(), 2);
    assert!(plans.iter().all(|(t, _, _)| r.since(*t) == secs(0.0)));
    let ex = r.fake.executes();
    assert_eq!(ex.len(), 2, "both drained and executing at 2 s");
    let mut victims: Vec<(String, String)> = ex
        .iter()
        .map(|(t, o)| {
            assert_eq!(r.since(*t), secs(2.0));
            assert_eq!((o.window, o.drain), (secs(2.0), secs(0.0)));
            (o.target.clone(), o.victims[0].0.deployment.clone())
        })
        .collect();
    victims.sort();
    assert_eq!(
        victims,
        [
            (B.to_string(), A.to_string()),
            (C.to_string(), D.to_string())
        ]
    );
    // Window 2 s, park 1 s, wake 3 s: both at 6 s (one after the other, chat-c would open
    // at 10 s).
    r.until(6.0).await;
    assert_eq!(b.admitted_at(), secs(6.0));
    assert_eq!(c.admitted_at(), secs(6.0));
    assert!(r.fake.abandons().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_third_switch_that_gets_later_is_planned_again_when_one_ends() {
    let (r, d, e) = two_gpus().await;
    let (mut b, mut c, _running) = two_waves(&r, &d, 1.5);
    r.until(0.5).await;
    // Both GPUs are held by the two switches: chat-e's plan says `Later`.
    let mut e = r.send(&e, hold(1.0));
    r.until(5.999).await;
    let later = r.fake.later_plans();
    assert!(!later.is_empty());
    assert_eq!(r.since(later[0].0), secs(0.5));
    assert!(later.iter().all(|(_, dep)| dep == E));
    assert_eq!(r.fake.plans_not_later().len(), 2);
    assert!(e.waiting());
    // The two switches end at 6 s: chat-e is planned again and gets a victim (chat-b, idle
    // since its request ends at 7 s: window to 8 s, park 1 s, wake 3 s).
    r.until(6.0).await;
    assert_eq!(b.admitted_at(), secs(6.0));
    assert_eq!(c.admitted_at(), secs(6.0));
    let plans = r.fake.plans_not_later();
    assert_eq!(plans.len(), 3);
    assert_eq!((r.since(plans[2].0), plans[2].1.as_str()), (secs(6.0), E));
    assert!(plans[2].2.contains(E));
    r.until(11.999).await;
    assert!(e.waiting());
    r.until(12.0).await;
    assert_eq!(e.admitted_at(), secs(12.0));
    let ex = r.fake.executes();
    assert_eq!(ex.len(), 3);
    assert_eq!(ex[2].1.target, E);
    assert_eq!(r.since(ex[2].0), secs(8.0));
}

#[tokio::test(start_paused = true)]
async fn a_victim_with_another_open_instance_closes_at_once_and_its_sibling_serves() {
    // chat-a has two instances. chat-b's switch takes a0 (a1 stays open and no switch names
    // it): no window. chat-c's switch, beside it, takes a1, chat-a's last open instance: the
    // product page's window applies to it.
    let timings = FakeTimings {
        capacity: 3,
        ..FakeTimings::default()
    };
    let r = rig_with(RouterConfig::default(), timings, 2).await;
    let (a0, a1) = (r.fake.key(A, 0), r.fake.key(A, 1));
    let mut running = r.send(&r.a, hold(1.0));
    r.until(0.0).await;
    assert_eq!(running.answered().1.unwrap().key, a0);
    let switch = |id: &str, victim| {
        Ok(Plan::Switch {
            switch_id: id.into(),
            victims: vec![victim],
            window: None,
        })
    };
    r.fake.script_plan(B, switch("sw-b", a0.clone()));
    r.fake.script_plan(C, switch("sw-c", a1.clone()));
    let _b = r.send(&r.b, hold(1.0));
    r.until(0.5).await;
    // a0 closed at once: chat-a's requests go to a1 at once, none waits.
    let mut sent: Vec<(f64, Req)> = Vec::new();
    for i in 0..4 {
        sent.push((0.5 + 0.1 * f64::from(i), r.send(&r.a, hold(0.05))));
        r.until(0.5 + 0.1 * f64::from(i + 1)).await;
    }
    // chat-c's switch takes a1 at 1 s: it keeps a window (to 3 s), chat-a serves on it.
    r.until(1.0).await;
    let _c = r.send(&r.c, hold(1.0));
    r.until(1.0).await;
    for (t, run) in [(1.5, 0.05), (2.9, 0.5)] {
        r.until(t).await;
        sent.push((t, r.send(&r.a, hold(run))));
        r.until(t).await;
    }
    for (t, q) in &mut sent {
        let (at, up) = q.answered();
        assert_eq!(at, secs(*t), "no request of chat-a waited");
        assert_eq!(up.unwrap().key, a1);
    }
    let ex = r.fake.executes();
    assert_eq!(ex.len(), 1);
    // chat-b's switch: drained when a0's request ended at 1 s, no 2 s window.
    assert_eq!((ex[0].1.target.as_str(), r.since(ex[0].0)), (B, secs(1.0)));
    assert_eq!(ex[0].1.window, secs(0.0));
    // After a1's window (a1 drains until 3.4 s) chat-a has no open instance: the drain's 503.
    r.until(3.1).await;
    let mut late = r.send(&r.a, hold(0.05));
    r.until(3.1).await;
    assert_eq!(
        late.refused().1,
        ApiError::DispatchClosed {
            deployment: A.into()
        }
    );
    assert_eq!(r.fake.executes().len(), 1);
    r.until(3.4).await;
    let ex = r.fake.executes();
    assert_eq!(ex.len(), 2);
    assert_eq!((ex[1].1.target.as_str(), r.since(ex[1].0)), (C, secs(3.4)));
    assert_eq!((ex[1].1.window, ex[1].1.drain), (secs(2.0), secs(0.4)));
}

#[tokio::test(start_paused = true)]
async fn an_instance_beside_victims_in_another_switch_window_keeps_its_own_window() {
    // chat-b's switch takes both of chat-a's instances (a0, a1: a window, as chat-a has no
    // other). A third instance, a2, opens meanwhile; chat-c's switch takes it. a0 and a1 are
    // victims of chat-b's switch, so a2 is not "another ready instance elsewhere": it keeps
    // the window, and chat-a's requests are served on it until it closes.
    let timings = FakeTimings {
        capacity: 3,
        ..FakeTimings::default()
    };
    let r = rig_with(RouterConfig::default(), timings, 2).await;
    let (a0, a1, a2) = (r.fake.key(A, 0), r.fake.key(A, 1), r.fake.key(A, 2));
    r.fake.script_plan(
        B,
        Ok(Plan::Switch {
            switch_id: "sw-b".into(),
            victims: vec![a0.clone(), a1.clone()],
            window: None,
        }),
    );
    r.fake.script_plan(
        C,
        Ok(Plan::Switch {
            switch_id: "sw-c".into(),
            victims: vec![a2.clone()],
            window: None,
        }),
    );
    let _b = r.send(&r.b, hold(1.0));
    r.until(0.5).await;
    r.h.instance_ready(r.fake.upstream(A, 2)).await;
    let _c = r.send(&r.c, hold(1.0));
    r.until(0.5).await;
    // chat-b's window (a0, a1 idle since 0 s) closes at 2 s; a2 serves on in chat-c's.
    r.until(2.2).await;
    let mut a = r.send(&r.a, hold(0.05));
    r.until(2.2).await;
    let (at, up) = a.answered();
    assert_eq!((at, up.unwrap().key), (secs(2.2), a2));
    r.until(5.0).await;
    let ex = r.fake.executes();
    assert_eq!(ex.len(), 2);
    assert_eq!((ex[0].1.target.as_str(), ex[0].1.window), (B, secs(2.0)));
    // a2 ran a request at 2.2 s: its window is the full 2 s from 0.5 s.
    assert_eq!((ex[1].1.target.as_str(), ex[1].1.window), (C, secs(2.0)));
    assert_eq!(r.since(ex[1].0), secs(2.5));
}

#[tokio::test(start_paused = true)]
async fn an_operator_switch_waits_for_every_switch_in_progress_and_runs_alone() {
    let (r, d, _) = two_gpus().await;
    // chat-b's switch ends at 6 s; chat-c's victim chat-d drains until 3.5 s, so chat-c's
    // switch ends at 7.5 s.
    let (mut b, mut c, _running) = two_waves(&r, &d, 3.5);
    r.until(0.5).await;
    let h = r.h.clone();
    let t0 = r.t0;
    let op = tokio::spawn(async move {
        let out = h.operator_start(E.to_string()).await;
        (tokio::time::Instant::now() - t0, out)
    });
    // A wave newer than the operator's switch (chat-a, parked by chat-b's switch) is not
    // planned before it.
    r.until(6.5).await;
    assert_eq!(b.admitted_at(), secs(6.0));
    let mut a = r.send(&r.a, hold(1.0));
    r.until(7.499).await;
    assert!(r.fake.operator_plans().is_empty());
    assert_eq!(
        r.fake.plans().len(),
        2,
        "nothing planned while the operator waits"
    );
    r.until(7.5).await;
    assert_eq!(c.admitted_at(), secs(7.5));
    let plans = r.fake.operator_plans();
    assert_eq!(plans.len(), 1);
    assert_eq!((r.since(plans[0].0), plans[0].1.as_str()), (secs(7.5), E));
    assert!(plans[0].2.contains(A), "chat-a's wave is protected");
    // No window; chat-b idle since 7 s: parked from 7.5 s to 8.5 s. Nothing else is planned
    // until the operator's execute answered.
    r.until(8.499).await;
    assert_eq!(r.fake.plans().len(), 3);
    let (at, out) = op.await.unwrap();
    assert_eq!(at, secs(8.5));
    assert!(out.is_ok(), "{out:?}");
    r.until(8.5).await;
    let plans = r.fake.plans();
    assert_eq!((r.since(plans[3].0), plans[3].1.as_str()), (secs(8.5), A));
    assert!(a.waiting());
}

#[tokio::test(start_paused = true)]
async fn a_wave_answered_later_beside_a_switch_is_not_planned_at_each_request_end() {
    // One GPU: chat-b's switch holds it from 0 s. chat-c, asked for at 0.5 s, is answered
    // `Later`; chat-a's five requests ending between 0.6 s and 1 s free nothing, so chat-c is
    // planned again only when chat-b's switch moves on: its drain ends at 2 s (`Later` again:
    // the park and wake go on), it ends at 6 s (a switch, chat-b its victim).
    let r = rig().await;
    let _running: Vec<Req> = (0..5)
        .map(|i| r.send(&r.a, hold(0.6 + 0.1 * f64::from(i))))
        .collect();
    let _b = r.send(&r.b, hold(1.0));
    r.until(0.5).await;
    let _c = r.send(&r.c, hold(1.0));
    r.until(6.0).await;
    let later: Vec<_> = r
        .fake
        .later_plans()
        .into_iter()
        .map(|(t, d)| (r.since(t), d))
        .collect();
    assert_eq!(
        later,
        [(secs(0.5), C.to_string()), (secs(2.0), C.to_string())]
    );
    let plans = r.fake.plans_not_later();
    assert_eq!((r.since(plans[1].0), plans[1].1.as_str()), (secs(6.0), C));
}

#[tokio::test(start_paused = true)]
async fn the_oldest_wave_answered_later_is_planned_first_when_switches_end() {
    let (r, d, e) = two_gpus().await;
    let f = r.fake.add(F, "chat-f", FakeState::Parked, 1);
    let (mut b, mut c, _running) = two_waves(&r, &d, 1.5);
    r.until(0.5).await;
    let mut e = r.send(&e, hold(1.0));
    r.until(0.7).await;
    let mut f = r.send(&f, hold(1.0));
    r.until(5.999).await;
    assert!(r.fake.later_plans().iter().any(|(_, dep)| dep == F));
    assert_eq!(r.fake.plans_not_later().len(), 2);
    // The two switches end at 6 s and free both GPUs: chat-e (waiting since 0.5 s) is planned
    // first and gets one, chat-f the other; both switch at once (window to 8 s, chat-b's and
    // chat-c's requests end at 7 s; park 1 s, wake 3 s).
    r.until(6.0).await;
    assert_eq!((b.admitted_at(), c.admitted_at()), (secs(6.0), secs(6.0)));
    let plans = r.fake.plans_not_later();
    let planned: Vec<(std::time::Duration, &str)> = plans[2..]
        .iter()
        .map(|(t, dep, _)| (r.since(*t), dep.as_str()))
        .collect();
    assert_eq!(planned, [(secs(6.0), E), (secs(6.0), F)]);
    r.until(12.0).await;
    assert_eq!((e.admitted_at(), f.admitted_at()), (secs(12.0), secs(12.0)));
}
