//! A small pooled HTTP/1 client for engine control calls, with a timeout on every call and
//! errors that name the engine, the step and the URL.

use std::time::Duration;

use bytes::Bytes;
use capyctl_spec::EngineKind;
use http::{Method, Request, header};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

use crate::error::AgentError;

/// How much of an error body an error message keeps.
const BODY_IN_ERROR: usize = 300;
/// The largest answer read from an engine (its `/metrics` text is the largest, some hundred
/// KiB): an engine that sends more is answered an error rather than held in memory whole.
pub const MAX_ANSWER_BYTES: usize = 16 * 1024 * 1024;

/// One engine call: which engine, which step, where.
#[derive(Debug, Clone, Copy)]
pub struct Call<'a> {
    /// The engine.
    pub engine: EngineKind,
    /// The step's name (`sleep`, `wake_up`, `reload_weights`, `health`, ...).
    pub step: &'static str,
    /// The URL.
    pub url: &'a str,
    /// The bound on the whole call, body included.
    pub timeout: Duration,
}

/// The pooled client. Cheap to clone; connections are reused across calls.
#[derive(Debug, Clone)]
pub struct EngineClient {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Default for EngineClient {
    fn default() -> Self {
        Self::new()
    }
}

impl EngineClient {
    /// A client keeping up to 8 idle connections per engine for 90 s.
    pub fn new() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(8)
            .build(connector);
        Self { client }
    }

    /// Sends one request and returns the status and body, whatever the status.
    pub async fn send(
        &self,
        call: Call<'_>,
        method: Method,
        body: Option<&Value>,
    ) -> Result<(u16, Bytes), AgentError> {
        let mut builder = Request::builder().method(method).uri(call.url);
        let body = match body {
            Some(v) => {
                builder = builder.header(header::CONTENT_TYPE, "application/json");
                Full::new(Bytes::from(v.to_string()))
            }
            None => Full::new(Bytes::new()),
        };
        let request = builder.body(body).map_err(|e| AgentError::EngineAnswer {
            engine: call.engine,
            step: call.step,
            url: call.url.to_string(),
            detail: format!("cannot build the request: {e}"),
        })?;
        let exchange = async {
            let response = self.client.request(request).await.map_err(|source| {
                AgentError::EngineUnreachable {
                    engine: call.engine,
                    step: call.step,
                    url: call.url.to_string(),
                    source: Box::new(source),
                }
            })?;
            let status = response.status().as_u16();
            // A body that breaks off is a connection lost mid-answer (the engine went away); one
            // over MAX_ANSWER_BYTES is not read further.
            let bytes = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
                .collect()
                .await
                .map_err(|source| {
                    if source.downcast_ref::<LengthLimitError>().is_some() {
                        AgentError::EngineAnswer {
                            engine: call.engine,
                            step: call.step,
                            url: call.url.to_string(),
                            detail: format!(
                                "the answer is longer than {} MiB",
                                MAX_ANSWER_BYTES >> 20
                            ),
                        }
                    } else {
                        AgentError::EngineUnreachable {
                            engine: call.engine,
                            step: call.step,
                            url: call.url.to_string(),
                            source,
                        }
                    }
                })?
                .to_bytes();
            Ok((status, bytes))
        };
        match tokio::time::timeout(call.timeout, exchange).await {
            Ok(result) => result,
            Err(_) => Err(AgentError::EngineTimeout {
                engine: call.engine,
                step: call.step,
                url: call.url.to_string(),
                after: call.timeout,
            }),
        }
    }

    /// Sends one request and insists on a 2xx status; returns the body.
    pub async fn expect_ok(
        &self,
        call: Call<'_>,
        method: Method,
        body: Option<&Value>,
    ) -> Result<Bytes, AgentError> {
        let (status, bytes) = self.send(call, method, body).await?;
        if (200..300).contains(&status) {
            Ok(bytes)
        } else {
            Err(AgentError::EngineStatus {
                engine: call.engine,
                step: call.step,
                url: call.url.to_string(),
                status,
                body: excerpt(&bytes),
            })
        }
    }

    /// Like [`EngineClient::expect_ok`], and parses the body as JSON.
    pub async fn expect_json(
        &self,
        call: Call<'_>,
        method: Method,
        body: Option<&Value>,
    ) -> Result<Value, AgentError> {
        let bytes = self.expect_ok(call, method, body).await?;
        serde_json::from_slice(&bytes).map_err(|e| AgentError::EngineAnswer {
            engine: call.engine,
            step: call.step,
            url: call.url.to_string(),
            detail: format!("the answer is not JSON ({e}): {}", excerpt(&bytes)),
        })
    }
}

/// The start of a body, as text, for an error message.
pub fn excerpt(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let text = text.trim();
    match text.char_indices().nth(BODY_IN_ERROR) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_string(),
    }
}
