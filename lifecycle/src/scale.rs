//! Replicas, as a pure policy: how many instances of a deployment in use should run, and which
//! one to bring up or take down next ([`decide`]). The server runs it on every timer tick and
//! after each bring-up (`Core::scale_run`), with the router's load; the bring-ups it asks for
//! take free room only (they never name victims: "as room allows"), and the instances it takes
//! down are drained through the router like any release (an instance whose deployment keeps
//! another open has no admission window there).
//!
//! The rules (DESIGN 4.7):
//! - Nothing while no instance of the deployment is ready or on its way: the first comes with
//!   a request or an operator's start, as for one instance.
//! - Without `scale`: every one of `replicas` runs while the deployment is in use.
//! - With `scale`: between `min` and `replicas`. One more is brought up when the requests
//!   (running plus waiting at the router) per ready instance pass `target_in_flight`, one at a
//!   time (not while another is on its way). One is taken down once the load has stayed, for
//!   `scale_down_delay`, where the instances left would still be at or below the target:
//!   `load <= target x (ready - 1)` (read literally, "below the target per ready instance"
//!   takes one down as soon as the load is under the target, and the next request wave brings
//!   it back: a flap). With `min: 0` the last instance goes once there has been no load for
//!   the delay.
//! - Instances past `replicas` (it was lowered) are stopped first, one at a time.

use capyctl_spec::InstanceState;
use capyctl_spec::documents::Scale;
use tokio::time::Instant;

/// One instance, as the policy reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct UnitInfo {
    /// Its key in the lifecycle's state.
    pub unit: String,
    pub index: u32,
    pub state: InstanceState,
    /// An operation is in progress, or a switch or release has reserved or claimed it.
    pub held: bool,
    /// A switch has claimed it: it is on its way.
    pub claimed: bool,
}

impl UnitInfo {
    /// Ready and staying: one reserved by a switch or a release is on its way out.
    fn ready(&self) -> bool {
        self.state == InstanceState::Ready && !self.held
    }

    fn coming(&self) -> bool {
        matches!(self.state, InstanceState::Starting | InstanceState::Waking) || self.claimed
    }
}

/// What the policy reads of one deployment.
#[derive(Debug, Clone)]
pub(crate) struct Input<'a> {
    pub replicas: u32,
    pub scale: Option<Scale>,
    /// An operator stopped it: nothing is brought up.
    pub stopped: bool,
    /// Its instances, in index order.
    pub units: &'a [UnitInfo],
    /// Requests running on it now (the router's count).
    pub in_flight: usize,
    /// Requests waiting for it at the router.
    pub waiting: usize,
    /// Since when the load has allowed one fewer instance (kept by the caller between runs).
    pub below_since: Option<Instant>,
}

/// What to do next for one deployment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Nothing now.
    Nothing,
    /// Bring one of these instances up (wake it, or start it), into free room: the first
    /// that has room now (a parked one can wake only where it parked, and another model may
    /// have taken that GPU meanwhile: then the next is tried).
    Up(Vec<String>),
    /// Take this ready instance down (park it; `stop`: stop it, an instance past `replicas`).
    Down { unit: String, stop: bool },
}

/// The policy's answer: the decision, and the new `below_since`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Answer {
    pub decision: Decision,
    pub below_since: Option<Instant>,
}

/// Decides on one deployment at `now` (see the module's rules).
pub(crate) fn decide(input: &Input<'_>, now: Instant) -> Answer {
    let nothing = |below_since| Answer {
        decision: Decision::Nothing,
        below_since,
    };
    let replicas = input.replicas;
    // Past `replicas`: stopped first, whatever the load (parked ones too).
    if let Some(u) = input.units.iter().find(|u| {
        u.index >= replicas
            && !u.held
            && matches!(u.state, InstanceState::Ready | InstanceState::Parked)
    }) {
        return Answer {
            decision: Decision::Down {
                unit: u.unit.clone(),
                stop: true,
            },
            below_since: None,
        };
    }
    let within: Vec<&UnitInfo> = input.units.iter().filter(|u| u.index < replicas).collect();
    let ready = within.iter().filter(|u| u.ready()).count();
    let coming = within.iter().filter(|u| u.coming()).count();
    if input.stopped || ready + coming == 0 {
        return nothing(None);
    }
    // The instances to bring up, best first: a parked one first (a wake is quicker), lowest
    // index.
    let next_up = || {
        let mut free: Vec<&&UnitInfo> = within
            .iter()
            .filter(|u| {
                !u.held
                    && matches!(
                        u.state,
                        InstanceState::Parked | InstanceState::Stopped | InstanceState::Failed
                    )
            })
            .collect();
        free.sort_by_key(|u| (u.state != InstanceState::Parked, u.index));
        free.iter().map(|u| u.unit.clone()).collect::<Vec<_>>()
    };
    let up = |below_since| {
        let units = next_up();
        if units.is_empty() {
            nothing(below_since)
        } else {
            Answer {
                decision: Decision::Up(units),
                below_since,
            }
        }
    };
    let Some(scale) = input.scale else {
        return if ready + coming < replicas as usize {
            up(None)
        } else {
            nothing(None)
        };
    };
    let load = input.in_flight + input.waiting;
    let target = scale.target_in_flight as usize;
    let min = (scale.min as usize).min(replicas as usize);
    if ready + coming < min {
        return up(None);
    }
    if coming > 0 {
        // One at a time: the load per instance is read again once it is up.
        return nothing(None);
    }
    if ready < replicas as usize && load > target * ready {
        return up(None);
    }
    let may_go = if ready > 1 {
        ready > min && load <= target * (ready - 1)
    } else {
        min == 0 && ready == 1 && load == 0
    };
    if !may_go {
        return nothing(None);
    }
    let since = input.below_since.unwrap_or(now);
    if now.saturating_duration_since(since) < scale.scale_down_delay {
        return nothing(Some(since));
    }
    // The highest index goes first, so that instance 0 (the deployment's) stays.
    match within
        .iter()
        .filter(|u| u.ready() && !u.held)
        .max_by_key(|u| u.index)
    {
        Some(u) => Answer {
            decision: Decision::Down {
                unit: u.unit.clone(),
                stop: false,
            },
            below_since: None,
        },
        None => nothing(Some(since)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const DELAY: Duration = Duration::from_secs(60);

    fn units(states: &[InstanceState]) -> Vec<UnitInfo> {
        states
            .iter()
            .enumerate()
            .map(|(i, s)| UnitInfo {
                unit: if i == 0 {
                    "d".to_string()
                } else {
                    format!("d-{i}")
                },
                index: i as u32,
                state: *s,
                held: false,
                claimed: false,
            })
            .collect()
    }

    fn scale(min: u32, target: u32) -> Option<Scale> {
        Some(Scale {
            min,
            target_in_flight: target,
            scale_down_delay: DELAY,
        })
    }

    fn input<'a>(units: &'a [UnitInfo], scale: Option<Scale>, load: usize) -> Input<'a> {
        Input {
            replicas: 4,
            scale,
            stopped: false,
            units,
            in_flight: load,
            waiting: 0,
            below_since: None,
        }
    }

    use InstanceState::{Parked, Ready, Starting, Stopped};

    #[tokio::test(start_paused = true)]
    async fn without_scale_every_replica_comes_once_one_is_in_use() {
        let now = Instant::now();
        // Not in use: nothing.
        let u = units(&[Stopped, Stopped, Stopped, Stopped]);
        assert_eq!(decide(&input(&u, None, 0), now).decision, Decision::Nothing);
        // One ready: a parked one is woken before a stopped one is started.
        let u = units(&[Ready, Stopped, Parked, Stopped]);
        assert_eq!(
            decide(&input(&u, None, 0), now).decision,
            Decision::Up(vec!["d-2".into(), "d-1".into(), "d-3".into()])
        );
        // All coming or ready: nothing; an operator's stop: nothing.
        let u = units(&[Ready, Starting, Starting, Ready]);
        assert_eq!(decide(&input(&u, None, 0), now).decision, Decision::Nothing);
        let u = units(&[Ready, Stopped, Stopped, Stopped]);
        let mut i = input(&u, None, 0);
        i.stopped = true;
        assert_eq!(decide(&i, now).decision, Decision::Nothing);
    }

    #[tokio::test(start_paused = true)]
    async fn scale_up_past_the_target_per_ready_instance_one_at_a_time() {
        let now = Instant::now();
        let u = units(&[Ready, Stopped, Stopped, Stopped]);
        // 24 per instance is the target: 24 is not past it, 25 is.
        assert_eq!(
            decide(&input(&u, scale(1, 24), 24), now).decision,
            Decision::Nothing
        );
        assert_eq!(
            decide(&input(&u, scale(1, 24), 25), now).decision,
            Decision::Up(vec!["d-1".into(), "d-2".into(), "d-3".into()])
        );
        // While one is on its way, nothing more.
        let u = units(&[Ready, Starting, Stopped, Stopped]);
        assert_eq!(
            decide(&input(&u, scale(1, 24), 90), now).decision,
            Decision::Nothing
        );
        // Waiting requests count as load.
        let u = units(&[Ready, Ready, Stopped, Stopped]);
        let mut i = input(&u, scale(1, 10), 15);
        i.waiting = 6;
        assert_eq!(
            decide(&i, now).decision,
            Decision::Up(vec!["d-2".into(), "d-3".into()])
        );
        // One being released (reserved) is not counted as staying: nothing comes for it
        // unless a free instance can.
        let mut u = units(&[Ready, Ready, Ready, Ready]);
        u[3].held = true;
        assert_eq!(decide(&input(&u, None, 0), now).decision, Decision::Nothing);
        // Never past replicas.
        let u = units(&[Ready, Ready, Ready, Ready]);
        assert_eq!(
            decide(&input(&u, scale(1, 1), 500), now).decision,
            Decision::Nothing
        );
        // Below min (2): up, whatever the load.
        let u = units(&[Ready, Stopped, Stopped, Stopped]);
        assert_eq!(
            decide(&input(&u, scale(2, 24), 0), now).decision,
            Decision::Up(vec!["d-1".into(), "d-2".into(), "d-3".into()])
        );
    }

    #[tokio::test(start_paused = true)]
    async fn scale_down_after_the_delay_when_the_others_stay_within_the_target() {
        let t0 = Instant::now();
        let u = units(&[Ready, Ready, Ready, Stopped]);
        // 3 ready, target 10: 21 would put 10.5 on each of two: not yet.
        let a = decide(&input(&u, scale(1, 10), 21), t0);
        assert_eq!(
            a,
            Answer {
                decision: Decision::Nothing,
                below_since: None
            }
        );
        // 20 fits two: the delay starts.
        let a = decide(&input(&u, scale(1, 10), 20), t0);
        assert_eq!(a.decision, Decision::Nothing);
        assert_eq!(a.below_since, Some(t0));
        // Just before the delay: still nothing; at it: the highest index goes.
        let mut i = input(&u, scale(1, 10), 20);
        i.below_since = Some(t0);
        assert_eq!(
            decide(&i, t0 + DELAY - Duration::from_millis(1)).decision,
            Decision::Nothing
        );
        let a = decide(&i, t0 + DELAY);
        assert_eq!(
            a.decision,
            Decision::Down {
                unit: "d-2".into(),
                stop: false
            }
        );
        assert_eq!(a.below_since, None);
        // A load back above the bound resets the delay.
        let mut i = input(&u, scale(1, 10), 25);
        i.below_since = Some(t0);
        assert_eq!(decide(&i, t0 + DELAY).below_since, None);
        // Never below min.
        let u = units(&[Ready, Ready, Stopped, Stopped]);
        let mut i = input(&u, scale(2, 10), 0);
        i.below_since = Some(t0);
        assert_eq!(decide(&i, t0 + DELAY).decision, Decision::Nothing);
        // min 0: the last one goes once there has been no load for the delay.
        let u = units(&[Ready, Stopped, Stopped, Stopped]);
        let mut i = input(&u, scale(0, 10), 0);
        i.below_since = Some(t0);
        assert_eq!(
            decide(&i, t0 + DELAY).decision,
            Decision::Down {
                unit: "d".into(),
                stop: false
            }
        );
        let mut i = input(&u, scale(0, 10), 1);
        i.below_since = Some(t0);
        assert_eq!(decide(&i, t0 + DELAY).decision, Decision::Nothing);
    }

    #[tokio::test(start_paused = true)]
    async fn instances_past_replicas_stop_first() {
        let now = Instant::now();
        let u = units(&[Ready, Ready, Parked, Ready]);
        let mut i = input(&u, None, 0);
        i.replicas = 2;
        assert_eq!(
            decide(&i, now).decision,
            Decision::Down {
                unit: "d-2".into(),
                stop: true
            }
        );
    }
}
