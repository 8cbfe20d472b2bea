//! The adapter owner's effects on real engines: the host agent of the instance's host, each
//! load and unload a switch record of cause `adapter` with its phase (`adapter_load`,
//! `adapter_unload`), its times and its outcome (`capyctl switches`, `/ui/`,
//! `capyctl_switch_phase_seconds`).

use std::sync::Weak;

use capyctl_interfaces::BoxFuture;
use capyctl_interfaces::router::{AdapterRoute, InstanceKey};
use capyctl_spec::api::{SwitchCause, SwitchPhaseKind};
use capyctl_spec::errors::ApiError;
use tokio::time::Instant;

use super::Engines;
use crate::Core;
use crate::state::unit_of_key;
use crate::switches::Target;

/// [`Engines`] over the lifecycle's host agents.
pub(crate) struct CoreEngines(pub(crate) Weak<Core>);

/// Why an adapter call could not be made or what the agent answered, as the request's error.
fn failed(adapter: &str, reason: impl std::fmt::Display) -> ApiError {
    ApiError::AdapterLoadFailed {
        adapter: adapter.to_string(),
        reason: reason.to_string(),
    }
}

impl CoreEngines {
    /// The record of a load or unload of `adapter` on `key`, begun now.
    fn record(
        core: &Core,
        key: &InstanceKey,
        adapter: &str,
        adapter_id: String,
    ) -> (crate::switches::Recording, String) {
        let iid = crate::instance_id_at(&key.deployment, key.index);
        let engine = core.read(|inner| {
            inner
                .deps
                .get(&unit_of_key(key))
                .map_or("", |d| d.engine().as_str())
        });
        let target = Target {
            switch_id: core.fresh_id("adapter"),
            deployment: adapter.to_string(),
            deployment_id: adapter_id,
            instance: iid.clone(),
            host_id: key.host_id.clone(),
            gpus: Vec::new(),
            engine,
            wave: 0,
        };
        let rec = core
            .switches
            .begin(target, SwitchCause::Adapter, Instant::now());
        (rec, iid)
    }
}

impl CoreEngines {
    /// A load of `load` (or, `None`, an unload of adapter `name`) on `key` through its host's
    /// agent, in a switch record of its own with its one `phase`.
    async fn recorded(
        &self,
        key: &InstanceKey,
        name: &str,
        load: Option<&AdapterRoute>,
        phase: SwitchPhaseKind,
    ) -> Result<(), ApiError> {
        let core = self
            .0
            .upgrade()
            .ok_or_else(|| failed(name, "CapyCTL is shutting down"))?;
        let agent = core
            .agent_of(&unit_of_key(key))
            .map_err(|e| failed(name, e.message()))?;
        let id = match load {
            Some(adapter) => Some(adapter.id.clone()),
            None => core.read(|inner| inner.by_name(name).map(|d| d.rec.id.clone())),
        };
        let (rec, iid) = Self::record(&core, key, name, id.unwrap_or_default());
        let mark = rec.begin_phase(phase, &iid, rec.engine(), Instant::now());
        let done = match load {
            Some(adapter) => agent.load_adapter(&iid, name, &adapter.path).await,
            None => agent.unload_adapter(&iid, name).await,
        }
        .map_err(|e| failed(name, e));
        let ended = Instant::now();
        rec.end_phase(&mark, ended);
        rec.finish(done.as_ref().map(|_| ()), ended);
        done
    }
}

impl Engines for CoreEngines {
    fn list<'a>(&'a self, key: &'a InstanceKey) -> BoxFuture<'a, Result<Vec<String>, ApiError>> {
        Box::pin(async move {
            let core = self.0.upgrade().ok_or_else(|| failed("-", "closed"))?;
            let agent = core.agent_of(&unit_of_key(key))?;
            let iid = crate::instance_id_at(&key.deployment, key.index);
            agent.adapters(&iid).await.map_err(|e| failed("-", e))
        })
    }

    fn load<'a>(
        &'a self,
        key: &'a InstanceKey,
        adapter: &'a AdapterRoute,
    ) -> BoxFuture<'a, Result<(), ApiError>> {
        Box::pin(self.recorded(
            key,
            &adapter.name,
            Some(adapter),
            SwitchPhaseKind::AdapterLoad,
        ))
    }

    fn unload<'a>(
        &'a self,
        key: &'a InstanceKey,
        name: &'a str,
    ) -> BoxFuture<'a, Result<(), ApiError>> {
        Box::pin(self.recorded(key, name, None, SwitchPhaseKind::AdapterUnload))
    }
}
