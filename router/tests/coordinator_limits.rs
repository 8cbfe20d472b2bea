//! The waiting limits, the deadlines and "No waiting" mode, each with its exact error.
#![allow(clippy::unwrap_used)]

mod coordinator_support;

use capyctl_interfaces::router::Plan;
use capyctl_router::admission::{Admission, Permit, deadline_error};
use capyctl_router::config::RouterConfig;
use capyctl_router::coordinator::testing::FakeState;
use capyctl_router::coordinator::testing::FakeTimings;
use capyctl_spec::errors::ApiError;
use coordinator_support::*;
use std::time::Duration;
use tokio::time::Instant;

fn config(f: impl FnOnce(&mut RouterConfig)) -> RouterConfig {
    let mut c = RouterConfig::default();
    f(&mut c);
    c
}

#[tokio::test(start_paused = true)]
async fn limit_max_pending_per_deployment() {
    let r = rig_with(
        config(|c| c.max_pending_per_deployment = 2),
        FakeTimings::default(),
        1,
    )
    .await;
    let mut qs: Vec<Req> = (0..3).map(|_| r.send(&r.b, hold(1.0))).collect();
    r.until(0.0).await;
    assert!(qs[0].waiting() && qs[1].waiting());
    let (at, e) = qs[2].refused();
    assert_eq!(at, secs(0.0));
    assert_eq!(
        e,
        ApiError::TooManyWaiting {
            deployment: B.into()
        }
    );
    assert_eq!(
        e.message(),
        format!("too many requests are waiting for deployment {B}")
    );
    assert_eq!((e.status(), e.retry_after()), (429, Some(1)));
    let load = r.h.load().await;
    let lb = load.iter().find(|l| l.deployment_id == B).unwrap();
    assert_eq!((lb.waiting, lb.waiting_limit), (2, 2));
}

#[tokio::test(start_paused = true)]
async fn limit_max_pending_total() {
    let r = rig_with(
        config(|c| c.max_pending_total = 3),
        FakeTimings::default(),
        1,
    )
    .await;
    let mut qs: Vec<Req> = (0..2).map(|_| r.send(&r.b, hold(1.0))).collect();
    let mut c1 = r.send(&r.c, hold(1.0));
    r.until(0.0).await;
    let mut c2 = r.send(&r.c, hold(1.0));
    r.until(0.0).await;
    assert!(qs.iter_mut().all(|q| q.waiting()) && c1.waiting());
    assert_eq!(
        c2.refused().1,
        ApiError::TooManyWaiting {
            deployment: C.into()
        },
        "named for the deployment asked for"
    );
}

#[tokio::test(start_paused = true)]
async fn deadline_queue_when_never_servable() {
    let r = rig().await;
    r.fake.script_plan(B, Ok(Plan::Later));
    let mut q = r.send_full(&r.b, r.t0 + secs(10.0), hold(1.0));
    r.until(9.999).await;
    assert!(q.waiting());
    r.until(10.0).await;
    let (at, e) = q.refused();
    assert_eq!(at, secs(10.0), "exactly at its deadline");
    assert_eq!(
        e,
        ApiError::QueueDeadline {
            deployment: B.into()
        }
    );
    assert_eq!(
        e.message(),
        format!("deployment {B} did not become servable within the queue deadline; retry shortly")
    );
    assert_eq!(e.status(), 503);
}

#[tokio::test(start_paused = true)]
async fn deadline_in_flight_when_32_running() {
    let r = rig().await;
    let _running: Vec<Req> = (0..32).map(|_| r.send(&r.a, Hold::Forever)).collect();
    r.until(0.0).await;
    let mut q = r.send_full(&r.a, r.t0 + secs(5.0), hold(1.0));
    r.until(4.999).await;
    assert!(q.waiting());
    r.until(5.0).await;
    let (at, e) = q.refused();
    assert_eq!(at, secs(5.0));
    assert_eq!(
        e,
        ApiError::InFlightDeadline {
            deployment: A.into()
        }
    );
    assert_eq!(
        e.message(),
        format!("deployment {A} stayed at its in-flight bound for the queue deadline")
    );
    assert_eq!(e.status(), 429);
}

/// The 32 requests ahead end a moment before the waiter's deadline (as requests the engine
/// never answers reach their own deadlines first): the waiter gets its slot then, with the
/// time it waited at the bound, and the one deadline rule names the in-flight bound should
/// its own deadline pass at the engine (through the listener: `proxy_coordinator.rs`).
#[tokio::test(start_paused = true)]
async fn a_slot_freed_just_before_the_deadline_carries_the_wait_at_the_bound() {
    let r = rig().await;
    let _running: Vec<Req> = (0..32).map(|_| r.send(&r.a, hold(4.9))).collect();
    r.until(0.0).await;
    let deadline = r.t0 + secs(5.0);
    let permit = r.h.admit(r.a.clone(), deadline).await.unwrap();
    assert_eq!(Instant::now() - r.t0, secs(4.9));
    assert_eq!(permit.waited_at_bound(), secs(4.9));
    assert_eq!(
        deadline_error(A, permit.waited_at_bound(), secs(5.0)),
        ApiError::InFlightDeadline {
            deployment: A.into()
        }
    );
    // Admitted at once: nothing at the bound.
    drop(permit);
    r.until(5.0).await;
    let permit = r.h.admit(r.a.clone(), r.t0 + secs(10.0)).await.unwrap();
    assert_eq!(permit.waited_at_bound(), Duration::ZERO);
}

/// Waiting for a wake most of the deadline, then briefly at the bound of the woken model:
/// the deadline is the queue's (503), not the in-flight bound's.
#[tokio::test(start_paused = true)]
async fn deadline_queue_when_servable_only_at_the_end() {
    let r = rig().await;
    // chat-b wakes at 9 s (its plan answers `Later` until then), 32 requests take its slots
    // at once and hold them; one more waited 9 s for the wake and 1 s at the bound.
    r.fake.script_plan(B, Ok(Plan::Later));
    let _running: Vec<Req> = (0..32)
        .map(|_| r.send_full(&r.b, r.t0 + secs(600.0), Hold::Forever))
        .collect();
    r.until(0.0).await;
    let mut late = r.send_full(&r.b, r.t0 + secs(10.0), hold(1.0));
    r.until(9.0).await;
    r.fake.set_state(B, FakeState::Ready);
    r.fake.announce(B).await;
    r.until(9.999).await;
    assert!(late.waiting());
    r.until(10.0).await;
    let (at, e) = late.refused();
    assert_eq!(at, secs(10.0));
    assert_eq!(
        e,
        ApiError::QueueDeadline {
            deployment: B.into()
        }
    );
}

#[tokio::test(start_paused = true)]
async fn no_wait_at_in_flight_bound() {
    let r = rig_with(
        config(|c| c.max_pending_per_deployment = 0),
        FakeTimings::default(),
        1,
    )
    .await;
    let _running: Vec<Req> = (0..32).map(|_| r.send(&r.a, Hold::Forever)).collect();
    r.until(0.0).await;
    let mut q = r.send(&r.a, hold(1.0));
    r.until(0.0).await;
    let (at, e) = q.refused();
    assert_eq!(at, secs(0.0));
    assert_eq!(
        e,
        ApiError::InFlightNoWait {
            deployment: A.into()
        }
    );
    assert_eq!(
        e.message(),
        format!("deployment {A} is at its in-flight bound and lets no request wait; retry shortly")
    );
    assert_eq!(e.retry_after(), Some(1));
}

#[tokio::test(start_paused = true)]
async fn no_wait_not_servable_still_starts_switch() {
    let r = rig_with(
        config(|c| c.max_pending_per_deployment = 0),
        FakeTimings::default(),
        1,
    )
    .await;
    let _a = r.send(&r.a, hold(5.0));
    r.until(1.0).await;
    let mut b = r.send(&r.b, hold(1.0));
    r.until(1.0).await;
    let (at, e) = b.refused();
    assert_eq!(at, secs(1.0));
    assert_eq!(
        e,
        ApiError::NotServableNoWait {
            deployment: B.into()
        }
    );
    assert_eq!(
        e.message(),
        format!("deployment {B} is not servable now and lets no request wait; retry shortly")
    );
    // Its wake was asked for: a switch for a wave of zero, under chat-a's window and drain.
    let plans = r.fake.plans();
    assert_eq!(plans.len(), 1);
    assert_eq!((r.since(plans[0].0), plans[0].1.as_str()), (secs(1.0), B));
    r.until(2.0).await;
    let mut a = r.send(&r.a, hold(0.1));
    r.until(3.5).await;
    assert_eq!(a.admitted_at(), secs(2.0), "still in chat-a's window");
    // The drain: in no-wait mode chat-a is "switching", the 429 with Retry-After.
    let mut closed = r.send(&r.a, hold(0.1));
    r.until(3.5).await;
    let (_, e) = closed.refused();
    assert_eq!(
        e,
        ApiError::NotServableNoWait {
            deployment: A.into()
        }
    );
    assert_eq!(e.retry_after(), Some(1));
    // chat-a's stream ends at 5 s: execute; chat-b ready at 9 s; a retry finds it loaded.
    r.until(9.5).await;
    assert_eq!(r.since(r.fake.executes()[0].0), secs(5.0));
    let mut retry = r.send(&r.b, hold(1.0));
    r.until(9.5).await;
    assert_eq!(retry.admitted_at(), secs(9.5));
}

#[tokio::test(start_paused = true)]
async fn no_wait_during_a_drain_is_the_switching_429_and_asks_for_nothing() {
    let r = rig_with(
        config(|c| c.max_pending_per_deployment = 0),
        FakeTimings::default(),
        1,
    )
    .await;
    // chat-a runs until 4 s; chat-b's no-wait request at 0 s begins a switch: window 0–2 s,
    // drain 2–4 s, park 4–5 s.
    let _a = r.send(&r.a, hold(4.0));
    let _b = r.send(&r.b, hold(1.0));
    r.until(3.0).await;
    let mut during = r.send(&r.a, hold(1.0));
    r.until(3.0).await;
    let (at, e) = during.refused();
    assert_eq!(at, secs(3.0));
    assert_eq!(
        e,
        ApiError::NotServableNoWait {
            deployment: A.into()
        }
    );
    assert_eq!((e.status(), e.retry_after()), (429, Some(1)));
    assert_eq!(r.fake.plans().len(), 1, "no wake asked for chat-a");
    // Once parking has begun, a retry asks for chat-a's wake (the next switch).
    r.until(4.5).await;
    let mut retry = r.send(&r.a, hold(1.0));
    r.until(4.5).await;
    assert!(matches!(
        retry.refused().1,
        ApiError::NotServableNoWait { .. }
    ));
    r.until(8.0).await;
    let plans = r.fake.plans();
    assert_eq!(plans.len(), 2);
    assert_eq!((r.since(plans[1].0), plans[1].1.as_str()), (secs(8.0), A));
}

#[tokio::test(start_paused = true)]
async fn no_wait_operator_stopped_deployment_is_409_and_starts_nothing() {
    let r = rig_with(
        config(|c| c.max_pending_per_deployment = 0),
        FakeTimings::default(),
        1,
    )
    .await;
    let stopped = ApiError::DeploymentStopped {
        deployment: B.into(),
    };
    r.fake.set_refusal(B, Some(stopped.clone()));
    let mut q = r.send(&r.b, hold(1.0));
    r.until(1.0).await;
    let (at, e) = q.refused();
    assert_eq!((at, &e), (secs(0.0), &stopped));
    assert_eq!(
        (e.status(), e.retry_after(), e.retryable()),
        (409, None, false)
    );
    assert!(r.fake.plans().is_empty());
}

#[tokio::test(start_paused = true)]
async fn no_wait_refused_deployment_starts_nothing() {
    let r = rig_with(
        config(|c| c.max_pending_per_deployment = 0),
        FakeTimings::default(),
        1,
    )
    .await;
    let inactive = ApiError::DeploymentInactive {
        deployment: B.into(),
    };
    r.fake.set_refusal(B, Some(inactive.clone()));
    let mut q = r.send(&r.b, hold(1.0));
    r.until(1.0).await;
    let (_, e) = q.refused();
    assert_eq!(e, inactive);
    assert_eq!(e.status(), 409);
    assert!(r.fake.plans().is_empty());
}

#[tokio::test(start_paused = true)]
async fn plan_error_fails_the_wave() {
    let r = rig().await;
    let e = ApiError::ParkedCapacity {
        deployment: A.into(),
    };
    r.fake.script_plan(B, Err(e.clone()));
    let mut qs: Vec<Req> = (0..2).map(|_| r.send(&r.b, hold(1.0))).collect();
    r.until(0.0).await;
    for q in qs.iter_mut() {
        assert_eq!(q.refused(), (secs(0.0), e.clone()));
    }
    let load = r.h.load().await;
    assert_eq!(
        load.iter().find(|l| l.deployment_id == B).unwrap().waiting,
        0
    );
}

#[tokio::test(start_paused = true)]
async fn every_request_ends_once_under_churn() {
    // Many requests for three deployments with short deadlines and hang-ups: every one is
    // answered (or hung up) by its deadline, and nothing is left charged or waiting.
    let r = rig_with(
        config(|c| c.max_pending_per_deployment = 8),
        FakeTimings::default(),
        1,
    )
    .await;
    let mut reqs = Vec::new();
    let mut deadlines = Vec::new();
    let mut hung_up = Vec::new();
    for i in 0..60u32 {
        let dep = [&r.a, &r.b, &r.c][(i % 3) as usize].clone();
        let deadline = tokio::time::Instant::now() + secs(4.0 + f64::from(i % 7));
        reqs.push(r.send_full(&dep, deadline, hold(0.3)));
        deadlines.push(deadline - r.t0);
        if i.is_multiple_of(11) {
            let victim = i as usize / 2;
            // Hung up now: unless it was answered already, it never is.
            if reqs[victim].waiting() {
                hung_up.push(victim);
            }
            reqs[victim].end();
        }
        r.until(f64::from(i) * 0.25).await;
    }
    r.until(200.0).await;
    let mut answered = 0;
    for (i, q) in reqs.iter_mut().enumerate() {
        if hung_up.contains(&i) {
            continue;
        }
        assert!(!q.waiting(), "request {i} never ended");
        let (at, result) = q.answered();
        assert!(
            at <= deadlines[i],
            "request {i} answered at {at:?}, past its deadline {:?}: {result:?}",
            deadlines[i]
        );
        answered += 1;
    }
    assert!(answered >= 50, "only {answered} answered");
    for l in r.h.load().await {
        assert_eq!((l.in_flight, l.waiting), (0, 0), "{l:?}");
    }
}
