//! Slots the coordinator lends to its handles (a ready deployment with room and nobody waiting
//! is admitted without a round trip to the task): they count as in flight at once, never more
//! than 32, and a drain sees every one of them.
#![allow(clippy::unwrap_used)]

mod coordinator_support;

use capyctl_interfaces::router::DrainReport;
use coordinator_support::*;
use tokio::time::Instant;

fn a_load(loads: &[capyctl_router::coordinator::DeploymentLoad]) -> (usize, usize) {
    loads
        .iter()
        .find(|d| d.deployment_id == A)
        .map(|d| (d.in_flight, d.waiting))
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn rule_lent_slots_count_at_once_and_the_33rd_waits_for_a_finish() {
    let r = rig().await;
    let mut running: Vec<Req> = (0..32).map(|_| r.send(&r.a, hold(5.0))).collect();
    r.until(0.0).await;
    for req in &mut running {
        assert_eq!(req.admitted_at(), secs(0.0));
    }
    assert_eq!(a_load(&r.h.load().await), (32, 0));

    let mut next = r.send(&r.a, hold(1.0));
    r.until(1.0).await;
    assert!(next.waiting());
    assert_eq!(a_load(&r.h.load().await), (32, 1));

    r.until(5.0).await;
    assert_eq!(next.admitted_at(), secs(5.0));
    assert_eq!(a_load(&r.h.load().await), (1, 0));
    r.until(6.0).await;
    assert_eq!(a_load(&r.h.load().await), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn rule_a_lent_slot_taken_just_before_a_release_is_drained() {
    let r = rig().await;
    // Admitted, and the release sent, at the same instant, before the task saw either.
    let mut req = r.send(&r.a, hold(2.0));
    let h = r.h.clone();
    let key = r.fake.key(A, 0);
    let t0 = r.t0;
    let release = tokio::spawn(async move {
        let out = h.release(vec![key]).await;
        (Instant::now() - t0, out)
    });
    let (at, out) = release.await.unwrap();
    assert_eq!(req.admitted_at(), secs(0.0));
    assert_eq!(
        at,
        secs(2.0),
        "answered only once the lent request finished"
    );
    assert_eq!(out, Ok(vec![(r.fake.key(A, 0), DrainReport::default())]));
}

#[tokio::test(start_paused = true)]
async fn rule_lent_slots_given_back_are_free_at_once_and_counted_exactly() {
    let r = rig().await;
    let mut first: Vec<Req> = (0..32).map(|_| r.send(&r.a, hold(1.0))).collect();
    r.until(1.0).await;
    // The 32 ended at 1 s, giving their slots back to the lane: 32 more run at once.
    let mut second: Vec<Req> = (0..32).map(|_| r.send(&r.a, hold(1.0))).collect();
    r.until(1.0).await;
    for req in &mut first {
        assert_eq!(req.admitted_at(), secs(0.0));
    }
    for req in &mut second {
        assert_eq!(req.admitted_at(), secs(1.0));
    }
    assert_eq!(a_load(&r.h.load().await), (32, 0));
    r.until(2.0).await;
    assert_eq!(a_load(&r.h.load().await), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn rule_a_lent_slot_cut_before_output_still_tells_the_owner() {
    let r = rig().await;
    let _cut = r.send(
        &r.a,
        Hold::Cut {
            after: secs(1.0),
            output: false,
        },
    );
    r.until(2.0).await;
    assert_eq!(a_load(&r.h.load().await), (0, 0));
    let out = r.h.release(vec![r.fake.key(A, 0)]).await;
    assert_eq!(
        out,
        Ok(vec![(
            r.fake.key(A, 0),
            DrainReport {
                cut_before_output: true
            }
        )])
    );
}

#[tokio::test(start_paused = true)]
async fn rule_an_end_given_back_to_the_lane_counts_for_the_window() {
    let r = rig().await;
    // chat-a's last request ends at 0.4 s (given back to the lane, no event); chat-b is asked
    // for at 1 s: one idle window after 0.4 s is 2.4 s, before 1 + 2 = 3 s.
    let _a = r.send(&r.a, hold(0.4));
    r.until(1.0).await;
    let _b = r.send(&r.b, hold(1.0));
    r.until(3.5).await;
    let ex = r.fake.executes();
    assert_eq!(ex.len(), 1);
    assert_eq!(r.since(ex[0].0), secs(2.4));
}

#[tokio::test(start_paused = true)]
async fn rule_an_end_given_back_during_the_window_does_not_shorten_it() {
    let r = rig().await;
    // chat-b is asked for at 1 s while chat-a runs a request until 1.5 s: the window runs its
    // full length, 1–3 s (the end at 1.5 s is one the owner learns only from the lane).
    let _a = r.send(&r.a, hold(1.5));
    r.until(1.0).await;
    let _b = r.send(&r.b, hold(1.0));
    r.until(2.0).await;
    let mut late = r.send(&r.a, hold(0.1));
    r.until(3.5).await;
    assert_eq!(late.admitted_at(), secs(2.0));
    let ex = r.fake.executes();
    assert_eq!(ex.len(), 1);
    assert_eq!(r.since(ex[0].0), secs(3.0));
}
