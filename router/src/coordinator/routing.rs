//! Which open instance of a deployment a request goes to (DESIGN 4.7, "Replicas"): pure
//! functions over plain numbers, no state of their own. `state.rs` calls them with its
//! instances' counts; unit tests call them with made-up ones.
//!
//! - **least_loaded** (the default): the open instance with room (fewer than the per-instance
//!   bound running) and the least `router in-flight + engine waiting`, the engine's waiting
//!   count taken from a sample younger than [`ENGINE_SAMPLE_FRESH`] (an older one, or none,
//!   counts as 0); ties go to the fewest router in-flight, then the lowest key.
//! - **prefix**: consistent hashing with bounded load (Mirrokni, Thorup, Zadimoghaddam,
//!   "Consistent Hashing with Bounded Loads", 2018). Each open instance has [`VNODES`] points
//!   on a ring of `u64`; a request whose prompt prefix hashes to `h` walks the ring from `h`
//!   and goes to the first instance whose router in-flight is below
//!   `ceil(c × (total + 1) / n)` (c = [`BOUND_C_NUM`] / [`BOUND_C_DEN`] = 1.25, total = the
//!   router in-flight of the `n` open instances) and below the per-instance bound. So prompts
//!   that share a prefix stay on one instance (its KV cache is reused) until it carries 25%
//!   more than its share, and then spill to the next instance on the ring (which is the same
//!   for every prompt of that prefix, so the spill-over shares a cache too).
//! - **preferred** (a request that names a LoRA adapter, DESIGN 4.9, with either routing):
//!   the least_loaded of the open instances that have its adapter loaded, when one of them
//!   has room; else the deployment's routing as above (and the adapter is loaded there).
//!
//! NB: neither allocates per request: the ring is built when the open instances change (see
//! `Dep::pick` in `state.rs`), and a pick walks it in place.

use std::time::Duration;

use tokio::time::Instant;

/// An engine's waiting count this old or older counts as 0: the load read's `stale_after_ms`,
/// the product page's one meaning of a fresh sample. A host samples each engine about once a
/// second, a node agent's samples are read about once a second, and the lifecycle passes them
/// on about once a second, so a count read here is up to about 3 s old on a node agent's
/// host (a tighter bound would drop a sample on its way rather than one that says nothing
/// about now).
pub(crate) const ENGINE_SAMPLE_FRESH: Duration =
    Duration::from_millis(capyctl_spec::api::STALE_AFTER_MS);

/// The bytes of a prompt that make its prefix key (`prompt` for completions, the
/// concatenated `messages[].content` for chat; see `proxy::prompt_prefix`): a system prompt or
/// a shared document at the start of a conversation fits, and a request that differs only past
/// them maps to the same instance.
pub const PREFIX_BYTES: usize = 256;

/// Points per instance on the prefix ring: enough that each instance's share of the ring is
/// within 20% of `1/n` for up to 64 instances (checked by `ring_shares_are_even`; random
/// points spread as `1/sqrt(VNODES)`, so 256 points is about ±6% typical, ±17% at worst over
/// 64 instances). The bounded load evens out what is left. 64 instances make 16,384 points
/// (256 KiB), built only when the open instances change.
pub(crate) const VNODES: usize = 256;

/// The bounded-load factor c = 1.25, as a fraction (integer arithmetic only).
pub(crate) const BOUND_C_NUM: usize = 5;
/// See [`BOUND_C_NUM`].
pub(crate) const BOUND_C_DEN: usize = 4;

/// One open instance's load, as the owner counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Load {
    /// Requests the router forwards to it now.
    pub in_flight: usize,
    /// The engine's waiting requests, as of its latest sample.
    pub engine_waiting: usize,
    /// When that sample was taken (`None`: none yet).
    pub sampled_at: Option<Instant>,
}

impl Load {
    /// The engine's waiting count, if its sample is fresh at `now`, else 0.
    pub(crate) fn waiting_at(&self, now: Instant) -> usize {
        match self.sampled_at {
            Some(at) if now.saturating_duration_since(at) < ENGINE_SAMPLE_FRESH => {
                self.engine_waiting
            }
            _ => 0,
        }
    }
}

/// least_loaded: the position (in the order given) of the instance to take the request, among
/// `loads` (`None`: closed, it takes nothing), or `None` when every open instance already runs
/// `cap` requests. Order: least `in_flight + fresh engine waiting`, then least `in_flight`, then
/// the first given (the lowest key, instances being given in key order).
pub(crate) fn least_loaded(
    now: Instant,
    cap: usize,
    loads: impl IntoIterator<Item = Option<Load>>,
) -> Option<usize> {
    let mut best: Option<(usize, usize, usize)> = None;
    for (i, load) in loads.into_iter().enumerate() {
        let Some(load) = load else { continue };
        if load.in_flight >= cap {
            continue;
        }
        // NB: saturating: an engine's waiting count is whatever its metrics said (a count
        // past `usize` is read as `usize::MAX`).
        let score = (
            load.in_flight.saturating_add(load.waiting_at(now)),
            load.in_flight,
        );
        if best.is_none_or(|(s, f, _)| score < (s, f)) {
            best = Some((score.0, score.1, i));
        }
    }
    best.map(|(_, _, i)| i)
}

/// An adapter's preference (DESIGN 4.9, "routes to an instance that has the adapter loaded
/// when one is ready, else the least loaded"): the position of the [`least_loaded`] among
/// the instances marked preferred (those with the request's adapter loaded), or `None` when
/// none of them is open with room (the caller then routes as for any request).
pub(crate) fn preferred(
    now: Instant,
    cap: usize,
    loads: impl IntoIterator<Item = (Option<Load>, bool)>,
) -> Option<usize> {
    least_loaded(
        now,
        cap,
        loads
            .into_iter()
            .map(|(load, preferred)| load.filter(|_| preferred)),
    )
}

/// The bounded-load bound: an instance may take a request while its load is below this
/// (`ceil(c × (total + 1) / n)`, c = 1.25). `n` is at least 1.
pub(crate) fn load_bound(total: usize, n: usize) -> usize {
    let den = BOUND_C_DEN * n.max(1);
    (BOUND_C_NUM * (total + 1)).div_ceil(den)
}

/// 64-bit FNV-1a, then a finalizer (splitmix64's) so that nearby inputs land far apart.
#[cfg(test)]
pub(crate) fn hash_bytes(bytes: &[u8]) -> u64 {
    let mut h = Fnv::new();
    h.write(bytes);
    h.finish()
}

/// An incremental [`hash_bytes`]: fed piece by piece (the prompt's strings), it hashes their
/// concatenation.
#[derive(Debug, Clone, Copy)]
pub struct Fnv(u64);

impl Fnv {
    /// Empty.
    pub fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    /// Adds bytes.
    pub fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    /// The hash of everything written.
    pub fn finish(&self) -> u64 {
        mix(self.0)
    }
}

impl Default for Fnv {
    fn default() -> Self {
        Self::new()
    }
}

/// splitmix64's finalizer.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The prefix ring of a deployment's open instances: [`VNODES`] points per member.
#[derive(Debug, Clone)]
pub(crate) struct Ring<K> {
    /// The members, in the order given when it was built.
    members: Vec<K>,
    /// `(point, member position)`, ascending.
    points: Vec<(u64, u32)>,
}

impl<K> Ring<K> {
    /// A ring of `members`, each placed by its identity (`ids`: the same identity gets the same
    /// points in every ring, so a member that comes and goes moves only its own share).
    pub(crate) fn new(members: Vec<K>, ids: impl Fn(&K) -> u64) -> Self {
        let mut points = Vec::with_capacity(members.len() * VNODES);
        for (m, member) in members.iter().enumerate() {
            let id = ids(member);
            let m = u32::try_from(m).unwrap_or(u32::MAX);
            for v in 0..VNODES as u64 {
                points.push((mix(id ^ mix(v.wrapping_add(0x9e37_79b9_7f4a_7c15))), m));
            }
        }
        points.sort_unstable();
        Ring { members, points }
    }

    /// The members, as given.
    pub(crate) fn members(&self) -> &[K] {
        &self.members
    }

    /// The members in ring order from `key` (with repeats: one per point, every point once).
    pub(crate) fn walk(&self, key: u64) -> impl Iterator<Item = (usize, &K)> {
        let start = self.points.partition_point(|(p, _)| *p < key);
        let (after, before) = (&self.points[start..], &self.points[..start]);
        after.iter().chain(before).filter_map(|(_, m)| {
            let m = usize::try_from(*m).ok()?;
            Some((m, self.members.get(m)?))
        })
    }
}

/// prefix: the position (in [`Ring::members`]) of the instance to take a request whose prefix
/// key is `key`: the first on the ring from `key` whose load (`in_flight` of each member, by
/// position; `None`: not open) is below both [`load_bound`] and `cap`. `None` when no open
/// member is below `cap`.
pub(crate) fn bounded_pick<K>(
    ring: &Ring<K>,
    key: u64,
    cap: usize,
    in_flight: impl Fn(&K) -> Option<usize>,
) -> Option<usize> {
    let (mut total, mut n, mut room) = (0usize, 0usize, false);
    for m in ring.members() {
        if let Some(load) = in_flight(m) {
            total += load;
            n += 1;
            room |= load < cap;
        }
    }
    if !room {
        return None;
    }
    // Some open member is below the bound (the bound times `n` exceeds the total), and when
    // the bound is above `cap` every member below `cap` is below it: the walk finds one.
    let bound = load_bound(total, n).min(cap);
    ring.walk(key)
        .find(|(_, m)| in_flight(m).is_some_and(|load| load < bound))
        .map(|(i, _)| i)
        // Unreachable by the reasoning above; kept so that a pick never fails while room is.
        .or_else(|| {
            ring.members()
                .iter()
                .position(|m| in_flight(m).is_some_and(|load| load < cap))
        })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn load(in_flight: usize, engine_waiting: usize, sampled_at: Option<Instant>) -> Option<Load> {
        Some(Load {
            in_flight,
            engine_waiting,
            sampled_at,
        })
    }

    #[test]
    fn least_loaded_takes_router_and_fresh_engine_load_together() {
        let now = Instant::now();
        let fresh = Some(now - Duration::from_millis(500));
        // 2 + 5 waiting at the engine against 4 + 0: the second.
        assert_eq!(
            least_loaded(now, 32, [load(2, 5, fresh), load(4, 0, fresh)]),
            Some(1)
        );
        // Closed instances take nothing; full ones neither.
        assert_eq!(
            least_loaded(now, 32, [None, load(32, 0, None), load(31, 9, fresh)]),
            Some(2)
        );
        assert_eq!(least_loaded(now, 32, [None, load(32, 0, None)]), None);
        assert_eq!(least_loaded(now, 32, []), None);
    }

    #[test]
    fn least_loaded_ties_go_to_fewer_in_flight_then_the_first() {
        let now = Instant::now();
        let fresh = Some(now);
        // Both 6 in all: the one with fewer router requests.
        assert_eq!(
            least_loaded(now, 32, [load(5, 1, fresh), load(2, 4, fresh)]),
            Some(1)
        );
        // Equal in every way: the first (lowest key).
        assert_eq!(
            least_loaded(now, 32, [load(3, 0, None), load(3, 0, None)]),
            Some(0)
        );
    }

    #[test]
    fn a_stale_engine_sample_counts_as_zero() {
        let now = Instant::now() + Duration::from_secs(10);
        let stale = Some(now - ENGINE_SAMPLE_FRESH);
        let edge = Some(now - ENGINE_SAMPLE_FRESH + Duration::from_millis(1));
        assert_eq!(load(0, 7, stale).unwrap().waiting_at(now), 0);
        assert_eq!(load(0, 7, edge).unwrap().waiting_at(now), 7);
        assert_eq!(load(0, 7, None).unwrap().waiting_at(now), 0);
        // 1 + stale 50 against 2: the first, its engine count being too old to say anything.
        assert_eq!(
            least_loaded(now, 32, [load(1, 50, stale), load(2, 0, None)]),
            Some(0)
        );
    }

    #[test]
    fn an_engine_waiting_count_past_usize_does_not_overflow_the_score() {
        let now = Instant::now();
        let fresh = Some(now);
        // An engine whose metrics said 1e20 waiting (read as usize::MAX) while the router
        // runs one there: the other instance, not a wrapped score.
        assert_eq!(
            least_loaded(now, 32, [load(1, usize::MAX, fresh), load(5, 0, fresh)]),
            Some(1)
        );
    }

    #[test]
    fn least_loaded_spreads_evenly() {
        let now = Instant::now();
        let mut counts = [0usize; 4];
        for _ in 0..100 {
            let i = least_loaded(now, 32, counts.map(|c| load(c, 0, None))).unwrap();
            counts[i] += 1;
        }
        assert_eq!(counts, [25, 25, 25, 25]);
        // At the bound: 128 in all, then nothing.
        for _ in 0..28 {
            let i = least_loaded(now, 32, counts.map(|c| load(c, 0, None))).unwrap();
            counts[i] += 1;
        }
        assert_eq!(counts, [32, 32, 32, 32]);
        assert_eq!(
            least_loaded(now, 32, counts.map(|c| load(c, 0, None))),
            None
        );
    }

    #[test]
    fn an_adapter_goes_where_it_is_loaded_while_that_has_room() {
        let now = Instant::now();
        // Loaded on the second only: the second, though the first is idle.
        assert_eq!(
            preferred(
                now,
                32,
                [(load(0, 0, None), false), (load(5, 0, None), true)]
            ),
            Some(1)
        );
        // Loaded on two: the least loaded of those two, never the idle one without it.
        assert_eq!(
            preferred(
                now,
                32,
                [
                    (load(0, 0, None), false),
                    (load(7, 0, None), true),
                    (load(3, 2, Some(now)), true),
                ]
            ),
            Some(2)
        );
        // Where it is loaded is full or closed: none (the caller takes the least loaded).
        assert_eq!(
            preferred(
                now,
                32,
                [(load(0, 0, None), false), (load(32, 0, None), true)]
            ),
            None
        );
        assert_eq!(
            preferred(now, 32, [(load(0, 0, None), false), (None, true)]),
            None
        );
        // Loaded nowhere: none.
        assert_eq!(
            preferred(
                now,
                32,
                [(load(0, 0, None), false), (load(1, 0, None), false)]
            ),
            None
        );
    }

    #[test]
    fn the_bound_is_c_times_the_average_after_this_one() {
        assert_eq!(load_bound(0, 1), 2); // ceil(1.25)
        assert_eq!(load_bound(0, 2), 1); // ceil(0.625)
        assert_eq!(load_bound(1, 2), 2); // ceil(1.25)
        assert_eq!(load_bound(2, 2), 2); // ceil(1.875)
        assert_eq!(load_bound(63, 4), 20); // ceil(20)
        assert_eq!(load_bound(64, 4), 21); // ceil(20.3125)
        assert_eq!(load_bound(5, 0), 8); // n taken as 1
    }

    fn ring(n: u32) -> Ring<u32> {
        Ring::new((0..n).collect(), |m| hash_bytes(&m.to_le_bytes()))
    }

    #[test]
    fn ring_shares_are_even() {
        for n in [2u32, 3, 4, 8, 64] {
            let r = ring(n);
            // Each member's share of the ring: the arcs that end at its points.
            let mut share = vec![0f64; n as usize];
            let pts = &r.points;
            for (i, (p, m)) in pts.iter().enumerate() {
                let prev = if i == 0 {
                    pts[pts.len() - 1].0
                } else {
                    pts[i - 1].0
                };
                share[*m as usize] += p.wrapping_sub(prev) as f64 / 2f64.powi(64);
            }
            let even = 1.0 / f64::from(n);
            for s in &share {
                assert!(
                    (s - even).abs() < 0.2 * even,
                    "n {n}: share {s} against {even}"
                );
            }
        }
    }

    #[test]
    fn ring_spreads_prefixes_over_members() {
        let r = ring(4);
        let mut counts = [0usize; 4];
        for p in 0..4000u32 {
            let key = hash_bytes(format!("prompt {p}").as_bytes());
            counts[bounded_pick(&r, key, 32, |_| Some(0)).unwrap()] += 1;
        }
        for c in counts {
            assert!((800..=1200).contains(&c), "{counts:?}");
        }
        assert_eq!(counts.iter().sum::<usize>(), 4000);
    }

    #[test]
    fn a_prefix_sticks_to_its_instance_while_under_the_bound() {
        let r = ring(4);
        let key = hash_bytes(b"You are a helpful assistant.");
        let home = bounded_pick(&r, key, 32, |_| Some(0)).unwrap();
        // Others busy too: the home instance keeps it while it is within 25% of the average.
        let loads = |home_load: usize| {
            move |m: &u32| Some(if *m as usize == home { home_load } else { 10 })
        };
        // total 30 + 12 = 42; bound ceil(1.25 * 43 / 4) = 14.
        assert_eq!(bounded_pick(&r, key, 32, loads(12)), Some(home));
        assert_eq!(bounded_pick(&r, key, 32, loads(13)), Some(home));
        // total 44: bound ceil(1.25 * 45 / 4) = 15; at 14 it still takes, at 15 it spills.
        assert_eq!(bounded_pick(&r, key, 32, loads(14)), Some(home));
        let spill = bounded_pick(&r, key, 32, loads(15)).unwrap();
        assert_ne!(spill, home);
        // The spill-over is the next instance on the ring: the same every time.
        let next = r.walk(key).map(|(i, _)| i).find(|i| *i != home).unwrap();
        assert_eq!(spill, next);
    }

    #[test]
    fn bounded_load_keeps_every_instance_within_c_of_the_average() {
        // Every request has the same prefix: the worst case for affinity.
        let r = ring(4);
        let key = hash_bytes(b"same");
        let mut counts = [0usize; 4];
        for _ in 0..100 {
            let i = bounded_pick(&r, key, 32, |m| Some(counts[*m as usize])).unwrap();
            counts[i] += 1;
            let total: usize = counts.iter().sum();
            let max = *counts.iter().max().unwrap();
            assert!(max <= load_bound(total - 1, 4), "{counts:?}");
        }
        // Spread over the ring in its order from the key (the first instances fill up to the
        // bound, the rest take what is left), never more than c times the average on one.
        assert_eq!(counts.iter().sum::<usize>(), 100);
        assert!(*counts.iter().max().unwrap() <= 32, "{counts:?}");
        assert!(counts.iter().filter(|c| **c > 0).count() >= 3, "{counts:?}");
    }

    #[test]
    fn bounded_pick_respects_the_per_instance_cap_and_closed_members() {
        let r = ring(2);
        let key = hash_bytes(b"x");
        // Member 0 closed: only member 1.
        assert_eq!(
            bounded_pick(&r, key, 32, |m| (*m == 1).then_some(5)),
            Some(1)
        );
        // Both full: none.
        assert_eq!(bounded_pick(&r, key, 32, |_| Some(32)), None);
        // One full, the bound above the cap: the other, even if it has more than the bound.
        assert_eq!(
            bounded_pick(&r, key, 32, |m| Some(if *m == 0 { 32 } else { 31 })),
            Some(1)
        );
        assert_eq!(
            bounded_pick(&r, key, 32, |m| Some(if *m == 1 { 32 } else { 31 })),
            Some(0)
        );
    }

    #[test]
    fn a_member_leaving_moves_only_its_own_prefixes() {
        let four = ring(4);
        let three: Ring<u32> = Ring::new(vec![0, 1, 3], |m| hash_bytes(&m.to_le_bytes()));
        let mut moved = 0;
        for p in 0..2000u32 {
            let key = hash_bytes(format!("p{p}").as_bytes());
            let before = four.members()[bounded_pick(&four, key, 32, |_| Some(0)).unwrap()];
            let after = three.members()[bounded_pick(&three, key, 32, |_| Some(0)).unwrap()];
            if before != 2 {
                assert_eq!(before, after, "prefix {p} moved");
            } else {
                moved += 1;
            }
        }
        assert!((350..=650).contains(&moved), "{moved}");
    }

    #[test]
    fn the_hash_of_pieces_is_the_hash_of_their_concatenation() {
        let mut h = Fnv::new();
        h.write(b"hello ");
        h.write(b"world");
        assert_eq!(h.finish(), hash_bytes(b"hello world"));
        assert_ne!(hash_bytes(b"a"), hash_bytes(b"b"));
    }
}
