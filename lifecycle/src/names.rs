//! The model names the router resolves, cached so that the request path takes no lock of the
//! lifecycle's.

use std::collections::HashMap;
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
    /// By name: its deployment, or `None`: not found (as of `seen`).
    pub(crate) by_name: HashMap<String, Option<Named>>,
}

/// A name's deployment, and whether that deployment is gone.
#[derive(Clone)]
pub(crate) struct Named {
    pub(crate) deployment: DeploymentRef,
    /// Set when its deployment is dropped (deleted): an entry holding this is stale.
    pub(crate) gone: Arc<AtomicBool>,
}

impl Named {
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
                by_name: HashMap::new(),
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
            match names.by_name.get(model) {
                Some(Some(n)) if !n.gone() => return Some(n.deployment.clone()),
                Some(None) if !names.seen.has_changed().unwrap_or(true) => return None,
                _ => {}
            }
        }
        let mut names = self.names.write().unwrap_or_else(PoisonError::into_inner);
        if names.seen.has_changed().unwrap_or(true) {
            // Marked first: a change during the look-up below makes the next one look again.
            names.seen.borrow_and_update();
            names
                .by_name
                .retain(|_, n| n.as_ref().is_some_and(|n| !n.gone()));
        }
        let found = look_up();
        if found.is_none() && names.by_name.len() >= NOT_FOUND_KEPT {
            names.by_name.retain(|_, n| n.is_some());
        }
        names.by_name.insert(model.to_string(), found.clone());
        found.map(|n| n.deployment)
    }
}
