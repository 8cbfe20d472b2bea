//! What the router asks of the lifecycle: [`Lifecycle`] implemented by [`Core`].

use std::collections::BTreeSet;
use std::sync::Arc;

use capyctl_interfaces::router::{
    AdapterLease, AdapterRoute, BoxFuture, DeploymentId, DeploymentRef, Executed, InstanceKey,
    Lifecycle, Plan, PlanFor, SwitchOrder,
};
use capyctl_spec::api::{SwitchPhaseKind, VictimResult};
use capyctl_spec::errors::ApiError;
use tokio::time::Instant;

use crate::Core;
use crate::adapters::Retired;
use crate::names::{Named, named};
use crate::state::unit_of_key;
use crate::switches::victim_entry;

impl Lifecycle for Core {
    /// Through the name cache: the request path takes no lock of this server's (see
    /// [`NameCache`](crate::names::NameCache)).
    fn resolve(&self, model: &str) -> Option<DeploymentRef> {
        self.names.get(model, || {
            self.read(|inner| {
                named(inner, model).and_then(|d| {
                    // An adapter's requests make its base servable (DESIGN 4.9); the name
                    // stays cached while the adapter exists (its base cannot go before it).
                    let served = match d.rec.doc.base() {
                        Some(_) => inner.base_of(d)?,
                        None => d,
                    };
                    Some(Named {
                        deployment: DeploymentRef {
                            id: served.rec.id.clone(),
                            name: served.name().to_string(),
                            routing: served.rec.doc.routing(),
                            priority: served.rec.doc.priority(),
                        },
                        gone: Arc::clone(&d.presence.0),
                    })
                })
            })
        })
    }

    fn adapter(&self, model: &str) -> Option<AdapterRoute> {
        self.read(|inner| inner.adapter_route(model))
    }

    fn acquire_adapter<'a>(
        &'a self,
        instance: &'a InstanceKey,
        adapter: &'a AdapterRoute,
        deadline: Instant,
    ) -> BoxFuture<'a, Result<AdapterLease, ApiError>> {
        let limit = usize::try_from(self.config.waiting_limit).unwrap_or(usize::MAX);
        Box::pin(async move {
            // Deleted since the request resolved its name (it waited for its base): the
            // page's 404, before a load and after one.
            if matches!(
                self.adapter_now(adapter),
                AdapterNow::Gone | AdapterNow::Replaced
            ) {
                return Err(not_an_adapter(adapter));
            }
            let lease = self
                .adapters
                .acquire(instance, adapter, deadline, limit)
                .await?;
            match self.adapter_now(adapter) {
                AdapterNow::Same => Ok(lease),
                // Loaded from the files it had: this request runs on them, the next loads
                // the new ones.
                AdapterNow::Revised => {
                    self.adapters.retire(&adapter.name, Retired::Revised);
                    Ok(lease)
                }
                // What it loaded goes (another adapter of its name loads its own files).
                gone => {
                    drop(lease);
                    let why = match gone {
                        AdapterNow::Replaced => Retired::Revised,
                        _ => Retired::Deleted,
                    };
                    self.adapters.retire(&adapter.name, why);
                    Err(not_an_adapter(adapter))
                }
            }
        })
    }

    fn adapter_loaded_on(&self, adapter: &str) -> Vec<InstanceKey> {
        self.adapters.holding(adapter)
    }

    fn adapter_lost(&self, instance: &InstanceKey, adapter: &str) {
        self.adapters.lost(instance, adapter);
    }

    fn admissible(&self, deployment: &DeploymentId) -> Result<(), ApiError> {
        self.read(|inner| inner.admissible(deployment))
    }

    fn plan<'a>(
        &'a self,
        deployment: &'a DeploymentId,
        protected: &'a BTreeSet<DeploymentId>,
        who: PlanFor,
    ) -> BoxFuture<'a, Result<Plan, ApiError>> {
        Box::pin(self.plan_now(deployment, protected, who))
    }

    fn execute(&self, order: SwitchOrder) -> BoxFuture<'_, Result<Executed, ApiError>> {
        Box::pin(self.execute_order(order))
    }

    fn abandon(&self, switch_id: &str) {
        // A plan given back before it ran (not one that failed: its record has ended): its
        // victims serve on.
        if let Some(p) = self.planned_of().remove(switch_id) {
            for (id, name) in &p.victims {
                p.rec
                    .victim(victim_entry(name, id, false, VictimResult::Kept, None));
            }
            p.rec.abandon(Instant::now());
        }
        let switch_id = switch_id.to_string();
        self.owner
            .tell(move |inner| inner.release_reservation(&switch_id));
    }

    fn switch_draining(&self, switch_id: &str) {
        let now = Instant::now();
        if let Some(p) = self.planned_of().get_mut(switch_id) {
            if let Some(window) = p.open.take() {
                p.rec.end_phase(&window, now);
            }
            p.open = Some(
                p.rec
                    .begin_live_phase(SwitchPhaseKind::Drain, p.rec.engine(), now),
            );
        }
    }

    fn switch_failed(&self, failed: &SwitchOrder, error: &ApiError) {
        tracing::warn!(switch_id = %failed.switch_id, %error, "switch failed in the router");
        let rec = self.record_order(failed);
        // Its victims serve again.
        self.read(|inner| {
            for (k, _) in &failed.victims {
                let unit = unit_of_key(k);
                let name = inner
                    .deps
                    .get(&unit)
                    .map_or(k.deployment.as_str(), |d| d.name());
                rec.victim(victim_entry(name, &unit, false, VictimResult::Kept, None));
            }
        });
        rec.finish(Err(error), failed.began + failed.window + failed.drain);
    }

    fn engine_idle<'a>(&'a self, instance: &'a InstanceKey) -> BoxFuture<'a, bool> {
        Box::pin(self.idle_engine(instance))
    }
}

/// What became of the adapter a request resolved, by the time it runs.
#[derive(Debug, PartialEq, Eq)]
enum AdapterNow {
    /// The same adapter, the same files.
    Same,
    /// The same adapter with new files (a new revision).
    Revised,
    /// Deleted, and another adapter of that name deployed since.
    Replaced,
    /// Deleted.
    Gone,
}

impl Core {
    fn adapter_now(&self, adapter: &AdapterRoute) -> AdapterNow {
        self.read(|inner| match inner.adapter_route(&adapter.name) {
            Some(now) if now.id == adapter.id && now.path == adapter.path => AdapterNow::Same,
            Some(now) if now.id == adapter.id => AdapterNow::Revised,
            Some(_) => AdapterNow::Replaced,
            None => AdapterNow::Gone,
        })
    }
}

/// The page's 404 for an adapter deleted while its request waited.
fn not_an_adapter(adapter: &AdapterRoute) -> ApiError {
    ApiError::ModelNotFound {
        model: adapter.name.clone(),
    }
}
