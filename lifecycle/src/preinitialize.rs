//! The operator's `preinitialize`: an engine started and parked before any request.

use capyctl_spec::api::ActionReceipt;
use capyctl_spec::errors::ApiError;
use tokio::time::Instant;

use crate::Core;
use crate::errors::not_found;
use crate::ids::engine_addr;
use crate::release::{NoRoom, Put};
use crate::state::{Started, Up, UpDone};

impl Core {
    /// Measures the deployment and checks that it can park; when its checkpoint is still
    /// awaiting measurement and the GPU has room, starts it in the background without serving
    /// it (its first answer and footprint are recorded) and parks it (or stops it where it does
    /// not park). A request then wakes it.
    pub(crate) async fn do_preinitialize(&self, key: &str) -> Result<ActionReceipt, ApiError> {
        let id = self.find(key)?;
        self.read(|inner| inner.adapter_command_refusal(&id, "preinitialize"))?;
        self.read(|inner| inner.held_refusal())?;
        let spec = self
            .read(|inner| inner.deps.get(&id).map(|d| d.spec()))
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
                    let why = format!("preinitialize: start ended: {}", ended.refusal.message());
                    let done = UpDone::Ended {
                        why,
                        stopped: ended.stopped.map_err(|e| e.to_string()),
                    };
                    self.on(id, move |inner, id| {
                        inner.up_done(id, Up::Start, done, Instant::now())
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
                // Not `ready`: it never serves before it is parked.
                let done = UpDone::Closed {
                    started: Started {
                        addr: engine_addr(&started.base_url),
                        pid: started.pid,
                        max_running: started.max_running,
                        measurement: started.measurement,
                    },
                    first_answer: started.first_answer,
                };
                self.on(id, move |inner, id| {
                    inner.up_done(id, Up::Start, done, Instant::now())
                })
                .await;
                self.save_logged(id).await;
                // Parked, or stopped when its copy finds no room.
                if let Err(e) = self.put_away(id, Put::Park, NoRoom::Stop).await {
                    tracing::warn!(deployment = %id, error = %e, "preinitialize: parking failed");
                }
            }
            Err(e) => {
                let done = UpDone::Gone(format!("preinitialize: {e}"));
                self.on(id, move |inner, id| {
                    inner.up_done(id, Up::Start, done, Instant::now())
                })
                .await;
                self.announce_gone(key).await;
                self.memory_freed();
            }
        }
    }
}
