//! The operator's `preinitialize`: an engine started and parked before any request.

use capyctl_spec::InstanceState;
use capyctl_spec::api::ActionReceipt;
use capyctl_spec::errors::ApiError;
use tokio::time::Instant;

use crate::Server;
use crate::errors::not_found;
use crate::ids::engine_addr;
use crate::release::{NoRoom, Put};

impl Server {
    /// Measures the deployment and checks that it can park; when its checkpoint is still
    /// awaiting measurement and the GPU has room, starts it in the background without serving
    /// it (its first answer and footprint are recorded) and parks it (or stops it where it does
    /// not park). A request then wakes it.
    pub(crate) async fn do_preinitialize(&self, key: &str) -> Result<ActionReceipt, ApiError> {
        let id = self.find(key)?;
        self.read(|inner| inner.held_refusal())?;
        let spec = self
            .read(|inner| inner.deps.get(&id).map(|d| d.spec.clone()))
            .ok_or_else(|| not_found(&id))?;
        let agent = self.agent_of(&id)?;
        let measured = agent
            .measure(&spec)
            .await
            .map_err(|e| ApiError::EngineFailed {
                deployment: id.clone(),
                detail: e.to_string(),
            })?;
        if let Err(e) = agent.parkability(&spec).await
            && let Some(api) = e.to_api_error(&id)
        {
            return Err(api);
        }
        let begun = self
            .on(&id, move |inner, id| {
                inner.preinitialize(id, measured, Instant::now())
            })
            .await?;
        if begun {
            let target = id.clone();
            self.spawn(move |me| Box::pin(async move { me.preinitialize_run(&target).await }));
        }
        self.receipt("preinitialize", &id)
    }

    /// The background part of a preinitialize: start without announcing, then park or stop.
    async fn preinitialize_run(&self, id: &str) {
        let Some((iid, spec, key)) = self.read(|inner| {
            inner
                .deps
                .get(id)
                .map(|d| (d.instance_id(), d.launch_spec(), d.key(&inner.host_id)))
        }) else {
            return;
        };
        self.save_logged(id).await;
        let started = match self.agent_of(id) {
            Ok(agent) => match self
                .unless_ended(id, agent.as_ref(), &iid, agent.start(&iid, &spec))
                .await
            {
                Ok(started) => started.map_err(|e| e.to_string()),
                Err(ended) => {
                    let (stopped, why) = (ended.stopped.is_ok(), ended.refusal.message());
                    self.on(id, move |inner, id| {
                        if let Some(d) = inner.deps.get_mut(id) {
                            d.busy = false;
                            let why = format!("preinitialize: start ended: {why}");
                            if stopped {
                                d.state = InstanceState::Stopped;
                                d.last_error = Some(why);
                            } else {
                                d.fail(why);
                            }
                        }
                    })
                    .await;
                    self.announce_gone(key).await;
                    self.memory_freed();
                    return;
                }
            },
            Err(e) => Err(e.message()),
        };
        match started {
            Ok(started) => {
                self.on(id, move |inner, id| {
                    if let Some(d) = inner.deps.get_mut(id) {
                        d.addr = engine_addr(&started.base_url);
                        d.pid = Some(started.pid);
                        d.max_running = Some(started.max_running);
                        if !started.measurement.awaiting() {
                            d.measurement = started.measurement;
                        }
                        d.rec.first_answer = Some(started.first_answer.clone());
                        // Not `ready`: it never serves before it is parked.
                        d.state = InstanceState::Closed;
                    }
                })
                .await;
                self.save_logged(id).await;
                // Parked, or stopped when its copy finds no room.
                if let Err(e) = self.put_away(id, Put::Park, NoRoom::Stop).await {
                    tracing::warn!(deployment = %id, error = %e, "preinitialize: parking failed");
                }
            }
            Err(e) => {
                self.on(id, move |inner, id| {
                    if let Some(d) = inner.deps.get_mut(id) {
                        d.busy = false;
                        d.fail(format!("preinitialize: {e}"));
                    }
                })
                .await;
                self.announce_gone(key).await;
                self.memory_freed();
            }
        }
    }
}
