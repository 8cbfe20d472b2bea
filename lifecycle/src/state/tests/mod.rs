//! The rules on plain state, with the time given (no owner task, no host calls).
#![allow(clippy::unwrap_used)]

use super::*;
use crate::instance_id;
use capyctl_interfaces::agent::EngineExit;
use capyctl_interfaces::measure::{MeasureSource, Measured};
use capyctl_interfaces::router::{Plan, PlanFor};
use capyctl_spec::api::{DeployOutcome, Released};
use capyctl_spec::settings::LifecycleDefaults;
use std::collections::HashMap;

const GIB: u64 = 1 << 30;

/// One host, `gpu-1`, of 10 GiB, and deployments `a`, `b`, `c` needing 6 GiB each.
fn state(now: Instant) -> State {
    let mut s = State {
        host_id: "gpu-1".into(),
        ..State::default()
    };
    s.add_host("gpu-1".into(), host(), &[]);
    for id in ["a", "b", "c"] {
        s.insert(dep(id, &format!("chat-{id}"), "", now));
    }
    s
}

/// A host of 10 GiB (the fake host agent).
fn host() -> Host {
    Host {
        agent: Arc::new(capyctl_test_support::FakeHost::new()),
        activation: Activation::OnDemand,
        settings: HostSettings::default(),
        admission_window: None,
        remote: false,
        capacity: 10 * GIB,
        gpus: Vec::new(),
    }
}

/// A deployment of 6 GiB (declared), last used at `now`.
fn dep(id: &str, name: &str, extra: &str, now: Instant) -> Dep {
    sized_dep(id, name, extra, 6, now)
}

/// A deployment of `gib` GiB (declared), last used at `now`.
fn sized_dep(id: &str, name: &str, extra: &str, gib: u64, now: Instant) -> Dep {
    let doc = capyctl_spec::documents::parse_deployment_str(
        "t.yaml",
        &format!("name: {name}\nengine: vllm\nmodel: m\n{extra}"),
    )
    .unwrap();
    let mut d = Dep::new(DeploymentRecord::first(id.to_string(), doc), now);
    d.measurement.gpu_memory = Some(Measured {
        bytes: gib * GIB,
        source: MeasureSource::Declared,
    });
    d.last_used = now;
    d
}

/// Makes `id` ready on `gpu-1`, last used at `used`.
fn ready(s: &mut State, id: &str, used: Instant) {
    s.set_host(id, Some("gpu-1".into()));
    let d = s.deps.get_mut(id).unwrap();
    d.state = InstanceState::Ready;
    d.addr = Some(([127, 0, 0, 1], 9).into());
    d.last_used = used;
}

fn none() -> BTreeSet<String> {
    BTreeSet::new()
}

impl State {
    /// A request's plan for `target` (nothing protected, no request recorded).
    fn request_plan(
        &mut self,
        target: &str,
        switch_id: String,
        now: Instant,
    ) -> Result<Plan, ApiError> {
        self.plan(
            target,
            &none(),
            PlanFor::Requests,
            switch_id,
            &NoRequests,
            now,
        )
    }
}

fn held() -> ApiError {
    ApiError::Unavailable {
        detail: "the Kubernetes API server cannot be reached; this replica serves ready models only until it can renew its leadership".into(),
        retry_after: 2,
    }
}

/// A host of `n` GPUs of `gib` GiB each.
fn gpus_host(n: u32, gib: u64) -> Host {
    Host {
        capacity: u64::from(n) * gib * GIB,
        gpus: (0..n)
            .map(|index| capyctl_interfaces::inventory::GpuInfo {
                index,
                uuid: None,
                name: None,
                total_bytes: gib * GIB,
                free_bytes: None,
                unified: false,
            })
            .collect(),
        ..host()
    }
}

/// A state with one host, `id`, of `gpus` GPUs of `gib` GiB each.
fn one_host(id: &str, gpus: u32, gib: u64) -> State {
    let mut s = State {
        host_id: id.into(),
        ..State::default()
    };
    s.add_host(id.into(), gpus_host(gpus, gib), &[]);
    s
}

/// Brings unit `unit` up as a plan would (placed, claimed, then ready).
fn bring_up(s: &mut State, unit: &str, now: Instant) -> (Option<String>, Vec<u32>) {
    let (placed, fit) = s.place_target(unit, &none(), Victims::Idle, &NoRequests, now);
    assert_eq!(fit, Fit::Now, "{unit}");
    let host = placed.host.clone();
    s.set_placed(unit, placed);
    let d = s.deps.get_mut(unit).unwrap();
    d.state = InstanceState::Ready;
    (host, d.gpus.clone())
}

/// The held sums (`state/held.rs`) are what placement would read from the holders: per host,
/// per GPU, and the holders' index; and "it fits now" from the sums is the answer of the pure
/// placement on the holders, for every unit on every host.
fn held_sums_agree(s: &mut State, now: Instant, step: &str) {
    s.settle_held();
    for (host_id, host) in s.hosts.iter() {
        let capacity = host.capacity;
        let holders: Vec<&Dep> = s
            .deps
            .values()
            .map(|d| &**d)
            .filter(|d| d.host.as_deref() == Some(host_id.as_str()) && d.holds_gpu())
            .collect();
        let total: u64 = holders.iter().map(|d| d.held_bytes(capacity)).sum();
        let read: u64 = s
            .holders(host_id, "", &none(), Victims::Idle, &NoRequests, now)
            .iter()
            .map(|h| h.bytes)
            .sum();
        assert_eq!(read, total, "{step}: the holders of {host_id}");
        assert_eq!(s.gpu_held.on(host_id, None, ""), total, "{step}: {host_id}");
        let mut ids: Vec<&str> = holders.iter().map(|d| d.id()).collect();
        ids.sort_unstable();
        let index: Vec<&str> = s
            .holding
            .get(host_id)
            .into_iter()
            .flatten()
            .map(|id| &**id)
            .collect();
        assert_eq!(index, ids, "{step}: the holders' index of {host_id}");
        if host.gpus.len() > 1 {
            for g in &host.gpus {
                let on_gpu: u64 = holders
                    .iter()
                    .filter_map(|d| {
                        crate::placement::gpu_share(
                            d.held_bytes(capacity),
                            &d.gpus,
                            g.index,
                            g.total_bytes,
                        )
                    })
                    .sum();
                assert_eq!(
                    s.gpu_held.on(host_id, Some(g.index), ""),
                    on_gpu,
                    "{step}: {host_id} GPU {}",
                    g.index
                );
            }
        }
        for d in s.deps.values() {
            let want = d.rec.doc.gpus_per_instance() as usize;
            if !host.gpus.is_empty() && want > host.gpus.len() {
                continue;
            }
            let theirs = s.holders(host_id, d.id(), &none(), Victims::Idle, &NoRequests, now);
            let slow = if host.gpus.len() > 1 {
                s.place_on_gpus(d, host_id, host, &theirs, true, &NoRequests)
                    .ok()
                    .filter(|(_, fit, _)| *fit == Fit::Now)
                    .map(|(gpus, _, rank)| (gpus, rank))
            } else {
                let need = d.need(capacity);
                let fit = crate::placement::place(capacity, need, &theirs, true);
                (fit == Fit::Now).then(|| {
                    let rank = crate::placement::rank_of(&fit, capacity, need, &theirs);
                    (Vec::new(), rank.unwrap())
                })
            };
            assert_eq!(
                s.fits_now(d, host_id, host),
                slow,
                "{step}: {} on {host_id}",
                d.id()
            );
        }
    }
}

mod held;
mod outcomes;
mod placing;
