//! Plumbing: calls to the owner (read, write), saves, IDs, spawned work, receipts.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard, PoisonError};

use capyctl_interfaces::router::BoxFuture;
use capyctl_spec::api::ActionReceipt;
use capyctl_spec::errors::ApiError;

use crate::errors::{internal, not_found};
use crate::state::{State, dep_of_unit};
use crate::{Core, writer};

impl Core {
    /// Reads the state (see [`owner::Owner::read`]).
    pub(crate) fn read<R>(&self, f: impl FnOnce(&State) -> R) -> R {
        self.owner.read(f)
    }

    /// [`Core::write`] of deployment `id`'s change: `f` gets the state and `id`.
    pub(crate) async fn on<R: Send + 'static>(
        &self,
        id: &str,
        f: impl FnOnce(&mut State, &str) -> R + Send + 'static,
    ) -> R {
        let id = id.to_string();
        self.owner.call(move |inner| f(inner, &id)).await
    }

    /// Changes the state: `f` runs on the owner's task, in its turn (see
    /// [`owner::Owner::call`]).
    pub(crate) async fn write<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut State) -> R + Send + 'static,
    ) -> R {
        self.owner.call(f).await
    }

    pub(crate) fn host_exits_of(
        &self,
    ) -> MutexGuard<'_, HashMap<String, tokio::task::AbortHandle>> {
        self.host_exits
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn fresh_id(&self, what: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{what}-{}-{n}", ulid::Ulid::new())
    }

    /// Saves the records changed and not written yet (`State::dirty`), if any: those a
    /// change marked for a later save (a pending start taken, an adoption, a batch of
    /// deploys).
    pub(crate) async fn flush_due(&self) {
        if self.read(|inner| inner.dirty.any()) {
            self.log_failed(self.save().await);
        }
    }

    /// Saves deployment `id`'s record (or its removal, when it is gone) and every other one
    /// changed and not written yet: it is durable when this returns, unless the write failed,
    /// which is logged and must not undo what was decided (the next save writes it again).
    /// `id` may be an instance's unit: its deployment's record is the one stored (instance 0's;
    /// the others' copies are never written over it).
    pub(crate) async fn save_logged(&self, id: &str) {
        let id = dep_of_unit(id).to_string();
        self.read(|inner| inner.dirty.give_back(BTreeSet::from([id])));
        self.log_failed(self.save().await);
    }

    pub(crate) fn log_failed(&self, saved: Result<(), ApiError>) {
        if let Err(e) = saved {
            tracing::warn!(error = %e, "the state was not written; the next change writes it again");
        }
    }

    /// Writes every record in `State::dirty` (and removes the deleted ones) in one transaction,
    /// on Tokio's blocking pool under the persist lock (`writer.rs`: no worker waits for the
    /// disk): saves land in order, each with the records as they are when its commit takes
    /// them, and one that returns `Ok` has every change made before it committed. Saves that
    /// meet while one commits are written by the next (group commit). A failed write gives its
    /// records back to `dirty`, for the next save.
    async fn save(&self) -> Result<(), ApiError> {
        let (order, store, state) = (
            Arc::clone(&self.persist),
            Arc::clone(&self.store),
            self.owner.shared(),
        );
        let committed = tokio::task::spawn_blocking(move || {
            let _order = order.lock().unwrap_or_else(PoisonError::into_inner);
            writer::commit(store.as_ref(), &state)
        })
        .await
        .unwrap_or_else(|e| Err(format!("the commit did not run: {e}")));
        committed.map_err(|e| self.save_failed(&e))
    }

    pub(crate) fn save_failed(&self, e: &str) -> ApiError {
        tracing::error!(error = %e, "saving the state failed");
        internal(format!("saving the state: {e}"))
    }

    pub(crate) fn find(&self, name_or_id: &str) -> Result<String, ApiError> {
        self.read(|inner| inner.by_name_or_id(name_or_id).map(|d| d.rec.id.clone()))
            .ok_or_else(|| not_found(name_or_id))
    }

    pub(crate) fn spawn(&self, work: impl FnOnce(Arc<Core>) -> BoxFuture<'static, ()>) {
        if let Some(me) = self.me.upgrade() {
            tokio::spawn(work(me));
        }
    }

    pub(crate) fn receipt(&self, action: &str, id: &str) -> Result<ActionReceipt, ApiError> {
        Ok(ActionReceipt {
            action: action.to_string(),
            deployment: self.view(id).ok_or_else(|| not_found(id))?,
            switch_id: None,
            victims: Vec::new(),
        })
    }
}
