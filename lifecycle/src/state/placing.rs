//! Placement on hosts and GPUs: where an instance would go, and which victims make room (the
//! rules of `state.rs` call it).

use std::collections::BTreeSet;
use std::sync::Arc;

use capyctl_interfaces::inventory::GpuInfo;
use capyctl_interfaces::router::InstanceKey;
use capyctl_spec::{Activation, InstanceState};
use tokio::time::Instant;

use crate::placement::{
    Fit, GpuChoice, GpuPlacement, Hold, Holder, choose_gpus, gpu_share, place, rank_of,
    victim_order,
};

use super::held::HostHeld;
use super::{Dep, Host, Requests, State, dep_of_unit};

/// Whom a placement may name as victims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Victims {
    /// Nobody: a start without `--evict` (and a pending one) waits for memory instead.
    None,
    /// Idle ready instances and parked engines, and starts or wakes in progress that no
    /// request waits for and no operator asked for ([`Dep::operator_up`]): a request's switch.
    /// A start that hangs once its requests gave up is then ended (its engine stopped, as a
    /// stop ends it) for another model's requests, without an operator.
    Idle,
    /// Those, and the operator's starts or wakes in progress that no request waits for
    /// (`start --evict`): they are ended, their engines stopped.
    IdleAndBringUps,
}

/// Where [`State::place_target`] would put an instance: the host (`None` when it fits nowhere
/// now), and the GPUs there (empty: the host as a whole).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Placed {
    pub(crate) host: Option<String>,
    pub(crate) gpus: Vec<u32>,
}

/// How good a host is for a placement, lower first: [`rank_of`]'s kind of fit, the highest
/// priority among its victims (DESIGN 4.10: lower priorities go first; `i32::MIN` without
/// victims), whether an instance of the same deployment holds memory there, then `rank_of`'s
/// bytes.
type HostRank = (u8, i32, u8, u64);

/// The highest priority among the victims `fit` names of `holders` (`i32::MIN`: none).
fn victims_priority(fit: &Fit, holders: &[Holder<'_>]) -> i32 {
    match fit {
        Fit::After(v) | Fit::AfterStopping(v) => holders
            .iter()
            .filter(|h| v.iter().any(|id| id == h.id))
            .map(|h| h.priority)
            .max()
            .unwrap_or(i32::MIN),
        _ => i32::MIN,
    }
}

/// `d`'s share of its memory on one GPU of `cap` bytes, over `want` GPUs (unknown: the whole
/// GPU).
fn gpu_need(d: &Dep, cap: u64, want: usize) -> u64 {
    d.measurement
        .gpu_memory
        .map_or(cap, |m| m.bytes.div_ceil(want as u64))
}

/// Why nothing is placed on the drained `hosts`.
pub(crate) fn cordoned_words(hosts: &[&str]) -> String {
    let (which, them) = match hosts {
        [one] => (format!("host {one} is"), format!("host {one}")),
        _ => (
            format!("every host ({}) is", hosts.join(", ")),
            "one of them".to_string(),
        ),
    };
    format!("{which} drained and out of service; `capyctl uncordon host` puts {them} back")
}

impl State {
    /// The key of `d`'s instance on `host`.
    pub(crate) fn key_of(d: &Dep, host: &str) -> InstanceKey {
        InstanceKey {
            deployment: d.rec.id.clone(),
            index: d.index,
            host_id: host.to_string(),
            generation: d.rec.generation,
        }
    }

    /// "A model is explicit when its deployment or any host it may run on says so."
    pub(crate) fn explicit(&self, d: &Dep) -> bool {
        d.rec.doc.activation() == Activation::Explicit || self.any_host_explicit
    }

    /// Where `target` fits: on the host its instance is bound to (parked there, say), or on the
    /// best of all hosts: one with room now (the fullest that fits: large models keep room
    /// elsewhere), else the one needing the fewest victim bytes, else `Later` where some host
    /// could take it once memory frees. `Never` only when no host can ever take it.
    /// `requests` is the router's record of requests: which victims go first (the longest
    /// idle, those that run nothing); a placement that names none (`Victims::None`) reads
    /// nothing of it.
    pub(crate) fn place_target(
        &mut self,
        target: &str,
        protected: &BTreeSet<String>,
        victims: Victims,
        requests: &dyn Requests,
        now: Instant,
    ) -> (Placed, Fit) {
        let (host, gpus, fit) = self.place_target_gpus(target, protected, victims, requests, now);
        (Placed { host, gpus }, fit)
    }

    /// [`State::place_target`], with the GPUs chosen on the host (empty: the host as a whole).
    fn place_target_gpus(
        &mut self,
        target: &str,
        protected: &BTreeSet<String>,
        victims: Victims,
        requests: &dyn Requests,
        now: Instant,
    ) -> (Option<String>, Vec<u32>, Fit) {
        self.settle_held();
        let Some(d) = self.deps.get(target) else {
            return (
                None,
                Vec::new(),
                Fit::Never(format!("deployment {target} is not known")),
            );
        };
        let bound = d.bound_host();
        let mut best: Option<(HostRank, &String, Fit)> = None;
        let mut never = Vec::new();
        // Bound: its host only. NB: each host's holders come from the holders' index
        // (`holding`, settled above), so a placement reads the hosts and what holds memory on
        // them, never every deployment per host, nor every one that ever ran there.
        // A drained host (cordoned) takes nothing: a deployment bound to one waits until the
        // drain has stopped it (then it may go elsewhere), and one free to go anywhere goes
        // elsewhere; nowhere else to go is said at once.
        if bound.is_some_and(|b| self.cordoned.contains(b)) {
            return (None, Vec::new(), Fit::Later);
        }
        if bound.is_none()
            && !self.hosts.is_empty()
            && self.hosts.keys().all(|h| self.cordoned.contains(h))
        {
            let all: Vec<&str> = self.hosts.keys().map(String::as_str).collect();
            return (None, Vec::new(), Fit::Never(cordoned_words(&all)));
        }
        let candidates = || -> Box<dyn Iterator<Item = (&String, &Arc<Host>)>> {
            match bound {
                Some(b) => Box::new(self.hosts.get_key_value(b).into_iter()),
                None => Box::new(
                    self.hosts
                        .iter()
                        .filter(|(id, _)| !self.cordoned.contains(*id)),
                ),
            }
        };
        // Instances go to hosts that run none of their deployment's yet, where they can: among
        // hosts with the same kind of fit (room now, victims, later), one that does ranks
        // after every one that does not.
        // Read once, not per host: with 10,000 hosts a look-up per host was most of a plan.
        let sibling_hosts: Vec<&str> = self
            .units_of(&d.rec.id)
            .filter(|u| u.id() != d.id() && u.holds_gpu())
            .filter_map(|u| u.host.as_deref())
            .collect();
        let siblings_on = |host: &str| sibling_hosts.contains(&host);
        let mut best_gpus: Vec<u32> = Vec::new();
        let want = d.rec.doc.gpus_per_instance() as usize;
        // A host whose GPUs are listed has too few (one whose GPUs are not listed is taken as
        // it says).
        let too_few = |host: &Host| !host.gpus.is_empty() && want > host.gpus.len();
        // First from the held sums alone: where it fits now, nothing else ranks better (room
        // now ranks first), so the holders are read only when it fits now nowhere.
        let mut now_best: Option<(HostRank, &String, Vec<u32>)> = None;
        // The candidates come in ascending order of ID: their sums are walked along with them.
        let mut held = self.gpu_held.in_order();
        for (id, host) in candidates() {
            if too_few(host) {
                continue;
            }
            if let Some((gpus, rank)) = self.fits_now_held(d, id, host, held.get(id)) {
                let rank = (rank.0, i32::MIN, u8::from(siblings_on(id)), rank.1);
                if now_best.as_ref().is_none_or(|(r, _, _)| rank < *r) {
                    now_best = Some((rank, id, gpus));
                }
            }
        }
        if let Some((_, id, gpus)) = now_best {
            return (Some(id.clone()), gpus, Fit::Now);
        }
        for (id, host) in candidates() {
            if too_few(host) {
                never.push((
                    id,
                    format!(
                        "it needs {want} GPUs (gpus_per_instance) and the host has {}",
                        host.gpus.len()
                    ),
                ));
                continue;
            }
            let holders = self.holders(id, target, protected, victims, requests, now);
            let (gpus, fit, rank) = if host.gpus.len() > 1 {
                let evict = victims != Victims::None;
                match self.place_on_gpus(d, id, host, &holders, evict, requests) {
                    Ok(placed) => placed,
                    Err(why) => {
                        never.push((id, why));
                        continue;
                    }
                }
            } else {
                let need = d.need(host.capacity);
                let fit = place(host.capacity, need, &holders, victims != Victims::None);
                let Some(rank) = rank_of(&fit, host.capacity, need, &holders) else {
                    if let Fit::Never(why) = fit {
                        never.push((id, why));
                    }
                    continue;
                };
                (Vec::new(), fit, rank)
            };
            let rank = (
                rank.0,
                victims_priority(&fit, &holders),
                u8::from(siblings_on(id)),
                rank.1,
            );
            if best.as_ref().is_none_or(|(r, _, _)| rank < *r) {
                best = Some((rank, id, fit));
                best_gpus = gpus;
            }
        }
        match best {
            Some((_, id, fit)) => (Some(id.clone()), best_gpus, fit),
            None if never.is_empty() => (
                None,
                Vec::new(),
                Fit::Never(match bound {
                    Some(b) => format!("its host {b} is not known"),
                    None => "no host is known".to_string(),
                }),
            ),
            None if self.hosts.len() == 1 => (None, Vec::new(), Fit::Never(never.remove(0).1)),
            None => (
                None,
                Vec::new(),
                Fit::Never(
                    never
                        .iter()
                        .map(|(h, why)| format!("on host {h}: {why}"))
                        .collect::<Vec<_>>()
                        .join("; "),
                ),
            ),
        }
    }

    /// Where `d`'s instance fits on the GPUs of `host` (a host with several): on
    /// `gpus_per_instance` GPUs that run no other instance of its deployment (the ones it is
    /// bound to, when parked there), each taking its share of the instance's memory, chosen
    /// as a host is (room now, the fullest that fits; else the fewest victim bytes). `holders`
    /// are the host's; one whose GPUs are not known counts on every GPU. `Err` says why it
    /// never fits there.
    pub(super) fn place_on_gpus(
        &self,
        d: &Dep,
        host_id: &str,
        host: &Host,
        holders: &[Holder<'_>],
        evict: bool,
        requests: &dyn Requests,
    ) -> Result<GpuPlacement, String> {
        // NB: `want` is at most the host's GPUs (`place_target_gpus`).
        let want = d.rec.doc.gpus_per_instance() as usize;
        let (open, taken) = self.open_gpus(d, host_id, host);
        let gpus_of = |id: &str| -> &[u32] { self.deps.get(id).map_or(&[], |h| h.gpus.as_slice()) };
        // Each GPU that may take it: its index, the fit there, its rank, whether a victim it
        // names runs requests now (the router's count: a deployment's last use is every one of
        // its instances'), and how long they have been idle; among equal ranks the victims
        // that run nothing, then the longest idle, go first.
        let mut each: Vec<GpuChoice<'_>> = Vec::new();
        let mut never = Vec::new();
        for gpu in open {
            let cap = gpu.total_bytes;
            let need = gpu_need(d, cap, want);
            let on_gpu: Vec<Holder<'_>> = holders
                .iter()
                .filter_map(|h| {
                    let theirs = gpus_of(h.id);
                    let bytes = gpu_share(h.bytes, theirs, gpu.index, cap)?;
                    let n = theirs.len().max(1) as u64;
                    Some(Holder {
                        bytes,
                        keeps: h.keeps / n,
                        ..h.clone()
                    })
                })
                .collect();
            let fit = place(cap, need, &on_gpu, evict);
            let idle = victim_order(&fit, &on_gpu, |id| {
                self.deps
                    .get(id)
                    .is_some_and(|u| Self::runs_requests(u, requests))
            });
            match rank_of(&fit, cap, need, &on_gpu) {
                Some(rank) => each.push((gpu.index, fit, rank, idle, (cap, need, on_gpu))),
                None => {
                    if let Fit::Never(why) = fit {
                        never.push(format!("GPU {}: {why}", gpu.index));
                    }
                }
            }
        }
        if each.len() < want {
            let free = each.len();
            return Err(if never.is_empty() || taken + free >= want {
                format!(
                    "its other instances already run on {} of the host's {} GPUs, and each instance needs GPUs of its own",
                    taken,
                    host.gpus.len()
                )
            } else {
                never.join("; ")
            });
        }
        Ok(choose_gpus(each, want))
    }

    /// The GPUs of `host` (one of several GPUs) that `d`'s instance may take: the ones it is
    /// bound to when parked there, else those no other instance of its deployment is bound to;
    /// and how many GPUs those others are bound to there.
    fn open_gpus<'h>(&self, d: &Dep, host_id: &str, host: &'h Host) -> (Vec<&'h GpuInfo>, usize) {
        let bound: &[u32] = if d.bound_host().is_some() {
            &d.gpus
        } else {
            &[]
        };
        let taken: BTreeSet<u32> = self
            .units_of(&d.rec.id)
            // NB: bound there, not only holding memory: a parked sibling whose residue is not
            // known still wakes on its GPUs.
            .filter(|u| u.id() != d.id() && u.bound_host() == Some(host_id))
            .flat_map(|u| u.gpus.iter().copied())
            .collect();
        let open = host
            .gpus
            .iter()
            .filter(|gpu| {
                if bound.is_empty() {
                    !taken.contains(&gpu.index)
                } else {
                    bound.contains(&gpu.index)
                }
            })
            .collect();
        (open, taken.len())
    }

    /// [`State::fits_now_held`] with `host_id`'s sums looked up.
    #[cfg(test)]
    pub(super) fn fits_now(
        &self,
        d: &Dep,
        host_id: &str,
        host: &Host,
    ) -> Option<(Vec<u32>, (u8, u64))> {
        self.fits_now_held(d, host_id, host, self.gpu_held.hosts.get(host_id))
    }

    /// Where `d`'s instance fits now on `host`, from the held sums alone ([`State::gpu_held`],
    /// never the holders): the GPUs there (empty: the host as a whole) and the rank
    /// ([`rank_of`]'s for `Fit::Now`); `None` when it does not fit now. The same answer as
    /// [`place`] (and [`choose_gpus`]) on the holders when they say `Now`. `held`: the held
    /// sums of `host_id`, already found (`None`: it holds nothing).
    fn fits_now_held(
        &self,
        d: &Dep,
        host_id: &str,
        host: &Host,
        held: Option<&HostHeld>,
    ) -> Option<(Vec<u32>, (u8, u64))> {
        let room_now = |cap: u64, need: u64, used: u64| {
            let free = cap.saturating_sub(used);
            (need <= cap && free >= need).then(|| (0, free - need))
        };
        if host.gpus.len() <= 1 {
            let need = d.need(host.capacity);
            let used = self.gpu_held.on_held(held, host_id, None, d.id());
            return room_now(host.capacity, need, used).map(|rank| (Vec::new(), rank));
        }
        let want = d.rec.doc.gpus_per_instance() as usize;
        let (open, _) = self.open_gpus(d, host_id, host);
        let each: Vec<GpuChoice<'_>> = open
            .into_iter()
            .filter_map(|gpu| {
                let cap = gpu.total_bytes;
                let need = gpu_need(d, cap, want);
                let used = self
                    .gpu_held
                    .on_held(held, host_id, Some(gpu.index), d.id());
                let rank = room_now(cap, need, used)?;
                let order = (
                    i32::MIN,
                    false,
                    std::cmp::Reverse(std::time::Duration::ZERO),
                );
                Some((gpu.index, Fit::Now, rank, order, (cap, need, Vec::new())))
            })
            .collect();
        if each.len() < want {
            return None;
        }
        let (gpus, _, rank) = choose_gpus(each, want);
        Some((gpus, rank))
    }

    /// The GPU holders of `host` as placement sees them, for bringing up `target`; how long
    /// each has been idle at `now` by the router's record of requests (`requests`).
    pub(crate) fn holders<'a>(
        &'a self,
        host: &'a str,
        target: &str,
        protected: &BTreeSet<String>,
        victims: Victims,
        requests: &dyn Requests,
        now: Instant,
    ) -> Vec<Holder<'a>> {
        let capacity = self.hosts.get(host).map_or(0, |h| h.capacity);
        let target_dep = dep_of_unit(target);
        let target_priority = self.deps.get(target).map_or(0, |t| t.rec.doc.priority());
        self.holding_on(host)
            .filter(|d| d.id() != target && d.holds_gpu())
            .map(|d| {
                // NB: an explicit or warm model that is draining, parking or stopping on an
                // operator's command (reserved by it; never by a switch) is on its way out:
                // its memory frees soon, so others wait for it instead of being refused.
                let leaving = d.reserved.is_some()
                    || matches!(d.state, InstanceState::Parking | InstanceState::Stopping);
                // A parked target a switch has claimed is about to take its whole memory.
                let parked = d.state == InstanceState::Parked && d.claim.is_none();
                // A start or wake no request waits for (those with waiting requests are
                // `protected`), ended for the target (it stops): `start --evict` ends any such,
                // a request's switch those no operator asked for.
                let ends = match victims {
                    Victims::None => false,
                    Victims::Idle => !d.operator_up,
                    Victims::IdleAndBringUps => true,
                } && d.bringing_up()
                    && d.end().borrow().is_none();
                let hold = if (self.explicit(d) || d.warm()) && !leaving {
                    Hold::Pinned
                } else if d.dep_id() == target_dep {
                    // Another instance of the target's own deployment: never its victim.
                    Hold::Busy
                } else if (ends
                    || matches!(d.state, InstanceState::Ready | InstanceState::Parked) && !d.busy)
                    && d.reserved.is_none()
                    && d.claim.is_none()
                    && !protected.contains(d.dep_id())
                    // A fenced instance (adopted from a leader that may still serve it) is
                    // released only once the fence ends: meanwhile placement waits (`Later`).
                    && !self.fenced(d.id())
                {
                    Hold::Releasable
                } else {
                    Hold::Busy
                };
                // DESIGN 4.10: never parked or stopped for a lower priority (a placement that
                // names no victims parks nothing, and waits as before).
                let priority = d.rec.doc.priority();
                let hold = if hold != Hold::Pinned
                    && victims != Victims::None
                    && priority > target_priority
                    && !leaving
                {
                    Hold::Outranks
                } else {
                    hold
                };
                Holder {
                    id: d.id(),
                    name: d.name(),
                    bytes: d.held_bytes(capacity),
                    hold,
                    idle_for: now.saturating_duration_since(Self::used_at(d, requests)),
                    parked,
                    keeps: if parked || ends {
                        0
                    } else {
                        d.residue_if_parked()
                    },
                    priority,
                }
            })
            .collect()
    }
}
