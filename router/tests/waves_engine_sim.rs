//! The real coordinator and the real listener, through real sockets, with the engine simulator
//! (vLLM flavour, in-process) as the engine: a wave is released together and never runs more
//! than 32 at the engine; a client that goes away reaches the engine as an abort.
//!
//! The engine is seen from two sides: its own counters (`running`, `completed`, `aborted`, and
//! `vllm:num_requests_running` on `/metrics`), and a door in front of its HTTP app that records,
//! for every inference request that arrives, how many requests were then at the engine and not
//! yet finished (arrived minus completed minus aborted, read from the engine's own counters,
//! which it updates before it sends an answer's last byte).

#![allow(clippy::unwrap_used)]

mod proxy_support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::Response;
use capyctl_engine_sim::{EngineSim, SimConfig};
use capyctl_interfaces::router::{
    BoxFuture, DeploymentId, DeploymentRef, Executed, InstanceKey, Lifecycle, Plan, PlanFor,
    SwitchOrder, Upstream,
};
use capyctl_router::config::RouterConfig;
use capyctl_router::coordinator::{Coordinator, CoordinatorHandle, DeploymentLoad};
use capyctl_router::proxy::{ModelEntry, Proxy, ProxyConfig, serve};
use capyctl_spec::errors::ApiError;
use http_body_util::BodyExt;
use proxy_support::{Conn, PATIENCE, get};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::time::Instant;

const DEPLOYMENT: &str = "01WAVES0000000000000000000";
const MODEL: &str = "chat-a";

/// What the door in front of the engine saw.
#[derive(Default)]
struct Door {
    /// Inference requests that reached the engine.
    arrived: AtomicUsize,
    /// For each, in order of arrival: (requests at the engine and not finished, counting it;
    /// requests the engine had completed).
    arrivals: Mutex<Vec<(usize, u64)>>,
}

impl Door {
    fn arrivals(&self) -> Vec<(usize, u64)> {
        self.arrivals.lock().unwrap().clone()
    }
}

async fn door(
    State((door, sim)): State<(Arc<Door>, Arc<EngineSim>)>,
    request: Request,
    next: Next,
) -> Response {
    if request.uri().path().starts_with("/v1/") {
        let mut arrivals = door.arrivals.lock().unwrap();
        let arrived = door.arrived.fetch_add(1, Ordering::SeqCst) + 1;
        let c = sim.snapshot().counters;
        let open = arrived - usize::try_from(c.completed + c.aborted).unwrap();
        arrivals.push((open, c.completed));
    }
    next.run(request).await
}

/// The engine simulator (vLLM) at `token_rate` tokens per second, behind the door.
async fn start_engine(token_rate: &str) -> (SocketAddr, Arc<EngineSim>, Arc<Door>) {
    let config = SimConfig::try_parse_from([
        "engine-sim",
        "serve",
        "Qwen3-4B",
        "--served-model-name",
        MODEL,
        "--port",
        "0",
        "--sim-token-rate",
        token_rate,
    ])
    .unwrap();
    let sim = EngineSim::new(config);
    let door_state = Arc::new(Door::default());
    let app = capyctl_engine_sim::app(Arc::clone(&sim)).layer(middleware::from_fn_with_state(
        (Arc::clone(&door_state), Arc::clone(&sim)),
        door,
    ));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (addr, sim, door_state)
}

/// One deployment on the simulator: parked (a wake waits for the test's gate) or ready.
struct SimLifecycle {
    upstream: Upstream,
    sim: Arc<EngineSim>,
    ready: AtomicBool,
    /// `execute` takes one permit before it announces the instance.
    gate: Semaphore,
    handle: OnceLock<CoordinatorHandle>,
    plans: AtomicUsize,
    executes: AtomicUsize,
    /// What each `engine_idle` saw: the engine's running and waiting requests.
    idle_reads: Mutex<Vec<(u64, u64)>>,
}

impl SimLifecycle {
    fn new(addr: SocketAddr, sim: Arc<EngineSim>, ready: bool) -> Arc<Self> {
        Arc::new(SimLifecycle {
            upstream: Upstream {
                key: InstanceKey {
                    deployment: DEPLOYMENT.to_string(),
                    index: 0,
                    host_id: "sim-host".to_string(),
                    generation: 1,
                },
                addr,
            },
            sim,
            ready: AtomicBool::new(ready),
            gate: Semaphore::new(0),
            handle: OnceLock::new(),
            plans: AtomicUsize::new(0),
            executes: AtomicUsize::new(0),
            idle_reads: Mutex::new(Vec::new()),
        })
    }
}

impl Lifecycle for SimLifecycle {
    fn resolve(&self, model: &str) -> Option<DeploymentRef> {
        (model == MODEL).then(|| DeploymentRef {
            id: DEPLOYMENT.to_string(),
            name: MODEL.to_string(),
            routing: capyctl_spec::Routing::LeastLoaded,
            priority: 0,
        })
    }

    fn admissible(&self, _deployment: &DeploymentId) -> Result<(), ApiError> {
        Ok(())
    }

    fn plan<'a>(
        &'a self,
        _deployment: &'a DeploymentId,
        _protected: &'a BTreeSet<DeploymentId>,
        _who: PlanFor,
    ) -> BoxFuture<'a, Result<Plan, ApiError>> {
        Box::pin(async move {
            let n = self.plans.fetch_add(1, Ordering::SeqCst);
            if self.ready.load(Ordering::SeqCst) {
                return Ok(Plan::AlreadyComing);
            }
            Ok(Plan::BringUp {
                switch_id: format!("sw-{n}"),
            })
        })
    }

    fn execute(&self, _order: SwitchOrder) -> BoxFuture<'_, Result<Executed, ApiError>> {
        Box::pin(async move {
            self.executes.fetch_add(1, Ordering::SeqCst);
            self.gate.acquire().await.unwrap().forget();
            self.ready.store(true, Ordering::SeqCst);
            if let Some(handle) = self.handle.get() {
                handle.instance_ready(self.upstream.clone()).await;
            }
            Ok(Executed::default())
        })
    }

    fn abandon(&self, _switch_id: &str) {}

    fn engine_idle<'a>(&'a self, _instance: &'a InstanceKey) -> BoxFuture<'a, bool> {
        Box::pin(async move {
            let c = self.sim.snapshot().counters;
            self.idle_reads.lock().unwrap().push((c.running, c.waiting));
            c.running == 0 && c.waiting == 0
        })
    }
}

fn catalog() -> Vec<ModelEntry> {
    vec![ModelEntry {
        id: MODEL.to_string(),
        deployment_id: DEPLOYMENT.to_string(),
        state: "ready".to_string(),
    }]
}

/// The coordinator on `lifecycle` and the listener in front of it on a fresh port.
async fn start_router(lifecycle: &Arc<SimLifecycle>) -> (SocketAddr, CoordinatorHandle) {
    let handle = Coordinator::spawn(lifecycle.clone(), RouterConfig::default());
    let _ = lifecycle.handle.set(handle.clone());
    if lifecycle.ready.load(Ordering::SeqCst) {
        handle.instance_ready(lifecycle.upstream.clone()).await;
    }
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let proxy = Proxy::new(handle.clone(), catalog, ProxyConfig::default());
    tokio::spawn(serve(listener, proxy, std::future::pending()));
    (addr, handle)
}

/// Waits until `check` holds, polling; panics after [`PATIENCE`].
async fn until(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let end = Instant::now() + PATIENCE;
    while !check().await {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn deployment(load: &[DeploymentLoad]) -> (usize, usize) {
    load.iter()
        .find(|d| d.deployment_id == DEPLOYMENT)
        .map_or((0, 0), |d| (d.in_flight, d.waiting))
}

fn body(max_tokens: u32, stream: bool) -> String {
    format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Tell me about capybaras"}}],"max_tokens":{max_tokens},"stream":{stream}}}"#
    )
}

/// The engine's own `vllm:num_requests_running`.
async fn engine_running_metric(engine: SocketAddr) -> f64 {
    let (status, text) = get(engine, "/metrics").await;
    assert_eq!(status, 200);
    let text = String::from_utf8(text.to_vec()).unwrap();
    text.lines()
        .find(|l| l.starts_with("vllm:num_requests_running"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no vllm:num_requests_running in {text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wave_of_40_is_released_together_at_most_32_at_the_engine_rest_as_slots_free() {
    // 100 tokens at 20 per second: each answer takes 5 s at the engine, far longer than the
    // router needs to hand out the first 32 slots even on a loaded machine (the test waits for
    // the engine's own running count to reach 32, and checks that none completed before).
    let (engine, sim, door) = start_engine("20").await;
    let lifecycle = SimLifecycle::new(engine, Arc::clone(&sim), false);
    let (router, handle) = start_router(&lifecycle).await;

    let clients: Vec<_> = (0..40)
        .map(|_| {
            tokio::spawn(async move {
                let mut conn = Conn::open(router).await;
                let response = conn.post("/v1/chat/completions", &body(100, false)).await;
                let status = response.status();
                let bytes = response.into_body().collect().await.unwrap().to_bytes();
                (status, bytes)
            })
        })
        .collect();

    // The whole wave waits for the one wake; nothing has reached the engine.
    until("40 waiting", async || {
        deployment(&handle.load().await) == (0, 40)
            && lifecycle.executes.load(Ordering::SeqCst) == 1
    })
    .await;
    assert_eq!(door.arrived.load(Ordering::SeqCst), 0);

    // The instance opens: 32 are released at once and run together at the engine.
    lifecycle.gate.add_permits(1);
    until("32 running at the engine", async || {
        sim.snapshot().counters.running == 32
    })
    .await;
    assert_eq!(engine_running_metric(engine).await, 32.0);
    assert_eq!(sim.snapshot().counters.completed, 0);
    assert_eq!(deployment(&handle.load().await), (32, 8));

    for client in clients {
        let (status, bytes) = client.await.unwrap();
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
        let answer: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(answer["object"], "chat.completion", "{answer}");
    }

    let arrivals = door.arrivals();
    assert_eq!(arrivals.len(), 40);
    // Never more than 32 at the engine at once; exactly 32 when the wave went out.
    assert_eq!(arrivals.iter().map(|(open, _)| *open).max(), Some(32));
    // The first 32 all reached the engine before any answer was complete: released together.
    assert!(
        arrivals[..32].iter().all(|&(_, completed)| completed == 0),
        "{arrivals:?}"
    );
    // The 33rd and later each came only after a slot was freed by a completed answer.
    for (i, &(_, completed)) in arrivals[32..].iter().enumerate() {
        assert!(completed > i as u64, "arrival {}: {arrivals:?}", 33 + i);
    }
    let c = sim.snapshot().counters;
    assert_eq!((c.completed, c.aborted, c.running), (40, 0, 0));
    // One wake for the whole wave.
    assert_eq!(lifecycle.plans.load(Ordering::SeqCst), 1);
    assert_eq!(lifecycle.executes.load(Ordering::SeqCst), 1);
    // A request ends at the router once its answer's last byte is written, a moment after the
    // client has read it: the load read shows the end then (bounded).
    until("every request ended at the router", async || {
        deployment(&handle.load().await) == (0, 0)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_gone_mid_stream_reaches_engine_as_abort_and_park_waits_for_engine_idle() {
    let (engine, sim, _door) = start_engine("20").await;
    let lifecycle = SimLifecycle::new(engine, Arc::clone(&sim), true);
    let (router, handle) = start_router(&lifecycle).await;

    // 400 tokens at 20 per second: 20 s; the client leaves after the first output.
    let mut conn = Conn::open(router).await;
    let response = conn.post("/v1/chat/completions", &body(400, true)).await;
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("\"content\":\"") {
        let frame = tokio::time::timeout(PATIENCE, body.frame())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if let Ok(data) = frame.into_data() {
            seen.extend_from_slice(&data);
        }
    }
    assert_eq!(sim.snapshot().counters.running, 1);
    assert_eq!(deployment(&handle.load().await).0, 1);
    drop(body);
    drop(conn);

    until("the engine aborted it", async || {
        let c = sim.snapshot().counters;
        c.aborted == 1 && c.running == 0
    })
    .await;
    assert_eq!(sim.snapshot().counters.completed, 0);
    until("the router freed its slot", async || {
        deployment(&handle.load().await) == (0, 0)
    })
    .await;

    // Cut after output: the release asks the engine whether it is idle before it may park.
    let reports = handle
        .release(vec![lifecycle.upstream.key.clone()])
        .await
        .unwrap();
    assert_eq!(reports.len(), 1);
    assert!(!reports[0].1.cut_before_output);
    assert_eq!(*lifecycle.idle_reads.lock().unwrap(), vec![(0, 0)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_gone_before_a_whole_answer_reaches_engine_as_abort_and_the_model_stops() {
    let (engine, sim, _door) = start_engine("20").await;
    let lifecycle = SimLifecycle::new(engine, Arc::clone(&sim), true);
    let (router, handle) = start_router(&lifecycle).await;

    // Not streamed: nothing comes back until the whole answer (20 s); the client leaves while
    // the engine generates it.
    let client = tokio::spawn(async move {
        let mut conn = Conn::open(router).await;
        let _ = conn.post("/v1/chat/completions", &body(400, false)).await;
    });
    until("running at the engine", async || {
        sim.snapshot().counters.running == 1
    })
    .await;
    assert_eq!(deployment(&handle.load().await).0, 1);
    client.abort();
    let _ = client.await;

    until("the engine aborted it", async || {
        let c = sim.snapshot().counters;
        c.aborted == 1 && c.running == 0
    })
    .await;
    assert_eq!(sim.snapshot().counters.completed, 0);
    until("the router freed its slot", async || {
        deployment(&handle.load().await) == (0, 0)
    })
    .await;

    // Cut before any output: the model must stop rather than park; no engine read needed.
    let reports = handle
        .release(vec![lifecycle.upstream.key.clone()])
        .await
        .unwrap();
    assert_eq!(reports.len(), 1);
    assert!(reports[0].1.cut_before_output);
    assert!(lifecycle.idle_reads.lock().unwrap().is_empty());
}
