//! The lifecycle's reads of adapters (DESIGN 4.9), rules of `State` that change nothing: a
//! deploy's refusals across deployments, a delete's, the commands an adapter refuses, and the
//! route a request for an adapter takes.
//!
//! An adapter is a deployment of its own (its record, its name, its revision, stored like any),
//! with one unit that never runs an engine: its state stays `stopped`, nothing places, plans or
//! brings it up (a request for it resolves to its base, and the commands that would move it are
//! refused, [`State::adapter_command_refusal`]). What it has loaded is the adapter owner's
//! (`super::Adapters`), not a unit state.

use capyctl_interfaces::router::AdapterRoute;
use capyctl_spec::documents::{BaseOf, DeploymentDoc, check_adapter_of};
use capyctl_spec::errors::ApiError;

use crate::state::{Dep, State};

impl State {
    /// An adapter's document, or a model's revision, checked against the other deployments
    /// (DESIGN 4.9) and the bases deployed with it (`batch`, which win), changing nothing; the
    /// document to deploy (an adapter's with its base's engine and model). `files_visible`:
    /// CapyCTL sees the hosts' files (standalone).
    pub(crate) fn check_adapters(
        &self,
        mut doc: DeploymentDoc,
        files_visible: bool,
        batch: &[DeploymentDoc],
    ) -> Result<DeploymentDoc, ApiError> {
        let refused = |key: &str, why: String| ApiError::InvalidRequest {
            detail: format!("deployment {}: {key}: {why}", doc.name),
        };
        let existing = self.by_name(&doc.name);
        match (existing.map(|d| d.rec.doc.base()), doc.base()) {
            (Some(Some(was)), Some(base)) if was != base => {
                return Err(refused(
                    "adapter.base",
                    format!(
                        "`{}` is already an adapter of `{was}`; two adapters of the same name on different bases are refused: delete it first or choose another name",
                        doc.name
                    ),
                ));
            }
            (Some(None), Some(_)) => {
                return Err(refused(
                    "adapter",
                    format!(
                        "`{}` is a model; an adapter needs a name of its own (or delete the model first)",
                        doc.name
                    ),
                ));
            }
            (Some(Some(was)), None) => {
                return Err(refused(
                    "adapter",
                    format!(
                        "`{}` is an adapter of `{was}`; a model needs a name of its own (or delete the adapter first)",
                        doc.name
                    ),
                ));
            }
            _ => {}
        }
        let Some(adapter) = &doc.adapter else {
            // A model: a revision that no longer takes adapters while some name it.
            let took = existing.is_some_and(|d| d.rec.doc.adapters.is_some());
            if took && doc.adapters.is_none() {
                let names = self.adapters_of(&doc.name);
                if !names.is_empty() {
                    return Err(refused(
                        "adapters",
                        format!(
                            "the adapters {} are loaded into `{}`; keep adapters: or delete them first",
                            names.join(", "),
                            doc.name
                        ),
                    ));
                }
            }
            return Ok(doc);
        };
        let base = batch
            .iter()
            .rev()
            .find(|d| d.name == adapter.base)
            .or_else(|| self.by_name(&adapter.base).map(|d| &*d.rec.doc));
        check_adapter_of(&doc, base.map(|doc| BaseOf { doc, files_visible })).map_err(
            |(path, problem)| refused(&path.display().unwrap_or_default(), problem.to_string()),
        )?;
        if let Some(base) = base {
            doc.engine = base.engine;
            doc.model.clone_from(&base.model);
        }
        Ok(doc)
    }

    /// The names of the adapters whose base is `base`, sorted.
    pub(crate) fn adapters_of(&self, base: &str) -> Vec<String> {
        let mut names: Vec<String> = self
            .deps
            .values()
            .filter(|d| d.index == 0 && d.rec.doc.base() == Some(base))
            .map(|d| d.name().to_string())
            .collect();
        names.sort();
        names
    }

    /// A delete of `id` refused while adapters name it as their base.
    pub(crate) fn delete_refusal(&self, id: &str) -> Result<(), ApiError> {
        let Some(d) = self.deps.get(id) else {
            return Ok(());
        };
        if d.rec.doc.adapters.is_none() {
            return Ok(());
        }
        let names = self.adapters_of(d.name());
        if names.is_empty() {
            return Ok(());
        }
        Err(ApiError::Conflict {
            detail: format!(
                "deployment {} is the base of the adapters {}; delete them first",
                d.name(),
                names.join(", ")
            ),
        })
    }

    /// An operator's `what` (start, stop, park, preinitialize) of an adapter, refused: it is
    /// loaded on demand into its base, which the command moves.
    pub(crate) fn adapter_command_refusal(&self, id: &str, what: &str) -> Result<(), ApiError> {
        match self.deps.get(id).and_then(|d| d.rec.doc.base()) {
            Some(base) => Err(ApiError::Conflict {
                detail: format!(
                    "deployment {} is an adapter of {base}: it is loaded into {base} on demand, by the requests that name it; {what} {base} instead",
                    self.deps.get(id).map_or(id, |d| d.name())
                ),
            }),
            None => Ok(()),
        }
    }

    /// The adapter `model` names, with its base's deployment ID and slots; `None` for a
    /// model.
    pub(crate) fn adapter_route(&self, model: &str) -> Option<AdapterRoute> {
        let d = self.by_name(model)?;
        let adapter = d.rec.doc.adapter.as_ref()?;
        let base = self.by_name(&adapter.base)?;
        Some(AdapterRoute {
            id: d.rec.id.clone(),
            name: d.name().to_string(),
            path: adapter.path.clone(),
            base: base.rec.id.clone(),
            max_loaded: base.rec.doc.adapters.as_ref().map_or(1, |a| a.max_loaded),
            request_field: base
                .rec
                .doc
                .engine
                .and_then(capyctl_engine_rules::adapters::adapter_request_field),
        })
    }

    /// The base of adapter `d` (what a request for it makes servable).
    pub(crate) fn base_of(&self, d: &Dep) -> Option<&Dep> {
        self.by_name(d.rec.doc.base()?)
    }
}
