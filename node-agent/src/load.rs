//! Load samples read from an engine's Prometheus `/metrics`: the metric names of each engine
//! and the parse. The values (`EngineLoad`, `LoadSample`) are `capyctl_interfaces::load`'s,
//! re-exported here.

use capyctl_spec::EngineKind;

pub use capyctl_interfaces::load::{EngineLoad, LoadSample};

/// The metric names of one engine.
#[derive(Debug, Clone, Copy)]
pub struct MetricNames {
    /// Requests running.
    pub running: &'static [&'static str],
    /// Requests waiting in the engine.
    pub waiting: &'static [&'static str],
    /// KV-cache use as a fraction 0..1.
    pub kv_usage: &'static [&'static str],
}

/// The metric names `engine` exports (several where releases renamed them), newest first: the
/// first one present is read.
pub fn metric_names(engine: EngineKind) -> MetricNames {
    match engine {
        EngineKind::Vllm => MetricNames {
            running: &["vllm:num_requests_running"],
            waiting: &["vllm:num_requests_waiting"],
            kv_usage: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
        },
        EngineKind::Sglang => MetricNames {
            running: &["sglang:num_running_reqs"],
            waiting: &["sglang:num_queue_reqs"],
            kv_usage: &["sglang:token_usage"],
        },
        EngineKind::Tensorfold => MetricNames {
            running: &[
                "tensorfold_requests_running",
                "tensorfold:num_requests_running",
            ],
            waiting: &[
                "tensorfold_requests_waiting",
                "tensorfold:num_requests_waiting",
            ],
            kv_usage: &[
                "tensorfold_kv_cache_usage_ratio",
                "tensorfold_kv_cache_usage",
                "tensorfold:kv_cache_usage_perc",
            ],
        },
    }
}

/// How the samples of one metric over its label sets (one per model, data-parallel rank, ...)
/// make one figure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Combine {
    /// Counts: requests of every rank together.
    Sum,
    /// Fractions: the mean over the ranks (each rank's KV cache is its own pool).
    Mean,
}

/// The samples of the first metric of `names` (in order) that `text` holds, combined over its
/// label sets; `None` when none is present. NB: only the first name present counts: vLLM
/// releases that export `vllm:kv_cache_usage_perc` also export the deprecated
/// `vllm:gpu_cache_usage_perc` with the same value, and adding both would double it.
fn figure(text: &str, names: &[&str], combine: Combine) -> Option<f64> {
    names
        .iter()
        .find_map(|name| samples_of(text, name, combine))
}

/// The samples of metric `name` (all label sets), combined; `None` when it has none.
fn samples_of(text: &str, name: &str, combine: Combine) -> Option<f64> {
    let mut total = 0.0;
    let mut count = 0u32;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line
            .find(|c: char| c == '{' || c.is_whitespace())
            .unwrap_or(line.len());
        if &line[..name_end] != name {
            continue;
        }
        let rest = &line[name_end..];
        let rest = match rest.strip_prefix('{') {
            Some(r) => match r.find('}') {
                Some(i) => &r[i + 1..],
                None => continue,
            },
            None => rest,
        };
        let Some(value) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        if value.is_finite() {
            total += value;
            count += 1;
        }
    }
    match (count, combine) {
        (0, _) => None,
        (_, Combine::Sum) => Some(total),
        (n, Combine::Mean) => Some(total / f64::from(n)),
    }
}

/// Reads one engine's load from its `/metrics` text; `None` when none of its figures is there.
/// Running and waiting requests are summed over the label sets (data-parallel ranks); the KV
/// use is their mean. Where an engine exports a figure under several names (renamed between
/// releases, see [`metric_names`]), the first name present is read and the others ignored.
pub fn parse_metrics(engine: EngineKind, text: &str) -> Option<EngineLoad> {
    let names = metric_names(engine);
    let count = |v: f64| (v >= 0.0).then(|| v.round() as u64);
    let load = EngineLoad {
        running: figure(text, names.running, Combine::Sum).and_then(count),
        waiting: figure(text, names.waiting, Combine::Sum).and_then(count),
        kv_usage_ppm: figure(text, names.kv_usage, Combine::Mean)
            .filter(|v| *v >= 0.0)
            .map(|v| (v.min(1.0) * 1_000_000.0).round() as u32),
    };
    (load.running.is_some() || load.waiting.is_some() || load.kv_usage_ppm.is_some())
        .then_some(load)
}
