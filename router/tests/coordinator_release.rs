//! What the lifecycle tells the router: releases it starts itself, instances opening and going,
//! refusals; and the load read.
#![allow(clippy::unwrap_used)]

mod coordinator_support;

use capyctl_interfaces::router::DrainReport;
use capyctl_router::coordinator::testing::FakeState;
use capyctl_spec::errors::ApiError;
use coordinator_support::*;
use tokio::time::Instant;

#[tokio::test(start_paused = true)]
async fn release_drains_and_reports() {
    let r = rig().await;
    let _a = r.send(&r.a, hold(3.0));
    r.until(1.0).await;
    let h = r.h.clone();
    let key = r.fake.key(A, 0);
    let t0 = r.t0;
    let release = tokio::spawn(async move {
        let out = h.release(vec![key]).await;
        (Instant::now() - t0, out)
    });
    r.until(1.5).await;
    let mut closed = r.send(&r.a, hold(1.0));
    r.until(1.5).await;
    assert_eq!(
        closed.refused().1,
        ApiError::DispatchClosed {
            deployment: A.into()
        }
    );
    let (at, out) = release.await.unwrap();
    assert_eq!(at, secs(3.0), "answered once drained");
    assert_eq!(out, Ok(vec![(r.fake.key(A, 0), DrainReport::default())]));
    // Forgotten: the next request waits and asks for chat-a.
    let mut later = r.send(&r.a, hold(1.0));
    r.until(3.0).await;
    assert!(later.waiting());
    assert_eq!(r.fake.plans()[0].1, A);
}

#[tokio::test(start_paused = true)]
async fn release_drain_timeout_serves_again() {
    let r = rig().await;
    let _a = r.send(&r.a, hold(100.0));
    r.until(1.0).await;
    let h = r.h.clone();
    let key = r.fake.key(A, 0);
    let t0 = r.t0;
    let release = tokio::spawn(async move {
        let out = h.release(vec![key]).await;
        (Instant::now() - t0, out)
    });
    let (at, out) = release.await.unwrap();
    assert_eq!(at, secs(31.0));
    assert_eq!(
        out,
        Err(ApiError::DrainTimeout {
            deployment: A.into(),
            drain_ms: 30000,
            charged: 1
        })
    );
    let mut a = r.send(&r.a, hold(1.0));
    r.until(31.0).await;
    assert_eq!(a.admitted_at(), secs(31.0), "serves again");
}

#[tokio::test(start_paused = true)]
async fn deployment_refused_fails_waiters_and_gives_back_switch() {
    let r = rig().await;
    let _a = r.send(&r.a, hold(10.0));
    let mut bs: Vec<Req> = (0..2).map(|_| r.send(&r.b, hold(1.0))).collect();
    r.until(2.5).await;
    let stopped = ApiError::DeploymentStopped {
        deployment: B.into(),
    };
    r.h.deployment_refused(B.into(), stopped.clone()).await;
    r.until(2.5).await;
    for q in bs.iter_mut() {
        assert_eq!(q.refused(), (secs(2.5), stopped.clone()));
    }
    assert_eq!(r.since(r.fake.abandons()[0].0), secs(2.5));
    // The drain is given up: chat-a serves again.
    r.until(2.6).await;
    let mut a = r.send(&r.a, hold(1.0));
    r.until(2.6).await;
    assert_eq!(a.admitted_at(), secs(2.6));
    assert!(r.fake.executes().is_empty());
}

#[tokio::test(start_paused = true)]
async fn target_ready_by_other_means_gives_back_switch() {
    let r = rig().await;
    let _a = r.send(&r.a, hold(10.0));
    let mut b = r.send(&r.b, hold(1.0));
    r.until(1.0).await;
    r.fake.set_state(B, FakeState::Ready);
    r.fake.announce(B).await;
    r.until(1.0).await;
    assert_eq!(b.admitted_at(), secs(1.0));
    assert_eq!(r.fake.abandons().len(), 1);
    r.until(3.0).await;
    let mut a = r.send(&r.a, hold(1.0));
    r.until(3.0).await;
    assert_eq!(a.admitted_at(), secs(3.0), "chat-a was not closed");
}

#[tokio::test(start_paused = true)]
async fn instance_gone_makes_requests_wait() {
    let r = rig().await;
    r.h.instance_gone(r.fake.key(A, 0)).await;
    r.fake.set_state(A, FakeState::Parked);
    let mut a = r.send(&r.a, hold(1.0));
    r.until(1.0).await;
    assert!(a.waiting());
    // chat-a is parked and the GPU is free: bring up, wake 3 s.
    r.until(3.0).await;
    assert_eq!(a.admitted_at(), secs(3.0));
}

#[tokio::test(start_paused = true)]
async fn load_reports_in_flight_and_waiting() {
    let r = rig().await;
    let _running: Vec<Req> = (0..3).map(|_| r.send(&r.a, hold(10.0))).collect();
    let _waiting: Vec<Req> = (0..2).map(|_| r.send(&r.b, hold(1.0))).collect();
    r.until(0.5).await;
    let load = r.h.load().await;
    let la = load.iter().find(|l| l.deployment_id == A).unwrap();
    assert_eq!(
        (
            la.in_flight,
            la.in_flight_limit,
            la.waiting,
            la.waiting_limit
        ),
        (3, 32, 0, 64)
    );
    assert_eq!(la.instances.len(), 1);
    assert_eq!(la.instances[0].key, r.fake.key(A, 0));
    assert_eq!(la.instances[0].router_in_flight, 3);
    let lb = load.iter().find(|l| l.deployment_id == B).unwrap();
    assert_eq!((lb.in_flight, lb.waiting), (0, 2));
    assert!(lb.instances.is_empty());
}
