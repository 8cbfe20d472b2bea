//! Placement and the choice of victims, as pure functions: does a deployment fit on one host
//! or GPU now, after releasing which idle instances, later, or never ([`place`]); how good a
//! placement is ([`rank_of`]); and, for an instance over several GPUs, which GPUs it takes and
//! the fewest victims that make room on all of them ([`choose_gpus`], [`fewest_victims`]).
//! `state/placing.rs` reads the lifecycle's state into [`Holder`]s and calls these.

use std::time::Duration;

/// How an instance that holds GPU memory may be treated by a placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hold {
    /// Idle and releasable (a victim candidate): ready, not explicit, not warm, no waiting
    /// requests, not reserved, no operation in progress.
    Releasable,
    /// Held for now (busy, reserved by another switch, waiting requests, starting, ...).
    Busy,
    /// Held for good as far as placement goes (explicit or warm).
    Pinned,
    /// Held for this placement: of a higher priority than the target's, never parked or
    /// stopped for it (DESIGN 4.10). Only a placement that may name victims says so.
    Outranks,
}

/// One deployment holding (or about to hold) GPU memory (borrowed from the lifecycle's state:
/// a placement copies no strings but its victims' IDs).
#[derive(Debug, Clone)]
pub(crate) struct Holder<'a> {
    /// The deployment's ID.
    pub id: &'a str,
    /// Its name, for messages.
    pub name: &'a str,
    /// The bytes it holds.
    pub bytes: u64,
    /// How it may be treated.
    pub hold: Hold,
    /// How long since its last request (longest idle is released first).
    pub idle_for: Duration,
    /// A parked engine: what it still holds on the GPU is its `bytes`, and releasing it stops
    /// it. Ready instances are released first; parked ones only when that is not enough.
    pub parked: bool,
    /// What it would still hold once released: a ready instance that parks keeps its parked
    /// residue (CUDA context, graphs, pools); 0 for one that stops.
    pub keeps: u64,
    /// Its deployment's `priority` (DESIGN 4.10): among victims that may go, lower first.
    pub priority: i32,
}

impl Holder<'_> {
    /// What it still holds on the GPU once released: its residue when it parks, nothing when
    /// it stops (`stopping`).
    pub fn left_after_release(&self, stopping: bool) -> u64 {
        if stopping {
            0
        } else {
            self.keeps.min(self.bytes)
        }
    }
}

/// The share on GPU `gpu` (of `cap` bytes) of a holder of `bytes` over the GPUs `theirs` of
/// its host (empty: not known, so it counts whole on every GPU): its bytes split evenly over
/// its GPUs, at most the GPU's. `None` when it is not on that GPU.
pub(crate) fn gpu_share(bytes: u64, theirs: &[u32], gpu: u32, cap: u64) -> Option<u64> {
    if !theirs.is_empty() && !theirs.contains(&gpu) {
        return None;
    }
    Some((bytes / theirs.len().max(1) as u64).min(cap))
}

/// The answer of [`place`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Fit {
    /// There is room now.
    Now,
    /// There is room once these deployments' instances are released (longest idle first).
    After(Vec<String>),
    /// There is room only if these deployments' ready instances stop instead of parking (what
    /// a parked engine keeps on the GPU would be in the way); parked ones among them stop too.
    AfterStopping(Vec<String>),
    /// Memory is held by instances that cannot be released now.
    Later,
    /// It can never fit while the pinned instances hold their memory (or the GPU is too small).
    Never(String),
}

/// Bytes as people read them (`6.0 GiB`).
pub(crate) fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// Where `need` bytes fit on a host with `capacity` bytes held by `holders`. With `evict`
/// false no victim is ever named (`Later` instead).
pub(crate) fn place(capacity: u64, need: u64, holders: &[Holder<'_>], evict: bool) -> Fit {
    if need > capacity {
        return Fit::Never(format!(
            "it needs {} and the GPU has {}",
            gib(need),
            gib(capacity)
        ));
    }
    let used: u64 = holders.iter().map(|h| h.bytes).sum();
    let free = capacity.saturating_sub(used);
    if free >= need {
        return Fit::Now;
    }
    let pinned: Vec<&Holder<'_>> = holders.iter().filter(|h| h.hold == Hold::Pinned).collect();
    let pinned_bytes: u64 = pinned.iter().map(|h| h.bytes).sum();
    if need > capacity.saturating_sub(pinned_bytes) {
        let names: Vec<&str> = pinned.iter().map(|h| h.name).collect();
        return Fit::Never(format!(
            "it needs {}, and {} of the GPU's {} is held by explicit or warm deployments that are never released for room ({})",
            gib(need),
            gib(pinned_bytes),
            gib(capacity),
            names.join(", ")
        ));
    }
    if let Some(why) = outranked(capacity, need, pinned_bytes, holders) {
        return Fit::Never(why);
    }
    if !evict {
        return Fit::Later;
    }
    let mut candidates: Vec<&Holder<'_>> = holders
        .iter()
        .filter(|h| h.hold == Hold::Releasable)
        .collect();
    // Lower priorities first (DESIGN 4.10); then ready instances (they park and keep their
    // copy), longest idle first; parked engines are stopped for their residue only when that
    // is not enough.
    candidates.sort_by(|a, b| {
        a.priority
            .cmp(&b.priority)
            .then(a.parked.cmp(&b.parked))
            .then(b.idle_for.cmp(&a.idle_for))
            .then(a.id.cmp(b.id))
    });
    let mixed = candidates
        .windows(2)
        .any(|w| w[0].priority != w[1].priority);
    // First as they park (keeping their residue), then, if that is not enough, as they stop.
    for stopping in [false, true] {
        let mut freed = free;
        let mut victims: Vec<&Holder<'_>> = Vec::new();
        for c in &candidates {
            if freed >= need {
                break;
            }
            freed = freed.saturating_add(c.bytes - c.left_after_release(stopping));
            victims.push(c);
        }
        if freed >= need && mixed {
            // A lower priority taken first may not be needed once a higher one goes too:
            // only as many as needed, the highest priority kept out first.
            // NB: with one priority everywhere the page's order is exact as it was.
            for i in (0..victims.len()).rev() {
                let gives = victims[i].bytes - victims[i].left_after_release(stopping);
                if freed - gives >= need {
                    freed -= gives;
                    victims.remove(i);
                }
            }
        }
        let victims: Vec<String> = victims.iter().map(|c| c.id.to_string()).collect();
        if freed >= need {
            return if stopping {
                Fit::AfterStopping(victims)
            } else {
                Fit::After(victims)
            };
        }
    }
    Fit::Later
}

/// `Never` (why) when `need` cannot fit while the pinned holders and those that outrank the
/// target (`Hold::Outranks`, DESIGN 4.10) keep their memory, naming the priority that protects
/// it; `None` when it could, or nothing outranks the target.
fn outranked(
    capacity: u64,
    need: u64,
    pinned_bytes: u64,
    holders: &[Holder<'_>],
) -> Option<String> {
    let above: Vec<&Holder<'_>> = holders
        .iter()
        .filter(|h| h.hold == Hold::Outranks)
        .collect();
    let above_bytes: u64 = above.iter().map(|h| h.bytes).sum();
    if above.is_empty() || need <= capacity.saturating_sub(pinned_bytes + above_bytes) {
        return None;
    }
    let mut names: Vec<String> = above
        .iter()
        .map(|h| format!("{}: priority {}", h.name, h.priority))
        .collect();
    names.extend(
        holders
            .iter()
            .filter(|h| h.hold == Hold::Pinned)
            .map(|h| format!("{}: explicit or warm", h.name)),
    );
    Some(format!(
        "it needs {}, and {} of the GPU's {} is held by deployments of a higher priority, which are never parked or stopped for a lower one ({})",
        gib(need),
        gib(pinned_bytes + above_bytes),
        gib(capacity),
        names.join("; ")
    ))
}

/// Among GPUs of the same kind of fit, which victims go first: the lowest of their highest
/// priority (DESIGN 4.10; `i32::MIN` without victims), and among equal ranks those that run no
/// request now, then the longest idle.
pub(crate) type VictimOrder = (i32, bool, std::cmp::Reverse<Duration>);

/// One GPU as `State::place_on_gpus` reads it: its bytes, the instance's share of its
/// memory there, and what holds that GPU.
pub(crate) type GpuRoom<'a> = (u64, u64, Vec<Holder<'a>>);

/// `victims` (sorted), each GPU's choice for an instance over several GPUs (`rooms`), less
/// those the others make unneeded: a victim that spans several of these GPUs frees its share on
/// each, so the victim another GPU named beside it may not be needed at all. Tried for removal
/// the most recently used first; one goes when every GPU still has room with the rest released
/// (parked, keeping their residue; stopped, none, when `stop`).
pub(crate) fn fewest_victims(
    rooms: &[GpuRoom<'_>],
    mut victims: Vec<String>,
    stop: bool,
) -> Vec<String> {
    let idle_for = |id: &str| {
        rooms
            .iter()
            .flat_map(|(_, _, on_gpu)| on_gpu.iter())
            .find(|h| h.id == id)
            .map_or(Duration::ZERO, |h| h.idle_for)
    };
    let room_with = |released: &[String]| {
        rooms.iter().all(|(cap, need, on_gpu)| {
            let held: u64 = on_gpu
                .iter()
                .map(|h| {
                    if released.iter().any(|v| v == h.id) {
                        h.left_after_release(stop)
                    } else {
                        h.bytes
                    }
                })
                .sum();
            cap.saturating_sub(held) >= *need
        })
    };
    let priority = |id: &str| {
        rooms
            .iter()
            .flat_map(|(_, _, on_gpu)| on_gpu.iter())
            .find(|h| h.id == id)
            .map_or(0, |h| h.priority)
    };
    let mut order = victims.clone();
    // The highest priority is tried first (DESIGN 4.10), then the most recently used.
    order.sort_by_key(|id| (std::cmp::Reverse(priority(id)), idle_for(id), id.clone()));
    for id in order {
        let without: Vec<String> = victims.iter().filter(|v| **v != id).cloned().collect();
        if room_with(&without) {
            victims = without;
        }
    }
    victims
}

/// A GPU that may take an instance (`State::place_on_gpus`, [`choose_gpus`]): its index, the fit there, its
/// rank, the order of its victims, and its room.
pub(crate) type GpuChoice<'a> = (u32, Fit, (u8, u64), VictimOrder, GpuRoom<'a>);

/// A placement on some GPUs of a host: the GPUs, the fit, and its rank ([`rank_of`]).
pub(crate) type GpuPlacement = (Vec<u32>, Fit, (u8, u64));

/// How good a placement on a host (or GPU) of `capacity` is, lower first: room now (the
/// fullest that fits), then victims that park before victims that must stop (fewest bytes
/// first), then later. `None` for `Never`.
pub(crate) fn rank_of(
    fit: &Fit,
    capacity: u64,
    need: u64,
    holders: &[Holder<'_>],
) -> Option<(u8, u64)> {
    Some(match fit {
        Fit::Now => {
            let used: u64 = holders.iter().map(|h| h.bytes).sum();
            (0, capacity.saturating_sub(used).saturating_sub(need))
        }
        Fit::After(victims) | Fit::AfterStopping(victims) => (
            if matches!(fit, Fit::After(_)) { 1 } else { 2 },
            holders
                .iter()
                .filter(|h| victims.iter().any(|v| v == h.id))
                .map(|h| h.bytes)
                .sum(),
        ),
        Fit::Later => (3, 0),
        Fit::Never(_) => return None,
    })
}

/// The order of the victims `fit` names on a GPU held by `on_gpu` ([`VictimOrder`]): the
/// highest priority among them, whether one of them `runs` requests now, and how long the
/// least idle of them has been idle.
pub(crate) fn victim_order(
    fit: &Fit,
    on_gpu: &[Holder<'_>],
    runs: impl Fn(&str) -> bool,
) -> VictimOrder {
    match fit {
        Fit::After(v) | Fit::AfterStopping(v) => (
            on_gpu
                .iter()
                .filter(|h| v.iter().any(|id| id == h.id))
                .map(|h| h.priority)
                .max()
                .unwrap_or(i32::MIN),
            v.iter().any(|id| runs(id)),
            std::cmp::Reverse(
                on_gpu
                    .iter()
                    .filter(|h| v.iter().any(|id| id == h.id))
                    .map(|h| h.idle_for)
                    .min()
                    .unwrap_or_default(),
            ),
        ),
        _ => (i32::MIN, false, std::cmp::Reverse(Duration::ZERO)),
    }
}

/// The GPUs of a host an instance over `want` of them takes, among those that may (`each`, at
/// least `want`): the best kind of fit first, then the lowest priority among its victims,
/// then the fewest victim bytes (the rest of the rank), then the victims that run no request,
/// then the longest idle ([`VictimOrder`]), then the lowest index. Their victims are the union of each
/// GPU's, less those the others make unneeded ([`fewest_victims`]); the placement's rank is
/// the worst of theirs.
pub(crate) fn choose_gpus(mut each: Vec<GpuChoice<'_>>, want: usize) -> GpuPlacement {
    each.sort_by_key(|(index, _, rank, (priority, runs, idle), _)| {
        (rank.0, *priority, rank.1, *runs, *idle, *index)
    });
    each.truncate(want);
    let gpus: Vec<u32> = each.iter().map(|(i, _, _, _, _)| *i).collect();
    let worst = each
        .iter()
        .map(|(_, _, r, _, _)| *r)
        .max()
        .unwrap_or((0, 0));
    let mut stop = false;
    let mut victims: Vec<String> = Vec::new();
    let mut later = false;
    let mut rooms: Vec<GpuRoom<'_>> = Vec::with_capacity(each.len());
    for (_, fit, _, _, room) in each {
        rooms.push(room);
        match fit {
            Fit::Now => {}
            Fit::After(v) => victims.extend(v),
            Fit::AfterStopping(v) => {
                stop = true;
                victims.extend(v);
            }
            Fit::Later | Fit::Never(_) => later = true,
        }
    }
    victims.sort();
    victims.dedup();
    if !later && rooms.len() > 1 {
        victims = fewest_victims(&rooms, victims, stop);
    }
    let fit = if later {
        Fit::Later
    } else if victims.is_empty() {
        Fit::Now
    } else if stop {
        Fit::AfterStopping(victims)
    } else {
        Fit::After(victims)
    };
    let rank = match fit {
        Fit::Now => (0, worst.1),
        _ => worst,
    };
    (gpus, fit, rank)
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 1 << 30;

    fn h(id: &'static str, gb: u64, hold: Hold, idle_s: u64) -> Holder<'static> {
        Holder {
            id,
            name: Box::leak(format!("n-{id}").into_boxed_str()),
            bytes: gb * G,
            hold,
            idle_for: Duration::from_secs(idle_s),
            parked: false,
            keeps: 0,
            priority: 0,
        }
    }

    #[test]
    fn a_parked_residue_counts_and_is_stopped_only_after_the_ready_ones() {
        let mut parked = h("p", 1, Hold::Releasable, 900);
        parked.parked = true;
        // A ready model that parks keeps 1 GiB of its 6.
        let mut ready = h("r", 6, Hold::Releasable, 10);
        ready.keeps = G;
        // 10 GiB: 1 parked + 6 ready in use, 3 free. 8 needed: parking r frees 5 (8 free),
        // enough; the older parked engine stays.
        assert_eq!(
            place(10 * G, 8 * G, &[parked.clone(), ready.clone()], true),
            Fit::After(vec!["r".into()])
        );
        // 9 needed: r's residue stays, so the parked engine is stopped too.
        assert_eq!(
            place(10 * G, 9 * G, &[parked.clone(), ready.clone()], true),
            Fit::After(vec!["r".into(), "p".into()])
        );
        // 9.5 needed: even then 9 are free; only stopping r (no residue) makes room.
        assert_eq!(
            place(10 * G, 19 * G / 2, &[parked.clone(), ready.clone()], true),
            Fit::AfterStopping(vec!["r".into(), "p".into()])
        );
        // Without evict: a parked residue in the way means later, not never.
        assert_eq!(place(10 * G, 9 * G, &[parked, ready], false), Fit::Later);
    }

    fn prio(mut h: Holder<'static>, priority: i32) -> Holder<'static> {
        h.priority = priority;
        h
    }

    #[test]
    fn lower_priorities_go_first_then_the_pages_order_and_no_more_than_needed() {
        // `a` is the longest idle, but of priority 5: `b` and `c` (0) go first, longest idle
        // first.
        let holders = [
            prio(h("a", 4, Hold::Releasable, 500), 5),
            h("b", 2, Hold::Releasable, 5),
            h("c", 2, Hold::Releasable, 50),
        ];
        assert_eq!(
            place(10 * G, 4 * G, &holders, true),
            Fit::After(vec!["c".into()])
        );
        assert_eq!(
            place(10 * G, 6 * G, &holders, true),
            Fit::After(vec!["c".into(), "b".into()])
        );
        // 8 needed: the lower ones are not enough, `a` goes too; then `c` and `b` are not
        // both needed: `b`, the most recently used, is left out.
        assert_eq!(
            place(10 * G, 8 * G, &holders, true),
            Fit::After(vec!["c".into(), "a".into()])
        );
        // A lower-priority parked residue is taken before a higher ready model, and left out
        // when the ready one alone makes room.
        let mut parked = h("p", 1, Hold::Releasable, 900);
        parked.parked = true;
        let ready = prio(h("r", 6, Hold::Releasable, 10), 3);
        assert_eq!(
            place(10 * G, 8 * G, &[parked.clone(), ready.clone()], true),
            Fit::After(vec!["r".into()])
        );
        assert_eq!(
            place(10 * G, 19 * G / 2, &[parked, ready], true),
            Fit::After(vec!["p".into(), "r".into()])
        );
    }

    #[test]
    fn a_higher_priority_that_keeps_the_room_means_never_naming_it() {
        let holders = [prio(h("prod", 8, Hold::Outranks, 500), 100)];
        match place(10 * G, 6 * G, &holders, true) {
            Fit::Never(why) => assert_eq!(
                why,
                "it needs 6.0 GiB, and 8.0 GiB of the GPU's 10.0 GiB is held by deployments of a higher priority, which are never parked or stopped for a lower one (n-prod: priority 100)"
            ),
            other => panic!("{other:?}"),
        }
        // Room beside it: it stays, and the rest is as before.
        assert_eq!(place(10 * G, 2 * G, &holders, true), Fit::Now);
        let holders = [
            prio(h("prod", 4, Hold::Outranks, 500), 100),
            h("t", 4, Hold::Releasable, 5),
        ];
        assert_eq!(
            place(10 * G, 6 * G, &holders, true),
            Fit::After(vec!["t".into()])
        );
        // Only busy lower ones besides: later, not never.
        let holders = [
            prio(h("prod", 4, Hold::Outranks, 500), 100),
            h("t", 4, Hold::Busy, 5),
        ];
        assert_eq!(place(10 * G, 6 * G, &holders, true), Fit::Later);
        // With a pinned one, both are named.
        let holders = [
            prio(h("prod", 4, Hold::Outranks, 500), 100),
            h("w", 4, Hold::Pinned, 5),
        ];
        match place(10 * G, 6 * G, &holders, true) {
            Fit::Never(why) => assert!(
                why.ends_with("(n-prod: priority 100; n-w: explicit or warm)"),
                "{why}"
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_instance_over_gpus_takes_the_gpus_of_the_lowest_priorities() {
        // Three GPUs of 10 GiB, one victim each; the instance needs 8 GiB on each of two. `a`
        // is the longest idle but of priority 5; `b` and `c` (0) go, though `b` holds more.
        let choice = |index: u32, on_gpu: Vec<Holder<'static>>| {
            let fit = place(10 * G, 8 * G, &on_gpu, true);
            let rank = rank_of(&fit, 10 * G, 8 * G, &on_gpu).expect("ranked");
            let order = victim_order(&fit, &on_gpu, |_| false);
            (index, fit, rank, order, (10 * G, 8 * G, on_gpu))
        };
        let (gpus, fit, _) = choose_gpus(
            vec![
                choice(0, vec![prio(h("a", 6, Hold::Releasable, 900), 5)]),
                choice(1, vec![h("b", 7, Hold::Releasable, 10)]),
                choice(2, vec![h("c", 6, Hold::Releasable, 50)]),
            ],
            2,
        );
        assert_eq!(gpus, [2, 1]);
        assert_eq!(fit, Fit::After(vec!["b".into(), "c".into()]));
        // Of two victims over both GPUs, either enough: the higher priority is left out,
        // though the more idle.
        let wide = || {
            vec![
                prio(h("w", 3, Hold::Releasable, 500), 9),
                h("x", 3, Hold::Releasable, 10),
            ]
        };
        let rooms = vec![(10 * G, 5 * G, wide()), (10 * G, 5 * G, wide())];
        assert_eq!(
            fewest_victims(&rooms, vec!["w".into(), "x".into()], false),
            ["x".to_string()]
        );
    }

    #[test]
    fn fits_now_when_free() {
        assert_eq!(
            place(10 * G, 4 * G, &[h("a", 6, Hold::Busy, 0)], true),
            Fit::Now
        );
    }

    #[test]
    fn longest_idle_goes_first_and_only_as_many_as_needed() {
        let holders = [
            h("a", 4, Hold::Releasable, 5),
            h("b", 4, Hold::Releasable, 50),
            h("c", 2, Hold::Busy, 0),
        ];
        assert_eq!(
            place(10 * G, 4 * G, &holders, true),
            Fit::After(vec!["b".into()])
        );
        assert_eq!(
            place(10 * G, 8 * G, &holders, true),
            Fit::After(vec!["b".into(), "a".into()])
        );
    }

    #[test]
    fn without_evict_it_waits() {
        let holders = [h("a", 8, Hold::Releasable, 5)];
        assert_eq!(place(10 * G, 6 * G, &holders, false), Fit::Later);
    }

    #[test]
    fn busy_memory_means_later() {
        let holders = [h("a", 8, Hold::Busy, 5)];
        assert_eq!(place(10 * G, 6 * G, &holders, true), Fit::Later);
    }

    #[test]
    fn pinned_memory_and_small_gpus_mean_never() {
        let holders = [h("a", 8, Hold::Pinned, 500)];
        match place(10 * G, 6 * G, &holders, true) {
            Fit::Never(why) => assert!(why.contains("n-a"), "{why}"),
            other => panic!("{other:?}"),
        }
        match place(10 * G, 11 * G, &[], true) {
            Fit::Never(why) => assert!(why.contains("11.0 GiB"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_instance_over_gpus_takes_those_whose_victims_run_nothing_and_no_victim_too_many() {
        // Four GPUs of 10 GiB; the instance needs 8 GiB on each of two.
        let one = |victim: &'static str, idle_s: u64| {
            let on_gpu = vec![h(victim, 6, Hold::Releasable, idle_s)];
            let fit = place(10 * G, 8 * G, &on_gpu, true);
            (fit, on_gpu)
        };
        let (fit_a, a) = one("a", 100);
        let (fit_b, b) = one("b", 500);
        let (fit_c, c) = one("c", 900);
        // `c` runs requests now: its GPU goes last though it is the longest idle.
        let runs = |id: &str| id == "c";
        let choice = |index: u32, fit: Fit, on_gpu: Vec<Holder<'static>>| {
            let rank =
                rank_of(&fit, 10 * G, 8 * G, &on_gpu).expect("a fit that is not `never` is ranked");
            let order = victim_order(&fit, &on_gpu, runs);
            (index, fit, rank, order, (10 * G, 8 * G, on_gpu))
        };
        let (gpus, fit, rank) = choose_gpus(
            vec![
                choice(0, fit_c, c),
                choice(1, fit_a, a),
                choice(2, fit_b, b),
            ],
            2,
        );
        assert_eq!(
            gpus,
            [2, 1],
            "the longest idle of those that run nothing first"
        );
        assert_eq!(fit, Fit::After(vec!["a".into(), "b".into()]));
        assert_eq!(rank, (1, 6 * G));
        // Two GPUs, each with 4 GiB free and 5 GiB needed, each held by `w` and `x` (3 GiB
        // each): both named, but releasing `w` alone makes room on both; `x`, the most
        // recently used, is tried first and is not needed.
        let wide = || {
            vec![
                h("w", 3, Hold::Releasable, 50),
                h("x", 3, Hold::Releasable, 10),
            ]
        };
        let rooms = vec![(10 * G, 5 * G, wide()), (10 * G, 5 * G, wide())];
        assert_eq!(
            fewest_victims(&rooms, vec!["w".into(), "x".into()], false),
            ["w".to_string()],
            "the most recently used goes when the rest make room"
        );
    }
}
