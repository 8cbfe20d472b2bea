//! TLS for CapyCTL's listeners (DESIGN.md 4.3: plain HTTP, or TLS when a certificate and key
//! are configured: `server.listen.tls`).
//!
//! - [`server_config`] reads a PEM certificate chain and private key into a rustls server
//!   configuration (HTTP/1.1 by ALPN; ring, as the Kubernetes client uses);
//! - [`TlsIncoming`] accepts TCP connections and completes their handshakes in tasks of their
//!   own, bounded by [`HANDSHAKE_TIMEOUT`], so that a slow or silent client never holds up the
//!   accept loop; the listeners take finished TLS streams from it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

/// The longest a client may take to complete its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the TLS files could not be used. Each names the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read or holds no valid PEM.
    #[error("server.listen.tls: cannot read {what} {}: {detail}", path.display())]
    Read {
        /// `certificate` or `private key`.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// What went wrong.
        detail: String,
    },
    /// The certificate file holds no certificate.
    #[error("server.listen.tls: {} holds no PEM certificate", path.display())]
    NoCertificate {
        /// The file.
        path: PathBuf,
    },
    /// The pair was refused (the key does not match the certificate, an unsupported key).
    #[error("server.listen.tls: the certificate {} and the key {} cannot be used together: {source}", cert.display(), key.display())]
    Config {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// What rustls said.
        #[source]
        source: rustls::Error,
    },
}

impl TlsError {
    /// A short, stable label for metrics and event reasons.
    pub fn metric_label(&self) -> &'static str {
        match self {
            TlsError::Read { .. } => "tls_read",
            TlsError::NoCertificate { .. } => "tls_no_certificate",
            TlsError::Config { .. } => "tls_config",
        }
    }
}

/// The listeners' TLS configuration of `server.listen.tls`: `None` (plain HTTP) when absent.
pub fn listen_config(
    tls: Option<&capyctl_spec::settings::TlsFiles>,
) -> Result<Option<Arc<ServerConfig>>, TlsError> {
    tls.map(|files| server_config(&files.cert, &files.key))
        .transpose()
}

/// The rustls server configuration of the PEM certificate chain `cert` and private key `key`.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, TlsError> {
    let read = |what: &'static str, path: &Path, e: &dyn std::fmt::Display| TlsError::Read {
        what,
        path: path.to_path_buf(),
        detail: e.to_string(),
    };
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| read("certificate", cert, &e))?
        .collect::<Result<_, _>>()
        .map_err(|e| read("certificate", cert, &e))?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate {
            path: cert.to_path_buf(),
        });
    }
    let private = PrivateKeyDer::from_pem_file(key).map_err(|e| read("private key", key, &e))?;
    let config_err = |source| TlsError::Config {
        cert: cert.to_path_buf(),
        key: key.to_path_buf(),
        source,
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(config_err)?
        .with_no_client_auth()
        .with_single_cert(chain, private)
        .map_err(config_err)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The server side of a TLS handshake on `tcp`, bounded by [`HANDSHAKE_TIMEOUT`]; `None` (and a
/// debug line) when it fails or takes too long.
pub async fn handshake(acceptor: &TlsAcceptor, tcp: TcpStream) -> Option<TlsStream<TcpStream>> {
    let peer = tcp.peer_addr().ok();
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
        Ok(Ok(tls)) => Some(tls),
        Ok(Err(err)) => {
            tracing::debug!(?peer, error = %err, "TLS handshake failed");
            None
        }
        Err(_) => {
            tracing::debug!(?peer, "TLS handshake timed out");
            None
        }
    }
}

/// TLS connections of a TCP listener, handshakes done. Dropping it stops accepting.
#[derive(Debug)]
pub struct TlsIncoming {
    /// Finished handshakes, in the order they finished.
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    /// The listener's address.
    local: SocketAddr,
    /// The accept loop (it spawns one task per handshake).
    task: JoinHandle<()>,
}

impl TlsIncoming {
    /// Accepts on `listener` with `config`; `prepare` runs on each TCP stream before its
    /// handshake (socket options).
    pub fn new(
        listener: TcpListener,
        config: Arc<ServerConfig>,
        prepare: fn(&TcpStream),
    ) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        let acceptor = TlsAcceptor::from(config);
        let (tx, ready) = mpsc::channel(64);
        let task = tokio::spawn(async move {
            loop {
                let (tcp, peer) = match listener.accept().await {
                    Ok(accepted) => accepted,
                    Err(err) => {
                        // Out of file descriptors and the like: back off a little.
                        tracing::warn!(error = %err, "accepting a connection failed");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                };
                if tx.is_closed() {
                    return;
                }
                prepare(&tcp);
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    if let Some(tls) = handshake(&acceptor, tcp).await {
                        let _ = tx.send((tls, peer)).await;
                    }
                });
            }
        });
        Ok(Self { ready, local, task })
    }

    /// The next connection whose handshake finished; `None` once the accept loop ended.
    pub async fn accept(&mut self) -> Option<(TlsStream<TcpStream>, SocketAddr)> {
        self.ready.recv().await
    }

    /// The listener's address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }
}

impl Drop for TlsIncoming {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use rustls::pki_types::ServerName;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../spec/tests/fixtures/tls")
            .join(name)
    }

    fn client_config() -> Arc<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_file_iter(fixture("ca.crt")).unwrap() {
            roots.add(cert.unwrap()).unwrap();
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        Arc::new(
            rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth(),
        )
    }

    #[test]
    fn each_unusable_file_is_named() {
        let missing = fixture("missing.key");
        let err = server_config(&fixture("server.crt"), &missing).unwrap_err();
        assert!(matches!(
            err,
            TlsError::Read {
                what: "private key",
                ..
            }
        ));
        let text = err.to_string();
        assert!(
            text.starts_with("server.listen.tls: cannot read private key")
                && text.contains(&missing.display().to_string()),
            "{text}"
        );

        // A key where the certificate should be: no certificate in it.
        let err = server_config(&fixture("server.key"), &fixture("server.key")).unwrap_err();
        assert!(matches!(err, TlsError::NoCertificate { .. }), "{err}");
        assert!(
            err.to_string()
                .contains("server.key holds no PEM certificate")
        );

        // A certificate where the key should be.
        let err = server_config(&fixture("server.crt"), &fixture("ca.crt")).unwrap_err();
        assert!(
            matches!(
                err,
                TlsError::Read {
                    what: "private key",
                    ..
                }
            ),
            "{err}"
        );

        let config = server_config(&fixture("server.crt"), &fixture("server.key")).unwrap();
        assert_eq!(config.alpn_protocols, vec![b"http/1.1".to_vec()]);
        assert!(listen_config(None).unwrap().is_none());
    }

    /// A client that connects and says nothing holds neither the accept loop nor the next
    /// client's handshake.
    #[tokio::test]
    async fn a_silent_client_holds_up_nobody() {
        let config = server_config(&fixture("server.crt"), &fixture("server.key")).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut incoming = TlsIncoming::new(listener, config, |_| {}).unwrap();
        let addr = incoming.local_addr();
        let _silent = TcpStream::connect(addr).await.unwrap();

        let connector = tokio_rustls::TlsConnector::from(client_config());
        let client = tokio::spawn(async move {
            let tcp = TcpStream::connect(addr).await.unwrap();
            let name = ServerName::try_from("localhost").unwrap();
            let mut tls = connector.connect(name, tcp).await.unwrap();
            tls.write_all(b"ping").await.unwrap();
            tls.flush().await.unwrap();
            let mut back = [0u8; 4];
            tls.read_exact(&mut back).await.unwrap();
            back
        });
        let (mut served, _) = tokio::time::timeout(Duration::from_secs(5), incoming.accept())
            .await
            .expect("the second client's handshake finished first")
            .unwrap();
        let mut got = [0u8; 4];
        served.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
        served.write_all(b"pong").await.unwrap();
        served.flush().await.unwrap();
        assert_eq!(&client.await.unwrap(), b"pong");
    }
}
