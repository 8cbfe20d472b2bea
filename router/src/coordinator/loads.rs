//! The load the coordinator publishes after its events, read without a turn of its task (the
//! load read, the lifecycle's last uses) and the lanes of lent slots found through it.
//!
//! NB (memory and reads at scale): one allocation per deployment the router knows, its
//! [`LoadCell`], written in place by the owner: the cell holds the deployment's ID (the key
//! of the shards' sets and of the list in ID order, so no map holds a copy of it), its figures
//! ([`Published`]: numbers, and per instance its index, generation and count beside the
//! instance's shared `Upstream`) and its lane, in place. A read of every deployment walks the
//! list of cells in ID order and copies each one's figures into one record it keeps
//! ([`LoadsInOrder::get`]): no `Arc` of a load cloned, no load built, nothing allocated per
//! deployment, and no lock taken where the deployment has one instance or none (its numbers
//! and first instance's are atomics, [`Figures`], copied under the cell's `seq`). Before, each deployment had a cell, an `Arc`'d `DeploymentLoad` with its ID and
//! each instance's key copied (deployment and host ID), a lane found through a map of its
//! own, and a copy of its ID in four maps.

use std::borrow::Borrow;
use std::collections::HashSet;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering, fence};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};

use capyctl_interfaces::router::{
    DeploymentLoad, InstanceFigures, InstanceKey, InstanceLoad, LoadFigures, Upstream,
};
use tokio::time::Instant;

use super::Lane;
use crate::fast_hash::FastHash;

/// Shards of [`Loads`]: a read holds one shard's lock only to find a cell, and the owner one
/// shard's to add or drop a cell.
const LOAD_SHARDS: usize = 16;

/// What the owner publishes of one deployment after an event that changed it (the figures of
/// its [`DeploymentLoad`], the instances' keys shared with their `Upstream`s).
#[derive(Debug, Clone)]
pub(crate) struct Published {
    pub(crate) in_flight: usize,
    pub(crate) in_flight_limit: usize,
    pub(crate) waiting: usize,
    pub(crate) waiting_limit: usize,
    pub(crate) last_used: Option<Instant>,
    pub(crate) instances: PublishedInstances,
}

/// One instance in [`Published`].
#[derive(Debug, Clone)]
pub(crate) struct PublishedInstance {
    /// Its key (and address), shared with the owner's entry.
    upstream: Arc<Upstream>,
    /// Its key's index and generation, beside the rest (a full read copies them: not through
    /// `upstream`, a memory access more per deployment).
    index: u32,
    generation: u64,
    router_in_flight: usize,
    open: bool,
}

impl PublishedInstance {
    pub(crate) fn new(upstream: Arc<Upstream>, router_in_flight: usize, open: bool) -> Self {
        PublishedInstance {
            index: upstream.key.index,
            generation: upstream.key.generation,
            upstream,
            router_in_flight,
            open,
        }
    }
}

/// A deployment's instances in key order, the first in place (most deployments have one: a
/// full read finds it in the cell, with no vector to follow).
#[derive(Debug, Clone, Default)]
pub(crate) struct PublishedInstances {
    first: Option<PublishedInstance>,
    rest: Vec<PublishedInstance>,
}

impl PublishedInstances {
    pub(crate) fn of(mut all: impl Iterator<Item = PublishedInstance>) -> Self {
        PublishedInstances {
            first: all.next(),
            rest: all.collect(),
        }
    }
}

/// The numbers of a cell's published load (and its first instance's), which a full read copies
/// under the cell's `seq` without a lock. NB (reads at scale): the cell's mutex was a sixth of
/// the reader's time (an atomic swap to take it, one to let it go, per deployment); the
/// second and later instances, the instances' `Upstream`s and the last use stay behind it
/// ([`Kept`]).
///
/// NB (reads at scale): `repr(C)`, in this order, 64 bytes: with the cell's `seq` before it and
/// its lane's words after it, what a full read copies is 88 bytes in a row (see [`LoadCell`]).
#[derive(Default)]
#[repr(C)]
struct Figures {
    in_flight: AtomicUsize,
    in_flight_limit: AtomicUsize,
    waiting: AtomicUsize,
    waiting_limit: AtomicUsize,
    /// How many instances it has: the first's figures are here, the rest's in [`Kept`].
    instances: AtomicUsize,
    first_generation: AtomicU64,
    first_in_flight: AtomicUsize,
    first_index: AtomicU32,
    first_open: AtomicBool,
}

impl Figures {
    /// Written by the owner only (at the cell's making, or within its turn: `seq` odd).
    fn store(&self, p: &Published) {
        let o = Ordering::Relaxed;
        self.in_flight.store(p.in_flight, o);
        self.in_flight_limit.store(p.in_flight_limit, o);
        self.waiting.store(p.waiting, o);
        self.waiting_limit.store(p.waiting_limit, o);
        let first = p.instances.first.as_ref();
        let n = usize::from(first.is_some()) + p.instances.rest.len();
        self.instances.store(n, o);
        self.first_index.store(first.map_or(0, |i| i.index), o);
        self.first_open.store(first.is_some_and(|i| i.open), o);
        self.first_generation
            .store(first.map_or(0, |i| i.generation), o);
        self.first_in_flight
            .store(first.map_or(0, |i| i.router_in_flight), o);
    }

    /// The first instance's figures, if it has one.
    fn first(&self) -> Option<InstanceFigures> {
        let o = Ordering::Relaxed;
        (self.instances.load(o) > 0).then(|| InstanceFigures {
            index: self.first_index.load(o),
            generation: self.first_generation.load(o),
            router_in_flight: self.first_in_flight.load(o),
            open: self.first_open.load(o),
        })
    }

    /// Its numbers and first instance written over `out` (its instances' vector reused); the
    /// number of instances (those after the first are [`Kept`]'s to add).
    fn fill(&self, out: &mut LoadFigures) -> usize {
        let o = Ordering::Relaxed;
        out.in_flight = self.in_flight.load(o);
        out.in_flight_limit = self.in_flight_limit.load(o);
        out.waiting = self.waiting.load(o);
        out.waiting_limit = self.waiting_limit.load(o);
        out.instances.clear();
        out.instances.extend(self.first());
        self.instances.load(o)
    }
}

/// What the cell keeps of its published load behind its mutex: what is not a number.
#[derive(Debug)]
struct Kept {
    last_used: Option<Instant>,
    /// The first instance's key (and address), shared with the owner's entry.
    first: Option<Arc<Upstream>>,
    /// The second and later instances.
    rest: Vec<PublishedInstance>,
}

impl Kept {
    fn of(p: Published) -> Self {
        Kept {
            last_used: p.last_used,
            first: p.instances.first.map(|i| i.upstream),
            rest: p.instances.rest,
        }
    }
}

fn figures_of(i: &PublishedInstance) -> InstanceFigures {
    InstanceFigures {
        index: i.index,
        generation: i.generation,
        router_in_flight: i.router_in_flight,
        open: i.open,
    }
}

/// A deployment's ID kept in its cell, and beside it in the list of cells in ID order
/// ([`Ordered`]): in place where it is short (a ULID is 26 bytes), so that a full read compares
/// it in that list, with no access to the cell (a separate string was a memory access more per
/// deployment).
#[derive(Clone)]
enum CellId {
    Inline {
        len: u8,
        bytes: [u8; CellId::INLINE],
    },
    Heap(Box<str>),
}

impl CellId {
    const INLINE: usize = 30;

    fn new(id: &str) -> Self {
        match u8::try_from(id.len()) {
            Ok(len) if id.len() <= Self::INLINE => {
                let mut bytes = [0; Self::INLINE];
                bytes[..id.len()].copy_from_slice(id.as_bytes());
                CellId::Inline { len, bytes }
            }
            _ => CellId::Heap(id.into()),
        }
    }

    /// Its bytes (compared as the `str`s compare).
    fn as_bytes(&self) -> &[u8] {
        match self {
            CellId::Inline { len, bytes } => &bytes[..usize::from(*len)],
            CellId::Heap(s) => s.as_bytes(),
        }
    }

    fn as_str(&self) -> &str {
        match self {
            // Copied from a `str` whole: always UTF-8.
            CellId::Inline { .. } => std::str::from_utf8(self.as_bytes()).unwrap_or_default(),
            CellId::Heap(s) => s,
        }
    }
}

/// One deployment's published load.
///
/// NB (an exact read without the owner): between two events the requests that took and gave
/// back lent slots are counted by their lane, not the owner (see `Lane`); a read adds the
/// lane's count to the published load. The owner changes the two together (it takes a lane
/// back, and publishes the load that now counts its requests) only between two bumps of `seq`
/// (odd meanwhile), within one synchronous turn; a read that sees `seq` odd, or changed across
/// its copy, copies again (a seqlock). The numbers (and the first instance's) are atomics
/// ([`Figures`]) that a full read copies with no lock; the rest ([`Kept`]: the instances'
/// `Upstream`s, a second instance's figures, the last use) is behind the cell's mutex. The
/// owner never waits for a read: a read holds the mutex only to copy one deployment's.
///
/// NB (reads at scale): `repr(C)`, what a full read copies first and in a row: `seq`, the
/// figures and the lane's two words that its count is made of (88 bytes: two cache lines, at
/// times three, all of which [`LoadCell::fetch`] asks for); the ID, which the read compares in
/// the ordered list instead ([`Ordered`]), and what is behind the mutex come after. In the
/// compiler's own order the ID, the figures and the lane's words were three to four lines apart.
#[repr(C)]
pub(crate) struct LoadCell {
    /// Even: settled; odd: the owner is changing the load and the lane's count together.
    seq: AtomicU64,
    /// As of the owner's last event that changed it: its numbers, read without a lock ...
    figures: Figures,
    /// Its lane (lent slots are taken through the cell; closed until the owner first opens
    /// it). NB: in the cell, not an allocation of its own: a full read reads its count, and a
    /// lane apart was a memory access more per deployment (half the reader's time).
    pub(crate) lane: Lane,
    /// ... and the rest of its published load, behind the mutex.
    kept: Mutex<Kept>,
    /// The deployment's ID: the key it is found and ordered by.
    id: CellId,
}

impl LoadCell {
    pub(crate) fn new(id: &str, published: Published) -> Self {
        LoadCell {
            id: CellId::new(id),
            seq: AtomicU64::new(0),
            figures: {
                let figures = Figures::default();
                figures.store(&published);
                figures
            },
            kept: Mutex::new(Kept::of(published)),
            lane: Lane::new(),
        }
    }

    /// Its deployment's ID.
    pub(crate) fn id(&self) -> &str {
        self.id.as_str()
    }

    /// Asks for the memory a full read copies ([`LoadCell::read_figures`]: `seq`, the figures,
    /// the lane's word and slots lent, 88 bytes in a row) without using it: one load in each
    /// 64 bytes of it, its first and its last, so that each of the two or three cache lines it
    /// spans is asked for.
    fn fetch(&self) {
        let o = Ordering::Relaxed;
        std::hint::black_box((
            self.seq.load(o),
            self.figures.first_generation.load(o),
            self.lane.lent.load(o),
        ));
    }

    fn kept(&self) -> MutexGuard<'_, Kept> {
        self.kept.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The owner publishes the deployment's load now (within a turn it has begun: see
    /// [`LoadCell::begin`]).
    pub(crate) fn set(&self, published: Published) {
        // `seq` is odd: a reader that copies any of the stores below sees it moved (the fence
        // pairs with the one in [`LoadCell::settled`]).
        fence(Ordering::Release);
        self.figures.store(&published);
        *self.kept() = Kept::of(published);
    }

    /// The deployment's last use now: the later of the owner's (published) and its lane's.
    ///
    /// NB (no seqlock needed): both only ever grow, and a lane's instants stay in it after the
    /// owner takes them, so the later of the two is right whichever the owner moved last.
    fn last_used(&self, base: Instant) -> Option<Instant> {
        let published = self.kept().last_used;
        let lane = self.lane.last_use(base);
        published.max(lane)
    }

    /// Requests the owner last published as forwarded to instance `index`.
    ///
    /// NB (never waits for `seq`): the lifecycle reads it under its state's write lock (a
    /// plan's placement), while a router turn that holds this cell's `seq` odd may wait for
    /// that lock's read side (`admissible`): waiting here for `seq` to settle would deadlock
    /// the two. So it copies the figures as they are (as it read them under the cell's mutex
    /// alone before they were atomics): one changed by a turn under way may mix its before and
    /// after, which weighs one victim's choice once, no more.
    fn in_flight_of(&self, index: u32) -> usize {
        let first = self
            .figures
            .first()
            .filter(|i| i.index == index)
            .map_or(0, |i| i.router_in_flight);
        let rest: usize = if self.figures.instances.load(Ordering::Relaxed) > 1 {
            self.kept()
                .rest
                .iter()
                .filter(|i| i.index == index)
                .map(|i| i.router_in_flight)
                .sum()
        } else {
            0
        };
        first + rest
    }

    /// A settled copy (see the type's note) made by `copy` from the published load (its
    /// [`Figures`], and [`Kept`] where `copy` locks it) and the lane (its count since it was
    /// opened, `Lane::net`: 0 while it is closed; its last use).
    fn settled<T>(&self, mut copy: impl FnMut(&Lane) -> T) -> T {
        let mut spins = 0u32;
        loop {
            let before = self.seq.load(Ordering::SeqCst);
            if before & 1 == 0 {
                let out = copy(&self.lane);
                // Pairs with the owner's in [`LoadCell::set`]: a copy of any figure it stored
                // since `before` makes the load below see `seq` moved.
                fence(Ordering::Acquire);
                if self.seq.load(Ordering::SeqCst) == before {
                    return out;
                }
            }
            // The owner is within one synchronous turn: copy again.
            spins += 1;
            if spins.is_multiple_of(64) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// The load now: the published one, with the requests its lane counts (its figures as
    /// [`LoadCell::read_figures`] copies them, with the instances' keys and the last use).
    fn read(&self, base: Instant) -> DeploymentLoad {
        let mut figures = LoadFigures::default();
        let (keys, last_used) = self.settled(|lane| {
            self.copy_figures(lane, &mut figures);
            let kept = self.kept();
            let keys: Vec<InstanceKey> = kept
                .first
                .iter()
                .map(|u| u.key.clone())
                .chain(kept.rest.iter().map(|i| i.upstream.key.clone()))
                .collect();
            (keys, kept.last_used.max(lane.last_use(base)))
        });
        DeploymentLoad {
            deployment_id: self.id().to_string(),
            in_flight: figures.in_flight,
            in_flight_limit: figures.in_flight_limit,
            waiting: figures.waiting,
            waiting_limit: figures.waiting_limit,
            instances: keys
                .into_iter()
                .zip(figures.instances)
                .map(|(key, i)| InstanceLoad {
                    key,
                    router_in_flight: i.router_in_flight,
                    open: i.open,
                })
                .collect(),
            last_used,
        }
    }

    /// The figures of the load now written over `out`: with no lock where the deployment has
    /// one instance or none.
    fn read_figures(&self, out: &mut LoadFigures) {
        self.settled(|lane| self.copy_figures(lane, out));
    }

    /// [`LoadCell::read_figures`]'s copy (within [`LoadCell::settled`]): the published figures
    /// with the requests `lane` counts.
    fn copy_figures(&self, lane: &Lane, out: &mut LoadFigures) {
        let net = lane.net();
        if self.figures.fill(out) > 1 {
            out.instances
                .extend(self.kept().rest.iter().map(figures_of));
        }
        if net != 0 {
            out.in_flight = add_net(out.in_flight, net);
            // A lane is open only on a deployment's one instance.
            if let [only] = out.instances.as_mut_slice() {
                only.router_in_flight = add_net(only.router_in_flight, net);
            }
        }
    }

    /// The owner begins changing it (`seq` odd), once per turn: noted in `begun`.
    pub(crate) fn begin(self: &Arc<Self>, begun: &mut Vec<Arc<LoadCell>>) {
        if self.seq.load(Ordering::Relaxed) & 1 == 0 {
            self.seq.fetch_add(1, Ordering::SeqCst);
            begun.push(Arc::clone(self));
        }
    }

    /// The owner is done changing it (`seq` even).
    pub(crate) fn end(&self) {
        self.seq.fetch_add(1, Ordering::SeqCst);
    }
}

/// `n` with a lane's count `net` added (saturating).
fn add_net(n: usize, net: i64) -> usize {
    let m = usize::try_from(net.unsigned_abs()).unwrap_or(usize::MAX);
    if net > 0 {
        n.saturating_add(m)
    } else {
        n.saturating_sub(m)
    }
}

/// A cell, hashed and compared as its deployment's ID (so a set of cells is a map by ID that
/// holds no copy of the IDs).
#[derive(Clone)]
pub(crate) struct ById(pub(crate) Arc<LoadCell>);

impl Borrow<str> for ById {
    fn borrow(&self) -> &str {
        self.0.id()
    }
}

impl Hash for ById {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // As `str` hashes (so that a look-up by `&str` finds it).
        self.0.id().hash(state);
    }
}

impl PartialEq for ById {
    fn eq(&self, other: &Self) -> bool {
        self.0.id.as_bytes() == other.0.id.as_bytes()
    }
}

impl Eq for ById {}

/// The load of every deployment the router knows, as the owner published it after its last
/// event that changed it: the load read copies it without a turn of the task.
pub(crate) struct Loads {
    shards: Vec<RwLock<HashSet<ById, FastHash>>>,
    hasher: FastHash,
    /// Bumped by the owner after each cell it adds or drops (one atomic add: it never waits).
    cells_changed: AtomicU64,
    /// Every cell in deployment ID order, as of `cells_changed`'s value, for reads of every
    /// deployment; sorted again by the first such read after a change (readers only lock it).
    ordered: Mutex<(u64, Arc<[Ordered]>)>,
    /// The origin of the lanes' instants (`Lane::last_start`, `Lane::last_end`): a moment
    /// (1 ns) before the task began, so that 0 stands for "none yet".
    pub(crate) base: Instant,
}

impl Loads {
    pub(crate) fn new(base: Instant) -> Self {
        Loads {
            shards: (0..LOAD_SHARDS)
                .map(|_| RwLock::new(HashSet::default()))
                .collect(),
            hasher: FastHash::default(),
            cells_changed: AtomicU64::new(0),
            ordered: Mutex::new((0, Arc::from(Vec::new()))),
            base,
        }
    }

    fn shard(&self, deployment: &str) -> &RwLock<HashSet<ById, FastHash>> {
        let i = usize::try_from(self.hasher.hash_one(deployment) % LOAD_SHARDS as u64).unwrap_or(0);
        &self.shards[i]
    }

    pub(crate) fn cell(&self, deployment: &str) -> Option<Arc<LoadCell>> {
        let shard = self
            .shard(deployment)
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        shard.get(deployment).map(|c| Arc::clone(&c.0))
    }

    pub(crate) fn insert(&self, cell: Arc<LoadCell>) {
        let mut shard = self
            .shard(cell.id())
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        shard.replace(ById(cell));
        drop(shard);
        self.cells_changed.fetch_add(1, Ordering::Release);
    }

    pub(crate) fn remove(&self, deployment: &str) {
        let mut shard = self
            .shard(deployment)
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        shard.remove(deployment);
        drop(shard);
        self.cells_changed.fetch_add(1, Ordering::Release);
    }

    pub(crate) fn clear(&self) {
        for shard in &self.shards {
            shard
                .write()
                .unwrap_or_else(PoisonError::into_inner)
                .clear();
        }
        self.cells_changed.fetch_add(1, Ordering::Release);
    }

    /// Every cell in deployment ID order: the list kept since the last change of the cells
    /// (one lock and one `Arc` copy), else the shards copied (one read lock each) and sorted.
    fn ordered(&self) -> Arc<[Ordered]> {
        let mut kept = self.ordered.lock().unwrap_or_else(PoisonError::into_inner);
        let changed = self.cells_changed.load(Ordering::Acquire);
        if kept.0 != changed {
            let mut cells: Vec<Ordered> = Vec::new();
            for shard in &self.shards {
                let shard = shard.read().unwrap_or_else(PoisonError::into_inner);
                cells.extend(shard.iter().map(|c| Ordered {
                    id: c.0.id.clone(),
                    cell: Arc::clone(&c.0),
                }));
            }
            cells.sort_unstable_by(|a, b| a.id.as_bytes().cmp(b.id.as_bytes()));
            *kept = (changed, Arc::from(cells));
        }
        Arc::clone(&kept.1)
    }

    /// Every deployment's load, by deployment ID.
    pub(crate) fn all(&self) -> Vec<DeploymentLoad> {
        self.ordered()
            .iter()
            .map(|o| o.cell.read(self.base))
            .collect()
    }

    /// Each deployment's ID and the figures of its load now, in ID order, handed to `each`
    /// (one record, filled again for each: nothing allocated per deployment).
    pub(crate) fn each_figures(&self, each: &mut dyn FnMut(&str, &LoadFigures)) {
        let mut figures = LoadFigures::default();
        for o in self.ordered().iter() {
            o.cell.read_figures(&mut figures);
            each(o.id.as_str(), &figures);
        }
    }

    /// `deployment`'s load now.
    pub(crate) fn load_of(&self, deployment: &str) -> Option<DeploymentLoad> {
        self.cell(deployment).map(|c| c.read(self.base))
    }

    /// The figures of `deployment`'s load now (as [`LoadsInOrder::get`] copies them).
    pub(crate) fn figures_of(&self, deployment: &str) -> Option<LoadFigures> {
        self.cell(deployment).map(|c| {
            let mut out = LoadFigures::default();
            c.read_figures(&mut out);
            out
        })
    }

    /// `deployment`'s last use now (see [`LoadCell::last_used`]).
    pub(crate) fn last_used(&self, deployment: &str) -> Option<Instant> {
        self.cell(deployment).and_then(|c| c.last_used(self.base))
    }

    /// Requests last published as forwarded to instance `index` of `deployment`.
    pub(crate) fn in_flight_of(&self, deployment: &str, index: u32) -> usize {
        self.cell(deployment).map_or(0, |c| c.in_flight_of(index))
    }

    /// A reader of every deployment's figures in ascending order of ID.
    pub(crate) fn in_order(&self) -> LoadsInOrder {
        LoadsInOrder {
            cells: self.ordered(),
            next: 0,
            fetched: 0,
            figures: LoadFigures::default(),
        }
    }
}

/// A cell in the list of every cell in ID order, with its deployment's ID beside it.
///
/// NB (reads at scale): the merge of a full read compares IDs in this list, one entry after
/// the other in memory, and follows the pointer to a cell only to copy its figures; with the ID
/// in the cell alone, each compare was the read's first access to a cell, waited for (some 30%
/// of the router's side). 40 bytes per deployment while the list is kept.
struct Ordered {
    id: CellId,
    cell: Arc<LoadCell>,
}

/// The router's published loads of every deployment, looked up in ascending order of
/// deployment ID (see `CoordinatorHandle::loads_in_order`).
pub struct LoadsInOrder {
    cells: Arc<[Ordered]>,
    /// The first cell not yet passed.
    next: usize,
    /// The cells before this one were fetched ([`LoadsInOrder::fetch`]).
    fetched: usize,
    /// The figures of the deployment last asked for, filled again by each look-up.
    figures: LoadFigures,
}

/// How many cells ahead of the next one [`LoadsInOrder::get`] has fetched.
const FETCH_AHEAD: usize = 16;

impl LoadsInOrder {
    /// Asks for the memory of the next cells a read copies ([`LoadCell::fetch`]) without using
    /// it. NB (reads at scale): a cell is a memory access of its own per deployment; fetched 64
    /// at a time, one after the other, those accesses are in flight together instead of each
    /// waited for as the merge reaches it.
    fn fetch(&mut self) {
        let from = self.fetched.max(self.next);
        let to = (from + 64).min(self.cells.len());
        for c in self.cells.get(from..to).unwrap_or_default() {
            c.cell.fetch();
        }
        self.fetched = to.max(self.next + FETCH_AHEAD);
    }
}

impl std::fmt::Debug for LoadsInOrder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadsInOrder")
            .field("deployments", &self.cells.len())
            .field("next", &self.next)
            .finish()
    }
}

impl LoadsInOrder {
    /// The figures of `deployment`'s load now, copied into the reader's own record (filled
    /// again by the next call); `None` when the router did not know it when the reader was
    /// made. Asked in ascending order of ID, each look-up moves on from the last (a merge: one
    /// pass over the router's deployments for them all); an ID below the last one asked is
    /// found by binary search.
    pub fn get(&mut self, deployment: &str) -> Option<&LoadFigures> {
        if self.next + FETCH_AHEAD > self.fetched {
            self.fetch();
        }
        let id = deployment.as_bytes();
        // NB (reads at scale): the merge's usual step, the next cell's, with one compare of
        // equal bytes (the order's, below, is the rest).
        if self
            .cells
            .get(self.next)
            .is_some_and(|o| o.id.as_bytes() == id)
        {
            return Some(self.copy_next());
        }
        if self
            .next
            .checked_sub(1)
            .is_some_and(|last| self.cells[last].id.as_bytes() >= id)
        {
            self.next = self.cells.partition_point(|o| o.id.as_bytes() < id);
        }
        while let Some(o) = self.cells.get(self.next) {
            match o.id.as_bytes().cmp(id) {
                std::cmp::Ordering::Less => self.next += 1,
                std::cmp::Ordering::Equal => return Some(self.copy_next()),
                std::cmp::Ordering::Greater => return None,
            }
        }
        None
    }

    /// The next cell's figures copied (it is the one asked for), and the merge moved past it.
    fn copy_next(&mut self) -> &LoadFigures {
        self.cells[self.next].cell.read_figures(&mut self.figures);
        self.next += 1;
        &self.figures
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(id: &str, waiting: usize) -> Arc<LoadCell> {
        Arc::new(LoadCell::new(
            id,
            Published {
                in_flight: 0,
                in_flight_limit: 32,
                waiting,
                waiting_limit: 8,
                instances: PublishedInstances::default(),
                last_used: None,
            },
        ))
    }

    fn waiting(r: &mut LoadsInOrder, id: &str) -> Option<usize> {
        r.get(id).map(|l| l.waiting)
    }

    #[test]
    fn loads_in_order_merge_by_id_and_see_cells_added_and_dropped() {
        let loads = Loads::new(Instant::now());
        for (i, id) in ["d", "b", "a", "c"].iter().enumerate() {
            loads.insert(cell(id, i));
        }
        let ids: Vec<String> = loads.all().into_iter().map(|l| l.deployment_id).collect();
        assert_eq!(ids, ["a", "b", "c", "d"]);
        assert_eq!(loads.load_of("b").map(|l| l.waiting), Some(1));
        assert_eq!(loads.load_of("bb"), None);

        // In ascending order, with IDs the router does not know between them.
        let mut r = loads.in_order();
        assert_eq!(waiting(&mut r, "a"), Some(2));
        assert_eq!(waiting(&mut r, "aa"), None);
        assert_eq!(waiting(&mut r, "c"), Some(3));
        assert_eq!(waiting(&mut r, "d"), Some(0));
        assert_eq!(waiting(&mut r, "e"), None);
        // Out of order: found all the same.
        assert_eq!(waiting(&mut r, "b"), Some(1));
        assert_eq!(waiting(&mut r, "a"), Some(2));

        // The kept order is renewed after a cell is added or dropped.
        loads.insert(cell("bb", 7));
        loads.remove("c");
        let mut r = loads.in_order();
        assert_eq!(waiting(&mut r, "bb"), Some(7));
        assert_eq!(waiting(&mut r, "c"), None);
        assert_eq!(waiting(&mut r, "d"), Some(0));
        loads.clear();
        assert!(loads.all().is_empty());
    }

    /// A read of every deployment copies the same figures as a read of one: the published
    /// numbers and each instance's index, generation and count.
    #[test]
    fn the_figures_in_order_are_the_loads() {
        let loads = Loads::new(Instant::now());
        let upstream = |d: &str, index: u32, generation: u64| {
            Arc::new(Upstream {
                key: capyctl_interfaces::router::InstanceKey {
                    deployment: d.to_string(),
                    index,
                    host_id: "gpu-box".to_string(),
                    generation,
                },
                addr: "127.0.0.1:9".parse().expect("an address"),
            })
        };
        for (id, n) in [("x", 1), ("y", 3), ("z", 0)] {
            loads.insert(Arc::new(LoadCell::new(
                id,
                Published {
                    in_flight: n * 2,
                    in_flight_limit: 32 * n.max(1),
                    waiting: n,
                    waiting_limit: 9,
                    last_used: None,
                    instances: PublishedInstances::of((0..n).map(|i| {
                        PublishedInstance::new(
                            upstream(id, u32::try_from(i).expect("small"), 7 + i as u64),
                            i,
                            i % 2 == 0,
                        )
                    })),
                },
            )));
        }
        let mut r = loads.in_order();
        for load in loads.all() {
            assert_eq!(r.get(&load.deployment_id), Some(&load.figures()));
            assert_eq!(load.instances.len(), load.waiting);
        }
        assert_eq!(loads.in_flight_of("y", 2), 2);
        assert_eq!(loads.in_flight_of("y", 3), 0);
    }

    /// A walk of every cell hands each deployment's ID, in order, with the figures a read of
    /// it copies; one deployment's figures are the same. IDs too long to be kept in place
    /// (over 30 bytes) are ordered and found as the others.
    #[test]
    fn each_figures_walks_the_loads_in_order() {
        let loads = Loads::new(Instant::now());
        let long = "b-an-id-longer-than-thirty-bytes-is-kept-apart";
        for (i, id) in ["d", long, "b", "a", "c"].iter().enumerate() {
            loads.insert(cell(id, i));
        }
        let mut r = loads.in_order();
        assert_eq!(waiting(&mut r, "b"), Some(2));
        assert_eq!(waiting(&mut r, long), Some(1));
        assert_eq!(waiting(&mut r, "c"), Some(4));
        let mut walked = Vec::new();
        loads.each_figures(&mut |id, f| walked.push((id.to_string(), f.clone())));
        let all: Vec<(String, LoadFigures)> = loads
            .all()
            .into_iter()
            .map(|l| (l.deployment_id.clone(), l.figures()))
            .collect();
        assert_eq!(walked, all);
        let ids: Vec<&str> = walked.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(ids, ["a", "b", long, "c", "d"]);
        assert_eq!(loads.figures_of("c"), Some(all[3].1.clone()));
        assert_eq!(loads.figures_of("e"), None);
    }

    /// What a full read copies of a cell (its `seq`, figures, and its lane's word and slots
    /// lent) is 88 bytes in a row at its start, the three loads of `LoadCell::fetch` one in
    /// each of the cache lines they may span.
    #[test]
    fn what_a_full_read_copies_of_a_cell_is_in_a_row() {
        use std::mem::{offset_of, size_of};
        assert_eq!(offset_of!(LoadCell, seq), 0);
        assert_eq!(offset_of!(LoadCell, figures), 8);
        assert_eq!(size_of::<Figures>(), 64);
        assert_eq!(
            offset_of!(Figures, first_generation) + 8,
            offset_of!(Figures, first_in_flight)
        );
        assert_eq!(offset_of!(LoadCell, lane) + offset_of!(Lane, word), 72);
        assert_eq!(offset_of!(LoadCell, lane) + offset_of!(Lane, lent), 80);
    }

    /// The lifecycle reads a deployment's in-flight count under its own lock, which a router
    /// turn (the cell's `seq` odd) may be waiting for: the read answers while a turn is under
    /// way, it does not wait for the turn's end.
    #[test]
    fn in_flight_of_answers_while_a_turn_changes_the_cell() {
        let loads = Arc::new(Loads::new(Instant::now()));
        let c = cell("d", 0);
        loads.insert(Arc::clone(&c));
        let mut begun = Vec::new();
        c.begin(&mut begun);
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = Arc::clone(&loads);
        std::thread::spawn(move || {
            let _ = tx.send(reader.in_flight_of("d", 0));
        });
        let answer = rx.recv_timeout(std::time::Duration::from_secs(10));
        c.end();
        assert_eq!(answer, Ok(0), "the read waited for the turn's end");
    }
}
