//! Two instances of one deployment, each an engine simulator (vLLM flavour, in-process) on its
//! own port, behind the real coordinator and the real listener, through real sockets: the 32
//! running requests are per instance (64 run at once over two engines, the 65th waits), and
//! `prefix` routing keeps prompts that share a prefix on one engine (DESIGN 4.7).

#![allow(clippy::unwrap_used)]

mod proxy_support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use capyctl_interfaces::router::{InstanceKey, Upstream};
use capyctl_router::config::RouterConfig;
use capyctl_router::coordinator::testing::AllReady;
use capyctl_router::coordinator::{Coordinator, CoordinatorHandle};
use capyctl_router::proxy::{ModelEntry, Proxy, ProxyConfig, serve};
use capyctl_spec::Routing;
use http_body_util::BodyExt;
use proxy_support::{Conn, MODEL, PATIENCE, sim_state, start_sim};
use tokio::net::TcpListener;
use tokio::time::Instant;

const DEPLOYMENT: &str = "01REP11CA5000000000000000A";

fn catalog() -> Vec<ModelEntry> {
    vec![ModelEntry {
        id: MODEL.to_string(),
        deployment_id: DEPLOYMENT.to_string(),
        state: "ready".to_string(),
    }]
}

/// The coordinator with `engines` as the deployment's instances 0, 1, ..., and the listener in
/// front of it on a fresh port.
async fn start_router(routing: Routing, engines: &[SocketAddr]) -> (SocketAddr, CoordinatorHandle) {
    let lifecycle = AllReady {
        id: DEPLOYMENT.to_string(),
        name: MODEL.to_string(),
        routing,
    };
    let handle = Coordinator::spawn(Arc::new(lifecycle), RouterConfig::default());
    for (index, addr) in engines.iter().enumerate() {
        let key = InstanceKey {
            deployment: DEPLOYMENT.to_string(),
            index: u32::try_from(index).unwrap(),
            host_id: "sim-host".to_string(),
            generation: 1,
        };
        handle.instance_ready(Upstream { key, addr: *addr }).await;
    }
    // Announced once the coordinator has handled them (its load shows them).
    until("every instance open", async || {
        handle
            .load_of(DEPLOYMENT)
            .await
            .is_some_and(|l| l.instances.iter().filter(|i| i.open).count() == engines.len())
    })
    .await;
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

/// A chat request with a system prompt and a user message.
fn chat(system: &str, user: &str, max_tokens: u32) -> String {
    format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"{user}"}}],"max_tokens":{max_tokens}}}"#
    )
}

/// Sends one request and checks that it is answered 200.
async fn ask(router: SocketAddr, body: String) {
    let mut conn = Conn::open(router).await;
    let response = conn.post("/v1/chat/completions", &body).await;
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
}

/// The simulator's (running, completed) counters, read over its `/sim/state`.
async fn counters(engine: SocketAddr) -> (u64, u64) {
    let state = sim_state(engine).await;
    (
        state["running"].as_u64().unwrap(),
        state["completed"].as_u64().unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_run_at_once_over_two_engines_32_each_and_the_65th_waits() {
    // 40 tokens at 20 per second: 2 s at the engine, far longer than handing out 64 slots.
    let e0 = start_sim(&["--sim-token-rate", "20"]).await;
    let e1 = start_sim(&["--sim-token-rate", "20"]).await;
    let (router, handle) = start_router(Routing::LeastLoaded, &[e0, e1]).await;
    let load = handle.load_of(DEPLOYMENT).await.unwrap();
    assert_eq!(load.in_flight_limit, 64);

    let clients: Vec<_> = (0..65)
        .map(|i| tokio::spawn(ask(router, chat("Be brief.", &format!("question {i}"), 40))))
        .collect();
    until("32 running on each engine and 1 waiting", async || {
        let l = handle.load_of(DEPLOYMENT).await.unwrap();
        counters(e0).await.0 == 32
            && counters(e1).await.0 == 32
            && (l.in_flight, l.waiting) == (64, 1)
    })
    .await;
    // None had finished: the 64 were all out at once.
    assert_eq!(counters(e0).await.1 + counters(e1).await.1, 0);
    for client in clients {
        client.await.unwrap();
    }
    let (c0, c1) = (counters(e0).await.1, counters(e1).await.1);
    assert_eq!(c0 + c1, 65);
    assert!(c0 >= 32 && c1 >= 32, "{c0} {c1}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_routing_keeps_a_shared_prefix_on_one_engine_and_spreads_the_others() {
    let e0 = start_sim(&[]).await;
    let e1 = start_sim(&[]).await;
    let (router, _handle) = start_router(Routing::Prefix, &[e0, e1]).await;
    let completed = async || (counters(e0).await.1, counters(e1).await.1);

    // One long shared system prompt (past the prefix's 256 bytes), different questions: one
    // engine serves them all.
    let system = "You are the capybara expert of a zoo. ".repeat(8);
    for i in 0..12 {
        ask(router, chat(&system, &format!("question {i}"), 4)).await;
    }
    let (a, b) = completed().await;
    assert!((a, b) == (12, 0) || (a, b) == (0, 12), "{a} {b}");

    // Different prompts: both engines serve some.
    for i in 0..24 {
        ask(router, chat(&format!("system prompt number {i}"), "hi", 4)).await;
    }
    let (a2, b2) = completed().await;
    assert_eq!(a2 + b2, 36);
    assert!(a2 > a && b2 > b, "{a2} {b2} after {a} {b}");
}
