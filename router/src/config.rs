//! The router's own settings, as plain values.
//!
//! NB: this is deliberately not the settings document's type (that lives in `capyctl-crds` and
//! carries ranges, units and sources). The server maps the resolved settings into a
//! [`RouterConfig`]; the router only sees the numbers. The defaults are the product page's
//! ("Settings"), with the server's request deadline.

use std::time::Duration;

/// Requests running at once per instance: fixed at 32 by the product page ("32 per model",
/// per instance with replicas: DESIGN 4.7). A deployment's bound is this times its open
/// (ready) instances.
pub const IN_FLIGHT_PER_INSTANCE: usize = capyctl_spec::settings::IN_FLIGHT_PER_INSTANCE;

/// The request deadline a standalone server uses by default (`host.resource_policy.queue.
/// request_deadline`, 1800 s); [`RouterConfig::default`] has the server's 600 s.
pub const STANDALONE_REQUEST_DEADLINE: Duration = Duration::from_secs(1800);

/// How the router queues, switches and bounds requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouterConfig {
    /// How long a loaded model keeps taking new requests once a switch away from it began
    /// (`resource_policy.queue.admission_window`, default 2 s). Counted from the moment the
    /// switch began; the victims' own traffic does not extend it.
    pub admission_window: Duration,
    /// How long the victims of a switch (or a release) may take to finish their running
    /// requests (`server.switching.drain_timeout`, default 30 s). Past it the switch fails and
    /// the victims serve again.
    pub drain_timeout: Duration,
    /// How long a request may wait for its first output, the switch and the prefill included
    /// (`resource_policy.queue.request_deadline`, default 600 s on a server, 1800 s standalone).
    /// The listener turns it into each request's deadline; the coordinator enforces the
    /// deadline it is given.
    pub request_deadline: Duration,
    /// The longest silence in a reply after its first output
    /// (`resource_policy.queue.stream_idle_timeout`, default 120 s). Enforced by the listener.
    pub stream_idle_timeout: Duration,
    /// Waiting requests per deployment (`resource_policy.queue.max_pending_per_deployment`,
    /// default 64, 0 to 4096). 0 is "no waiting": a request is never queued.
    pub max_pending_per_deployment: usize,
    /// Waiting requests over all deployments (`resource_policy.queue.max_pending_total`,
    /// default 256).
    pub max_pending_total: usize,
    /// Requests forwarded at once to one instance. Fixed at [`IN_FLIGHT_PER_INSTANCE`] by the
    /// product; a field only so that the load read and tests can name it. A deployment's
    /// bound (the load read's `in_flight_limit`) is this times its open instances.
    pub in_flight_per_instance: usize,
    /// How long the lifecycle may take to carry out a switch (release the victims, then wake
    /// or start the target) before the router gives up waiting for it: its waiting requests
    /// are answered `500 internal` and the switch no longer holds up others. The lifecycle
    /// bounds its own steps (`server.switching.wake_timeout`, 600 s by default); this only
    /// catches one that never answers. Default 20 min. (A plan is bounded by `drain_timeout`.)
    pub execute_timeout: Duration,
}

impl RouterConfig {
    /// Whether this is "no waiting" mode (`max_pending_per_deployment == 0`): a request is
    /// answered at once instead of queued.
    pub fn no_wait(&self) -> bool {
        self.max_pending_per_deployment == 0
    }
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            admission_window: Duration::from_secs(2),
            drain_timeout: Duration::from_secs(30),
            request_deadline: Duration::from_secs(600),
            stream_idle_timeout: Duration::from_secs(120),
            max_pending_per_deployment: 64,
            max_pending_total: 256,
            in_flight_per_instance: IN_FLIGHT_PER_INSTANCE,
            execute_timeout: Duration::from_secs(20 * 60),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_product_pages() {
        let c = RouterConfig::default();
        assert_eq!(c.admission_window, Duration::from_secs(2));
        assert_eq!(c.drain_timeout, Duration::from_secs(30));
        assert_eq!(c.stream_idle_timeout, Duration::from_secs(120));
        assert_eq!(c.max_pending_per_deployment, 64);
        assert_eq!(c.max_pending_total, 256);
        assert_eq!(c.in_flight_per_instance, 32);
        assert!(!c.no_wait());
    }
}
