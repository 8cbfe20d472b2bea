//! The load read: published by the coordinator after its events and read without a turn of its
//! task (so no admission ever waits behind a read), exact with lent slots, one deployment in
//! O(1); and a deployment's entry goes when the deployment goes.
#![allow(clippy::unwrap_used)]

mod coordinator_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use capyctl_interfaces::router::DrainReport;
use capyctl_router::admission::Admission;
use capyctl_router::config::RouterConfig;
use capyctl_router::coordinator::DeploymentLoad;
use capyctl_router::coordinator::testing::{FakeLifecycle, FakeState, FakeTimings};
use capyctl_spec::errors::ApiError;
use coordinator_support::*;
use futures_util::FutureExt;

fn of(loads: &[DeploymentLoad], id: &str) -> Option<(usize, usize)> {
    loads
        .iter()
        .find(|d| d.deployment_id == id)
        .map(|d| (d.in_flight, d.waiting))
}

#[tokio::test(start_paused = true)]
async fn a_load_read_answers_without_a_turn_of_the_coordinator() {
    let r = rig().await;
    let _running: Vec<Req> = (0..3).map(|_| r.send(&r.a, hold(10.0))).collect();
    let _waiting: Vec<Req> = (0..2).map(|_| r.send(&r.b, hold(1.0))).collect();
    r.until(0.5).await;
    // This test's runtime has one thread: a read that needed the coordinator's task to run
    // could not answer before this task yields. Both answer at once.
    let all =
        r.h.load()
            .now_or_never()
            .expect("answered without the task");
    assert_eq!(of(&all, A), Some((3, 0)));
    assert_eq!(of(&all, B), Some((0, 2)));
    let ids: Vec<&str> = all.iter().map(|l| l.deployment_id.as_str()).collect();
    assert_eq!(ids, [A, B], "by deployment ID");
    let a =
        r.h.load_of(A)
            .now_or_never()
            .expect("answered without the task");
    assert_eq!(a.as_ref(), all.iter().find(|l| l.deployment_id == A));
    let a = a.unwrap();
    assert_eq!(a.instances.len(), 1);
    assert_eq!(
        (a.instances[0].router_in_flight, a.instances[0].open),
        (3, true)
    );
    assert_eq!(
        r.h.load_of(C).await,
        None,
        "never wanted: the router does not know it"
    );
}

#[tokio::test(start_paused = true)]
async fn a_deleted_deployments_entry_goes_with_its_load_and_counters() {
    let r = rig().await;
    let mut running = r.send(&r.a, hold(2.0));
    r.until(0.0).await;
    assert_eq!(running.admitted_at(), secs(0.0));
    assert_eq!(of(&r.h.load().await, A), Some((1, 0)));

    // The lifecycle deletes chat-a: it drains it, its instance goes, then it is forgotten.
    let h = r.h.clone();
    let key = r.fake.key(A, 0);
    let release = tokio::spawn(async move { h.release(vec![key]).await });
    r.until(2.0).await;
    let drained = release.await.unwrap().unwrap();
    assert_eq!(drained, vec![(r.fake.key(A, 0), DrainReport::default())]);
    r.fake.remove(A);
    r.h.forget(A.to_string()).await;
    r.until(2.0).await;
    assert_eq!(of(&r.h.load().await, A), None);
    assert_eq!(r.h.load_of(A).await, None);

    // A request that resolved the name before the delete is refused and leaves no entry.
    let mut late = r.send(&r.a, hold(1.0));
    r.until(2.0).await;
    assert!(matches!(late.refused().1, ApiError::NotFound { .. }));
    assert_eq!(r.h.load_of(A).await, None);
    assert_eq!(
        r.h.load().await.len(),
        0,
        "chat-b and chat-c were never wanted"
    );
}

#[tokio::test(start_paused = true)]
async fn a_deployment_forgotten_while_a_request_runs_goes_once_it_ends() {
    let r = rig().await;
    let mut running = r.send(&r.a, hold(3.0));
    let mut waiting = r.send(&r.b, hold(1.0));
    r.until(0.0).await;
    assert_eq!(running.admitted_at(), secs(0.0));
    assert!(waiting.waiting());
    // chat-b is deleted while a request waits for it: the request fails, its entry goes.
    r.fake.remove(B);
    r.h.forget(B.to_string()).await;
    r.until(0.0).await;
    assert!(matches!(waiting.refused(), (_, ApiError::NotFound { .. })));
    assert_eq!(r.h.load_of(B).await, None);
    // chat-a, forgotten with a request still charged to it (its instance was never released),
    // keeps its entry while the request runs; the instance's end then takes the rest.
    r.fake.remove(A);
    r.h.forget(A.to_string()).await;
    r.until(1.0).await;
    assert_eq!(of(&r.h.load().await, A), Some((1, 0)));
    r.until(3.0).await;
    r.h.instance_gone(r.fake.key(A, 0)).await;
    r.until(3.0).await;
    assert_eq!(r.h.load_of(A).await, None);
}

/// Requests take and give back lent slots on several threads while another thread reads the
/// load without pause: every read is a count that was true at some instant (never more than the
/// 32 slots, the instance's count equal to the deployment's), and the last one, once all have
/// ended, is zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reads_of_lent_slots_are_exact_while_requests_come_and_go() {
    let fake = FakeLifecycle::new(FakeTimings::default());
    let a = fake.add(A, "chat-a", FakeState::Ready, 1);
    let h = fake.spawn(RouterConfig::default());
    fake.announce(A).await;
    while h.load_of(A).await.is_none() {
        tokio::task::yield_now().await;
    }
    let done = Arc::new(AtomicBool::new(false));
    let reader = {
        let h = h.clone();
        let done = done.clone();
        tokio::spawn(async move {
            let mut reads = 0u64;
            while !done.load(Ordering::Relaxed) {
                let l = h.load_of(A).await.unwrap();
                assert!(l.in_flight <= 32, "{l:?}");
                assert_eq!(l.instances[0].router_in_flight, l.in_flight, "{l:?}");
                reads += 1;
                tokio::task::yield_now().await;
            }
            reads
        })
    };
    let workers: Vec<_> = (0..8)
        .map(|_| {
            let h = h.clone();
            let a = a.clone();
            tokio::spawn(async move {
                for _ in 0..2000 {
                    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
                    let permit = h.admit(a.clone(), deadline).await.unwrap();
                    tokio::task::yield_now().await;
                    drop(permit);
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    done.store(true, Ordering::Relaxed);
    assert!(reader.await.unwrap() > 0);
    // Every end reached the lane or the owner; the owner's next event settles the lane.
    let mut last = h.load_of(A).await.unwrap();
    let mut tries = 0;
    while last.in_flight != 0 && tries < 1000 {
        tokio::task::yield_now().await;
        last = h.load_of(A).await.unwrap();
        tries += 1;
    }
    assert_eq!((last.in_flight, last.waiting), (0, 0), "{last:?}");
}
