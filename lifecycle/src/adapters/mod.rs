//! LoRA adapters loaded on demand into the instances of their base (DESIGN 4.9): the one owner
//! of every instance's adapter set ([`Adapters`]), whose rules are pure ([`policy::Slots`]) and
//! whose engine calls ([`Engines`]: the host agent's `adapters`, `load_adapter`,
//! `unload_adapter`, each with its switch record) run on spawned tasks, one at a time per
//! instance, never under its lock. See `lifecycle/DESIGN.md`, "Adapters".

mod engines;
pub(crate) mod policy;
mod rules;
#[cfg(test)]
mod tests;

pub(crate) use engines::CoreEngines;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use capyctl_interfaces::BoxFuture;
use capyctl_interfaces::router::{AdapterRoute, InstanceKey};
use capyctl_spec::errors::ApiError;
use tokio::sync::oneshot;
use tokio::time::Instant;

use policy::{Acquired, Decided, Effect, Outcome, Slots, WaiterId};

pub use policy::Retired;

pub use capyctl_interfaces::router::AdapterLease;

/// The engine calls the owner's effects are (implemented by the lifecycle over its host
/// agents, with switch records; by a script in tests).
pub trait Engines: Send + Sync + 'static {
    /// The adapters the instance's engine has loaded.
    fn list<'a>(&'a self, key: &'a InstanceKey) -> BoxFuture<'a, Result<Vec<String>, ApiError>>;
    /// Loads `adapter` into the instance's engine.
    fn load<'a>(
        &'a self,
        key: &'a InstanceKey,
        adapter: &'a AdapterRoute,
    ) -> BoxFuture<'a, Result<(), ApiError>>;
    /// Unloads adapter `name` from the instance's engine.
    fn unload<'a>(
        &'a self,
        key: &'a InstanceKey,
        name: &'a str,
    ) -> BoxFuture<'a, Result<(), ApiError>>;
}

struct Inner {
    slots: Slots,
    next_id: WaiterId,
    /// The answers of the requests waiting.
    answers: HashMap<WaiterId, oneshot::Sender<Result<(), ApiError>>>,
}

/// The owner of every instance's adapter set (see the module doc).
pub struct Adapters {
    inner: Mutex<Inner>,
    engines: Arc<dyn Engines>,
    me: Weak<Adapters>,
}

impl std::fmt::Debug for Adapters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Adapters").finish_non_exhaustive()
    }
}

impl Adapters {
    /// An owner whose effects `engines` carries out.
    pub fn new(engines: Arc<dyn Engines>) -> Arc<Self> {
        Arc::new_cyclic(|me| Self {
            inner: Mutex::new(Inner {
                slots: Slots::default(),
                next_id: 0,
                answers: HashMap::new(),
            }),
            engines,
            me: me.clone(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until `adapter` is loaded on `key` and counted as running there, or fails: with
    /// `adapter_load_failed` when its load failed, `queue_full` past `limit` requests waiting
    /// on the instance, the queue deadline's error at `deadline`. The lease ends the use.
    pub async fn acquire(
        &self,
        key: &InstanceKey,
        adapter: &AdapterRoute,
        deadline: Instant,
        limit: usize,
    ) -> Result<AdapterLease, ApiError> {
        let Some(me) = self.me.upgrade() else {
            return Err(gone(adapter));
        };
        let mut lease = Lease {
            adapters: Arc::clone(&me),
            key: key.clone(),
            name: adapter.name.clone(),
            armed: false,
        };
        let (id, rx, decided) = {
            let mut inner = self.lock();
            let id = inner.next_id;
            inner.next_id += 1;
            match inner.slots.acquire(key, adapter, id, limit.max(1)) {
                Acquired::Now => {
                    lease.armed = true;
                    return Ok(Box::new(lease));
                }
                Acquired::Full => {
                    return Err(ApiError::TooManyWaiting {
                        deployment: adapter.base.clone(),
                    });
                }
                Acquired::Wait(decided) => {
                    let (tx, rx) = oneshot::channel();
                    inner.answers.insert(id, tx);
                    (id, rx, *decided)
                }
            }
        };
        self.apply(decided);
        let mut pending = Pending {
            lease: Some(lease),
            id,
            rx,
        };
        match tokio::time::timeout_at(deadline, &mut pending.rx).await {
            Ok(Ok(Ok(()))) => pending
                .granted()
                .map(|lease| Box::new(lease) as AdapterLease)
                .ok_or_else(|| gone(adapter)),
            Ok(Ok(Err(e))) => Err(e),
            Ok(Err(_)) => Err(gone(adapter)),
            Err(_) => Err(ApiError::QueueDeadline {
                deployment: adapter.base.clone(),
            }),
        }
    }

    /// Instance `key` opened (started, woken, adopted) or went away: its set is read again
    /// from its engine on its next adapter request; requests waiting on it fail with
    /// `error`.
    pub fn reset(&self, key: &InstanceKey, error: &ApiError) {
        let failed = self.lock().slots.reset(key, error);
        self.apply(Decided {
            failed,
            ..Decided::default()
        });
    }

    /// The engine answered a request for `adapter` on `key` as if it did not have it (its
    /// 404): loaded again by the next request.
    pub fn lost(&self, key: &InstanceKey, adapter: &str) {
        self.lock().slots.lost(key, adapter);
    }

    /// Adapter `name` was deleted or given new files (`why`): retired on every instance
    /// ([`Slots::retire`]): it serves no new request, its running requests finish untouched,
    /// and it is unloaded from the engine once none runs (a switch record of cause `adapter`);
    /// requests waiting for a deleted one get the page's 404.
    pub fn retire(&self, name: &str, why: Retired) {
        let all = self.lock().slots.retire(name, why);
        for decided in all {
            self.apply(decided);
        }
    }

    /// The adapters loaded on each instance (of a base), as far as known.
    pub fn loaded_on(&self) -> Vec<(InstanceKey, Vec<String>)> {
        self.lock().slots.loaded_on()
    }

    /// The instances that have adapter `name` loaded (see [`Slots::holding`]).
    pub fn holding(&self, name: &str) -> Vec<InstanceKey> {
        self.lock().slots.holding(name)
    }

    /// Answers the requests the rules decided on and starts the next effect.
    fn apply(&self, decided: Decided) {
        let Decided {
            granted,
            failed,
            effect,
        } = decided;
        let mut ended = Vec::new();
        if !granted.is_empty() || !failed.is_empty() {
            let mut inner = self.lock();
            for (id, key, name) in granted {
                let sent = inner.answers.remove(&id).map(|tx| tx.send(Ok(())));
                if !matches!(sent, Some(Ok(()))) {
                    // Its waiter went away meanwhile (see `Pending`'s drop): the use it was
                    // granted ends now.
                    ended.push((key, name));
                }
            }
            for (id, e) in failed {
                if let Some(tx) = inner.answers.remove(&id) {
                    let _ = tx.send(Err(e));
                }
            }
        }
        for (key, name) in ended {
            self.release(&key, &name);
        }
        if let Some(effect) = effect {
            self.run(effect);
        }
    }

    /// Carries out `effect` on a task of its own, then reports its outcome.
    fn run(&self, effect: Effect) {
        let Some(me) = self.me.upgrade() else { return };
        tokio::spawn(async move {
            let engines = Arc::clone(&me.engines);
            let (key, outcome) = match effect {
                Effect::List(key) => {
                    let listed = engines.list(&key).await;
                    (key, Outcome::Listed(listed))
                }
                Effect::Load(key, adapter) => {
                    let loaded = engines.load(&key, &adapter).await;
                    (key, Outcome::Loaded(loaded))
                }
                Effect::Unload(key, name) => {
                    let unloaded = engines.unload(&key, &name).await;
                    (key, Outcome::Unloaded(unloaded))
                }
            };
            let decided = me.lock().slots.done(&key, outcome);
            me.apply(decided);
        });
    }

    fn release(&self, key: &InstanceKey, name: &str) {
        let decided = self.lock().slots.release(key, name);
        self.apply(decided);
    }
}

fn gone(adapter: &AdapterRoute) -> ApiError {
    ApiError::AdapterLoadFailed {
        adapter: adapter.name.clone(),
        reason: "CapyCTL is shutting down".into(),
    }
}

/// One request's use of a loaded adapter; dropped when the request ends.
struct Lease {
    adapters: Arc<Adapters>,
    key: InstanceKey,
    name: String,
    /// The use is counted (a lease of a request that never ran ends nothing).
    armed: bool,
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.armed {
            self.adapters.release(&self.key, &self.name);
        }
    }
}

/// A request waiting, with the lease it gets when granted. Dropped before its answer (client
/// gone, deadline), it leaves the queue; when its grant crossed its going, the use it was
/// granted ends (here, or in `Adapters::apply` when the grant came after).
struct Pending {
    /// Not armed until granted; `None` once handed out.
    lease: Option<Lease>,
    id: WaiterId,
    rx: oneshot::Receiver<Result<(), ApiError>>,
}

impl Pending {
    /// The lease of a granted request.
    fn granted(&mut self) -> Option<Lease> {
        let mut lease = self.lease.take()?;
        lease.armed = true;
        Some(lease)
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let Some(lease) = &mut self.lease else {
            return;
        };
        let decided = {
            let mut inner = lease.adapters.lock();
            inner
                .answers
                .remove(&self.id)
                .map(|_| inner.slots.cancel(&lease.key, self.id))
        };
        match decided {
            Some(decided) => lease.adapters.apply(decided),
            None => {
                // Answered already: granted (the use ends as the lease drops) or failed (it
                // never ran). Closed first, so that a grant not sent yet is refused, and
                // ended by `apply`.
                self.rx.close();
                lease.armed = matches!(self.rx.try_recv(), Ok(Ok(())));
            }
        }
    }
}
