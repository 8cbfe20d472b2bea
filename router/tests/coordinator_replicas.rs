//! Several instances of one deployment (DESIGN 4.7): the 32 running requests are per instance,
//! a request waits only when every open instance runs its 32, least_loaded counts the engine's
//! fresh waiting count, and `prefix` keeps prompts that share a prefix on one instance while its
//! load stays within the bound. Under tokio's paused clock, with the fake lifecycle.
#![allow(clippy::unwrap_used)]

mod coordinator_support;

use std::sync::Arc;
use std::time::Duration;

use capyctl_interfaces::router::DeploymentRef;
use capyctl_router::admission::{Admission, Permit};
use capyctl_router::config::RouterConfig;
use capyctl_router::coordinator::testing::{FakeLifecycle, FakeState, FakeTimings};
use capyctl_router::coordinator::{CoordinatorHandle, CoordinatorPermit, DeploymentLoad};
use capyctl_spec::Routing;
use capyctl_spec::errors::ApiError;
use coordinator_support::{A, quiesce};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// `chat-a` with `instances` instances, none announced yet.
async fn replicas(instances: u32) -> (Arc<FakeLifecycle>, CoordinatorHandle, DeploymentRef) {
    let fake = FakeLifecycle::new(FakeTimings::default());
    let a = fake.add(A, "chat-a", FakeState::Ready, instances);
    let h = fake.spawn(RouterConfig::default());
    quiesce().await;
    (fake, h, a)
}

/// An admission running as a task (it may wait).
struct Ask(JoinHandle<Result<CoordinatorPermit, ApiError>>);

impl Ask {
    fn new(h: &CoordinatorHandle, dep: &DeploymentRef, prefix: Option<u64>) -> Self {
        let (h, dep) = (h.clone(), dep.clone());
        let deadline = Instant::now() + Duration::from_secs(600);
        Ask(tokio::spawn(async move {
            h.admit_routed(dep, deadline, prefix).await
        }))
    }

    fn waiting(&self) -> bool {
        !self.0.is_finished()
    }

    /// The permit of an admission that has been answered (panics otherwise).
    async fn permit(self) -> CoordinatorPermit {
        assert!(self.0.is_finished(), "still waiting");
        self.0.await.unwrap().unwrap()
    }
}

/// Admits `n` requests (at once: each must be answered without waiting) and keeps them.
async fn admit_n(
    h: &CoordinatorHandle,
    dep: &DeploymentRef,
    n: usize,
    prefix: Option<u64>,
) -> Vec<CoordinatorPermit> {
    let mut held = Vec::new();
    for _ in 0..n {
        let ask = Ask::new(h, dep, prefix);
        quiesce().await;
        held.push(ask.permit().await);
    }
    held
}

/// How many of `held` run on the instance with `index` (the fake's port is 9000 + index).
fn on(held: &[CoordinatorPermit], index: u16) -> usize {
    held.iter()
        .filter(|p| p.upstream().addr.port() == 9000 + index)
        .count()
}

/// Ends one of `held` running on the instance with `index`.
async fn end_one(held: &mut Vec<CoordinatorPermit>, index: u16) {
    let at = held
        .iter()
        .position(|p| p.upstream().addr.port() == 9000 + index)
        .unwrap();
    drop(held.remove(at));
    quiesce().await;
}

async fn load(h: &CoordinatorHandle) -> DeploymentLoad {
    h.load_of(A).await.unwrap()
}

#[tokio::test(start_paused = true)]
async fn the_bound_is_32_per_instance_and_the_load_read_says_so() {
    let (fake, h, a) = replicas(2).await;
    fake.announce(A).await;
    quiesce().await;
    assert_eq!(load(&h).await.in_flight_limit, 64);

    // 64 at once: none waits, 32 on each.
    let mut held = admit_n(&h, &a, 64, None).await;
    assert_eq!((on(&held, 0), on(&held, 1)), (32, 32));
    let l = load(&h).await;
    assert_eq!((l.in_flight, l.in_flight_limit, l.waiting), (64, 64, 0));
    assert!(l.instances.iter().all(|i| i.router_in_flight == 32));

    // The 65th waits: every open instance runs its 32.
    let next = Ask::new(&h, &a, None);
    quiesce().await;
    assert!(next.waiting());
    assert_eq!(load(&h).await.waiting, 1);

    // A request ends on instance 1: the waiter takes that slot.
    end_one(&mut held, 1).await;
    let p = next.permit().await;
    assert_eq!(p.upstream().addr.port(), 9001);
    held.push(p);
    let l = load(&h).await;
    assert_eq!((l.in_flight, l.waiting), (64, 0));

    // One instance goes: the bound is 32 again.
    h.instance_gone(fake.key(A, 1)).await;
    quiesce().await;
    assert_eq!(load(&h).await.in_flight_limit, 32);
}

#[tokio::test(start_paused = true)]
async fn a_request_never_waits_behind_a_busy_instance_when_another_has_room() {
    let (fake, h, a) = replicas(2).await;
    h.instance_ready(fake.upstream(A, 0)).await;
    quiesce().await;
    // Instance 0 alone: 32 run (on lent slots), the 33rd waits.
    let mut held = admit_n(&h, &a, 32, None).await;
    let waiter = Ask::new(&h, &a, None);
    quiesce().await;
    assert!(waiter.waiting());
    assert_eq!(load(&h).await.in_flight_limit, 32);

    // Instance 1 opens: the waiter goes to it at once, and so do the next 31 (instance 0 is
    // still full); the one after waits.
    h.instance_ready(fake.upstream(A, 1)).await;
    quiesce().await;
    let p = waiter.permit().await;
    assert_eq!(p.upstream().addr.port(), 9001);
    held.push(p);
    held.extend(admit_n(&h, &a, 31, None).await);
    assert_eq!((on(&held, 0), on(&held, 1)), (32, 32));
    let last = Ask::new(&h, &a, None);
    quiesce().await;
    assert!(last.waiting());
    let l = load(&h).await;
    assert_eq!((l.in_flight, l.in_flight_limit, l.waiting), (64, 64, 1));

    // Instance 0 finishes everything: the waiter goes there, not behind instance 1.
    let (zero, one): (Vec<_>, Vec<_>) = held
        .into_iter()
        .partition(|p| p.upstream().addr.port() == 9000);
    drop(zero);
    quiesce().await;
    assert_eq!(last.permit().await.upstream().addr.port(), 9000);
    drop(one);
}

#[tokio::test(start_paused = true)]
async fn requests_on_a_gone_instance_take_no_slot_of_the_new_one() {
    let (fake, h, a) = replicas(2).await;
    h.instance_ready(fake.upstream(A, 0)).await;
    quiesce().await;
    let old = admit_n(&h, &a, 5, None).await;
    // The instance goes (a crash) while 5 are still charged to it; another opens alone.
    h.instance_gone(fake.key(A, 0)).await;
    h.instance_ready(fake.upstream(A, 1)).await;
    quiesce().await;
    // Its 32 slots are all free (lent: one instance).
    let new = admit_n(&h, &a, 32, None).await;
    assert_eq!(on(&new, 1), 32);
    let next = Ask::new(&h, &a, None);
    quiesce().await;
    assert!(next.waiting());
    let l = load(&h).await;
    assert_eq!((l.in_flight, l.in_flight_limit, l.waiting), (37, 32, 1));
    // An end on the gone instance frees nothing here.
    drop(old);
    quiesce().await;
    assert!(next.waiting());
    drop(new);
    quiesce().await;
    assert_eq!(next.permit().await.upstream().addr.port(), 9001);
}

#[tokio::test(start_paused = true)]
async fn least_loaded_counts_a_fresh_engine_waiting_count_and_not_a_stale_one() {
    let (fake, h, a) = replicas(2).await;
    fake.announce(A).await;
    quiesce().await;
    // Instance 0's engine has 10 waiting (sampled now): the next 10 go to instance 1.
    assert!(h.note_engine_load(fake.key(A, 0), 10, Instant::now()));
    quiesce().await;
    let mut held = admit_n(&h, &a, 10, None).await;
    assert_eq!((on(&held, 0), on(&held, 1)), (0, 10));
    // 0 + 10 against 10 + 0: a tie, to the fewer router requests: instance 0.
    held.extend(admit_n(&h, &a, 1, None).await);
    assert_eq!((on(&held, 0), on(&held, 1)), (1, 10));

    // An older sample than the one kept changes nothing.
    let older = Instant::now() - Duration::from_secs(1);
    assert!(h.note_engine_load(fake.key(A, 0), 0, older));
    quiesce().await;
    held.extend(admit_n(&h, &a, 1, None).await);
    assert_eq!((on(&held, 0), on(&held, 1)), (1, 11), "1 + 10 > 11 + 0");

    // 3 s on (the load read's stale_after_ms) the sample counts as 0: the router's own
    // counts decide.
    tokio::time::sleep(Duration::from_millis(2999)).await;
    quiesce().await;
    // Still fresh 1 ms before: 1 + 10 against 11 is a tie (to instance 0), then 2 + 10
    // against 11 (to instance 1); were it stale, both would go to instance 0.
    held.extend(admit_n(&h, &a, 2, None).await);
    assert_eq!((on(&held, 0), on(&held, 1)), (2, 12));
    tokio::time::sleep(Duration::from_millis(1)).await;
    quiesce().await;
    held.extend(admit_n(&h, &a, 10, None).await);
    assert_eq!((on(&held, 0), on(&held, 1)), (12, 12));
}

#[tokio::test(start_paused = true)]
async fn prefix_keeps_a_prompt_on_one_instance_within_the_bound() {
    let (fake, h, _) = replicas(4).await;
    let a = fake.set_routing(A, Routing::Prefix);
    fake.announce(A).await;
    quiesce().await;

    // Others' load first (no prompt: least_loaded): 8 on each.
    let held = admit_n(&h, &a, 32, None).await;
    assert_eq!(
        (0..4).map(|i| on(&held, i)).collect::<Vec<_>>(),
        [8, 8, 8, 8]
    );

    // One prefix: its requests go to one instance while it is below the bound
    // ceil(1.25 × (total + 1) / 4): 8 → 12 (at total 35 the bound is 12).
    let key = 0x1234_5678_9abc_def0;
    let sticky = admit_n(&h, &a, 4, Some(key)).await;
    let home = sticky[0].upstream().addr.port() - 9000;
    assert_eq!(on(&sticky, home), 4);

    // Then it spills to the next instance on the ring, and the next, never past the bound:
    // of 12 more, home takes 3 (to 15), the next 7 (to 15), the third 2 (to 10), the fourth
    // none (the bound at 47 in all is 15).
    let more = admit_n(&h, &a, 12, Some(key)).await;
    let mut loads: Vec<usize> = (0..4)
        .map(|i| on(&held, i) + on(&sticky, i) + on(&more, i))
        .collect();
    assert_eq!(loads[usize::from(home)], 15);
    assert_eq!((0..4).filter(|i| on(&more, *i) > 0).count(), 3);
    loads.sort_unstable();
    assert_eq!(loads, [8, 10, 15, 15]);
    drop(more);
    drop(sticky);

    // A deployment routed least_loaded ignores a prefix key: it spreads.
    let plain = fake.set_routing(A, Routing::LeastLoaded);
    drop(held);
    quiesce().await;
    let spread = admit_n(&h, &plain, 8, Some(key)).await;
    assert_eq!(
        (0..4).map(|i| on(&spread, i)).collect::<Vec<_>>(),
        [2, 2, 2, 2]
    );
}

#[tokio::test(start_paused = true)]
async fn prefix_spreads_different_prompts_and_a_waiter_keeps_its_key() {
    let (fake, h, _) = replicas(2).await;
    let a = fake.set_routing(A, Routing::Prefix);
    fake.announce(A).await;
    quiesce().await;
    // Both full: 64 with many prefixes (spread over both).
    let mut held = Vec::new();
    for k in 0..64u64 {
        held.extend(admit_n(&h, &a, 1, Some(k.wrapping_mul(0x9e37_79b9_7f4a_7c15))).await);
    }
    assert_eq!((on(&held, 0), on(&held, 1)), (32, 32));
    // A waiter with a prefix gets whichever instance frees a slot (FIFO, never stuck behind
    // its home instance while the other has room).
    let waiter = Ask::new(&h, &a, Some(7));
    quiesce().await;
    assert!(waiter.waiting());
    end_one(&mut held, 0).await;
    let first = waiter.permit().await;
    assert_eq!(first.upstream().addr.port(), 9000);
    let waiter = Ask::new(&h, &a, Some(7));
    quiesce().await;
    assert!(waiter.waiting());
    end_one(&mut held, 1).await;
    assert_eq!(waiter.permit().await.upstream().addr.port(), 9001);
    drop(first);
}

#[tokio::test(start_paused = true)]
async fn waiters_end_when_the_last_open_instance_goes_while_another_drains() {
    let (fake, h, a) = replicas(2).await;
    fake.announce(A).await;
    quiesce().await;
    // Both full; a waiter.
    let held = admit_n(&h, &a, 64, None).await;
    let waiter = Ask::new(&h, &a, None);
    quiesce().await;
    assert!(waiter.waiting());
    // Instance 0 is released (a scale-down, an operator's park): it drains its 32; the
    // waiter still waits for instance 1's slots.
    let release = {
        let (h, key) = (h.clone(), fake.key(A, 0));
        tokio::spawn(async move { h.release(vec![key]).await })
    };
    quiesce().await;
    assert!(waiter.waiting());
    // Instance 1 crashes: no open instance is left, so the waiter ends as one that comes
    // now does (503 unavailable), not at its deadline.
    h.instance_gone(fake.key(A, 1)).await;
    quiesce().await;
    let closed = ApiError::DispatchClosed {
        deployment: A.into(),
    };
    assert!(!waiter.waiting());
    assert_eq!(waiter.0.await.unwrap().unwrap_err(), closed);
    let now = Ask::new(&h, &a, None);
    quiesce().await;
    assert_eq!(now.0.await.unwrap().unwrap_err(), closed);
    // Instance 0's requests ran on; its drain ends with them.
    assert!(!release.is_finished());
    drop(held);
    quiesce().await;
    assert!(release.await.unwrap().is_ok());
}

#[tokio::test(start_paused = true)]
async fn an_adapter_request_goes_where_its_adapter_is_loaded_while_that_has_room() {
    let (fake, h, a) = replicas(2).await;
    fake.announce(A).await;
    quiesce().await;
    // Instance 1 has the adapter; instance 0 is idle and instance 1 runs 5: still instance 1.
    let mut held = admit_n(&h, &a, 10, None).await;
    for _ in 0..5 {
        end_one(&mut held, 0).await;
    }
    assert_eq!((on(&held, 0), on(&held, 1)), (0, 5));
    let ask = |h: &CoordinatorHandle, prefer: Vec<_>| {
        let (h, dep) = (h.clone(), a.clone());
        let deadline = Instant::now() + Duration::from_secs(600);
        Ask(tokio::spawn(async move {
            h.admit_preferring(dep, deadline, None, None, prefer).await
        }))
    };
    let loaded_on_1 = vec![fake.key(A, 1)];
    for _ in 0..27 {
        let p = ask(&h, loaded_on_1.clone());
        quiesce().await;
        held.push(p.permit().await);
    }
    assert_eq!((on(&held, 0), on(&held, 1)), (0, 32));
    // Instance 1 is full: the least loaded (instance 0), not a wait.
    let p = ask(&h, loaded_on_1.clone());
    quiesce().await;
    assert_eq!(p.permit().await.upstream().addr.port(), 9000);
    // Without a preference: the least loaded, as before.
    end_one(&mut held, 1).await;
    let p = Ask::new(&h, &a, None);
    quiesce().await;
    assert_eq!(p.permit().await.upstream().addr.port(), 9000);
    // Loaded on an instance that is gone: the least loaded.
    let p = ask(&h, vec![fake.key(A, 7)]);
    quiesce().await;
    assert_eq!(p.permit().await.upstream().addr.port(), 9000);
}
