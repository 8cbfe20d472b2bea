//! Load samples: the engine's running and waiting requests and KV-cache use, read from its
//! Prometheus `/metrics` about once a second (the node agent reads them:
//! `capyctl_node_agent::load`). A figure the engine did not report is `None`, never zero;
//! `engine` is `None` when the metrics could not be read at all.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The engine's figures in one sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineLoad {
    /// Requests running in the engine.
    pub running: Option<u64>,
    /// Requests waiting in the engine.
    pub waiting: Option<u64>,
    /// KV-cache use in parts per million.
    pub kv_usage_ppm: Option<u32>,
}

/// One load sample of an instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadSample {
    /// When the scrape began, in milliseconds since the Unix epoch.
    pub sampled_at_ms: u64,
    /// How long the scrape took.
    pub took: Duration,
    /// The figures; `None` when the metrics could not be read.
    pub engine: Option<EngineLoad>,
}

impl LoadSample {
    /// Its age at `now_ms` (0 when the sample looks newer, as with clocks a little apart).
    pub fn age_ms(&self, now_ms: u64) -> u64 {
        now_ms.saturating_sub(self.sampled_at_ms)
    }

    /// Fresh at `now_ms`: younger than [`STALE_AFTER_MS`](capyctl_spec::api::STALE_AFTER_MS).
    pub fn fresh(&self, now_ms: u64) -> bool {
        self.age_ms(now_ms) < capyctl_spec::api::STALE_AFTER_MS
    }

    /// Still held at `now_ms`: fresh, or stale for at most
    /// [`STALE_SAMPLE_KEPT_MS`](capyctl_spec::api::STALE_SAMPLE_KEPT_MS) (so dropped once older
    /// than 33 s).
    pub fn held(&self, now_ms: u64) -> bool {
        self.age_ms(now_ms)
            <= capyctl_spec::api::STALE_AFTER_MS + capyctl_spec::api::STALE_SAMPLE_KEPT_MS
    }

    /// The sample as the load read shows it at `now_ms`, with `ingress_in_flight` (what the
    /// caller forwards to the instance); `None` once it is no longer held. `engine` is `null`
    /// unless all three figures are known: an absent figure is unknown, never zero.
    pub fn view(
        &self,
        now_ms: u64,
        ingress_in_flight: u64,
    ) -> Option<capyctl_spec::api::SampleView> {
        if !self.held(now_ms) {
            return None;
        }
        let engine = self.engine.and_then(|e| {
            Some(capyctl_spec::api::EngineLoadView {
                running: e.running?,
                waiting: e.waiting?,
                kv_usage_ppm: u64::from(e.kv_usage_ppm?),
            })
        });
        Some(capyctl_spec::api::SampleView {
            sampled_at_ms: self.sampled_at_ms,
            age_ms: self.age_ms(now_ms),
            fresh: self.fresh(now_ms),
            ingress_in_flight,
            engine,
        })
    }
}
