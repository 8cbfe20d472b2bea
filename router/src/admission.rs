//! The seam between the HTTP listener and the switch coordinator.
//!
//! The listener (`proxy`) parses a request far enough to know its `model` and body size, asks
//! an [`Admission`] for a [`Permit`] on a ready instance, forwards, and reports how the request
//! ended through the permit. The coordinator implements [`Admission`]; listener tests use a
//! trivial one. Keeping this seam small keeps the listener testable without the coordinator
//! and the coordinator testable without sockets.

use std::future::Future;
use std::time::Duration;

use capyctl_spec::errors::ApiError;
use tokio::time::Instant;

use capyctl_interfaces::router::{DeploymentRef, InstanceKey, Upstream};

/// Hands out permits to forward one request to a ready instance.
pub trait Admission: Clone + Send + Sync + 'static {
    /// The permit type; dropping it ends the request's charge on its instance.
    type Permit: Permit;

    /// The deployment a request's `model` names, or `None` (404 `model_not_found`).
    fn resolve(&self, model: &str) -> Option<DeploymentRef>;

    /// Waits (queueing, switching, the 32 in-flight bound) until the request may be forwarded,
    /// or fails with the product page's error. `deadline` is the request deadline (arrival +
    /// `request_deadline`): past it the wait fails with [`deadline_error`]'s error. (The
    /// bodies of waiting requests are bounded by the listener, which holds every body it
    /// reads within one budget of `max_buffered_bytes_total`: see `proxy::budget`.)
    fn admit(
        &self,
        deployment: DeploymentRef,
        deadline: Instant,
    ) -> impl Future<Output = Result<Self::Permit, ApiError>> + Send;

    /// [`Admission::admit`] with the request's prompt prefix key (see
    /// `coordinator::routing`), which a deployment routed by `prefix` uses to keep prompts
    /// that share a prefix on one instance. An admission with one instance per deployment
    /// ignores it.
    fn admit_routed(
        &self,
        deployment: DeploymentRef,
        deadline: Instant,
        prefix: Option<u64>,
    ) -> impl Future<Output = Result<Self::Permit, ApiError>> + Send {
        let _ = prefix;
        self.admit(deployment, deadline)
    }

    /// [`Admission::admit_routed`] for a request of `tenant` (DESIGN 4.10: beyond the running
    /// bound, the tenants' requests start round-robin and share the waiting limit). An
    /// admission without tenants ignores it.
    fn admit_as(
        &self,
        deployment: DeploymentRef,
        deadline: Instant,
        prefix: Option<u64>,
        tenant: Option<std::sync::Arc<str>>,
    ) -> impl Future<Output = Result<Self::Permit, ApiError>> + Send {
        let _ = tenant;
        self.admit_routed(deployment, deadline, prefix)
    }

    /// [`Admission::admit_as`] for a request that names a LoRA adapter (DESIGN 4.9): `prefer`
    /// are the instances that have it loaded, one of which takes it when any is ready with
    /// room (else it is routed as any request). An admission with one instance per deployment
    /// ignores it.
    fn admit_preferring(
        &self,
        deployment: DeploymentRef,
        deadline: Instant,
        prefix: Option<u64>,
        tenant: Option<std::sync::Arc<str>>,
        prefer: Vec<InstanceKey>,
    ) -> impl Future<Output = Result<Self::Permit, ApiError>> + Send {
        let _ = prefer;
        self.admit_as(deployment, deadline, prefix, tenant)
    }
}

/// The product page's error for a request whose deadline passed before its first output, one
/// rule for the coordinator (a request still waiting at its deadline) and the listener (one
/// forwarded, still without output): `429 queue_full` "stayed at its in-flight bound for the
/// queue deadline" when it spent at least half of `waited` (from its admission to its deadline)
/// waiting for one of the 32 in-flight slots of its deployment while that was servable
/// (`at_bound`): the page's "32 requests kept running for the whole request deadline";
/// otherwise `503 unavailable` "did not become servable within the queue deadline" (it
/// waited for a wake or start, or at the engine).
///
/// NB: "at least half", not "all": a request that waits at the bound behind 32 requests the
/// engine never answers gets its slot when they reach their own deadlines, a moment before
/// its own, and then reaches its deadline at the engine; it waited at the bound all but that
/// moment.
pub fn deadline_error(deployment: &str, at_bound: Duration, waited: Duration) -> ApiError {
    let deployment = deployment.to_string();
    if at_bound > Duration::ZERO && at_bound * 2 >= waited {
        ApiError::InFlightDeadline { deployment }
    } else {
        ApiError::QueueDeadline { deployment }
    }
}

/// One admitted request's charge on an instance. Drop it when the request has ended.
pub trait Permit: Send + Sync + 'static {
    /// Where to forward.
    fn upstream(&self) -> &Upstream;
    /// The engine produced the first output (a chunk that is more than the opening role chunk,
    /// or a non-streamed answer's headers and body).
    fn first_output(&self);
    /// The request was cut short (client gone, stalled reader, oversized piece, deadline).
    /// Whether it had produced output is what `first_output` recorded.
    fn cut(&self);
    /// How long the request waited for one of the in-flight slots of its deployment while
    /// that was servable, before this permit (zero for one admitted at once); for
    /// [`deadline_error`].
    fn waited_at_bound(&self) -> Duration;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deadline_error_names_where_most_of_the_wait_went() {
        let s = Duration::from_secs;
        let in_flight = ApiError::InFlightDeadline {
            deployment: "d".into(),
        };
        let queue = ApiError::QueueDeadline {
            deployment: "d".into(),
        };
        assert_eq!(deadline_error("d", s(5), s(5)), in_flight);
        assert_eq!(deadline_error("d", s(599), s(600)), in_flight);
        assert_eq!(deadline_error("d", s(300), s(600)), in_flight);
        assert_eq!(deadline_error("d", s(299), s(600)), queue);
        assert_eq!(deadline_error("d", s(0), s(600)), queue);
        assert_eq!(deadline_error("d", s(0), s(0)), queue);
    }
}
