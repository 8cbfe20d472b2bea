//! CapyCTL's Kubernetes operator (DESIGN.md 4.6), Kubernetes only: what turns the lifecycle
//! (`capyctl-lifecycle`) into an operator. `capyctl-server` gives it the management listener.
//!
//! - [`status`]: the `Deployment` CR's `status` from the lifecycle's
//!   [`DeploymentView`](capyctl_spec::api::DeploymentView), whether it needs writing, and the
//!   server-side apply of it (field manager [`FIELD_MANAGER`]);
//! - [`leader`]: leader election on a `coordination.k8s.io/v1` Lease, so that one replica runs
//!   the lifecycle and the router while a standby waits;
//! - [`reconcile`]: `Deployment` CRs into the lifecycle through
//!   [`ManagementApi`](capyctl_lifecycle::api::ManagementApi), the finalizer [`FINALIZER`], status write-back
//!   and Kubernetes Events for parks, wakes, switches, refusals and failures;
//! - [`events`]: the feed of happenings those Events are told from, and the observers of the
//!   router's lifecycle and of the management API that fill it;
//! - [`pods`]: the engine Pod of an instance (image, DESIGN.md 4.2 arguments, GPU access,
//!   model cache), owned by its CR;
//! - [`engines`]: [`engines::PodHostAgent`], the node agent's client plus the engine Pods the
//!   operator creates and deletes (`--engine-runtime pod`);
//! - [`store`]: the lifecycle's records rebuilt from the CRs (a new leader's state);
//! - [`tenants`]: the `Tenant` objects and their Secrets, watched into the router's tenant
//!   table (DESIGN 4.10), each object's `status` saying whether it is in use;
//! - [`watch`]: the namespaces whose `Deployment` objects are reconciled, and which object
//!   serves a name several namespaces use;
//! - [`args`]: `capyctl-operator`'s command line, and what turns it into the
//!   [`operator::OperatorOptions`] the operator runs with (the binary parses and calls in);
//! - [`operator`]: `capyctl-operator`'s assembly: election, management listener (which refuses
//!   deploys and deletes: the `Deployment` objects say what is deployed), and while leading the
//!   lifecycle, router and reconciler.
//!
//! Everything here needs only what the chart's RBAC grants the operator
//! (`charts/capyctl/templates/rbac.yaml`, checked against a real API server by
//! `operator/tests/k8s_rbac.rs`): get/list/watch/patch on `deployments`, patch on
//! `deployments/status`, update on `deployments/finalizers` (engine Pods' owner references),
//! list/create/delete/patch on `pods` (engine Pods and their annotations, the node agents'
//! Pods, the leader label), create/patch on `events.k8s.io` events, create and get/update of
//! its Lease, get/list/watch on the cluster-scoped `hosts`, and for [`tenants`] get/list/watch
//! on `tenants` and the namespace's `secrets` and patch on `tenants/status`. Every call is bounded
//! ([`API_CALL_TIMEOUT`]) and observed ([`api_client`]).

pub mod args;
pub mod engines;
pub mod events;
pub mod handover;
pub mod leader;
#[cfg(test)]
mod mock;
pub mod operator;
pub mod pods;
pub mod reconcile;
pub mod status;
pub mod store;
pub mod tenants;
pub mod watch;

/// The one field manager of everything the operator writes (server-side apply).
pub const FIELD_MANAGER: &str = "capyctl-operator";

/// The finalizer on every `Deployment` CR: removed once the deployment is gone from the
/// lifecycle (its engines stopped).
pub const FINALIZER: &str = "capyctl.io/finalizer";

/// The controller name in Events (`reportingController`).
pub const CONTROLLER_NAME: &str = "capyctl.io/operator";

/// The bound on one call to the API server (to its response's head); Lease calls are bounded
/// by the renew deadline besides.
pub const API_CALL_TIMEOUT: std::time::Duration = capyctl_crds::api_client::API_CALL_TIMEOUT;

/// The operator's client of the API server of `config`: every call bounded by
/// [`API_CALL_TIMEOUT`] and observed into `metrics` (`capyctl_kube_api_request_seconds`).
pub fn api_client(
    config: kube::Config,
    metrics: std::sync::Arc<capyctl_lifecycle::metrics::Metrics>,
) -> Result<kube::Client, kube::Error> {
    let observer = std::sync::Arc::new(ApiCalls(metrics));
    capyctl_crds::api_client::client(config, API_CALL_TIMEOUT, Some(observer))
}

/// The server's metrics as the observer of the API server calls.
struct ApiCalls(std::sync::Arc<capyctl_lifecycle::metrics::Metrics>);

impl capyctl_crds::api_client::ApiCallObserver for ApiCalls {
    fn observe(&self, call: &capyctl_crds::api_client::ApiCall) {
        self.0
            .kube_api_call(call.verb, &call.resource, call.outcome, call.took);
    }
}

/// Waits until `rx` holds `want` (or its sender is gone). Keeps `watch`'s read guard out of
/// the callers' futures, so they stay `Send`.
pub(crate) async fn until(rx: &mut tokio::sync::watch::Receiver<bool>, want: bool) {
    let _ = rx.wait_for(|v| *v == want).await;
}
