//! Just enough of the W3C WebDriver protocol (plain HTTP and JSON) to drive Debian's Chromium
//! headless through `chromedriver`: open a URL, run a script in the page, type into an element,
//! click it, take a screenshot. The HTTP client is hyper-util's, on a runtime of its own, so
//! that the synchronous tests can call it.
#![allow(dead_code, clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

/// Set to `1` to skip the browser tests where Chromium is not installed (CI installs it).
pub const SKIP_ENV: &str = "CAPYCTL_SKIP_BROWSER";

/// How to install what the browser tests need, for the failure message.
pub const INSTALL: &str = "install them with `apt-get install -y chromium chromium-driver` \
    (Debian; CI's .ci/run does), point CAPYCTL_CHROMIUM and CAPYCTL_CHROMEDRIVER at them, or \
    set CAPYCTL_SKIP_BROWSER=1 to skip the browser tests";

/// The viewport the screenshots have.
pub const VIEWPORT: (u32, u32) = (1280, 800);

/// Chromium and chromedriver on this machine.
#[derive(Debug, Clone)]
pub struct Browser {
    /// The browser binary.
    pub chromium: PathBuf,
    /// chromedriver.
    pub driver: PathBuf,
}

impl Browser {
    /// Chromium and chromedriver (`CAPYCTL_CHROMIUM` and `CAPYCTL_CHROMEDRIVER`, else found on
    /// the `PATH`). When one is missing the test fails saying how to install them, unless
    /// `CAPYCTL_SKIP_BROWSER=1` is set: then `None`, and a line on stderr.
    #[track_caller]
    pub fn find_or_fail() -> Option<Browser> {
        let chromium = std::env::var_os("CAPYCTL_CHROMIUM")
            .map(PathBuf::from)
            .or_else(|| {
                [
                    "chromium",
                    "chromium-browser",
                    "google-chrome",
                    "google-chrome-stable",
                ]
                .iter()
                .find_map(|n| on_path(n))
            });
        let driver = std::env::var_os("CAPYCTL_CHROMEDRIVER")
            .map(PathBuf::from)
            .or_else(|| on_path("chromedriver"));
        match (chromium, driver) {
            (Some(chromium), Some(driver)) if chromium.exists() && driver.exists() => {
                Some(Browser { chromium, driver })
            }
            (chromium, driver) => {
                let missing = match (
                    chromium.filter(|p| p.exists()),
                    driver.filter(|p| p.exists()),
                ) {
                    (None, None) => "chromium and chromedriver are",
                    (None, Some(_)) => "chromium is",
                    _ => "chromedriver is",
                };
                if std::env::var(SKIP_ENV).is_ok_and(|v| v == "1") {
                    eprintln!("SKIPPED: {missing} not installed and {SKIP_ENV}=1 is set");
                    return None;
                }
                panic!("the browser test needs Chromium: {missing} not found; {INSTALL}");
            }
        }
    }
}

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// A chromedriver process and one headless Chromium session through it.
pub struct Session {
    driver: Child,
    base: String,
    id: String,
    runtime: tokio::runtime::Runtime,
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Session {
    /// Starts chromedriver on a free port and a headless Chromium session with a
    /// [`VIEWPORT`]-sized window; chromedriver's log goes to `log`.
    pub fn start(browser: &Browser, log: &Path) -> Session {
        let log_file = std::fs::File::create(log).unwrap();
        let mut driver = Command::new(&browser.driver)
            .arg("--port=0")
            .arg(format!(
                "--log-path={}",
                log.with_extension("verbose.log").display()
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log_file)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}; {INSTALL}", browser.driver.display()));
        // "ChromeDriver was started successfully on port 43849."
        let stdout = driver.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(port) = line
                    .split("on port ")
                    .nth(1)
                    .and_then(|p| p.trim_end_matches('.').trim().parse::<u16>().ok())
                    .filter(|p| *p != 0)
                {
                    let _ = tx.send(port);
                }
            }
        });
        let port = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(port) => port,
            Err(_) => {
                let _ = driver.kill();
                panic!(
                    "chromedriver did not say its port within 30 s; see {}",
                    log.display()
                );
            }
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let client = Client::builder(TokioExecutor::new()).build_http();
        let mut session = Session {
            driver,
            base: format!("http://127.0.0.1:{port}"),
            id: String::new(),
            runtime,
            client,
        };
        let args = [
            "--headless=new".to_string(),
            "--no-sandbox".to_string(),
            "--disable-gpu".to_string(),
            "--disable-dev-shm-usage".to_string(),
            "--no-first-run".to_string(),
            "--hide-scrollbars".to_string(),
            format!("--window-size={},{}", VIEWPORT.0, VIEWPORT.1),
        ];
        let created = session.call(
            "POST",
            "/session",
            Some(json!({"capabilities": {"alwaysMatch": {
                "browserName": "chrome",
                "goog:loggingPrefs": {"browser": "ALL"},
                "goog:chromeOptions": {
                    "binary": browser.chromium.display().to_string(),
                    "args": args,
                },
            }}})),
        );
        session.id = created["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no sessionId in {created}"))
            .to_string();
        // The window holds more than the viewport (headless Chromium keeps room for its
        // toolbars): grow it by the difference so that the viewport is VIEWPORT.
        let frame = session.eval(
            "return [window.outerWidth - window.innerWidth, window.outerHeight - window.innerHeight];",
        );
        let (dw, dh) = (
            frame[0].as_u64().unwrap_or(0),
            frame[1].as_u64().unwrap_or(0),
        );
        session.call(
            "POST",
            &session.at("/window/rect"),
            Some(
                json!({"width": u64::from(VIEWPORT.0) + dw, "height": u64::from(VIEWPORT.1) + dh}),
            ),
        );
        session
    }

    /// One WebDriver command: its `value`, or a panic naming the WebDriver error.
    pub fn call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        match self.try_call(method, path, body) {
            Ok(v) => v,
            Err(e) => panic!("WebDriver {method} {path}: {e}"),
        }
    }

    fn try_call(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, String> {
        let request = http::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header("content-type", "application/json; charset=utf-8")
            .body(Full::new(Bytes::from(
                body.map(|b| b.to_string()).unwrap_or_default(),
            )))
            .unwrap();
        let (status, bytes) = self.runtime.block_on(async {
            let fut = async {
                let response = self
                    .client
                    .request(request)
                    .await
                    .map_err(|e| e.to_string())?;
                let status = response.status();
                let bytes = response
                    .into_body()
                    .collect()
                    .await
                    .map_err(|e| e.to_string())?
                    .to_bytes();
                Ok::<_, String>((status, bytes))
            };
            tokio::time::timeout(Duration::from_secs(120), fut)
                .await
                .map_err(|_| "no answer within 120 s".to_string())?
        })?;
        let v: Value = serde_json::from_slice(&bytes).map_err(|e| {
            format!(
                "{status}, not JSON ({e}): {}",
                String::from_utf8_lossy(&bytes)
            )
        })?;
        if !status.is_success() {
            return Err(format!(
                "{status}: {} {}",
                v["value"]["error"], v["value"]["message"]
            ));
        }
        Ok(v["value"].clone())
    }

    fn at(&self, rest: &str) -> String {
        format!("/session/{}{rest}", self.id)
    }

    /// Opens `url`.
    pub fn open(&self, url: &str) {
        self.call("POST", &self.at("/url"), Some(json!({"url": url})));
    }

    /// Runs `script` (a function body: `return ...;`) in the page; what it returns.
    pub fn eval(&self, script: &str) -> Value {
        self.call(
            "POST",
            &self.at("/execute/sync"),
            Some(json!({"script": script, "args": []})),
        )
    }

    /// Runs `script` every 100 ms until it returns something truthy (not `null`, `false`, `0`
    /// or `""`), for up to `patience`; that value. Panics with `what` and the last value.
    #[track_caller]
    pub fn wait_for(&self, what: &str, patience: Duration, script: &str) -> Value {
        let start = Instant::now();
        loop {
            let v = self.eval(script);
            let truthy = match &v {
                Value::Null => false,
                Value::Bool(b) => *b,
                Value::Number(n) => n.as_f64() != Some(0.0),
                Value::String(s) => !s.is_empty(),
                _ => true,
            };
            if truthy {
                return v;
            }
            if start.elapsed() > patience {
                let status = self.eval("return document.getElementById('status')?.textContent;");
                panic!(
                    "the page never showed {what} in {patience:?}: last {v}; status line {status}"
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The WebDriver element reference of the first match of `css`.
    pub fn element(&self, css: &str) -> String {
        let v = self.call(
            "POST",
            &self.at("/element"),
            Some(json!({"using": "css selector", "value": css})),
        );
        v.as_object()
            .and_then(|o| o.values().next())
            .and_then(Value::as_str)
            .unwrap_or_else(|| panic!("no element reference for {css}: {v}"))
            .to_string()
    }

    /// Types `text` into the element `css`, as a user would.
    pub fn type_into(&self, css: &str, text: &str) {
        let e = self.element(css);
        self.call(
            "POST",
            &self.at(&format!("/element/{e}/value")),
            Some(json!({"text": text})),
        );
    }

    /// Clicks the element `css`.
    pub fn click(&self, css: &str) {
        let e = self.element(css);
        self.call(
            "POST",
            &self.at(&format!("/element/{e}/click")),
            Some(json!({})),
        );
    }

    /// The browser's console messages since the last call (chromedriver's log extension):
    /// `(level, message)`, e.g. `("SEVERE", "... violates the following Content Security Policy
    /// directive ...")`.
    pub fn console(&self) -> Vec<(String, String)> {
        let v = self.call(
            "POST",
            &self.at("/se/log"),
            Some(json!({"type": "browser"})),
        );
        v.as_array()
            .unwrap_or_else(|| panic!("browser log: {v}"))
            .iter()
            .map(|e| {
                (
                    e["level"].as_str().unwrap_or("").to_string(),
                    e["message"].as_str().unwrap_or("").to_string(),
                )
            })
            .collect()
    }

    /// A PNG screenshot of the viewport.
    pub fn screenshot(&self) -> Vec<u8> {
        let v = self.call("GET", &self.at("/screenshot"), None);
        base64_decode(v.as_str().unwrap_or_else(|| panic!("screenshot: {v}")))
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if !self.id.is_empty() {
            let _ = self.try_call("DELETE", &self.at(""), None);
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

/// Standard base64 (WebDriver's screenshots), padding optional.
fn base64_decode(text: &str) -> Vec<u8> {
    let value = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {:?}", char::from(c)),
        }
    };
    let digits: Vec<u8> = text
        .bytes()
        .filter(|c| !c.is_ascii_whitespace() && *c != b'=')
        .collect();
    let mut out = Vec::with_capacity(digits.len() * 3 / 4);
    for chunk in digits.chunks(4) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, c)| n | value(*c) << (18 - 6 * i));
        out.extend_from_slice(&n.to_be_bytes()[1..chunk.len()]);
    }
    out
}

/// A PNG's width and height (its IHDR chunk).
pub fn png_size(png: &[u8]) -> Option<(u32, u32)> {
    if png.len() < 24 || &png[..8] != b"\x89PNG\r\n\x1a\n" || &png[12..16] != b"IHDR" {
        return None;
    }
    let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    Some((be(&png[16..20]), be(&png[20..24])))
}

#[test]
fn base64_decodes_every_length() {
    assert_eq!(base64_decode("aGVsbG8="), b"hello");
    assert_eq!(base64_decode("aGVsbG8h"), b"hello!");
    assert_eq!(base64_decode("aGk="), b"hi");
    assert_eq!(base64_decode(""), b"");
}
