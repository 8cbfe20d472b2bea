//! The GPU memory held on each host and on each of its GPUs, kept as the rules change the
//! instances, so that placement answers "it fits now" without reading every instance that
//! holds memory there (with 10,000 deployments ready on one host, each plan read all of them).
//!
//! Every write of a unit goes through [`Units`] (`State::deps`: read as the map it derefs to,
//! written only by its `get_mut`, `insert` and `remove`, which note the unit changed), so no
//! rule can change what a unit holds without its count being redone: [`State::settle_held`]
//! recounts the units changed since it last ran (subtracting what each counted before, adding
//! what it holds now) and keeps the holders' index (`State::holding`) exact. It runs before
//! every placement and at the end of every turn of the owner; a host that joins or comes back
//! (its capacity or GPUs may differ) has its units recounted ([`State::host_changed`]).
//!
//! What a unit counts is what placement reads of it as a holder (`State::holders`,
//! [`Dep::held_bytes`]; per GPU, [`crate::placement::gpu_share`]): the sums equal the sums over
//! the holders, which `state/tests/` checks after every kind of transition.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Deref;
use std::sync::Arc;

use super::{Dep, Hosts, State};

/// The units, by key ([`super::unit_id`]): the map as read, and the units written since the
/// held sums were last brought in step ([`State::settle_held`]).
#[derive(Debug, Default)]
pub(crate) struct Units {
    map: BTreeMap<String, Box<Dep>>,
    /// Written (borrowed mutably, inserted, removed) since the last [`State::settle_held`].
    changed: BTreeSet<String>,
}

impl Deref for Units {
    type Target = BTreeMap<String, Box<Dep>>;

    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl Units {
    /// Unit `id`, to write: noted changed (its held memory is counted again).
    pub(crate) fn get_mut(&mut self, id: &str) -> Option<&mut Box<Dep>> {
        let d = self.map.get_mut(id)?;
        if !self.changed.contains(id) {
            self.changed.insert(id.to_string());
        }
        Some(d)
    }

    /// Adds (or replaces) unit `id`.
    pub(crate) fn insert(&mut self, id: String, d: Box<Dep>) -> Option<Box<Dep>> {
        // NB: a new unit that is on no host holds nothing there: not noted (a document of
        // 100,000 deployments adds them all at the open).
        let counts = d.host.is_some();
        let old = self.map.insert(id.clone(), d);
        if counts || old.is_some() {
            self.changed.insert(id);
        }
        old
    }

    /// Builds the map again from its units, in order, its B-tree's nodes full. NB (memory at
    /// scale): units inserted one by one in key order (the open loads them so) leave each
    /// node split in half, some 60 bytes per unit where full nodes take some 35.
    pub(crate) fn pack(&mut self) {
        self.map = std::mem::take(&mut self.map).into_iter().collect();
    }

    /// Removes unit `id`.
    pub(crate) fn remove(&mut self, id: &str) -> Option<Box<Dep>> {
        let old = self.map.remove(id)?;
        self.changed.insert(id.to_string());
        Some(old)
    }

    /// Notes unit `id` changed (its host changed under it).
    fn mark(&mut self, id: &str) {
        if self.map.contains_key(id) && !self.changed.contains(id) {
            self.changed.insert(id.to_string());
        }
    }
}

/// What the units hold on one host.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct HostHeld {
    /// The units counted.
    pub(crate) units: usize,
    /// Bytes held on the host as a whole.
    pub(crate) total: u64,
    /// Bytes held on each of its GPUs, by index (a host of several GPUs only).
    pub(crate) gpus: BTreeMap<u32, u64>,
}

/// What one unit is counted as holding ([`HostHeld`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Counted {
    /// Its host's ID (the unit's `Dep::host`, shared).
    pub(crate) host: Arc<str>,
    pub(crate) total: u64,
    /// Its share on each GPU of its host (a host of several GPUs only).
    pub(crate) gpus: Vec<(u32, u64)>,
}

/// The held sums: per host, and what each unit counted.
///
/// NB (reads at scale): the hosts' sums are ordered by host ID, as `State::hosts` is, so that a
/// placement walks both in one pass ([`Held::in_order`]) instead of looking each host up: with
/// 10,000 hosts, hashing every host's ID was most of a first request's own time.
#[derive(Debug, Default)]
pub(crate) struct Held {
    pub(crate) hosts: BTreeMap<String, HostHeld>,
    /// By unit: the ID shared with [`State::by_host`]'s (NB: memory at scale, as there).
    pub(crate) counted: HashMap<Arc<str>, Counted>,
}

impl Held {
    fn add(&mut self, c: &Counted) {
        let h = match self.hosts.get_mut(&*c.host) {
            Some(h) => h,
            None => self.hosts.entry(c.host.to_string()).or_default(),
        };
        h.units += 1;
        h.total += c.total;
        for (gpu, bytes) in &c.gpus {
            *h.gpus.entry(*gpu).or_default() += bytes;
        }
    }

    fn subtract(&mut self, c: &Counted) {
        let Some(h) = self.hosts.get_mut(&*c.host) else {
            return;
        };
        h.units -= 1;
        h.total -= c.total;
        for (gpu, bytes) in &c.gpus {
            if let Some(b) = h.gpus.get_mut(gpu) {
                *b -= bytes;
            }
        }
        if h.units == 0 {
            self.hosts.remove(&*c.host);
        }
    }

    /// The sums of each host asked for in ascending order of host ID, found by walking
    /// [`Held::hosts`] along with the asking (a merge: no look-up per host).
    pub(crate) fn in_order(&self) -> InOrder<'_> {
        InOrder {
            rest: self.hosts.iter().peekable(),
            #[cfg(debug_assertions)]
            last: None,
        }
    }

    /// Bytes held on `host` (on its GPU `gpu`, when given), less what unit `but` holds there.
    #[cfg(test)]
    pub(crate) fn on(&self, host: &str, gpu: Option<u32>, but: &str) -> u64 {
        self.on_held(self.hosts.get(host), host, gpu, but)
    }

    /// [`Held::on`] with `host`'s sums, `held` (`None`: it holds nothing), already found.
    pub(crate) fn on_held(
        &self,
        held: Option<&HostHeld>,
        host: &str,
        gpu: Option<u32>,
        but: &str,
    ) -> u64 {
        let Some(h) = held else {
            return 0;
        };
        let of = |c: &Counted| match gpu {
            None => c.total,
            Some(g) => c.gpus.iter().find(|(i, _)| *i == g).map_or(0, |(_, b)| *b),
        };
        let all = match gpu {
            None => h.total,
            Some(g) => h.gpus.get(&g).copied().unwrap_or(0),
        };
        let own = self
            .counted
            .get(but)
            .filter(|c| &*c.host == host)
            .map_or(0, of);
        all - own
    }
}

/// [`Held::in_order`]'s walk.
pub(crate) struct InOrder<'a> {
    rest: std::iter::Peekable<std::collections::btree_map::Iter<'a, String, HostHeld>>,
    /// The last host asked (debug builds check the order).
    #[cfg(debug_assertions)]
    last: Option<String>,
}

impl<'a> InOrder<'a> {
    /// The sums of `host` (`None`: it holds nothing). Asked in ascending order of host ID
    /// (each look-up moves on from the last: no compare once every held host is passed).
    /// NB: a host asked out of order is not found; debug builds panic on it.
    pub(crate) fn get(&mut self, host: &str) -> Option<&'a HostHeld> {
        #[cfg(debug_assertions)]
        {
            assert!(
                self.last.as_deref().is_none_or(|l| l < host),
                "hosts asked out of order: {host} after {:?}",
                self.last
            );
            self.last = Some(host.to_string());
        }
        while let Some((h, held)) = self.rest.next_if(|(h, _)| h.as_str() <= host) {
            if h == host {
                return Some(held);
            }
        }
        None
    }
}

/// What unit `d` holds, as placement counts it: `None` unless it is on a host and holds GPU
/// memory there (`Dep::holds_gpu`).
pub(crate) fn counted(d: &Dep, hosts: &Hosts) -> Option<Counted> {
    let host = d.host.as_ref()?;
    if !d.holds_gpu() {
        return None;
    }
    let h = hosts.get(&**host);
    let capacity = h.map_or(0, |h| h.capacity);
    let total = d.held_bytes(capacity);
    let gpus = match h {
        Some(h) if h.gpus.len() > 1 => h
            .gpus
            .iter()
            .filter_map(|g| {
                crate::placement::gpu_share(total, &d.gpus, g.index, g.total_bytes)
                    .map(|b| (g.index, b))
            })
            .collect(),
        _ => Vec::new(),
    };
    Some(Counted {
        host: Arc::clone(host),
        total,
        gpus,
    })
}

impl State {
    /// Brings the held sums (and the holders' index, `holding`) in step with the units
    /// written since it last ran: each is counted again. Run before every placement and at
    /// the end of every turn of the owner; costs what changed, not what holds memory.
    pub(crate) fn settle_held(&mut self) {
        if self.deps.changed.is_empty() {
            return;
        }
        for id in std::mem::take(&mut self.deps.changed) {
            let old = self.gpu_held.counted.remove(id.as_str());
            if let Some(old) = &old {
                self.gpu_held.subtract(old);
            }
            let now = self.deps.get(&id).and_then(|d| counted(d, &self.hosts));
            let host = self.deps.get(&id).and_then(|d| d.host.clone());
            // The ID as the by-host index holds it (a unit counted is bound there).
            let shared = |host: &str| {
                self.by_host
                    .get(host)
                    .and_then(|ids| ids.get(id.as_str()))
                    .map_or_else(|| Arc::from(id.as_str()), Arc::clone)
            };
            // The holders' index: exactly the units counted on each host.
            for h in [old.map(|c| c.host), host].into_iter().flatten() {
                if now.as_ref().is_some_and(|c| c.host == h) {
                    super::index(&mut self.holding, &h, &id, || shared(&h));
                } else {
                    super::unindex(&mut self.holding, &h, &id);
                }
            }
            if let Some(c) = now {
                self.gpu_held.add(&c);
                let key = shared(&c.host);
                self.gpu_held.counted.insert(key, c);
            }
        }
    }

    /// Host `host` joined or came back (its capacity or GPUs may differ): what its units hold
    /// is counted again at the next [`State::settle_held`].
    pub(crate) fn host_changed(&mut self, host: &str) {
        let ids: Vec<String> = self
            .holding
            .get(host)
            .into_iter()
            .flatten()
            .map(|id| id.to_string())
            .collect();
        for id in ids {
            self.deps.mark(&id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Held, HostHeld};

    /// The walk answers what a look-up answers: hosts asked in order, held or not, before,
    /// between and after the held ones.
    #[test]
    fn the_walk_in_order_answers_as_a_look_up() {
        let mut held = Held::default();
        for (host, total) in [("gpu-02", 2), ("gpu-05", 5), ("gpu-09", 9)] {
            held.hosts.insert(
                host.to_string(),
                HostHeld {
                    units: 1,
                    total,
                    ..HostHeld::default()
                },
            );
        }
        let asked = [
            "gpu-01", "gpu-02", "gpu-03", "gpu-05", "gpu-06", "gpu-09", "gpu-10",
        ];
        let mut walk = held.in_order();
        for host in asked {
            assert_eq!(
                walk.get(host).map(|h| h.total),
                held.hosts.get(host).map(|h| h.total),
                "{host}"
            );
        }
    }

    /// Debug builds refuse a host asked out of order (it would not be found).
    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "out of order")]
    fn a_host_asked_out_of_order_panics_in_debug_builds() {
        let held = Held::default();
        let mut walk = held.in_order();
        let _ = walk.get("gpu-02");
        let _ = walk.get("gpu-01");
    }
}
