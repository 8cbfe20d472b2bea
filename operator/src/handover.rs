//! The router Service across a takeover: never without an endpoint that answers.
//!
//! The router Service selects the leader by its label (`CAPYCTL_LEADER_LABEL`). Before, a
//! leader that stopped (its Pod deleted, say) went not ready at once and closed its inference
//! port, and the next leader was labelled only once the old one had released the Lease (20 to
//! 30 s later, the inference listener's grace): meanwhile the Service had no usable endpoint,
//! and kube-proxy rejected its connections. When the new leader's endpoint came, kube-proxy
//! replaced that reject rule (filter table) with the translation to the new Pod (nat table) in
//! two commits, and a connection opened in between was neither rejected nor translated: it
//! left the node by its default route to the ClusterIP itself. On the local cluster the
//! machine's egress proxy answers such a connection `404` with an empty body (seen in 2 of 5
//! runs of the leader test, the first request after the takeover; reproduced by toggling a
//! Service's only endpoint: 3 leaks in 4 toggles); elsewhere it is lost or answered by
//! whatever the route reaches.
//!
//! So a stopping leader keeps the Service an endpoint until the next leader has one:
//! - it stays ready and labelled, and answers every request on the inference port that its
//!   router no longer takes ([`serve_unavailable`]): 503 `unavailable`, the product page's
//!   retryable error with its JSON body and `Retry-After: 1`, "this replica is handing over
//!   the router to the next leader; retry shortly" (over TLS when the port has
//!   `server.listen.tls`). It answers on the inference port's own
//!   listening socket, which the router's listener gives back when it stops accepting
//!   ([`serve_unavailable_given_back`]): the port is never closed, so no connection is
//!   refused in between. Requests its router already holds are answered as before (their
//!   switch within the grace, or 503 just before it ends);
//! - after it has released the Lease it lingers ([`linger`]) until another Pod carries the
//!   leader label and is Ready (at most [`LINGER_MAX`]), then [`LINGER_AFTER`] more for
//!   kube-proxy to move the Service to it, and only then removes its label and exits.
//!
//! The Service's endpoints thus go from the old leader to the new one without a gap: no reject
//! rule is ever written for it, so none is replaced. A standby is not selected at all (it
//! carries no label; selecting it would send it part of the traffic in steady state).

use std::sync::Arc;
use std::time::Duration;

use capyctl_spec::errors::ApiError;
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, ResourceExt};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};

/// The longest a stopping leader waits for the next one's label after releasing the Lease.
pub const LINGER_MAX: Duration = Duration::from_secs(15);

/// How long it stays an endpoint once the next leader is labelled and Ready.
pub const LINGER_AFTER: Duration = Duration::from_secs(2);

/// Between two reads of the Pods while lingering.
const LINGER_POLL: Duration = Duration::from_millis(250);

/// The most of a request head read before answering.
const MAX_HEAD: usize = 16 * 1024;

/// How long a connection may take to send its head, and to close after the answer.
const CONN_TIMEOUT: Duration = Duration::from_secs(5);

/// The answer of a stopping leader's inference port.
pub fn handing_over() -> ApiError {
    ApiError::Unavailable {
        detail: "this replica is handing over the router to the next leader; retry shortly"
            .to_string(),
        retry_after: 1,
    }
}

/// [`serve_unavailable`] on the inference port's own listening socket, once the router's
/// listener gives it back (`capyctl_router::proxy::serve_giving_back`, when it stops
/// accepting). The socket never closes in between: a connection made meanwhile waits in its
/// backlog and is answered here, none is refused or reset. (Before, the router's listener
/// closed the socket and this bound the port again: a connection in that moment was refused,
/// seen in 2 of 6 handovers on the local cluster.)
pub async fn serve_unavailable_given_back(
    given_back: oneshot::Receiver<std::net::TcpListener>,
    error: ApiError,
    tls: Option<Arc<rustls::ServerConfig>>,
    stop: watch::Receiver<bool>,
) {
    let listener = match given_back.await.map(TcpListener::from_std) {
        Ok(Ok(listener)) => listener,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "the inference port's socket could not be taken over to answer 503 while handing over");
            return;
        }
        Err(_) => {
            tracing::warn!(
                "the router's listener ended without giving the inference port's socket back: no 503 while handing over"
            );
            return;
        }
    };
    serve_unavailable(listener, error, tls, stop).await
}

/// Answers every connection on `listener` with `error` (its status, JSON body and
/// `Retry-After`, `Connection: close`) until `stop` turns `true`; over TLS with `tls` (the
/// inference listener's `server.listen.tls`: its clients speak HTTPS to the port). Each connection's head is
/// read first (at most [`MAX_HEAD`] bytes, within [`CONN_TIMEOUT`]); after the answer the
/// connection is closed for writing and what the client still sends is read and dropped
/// (within [`CONN_TIMEOUT`]), so that an unread body does not reset the connection before
/// the client has the answer.
pub async fn serve_unavailable(
    listener: TcpListener,
    error: ApiError,
    tls: Option<Arc<rustls::ServerConfig>>,
    mut stop: watch::Receiver<bool>,
) {
    let answer = Arc::new(response(&error));
    let tls = tls.map(tokio_rustls::TlsAcceptor::from);
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.wait_for(|s| *s) => return,
        };
        match accepted {
            Ok((stream, _)) => {
                let (answer, tls) = (answer.clone(), tls.clone());
                tokio::spawn(async move {
                    let Some(tls) = tls else {
                        let _ = tokio::time::timeout(2 * CONN_TIMEOUT, answer_one(stream, &answer))
                            .await;
                        return;
                    };
                    // The handshake is bounded by its own timeout.
                    if let Some(stream) = capyctl_router::tls::handshake(&tls, stream).await {
                        let _ = tokio::time::timeout(2 * CONN_TIMEOUT, answer_one(stream, &answer))
                            .await;
                    }
                });
            }
            Err(e) => {
                tracing::debug!(error = %e, "accepting on the inference port failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// The whole HTTP/1.1 answer of `error`.
pub fn response(error: &ApiError) -> Vec<u8> {
    let body = error.to_json();
    let status =
        http::StatusCode::from_u16(error.status()).unwrap_or(http::StatusCode::SERVICE_UNAVAILABLE);
    let mut head = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        body.len()
    );
    if let Some(after) = error.retry_after() {
        head.push_str(&format!("retry-after: {after}\r\n"));
    }
    head.push_str("connection: close\r\n\r\n");
    let mut out = head.into_bytes();
    out.extend_from_slice(body.as_bytes());
    out
}

async fn answer_one<S>(mut stream: S, answer: &[u8]) -> std::io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; 4096];
    let mut head = Vec::new();
    let read_head = async {
        loop {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                return Ok::<bool, std::io::Error>(false);
            }
            head.extend_from_slice(&buf[..n]);
            if head.windows(4).any(|w| w == b"\r\n\r\n") || head.len() >= MAX_HEAD {
                return Ok(true);
            }
        }
    };
    match tokio::time::timeout(CONN_TIMEOUT, read_head).await {
        Ok(Ok(true)) | Err(_) => {}
        // The client closed before a whole head: nobody to answer.
        Ok(Ok(false)) | Ok(Err(_)) => return Ok(()),
    }
    stream.write_all(answer).await?;
    stream.shutdown().await?;
    // Lingering close: drain what the client still sends until it closes.
    let _ = tokio::time::timeout(CONN_TIMEOUT, async {
        while stream.read(&mut buf).await.unwrap_or(0) > 0 {}
    })
    .await;
    Ok(())
}

/// Whether a Pod other than `me` carries `label: "true"` and is Ready (not being deleted).
pub fn another_leader_ready(pods: &[Pod], me: &str, label: &str) -> bool {
    pods.iter().any(|p| {
        p.name_any() != me
            && p.metadata.deletion_timestamp.is_none()
            && p.labels().get(label).map(String::as_str) == Some("true")
            && p.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
    })
}

/// After this replica released the Lease: waits until another Pod of `selector` carries the
/// leader label and is Ready (at most [`LINGER_MAX`]), then [`LINGER_AFTER`] more. Answers
/// whether the next leader was seen.
pub async fn linger(pods: &Api<Pod>, selector: &str, me: &str, label: &str) -> bool {
    let params = ListParams::default().labels(selector);
    let seen = tokio::time::timeout(LINGER_MAX, async {
        loop {
            match pods.list(&params).await {
                Ok(list) if another_leader_ready(&list.items, me, label) => return,
                Ok(_) => {}
                Err(e) => tracing::debug!(error = %e, "listing the operator Pods failed"),
            }
            tokio::time::sleep(LINGER_POLL).await;
        }
    })
    .await
    .is_ok();
    if seen {
        tokio::time::sleep(LINGER_AFTER).await;
    }
    seen
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use tokio::net::TcpStream;

    fn pod(name: &str, leader: bool, ready: bool, deleting: bool) -> Pod {
        let mut v = serde_json::json!({
            "metadata": {"name": name, "labels": {"app": "op"}},
            "status": {"conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"}}]},
        });
        if leader {
            v["metadata"]["labels"]["capyctl.io/leader"] = "true".into();
        }
        if deleting {
            v["metadata"]["deletionTimestamp"] = "2026-12-06T15:53:33Z".into();
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn the_next_leader_is_another_pod_labelled_and_ready() {
        let l = "capyctl.io/leader";
        let me = pod("a", true, true, true);
        assert!(!another_leader_ready(std::slice::from_ref(&me), "a", l));
        for (other, seen) in [
            (pod("b", false, true, false), false),
            (pod("b", true, false, false), false),
            (pod("b", true, true, true), false),
            (pod("b", true, true, false), true),
        ] {
            assert_eq!(
                another_leader_ready(&[me.clone(), other.clone()], "a", l),
                seen,
                "{other:?}"
            );
        }
    }

    fn list(items: &[Pod]) -> serde_json::Value {
        serde_json::json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items})
    }

    /// A stopping leader stays an endpoint until another Pod is labelled and Ready, then
    /// [`LINGER_AFTER`] more; without one, [`LINGER_MAX`].
    #[tokio::test(start_paused = true)]
    async fn a_stopping_leader_lingers_until_the_next_one_is_labelled_and_ready() {
        use super::super::mock::{self, Exchange};
        use http::Method;
        let path = "/api/v1/namespaces/capyctl/pods";
        let l = "capyctl.io/leader";
        let me = pod("a", true, true, true);
        let not_yet = list(&[me.clone(), pod("b", true, false, false)]);
        let next = list(&[me.clone(), pod("b", true, true, false)]);
        let (client, handle) = mock::client();
        let server = mock::serve(
            handle,
            vec![
                Exchange::ok(Method::GET, path, list(std::slice::from_ref(&me))),
                Exchange::ok(Method::GET, path, not_yet),
                Exchange::ok(Method::GET, path, next),
            ],
        );
        let pods: Api<Pod> = Api::namespaced(client, "capyctl");
        let began = tokio::time::Instant::now();
        assert!(linger(&pods, &format!("{l}=true"), "a", l).await);
        assert_eq!(began.elapsed(), 2 * LINGER_POLL + LINGER_AFTER);
        server.await.unwrap();

        let (client, handle) = mock::client();
        let calls = (LINGER_MAX.as_millis() / LINGER_POLL.as_millis()) as usize + 1;
        let script = (0..calls)
            .map(|_| Exchange::ok(Method::GET, path, list(std::slice::from_ref(&me))))
            .collect();
        let server = mock::serve(handle, script);
        let pods: Api<Pod> = Api::namespaced(client, "capyctl");
        let began = tokio::time::Instant::now();
        assert!(!linger(&pods, &format!("{l}=true"), "a", l).await);
        assert_eq!(began.elapsed(), LINGER_MAX);
        drop(pods);
        let _ = server.await;
    }

    /// An admission that knows no model: the listener answers `GET /v1/models` itself.
    #[derive(Clone)]
    struct NoModels;

    enum NoPermit {}

    impl capyctl_router::admission::Permit for NoPermit {
        fn upstream(&self) -> &capyctl_interfaces::router::Upstream {
            match *self {}
        }
        fn first_output(&self) {}
        fn cut(&self) {}
        fn waited_at_bound(&self) -> Duration {
            match *self {}
        }
    }

    impl capyctl_router::admission::Admission for NoModels {
        type Permit = NoPermit;
        fn resolve(&self, _: &str) -> Option<capyctl_interfaces::router::DeploymentRef> {
            None
        }
        async fn admit(
            &self,
            _: capyctl_interfaces::router::DeploymentRef,
            _: tokio::time::Instant,
        ) -> Result<NoPermit, ApiError> {
            unreachable!("no model resolves")
        }
    }

    /// One client's connection: `GET /v1/models`, `Connection: close`. The answer's status,
    /// or what went wrong (refused, reset, closed without an answer).
    async fn one_request(addr: std::net::SocketAddr) -> Result<u16, String> {
        let mut s = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        s.write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .map_err(|e| format!("write: {e}"))?;
        let mut out = Vec::new();
        s.read_to_end(&mut out)
            .await
            .map_err(|e| format!("read: {e}"))?;
        let head = String::from_utf8_lossy(&out);
        head.strip_prefix("HTTP/1.1 ")
            .and_then(|h| h.get(..3))
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| format!("no answer: {head:?}"))
    }

    /// The handover of the inference port: clients connect continuously while the router's
    /// listener stops and gives its socket to [`serve_unavailable_given_back`]; every
    /// connection gets the router's answer (200) or the handover's 503, none is refused,
    /// reset or closed without an answer. (With the router's listener closing the socket and
    /// the port bound again, connections were refused in between.) With the listener's
    /// connections served on the caller's runtime and on threads of its own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn connections_across_the_handover_are_all_answered() {
        use std::sync::atomic::{AtomicBool, Ordering};
        const EACH: usize = 200;
        const CLIENTS: usize = 4;
        for threads in [0, 2] {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let config = capyctl_router::proxy::ProxyConfig {
                listener_threads: threads,
                shutdown_grace: Duration::from_secs(1),
                ..Default::default()
            };
            let proxy = capyctl_router::proxy::Proxy::new(NoModels, Vec::new, config);
            let (stop_router, mut stopping) = watch::channel(false);
            let (give_back, given_back) = oneshot::channel();
            let router = tokio::spawn(capyctl_router::proxy::serve_giving_back(
                listener,
                proxy,
                async move {
                    let _ = stopping.wait_for(|s| *s).await;
                },
                give_back,
            ));
            let (stop_503, rx) = watch::channel(false);
            let handing_over = tokio::spawn(serve_unavailable_given_back(
                given_back,
                handing_over(),
                None,
                rx,
            ));

            let done = Arc::new(AtomicBool::new(false));
            let (results, mut outcomes) = tokio::sync::mpsc::unbounded_channel();
            let clients: Vec<_> = (0..CLIENTS)
                .map(|_| {
                    let (done, results) = (done.clone(), results.clone());
                    tokio::spawn(async move {
                        while !done.load(Ordering::Relaxed) {
                            let _ = results.send(one_request(addr).await);
                        }
                    })
                })
                .collect();
            drop(results);
            let (mut served, mut unavailable, mut failed) = (0, 0, Vec::new());
            while let Some(outcome) = outcomes.recv().await {
                match outcome {
                    Ok(200) => served += 1,
                    Ok(503) => unavailable += 1,
                    other => failed.push(other),
                }
                if served == EACH {
                    stop_router.send_replace(true);
                }
                if unavailable >= EACH {
                    done.store(true, Ordering::Relaxed);
                }
            }
            for c in clients {
                c.await.unwrap();
            }
            router.await.unwrap().unwrap();
            assert!(
                failed.is_empty(),
                "threads {threads}: {} of {} connections without an answer: {:?}",
                failed.len(),
                served + unavailable + failed.len(),
                &failed[..failed.len().min(5)]
            );
            assert!(
                served >= EACH && unavailable >= EACH,
                "{served} {unavailable}"
            );
            stop_503.send_replace(true);
            handing_over.await.unwrap();
            assert!(TcpStream::connect(addr).await.is_err(), "still accepting");
        }
    }

    /// With `server.listen.tls` the inference port speaks HTTPS, and so does its 503 while
    /// handing over: a TLS client (trusting the test CA) gets the page's 503.
    #[tokio::test]
    async fn the_503_is_answered_over_tls_when_the_inference_port_has_it() {
        use rustls::pki_types::pem::PemObject;
        let fixture = |name: &str| {
            std::path::PathBuf::from(format!(
                "{}/../spec/tests/fixtures/tls/{name}",
                env!("CARGO_MANIFEST_DIR")
            ))
        };
        let tls =
            capyctl_router::tls::server_config(&fixture("server.crt"), &fixture("server.key"))
                .unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, rx) = watch::channel(false);
        let served = tokio::spawn(serve_unavailable(listener, handing_over(), Some(tls), rx));

        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls::pki_types::CertificateDer::pem_file_iter(fixture("ca.crt")).unwrap() {
            roots.add(cert.unwrap()).unwrap();
        }
        let client = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        let connector = tokio_rustls::TlsConnector::from(Arc::new(client));
        let tcp = TcpStream::connect(addr).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let mut s = connector.connect(name, tcp).await.unwrap();
        s.write_all(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .await
            .unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
            "{text}"
        );
        assert!(text.contains("\"code\":\"unavailable\""), "{text}");
        stop.send_replace(true);
        served.await.unwrap();
    }

    /// A client of a stopping leader's inference port gets the page's 503 with its JSON body,
    /// whole, even when it sent a body that is never read.
    #[tokio::test]
    async fn a_stopping_leaders_inference_port_answers_the_pages_503() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, rx) = watch::channel(false);
        let served = tokio::spawn(serve_unavailable(listener, handing_over(), None, rx));
        let body = format!(
            r#"{{"model":"chat-b","messages":[],"pad":"{}"}}"#,
            "x".repeat(200_000)
        );
        let mut s = TcpStream::connect(addr).await.unwrap();
        let request = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let (mut r, mut w) = s.split();
        let (_, answer) = tokio::join!(w.write_all(request.as_bytes()), async {
            let mut out = Vec::new();
            r.read_to_end(&mut out).await.unwrap();
            out
        });
        let text = String::from_utf8(answer).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(
            head.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
            "{head}"
        );
        assert!(head.contains("retry-after: 1\r\n"), "{head}");
        assert!(
            head.contains("content-type: application/json\r\n"),
            "{head}"
        );
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["code"], "unavailable");
        assert_eq!(v["retryable"], true);
        assert!(
            v["message"].as_str().unwrap().contains("retry shortly"),
            "{v}"
        );
        stop.send_replace(true);
        served.await.unwrap();
        // Stopped: the port is closed.
        assert!(TcpStream::connect(addr).await.is_err());
    }
}
