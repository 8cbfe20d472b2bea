//! The state's commits (see `lifecycle/DESIGN.md`, "Saves"): [`commit`] writes the changed
//! records to the store, and the server runs it on Tokio's blocking pool, never on a worker.
//!
//! A commit is a disk's write (redb's fsync, standalone): on a Tokio worker a slow disk would
//! hold up every request and timer that worker serves. So a save hands its commit to
//! `spawn_blocking` and waits for it without holding a worker (under tokio's paused clock the
//! blocking pool also keeps the clock from jumping while a commit runs). Commits run one at a
//! time, under the server's persist lock, each taking the records changed and not written yet
//! (`State::dirty`) once it holds the lock: a save that returns `Ok` has every change made
//! before it asked committed (crash-only: a change whose save returned survives a kill), a
//! commit never writes older records over newer ones, and saves that meet while one commits
//! are written by the next (group commit). The commit runs to its end even when the caller
//! that asked for it is dropped. A failed commit gives its records back to `dirty`, for the
//! next; a store that panics fails that commit only.

use std::panic::AssertUnwindSafe;
use std::sync::{PoisonError, RwLock};

use crate::state::State;
use crate::store::{Changes, Store};

/// One commit: the records in `state`'s `dirty` (and the removal of those deleted), in one
/// write. Call it under the persist lock, off the runtime's workers; why it failed, in words.
pub(crate) fn commit(store: &dyn Store, state: &RwLock<State>) -> Result<(), String> {
    let read = || state.read().unwrap_or_else(PoisonError::into_inner);
    let (ids, changes) = {
        let inner = read();
        let ids = inner.dirty.take();
        let mut changes = Changes::default();
        for id in &ids {
            match inner.deps.get(id) {
                Some(d) => changes.put.push(d.rec.clone()),
                None => changes.remove.push(id.clone()),
            }
        }
        (ids, changes)
    };
    if changes.is_empty() {
        return Ok(());
    }
    let written = std::panic::catch_unwind(AssertUnwindSafe(|| store.write(&changes)))
        .map_err(|_| "the store panicked".to_string())
        .and_then(|w| w.map_err(|e| e.to_string()));
    if written.is_err() {
        read().dirty.give_back(ids);
    }
    written
}
