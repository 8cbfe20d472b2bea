//! The operator's leadership rules through the lifecycle and the router (see
//! `lifecycle/DESIGN.md`, "Leadership on Kubernetes"), against the in-memory simulated host agent
//! on tokio's paused clock: switches held (hold-over) refuse at once what needs a switch, the
//! ones already waiting included, and serve what is ready; a fence keeps an adopted ready
//! instance from being a victim until its end, when a waiting request is switched at once.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use capyctl_interfaces::router::{DrainReport, Lifecycle, Plan, PlanFor, SwitchOrder};
use capyctl_lifecycle::api::ManagementApi;
use capyctl_lifecycle::store::MemoryStore;
use capyctl_lifecycle::{Core, LifecycleConfig};
use capyctl_router::admission::Admission;
use capyctl_router::config::RouterConfig;
use capyctl_router::coordinator::CoordinatorHandle;
use capyctl_server::assembly::assemble;
use capyctl_spec::InstanceState;
use capyctl_spec::api::StartRequest;
use capyctl_spec::documents::parse_deployment_str;
use capyctl_spec::errors::ApiError;
use capyctl_test_support::SimHost;
use tokio::time::Instant;

/// A lifecycle on one 10 GiB simulated host with its router, and `x` and `y` (6 GiB each)
/// deployed, `x` ready.
async fn lifecycle() -> (Arc<Core>, CoordinatorHandle) {
    let server = Core::open(
        Arc::new(SimHost::new()),
        Arc::new(MemoryStore::default()),
        LifecycleConfig::new("h"),
    )
    .await
    .unwrap();
    let router = assemble(&server, server.clone(), RouterConfig::default(), None)
        .await
        .router;
    for name in ["x", "y"] {
        let doc = parse_deployment_str(
            "t.yaml",
            &format!("name: {name}\nengine: vllm\nmodel: m\nresources: {{gpu_memory: 6GiB}}\n"),
        )
        .unwrap();
        server.deploy(doc).await.unwrap();
    }
    let wait = StartRequest {
        evict: false,
        wait: true,
    };
    server.start("x", wait).await.unwrap();
    (server, router)
}

fn held() -> ApiError {
    ApiError::Unavailable {
        detail: "the Kubernetes API server cannot be reached; this replica serves ready models only until it can renew its leadership; retry shortly".into(),
        retry_after: 2,
    }
}

async fn state_of(s: &Core, name: &str) -> InstanceState {
    s.get(name).await.unwrap().state
}

#[tokio::test(start_paused = true)]
async fn held_switches_serve_the_ready_model_and_refuse_the_rest_at_once_waiters_included() {
    let (s, router) = lifecycle().await;
    let deadline = Instant::now() + Duration::from_secs(600);
    // A request for `y` waits (its switch parks `x`: the admission window first) when the
    // hold begins: it is refused then, not at its deadline.
    let waiting = {
        let router = router.clone();
        tokio::spawn(async move {
            let y = router.resolve("y").unwrap();
            router.admit(y, deadline).await.map(|_| ())
        })
    };
    tokio::task::yield_now().await;
    s.hold_switches(held()).await;
    let began = Instant::now();
    let e = waiting.await.unwrap().unwrap_err();
    assert_eq!((e.status(), e.code()), (503, "unavailable"), "{e:?}");
    assert!(e.message().contains("API server cannot be reached"), "{e}");
    assert!(
        began.elapsed() < Duration::from_secs(1),
        "{:?}",
        began.elapsed()
    );
    // The ready model serves; a new request for `y` is refused at once.
    let x = router.resolve("x").unwrap();
    drop(router.admit(x, deadline).await.unwrap());
    let y = router.resolve("y").unwrap();
    let e = router.admit(y.clone(), deadline).await.unwrap_err();
    assert_eq!(e.retry_after(), Some(2));
    // Operator commands that change something: refused, nothing changed.
    assert_eq!(s.park("x").await.unwrap_err().code(), "unavailable");
    assert_eq!(s.stop("x").await.unwrap_err().code(), "unavailable");
    let evict = StartRequest {
        evict: true,
        wait: false,
    };
    assert_eq!(s.start("y", evict).await.unwrap_err().code(), "unavailable");
    assert_eq!(state_of(&s, "x").await, InstanceState::Ready);
    assert!(!s.get("x").await.unwrap().operator_stopped);
    // Resumed: the request switches.
    s.resume_switches().await;
    drop(router.admit(y, deadline).await.unwrap());
    assert_eq!(state_of(&s, "y").await, InstanceState::Ready);
    assert_eq!(state_of(&s, "x").await, InstanceState::Parked);
}

#[tokio::test(start_paused = true)]
async fn a_fenced_instance_is_no_victim_until_the_fence_ends_then_the_waiter_is_switched() {
    let (s, router) = lifecycle().await;
    let fence = Instant::now() + Duration::from_secs(90);
    assert_eq!(s.fence(fence).await, ["x"]);
    // The fenced model serves; a park of it is refused naming the fence.
    let deadline = Instant::now() + Duration::from_secs(600);
    let x = router.resolve("x").unwrap();
    drop(router.admit(x, deadline).await.unwrap());
    let e = s.park("x").await.unwrap_err();
    assert_eq!((e.status(), e.code()), (503, "unavailable"));
    assert!(e.message().contains("previous leader"), "{e}");
    // A request for `y` needs `x`'s memory: it waits for the fence's end, and is switched
    // then (the fence's end is an event), long before its deadline.
    let y = router.resolve("y").unwrap();
    let admitted = router.admit(y, deadline).await.unwrap();
    let at = Instant::now();
    assert!(at >= fence, "switched before the fence ended");
    assert!(
        at < fence + Duration::from_secs(10),
        "{:?} late",
        at - fence
    );
    drop(admitted);
    assert_eq!(state_of(&s, "y").await, InstanceState::Ready);
    assert_eq!(state_of(&s, "x").await, InstanceState::Parked);
}

/// A switch the router drained before the hold began is not carried out: it fails with the
/// hold's refusal, its victim stays ready and unreserved (it serves on), its target unclaimed.
#[tokio::test(start_paused = true)]
async fn a_switch_drained_before_the_hold_is_not_carried_out() {
    let (s, _router) = lifecycle().await;
    let y = s.get("y").await.unwrap().id;
    let plan = s.plan(&y, &Default::default(), PlanFor::Requests).await;
    // The router's order once `x` is drained (no window, no drain on the paused clock).
    let order = match plan.unwrap() {
        Plan::Switch {
            switch_id, victims, ..
        } => SwitchOrder {
            victims: victims
                .into_iter()
                .map(|k| (k, DrainReport::default()))
                .collect(),
            window: Duration::ZERO,
            drain: Duration::ZERO,
            operator: false,
            target: y,
            switch_id,
            began: tokio::time::Instant::now(),
            wave: 1,
        },
        other => panic!("a switch: {other:?}"),
    };
    s.hold_switches(held()).await;
    let e = s.execute(order).await.unwrap_err();
    assert_eq!(e.code(), "unavailable");
    assert_eq!(state_of(&s, "x").await, InstanceState::Ready);
    assert_eq!(state_of(&s, "y").await, InstanceState::Stopped);
    // Nothing is left reserved: once resumed, `x` parks on the operator's word.
    s.resume_switches().await;
    s.park("x").await.unwrap();
}
