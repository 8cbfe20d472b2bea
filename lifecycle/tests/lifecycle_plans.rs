//! The lifecycle's answers to the router (admissible, plan, abandon, execute) against the
//! in-memory simulated host agent (`SimHost`: engines start, park, wake and stop at once, the calls
//! recorded, operations that hang until a stop, stops that fail): reservations, the protected
//! set, refusals. No processes, no sockets.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use capyctl_interfaces::router::{DrainReport, Lifecycle, Plan, PlanFor, SwitchOrder};
use capyctl_lifecycle::api::ManagementApi;
use capyctl_lifecycle::store::{Changes, DeploymentRecord, MemoryStore, Store, StoreError};
use capyctl_lifecycle::{Core, LifecycleConfig};
use capyctl_spec::InstanceState;
use capyctl_spec::api::{Released, StartRequest};
use capyctl_spec::documents::{DeploymentDoc, parse_deployment_str};
use capyctl_test_support::SimHost;

/// The records by ID, and every write it was given. With a gate, the first write says it began
/// and waits until the gate is opened (a slow disk).
#[derive(Default)]
struct MemStore {
    records: MemoryStore,
    writes: Mutex<Vec<Changes>>,
    gate: Mutex<Option<Gate>>,
}

/// (The write began, the gate is open.)
type Gate = (std::sync::mpsc::Sender<()>, std::sync::mpsc::Receiver<()>);

impl MemStore {
    /// The writes since the last call: (names written, IDs removed) of each.
    fn take_writes(&self) -> Vec<(Vec<String>, Vec<String>)> {
        std::mem::take(&mut *self.writes.lock().unwrap())
            .into_iter()
            .map(|c| {
                let names = c.put.iter().map(|r| r.doc.name.clone()).collect();
                (names, c.remove)
            })
            .collect()
    }
}

impl Store for MemStore {
    fn load(&self) -> Result<Vec<DeploymentRecord>, StoreError> {
        self.records.load()
    }
    fn write(&self, changes: &Changes) -> Result<(), StoreError> {
        let gate = self.gate.lock().unwrap().take();
        if let Some((began, open)) = gate {
            began.send(()).unwrap();
            open.recv().unwrap();
        }
        self.records.write(changes)?;
        self.writes.lock().unwrap().push(changes.clone());
        Ok(())
    }
}

fn doc(name: &str, gib: u64, extra: &str) -> DeploymentDoc {
    parse_deployment_str(
        "t.yaml",
        &format!(
            "name: {name}\nengine: vllm\nmodel: m\nresources: {{gpu_memory: {gib}GiB}}\n{extra}"
        ),
    )
    .unwrap()
}

async fn server() -> (Arc<Core>, Arc<SimHost>, Arc<MemStore>) {
    let agent = Arc::new(SimHost::new());
    let store = Arc::new(MemStore::default());
    let s = Core::open(agent.clone(), store.clone(), LifecycleConfig::new("h"))
        .await
        .unwrap();
    (s, agent, store)
}

async fn ready(s: &Core, name: &str) -> String {
    s.start(
        name,
        StartRequest {
            evict: false,
            wait: true,
        },
    )
    .await
    .unwrap()
    .deployment
    .id
}

fn victims(plan: &Plan) -> Vec<String> {
    match plan {
        Plan::Switch { victims, .. } => victims.iter().map(|k| k.deployment.clone()).collect(),
        other => panic!("expected a switch, got {other:?}"),
    }
}

#[tokio::test]
async fn two_plans_never_name_the_same_victim_and_protected_ones_are_never_named() {
    let (s, _, _) = server().await;
    for (n, g) in [("a", 4), ("b", 4), ("c", 4), ("d", 4)] {
        s.deploy(doc(n, g, "")).await.unwrap();
    }
    let a = ready(&s, "a").await;
    let b = ready(&s, "b").await;
    let c = s.get("c").await.unwrap().id;
    let d = s.get("d").await.unwrap().id;
    let none = BTreeSet::new();

    let p1 = s.plan(&c, &none, PlanFor::Requests).await.unwrap();
    let v1 = victims(&p1);
    assert_eq!(v1.len(), 1);
    let p2 = s.plan(&d, &none, PlanFor::Requests).await.unwrap();
    let v2 = victims(&p2);
    assert_eq!(v2.len(), 1);
    assert_ne!(v1, v2, "a reserved victim is not named twice");
    // Every releasable instance is reserved now: a third plan waits.
    s.deploy(doc("e", 4, "")).await.unwrap();
    let e = s.get("e").await.unwrap().id;
    assert_eq!(
        s.plan(&e, &none, PlanFor::Requests).await.unwrap(),
        Plan::Later
    );

    // Given back, the victims may be named again; never a protected one.
    if let Plan::Switch { switch_id, .. } = &p1 {
        s.abandon(switch_id);
    }
    if let Plan::Switch { switch_id, .. } = &p2 {
        s.abandon(switch_id);
    }
    let protected: BTreeSet<String> = [a.clone(), c.clone()].into_iter().collect();
    let p = s.plan(&c, &protected, PlanFor::Requests).await.unwrap();
    assert_eq!(victims(&p), vec![b.clone()]);
    // The target is claimed: asked again, it is already coming.
    assert_eq!(
        s.plan(&c, &none, PlanFor::Requests).await.unwrap(),
        Plan::AlreadyComing
    );
}

#[tokio::test]
async fn execute_parks_the_victims_then_starts_the_target() {
    let (s, agent, _) = server().await;
    s.deploy(doc("a", 6, "")).await.unwrap();
    s.deploy(doc("b", 6, "")).await.unwrap();
    let a = ready(&s, "a").await;
    let b = s.get("b").await.unwrap().id;
    let plan = s
        .plan(&b, &BTreeSet::new(), PlanFor::Requests)
        .await
        .unwrap();
    let Plan::Switch {
        switch_id, victims, ..
    } = plan
    else {
        panic!("expected a switch");
    };
    assert_eq!(victims[0].deployment, a);
    assert_eq!(victims[0].generation, 1);
    s.execute(SwitchOrder {
        switch_id,
        target: b.clone(),
        victims: victims
            .into_iter()
            .map(|k| (k, DrainReport::default()))
            .collect(),
        window: Duration::ZERO,
        drain: Duration::ZERO,
        began: tokio::time::Instant::now(),
        wave: 1,
        operator: false,
    })
    .await
    .unwrap();
    assert_eq!(s.get("a").await.unwrap().state, InstanceState::Parked);
    assert_eq!(s.get("b").await.unwrap().state, InstanceState::Ready);
    let calls = agent.calls();
    assert_eq!(
        calls,
        vec![
            format!("start {a}-0"),
            format!("park {a}-0"),
            format!("start {b}-0")
        ]
    );
    // A cut before output: the victim is stopped, not parked.
    let plan = s
        .plan(&a, &BTreeSet::new(), PlanFor::Requests)
        .await
        .unwrap();
    let Plan::Switch {
        switch_id, victims, ..
    } = plan
    else {
        panic!("expected a switch");
    };
    s.execute(SwitchOrder {
        switch_id,
        target: a.clone(),
        victims: victims
            .into_iter()
            .map(|k| {
                (
                    k,
                    DrainReport {
                        cut_before_output: true,
                    },
                )
            })
            .collect(),
        window: Duration::ZERO,
        drain: Duration::ZERO,
        began: tokio::time::Instant::now(),
        wave: 1,
        operator: false,
    })
    .await
    .unwrap();
    assert_eq!(s.get("b").await.unwrap().state, InstanceState::Stopped);
    let v = s.get("a").await.unwrap();
    assert_eq!(
        (v.state, v.instances[0].generation),
        (InstanceState::Ready, 1),
        "woken"
    );
}

/// Each change writes the records it changed and no other; a document deployed whole is one
/// write; deploying what is deployed writes nothing, also after a restart.
#[tokio::test]
async fn a_change_writes_its_own_records_and_the_same_documents_write_nothing() {
    let (s, agent, store) = server().await;
    let docs = || vec![doc("a", 4, ""), doc("b", 4, ""), doc("c", 4, "")];
    s.deploy_all(docs()).await.unwrap();
    let names = |n: &[&str]| n.iter().map(|n| n.to_string()).collect::<Vec<_>>();
    let mut written = store.take_writes();
    written[0].0.sort();
    assert_eq!(written, [(names(&["a", "b", "c"]), vec![])], "one write");

    s.deploy_all(docs()).await.unwrap();
    s.deploy(doc("a", 4, "")).await.unwrap();
    assert_eq!(store.take_writes(), [], "nothing changed");

    let b = s
        .deploy(doc("b", 4, "max_concurrent_requests: 4\n"))
        .await
        .unwrap();
    assert_eq!(b.deployment.revision, 2);
    assert_eq!(store.take_writes(), [(names(&["b"]), vec![])]);
    s.stop("a").await.unwrap();
    assert_eq!(store.take_writes(), [(names(&["a"]), vec![])]);
    // A delete: its stop first, then its removal.
    let c = s.delete("c").await.unwrap().id;
    assert_eq!(
        store.take_writes(),
        [(names(&["c"]), vec![]), (vec![], vec![c])]
    );

    // The whole batch is checked first: a refusal changes nothing, before it or after it.
    let (name, err) = s
        .deploy_all(vec![doc("d", 4, ""), doc("e", 99, ""), doc("f", 4, "")])
        .await
        .unwrap_err();
    assert_eq!((name.as_str(), err.code()), ("e", "does_not_fit"));
    assert_eq!(store.take_writes(), []);
    assert!(s.get("d").await.is_err());
    assert!(s.get("f").await.is_err());
    s.deploy_all(vec![doc("d", 4, "")]).await.unwrap();
    assert_eq!(store.take_writes(), [(names(&["d"]), vec![])]);

    // A restart: the records come back, and the same documents write nothing.
    s.close();
    let s = Core::open(agent, store.clone(), LifecycleConfig::new("h"))
        .await
        .unwrap();
    assert_eq!(s.get("b").await.unwrap().revision, 2);
    assert!(s.get("a").await.unwrap().operator_stopped);
    s.deploy_all(vec![doc("a", 4, ""), doc("d", 4, "")])
        .await
        .unwrap();
    assert_eq!(store.take_writes(), []);
}

/// Saves that meet while one writes coalesce: the next holder of the persist lock writes every
/// record changed meanwhile in one write, and each deploy answers only once its record is
/// written.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn saves_that_meet_are_one_write_and_each_answers_once_written() {
    let (s, _, store) = server().await;
    let (began_tx, began) = std::sync::mpsc::channel();
    let (open, gate) = std::sync::mpsc::channel();
    *store.gate.lock().unwrap() = Some((began_tx, gate));
    let deploy = |name: &'static str| {
        let s = s.clone();
        tokio::spawn(async move { s.deploy(doc(name, 4, "")).await.unwrap() })
    };
    let a = deploy("a");
    // a's write holds the persist lock (the gate); b and c are deployed meanwhile, and wait.
    while began.try_recv().is_err() {
        tokio::task::yield_now().await;
    }
    let (b, c) = (deploy("b"), deploy("c"));
    // Listed means changed and marked for the next save (the same lock section).
    while s.get("b").await.is_err() || s.get("c").await.is_err() {
        tokio::task::yield_now().await;
    }
    assert!(
        !b.is_finished() && !c.is_finished(),
        "answered before written"
    );
    open.send(()).unwrap();
    for d in [a, b, c] {
        d.await.unwrap();
    }
    let mut written = store.take_writes();
    for w in &mut written {
        w.0.sort();
    }
    let names = |n: &[&str]| n.iter().map(|n| n.to_string()).collect::<Vec<_>>();
    // NB: on a loaded machine one of b's or c's tasks may reach its save only after the
    // group commit wrote both; its save then writes its own record once more (a save always
    // writes the record it names). Both were still written together, before either answered.
    let again = written.split_off(written.len().min(2));
    assert_eq!(
        written,
        [(names(&["a"]), vec![]), (names(&["b", "c"]), vec![])]
    );
    for (records, removed) in again {
        assert!(
            removed.is_empty() && records.len() == 1 && ["b", "c"].contains(&records[0].as_str()),
            "only a record already written may be written again: {records:?} {removed:?}"
        );
    }
}

#[tokio::test]
async fn refusals_come_from_the_operator_and_activation() {
    let (s, _, store) = server().await;
    s.deploy(doc("a", 4, "")).await.unwrap();
    s.deploy(doc("x", 4, "lifecycle: {activation: explicit}\n"))
        .await
        .unwrap();
    s.deploy(doc("w", 8, "lifecycle: {warm: true}\n"))
        .await
        .unwrap();
    let a = s.get("a").await.unwrap().id;
    let x = s.get("x").await.unwrap().id;
    assert_eq!(s.admissible(&a), Ok(()));
    assert_eq!(s.admissible(&x).unwrap_err().code(), "deployment_inactive");
    assert_eq!(
        s.plan(&x, &BTreeSet::new(), PlanFor::Requests)
            .await
            .unwrap_err()
            .code(),
        "deployment_inactive"
    );
    s.stop("a").await.unwrap();
    assert_eq!(s.admissible(&a).unwrap_err().code(), "deployment_stopped");
    assert!(
        store
            .load()
            .unwrap()
            .iter()
            .any(|d| d.id == a && d.operator_stopped)
    );
    s.start("a", StartRequest::default()).await.unwrap();
    assert_eq!(s.admissible(&a), Ok(()));

    // A warm model is kept loaded like an explicit one: never a victim.
    s.stop("a").await.unwrap();
    ready(&s, "w").await;
    let err = s
        .plan(&x, &BTreeSet::new(), PlanFor::Requests)
        .await
        .unwrap_err();
    assert_eq!(err.code(), "deployment_inactive");
    let err = s
        .start(
            "x",
            StartRequest {
                evict: true,
                wait: false,
            },
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), "does_not_fit");
    assert_eq!(s.get("w").await.unwrap().state, InstanceState::Ready);
}

/// What a command that ends a start or a wake may take, on the paused clock: the fake agent's
/// hanging operations end only through a stop, so a command that waited for them instead
/// would run into this bound (the clock jumps to it once everything idles).
const PROMPT: Duration = Duration::from_secs(5);

/// An operator's start of `name` (without `--evict`) answers that it waits for memory.
async fn start_waits_for_memory(s: &Core, name: &str) {
    let r = s.start(name, StartRequest::default()).await.unwrap();
    let conditions = &r.deployment.conditions;
    assert!(
        conditions
            .iter()
            .any(|c| c.kind == "Ready" && c.reason == "waiting_for_memory"),
        "{conditions:?}"
    );
}

/// Asserts that `name` shows `failed`, its instance's error containing `what`.
async fn failed_with(s: &Core, name: &str, what: &str) {
    let d = s.get(name).await.unwrap();
    assert_eq!(d.state, InstanceState::Failed);
    let error = d.instances[0].last_error.as_deref();
    assert!(error.is_some_and(|e| e.contains(what)), "{error:?}");
}

async fn state_of(s: &Core, name: &str) -> InstanceState {
    s.get(name).await.unwrap().state
}

/// Waits (on the paused clock, bounded) until the agent was called `call` (`start <iid>`): the
/// operation is in progress in the agent, not only marked in the lifecycle.
async fn called(agent: &SimHost, call: &str) {
    let deadline = tokio::time::Instant::now() + PROMPT;
    while !agent.calls().iter().any(|c| c == call) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never called: {call}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits (on the paused clock) until `name` shows `state`.
async fn becomes(s: &Core, name: &str, state: InstanceState) {
    if let Err(last) = s.wait_for_state(name, &[state], PROMPT).await {
        panic!("{name} never became {state}: {last:?}");
    }
}

/// Issue 16, item 5: a stop during a start that never ends answers at once; the engine is
/// stopped and the start's caller gets `deployment_stopped`.
#[tokio::test(start_paused = true)]
async fn a_stop_ends_a_start_in_progress() {
    let (s, agent, _) = server().await;
    s.deploy(doc("x", 6, "")).await.unwrap();
    agent.hang("x");
    let starting = {
        let s = s.clone();
        tokio::spawn(async move {
            s.start(
                "x",
                StartRequest {
                    evict: false,
                    wait: true,
                },
            )
            .await
        })
    };
    becomes(&s, "x", InstanceState::Starting).await;
    let id = s.get("x").await.unwrap().id;
    called(&agent, &format!("start {id}-0")).await;
    let receipt = tokio::time::timeout(PROMPT, s.stop("x"))
        .await
        .expect("the stop waited for the start")
        .unwrap();
    assert_eq!(receipt.deployment.state, InstanceState::Stopped);
    let iid = format!("{}-0", receipt.deployment.id);
    assert!(
        agent.calls().contains(&format!("stop {iid}")),
        "{:?}",
        agent.calls()
    );
    let e = starting.await.unwrap().unwrap_err();
    assert_eq!(e.code(), "deployment_stopped", "{e:?}");
    let v = s.get("x").await.unwrap();
    assert!(v.operator_stopped);
    assert!(
        v.instances[0]
            .last_error
            .as_deref()
            .is_some_and(|e| e.starts_with("start ended and engine stopped")),
        "{:?}",
        v.instances[0].last_error
    );
    // It starts again on the operator's word.
    agent.stop_hanging();
    ready(&s, "x").await;
}

/// A delete during a wake that never ends: the wake is ended, the engine stopped, the
/// deployment gone.
#[tokio::test(start_paused = true)]
async fn a_delete_ends_a_wake_in_progress() {
    let (s, agent, _) = server().await;
    s.deploy(doc("x", 6, "")).await.unwrap();
    let id = ready(&s, "x").await;
    s.park("x").await.unwrap();
    becomes(&s, "x", InstanceState::Parked).await;
    let iid = format!("{id}-0");
    agent.hang(&iid);
    s.start("x", StartRequest::default()).await.unwrap();
    becomes(&s, "x", InstanceState::Waking).await;
    called(&agent, &format!("wake {iid}")).await;
    tokio::time::timeout(PROMPT, s.delete("x"))
        .await
        .expect("the delete waited for the wake")
        .unwrap();
    assert!(
        agent.calls().contains(&format!("stop {iid}")),
        "{:?}",
        agent.calls()
    );
    assert_eq!(s.get("x").await.unwrap_err().code(), "not_found");
}

/// `start --evict` of a model that needs the memory of one whose start never ends (and no
/// request waits for it): that start is ended, its engine stopped and named a victim; the
/// evicting start goes on.
#[tokio::test(start_paused = true)]
async fn start_evict_ends_a_start_in_progress() {
    let (s, agent, _) = server().await;
    s.deploy(doc("x", 6, "")).await.unwrap();
    s.deploy(doc("y", 6, "")).await.unwrap();
    agent.hang("x");
    let x = s
        .start("x", StartRequest::default())
        .await
        .unwrap()
        .deployment;
    becomes(&s, "x", InstanceState::Starting).await;
    called(&agent, &format!("start {}-0", x.id)).await;
    // Without --evict: y waits for memory, x goes on starting.
    let r = s.start("y", StartRequest::default()).await.unwrap();
    assert_eq!(r.deployment.state, InstanceState::Stopped);
    assert_eq!(state_of(&s, "x").await, InstanceState::Starting);
    let r = tokio::time::timeout(
        PROMPT,
        s.start(
            "y",
            StartRequest {
                evict: true,
                wait: true,
            },
        ),
    )
    .await
    .expect("the evicting start waited for x's start")
    .unwrap();
    assert_eq!(r.deployment.state, InstanceState::Ready);
    let victims: Vec<(&str, Released)> = r
        .victims
        .iter()
        .map(|v| (v.name.as_str(), v.released))
        .collect();
    assert_eq!(victims, [("x", Released::Stopped)]);
    assert!(r.switch_id.is_some());
    let x = s.get("x").await.unwrap();
    assert_eq!(x.state, InstanceState::Stopped);
    assert!(
        !x.operator_stopped,
        "an evicted start is not an operator stop"
    );
    assert!(
        agent.calls().contains(&format!("stop {}-0", x.id)),
        "{:?}",
        agent.calls()
    );
}

/// `start --evict` that ends a victim's start whose engine then cannot be stopped: the evict
/// fails, naming the victim and the failed stop, and the target is not started on memory the
/// old engine may still hold (as `stop` answers an error when its stop fails). Before: the
/// victim was named `released: stopped` and the target started.
#[tokio::test(start_paused = true)]
async fn start_evict_fails_when_an_ended_start_could_not_be_stopped() {
    let (s, agent, _) = server().await;
    s.deploy(doc("x", 6, "")).await.unwrap();
    s.deploy(doc("y", 6, "")).await.unwrap();
    agent.hang("x");
    let x = s
        .start("x", StartRequest::default())
        .await
        .unwrap()
        .deployment;
    let (x_iid, y_iid) = (
        format!("{}-0", x.id),
        format!("{}-0", s.get("y").await.unwrap().id),
    );
    agent.fail_stops(&x_iid);
    called(&agent, &format!("start {x_iid}")).await;
    let evict = StartRequest {
        evict: true,
        wait: true,
    };
    let err = tokio::time::timeout(PROMPT, s.start("y", evict))
        .await
        .expect("the evicting start answers")
        .unwrap_err();
    assert_eq!(err.code(), "engine_failed", "{err:?}");
    let message = err.message();
    assert!(
        message.contains(&format!("deployment {}", x.id))
            && message.contains("start --evict of y could not stop x")
            && message.contains("the engine's process group would not die")
            && message.contains("y was not started"),
        "{message}"
    );
    assert!(
        !agent.calls().contains(&format!("start {y_iid}")),
        "{:?}",
        agent.calls()
    );
    assert_eq!(state_of(&s, "y").await, InstanceState::Stopped);
    failed_with(&s, "x", "stopping the engine failed").await;
    // Nothing stays reserved: once the stop works, y starts.
    agent.stop_failing();
    s.stop("x").await.unwrap();
    let r = tokio::time::timeout(PROMPT, s.start("y", evict))
        .await
        .expect("the start answers")
        .unwrap();
    assert_eq!(r.deployment.state, InstanceState::Ready);
}

/// A release whose engine could not be stopped (here an operator's stop; a park that failed
/// and whose cleanup stop failed is the same rule) leaves the deployment `failed`, its engine
/// kept: the books count its memory, so another model's start waits for memory instead of
/// starting beside it. The next stop tries again; once it succeeds, the waiting start goes on.
/// Before: the failed instance counted nothing, and y started on memory x may still hold.
#[tokio::test(start_paused = true)]
async fn an_engine_that_could_not_be_stopped_keeps_its_memory_from_the_next_start() {
    let (s, agent, _) = server().await;
    s.deploy(doc("x", 6, "")).await.unwrap();
    s.deploy(doc("y", 6, "")).await.unwrap();
    let x_id = ready(&s, "x").await;
    let x_iid = format!("{x_id}-0");
    let y_iid = format!("{}-0", s.get("y").await.unwrap().id);
    agent.fail_stops(&x_iid);
    let err = s.stop("x").await.unwrap_err();
    assert_eq!(err.code(), "engine_failed", "{err:?}");
    failed_with(&s, "x", "the engine's process group would not die").await;
    start_waits_for_memory(&s, "y").await;
    assert!(
        !agent.calls().contains(&format!("start {y_iid}")),
        "y was started beside x: {:?}",
        agent.calls()
    );
    // The stop fails again: still held.
    let stops = |agent: &SimHost| {
        agent
            .calls()
            .iter()
            .filter(|c| **c == format!("stop {x_iid}"))
            .count()
    };
    assert_eq!(stops(&agent), 1);
    assert_eq!(s.stop("x").await.unwrap_err().code(), "engine_failed");
    assert_eq!(stops(&agent), 2, "the stop is tried again");
    assert_eq!(state_of(&s, "y").await, InstanceState::Stopped);
    // It succeeds: the memory is free, and y's waiting start goes on.
    agent.stop_failing();
    s.stop("x").await.unwrap();
    assert_eq!(state_of(&s, "x").await, InstanceState::Stopped);
    becomes(&s, "y", InstanceState::Ready).await;
}

/// A park that fails, whose engine then cannot be stopped either, leaves the deployment
/// `failed` with both errors, its memory counted as held: another model's start waits for
/// memory. A stop that succeeds frees it, and the waiting start goes on. Before:
/// y started at once beside x's engine.
#[tokio::test(start_paused = true)]
async fn a_failed_park_whose_engine_could_not_be_stopped_keeps_its_memory() {
    let (s, agent, _) = server().await;
    s.deploy(doc("x", 6, "")).await.unwrap();
    s.deploy(doc("y", 6, "")).await.unwrap();
    let x_iid = format!("{}-0", ready(&s, "x").await);
    agent.fail_parks(&x_iid);
    agent.fail_stops(&x_iid);
    s.park("x").await.unwrap();
    becomes(&s, "x", InstanceState::Failed).await;
    failed_with(
        &s,
        "x",
        "did not answer its sleep call, and stopping the engine failed",
    )
    .await;
    start_waits_for_memory(&s, "y").await;
    assert!(
        !agent
            .calls()
            .iter()
            .any(|c| c.starts_with("start ") && c != &format!("start {x_iid}")),
        "y was started beside x: {:?}",
        agent.calls()
    );
    // A stop that succeeds frees the memory: y's waiting start goes on.
    agent.stop_failing();
    s.stop("x").await.unwrap();
    becomes(&s, "y", InstanceState::Ready).await;
}

/// Issue 16, item 7: standalone (no host joins later), a deployment needing more GPU memory
/// than the host has is refused at deploy, naming the key and the largest host; a changed
/// document refused so leaves the working revision in place, running.
#[tokio::test]
async fn a_document_no_host_can_place_is_refused_and_the_working_revision_stays() {
    let (s, _, _) = server().await;
    let a = s.deploy(doc("x", 6, "")).await.unwrap().deployment;
    ready(&s, "x").await;
    let e = s.deploy(doc("x", 12, "")).await.unwrap_err();
    assert_eq!(e.code(), "does_not_fit", "{e:?}");
    let message = e.message();
    assert!(
        message.contains("resources.gpu_memory: 12.0 GiB")
            && message.contains("the largest: 10.0 GiB on host h"),
        "{message}"
    );
    let now = s.get("x").await.unwrap();
    assert_eq!(now.revision, 1);
    assert_eq!(now.spec, a.spec, "the working document stays");
    assert_eq!(now.state, InstanceState::Ready);
    // A new one is not created.
    assert_eq!(
        s.deploy(doc("z", 12, "")).await.unwrap_err().code(),
        "does_not_fit"
    );
    assert_eq!(s.get("z").await.unwrap_err().code(), "not_found");
    assert_eq!(s.list().await.deployments.len(), 1);
    // The whole GPU is still taken.
    s.deploy(doc("w", 10, "")).await.unwrap();
}
