//! The one client of the Kubernetes API server (feature `client`): every call the node agent
//! and the operator make to it goes through
//! [`ApiCallLayer`] (STYLE.md, Kubernetes: "a timeout and a latency histogram on every API
//! call"):
//!
//! - a bound on the time to the response's head ([`API_CALL_TIMEOUT`] unless told otherwise);
//!   a call past it fails with [`ApiCallTimeout`] (as `kube::Error::Service`). A watch's head
//!   comes at once, its events stream afterwards: the bound never cuts a watch;
//! - an [`ApiCallObserver`] told each call's verb, resource, outcome and latency (the
//!   operator's Prometheus histogram `capyctl_kube_api_request_seconds`); without one, calls
//!   slower than a second are logged.
//!
//! [`client`] builds a `kube::Client` with the layer; tests wrap a `tower_test` mock the same
//! way (`Client::new(ApiCallLayer::new(..).layer(service), ns)`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use tokio::time::Instant;
use tower::{Layer, Service};

/// The default bound on one API call (to the response's head).
pub const API_CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// One finished API call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiCall {
    /// `get`, `list`, `watch`, `create`, `update`, `patch`, `delete` (HTTP methods otherwise).
    pub verb: &'static str,
    /// The resource, with its subresource: `pods`, `deployments/status`, `leases`.
    pub resource: String,
    /// `ok` (2xx), `client_error` (4xx: not found, conflict, forbidden, ...), `server_error`
    /// (5xx), `failed` (no answer: connection, TLS) or `timeout`.
    pub outcome: &'static str,
    /// From the call to its response's head (or its failure).
    pub took: Duration,
}

/// Told about every API call when its head comes (or it fails). Keep it short: it runs on the
/// call's task.
pub trait ApiCallObserver: Send + Sync {
    /// One call ended.
    fn observe(&self, call: &ApiCall);
}

/// The error of a call past its bound.
#[derive(Debug, thiserror::Error)]
#[error("the Kubernetes API server did not answer {verb} {resource} within {} s", bound.as_secs_f64())]
pub struct ApiCallTimeout {
    /// The call's verb.
    pub verb: &'static str,
    /// Its resource.
    pub resource: String,
    /// The bound.
    pub bound: Duration,
}

/// The layer (see the module doc).
#[derive(Clone)]
pub struct ApiCallLayer {
    timeout: Duration,
    observer: Option<Arc<dyn ApiCallObserver>>,
}

impl std::fmt::Debug for ApiCallLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiCallLayer")
            .field("timeout", &self.timeout)
            .field("observed", &self.observer.is_some())
            .finish()
    }
}

impl ApiCallLayer {
    /// Calls bounded by `timeout`, told to `observer`.
    pub fn new(timeout: Duration, observer: Option<Arc<dyn ApiCallObserver>>) -> Self {
        Self { timeout, observer }
    }

    /// `inner` behind the layer (`tower::Layer::layer`, for crates without `tower`).
    pub fn service<S>(&self, inner: S) -> ApiCallService<S> {
        self.layer(inner)
    }
}

impl<S> Layer<S> for ApiCallLayer {
    type Service = ApiCallService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ApiCallService {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service of [`ApiCallLayer`].
#[derive(Clone)]
pub struct ApiCallService<S> {
    inner: S,
    layer: ApiCallLayer,
}

impl<S> std::fmt::Debug for ApiCallService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiCallService")
            .field("layer", &self.layer)
            .finish_non_exhaustive()
    }
}

/// The verb of a request (Kubernetes' words where the method and query say them).
pub fn verb_of(method: &http::Method, path: &str, query: Option<&str>) -> &'static str {
    let watch = query.is_some_and(|q| q.split('&').any(|p| p == "watch=true" || p == "watch=1"));
    // A collection path ends with the plural (`[namespaces/<ns>/]<plural>`).
    let rest = api_rest(path);
    let rest: &[&str] = match rest.as_slice() {
        ["namespaces", _ns, tail @ ..] if !tail.is_empty() => tail,
        other => other,
    };
    let collection = rest.len() == 1;
    match *method {
        http::Method::GET if watch => "watch",
        http::Method::GET if collection => "list",
        http::Method::GET => "get",
        http::Method::POST => "create",
        http::Method::PUT => "update",
        http::Method::PATCH => "patch",
        http::Method::DELETE if collection => "deletecollection",
        http::Method::DELETE => "delete",
        http::Method::HEAD => "head",
        _ => "other",
    }
}

/// The path's segments after `/api/v1` or `/apis/<group>/<version>`.
fn api_rest(path: &str) -> Vec<&str> {
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    match segs.first() {
        Some(&"api") => segs.into_iter().skip(2).collect(),
        Some(&"apis") => segs.into_iter().skip(3).collect(),
        _ => segs,
    }
}

/// The resource of a request path: `pods`, `deployments/status`, `namespaces`; `-` when the
/// path names none (discovery, `/version`).
pub fn resource_of(path: &str) -> String {
    let rest = api_rest(path);
    let rest: &[&str] = match rest.as_slice() {
        ["namespaces", _ns, tail @ ..] if !tail.is_empty() => tail,
        other => other,
    };
    match rest {
        [] => "-".to_string(),
        [plural] | [plural, _] => (*plural).to_string(),
        [plural, _, sub, ..] => format!("{plural}/{sub}"),
    }
}

fn outcome_of(status: http::StatusCode) -> &'static str {
    if status.is_success() {
        "ok"
    } else if status.is_client_error() {
        "client_error"
    } else if status.is_server_error() {
        "server_error"
    } else {
        "ok"
    }
}

impl<S, B, R> Service<Request<B>> for ApiCallService<S>
where
    S: Service<Request<B>, Response = Response<R>>,
    S::Error: Into<tower::BoxError>,
    S::Future: Send + 'static,
{
    type Response = Response<R>;
    type Error = tower::BoxError;
    type Future =
        Pin<Box<dyn Future<Output = Result<Response<R>, tower::BoxError>> + Send + 'static>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let verb = verb_of(
            request.method(),
            request.uri().path(),
            request.uri().query(),
        );
        let resource = resource_of(request.uri().path());
        let bound = self.layer.timeout;
        let observer = self.layer.observer.clone();
        let call = self.inner.call(request);
        Box::pin(async move {
            let began = Instant::now();
            let (result, outcome) = match tokio::time::timeout(bound, call).await {
                Ok(Ok(response)) => {
                    let outcome = outcome_of(response.status());
                    (Ok(response), outcome)
                }
                Ok(Err(e)) => (Err(e.into()), "failed"),
                Err(_) => {
                    let e: tower::BoxError = Box::new(ApiCallTimeout {
                        verb,
                        resource: resource.clone(),
                        bound,
                    });
                    (Err(e), "timeout")
                }
            };
            let call = ApiCall {
                verb,
                resource,
                outcome,
                took: began.elapsed(),
            };
            match &observer {
                Some(o) => o.observe(&call),
                None if call.took >= Duration::from_secs(1) || outcome == "timeout" => {
                    tracing::info!(verb = call.verb, resource = %call.resource, outcome, took_ms = call.took.as_millis() as u64, "slow Kubernetes API call");
                }
                None => {}
            }
            result
        })
    }
}

/// A client of the API server of `config` whose every call goes through [`ApiCallLayer`].
pub fn client(
    config: kube::Config,
    timeout: Duration,
    observer: Option<Arc<dyn ApiCallObserver>>,
) -> Result<kube::Client, kube::Error> {
    let builder = kube::client::ClientBuilder::try_from(config)?;
    Ok(builder
        .with_layer(&ApiCallLayer::new(timeout, observer))
        .build())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Mutex;

    use k8s_openapi::api::core::v1::Pod;
    use kube::Api;

    use super::*;

    #[test]
    fn verbs_and_resources_are_kubernetes_words() {
        let get = http::Method::GET;
        assert_eq!(verb_of(&get, "/api/v1/namespaces/ns/pods", None), "list");
        assert_eq!(verb_of(&get, "/api/v1/namespaces/ns/pods/p", None), "get");
        assert_eq!(
            verb_of(&get, "/api/v1/namespaces/ns/pods", Some("watch=true&rv=1")),
            "watch"
        );
        assert_eq!(
            verb_of(
                &http::Method::PATCH,
                "/apis/capyctl.io/v1alpha1/hosts/n",
                None
            ),
            "patch"
        );
        assert_eq!(
            verb_of(&get, "/apis/capyctl.io/v1alpha1/hosts", None),
            "list"
        );
        assert_eq!(resource_of("/api/v1/namespaces/ns/pods/p"), "pods");
        assert_eq!(resource_of("/api/v1/namespaces/ns"), "namespaces");
        assert_eq!(
            resource_of("/apis/capyctl.io/v1alpha1/namespaces/ns/deployments/d/status"),
            "deployments/status"
        );
        assert_eq!(
            resource_of("/apis/capyctl.io/v1alpha1/hosts/n/status"),
            "hosts/status"
        );
        assert_eq!(
            resource_of("/apis/coordination.k8s.io/v1/namespaces/ns/leases"),
            "leases"
        );
        assert_eq!(resource_of("/version"), "version");
        assert_eq!(resource_of("/apis"), "-");
    }

    #[derive(Default)]
    struct Seen(Mutex<Vec<ApiCall>>);

    impl ApiCallObserver for Seen {
        fn observe(&self, call: &ApiCall) {
            self.0.lock().unwrap().push(call.clone());
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_past_its_bound_fails_and_every_call_is_observed() {
        let (service, mut api) = capyctl_test_support::MockApi::pair();
        let seen = Arc::new(Seen::default());
        let layer = ApiCallLayer::new(Duration::from_secs(5), Some(seen.clone()));
        let client = kube::Client::new(layer.layer(service), "ns");
        let pods: Api<Pod> = Api::namespaced(client, "ns");
        let server = tokio::spawn(async move {
            use capyctl_test_support::{Exchange, status_body};
            // The first call is never answered (held while the mock lives); the second is, at
            // once.
            api.answer(Exchange::hang(
                http::Method::GET,
                "/api/v1/namespaces/ns/pods/p",
            ))
            .await;
            api.answer(Exchange::new(
                http::Method::GET,
                "/api/v1/namespaces/ns/pods/p",
                404,
                status_body(404, "NotFound", "pods \"p\" not found"),
            ))
            .await;
            // Keep the first call's reply alive until the test is done with it.
            std::future::pending::<()>().await;
        });
        let began = Instant::now();
        let err = pods.get("p").await.unwrap_err();
        assert_eq!(began.elapsed(), Duration::from_secs(5));
        assert!(
            err.to_string()
                .contains("did not answer get pods within 5 s"),
            "{err}"
        );
        assert!(pods.get_opt("p").await.unwrap().is_none());
        server.abort();
        let seen = seen.0.lock().unwrap().clone();
        let outcomes: Vec<(&str, &str, &str)> = seen
            .iter()
            .map(|c| (c.verb, c.resource.as_str(), c.outcome))
            .collect();
        assert_eq!(
            outcomes,
            [("get", "pods", "timeout"), ("get", "pods", "client_error")]
        );
        assert_eq!(seen[0].took, Duration::from_secs(5));
    }
}
