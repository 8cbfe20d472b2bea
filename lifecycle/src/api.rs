//! The seam between the management listener and the server: [`ManagementApi`].
//!
//! Every method answers a body of `capyctl_spec::api` or an [`ApiError`] (its status, code and
//! message are what the listener sends). `name_or_id` accepts a deployment's name or its ID.

use capyctl_spec::api::{
    ActionReceipt, DeployReceipt, DeploymentList, DeploymentView, EngineList, HostDrainReceipt,
    HostList, LoadReport, StartRequest, SwitchList, SwitchQuery,
};
use capyctl_spec::documents::DeploymentDoc;
use capyctl_spec::errors::ApiError;

/// The one boxed, sendable future (keeps the trait object-safe): `capyctl_interfaces`'.
pub use capyctl_interfaces::BoxFuture;

/// What the management listener asks of the server (DESIGN 4.5).
pub trait ManagementApi: Send + Sync + 'static {
    /// `GET /deployments`.
    fn list(&self) -> BoxFuture<'_, DeploymentList>;
    /// `GET /deployments` as the listener sends it: the JSON of [`ManagementApi::list`], byte
    /// for byte. The server writes it as it builds the views, without the whole list at once
    /// (by default: `list` encoded).
    fn list_json(&self) -> BoxFuture<'_, Result<Vec<u8>, ApiError>> {
        Box::pin(async move { encoded(&self.list().await) })
    }
    /// `POST /deployments`: deploy (or re-deploy) a document. A changed document bumps the
    /// revision; the same document again changes nothing.
    fn deploy(&self, doc: DeploymentDoc) -> BoxFuture<'_, Result<DeployReceipt, ApiError>>;
    /// `GET /deployments/{name-or-id}`.
    fn get<'a>(&'a self, name_or_id: &'a str) -> BoxFuture<'a, Result<DeploymentView, ApiError>>;
    /// `DELETE /deployments/{name-or-id}`: stops its instances and forgets it.
    fn delete<'a>(&'a self, name_or_id: &'a str)
    -> BoxFuture<'a, Result<DeploymentView, ApiError>>;
    /// `POST /deployments/{id}/start`.
    fn start<'a>(
        &'a self,
        name_or_id: &'a str,
        request: StartRequest,
    ) -> BoxFuture<'a, Result<ActionReceipt, ApiError>>;
    /// `POST /deployments/{id}/stop`: an operator stop (requests get `deployment_stopped`).
    fn stop<'a>(&'a self, name_or_id: &'a str) -> BoxFuture<'a, Result<ActionReceipt, ApiError>>;
    /// `POST /deployments/{id}/park`: parks in the background; answers at once.
    fn park<'a>(&'a self, name_or_id: &'a str) -> BoxFuture<'a, Result<ActionReceipt, ApiError>>;
    /// `POST /deployments/{id}/preinitialize`: measure / prepare without serving.
    fn preinitialize<'a>(
        &'a self,
        name_or_id: &'a str,
    ) -> BoxFuture<'a, Result<ActionReceipt, ApiError>>;
    /// `GET /engines`.
    fn engines(&self) -> BoxFuture<'_, EngineList>;
    /// `GET /hosts`.
    fn hosts(&self) -> BoxFuture<'_, HostList>;
    /// `POST /hosts/{id}/drain` (`drain`): takes host `host_id` out of service (nothing is
    /// placed on it) and stops every instance on it, each drained first as `stop` does,
    /// explicit ones too; requests for them are placed elsewhere, or refused while no host
    /// may take them. `POST /hosts/{id}/uncordon` (`!drain`): puts it back in service.
    fn drain_host<'a>(
        &'a self,
        host_id: &'a str,
        drain: bool,
    ) -> BoxFuture<'a, Result<HostDrainReceipt, ApiError>>;
    /// `GET /metrics/load[?deployment=ID]`; an ID that names no deployment is 404 `not_found`.
    fn load<'a>(
        &'a self,
        deployment: Option<&'a str>,
    ) -> BoxFuture<'a, Result<LoadReport, ApiError>>;
    /// `GET /metrics/load[?deployment=ID]` as the listener sends it: the JSON of
    /// [`ManagementApi::load`], byte for byte (by default: `load` encoded; the server writes
    /// each deployment's as it builds it).
    fn load_json<'a>(
        &'a self,
        deployment: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Vec<u8>, ApiError>> {
        Box::pin(async move { encoded(&self.load(deployment).await?) })
    }
    /// `/readyz`: whether the server has finished starting (state loaded, engines recovered).
    fn ready(&self) -> bool;

    /// `GET /switches`: the switch records with `seq > after`, oldest first (DESIGN 4.8).
    /// `deployment` (a name or an ID) keeps that deployment's. An implementation that keeps
    /// no records answers none.
    fn switches(&self, query: SwitchQuery) -> BoxFuture<'_, Result<SwitchList, ApiError>> {
        Box::pin(async move {
            Ok(SwitchList {
                switches: Vec::new(),
                next: query.after.unwrap_or(0),
            })
        })
    }

    /// A receiver that changes whenever the server's state does (a counter; its value means
    /// nothing), for those who mirror the views (the Kubernetes status writer); `None` when the
    /// implementation cannot tell (then poll).
    fn changes(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        None
    }
}

/// `body`'s JSON, as the management listener sends it.
pub fn encoded<T: serde::Serialize>(body: &T) -> Result<Vec<u8>, ApiError> {
    serde_json::to_vec(body).map_err(|e| ApiError::Internal {
        detail: format!("cannot serialize the answer: {e}"),
    })
}
