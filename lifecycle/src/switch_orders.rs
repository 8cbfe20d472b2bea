//! The router's switches: plans, the switch orders it hands back to execute (victims released, the
//! target brought up), their records.

use std::collections::{BTreeSet, HashMap};
use std::sync::{MutexGuard, PoisonError};
use std::time::Duration;

use capyctl_interfaces::router::{Executed, InstanceKey, Plan, PlanFor, SwitchOrder};
use capyctl_spec::InstanceState;
use capyctl_spec::api::{
    Released, SwitchCause, SwitchError, SwitchPhaseKind, Victim, VictimResult,
};
use capyctl_spec::errors::ApiError;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::gpus::gpus_of;
use crate::ids::instance_id_at;
use crate::release::{NoRoom, Put};
use crate::start::evict_failed;
use crate::state::{Dep, Up, dep_of_unit, unit_instance, unit_of_key};
use crate::switches::{self, Recording, Target, victim_entry};
use crate::{Core, views};

/// The longest [`Core::idle_engine`] waits: the drain bound's maximum (600 s).
pub(crate) const IDLE_ENGINE_BOUND: Duration = Duration::from_secs(600);

/// The record of a switch the router planned, while its window and drain run.
pub(crate) struct Planned {
    pub(crate) rec: Recording,
    /// Its window's or drain's phase, as seen live.
    pub(crate) open: Option<switches::PhaseMark>,
    /// Its victims (ID, name): `kept` if it is given back.
    pub(crate) victims: Vec<(String, String)>,
}

impl Core {
    /// Plans bringing `target` up for `who` (see [`State::plan`]).
    pub(crate) async fn plan_now(
        &self,
        target: &str,
        protected: &BTreeSet<String>,
        who: PlanFor,
    ) -> Result<Plan, ApiError> {
        let switch_id = self.fresh_id("sw");
        let (id, protected, uses) = (target.to_string(), protected.clone(), self.uses.clone());
        let plan = self
            .write(move |inner| inner.plan(&id, &protected, who, switch_id, &uses, Instant::now()))
            .await;
        if let Ok(Plan::BringUp { switch_id } | Plan::Switch { switch_id, .. }) = &plan {
            self.record_plan(target, switch_id, who, &plan);
        }
        plan
    }

    /// Begins the record of a switch the router planned, shown while it runs: a request's
    /// window begins now (an operator's switch has none: its drain begins when the router
    /// says, [`Lifecycle::switch_draining`]). [`Core::record_order`] gives it the router's
    /// exact times.
    fn record_plan(
        &self,
        target: &str,
        switch_id: &str,
        who: PlanFor,
        plan: &Result<Plan, ApiError>,
    ) {
        let now = Instant::now();
        let victims: Vec<(String, String)> = match plan {
            Ok(Plan::Switch { victims, .. }) => self.read(|inner| {
                victims
                    .iter()
                    .map(|k| {
                        let unit = unit_of_key(k);
                        let name = inner
                            .deps
                            .get(&unit)
                            .map_or(k.deployment.as_str(), |d| d.name())
                            .to_string();
                        (unit, name)
                    })
                    .collect()
            }),
            _ => Vec::new(),
        };
        let cause = match (victims.is_empty(), who) {
            (true, _) => SwitchCause::BringUp,
            (false, PlanFor::Operator) => SwitchCause::Operator,
            (false, PlanFor::Requests) => SwitchCause::Wave,
        };
        let rec = self
            .switches
            .begin(self.target_of(target, switch_id, 0), cause, now);
        let open = (cause == SwitchCause::Wave)
            .then(|| rec.begin_live_phase(SwitchPhaseKind::AdmissionWindow, rec.engine(), now));
        self.planned_of()
            .insert(switch_id.to_string(), Planned { rec, open, victims });
    }

    pub(crate) fn planned_of(&self) -> MutexGuard<'_, HashMap<String, Planned>> {
        self.planned.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Carries out a switch's order (see [`Lifecycle::execute`]): releases the victims, then
    /// brings the target up. An operator's order answers once the bring-up has begun; the
    /// bring-up goes on in a task of its own, whose outcome [`Executed::bring_up`] carries (a
    /// failure also fails the requests waiting for the target). The switch's record (begun
    /// here, with the router's window and drain) ends once the bring-up has ended.
    pub(crate) async fn execute_order(&self, mut order: SwitchOrder) -> Result<Executed, ApiError> {
        // Held (the operator's hold-over): no switch is carried out.
        self.refuse_held_order(&order).await?;
        // The instance the plan chose (its reservation's target); the router names the
        // deployment.
        if let Some(unit) = self.read(|inner| {
            inner
                .reservations
                .get(&order.switch_id)
                .and_then(|r| r.target.clone())
        }) {
            order.target = unit;
        }
        let rec = self.record_order(&order);
        let released = rec.scope(self.execute_inner(&order)).await;
        let (released, up) = match released {
            Ok(r) => r,
            Err(e) => {
                rec.finish(Err(&e), Instant::now());
                return Err(e);
            }
        };
        let Some(up) = up else {
            // The target is up or on its way already.
            rec.finish(Ok(()), Instant::now());
            return Ok(Executed {
                released,
                bring_up: None,
            });
        };
        if !order.operator {
            let result = rec.scope(self.finish_up(&order.target, up)).await;
            rec.finish(result.as_ref().map(|_| ()), Instant::now());
            return result.map(|()| Executed {
                released,
                bring_up: None,
            });
        }
        let (tx, rx) = oneshot::channel();
        let target = order.target.clone();
        self.spawn(move |me| {
            Box::pin(async move {
                let result = rec.scope(me.finish_up(&target, up)).await;
                rec.finish(result.as_ref().map(|_| ()), Instant::now());
                if let Err(e) = &result
                    && let Some(r) = me.router()
                {
                    r.deployment_refused(target, e.clone()).await;
                }
                let _ = tx.send(result);
            })
        });
        Ok(Executed {
            released,
            bring_up: Some(rx),
        })
    }

    /// What a switch's record says of its target `id` (`switch_id`, `wave`).
    pub(crate) fn target_of(&self, id: &str, switch_id: &str, wave: usize) -> Target {
        self.read(|inner| {
            let d = inner.deps.get(id);
            Target {
                switch_id: switch_id.to_string(),
                deployment: d.map_or_else(|| id.to_string(), |d| d.name().to_string()),
                deployment_id: id.to_string(),
                instance: unit_instance(id),
                host_id: d
                    .and_then(|d| d.host.as_deref())
                    .map(str::to_string)
                    .unwrap_or_default(),
                gpus: d.map(|d| gpus_of(inner, d)).unwrap_or_default(),
                engine: d.map_or("unknown", |d| d.engine().as_str()),
                wave: u64::try_from(wave).unwrap_or(u64::MAX),
            }
        })
    }

    /// Begins the record of a switch the router ordered (or failed: `switch_failed`): `wave`
    /// or `operator` when it releases victims, else `bring_up`; its admission window (none for
    /// an operator's) and its drain, as the router timed them, when it has victims.
    pub(crate) fn record_order(&self, order: &SwitchOrder) -> Recording {
        let reserved = self.read(|inner| {
            inner
                .reservations
                .get(&order.switch_id)
                .is_some_and(|r| !r.victims.is_empty())
        });
        let victims = reserved || !order.victims.is_empty();
        let cause = match (victims, order.operator) {
            (false, _) => SwitchCause::BringUp,
            (true, true) => SwitchCause::Operator,
            (true, false) => SwitchCause::Wave,
        };
        let wave = u64::try_from(order.wave).unwrap_or(u64::MAX);
        let planned = self.planned_of().remove(&order.switch_id);
        let rec = match planned {
            Some(p) => {
                p.rec.rebase(order.began, wave);
                p.rec
            }
            None => {
                let target = self.target_of(&order.target, &order.switch_id, order.wave);
                self.switches.begin(target, cause, order.began)
            }
        };
        if victims {
            let (instance, engine) = (rec.instance().to_string(), rec.engine());
            let closed = order.began + order.window;
            if !order.operator {
                rec.phase(
                    SwitchPhaseKind::AdmissionWindow,
                    &instance,
                    engine,
                    order.began,
                    closed,
                );
            }
            rec.phase(
                SwitchPhaseKind::Drain,
                &instance,
                engine,
                closed,
                closed + order.drain,
            );
        }
        rec
    }

    /// [`Core::take_down`] of `id` (reserved by `rid`) for `cause`, recorded as a switch of
    /// its own ([`Core::release_recorded`]).
    pub(crate) async fn take_down_recorded(
        &self,
        cause: SwitchCause,
        id: &str,
        rid: &str,
        down: Option<bool>,
        stop: bool,
    ) -> Result<Option<Released>, ApiError> {
        // The scaler's park is its own choice (one instance fewer): with no room to park, the
        // instance stops instead of serving on (and being drained again at the next delay).
        let no_room = if cause == SwitchCause::Scale {
            NoRoom::Stop
        } else {
            NoRoom::Refuse
        };
        let work = self.take_down(id, rid, down, stop, no_room);
        self.release_recorded(cause, id, rid, down, work).await
    }

    /// Runs `work`, the release of `id` (reserved by `rid`) that `cause` asked for, as a switch
    /// of its own: its record says the drain, the park or stop, and how it ended. Nothing to
    /// release (`down` is `None`): no record.
    async fn release_recorded<T>(
        &self,
        cause: SwitchCause,
        id: &str,
        rid: &str,
        down: Option<bool>,
        work: impl std::future::Future<Output = Result<T, ApiError>>,
    ) -> Result<T, ApiError> {
        if down.is_none() {
            return work.await;
        }
        let rec = self
            .switches
            .begin(self.target_of(id, rid, 0), cause, Instant::now());
        let result = rec.scope(work).await;
        rec.finish(result.as_ref().map(|_| ()), Instant::now());
        result
    }

    /// Releases the victims of `order`, then begins bringing the target up. The victims
    /// released, and how the target's bring-up began (`None`: it is up or on its way already).
    ///
    /// The victims are the switch's reservation's, in its order: the ready ones the router
    /// drained (`order.victims`, with their reports) park or stop; parked engines are stopped
    /// for what they still hold on the GPU; starts and wakes in progress (only an operator's
    /// plan names them) are ended and their engines stopped (a request that came for one
    /// meanwhile gets the retryable `unavailable`); one that became ready before it could be
    /// ended is drained here (through the router) and released like the others. A victim that
    /// could not be released fails an operator's order (`evict_failed`: the target is not
    /// brought up on memory its engine may still hold); a request's switch goes on only when
    /// every such victim has given its memory back ([`State::kept_memory`]: one that serves
    /// again after its drain timed out fails the switch as the router's drain timeout does).
    async fn execute_inner(
        &self,
        order: &SwitchOrder,
    ) -> Result<(Vec<Victim>, Option<Up>), ApiError> {
        let switch_id = order.switch_id.as_str();
        let (victims, stop_all) = self.read(|inner| {
            inner
                .reservations
                .get(switch_id)
                .map_or((Vec::new(), false), |r| (r.victims.clone(), r.stop))
        });
        let mut released = Vec::new();
        // Victims whose engine could not be released (ID, name, why), and their errors.
        let mut not_released: Vec<(String, String, String)> = Vec::new();
        let mut kept: Vec<(String, ApiError)> = Vec::new();
        for v in &victims {
            let ours = |d: &Dep| d.reserved.as_deref() == Some(switch_id);
            let Some((name, iid, bringing_up)) = self.read(|inner| {
                let d = inner.deps.get(v).filter(|d| ours(d))?;
                Some((d.name().to_string(), d.instance_id(), d.bringing_up()))
            }) else {
                continue;
            };
            if bringing_up {
                let refusal = ApiError::DispatchClosed {
                    deployment: v.clone(),
                };
                self.end_bring_up(v, &refusal).await;
                let ended = self.read(|inner| {
                    inner.deps.get(v).map(|d| {
                        (
                            matches!(d.state, InstanceState::Stopped | InstanceState::Failed),
                            d.ended_stop_failed.clone(),
                        )
                    })
                });
                match ended {
                    None => continue,
                    Some((true, Some(why))) => {
                        tracing::warn!(victim = %v, error = %why, "its start or wake ended, but stopping its engine failed");
                        kept.push((
                            v.clone(),
                            ApiError::EngineFailed {
                                // The deployment's ID (the field's meaning), not its unit key.
                                deployment: dep_of_unit(v).to_string(),
                                detail: format!(
                                    "its start or wake was ended, but stopping its engine \
                                     failed: {why}"
                                ),
                            },
                        ));
                        not_released.push((v.clone(), name, why.into()));
                        continue;
                    }
                    Some((true, None)) => {
                        tracing::info!(victim = %v, "released: stopped (its start or wake ended)");
                        if let Some(rec) = switches::current() {
                            rec.victim(victim_entry(&name, v, true, VictimResult::Stopped, None));
                        }
                        released.push(Victim {
                            deployment_id: v.clone(),
                            name,
                            instance_id: iid,
                            released: Released::Stopped,
                        });
                        continue;
                    }
                    // It became ready before it could be ended: drained below.
                    Some((false, _)) => {
                        tracing::info!(victim = %v, "its start or wake ended before the switch could end it: drained now");
                    }
                }
            }
            let drained = order.victims.iter().find(|(k, _)| unit_of_key(k) == *v);
            let state = self.read(|inner| {
                let d = inner.deps.get(v).filter(|d| ours(d))?;
                let generation = drained.is_none_or(|(k, _)| d.rec.generation == k.generation);
                Some((d.state, generation))
            });
            let put = match (state, drained) {
                (Some((InstanceState::Parked, _)), _) => Put::StopNoRoom,
                (Some((InstanceState::Ready | InstanceState::Closed, true)), Some((_, report))) => {
                    Put::victim(report.cut_before_output, stop_all)
                }
                (Some((InstanceState::Ready, _)), None) => {
                    // Not drained by the switch (it was starting when planned): drained now.
                    match self
                        .drain(std::slice::from_ref(v), InstanceState::Closed)
                        .await
                    {
                        Ok(reports) => Put::victim(
                            reports.get(v).is_some_and(|r| r.cut_before_output),
                            stop_all,
                        ),
                        Err(e) => {
                            tracing::warn!(victim = %v, error = %e, "draining a victim failed");
                            not_released.push((v.clone(), name, e.message()));
                            kept.push((v.clone(), e));
                            continue;
                        }
                    }
                }
                _ => continue,
            };
            match self.put_away(v, put, NoRoom::Stop).await {
                Ok(put) => {
                    tracing::info!(victim = %v, released = put.released.words(), room = ?put.room.iter().map(|v| &v.name).collect::<Vec<_>>(), "victim released");
                    released.push(Victim {
                        deployment_id: v.clone(),
                        name,
                        instance_id: iid,
                        released: put.released,
                    });
                    // Parked copies stopped to make room for this one's copy.
                    released.extend(put.room);
                }
                Err(e) => {
                    tracing::warn!(victim = %v, error = %e, "releasing a victim failed");
                    not_released.push((v.clone(), name, e.message()));
                    kept.push((v.clone(), e));
                }
            }
        }
        if let Some(rec) = switches::current() {
            // Each with its own error's code (`drain_timeout`, `engine_failed`, ...), as the
            // switch's error is written.
            for (id, name, why) in &not_released {
                let code = kept
                    .iter()
                    .find(|(k, _)| k == id)
                    .map_or("engine_failed", |(_, e)| e.metric_label());
                rec.victim(victim_entry(
                    name,
                    id,
                    true,
                    VictimResult::Failed,
                    Some(SwitchError {
                        code: code.into(),
                        message: why.clone(),
                    }),
                ));
            }
        }
        if order.operator {
            // A stop that failed fails the evict, as it fails `stop`: the victim shows
            // `failed` with the error, and the target is not started.
            let target = self
                .read(|inner| inner.deps.get(&order.target).map(|d| d.name().to_string()))
                .unwrap_or_else(|| order.target.clone());
            if let Some(e) = evict_failed(&target, &not_released) {
                let switch = switch_id.to_string();
                self.write(move |inner| inner.release_reservation(&switch))
                    .await;
                return Err(e);
            }
        }
        let (switch, target) = (order.switch_id.clone(), order.target.clone());
        let up = self
            .write(move |inner| inner.switch_target_up(&switch, &target, &kept, Instant::now()))
            .await?;
        Ok((released, up))
    }

    /// Waits until the engine of `key` reports no running and no waiting requests in a sample
    /// taken after the question (an aborted request can take the engine a moment to drop).
    /// `false` when its metrics cannot be read, when no fresh sample comes, or past
    /// [`IDLE_ENGINE_BOUND`]; the router bounds the wait by its drain bound anyway.
    pub(crate) async fn idle_engine(&self, key: &InstanceKey) -> bool {
        let asked = views::now_ms();
        let iid = instance_id_at(&key.deployment, key.index);
        let mut rx = self.closed.subscribe();
        let give_up = Instant::now() + IDLE_ENGINE_BOUND;
        let Some(agent) = self.read(|inner| inner.hosts.get(&key.host_id).map(|h| h.agent.clone()))
        else {
            return false;
        };
        loop {
            let Some(s) = agent.sample(&iid) else {
                return false;
            };
            match s.engine {
                None => return false,
                Some(e) if s.sampled_at_ms >= asked => {
                    let idle = e.running == Some(0) && e.waiting.unwrap_or(0) == 0;
                    if idle {
                        return true;
                    }
                    if e.running.is_none() {
                        return false;
                    }
                }
                Some(_) => {}
            }
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
                () = tokio::time::sleep_until(give_up) => return false,
                _ = rx.changed() => return false,
            }
        }
    }
}
