//! A scripted mock API server for the unit tests (`tower_test::mock::pair`): each expected
//! call names its method and path and gets a status and a JSON body; what was asked is kept
//! for the test's assertions. A call that is not the next one expected fails the test.

#![allow(clippy::unwrap_used)]

use std::pin::pin;

use capyctl_crds::Activation;
use capyctl_crds::InstanceState;
use capyctl_crds::api::{ConditionView, DeploymentView, InstanceView};
use capyctl_crds::documents::DeploymentDoc;
use http::{Method, Request, Response};
use kube::Client;
use kube::client::Body;
use tokio::task::JoinHandle;
use tower_test::mock::{self, Handle};

/// One expected call and its answer.
#[derive(Debug, Clone)]
pub(crate) struct Exchange {
    pub method: Method,
    /// The path (without the query).
    pub path: String,
    /// `path` is a prefix of the call's path (a name the client makes up).
    pub prefix: bool,
    pub status: u16,
    pub body: serde_json::Value,
}

impl Exchange {
    pub(crate) fn new(method: Method, path: &str, status: u16, body: serde_json::Value) -> Self {
        Self {
            method,
            path: path.to_string(),
            prefix: false,
            status,
            body,
        }
    }

    /// A 200 with `body` for a call whose path begins with `prefix`.
    pub(crate) fn ok_under(method: Method, prefix: &str, body: serde_json::Value) -> Self {
        Self {
            prefix: true,
            ..Self::ok(method, prefix, body)
        }
    }

    /// A 200 with `body`.
    pub(crate) fn ok(method: Method, path: &str, body: serde_json::Value) -> Self {
        Self::new(method, path, 200, body)
    }
}

/// A call as the mock saw it.
#[derive(Debug, Clone)]
pub(crate) struct Seen {
    pub method: Method,
    pub path: String,
    pub query: String,
    pub content_type: Option<String>,
    /// The JSON body; `Null` when there was none.
    pub body: serde_json::Value,
}

/// A `Status` error body as the API server sends it.
pub(crate) fn status_body(code: u16, reason: &str, message: &str) -> serde_json::Value {
    serde_json::json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    })
}

/// A client whose calls go to the returned handle, through the operator's
/// [`ApiCallLayer`](capyctl_node_agent::k8s::api::ApiCallLayer) as in production.
pub(crate) fn client() -> (Client, Handle<Request<Body>, Response<Body>>) {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let layer = capyctl_node_agent::k8s::api::ApiCallLayer::new(super::API_CALL_TIMEOUT, None);
    (Client::new(layer.service(service), "capyctl"), handle)
}

/// Answers `script` in order; the task's result is every call seen. It panics (failing the
/// test that joins it) on a call that is not the next expected one.
pub(crate) fn serve(
    handle: Handle<Request<Body>, Response<Body>>,
    script: Vec<Exchange>,
) -> JoinHandle<Vec<Seen>> {
    tokio::spawn(async move {
        let mut handle = pin!(handle);
        let mut seen = Vec::new();
        for ex in script {
            let (request, send) = handle
                .next_request()
                .await
                .unwrap_or_else(|| panic!("expected {} {}, no call came", ex.method, ex.path));
            let (parts, body) = request.into_parts();
            let bytes = body.collect_bytes().await.unwrap();
            let body = if bytes.is_empty() {
                serde_json::Value::Null
            } else {
                serde_json::from_slice(&bytes).unwrap()
            };
            let call = Seen {
                method: parts.method.clone(),
                path: parts.uri.path().to_string(),
                query: parts.uri.query().unwrap_or_default().to_string(),
                content_type: parts
                    .headers
                    .get(http::header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string),
                body,
            };
            let path = if ex.prefix && call.path.starts_with(&ex.path) {
                ex.path.as_str()
            } else {
                call.path.as_str()
            };
            assert_eq!(
                (&call.method, path),
                (&ex.method, ex.path.as_str()),
                "unexpected call {call:?}"
            );
            seen.push(call);
            let response = Response::builder()
                .status(ex.status)
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(Body::from(serde_json::to_vec(&ex.body).unwrap()))
                .unwrap();
            send.send_response(response);
        }
        seen
    })
}

/// A view of deployment `doc` at `revision`: stopped, instance 0 on `gpu-1`.
pub(crate) fn view_of(doc: &DeploymentDoc, revision: u64) -> DeploymentView {
    DeploymentView {
        id: format!("01K{}", doc.name.to_uppercase()),
        name: doc.name.clone(),
        state: InstanceState::Stopped,
        ready: "0/1".into(),
        revision,
        hosts: vec!["gpu-1".into()],
        activation: Activation::OnDemand,
        warm: false,
        operator_stopped: false,
        engine: doc.engine,
        model: doc.model.clone(),
        residency: doc.residency,
        measurement: None,
        instances: vec![InstanceView {
            instance_id: format!("01K{}-0", doc.name.to_uppercase()),
            index: 0,
            host_id: "gpu-1".into(),
            generation: 0,
            state: InstanceState::Stopped,
            parked_tier: None,
            port: None,
            pid: None,
            last_error: None,
        }],
        conditions: vec![ConditionView {
            kind: "Ready".into(),
            status: "False".into(),
            reason: "not_running".into(),
            message: "the instance is stopped".into(),
        }],
        spec: doc.clone(),
    }
}
