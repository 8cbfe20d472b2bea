//! The rules of the operator's commands that are not engine operations of their own: a
//! deploy's record written, a delete's end, a stop's and a park's marks, a host cordoned, a
//! start that waits for memory; and what a restart learns of measurements. Each is one call
//! of the owner (the engine operations they lead to are `rules.rs`' and `releases.rs`').

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use capyctl_interfaces::measure::Measurement;
use capyctl_spec::InstanceState;
use capyctl_spec::api::DeployOutcome;
use capyctl_spec::documents::DeploymentDoc;
use capyctl_spec::errors::ApiError;
use tokio::time::Instant;

use crate::errors::not_found;
use crate::store::DeploymentRecord;

use super::{Dep, PresenceOf, State};

impl State {
    /// Writes a deploy of `doc` (checked; `id`: the new deployment's ID when its name is new,
    /// created last used `now`): a new revision of the deployment of that name, or a new
    /// deployment; `unchanged` when the same document is deployed already. A measurement
    /// still awaited does not replace one known (the same checkpoint).
    pub(crate) fn apply_deploy(
        &mut self,
        doc: DeploymentDoc,
        id: String,
        measured: Option<Measurement>,
        now: Instant,
    ) -> (String, DeployOutcome) {
        let known = self.by_name.get(&doc.name).cloned();
        let (id, outcome) = if let Some(d) = known.and_then(|id| self.deps.get_mut(&id)) {
            if *d.rec.doc == doc {
                return (d.rec.id.clone(), DeployOutcome::Unchanged);
            }
            d.rec.revision += 1;
            d.rec.doc = Arc::new(doc);
            d.renew_fixed();
            // The name cache's entry holds what the router reads of the document (its
            // routing): a new revision gets a new presence flag, and the old one, dropped,
            // marks that entry stale, so the next request reads the new document.
            d.presence = PresenceOf(Arc::new(AtomicBool::new(false)));
            (d.rec.id.clone(), DeployOutcome::Updated)
        } else {
            self.insert(Dep::new(DeploymentRecord::first(id.clone(), doc), now));
            (id.clone(), DeployOutcome::Created)
        };
        self.dirty.mark(&id);
        if let (Some(d), Some(m)) = (self.deps.get_mut(&id), measured)
            && (!m.awaiting() || d.measurement.awaiting())
        {
            d.measurement = m;
        }
        (id, outcome)
    }

    /// Ends the delete of deployment `id` (reserved by `rid`): the reservation is released
    /// and, when every instance was taken down (`removed`), the deployment is removed.
    pub(crate) fn delete_done(&mut self, id: &str, rid: &str, removed: bool) {
        self.release_reservation(rid);
        if removed {
            self.remove(id);
        }
    }

    /// The operator's stop of deployment `id`: stopped by its operator (no longer started,
    /// no start pending); its other instances take the stop at the end of the turn.
    pub(crate) fn operator_stop(&mut self, id: &str) -> Result<(), ApiError> {
        let d = self.deps.get_mut(id).ok_or_else(|| not_found(id))?;
        d.rec.operator_stopped = true;
        d.rec.operator_started = false;
        d.rec.pending_start = false;
        self.dirty.mark(id);
        Ok(())
    }

    /// The operator's park of deployment `id`, of several instances, as one turn: its
    /// instances and their states, and the deployment marked parked by its operator (no
    /// longer started; the scaler brings none of its units up). `Err(unit)` when none is
    /// ready (only a ready deployment parks): the unit to park as one instance (the one on
    /// its way up if any, else the first: parked already, its receipt), nothing marked.
    pub(crate) fn operator_park(
        &mut self,
        id: &str,
    ) -> Result<Vec<(String, InstanceState)>, String> {
        let units: Vec<(String, InstanceState)> = self
            .units_of(id)
            .map(|u| (u.id().to_string(), u.state))
            .collect();
        if !units.iter().any(|(_, s)| *s == InstanceState::Ready) {
            let coming = units
                .iter()
                .find(|(_, s)| matches!(s, InstanceState::Starting | InstanceState::Waking));
            return Err(coming.map_or_else(|| id.to_string(), |(u, _)| u.clone()));
        }
        if let Some(d) = self.deps.get_mut(id) {
            d.rec.operator_started = false;
            self.dirty.mark(id);
            self.operator_parked.insert(id.to_string());
        }
        Ok(units)
    }

    /// Ends deployment `dep`'s operator's park mark: the scaler keeps its instances again.
    pub(crate) fn end_operator_park(&mut self, dep: &str) -> bool {
        self.operator_parked.remove(dep)
    }

    /// Cordons `host` (a host drain): nothing new is placed there. The deployments bound to
    /// it, to be taken down.
    pub(crate) fn cordon(&mut self, host: &str) -> Vec<String> {
        self.cordoned.insert(host.to_string());
        self.on_host(host)
            .filter(|d| d.bound_host() == Some(host))
            .map(|d| d.id().to_string())
            .collect()
    }

    /// Puts `host` back in service (`uncordon`).
    pub(crate) fn uncordon(&mut self, host: &str) -> bool {
        self.cordoned.remove(host)
    }

    /// An operator's start of `id` that nothing can be released for now waits for memory, as
    /// a start without `--evict` does (`pending_start`), when nothing runs or comes for it.
    /// Whether it waits now (and is to be saved).
    pub(crate) fn wait_for_memory(&mut self, id: &str) -> bool {
        let Some(d) = self.deps.get_mut(id) else {
            return false;
        };
        let idle = !d.busy && d.claim.is_none() && !d.occupies();
        if idle && !d.rec.pending_start {
            d.rec.pending_start = true;
            true
        } else {
            false
        }
    }

    /// Writes what the engines measured at the open (`measured`, by deployment) where it is
    /// still awaited, and brings every deployment of several instances in step (at `now`):
    /// measured by deployment, into its first instance, the others take it from there.
    pub(crate) fn learn_measurements(
        &mut self,
        measured: Vec<(String, Measurement)>,
        now: Instant,
    ) {
        for (id, m) in measured {
            if let Some(d) = self.deps.get_mut(&id)
                && d.measurement.awaiting()
            {
                d.measurement = m;
            }
        }
        // NB: left unknown, each would count a whole GPU in placement until the next deploy
        // (the soak found a GPU over-booked after a restart so, seed 42).
        let replicated: Vec<String> = self.replicated.iter().cloned().collect();
        for dep in replicated {
            self.sync_units(&dep, now);
        }
    }
}
