//! An operator's switch (`start --evict`, `CoordinatorHandle::operator_start`): a switch like a
//! wave's, ordered by the operator, through the one owner of switches. It takes the switch slot
//! in turn, protects the deployments with waiting requests (decided in the owner), has no
//! admission window, drains its victims as a switch does, and answers the operator with the
//! lifecycle's execute (or the error that ended it).
#![allow(clippy::unwrap_used)]

mod coordinator_support;

use std::time::Duration;

use capyctl_interfaces::router::Plan;
use capyctl_router::coordinator::{OperatorResult, OperatorStart};
use capyctl_spec::api::Released;
use capyctl_spec::errors::ApiError;
use coordinator_support::*;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Submits an operator's `start --evict` of `deployment`; the task answers when (since `t0`)
/// and what.
fn operator_start(r: &Rig, deployment: &str) -> JoinHandle<(Duration, OperatorResult)> {
    let h = r.h.clone();
    let t0 = r.t0;
    let deployment = deployment.to_string();
    tokio::spawn(async move {
        let out = h.operator_start(deployment).await;
        (Instant::now() - t0, out)
    })
}

/// The victims an operator's switch released (`deployment_id`, how), or panics.
fn released(out: &OperatorResult) -> Vec<(String, Released)> {
    match out {
        Ok(OperatorStart::Switched { executed, .. }) => executed
            .released
            .iter()
            .map(|v| (v.deployment_id.clone(), v.released))
            .collect(),
        other => panic!("not switched: {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn an_operator_switch_waits_for_the_switch_in_progress() {
    let r = rig().await;
    // A wave for chat-b: its switch holds the slot from 0 s (window until 2 s, park 1 s, wake
    // 3 s: chat-b opens at 6 s).
    let mut b = r.send(&r.b, hold(1.0));
    r.until(1.0).await;
    let op = operator_start(&r, C);
    r.until(5.9).await;
    assert!(
        r.fake.operator_plans().is_empty(),
        "no second switch while one runs"
    );
    r.until(6.0).await;
    assert_eq!(b.admitted_at(), secs(6.0));
    let plans = r.fake.operator_plans();
    assert_eq!(plans.len(), 1);
    assert_eq!(
        r.since(plans[0].0),
        secs(6.0),
        "planned once the slot freed"
    );
    // Its victim is chat-b, which has no waiters any more: drained (its request ends at 7 s),
    // then parked (1 s).
    let (at, out) = op.await.unwrap();
    assert_eq!(at, secs(8.0));
    assert_eq!(released(&out), [(B.to_string(), Released::Parked)]);
    let executes = r.fake.executes();
    assert_eq!(executes.len(), 2);
    assert!(!executes[0].1.operator && executes[1].1.operator);
    assert_eq!(r.since(executes[1].0), secs(7.0));
}

#[tokio::test(start_paused = true)]
async fn a_wave_waits_for_an_operator_switch_in_progress() {
    let r = rig().await;
    let _a = r.send(&r.a, hold(3.0));
    r.until(0.5).await;
    let op = operator_start(&r, C);
    r.until(1.0).await;
    // chat-a drains until 3 s, is parked by 4 s; chat-c's start then runs in the lifecycle.
    let mut b = r.send(&r.b, hold(1.0));
    r.until(3.9).await;
    assert_eq!(r.fake.plans().len(), 1, "the wave is not planned meanwhile");
    let (at, out) = op.await.unwrap();
    assert_eq!(at, secs(4.0));
    assert_eq!(released(&out), [(A.to_string(), Released::Parked)]);
    r.until(4.0).await;
    let plans = r.fake.plans();
    assert_eq!(plans.len(), 2);
    assert_eq!((r.since(plans[1].0), plans[1].1.as_str()), (secs(4.0), B));
    assert!(b.waiting());
}

#[tokio::test(start_paused = true)]
async fn an_operator_switch_protects_the_deployments_with_waiting_requests() {
    let r = rig().await;
    // chat-b's requests wait (its plan says `Later`), so chat-b is never a victim.
    r.fake.script_plan(B, Ok(Plan::Later));
    let mut b = r.send(&r.b, hold(1.0));
    r.until(1.0).await;
    assert!(b.waiting());
    let op = operator_start(&r, C);
    r.until(1.0).await;
    let plans = r.fake.operator_plans();
    assert_eq!(plans.len(), 1);
    assert_eq!(plans[0].1, C);
    assert!(plans[0].2.contains(B), "{:?}", plans[0].2);
    assert!(!plans[0].2.contains(A), "chat-a has no waiting requests");
    let (_, out) = op.await.unwrap();
    assert_eq!(released(&out), [(A.to_string(), Released::Parked)]);
}

#[tokio::test(start_paused = true)]
async fn an_operator_switch_has_no_admission_window_and_drains_its_victims() {
    let r = rig().await;
    let _running = r.send(&r.a, hold(5.0));
    r.until(1.0).await;
    let op = operator_start(&r, C);
    r.until(1.0).await;
    // No window: chat-a closes as soon as the plan is there (a wave's would keep it open
    // until 3 s): a new request for it is answered 503 at once.
    let mut late = r.send(&r.a, hold(1.0));
    r.until(1.0).await;
    assert_eq!(
        late.refused(),
        (
            secs(1.0),
            ApiError::DispatchClosed {
                deployment: A.into()
            }
        )
    );
    // Its running request finishes (5 s) before the order is executed; then the park (1 s).
    r.until(4.9).await;
    assert!(r.fake.executes().is_empty(), "nothing is cut off");
    let (at, out) = op.await.unwrap();
    assert_eq!(at, secs(6.0));
    assert_eq!(released(&out), [(A.to_string(), Released::Parked)]);
    let executes = r.fake.executes();
    let (when, order) = &executes[0];
    assert_eq!(r.since(*when), secs(5.0));
    assert!(order.operator);
    assert_eq!((order.window, order.drain), (secs(0.0), secs(4.0)));
    assert_eq!(order.victims.len(), 1);
    assert_eq!(order.victims[0].0, r.fake.key(A, 0));
}

#[tokio::test(start_paused = true)]
async fn an_operator_switch_whose_drain_times_out_answers_the_error_and_the_victim_serves_again() {
    let r = rig().await;
    let _stuck = r.send(&r.a, hold(100.0));
    r.until(1.0).await;
    let op = operator_start(&r, C);
    let (at, out) = op.await.unwrap();
    assert_eq!(at, secs(31.0));
    assert_eq!(
        out.unwrap_err(),
        ApiError::DrainTimeout {
            deployment: C.into(),
            drain_ms: 30_000,
            charged: 1
        }
    );
    assert_eq!(r.fake.abandons().len(), 1);
    assert!(r.fake.executes().is_empty());
    let mut a = r.send(&r.a, hold(1.0));
    r.until(31.0).await;
    assert_eq!(a.admitted_at(), secs(31.0), "serves again");
}

#[tokio::test(start_paused = true)]
async fn an_operator_switch_answers_the_error_of_its_plan_or_its_execute() {
    let r = rig().await;
    let full = ApiError::DoesNotFit {
        deployment: C.into(),
        detail: "it needs more than the GPU has".into(),
    };
    r.fake.script_plan(C, Err(full.clone()));
    let (at, out) = operator_start(&r, C).await.unwrap();
    assert_eq!((at, out.unwrap_err()), (secs(0.0), full));
    // The slot is free again: the next one plans, and its execute fails.
    let failed = ApiError::EngineFailed {
        deployment: A.into(),
        detail: "start --evict of chat-c could not stop chat-a".into(),
    };
    r.fake.fail_execute(C, failed.clone());
    let (at, out) = operator_start(&r, C).await.unwrap();
    assert_eq!((at, out.unwrap_err()), (secs(1.0), failed));
    // A wave after it is planned as usual.
    let _b = r.send(&r.b, hold(1.0));
    r.until(1.0).await;
    assert_eq!(r.fake.plans().len(), 3);
}

#[tokio::test(start_paused = true)]
async fn an_operator_switch_without_room_or_to_a_ready_deployment_says_so() {
    let r = rig().await;
    r.fake.script_plan(C, Ok(Plan::Later));
    let (_, out) = operator_start(&r, C).await.unwrap();
    assert!(matches!(out, Ok(OperatorStart::Later)), "{out:?}");
    let (_, out) = operator_start(&r, A).await.unwrap();
    assert!(matches!(out, Ok(OperatorStart::AlreadyComing)), "{out:?}");
}

/// Replicas: an operator's switch to a deployment that already serves (one of its instances is
/// open) goes on when the lifecycle plans one (another instance to bring up, for `start
/// --evict` of every replica): it is carried out, not given back as "already coming".
#[tokio::test(start_paused = true)]
async fn an_operator_switch_to_a_deployment_that_serves_goes_on_when_planned() {
    let r = rig().await;
    r.fake.script_plan(
        A,
        Ok(Plan::BringUp {
            switch_id: "sw-more".to_string(),
        }),
    );
    let op = operator_start(&r, A);
    r.until(1.0).await;
    let (_, out) = op.await.unwrap();
    assert!(
        matches!(out, Ok(OperatorStart::Switched { ref switch_id, .. }) if switch_id == "sw-more"),
        "{out:?}"
    );
    assert!(r.fake.abandons().is_empty(), "{:?}", r.fake.abandons());
    assert_eq!(r.fake.executes().len(), 1);
}
