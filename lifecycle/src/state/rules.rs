//! Rules of bring-ups, plans, idle timers and fences, each one call of the owner. The release's
//! rules are in `releases.rs`, the operator commands' in `commands.rs`, a unit's own writes in
//! `state.rs`; `lifecycle/DESIGN.md` ("Rules and who calls them") lists them all.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use capyctl_interfaces::launch::MaxRunning;
use capyctl_interfaces::measure::Measurement;
use capyctl_interfaces::router::{InstanceKey, Plan, PlanFor};
use capyctl_interfaces::tier::ParkTier;
use capyctl_spec::errors::ApiError;
use capyctl_spec::{Activation, InstanceState};
use tokio::time::Instant;

use crate::errors::not_found;
use crate::ids::engine_addr;
use crate::placement::Fit;
use crate::views;

use super::placing::Victims;
use super::{
    Dep, Fence, Host, NoRequests, Requests, Reservation, State, dep_of_unit, deployment_of,
};

/// How an instance is to be brought up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Up {
    Wake,
    Start,
}

/// Engine exits.
impl State {
    /// An engine exited by itself on `host`: a ready, draining or parked instance there is
    /// `failed` (the next request starts it afresh, unless it is explicit); the key to tell
    /// the router is gone. Nothing for an instance with an operation in progress (the
    /// operation sees the failure itself), nor for an engine of a host it left.
    pub(crate) fn engine_exited(
        &mut self,
        host: &str,
        exit: &capyctl_interfaces::agent::EngineExit,
        now: Instant,
    ) -> Option<InstanceKey> {
        let d = self.deps.get_mut(&deployment_of(&exit.instance)?)?;
        if d.host.as_deref() != Some(host) || d.busy {
            return None;
        }
        if d.keeps_engine() {
            // An engine that could not be stopped is gone after all: its memory is free.
            d.ended_stop_failed = None;
            return Some(d.key(&self.host_id));
        }
        if !matches!(
            d.state,
            InstanceState::Ready | InstanceState::Parked | InstanceState::Closed
        ) {
            return None;
        }
        d.touch(now);
        d.fail(
            format!(
                "the engine exited: {}",
                exit.status.as_deref().unwrap_or("status unknown")
            ),
            now,
        );
        Some(d.key(&self.host_id))
    }
}

/// What adding a host leaves to do ([`State::add_host`]).
#[derive(Debug, Default)]
pub(crate) struct Adoption {
    /// Engines to stop there: of deployments that no longer exist, or run elsewhere.
    pub(crate) to_stop: Vec<String>,
    /// Instances adopted ready (or at a new address): the router is told.
    pub(crate) came: Vec<(InstanceKey, SocketAddr)>,
    /// Instances believed on that host that it no longer has: failed, the router is told.
    pub(crate) lost: Vec<InstanceKey>,
}

/// Hosts.
impl State {
    /// Adds host `host_id` (or replaces its agent) and reconciles the deployments with the
    /// engines it reports (`adopted`): engines it holds are adopted (ready or parked) unless
    /// an operation on them is in flight (then only where the engine answers is learnt);
    /// engines of unknown deployments, or of a deployment bound elsewhere, are to be stopped;
    /// instances believed on that host that it no longer has are failed.
    pub(crate) fn add_host(
        &mut self,
        host_id: String,
        host: Host,
        adopted: &[capyctl_interfaces::agent::AdoptedInstance],
    ) -> Adoption {
        Arc::make_mut(&mut self.hosts).insert(host_id.clone(), Arc::new(host));
        // Its capacity or GPUs may differ: what its units hold is counted again.
        self.host_changed(&host_id);
        // Adopted engines may be parked copies: the host's index of them is built again.
        self.parked_copies.forget(&host_id);
        self.any_host_explicit = self
            .hosts
            .values()
            .any(|h| h.activation == Activation::Explicit);
        let mut to_stop = Vec::new();
        let mut came = Vec::new();
        let mut lost = Vec::new();
        let mut adopted_here = BTreeSet::new();
        let mut changed = BTreeSet::new();
        let multi_gpu = self.hosts.get(&host_id).is_some_and(|h| h.gpus.len() > 1);
        for adopted in adopted {
            let Some(d) = deployment_of(&adopted.instance)
                .and_then(|id| self.deps.get_mut(&id))
                .filter(|d| d.instance_id() == adopted.instance)
            else {
                tracing::info!(host = %host_id, instance = %adopted.instance, "stopping an engine of a deployment that no longer exists");
                to_stop.push(adopted.instance.clone());
                continue;
            };
            let elsewhere = d.bound_host().is_some_and(|h| h != host_id);
            if elsewhere {
                tracing::info!(host = %host_id, instance = %adopted.instance, "stopping a second engine of a deployment that runs elsewhere");
                to_stop.push(adopted.instance.clone());
                continue;
            }
            if d.busy || d.reserved.is_some() || d.claim.is_some() {
                // An operation on it is in flight (a start, a wake, a drain, a park): it
                // decides the state; only where the engine answers is learnt.
                if d.host.as_deref() == Some(host_id.as_str()) {
                    d.pid = Some(adopted.pid);
                    if let Some(addr) = engine_addr(&adopted.base_url) {
                        d.addr = Some(addr);
                    }
                    adopted_here.insert(d.id().to_string());
                }
                continue;
            }
            let was = (d.state, d.addr);
            d.state = if adopted.parked.is_some() {
                InstanceState::Parked
            } else {
                InstanceState::Ready
            };
            d.tier = adopted.parked;
            d.parked_gpu = adopted.gpu_held.map(|g| g.bytes);
            d.pid = Some(adopted.pid);
            // The GPUs it was given (placement on a host of several GPUs sets them).
            d.gpus = if multi_gpu {
                adopted
                    .spec
                    .env
                    .get(crate::gpus::VISIBLE_DEVICES)
                    .map(|v| v.split(',').filter_map(|g| g.trim().parse().ok()).collect())
                    .unwrap_or_default()
            } else {
                Vec::new()
            };
            d.addr = engine_addr(&adopted.base_url);
            if adopted.parked.is_none() && d.rec.pending_start {
                // It runs: a start that waited for memory has happened.
                d.rec.pending_start = false;
                self.dirty.mark(&d.rec.id);
            }
            let id = d.id().to_string();
            if (d.state, d.addr) != was {
                changed.insert(id.clone());
            }
            tracing::info!(host = %host_id, instance = %adopted.instance, state = %d.state, "adopted an engine");
            if let Some(f) = &mut self.fence
                && d.state == InstanceState::Ready
            {
                // A host that joins while the fence lasts: what it holds ready is inherited too.
                f.ids.insert(id.clone());
            }
            self.set_host(&id, Some(host_id.clone()));
            adopted_here.insert(id);
        }
        // Only deployments on this host can be adopted here or lost by it.
        let on_this_host: Vec<String> =
            self.on_host(&host_id).map(|d| d.id().to_string()).collect();
        for id in &on_this_host {
            let Some(d) = self.deps.get_mut(id) else {
                continue;
            };
            if adopted_here.contains(d.id()) {
                if changed.contains(d.id())
                    && d.state == InstanceState::Ready
                    && let Some(addr) = d.addr
                {
                    came.push((Self::key_of(d, &host_id), addr));
                }
                continue;
            }
            let held = d.occupies() || d.keeps_engine() || d.state == InstanceState::Parked;
            if held && !d.busy && d.reserved.is_none() && d.claim.is_none() {
                lost.push(Self::key_of(d, &host_id));
                d.lost(format!(
                    "its engine is gone: host {host_id} no longer has it"
                ));
                // One that could not be stopped is gone too: its memory is free.
                d.ended_stop_failed = None;
            }
        }
        Adoption {
            to_stop,
            came,
            lost,
        }
    }
}

/// What a started engine reports ([`UpDone::Ready`]).
#[derive(Debug)]
pub(crate) struct Started {
    /// Where it answers (`None`: not an IP address and port).
    pub(crate) addr: Option<SocketAddr>,
    pub(crate) pid: u32,
    pub(crate) max_running: MaxRunning,
    pub(crate) measurement: Measurement,
}

/// How a start or a wake ended ([`State::up_done`]).
#[derive(Debug)]
pub(crate) enum UpDone {
    /// It is ready: what a started engine reports (`None` for a wake: it keeps its engine).
    Ready(Option<Started>),
    /// It failed with `error`; `ended`: it was ended ([`Dep::end`]), and the agent's stop of
    /// its engine answered this.
    Failed {
        error: ApiError,
        ended: Option<Result<(), String>>,
    },
    /// A preinitialize's start: its engine is up and has answered (`first_answer`), shown
    /// `closed` (it never serves before it is parked) and still busy: its park follows.
    Closed {
        started: Started,
        first_answer: capyctl_interfaces::verify::FirstAnswer,
    },
    /// Failed with this status line, its last use kept: no engine was started (its host has
    /// no agent), or a preinitialize's start failed.
    Gone(String),
    /// A preinitialize's start ended (a stop, a host drain, a delete): `stopped` with the status
    /// line `why` when its engine was stopped; when that stop failed, failed with `why`, its
    /// last use kept, and the stop's error kept for whoever ended it
    /// ([`Dep::ended_stop_failed`]: a drain then reports the engine not stopped).
    Ended {
        why: String,
        stopped: Result<(), String>,
    },
}

/// Bring-ups.
impl State {
    /// Started `id`'s engine gave its first answer (the reference its wakes are checked
    /// against): recorded before the instance is announced (the caller saves it then).
    pub(crate) fn answered_first(
        &mut self,
        id: &str,
        first: capyctl_interfaces::verify::FirstAnswer,
    ) {
        if let Some(d) = self.deps.get_mut(id) {
            d.rec.first_answer = Some(first);
        }
    }

    /// Writes how the start or wake of `id` (`up`, begun by [`State::begin_up`] or
    /// [`State::preinitialize`]) ended: `ready`, or `failed` with the error (`stopped` when it
    /// was ended and its engine stopped), or a preinitialize's `closed` (see [`UpDone`]). The
    /// key to announce, with the address, when ready; `Err(key)` to tell the router it is
    /// gone; `None` when `id` is gone (deleted meanwhile) or is `closed`.
    /// The one rule that writes the outcome of a start or a wake.
    pub(crate) fn up_done(
        &mut self,
        id: &str,
        up: Up,
        done: UpDone,
        now: Instant,
    ) -> Option<Result<(InstanceKey, Option<SocketAddr>), InstanceKey>> {
        let d = self.deps.get_mut(id)?;
        match done {
            UpDone::Closed {
                started,
                first_answer,
            } => {
                d.addr = started.addr;
                d.pid = Some(started.pid);
                d.max_running = Some(started.max_running);
                if !started.measurement.awaiting() {
                    d.measurement = started.measurement;
                }
                d.rec.first_answer = Some(first_answer);
                d.state = InstanceState::Closed;
                None
            }
            UpDone::Gone(why) => {
                d.busy = false;
                d.fail(why, now);
                Some(Err(d.key(&self.host_id)))
            }
            UpDone::Ended { why, stopped } => {
                d.busy = false;
                match stopped {
                    Ok(()) => {
                        d.state = InstanceState::Stopped;
                        d.last_error = Some(why);
                    }
                    Err(stop) => {
                        d.fail(
                            format!("{why}, but stopping the engine failed: {stop}"),
                            now,
                        );
                        d.ended_stop_failed = Some(stop.into());
                    }
                }
                Some(Err(d.key(&self.host_id)))
            }
            UpDone::Ready(started) => {
                d.busy = false;
                // Over: nothing ends it any more.
                d.end = OnceLock::new();
                d.touch(now);
                if let Some(s) = started {
                    d.addr = s.addr;
                    d.pid = Some(s.pid);
                    d.max_running = Some(s.max_running);
                    if !s.measurement.awaiting() {
                        d.measurement = s.measurement;
                    }
                }
                d.state = InstanceState::Ready;
                d.tier = None;
                Some(Ok((d.key(&self.host_id), d.addr)))
            }
            UpDone::Failed { error: e, ended } => {
                d.busy = false;
                d.touch(now);
                d.fail(format!("{}: {}", e.code(), e.message()), now);
                if let Some(stopped) = ended {
                    let what = match up {
                        Up::Start => "start",
                        Up::Wake => "wake",
                    };
                    match stopped {
                        Ok(()) => {
                            d.state = InstanceState::Stopped;
                            d.last_error =
                                Some(format!("{what} ended and engine stopped: {}", e.message()));
                        }
                        Err(stop) => {
                            d.last_error = Some(format!(
                                "{what} ended ({}), but stopping the engine failed: {stop}",
                                e.message()
                            ));
                            d.ended_stop_failed = Some(stop.into());
                        }
                    }
                }
                Some(Err(d.key(&self.host_id)))
            }
        }
    }
}

/// Operator starts that wait for memory.
impl State {
    /// Begins the operator's start of `id` that waits for memory (`pending_start`) when it
    /// fits now, without victims (as a start without `--evict`); how it comes up. `None`
    /// when it no longer waits, something else has it, or it does not fit yet.
    pub(crate) fn start_pending(&mut self, id: &str, now: Instant) -> Option<Up> {
        let d = self.deps.get(id)?;
        if !d.rec.pending_start || d.busy || d.reserved.is_some() || d.claim.is_some() {
            return None;
        }
        if self.held.is_some() {
            return None;
        }
        // NB: no victims, so the placement reads nothing of the router's record.
        let (placed, fit) =
            self.place_target(id, &BTreeSet::new(), Victims::None, &NoRequests, now);
        if fit != Fit::Now {
            return None;
        }
        self.set_placed(id, placed);
        self.begin_up(id, true, now)
    }
}

/// Switches.
impl State {
    /// The end of switch `switch_id`'s release: its reservation goes, and its target comes up
    /// (how; `None` when it is up or on its way already). `conflict` when the switch was
    /// given up meanwhile (the target no longer claimed by it); the target's `admissible`
    /// error when requests may no longer bring it up; the error of a victim that could not
    /// be released (`kept`: ID and error) and still holds its memory ([`State::kept_memory`]).
    pub(crate) fn switch_target_up(
        &mut self,
        switch_id: &str,
        target: &str,
        kept: &[(String, ApiError)],
        now: Instant,
    ) -> Result<Option<Up>, ApiError> {
        let claimed = self
            .deps
            .get(target)
            .is_some_and(|d| d.claim.as_deref() == Some(switch_id));
        let operator = self.reservations.get(switch_id).is_some_and(|r| r.operator);
        self.release_reservation(switch_id);
        if !claimed {
            return Err(ApiError::Conflict {
                detail: format!("switch {switch_id} to deployment {target} was given up"),
            });
        }
        if let Some(e) = &self.held {
            return Err(e.clone());
        }
        if let Some(e) = self.kept_memory(target, kept) {
            return Err(e);
        }
        self.admissible(target)?;
        let d = self.deps.get(target).ok_or_else(|| not_found(target))?;
        if d.busy || d.occupies() {
            return Ok(None);
        }
        Ok(self.begin_up(target, operator, now))
    }
}

impl State {
    /// Why `target`, placed on the memory of victims of which `kept` could not be released
    /// (ID and error), may not come up: one of them still holds its memory. It serves again
    /// (its drain timed out: the switch fails as a drain timeout fails one, "the victims
    /// serve again"; or its park was refused before it began), or its start or wake was ended
    /// but its engine could not be stopped. `None` when every one of them has given its memory
    /// back (a park that failed and stopped its engine): the switch goes on.
    ///
    /// NB: the plan counted their memory as freed; brought up beside one, the target
    /// over-books the GPU (the soak, seed 20261205: a start no request waited for, a victim,
    /// became ready before the switch could end it, then served a long answer through its drain).
    pub(crate) fn kept_memory(
        &self,
        target: &str,
        kept: &[(String, ApiError)],
    ) -> Option<ApiError> {
        let (_, e) = kept.iter().find(|(id, _)| {
            self.deps
                .get(id)
                .is_some_and(|d| d.occupies() || d.ended_stop_failed.is_some())
        })?;
        Some(match e {
            ApiError::DrainTimeout {
                drain_ms, charged, ..
            } => ApiError::DrainTimeout {
                deployment: dep_of_unit(target).to_string(),
                drain_ms: *drain_ms,
                charged: *charged,
            },
            other => other.clone(),
        })
    }
}

/// What an operator's start does next ([`State::start`]).
#[derive(Debug)]
pub(crate) enum StartNext {
    /// Nothing: it is ready or on its way.
    Nothing,
    /// Bring it up so (begun).
    Up(Up),
    /// A `start --evict`: an operator's switch, through the router's coordinator.
    Evict,
    /// It waits for memory (`pending_start`).
    Pending,
}

/// Operator commands.
impl State {
    /// An operator's start of `id` (`wait`: `--wait`; `evict`: `--evict`): clears the operator
    /// stop and decides. `awaiting_measurement` unless `wait` (or it runs); `conflict` while it
    /// is going away; without `--evict`, placement without victims: it comes up now, or waits
    /// for memory; with it, the switch is the coordinator's.
    pub(crate) fn start(
        &mut self,
        id: &str,
        wait: bool,
        evict: bool,
        now: Instant,
    ) -> Result<StartNext, ApiError> {
        self.held_refusal()?;
        let d = self.deps.get(id).ok_or_else(|| not_found(id))?;
        if d.measurement.awaiting() && !wait && d.state != InstanceState::Ready {
            return Err(ApiError::AwaitingMeasurement {
                deployment: id.to_string(),
            });
        }
        if matches!(
            d.state,
            InstanceState::Closed | InstanceState::Parking | InstanceState::Stopping
        ) || d.reserved.is_some()
        {
            return Err(ApiError::Conflict {
                detail: format!(
                    "deployment {} is {} now; start it again once that has finished",
                    d.name(),
                    views::shown_state(d)
                ),
            });
        }
        let coming = matches!(
            d.state,
            InstanceState::Ready | InstanceState::Starting | InstanceState::Waking
        ) || d.claim.is_some()
            // A start that waits for memory is taken over by a start with --evict.
            || (d.rec.pending_start && !evict);
        // With --evict the placement is the switch's (`operator_switch`); without, nothing
        // is released.
        // NB: no victims, so the placement reads nothing of the router's record.
        let fit = (!evict)
            .then(|| self.place_target(id, &BTreeSet::new(), Victims::None, &NoRequests, now));
        let d = self.deps.get_mut(id).ok_or_else(|| not_found(id))?;
        d.rec.operator_stopped = false;
        d.rec.operator_started = true;
        if coming {
            return Ok(StartNext::Nothing);
        }
        let Some((placed, fit)) = fit else {
            return Ok(StartNext::Evict);
        };
        match fit {
            Fit::Now => {
                self.set_placed(id, placed);
                Ok(self
                    .begin_up(id, true, now)
                    .map_or(StartNext::Nothing, StartNext::Up))
            }
            // Without --evict nothing is released: placement never names victims then.
            Fit::Later | Fit::After(_) | Fit::AfterStopping(_) => {
                if let Some(d) = self.deps.get_mut(id) {
                    d.rec.pending_start = true;
                }
                Ok(StartNext::Pending)
            }
            Fit::Never(detail) => Err(ApiError::DoesNotFit {
                deployment: id.to_string(),
                detail,
            }),
        }
    }
}

impl State {
    /// An operator's park of ready `id` begins (reserved by `rid`, shown `parking` at once:
    /// it drains and parks in the background; see [`State::begin_down`]). `None`: nothing to
    /// do (parked meanwhile by a switch, or gone).
    pub(crate) fn park(
        &mut self,
        id: &str,
        rid: &str,
        now: Instant,
    ) -> Result<Option<bool>, ApiError> {
        if self
            .deps
            .get(id)
            .is_none_or(|d| d.state != InstanceState::Ready)
        {
            return Ok(None);
        }
        let down = self.begin_down(id, rid, now)?;
        if let Some(d) = self.deps.get_mut(id) {
            d.rec.operator_started = false;
            d.state = InstanceState::Parking;
        }
        Ok(down)
    }
}

impl State {
    /// A preinitialize of `id` with its fresh measurement: when still unmeasured, idle and the
    /// GPU has room now (no victims), its start begins (`true`: run it without serving, then
    /// park); `conflict` when no memory is free, `does_not_fit` when none ever is.
    pub(crate) fn preinitialize(
        &mut self,
        id: &str,
        measured: Measurement,
        now: Instant,
    ) -> Result<bool, ApiError> {
        self.held_refusal()?;
        let d = self.deps.get_mut(id).ok_or_else(|| not_found(id))?;
        if !measured.awaiting() {
            d.measurement = measured;
        }
        let idle = matches!(d.state, InstanceState::Stopped | InstanceState::Failed)
            && !d.busy
            && d.reserved.is_none()
            && d.claim.is_none()
            && !d.rec.pending_start;
        if !d.measurement.awaiting() || !idle {
            return Ok(false);
        }
        let name = d.name().to_string();
        // NB: no victims, so the placement reads nothing of the router's record.
        let (placed, fit) =
            self.place_target(id, &BTreeSet::new(), Victims::None, &NoRequests, now);
        match fit {
            Fit::Now => {
                self.set_placed(id, placed);
                Ok(self.begin_up(id, true, now).is_some())
            }
            Fit::Later | Fit::After(_) | Fit::AfterStopping(_) => Err(ApiError::Conflict {
                detail: format!(
                    "no GPU memory is free to measure deployment {name} now; park or stop the others, or start it with --wait"
                ),
            }),
            Fit::Never(detail) => Err(ApiError::DoesNotFit {
                deployment: id.to_string(),
                detail,
            }),
        }
    }
}

/// The idle timers (`server.lifecycle_defaults`).
impl State {
    /// The deployments whose idle timer is due at `now`: ready ones idle for
    /// `ready_idle_timeout` (`true`: to park), parked ones for `parked_idle_timeout` (`false`:
    /// to stop). Never explicit or warm ones, never one busy, reserved, claimed or waiting for
    /// memory, never one in `in_use` (requests wait or run, as the router's load says). Idle
    /// since its last use ([`State::used_at`], with the router's record `requests`). Only
    /// candidates: each is decided again by [`State::begin_idle_down`], and then by the router.
    pub(crate) fn idle_due(
        &self,
        timeouts: &capyctl_spec::settings::LifecycleDefaults,
        in_use: &BTreeSet<String>,
        requests: &dyn Requests,
        now: Instant,
    ) -> Vec<(String, bool)> {
        self.deps
            .values()
            .filter(|d| !self.explicit(d) && !d.warm() && !d.busy && d.reserved.is_none())
            .filter(|d| d.claim.is_none() && !d.rec.pending_start && !in_use.contains(d.id()))
            // Held or fenced: no idle timer parks or stops either.
            .filter(|d| self.held.is_none() && !self.fenced(d.id()))
            .filter_map(|d| {
                let idle = now.saturating_duration_since(Self::used_at(d, requests));
                let due = |t: Option<Duration>| t.is_some_and(|t| idle >= t);
                match d.state {
                    InstanceState::Ready if due(timeouts.ready_idle_timeout) => {
                        Some((d.id().to_string(), true))
                    }
                    InstanceState::Parked if due(timeouts.parked_idle_timeout) => {
                        Some((d.id().to_string(), false))
                    }
                    _ => None,
                }
            })
            .collect()
    }

    /// The idle timer of `id` (`ready`: its ready timer, else its parked one) takes it down,
    /// decided again at `now` on the state it changes: still in that state, not used since
    /// `now - timeout` (by the router's record `requests` too), not waiting for memory;
    /// reserved by `rid` (see [`State::begin_down`]).
    /// What [`State::begin_down`] says, and the instant the router checks that nothing used
    /// it after; `None` when it is not due after all.
    pub(crate) fn begin_idle_down(
        &mut self,
        id: &str,
        ready: bool,
        timeouts: &capyctl_spec::settings::LifecycleDefaults,
        rid: &str,
        requests: &dyn Requests,
        now: Instant,
    ) -> Option<(Option<bool>, Instant)> {
        let d = self.deps.get(id)?;
        let timeout = match d.state {
            InstanceState::Ready if ready => timeouts.ready_idle_timeout?,
            InstanceState::Parked if !ready => timeouts.parked_idle_timeout?,
            _ => return None,
        };
        // No use after this instant: the rule, as the router checks it.
        let idle_since = now.checked_sub(timeout)?;
        if Self::used_at(d, requests) > idle_since || d.rec.pending_start {
            return None;
        }
        let down = self.begin_down(id, rid, now).ok()?;
        let dep = dep_of_unit(id);
        if self.replicated.contains(dep) {
            self.idle_taken.insert(dep.to_string(), now);
        }
        Some((down, idle_since))
    }
}

/// The parked set's room in host RAM.
impl State {
    /// Reserves `id`'s parked copy in host RAM (by `rid`), to be stopped for room: only while
    /// it is parked there, with no operation, reservation or claim on it (see
    /// [`State::begin_down`]). Its name; `None` when it is not such a copy now.
    pub(crate) fn reserve_parked_copy(
        &mut self,
        id: &str,
        rid: &str,
        now: Instant,
    ) -> Option<String> {
        let d = self.deps.get(id)?;
        if d.state != InstanceState::Parked || d.tier != Some(ParkTier::HostRam) {
            return None;
        }
        let name = d.name().to_string();
        matches!(self.begin_down(id, rid, now), Ok(Some(false))).then_some(name)
    }
}

/// The operator's hold-over and fence (see `lifecycle/DESIGN.md`, "Leadership on
/// Kubernetes").
impl State {
    /// Holds every switch with `refusal` (503 `unavailable`): a request for a deployment that
    /// is not ready (or already starting or waking) is refused at once, plans fail with it,
    /// and no operator command, idle timer or pending start changes anything. Ready instances
    /// serve on; engine exits are still recorded. The targets of the switches planned and not begun (claimed) are returned: they are
    /// given up (their victims serve on, their requests get the refusal).
    pub(crate) fn hold(&mut self, refusal: ApiError) -> Vec<String> {
        self.held = Some(refusal);
        self.deps
            .values()
            .filter(|d| d.claim.is_some())
            .map(|d| d.rec.id.clone())
            .collect()
    }

    /// A switch (`switch_id`) the router drained before switches were held is not carried
    /// out: its reservation is given back. Its `victims` still ready (of the same
    /// generation), with their addresses, to announce again.
    pub(crate) fn give_back_held_order(
        &mut self,
        switch_id: &str,
        victims: Vec<InstanceKey>,
    ) -> Vec<(InstanceKey, SocketAddr)> {
        self.release_reservation(switch_id);
        victims
            .into_iter()
            .filter_map(|k| {
                let d = self.deps.get(&super::unit_of_key(&k))?;
                (d.state == InstanceState::Ready && d.rec.generation == k.generation)
                    .then_some(())?;
                Some((k, d.addr?))
            })
            .collect()
    }

    /// Ends the hold: switching resumes.
    pub(crate) fn resume(&mut self) {
        self.held = None;
    }

    /// Fences the instances ready now (adopted from a leader that did not release its Lease):
    /// until `until` they are not victims of any switch, no idle timer takes them down, and an
    /// operator's park or stop of them is refused ([`State::command_refusal`]). Their names.
    pub(crate) fn set_fence(&mut self, until: Instant, now: Instant) -> Vec<String> {
        if until <= now {
            self.fence = None;
            return Vec::new();
        }
        let ids: BTreeSet<String> = self
            .deps
            .values()
            .filter(|d| d.state == InstanceState::Ready)
            .map(|d| d.id().to_string())
            .collect();
        let names = ids
            .iter()
            .filter_map(|id| self.deps.get(id).map(|d| d.name().to_string()))
            .collect();
        self.fence = Some(Fence { until, ids });
        names
    }

    /// Ends the fence once `now` has reached its end; whether it ended now.
    pub(crate) fn end_fence(&mut self, now: Instant) -> bool {
        if self.fence.as_ref().is_some_and(|f| now >= f.until) {
            self.fence = None;
            return true;
        }
        false
    }

    /// Whether deployment `id` is fenced ([`State::set_fence`]; the fence is dropped at its
    /// end by [`State::end_fence`]).
    pub(crate) fn fenced(&self, id: &str) -> bool {
        self.fence.as_ref().is_some_and(|f| f.ids.contains(id))
    }

    /// The refusal of every change while switches are held ([`State::hold`]).
    pub(crate) fn held_refusal(&self) -> Result<(), ApiError> {
        match &self.held {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Why taking deployment `id` down (an operator's stop, park or delete, a host drain, an
    /// idle timer) is refused now: held, or `id` fenced (answered with the fence's end).
    pub(crate) fn command_refusal(&self, id: &str, now: Instant) -> Result<(), ApiError> {
        self.held_refusal()?;
        match &self.fence {
            Some(f) if f.ids.contains(id) => {
                let left = f.until.saturating_duration_since(now);
                let name = self.deps.get(id).map_or(id, |d| d.name());
                Err(ApiError::Unavailable {
                    detail: format!(
                        "deployment {name} was adopted from the previous leader, which may still serve it; it is not parked or stopped for another {} s (until that leader's hold-over has surely ended)",
                        left.as_secs() + 1
                    ),
                    retry_after: u32::try_from(left.as_secs() + 1).unwrap_or(u32::MAX),
                })
            }
            _ => Ok(()),
        }
    }
}

impl State {
    /// Marks `id` as coming up and says how; `operator`: an operator asked for it
    /// ([`Dep::operator_up`]).
    pub(crate) fn begin_up(&mut self, id: &str, operator: bool, now: Instant) -> Option<Up> {
        if let Some(f) = &mut self.fence {
            // Brought up by this leader: no longer the previous leader's.
            f.ids.remove(id);
        }
        // In use again: the scaler brings up the other instances (never called by the scaler
        // for a deployment it keeps off: `scale_up`).
        self.operator_parked.remove(dep_of_unit(id));
        self.idle_taken.remove(dep_of_unit(id));
        let d = self.deps.get_mut(id)?;
        if std::mem::take(&mut d.rec.pending_start) || d.state != InstanceState::Parked {
            // A pending start taken, a new generation: saved by the bring-up.
            self.dirty.mark(id);
        }
        d.claim = None;
        d.busy = true;
        d.last_error = None;
        d.touch(now);
        d.end = OnceLock::new();
        d.ended_stop_failed = None;
        d.operator_up = operator;
        if d.state == InstanceState::Parked {
            d.parked_gpu = None;
            d.state = InstanceState::Waking;
            Some(Up::Wake)
        } else {
            d.state = InstanceState::Starting;
            d.rec.generation += 1;
            d.rec.first_answer = None;
            Some(Up::Start)
        }
    }

    /// Whether requests may bring deployment `id` up now (see [`crate::Lifecycle`]'s
    /// `admissible`).
    pub(crate) fn admissible(&self, id: &str) -> Result<(), ApiError> {
        let Some(d) = self.deps.get(id) else {
            return Err(not_found(id));
        };
        if d.rec.operator_stopped {
            return Err(ApiError::DeploymentStopped {
                deployment: id.to_string(),
            });
        }
        let dep = dep_of_unit(id);
        if self.explicit(d) && !self.units_of(dep).any(Dep::running_or_coming) {
            return Err(ApiError::DeploymentInactive {
                deployment: id.to_string(),
            });
        }
        // Held: only what is ready or already on its way serves; nothing is switched.
        if let Some(e) = &self.held
            && !self.units_of(dep).any(|u| {
                matches!(
                    u.state,
                    InstanceState::Ready | InstanceState::Starting | InstanceState::Waking
                )
            })
        {
            return Err(e.clone());
        }
        Ok(())
    }

    /// Plans bringing `target` up for `who` (see [`PlanFor`]): reserves the victims and
    /// claims the target. An operator's plan (`start --evict`) may also name starts and wakes
    /// in progress that no request waits for ([`Victims::IdleAndBringUps`]); it does not ask
    /// whether requests may bring the target up (the operator's start is what does).
    /// `requests`: the router's record, which orders the victims (see [`State::place_target`]).
    pub(crate) fn plan(
        &mut self,
        target: &str,
        protected: &BTreeSet<String>,
        who: PlanFor,
        switch_id: String,
        requests: &dyn Requests,
        now: Instant,
    ) -> Result<Plan, ApiError> {
        if who == PlanFor::Requests {
            self.admissible(target)?;
        }
        if !self.deps.contains_key(target) {
            return Err(not_found(target));
        }
        // The instance to bring up: one already on its way says so; else a parked one (a wake
        // is quicker than a start), else a stopped one; `Later` while every one is busy. An
        // operator's `start --evict` makes room for every instance it starts
        // ([`State::unit_to_fill`]).
        let pick = match who {
            PlanFor::Requests => self.unit_to_bring_up(target),
            PlanFor::Operator => self.unit_to_fill(target),
        };
        let target = match pick {
            Some(unit) => unit,
            None => return Ok(Plan::AlreadyComing),
        };
        let target = target.as_str();
        let Some(d) = self.deps.get(target) else {
            return Err(not_found(target));
        };
        // NB: an operator start that waits for memory (`pending_start`) never evicts; a
        // request for the same deployment plans as usual and may, taking the start over.
        if d.claim.is_some() {
            return Ok(Plan::AlreadyComing);
        }
        match d.state {
            InstanceState::Ready | InstanceState::Starting | InstanceState::Waking => {
                return Ok(Plan::AlreadyComing);
            }
            _ if d.busy || d.reserved.is_some() => return Ok(Plan::Later),
            InstanceState::Closed | InstanceState::Parking | InstanceState::Stopping => {
                return Ok(Plan::Later);
            }
            _ => {}
        }
        if let Some(e) = &self.held {
            return Err(e.clone());
        }
        let policy = match who {
            PlanFor::Requests => Victims::Idle,
            PlanFor::Operator => Victims::IdleAndBringUps,
        };
        let (placed, fit) = self.place_target(target, protected, policy, requests, now);
        let plan = match fit {
            Fit::Now => {
                self.reservations.insert(
                    switch_id.clone(),
                    Reservation {
                        target: Some(target.to_string()),
                        victims: Vec::new(),
                        stop: false,
                        operator: who == PlanFor::Operator,
                    },
                );
                // NB: a pending operator start stays pending until the bring-up begins
                // (`begin_up` takes it): a switch given back leaves it waiting as before.
                if let Some(d) = self.deps.get_mut(target) {
                    d.claim = Some(switch_id.as_str().into());
                }
                self.set_placed(target, placed);
                Plan::BringUp { switch_id }
            }
            Fit::After(ref victims) | Fit::AfterStopping(ref victims) => {
                let stop = matches!(fit, Fit::AfterStopping(_));
                let victims = victims.clone();
                let window = placed
                    .host
                    .as_ref()
                    .and_then(|h| self.hosts.get(h))
                    .and_then(|h| h.admission_window);
                // The router drains the ready victims; parked ones (stopped for what they still
                // hold on the GPU) and starts or wakes in progress (ended) are the lifecycle's
                // alone.
                let mut keys = Vec::new();
                for v in &victims {
                    if let Some(vd) = self.deps.get_mut(v) {
                        vd.reserved = Some(switch_id.as_str().into());
                        if vd.state == InstanceState::Ready {
                            let host = vd.host.as_deref().unwrap_or(self.host_id.as_str());
                            keys.push(Self::key_of(vd, host));
                        }
                    }
                }
                if let Some(d) = self.deps.get_mut(target) {
                    d.claim = Some(switch_id.as_str().into());
                }
                self.set_placed(target, placed);
                self.reservations.insert(
                    switch_id.clone(),
                    Reservation {
                        target: Some(target.to_string()),
                        victims,
                        stop,
                        operator: who == PlanFor::Operator,
                    },
                );
                if keys.is_empty() {
                    Plan::BringUp { switch_id }
                } else {
                    Plan::Switch {
                        switch_id,
                        victims: keys,
                        // The window of the host where the switch happens.
                        window,
                    }
                }
            }
            Fit::Later => Plan::Later,
            Fit::Never(detail) => {
                return Err(ApiError::DoesNotFit {
                    deployment: target.to_string(),
                    detail,
                });
            }
        };
        Ok(plan)
    }

    /// The instance of deployment `dep` a plan brings up: `None` when one is ready, coming or
    /// claimed (the plan is "already coming"); else the first parked one that nothing holds,
    /// else the first stopped or failed one, else the first instance (whose state then says
    /// `Later`). Only instances within `replicas` count.
    pub(crate) fn unit_to_bring_up(&self, dep: &str) -> Option<String> {
        let replicas = self.deps.get(dep).map_or(1, |d| d.rec.doc.replicas());
        if self.units_of(dep).any(|u| u.index < replicas && u.up()) {
            return None;
        }
        Some(self.next_to_bring_up(dep, replicas, |_| true))
    }

    /// Of deployment `dep`'s instances within `replicas` that nothing holds (no operation, no
    /// reservation) and that `may` come up, the one to bring up first: a parked one (a wake
    /// is quicker than a start), else the lowest index; the first instance when there is none
    /// (its state then says `Later` or "already coming").
    fn next_to_bring_up(&self, dep: &str, replicas: u32, may: impl Fn(&Dep) -> bool) -> String {
        self.units_of(dep)
            .filter(|u| u.index < replicas && !u.busy && u.reserved.is_none() && may(u))
            .min_by_key(|u| (u.state != InstanceState::Parked, u.index))
            .map_or_else(|| dep.to_string(), |u| u.id().to_string())
    }

    /// The instance of deployment `dep` an operator's `start --evict` brings up next: one that
    /// is not up while fewer than the instances a start runs (`replicas`, or `scale.min`, at
    /// least one) are ready or on their way; `None` once they are. One instance: as
    /// [`State::unit_to_bring_up`].
    pub(crate) fn unit_to_fill(&self, dep: &str) -> Option<String> {
        let Some(first) = self.deps.get(dep) else {
            return Some(dep.to_string());
        };
        let replicas = first.rec.doc.replicas();
        if replicas == 1 {
            return self.unit_to_bring_up(dep);
        }
        let (wanted, up) = self.filled(dep);
        if up >= wanted {
            return None;
        }
        Some(self.next_to_bring_up(dep, replicas, |u| {
            u.claim.is_none()
                && matches!(
                    u.state,
                    InstanceState::Parked
                        | InstanceState::Stopped
                        | InstanceState::Failed
                        | InstanceState::AwaitingMeasurement
                )
        }))
    }

    /// How many of deployment `dep`'s instances an operator's start wants up, and how many
    /// are ready or on their way.
    pub(crate) fn filled(&self, dep: &str) -> (usize, usize) {
        let Some(first) = self.deps.get(dep) else {
            return (0, 0);
        };
        let replicas = first.rec.doc.replicas();
        let wanted = first
            .rec
            .doc
            .scale()
            .map_or(replicas, |s| s.min.max(1))
            .min(replicas) as usize;
        let up = self
            .units_of(dep)
            .filter(|u| u.index < replicas)
            .filter(|u| u.up())
            .count();
        (wanted, up)
    }

    /// Begins taking `id` down: `Ok(Some(true))` ready (drain first),
    /// `Ok(Some(false))` parked, or failed with an engine that could not be stopped
    /// ([`Dep::keeps_engine`]): stop directly; `Ok(None)` nothing runs.
    pub(crate) fn begin_down(
        &mut self,
        id: &str,
        rid: &str,
        now: Instant,
    ) -> Result<Option<bool>, ApiError> {
        self.command_refusal(id, now)?;
        let d = self.deps.get_mut(id).ok_or_else(|| not_found(id))?;
        if d.busy || d.reserved.is_some() || d.claim.is_some() {
            return Err(ApiError::Conflict {
                detail: format!(
                    "deployment {} is {} now; try again once that has finished",
                    d.name(),
                    views::shown_state(d)
                ),
            });
        }
        d.rec.pending_start = false;
        let down = match d.state {
            InstanceState::Ready => Some(true),
            InstanceState::Parked => Some(false),
            // Failed with an engine that could not be stopped: stopped again (it holds its
            // memory in the books until a stop succeeds).
            InstanceState::Failed if d.keeps_engine() => Some(false),
            _ => return Ok(None),
        };
        // Reserved like a switch's victim: nothing else wakes, plans or stops it meanwhile.
        d.reserved = Some(rid.into());
        self.reservations.insert(
            rid.to_string(),
            Reservation {
                target: None,
                victims: vec![id.to_string()],
                ..Reservation::default()
            },
        );
        Ok(down)
    }
}
