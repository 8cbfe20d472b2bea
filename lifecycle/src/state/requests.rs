//! The router's record of requests as the rules read it ([`Requests`]): each deployment's last
//! request start or end, and the requests running on each instance. It is the router's (it sees
//! every request) and changes between two turns of the owner, so the rules that read it take
//! it as an argument, like `now`: a rule is a function of the state, the time and this record,
//! and a unit test gives it a record of its own.

use std::sync::{Arc, PoisonError, RwLock};

use capyctl_interfaces::router::LastUses;
use tokio::time::Instant;

/// What the router records of requests, as the rules read it.
pub(crate) trait Requests {
    /// Deployment `dep`'s last request start or end (none yet: `None`).
    fn last_use(&self, dep: &str) -> Option<Instant>;

    /// Requests the router forwards to instance `index` of deployment `dep` now.
    fn in_flight(&self, dep: &str, index: u32) -> usize;
}

/// No request recorded: a lifecycle without a router, or a rule whose placement names no
/// victims (whom it would release first is all a placement reads of the record).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct NoRequests;

impl Requests for NoRequests {
    fn last_use(&self, _dep: &str) -> Option<Instant> {
        None
    }

    fn in_flight(&self, _dep: &str, _index: u32) -> usize {
        0
    }
}

impl Requests for dyn LastUses {
    fn last_use(&self, dep: &str) -> Option<Instant> {
        self.of(dep)
    }

    fn in_flight(&self, dep: &str, index: u32) -> usize {
        self.in_flight_of(dep, index)
    }
}

/// The server's handle on the router's record ([`Router::last_uses`]): one shared
/// cell, set when the router is attached (`Core::attach_router`); until then nothing is
/// recorded. Reading it takes a read lock of its own and no turn of the router's task. The
/// server hands it to the rules that read it.
///
/// [`Router::last_uses`]: capyctl_interfaces::router::Router::last_uses
#[derive(Debug, Clone, Default)]
pub(crate) struct RouterUses(Arc<RwLock<Option<Arc<dyn LastUses>>>>);

impl RouterUses {
    /// The router's record from now on.
    pub(crate) fn attach(&self, uses: Arc<dyn LastUses>) {
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = Some(uses);
    }

    fn with<R>(&self, f: impl FnOnce(&dyn LastUses) -> R) -> Option<R> {
        self.0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .as_deref()
            .map(f)
    }
}

impl Requests for RouterUses {
    fn last_use(&self, dep: &str) -> Option<Instant> {
        self.with(|u| u.of(dep)).flatten()
    }

    fn in_flight(&self, dep: &str, index: u32) -> usize {
        self.with(|u| u.in_flight_of(dep, index)).unwrap_or(0)
    }
}
