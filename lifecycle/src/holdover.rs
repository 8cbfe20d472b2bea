//! The operator's leadership rules on the lifecycle's side (see `lifecycle/DESIGN.md`,
//! "Leadership on Kubernetes"): the operator only tells the lifecycle "hold" and "resume"
//! (its leader cannot reach the API server: hold-over) and "fence until T" (it took the Lease
//! over from a leader that did not release it). The rules are [`State`]'s
//! ([`State::hold`], [`State::set_fence`], [`State::command_refusal`], and the gates in
//! `plan`, `admissible`, `holders`, `start`, `preinitialize`, `begin_down`, `idle_due`,
//! `start_pending` and `switch_target_up`); this is how they are asked for, and the router told.

use std::net::SocketAddr;

use capyctl_interfaces::router::{InstanceKey, SwitchOrder};
use capyctl_spec::errors::ApiError;
use tokio::time::Instant;

use crate::Core;

impl Core {
    /// Holds every switch with `refusal` (a 503 `unavailable` naming the cause; see
    /// [`crate::state::State::hold`]): ready instances serve on, nothing is started, woken,
    /// parked or stopped, and the requests waiting for a deployment that is not ready are
    /// refused with it now (a switch planned and not begun is given up; the router plans the
    /// others again).
    pub async fn hold_switches(&self, refusal: ApiError) {
        let held = refusal.clone();
        // The targets of switches planned and not begun: given up now (their victims serve
        // on, their requests get the refusal), not carried out after their window and drain.
        let claimed: Vec<String> = self.write(move |s| s.hold(held)).await;
        if let Some(r) = self.router() {
            for id in claimed {
                r.deployment_refused(id, refusal.clone()).await;
            }
            r.replan().await;
        }
    }

    /// Ends the hold: switching resumes; waiting deployments plan again and operator starts
    /// that wait for memory try again.
    pub async fn resume_switches(&self) {
        self.write(|s| s.resume()).await;
        if let Some(r) = self.router() {
            r.replan().await;
        }
        self.memory_freed();
    }

    /// Whether switches are held now.
    pub fn switches_held(&self) -> bool {
        self.read(|s| s.held.is_some())
    }

    /// Fences the instances ready now until `until` (see
    /// [`crate::state::State::set_fence`]): the names of the deployments fenced. At `until`
    /// the fence ends and the router plans again (a request waiting for a fenced victim's
    /// memory is switched then, not at its deadline).
    pub async fn fence(&self, until: Instant) -> Vec<String> {
        let names = self
            .write(move |s| s.set_fence(until, Instant::now()))
            .await;
        if names.is_empty() {
            return names;
        }
        let me = self.me.clone();
        let mut closed = self.closed.subscribe();
        tokio::spawn(async move {
            tokio::select! {
                () = tokio::time::sleep_until(until) => {}
                _ = closed.wait_for(|c| *c) => return,
            }
            let Some(me) = me.upgrade() else { return };
            if me.write(|s| s.end_fence(Instant::now())).await {
                tracing::info!("the fence on the instances adopted from the previous leader ended");
                if let Some(r) = me.router() {
                    r.replan().await;
                }
                me.memory_freed();
            }
        });
        names
    }

    /// A switch the router drained before switches were held is not carried out while they
    /// are: its reservation is given back and its drained victims (still ready) are announced
    /// again, so that they serve on; the order fails with the hold's refusal.
    pub(crate) async fn refuse_held_order(&self, order: &SwitchOrder) -> Result<(), ApiError> {
        let Some(refusal) = self.read(|s| s.held.clone()) else {
            return Ok(());
        };
        let switch_id = order.switch_id.clone();
        let victims: Vec<InstanceKey> = order.victims.iter().map(|(k, _)| k.clone()).collect();
        let ready: Vec<(InstanceKey, SocketAddr)> = self
            .write(move |s| s.give_back_held_order(&switch_id, victims))
            .await;
        for (key, addr) in ready {
            self.announce_ready(key, addr).await;
        }
        Err(refusal)
    }
}
