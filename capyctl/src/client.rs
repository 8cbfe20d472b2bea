//! The management API client: every command but `check` and `start standalone` goes through
//! it, and only through the routes of DESIGN.md 4.5.
//!
//! The server is `--server` / `CAPYCTL_SERVER` (default `http://127.0.0.1:7443`); a path in the
//! URL is kept as a prefix (a proxy in front of the server). The token is `--token` /
//! `CAPYCTL_ADMIN_TOKEN` / the standalone data directory's `admin-token` file. Errors are one
//! line each: the server's catalogue error (`message (code)`), or what kept the request from
//! reaching it.

use std::path::{Path, PathBuf};

use bytes::Bytes;
use capyctl_spec::api::PREFIX;
use http::{Method, Request, StatusCode, Uri, header};
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::de::DeserializeOwned;

/// The default management address (DESIGN.md 4.3).
pub const DEFAULT_SERVER: &str = "http://127.0.0.1:7443";

/// Why a command failed; `Display` is the one line printed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server answered with one of its errors.
    #[error("{message} ({code})")]
    Api {
        /// The HTTP status.
        status: StatusCode,
        /// The error's code.
        code: String,
        /// The error's message.
        message: String,
    },
    /// The server could not be reached.
    #[error(
        "cannot reach the CapyCTL server at {server}: {detail} (is `capyctl start standalone` running? set --server or CAPYCTL_SERVER)"
    )]
    Unreachable {
        /// The server's URL.
        server: String,
        /// What the connection said.
        detail: String,
    },
    /// The server's answer was not what the API says.
    #[error("the server at {server} answered {what}")]
    BadAnswer {
        /// The server's URL.
        server: String,
        /// What was wrong with it.
        what: String,
    },
    /// No admin token could be found.
    #[error(
        "no admin token: pass --token, set CAPYCTL_ADMIN_TOKEN, or run where `capyctl start standalone` keeps {}",
        path.display()
    )]
    NoToken {
        /// The token file looked for.
        path: PathBuf,
    },
    /// The token file exists but cannot be read.
    #[error("cannot read the admin token file {}: {source}", path.display())]
    TokenFile {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// `--ca-file` cannot be used.
    #[error("--ca-file {}: {detail}", path.display())]
    CaFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        detail: String,
    },
    /// `--server` is not a URL this client can use.
    #[error("--server {server}: {why}")]
    BadServer {
        /// What was given.
        server: String,
        /// Why it does not work.
        why: &'static str,
    },
}

/// The standalone data directory: `$CAPYCTL_DATA_DIR`, else `$XDG_STATE_HOME/capyctl`, else
/// `~/.local/state/capyctl`, else `./.capyctl` when there is no home.
pub fn default_data_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CAPYCTL_DATA_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_STATE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir).join("capyctl");
    }
    match std::env::var_os("HOME").filter(|d| !d.is_empty()) {
        Some(home) => PathBuf::from(home).join(".local/state/capyctl"),
        None => PathBuf::from(".capyctl"),
    }
}

/// The token: `given` (flag or variable) if any, else the data directory's token file.
pub fn resolve_token(given: Option<String>, data_dir: &Path) -> Result<String, ClientError> {
    if let Some(token) = given
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
    {
        return Ok(token);
    }
    let path = capyctl_server::management::token_path(data_dir);
    match std::fs::read_to_string(&path) {
        Ok(text) if !text.trim().is_empty() => Ok(text.trim().to_string()),
        Ok(_) => Err(ClientError::NoToken { path }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(ClientError::NoToken { path }),
        Err(source) => Err(ClientError::TokenFile { path, source }),
    }
}

/// The TLS client configuration: the roots of `ca_file` (PEM) when given, else the system's.
fn tls_config(ca_file: Option<&Path>) -> Result<rustls::ClientConfig, ClientError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            let bad = |detail: String| ClientError::CaFile {
                path: path.to_path_buf(),
                detail,
            };
            let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
                .map_err(|e| bad(e.to_string()))?
                .collect::<Result<_, _>>()
                .map_err(|e| bad(e.to_string()))?;
            if certs.is_empty() {
                return Err(bad("it holds no PEM certificate".into()));
            }
            for cert in certs {
                roots.add(cert).map_err(|e| bad(e.to_string()))?;
            }
        }
        None => {
            // Certificates the system's store cannot parse are skipped.
            for cert in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(cert);
            }
        }
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ClientError::CaFile {
            path: ca_file.map(Path::to_path_buf).unwrap_or_default(),
            detail: e.to_string(),
        })?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(config)
}

/// A management API client.
#[derive(Clone)]
pub struct Client {
    /// `scheme://authority` plus any path prefix, without a trailing `/` (under kubectl: the
    /// service-proxy path on the API server).
    base: String,
    token: String,
    transport: Transport,
}

/// How requests reach the management API.
#[derive(Clone)]
enum Transport {
    /// Straight to `--server` (`http://`, or `https://` verified against the system's roots
    /// or `--ca-file`).
    Direct(Box<HyperClient<HttpsConnector<HttpConnector>, Full<Bytes>>>),
    /// Through the Kubernetes API server's service proxy, authenticated by the kubeconfig; the
    /// admin token then travels in [`capyctl_spec::auth::TOKEN_HEADER`]. With where the
    /// user's Deployment objects go.
    Kube(kube::Client, std::sync::Arc<crate::cluster::Target>),
}

/// One answer: status and body.
#[derive(Debug)]
pub struct Answer {
    /// The status (2xx: errors are [`ClientError::Api`]).
    pub status: StatusCode,
    /// The body.
    pub body: Bytes,
}

impl Answer {
    /// The body as `T`.
    pub fn json<T: DeserializeOwned>(&self, server: &str) -> Result<T, ClientError> {
        serde_json::from_slice(&self.body).map_err(|e| ClientError::BadAnswer {
            server: server.to_string(),
            what: format!("a body that is not what the API says: {e}"),
        })
    }

    /// The body, pretty-printed when it is JSON.
    pub fn pretty(&self) -> String {
        match serde_json::from_slice::<serde_json::Value>(&self.body) {
            Ok(v) => serde_json::to_string_pretty(&v)
                .unwrap_or_else(|_| String::from_utf8_lossy(&self.body).into_owned()),
            Err(_) => String::from_utf8_lossy(&self.body).into_owned(),
        }
    }
}

impl Client {
    /// A client for `server` with `token` (an `https://` server verified against the system's
    /// root certificates).
    pub fn new(server: &str, token: String) -> Result<Client, ClientError> {
        Self::with_ca(server, token, None)
    }

    /// A client for `server` with `token`; an `https://` server is verified against the PEM
    /// certificates of `ca_file` when given (a private CA), else the system's roots.
    pub fn with_ca(
        server: &str,
        token: String,
        ca_file: Option<&Path>,
    ) -> Result<Client, ClientError> {
        let bad = |why| ClientError::BadServer {
            server: server.to_string(),
            why,
        };
        let uri: Uri = server.parse().map_err(|_| bad("not a URL"))?;
        match uri.scheme_str() {
            Some("http" | "https") => {}
            _ => return Err(bad("must start with http:// or https://")),
        }
        if uri.authority().is_none() {
            return Err(bad("has no host"));
        }
        if uri.query().is_some() {
            return Err(bad("must not have a query"));
        }
        let base = server.trim_end_matches('/').to_string();
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.enforce_http(false);
        let tls = tls_config(ca_file)?;
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(connector);
        let http = HyperClient::builder(TokioExecutor::new()).build(connector);
        Ok(Client {
            base,
            token,
            transport: Transport::Direct(Box::new(http)),
        })
    }

    /// A client reaching the management API through the API server's service proxy: `base` is
    /// `/api/v1/namespaces/{namespace}/services/{name}:{port}/proxy`.
    pub fn through_kube(
        client: kube::Client,
        target: crate::cluster::Target,
        base: String,
        token: String,
    ) -> Client {
        Client {
            base,
            token,
            transport: Transport::Kube(client, std::sync::Arc::new(target)),
        }
    }

    /// Under `kubectl capyctl`: the Kubernetes client and where the Deployment objects go.
    pub fn cluster(&self) -> Option<(kube::Client, &crate::cluster::Target)> {
        match &self.transport {
            Transport::Kube(client, target) => Some((client.clone(), target.as_ref())),
            Transport::Direct(_) => None,
        }
    }

    /// The server's URL as given.
    pub fn server(&self) -> &str {
        &self.base
    }

    /// `GET {PREFIX}{path}`.
    pub async fn get(&self, path: &str) -> Result<Answer, ClientError> {
        self.call(Method::GET, path, None).await
    }

    /// `POST {PREFIX}{path}` with a JSON body.
    pub async fn post_json(
        &self,
        path: &str,
        body: &serde_json::Value,
    ) -> Result<Answer, ClientError> {
        let bytes = Bytes::from(body.to_string());
        self.call(Method::POST, path, Some(("application/json", bytes)))
            .await
    }

    /// `POST {PREFIX}{path}` with a YAML body.
    pub async fn post_yaml(&self, path: &str, yaml: String) -> Result<Answer, ClientError> {
        self.call(Method::POST, path, Some(("application/yaml", yaml.into())))
            .await
    }

    /// `DELETE {PREFIX}{path}`.
    pub async fn delete(&self, path: &str) -> Result<Answer, ClientError> {
        self.call(Method::DELETE, path, None).await
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<(&'static str, Bytes)>,
    ) -> Result<Answer, ClientError> {
        let url = format!("{}{PREFIX}{path}", self.base);
        let mut request = Request::builder()
            .method(method)
            .uri(&url)
            .header(header::ACCEPT, "application/json");
        request = match self.transport {
            Transport::Direct(_) => {
                request.header(header::AUTHORIZATION, format!("Bearer {}", self.token))
            }
            Transport::Kube(..) => request.header(capyctl_spec::auth::TOKEN_HEADER, &self.token),
        };
        let body = match body {
            Some((kind, bytes)) => {
                request = request.header(header::CONTENT_TYPE, kind);
                bytes
            }
            None => Bytes::new(),
        };
        let request = request.body(body).map_err(|e| ClientError::BadServer {
            server: self.base.clone(),
            why: if e.is::<http::uri::InvalidUri>() {
                "does not make a valid request URL"
            } else {
                "cannot be used for a request"
            },
        })?;
        let unreachable = |detail: String| ClientError::Unreachable {
            server: self.base.clone(),
            detail,
        };
        let (status, body) = match &self.transport {
            Transport::Direct(http) => {
                let response = http
                    .request(request.map(Full::new))
                    .await
                    .map_err(|e| unreachable(describe(&e)))?;
                let status = response.status();
                let body = response
                    .into_body()
                    .collect()
                    .await
                    .map_err(|e| unreachable(format!("the answer broke off: {e}")))?
                    .to_bytes();
                (status, body)
            }
            Transport::Kube(client, _) => {
                let response = client
                    .send(request.map(|b| kube::client::Body::from(b.to_vec())))
                    .await
                    .map_err(|e| {
                        unreachable(format!(
                            "through the Kubernetes API server: {}",
                            describe(&e)
                        ))
                    })?;
                let status = response.status();
                let body = response
                    .into_body()
                    .collect()
                    .await
                    .map_err(|e| unreachable(format!("the answer broke off: {e}")))?
                    .to_bytes();
                (status, body)
            }
        };
        if status.is_success() {
            return Ok(Answer { status, body });
        }
        #[derive(serde::Deserialize)]
        struct ErrorBody {
            code: String,
            message: String,
        }
        /// A Kubernetes `Status` (the API server's own refusal: RBAC, no endpoints).
        #[derive(serde::Deserialize)]
        struct KubeStatus {
            kind: String,
            #[serde(default)]
            message: String,
            #[serde(default)]
            reason: String,
        }
        if let Ok(e) = serde_json::from_slice::<ErrorBody>(&body) {
            return Err(ClientError::Api {
                status,
                code: e.code,
                message: e.message,
            });
        }
        if let Ok(k) = serde_json::from_slice::<KubeStatus>(&body)
            && k.kind == "Status"
        {
            return Err(ClientError::BadAnswer {
                server: self.base.clone(),
                what: format!(
                    "{status} from the Kubernetes API server: {} ({})",
                    k.message, k.reason
                ),
            });
        }
        Err(ClientError::BadAnswer {
            server: self.base.clone(),
            what: format!(
                "{status} without an error body: {}",
                String::from_utf8_lossy(&body[..body.len().min(200)])
            ),
        })
    }
}

/// The innermost cause of a connection error (`connection refused`, not `client error`).
fn describe(err: &(dyn std::error::Error + 'static)) -> String {
    let mut last = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        last = s.to_string();
        source = s.source();
    }
    last
}

/// A path segment: names and IDs are DNS labels and ULIDs, but anything else is escaped.
pub fn segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}
