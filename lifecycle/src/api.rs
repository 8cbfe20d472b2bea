//! The seam between the management listener and the server: [`ManagementApi`].
//!
//! Every method answers a body of `capyctl_spec::api` or an [`ApiError`] (its status, code and
//! message are what the listener sends). `name_or_id` accepts a deployment's name or its ID.

use bytes::Bytes;
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
    /// for byte, whole (by default: `list` encoded). The listener sends
    /// [`ManagementApi::list_parts`].
    fn list_json(&self) -> BoxFuture<'_, Result<Vec<u8>, ApiError>> {
        Box::pin(async move { encoded(&self.list().await) })
    }
    /// [`ManagementApi::list_json`] a part at a time, each written when it is asked for (the
    /// listener sends each part as it comes, so no answer of every deployment is held at
    /// once); the parts together are `list_json`'s bytes. An error here is the answer's; one
    /// from a part after the first ends the answer unfinished (see [`JsonParts`]). By
    /// default: `list_json` as one part.
    fn list_parts(&self) -> BoxFuture<'_, Result<JsonParts, ApiError>> {
        Box::pin(async move { Ok(JsonParts::whole(self.list_json().await?)) })
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
    /// each deployment's as it builds it, a full read into the buffer the last one gave back
    /// when its `Bytes` were dropped).
    fn load_json<'a>(
        &'a self,
        deployment: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Bytes, ApiError>> {
        Box::pin(async move { encoded(&self.load(deployment).await?).map(Bytes::from) })
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

/// An answer's JSON a part at a time ([`ManagementApi::list_parts`]): an iterator of its
/// parts, each written when it is asked for, on the caller's thread. The management listener
/// answers with the first part's error when it has one, sends a body of one part as it sends
/// any answer, and a longer one as a chunked body, a part at a time; an error after the first
/// part (an encoding that fails half-way: none of the lists' can) ends that body unfinished,
/// which the client sees as a broken answer, never as a complete one.
pub struct JsonParts {
    parts: Box<dyn Iterator<Item = Result<Bytes, ApiError>> + Send>,
}

impl JsonParts {
    /// The parts `parts` yields.
    pub fn new(parts: impl Iterator<Item = Result<Bytes, ApiError>> + Send + 'static) -> Self {
        JsonParts {
            parts: Box::new(parts),
        }
    }

    /// `body` as one part.
    pub fn whole(body: Vec<u8>) -> Self {
        Self::new(std::iter::once(Ok(Bytes::from(body))))
    }

    /// Every part, joined: the whole answer, or the first error.
    pub fn join(self) -> Result<Vec<u8>, ApiError> {
        let mut out = Vec::new();
        for part in self {
            out.extend_from_slice(&part?);
        }
        Ok(out)
    }
}

impl Iterator for JsonParts {
    type Item = Result<Bytes, ApiError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.parts.next()
    }
}

impl std::fmt::Debug for JsonParts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonParts").finish_non_exhaustive()
    }
}

/// `body`'s JSON, as the management listener sends it.
pub fn encoded<T: serde::Serialize>(body: &T) -> Result<Vec<u8>, ApiError> {
    serde_json::to_vec(body).map_err(|e| ApiError::Internal {
        detail: format!("cannot serialize the answer: {e}"),
    })
}
