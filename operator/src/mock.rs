//! The shared scripted mock API server ([`capyctl_test_support::MockApi`]) as the operator's
//! unit tests use it: a client through the operator's
//! [`ApiCallLayer`](capyctl_crds::api_client::ApiCallLayer), and a script answered in
//! order. Besides, [`FakeApi`]: the lifecycle's management API as the adapter's tests need it.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::Mutex;

use capyctl_spec::Activation;
use capyctl_spec::InstanceState;
use capyctl_spec::api::{
    ActionReceipt, ConditionView, DeployOutcome, DeployReceipt, DeploymentList, DeploymentView,
    EngineList, HostDrainReceipt, HostList, InstanceView, LoadReport, StartRequest,
};
use capyctl_spec::documents::DeploymentDoc;
use capyctl_spec::errors::ApiError;
pub(crate) use capyctl_test_support::{Answer, Exchange, MockApi, Seen, status_body};
use kube::Client;
use tokio::task::JoinHandle;

use capyctl_lifecycle::api::{BoxFuture, ManagementApi};

/// A client whose calls go to the returned mock, through the operator's
/// [`ApiCallLayer`](capyctl_crds::api_client::ApiCallLayer) as in production.
pub(crate) fn client() -> (Client, MockApi) {
    let (service, api) = MockApi::pair();
    let layer = capyctl_crds::api_client::ApiCallLayer::new(super::API_CALL_TIMEOUT, None);
    (Client::new(layer.service(service), "capyctl"), api)
}

/// Answers `script` in order ([`MockApi::serve`]); the task's result is every call seen. It
/// panics (failing the test that joins it) on a call that is not the next expected one.
pub(crate) fn serve(api: MockApi, script: Vec<Exchange>) -> JoinHandle<Vec<Seen>> {
    api.serve(script)
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
        engine: doc.engine_kind(),
        model: doc.model_arg().to_string(),
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
    fn drain_host<'a>(
        &'a self,
        host_id: &'a str,
        _: bool,
    ) -> BoxFuture<'a, Result<HostDrainReceipt, ApiError>> {
        self.unscripted("drain_host", host_id)
    }
    fn load<'a>(&'a self, name: Option<&'a str>) -> BoxFuture<'a, Result<LoadReport, ApiError>> {
        self.unscripted("load", name.unwrap_or("*"))
    }
    fn ready(&self) -> bool {
        !self.unready
    }
}
