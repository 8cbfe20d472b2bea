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

/// One deployment holding (or about to hold) GPU memory.
#[derive(Debug, Clone)]
pub(crate) struct Holder {
    /// The deployment's ID.
    pub id: String,
    /// Its name, for messages.
    pub name: String,
    /// The bytes it holds.
    pub bytes: u64,
    /// How it may be treated.
    pub hold: Hold,
    /// How long since its last request (longest idle is released first).
    pub idle_for: Duration,
}

/// The answer of [`place`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Fit {
    /// There is room now.
    Now,
    /// There is room once these deployments' instances are released (longest idle first).
    After(Vec<String>),
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
pub(crate) fn place(capacity: u64, need: u64, holders: &[Holder], evict: bool) -> Fit {
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
    let pinned: Vec<&Holder> = holders.iter().filter(|h| h.hold == Hold::Pinned).collect();
    let pinned_bytes: u64 = pinned.iter().map(|h| h.bytes).sum();
    if need > capacity.saturating_sub(pinned_bytes) {
        let names: Vec<&str> = pinned.iter().map(|h| h.name.as_str()).collect();
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
    let mut candidates: Vec<&Holder> = holders
        .iter()
        .filter(|h| h.hold == Hold::Releasable)
        .collect();
    candidates.sort_by(|a, b| b.idle_for.cmp(&a.idle_for).then(a.id.cmp(&b.id)));
    let mut freed = free;
    let mut victims = Vec::new();
    for c in candidates {
        if freed >= need {
            break;
        }
        freed = freed.saturating_add(c.bytes);
        victims.push(c.id.clone());
    }
    if freed >= need {
        Fit::After(victims)
    } else {
        Fit::Later
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 1 << 30;

    fn h(id: &str, gb: u64, hold: Hold, idle_s: u64) -> Holder {
        Holder {
            id: id.into(),
            name: format!("n-{id}"),
            bytes: gb * G,
            hold,
            idle_for: Duration::from_secs(idle_s),
        }
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
