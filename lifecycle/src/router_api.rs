//! What the router asks of the lifecycle: [`Lifecycle`] implemented by [`Core`].

use std::collections::BTreeSet;
use std::sync::Arc;

use capyctl_interfaces::router::{
    BoxFuture, DeploymentId, DeploymentRef, Executed, InstanceKey, Lifecycle, Plan, PlanFor,
    SwitchOrder,
};
use capyctl_spec::api::{SwitchPhaseKind, VictimResult};
use capyctl_spec::errors::ApiError;
use tokio::time::Instant;

use crate::Core;
use crate::names::{Named, named};
use crate::state::unit_of_key;
use crate::switches::victim_entry;

impl Lifecycle for Core {
    /// Through the name cache: the request path takes no lock of this server's (see
    /// [`NameCache`](crate::names::NameCache)).
    fn resolve(&self, model: &str) -> Option<DeploymentRef> {
        self.names.get(model, || {
            self.read(|inner| {
                named(inner, model).map(|d| Named {
                    deployment: DeploymentRef {
                        id: d.rec.id.clone(),
                        name: d.name().to_string(),
                        routing: d.rec.doc.routing(),
                        priority: d.rec.doc.priority(),
                    },
                    gone: Arc::clone(&d.presence.0),
                })
            })
        })
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
