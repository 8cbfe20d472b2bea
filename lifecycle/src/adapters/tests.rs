//! The adapter owner's rules under tokio's paused clock, over a scripted engine: least recently
//! used unloaded first, busy adapters kept, loads serialized per instance, one load for every
//! request waiting for it, waits bounded by the deadline and the waiting limit, failures that
//! change nothing else, the engine's list after a reset, and adapters deleted or given new files
//! while requests run on them (unloaded once those end).
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use capyctl_interfaces::BoxFuture;
use capyctl_interfaces::router::{AdapterRoute, InstanceKey};
use capyctl_spec::errors::ApiError;
use tokio::time::Instant;

use super::{Adapters, Engines, Retired};

const LOAD: Duration = Duration::from_millis(40);
const LONG: Duration = Duration::from_secs(600);

/// An engine whose loads take [`LOAD`], that refuses the adapters named in `refuse`, and
/// records every call and how many ran at once.
#[derive(Default)]
struct Script {
    calls: Mutex<Vec<String>>,
    loaded: Mutex<BTreeSet<String>>,
    refuse: Mutex<BTreeSet<String>>,
    running: AtomicUsize,
    most_at_once: AtomicUsize,
}

impl Script {
    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }

    async fn op(&self, call: String) {
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_at_once.fetch_max(now, Ordering::SeqCst);
        self.calls.lock().unwrap().push(call);
        tokio::time::sleep(LOAD).await;
        self.running.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Engines for Script {
    fn list<'a>(&'a self, _: &'a InstanceKey) -> BoxFuture<'a, Result<Vec<String>, ApiError>> {
        Box::pin(async move {
            self.calls.lock().unwrap().push("list".into());
            Ok(self.loaded.lock().unwrap().iter().cloned().collect())
        })
    }

    fn load<'a>(
        &'a self,
        _: &'a InstanceKey,
        adapter: &'a AdapterRoute,
    ) -> BoxFuture<'a, Result<(), ApiError>> {
        Box::pin(async move {
            self.op(format!("load {}", adapter.name)).await;
            if self.refuse.lock().unwrap().contains(&adapter.name) {
                return Err(ApiError::AdapterLoadFailed {
                    adapter: adapter.name.clone(),
                    reason: "the engine answered 400: No adapter found".into(),
                });
            }
            self.loaded.lock().unwrap().insert(adapter.name.clone());
            Ok(())
        })
    }

    fn unload<'a>(
        &'a self,
        _: &'a InstanceKey,
        name: &'a str,
    ) -> BoxFuture<'a, Result<(), ApiError>> {
        Box::pin(async move {
            self.op(format!("unload {name}")).await;
            self.loaded.lock().unwrap().remove(name);
            Ok(())
        })
    }
}

fn key(generation: u64) -> InstanceKey {
    InstanceKey {
        deployment: "base".into(),
        index: 0,
        host_id: "h".into(),
        generation,
    }
}

fn route(name: &str, max_loaded: u32) -> AdapterRoute {
    AdapterRoute {
        id: format!("id-{name}"),
        name: name.into(),
        path: format!("/loras/{name}"),
        base: "base".into(),
        max_loaded,
        request_field: None,
    }
}

fn setup() -> (Arc<Script>, Arc<Adapters>) {
    let script = Arc::new(Script::default());
    let adapters = Adapters::new(script.clone());
    (script, adapters)
}

fn deadline() -> Instant {
    Instant::now() + LONG
}

#[tokio::test(start_paused = true)]
async fn the_least_recently_used_idle_adapter_is_unloaded_first() {
    let (script, a) = setup();
    let k = key(1);
    let began = Instant::now();
    drop(a.acquire(&k, &route("x", 2), deadline(), 8).await.unwrap());
    assert_eq!(began.elapsed(), LOAD, "a load takes the engine's load time");
    drop(a.acquire(&k, &route("y", 2), deadline(), 8).await.unwrap());
    // x used again: y is now the least recently used.
    let began = Instant::now();
    drop(a.acquire(&k, &route("x", 2), deadline(), 8).await.unwrap());
    assert_eq!(
        began.elapsed(),
        Duration::ZERO,
        "a loaded adapter runs at once"
    );
    drop(a.acquire(&k, &route("z", 2), deadline(), 8).await.unwrap());
    assert_eq!(
        script.calls(),
        ["list", "load x", "load y", "unload y", "load z"]
    );
    assert_eq!(a.loaded_on(), [(k, vec!["x".to_string(), "z".to_string()])]);
}

#[tokio::test(start_paused = true)]
async fn a_busy_adapter_is_kept_and_a_request_waits_for_a_slot() {
    let (script, a) = setup();
    let k = key(1);
    let x = a.acquire(&k, &route("x", 1), deadline(), 8).await.unwrap();
    // x runs a request: y waits (nothing may be unloaded), under its deadline.
    let waiting = {
        let (a, k) = (a.clone(), k.clone());
        tokio::spawn(async move {
            let began = Instant::now();
            let lease = a.acquire(&k, &route("y", 1), deadline(), 8).await;
            (began.elapsed(), lease.is_ok())
        })
    };
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(script.calls(), ["list", "load x"], "x is busy: kept");
    drop(x);
    let (waited, ok) = waiting.await.unwrap();
    assert!(ok);
    assert_eq!(
        waited,
        Duration::from_secs(5) + 2 * LOAD,
        "the end, then unload and load"
    );
    assert_eq!(script.calls(), ["list", "load x", "unload x", "load y"]);
}

#[tokio::test(start_paused = true)]
async fn loads_into_one_instance_are_serialized_and_waiters_share_one_load() {
    let (script, a) = setup();
    let k = key(1);
    let mut tasks = Vec::new();
    for name in ["x", "x", "y", "x", "y"] {
        let (a, k) = (a.clone(), k.clone());
        tasks.push(tokio::spawn(async move {
            a.acquire(&k, &route(name, 4), deadline(), 8)
                .await
                .map(drop)
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(
        script.calls(),
        ["list", "load x", "load y"],
        "one load per adapter"
    );
    assert_eq!(
        script.most_at_once.load(Ordering::SeqCst),
        1,
        "never two at once"
    );
    // Another instance (a replica) has a set of its own, read from its engine.
    let other = InstanceKey { index: 1, ..key(1) };
    script.loaded.lock().unwrap().clear();
    drop(
        a.acquire(&other, &route("y", 4), deadline(), 8)
            .await
            .unwrap(),
    );
    assert_eq!(script.calls()[3..], ["list", "load y"]);
    let sets = a.loaded_on();
    assert_eq!(sets.len(), 2);
    assert_eq!(sets[0].1, ["x", "y"]);
    assert_eq!(sets[1], (other, vec!["y".to_string()]));
}

#[tokio::test(start_paused = true)]
async fn a_failed_load_fails_its_waiters_and_changes_nothing_else() {
    let (script, a) = setup();
    let k = key(1);
    drop(a.acquire(&k, &route("x", 2), deadline(), 8).await.unwrap());
    script.refuse.lock().unwrap().insert("bad".into());
    let bad = route("bad", 2);
    let (one, two) = tokio::join!(
        a.acquire(&k, &bad, deadline(), 8),
        a.acquire(&k, &bad, deadline(), 8)
    );
    for e in [one.err().unwrap(), two.err().unwrap()] {
        assert_eq!(e.code(), "adapter_load_failed");
        assert!(e.message().contains("adapter bad") && e.message().contains("No adapter found"));
    }
    assert_eq!(
        script.calls(),
        ["list", "load x", "load bad"],
        "one load, failed"
    );
    // x is still loaded and serves at once.
    let began = Instant::now();
    drop(a.acquire(&k, &route("x", 2), deadline(), 8).await.unwrap());
    assert_eq!(began.elapsed(), Duration::ZERO);
    assert_eq!(a.loaded_on(), [(k, vec!["x".to_string()])]);
}

#[tokio::test(start_paused = true)]
async fn a_wait_ends_at_its_deadline_and_past_the_waiting_limit() {
    let (script, a) = setup();
    let k = key(1);
    let x = a.acquire(&k, &route("x", 1), deadline(), 1).await.unwrap();
    let began = Instant::now();
    let e = a
        .acquire(&k, &route("y", 1), began + Duration::from_secs(3), 1)
        .await
        .err()
        .unwrap();
    assert_eq!(began.elapsed(), Duration::from_secs(3));
    assert_eq!((e.status(), e.code()), (503, "unavailable"));
    // One waits (the limit is 1): the next is refused at once.
    let waiting = {
        let (a, k) = (a.clone(), k.clone());
        tokio::spawn(async move { a.acquire(&k, &route("y", 1), deadline(), 1).await.map(drop) })
    };
    tokio::time::sleep(Duration::from_millis(1)).await;
    let e = a
        .acquire(&k, &route("z", 1), deadline(), 1)
        .await
        .err()
        .unwrap();
    assert_eq!((e.status(), e.code()), (429, "queue_full"));
    // A client that goes away while waiting leaves nothing behind: the one left loads.
    waiting.abort();
    let _ = waiting.await;
    drop(x);
    drop(a.acquire(&k, &route("z", 1), deadline(), 1).await.unwrap());
    assert_eq!(script.calls(), ["list", "load x", "unload x", "load z"]);
}

#[tokio::test(start_paused = true)]
async fn after_a_reset_the_engines_list_is_what_is_loaded() {
    let (script, a) = setup();
    drop(
        a.acquire(&key(1), &route("x", 2), deadline(), 8)
            .await
            .unwrap(),
    );
    // The engine restarted (a new generation) and lost x; it lists only w.
    script.loaded.lock().unwrap().clear();
    script.loaded.lock().unwrap().insert("w".into());
    a.reset(
        &key(1),
        &ApiError::DispatchClosed {
            deployment: "base".into(),
        },
    );
    let began = Instant::now();
    drop(
        a.acquire(&key(2), &route("w", 2), deadline(), 8)
            .await
            .unwrap(),
    );
    assert_eq!(began.elapsed(), Duration::ZERO, "w is listed: no load");
    drop(
        a.acquire(&key(2), &route("x", 2), deadline(), 8)
            .await
            .unwrap(),
    );
    assert_eq!(script.calls(), ["list", "load x", "list", "load x"]);
    // An engine that answers as if it did not have x (its 404): loaded again next time.
    a.lost(&key(2), "x");
    drop(
        a.acquire(&key(2), &route("x", 2), deadline(), 8)
            .await
            .unwrap(),
    );
    assert_eq!(script.calls().last().unwrap(), "load x");
}

#[tokio::test(start_paused = true)]
async fn a_deleted_adapter_is_unloaded_once_its_running_requests_end() {
    let (script, a) = setup();
    let k = key(1);
    let one = a.acquire(&k, &route("x", 2), deadline(), 8).await.unwrap();
    let two = a.acquire(&k, &route("x", 2), deadline(), 8).await.unwrap();
    drop(a.acquire(&k, &route("y", 2), deadline(), 8).await.unwrap());
    a.retire("x", Retired::Deleted);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        script.calls(),
        ["list", "load x", "load y"],
        "x runs two requests: left alone"
    );
    // Shown nowhere, preferred nowhere, from the delete on.
    assert_eq!(a.loaded_on(), [(k.clone(), vec!["y".to_string()])]);
    assert!(a.holding("x").is_empty());
    drop(one);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(script.calls().len(), 3, "one request still runs on x");
    drop(two);
    tokio::time::sleep(LOAD).await;
    assert_eq!(script.calls(), ["list", "load x", "load y", "unload x"]);
    assert_eq!(script.most_at_once.load(Ordering::SeqCst), 1);
    // Its room is free: z loads without unloading y.
    drop(a.acquire(&k, &route("z", 2), deadline(), 8).await.unwrap());
    assert_eq!(script.calls()[4..], ["load z"]);
    assert_eq!(a.loaded_on(), [(k, vec!["y".to_string(), "z".to_string()])]);
}

#[tokio::test(start_paused = true)]
async fn an_adapter_deleted_while_it_loads_fails_its_waiters_and_is_unloaded() {
    let (script, a) = setup();
    let k = key(1);
    let waiters: Vec<_> = (0..2)
        .map(|_| {
            let (a, k) = (a.clone(), k.clone());
            tokio::spawn(async move {
                let began = Instant::now();
                let e = a
                    .acquire(&k, &route("x", 2), deadline(), 8)
                    .await
                    .err()
                    .unwrap();
                (began.elapsed(), e)
            })
        })
        .collect();
    tokio::time::sleep(LOAD / 4).await;
    assert_eq!(script.calls(), ["list", "load x"]);
    a.retire("x", Retired::Deleted);
    for w in waiters {
        let (waited, e) = w.await.unwrap();
        assert_eq!(
            waited,
            LOAD / 4,
            "answered at the delete, not after the load"
        );
        assert_eq!((e.status(), e.code()), (404, "model_not_found"));
        assert!(e.message().contains('x'), "{}", e.message());
    }
    // The load in progress ends; what it loaded is unloaded at once.
    tokio::time::sleep(2 * LOAD).await;
    assert_eq!(script.calls(), ["list", "load x", "unload x"]);
    assert!(script.loaded.lock().unwrap().is_empty());
    assert_eq!(a.loaded_on(), [(k, Vec::new())]);
}

#[tokio::test(start_paused = true)]
async fn new_files_load_once_the_old_ones_are_unloaded() {
    let (script, a) = setup();
    let k = key(1);
    let old = a.acquire(&k, &route("x", 2), deadline(), 8).await.unwrap();
    a.retire("x", Retired::Revised);
    // A request for the new files waits for the old ones' requests to end.
    let waiting = {
        let (a, k) = (a.clone(), k.clone());
        tokio::spawn(async move {
            let began = Instant::now();
            let lease = a.acquire(&k, &route("x", 2), deadline(), 8).await;
            (began.elapsed(), lease.map(drop))
        })
    };
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(script.calls(), ["list", "load x"], "the old x still runs");
    // Another adapter is not held up meanwhile.
    drop(a.acquire(&k, &route("y", 2), deadline(), 8).await.unwrap());
    drop(old);
    let (waited, lease) = waiting.await.unwrap();
    lease.unwrap();
    assert_eq!(
        script.calls(),
        ["list", "load x", "load y", "unload x", "load x"]
    );
    assert_eq!(
        waited,
        Duration::from_secs(5) + 3 * LOAD,
        "y's load, then the unload and the load"
    );
}
