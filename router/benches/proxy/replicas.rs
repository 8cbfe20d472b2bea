//! `--replicas`: requests per second through the router with 1, 2 and 4 instances of one
//! deployment, each against the same engines reached directly (DESIGN 4.7, issue 18).
//!
//! ```text
//! cargo bench -p capyctl-router --bench proxy -- --replicas            # ~60 s: 3 rounds of 4 s
//! cargo bench -p capyctl-router --bench proxy -- --replicas --quick    # ~15 s: 1 round of 2 s
//! cargo bench -p capyctl-router --bench proxy -- --replicas --routing prefix
//! cargo bench -p capyctl-router --bench proxy -- --replicas --help
//! ```
//!
//! The engines are the engine simulator (vLLM flavour, in-process, on a runtime of their own)
//! made the bottleneck: each runs at most `--max-running` requests at once (`--max-num-seqs`)
//! and produces `--token-rate` tokens per second per request, so one engine serves about
//! `max_running × token_rate / max_tokens` requests per second however fast the machine is,
//! and N engines N times that. The clients (`--clients-per-instance` per engine, on a
//! runtime of their own) keep every engine full. On the direct side client `i` talks to engine
//! `i mod N`; on the routed side every client talks to the router, which has the N engines as
//! one deployment's instances (the real coordinator and listener; an engine-load sampler
//! reports each engine's waiting count to the coordinator every 200 ms, as the lifecycle
//! does). So routed/direct measures how well the router spreads requests over the instances
//! (1.0: as well as clients pinned evenly to the engines), and routed 4 / routed 1 the
//! throughput gained by adding instances (the target is at least 3.5).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use capyctl_engine_sim::EngineSim;
use capyctl_interfaces::router::{InstanceKey, Upstream};
use capyctl_router::config::RouterConfig;
use capyctl_router::coordinator::testing::AllReady;
use capyctl_router::coordinator::{Coordinator, CoordinatorHandle};
use capyctl_router::proxy::{ModelEntry, Proxy, ProxyConfig, serve};
use capyctl_spec::Routing;
use http_body_util::{BodyExt, Full};
use tokio::net::TcpListener;

use super::{Sender, connect, run, runtime, start_sim_with};

const MODEL: &str = "bench-model";
const DEPLOYMENT: &str = "01REP11CA5BENCH00000000000";

const USAGE: &str = "\
Requests per second through the router with 1, 2 and 4 instances, each against the same engines
reached directly (clients spread over the engines themselves).

usage: cargo bench -p capyctl-router --bench proxy -- --replicas [options]

  --quick                    1 round of 2 s per side (default: 3 rounds of 4 s)
  --seconds S                length of one measured segment per side
  --rounds N                 alternating direct/routed rounds per case (medians are printed)
  --instances 1,2,4          instance counts (default 1,2,4)
  --clients-per-instance N   clients per engine (default 16)
  --max-running N            requests an engine runs at once (default 8)
  --token-rate R             tokens per second per request at the engine (default 100)
  --max-tokens N             tokens per answer (default 10)
  --routing R                least_loaded (default) | prefix (each client its own prompt)
  -h, --help                 this text";

struct Args {
    seconds: f64,
    rounds: usize,
    instances: Vec<usize>,
    clients_per_instance: usize,
    max_running: usize,
    token_rate: f64,
    max_tokens: u32,
    routing: Routing,
}

fn args(given: impl Iterator<Item = String>) -> Args {
    let mut a = Args {
        seconds: 4.0,
        rounds: 3,
        instances: vec![1, 2, 4],
        clients_per_instance: 16,
        max_running: 8,
        token_rate: 100.0,
        max_tokens: 10,
        routing: Routing::LeastLoaded,
    };
    let mut it = given;
    while let Some(arg) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{arg} needs a value"));
        match arg.as_str() {
            "--quick" => {
                a.seconds = 2.0;
                a.rounds = 1;
            }
            "--seconds" => a.seconds = value().parse().unwrap(),
            "--rounds" => a.rounds = value().parse::<usize>().unwrap().max(1),
            "--instances" => {
                a.instances = value().split(',').map(|n| n.parse().unwrap()).collect();
            }
            "--clients-per-instance" => a.clients_per_instance = value().parse().unwrap(),
            "--max-running" => a.max_running = value().parse().unwrap(),
            "--token-rate" => a.token_rate = value().parse().unwrap(),
            "--max-tokens" => a.max_tokens = value().parse().unwrap(),
            "--routing" => {
                a.routing = match value().as_str() {
                    "least_loaded" => Routing::LeastLoaded,
                    "prefix" => Routing::Prefix,
                    other => panic!("--routing least_loaded | prefix, not {other}"),
                }
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            // `cargo bench` passes `--bench`; `--replicas` chose this mode.
            "--bench" | "--replicas" => {}
            other => panic!("unknown option {other}\n\n{USAGE}"),
        }
    }
    a
}

async fn start_engine(max_running: usize, token_rate: f64) -> (SocketAddr, Arc<EngineSim>) {
    let (max_running, token_rate) = (max_running.to_string(), token_rate.to_string());
    let extra = [
        "--max-num-seqs",
        &max_running,
        "--sim-token-rate",
        &token_rate,
    ];
    start_sim_with(MODEL, &extra).await
}

fn key(index: usize) -> InstanceKey {
    InstanceKey {
        deployment: DEPLOYMENT.to_string(),
        index: u32::try_from(index).unwrap(),
        host_id: "bench".to_string(),
        generation: 1,
    }
}

/// The router with `engines` as one deployment's instances, and the engine-load sampler.
async fn start_router(routing: Routing, engines: Vec<(SocketAddr, Arc<EngineSim>)>) -> SocketAddr {
    let lifecycle = AllReady {
        id: DEPLOYMENT.to_string(),
        name: MODEL.to_string(),
        routing,
    };
    let handle: CoordinatorHandle =
        Coordinator::spawn(Arc::new(lifecycle), RouterConfig::default());
    for (index, (addr, _)) in engines.iter().enumerate() {
        handle
            .instance_ready(Upstream {
                key: key(index),
                addr: *addr,
            })
            .await;
    }
    let sampler = handle.clone();
    tokio::spawn(async move {
        loop {
            for (index, (_, sim)) in engines.iter().enumerate() {
                let waiting = usize::try_from(sim.snapshot().counters.waiting).unwrap();
                sampler.note_engine_load(key(index), waiting, tokio::time::Instant::now());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let catalog = || {
        vec![ModelEntry {
            id: MODEL.to_string(),
            deployment_id: DEPLOYMENT.to_string(),
            state: "ready".to_string(),
        }]
    };
    let proxy = Proxy::new(handle, catalog, ProxyConfig::default());
    tokio::spawn(serve(listener, proxy, std::future::pending()));
    addr
}

/// One whole (not streamed) answer, checked to be a 200.
async fn one(sender: &mut Sender, body: &Bytes) {
    let request = http::Request::post("/v1/chat/completions")
        .header("host", "bench")
        .header("content-type", "application/json")
        .body(Full::new(body.clone()))
        .unwrap();
    sender.ready().await.unwrap();
    let response = sender.send_request(request).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
}

/// Requests per second over `seconds`, `clients` clients, client `i` on `addrs[i % len]`
/// (each its own prompt), after every client has finished one request.
async fn measure(addrs: Vec<SocketAddr>, clients: usize, max_tokens: u32, seconds: f64) -> f64 {
    // Connected and warmed together (one request each).
    let warming: Vec<_> = (0..clients)
        .map(|i| {
            let addr = addrs[i % addrs.len()];
            tokio::spawn(async move {
                let body = Bytes::from(format!(
                    r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"client {i}: tell me about capybaras"}}],"max_tokens":{max_tokens}}}"#
                ));
                let mut sender = connect(addr).await;
                one(&mut sender, &body).await;
                (sender, body)
            })
        })
        .collect();
    let mut senders = Vec::new();
    for w in warming {
        senders.push(w.await.unwrap());
    }
    let start = Instant::now() + Duration::from_millis(200);
    let end = start + Duration::from_secs_f64(seconds);
    let tasks: Vec<_> = senders
        .into_iter()
        .map(|(mut sender, body)| {
            tokio::spawn(async move {
                let mut done = 0u64;
                loop {
                    one(&mut sender, &body).await;
                    let now = Instant::now();
                    if now >= end {
                        return done;
                    }
                    if now >= start {
                        done += 1;
                    }
                }
            })
        })
        .collect();
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    total as f64 / seconds
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// The `--replicas` mode, with the command line's arguments.
pub(super) fn main(given: impl Iterator<Item = String>) {
    let a = args(given);
    let engines_rt = runtime("engines", 2);
    let router_rt = runtime("router", 2);
    let load_rt = runtime("load", 0);
    let most = a.instances.iter().copied().max().unwrap_or(1);
    let (max_running, token_rate) = (a.max_running, a.token_rate);
    let engines: Vec<(SocketAddr, Arc<EngineSim>)> = run(&engines_rt, async move {
        let mut engines = Vec::new();
        for _ in 0..most {
            engines.push(start_engine(max_running, token_rate).await);
        }
        engines
    });
    let per_engine = a.max_running as f64 * a.token_rate / f64::from(a.max_tokens);
    println!(
        "engines: at most {} running, {} tokens/s per request, {} tokens per answer: about {:.0} requests/s each; {} clients per instance; routing {}; {} round(s) of {} s per side",
        a.max_running,
        a.token_rate,
        a.max_tokens,
        per_engine,
        a.clients_per_instance,
        a.routing.as_str(),
        a.rounds,
        a.seconds
    );
    println!(
        "{:>9} {:>12} {:>12} {:>14}",
        "instances", "direct rps", "routed rps", "routed/direct"
    );
    let mut routed_by_n = Vec::new();
    for &n in &a.instances {
        let mine: Vec<_> = engines[..n].to_vec();
        let direct_addrs: Vec<SocketAddr> = mine.iter().map(|(addr, _)| *addr).collect();
        let router = run(&router_rt, start_router(a.routing, mine));
        let clients = n * a.clients_per_instance;
        let (mut direct, mut routed) = (Vec::new(), Vec::new());
        for _ in 0..a.rounds {
            let (addrs, tokens, secs) = (direct_addrs.clone(), a.max_tokens, a.seconds);
            direct.push(run(&load_rt, measure(addrs, clients, tokens, secs)));
            routed.push(run(
                &load_rt,
                measure(vec![router], clients, a.max_tokens, a.seconds),
            ));
        }
        let (d, r) = (median(direct), median(routed));
        println!("{n:>9} {d:>12.1} {r:>12.1} {:>14.3}", r / d);
        routed_by_n.push((n, r, d));
    }
    let one = routed_by_n.iter().find(|(n, _, _)| *n == 1);
    let four = routed_by_n.iter().find(|(n, _, _)| *n == 4);
    if let (Some((_, r1, d1)), Some((_, r4, d4))) = (one, four) {
        println!(
            "4 instances vs 1: routed {:.2}x (target >= 3.5), direct {:.2}x",
            r4 / r1,
            d4 / d1
        );
    }
}
