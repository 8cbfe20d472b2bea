//! What the management API shows: deployment views, the load read and the host view, as pure
//! functions of the lifecycle's state.

use std::time::{SystemTime, UNIX_EPOCH};

use capyctl_node_agent::inventory::Inventory;
use capyctl_node_agent::launch::{MaxRunning, MaxRunningInput, MaxRunningSource, max_running};
use capyctl_node_agent::load::LoadSample;
use capyctl_node_agent::measure::{MeasureSource, Measurement};
use capyctl_node_agent::tier::ParkTier;
use capyctl_router::coordinator::DeploymentLoad;
use capyctl_spec::api::{
    ConditionView, DeploymentLoadView, DeploymentView, EngineLoadView, GpuView, HostView,
    InstanceLoadView, InstanceView, MaxRunningView, MeasurementView, RouterLoadView,
    STALE_AFTER_MS, STALE_SAMPLE_KEPT_MS, SampleView,
};
use capyctl_spec::{Activation, InstanceState};

use super::{Dep, Host, Inner, LifecycleConfig};

/// Some host says `lifecycle.activation: explicit`.
fn any_host_explicit(inner: &Inner) -> bool {
    inner
        .hosts
        .values()
        .any(|h| h.activation == Activation::Explicit)
}

/// The host of `d`'s instance, else the first host (one host in standalone).
fn host_of<'a>(d: &Dep, inner: &'a Inner) -> Option<(&'a String, &'a Host)> {
    d.host
        .as_deref()
        .and_then(|h| inner.hosts.get_key_value(h))
        .or_else(|| inner.hosts.iter().next())
}

/// Milliseconds since the Unix epoch.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The state shown: the instance's, with `awaiting_measurement` for a stopped deployment whose
/// checkpoint is not measured yet.
pub(crate) fn shown_state(d: &Dep) -> InstanceState {
    if d.state == InstanceState::Stopped && d.measurement.awaiting() {
        InstanceState::AwaitingMeasurement
    } else {
        d.state
    }
}

pub(crate) fn tier_words(t: ParkTier) -> &'static str {
    match t {
        ParkTier::HostRam => "host_ram",
        ParkTier::Deep => "deep",
        ParkTier::KvOnly => "kv_only",
    }
}

fn measurement_view(m: &Measurement) -> Option<MeasurementView> {
    let gpu = m.gpu_memory?;
    let source = match gpu.source {
        MeasureSource::Declared => "declared",
        MeasureSource::Checkpoint => "measured",
        MeasureSource::EngineFootprint => "observed",
    };
    Some(MeasurementView {
        gpu_memory: gpu.bytes,
        weights_memory: m.weights_bytes().unwrap_or(gpu.bytes),
        source: source.to_string(),
    })
}

fn condition(kind: &str, ok: bool, reason: &str, message: String) -> ConditionView {
    ConditionView {
        kind: kind.to_string(),
        status: if ok { "True" } else { "False" }.to_string(),
        reason: reason.to_string(),
        message,
    }
}

/// One deployment's view.
pub(crate) fn deployment_view(d: &Dep, config: &LifecycleConfig, inner: &Inner) -> DeploymentView {
    let state = shown_state(d);
    let explicit = d.rec.doc.activation() == Activation::Explicit || any_host_explicit(inner);
    // Where it is, or where it may run.
    let hosts: Vec<String> = match d.bound_host() {
        Some(h) => vec![h.to_string()],
        None => inner.hosts.keys().cloned().collect(),
    };
    let instance_host =
        host_of(d, inner).map_or_else(|| config.host_id.clone(), |(h, _)| h.clone());
    let ready = d.state == InstanceState::Ready;
    let (ready_reason, ready_message) = if ready {
        ("ready", "the instance serves requests".to_string())
    } else if d.rec.pending_start {
        (
            "waiting_for_memory",
            "an operator start waits for GPU memory (start --evict parks idle models to make room)"
                .to_string(),
        )
    } else if let Some(e) = &d.last_error {
        ("failed", e.clone())
    } else {
        ("not_running", format!("the instance is {state}"))
    };
    let measured = !d.measurement.awaiting();
    DeploymentView {
        id: d.rec.id.clone(),
        name: d.rec.doc.name.clone(),
        state,
        ready: format!("{}/1", u8::from(ready)),
        revision: d.rec.revision,
        hosts,
        activation: if explicit {
            Activation::Explicit
        } else {
            Activation::OnDemand
        },
        warm: d.rec.doc.warm(),
        operator_stopped: d.rec.operator_stopped,
        engine: d.rec.doc.engine,
        model: d.rec.doc.model.clone(),
        residency: d.rec.doc.residency,
        measurement: measurement_view(&d.measurement),
        instances: vec![InstanceView {
            instance_id: d.instance_id(),
            index: 0,
            host_id: instance_host,
            generation: d.rec.generation,
            state,
            parked_tier: d.tier.map(|t| tier_words(t).to_string()),
            port: d.addr.map(|a| a.port()),
            pid: d.pid,
            last_error: d.last_error.clone(),
        }],
        conditions: vec![
            condition("Ready", ready, ready_reason, ready_message),
            condition(
                "Measured",
                measured,
                if measured {
                    "measured"
                } else {
                    "awaiting_measurement"
                },
                if measured {
                    "the checkpoint's memory is known".to_string()
                } else if d.rec.first_answer.is_some() {
                    // Started, and still unknown: the host cannot read a process's GPU memory
                    // (no NVML, or GPUs declared in the host document).
                    "the engine's GPU footprint could not be read on this host; it is placed as needing the whole GPU: declare resources.gpu_memory".to_string()
                } else {
                    "no measurement yet: declare resources, or start it with --wait".to_string()
                },
            ),
        ],
        spec: d.rec.doc.clone(),
    }
}

fn source_words(s: MaxRunningSource) -> &'static str {
    match s {
        MaxRunningSource::Engine => "engine",
        MaxRunningSource::Declared => "declared",
        MaxRunningSource::Default => "default",
        MaxRunningSource::StateCache => "state_cache",
        MaxRunningSource::ExtraArgs => "extra_args",
        MaxRunningSource::HostFixed => "host_fixed",
        MaxRunningSource::EngineDefault => "engine_default",
        MaxRunningSource::OnHost => "on_host",
    }
}

fn max_running_view(m: MaxRunning) -> MaxRunningView {
    MaxRunningView {
        count: m.count,
        source: source_words(m.source).to_string(),
    }
}

/// What CapyCTL passes or expects before the engine says (the deployment's figure).
fn expected_max_running(d: &Dep, config: &LifecycleConfig, host: Option<&Host>) -> MaxRunning {
    let settings = host.map_or(&config.host_settings, |h| &h.settings);
    max_running(&MaxRunningInput {
        engine: d.spec.engine,
        declared: d.spec.max_concurrent_requests,
        extra_args: &d.spec.extra_args,
        host_command: &settings.engine(d.spec.engine).command,
        engine_reported: None,
        hybrid_checkpoint: false,
        sized_on_host: host.is_some_and(|h| h.remote),
    })
}

/// The sample as the load read shows it: `None` when none is held or it is older than
/// [`STALE_SAMPLE_KEPT_MS`].
pub(crate) fn sample_view(s: &LoadSample, now_ms: u64, ingress: u64) -> Option<SampleView> {
    let age = now_ms.saturating_sub(s.sampled_at_ms);
    if age > STALE_SAMPLE_KEPT_MS {
        return None;
    }
    Some(SampleView {
        sampled_at_ms: s.sampled_at_ms,
        age_ms: age,
        fresh: age < STALE_AFTER_MS,
        ingress_in_flight: ingress,
        // NB: the API's engine figures are all-or-nothing; one the engine did not report
        // makes `engine` null rather than a made-up zero.
        engine: s.engine.and_then(|e| {
            Some(EngineLoadView {
                running: e.running?,
                waiting: e.waiting?,
                kv_usage_ppm: u64::from(e.kv_usage_ppm?),
            })
        }),
    })
}

/// One deployment's load.
pub(crate) fn load_view(
    d: &Dep,
    router: Option<&DeploymentLoad>,
    config: &LifecycleConfig,
    inner: &Inner,
    now_ms: u64,
) -> DeploymentLoadView {
    let host = host_of(d, inner);
    let expected = expected_max_running(d, config, host.map(|(_, h)| h));
    let instance_mr = d.max_running.unwrap_or(expected);
    let router_in_flight = router
        .and_then(|r| {
            r.instances
                .iter()
                .find(|i| i.key.generation == d.rec.generation)
        })
        .map_or(0, |i| i.router_in_flight as u64);
    let loaded = matches!(d.state, InstanceState::Ready | InstanceState::Closed);
    let sample = if loaded {
        host.and_then(|(_, h)| h.agent.sample(&d.instance_id()))
            .and_then(|s| sample_view(&s, now_ms, router_in_flight))
    } else {
        None
    };
    DeploymentLoadView {
        deployment_id: d.rec.id.clone(),
        name: d.rec.doc.name.clone(),
        router: RouterLoadView {
            in_flight: router.map_or(0, |r| r.in_flight as u64),
            in_flight_limit: router.map_or(
                u64::from(capyctl_spec::settings::IN_FLIGHT_PER_DEPLOYMENT),
                |r| r.in_flight_limit as u64,
            ),
            waiting: router.map_or(0, |r| r.waiting as u64),
            waiting_limit: router
                .map_or(u64::from(config.waiting_limit), |r| r.waiting_limit as u64),
        },
        // The deployment's figure is what CapyCTL passed or expects; the instance's is the
        // engine's own where it said (SGLang).
        max_running: max_running_view(expected),
        instances: vec![InstanceLoadView {
            index: 0,
            host_id: host.map_or_else(|| config.host_id.clone(), |(id, _)| id.clone()),
            generation: d.rec.generation,
            observed_state: shown_state(d),
            router_in_flight,
            max_running: max_running_view(instance_mr),
            sample,
        }],
    }
}

/// A host's view.
pub(crate) fn host_view(id: &str, host: &Host, inv: Option<&Inventory>, inner: &Inner) -> HostView {
    let here = |d: &&Dep| d.host.as_deref() == Some(id);
    // Loaded instances, and what parked engines still hold.
    let used: u64 = inner
        .deps
        .values()
        .filter(here)
        .map(|d| {
            if d.occupies() {
                d.need(host.capacity)
            } else {
                d.parked_holds()
            }
        })
        .sum();
    let parked: u64 = inner
        .deps
        .values()
        .filter(here)
        .filter(|d| d.state == InstanceState::Parked && d.tier == Some(ParkTier::HostRam))
        .map(|d| d.measurement.weights_bytes().unwrap_or(0))
        .sum();
    let mut left = used;
    HostView {
        id: id.to_string(),
        gpus: inv
            .map(|i| {
                i.gpus
                    .iter()
                    .map(|g| {
                        let here = left.min(g.total_bytes);
                        left -= here;
                        GpuView {
                            index: g.index,
                            uuid: g.uuid.clone(),
                            memory: g.total_bytes,
                            unified: g.unified,
                            used: here,
                        }
                    })
                    .collect()
            })
            .unwrap_or_default(),
        host_memory: inv.map_or(0, |i| i.host_memory.total_bytes),
        host_memory_used: parked,
        activation: host.activation,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use capyctl_node_agent::load::EngineLoad;
    use std::time::Duration;

    fn sample(at: u64, engine: Option<EngineLoad>) -> LoadSample {
        LoadSample {
            sampled_at_ms: at,
            took: Duration::from_millis(2),
            engine,
        }
    }

    #[test]
    fn a_sample_is_fresh_then_stale_then_dropped() {
        let e = Some(EngineLoad {
            running: Some(3),
            waiting: Some(0),
            kv_usage_ppm: Some(121_000),
        });
        let v = sample_view(&sample(1000, e), 1400, 3).expect("held");
        assert_eq!((v.age_ms, v.fresh, v.ingress_in_flight), (400, true, 3));
        assert_eq!(v.engine.map(|e| e.kv_usage_ppm), Some(121_000));
        let v = sample_view(&sample(1000, e), 4000, 0).expect("kept");
        assert!(!v.fresh);
        assert!(sample_view(&sample(1000, e), 1000 + 30_001, 0).is_none());
    }

    #[test]
    fn unknown_engine_figures_are_null_never_zero() {
        let e = Some(EngineLoad {
            running: Some(1),
            waiting: None,
            kv_usage_ppm: Some(5),
        });
        assert_eq!(
            sample_view(&sample(10, e), 20, 0).expect("held").engine,
            None
        );
        assert_eq!(
            sample_view(&sample(10, None), 20, 0).expect("held").engine,
            None
        );
    }
}
