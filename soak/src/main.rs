//! `capyctl-soak`: runs a real standalone CapyCTL (`capyctl start standalone`) with its own host
//! and two node agents (`capyctl start host`, driven with `--node-agent`), whose engines are
//! real `engine-sim` processes, for `--duration`, under random traffic from a seeded RNG, with
//! engine faults, operator commands racing the requests, and kill -9 of CapyCTL followed by a
//! restart on the same data directory. Every request's end is recorded once, in the [`Ledger`];
//! at the end it prints a table and exits 1 when an invariant failed, naming it and the seed.
//!
//! The seed fixes every random choice (which model, streamed or not, how the client behaves,
//! which fault or command when, when to kill); the interleaving with CapyCTL's own timing is
//! not fixed, so a failing seed reproduces the same scenario, not the same microseconds.

mod catalog;
mod http;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use capyctl_engine_sim::{INTACT, Words};
use capyctl_test_support::free_port;
use clap::Parser;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use http::{Client, Raw};

/// The soak's command line.
#[derive(Parser, Debug)]
#[command(
    name = "capyctl-soak",
    about = "Runs a standalone CapyCTL and two node agents with engine-sim engines under random traffic, engine faults, operator commands and kill -9, and checks that no request is lost, cut, hung, ended twice or answered wrongly"
)]
struct Args {
    /// How long the traffic runs (`30m`, `180s`).
    #[arg(long, default_value = "30m", value_parser = capyctl_engine_sim::parse_duration)]
    duration: Duration,
    /// The RNG seed; a random one (printed) when absent.
    #[arg(long)]
    seed: Option<u64>,
    /// Clients sending requests at once.
    #[arg(long, default_value_t = 10)]
    clients: usize,
    /// Mean seconds between two kill -9 of CapyCTL (kills happen in the first 60% of the run).
    #[arg(long, default_value_t = 90)]
    kill_every: u64,
    /// The `capyctl` binary; default: beside this program.
    #[arg(long)]
    capyctl: Option<PathBuf>,
    /// The `engine-sim` binary; default: beside this program.
    #[arg(long)]
    engine_sim: Option<PathBuf>,
    /// Where the run's files go (document, data directory, logs); default: a new temporary
    /// directory, removed after a run that passed.
    #[arg(long)]
    dir: Option<PathBuf>,
}

/// The run's request deadline (`host.resource_policy.queue.request_deadline`).
const REQUEST_DEADLINE: Duration = Duration::from_secs(60);
/// The drain bound (`server.switching.drain_timeout`): short, so that long answers make drains
/// time out.
const DRAIN: Duration = Duration::from_secs(5);
/// The engines' token rate (tokens a second).
const TOKEN_RATE: u64 = 40;
/// A client's margin over the longest wait the product page allows (busy 2-core machines).
const MARGIN: Duration = Duration::from_secs(45);
/// How long a client must read nothing before CapyCTL may end its answer (the page: 10 s).
const STALL_CUT: Duration = Duration::from_secs(10);
/// Bounds on the growth of CapyCTL between the start of its last life and the end of the run.
const RSS_GROWTH_BOUND: u64 = 64 * 1024 * 1024;
const FD_GROWTH_BOUND: i64 = 32;
/// How long after the last request the soak waits, at most, for CapyCTL's descriptors and RSS
/// to come within those bounds.
const QUIET_END: Duration = Duration::from_secs(15);

/// Whether CapyCTL's footprint `end` (RSS, descriptors) is within the growth bounds of `start`.
fn within_bound((rss0, fd0): (u64, i64), (rss1, fd1): (u64, i64)) -> bool {
    rss1 <= rss0 + RSS_GROWTH_BOUND && fd1 <= fd0 + FD_GROWTH_BOUND
}

/// A deployment of the run.
struct Model {
    name: &'static str,
    engine: &'static str,
    /// The engine's model (what its answers are made from).
    model: &'static str,
    gpu_memory: &'static str,
    /// More of its deployment document (`replicas`, `scale`), empty for most.
    extra: &'static str,
}

/// Three GPUs: CapyCTL's own host's 12 GiB (two 6 GiB models, or the 10 GiB one) and each node
/// agent's 6 GiB (one 6 GiB model); five models, so that the GPUs hold one or two and most
/// requests switch. One (3 GiB) has two instances, the second brought up on load into free room
/// and parked after a short delay (`scale`), so that the scaler, routing among instances and
/// per-instance switches run under the same chaos.
const MODELS: &[Model] = &[
    Model {
        name: "soak-a",
        engine: "vllm",
        model: "Soak-A-1B",
        gpu_memory: "6GiB",
        extra: "",
    },
    Model {
        name: "soak-b",
        engine: "vllm",
        model: "Soak-B-1B",
        gpu_memory: "6GiB",
        extra: "",
    },
    Model {
        name: "soak-c",
        engine: "sglang",
        model: "Soak-C-1B",
        gpu_memory: "6GiB",
        extra: "",
    },
    Model {
        name: "soak-d",
        engine: "vllm",
        model: "Soak-D-3B",
        gpu_memory: "10GiB",
        extra: "",
    },
    Model {
        name: "soak-e",
        engine: "vllm",
        model: "Soak-E-1B",
        gpu_memory: "3GiB",
        extra: "replicas: 2\nscale: {min: 1, target_in_flight: 2, scale_down_delay: 10s}\n",
    },
];

/// SplitMix64: small, seeded, good enough to pick scenarios.
struct Rng(u64);

impl Rng {
    fn new(seed: u64, stream: u64) -> Rng {
        Rng(seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// In `0..n`.
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    /// True with probability `p` percent.
    fn percent(&mut self, p: u64) -> bool {
        self.below(100) < p
    }
    fn millis(&mut self, low: u64, high: u64) -> Duration {
        Duration::from_millis(low + self.below(high - low + 1))
    }
}

/// How a request ended. Each request gets exactly one, in [`Ledger::end`].
#[derive(Debug)]
enum End {
    Answered,
    Refused(String),
    HungUpBeforeOutput,
    HungUpMidAnswer,
    /// A client that stopped reading for 10 s or more had its answer ended (the page's rule).
    CutAfterStall,
    /// An injected engine crash ended it (its engine's crash count moved while it ran).
    EngineCrash,
    /// An operator's stop, delete or redeploy of its model ended it.
    OperatorStop,
    /// kill -9 of CapyCTL ended it, or CapyCTL was down.
    Killed,
    // The invariants: each of these must stay at 0.
    Lost(String),
    EndedTwice(String),
    Hung,
    Cut(String),
    WrongAnswer(String),
    BadRefusal(String),
}

impl End {
    fn label(&self) -> String {
        match self {
            End::Answered => "answered (text checked)".into(),
            End::Refused(code) => format!("refused: {code}"),
            End::HungUpBeforeOutput => "client hung up before output or while waiting".into(),
            End::HungUpMidAnswer => "client hung up mid-answer".into(),
            End::CutAfterStall => "ended after the client stalled >= 10 s".into(),
            End::EngineCrash => "ended by an injected engine crash (engine failure)".into(),
            End::OperatorStop => "ended by an operator stop/delete/redeploy".into(),
            End::Killed => "ended by kill -9 of CapyCTL (or sent while it was down)".into(),
            End::Lost(_) => LOST.into(),
            End::EndedTwice(_) => TWICE.into(),
            End::Hung => HUNG.into(),
            End::Cut(_) => CUT.into(),
            End::WrongAnswer(_) => WRONG.into(),
            End::BadRefusal(_) => BAD_REFUSAL.into(),
        }
    }
    fn detail(&self) -> Option<&str> {
        match self {
            End::Lost(d)
            | End::EndedTwice(d)
            | End::Cut(d)
            | End::WrongAnswer(d)
            | End::BadRefusal(d) => Some(d),
            End::Hung => Some("no end before the client's deadline"),
            _ => None,
        }
    }
}

const LOST: &str = "lost (no end at all)";
const TWICE: &str = "ended twice";
const HUNG: &str = "hung past their deadline";
const CUT: &str = "cut by a park or switch";
const WRONG: &str = "wrong answers (after a failed wake or otherwise)";
const BAD_REFUSAL: &str = "refusals not in the page's catalogue";
const INVARIANTS: &[&str] = &[LOST, TWICE, HUNG, CUT, WRONG, BAD_REFUSAL];

/// Every request's end, recorded once.
#[derive(Default)]
struct Ledger {
    inner: Mutex<LedgerInner>,
}

#[derive(Default)]
struct LedgerInner {
    sent: u64,
    open: BTreeMap<u64, String>,
    counts: BTreeMap<String, u64>,
    twice: u64,
    examples: Vec<String>,
}

impl Ledger {
    fn begin(&self, what: String) -> u64 {
        let mut l = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        l.sent += 1;
        let id = l.sent;
        l.open.insert(id, what);
        id
    }
    fn end(&self, id: u64, end: End) {
        let mut l = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let Some(what) = l.open.remove(&id) else {
            l.twice += 1;
            return;
        };
        *l.counts.entry(end.label()).or_default() += 1;
        if let Some(d) = end.detail()
            && l.examples.len() < 20
        {
            l.examples
                .push(format!("{}: request {id} ({what}): {d}", end.label()));
        }
    }
}

/// What the run shares between its tasks.
struct Run {
    seed: u64,
    run_id: String,
    capyctl: PathBuf,
    dir: PathBuf,
    data: PathBuf,
    inference: SocketAddr,
    management: SocketAddr,
    /// The node agents' listeners (`capyctl start host`): two more hosts besides CapyCTL's own.
    agents: [SocketAddr; 2],
    /// The node agents' process IDs (which host an engine is on: its parent).
    agent_pids: Mutex<Vec<u32>>,
    ledger: Ledger,
    /// CapyCTL's life: moves before every kill -9.
    life: AtomicU64,
    /// Whether CapyCTL is up (clients wait while it is not).
    up: tokio::sync::watch::Sender<bool>,
    stopping: AtomicBool,
    /// Per model: injected crashes, and operator stops/deletes/redeploys, so far.
    crashes: Vec<AtomicU64>,
    stops: Vec<AtomicU64>,
    /// Counters of the chaos: operator commands and faults by outcome.
    chaos: Mutex<BTreeMap<String, u64>>,
    /// The document revision of each model (a redeploy bumps it).
    revisions: Vec<AtomicU64>,
    /// Requests sent beside the clients (before a crash, before a kill): awaited at the end.
    side: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl Run {
    fn note(&self, what: String) {
        *self
            .chaos
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(what)
            .or_default() += 1;
    }
    fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }
    fn token(&self) -> String {
        std::fs::read_to_string(self.data.join("admin-token"))
            .unwrap_or_default()
            .trim()
            .to_owned()
    }

    fn deployment_doc(&self, m: &Model, rev: u64) -> String {
        format!(
            "name: {}\nengine: {}\nmodel: {}\nresources: {{gpu_memory: {}, weights_memory: 96MiB}}\n\
             env: {{ENGINE_SIM_WEIGHTS_BYTES: 96MiB, ENGINE_SIM_GPU_MEMORY_BYTES: {}, ENGINE_SIM_TOKEN_RATE: \"{TOKEN_RATE}\", ENGINE_SIM_STARTUP_DELAY: 300ms, SOAK_RUN: \"{}\", SOAK_MODEL: {}, SOAK_REV: \"{rev}\"}}\n{}",
            m.name, m.engine, m.model, m.gpu_memory, m.gpu_memory, self.run_id, m.name, m.extra
        )
    }

    fn document(&self, engine_sim: &Path) -> String {
        let bin = engine_sim.display();
        let mut doc = format!(
            "server:\n  listen:\n    inference: \"{}\"\n    management: \"{}\"\n  switching:\n    drain_timeout: {}s\n    wake_timeout: 10s\n\
             host:\n  id: soak-box\n  gpus: [{{memory: 12GiB}}]\n  host_memory: 256MiB\n  resource_policy:\n    queue:\n      admission_window: 300ms\n      request_deadline: {}s\n      stream_idle_timeout: 30s\n\
             \x20 engines:\n    vllm: {{command: [\"{bin}\"]}}\n    sglang: {{command: [\"{bin}\", \"--engine\", \"sglang\"]}}\ndeployments:\n",
            self.inference,
            self.management,
            DRAIN.as_secs(),
            REQUEST_DEADLINE.as_secs()
        );
        for m in MODELS {
            for (i, line) in self.deployment_doc(m, 0).lines().enumerate() {
                doc.push_str(if i == 0 { "  - " } else { "    " });
                doc.push_str(line);
                doc.push('\n');
            }
        }
        doc
    }
}

/// The host document of node agent `i` (`soak-node-0`, `soak-node-1`): one 6 GiB GPU.
fn agent_document(i: usize, engine_sim: &Path) -> String {
    let bin = engine_sim.display();
    format!(
        "id: soak-node-{i}\ngpus: [{{memory: 6GiB}}]\nhost_memory: 256MiB\n\
         engines:\n  vllm: {{command: [\"{bin}\"]}}\n  sglang: {{command: [\"{bin}\", \"--engine\", \"sglang\"]}}\n"
    )
}

/// The parent of process `pid` (from `/proc/<pid>/stat`), when it is alive.
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

impl Run {
    /// Which host runs engine `pid`: a node agent's (its parent), else CapyCTL's own.
    fn host_of(&self, pid: u32) -> String {
        let parent = parent_of(pid);
        let agents = self.agent_pids.lock().unwrap_or_else(|e| e.into_inner());
        let host = match agents.iter().position(|a| Some(*a) == parent) {
            Some(i) => format!("soak-node-{i}"),
            None => format!("own host or adopted (parent {parent:?})"),
        };
        // The instance it was started for (the runtime's variable in its environment).
        let instance = std::fs::read(format!("/proc/{pid}/environ"))
            .ok()
            .and_then(|env| {
                env.split(|b| *b == 0).find_map(|v| {
                    v.strip_prefix(b"CAPYCTL_ENGINE_INSTANCE=")
                        .map(|i| String::from_utf8_lossy(i).into_owned())
                })
            })
            .unwrap_or_else(|| "?".to_owned());
        format!("{host}, instance {instance}")
    }
}

/// The engines the node agents still run (their records, `<agent dir>/engines/<instance>.json`,
/// whose pid is alive) that CapyCTL does not drive: of a deployment it no longer has
/// (`live` holds the IDs it has), or a second one of the same instance. Read after CapyCTL's
/// clean shutdown, which leaves the node agents' engines running by design.
fn agents_orphans(run: &Run, live: &std::collections::BTreeSet<String>) -> Vec<String> {
    let mut seen = std::collections::BTreeSet::new();
    let mut orphans = Vec::new();
    for i in 0..run.agents.len() {
        let dir = run.dir.join(format!("agent-{i}")).join("engines");
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().and_then(|e| e.to_str()) != Some("json") {
                continue;
            }
            let Some(record) = std::fs::read_to_string(&path)
                .ok()
                .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            else {
                continue;
            };
            let (Some(pid), Some(instance)) = (record["pid"].as_u64(), record["instance"].as_str())
            else {
                continue;
            };
            if parent_of(pid as u32).is_none() {
                continue;
            }
            let deployment = instance.rsplit_once('-').map_or(instance, |(d, _)| d);
            if !live.contains(deployment) {
                orphans.push(format!(
                    "soak-node-{i}: {instance} (pid {pid}): its deployment is gone"
                ));
            } else if !seen.insert(instance.to_owned()) {
                orphans.push(format!(
                    "soak-node-{i}: {instance} (pid {pid}): a second engine of its instance"
                ));
            }
        }
    }
    orphans
}

/// The agent token the node agents and CapyCTL share.
const AGENT_TOKEN: &str = "soak-agent-token";

/// Starts the two node agents (`capyctl start host`, engines as child processes), each on its
/// host document and data directory, and waits until both take connections. They live for the
/// whole run: CapyCTL's kill -9 leaves them and their engines, and its restart adopts those.
async fn start_agents(run: &Run, engine_sim: &Path) -> Result<Vec<Child>> {
    let mut agents = Vec::new();
    for (i, addr) in run.agents.iter().enumerate() {
        let file = run.dir.join(format!("host-{i}.yaml"));
        std::fs::write(&file, agent_document(i, engine_sim))?;
        let log = std::fs::File::create(run.dir.join(format!("agent-{i}.log")))?;
        let child = Command::new(&run.capyctl)
            .args(["start", "host", "--file"])
            .arg(&file)
            .args(["--node-name", &format!("soak-node-{i}")])
            .args(["--engine-runtime", "process", "--listen", &addr.to_string()])
            .arg("--data-dir")
            .arg(run.dir.join(format!("agent-{i}")))
            .env("CAPYCTL_AGENT_TOKEN", AGENT_TOKEN)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .context("starting a node agent")?;
        agents.push(child);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    for addr in &run.agents {
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            if Instant::now() > deadline {
                bail!(
                    "node agent {addr} not listening within 60 s (see {}/agent-*.log)",
                    run.dir.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(agents)
}

/// Starts `capyctl start standalone` on the run's document and data directory and waits until
/// `/readyz` answers 200.
async fn start_capyctl(run: &Run) -> Result<Child> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(run.dir.join("capyctl.log"))?;
    let mut child = Command::new(&run.capyctl)
        .args(["start", "standalone", "--file"])
        .arg(run.dir.join("standalone.yaml"))
        .arg("--data-dir")
        .arg(&run.data)
        .args(
            run.agents
                .iter()
                .flat_map(|a| ["--node-agent".to_string(), format!("http://{a}")]),
        )
        .env("CAPYCTL_AGENT_TOKEN", AGENT_TOKEN)
        .env("RUST_LOG", "info")
        .env_remove("CAPYCTL_SERVER")
        .env_remove("CAPYCTL_ADMIN_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log)
        // Its own process group: a Ctrl-C of the soak ends the run, it does not reach CapyCTL.
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .context("starting capyctl")?;
    let stdout = child.stdout.take().context("capyctl's stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let first = tokio::time::timeout(Duration::from_secs(120), lines.next_line())
        .await
        .context("no banner from capyctl within 120 s")??;
    if first.is_none() {
        bail!(
            "capyctl exited at start (see {}/capyctl.log)",
            run.dir.display()
        );
    }
    // Drain the rest of stdout so that it never blocks.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(200) = get_status(run.management, "/readyz").await {
            return Ok(child);
        }
        if Instant::now() > deadline {
            bail!("capyctl not ready within 120 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A GET's status (no token).
async fn get_status(addr: SocketAddr, path: &str) -> Result<u16> {
    let body = get(addr, path, None).await?;
    Ok(body.0)
}

/// A GET's status and body.
async fn get(addr: SocketAddr, path: &str, token: Option<&str>) -> Result<(u16, Vec<u8>)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: soak\r\n{auth}Connection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut bytes = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut bytes)).await??;
    let (r, _) = http::parse(&bytes).context("no HTTP answer")?;
    Ok((r.status, r.body))
}

/// RSS (bytes) and open file descriptors of a process.
fn footprint(pid: u32) -> Option<(u64, i64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse::<u64>()
        .ok()?
        * 1024;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as i64;
    Some((rss, fds))
}

/// A process's open descriptors by kind (`pipe`, `anon_inode:[pidfd]` and the like, the
/// file's directory, and TCP sockets by what is at their other end: see [`socket_kind`]), e.g.
/// `socket tcp to an engine 12, pipe 4, /tmp/x 2`.
fn fd_kinds(pid: u32, run: &Run) -> String {
    let tcp = tcp_sockets(pid);
    let engine_ports: Vec<u16> = engines(&run.run_id)
        .into_iter()
        .filter_map(|(_, _, port)| port)
        .collect();
    let mut kinds: BTreeMap<String, u64> = BTreeMap::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let target = std::fs::read_link(entry.path())
            .map(|t| t.display().to_string())
            .unwrap_or_default();
        let kind = match target.split_once(':') {
            Some(_) if target.starts_with("anon_inode:") => target.clone(),
            Some(("socket", inode)) => {
                let inode = inode.trim_matches(|c| c == '[' || c == ']');
                match inode.parse::<u64>().ok().and_then(|i| tcp.get(&i)) {
                    Some(s) => socket_kind(s, run, &engine_ports),
                    None => "socket (not TCP)".to_owned(),
                }
            }
            Some((k, _)) if !target.starts_with('/') => k.to_owned(),
            _ => Path::new(&target)
                .parent()
                .map(|p| p.display().to_string())
                .unwrap_or(target),
        };
        *kinds.entry(kind).or_default() += 1;
    }
    kinds
        .iter()
        .map(|(k, n)| format!("{k} {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A TCP socket of `/proc/<pid>/net/tcp{,6}`: its local and remote ports and its state.
struct TcpSocket {
    local: u16,
    remote: u16,
    /// The kernel's state number: 1 established, 8 close-wait (the peer closed), 10 listening.
    state: u8,
}

/// The TCP sockets of `pid`'s network namespace, by inode.
fn tcp_sockets(pid: u32) -> std::collections::HashMap<u64, TcpSocket> {
    let mut found = std::collections::HashMap::new();
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let port = |addr: &str| {
                addr.rsplit_once(':')
                    .and_then(|(_, p)| u16::from_str_radix(p, 16).ok())
            };
            let (Some(local), Some(remote), Some(state), Some(inode)) = (
                f.get(1).and_then(|a| port(a)),
                f.get(2).and_then(|a| port(a)),
                f.get(3).and_then(|s| u8::from_str_radix(s, 16).ok()),
                f.get(9).and_then(|i| i.parse::<u64>().ok()),
            ) else {
                continue;
            };
            found.insert(
                inode,
                TcpSocket {
                    local,
                    remote,
                    state,
                },
            );
        }
    }
    found
}

/// What a TCP socket of CapyCTL is: a listener, a client's connection to one of its listeners,
/// or a connection to a node agent, to an engine (`engine_ports`: the live engines' ports), or
/// to something else; " (closed by the peer)" when the other end closed it.
fn socket_kind(s: &TcpSocket, run: &Run, engine_ports: &[u16]) -> String {
    const LISTEN: u8 = 10;
    const CLOSE_WAIT: u8 = 8;
    if s.state == LISTEN {
        return "socket tcp listening".to_owned();
    }
    let ours = [run.inference.port(), run.management.port()];
    let what = if ours.contains(&s.local) {
        "socket tcp from a client"
    } else if run.agents.iter().any(|a| a.port() == s.remote) {
        "socket tcp to a node agent"
    } else if engine_ports.contains(&s.remote) {
        "socket tcp to an engine"
    } else {
        "socket tcp to another port"
    };
    if s.state == CLOSE_WAIT {
        format!("{what} (closed by the peer)")
    } else {
        what.to_owned()
    }
}

/// The engine processes of this run: (pid, model name, port), found by the `SOAK_RUN` variable
/// every deployment sets in its engine's environment.
fn engines(run_id: &str) -> Vec<(u32, String, Option<u16>)> {
    let marker = format!("SOAK_RUN={run_id}");
    let mut found = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        let vars: Vec<&[u8]> = env.split(|b| *b == 0).collect();
        if !vars.contains(&marker.as_bytes()) {
            continue;
        }
        // Not a zombie.
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        if stat
            .rsplit_once(") ")
            .is_some_and(|(_, r)| r.starts_with('Z'))
        {
            continue;
        }
        let model = vars
            .iter()
            .find_map(|v| v.strip_prefix(b"SOAK_MODEL="))
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .unwrap_or_default();
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let args: Vec<String> = cmd
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let port = args
            .iter()
            .position(|a| a == "--port")
            .and_then(|i| args.get(i + 1))
            .and_then(|p| p.parse().ok());
        found.push((pid, model, port));
    }
    found
}

/// Which model a request asks for.
#[derive(Clone, Copy)]
enum Pick {
    /// Any, at random.
    Random,
    /// This one.
    Model(usize),
    /// This one, a long streamed answer read to its end.
    LongStream(usize),
}

/// One request: its plan, sent, its end classified and recorded.
async fn request(run: Arc<Run>, rng: &mut Rng, pick: Pick) {
    let (m, long_stream_for) = match pick {
        Pick::Random => (rng.below(MODELS.len() as u64) as usize, None),
        Pick::Model(m) => (m, None),
        Pick::LongStream(m) => (m, Some(m)),
    };
    let model = &MODELS[m];
    let stream = long_stream_for.is_some() || rng.percent(50);
    let chat = rng.percent(50);
    let long = long_stream_for.is_some() || rng.percent(4);
    let max_tokens = if long {
        200 + rng.below(400)
    } else {
        1 + rng.below(48)
    };
    let client = match rng.below(100) {
        _ if long_stream_for.is_some() => Client::Reads,
        0..=7 => Client::HangsUpAfter(rng.millis(0, 3000)),
        8..=13 => Client::HangsUpMidAnswer,
        14..=16 => Client::Stalls(rng.millis(1000, 4000)),
        17..=18 => Client::Stalls(rng.millis(11_000, 15_000)),
        _ => Client::Reads,
    };
    let content = format!("soak {} question {}", run.seed, rng.next() % 1_000_000);
    let (path, body, prompt) = if chat {
        (
            "/v1/chat/completions",
            serde_json::json!({"model": model.name, "stream": stream, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": content}]}),
            format!("user: {content}\n"),
        )
    } else {
        (
            "/v1/completions",
            serde_json::json!({"model": model.name, "stream": stream, "max_tokens": max_tokens, "prompt": content}),
            content.clone(),
        )
    };
    let stall = match client {
        Client::Stalls(d) => d,
        _ => Duration::ZERO,
    };
    let deadline = REQUEST_DEADLINE
        + DRAIN
        + Duration::from_millis(max_tokens * 1000 / TOKEN_RATE)
        + stall
        + MARGIN;
    let what = format!(
        "{} {path} stream={stream} max_tokens={max_tokens} client={client:?}",
        model.name
    );
    let life = run.life.load(Ordering::SeqCst);
    let crashes = run.crashes[m].load(Ordering::SeqCst);
    let stops = run.stops[m].load(Ordering::SeqCst);
    let id = run.ledger.begin(what);
    let body = serde_json::to_vec(&body).unwrap_or_default();
    let close = rng.percent(50);
    let raw = tokio::time::timeout(
        deadline,
        http::exchange(run.inference, path, &body, client, close),
    )
    .await;
    let killed = run.life.load(Ordering::SeqCst) != life || !*run.up.borrow();
    let crashed = run.crashes[m].load(Ordering::SeqCst) != crashes;
    let stopped = run.stops[m].load(Ordering::SeqCst) != stops;
    // An early end that something injected explains.
    let explained = |why: String| -> End {
        if killed {
            End::Killed
        } else if crashed {
            End::EngineCrash
        } else if stopped {
            End::OperatorStop
        } else if stall >= STALL_CUT {
            End::CutAfterStall
        } else {
            End::Cut(why)
        }
    };
    let end = match raw {
        Err(_) => End::Hung,
        Ok(Raw::ConnectFailed(e)) => {
            if killed {
                End::Killed
            } else {
                End::Lost(format!("connect: {e}"))
            }
        }
        Ok(Raw::HungUp { output: false }) => End::HungUpBeforeOutput,
        Ok(Raw::HungUp { output: true }) => End::HungUpMidAnswer,
        Ok(Raw::Broken { bytes, error }) => match http::parse(&bytes) {
            None if killed => End::Killed,
            None => End::Lost(format!(
                "closed with {} byte(s) and no answer ({error:?})",
                bytes.len()
            )),
            Some((r, _)) if r.status != 200 => {
                End::BadRefusal(format!("{} refusal broken off ({error:?})", r.status))
            }
            Some((r, _)) => {
                let errors = if stream {
                    http::sse(&r.body).errors
                } else {
                    Vec::new()
                };
                explained(format!(
                    "answer broken off after {} byte(s) ({error:?}), error events {errors:?}",
                    r.body.len()
                ))
            }
        },
        Ok(Raw::Complete { bytes, extra }) => classify(
            &bytes, &extra, stream, chat, model, &prompt, max_tokens, explained,
        ),
    };
    run.ledger.end(id, end);
}

/// The end of a request whose framing completed.
#[allow(clippy::too_many_arguments)]
fn classify(
    bytes: &[u8],
    extra: &[u8],
    stream: bool,
    chat: bool,
    model: &Model,
    prompt: &str,
    max_tokens: u64,
    explained: impl Fn(String) -> End,
) -> End {
    let Some((r, _)) = http::parse(bytes) else {
        return End::Lost("no head".into());
    };
    if !extra.is_empty() {
        return End::EndedTwice(format!(
            "{} byte(s) after the end: {:?}",
            extra.len(),
            String::from_utf8_lossy(&extra[..extra.len().min(200)])
        ));
    }
    if r.status != 200 {
        return match catalog::check(r.status, &r.body, r.header("retry-after")) {
            Ok(code) => End::Refused(code),
            Err(e) => End::BadRefusal(e),
        };
    }
    let expected: String = {
        let words = Words::answering(model.model, INTACT, prompt);
        (0..max_tokens).map(|i| words.token(i)).collect()
    };
    let text = if stream {
        let s = http::sse(&r.body);
        if s.done > 1 || s.after_done > 0 || (s.done == 1 && !s.errors.is_empty()) {
            return End::EndedTwice(format!(
                "{} [DONE], {} event(s) after it, errors {:?}",
                s.done, s.after_done, s.errors
            ));
        }
        if s.garbage > 0 {
            return End::Cut(format!("{} event(s) that are not JSON", s.garbage));
        }
        if !s.errors.is_empty() || s.done == 0 {
            return explained(format!(
                "stream ended with error events {:?} after {} of {} characters",
                s.errors,
                s.text.len(),
                expected.len()
            ));
        }
        s.text
    } else {
        let v: serde_json::Value = match serde_json::from_slice(&r.body) {
            Ok(v) => v,
            Err(e) => return explained(format!("answer is not JSON: {e}")),
        };
        let choice = &v["choices"][0];
        let t = if chat {
            choice["message"]["content"].as_str()
        } else {
            choice["text"].as_str()
        };
        t.unwrap_or("").to_owned()
    };
    if text == expected {
        End::Answered
    } else {
        End::WrongAnswer(format!(
            "{} answered {:?}, intact weights answer {:?}",
            model.name,
            &text[..text.len().min(80)],
            &expected[..expected.len().min(80)]
        ))
    }
}

/// One client: requests one after another until the run stops, waiting while CapyCTL is down.
async fn client(run: Arc<Run>, index: u64) {
    let mut rng = Rng::new(run.seed, 1000 + index);
    let mut up = run.up.subscribe();
    while !run.stopping() {
        if up.wait_for(|u| *u).await.is_err() {
            return;
        }
        if run.stopping() {
            return;
        }
        request(run.clone(), &mut rng, Pick::Random).await;
        tokio::time::sleep(rng.millis(0, 400)).await;
    }
}

/// `capyctl <args>` against the run's CapyCTL: "ok", or the error's code, or why neither.
async fn cli(run: &Run, args: &[&str], wait: Duration) -> String {
    let mut command = Command::new(&run.capyctl);
    command
        .arg("--server")
        .arg(format!("http://{}", run.management))
        .arg("--token")
        .arg(run.token())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let life = run.life.load(Ordering::SeqCst);
    let Ok(child) = command.spawn() else {
        return "not started".into();
    };
    match tokio::time::timeout(wait, child.wait_with_output()).await {
        Err(_) => "no answer in time".into(),
        Ok(Err(e)) => format!("error {e}"),
        Ok(Ok(out)) if out.status.success() => "ok".into(),
        Ok(Ok(out)) => {
            let err = String::from_utf8_lossy(&out.stderr);
            let line = err.trim_end();
            let code = line
                .rsplit_once('(')
                .and_then(|(_, c)| c.strip_suffix(')'))
                .filter(|c| {
                    !c.is_empty()
                        && c.chars()
                            .all(|ch| ch.is_ascii_lowercase() || ch == '_' || ch == ':')
                });
            match code {
                Some(code) => code.to_owned(),
                None if run.life.load(Ordering::SeqCst) != life || !*run.up.borrow() => {
                    "no answer (CapyCTL killed)".into()
                }
                None => format!("failed without a code: {line}"),
            }
        }
    }
}

/// Sets a fault in the engine of model `m`; false when it has no engine now.
async fn fault(run: &Run, m: usize, fault: &str) -> bool {
    let Some(port) = engines(&run.run_id)
        .into_iter()
        .find(|(_, model, _)| model == MODELS[m].name)
        .and_then(|(_, _, port)| port)
    else {
        return false;
    };
    if fault == "crash" {
        run.crashes[m].fetch_add(1, Ordering::SeqCst);
    }
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let body = format!("{{\"set\":[\"{fault}\"]}}");
    let send = async {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(
            format!(
                "POST /sim/faults HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await?;
        anyhow::Ok(())
    };
    let _ = tokio::time::timeout(Duration::from_secs(5), send).await;
    true
}

/// The chaos: operator commands and engine faults at random moments.
async fn chaos(run: Arc<Run>) {
    let mut rng = Rng::new(run.seed, 7);
    let mut up = run.up.subscribe();
    while !run.stopping() {
        tokio::time::sleep(rng.millis(1500, 5000)).await;
        if run.stopping() || up.wait_for(|u| *u).await.is_err() {
            return;
        }
        let m = rng.below(MODELS.len() as u64) as usize;
        let name = MODELS[m].name;
        let short = Duration::from_secs(60);
        match rng.below(19) {
            0..=2 => {
                let wait = rng.percent(30);
                let mut args = vec!["start", "deployment", name, "--evict"];
                if wait {
                    args.push("--wait");
                }
                let out = cli(&run, &args, Duration::from_secs(150)).await;
                run.note(format!(
                    "op start --evict{}: {out}",
                    if wait { " --wait" } else { "" }
                ));
            }
            3..=5 => {
                let out = cli(&run, &["park", "deployment", name], short).await;
                run.note(format!("op park: {out}"));
            }
            6 => {
                run.stops[m].fetch_add(1, Ordering::SeqCst);
                let out = cli(&run, &["stop", "deployment", name], short).await;
                run.note(format!("op stop: {out}"));
                tokio::time::sleep(rng.millis(500, 4000)).await;
                let out = cli(&run, &["start", "deployment", name], short).await;
                run.note(format!("op start (after stop): {out}"));
            }
            7 => {
                run.stops[m].fetch_add(1, Ordering::SeqCst);
                let out = cli(&run, &["delete", "deployment", name], short).await;
                run.note(format!("op delete: {out}"));
                tokio::time::sleep(rng.millis(500, 4000)).await;
                let out = redeploy(&run, m, false, short).await;
                run.note(format!("op deploy (after delete): {out}"));
            }
            8 => {
                run.stops[m].fetch_add(1, Ordering::SeqCst);
                let out = redeploy(&run, m, true, short).await;
                run.note(format!("op redeploy (new revision): {out}"));
            }
            9..=10 => {
                // A long stream for the model, then its engine crashes under it.
                let r = run.clone();
                let mut side = Rng::new(rng.next(), 11);
                let task =
                    tokio::spawn(async move { request(r, &mut side, Pick::LongStream(m)).await });
                run.side
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(task);
                tokio::time::sleep(rng.millis(1000, 4000)).await;
                let set = fault(&run, m, "crash").await;
                run.note(format!(
                    "fault crash mid-answer: {}",
                    if set { "set" } else { "no engine" }
                ));
            }
            f @ 11..=16 => {
                let name_f = match f {
                    11 | 12 => "wake_mismatch",
                    13 => "reload_fails",
                    14 => "wake_hangs",
                    // Beyond the list: a park or wake that claims success and does
                    // nothing, and a crash in the middle of a wake.
                    _ => ["sleep_ignored", "wake_ignored", "crash_on_wake"][rng.below(3) as usize],
                };
                let set = fault(&run, m, name_f).await;
                run.note(format!(
                    "fault {name_f}: {}",
                    if set { "set" } else { "no engine" }
                ));
                if set {
                    // Parked now, the next request wakes it through the fault.
                    let out = cli(&run, &["park", "deployment", name], short).await;
                    run.note(format!("op park (after a fault): {out}"));
                }
            }
            _ => {
                // A burst: more requests for one model than it runs at once (32).
                let n = 20 + rng.below(40);
                for i in 0..n {
                    let r = run.clone();
                    let mut side = Rng::new(rng.next(), 100 + i);
                    let task =
                        tokio::spawn(async move { request(r, &mut side, Pick::Model(m)).await });
                    run.side
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(task);
                }
                run.note("burst of 20 to 59 requests for one model".to_owned());
            }
        }
    }
}

/// `capyctl deploy model` of model `m` (a new revision when `bump`).
async fn redeploy(run: &Run, m: usize, bump: bool, wait: Duration) -> String {
    let rev = if bump {
        run.revisions[m].fetch_add(1, Ordering::SeqCst) + 1
    } else {
        run.revisions[m].load(Ordering::SeqCst)
    };
    let file = run.dir.join(format!("{}-{rev}.yaml", MODELS[m].name));
    if std::fs::write(&file, run.deployment_doc(&MODELS[m], rev)).is_err() {
        return "cannot write the document".into();
    }
    let file = file.display().to_string();
    cli(run, &["deploy", "model", "--file", &file], wait).await
}

/// After the traffic: every model, deployed and started again where the chaos left it deleted
/// or stopped, must answer (correctly) within two minutes. Returns the models that did not.
async fn all_serve(run: &Run) -> Vec<String> {
    let mut failed = Vec::new();
    for (m, model) in MODELS.iter().enumerate() {
        let deployed = redeploy(run, m, false, Duration::from_secs(60)).await;
        let started = cli(
            run,
            &["start", "deployment", model.name],
            Duration::from_secs(60),
        )
        .await;
        let prompt = format!("soak {} final check", run.seed);
        let body = serde_json::json!({"model": model.name, "max_tokens": 8, "prompt": prompt});
        let body = serde_json::to_vec(&body).unwrap_or_default();
        let until = Instant::now() + Duration::from_secs(120);
        let mut last = String::new();
        let ok = loop {
            let raw = tokio::time::timeout(
                REQUEST_DEADLINE + MARGIN,
                http::exchange(run.inference, "/v1/completions", &body, Client::Reads, true),
            )
            .await;
            match raw {
                Ok(Raw::Complete { bytes, extra }) => {
                    match classify(&bytes, &extra, false, false, model, &prompt, 8, |w| {
                        End::Cut(w)
                    }) {
                        End::Answered => break true,
                        other => last = format!("{other:?}"),
                    }
                }
                other => last = format!("{other:?}"),
            }
            if Instant::now() > until {
                break false;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        };
        if !ok {
            failed.push(format!(
                "{} (deploy: {deployed}, start: {started}, last: {last})",
                model.name
            ));
        }
    }
    failed
}

/// The GPUs of the run, in bytes: CapyCTL's own host's, then each node agent's.
const GPUS: [u64; 3] = [12 << 30, 6 << 30, 6 << 30];

/// Whether engines holding `held` bytes of GPU memory each can sit on [`GPUS`] (each engine on
/// one GPU; every assignment is tried: a necessary condition, as the engines' hosts are not
/// read).
fn fits(held: &[u64]) -> bool {
    let n = u32::try_from(held.len()).unwrap_or(u32::MAX).min(12);
    let gpus = GPUS.len() as u64;
    (0..gpus.pow(n)).any(|mut choice| {
        let mut used = [0u64; GPUS.len()];
        for b in held {
            used[(choice % gpus) as usize] += b;
            choice /= gpus;
        }
        used.iter().zip(GPUS).all(|(u, g)| *u <= g)
    })
}

/// The GPU memory every engine of the run holds now (engine-sim's `/sim/state`), by pid.
async fn gpu_held(run_id: &str) -> BTreeMap<u32, (String, u64)> {
    let mut held = BTreeMap::new();
    for (pid, model, port) in engines(run_id) {
        let Some(port) = port else { continue };
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        if let Ok(Ok((200, body))) =
            tokio::time::timeout(Duration::from_secs(2), get(addr, "/sim/state", None)).await
        {
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            if let Some(b) = v["gpu_memory_bytes"].as_u64() {
                held.insert(pid, (model, b));
            }
        }
    }
    held
}

/// Samples the engines' GPU memory four times a second: the engines that hold memory must fit on
/// the GPUs. A sample that does not fit counts only when the next one, 200 ms later, shows the same
/// engines still holding it (the engines are read one after another, not at one instant).
async fn booking(run: Arc<Run>) {
    let mut up = run.up.subscribe();
    while !run.stopping() {
        if up.wait_for(|u| *u).await.is_err() {
            return;
        }
        let a = gpu_held(&run.run_id).await;
        // The model of several instances at work: two of its engines awake at once (holding
        // more than a parked engine's residue).
        let mut awake: BTreeMap<&str, u32> = BTreeMap::new();
        for (m, b) in a.values() {
            if *b >= 1 << 30 {
                *awake.entry(m.as_str()).or_default() += 1;
            }
        }
        for (m, n) in awake {
            if n > 1 {
                run.note(format!("samples with {n} instances of {m} awake"));
            }
        }
        let bytes: Vec<u64> = a.values().map(|(_, b)| *b).filter(|b| *b > 0).collect();
        if !fits(&bytes) {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let b = gpu_held(&run.run_id).await;
            if a.iter()
                .all(|(pid, (_, x))| b.get(pid).is_some_and(|(_, y)| y >= x))
            {
                let what: Vec<String> = a
                    .iter()
                    .filter(|(_, (_, b))| *b > 0)
                    .map(|(pid, (m, b))| {
                        format!("{m} {} MiB (pid {pid}, {})", b >> 20, run.host_of(*pid))
                    })
                    .collect();
                // What CapyCTL believes at that moment (each instance's state, host and pid),
                // to tell which of its decisions put the engines there.
                let believes = instances_believed(&run).await;
                run.note(OVERBOOKED.to_owned());
                let mut l = run.ledger.inner.lock().unwrap_or_else(|e| e.into_inner());
                if l.examples.len() < 20 {
                    l.examples.push(format!(
                        "{OVERBOOKED} at {}: {}; CapyCTL says: {believes}",
                        utc_now(),
                        what.join(", ")
                    ));
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

const OVERBOOKED: &str = "GPU memory over-booked (samples)";

/// Every instance as CapyCTL's `GET /management/v1/deployments` shows it now:
/// `name#index state host pid` (or why it could not be read).
async fn instances_believed(run: &Run) -> String {
    let token = run.token();
    let body = match get(run.management, "/management/v1/deployments", Some(&token)).await {
        Ok((200, body)) => body,
        Ok((status, _)) => return format!("(deployments read: status {status})"),
        Err(e) => return format!("(deployments read: {e:#})"),
    };
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let mut out = Vec::new();
    for d in v["deployments"].as_array().into_iter().flatten() {
        for i in d["instances"].as_array().into_iter().flatten() {
            out.push(format!(
                "{}#{} {} {} pid {}",
                d["name"].as_str().unwrap_or("?"),
                i["index"],
                i["state"].as_str().unwrap_or("?"),
                i["host_id"].as_str().unwrap_or("?"),
                i["pid"],
            ));
        }
    }
    out.join(", ")
}

/// The time of day (UTC, `hh:mm:ss.mmm`), to find a moment in the logs.
fn utc_now() -> String {
    time_of_day(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis()),
    )
}

/// The time of day (UTC, `hh:mm:ss.mmm`) of `ms` milliseconds after the Unix epoch.
fn time_of_day(ms: u128) -> String {
    let (s, ms) = (ms / 1000, ms % 1000);
    format!(
        "{:02}:{:02}:{:02}.{ms:03}",
        s / 3600 % 24,
        s / 60 % 60,
        s % 60
    )
}

/// Kills CapyCTL with SIGKILL right after asking for a switch, and restarts it on the same data
/// directory; returns the new child.
async fn kill_and_restart(run: &Arc<Run>, child: &mut Child, rng: &mut Rng) -> Result<()> {
    // A request for a random model begins a switch (or not: then the kill hits whatever runs).
    let token = run.token();
    let not_ready: Vec<usize> =
        match get(run.management, "/management/v1/deployments", Some(&token)).await {
            Ok((200, body)) => {
                let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                MODELS
                    .iter()
                    .enumerate()
                    .filter(|(_, m)| {
                        v["deployments"].as_array().into_iter().flatten().any(|d| {
                            d["name"].as_str() == Some(m.name)
                                && d["state"].as_str() != Some("ready")
                        })
                    })
                    .map(|(i, _)| i)
                    .collect()
            }
            _ => Vec::new(),
        };
    let pick = if not_ready.is_empty() {
        Pick::Random
    } else {
        Pick::Model(not_ready[rng.below(not_ready.len() as u64) as usize])
    };
    let r = run.clone();
    let mut side = Rng::new(rng.next(), 3);
    let trigger = tokio::spawn(async move { request(r, &mut side, pick).await });
    // Kill as soon as a switch is seen under way (a deployment closed, parking, waking,
    // starting or stopping), else after a few seconds.
    let watch_until = Instant::now() + rng.millis(1000, 4000);
    let mut in_switch = None;
    while Instant::now() < watch_until {
        if let Ok((200, body)) =
            get(run.management, "/management/v1/deployments", Some(&token)).await
        {
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            let moving: Vec<String> = v["deployments"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|d| {
                    matches!(
                        d["state"].as_str(),
                        Some("closed" | "parking" | "waking" | "starting" | "stopping")
                    )
                })
                .map(|d| {
                    format!(
                        "{} {}",
                        d["name"].as_str().unwrap_or("?"),
                        d["state"].as_str().unwrap_or("?")
                    )
                })
                .collect();
            if !moving.is_empty() {
                in_switch = Some(moving.join(", "));
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(rng.millis(0, 150)).await;
    run.note(match &in_switch {
        Some(_) => "kill -9 with a switch under way".to_owned(),
        None => "kill -9 with no switch seen under way".to_owned(),
    });
    if let Some(states) = in_switch {
        println!("kill -9 of CapyCTL while {states}");
    }
    run.life.fetch_add(1, Ordering::SeqCst);
    run.up.send_replace(false);
    child.start_kill()?;
    let _ = child.wait().await;
    let _ = trigger.await;
    *child = start_capyctl(run).await.context("restart after kill -9")?;
    Ok(())
}

/// Sleeps until `until`; true when Ctrl-C came first (the run then ends early, as at the end
/// of its time: traffic stopped, CapyCTL stopped cleanly, the table printed).
async fn interrupted(until: Instant) -> bool {
    tokio::select! {
        () = tokio::time::sleep_until(until.into()) => false,
        _ = tokio::signal::ctrl_c() => {
            println!("capyctl-soak: interrupted; ending the run");
            true
        }
    }
}

/// The run's result: the table's rows, and the names of the failed invariants.
struct Report {
    rows: Vec<(String, String)>,
    failed: Vec<String>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    match soak(args).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("capyctl-soak: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn beside_me(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let path = exe.parent().context("no directory")?.join(name);
    if !path.exists() {
        bail!(
            "{} not found; build it (cargo build -p capyctl -p capyctl-engine-sim -p capyctl-soak) or pass --capyctl/--engine-sim",
            path.display()
        );
    }
    Ok(path)
}

async fn soak(args: Args) -> Result<bool> {
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    let capyctl = match args.capyctl {
        Some(p) => p,
        None => beside_me("capyctl")?,
    };
    let engine_sim = match args.engine_sim {
        Some(p) => p,
        None => beside_me("engine-sim")?,
    };
    let temp = args.dir.is_none();
    let dir = match args.dir {
        Some(d) => d,
        None => std::env::temp_dir().join(format!("capyctl-soak-{}-{seed}", std::process::id())),
    };
    std::fs::create_dir_all(&dir)?;
    let dir = std::fs::canonicalize(&dir)?;
    println!(
        "capyctl-soak: seed {seed}, duration {}s, {} clients; files in {}",
        args.duration.as_secs(),
        args.clients,
        dir.display()
    );
    let run = Arc::new(Run {
        seed,
        run_id: format!("{}-{seed}", std::process::id()),
        capyctl,
        data: dir.join("data"),
        inference: SocketAddr::from(([127, 0, 0, 1], free_port())),
        management: SocketAddr::from(([127, 0, 0, 1], free_port())),
        agents: [
            SocketAddr::from(([127, 0, 0, 1], free_port())),
            SocketAddr::from(([127, 0, 0, 1], free_port())),
        ],
        agent_pids: Mutex::new(Vec::new()),
        dir: dir.clone(),
        ledger: Ledger::default(),
        life: AtomicU64::new(0),
        up: tokio::sync::watch::Sender::new(false),
        stopping: AtomicBool::new(false),
        crashes: MODELS.iter().map(|_| AtomicU64::new(0)).collect(),
        stops: MODELS.iter().map(|_| AtomicU64::new(0)).collect(),
        chaos: Mutex::new(BTreeMap::new()),
        revisions: MODELS.iter().map(|_| AtomicU64::new(0)).collect(),
        side: Mutex::new(Vec::new()),
    });
    std::fs::write(dir.join("standalone.yaml"), run.document(&engine_sim))?;
    let agents = start_agents(&run, &engine_sim).await?;
    *run.agent_pids.lock().unwrap_or_else(|e| e.into_inner()) =
        agents.iter().filter_map(Child::id).collect();
    let mut child = start_capyctl(&run).await?;
    let first_pid = child.id().unwrap_or(0);
    let first = footprint(first_pid);
    let mut last_start = first;
    let mut last_start_fds = fd_kinds(first_pid, &run);
    run.up.send_replace(true);
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..args.clients {
        tasks.spawn(client(run.clone(), i as u64));
    }
    tasks.spawn(chaos(run.clone()));
    tasks.spawn(booking(run.clone()));
    // The kills, in the first 60% of the run, then the rest of the time.
    let mut rng = Rng::new(seed, 5);
    let kill_until = started + args.duration.mul_f64(0.6);
    let end_at = started + args.duration;
    let mut kills = 0u64;
    let mut ended_early = false;
    let mut failure: Option<String> = None;
    loop {
        let gap = Duration::from_secs(args.kill_every / 2 + rng.below(args.kill_every.max(1)));
        let next = Instant::now() + gap;
        if next >= kill_until {
            break;
        }
        if interrupted(next).await {
            ended_early = true;
            break;
        }
        if let Err(e) = kill_and_restart(&run, &mut child, &mut rng).await {
            failure = Some(format!("{e:#}"));
            break;
        }
        kills += 1;
        last_start = footprint(child.id().unwrap_or(0));
        last_start_fds = fd_kinds(child.id().unwrap_or(0), &run);
        run.up.send_replace(true);
    }
    if failure.is_none() && !ended_early {
        interrupted(end_at).await;
    }
    // Stop: no new request; every one ends by its own deadline.
    run.stopping.store(true, Ordering::SeqCst);
    run.up.send_replace(true);
    while tasks.join_next().await.is_some() {}
    let side: Vec<_> = std::mem::take(&mut *run.side.lock().unwrap_or_else(|e| e.into_inner()));
    for task in side {
        let _ = task.await;
    }
    let not_serving = if failure.is_none() {
        all_serve(&run).await
    } else {
        Vec::new()
    };
    // The quiet end: RSS and descriptors once they are within the bound, or as they are
    // after QUIET_END (CapyCTL closes an engine connection idle past 4 s within about 9 s).
    let pid = child.id().unwrap_or(0);
    let quiet_until = Instant::now() + QUIET_END;
    let end = loop {
        let end = footprint(pid);
        let within =
            matches!((last_start, end), (Some(start), Some(end)) if within_bound(start, end));
        if within || Instant::now() >= quiet_until {
            break end;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let end_fds = fd_kinds(pid, &run);
    let metrics = get(run.management, "/metrics", None)
        .await
        .map(|(_, b)| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    // The deployments CapyCTL has at the end, for the node agents' engines below.
    let live: std::collections::BTreeSet<String> = match get(
        run.management,
        "/management/v1/deployments",
        Some(&run.token()),
    )
    .await
    {
        Ok((200, body)) => serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| {
                v["deployments"].as_array().map(|ds| {
                    ds.iter()
                        .filter_map(|d| d["id"].as_str().map(str::to_owned))
                        .collect()
                })
            })
            .unwrap_or_default(),
        _ => Default::default(),
    };
    // A clean shutdown: SIGTERM, then no engine of this run may be left.
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let clean = tokio::time::timeout(Duration::from_secs(60), child.wait()).await;
    // What the node agents still run that CapyCTL does not drive (its clean shutdown leaves
    // their engines running, by design; the agents' own shutdown below stops every one).
    let orphans = if live.is_empty() {
        vec!["the deployments could not be read at the end".to_owned()]
    } else {
        agents_orphans(&run, &live)
    };
    // Then the node agents, which stop their engines on SIGTERM (CapyCTL leaves theirs).
    let mut agents_clean = true;
    for mut agent in agents {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &agent.id().unwrap_or(0).to_string()])
            .status();
        agents_clean &= matches!(
            tokio::time::timeout(Duration::from_secs(60), agent.wait()).await,
            Ok(Ok(s)) if s.success()
        );
    }
    let mut leaked = engines(&run.run_id);
    for _ in 0..50 {
        if leaked.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        leaked = engines(&run.run_id);
    }
    for (pid, _, _) in &leaked {
        let _ = std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
    }

    // The table.
    let l = run.ledger.inner.lock().unwrap_or_else(|e| e.into_inner());
    let mut report = Report {
        rows: Vec::new(),
        failed: Vec::new(),
    };
    let mut row = |k: &str, v: String| report.rows.push((k.to_owned(), v));
    row("seed", seed.to_string());
    row("duration", format!("{} s", started.elapsed().as_secs()));
    row("requests sent", l.sent.to_string());
    for (label, n) in &l.counts {
        if !INVARIANTS.contains(&label.as_str()) {
            row(label, n.to_string());
        }
    }
    let lost = l.counts.get(LOST).copied().unwrap_or(0) + l.open.len() as u64;
    let twice = l.counts.get(TWICE).copied().unwrap_or(0) + l.twice;
    let inv = [
        (LOST, lost),
        (TWICE, twice),
        (HUNG, l.counts.get(HUNG).copied().unwrap_or(0)),
        (CUT, l.counts.get(CUT).copied().unwrap_or(0)),
        (WRONG, l.counts.get(WRONG).copied().unwrap_or(0)),
        (BAD_REFUSAL, l.counts.get(BAD_REFUSAL).copied().unwrap_or(0)),
        ("engine processes leaked after the run", leaked.len() as u64),
        (
            "engines on node agents that CapyCTL does not drive",
            orphans.len() as u64,
        ),
        (
            "models not answering after the run",
            not_serving.len() as u64,
        ),
        (
            OVERBOOKED,
            run.chaos
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(OVERBOOKED)
                .unwrap_or(0),
        ),
    ];
    let mut failed = Vec::new();
    for (name, n) in inv {
        row(&format!("{name} (must be 0)"), n.to_string());
        if n > 0 {
            failed.push(name.to_owned());
        }
    }
    row("kill -9 of CapyCTL mid-switch, restarts", kills.to_string());
    for (k, n) in run.chaos.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        row(k, n.to_string());
    }
    for line in metrics.lines() {
        if (line.starts_with("capyctl_wakes_total{") || line.starts_with("capyctl_switches_total{"))
            && !line.ends_with(" 0")
        {
            let (k, v) = line.rsplit_once(' ').unwrap_or((line, ""));
            row(&format!("{k} (last life)"), v.to_owned());
        }
    }
    let mib = |b: u64| format!("{:.1} MiB", b as f64 / 1048576.0);
    if let Some((rss, fds)) = first {
        row(
            "CapyCTL at its first start: RSS, fds",
            format!("{}, {fds}", mib(rss)),
        );
    }
    match (last_start, end) {
        (Some((rss0, fd0)), Some((rss1, fd1))) => {
            row(
                "CapyCTL at its last start: RSS, fds",
                format!("{}, {fd0}", mib(rss0)),
            );
            row(
                "CapyCTL at the end: RSS, fds",
                format!("{}, {fd1}", mib(rss1)),
            );
            row(
                "CapyCTL's descriptors at its last start",
                last_start_fds.clone(),
            );
            row("CapyCTL's descriptors at the end", end_fds.clone());
            let ok = within_bound((rss0, fd0), (rss1, fd1));
            row(
                &format!(
                    "growth within bound (RSS +{}, fds +{FD_GROWTH_BOUND})",
                    mib(RSS_GROWTH_BOUND)
                ),
                ok.to_string(),
            );
            if !ok {
                failed.push("RSS or descriptors of CapyCTL grew beyond the bound".into());
            }
        }
        _ => {
            row("CapyCTL footprint", "not read".into());
            failed.push("CapyCTL's RSS and descriptors could not be read".into());
        }
    }
    match clean {
        Ok(Ok(s)) if s.success() => row("clean shutdown (SIGTERM)", "exit 0".into()),
        other => {
            row("clean shutdown (SIGTERM)", format!("{other:?}"));
            failed.push("clean shutdown".into());
        }
    }
    row(
        "node agents' clean shutdown (SIGTERM)",
        if agents_clean { "exit 0" } else { "failed" }.into(),
    );
    if !agents_clean {
        failed.push("node agents' clean shutdown".into());
    }
    if let Some(f) = &failure {
        row("aborted", f.clone());
        failed.push(format!("run aborted: {f}"));
    }
    let width = report.rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    println!("\n| {:width$} | value |", "what");
    println!("|{}|-------|", "-".repeat(width + 2));
    for (k, v) in &report.rows {
        println!("| {k:width$} | {v} |");
    }
    for m in &not_serving {
        println!("not answering after the run: {m}");
    }
    for o in &orphans {
        println!("engine on a node agent that CapyCTL does not drive: {o}");
    }
    for e in &l.examples {
        println!("example: {e}");
    }
    report.failed = failed;
    if report.failed.is_empty() {
        println!("\ncapyctl-soak: PASSED (seed {seed})");
        if temp {
            let _ = std::fs::remove_dir_all(&dir);
        }
        Ok(true)
    } else {
        for f in &report.failed {
            println!("capyctl-soak: FAILED: {f} (seed {seed}; rerun with --seed {seed})");
        }
        println!("files kept in {}", dir.display());
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placements() {
        const G: u64 = 1 << 30;
        // GPUs of 12, 6 and 6 GiB.
        const M: u64 = 1 << 20;
        assert!(fits(&[6 * G, 6 * G, 6 * G, 6 * G]));
        assert!(fits(&[10 * G, 6 * G, 6 * G]));
        assert!(fits(&[6 * G, 6 * G, 6 * G, 24 * M]));
        assert!(!fits(&[10 * G, 10 * G]));
        assert!(!fits(&[10 * G, 6 * G, 6 * G, 6 * G]));
        assert!(!fits(&[6 * G, 6 * G, 6 * G, 6 * G, 24 * M]));
        assert!(fits(&[]));
    }

    #[test]
    fn the_time_of_day_of_an_example() {
        // 2026-12-07T08:09:47.180Z.
        assert_eq!(time_of_day(1_796_630_987_180), "08:09:47.180");
        assert_eq!(time_of_day(0), "00:00:00.000");
    }

    #[test]
    fn seeded() {
        let (mut a, mut b) = (Rng::new(7, 1), Rng::new(7, 1));
        assert_eq!(
            (0..5).map(|_| a.next()).collect::<Vec<_>>(),
            (0..5).map(|_| b.next()).collect::<Vec<_>>()
        );
        assert_ne!(Rng::new(7, 1).next(), Rng::new(7, 2).next());
    }
}
