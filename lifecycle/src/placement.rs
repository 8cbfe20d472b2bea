//! Placement on one host, as a pure function: does a deployment fit now, after releasing which
//! idle instances, later, or never?

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
    if !evict {
        return Fit::Later;
    }
    let mut candidates: Vec<&Holder<'_>> = holders
        .iter()
        .filter(|h| h.hold == Hold::Releasable)
        .collect();
    // Ready instances first (they park and keep their copy), longest idle first; parked
    // engines are stopped for their residue only when that is not enough.
    candidates.sort_by(|a, b| {
        a.parked
            .cmp(&b.parked)
            .then(b.idle_for.cmp(&a.idle_for))
            .then(a.id.cmp(b.id))
    });
    // First as they park (keeping their residue), then, if that is not enough, as they stop.
    for stopping in [false, true] {
        let mut freed = free;
        let mut victims = Vec::new();
        for c in &candidates {
            if freed >= need {
                break;
            }
            freed = freed.saturating_add(c.bytes - c.left_after_release(stopping));
            victims.push(c.id.to_string());
        }
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
}
