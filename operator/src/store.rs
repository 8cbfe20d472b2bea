//! The lifecycle's [`Store`] on Kubernetes: the `Deployment` CRs themselves.
//!
//! A new leader lists the CRs before it opens the lifecycle; [`CrStore::from_crs`] rebuilds
//! each deployment's record from its status (`deploymentId`, `revision`) and its
//! `lifecycleRecord`: the operator's decisions (`operator_stopped`, `operator_started`), the
//! instance's `generation`, the first answer, and the document of the revision that runs. So
//! the deployments keep their IDs, revisions and operator decisions across a restart or a
//! failover, and the node agent's recovery adopts the engines the previous leader left.
//! Writes are kept in memory, by ID (each record written or removed on its own, never the whole
//! state): what the lifecycle records reaches the API server as the CRs' status (written by
//! the reconciler), which the next leader reads.
//!
//! NB: a CR edited while no leader ran has a spec that is not its revision's. The record is
//! rebuilt with the revision's document (from `lifecycleRecord`), so the reconciler's deploy
//! of the new spec is a change: the revision is bumped (`Redeployed`) as it would have been
//! live. A CR whose new spec is refused keeps running its revision. Records written before
//! the document was kept fall back to the CR's spec.

use capyctl_crds::Deployment;
use capyctl_spec::documents::DeploymentDoc;
use kube::ResourceExt;

use capyctl_lifecycle::store::{Changes, DeploymentRecord, MemoryStore, Store, StoreError};

/// The records rebuilt from the CRs, and what the lifecycle wrote since, by deployment ID.
#[derive(Debug, Default)]
pub struct CrStore {
    records: MemoryStore,
}

impl CrStore {
    /// The records of `crs`: every CR with a valid spec and a `status.deploymentId`, not being
    /// deleted. A CR without an ID yet is deployed fresh by the reconciler.
    pub fn from_crs<'a>(crs: impl IntoIterator<Item = &'a Deployment>) -> Self {
        let mut records = Vec::new();
        for cr in crs {
            if cr.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let Some(status) = &cr.status else { continue };
            let Some(id) = status.deployment_id.clone().filter(|i| !i.is_empty()) else {
                continue;
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
            let current = cr.to_document();
            let doc = match (kept.doc, current) {
                // The revision's document: a spec edited meanwhile is deployed as a change.
                (Some(revision_doc), current) => {
                    if let Ok(c) = &current
                        && *c != revision_doc
                    {
                        tracing::info!(deployment = %cr.name_any(), "the spec changed while no leader ran; it is deployed as a new revision");
                    }
                    revision_doc
                }
                (None, Ok(d)) => d,
                (None, Err(e)) => {
                    tracing::warn!(deployment = %cr.name_any(), error = %e, "a CR's spec is refused; it is not restored");
                    continue;
                }
            };
            let record = DeploymentRecord {
                id,
                revision: status.revision.unwrap_or(1).max(1),
                doc: doc.into(),
                operator_stopped: kept.operator_stopped,
                operator_started: kept.operator_started,
                pending_start: false,
                generation: kept
                    .generation
                    .or_else(|| status.instances.first().map(|i| i.generation))
                    .unwrap_or(0),
                first_answer: kept.first_answer,
            };
            records.push(record);
        }
        Self {
            records: MemoryStore::new(records),
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
    /// The document of the revision that runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    doc: Option<DeploymentDoc>,
}

impl CrStore {
    /// The `lifecycleRecord` of deployment `id` as last saved by the lifecycle, for its CR's
    /// status; `None` when the lifecycle has no such deployment.
    pub fn lifecycle_record(&self, id: &str) -> Option<String> {
        let r = self.records.get(id)?;
        serde_json::to_string(&Kept {
            operator_stopped: r.operator_stopped,
            operator_started: r.operator_started,
            generation: Some(r.generation),
            first_answer: r.first_answer.clone(),
            doc: Some((*r.doc).clone()),
        })
        .ok()
    }
}

impl Store for CrStore {
    /// By name.
    fn load(&self) -> Result<Vec<DeploymentRecord>, StoreError> {
        let mut records = self.records.load()?;
        records.sort_by(|a, b| a.doc.name.cmp(&b.doc.name));
        Ok(records)
    }

    fn write(&self, changes: &Changes) -> Result<(), StoreError> {
        self.records.write(changes)
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
        let records = store.load().unwrap();
        let names: Vec<&str> = records.iter().map(|d| d.doc.name.as_str()).collect();
        assert_eq!(names, ["chat-a", "chat-b"]);
        let b = &records[1];
        assert_eq!((b.id.as_str(), b.revision, b.generation), ("01KB", 3, 7));
        assert_eq!(records[0].revision, 1);
        // Writes are kept, record by record.
        let mut a = records[0].clone();
        a.operator_stopped = true;
        store
            .write(&Changes {
                put: vec![a.clone()],
                remove: vec!["01KB".into()],
            })
            .unwrap();
        assert_eq!(store.load().unwrap(), [a]);
    }

    fn doc(text: &str) -> DeploymentDoc {
        capyctl_spec::documents::parse_deployment_str("t.yaml", text).unwrap()
    }

    #[test]
    fn the_lifecycle_record_round_trips_through_the_crs_status() {
        let record = DeploymentRecord {
            id: "01KA".into(),
            revision: 4,
            doc: doc("name: chat-a\nengine: vllm\nmodel: Qwen3-4B\nmax_concurrent_requests: 8\n")
                .into(),
            operator_stopped: true,
            operator_started: false,
            pending_start: false,
            generation: 7,
            first_answer: Some(capyctl_node_agent::verify::FirstAnswer::Text {
                text: "Paris".into(),
            }),
        };
        let store = CrStore::default();
        store
            .write(&Changes {
                put: vec![record.clone()],
                remove: Vec::new(),
            })
            .unwrap();
        let text = store.lifecycle_record("01KA").unwrap();
        assert_eq!(store.lifecycle_record("01KOTHER"), None);
        let status = serde_json::json!({"deploymentId": "01KA", "revision": 4,
            "lifecycleRecord": text});
        let spec = serde_json::json!({"engine": "vllm", "model": "Qwen3-4B",
            "maxConcurrentRequests": 8});
        let back = CrStore::from_crs(&[cr("chat-a", status, spec)]);
        assert_eq!(back.load().unwrap(), [record]);
    }

    #[test]
    fn a_spec_edited_while_no_leader_ran_comes_back_as_its_revisions_document() {
        let running = doc("name: chat-a\nengine: vllm\nmodel: Qwen3-4B\n");
        let record = DeploymentRecord {
            id: "01KA".into(),
            revision: 2,
            doc: running.clone().into(),
            operator_stopped: false,
            operator_started: false,
            pending_start: false,
            generation: 3,
            first_answer: None,
        };
        let store = CrStore::default();
        store
            .write(&Changes {
                put: vec![record],
                remove: Vec::new(),
            })
            .unwrap();
        let kept = store.lifecycle_record("01KA").unwrap();
        let status =
            serde_json::json!({"deploymentId": "01KA", "revision": 2, "lifecycleRecord": kept});
        // Edited meanwhile: new arguments.
        let edited = serde_json::json!({"engine": "vllm", "model": "Qwen3-4B",
            "extraArgs": ["--max-model-len", "8192"]});
        let cr_edited = cr("chat-a", status.clone(), edited);
        let back = CrStore::from_crs(std::slice::from_ref(&cr_edited));
        let r = &back.load().unwrap()[0];
        // The revision's document, not the new spec: the reconciler's deploy of the new spec is
        // then a change, which bumps the revision (2 -> 3).
        assert_eq!(*r.doc, running);
        assert_eq!(r.revision, 2);
        assert_ne!(cr_edited.to_document().unwrap(), *r.doc);
        // Edited into a spec that is refused: the revision keeps running.
        let refused = serde_json::json!({"engine": "vllm", "model": "Qwen3-4B",
            "maxConcurrentRequests": 0});
        let back = CrStore::from_crs(&[cr("chat-a", status, refused)]);
        assert_eq!(*back.load().unwrap()[0].doc, running);
    }
}
