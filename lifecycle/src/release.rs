//! Putting an instance away: drained through the router, then parked or stopped; room made in host
//! RAM for a parked copy.

use std::collections::HashMap;

use capyctl_interfaces::agent::ParkResult;
use capyctl_interfaces::router::{DrainReport, IdleRelease};
use capyctl_interfaces::tier::{NoParkReason, ParkTier};
use capyctl_spec::InstanceState;
use capyctl_spec::api::{Released, SwitchError, SwitchPhaseKind, Victim, VictimResult};
use capyctl_spec::errors::ApiError;
use tokio::time::Instant;

use crate::errors::not_found;
use crate::state::{self, Dep, DownDone, Releasing, State, unit_instance, unit_of_key};
use crate::switches::{self, victim_entry};
use crate::{Core, parked_room, views};

/// How the router is asked to release instances the lifecycle puts away itself.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Ask {
    /// Whatever runs drains first (an operator's command, `start --evict`).
    Always,
    /// Only if its coordinator finds the deployment idle, with no use after this instant (the
    /// idle timers): see `Router::release_if_idle`.
    IfIdleSince(Instant),
}

/// What a release does when its copy finds no room in host RAM (only explicit parked copies
/// stand in the way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NoRoom {
    /// Refuse the park (`parked_capacity`); the model serves again (an operator park, the
    /// idle timer).
    Refuse,
    /// Stop it instead (`released: stopped (no room to park)`): a switch's victim, whose
    /// memory a waiting model needs, or an instance the scaler takes away.
    Stop,
}

/// Whether a drained instance parks or stops, and why it stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Put {
    /// It parks (the agent may still stop it where it does not park, or for want of host RAM).
    Park,
    /// It stops: an operator's stop, or a request cut before output.
    Stop,
    /// It stops because the GPU has no room to keep it parked: a victim whose parked residue
    /// would be in the way, or a parked engine stopped for what it holds. Said as
    /// `released: stopped (no room to park)` when it would otherwise park.
    StopNoRoom,
}

impl Put {
    /// How a victim is put away: stopped after a cut before output, stopped for room when
    /// `no_room`, else parked.
    pub(crate) fn victim(cut: bool, no_room: bool) -> Put {
        if cut {
            Put::Stop
        } else if no_room {
            Put::StopNoRoom
        } else {
            Put::Park
        }
    }
}

/// How a drained instance was put away.
#[derive(Debug)]
pub(crate) struct PutAway {
    /// Its own release.
    pub(crate) released: Released,
    /// Parked copies stopped to make room in host RAM for its copy
    /// (`released: stopped (no room to park)`).
    pub(crate) room: Vec<Victim>,
}

/// Whether `unit` holds a parked copy in host RAM on `host` now, for [`Core::make_parked_room`]
/// of `park` (whose own unit is never one of the copies in its way).
fn held_copy(inner: &state::State, host: &str, park: &str, unit: &str) -> parked_room::Held {
    use parked_room::Held;
    let Some(d) = inner.deps.get(unit) else {
        return Held::Never;
    };
    if d.host.as_deref() != Some(host) {
        return Held::Never;
    }
    match d.state {
        InstanceState::Parked if d.tier == Some(ParkTier::HostRam) && unit != park => Held::Copy,
        InstanceState::Parked
        | InstanceState::Stopped
        | InstanceState::Failed
        | InstanceState::AwaitingMeasurement => Held::Never,
        _ => Held::Maybe,
    }
}

impl Core {
    /// Makes room in host RAM for `id`'s parked copy: stops the copies the pure
    /// [`parked_room::parked_room`] names (lower priorities first, then least recently used;
    /// never explicit, warm, busy, reserved or claimed ones, nor those of a higher priority),
    /// or `ParkedCapacity` when only copies never stopped for room stand in the way. Nothing
    /// is done when the copy would not go to host RAM, or does not fit even in empty host RAM
    /// (the agent then parks deep or stops it).
    pub(crate) async fn make_parked_room(&self, id: &str) -> Result<Vec<Victim>, ApiError> {
        let Ok(agent) = self.agent_of(id) else {
            return Ok(Vec::new());
        };
        let inv = agent.inventory().await;
        let planned = Instant::now();
        let plan = self.read(|inner| {
            let d = inner.deps.get(id)?;
            // The host's parked copies, from the index of those that may hold one (this park
            // is noted there first, even when the inventory could not be read).
            let ids = match d.host.as_deref() {
                Some(host) => inner.parked_copies.copies_on(
                    host,
                    id,
                    || inner.on_host(host).map(Dep::id).collect(),
                    |unit| held_copy(inner, host, id, unit),
                ),
                None => Vec::new(),
            };
            let inv = inv.as_ref().ok()?;
            let copy = parked_room::NewCopy {
                bytes: d.measurement.weights_bytes(),
                to_host_ram: parked_room::parks_in_host_ram(&*d.rec.doc, inv.unified_memory()),
                priority: d.rec.doc.priority(),
            };
            let copies: Vec<parked_room::ParkedCopy<'_>> = ids
                .iter()
                .filter_map(|unit| inner.deps.get(unit))
                .map(|o| parked_room::ParkedCopy {
                    id: o.id(),
                    bytes: o.measurement.weights_bytes().unwrap_or(0),
                    used_at: State::used_at(o, &self.uses),
                    priority: o.rec.doc.priority(),
                    kept: inner.explicit(o) || o.warm() || o.busy || o.reserved.is_some(),
                    claimed: o.claim.is_some(),
                })
                .collect();
            Some(parked_room::parked_room(copy, &inv.host_memory, &copies))
        });
        let victims = match plan {
            None | Some(parked_room::ParkedRoom::NothingToStop) => return Ok(Vec::new()),
            Some(parked_room::ParkedRoom::Capacity) => {
                return Err(ApiError::ParkedCapacity {
                    deployment: id.to_string(),
                });
            }
            Some(parked_room::ParkedRoom::Stop(victims)) => victims,
        };
        // Each copy named is stopped only if the router's coordinator, deciding on its own
        // state, finds nobody waiting for it and no use of it since the room was planned (a
        // request that came meanwhile wakes it instead): as an idle timer's stop.
        let mut stopped = Vec::new();
        for v in victims {
            let rid = self.fresh_id("room");
            let r = rid.clone();
            let reserved = self
                .on(&v, move |inner, v| {
                    inner.reserve_parked_copy(v, &r, Instant::now())
                })
                .await;
            let Some(name) = reserved else { continue };
            let idle = match self.router() {
                Some(r) => r.release_if_idle(v.clone(), Vec::new(), planned).await,
                None => IdleRelease::Released(Ok(Vec::new())),
            };
            let result = match idle {
                IdleRelease::Released(Ok(_)) => {
                    tracing::info!(instance = %unit_instance(&v), "stopping a parked copy to make room for a newer one");
                    Some(self.release_drained(&v, Put::StopNoRoom).await)
                }
                IdleRelease::Released(Err(e)) => Some(Err(e)),
                IdleRelease::InUse => None,
            };
            self.write(move |inner| inner.release_reservation(&rid))
                .await;
            match result {
                Some(Ok(released)) => stopped.push(Victim {
                    instance_id: unit_instance(&v),
                    deployment_id: v,
                    name,
                    released,
                }),
                Some(Err(e)) => {
                    tracing::warn!(deployment = %v, error = %e, "stopping a parked copy for room failed");
                }
                None => {
                    tracing::info!(deployment = %v, "a parked copy in use is kept: no room made for a newer one");
                }
            }
        }
        Ok(stopped)
    }

    /// Parks (or stops, per `put` or where it does not park) an instance whose requests have
    /// drained: state `Closed`/`Ready`/`Parked`, reserved by the caller or idle. Says how it
    /// was released, and which parked copies were stopped to make room for its copy;
    /// `ParkedCapacity` leaves it ready (announced again).
    pub(crate) async fn put_away(
        &self,
        id: &str,
        put: Put,
        no_room: NoRoom,
    ) -> Result<PutAway, ApiError> {
        let room = if put == Put::Park {
            self.make_parked_room(id).await
        } else {
            Ok(Vec::new())
        };
        let (room, put) = match room {
            Ok(room) => (room, put),
            Err(ApiError::ParkedCapacity { .. }) if no_room == NoRoom::Stop => {
                (Vec::new(), Put::StopNoRoom)
            }
            Err(e) => {
                self.put_back(id).await;
                return Err(e);
            }
        };
        let released = self.release_drained(id, put).await?;
        Ok(PutAway { released, room })
    }

    /// Serves a drained instance again (a park refused before it began).
    async fn put_back(&self, id: &str) {
        let back = self.on(id, |inner, id| inner.serve_again(id)).await;
        if let Some((key, addr)) = back {
            self.announce_ready(key, addr).await;
        }
    }

    /// The engine half of [`Core::put_away`].
    async fn release_drained(&self, id: &str, put: Put) -> Result<Released, ApiError> {
        let agent = self.agent_of(id)?;
        let stop = put != Put::Park;
        let room = put == Put::StopNoRoom;
        let begun = self
            .on(id, move |inner, id| inner.begin_release(id, stop, room))
            .await;
        let Some(Releasing {
            instance: iid,
            key,
            parked,
            for_room,
            kept,
            name,
            engine,
        }) = begun
        else {
            return Err(not_found(id));
        };
        let began = Instant::now();
        // The park or stop is a phase of the switch it is part of, and this a victim of it.
        let rec = switches::current();
        let phase = if stop || parked {
            SwitchPhaseKind::Stop
        } else {
            SwitchPhaseKind::Park
        };
        let mark = rec
            .as_ref()
            .map(|r| r.begin_phase(phase, &iid, engine, began));
        // Where it parked, when it did (written with the outcome).
        let mut parked_in = None;
        // How the stop of its engine went, when it failed (see [`DownDone::Failed`]).
        let mut stop_failed = None;
        let result = if stop || parked {
            let stopped = match agent.stop(&iid).await {
                // Tried again for an engine that could not be stopped: the agent no longer
                // has it, so it holds nothing.
                Err(capyctl_interfaces::AgentError::UnknownInstance { .. }) if kept => Ok(()),
                other => other,
            };
            if let Err(e) = &stopped {
                stop_failed = Some(e.to_string());
            }
            if for_room && stopped.is_ok() {
                // Stopped where it would have parked: said so in the outcome itself.
                self.config
                    .metrics
                    .park("none", "stopped_no_room_to_park", began.elapsed());
                tracing::info!(instance = %iid, released = Released::StoppedNoRoomToPark.words(), "released: no room to keep it parked");
            }
            stopped.map(|()| {
                if for_room {
                    Released::StoppedNoRoomToPark
                } else {
                    Released::Stopped
                }
            })
        } else {
            match agent.park(&iid).await {
                Ok(ParkResult::Parked { tier, gpu_held }) => {
                    self.config
                        .metrics
                        .park(views::tier_words(tier), "ok", began.elapsed());
                    parked_in = Some((tier, gpu_held.map(|g| g.bytes)));
                    Ok(Released::Parked)
                }
                Ok(ParkResult::Stopped {
                    reason: NoParkReason::NoRoomToPark,
                }) => {
                    self.config
                        .metrics
                        .park("none", "stopped_no_room_to_park", began.elapsed());
                    Ok(Released::StoppedNoRoomToPark)
                }
                Ok(ParkResult::Stopped { .. }) => {
                    self.config.metrics.park("none", "stopped", began.elapsed());
                    Ok(Released::Stopped)
                }
                // A model its engine cannot wake correctly is stopped, never parked.
                Err(e @ capyctl_interfaces::AgentError::CapabilityMissing { .. }) => {
                    tracing::info!(instance = %iid, reason = %e, "stopped instead of parked");
                    self.config
                        .metrics
                        .park("none", "capability_missing", began.elapsed());
                    let stopped = agent.stop(&iid).await;
                    if let Err(e) = &stopped {
                        stop_failed = Some(e.to_string());
                    }
                    stopped.map(|()| Released::Stopped)
                }
                Err(e) => {
                    self.config
                        .metrics
                        .park("unknown", e.metric_label(), began.elapsed());
                    // Its engine is stopped; when that fails too, it may still hold its
                    // memory, which the books count then (see [`State::down_done`]).
                    if let Err(stop) = agent.stop(&iid).await {
                        tracing::warn!(instance = %iid, error = %stop, "the park failed, and stopping its engine failed too");
                        stop_failed = Some(stop.to_string());
                    }
                    Err(e)
                }
            }
        };
        // `Parked` always comes with where it parked (above).
        let done = match (&result, parked_in) {
            (Ok(Released::Parked), Some((tier, gpu_held))) => DownDone::Parked { tier, gpu_held },
            (Ok(r), _) => DownDone::Stopped(*r),
            (Err(e), _) => DownDone::Failed {
                error: e.to_string(),
                stopped: stop_failed.map_or(Ok(()), Err),
            },
        };
        self.on(id, move |inner, id| {
            inner.down_done(id, done, Instant::now())
        })
        .await;
        tracing::info!(instance = %iid, released = ?result.as_ref().map(|r| r.words()), "released");
        if let (Some(rec), Some(mark)) = (rec, mark) {
            rec.end_phase(&mark, Instant::now());
            let (noted, error) = match &result {
                Ok(Released::Parked) => (VictimResult::Parked, None),
                Ok(_) => (VictimResult::Stopped, None),
                Err(e) => (
                    VictimResult::Failed,
                    Some(SwitchError {
                        code: "engine_failed".into(),
                        message: e.to_string(),
                    }),
                ),
            };
            rec.victim(victim_entry(&name, id, stop || parked, noted, error));
        }
        self.announce_gone(key).await;
        self.memory_freed();
        result.map_err(|e| ApiError::EngineFailed {
            deployment: id.to_string(),
            detail: e.to_string(),
        })
    }

    /// Drains ready instances `ids` (reserved by `rid`) through the router: running requests
    /// finish first. `shown` is the state they show meanwhile (`closed`, or `parking` for an
    /// operator park). On a drain timeout they serve again.
    pub(crate) async fn drain(
        &self,
        ids: &[String],
        shown: InstanceState,
    ) -> Result<HashMap<String, DrainReport>, ApiError> {
        self.drain_as(ids, Some(shown), Ask::Always)
            .await
            .map(Option::unwrap_or_default)
    }

    /// [`Core::drain`], asked as `ask` says: `Ok(None)` (and they serve on, as they were)
    /// when the router finds them in use. `shown: None`: a parked deployment, no instance to
    /// drain (the router is still asked, for `Ask::IfIdleSince`: nothing may wait for it).
    /// NB: with `Ask::IfIdleSince` they show `shown` only once the router has released them,
    /// so that a refusal shows nothing.
    pub(crate) async fn drain_as(
        &self,
        ids: &[String],
        shown: Option<InstanceState>,
        ask: Ask,
    ) -> Result<Option<HashMap<String, DrainReport>>, ApiError> {
        let show = |shown: InstanceState| {
            let ids = ids.to_vec();
            self.write(move |inner| inner.show_draining(&ids, shown))
        };
        let keys = match (shown, ask) {
            (None, _) => Vec::new(),
            (Some(shown), Ask::Always) => show(shown).await,
            (Some(_), Ask::IfIdleSince(_)) => self.read(|inner| {
                ids.iter()
                    .filter_map(|id| Some(inner.deps.get(id)?.key(&inner.host_id)))
                    .collect()
            }),
        };
        let Some(router) = self.router() else {
            return Ok(Some(
                ids.iter()
                    .map(|i| (i.clone(), DrainReport::default()))
                    .collect(),
            ));
        };
        // A release's drain is a phase of its record (a switch's drain is the router's, noted
        // from its order).
        let rec = switches::current();
        let mark = rec.as_ref().map(|r| {
            r.begin_phase(
                SwitchPhaseKind::Drain,
                r.instance(),
                r.engine(),
                Instant::now(),
            )
        });
        let answer = match ask {
            Ask::Always => Some(router.release(keys).await),
            Ask::IfIdleSince(since) => {
                let deployment = ids
                    .first()
                    .map(|u| state::dep_of_unit(u).to_string())
                    .unwrap_or_default();
                match router.release_if_idle(deployment, keys, since).await {
                    IdleRelease::InUse => None,
                    IdleRelease::Released(result) => Some(result),
                }
            }
        };
        if let (Some(rec), Some(mark)) = (&rec, &mark) {
            rec.end_phase(mark, Instant::now());
        }
        match answer {
            Some(Ok(reports)) => {
                if let (Some(shown), Ask::IfIdleSince(_)) = (shown, ask) {
                    show(shown).await;
                }
                Ok(Some(
                    reports
                        .into_iter()
                        .map(|(k, r)| (unit_of_key(&k), r))
                        .collect(),
                ))
            }
            answer => {
                if let Some(shown) = shown {
                    let ids = ids.to_vec();
                    self.write(move |inner| inner.drain_refused(&ids, shown))
                        .await;
                }
                answer.transpose().map(|_| None)
            }
        }
    }

    /// Memory was freed: operator starts waiting for memory try again, and the router's
    /// `Later` deployments plan again (it is told through `instance_gone`).
    pub(crate) fn memory_freed(&self) {
        self.spawn(|me| {
            Box::pin(async move {
                let pending: Vec<String> = me.read(|inner| {
                    let mut pending: Vec<(i32, String)> = inner
                        .deps
                        .values()
                        .filter(|d| d.rec.pending_start)
                        .map(|d| (d.rec.doc.priority(), d.id().to_string()))
                        .collect();
                    // The higher priority takes the room first (DESIGN 4.10); else in order.
                    pending.sort_by_key(|(p, _)| std::cmp::Reverse(*p));
                    pending.into_iter().map(|(_, id)| id).collect()
                });
                for id in pending {
                    let up = me
                        .on(&id, |inner, id| inner.start_pending(id, Instant::now()))
                        .await;
                    if let Some(up) = up {
                        let _ = me.finish_up(&id, up).await;
                    }
                }
            })
        });
    }
}
