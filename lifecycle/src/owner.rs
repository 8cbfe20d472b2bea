//! The lifecycle's owner: one task, and the one turn at a time that writes [`State`] (see
//! `lifecycle/DESIGN.md`, "One owner").
//!
//! Everything that changes the lifecycle's state is a call of [`State`]'s rules sent to this
//! task's inbox ([`Owner::call`], or [`Owner::tell`] when nobody waits for the answer) and run
//! there, one at a time, in the order sent; engine exits and the timer's ticks come to the same
//! task. A call never waits (the rules call no host agent, router or store); the engine calls
//! of an operation run on the caller's task between two calls (mark busy; call the agent;
//! write the outcome). After each turn the owner bumps the change counter (`changes`), which
//! `start --wait`, a stop waiting out a start and the tests watch.
//!
//! NB (a call run where it is): when nothing sent before it is still waiting in the inbox and
//! the write lock is free at once, [`Owner::call`] runs its call on the caller's task, as a turn
//! of its own (the same lock, the same catch of a panic, the same bookkeeping after it), instead
//! of sending it and awaiting the answer: one at a time and in the order sent still hold (the
//! lock; a call goes through the inbox whenever one sent before it is still there, counted in
//! `queued`), and a switch's path crosses two hand-offs fewer per call (the owner's task woken,
//! then the caller woken with the answer: on a multi-thread runtime, each often a wake-up of the
//! other worker's thread; `switch_share` counts them).
//!
//! Reads ([`Owner::read`]: the views, the load read, the router's `resolve` and
//! `admissible`) do not take a turn: the state is published to them behind a read-write lock
//! that is taken for writing only for a turn (on the owner's task: one call, or the calls
//! already waiting in the inbox, at most [`TURN`]; or one call run where it is, above); so a
//! read waits for at most one short turn, and no read ever waits for a host call, a save or
//! another read.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard, TryLockError};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use crate::state::State;

/// A call of the rules, run by the owner.
type Job = Box<dyn FnOnce(&mut State) + Send>;

/// The most calls the owner runs in one turn (one hold of the write lock).
const TURN: usize = 64;

/// What the owner's task also listens to: engine exits and a timer (see [`Owner::spawn`]).
pub(crate) trait Ticks: Send + Sync + 'static {
    /// An engine exited on `host` (from `HostAgent::subscribe_exits`); called on the owner's
    /// task, between turns; must not wait (it may spawn).
    fn engine_exited(&self, state: &mut State, host: String, exit: super::EngineExit);
    /// The timer fired (idle timers, queue gauges): called between turns; must not wait for
    /// anything but a read of the state (which may wait out one turn run where it is).
    fn tick(&self);
}

/// The handle of the owner's task: how the lifecycle's state is read and changed.
pub(crate) struct Owner {
    state: Arc<RwLock<State>>,
    inbox: mpsc::UnboundedSender<Job>,
    /// Calls sent to the inbox and not yet run (decremented under the write lock, after the
    /// call ran).
    queued: Arc<AtomicUsize>,
    changes: Arc<watch::Sender<u64>>,
}

impl std::fmt::Debug for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Owner").finish_non_exhaustive()
    }
}

impl Owner {
    /// Starts the owner's task over `state`. It bumps `changes` after every turn, hands
    /// engine exits from `exits` and the ticks of a `tick`-long timer to `ticks`, and ends
    /// when every handle is dropped or `closed` turns true.
    pub(crate) fn spawn(
        state: State,
        changes: Arc<watch::Sender<u64>>,
        exits: mpsc::Receiver<(String, super::EngineExit)>,
        tick: Duration,
        ticks: std::sync::Weak<dyn Ticks>,
        closed: watch::Receiver<bool>,
    ) -> Owner {
        let state = Arc::new(RwLock::new(state));
        let (inbox, rx) = mpsc::unbounded_channel();
        let queued = Arc::new(AtomicUsize::new(0));
        tokio::spawn(run(
            Arc::clone(&state),
            rx,
            Arc::clone(&queued),
            Arc::clone(&changes),
            exits,
            tick,
            ticks,
            closed,
        ));
        Owner {
            state,
            inbox,
            queued,
            changes,
        }
    }

    /// The state itself, for a commit on the blocking pool (`writer.rs`), which reads it
    /// (a blocking thread has no `.await` to hold it across).
    pub(crate) fn shared(&self) -> Arc<RwLock<State>> {
        Arc::clone(&self.state)
    }

    /// Reads the state (no turn of the owner's task; waits at most for one turn).
    pub(crate) fn read<R>(&self, f: impl FnOnce(&State) -> R) -> R {
        f(&self.state())
    }

    /// The state, read-locked (see [`Owner::read`]): never held across an `.await`.
    pub(crate) fn state(&self) -> RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` in the owner's turn; its answer: on the caller's task when nothing sent
    /// before it waits and the write lock is free (see the module's notes), else on the
    /// owner's task. Panics when `f` panicked (logged as on the owner's task) or the owner's
    /// task is gone (the runtime shutting down).
    pub(crate) async fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut State) -> R + Send + 'static,
    ) -> R {
        if let Some(mut s) = self.turn_here() {
            let r = run_rule(|| f(&mut s));
            end_turn(&mut s);
            drop(s);
            self.changes.send_modify(|n| *n = n.wrapping_add(1));
            return r.unwrap_or_else(|| panic!("the lifecycle's owner did not answer"));
        }
        let (tx, rx) = oneshot::channel();
        self.tell(move |s| {
            let _ = tx.send(f(s));
        });
        match rx.await {
            Ok(r) => r,
            // The call panicked (logged by the owner), or the task is gone with the runtime.
            Err(_) => panic!("the lifecycle's owner did not answer"),
        }
    }

    /// Sends `f` to the owner's task (run in turn, after what was sent before); nobody waits.
    pub(crate) fn tell(&self, f: impl FnOnce(&mut State) + Send + 'static) {
        self.queued.fetch_add(1, Ordering::SeqCst);
        if self.inbox.send(Box::new(f)).is_err() {
            self.queued.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// The write lock, when it is free at once and no call sent before waits in the inbox
    /// (checked under the lock: the owner counts a call off only once it ran, under it).
    fn turn_here(&self) -> Option<RwLockWriteGuard<'_, State>> {
        let s = match self.state.try_write() {
            Ok(s) => s,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        (self.queued.load(Ordering::SeqCst) == 0).then_some(s)
    }
}

/// Runs one call of the rules: its answer, `None` when it panicked. A rule that panics is a
/// bug; it must not stop the lifecycle: it is logged, and its caller's answer is dropped (the
/// caller panics in turn).
fn run_rule<R>(rule: impl FnOnce() -> R) -> Option<R> {
    let r = std::panic::catch_unwind(AssertUnwindSafe(rule)).ok();
    if r.is_none() {
        tracing::error!("a lifecycle rule panicked; its change is lost");
    }
    r
}

/// What the owner does after each turn, whoever ran it.
fn end_turn(s: &mut State) {
    s.sync_touched(Instant::now());
    s.settle_held();
}

#[allow(clippy::too_many_arguments)]
async fn run(
    state: Arc<RwLock<State>>,
    mut inbox: mpsc::UnboundedReceiver<Job>,
    queued: Arc<AtomicUsize>,
    changes: Arc<watch::Sender<u64>>,
    mut exits: mpsc::Receiver<(String, super::EngineExit)>,
    tick: Duration,
    ticks: std::sync::Weak<dyn Ticks>,
    mut closed: watch::Receiver<bool>,
) {
    let mut interval = tokio::time::interval(tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut exits_open = true;
    let mut open = true;
    let mut jobs: Vec<Job> = Vec::with_capacity(TURN);
    loop {
        tokio::select! {
            biased;
            n = inbox.recv_many(&mut jobs, TURN) => {
                if n == 0 {
                    return;
                }
                {
                    let mut s = state.write().unwrap_or_else(PoisonError::into_inner);
                    for job in jobs.drain(..) {
                        run_rule(|| job(&mut s));
                        queued.fetch_sub(1, Ordering::SeqCst);
                    }
                    end_turn(&mut s);
                }
                changes.send_modify(|n| *n = n.wrapping_add(1));
            }
            exit = exits.recv(), if exits_open => match exit {
                Some((host, exit)) => {
                    // NB: not upgradable while the server is being built (the task starts
                    // first) or once it is dropped (then the inbox closes, and the task ends).
                    let Some(t) = ticks.upgrade() else { continue };
                    {
                        let mut s = state.write().unwrap_or_else(PoisonError::into_inner);
                        t.engine_exited(&mut s, host, exit);
                    }
                    changes.send_modify(|n| *n = n.wrapping_add(1));
                }
                None => exits_open = false,
            },
            _ = interval.tick(), if open => {
                if let Some(t) = ticks.upgrade() {
                    t.tick();
                }
            }
            _ = closed.wait_for(|c| *c), if open => {
                // Closed: no more engine exits or ticks; calls still run (the lifecycle's
                // callers finish), until every handle is gone.
                open = false;
                exits_open = false;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::sync::Mutex;

    struct NoTicks;

    impl Ticks for NoTicks {
        fn engine_exited(&self, _: &mut State, _: String, _: super::super::EngineExit) {}
        fn tick(&self) {}
    }

    fn owner() -> (Owner, watch::Receiver<u64>) {
        let (changes, seen) = watch::channel(0);
        let (_exits_tx, exits) = mpsc::channel(1);
        let (_closed_tx, closed) = watch::channel(false);
        let ticks: std::sync::Weak<dyn Ticks> = std::sync::Weak::<NoTicks>::new();
        let owner = Owner::spawn(
            State::default(),
            Arc::new(changes),
            exits,
            Duration::from_secs(3600),
            ticks,
            closed,
        );
        (owner, seen)
    }

    /// A call run where it is keeps the order sent: one sent after a `tell` that the owner's
    /// task has not run yet goes through the inbox, behind it; with nothing waiting, a call
    /// runs at once, before the owner's task is polled at all.
    #[tokio::test]
    async fn a_call_runs_where_it_is_only_with_nothing_sent_before_it_waiting() {
        let (owner, seen) = owner();
        let order = Arc::new(Mutex::new(Vec::new()));
        // Nothing waits: run here (the current-thread runtime has not polled the owner's task).
        let o = Arc::clone(&order);
        owner
            .call(move |_| o.lock().unwrap().push("first call"))
            .await;
        assert_eq!(*order.lock().unwrap(), ["first call"]);
        assert_eq!(*seen.borrow(), 1, "one turn counted");
        // A tell waits in the inbox: the next call goes behind it.
        let o = Arc::clone(&order);
        owner.tell(move |_| o.lock().unwrap().push("told"));
        assert_eq!(owner.queued.load(Ordering::SeqCst), 1);
        let o = Arc::clone(&order);
        owner
            .call(move |_| o.lock().unwrap().push("second call"))
            .await;
        assert_eq!(
            *order.lock().unwrap(),
            ["first call", "told", "second call"]
        );
        assert_eq!(owner.queued.load(Ordering::SeqCst), 0);
        // Nothing waits again: run here.
        let o = Arc::clone(&order);
        owner
            .call(move |_| o.lock().unwrap().push("third call"))
            .await;
        assert_eq!(order.lock().unwrap().last(), Some(&"third call"));
    }

    /// A rule that panics in a call run where it is panics its caller, as on the owner's task,
    /// and the lifecycle goes on: the next call runs.
    #[tokio::test]
    async fn a_panicking_call_run_where_it_is_panics_its_caller_and_the_next_call_runs() {
        let (owner, _seen) = owner();
        let owner = Arc::new(owner);
        let o = Arc::clone(&owner);
        let caller = tokio::spawn(async move {
            o.call(|_| -> () { panic!("a broken rule") }).await;
        });
        assert!(caller.await.unwrap_err().is_panic());
        assert_eq!(owner.call(|_| 7).await, 7);
    }
}
