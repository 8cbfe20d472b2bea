//! The adapter slots' rules (DESIGN 4.9), pure: which adapters each instance of a base has
//! loaded, which requests run on or wait for them, and what to do next. No clock, no engine, no
//! lock: the owner (`super::Adapters`) calls these under its one lock and carries out the
//! [`Effect`]s they answer, then reports each outcome back ([`Slots::done`]).
//!
//! Per instance (an [`InstanceKey`], generation included: an engine started afresh is another
//! instance):
//! - `loaded`: the adapters the engine has, each with the requests running on it and its last
//!   use (a counter of this instance's acquisitions and releases, not a clock);
//! - `op`: the one engine operation in progress (list, load or unload): loads into one
//!   instance are serialized;
//! - `waiting`: the requests waiting, first come first served: for the engine's list, for
//!   their adapter's load (one load for all of them), or for a slot.
//!
//! The rules: a request for a loaded adapter runs at once (unless that adapter is being
//! unloaded). Otherwise it waits, and when no operation runs the first waiter decides the
//! next: the engine's list first (an instance new to the slots: after a start, a wake or an
//! adoption, what the engine lists is what it has); then a load of its adapter when fewer than
//! `max_loaded` are loaded; else an unload of the least recently used adapter that has no
//! running and no waiting request; else nothing (every loaded adapter is busy): it waits
//! until a request ends. A load that fails fails the requests waiting for that adapter and
//! changes nothing else.
//!
//! An adapter deleted, or given new files, is *retired* ([`Slots::retire`]): where it is
//! loaded it serves no new request, its running requests finish untouched, and it is unloaded
//! as soon as none runs (before anything else the instance does); a load of it in progress, or
//! an engine list not read yet, retires it as it comes in. Requests waiting for a deleted one
//! fail with the page's 404 `model_not_found`; a waiter for one given new files loads them once
//! the old ones are unloaded.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use capyctl_interfaces::router::{AdapterRoute, InstanceKey};
use capyctl_spec::errors::ApiError;

/// A waiting request's number (the owner's, to find its answer).
pub(crate) type WaiterId = u64;

/// What the owner must do on an engine (one at a time per instance).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Effect {
    /// Read the adapters the engine has.
    List(InstanceKey),
    /// Load this adapter.
    Load(InstanceKey, AdapterRoute),
    /// Unload the adapter of this name (room for another).
    Unload(InstanceKey, String),
}

/// How an effect ended, reported back with [`Slots::done`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The engine's list (`Err`: unreadable; taken as none loaded).
    Listed(Result<Vec<String>, ApiError>),
    /// The load's result.
    Loaded(Result<(), ApiError>),
    /// The unload's result.
    Unloaded(Result<(), ApiError>),
}

/// What the rules decided for the requests: granted ones run (their adapter is loaded and
/// counted as running), failed ones get their error; and the next effect, if any.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Decided {
    /// Waiters that may run now (counted as running on their adapter, named).
    pub(crate) granted: Vec<(WaiterId, InstanceKey, String)>,
    /// Waiters answered with an error.
    pub(crate) failed: Vec<(WaiterId, ApiError)>,
    /// What to do next on an engine.
    pub(crate) effect: Option<Effect>,
}

/// What [`Slots::acquire`] answers.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Acquired {
    /// The adapter is loaded: the request runs now (counted; [`Slots::release`] when it ends).
    Now,
    /// The request waits as `WaiterId`; do `Decided::effect` (its `granted` and `failed` are
    /// other waiters').
    Wait(Box<Decided>),
    /// The waiting limit is reached.
    Full,
}

#[derive(Debug, Default)]
struct Loaded {
    running: u32,
    last_used: u64,
    /// Deleted or given new files: unloaded once no request runs on it, granted to none.
    retired: bool,
}

/// Why an adapter is retired ([`Slots::retire`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retired {
    /// It was deleted: the requests waiting for it get the page's 404.
    Deleted,
    /// Its files changed (a new revision): waiters load the new files after the unload.
    Revised,
}

#[derive(Debug)]
struct Waiter {
    id: WaiterId,
    adapter: AdapterRoute,
}

#[derive(Debug, Default)]
struct Instance {
    loaded: HashMap<String, Loaded>,
    op: Option<Op>,
    waiting: VecDeque<Waiter>,
    /// The engine's list has been read.
    listed: bool,
    /// Adapters retired while they could still come in (their load in progress, the engine's
    /// list not read yet): retired when they do.
    retiring: BTreeSet<String>,
    /// This instance's use counter (`Loaded::last_used`).
    uses: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Op {
    List,
    Load(String),
    Unload(String),
}

/// The adapter slots of every instance (see the module doc).
#[derive(Debug, Default)]
pub(crate) struct Slots {
    instances: BTreeMap<InstanceKey, Instance>,
}

impl Slots {
    /// A request for `adapter` on `key`, waiter `id` if it must wait; `limit` is how many may
    /// wait on one instance.
    pub(crate) fn acquire(
        &mut self,
        key: &InstanceKey,
        adapter: &AdapterRoute,
        id: WaiterId,
        limit: usize,
    ) -> Acquired {
        self.forget_older(key);
        let inst = self.instances.entry(key.clone()).or_default();
        if inst.listed
            && inst.op != Some(Op::Unload(adapter.name.clone()))
            && let Some(l) = inst.loaded.get_mut(&adapter.name)
            && !l.retired
        {
            inst.uses += 1;
            l.running += 1;
            l.last_used = inst.uses;
            return Acquired::Now;
        }
        if inst.waiting.len() >= limit {
            return Acquired::Full;
        }
        inst.waiting.push_back(Waiter {
            id,
            adapter: adapter.clone(),
        });
        Acquired::Wait(Box::new(self.next(key)))
    }

    /// A request that ran on `adapter` ended.
    pub(crate) fn release(&mut self, key: &InstanceKey, adapter: &str) -> Decided {
        let Some(inst) = self.instances.get_mut(key) else {
            return Decided::default();
        };
        if let Some(l) = inst.loaded.get_mut(adapter) {
            inst.uses += 1;
            l.running = l.running.saturating_sub(1);
            l.last_used = inst.uses;
        }
        self.next(key)
    }

    /// Waiter `id` went away (its client, its deadline).
    pub(crate) fn cancel(&mut self, key: &InstanceKey, id: WaiterId) -> Decided {
        let Some(inst) = self.instances.get_mut(key) else {
            return Decided::default();
        };
        inst.waiting.retain(|w| w.id != id);
        self.next(key)
    }

    /// The effect in progress on `key` ended with `outcome`.
    pub(crate) fn done(&mut self, key: &InstanceKey, outcome: Outcome) -> Decided {
        let Some(inst) = self.instances.get_mut(key) else {
            return Decided::default();
        };
        let mut decided = Decided::default();
        match (inst.op.take(), outcome) {
            (Some(Op::List), Outcome::Listed(listed)) => {
                inst.listed = true;
                let retiring = std::mem::take(&mut inst.retiring);
                inst.loaded = listed
                    .unwrap_or_default()
                    .into_iter()
                    .map(|name| {
                        let retired = retiring.contains(&name);
                        (
                            name,
                            Loaded {
                                retired,
                                ..Loaded::default()
                            },
                        )
                    })
                    .collect();
            }
            (Some(Op::Load(name)), Outcome::Loaded(Ok(()))) => {
                inst.uses += 1;
                let last_used = inst.uses;
                let retired = inst.retiring.remove(&name);
                inst.loaded.insert(
                    name,
                    Loaded {
                        running: 0,
                        last_used,
                        retired,
                    },
                );
            }
            (Some(Op::Load(name)), Outcome::Loaded(Err(e))) => {
                inst.retiring.remove(&name);
                let e = as_load_failure(&name, e);
                inst.waiting.retain(|w| {
                    let mine = w.adapter.name == name;
                    if mine {
                        decided.failed.push((w.id, e.clone()));
                    }
                    !mine
                });
            }
            (Some(Op::Unload(name)), Outcome::Unloaded(Ok(()))) => {
                inst.loaded.remove(&name);
            }
            (Some(Op::Unload(name)), Outcome::Unloaded(Err(_)))
                if inst.loaded.get(&name).is_some_and(|l| l.retired) =>
            {
                // A retired one is not tried again (the engine refused: whatever it keeps is
                // out of CapyCTL's hands until the base restarts); no waiter wanted its room.
                inst.loaded.remove(&name);
            }
            (Some(Op::Unload(name)), Outcome::Unloaded(Err(e))) => {
                // It stays loaded; the first waiter, for whom the room was wanted, fails with
                // why (else the same unload would be tried again at once).
                if let Some(w) = inst.waiting.pop_front() {
                    let reason =
                        format!("no room: unloading adapter {name} failed: {}", e.message());
                    decided.failed.push((
                        w.id,
                        ApiError::AdapterLoadFailed {
                            adapter: w.adapter.name,
                            reason,
                        },
                    ));
                }
            }
            (op, _) => inst.op = op,
        }
        let next = self.next(key);
        decided.granted.extend(next.granted);
        decided.failed.extend(next.failed);
        decided.effect = next.effect;
        decided
    }

    /// Instance `key` opened (a start, a wake, an adoption) or went away: what it had loaded
    /// is forgotten (read again from its engine on its next request), and the requests that
    /// waited on it fail with `error` (they hold a permit of an instance that went away).
    pub(crate) fn reset(
        &mut self,
        key: &InstanceKey,
        error: &ApiError,
    ) -> Vec<(WaiterId, ApiError)> {
        let same = |k: &InstanceKey| k.deployment == key.deployment && k.index == key.index;
        let gone: Vec<InstanceKey> = self.instances.keys().filter(|k| same(k)).cloned().collect();
        let mut failed = Vec::new();
        for k in gone {
            if let Some(inst) = self.instances.remove(&k) {
                failed.extend(inst.waiting.into_iter().map(|w| (w.id, error.clone())));
            }
        }
        failed
    }

    /// Adapter `name` was deleted or given new files (`why`): on every instance it is retired
    /// (see the module doc). Answers, per instance touched, what to do there: the requests
    /// waiting for a deleted one fail with `model_not_found`, and an idle one is unloaded now.
    pub(crate) fn retire(&mut self, name: &str, why: Retired) -> Vec<Decided> {
        let keys: Vec<InstanceKey> = self.instances.keys().cloned().collect();
        let mut all = Vec::new();
        for key in keys {
            let Some(inst) = self.instances.get_mut(&key) else {
                continue;
            };
            let mut decided = Decided::default();
            if let Some(l) = inst.loaded.get_mut(name) {
                l.retired = true;
            }
            if !inst.listed || inst.op == Some(Op::Load(name.to_string())) {
                inst.retiring.insert(name.to_string());
            }
            if why == Retired::Deleted {
                inst.waiting.retain(|w| {
                    let mine = w.adapter.name == name;
                    if mine {
                        decided.failed.push((
                            w.id,
                            ApiError::ModelNotFound {
                                model: name.to_string(),
                            },
                        ));
                    }
                    !mine
                });
            }
            let next = self.next(&key);
            decided.granted.extend(next.granted);
            decided.failed.extend(next.failed);
            decided.effect = next.effect;
            if decided != Decided::default() {
                all.push(decided);
            }
        }
        all
    }

    /// The adapters each instance has loaded, as far as known (read from its engine once),
    /// but the retired ones (on their way out).
    pub(crate) fn loaded_on(&self) -> Vec<(InstanceKey, Vec<String>)> {
        self.instances
            .iter()
            .filter(|(_, i)| i.listed)
            .map(|(k, i)| {
                let mut names: Vec<String> = i
                    .loaded
                    .iter()
                    .filter(|(_, l)| !l.retired)
                    .map(|(name, _)| name.clone())
                    .collect();
                names.sort();
                (k.clone(), names)
            })
            .collect()
    }

    /// The instances whose engine has adapter `name` loaded, as far as known (listed, and not
    /// being unloaded): where a request for it runs without a load.
    pub(crate) fn holding(&self, name: &str) -> Vec<InstanceKey> {
        self.instances
            .iter()
            .filter(|(_, i)| {
                i.listed
                    && i.loaded.get(name).is_some_and(|l| !l.retired)
                    && !matches!(&i.op, Some(Op::Unload(n)) if n == name)
            })
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// An answer of the engine that says it does not have `adapter` (its 404): forgotten, so
    /// that the next request loads it again.
    pub(crate) fn lost(&mut self, key: &InstanceKey, adapter: &str) {
        if let Some(inst) = self.instances.get_mut(key)
            && inst.op != Some(Op::Unload(adapter.to_string()))
            && inst.loaded.get(adapter).is_some_and(|l| l.running <= 1)
        {
            // The request that saw it is still counted; it releases into nothing.
            inst.loaded.remove(adapter);
        }
    }

    /// Older generations of `key`'s instance are gone (a restart the owner was not told of).
    fn forget_older(&mut self, key: &InstanceKey) {
        let older: Vec<InstanceKey> = self
            .instances
            .keys()
            .filter(|k| {
                k.deployment == key.deployment
                    && k.index == key.index
                    && k.generation != key.generation
            })
            .cloned()
            .collect();
        for k in older {
            self.instances.remove(&k);
        }
    }

    /// With no operation in progress on `key`: the waiters whose adapter is loaded run, and
    /// the first other waiter decides the next operation (see the module doc).
    fn next(&mut self, key: &InstanceKey) -> Decided {
        let mut decided = Decided::default();
        let Some(inst) = self.instances.get_mut(key) else {
            return decided;
        };
        if inst.op.is_some() {
            return decided;
        }
        if !inst.listed {
            if !inst.waiting.is_empty() {
                inst.op = Some(Op::List);
                decided.effect = Some(Effect::List(key.clone()));
            }
            return decided;
        }
        // A retired adapter that no request runs on goes first.
        if let Some(name) = inst
            .loaded
            .iter()
            .filter(|(_, l)| l.retired && l.running == 0)
            .map(|(name, _)| name.clone())
            .min()
        {
            inst.op = Some(Op::Unload(name.clone()));
            decided.effect = Some(Effect::Unload(key.clone(), name));
            return decided;
        }
        let Instance {
            loaded,
            waiting,
            uses,
            ..
        } = inst;
        waiting.retain(|w| match loaded.get_mut(&w.adapter.name) {
            Some(l) if !l.retired => {
                *uses += 1;
                l.running += 1;
                l.last_used = *uses;
                decided
                    .granted
                    .push((w.id, key.clone(), w.adapter.name.clone()));
                false
            }
            _ => true,
        });
        // The first waiter whose adapter is not loaded decides (one waiting for a retired
        // adapter still running waits for its unload without holding up the others).
        let Some(first) = waiting
            .iter()
            .find(|w| !loaded.contains_key(&w.adapter.name))
        else {
            return decided;
        };
        let max = usize::try_from(first.adapter.max_loaded).unwrap_or(usize::MAX);
        if loaded.len() < max {
            inst.op = Some(Op::Load(first.adapter.name.clone()));
            decided.effect = Some(Effect::Load(key.clone(), first.adapter.clone()));
            return decided;
        }
        // Every waiter wants an adapter not loaded or retired (the loaded ones' were granted
        // above), so a loaded adapter is busy only through its running requests; a retired
        // one goes once they end (above).
        let victim = loaded
            .iter()
            .filter(|(_, l)| l.running == 0 && !l.retired)
            .min_by_key(|(name, l)| (l.last_used, name.as_str()))
            .map(|(name, _)| name.clone());
        if let Some(victim) = victim {
            inst.op = Some(Op::Unload(victim.clone()));
            decided.effect = Some(Effect::Unload(key.clone(), victim));
        }
        decided
    }
}

/// An engine's refusal as the request's error: `adapter_load_failed` naming the adapter.
fn as_load_failure(name: &str, e: ApiError) -> ApiError {
    match e {
        ApiError::AdapterLoadFailed { .. } => e,
        other => ApiError::AdapterLoadFailed {
            adapter: name.to_string(),
            reason: other.message(),
        },
    }
}
