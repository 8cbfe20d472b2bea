//! Bringing an instance up (start or wake) and writing the outcome; ending a bring-up no longer
//! wanted.

use std::time::Duration;

use capyctl_interfaces::HostAgent;
use capyctl_spec::api::{SwitchCause, SwitchPhaseKind};
use capyctl_spec::errors::ApiError;
use tokio::time::Instant;
use tracing::Instrument;

use crate::errors::not_found;
use crate::gpus::gpus_of;
use crate::ids::engine_addr;
use crate::state::{self, Up, UpDone};
use crate::{Core, switches, views};

/// How often an ended start or wake is asked to stop again until it has ended (see
/// [`Core::unless_ended`]).
pub(crate) const STOP_AGAIN: Duration = Duration::from_millis(500);

/// How a start or a wake in progress was ended ([`Core::end_bring_up`]).
#[derive(Debug)]
pub(crate) struct Ended {
    /// What its waiting requests and its caller get.
    pub(crate) refusal: ApiError,
    /// The agent's stop of its engine.
    pub(crate) stopped: Result<(), capyctl_interfaces::AgentError>,
}

impl Core {
    /// Runs the start or wake begun by [`State::begin_up`]; announces the instance when ready.
    /// Its phases go to the record of the switch it is part of; outside every switch (an
    /// operator's start, a pending start taken) it is a `bring_up` record of its own.
    pub(crate) async fn finish_up(&self, id: &str, up: Up) -> Result<(), ApiError> {
        let name = self
            .read(|inner| inner.deps.get(id).map(|d| d.name().to_string()))
            .unwrap_or_default();
        let span = tracing::info_span!("bring_up", deployment = %name, how = ?up);
        if switches::current().is_some() {
            return self.finish_up_inner(id, up).instrument(span).await;
        }
        let switch_id = self.fresh_id("up");
        let rec = self.switches.begin(
            self.target_of(id, &switch_id, 0),
            SwitchCause::BringUp,
            Instant::now(),
        );
        let result = rec
            .scope(self.finish_up_inner(id, up).instrument(span))
            .await;
        rec.finish(result.as_ref().map(|_| ()), Instant::now());
        result
    }

    async fn finish_up_inner(&self, id: &str, up: Up) -> Result<(), ApiError> {
        let Some((iid, spec)) = self.read(|inner| {
            inner
                .deps
                .get(id)
                .map(|d| (d.instance_id(), d.launch_spec()))
        }) else {
            return Err(not_found(id));
        };
        let agent = match self.agent_of(id) {
            Ok(a) => a,
            Err(e) => {
                let done = UpDone::Gone(e.message());
                self.on(id, move |inner, id| {
                    inner.up_done(id, up, done, Instant::now())
                })
                .await;
                return Err(e);
            }
        };
        if up == Up::Start {
            // The generation is part of the record.
            self.save_logged(id).await;
        }
        let began = Instant::now();
        let (woken_from, host) = self.read(|inner| {
            inner
                .deps
                .get(id)
                .map(|d| {
                    let host = d.host.as_deref().map(str::to_string);
                    (d.tier, host.map(|h| (h, gpus_of(inner, d))))
                })
                .unzip()
        });
        let rec = switches::current();
        let engine = spec.engine.as_str();
        let mark = rec.as_ref().map(|r| {
            if let Some((host, gpus)) = host.flatten() {
                r.placed(&host, gpus);
            }
            let phase = match up {
                Up::Start => SwitchPhaseKind::Start,
                Up::Wake => SwitchPhaseKind::Wake,
            };
            r.begin_phase(phase, &iid, engine, began)
        });
        let woken_from = woken_from.flatten();
        // How long the wake's check took (the end of the wake), as the agent says.
        let mut checked = None;
        let bring_up = async {
            match up {
                Up::Start => match agent.start(&iid, &spec).await {
                    Ok(s) if engine_addr(&s.base_url).is_none() => {
                        // Requests could never reach it: a failed start, not a ready instance.
                        let _ = agent.stop(&iid).await;
                        Err(ApiError::EngineFailed {
                            deployment: id.to_string(),
                            detail: format!(
                                "the engine answers at {}, which is not an IP address and port",
                                s.base_url
                            ),
                        })
                    }
                    Ok(s) => Ok(Some(s)),
                    Err(e) => Err(ApiError::EngineFailed {
                        deployment: id.to_string(),
                        detail: e.to_string(),
                    }),
                },
                Up::Wake => match self.wake(&agent, &iid).await {
                    Ok(report) => {
                        checked = report.checked;
                        match report.into_result() {
                            Ok(()) => Ok(None),
                            Err(e) => Err(e.to_api_error(id).unwrap_or(ApiError::EngineFailed {
                                deployment: id.to_string(),
                                detail: e.to_string(),
                            })),
                        }
                    }
                    Err(e) => {
                        let _ = agent.stop(&iid).await;
                        Err(ApiError::EngineFailed {
                            deployment: id.to_string(),
                            detail: e.to_string(),
                        })
                    }
                },
            }
        };
        let (outcome, ended): (
            Result<Option<capyctl_interfaces::agent::StartedInstance>, ApiError>,
            _,
        ) = match self.unless_ended(id, agent.as_ref(), &iid, bring_up).await {
            Ok(outcome) => (outcome, None),
            Err(ended) => (Err(ended.refusal.clone()), Some(ended)),
        };
        let up_ended = Instant::now();
        if let (Some(rec), Some(mark)) = (&rec, &mark) {
            let check_began = checked
                .and_then(|c| up_ended.checked_sub(c))
                .map(|c| c.max(began));
            rec.end_phase(mark, check_began.unwrap_or(up_ended));
            if let Some(check_began) = check_began {
                rec.phase(
                    SwitchPhaseKind::WakeCheck,
                    &iid,
                    engine,
                    check_began,
                    up_ended,
                );
            }
        }
        if up == Up::Wake {
            let code = match &outcome {
                Ok(_) => "ok",
                Err(e) => e.code(),
            };
            self.config.metrics.wake(
                woken_from.map_or("unknown", views::tier_words),
                code,
                began.elapsed(),
            );
        }
        // A started engine's address (a woken one keeps the one it had).
        let started_addr = match &outcome {
            Ok(Some(s)) => Some(engine_addr(&s.base_url)),
            _ => None,
        };
        // A start's first answer is committed before the router hears of the instance: once
        // a request was served by it, the record has it (the commit runs off the runtime, so
        // anything after the announce may come after the request's answer).
        if let Ok(Some(started)) = &outcome {
            let (target, first) = (id.to_string(), started.first_answer.clone());
            self.write(move |inner| inner.answered_first(&target, first))
                .await;
            self.save_logged(id).await;
        }
        // The router hears of a ready instance before anyone can see it ready (status, `start
        // --wait`): a client that saw `ready` and asks at once finds the router routing to it.
        let announced = match &outcome {
            Ok(_) => {
                let at = self.read(|inner| {
                    let d = inner.deps.get(id)?;
                    Some((d.key(&inner.host_id), started_addr.unwrap_or(d.addr)?))
                });
                match at {
                    Some((key, addr)) => {
                        self.announce_ready(key.clone(), addr).await;
                        // The router opened it and released its waiters.
                        if let Some(rec) = &rec {
                            rec.phase(
                                SwitchPhaseKind::Release,
                                &iid,
                                engine,
                                up_ended,
                                Instant::now(),
                            );
                        }
                        Some(key)
                    }
                    None => None,
                }
            }
            Err(_) => None,
        };
        let done = match &outcome {
            Ok(started) => state::UpDone::Ready(started.as_ref().map(|s| state::Started {
                addr: started_addr.flatten(),
                pid: s.pid,
                max_running: s.max_running,
                measurement: s.measurement,
            })),
            Err(e) => state::UpDone::Failed {
                error: e.clone(),
                ended: ended
                    .as_ref()
                    .map(|ended| ended.stopped.as_ref().map_err(ToString::to_string).copied()),
            },
        };
        let target = id.to_string();
        let ready = self
            .write(move |inner| inner.up_done(&target, up, done, Instant::now()))
            .await;
        // A start's generation was saved as it began, its first answer before the announce; a
        // pending start taken is saved whatever came of it.
        if self.read(|inner| inner.dirty.has(id)) {
            self.save_logged(id).await;
        }
        match ready {
            Some(Ok((key, Some(addr)))) => {
                if announced.as_ref() != Some(&key) {
                    self.announce_ready(key, addr).await;
                }
                // Its deployment's other replicas follow, as room allows.
                self.scale_soon();
            }
            Some(Ok((_, None))) => {}
            Some(Err(key)) => {
                tracing::warn!(error = ?outcome.as_ref().err(), "bringing the instance up failed");
                self.announce_gone(key).await;
                self.memory_freed();
            }
            // Gone meanwhile (deleted): the router forgets what it was told.
            None => {
                if let Some(key) = announced {
                    self.announce_gone(key).await;
                }
            }
        }
        outcome.map(|_| ())
    }

    /// Runs `op`, the start or the wake of `id` (instance `iid` on `agent`) that
    /// [`State::begin_up`] began, unless it is ended meanwhile ([`Core::end_bring_up`]):
    /// then the agent is asked to stop the engine, which ends `op` (the agent answers it
    /// `cancelled`), and both are awaited: when this answers, the engine is gone. Ended before
    /// it began, `op` is never run (and the engine of a wake, parked, is stopped).
    pub(crate) async fn unless_ended<T>(
        &self,
        id: &str,
        agent: &dyn HostAgent,
        iid: &str,
        op: impl std::future::Future<Output = T>,
    ) -> Result<T, Ended> {
        let Some(mut end) = self.read(|inner| inner.deps.get(id).map(|d| d.end().subscribe()))
        else {
            return Ok(op.await);
        };
        let asked_before = end.borrow().clone();
        let refusal = match asked_before {
            // Ended before it began: it never runs (a parked engine is stopped below).
            Some(refusal) => refusal,
            None => {
                let asked = async {
                    end.wait_for(Option::is_some)
                        .await
                        .ok()
                        .and_then(|w| w.clone())
                };
                tokio::pin!(op);
                let refusal = tokio::select! {
                    out = &mut op => return Ok(out),
                    Some(refusal) = asked => refusal,
                };
                tracing::info!(instance = %iid, reason = %refusal.message(), "ending the start or wake in progress: stopping its engine");
                // The agent's stop ends the operation and waits for it, so both run together.
                // A call still on its way to a node agent when the stop arrives is not ended by
                // it: the stop is asked again until the operation has ended.
                let stops = async {
                    loop {
                        let _ = agent.stop(iid).await;
                        tokio::time::sleep(STOP_AGAIN).await;
                    }
                };
                tokio::select! {
                    _ = &mut op => {}
                    () = stops => {}
                }
                refusal
            }
        };
        // Once more, for an engine a start finished just before the stop could end it, or the
        // parked engine of a wake ended before it began.
        let stopped = match agent.stop(iid).await {
            Err(capyctl_interfaces::AgentError::UnknownInstance { .. }) => Ok(()),
            other => other,
        };
        if let Err(e) = &stopped {
            tracing::warn!(instance = %iid, error = %e, "stopping the engine of an ended start or wake failed");
        }
        Err(Ended { refusal, stopped })
    }

    /// Ends the start or wake of `id` in progress, if any: its requests and its caller get
    /// `refusal`, its engine is stopped. Waits until no operation is in progress on `id`
    /// (whatever it was); `false` when `id` is gone.
    pub(crate) async fn end_bring_up(&self, id: &str, refusal: &ApiError) -> bool {
        let mut rx = self.changes.subscribe();
        loop {
            let busy = self.read(|inner| {
                let d = inner.deps.get(id)?;
                if d.bringing_up() && d.end().borrow().is_none() {
                    d.end().send_replace(Some(refusal.clone()));
                }
                Some(d.busy)
            });
            match busy {
                None => return false,
                Some(false) => return true,
                Some(true) => {}
            }
            if rx.changed().await.is_err() {
                return false;
            }
        }
    }
}
