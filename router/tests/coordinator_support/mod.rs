//! Shared helpers of the coordinator's integration tests: a rig (fake GPU + coordinator) and
//! requests that run as tasks and record when they were answered.
#![allow(dead_code, clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use capyctl_interfaces::router::{DeploymentRef, Upstream};
use capyctl_router::admission::{Admission, Permit};
use capyctl_router::config::RouterConfig;
use capyctl_router::coordinator::CoordinatorHandle;
use capyctl_router::coordinator::testing::{FakeLifecycle, FakeState, FakeTimings};
use capyctl_spec::errors::ApiError;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// `chat-a`'s ID.
pub const A: &str = "01KAAAAAAAAAAAAAAAAAAAAAAA";
/// `chat-b`'s ID.
pub const B: &str = "01KBBBBBBBBBBBBBBBBBBBBBBB";
/// `chat-c`'s ID.
pub const C: &str = "01KCCCCCCCCCCCCCCCCCCCCCCC";

/// A fake GPU and a coordinator on it; the clock's zero is `t0`.
pub struct Rig {
    pub fake: Arc<FakeLifecycle>,
    pub h: CoordinatorHandle,
    pub config: RouterConfig,
    pub t0: Instant,
    pub a: DeploymentRef,
    pub b: DeploymentRef,
    pub c: DeploymentRef,
}

/// `chat-a` ready (one instance, announced), `chat-b` and `chat-c` parked; one deployment fits.
pub async fn rig() -> Rig {
    rig_with(RouterConfig::default(), FakeTimings::default(), 1).await
}

/// A rig with these settings; `chat-a` has `a_instances` instances.
pub async fn rig_with(config: RouterConfig, timings: FakeTimings, a_instances: u32) -> Rig {
    let fake = FakeLifecycle::new(timings);
    let a = fake.add(A, "chat-a", FakeState::Ready, a_instances);
    let b = fake.add(B, "chat-b", FakeState::Parked, 1);
    let c = fake.add(C, "chat-c", FakeState::Parked, 1);
    let h = fake.spawn(config.clone());
    fake.announce(A).await;
    quiesce().await;
    Rig {
        fake,
        h,
        config,
        t0: Instant::now(),
        a,
        b,
        c,
    }
}

impl Rig {
    /// Seconds since `t0`, as a duration.
    pub fn since(&self, t: Instant) -> Duration {
        t - self.t0
    }

    /// Sleeps until `secs` after `t0`, then lets every task run.
    pub async fn until(&self, secs: f64) {
        tokio::time::sleep_until(self.t0 + Duration::from_secs_f64(secs)).await;
        quiesce().await;
    }

    /// Sends a request that holds its permit for `hold`.
    pub fn send(&self, dep: &DeploymentRef, hold: Hold) -> Req {
        let deadline = Instant::now() + self.config.request_deadline;
        self.send_full(dep, deadline, hold)
    }

    /// Sends a request with everything chosen.
    pub fn send_full(&self, dep: &DeploymentRef, deadline: Instant, hold: Hold) -> Req {
        let (tx, rx) = oneshot::channel();
        let h = self.h.clone();
        let dep = dep.clone();
        let t0 = self.t0;
        let task = tokio::spawn(async move {
            let r = h.admit(dep, deadline).await;
            let at = Instant::now() - t0;
            match r {
                Err(e) => {
                    let _ = tx.send((at, Err(e)));
                }
                Ok(permit) => {
                    let _ = tx.send((at, Ok(permit.upstream().clone())));
                    match hold {
                        Hold::For(d) => tokio::time::sleep(d).await,
                        Hold::Cut { after, output } => {
                            tokio::time::sleep(after).await;
                            if output {
                                permit.first_output();
                            }
                            permit.cut();
                        }
                        Hold::Forever => std::future::pending::<()>().await,
                    }
                    drop(permit);
                }
            }
        });
        Req {
            answer: rx,
            got: None,
            task,
        }
    }
}

/// How long a granted request keeps its permit.
#[derive(Debug, Clone, Copy)]
pub enum Hold {
    /// This long, then it finishes.
    For(Duration),
    /// This long, then it is cut (after output or not) and ends.
    Cut { after: Duration, output: bool },
    /// Until the request's task is aborted ([`Req::end`]).
    Forever,
}

/// Seconds as a `Hold::For`.
pub fn hold(secs: f64) -> Hold {
    Hold::For(Duration::from_secs_f64(secs))
}

/// A sent request.
pub struct Req {
    answer: oneshot::Receiver<(Duration, Result<Upstream, ApiError>)>,
    got: Option<(Duration, Result<Upstream, ApiError>)>,
    task: JoinHandle<()>,
}

impl Req {
    fn poll(&mut self) -> Option<&(Duration, Result<Upstream, ApiError>)> {
        if self.got.is_none() {
            self.got = self.answer.try_recv().ok();
        }
        self.got.as_ref()
    }

    /// Its answer: when (since `t0`) and what. Panics if it has not been answered yet.
    pub fn answered(&mut self) -> (Duration, Result<Upstream, ApiError>) {
        self.poll()
            .cloned()
            .expect("the request has not been answered")
    }

    /// Whether it is still waiting for its answer.
    pub fn waiting(&mut self) -> bool {
        self.poll().is_none()
    }

    /// When it was admitted (panics if not answered or refused).
    pub fn admitted_at(&mut self) -> Duration {
        let (at, r) = self.answered();
        r.unwrap_or_else(|e| panic!("refused: {e}"));
        at
    }

    /// The error it was refused with, and when (panics if admitted or waiting).
    pub fn refused(&mut self) -> (Duration, ApiError) {
        let (at, r) = self.answered();
        match r {
            Ok(up) => panic!("admitted to {up:?}"),
            Err(e) => (at, e),
        }
    }

    /// Ends it now: a waiting request hangs up, a running one finishes.
    pub fn end(&self) {
        self.task.abort();
    }
}

/// Lets every ready task run (no time passes).
pub async fn quiesce() {
    for _ in 0..64 {
        tokio::task::yield_now().await;
    }
}

/// Seconds as a duration (for comparisons).
pub fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}
