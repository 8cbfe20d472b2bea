//! The management API's reads at scale, against in-memory host agents: views are built outside
//! the lifecycle's lock (a host agent's call never runs under it), host calls are concurrent and
//! bounded, the deployment view names no host for an unplaced deployment among several, names
//! follow deletes and deploys, and a deleted deployment leaves no router entry.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use capyctl_lifecycle::api::ManagementApi;
use capyctl_lifecycle::store::{Changes, DeploymentRecord, Store, StoreError};
use capyctl_lifecycle::{HostEntry, LifecycleConfig, Server};
use capyctl_node_agent::agent::{
    BoxFuture, ParkResult, RecoveryReport, StartedInstance, WakeReport,
};
use capyctl_node_agent::capability::{EngineInfo, engine_info};
use capyctl_node_agent::inventory::{GpuInfo, HostMemory, Inventory};
use capyctl_node_agent::launch::{MaxRunning, MaxRunningSource};
use capyctl_node_agent::load::LoadSample;
use capyctl_node_agent::measure::{MeasureSource, Measured, Measurement};
use capyctl_node_agent::spec::{HostSettings, InstanceSpec};
use capyctl_node_agent::tier::{LaunchParking, ParkChoice, ParkTier};
use capyctl_node_agent::verify::{FirstAnswer, WakeOutcome};
use capyctl_node_agent::{AgentError, HostAgent};
use capyctl_router::admission::Admission;
use capyctl_router::config::RouterConfig;
use capyctl_router::coordinator::{Coordinator, CoordinatorHandle};
use capyctl_router::lifecycle::Lifecycle;
use capyctl_spec::api::StartRequest;
use capyctl_spec::documents::{DeploymentDoc, parse_deployment_str};
use capyctl_spec::{Activation, EngineKind, InstanceState};

const GIB: u64 = 1 << 30;

/// Calls in progress now, and the most at once.
#[derive(Default)]
struct Concurrency {
    now: AtomicUsize,
    most: AtomicUsize,
}

impl Concurrency {
    async fn during<T>(&self, work: impl std::future::Future<Output = T>) -> T {
        let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(n, Ordering::SeqCst);
        let out = work.await;
        self.now.fetch_sub(1, Ordering::SeqCst);
        out
    }
}

/// A host agent whose engines start, park, wake and stop at once. Its `inventory` and `engines`
/// calls take `latency`; every call made while the lifecycle's lock is held is recorded (the
/// agent asks the lifecycle a question that takes the lock, from another thread, and notes
/// whether it was answered).
struct FakeAgent {
    latency: Duration,
    calls: Arc<Concurrency>,
    server: OnceLock<Weak<Server>>,
    under_lock: Mutex<Vec<String>>,
}

impl FakeAgent {
    fn new(latency: Duration, calls: Arc<Concurrency>) -> Arc<Self> {
        Arc::new(FakeAgent {
            latency,
            calls,
            server: OnceLock::new(),
            under_lock: Mutex::new(Vec::new()),
        })
    }

    /// Notes `call` if the lifecycle's lock is held now (by the caller, say).
    fn check_lock(&self, call: &str) {
        let Some(server) = self.server.get().and_then(Weak::upgrade) else {
            return;
        };
        let (tx, rx) = std::sync::mpsc::channel();
        // `admissible` takes the lock; asked from another thread, it answers only once the
        // lock is free.
        std::thread::spawn(move || {
            let _ = server.admissible(&"no-such-deployment".to_string());
            let _ = tx.send(());
        });
        if rx.recv_timeout(Duration::from_secs(2)).is_err() {
            self.under_lock.lock().unwrap().push(call.to_string());
        }
    }
}

fn declared(spec: &InstanceSpec) -> Measurement {
    Measurement {
        weights: spec.resources.weights_memory.map(|bytes| Measured {
            bytes,
            source: MeasureSource::Declared,
        }),
        gpu_memory: spec.resources.gpu_memory.map(|bytes| Measured {
            bytes,
            source: MeasureSource::Declared,
        }),
    }
}

impl HostAgent for FakeAgent {
    fn inventory(&self) -> BoxFuture<'_, Result<Inventory, AgentError>> {
        Box::pin(self.calls.during(async move {
            tokio::time::sleep(self.latency).await;
            Ok(Inventory {
                gpus: vec![GpuInfo {
                    index: 0,
                    uuid: None,
                    name: None,
                    total_bytes: 10 * GIB,
                    free_bytes: None,
                    unified: false,
                }],
                gpus_overridden: true,
                host_memory: HostMemory {
                    total_bytes: 64 * GIB,
                    available_bytes: 64 * GIB,
                    overridden: true,
                },
            })
        }))
    }

    fn engines(&self) -> BoxFuture<'_, Vec<EngineInfo>> {
        Box::pin(self.calls.during(async move {
            tokio::time::sleep(self.latency).await;
            vec![engine_info(EngineKind::Vllm, None)]
        }))
    }

    fn measure<'a>(
        &'a self,
        spec: &'a InstanceSpec,
    ) -> BoxFuture<'a, Result<Measurement, AgentError>> {
        Box::pin(async move { Ok(declared(spec)) })
    }

    fn parkability<'a>(
        &'a self,
        _: &'a InstanceSpec,
    ) -> BoxFuture<'a, Result<ParkChoice, AgentError>> {
        Box::pin(async { Ok(ParkChoice::Park(ParkTier::HostRam)) })
    }

    fn start<'a>(
        &'a self,
        instance: &'a str,
        spec: &'a InstanceSpec,
    ) -> BoxFuture<'a, Result<StartedInstance, AgentError>> {
        Box::pin(async move {
            Ok(StartedInstance {
                instance: instance.to_string(),
                pid: 1,
                port: 9,
                base_url: "http://127.0.0.1:9".into(),
                version: None,
                measurement: declared(spec),
                first_answer: FirstAnswer::Text { text: "x".into() },
                max_running: MaxRunning {
                    count: Some(32),
                    source: MaxRunningSource::Default,
                },
                parking: LaunchParking::default(),
            })
        })
    }

    fn park<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Result<ParkResult, AgentError>> {
        Box::pin(async {
            Ok(ParkResult::Parked {
                tier: ParkTier::HostRam,
                gpu_held: None,
            })
        })
    }

    fn wake<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Result<WakeReport, AgentError>> {
        Box::pin(async {
            Ok(WakeReport {
                outcome: WakeOutcome::Pass,
                took: Duration::ZERO,
            })
        })
    }

    fn stop<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Result<(), AgentError>> {
        Box::pin(async { Ok(()) })
    }

    fn sample(&self, instance: &str) -> Option<LoadSample> {
        self.check_lock(&format!("sample {instance}"));
        None
    }

    fn recover(&self) -> BoxFuture<'_, Result<RecoveryReport, AgentError>> {
        Box::pin(async { Ok(RecoveryReport::default()) })
    }
}

#[derive(Default)]
struct MemStore(Mutex<BTreeMap<String, DeploymentRecord>>);

impl Store for MemStore {
    fn load(&self) -> Result<Vec<DeploymentRecord>, StoreError> {
        Ok(self.0.lock().unwrap().values().cloned().collect())
    }
    fn write(&self, changes: &Changes) -> Result<(), StoreError> {
        let mut records = self.0.lock().unwrap();
        for r in &changes.put {
            records.insert(r.id.clone(), r.clone());
        }
        for id in &changes.remove {
            records.remove(id);
        }
        Ok(())
    }
}

fn doc(name: &str) -> DeploymentDoc {
    parse_deployment_str(
        "t.yaml",
        &format!("name: {name}\nengine: vllm\nmodel: m\nresources: {{gpu_memory: 1GiB}}\n"),
    )
    .unwrap()
}

struct Cluster {
    server: Arc<Server>,
    router: CoordinatorHandle,
    agents: Vec<Arc<FakeAgent>>,
    calls: Arc<Concurrency>,
}

/// A server over `hosts` fake hosts (`gpu-000`, ...) with the real coordinator attached.
async fn cluster(hosts: usize, latency: Duration) -> Cluster {
    let calls = Arc::new(Concurrency::default());
    let agents: Vec<Arc<FakeAgent>> = (0..hosts)
        .map(|_| FakeAgent::new(latency, calls.clone()))
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
    let server = Server::open_hosts(
        entries,
        Arc::new(MemStore::default()),
        LifecycleConfig::new("gpu-000"),
    )
    .await
    .unwrap();
    for a in &agents {
        let _ = a.server.set(Arc::downgrade(&server));
    }
    let router = Coordinator::spawn(server.clone(), RouterConfig::default());
    server.attach_router(router.clone()).await;
    Cluster {
        server,
        router,
        agents,
        calls,
    }
}

async fn start(s: &Server, name: &str) -> String {
    let req = StartRequest {
        evict: false,
        wait: true,
    };
    s.start(name, req).await.unwrap().deployment.id
}

#[tokio::test(start_paused = true)]
async fn host_calls_of_a_list_are_concurrent_and_bounded() {
    // 200 hosts whose calls take 10 ms each: one at a time would take 2 s.
    let c = cluster(200, Duration::from_millis(10)).await;
    c.calls.most.store(0, Ordering::SeqCst);
    let t = tokio::time::Instant::now();
    let hosts = c.server.hosts().await;
    let took = t.elapsed();
    let ids: Vec<&str> = hosts.hosts.iter().map(|h| h.id.as_str()).collect();
    let expected: Vec<String> = (0..200).map(|i| format!("gpu-{i:03}")).collect();
    assert_eq!(ids, expected, "in host order");
    assert!(hosts.hosts.iter().all(|h| h.gpus.len() == 1));
    let most = c.calls.most.load(Ordering::SeqCst);
    assert!(most > 1 && most <= 64, "{most} calls at once");
    assert!(took <= Duration::from_millis(40), "{took:?}");

    c.calls.most.store(0, Ordering::SeqCst);
    let t = tokio::time::Instant::now();
    let engines = c.server.engines().await;
    assert!(
        t.elapsed() <= Duration::from_millis(40),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(engines.engines.len(), 200);
    assert_eq!(engines.engines[0].host_id, "gpu-000");
    assert_eq!(engines.engines[199].host_id, "gpu-199");
    let most = c.calls.most.load(Ordering::SeqCst);
    assert!(most > 1 && most <= 64, "{most} calls at once");
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
    let asked: Vec<String> = c
        .agents
        .iter()
        .flat_map(|g| g.under_lock.lock().unwrap().clone())
        .collect();
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
