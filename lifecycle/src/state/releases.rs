//! The rules of a release (a park or a stop after a drain) and of the idle timer's take-down:
//! the instance shown drained, marked busy, its outcome written, or served again. Each is one
//! call of the owner; the host agent's park or stop runs between two of them (see
//! `release.rs`).

use std::net::SocketAddr;

use capyctl_interfaces::router::InstanceKey;
use capyctl_interfaces::tier::ParkTier;
use capyctl_spec::InstanceState;
use capyctl_spec::api::Released;
use tokio::time::Instant;

use super::State;

/// An instance whose park or stop began ([`State::begin_release`]).
#[derive(Debug)]
pub(crate) struct Releasing {
    /// Its instance ID, as its host agent knows it.
    pub(crate) instance: String,
    /// Its key, to tell the router it is gone.
    pub(crate) key: InstanceKey,
    /// It was parked already: it stops.
    pub(crate) parked: bool,
    /// It stops for want of room to keep it parked, where it would otherwise park: its stop
    /// is written `stopped (no room to park)` ([`DownDone::Stopped`]).
    pub(crate) for_room: bool,
    /// It was failed with an engine that could not be stopped ([`super::Dep::keeps_engine`]):
    /// this stop tries again, and an agent that no longer knows the engine has none to stop.
    pub(crate) kept: bool,
    /// Its deployment's name and engine (for the switch record).
    pub(crate) name: String,
    pub(crate) engine: &'static str,
}

/// How a park or stop ended ([`State::down_done`]).
#[derive(Debug, Clone)]
pub(crate) enum DownDone {
    /// Parked, in `tier`, holding `gpu_held` bytes of GPU memory (when the agent knows).
    Parked {
        tier: ParkTier,
        gpu_held: Option<u64>,
    },
    /// Stopped (`Released::Stopped`, or `StoppedNoRoomToPark`).
    Stopped(Released),
    /// The park or stop failed: the error, and how the stop of its engine went (the release's
    /// own stop, when it stopped; the one after a park that failed): `Err` with the agent's
    /// error when the engine could not be stopped, and may still hold its GPU memory.
    Failed {
        error: String,
        stopped: Result<(), String>,
    },
}

impl State {
    /// Stamps `now` as unit `id`'s last use (see [`super::Dep::touch`]): an idle timer that
    /// could not act starts over.
    pub(crate) fn touch(&mut self, id: &str, now: Instant) {
        if let Some(d) = self.deps.get_mut(id) {
            d.touch(now);
        }
    }

    /// Shows the drained instances `ids` as `shown` (`closed`, or `parking` for an operator's
    /// park) while their drain runs. The keys of those that exist.
    pub(crate) fn show_draining(
        &mut self,
        ids: &[String],
        shown: InstanceState,
    ) -> Vec<InstanceKey> {
        ids.iter()
            .filter_map(|id| {
                let d = self.deps.get_mut(id)?;
                d.state = shown;
                Some(d.key(&self.host_id))
            })
            .collect()
    }

    /// The drain of `ids` was refused or timed out: those still shown `shown` serve again.
    pub(crate) fn drain_refused(&mut self, ids: &[String], shown: InstanceState) {
        for id in ids {
            if let Some(d) = self.deps.get_mut(id)
                && d.state == shown
            {
                d.state = InstanceState::Ready;
            }
        }
    }

    /// Begins the park (or, with `stop` or when it is parked already, the stop) of drained
    /// instance `id`: busy, `parking` or `stopping`. `for_room`: it stops for want of room to
    /// keep it parked, which is said of it only when it would otherwise park (parked already,
    /// or a model that parks). `None` when `id` is gone.
    pub(crate) fn begin_release(
        &mut self,
        id: &str,
        stop: bool,
        for_room: bool,
    ) -> Option<Releasing> {
        let d = self.deps.get_mut(id)?;
        let parked = d.state == InstanceState::Parked;
        let kept = d.keeps_engine();
        let for_room = for_room && (parked || d.parks());
        d.busy = true;
        d.state = if stop || parked {
            InstanceState::Stopping
        } else {
            InstanceState::Parking
        };
        Some(Releasing {
            instance: d.instance_id(),
            key: d.key(&self.host_id),
            parked,
            for_room,
            kept,
            name: d.name().to_string(),
            engine: d.engine().as_str(),
        })
    }

    /// Writes how the park or stop of `id` ([`State::begin_release`]) ended, at `now`:
    /// `parked` (with its tier and what it still holds of the GPU), `stopped` (saying so in its
    /// status when it was for want of room to park: the agent's answer, or a stop
    /// [`Releasing::for_room`]), or `failed` with the error (and, when its engine could not be
    /// stopped, that error too: the books count its memory until a stop succeeds). Its last use
    /// is `now`. The one rule, and one turn, that writes the outcome of a release.
    pub(crate) fn down_done(&mut self, id: &str, done: DownDone, now: Instant) {
        let Some(d) = self.deps.get_mut(id) else {
            return;
        };
        d.busy = false;
        d.touch(now);
        match done {
            DownDone::Parked { tier, gpu_held } => {
                d.tier = Some(tier);
                d.parked_gpu = gpu_held;
                d.state = InstanceState::Parked;
            }
            DownDone::Stopped(r) => {
                d.ended_stop_failed = None;
                d.state = InstanceState::Stopped;
                d.tier = None;
                d.addr = None;
                d.pid = None;
                if r == Released::StoppedNoRoomToPark {
                    d.last_error = Some(Released::StoppedNoRoomToPark.status_line());
                }
            }
            // An engine that could not be stopped keeps its memory in the books
            // ([`super::Dep::keeps_engine`]) until a stop succeeds or it is seen gone.
            DownDone::Failed { error, stopped } => {
                let why = match &stopped {
                    Err(stop) if *stop != error => {
                        format!(
                            "park or stop failed: {error}, and stopping the engine failed: {stop}"
                        )
                    }
                    _ => format!("park or stop failed: {error}"),
                };
                d.fail(why, now);
                d.ended_stop_failed = stopped.err().map(String::into_boxed_str);
            }
        }
    }

    /// Serves drained instance `id` again (a park refused before it began): ready, not busy.
    /// Its key and address to announce; `None` when it is gone or has no address.
    pub(crate) fn serve_again(&mut self, id: &str) -> Option<(InstanceKey, SocketAddr)> {
        let d = self.deps.get_mut(id)?;
        d.busy = false;
        d.state = InstanceState::Ready;
        Some((d.key(&self.host_id), d.addr?))
    }

    /// Ends the idle timer's take-down of `id` (reserved by `rid`): the reservation is
    /// released and, when it `failed`, its last use is `now` (its timer starts over).
    pub(crate) fn idle_down_done(&mut self, id: &str, rid: &str, failed: bool, now: Instant) {
        self.release_reservation(rid);
        if failed {
            self.touch(id, now);
        }
    }
}
