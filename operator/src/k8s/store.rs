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
            let kept: Kept = status
                .lifecycle_record
                .as_deref()
                .and_then(|text| match serde_json::from_str(text) {
                    Ok(k) => Some(k),
                    Err(e) => {
                        tracing::warn!(deployment = %cr.name_any(), error = %e, "a CR's lifecycle record is unreadable; operator decisions and the first answer are not restored");
                        None
                    }
                })
                .unwrap_or_default();
            deployments.push(DeploymentRecord {
                id,
                revision: status.revision.unwrap_or(1).max(1),
                doc,
                operator_stopped: kept.operator_stopped,
                operator_started: kept.operator_started,
                pending_start: false,
                generation: kept
                    .generation
                    .or_else(|| status.instances.first().map(|i| i.generation))
                    .unwrap_or(0),
                first_answer: kept.first_answer,
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

/// What of a [`DeploymentRecord`] the CR's status keeps in `lifecycleRecord` (the rest is in
/// the spec and the status's own fields).
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct Kept {
    #[serde(default)]
    operator_stopped: bool,
    #[serde(default)]
    operator_started: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    generation: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    first_answer: Option<capyctl_node_agent::verify::FirstAnswer>,
}

impl CrStore {
    /// The `lifecycleRecord` of deployment `id` as last saved by the lifecycle, for its CR's
    /// status; `None` when the lifecycle has no such deployment.
    pub fn lifecycle_record(&self, id: &str) -> Option<String> {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let r = state.deployments.iter().find(|d| d.id == id)?;
        serde_json::to_string(&Kept {
            operator_stopped: r.operator_stopped,
            operator_started: r.operator_started,
            generation: Some(r.generation),
            first_answer: r.first_answer.clone(),
        })
        .ok()
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
