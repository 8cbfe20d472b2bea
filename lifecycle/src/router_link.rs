//! The router attached to the server (the assembly builds it: `capyctl_server::assembly`),
//! readiness, close, the catalog of models, and what the router is told of instances coming and
//! going.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use capyctl_interfaces::router::{InstanceKey, ModelEntry, Router, Upstream};
use capyctl_spec::InstanceState;
use capyctl_spec::api::DeploymentView;
use tokio::time::Instant;

use crate::{Core, views, writer};

impl Core {
    /// Attaches the router (built by the assembly, `capyctl_server::assembly::assemble`, over
    /// this server): announces the ready instances (adopted ones) and starts the background
    /// work (idle timers, engine exits).
    pub async fn attach_router(&self, router: Arc<dyn Router>) {
        *self.router.lock().unwrap_or_else(PoisonError::into_inner) = Some(router.clone());
        self.uses.attach(router.last_uses());
        let ready: Vec<(InstanceKey, SocketAddr)> = self.read(|inner| {
            inner
                .deps
                .values()
                .filter(|d| d.state == InstanceState::Ready)
                .filter_map(|d| Some((d.key(&inner.host_id), d.addr?)))
                .collect()
        });
        for (key, addr) in ready {
            router.instance_ready(Upstream { key, addr }).await;
        }
        // Operator starts that waited for memory when the previous run ended wait again.
        if self.read(|inner| inner.deps.values().any(|d| d.rec.pending_start)) {
            self.memory_freed();
        }
    }

    /// Holds `/readyz` at not ready (`false`), or lets it answer ready again (`true`): standalone
    /// holds it while it deploys its document's deployments. ([`Core::open`] leaves it ready.)
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    /// Stops the background work and lets go of the router (engines are left as they are;
    /// stop them through the host agent for a clean shutdown); writes what is not written yet
    /// (a batch of deploys cut short) and closes the store: nothing is written after it.
    pub fn close(&self) {
        if self.read(|inner| inner.dirty.any()) {
            // On the caller's thread: the last commit, after any still running.
            let _order = self.persist.lock().unwrap_or_else(PoisonError::into_inner);
            let saved = writer::commit(self.store.as_ref(), &self.owner.shared());
            self.log_failed(saved.map_err(|e| self.save_failed(&e)));
        }
        // The switch records changed so far are on disk (a switch still running is read back
        // as interrupted).
        self.switches.flush();
        self.store.close();
        self.closed.send_replace(true);
        self.ready.store(false, Ordering::SeqCst);
        self.router
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
    }

    /// The deployments for `GET /v1/models`.
    pub fn models(&self) -> Vec<ModelEntry> {
        let (shots, _) = self.shots();
        let loaded = self.adapters.loaded_on();
        let mut models: Vec<ModelEntry> = shots
            .iter()
            .map(|d| ModelEntry {
                id: d[0].name().to_string(),
                deployment_id: d[0].id().to_string(),
                // An adapter (DESIGN 4.9): whether an instance of its base has it loaded.
                state: match &d[0].fixed.doc.adapter {
                    Some(_) => capyctl_spec::api::adapter_state(
                        loaded
                            .iter()
                            .any(|(_, names)| names.iter().any(|n| n == d[0].name())),
                    )
                    .to_string(),
                    None => views::deployment_state(d).to_string(),
                },
            })
            .collect();
        // By name (IDs made in the same millisecond are in no particular order).
        models.sort_by(|a, b| a.id.cmp(&b.id));
        models
    }

    /// Waits until deployment `name_or_id` is in one of `states`, for at most `within`; its
    /// view then, or the last view with `Err` when the time ran out.
    pub async fn wait_for_state(
        &self,
        name_or_id: &str,
        states: &[InstanceState],
        within: Duration,
    ) -> Result<DeploymentView, Option<DeploymentView>> {
        let mut rx = self.changes.subscribe();
        let deadline = Instant::now() + within;
        loop {
            let view = self.view(name_or_id);
            if let Some(v) = view.clone()
                && states.contains(&v.state)
            {
                return Ok(v);
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                _ => return Err(view),
            }
        }
    }

    /// The error of the adapter requests that waited on an instance that went away.
    fn instance_closed(key: &InstanceKey) -> capyctl_spec::errors::ApiError {
        capyctl_spec::errors::ApiError::DispatchClosed {
            deployment: key.deployment.clone(),
        }
    }

    pub(crate) fn router(&self) -> Option<Arc<dyn Router>> {
        self.router
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub(crate) async fn announce_ready(&self, key: InstanceKey, addr: SocketAddr) {
        // Started, woken or adopted: its adapters are what its engine lists.
        self.adapters.reset(&key, &Self::instance_closed(&key));
        if let Some(r) = self.router() {
            r.instance_ready(Upstream { key, addr }).await;
        }
    }

    pub(crate) async fn announce_gone(&self, key: InstanceKey) {
        self.adapters.reset(&key, &Self::instance_closed(&key));
        if let Some(r) = self.router() {
            r.instance_gone(key).await;
        }
    }
}
