//! The seam between the HTTP listener and the switch coordinator.
//!
//! The listener (`proxy`) parses a request far enough to know its `model` and body size, asks
//! an [`Admission`] for a [`Permit`] on a ready instance, forwards, and reports how the request
//! ended through the permit. The coordinator implements [`Admission`]; listener tests use a
//! trivial one. Keeping this seam small keeps the listener testable without the coordinator
//! and the coordinator testable without sockets.

use std::future::Future;

use capyctl_crds::errors::ApiError;
use tokio::time::Instant;

use crate::lifecycle::{DeploymentRef, Upstream};

/// Hands out permits to forward one request to a ready instance.
pub trait Admission: Clone + Send + Sync + 'static {
    /// The permit type; dropping it ends the request's charge on its instance.
    type Permit: Permit;

    /// The deployment a request's `model` names, or `None` (404 `model_not_found`).
    fn resolve(&self, model: &str) -> Option<DeploymentRef>;

    /// Waits (queueing, switching, the 32 in-flight bound) until the request may be forwarded,
    /// or fails with the product page's error. `body_bytes` counts against
    /// `max_buffered_bytes_total` while the request waits. `deadline` is the request deadline
    /// (arrival + `request_deadline`): past it the wait fails with `QueueDeadline` or
    /// `InFlightDeadline`.
    fn admit(
        &self,
        deployment: DeploymentRef,
        body_bytes: u64,
        deadline: Instant,
    ) -> impl Future<Output = Result<Self::Permit, ApiError>> + Send;
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
}
