//! The model names the router resolves, cached so that the request path takes no lock of the
//! lifecycle's.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use capyctl_interfaces::router::DeploymentRef;
use tokio::sync::watch;

use crate::state::{Dep, State};

/// The most names [`NameCache`] keeps as not found (names no deployment has, as clients sent
/// them): past it, those are forgotten.
pub(crate) const NOT_FOUND_KEPT: usize = 4096;

/// The model names the lifecycle knows, for the router's [`Lifecycle::resolve`] (each request
/// asks).
///
/// NB (the request path takes no lock of the lifecycle's): a name is resolved through this
/// cache (a read lock of its own); an entry stays good until its deployment is dropped (its
/// [`PresenceOf`] says so), and a name not found is looked up again only after the lifecycle's
/// state changed (`changes`). A request's use of its deployment is the router's to record
/// (`DeploymentLoad::last_used`), not the lifecycle's.
pub(crate) struct NameCache {
    pub(crate) names: RwLock<Names>,
}

pub(crate) struct Names {
    /// The lifecycle's change counter, as of the last time the names not found were forgotten.
    pub(crate) seen: watch::Receiver<u64>,
    /// By name: its deployment (good until that is gone).
    pub(crate) found: HashMap<Box<str>, Found>,
    /// The names not found, as of `seen` (at most [`NOT_FOUND_KEPT`]): the only entries a
    /// change of the state makes stale, kept apart so that forgetting them costs what they
    /// are, not every name (each first look-up of a name follows a change when each model is
    /// used once: a sweep of every name there cost N² for N models).
    pub(crate) not_found: HashSet<String>,
    /// How many names `found` held after its entries whose deployment is gone were last let
    /// go: they are let go again once it holds twice as many (an entry found gone when its
    /// name is looked up is replaced then), so the cache stays within twice the names in use
    /// at a cost of O(1) per look-up, amortized.
    pub(crate) swept_at: usize,
}

/// The fewest names [`Names::found`] holds before its entries whose deployment is gone are let
/// go.
const SWEEP_FROM: usize = 1024;

/// A name's deployment, and whether that deployment is gone.
#[derive(Clone)]
pub(crate) struct Named {
    pub(crate) deployment: DeploymentRef,
    /// Set when its deployment is dropped (deleted): an entry holding this is stale.
    pub(crate) gone: Arc<AtomicBool>,
}

/// A [`Named`] as [`Names::found`] keeps it under its name: the [`DeploymentRef`] it answers
/// is made again for each request (two strings, as the clone of one kept was).
///
/// NB (memory at scale): a name's entry was its name twice (the key and the deployment's
/// `name`, the same but for an adapter's, which resolves to its base) and two `String`s:
/// some 50 bytes of heap per deployment used more than this.
pub(crate) struct Found {
    id: Box<str>,
    /// The deployment's name where it is not the name looked up (an adapter's base).
    name: Option<Box<str>>,
    routing: capyctl_spec::Routing,
    priority: i32,
    gone: Arc<AtomicBool>,
}

impl Found {
    /// `named`, found under `name`.
    fn of(name: &str, named: Named) -> Self {
        let DeploymentRef {
            id,
            name: served,
            routing,
            priority,
        } = named.deployment;
        Found {
            id: id.into(),
            name: (served != name).then(|| served.into()),
            routing,
            priority,
            gone: named.gone,
        }
    }

    /// The deployment it names, found under `name`.
    fn deployment(&self, name: &str) -> DeploymentRef {
        DeploymentRef {
            id: self.id.to_string(),
            name: self.name.as_deref().unwrap_or(name).to_string(),
            routing: self.routing,
            priority: self.priority,
        }
    }

    /// Its deployment is gone (the entry is stale).
    fn gone(&self) -> bool {
        self.gone.load(Ordering::Acquire)
    }
}

/// The deployment named `name` (by name only).
pub(crate) fn named<'a>(inner: &'a State, name: &str) -> Option<&'a Dep> {
    inner.by_name(name)
}

impl std::fmt::Debug for NameCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NameCache").finish_non_exhaustive()
    }
}

impl NameCache {
    pub(crate) fn new(seen: watch::Receiver<u64>) -> Self {
        NameCache {
            names: RwLock::new(Names {
                seen,
                found: HashMap::new(),
                not_found: HashSet::new(),
                swept_at: 0,
            }),
        }
    }

    /// The deployment `model` names; `look_up` reads it from the lifecycle's state (under its
    /// lock) when the cache cannot answer.
    pub(crate) fn get(
        &self,
        model: &str,
        look_up: impl FnOnce() -> Option<Named>,
    ) -> Option<DeploymentRef> {
        {
            let names = self.names.read().unwrap_or_else(PoisonError::into_inner);
            if let Some(n) = names.found.get(model).filter(|n| !n.gone()) {
                return Some(n.deployment(model));
            }
            if names.not_found.contains(model) && !names.seen.has_changed().unwrap_or(true) {
                return None;
            }
        }
        let mut names = self.names.write().unwrap_or_else(PoisonError::into_inner);
        if names.seen.has_changed().unwrap_or(true) {
            // Marked first: a change during the look-up below makes the next one look again.
            names.seen.borrow_and_update();
            names.not_found.clear();
        }
        match look_up() {
            Some(n) => {
                names.not_found.remove(model);
                if names.found.len() >= (2 * names.swept_at).max(SWEEP_FROM) {
                    names.found.retain(|_, n| !n.gone());
                    names.swept_at = names.found.len();
                }
                let deployment = n.deployment.clone();
                names.found.insert(model.into(), Found::of(model, n));
                Some(deployment)
            }
            None => {
                names.found.remove(model);
                if names.not_found.len() >= NOT_FOUND_KEPT {
                    names.not_found.clear();
                }
                names.not_found.insert(model.to_string());
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn named(name: &str) -> Named {
        Named {
            deployment: DeploymentRef {
                id: format!("id-{name}"),
                name: name.to_string(),
                routing: capyctl_spec::Routing::default(),
                priority: 0,
            },
            gone: Arc::new(AtomicBool::new(false)),
        }
    }

    #[test]
    fn a_name_not_found_is_looked_up_again_only_after_a_change_and_a_gone_one_at_once() {
        let (changes, seen) = watch::channel(0u64);
        let cache = NameCache::new(seen);
        let looks = std::cell::Cell::new(0);
        let get = |name: &str, answer: Option<Named>| {
            cache.get(name, || {
                looks.set(looks.get() + 1);
                answer
            })
        };
        assert!(get("a", None).is_none());
        assert!(get("a", None).is_none());
        assert_eq!(looks.get(), 1, "not found: kept until a change");
        changes.send_modify(|n| *n += 1);
        let a = named("a");
        assert_eq!(get("a", Some(a.clone())).unwrap().name, "a");
        assert_eq!(get("a", None).unwrap().name, "a");
        assert_eq!(looks.get(), 2, "found: kept across changes");
        changes.send_modify(|n| *n += 1);
        assert_eq!(get("a", None).unwrap().name, "a");
        assert_eq!(looks.get(), 2);
        // Its deployment dropped: looked up again at once, with no change seen.
        a.gone.store(true, Ordering::Release);
        assert!(get("a", None).is_none());
        assert_eq!(looks.get(), 3);
        assert!(get("a", None).is_none());
        assert_eq!(looks.get(), 3);
    }

    #[test]
    fn the_cache_lets_go_of_the_gone_and_keeps_few_names_not_found() {
        let (changes, seen) = watch::channel(0u64);
        let cache = NameCache::new(seen);
        // Many names found, each after a change (each model used once), then all dropped.
        let mut all = Vec::new();
        for i in 0..(4 * SWEEP_FROM) {
            changes.send_modify(|n| *n += 1);
            let n = named(&format!("m{i}"));
            cache.get(&format!("m{i}"), || Some(n.clone()));
            all.push(n);
        }
        for n in &all {
            n.gone.store(true, Ordering::Release);
        }
        for i in 0..(2 * SWEEP_FROM) {
            let n = named(&format!("new{i}"));
            cache.get(&format!("new{i}"), || Some(n));
        }
        let names = cache.names.read().unwrap();
        let live = names.found.values().filter(|n| !n.gone()).count();
        assert_eq!(live, 2 * SWEEP_FROM);
        assert!(
            names.found.len() <= 2 * live,
            "{} names kept for {live} in use",
            names.found.len()
        );
        drop(names);
        for i in 0..(NOT_FOUND_KEPT + 10) {
            cache.get(&format!("nobody{i}"), || None);
        }
        assert!(cache.names.read().unwrap().not_found.len() <= NOT_FOUND_KEPT);
    }
}
