//! A deployment's last use, as the router records it (the one record the lifecycle's idle timers
//! read), and releases the lifecycle's idle timers ask for: decided by the coordinator on its
//! own state, refused while the deployment is in use.
#![allow(clippy::unwrap_used)]

mod coordinator_support;

use capyctl_interfaces::router::DrainReport;
use capyctl_router::coordinator::IdleRelease;
use coordinator_support::*;

#[tokio::test(start_paused = true)]
async fn the_last_use_read_without_the_task_counts_requests_on_lent_slots() {
    let r = rig().await;
    assert_eq!(r.h.last_used(A), None, "no request yet");
    let uses = r.h.last_uses();
    r.until(1.0).await;
    let _a = r.send(&r.a, hold(2.0));
    r.until(1.0).await;
    // Started on chat-a's lane: the owner has not heard of it, the read has.
    assert_eq!(r.h.last_used(A), Some(r.t0 + secs(1.0)), "its start");
    assert_eq!(uses.of(A), Some(r.t0 + secs(1.0)));
    assert_eq!(r.h.load_of(A).await.unwrap().in_flight, 1);
    r.until(3.5).await;
    // Ended on the lane too (given back, no event).
    assert_eq!(r.h.last_used(A), Some(r.t0 + secs(3.0)), "its end");
    let load = r.h.load_of(A).await.unwrap();
    assert_eq!(
        (load.in_flight, load.last_used),
        (0, Some(r.t0 + secs(3.0)))
    );
    assert_eq!(uses.of(B), None, "nothing asked for chat-b");
}

#[tokio::test(start_paused = true)]
async fn an_idle_deployment_is_released_at_once_and_its_next_request_waits() {
    let r = rig().await;
    let _a = r.send(&r.a, hold(1.0));
    r.until(10.0).await;
    let key = r.fake.key(A, 0);
    let out =
        r.h.release_if_idle(A.into(), vec![key.clone()], r.t0 + secs(1.0))
            .await;
    assert_eq!(
        out,
        IdleRelease::Released(Ok(vec![(key, DrainReport::default())])),
        "idle since 1 s (its last request ended then)"
    );
    // Forgotten: the next request waits and asks for chat-a.
    let mut later = r.send(&r.a, hold(1.0));
    r.until(10.0).await;
    assert!(later.waiting());
    assert_eq!(r.fake.plans()[0].1, A);
}

#[tokio::test(start_paused = true)]
async fn an_idle_release_is_refused_when_a_request_came_after_the_instant() {
    let r = rig().await;
    // Through the lane: 1 s to 2 s.
    r.until(1.0).await;
    let _a = r.send(&r.a, hold(1.0));
    r.until(10.0).await;
    let key = r.fake.key(A, 0);
    let out =
        r.h.release_if_idle(A.into(), vec![key.clone()], r.t0 + secs(1.5))
            .await;
    assert_eq!(out, IdleRelease::InUse, "it ended at 2 s, after 1.5 s");
    // Nothing changed: it serves on, on its lane.
    let mut next = r.send(&r.a, hold(1.0));
    r.until(10.0).await;
    assert_eq!(next.admitted_at(), secs(10.0));
    assert!(r.fake.plans().is_empty());
}

#[tokio::test(start_paused = true)]
async fn an_idle_release_is_refused_while_a_request_runs_or_waits() {
    let r = rig().await;
    let running = r.send(&r.a, Hold::Forever);
    r.until(10.0).await;
    let key = r.fake.key(A, 0);
    // Started at 0 s, before the instant, but still running.
    let out =
        r.h.release_if_idle(A.into(), vec![key.clone()], r.t0 + secs(5.0))
            .await;
    assert_eq!(out, IdleRelease::InUse);
    running.end();
    // A short request at 19.5 s keeps chat-a's admission window open past 20 s.
    r.until(19.5).await;
    let _short = r.send(&r.a, hold(0.1));
    r.until(20.0).await;

    // A request waits for chat-c (parked): chat-c is not idle either.
    let mut c = r.send(&r.c, hold(1.0));
    r.until(20.0).await;
    assert!(c.waiting());
    let out =
        r.h.release_if_idle(C.into(), vec![], r.t0 + secs(20.0))
            .await;
    assert_eq!(out, IdleRelease::InUse, "a request waits for it");
    // And chat-a is the victim of the switch to chat-c (in its window now): not released here.
    assert_eq!(r.fake.plans().len(), 1);
    assert!(r.fake.executes().is_empty(), "the window is open");
    let out =
        r.h.release_if_idle(A.into(), vec![key], r.t0 + secs(20.0))
            .await;
    assert_eq!(out, IdleRelease::InUse, "a switch names it");
    r.until(60.0).await;
    assert!(!c.waiting(), "the switch went on");
    c.admitted_at();
}

#[tokio::test(start_paused = true)]
async fn an_idle_parked_deployment_is_released_with_no_instances() {
    let r = rig().await;
    r.until(5.0).await;
    let out =
        r.h.release_if_idle(B.into(), vec![], r.t0 + secs(5.0))
            .await;
    assert_eq!(out, IdleRelease::Released(Ok(vec![])));
    assert!(r.h.load_of(B).await.is_none(), "no entry made for it");
}
