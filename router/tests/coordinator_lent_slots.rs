//! Slots the coordinator lends to its handles (a ready deployment with room and nobody waiting
//! is admitted without a round trip to the task): they count as in flight at once, never more
//! than 32, and a drain sees every one of them.
#![allow(clippy::unwrap_used)]

mod coordinator_support;

use capyctl_router::lifecycle::DrainReport;
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
