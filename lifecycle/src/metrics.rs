//! The server's Prometheus metrics ([`Metrics`]), served as OpenMetrics text at `GET /metrics`
//! on the management listener.
//!
//! Every metric is named `capyctl_…`; durations are `_seconds` histograms with buckets from 1 ms
//! doubling to about 9 minutes. The lifecycle and the router report through the methods of
//! [`Metrics`]; nothing here keeps state of its own beyond the metric values and the ring of
//! recent requests ([`Metrics::recent_requests`]).
//!
//! | metric | type | labels | what |
//! |---|---|---|---|
//! | `capyctl_requests_total` | counter | `deployment`, `status`, `code` | inference requests that ended, by HTTP status and error code (`ok` for a success) |
//! | `capyctl_request_wait_seconds` | histogram | `deployment` | how long an ended request waited in CapyCTL before it was forwarded (or refused) |
//! | `capyctl_switches_total` | counter | `outcome` | switches that ended (`ok`, `drain_timeout`, …): one per switch record that ended `ok` or `failed` (not one given up), whatever its cause (a wave, `start --evict`, a bring-up, a release, an idle timer, a host drain) |
//! | `capyctl_switch_seconds` | histogram | `outcome` | a whole switch, from its begin (its admission window's) to its end |
//! | `capyctl_switch_phase_seconds` | histogram | `phase`, `engine` | one phase of a switch (its record's: `admission_window`, `drain`, `park`, `stop`, `wake`, `start`, `wake_check`, `release`), by the engine of the instance it moved (`vllm`, `sglang`, `tensorfold`) |
//! | `capyctl_parks_total` | counter | `tier`, `outcome` | parks that ended, by tier (`host_ram`, `deep`, `kv_only`) and outcome (`ok`, or the error's label); a release that stopped instead of parking counts under tier `none` with outcome `stopped` (the model does not park), `stopped_no_room_to_park` or `capability_missing` |
//! | `capyctl_park_seconds` | histogram | `tier`, `outcome` | how long a park took |
//! | `capyctl_wakes_total` | counter | `tier`, `outcome` | wakes that ended, by the tier woken from and outcome (`ok`, `wake_mismatch`, …) |
//! | `capyctl_wake_seconds` | histogram | `tier`, `outcome` | how long a wake took (check prompt included) |
//! | `capyctl_queue_waiting` | gauge | `deployment` | requests waiting in CapyCTL now |
//! | `capyctl_in_flight` | gauge | `deployment` | requests being forwarded now (bound 32 per instance) |
//! | `capyctl_kube_api_request_seconds` | histogram | `verb`, `resource`, `outcome` | a call to the Kubernetes API server, to its response's head (operator only) |
//! | `capyctl_build_info` | gauge | `version` | always 1: the CapyCTL release that answers |
//!
//! Every family is listed (its `HELP`, `TYPE` and `UNIT` lines) from the first scrape on, before
//! anything was observed: a scraper and its alerting rules see what exists, not only what
//! happened (prometheus-client leaves out an empty family by itself; [`Listed`] keeps it).
//!
//! NB: label values are what the caller passes; the lifecycle passes deployment IDs (ULIDs), not
//! names, so a re-deploy under the same name keeps one series.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use crate::recent::RecentRequests;
use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::{Registry, Unit};

/// The content type of [`Metrics::encode`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The metrics' common prefix.
pub const PREFIX: &str = "capyctl";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    /// The deployment's, shared with [`RequestHandles`]' key and `capyctl_request_wait_seconds`'
    /// label (NB: memory at scale, as [`DeploymentLabels`]).
    deployment: Arc<str>,
    status: String,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeploymentLabels {
    /// NB (memory at scale): shared (one per deployment for its request handles, counters and
    /// wait histogram; the queue gauges' is [`Queues`]' key).
    deployment: Arc<str>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabels {
    phase: String,
    engine: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierOutcomeLabels {
    tier: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VersionLabels {
    version: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KubeApiLabels {
    verb: String,
    resource: String,
    outcome: String,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// A metric registered so that it is always encoded: its descriptor (`HELP`, `TYPE`, `UNIT`)
/// even while it holds no sample yet, which prometheus-client would otherwise leave out.
#[derive(Debug)]
struct Listed<M>(M);

impl<M: EncodeMetric + TypedMetric> EncodeMetric for Listed<M> {
    fn encode(&self, encoder: MetricEncoder) -> Result<(), fmt::Error> {
        self.0.encode(encoder)
    }

    fn metric_type(&self) -> MetricType {
        M::TYPE
    }

    fn is_empty(&self) -> bool {
        false
    }
}

/// Every deployment's queue gauges: `capyctl_queue_waiting` (index 0) and `capyctl_in_flight`
/// (1), side by side under the deployment's ID, one map for the two families
/// ([`QueueFamily`]).
///
/// NB (memory at scale): as two prometheus-client families each deployment's label was held
/// in two maps and each gauge was an `Arc` of its own: some 180 bytes of heap per deployment
/// that had requests, about 100 now.
type Queues = Arc<RwLock<HashMap<Arc<str>, [AtomicI64; 2]>>>;

/// One of the two gauge families of [`Queues`] (`which`: its index there), encoded as a
/// prometheus-client family of gauges labelled `deployment` is (a sample per deployment), and
/// listed while it holds none (as [`Listed`]).
#[derive(Debug)]
struct QueueFamily {
    queues: Queues,
    which: usize,
}

impl TypedMetric for QueueFamily {
    const TYPE: MetricType = MetricType::Gauge;
}

impl EncodeMetric for QueueFamily {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), fmt::Error> {
        let queues = self.queues.read().unwrap_or_else(PoisonError::into_inner);
        for (deployment, values) in queues.iter() {
            let labels = DeploymentLabels {
                deployment: Arc::clone(deployment),
            };
            let value = values
                .get(self.which)
                .map_or(0, |v| v.load(Ordering::Relaxed));
            encoder.encode_family(&labels)?.encode_gauge(&value)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// 1 ms, 2 ms, 4 ms, … 524 s (20 buckets, then `+Inf`).
fn seconds_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 20))
}

fn histogram_family<L: Clone + std::hash::Hash + Eq>() -> HistogramFamily<L> {
    Family::new_with_constructor(seconds_histogram as fn() -> Histogram)
}

fn tier_outcome(tier: &str, outcome: &str) -> TierOutcomeLabels {
    TierOutcomeLabels {
        tier: tier.to_string(),
        outcome: outcome.to_string(),
    }
}

fn saturating_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// The server's metrics (see the module's table). Shared as `Arc<Metrics>`: every method takes
/// `&self` and is cheap (atomic updates behind a read lock per label set).
pub struct Metrics {
    /// Written once in [`Metrics::new`]; read by [`Metrics::encode`].
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    request_wait: HistogramFamily<DeploymentLabels>,
    switches: Family<OutcomeLabels, Counter>,
    switch_duration: HistogramFamily<OutcomeLabels>,
    switch_phase: HistogramFamily<PhaseLabels>,
    parks: Family<TierOutcomeLabels, Counter>,
    park_duration: HistogramFamily<TierOutcomeLabels>,
    wakes: Family<TierOutcomeLabels, Counter>,
    wake_duration: HistogramFamily<TierOutcomeLabels>,
    /// `capyctl_queue_waiting` and `capyctl_in_flight`.
    queues: Queues,
    kube_api: HistogramFamily<KubeApiLabels>,
    /// Every request ends in [`Metrics::request`]: its counter and histogram, found once per
    /// deployment and outcome, then reused without building label strings or looking through
    /// the families (the handles share their values with the families' metrics, which are
    /// never removed: only gauges are).
    request_handles: RwLock<HashMap<Arc<str>, RequestHandles>>,
    /// The last requests that named a model (`GET /management/v1/switches/trace`).
    recent: RecentRequests,
}

/// One deployment's request metrics, as handles.
struct RequestHandles {
    wait: Histogram,
    /// `(status, code)` and its counter; a few per deployment.
    outcomes: Vec<(u16, Box<str>, Counter)>,
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Every metric registered, none observed yet.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix(PREFIX);
        let requests = Family::<RequestLabels, Counter>::default();
        let request_wait = histogram_family();
        let switches = Family::<OutcomeLabels, Counter>::default();
        let switch_duration = histogram_family();
        let switch_phase = histogram_family();
        let parks = Family::<TierOutcomeLabels, Counter>::default();
        let park_duration = histogram_family();
        let wakes = Family::<TierOutcomeLabels, Counter>::default();
        let wake_duration = histogram_family();
        let queues = Queues::default();
        let kube_api = histogram_family();

        registry.register(
            "requests",
            "Inference requests that ended, by deployment, HTTP status and error code (ok for a success)",
            Listed(requests.clone()),
        );
        registry.register_with_unit(
            "request_wait",
            "How long an ended request waited in CapyCTL before it was forwarded or refused",
            Unit::Seconds,
            Listed(request_wait.clone()),
        );
        registry.register(
            "switches",
            "Switches that ended, by outcome",
            Listed(switches.clone()),
        );
        registry.register_with_unit(
            "switch",
            "Duration of a whole switch (from its begin to its end), by outcome",
            Unit::Seconds,
            Listed(switch_duration.clone()),
        );
        registry.register_with_unit(
            "switch_phase",
            "Duration of one phase of a switch, by phase and engine",
            Unit::Seconds,
            Listed(switch_phase.clone()),
        );
        registry.register(
            "parks",
            "Parks that ended, by tier and outcome",
            Listed(parks.clone()),
        );
        registry.register_with_unit(
            "park",
            "How long a park took, by tier and outcome",
            Unit::Seconds,
            Listed(park_duration.clone()),
        );
        registry.register(
            "wakes",
            "Wakes that ended, by tier and outcome",
            Listed(wakes.clone()),
        );
        registry.register_with_unit(
            "wake",
            "How long a wake took (check prompt included), by tier and outcome",
            Unit::Seconds,
            Listed(wake_duration.clone()),
        );
        registry.register(
            "queue_waiting",
            "Requests waiting in CapyCTL now, by deployment",
            QueueFamily {
                queues: Arc::clone(&queues),
                which: 0,
            },
        );
        registry.register(
            "in_flight",
            "Requests being forwarded now, by deployment",
            QueueFamily {
                queues: Arc::clone(&queues),
                which: 1,
            },
        );

        registry.register_with_unit(
            "kube_api_request",
            "A call to the Kubernetes API server, to its response's head, by verb, resource and outcome",
            Unit::Seconds,
            Listed(kube_api.clone()),
        );

        let build_info = Family::<VersionLabels, Gauge>::default();
        build_info
            .get_or_create(&VersionLabels {
                version: env!("CARGO_PKG_VERSION").to_string(),
            })
            .set(1);
        registry.register(
            "build_info",
            "The CapyCTL release that answers (always 1)",
            build_info,
        );

        Self {
            registry,
            requests,
            request_wait,
            switches,
            switch_duration,
            switch_phase,
            parks,
            park_duration,
            wakes,
            wake_duration,
            queues,
            kube_api,
            request_handles: RwLock::new(HashMap::new()),
            recent: RecentRequests::default(),
        }
    }

    /// The last requests that named a model, recorded as each ended (the trace `capyctl
    /// switches --export-trace` writes).
    pub fn recent_requests(&self) -> &RecentRequests {
        &self.recent
    }

    /// One inference request ended with `status` and `code` (`ok` for a success, else the
    /// error's code) after waiting `waited` in CapyCTL: `capyctl_requests_total`,
    /// `capyctl_request_wait_seconds`. On the request path: after the first request of a
    /// deployment and outcome, a read lock, a lookup by the deployment and two atomic updates.
    pub fn request(&self, deployment: &str, status: u16, code: &str, waited: Duration) {
        {
            let handles = self
                .request_handles
                .read()
                .unwrap_or_else(|e| e.into_inner());
            if let Some(h) = handles.get(deployment)
                && let Some((_, _, counter)) = h
                    .outcomes
                    .iter()
                    .find(|(s, c, _)| *s == status && &**c == code)
            {
                counter.inc();
                h.wait.observe(waited.as_secs_f64());
                return;
            }
        }
        let mut handles = self
            .request_handles
            .write()
            .unwrap_or_else(|e| e.into_inner());
        // One copy of the deployment's ID for its handles, its wait histogram and its counters.
        let label = handles
            .get_key_value(deployment)
            .map_or_else(|| Arc::from(deployment), |(label, _)| Arc::clone(label));
        let h = handles
            .entry(Arc::clone(&label))
            .or_insert_with(|| RequestHandles {
                wait: self
                    .request_wait
                    .get_or_create(&DeploymentLabels {
                        deployment: Arc::clone(&label),
                    })
                    .clone(),
                outcomes: Vec::new(),
            });
        let counter = match h
            .outcomes
            .iter()
            .find(|(s, c, _)| *s == status && &**c == code)
        {
            Some((_, _, counter)) => counter.clone(),
            None => {
                let counter = self
                    .requests
                    .get_or_create(&RequestLabels {
                        deployment: label,
                        status: status.to_string(),
                        code: code.to_string(),
                    })
                    .clone();
                h.outcomes.push((status, code.into(), counter.clone()));
                counter
            }
        };
        counter.inc();
        h.wait.observe(waited.as_secs_f64());
    }

    /// A switch ended with `outcome` after `took` (from its begin to its end):
    /// `capyctl_switches_total`, `capyctl_switch_seconds`.
    pub fn switch_finished(&self, outcome: &str, took: Duration) {
        let outcome = OutcomeLabels {
            outcome: outcome.to_string(),
        };
        self.switches.get_or_create(&outcome).inc();
        self.switch_duration
            .get_or_create(&outcome)
            .observe(took.as_secs_f64());
    }

    /// A phase of a switch (its record's word: `admission_window`, `park`, ...) ended after
    /// `took`, on an instance of `engine` (`vllm`, ...): `capyctl_switch_phase_seconds`.
    pub fn switch_phase(&self, phase: &str, engine: &str, took: Duration) {
        self.switch_phase
            .get_or_create(&PhaseLabels {
                phase: phase.to_string(),
                engine: engine.to_string(),
            })
            .observe(took.as_secs_f64());
    }

    /// A park to `tier` ended with `outcome` after `took`: `capyctl_parks_total`,
    /// `capyctl_park_seconds`.
    pub fn park(&self, tier: &str, outcome: &str, took: Duration) {
        let labels = tier_outcome(tier, outcome);
        self.parks.get_or_create(&labels).inc();
        self.park_duration
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
    }

    /// A wake from `tier` ended with `outcome` after `took`: `capyctl_wakes_total`,
    /// `capyctl_wake_seconds`.
    pub fn wake(&self, tier: &str, outcome: &str, took: Duration) {
        let labels = tier_outcome(tier, outcome);
        self.wakes.get_or_create(&labels).inc();
        self.wake_duration
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
    }

    /// The deployment's queue now: `capyctl_queue_waiting`, `capyctl_in_flight`.
    pub fn set_queue(&self, deployment: &str, waiting: u64, in_flight: u64) {
        let values = [saturating_i64(waiting), saturating_i64(in_flight)];
        let set = |gauges: &[AtomicI64; 2]| {
            for (gauge, value) in gauges.iter().zip(values) {
                gauge.store(value, Ordering::Relaxed);
            }
        };
        {
            let queues = self.queues.read().unwrap_or_else(PoisonError::into_inner);
            if let Some(gauges) = queues.get(deployment) {
                set(gauges);
                return;
            }
        }
        let mut queues = self.queues.write().unwrap_or_else(PoisonError::into_inner);
        set(queues.entry(Arc::from(deployment)).or_default());
    }

    /// A call to the Kubernetes API server ended with `outcome` after `took`:
    /// `capyctl_kube_api_request_seconds`.
    pub fn kube_api_call(&self, verb: &str, resource: &str, outcome: &str, took: Duration) {
        self.kube_api
            .get_or_create(&KubeApiLabels {
                verb: verb.to_string(),
                resource: resource.to_string(),
                outcome: outcome.to_string(),
            })
            .observe(took.as_secs_f64());
    }

    /// Drops the deployment's gauges (after a delete), so a gone deployment shows no queue.
    /// Its counters and histograms stay: they only ever grow.
    pub fn forget_deployment(&self, deployment: &str) {
        self.queues
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(deployment);
    }

    /// Every metric as OpenMetrics text ([`CONTENT_TYPE`]), ending with `# EOF`.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut text, &self.registry) {
            // Writing to a String does not fail; a metric's own encoder could.
            tracing::warn!(error = %e, "metrics encoding failed");
        }
        text
    }
}

/// The router's listener reports each request here when it ends: its real status and code.
/// A request that never named a deployment is counted under `deployment="-"`.
impl capyctl_interfaces::router::RequestObserver for Metrics {
    fn finished(&self, event: &capyctl_interfaces::router::RequestEvent) {
        self.request(
            event.deployment_id.as_deref().unwrap_or("-"),
            event.status,
            event.code.unwrap_or("ok"),
            event.waited,
        );
        self.recent.record(event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every family the server exports, by its name in the text.
    const FAMILIES: [(&str, &str); 13] = [
        ("capyctl_requests", "counter"),
        ("capyctl_request_wait_seconds", "histogram"),
        ("capyctl_switches", "counter"),
        ("capyctl_switch_seconds", "histogram"),
        ("capyctl_switch_phase_seconds", "histogram"),
        ("capyctl_parks", "counter"),
        ("capyctl_park_seconds", "histogram"),
        ("capyctl_wakes", "counter"),
        ("capyctl_wake_seconds", "histogram"),
        ("capyctl_queue_waiting", "gauge"),
        ("capyctl_in_flight", "gauge"),
        ("capyctl_kube_api_request_seconds", "histogram"),
        ("capyctl_build_info", "gauge"),
    ];

    #[test]
    fn every_family_is_listed_before_anything_is_observed() {
        let text = Metrics::new().encode();
        for (name, kind) in FAMILIES {
            assert!(
                text.contains(&format!("# HELP {name} ")),
                "HELP of {name} missing in:\n{text}"
            );
            assert!(
                text.contains(&format!("# TYPE {name} {kind}\n")),
                "TYPE of {name} missing in:\n{text}"
            );
        }
        assert_eq!(text.matches("# TYPE ").count(), FAMILIES.len(), "{text}");
        assert!(
            text.contains(&format!(
                "capyctl_build_info{{version=\"{}\"}} 1\n",
                env!("CARGO_PKG_VERSION")
            )),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn every_metric_is_named_after_it_is_observed() {
        let m = Metrics::new();
        m.request("01K", 429, "queue_full", Duration::from_millis(3));
        m.switch_finished("ok", Duration::from_millis(3810));
        m.switch_phase("wake", "vllm", Duration::from_millis(1500));
        m.park("host_ram", "ok", Duration::from_millis(700));
        m.wake("host_ram", "wake_mismatch", Duration::from_secs(2));
        m.set_queue("01K", 5, 32);
        m.kube_api_call(
            "patch",
            "deployments/status",
            "ok",
            Duration::from_millis(8),
        );
        let text = m.encode();
        for needle in [
            r#"capyctl_requests_total{deployment="01K",status="429",code="queue_full"} 1"#,
            r#"capyctl_request_wait_seconds_count{deployment="01K"} 1"#,
            r#"capyctl_switches_total{outcome="ok"} 1"#,
            r#"capyctl_switch_seconds_sum{outcome="ok"} 3.81"#,
            r#"capyctl_switch_phase_seconds_count{phase="wake",engine="vllm"} 1"#,
            r#"capyctl_parks_total{tier="host_ram",outcome="ok"} 1"#,
            r#"capyctl_park_seconds_sum{tier="host_ram",outcome="ok"} 0.7"#,
            r#"capyctl_wakes_total{tier="host_ram",outcome="wake_mismatch"} 1"#,
            r#"capyctl_wake_seconds_count{tier="host_ram",outcome="wake_mismatch"} 1"#,
            r#"capyctl_queue_waiting{deployment="01K"} 5"#,
            r#"capyctl_in_flight{deployment="01K"} 32"#,
            r#"capyctl_kube_api_request_seconds_count{verb="patch",resource="deployments/status",outcome="ok"} 1"#,
            "# EOF",
        ] {
            assert!(text.contains(needle), "{needle} missing in:\n{text}");
        }
        m.forget_deployment("01K");
        let text = m.encode();
        assert!(
            !text.contains(r#"capyctl_queue_waiting{deployment="01K"}"#),
            "{text}"
        );
        assert!(
            text.contains(r#"capyctl_requests_total{deployment="01K""#),
            "{text}"
        );
    }

    #[test]
    fn repeated_requests_count_through_the_cached_handles() {
        let m = Metrics::new();
        for _ in 0..3 {
            m.request("01K", 200, "ok", Duration::from_millis(1));
        }
        m.request("01K", 429, "queue_full", Duration::from_millis(2));
        m.request("01J", 200, "ok", Duration::from_millis(1));
        m.request("01K", 200, "ok", Duration::from_millis(1));
        let text = m.encode();
        for needle in [
            r#"capyctl_requests_total{deployment="01K",status="200",code="ok"} 4"#,
            r#"capyctl_requests_total{deployment="01K",status="429",code="queue_full"} 1"#,
            r#"capyctl_requests_total{deployment="01J",status="200",code="ok"} 1"#,
            r#"capyctl_request_wait_seconds_count{deployment="01K"} 5"#,
            r#"capyctl_request_wait_seconds_count{deployment="01J"} 1"#,
        ] {
            assert!(text.contains(needle), "{needle} missing in:\n{text}");
        }
        // Forgetting a deployment's gauges leaves its counters (and their handles) alone.
        m.forget_deployment("01K");
        m.request("01K", 200, "ok", Duration::from_millis(1));
        assert!(
            m.encode()
                .contains(r#"capyctl_requests_total{deployment="01K",status="200",code="ok"} 5"#)
        );
    }

    #[test]
    fn a_huge_queue_saturates_instead_of_wrapping() {
        let m = Metrics::new();
        m.set_queue("x", u64::MAX, 0);
        assert!(m.encode().contains(&format!(
            r#"capyctl_queue_waiting{{deployment="x"}} {}"#,
            i64::MAX
        )));
    }
}
