//! Background work: the owner's ticks and engine exits, the idle timers and the scaler.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, MutexGuard, PoisonError};
use std::time::Duration;

use capyctl_interfaces::agent::EngineExit;
use capyctl_interfaces::router::Router;
use capyctl_spec::api::SwitchCause;
use capyctl_spec::settings::LifecycleDefaults;
use tokio::time::Instant;

use crate::state::{State, unit_instance};
use crate::{Core, owner, scale, views};

/// What the owner's task hands back: engine exits, and the timer's ticks.
impl owner::Ticks for Core {
    /// An engine exited by itself: the instance is failed and gone (see
    /// [`State::engine_exited`]); the router hears of it, and the starts waiting for memory
    /// try again.
    fn engine_exited(&self, state: &mut State, host: String, exit: EngineExit) {
        let Some(key) = state.engine_exited(&host, &exit, Instant::now()) else {
            return;
        };
        tracing::warn!(instance = %exit.instance, status = ?exit.status, "engine exited unexpectedly");
        self.spawn(move |me| {
            Box::pin(async move {
                me.announce_gone(key).await;
                me.memory_freed();
            })
        });
    }

    /// Idle timers (once a router is attached), in a task of their own; a tick while the
    /// last one's run goes on does nothing. The load read's spare buffer goes once unused
    /// for a while (`reads::AnswerBuffer::expire`).
    fn tick(&self) {
        self.load_buffer.expire(Instant::now());
        if self.router().is_none() {
            return;
        }
        self.scale_soon();
        let Some(running) = Running::begin(&self.timers_running) else {
            return;
        };
        self.spawn(|me| {
            Box::pin(async move {
                let _running = running;
                me.idle_timers().await;
            })
        });
    }
}

/// A background run under way (the idle timers', the scaler's): its flag is set while this
/// lives and cleared when it is dropped, however the run ends. A run that panics (a rule, a
/// host agent) is dropped by its task like one that returns, so the next tick runs again.
pub(crate) struct Running(Arc<AtomicBool>);

impl Running {
    /// Sets `flag`; `None` when it was set already (a run is under way).
    fn begin(flag: &Arc<AtomicBool>) -> Option<Running> {
        (!flag.swap(true, Ordering::SeqCst)).then(|| Running(Arc::clone(flag)))
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

impl Core {
    /// Runs the scaler in a task of its own, unless a run is under way or it has nothing to do.
    ///
    /// NB (nothing to do): with no deployment of several instances (`State::replicated`) and
    /// nothing in `below_since`, a run changes nothing ([`Core::scale_run`]): it is not spawned,
    /// so a bring-up on a switch's path does not wake another worker for it (`switch_share`).
    pub(crate) fn scale_soon(&self) {
        if self.router().is_none() {
            return;
        }
        if self.read(|inner| inner.replicated.is_empty()) && self.below_since_of().is_empty() {
            return;
        }
        let Some(running) = Running::begin(&self.scaling) else {
            return;
        };
        self.spawn(|me| {
            Box::pin(async move {
                let _running = running;
                me.scale_run().await;
            })
        });
    }

    /// One run of the scaler (`scale.rs`) over the deployments with several instances: each
    /// decision (bring one more up into free room, take one down) is begun here and carried
    /// out in a task of its own, so that a start does not hold up the next run.
    async fn scale_run(&self) {
        // Instances past a lowered `replicas` that hold nothing any more (stopped below, or
        // failed) are dropped.
        let surplus = self.read(State::settled_surplus);
        if !surplus.is_empty() {
            self.write(move |inner| inner.drop_surplus(&surplus, Instant::now()))
                .await;
        }
        let now = Instant::now();
        let inputs = self.read(|inner| inner.scale_inputs(&self.uses, now));
        if inputs.is_empty() {
            self.below_since_of().clear();
            return;
        }
        let Some(router) = self.router() else { return };
        self.feed_engine_loads(router.as_ref());
        for input in inputs {
            let load = router.figures_of(&input.deployment);
            let (in_flight, waiting) = load.map_or((0, 0), |l| (l.in_flight, l.waiting));
            let below_since = self.below_since_of().get(&input.deployment).copied();
            let answer = scale::decide(
                &scale::Input {
                    replicas: input.replicas,
                    scale: input.scale,
                    stopped: input.stopped,
                    units: &input.units,
                    in_flight,
                    waiting,
                    below_since,
                },
                now,
            );
            match answer.below_since {
                Some(t) => self.below_since_of().insert(input.deployment.clone(), t),
                None => self.below_since_of().remove(&input.deployment),
            };
            match answer.decision {
                scale::Decision::Nothing => {}
                scale::Decision::Up(units) => {
                    // The first that has room now (in one owner turn: no other change comes
                    // between the tries).
                    let uses = self.uses.clone();
                    let up = self
                        .write(move |inner| inner.scale_up_first(units, &uses, Instant::now()))
                        .await;
                    let Some((unit, up)) = up else { continue };
                    tracing::info!(instance = %unit_instance(&unit), how = ?up, in_flight, waiting, "scale: one more instance");
                    self.spawn(move |me| {
                        Box::pin(async move {
                            let switch_id = me.fresh_id("scale");
                            let rec = me.switches.begin(
                                me.target_of(&unit, &switch_id, waiting),
                                SwitchCause::Scale,
                                Instant::now(),
                            );
                            let result = rec.scope(me.finish_up(&unit, up)).await;
                            rec.finish(result.as_ref().map(|_| ()), Instant::now());
                            if let Err(e) = result {
                                tracing::warn!(instance = %unit_instance(&unit), error = %e, "scale: the instance did not come up");
                            }
                        })
                    });
                }
                scale::Decision::Down { unit, stop } => {
                    let rid = self.fresh_id("scale");
                    let r = rid.clone();
                    let down = self
                        .on(&unit, move |inner, id| {
                            inner.begin_down(id, &r, Instant::now())
                        })
                        .await;
                    let Ok(down) = down else { continue };
                    tracing::info!(instance = %unit_instance(&unit), stop, in_flight, waiting, "scale: one fewer instance");
                    self.spawn(move |me| {
                        Box::pin(async move {
                            let result = me
                                .take_down_recorded(SwitchCause::Scale, &unit, &rid, down, stop)
                                .await;
                            me.write(move |inner| inner.release_reservation(&rid)).await;
                            if let Err(e) = result {
                                tracing::warn!(instance = %unit_instance(&unit), error = %e, "scale: the instance was not taken down");
                            }
                        })
                    });
                }
            }
        }
    }

    /// Tells the router each ready instance's engine waiting count, from its host's latest
    /// sample (with the sample's own time: the router counts a stale one as none), for the
    /// `least_loaded` choice among a deployment's instances.
    fn feed_engine_loads(&self, router: &dyn Router) {
        let feeds = self.read(State::engine_feeds);
        let (now, now_ms) = (Instant::now(), views::now_ms());
        for (key, agent, iid) in feeds {
            let Some(sample) = agent.sample(&iid) else {
                continue;
            };
            let Some(waiting) = sample.engine.and_then(|e| e.waiting) else {
                continue;
            };
            let age = Duration::from_millis(now_ms.saturating_sub(sample.sampled_at_ms));
            let at = now.checked_sub(age).unwrap_or(now);
            router.note_engine_load(key, usize::try_from(waiting).unwrap_or(usize::MAX), at);
        }
    }

    fn below_since_of(&self) -> MutexGuard<'_, HashMap<String, Instant>> {
        self.below_since
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Parks ready instances idle past `ready_idle_timeout` and stops parked ones idle past
    /// `parked_idle_timeout` (pressure decisions: a later request starts them again).
    async fn idle_timers(&self) {
        let LifecycleDefaults {
            ready_idle_timeout,
            parked_idle_timeout,
        } = self.config.lifecycle_defaults;
        // NB (a snapshot only narrows the candidates): the router's load says which deployments
        // are in use now, so that the timers do not ask about those; whether one is released
        // is decided by the router's coordinator on its own state (`release_if_idle`).
        // NB (at scale): each deployment's figures in turn, nothing kept (a `DeploymentLoad`
        // made per deployment each tick was some 100,000 allocations a second at 100,000).
        let mut busy = BTreeSet::new();
        if let Some(r) = self.router() {
            r.each_load(&mut |id, l| {
                self.config
                    .metrics
                    .set_queue(id, l.waiting as u64, l.in_flight as u64);
                if l.waiting > 0 || l.in_flight > 0 {
                    busy.insert(id.to_string());
                }
            });
        }
        if ready_idle_timeout.is_none() && parked_idle_timeout.is_none() {
            return;
        }
        let now = Instant::now();
        let timeouts = self.config.lifecycle_defaults;
        let due = self.read(|inner| inner.idle_due(&timeouts, &busy, &self.uses, now));
        for (id, ready) in due {
            // Checked before the drain, as an operator park is: when only explicit parked
            // copies hold host RAM the park is refused (`parked_capacity`) and the model keeps
            // serving, undisturbed; its timer starts over instead of closing it every tick.
            if ready && let Err(e) = self.make_parked_room(&id).await {
                tracing::info!(deployment = %id, error = %e, "idle timer: not parked");
                self.on(&id, |inner, id| inner.touch(id, Instant::now()))
                    .await;
                continue;
            }
            let rid = self.fresh_id("idle");
            // Decided again on the lifecycle's state it changes (the list above is a snapshot,
            // and a switch or a command may have moved the model since), and reserved; then
            // the router decides on its own state whether it is idle (`take_down_if_idle`).
            let (r, uses) = (rid.clone(), self.uses.clone());
            let down = self
                .on(&id, move |inner, id| {
                    inner.begin_idle_down(id, ready, &timeouts, &r, &uses, Instant::now())
                })
                .await;
            let Some((down, idle_since)) = down else {
                continue;
            };
            // In its own task: engine exits and the next ticks are not held up by a drain.
            self.spawn(move |me| {
                Box::pin(async move {
                    let result = me.take_down_if_idle(&id, down, idle_since).await;
                    let failed = result.is_err();
                    me.on(&id, move |inner, id| {
                        inner.idle_down_done(id, &rid, failed, Instant::now())
                    })
                    .await;
                    match result {
                        Ok(true) => tracing::info!(deployment = %id, ready, "idle timer"),
                        Ok(false) => {
                            tracing::debug!(deployment = %id, "idle timer: in use, not released");
                        }
                        Err(e) => {
                            tracing::warn!(deployment = %id, error = %e, "idle park or stop failed");
                        }
                    }
                })
            });
        }
    }
}
