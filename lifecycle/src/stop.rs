//! The operator's `stop` and host drain, and the take-downs they and the idle timers share.

use std::collections::HashMap;

use capyctl_interfaces::router::DrainReport;
use capyctl_spec::InstanceState;
use capyctl_spec::api::{
    ActionReceipt, HostDrainReceipt, Released, SwitchCause, SwitchPhaseKind, Victim,
};
use capyctl_spec::errors::ApiError;
use futures_util::StreamExt;
use tokio::time::Instant;

use crate::Core;
use crate::errors::{internal, not_found};
use crate::release::{Ask, NoRoom, Put};

/// How many deployments a host drain stops at once.
pub(crate) const DRAINS_AT_ONCE: usize = 16;

impl Core {
    /// An operator's stop or delete begins: marks `id` operator-stopped (requests get
    /// `deployment_stopped`), fails its waiting requests with `refusal`, then
    /// [`Core::settle_down`].
    pub(crate) async fn begin_operator_stop(
        &self,
        id: &str,
        rid: &str,
        refusal: ApiError,
    ) -> Result<Option<bool>, ApiError> {
        self.on(id, |inner, id| inner.operator_stop(id)).await?;
        self.save_logged(id).await;
        if let Some(r) = self.router() {
            r.deployment_refused(id.to_string(), refusal.clone()).await;
        }
        self.settle_down(id, rid, refusal).await
    }

    /// Ends a start or a wake of `id` in progress (its engine is stopped at once, its caller
    /// and requests get `refusal`: see [`Core::end_bring_up`]), waits for another operation
    /// on it (a park, a switch it is part of) to end, then begins taking it down, reserved by
    /// `rid` (see [`State::begin_down`]).
    async fn settle_down(
        &self,
        id: &str,
        rid: &str,
        refusal: ApiError,
    ) -> Result<Option<bool>, ApiError> {
        let mut rx = self.changes.subscribe();
        loop {
            let settled = self.read(|inner| {
                inner.deps.get(id).map(|d| {
                    // A start or wake begun after the stop (a switch claimed it before) too.
                    if d.bringing_up() && d.end().borrow().is_none() {
                        d.end().send_replace(Some(refusal.clone()));
                    }
                    !d.busy && d.reserved.is_none() && d.claim.is_none()
                })
            });
            match settled {
                None => return Err(not_found(id)),
                Some(true) => {
                    let rid = rid.to_string();
                    match self
                        .on(id, move |inner, id| {
                            inner.begin_down(id, &rid, Instant::now())
                        })
                        .await
                    {
                        Err(ApiError::Conflict { .. }) => {}
                        other => return other,
                    }
                    rx.borrow_and_update();
                }
                Some(false) => {}
            }
            if rx.changed().await.is_err() {
                return Err(internal("the server is shutting down"));
            }
        }
    }

    /// A host drain (`drain`) or uncordon (see [`ManagementApi::drain_host`]): the drain
    /// cordons the host first (placement passes it by from then on), then stops every
    /// deployment bound to it, a few at a time, each as a stop does (a start or a wake in
    /// progress is ended, a ready one drained through the router, then stopped) but without
    /// the operator's stop: its requests are placed elsewhere, or refused while no host may
    /// take them. The host stays cordoned when a stop fails (the error names it).
    pub(crate) async fn do_drain_host(
        &self,
        host_id: &str,
        drain: bool,
    ) -> Result<HostDrainReceipt, ApiError> {
        self.read(|inner| inner.held_refusal())?;
        if !self.read(|inner| inner.hosts.contains_key(host_id)) {
            return Err(ApiError::NotFound {
                what: format!("host {host_id}"),
            });
        }
        let host = host_id.to_string();
        if !drain {
            self.write(move |inner| inner.uncordon(&host)).await;
            tracing::info!(host = %host_id, "uncordoned: the host is in service again");
            // Starts that waited for memory may find it there.
            self.memory_freed();
            return Ok(HostDrainReceipt {
                action: "uncordon".into(),
                host_id: host_id.to_string(),
                cordoned: false,
                victims: Vec::new(),
            });
        }
        let bound = self.write(move |inner| inner.cordon(&host)).await;
        tracing::info!(host = %host_id, deployments = bound.len(), "draining the host: it takes nothing new, and what runs there stops");
        let outcomes: Vec<(String, Result<Option<Victim>, ApiError>)> =
            futures_util::stream::iter(bound)
                .map(|id| async move {
                    let outcome = self.drain_one(&id).await;
                    (id, outcome)
                })
                .buffer_unordered(DRAINS_AT_ONCE)
                .collect()
                .await;
        let mut victims = Vec::new();
        let mut failed = Vec::new();
        for (id, outcome) in outcomes {
            match outcome {
                Ok(Some(v)) => victims.push(v),
                Ok(None) | Err(ApiError::NotFound { .. }) => {}
                Err(e) => failed.push((id, e.message())),
            }
        }
        if let Some((id, why)) = failed.first() {
            return Err(ApiError::EngineFailed {
                deployment: id.clone(),
                detail: format!(
                    "the drain of host {host_id} could not stop it ({why}){}; the host stays cordoned, drain it again",
                    if failed.len() > 1 {
                        format!(" nor {} other deployment(s)", failed.len() - 1)
                    } else {
                        String::new()
                    }
                ),
            });
        }
        victims.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(HostDrainReceipt {
            action: "drain".into(),
            host_id: host_id.to_string(),
            cordoned: true,
            victims,
        })
    }

    /// Stops deployment `id` for a host drain (see [`Core::do_drain_host`]); how it was
    /// released, `None` when nothing ran.
    async fn drain_one(&self, id: &str) -> Result<Option<Victim>, ApiError> {
        let rid = self.fresh_id("drain");
        let refusal = ApiError::DispatchClosed {
            deployment: id.to_string(),
        };
        // `ran`: a start or wake in progress, which the drain ends.
        let (name, iid, ran) = self
            .read(|inner| {
                let d = inner.deps.get(id)?;
                Some((d.name().to_string(), d.instance_id(), d.bringing_up()))
            })
            .ok_or_else(|| not_found(id))?;
        let down = self.settle_down(id, &rid, refusal).await;
        let result = match down {
            Ok(down) => {
                self.take_down_recorded(SwitchCause::Drain, id, &rid, down, true)
                    .await
            }
            Err(e) => Err(e),
        };
        self.write(move |inner| inner.release_reservation(&rid))
            .await;
        let released = match result? {
            Some(r) => r,
            // A start or wake it ended stopped its engine, unless that stop failed.
            None if ran => {
                let stop_failed =
                    self.read(|inner| inner.deps.get(id).and_then(|d| d.ended_stop_failed.clone()));
                if let Some(why) = stop_failed {
                    return Err(ApiError::EngineFailed {
                        deployment: id.to_string(),
                        detail: format!(
                            "its start or wake ended, but stopping its engine failed: {why}"
                        ),
                    });
                }
                Released::Stopped
            }
            None => return Ok(None),
        };
        tracing::info!(deployment = %id, released = released.words(), "drained");
        Ok(Some(Victim {
            deployment_id: id.to_string(),
            name,
            instance_id: iid,
            released,
        }))
    }

    pub(crate) async fn do_stop(&self, key: &str) -> Result<ActionReceipt, ApiError> {
        let id = self.find(key)?;
        self.read(|inner| inner.adapter_command_refusal(&id, "stop"))?;
        self.read(|inner| inner.command_refusal(&id, Instant::now()))?;
        let rid = self.fresh_id("stop");
        let refusal = ApiError::DeploymentStopped {
            deployment: id.clone(),
        };
        let down = self.begin_operator_stop(&id, &rid, refusal.clone()).await?;
        // Every instance at once: a sibling left open while the first drains would take new
        // requests after the stop.
        let first = async {
            let result = self
                .take_down_recorded(SwitchCause::Release, &id, &rid, down, true)
                .await;
            let rid = rid.clone();
            self.write(move |inner| inner.release_reservation(&rid))
                .await;
            result
        };
        let (result, others) = tokio::join!(first, self.take_down_others(&id, refusal, true));
        result?;
        others?;
        self.receipt("stop", &id)
    }

    /// Takes down deployment `id`'s instances other than the first (ended when coming up,
    /// drained when ready, then stopped, or parked when `stop` is false), all at once, each
    /// recorded as a release; the first error, once every one has ended.
    pub(crate) async fn take_down_others(
        &self,
        id: &str,
        refusal: ApiError,
        stop: bool,
    ) -> Result<(), ApiError> {
        let units: Vec<String> = self.read(|inner| {
            inner
                .units_of(id)
                .filter(|u| u.index > 0)
                .map(|u| u.id().to_string())
                .collect()
        });
        let each = units.into_iter().map(|unit| {
            let refusal = refusal.clone();
            async move {
                let rid = self.fresh_id(if stop { "stop" } else { "park" });
                let down = self.settle_down(&unit, &rid, refusal).await?;
                let result = self
                    .take_down_recorded(SwitchCause::Release, &unit, &rid, down, stop)
                    .await;
                self.write(move |inner| inner.release_reservation(&rid))
                    .await;
                result.map(|_| ())
            }
        });
        futures_util::future::join_all(each)
            .await
            .into_iter()
            .collect::<Result<Vec<()>, ApiError>>()
            .map(|_| ())
    }

    /// Drains (when ready) and parks or stops `id`, as begun by [`State::begin_down`].
    pub(crate) async fn take_down(
        &self,
        id: &str,
        _rid: &str,
        down: Option<bool>,
        stop: bool,
        no_room: NoRoom,
    ) -> Result<Option<Released>, ApiError> {
        match down {
            None => Ok(None),
            Some(false) => self
                .put_away(id, Put::Stop, NoRoom::Refuse)
                .await
                .map(|p| Some(p.released)),
            Some(true) => {
                let shown = if stop {
                    InstanceState::Closed
                } else {
                    InstanceState::Parking
                };
                let reports = self.drain(&[id.to_string()], shown).await?;
                self.put_away_drained(id, stop, &reports, no_room)
                    .await
                    .map(Some)
            }
        }
    }

    /// Parks a drained ready `id` (or stops it: `stop`, or a request on it was cut before
    /// output, `reports`; or there is no room to park it and `no_room` says stop).
    async fn put_away_drained(
        &self,
        id: &str,
        stop: bool,
        reports: &HashMap<String, DrainReport>,
        no_room: NoRoom,
    ) -> Result<Released, ApiError> {
        let cut = reports.get(id).is_some_and(|r| r.cut_before_output);
        let put = if stop || cut { Put::Stop } else { Put::Park };
        self.put_away(id, put, no_room).await.map(|p| p.released)
    }

    /// The idle timers' [`Core::take_down`] (`down` from [`State::begin_down`]: a ready
    /// `id` is parked, a parked one stopped), once the router's coordinator has found it idle
    /// since `idle_since`, deciding on its own state, and released it. `Ok(false)`, nothing
    /// done, when it is in use (a request waits, runs, or came after `idle_since`).
    pub(crate) async fn take_down_if_idle(
        &self,
        id: &str,
        down: Option<bool>,
        idle_since: Instant,
    ) -> Result<bool, ApiError> {
        let Some(ready) = down else { return Ok(true) };
        let shown = ready.then_some(InstanceState::Parking);
        let ids = [id.to_string()];
        let asked = Instant::now();
        let Some(reports) = self
            .drain_as(&ids, shown, Ask::IfIdleSince(idle_since))
            .await?
        else {
            return Ok(false);
        };
        // A record only once the router has released it (nothing ran on it: its drain is
        // the router's answer): an idle timer that finds it in use records nothing.
        let rid = self.fresh_id("idle");
        let rec = self
            .switches
            .begin(self.target_of(id, &rid, 0), SwitchCause::Idle, asked);
        if ready {
            rec.phase(
                SwitchPhaseKind::Drain,
                rec.instance(),
                rec.engine(),
                asked,
                Instant::now(),
            );
        }
        let put = async {
            if ready {
                self.put_away_drained(id, false, &reports, NoRoom::Refuse)
                    .await
                    .map(|_| ())
            } else {
                self.put_away(id, Put::Stop, NoRoom::Refuse)
                    .await
                    .map(|_| ())
            }
        };
        let result = rec.scope(put).await;
        rec.finish(result.as_ref().map(|_| ()), Instant::now());
        result.map(|()| true)
    }
}
