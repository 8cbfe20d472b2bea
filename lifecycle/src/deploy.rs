//! The operator's `deploy` (documents checked against the hosts, then applied) and `delete`.

use std::sync::atomic::Ordering;

use capyctl_interfaces::measure::Measurement;
use capyctl_interfaces::spec::InstanceSpec;
use capyctl_spec::api::{DeployOutcome, DeployReceipt, DeploymentView, SwitchCause};
use capyctl_spec::documents::DeploymentDoc;
use capyctl_spec::errors::ApiError;

use crate::adapters::Retired;
use crate::errors::not_found;
use crate::state::State;
use crate::{Core, placement};
use tokio::time::Instant;

/// How many changed deployments [`Core::deploy_checked`] applies per turn of the owner.
const DEPLOY_CHUNK: usize = 256;

/// Deployment documents measured and checked against the hosts ([`Core::check_all`]), not
/// deployed yet ([`Core::deploy_checked`]).
#[derive(Debug, Default)]
pub struct Checked(Vec<CheckedDoc>);

impl Checked {
    /// How many documents it holds.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// It holds none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// One checked document: its deployment's ID (new or existing), its measurement.
#[derive(Debug)]
pub(crate) struct CheckedDoc {
    pub(crate) doc: DeploymentDoc,
    pub(crate) id: String,
    pub(crate) measured: Option<Measurement>,
    /// The same document is deployed already: nothing to do.
    pub(crate) unchanged: bool,
}

impl Core {
    /// Deploys `doc`: creates the deployment, or makes `doc` its next revision. It is measured
    /// and checked against the hosts first, so that a document that cannot work (no host could
    /// ever place it, where no other host can join) is refused and changes nothing: an existing
    /// deployment keeps its working revision.
    pub(crate) async fn do_deploy(&self, doc: DeploymentDoc) -> Result<DeployReceipt, ApiError> {
        let (id, outcome) = self.deploy_unsaved(doc).await?;
        if outcome != DeployOutcome::Unchanged {
            self.save_logged(&id).await;
        }
        Ok(DeployReceipt {
            outcome,
            deployment: self.view(&id).ok_or_else(|| not_found(&id))?,
        })
    }

    /// Deploys `docs` in order, each as [`ManagementApi::deploy`](crate::api::ManagementApi::deploy) does, and writes the records
    /// they change in one transaction at the end: a whole document (standalone) is one write.
    /// The whole document is checked first ([`Core::check_all`]): a refusal changes
    /// nothing, `Err` with the refused deployment's name.
    pub async fn deploy_all(&self, docs: Vec<DeploymentDoc>) -> Result<(), (String, ApiError)> {
        let checked = self.check_all(docs).await?;
        self.deploy_checked(checked).await;
        Ok(())
    }

    /// Measures each of `docs` and checks it against the hosts, as a deploy does before it
    /// changes anything, and changes nothing: the first refusal, with the refused deployment's
    /// name. What it answers is deployed by [`Core::deploy_checked`] without measuring again.
    pub async fn check_all(&self, docs: Vec<DeploymentDoc>) -> Result<Checked, (String, ApiError)> {
        let mut checked = Vec::with_capacity(docs.len());
        // The bases of a document's adapters may be in the same document.
        let batch: Vec<DeploymentDoc> = docs
            .iter()
            .filter(|d| d.adapters.is_some())
            .cloned()
            .collect();
        for (i, doc) in docs.into_iter().enumerate() {
            if i % 256 == 255 {
                // Unchanged ones await nothing: a caller's other branches (a signal) get
                // their turn.
                tokio::task::yield_now().await;
            }
            let name = doc.name.clone();
            checked.push(self.check(doc, &batch).await.map_err(|e| (name, e))?);
        }
        Ok(Checked(checked))
    }

    /// Deploys what [`Core::check_all`] checked, in order, and writes the records they change
    /// in one transaction. The changed ones are applied [`DEPLOY_CHUNK`] per turn of the
    /// owner (one turn each made a start of 100,000 deployments mostly turns).
    pub async fn deploy_checked(&self, checked: Checked) {
        let mut changed = checked
            .0
            .into_iter()
            .filter(|one| !one.unchanged)
            .peekable();
        while changed.peek().is_some() {
            let chunk: Vec<CheckedDoc> = changed.by_ref().take(DEPLOY_CHUNK).collect();
            let revised = self
                .write(move |inner| {
                    let now = Instant::now();
                    let mut revised = Vec::new();
                    for one in chunk {
                        let name = one.doc.adapter.is_some().then(|| one.doc.name.clone());
                        let (_, outcome) = inner.apply_deploy(one.doc, one.id, one.measured, now);
                        if outcome == DeployOutcome::Updated {
                            revised.extend(name);
                        }
                    }
                    revised
                })
                .await;
            for name in revised {
                self.adapters.retire(&name, Retired::Revised);
            }
        }
        self.flush_due().await;
    }

    /// [`Core::do_deploy`] but the write: a changed record is left in `State::dirty` for the
    /// next save.
    async fn deploy_unsaved(
        &self,
        doc: DeploymentDoc,
    ) -> Result<(String, DeployOutcome), ApiError> {
        let one = self.check(doc, &[]).await?;
        Ok(self.apply_deploy(one).await)
    }

    /// The part of a deploy that changes nothing: checked against the other deployments (an
    /// adapter's base, `batch`: bases deployed with it) and the hosts (a document no host can
    /// ever place, where no other host can join, is refused), and measured.
    async fn check(
        &self,
        doc: DeploymentDoc,
        batch: &[DeploymentDoc],
    ) -> Result<CheckedDoc, ApiError> {
        let files_visible = self.hosts_fixed.load(Ordering::Relaxed);
        let (doc, existing) = self.read(|inner| {
            let doc = inner.check_adapters(doc, files_visible, batch)?;
            let existing = inner
                .by_name(&doc.name)
                .map(|d| (d.rec.id.clone(), *d.rec.doc == doc));
            Ok::<_, ApiError>((doc, existing))
        })?;
        let id = match existing {
            Some((id, true)) => {
                return Ok(CheckedDoc {
                    doc,
                    id,
                    measured: None,
                    unchanged: true,
                });
            }
            Some((id, false)) => id,
            None => ulid::Ulid::new().to_string(),
        };
        let spec = InstanceSpec::from_doc(id.clone(), &doc);
        // No host known yet (a cluster before its first node agent): measured at the start.
        // An adapter runs no engine of its own.
        let measured = match self.agent_of(&id) {
            Ok(agent) if doc.adapter.is_none() => agent.measure(&spec).await.ok(),
            _ => None,
        };
        if self.hosts_fixed.load(Ordering::Relaxed) {
            self.read(|inner| Self::some_host_fits(inner, &doc.name, &spec, measured.as_ref()))?;
        }
        Ok(CheckedDoc {
            doc,
            id,
            measured,
            unchanged: false,
        })
    }

    /// The part of a deploy that changes the state: creates the deployment or makes the
    /// checked document its next revision (the record is left in `State::dirty`).
    async fn apply_deploy(&self, one: CheckedDoc) -> (String, DeployOutcome) {
        let CheckedDoc {
            doc,
            id,
            measured,
            unchanged,
        } = one;
        if unchanged {
            return (id, DeployOutcome::Unchanged);
        }
        let adapter = doc.adapter.is_some().then(|| doc.name.clone());
        let applied = self
            .write(move |inner| inner.apply_deploy(doc, id, measured, Instant::now()))
            .await;
        // An adapter's new revision (its files): what is loaded is the old one.
        if let (Some(name), DeployOutcome::Updated) = (adapter, applied.1) {
            self.adapters.retire(&name, Retired::Revised);
        }
        applied
    }

    /// `does_not_fit` when the GPU memory `spec` needs (declared, or `measured`) is more than
    /// any host has: no host could ever place it. Unknown needs and no hosts pass.
    fn some_host_fits(
        inner: &State,
        name: &str,
        spec: &InstanceSpec,
        measured: Option<&Measurement>,
    ) -> Result<(), ApiError> {
        let (need, whence) = match (
            spec.resources.gpu_memory,
            measured.and_then(|m| m.gpu_memory),
        ) {
            (Some(declared), _) => (declared, "resources.gpu_memory"),
            (None, Some(m)) => (m.bytes, "its measured GPU memory"),
            (None, None) => return Ok(()),
        };
        let Some((host, largest)) = inner
            .hosts
            .iter()
            .map(|(id, h)| (id, h.capacity))
            .max_by_key(|(_, capacity)| *capacity)
        else {
            return Ok(());
        };
        if need <= largest {
            return Ok(());
        }
        Err(ApiError::DoesNotFit {
            deployment: name.to_string(),
            detail: format!(
                "{whence}: {} is more than the GPU memory of any host (the largest: {} on host {host}); no host can ever place it",
                placement::gib(need),
                placement::gib(largest)
            ),
        })
    }

    pub(crate) async fn do_delete(&self, key: &str) -> Result<DeploymentView, ApiError> {
        let id = self.find(key)?;
        self.read(|inner| inner.command_refusal(&id, Instant::now()))?;
        self.read(|inner| inner.delete_refusal(&id))?;
        let rid = self.fresh_id("delete");
        let view = self.view(&id).ok_or_else(|| not_found(&id))?;
        let refusal = ApiError::ModelNotFound {
            model: view.name.clone(),
        };
        let down = self.begin_operator_stop(&id, &rid, refusal.clone()).await?;
        // Every instance at once (as a stop).
        let (result, others) = tokio::join!(
            self.take_down_recorded(SwitchCause::Release, &id, &rid, down, true),
            self.take_down_others(&id, refusal, true)
        );
        let result = match others {
            Ok(()) => result,
            Err(e) => result.and(Err(e)),
        };
        let removed = result.is_ok();
        self.on(&id, move |inner, id| inner.delete_done(id, &rid, removed))
            .await;
        result?;
        if view.spec.adapter.is_some() {
            // Unloaded from the engines once its running requests end; new ones get the
            // page's 404 (its name no longer resolves).
            self.adapters.retire(&view.name, Retired::Deleted);
        }
        self.config.metrics.forget_deployment(&id);
        self.save_logged(&id).await;
        Ok(view)
    }
}
