//! The lifecycle's [`Store`] on Kubernetes: the `Deployment` CRs themselves.
//!
//! A new leader lists the CRs before it opens the lifecycle; [`CrStore::from_crs`] rebuilds
//! each deployment's record from its spec and status (`deploymentId`, `revision`, the
//! instance's `generation`), so the deployments keep their IDs and revisions across a restart
//! or a failover, and the node agent's recovery adopts the engines the previous leader left.
//! Saves are kept in memory: what the lifecycle records reaches the API server as the CRs'
//! status (written by the reconciler), which the next leader reads.
//!
//! NB: the operator's own decisions (`operator_stopped`, `operator_started`) and the first
//! answer have no place in the CRD's status yet, so they do not survive a failover (a stopped
//! deployment comes back stopped only in its instance, not as an operator stop).

use std::sync::{Mutex, PoisonError};

use capyctl_crds::k8s::Deployment;
use kube::ResourceExt;

use crate::store::{DeploymentRecord, STATE_VERSION, Store, StoreError, StoredState};

/// The records rebuilt from the CRs, and what the lifecycle saved since.
#[derive(Debug, Default)]
pub struct CrStore {
    state: Mutex<StoredState>,
}

impl CrStore {
    /// The records of `crs`: every CR with a valid spec and a `status.deploymentId`, not being
    /// deleted. A CR without an ID yet is deployed fresh by the reconciler.
    pub fn from_crs<'a>(crs: impl IntoIterator<Item = &'a Deployment>) -> Self {
        let mut deployments = Vec::new();
        for cr in crs {
            if cr.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let Some(status) = &cr.status else { continue };
            let Some(id) = status.deployment_id.clone().filter(|i| !i.is_empty()) else {
                continue;
            };
            let doc = match cr.to_document() {
                Ok(d) => d,
                Err(e) => {
                    tracing::warn!(deployment = %cr.name_any(), error = %e, "a CR's spec is refused; it is not restored");
                    continue;
                }
            };
            deployments.push(DeploymentRecord {
                id,
                revision: status.revision.unwrap_or(1).max(1),
                doc,
                operator_stopped: false,
                operator_started: false,
                generation: status.instances.first().map(|i| i.generation).unwrap_or(0),
                first_answer: None,
            });
        }
        deployments.sort_by(|a, b| a.doc.name.cmp(&b.doc.name));
        Self {
            state: Mutex::new(StoredState {
                version: STATE_VERSION,
                deployments,
            }),
        }
    }
}

impl Store for CrStore {
    fn load(&self) -> Result<StoredState, StoreError> {
        Ok(self
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone())
    }

    fn save(&self, state: &StoredState) -> Result<(), StoreError> {
        *self.state.lock().unwrap_or_else(PoisonError::into_inner) = state.clone();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn cr(name: &str, status: serde_json::Value, spec: serde_json::Value) -> Deployment {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "capyctl.io/v1alpha1",
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": "capyctl", "uid": "u"},
            "spec": spec,
            "status": status,
        }))
        .unwrap()
    }

    #[test]
    fn records_come_back_from_the_crs_status() {
        let spec = serde_json::json!({"engine": "vllm", "model": "Qwen3-4B"});
        let crs = [
            cr(
                "chat-b",
                serde_json::json!({"deploymentId": "01KB", "revision": 3,
                    "instances": [{"index": 0, "hostId": "gpu-1", "generation": 7, "state": "parked"}]}),
                spec.clone(),
            ),
            // Never deployed: no ID, deployed fresh by the reconciler.
            cr("chat-c", serde_json::json!({}), spec.clone()),
            cr(
                "chat-a",
                serde_json::json!({"deploymentId": "01KA"}),
                spec.clone(),
            ),
            // A bad spec is not restored.
            cr(
                "chat-d",
                serde_json::json!({"deploymentId": "01KD"}),
                serde_json::json!({"engine": "vllm", "model": "m", "maxConcurrentRequests": 0}),
            ),
        ];
        let store = CrStore::from_crs(&crs);
        let state = store.load().unwrap();
        let names: Vec<&str> = state
            .deployments
            .iter()
            .map(|d| d.doc.name.as_str())
            .collect();
        assert_eq!(names, ["chat-a", "chat-b"]);
        let b = &state.deployments[1];
        assert_eq!((b.id.as_str(), b.revision, b.generation), ("01KB", 3, 7));
        assert_eq!(state.deployments[0].revision, 1);
        // Saves are kept.
        store.save(&StoredState::default()).unwrap();
        assert!(store.load().unwrap().deployments.is_empty());
    }
}
