//! The management API's reads at scale, against in-memory host agents (`SimHost`): views are built outside
//! the lifecycle's lock (a host agent's call never runs under it), host calls are concurrent and
//! bounded, the deployment view names no host for an unplaced deployment among several, names
//! follow deletes and deploys, and a deleted deployment leaves no router entry. A slow commit
//! of the state holds up no Tokio worker, and a change returns only once it is committed.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use capyctl_interfaces::router::Lifecycle;
use capyctl_lifecycle::api::ManagementApi;
use capyctl_lifecycle::store::{Changes, MemoryStore, Store, StoreError};
use capyctl_lifecycle::{Core, HostEntry, LifecycleConfig};
use capyctl_node_agent::spec::HostSettings;
use capyctl_router::admission::Admission;
use capyctl_router::config::RouterConfig;
use capyctl_router::coordinator::CoordinatorHandle;
use capyctl_server::assembly::assemble;
use capyctl_spec::api::StartRequest;
use capyctl_spec::documents::{DeploymentDoc, parse_deployment_str};
use capyctl_spec::{Activation, InstanceState};
use capyctl_test_support::{Concurrency, SimHost};

fn doc(name: &str) -> DeploymentDoc {
    parse_deployment_str(
        "t.yaml",
        &format!("name: {name}\nengine: vllm\nmodel: m\nresources: {{gpu_memory: 1GiB}}\n"),
    )
    .unwrap()
}

struct Cluster {
    server: Arc<Core>,
    router: CoordinatorHandle,
    calls: Arc<Concurrency>,
    /// The host calls made while the lifecycle's lock was held.
    under_lock: Arc<Mutex<Vec<String>>>,
}

/// A server over `hosts` simulated hosts (`gpu-000`, ...) with the real coordinator attached. Each
/// host's `inventory` and `engines` calls take `latency` and are counted in `calls`; every
/// `sample` asked while the lifecycle's lock is held is noted in `under_lock`.
async fn cluster(hosts: usize, latency: Duration) -> Cluster {
    cluster_with(hosts, |_| latency).await
}

/// [`cluster`] with host `i`'s calls taking `latency(i)`.
async fn cluster_with(hosts: usize, latency: impl Fn(usize) -> Duration) -> Cluster {
    let calls = Arc::new(Concurrency::default());
    let agents: Vec<Arc<SimHost>> = (0..hosts)
        .map(|i| {
            Arc::new(
                SimHost::new()
                    .with_latency(latency(i))
                    .counting(calls.clone()),
            )
        })
        .collect();
    let entries = agents
        .iter()
        .enumerate()
        .map(|(i, a)| HostEntry {
            id: format!("gpu-{i:03}"),
            agent: a.clone(),
            activation: Activation::OnDemand,
            settings: HostSettings::default(),
            admission_window: None,
            remote: true,
        })
        .collect();
    let server = Core::open_hosts(
        entries,
        Arc::new(MemoryStore::default()),
        LifecycleConfig::new("gpu-000"),
    )
    .await
    .unwrap();
    let under_lock = Arc::new(Mutex::new(Vec::new()));
    for a in &agents {
        let server = Arc::downgrade(&server);
        let under_lock = under_lock.clone();
        a.on_sample(move |instance| {
            if held(&server) {
                under_lock
                    .lock()
                    .unwrap()
                    .push(format!("sample {instance}"));
            }
        });
    }
    let router = assemble(&server, server.clone(), RouterConfig::default(), None)
        .await
        .router;
    Cluster {
        server,
        router,
        calls,
        under_lock,
    }
}

/// Whether the lifecycle's lock is held now (by the caller, say): `admissible` takes the lock;
/// asked from another thread, it answers only once the lock is free.
fn held(server: &Weak<Core>) -> bool {
    let Some(server) = server.upgrade() else {
        return false;
    };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = server.admissible(&"no-such-deployment".to_string());
        let _ = tx.send(());
    });
    rx.recv_timeout(Duration::from_secs(2)).is_err()
}

async fn start(s: &Core, name: &str) -> String {
    let req = StartRequest {
        evict: false,
        wait: true,
    };
    s.start(name, req).await.unwrap().deployment.id
}

#[tokio::test(start_paused = true)]
async fn host_calls_of_a_list_are_concurrent_and_bounded() {
    // 2,100 hosts whose calls take 10 ms each: one at a time would take 21 s; 1,024 at once
    // (`HOST_CALLS_AT_ONCE`), three rounds: 30 ms.
    let n = 2100;
    let c = cluster(n, Duration::from_millis(10)).await;
    c.calls.reset_most();
    let t = tokio::time::Instant::now();
    let hosts = c.server.hosts().await;
    let took = t.elapsed();
    let ids: Vec<&str> = hosts.hosts.iter().map(|h| h.id.as_str()).collect();
    let mut expected: Vec<String> = (0..n).map(|i| format!("gpu-{i:03}")).collect();
    expected.sort();
    assert_eq!(ids, expected, "in host order");
    assert!(hosts.hosts.iter().all(|h| h.gpus.len() == 1));
    let most = c.calls.most();
    assert!(most > 256 && most <= 1024, "{most} calls at once");
    assert!(took <= Duration::from_millis(40), "{took:?}");

    c.calls.reset_most();
    let t = tokio::time::Instant::now();
    let engines = c.server.engines().await;
    assert!(
        t.elapsed() <= Duration::from_millis(40),
        "{:?}",
        t.elapsed()
    );
    let engine_hosts: Vec<&str> = engines.engines.iter().map(|e| e.host_id.as_str()).collect();
    assert_eq!(engine_hosts, expected, "in host order");
    let most = c.calls.most();
    assert!(most > 256 && most <= 1024, "{most} calls at once");
}

#[tokio::test(start_paused = true)]
async fn a_slow_host_holds_up_no_other_host_call() {
    // 2,100 hosts, the first of which takes 100 ms per call, the others 10 ms: a new call
    // starts as each one ends, so the others are all asked while the first one is (in rounds,
    // or in a window that waits for the first host's answer, they would wait for it: 120 ms).
    let c = cluster_with(2100, |i| {
        Duration::from_millis(if i == 0 { 100 } else { 10 })
    })
    .await;
    let t = tokio::time::Instant::now();
    let hosts = c.server.hosts().await;
    assert_eq!(hosts.hosts.len(), 2100);
    assert_eq!(hosts.hosts[0].id, "gpu-000");
    assert!(
        t.elapsed() < Duration::from_millis(110),
        "{:?}",
        t.elapsed()
    );
    let t = tokio::time::Instant::now();
    let engines = c.server.engines().await;
    assert_eq!(engines.engines.len(), 2100);
    assert!(
        t.elapsed() < Duration::from_millis(110),
        "{:?}",
        t.elapsed()
    );
}

#[tokio::test]
async fn the_load_read_calls_no_host_agent_under_the_lock() {
    let c = cluster(2, Duration::ZERO).await;
    c.server.deploy(doc("chat-a")).await.unwrap();
    c.server.deploy(doc("chat-b")).await.unwrap();
    let a = start(&c.server, "chat-a").await;
    start(&c.server, "chat-b").await;
    let full = c.server.load(None).await.unwrap();
    assert_eq!(full.deployments.len(), 2);
    let one = c.server.load(Some(&a)).await.unwrap();
    assert_eq!(one.deployments.len(), 1);
    assert_eq!(one.deployments[0].deployment_id, a);
    let by_name = c.server.load(Some("chat-a")).await.unwrap();
    assert_eq!(by_name.deployments[0].deployment_id, a);
    let asked = c.under_lock.lock().unwrap().clone();
    assert_eq!(
        asked,
        Vec::<String>::new(),
        "host calls made under the lock"
    );
    // Each ready instance's sample was asked for (three reads of chat-a, one of chat-b).
    assert!(c.server.load(Some("nope")).await.is_err());
}

#[tokio::test]
async fn an_unplaced_deployment_names_no_host_among_several_and_its_host_once_placed() {
    let c = cluster(3, Duration::ZERO).await;
    c.server.deploy(doc("chat-a")).await.unwrap();
    let v = c.server.get("chat-a").await.unwrap();
    assert_eq!(v.state, InstanceState::Stopped);
    assert_eq!(v.hosts, Vec::<String>::new(), "may run on any of the three");
    start(&c.server, "chat-a").await;
    let v = c.server.get("chat-a").await.unwrap();
    assert_eq!(v.hosts.len(), 1);
    assert_eq!(v.hosts[0], v.instances[0].host_id);
    let list = c.server.list().await;
    assert_eq!(list.deployments[0].hosts, v.hosts);

    // With one host, an unplaced deployment names it (where it will run).
    let one = cluster(1, Duration::ZERO).await;
    one.server.deploy(doc("chat-b")).await.unwrap();
    assert_eq!(one.server.get("chat-b").await.unwrap().hosts, ["gpu-000"]);
}

#[tokio::test]
async fn names_follow_deletes_and_deploys_and_a_deleted_deployment_leaves_no_router_entry() {
    let c = cluster(1, Duration::ZERO).await;
    let admission = c.router.clone();
    assert_eq!(admission.resolve("chat-a"), None);
    c.server.deploy(doc("chat-a")).await.unwrap();
    let first = admission.resolve("chat-a").expect("deployed").id;

    // A request through the listener's admission: the router knows the deployment now.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let dref = admission.resolve("chat-a").unwrap();
    let permit = admission.admit(dref, deadline).await.unwrap();
    drop(permit);
    let known = async {
        loop {
            if let Some(l) = c.router.load_of(&first).await
                && l.in_flight == 0
            {
                return l;
            }
            tokio::task::yield_now().await;
        }
    };
    let load = tokio::time::timeout(Duration::from_secs(5), known)
        .await
        .unwrap();
    assert_eq!(load.instances.len(), 1);

    c.server.delete("chat-a").await.unwrap();
    assert_eq!(admission.resolve("chat-a"), None, "deleted");
    let forgotten = async {
        while c.router.load_of(&first).await.is_some() {
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), forgotten)
        .await
        .expect("the router forgets a deleted deployment");
    assert!(
        c.router
            .load()
            .await
            .iter()
            .all(|l| l.deployment_id != first)
    );

    c.server.deploy(doc("chat-a")).await.unwrap();
    let second = admission.resolve("chat-a").expect("deployed again").id;
    assert_ne!(first, second);
    let ids: BTreeSet<String> = c
        .server
        .list()
        .await
        .deployments
        .into_iter()
        .map(|d| d.id)
        .collect();
    assert_eq!(ids, [second].into_iter().collect());
}

/// A store on a slow disk: while `held`, a write waits (at most [`SlowDisk::BOUND`]) on the
/// thread that called it; `waiting` counts the writes waiting now.
#[derive(Debug, Default)]
struct SlowDisk {
    records: MemoryStore,
    held: AtomicBool,
    waiting: AtomicUsize,
}

impl SlowDisk {
    const BOUND: Duration = Duration::from_secs(3);
}

impl Store for SlowDisk {
    fn load(&self) -> Result<Vec<capyctl_lifecycle::store::DeploymentRecord>, StoreError> {
        self.records.load()
    }

    fn write(&self, changes: &Changes) -> Result<(), StoreError> {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let give_up = std::time::Instant::now() + Self::BOUND;
        while self.held.load(Ordering::SeqCst) && std::time::Instant::now() < give_up {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        self.records.write(changes)
    }
}

/// One runtime thread (the test's flavour): a commit on it would hold up everything else. While
/// a deploy's commit waits on the slow disk, the runtime serves on (a timer, a read), and the
/// deploy has not returned; it returns once its record is committed.
#[tokio::test]
async fn a_slow_commit_holds_up_no_runtime_thread_and_a_change_returns_once_committed() {
    let disk = Arc::new(SlowDisk::default());
    let server = Core::open(
        Arc::new(SimHost::new()),
        disk.clone(),
        LifecycleConfig::new("h"),
    )
    .await
    .unwrap();
    disk.held.store(true, Ordering::SeqCst);
    let deploy = tokio::spawn({
        let server = server.clone();
        async move { server.deploy(doc("a")).await }
    });
    let asked = std::time::Instant::now();
    while disk.waiting.load(Ordering::SeqCst) == 0 {
        assert!(
            asked.elapsed() < SlowDisk::BOUND / 2,
            "the deploy's commit was not seen waiting on the disk after {:?}: it held the runtime's thread",
            asked.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // The commit waits on the disk; the runtime serves on.
    let t = std::time::Instant::now();
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(server.view("a").unwrap().name, "a", "a read is served");
    assert!(t.elapsed() < SlowDisk::BOUND / 2, "{:?}", t.elapsed());
    assert_eq!(disk.waiting.load(Ordering::SeqCst), 1, "still committing");
    assert!(
        !deploy.is_finished(),
        "the deploy returned before its commit"
    );
    disk.held.store(false, Ordering::SeqCst);
    let id = deploy.await.unwrap().unwrap().deployment.id;
    assert!(
        disk.records.get(&id).is_some(),
        "committed when the deploy returned"
    );
}
