//! A scripted mock API server for the unit tests (`tower_test::mock::pair`): each expected
//! call names its method and path and gets a status and a JSON body; what was asked is kept
//! for the test's assertions. A call that is not the next one expected fails the test.
//! Besides, [`FakeApi`]: the lifecycle's management API as the adapter's tests need it.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::pin::pin;
use std::sync::Mutex;

use capyctl_spec::Activation;
use capyctl_spec::InstanceState;
use capyctl_spec::api::{
    ActionReceipt, ConditionView, DeployOutcome, DeployReceipt, DeploymentList, DeploymentView,
    EngineList, HostList, InstanceView, LoadReport, StartRequest,
};
use capyctl_spec::documents::DeploymentDoc;
use capyctl_spec::errors::ApiError;
use http::{Method, Request, Response};
use kube::Client;
use kube::client::Body;
use tokio::task::JoinHandle;
use tower_test::mock::{self, Handle};

use crate::api::{BoxFuture, ManagementApi};

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

/// The lifecycle as the reconciler and the management wrappers see it, for their unit tests:
/// deployments in a map, every call recorded (`calls`). Deploy and delete behave as the
/// lifecycle's (created, updated or unchanged; 404 `not_found` for an unknown name), and a
/// delete fails with `delete_error` when set. The commands and the load read are not scripted:
/// they are recorded and answered 500 `internal`, so a test that asserts `calls` sees them.
#[derive(Default)]
pub(crate) struct FakeApi {
    /// By name.
    pub(crate) deps: Mutex<BTreeMap<String, DeploymentView>>,
    /// `deploy NAME`, `delete NAME`, `start NAME`, ... in order.
    pub(crate) calls: Mutex<Vec<String>>,
    /// `/readyz` says not ready.
    pub(crate) unready: bool,
    /// What every delete answers.
    pub(crate) delete_error: Option<ApiError>,
}

impl FakeApi {
    /// Ready or not, nothing deployed.
    pub(crate) fn ready(ready: bool) -> Self {
        Self {
            unready: !ready,
            ..Self::default()
        }
    }

    /// The calls so far.
    pub(crate) fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }

    /// Sets a deployment's state (its instance's too) and tier, as a park or a wake would.
    pub(crate) fn set_state(&self, name: &str, state: InstanceState, tier: Option<&str>) {
        let mut deps = self.deps.lock().unwrap();
        let v = deps.get_mut(name).unwrap();
        v.state = state;
        v.instances[0].state = state;
        v.instances[0].parked_tier = tier.map(str::to_string);
        v.ready = if state == InstanceState::Ready {
            "1/1"
        } else {
            "0/1"
        }
        .into();
    }

    fn record(&self, call: String) {
        self.calls.lock().unwrap().push(call);
    }

    fn not_found(name: &str) -> ApiError {
        ApiError::NotFound {
            what: format!("deployment {name}"),
        }
    }

    /// A call this fake does not script: recorded, and answered `internal`.
    fn unscripted<T>(&self, what: &str, name: &str) -> BoxFuture<'_, Result<T, ApiError>>
    where
        T: Send + 'static,
    {
        self.record(format!("{what} {name}"));
        let detail = format!("FakeApi does not script {what}");
        Box::pin(async move { Err(ApiError::Internal { detail }) })
    }
}

impl ManagementApi for FakeApi {
    fn list(&self) -> BoxFuture<'_, DeploymentList> {
        Box::pin(async move {
            DeploymentList {
                deployments: self.deps.lock().unwrap().values().cloned().collect(),
            }
        })
    }
    fn deploy(&self, doc: DeploymentDoc) -> BoxFuture<'_, Result<DeployReceipt, ApiError>> {
        Box::pin(async move {
            self.record(format!("deploy {}", doc.name));
            let mut deps = self.deps.lock().unwrap();
            let (outcome, view) = match deps.get(&doc.name) {
                None => (DeployOutcome::Created, view_of(&doc, 1)),
                Some(v) if v.spec == doc => (DeployOutcome::Unchanged, v.clone()),
                Some(v) => (DeployOutcome::Updated, view_of(&doc, v.revision + 1)),
            };
            deps.insert(doc.name.clone(), view.clone());
            Ok(DeployReceipt {
                outcome,
                deployment: view,
            })
        })
    }
    fn get<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<DeploymentView, ApiError>> {
        Box::pin(async move {
            self.deps
                .lock()
                .unwrap()
                .get(name)
                .cloned()
                .ok_or_else(|| Self::not_found(name))
        })
    }
    fn delete<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<DeploymentView, ApiError>> {
        Box::pin(async move {
            self.record(format!("delete {name}"));
            if let Some(e) = &self.delete_error {
                return Err(e.clone());
            }
            self.deps
                .lock()
                .unwrap()
                .remove(name)
                .ok_or_else(|| Self::not_found(name))
        })
    }
    fn start<'a>(
        &'a self,
        name: &'a str,
        _: StartRequest,
    ) -> BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        self.unscripted("start", name)
    }
    fn stop<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        self.unscripted("stop", name)
    }
    fn park<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        self.unscripted("park", name)
    }
    fn preinitialize<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        self.unscripted("preinitialize", name)
    }
    fn engines(&self) -> BoxFuture<'_, EngineList> {
        Box::pin(async { EngineList { engines: vec![] } })
    }
    fn hosts(&self) -> BoxFuture<'_, HostList> {
        Box::pin(async { HostList { hosts: vec![] } })
    }
    fn load<'a>(&'a self, name: Option<&'a str>) -> BoxFuture<'a, Result<LoadReport, ApiError>> {
        self.unscripted("load", name.unwrap_or("*"))
    }
    fn ready(&self) -> bool {
        !self.unready
    }
}
