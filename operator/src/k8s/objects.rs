//! On Kubernetes the `Deployment` objects say what is deployed: the management API of the
//! operator ([`ObjectsOwnDeployments`]) refuses `POST /deployments` and
//! `DELETE /deployments/{name-or-id}`, so that nothing is deployed that no object records (it
//! would be lost at the next failover, and an engine Pod needs its object as owner) and nothing
//! deleted that an object still asks for (the reconciler would deploy it again).
//!
//! `kubectl capyctl deploy model` and `kubectl capyctl delete deployment` write the objects
//! themselves, with the user's own rights (see `capyctl/src/cluster.rs`), and the reconciler
//! does the rest. Every other route goes through unchanged.

use std::sync::Arc;

use capyctl_crds::api::{
    ActionReceipt, DeployReceipt, DeploymentList, DeploymentView, EngineList, HostList, LoadReport,
    StartRequest,
};
use capyctl_crds::documents::DeploymentDoc;
use capyctl_crds::errors::ApiError;

use crate::api::{BoxFuture, ManagementApi};

/// The refusal of a deploy through the management API on Kubernetes.
pub fn deploy_refused(name: &str) -> ApiError {
    ApiError::Conflict {
        detail: format!(
            "on Kubernetes the Deployment objects say what is deployed: apply a Deployment object named {name} (kubectl apply, or kubectl capyctl deploy model --file F, which writes it)"
        ),
    }
}

/// The refusal of a delete through the management API on Kubernetes.
pub fn delete_refused(name_or_id: &str) -> ApiError {
    ApiError::Conflict {
        detail: format!(
            "on Kubernetes the Deployment objects say what is deployed: delete the Deployment object of {name_or_id} (kubectl delete cdeploy NAME, or kubectl capyctl delete deployment NAME); its finalizer stops the engines"
        ),
    }
}

/// The management API of a server whose deployments come from `Deployment` objects (see the
/// module doc).
pub struct ObjectsOwnDeployments {
    inner: Arc<dyn ManagementApi>,
}

impl ObjectsOwnDeployments {
    /// `inner`, with deploys and deletes refused.
    pub fn new(inner: Arc<dyn ManagementApi>) -> Self {
        Self { inner }
    }
}

impl std::fmt::Debug for ObjectsOwnDeployments {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectsOwnDeployments")
            .finish_non_exhaustive()
    }
}

impl ManagementApi for ObjectsOwnDeployments {
    fn list(&self) -> BoxFuture<'_, DeploymentList> {
        self.inner.list()
    }

    fn deploy(&self, doc: DeploymentDoc) -> BoxFuture<'_, Result<DeployReceipt, ApiError>> {
        Box::pin(async move { Err(deploy_refused(&doc.name)) })
    }

    fn get<'a>(&'a self, name_or_id: &'a str) -> BoxFuture<'a, Result<DeploymentView, ApiError>> {
        self.inner.get(name_or_id)
    }

    fn delete<'a>(
        &'a self,
        name_or_id: &'a str,
    ) -> BoxFuture<'a, Result<DeploymentView, ApiError>> {
        Box::pin(async move {
            // An unknown name is still 404, as everywhere.
            self.inner.get(name_or_id).await?;
            Err(delete_refused(name_or_id))
        })
    }

    fn start<'a>(
        &'a self,
        name_or_id: &'a str,
        request: StartRequest,
    ) -> BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        self.inner.start(name_or_id, request)
    }

    fn stop<'a>(&'a self, name_or_id: &'a str) -> BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        self.inner.stop(name_or_id)
    }

    fn park<'a>(&'a self, name_or_id: &'a str) -> BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        self.inner.park(name_or_id)
    }

    fn preinitialize<'a>(
        &'a self,
        name_or_id: &'a str,
    ) -> BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        self.inner.preinitialize(name_or_id)
    }

    fn engines(&self) -> BoxFuture<'_, EngineList> {
        self.inner.engines()
    }

    fn hosts(&self) -> BoxFuture<'_, HostList> {
        self.inner.hosts()
    }

    fn load<'a>(
        &'a self,
        deployment: Option<&'a str>,
    ) -> BoxFuture<'a, Result<LoadReport, ApiError>> {
        self.inner.load(deployment)
    }

    fn ready(&self) -> bool {
        self.inner.ready()
    }

    fn changes(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.inner.changes()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::super::mock::{FakeApi, view_of};
    use super::*;

    fn doc() -> DeploymentDoc {
        capyctl_crds::documents::parse_deployment_str(
            "t.yaml",
            "name: chat-a\nengine: vllm\nmodel: m\n",
        )
        .unwrap()
    }

    #[tokio::test]
    async fn deploys_and_deletes_are_refused_naming_the_objects_and_nothing_reaches_the_server() {
        let inner = Arc::new(FakeApi::default());
        inner
            .deps
            .lock()
            .unwrap()
            .insert("chat-a".into(), view_of(&doc(), 1));
        let api = ObjectsOwnDeployments::new(inner.clone());

        let e = api.deploy(doc()).await.unwrap_err();
        assert_eq!(e.status(), 409);
        assert_eq!(e.code(), "conflict");
        assert!(
            e.message()
                .contains("apply a Deployment object named chat-a"),
            "{}",
            e.message()
        );

        let e = api.delete("chat-a").await.unwrap_err();
        assert_eq!(e.code(), "conflict");
        assert!(
            e.message()
                .contains("delete the Deployment object of chat-a"),
            "{}",
            e.message()
        );
        // An unknown name is 404, not a conflict.
        let e = api.delete("nope").await.unwrap_err();
        assert_eq!(e.code(), "not_found");
        // Nothing reached the server.
        assert!(inner.calls().is_empty());

        // Everything else goes through.
        assert_eq!(api.list().await.deployments[0].name, "chat-a");
        assert_eq!(api.get("chat-a").await.unwrap().name, "chat-a");
        assert!(api.ready());
    }
}
