//! What the benchmarks that drive a real standalone CapyCTL over the engine simulator share:
//! the engine simulator with every request timed inside it ([`wrapper`]), the calls it timed
//! ([`read_calls`]), wall-clock microseconds and a small HTTP client.
#![allow(dead_code)]

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;

/// Runs `task` on a multi-threaded runtime: exit status 0 when it ends well, else 1 with its
/// error after `who` on stderr.
pub fn run_to_end(
    who: &str,
    task: impl std::future::Future<Output = Result<(), String>>,
) -> ExitCode {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{who}: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(task) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{who}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Wall-clock microseconds since the Unix epoch (shared with the engine processes).
pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The engine side: the engine simulator, with every request timed.
pub mod wrapper {
    use super::*;
    use axum::body::Body;
    use axum::extract::{Request, State};
    use axum::middleware::{self, Next};
    use axum::response::{IntoResponse, Response};
    use axum::serve::ListenerExt;
    use capyctl_engine_sim::{EngineSim, SimConfig};

    /// Where the calls are written, one line each.
    struct CallLog {
        file: Mutex<std::fs::File>,
    }

    impl CallLog {
        fn write(&self, line: &str) {
            let mut f = self.file.lock().unwrap_or_else(PoisonError::into_inner);
            // One write per line (O_APPEND): the reader never sees half a line mixed in.
            if let Err(e) = f.write_all(line.as_bytes()) {
                tracing::warn!(error = %e, "cannot write the call log");
            }
        }
    }

    async fn timed(State(log): State<Arc<CallLog>>, req: Request, next: Next) -> Response {
        let start = now_us();
        let method = req.method().to_string();
        let path = req
            .uri()
            .path_and_query()
            .map(|p| p.as_str().to_string())
            .unwrap_or_default();
        let resp = next.run(req).await;
        let (mut parts, body) = resp.into_parts();
        // The whole answer (generation included) is the engine's time.
        let collected = axum::body::to_bytes(body, usize::MAX).await;
        let end = now_us();
        log.write(&format!(
            "{start}\t{end}\t{}\t{method}\t{path}\n",
            parts.status.as_u16()
        ));
        match collected {
            Ok(bytes) => {
                parts.headers.remove(http::header::TRANSFER_ENCODING);
                parts.headers.remove(http::header::CONTENT_LENGTH);
                Response::from_parts(parts, Body::from(bytes))
            }
            Err(e) => (
                http::StatusCode::INTERNAL_SERVER_ERROR,
                format!("engine-wrapper: the answer broke off: {e}"),
            )
                .into_response(),
        }
    }

    /// `<this binary> --engine-wrapper <dir> <engine-sim arguments…>`.
    pub fn main(args: &[String]) -> ExitCode {
        let Some((dir, rest)) = args.split_first() else {
            eprintln!("engine-wrapper: usage: --engine-wrapper <dir> <engine-sim arguments>");
            return ExitCode::from(2);
        };
        tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
            )
            .init();
        let config = match SimConfig::try_parse_from(
            std::iter::once("engine-sim".to_string()).chain(rest.iter().cloned()),
        ) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("engine-wrapper: {e}");
                return ExitCode::from(2);
            }
        };
        run_to_end("engine-wrapper", serve(PathBuf::from(dir), config))
    }

    async fn serve(dir: PathBuf, config: SimConfig) -> Result<(), String> {
        let listener = tokio::net::TcpListener::bind((config.host.as_str(), config.port))
            .await
            .map_err(|e| format!("cannot listen on {}:{}: {e}", config.host, config.port))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let path = dir.join(format!("calls-{}.tsv", addr.port()));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let log = Arc::new(CallLog {
            file: Mutex::new(file),
        });
        println!("engine-sim listening on {addr}");
        let app = capyctl_engine_sim::app(EngineSim::new(config))
            .layer(middleware::from_fn_with_state(log, timed));
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        axum::serve(listener, app).await.map_err(|e| e.to_string())
    }
}

/// One HTTP call an engine answered, as the engine timed it.
#[derive(Debug, Clone)]
pub struct Call {
    pub start: u64,
    pub end: u64,
    pub status: u16,
    pub method: String,
    pub path: String,
}

impl Call {
    pub fn is_answer(&self) -> bool {
        self.method == "POST" && self.path.starts_with("/v1/chat/completions")
    }
    pub fn is_background(&self) -> bool {
        self.method == "GET" && self.path.starts_with("/metrics")
    }
    pub fn us(&self) -> u64 {
        self.end.saturating_sub(self.start)
    }
}

pub fn read_calls(dir: &Path, port: u16) -> Vec<Call> {
    let text = std::fs::read_to_string(dir.join(format!("calls-{port}.tsv"))).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let mut f = l.splitn(5, '\t');
            Some(Call {
                start: f.next()?.parse().ok()?,
                end: f.next()?.parse().ok()?,
                status: f.next()?.parse().ok()?,
                method: f.next()?.to_string(),
                path: f.next()?.to_string(),
            })
        })
        .collect()
}

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub async fn http(
    client: &HttpClient,
    method: &str,
    url: String,
    token: Option<&str>,
    body: Option<String>,
) -> Result<(u16, Bytes), String> {
    let mut req = http::Request::builder().method(method).uri(&url);
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    if body.is_some() {
        req = req.header("content-type", "application/json");
    }
    let req = req
        .body(Full::new(Bytes::from(body.unwrap_or_default())))
        .map_err(|e| e.to_string())?;
    let resp = client
        .request(req)
        .await
        .map_err(|e| format!("{method} {url}: {e}"))?;
    let status = resp.status().as_u16();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("{method} {url}: {e}"))?
        .to_bytes();
    Ok((status, bytes))
}
