//! `cargo bench -p capyctl-server --bench scale`: the lifecycle at scale (issue 17's table).
//!
//! Each case runs in a child process of its own (this binary again, with `--case`), so that its
//! RSS is its own; the parent prints the figures as tables. Three kinds of case:
//!
//! - **standalone N**: a real [`Standalone`] (listeners, the local host agent, the standalone
//!   store in a fresh data directory) started with a document of N deployments, every engine
//!   stopped. Figures: the start (open + listeners + every deployment deployed, i.e. until
//!   `/readyz` would answer ready; the document's parse apart), a second start on the same
//!   directory (nothing changed), RSS after the start and after the deployments list,
//!   full and by-ID load reads (`ManagementApi::load_json`: the JSON the management listener
//!   sends), and the deployments, engines and hosts lists (their JSON; the deployments' a part
//!   at a time, `list_parts`, as the listener sends it).
//! - **used N**: N deployments on one in-process simulated host (its engines start, park and stop at
//!   once; every engine's address is one in-process HTTP server that answers at once), the real
//!   coordinator and inference listener on loopback sockets. Every deployment gets one chat
//!   request through the listener ("each used once"), then: load reads full (with the process's
//!   CPU and minor page faults per read, and the RSS after the reads) and by ID, and the
//!   latency of a request that gets 409 `deployment_stopped` (its model stopped by the
//!   operator), quiet and while another task reads the full load without pause.
//! - **hosts H**: `--host-deployments` deployments (10,000 by default) over H simulated hosts, opened
//!   from an in-memory store (as a new leader on Kubernetes opens them from the CRs). Each host's
//!   `inventory` and `engines` calls take `--host-latency-ms` (default 1 ms, a round trip to a
//!   node agent on a LAN; to within some 0.1 ms, `SimHost::with_exact_latency`: on tokio's
//!   timer, which ends a sleep at a millisecond tick, a 1 ms call took up to 2), its starts none. Figures: the open, the lists with the RSS after the deployments list, and the
//!   time of a first request to a stopped model (sequential, distinct models): with the fake
//!   engine and upstream answering at once, that is CapyCTL's own time.
//!
//! Exit status 0 whatever the figures (it is a benchmark); a case that fails prints why.
#![allow(missing_docs, clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use capyctl_lifecycle::api::ManagementApi;
use capyctl_lifecycle::store::{DeploymentRecord, MemoryStore};
use capyctl_lifecycle::{Core, HostEntry, LifecycleConfig};
use capyctl_node_agent::inventory::NoGpus;
use capyctl_node_agent::spec::HostSettings;
use capyctl_router::config::RouterConfig;
use capyctl_router::proxy::ProxyConfig;
use capyctl_server::assembly::{Inference, assemble};
use capyctl_server::standalone::Standalone;
use capyctl_spec::documents::{parse_deployment_str, parse_standalone_str};
use capyctl_spec::overrides::Overrides;
use capyctl_test_support::SimHost;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

const GIB: u64 = 1 << 30;

const HELP: &str = "\
scale: the lifecycle at scale (start, RSS, load reads, lists, first request)

USAGE:
    cargo bench -p capyctl-server --bench scale -- [OPTIONS]

OPTIONS:
    --standalone LIST       deployments of the standalone cases (default 100,1000,10000)
    --used LIST             deployments of the used-once cases (default 100,1000,10000)
    --hosts LIST            hosts of the fake-host cases (default 1,10,100,1000)
    --host-deployments N    deployments of each fake-host case (default 10000)
    --host-latency-ms X     each simulated host's inventory/engines round trip (default 1;
                            real time to within some 0.1 ms)
    --reads N               full load reads per figure (default 40)
    --quick                 --standalone 100,1000 --used 100,1000 --hosts 1,10,100
                            --host-deployments 1000
    --goals                 issue 30's rows: --standalone 100000 --used 10000 --hosts 10000
                            --host-deployments 100000 --reads 10 (--used 100000 is
                            not in it: using each of 100,000 on one host takes about
                            100 s on a 2-core machine)
    -h, --help              this text

An empty LIST (e.g. --used '') skips that kind of case.
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(i) = args.iter().position(|a| a == "--case") {
        let case: Vec<String> = args[i + 1..].to_vec();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .unwrap();
        let figures = rt.block_on(run_case(&case));
        println!("SCALE {}", serde_json::to_string(&figures).unwrap());
        // Leave at once: the cases leave servers and listeners behind on purpose.
        std::process::exit(0);
    }
    match Opts::parse(&args) {
        Ok(Some(opts)) => {
            parent(&opts);
            ExitCode::SUCCESS
        }
        Ok(None) => {
            print!("{HELP}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("scale: {e}\n\n{HELP}");
            ExitCode::from(2)
        }
    }
}

struct Opts {
    standalone: Vec<usize>,
    used: Vec<usize>,
    hosts: Vec<usize>,
    host_deployments: usize,
    host_latency_ms: f64,
    reads: usize,
}

fn list(v: &str) -> Result<Vec<usize>, String> {
    v.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.trim().parse().map_err(|e| format!("{s:?}: {e}")))
        .collect()
}

impl Opts {
    fn parse(args: &[String]) -> Result<Option<Opts>, String> {
        let mut o = Opts {
            standalone: vec![100, 1000, 10_000],
            used: vec![100, 1000, 10_000],
            hosts: vec![1, 10, 100, 1000],
            host_deployments: 10_000,
            host_latency_ms: 1.0,
            reads: 40,
        };
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let mut value = || {
                it.next()
                    .cloned()
                    .ok_or_else(|| format!("{a} needs a value"))
            };
            match a.as_str() {
                "-h" | "--help" => return Ok(None),
                // `cargo bench` passes this to every bench binary.
                "--bench" => {}
                "--quick" => {
                    o.standalone = vec![100, 1000];
                    o.used = vec![100, 1000];
                    o.hosts = vec![1, 10, 100];
                    o.host_deployments = 1000;
                }
                "--goals" => {
                    o.standalone = vec![100_000];
                    o.used = vec![10_000];
                    o.hosts = vec![10_000];
                    o.host_deployments = 100_000;
                    o.reads = 10;
                }
                "--standalone" => o.standalone = list(&value()?)?,
                "--used" => o.used = list(&value()?)?,
                "--hosts" => o.hosts = list(&value()?)?,
                "--host-deployments" => {
                    o.host_deployments = value()?.parse().map_err(|e| format!("{a}: {e}"))?
                }
                "--host-latency-ms" => {
                    o.host_latency_ms = value()?.parse().map_err(|e| format!("{a}: {e}"))?
                }
                "--reads" => o.reads = value()?.parse().map_err(|e| format!("{a}: {e}"))?,
                other => return Err(format!("unknown option {other:?}")),
            }
        }
        Ok(Some(o))
    }
}

type Figures = BTreeMap<String, f64>;

/// Runs one case in a child process; its figures, or why it failed.
fn child(case: &[String]) -> Result<Figures, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let out = Command::new(exe)
        .arg("--case")
        .args(case)
        .output()
        .map_err(|e| e.to_string())?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    match stdout.lines().find_map(|l| l.strip_prefix("SCALE ")) {
        Some(json) => serde_json::from_str(json).map_err(|e| e.to_string()),
        None => Err(format!(
            "the case ended ({}) without figures: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .rev()
                .take(8)
                .collect::<Vec<_>>()
                .join(" | ")
        )),
    }
}

fn cell(f: &Figures, key: &str) -> String {
    match f.get(key) {
        None => "-".into(),
        Some(v) if key.ends_with("_mb") => format!("{v:.0}"),
        Some(v) if *v >= 100.0 => format!("{v:.0}"),
        Some(v) if *v >= 1.0 => format!("{v:.1}"),
        Some(v) => format!("{v:.3}"),
    }
}

fn table(
    title: &str,
    what: &str,
    cols: &[(&str, &str)],
    rows: &[(String, Result<Figures, String>)],
) {
    println!("\n{title}");
    let mut header = format!("| {what} |");
    let mut rule = "|---|".to_string();
    for (name, _) in cols {
        header.push_str(&format!(" {name} |"));
        rule.push_str("---|");
    }
    println!("{header}\n{rule}");
    for (label, r) in rows {
        match r {
            Ok(f) => {
                let mut line = format!("| {label} |");
                for (_, key) in cols {
                    line.push_str(&format!(" {} |", cell(f, key)));
                }
                println!("{line}");
            }
            Err(e) => println!("| {label} | failed: {e} |"),
        }
    }
}

fn parent(o: &Opts) {
    println!(
        "scale: each case in its own process; times in ms, RSS in MB (VmRSS, peak VmHWM); {} full reads per figure",
        o.reads
    );
    let reads = o.reads.to_string();
    let run = |kind: &str, n: usize, extra: &[String]| {
        let mut case = vec![kind.to_string(), n.to_string(), reads.clone()];
        case.extend_from_slice(extra);
        eprintln!("scale: running {kind} {n} ...");
        (format!("{n}"), child(&case))
    };
    if !o.standalone.is_empty() {
        let rows: Vec<_> = o
            .standalone
            .iter()
            .map(|&n| run("standalone", n, &[]))
            .collect();
        table(
            "standalone: a document of N deployments (real standalone store, local host agent, no engine started)",
            "N",
            &[
                ("parse ms", "parse_ms"),
                ("start ms", "start_ms"),
                ("restart ms", "restart_ms"),
                ("RSS after start MB", "rss_start_mb"),
                ("RSS after list MB", "rss_mb"),
                ("peak MB", "hwm_mb"),
                ("load p50", "load_p50_ms"),
                ("load p99", "load_p99_ms"),
                ("by ID p50", "by_id_p50_ms"),
                ("by ID p99", "by_id_p99_ms"),
                ("deployments list", "list_ms"),
                ("its CPU", "list_cpu_ms"),
                ("engines list", "engines_ms"),
                ("hosts list", "hosts_ms"),
            ],
            &rows,
        );
    }
    if !o.used.is_empty() {
        let rows: Vec<_> = o.used.iter().map(|&n| run("used", n, &[])).collect();
        table(
            "used: N deployments on one simulated host, each used once through the listener",
            "N",
            &[
                ("use all s", "use_all_s"),
                ("RSS MB", "rss_mb"),
                ("load p50", "load_p50_ms"),
                ("load p99", "load_p99_ms"),
                ("load CPU ms", "load_cpu_ms"),
                ("load faults", "load_faults"),
                ("RSS after reads MB", "rss_reads_mb"),
                ("by ID p50", "by_id_p50_ms"),
                ("by ID p99", "by_id_p99_ms"),
                ("409 p50 quiet", "refused_p50_ms"),
                ("409 p99 quiet", "refused_p99_ms"),
                ("409 p50 polled", "refused_polled_p50_ms"),
                ("409 p99 polled", "refused_polled_p99_ms"),
            ],
            &rows,
        );
    }
    if !o.hosts.is_empty() {
        let extra = [
            o.host_deployments.to_string(),
            o.host_latency_ms.to_string(),
        ];
        let rows: Vec<_> = o.hosts.iter().map(|&h| run("hosts", h, &extra)).collect();
        table(
            &format!(
                "hosts: {} deployments over H simulated hosts ({} ms per inventory/engines call)",
                o.host_deployments, o.host_latency_ms
            ),
            "H",
            &[
                ("open ms", "open_ms"),
                ("deployments list", "list_ms"),
                ("its CPU", "list_cpu_ms"),
                ("RSS after list MB", "rss_mb"),
                ("peak MB", "hwm_mb"),
                ("engines list", "engines_ms"),
                ("its CPU", "engines_cpu_ms"),
                ("hosts list", "hosts_ms"),
                ("its CPU", "hosts_cpu_ms"),
                ("load p50", "load_p50_ms"),
                ("load CPU", "load_cpu_ms"),
                ("first request p50", "first_p50_ms"),
                ("first request p99", "first_p99_ms"),
                ("its CPU", "first_cpu_ms"),
            ],
            &rows,
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The cases (child side).

async fn run_case(case: &[String]) -> Figures {
    let n: usize = case[1].parse().unwrap();
    let reads: usize = case[2].parse().unwrap();
    match case[0].as_str() {
        "standalone" => standalone_case(n, reads).await,
        "used" => used_case(n, reads).await,
        "hosts" => {
            let deployments: usize = case[3].parse().unwrap();
            let latency_ms: f64 = case[4].parse().unwrap();
            hosts_case(n, deployments, reads, latency_ms).await
        }
        other => panic!("unknown case {other}"),
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// (p50, p99) in ms.
fn percentiles(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort();
    let at = |q: f64| ms(v[((v.len() as f64 * q) as usize).min(v.len() - 1)]);
    (at(0.50), at(0.99))
}

/// VmRSS and VmHWM of this process, MB.
fn rss_mb() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .map_or(0.0, |kb| kb / 1024.0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// This process's CPU time (user + system) and its minor page faults, from `/proc/self/stat`:
/// every thread's, those that have ended too (a full load read's copying thread ends with the
/// read), in 10 ms ticks (`USER_HZ`, 100 on Linux): for figures over many reads.
fn process_cpu() -> (Duration, u64) {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The fields after the command's `(…)`, from the state (field 3): minflt is field 10,
    // utime and stime fields 14 and 15.
    let fields: Vec<u64> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .map(|v| v.parse().unwrap_or(0))
        .collect();
    let field = |n: usize| fields.get(n - 4).copied().unwrap_or(0);
    (
        Duration::from_millis((field(14) + field(15)) * 10),
        field(10),
    )
}

/// This process's live threads' CPU time (user + system), summed from
/// `/proc/self/task/*/schedstat` (nanoseconds; `/proc/self/stat` counts 10 ms ticks): for
/// figures of a few milliseconds, where no thread ends (see [`process_cpu`]).
fn cpu_time() -> Duration {
    let mut ns = 0u64;
    for task in std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
    {
        let stat = std::fs::read_to_string(task.path().join("schedstat")).unwrap_or_default();
        ns += stat
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
    }
    Duration::from_nanos(ns)
}

fn name(i: usize) -> String {
    format!("model-{i:05}")
}

/// Full load reads (their JSON, as the management listener sends it: `load_json`) and reads by
/// ID, timed.
async fn load_reads(api: &dyn ManagementApi, n: usize, reads: usize, f: &mut Figures) {
    let mut full = Vec::with_capacity(reads);
    let (cpu0, faults0) = process_cpu();
    for _ in 0..reads {
        let t = Instant::now();
        let body = api.load_json(None).await.unwrap();
        std::hint::black_box(body);
        full.push(t.elapsed());
    }
    // The whole process's, the copying thread's included (it ends with each read).
    let (cpu, faults) = process_cpu();
    f.insert("load_cpu_ms".into(), ms(cpu - cpu0) / reads.max(1) as f64);
    f.insert(
        "load_faults".into(),
        (faults - faults0) as f64 / reads.max(1) as f64,
    );
    f.insert("rss_reads_mb".into(), rss_mb().0);
    let (p50, p99) = percentiles(full);
    f.insert("load_p50_ms".into(), p50);
    f.insert("load_p99_ms".into(), p99);
    let mut by_id = Vec::with_capacity(500);
    for i in 0..500 {
        let key = name((i * 7919) % n);
        let t = Instant::now();
        let body = api.load_json(Some(&key)).await.unwrap();
        std::hint::black_box(body);
        by_id.push(t.elapsed());
    }
    let (p50, p99) = percentiles(by_id);
    f.insert("by_id_p50_ms".into(), p50);
    f.insert("by_id_p99_ms".into(), p99);
}

/// The three lists, timed (their JSON, as the listener sends it); the RSS after the deployments
/// list.
async fn lists(api: &dyn ManagementApi, f: &mut Figures) {
    // Each part is dropped once counted, as the listener drops it once sent.
    let (t, cpu) = (Instant::now(), cpu_time());
    let mut bytes = 0;
    for part in api.list_parts().await.unwrap() {
        bytes += std::hint::black_box(part.unwrap()).len();
    }
    f.insert("list_ms".into(), ms(t.elapsed()));
    f.insert("list_cpu_ms".into(), ms(cpu_time() - cpu));
    f.insert("list_bytes".into(), bytes as f64);
    let (rss, hwm) = rss_mb();
    f.insert("rss_mb".into(), rss);
    f.insert("hwm_mb".into(), hwm);
    let (t, cpu) = (Instant::now(), cpu_time());
    let e = api.engines().await;
    std::hint::black_box(serde_json::to_vec(&e).unwrap());
    f.insert("engines_ms".into(), ms(t.elapsed()));
    f.insert("engines_cpu_ms".into(), ms(cpu_time() - cpu));
    let (t, cpu) = (Instant::now(), cpu_time());
    let h = api.hosts().await;
    std::hint::black_box(serde_json::to_vec(&h).unwrap());
    f.insert("hosts_ms".into(), ms(t.elapsed()));
    f.insert("hosts_cpu_ms".into(), ms(cpu_time() - cpu));
}

fn standalone_document(n: usize) -> String {
    // Engines are never started: the command only has to exist.
    let exe = std::env::current_exe().unwrap();
    let mut text = format!(
        r#"
server:
  listen:
    inference: "127.0.0.1:0"
    management: "127.0.0.1:0"
host:
  id: gpu-box
  gpus: [{{memory: 80GiB}}]
  host_memory: 64GiB
  engines:
    vllm: {{command: ["{}"]}}
deployments:
"#,
        exe.display()
    );
    for i in 0..n {
        text.push_str(&format!(
            "  - {{name: {}, engine: vllm, model: Qwen3-4B, resources: {{gpu_memory: 1GiB, weights_memory: 64MiB}}}}\n",
            name(i)
        ));
    }
    text
}

async fn standalone_case(n: usize, reads: usize) -> Figures {
    let mut f = Figures::new();
    let dir = capyctl_test_support::temp_dir("scale-standalone");
    let text = standalone_document(n);
    let t = Instant::now();
    let config = parse_standalone_str("scale.yaml", &text, &Overrides::none()).unwrap();
    f.insert("parse_ms".into(), ms(t.elapsed()));

    let t = Instant::now();
    // Moved, not cloned: the figures count no second copy of the document's deployments.
    let s = Standalone::start_with_probe(config, dir.clone(), Arc::new(NoGpus))
        .await
        .unwrap();
    f.insert("start_ms".into(), ms(t.elapsed()));
    f.insert("rss_start_mb".into(), rss_mb().0);
    assert_eq!(s.server().list().await.deployments.len(), n);
    let api: &dyn ManagementApi = s.server().as_ref();
    load_reads(api, n, reads, &mut f).await;
    lists(api, &mut f).await;
    s.shutdown().await;

    let config = parse_standalone_str("scale.yaml", &text, &Overrides::none()).unwrap();
    let t = Instant::now();
    let s = Standalone::start_with_probe(config, dir.clone(), Arc::new(NoGpus))
        .await
        .unwrap();
    f.insert("restart_ms".into(), ms(t.elapsed()));
    s.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
    f
}

// ---------------------------------------------------------------------------------------------
// Fake hosts: `capyctl_test_support::SimHost`, every engine answering at `upstream`.

/// An engine that answers every request at once with one chat completion.
async fn upstream() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().fallback(|| async {
        axum::Json(serde_json::json!({
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }))
    });
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    addr
}

/// The records of `n` deployments, as a store holds them when the server opens (on Kubernetes:
/// a new leader's, rebuilt from the CRs).
/// The fake-host cases' records (in memory, as on Kubernetes, where the CRs are the store).
fn records(n: usize) -> Vec<DeploymentRecord> {
    (0..n)
        .map(|i| {
            DeploymentRecord::first(
                format!("01SCALE{i:019}"),
                parse_deployment_str(
                    "scale.yaml",
                    &format!(
                        "name: {}\nengine: vllm\nmodel: Qwen3-4B\nresources: {{gpu_memory: 1GiB, weights_memory: 64MiB}}\n",
                        name(i)
                    ),
                )
                .unwrap(),
            )
        })
        .collect()
}

/// The lifecycle over `hosts` simulated hosts with `n` deployments from the CR store, the real
/// coordinator and inference listener; the server and the listener's address.
async fn fake_cluster(hosts: usize, n: usize, latency: Duration) -> (Arc<Core>, SocketAddr, f64) {
    let up = upstream().await;
    // Every deployment fits at once on any host: no case here waits for a switch.
    let gpu = (n as u64 + 2) * GIB;
    let settings = HostSettings::all_engines(vec![
        std::env::current_exe()
            .unwrap()
            .to_string_lossy()
            .into_owned(),
    ]);
    let entries: Vec<HostEntry> = (0..hosts)
        .map(|i| HostEntry {
            id: format!("gpu-{i:04}"),
            // No call log: the RSS figures count no test bookkeeping.
            agent: Arc::new(
                SimHost::new()
                    .with_gpu(gpu)
                    .with_upstream(up)
                    .with_exact_latency(latency)
                    .without_call_log(),
            ),
            activation: capyctl_spec::Activation::OnDemand,
            settings: settings.clone(),
            admission_window: None,
            remote: true,
        })
        .collect();
    let mut lc = LifecycleConfig::new("gpu-0000");
    lc.host_settings = settings;
    let store = Arc::new(MemoryStore::new(records(n)));
    let t = Instant::now();
    let server = Core::open_hosts(entries, store, lc).await.unwrap();
    let open_ms = ms(t.elapsed());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, rx) = tokio::sync::watch::channel(false);
    // The listener serves until the bench's process ends.
    std::mem::forget(stop);
    let inference = Inference {
        listener,
        config: ProxyConfig::default(),
        observer: None,
        stop: rx,
        give_back: None,
        tenants: Default::default(),
    };
    assemble(
        &server,
        server.clone(),
        RouterConfig::default(),
        Some(inference),
    )
    .await;
    server.set_ready(true);
    (server, addr, open_ms)
}

type HttpClient = Client<HttpConnector, Full<bytes::Bytes>>;

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// One chat request for `model`; its status and time.
async fn chat(client: &HttpClient, addr: SocketAddr, model: &str) -> (u16, Duration) {
    let body = serde_json::to_vec(&serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
    }))
    .unwrap();
    let req = http::Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(bytes::Bytes::from(body)))
        .unwrap();
    let t = Instant::now();
    let resp = client.request(req).await.unwrap();
    let status = resp.status().as_u16();
    let _ = resp.into_body().collect().await;
    (status, t.elapsed())
}

async fn used_case(n: usize, reads: usize) -> Figures {
    let mut f = Figures::new();
    let (server, addr, _) = fake_cluster(1, n, Duration::ZERO).await;
    let client = client();
    let t = Instant::now();
    // Every deployment used once, 8 at a time.
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let workers: Vec<_> = (0..8)
        .map(|_| {
            let next = next.clone();
            let client = client.clone();
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        return;
                    }
                    let (status, _) = chat(&client, addr, &name(i)).await;
                    assert_eq!(status, 200, "{}", name(i));
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    f.insert("use_all_s".into(), t.elapsed().as_secs_f64());
    let (rss, _) = rss_mb();
    f.insert("rss_mb".into(), rss);
    let api: &dyn ManagementApi = server.as_ref();
    load_reads(api, n, reads, &mut f).await;

    // A request refused at once: its model stopped by the operator.
    let stopped = name(0);
    api.stop(&stopped).await.unwrap();
    let refused = |count: usize| {
        let client = client.clone();
        let stopped = stopped.clone();
        async move {
            let mut v = Vec::with_capacity(count);
            for _ in 0..count {
                let (status, took) = chat(&client, addr, &stopped).await;
                assert_eq!(status, 409);
                v.push(took);
            }
            v
        }
    };
    let (p50, p99) = percentiles(refused(300).await);
    f.insert("refused_p50_ms".into(), p50);
    f.insert("refused_p99_ms".into(), p99);
    let polling = Arc::new(AtomicBool::new(true));
    let poller = {
        let server = server.clone();
        let polling = polling.clone();
        tokio::spawn(async move {
            while polling.load(Ordering::Relaxed) {
                std::hint::black_box(server.load_json(None).await.unwrap());
                tokio::task::yield_now().await;
            }
        })
    };
    let (p50, p99) = percentiles(refused(300).await);
    polling.store(false, Ordering::Relaxed);
    let _ = poller.await;
    f.insert("refused_polled_p50_ms".into(), p50);
    f.insert("refused_polled_p99_ms".into(), p99);
    f
}

async fn hosts_case(hosts: usize, n: usize, reads: usize, latency_ms: f64) -> Figures {
    let mut f = Figures::new();
    let latency = Duration::from_secs_f64(latency_ms / 1e3);
    let (server, addr, open_ms) = fake_cluster(hosts, n, latency).await;
    f.insert("open_ms".into(), open_ms);
    let api: &dyn ManagementApi = server.as_ref();
    lists(api, &mut f).await;
    // First requests to stopped models, one at a time, each model a different one.
    let client = client();
    let mut first = Vec::new();
    let cpu = cpu_time();
    for i in 0..40.min(n) {
        let (status, took) = chat(&client, addr, &name((i * 7919) % n)).await;
        assert_eq!(status, 200);
        first.push(took);
    }
    // The whole process's: the client's side of each request too.
    f.insert(
        "first_cpu_ms".into(),
        ms(cpu_time() - cpu) / first.len().max(1) as f64,
    );
    let (p50, p99) = percentiles(first);
    f.insert("first_p50_ms".into(), p50);
    f.insert("first_p99_ms".into(), p99);
    let mut full = Vec::new();
    let (cpu, _) = process_cpu();
    for _ in 0..reads.min(10) {
        let t = Instant::now();
        std::hint::black_box(api.load_json(None).await.unwrap());
        full.push(t.elapsed());
    }
    f.insert(
        "load_cpu_ms".into(),
        ms(process_cpu().0 - cpu) / full.len().max(1) as f64,
    );
    f.insert("load_p50_ms".into(), percentiles(full).0);
    f
}
