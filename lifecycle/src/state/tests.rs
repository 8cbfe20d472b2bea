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

#[tokio::test(start_paused = true)]
async fn replicas_are_units_on_distinct_gpus_and_never_each_others_victims() {
    let now = Instant::now();
    let mut s = one_host("box", 4, 10);
    s.insert(dep("r", "chat-r", "replicas: 3", now));
    s.insert(dep("b", "chat-b", "", now));
    // One unit per replica, keyed `r`, `r-1`, `r-2`; one deployment to the views.
    assert_eq!(s.unit_ids("r"), ["r", "r-1", "r-2"]);
    assert_eq!(s.deps["r-2"].instance_id(), "r-2");
    assert_eq!(s.deps["r"].instance_id(), "r-0");
    // Each on a GPU of its own (6 of 10 GiB: two would fit no GPU anyway; with 3 GiB they
    // would, and still go apart).
    let mut used = BTreeSet::new();
    for unit in ["r", "r-1", "r-2"] {
        let (host, gpus) = bring_up(&mut s, unit, now);
        assert_eq!(host.as_deref(), Some("box"));
        assert_eq!(gpus.len(), 1);
        assert!(used.insert(gpus[0]), "{unit} on a GPU of its own: {gpus:?}");
        let env = s.deps[unit].launch_spec().env;
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], gpus[0].to_string());
        assert_eq!(env["CUDA_DEVICE_ORDER"], "PCI_BUS_ID", "NVML's numbering");
    }
    // A fourth (replicas raised) finds the free GPU only.
    let mut d = s.deps["r"].rec.clone();
    Arc::make_mut(&mut d.doc).replicas = Some(4);
    d.revision = 2;
    s.deps.get_mut("r").unwrap().rec = d;
    s.deps.get_mut("r").unwrap().renew_fixed();
    s.sync_units("r", Instant::now());
    let (_, gpus) = bring_up(&mut s, "r-3", now);
    assert!(!used.contains(&gpus[0]));
    // Every GPU now holds an instance of r: chat-b names one instance (the longest idle),
    // never two; r's own plan never names its siblings.
    s.deps.get_mut("r-1").unwrap().last_used = now - Duration::from_secs(60);
    let plan = s.request_plan("b", "sw-1".into(), now).unwrap();
    match plan {
        Plan::Switch { victims, .. } => {
            assert_eq!(victims.len(), 1, "{victims:?}");
            assert_eq!((victims[0].deployment.as_str(), victims[0].index), ("r", 1));
        }
        other => panic!("{other:?}"),
    }
    // Lowering replicas leaves the running units to the scaler; stopped ones go at once.
    s.release_reservation("sw-1");
    s.deps.get_mut("r-3").unwrap().state = InstanceState::Stopped;
    let mut d = s.deps["r"].rec.clone();
    Arc::make_mut(&mut d.doc).replicas = Some(2);
    d.revision = 3;
    s.deps.get_mut("r").unwrap().rec = d;
    s.deps.get_mut("r").unwrap().renew_fixed();
    s.sync_units("r", Instant::now());
    assert_eq!(s.unit_ids("r"), ["r", "r-1", "r-2"]);
    s.remove("r");
    assert!(s.unit_ids("r").is_empty());
    assert!(s.replicated.is_empty());
}

#[tokio::test(start_paused = true)]
async fn an_operators_evict_fills_every_replica() {
    let now = Instant::now();
    let mut s = one_host("box", 4, 10);
    for id in ["a", "b", "c"] {
        s.insert(dep(id, &format!("chat-{id}"), "", now));
        bring_up(&mut s, id, now);
    }
    s.insert(dep("r", "chat-r", "replicas: 3", now));
    bring_up(&mut s, "r", now);
    assert_eq!(s.filled("r"), (3, 1));
    assert_eq!(s.unit_to_fill("r").as_deref(), Some("r-1"));
    let mut protected = none();
    protected.insert("r".to_string());
    let plan = s
        .plan(
            "r",
            &protected,
            PlanFor::Operator,
            "sw-1".into(),
            &NoRequests,
            now,
        )
        .unwrap();
    match plan {
        Plan::Switch { victims, .. } => assert_eq!(victims.len(), 1, "{victims:?}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(s.deps["r-1"].claim.as_deref(), Some("sw-1"));
    // Requests' plans do not fill: one instance is up.
    assert_eq!(
        s.request_plan("r", "sw-2".into(), now).unwrap(),
        Plan::AlreadyComing
    );
}

#[tokio::test(start_paused = true)]
async fn instances_prefer_hosts_without_a_sibling_and_span_gpus_per_instance() {
    let now = Instant::now();
    let mut s = one_host("a", 1, 40);
    s.add_host("b".into(), gpus_host(1, 40), &[]);
    s.insert(dep("r", "chat-r", "replicas: 2", now));
    let (first, _) = bring_up(&mut s, "r", now);
    let (second, _) = bring_up(&mut s, "r-1", now);
    assert_ne!(first, second, "the second instance goes to the other host");

    // gpus_per_instance: 2 on a host of 4 GPUs: two GPUs, each with half the memory.
    let mut s = one_host("box", 4, 10);
    s.insert(sized_dep(
        "t",
        "chat-t",
        "replicas: 2\ngpus_per_instance: 2",
        16,
        now,
    ));
    assert_eq!(s.deps["t-1"].spec().tensor_parallel, Some(2));
    let (_, g0) = bring_up(&mut s, "t", now);
    let (_, g1) = bring_up(&mut s, "t-1", now);
    assert_eq!((g0.len(), g1.len()), (2, 2));
    assert!(g0.iter().all(|g| !g1.contains(g)), "{g0:?} {g1:?}");
    // More GPUs than the host has: never (on a host of one GPU too: its engine would
    // start tensor-parallel on one).
    for (gpus, gib, want) in [(2, 10, 3), (1, 40, 2)] {
        let mut s = one_host("h", gpus, gib);
        s.insert(dep(
            "w",
            "chat-w",
            &format!("gpus_per_instance: {want}"),
            now,
        ));
        let (_, fit) = s.place_target("w", &none(), Victims::Idle, &NoRequests, now);
        assert_eq!(
            fit,
            Fit::Never(format!(
                "it needs {want} GPUs (gpus_per_instance) and the host has {gpus}"
            ))
        );
    }
}

#[tokio::test(start_paused = true)]
async fn an_instance_over_several_gpus_names_no_victim_another_one_already_makes_room_for() {
    let start = Instant::now();
    tokio::time::advance(Duration::from_secs(600)).await;
    let now = Instant::now();
    let mut s = one_host("box", 2, 10);
    // v spans both GPUs (7 GiB on each); x (2 GiB) shares one of them, idle longer.
    s.insert(sized_dep("v", "chat-v", "gpus_per_instance: 2", 14, start));
    s.insert(sized_dep("x", "chat-x", "", 2, start));
    let (_, gv) = bring_up(&mut s, "v", start);
    let (_, gx) = bring_up(&mut s, "x", start);
    assert_eq!((gv.len(), gx.len()), (2, 1));
    s.deps.get_mut("v").unwrap().last_used = now - Duration::from_secs(50);
    s.deps.get_mut("x").unwrap().last_used = now - Duration::from_secs(500);
    // t needs 4 GiB on each GPU. On x's GPU alone x goes first (the longest idle), and is
    // not enough, so v too; on the other, v. Yet v, released, frees 7 GiB on both: x is
    // not needed, and is no victim (it was, when each GPU chose alone).
    s.insert(sized_dep("t", "chat-t", "gpus_per_instance: 2", 8, now));
    let (_, fit) = s.place_target("t", &none(), Victims::Idle, &NoRequests, now);
    assert_eq!(fit, Fit::After(vec!["v".into()]));
}

#[tokio::test(start_paused = true)]
async fn the_scaler_starts_a_stopped_instance_where_a_parked_one_has_no_room() {
    let now = Instant::now();
    let mut s = one_host("box", 3, 10);
    s.insert(dep("r", "chat-r", "replicas: 3", now));
    s.insert(dep("b", "chat-b", "", now));
    bring_up(&mut s, "r", now);
    let (_, g1) = bring_up(&mut s, "r-1", now);
    let d = s.deps.get_mut("r-1").unwrap();
    d.state = InstanceState::Parked;
    d.parked_gpu = Some(GIB);
    // Another model takes the parked instance's GPU (the fullest that fits).
    let (_, gb) = bring_up(&mut s, "b", now);
    assert_eq!(gb, g1);
    // The parked instance can wake only there: no room, so the scaler's next candidate,
    // the stopped one, is started on the free GPU (`Core::scale_run` tries them in
    // the order `scale::decide` gives).
    assert_eq!(s.scale_up("r-1", &NoRequests, now), None);
    assert!(s.scale_up("r-2", &NoRequests, now).is_some());
    assert!(
        !s.deps["r-2"].gpus.contains(&g1[0]),
        "{:?}",
        s.deps["r-2"].gpus
    );
}

#[tokio::test(start_paused = true)]
async fn the_scaler_waits_out_the_back_off_of_an_engine_that_failed_not_one_its_host_lost() {
    let long_ago = Instant::now();
    tokio::time::advance(Duration::from_secs(600)).await;
    let mut s = one_host("box", 3, 10);
    s.insert(dep("r", "chat-r", "replicas: 3", long_ago));
    for unit in ["r", "r-1", "r-2"] {
        bring_up(&mut s, unit, long_ago);
        s.deps.get_mut(unit).unwrap().last_used = long_ago;
    }
    let held = |s: &State, unit: &str| {
        let now = Instant::now();
        s.scale_inputs(&NoRequests, now)[0]
            .units
            .iter()
            .find(|u| u.unit == unit)
            .unwrap()
            .held
    };
    // r-1's engine exits, unused for ten minutes: the back-off counts from the exit.
    let exit = capyctl_interfaces::agent::EngineExit {
        instance: "r-1".into(),
        status: Some("signal 9".into()),
    };
    assert!(s.engine_exited("box", &exit, Instant::now()).is_some());
    assert!(held(&s, "r-1"), "within the back-off");
    tokio::time::advance(FAILED_BACKOFF - Duration::from_secs(1)).await;
    assert!(held(&s, "r-1"), "still within it");
    tokio::time::advance(Duration::from_secs(1)).await;
    assert!(!held(&s, "r-1"), "past it");
    // The host comes back (its agent restarted) without its engines: r-2 failed, but not
    // on its own, so the scaler may bring it back at once, used a moment ago or not.
    s.deps.get_mut("r-2").unwrap().last_used = Instant::now();
    let lost = s.add_host("box".into(), gpus_host(3, 10), &[]).lost;
    assert!(lost.iter().any(|k| k.index == 2), "{lost:?}");
    assert_eq!(s.deps["r-2"].state, InstanceState::Failed);
    assert!(!held(&s, "r-2"), "a lost engine is no failure of its own");
}

#[tokio::test(start_paused = true)]
async fn a_parked_instance_keeps_its_gpu_from_its_siblings_with_no_residue_known() {
    let now = Instant::now();
    let mut s = one_host("box", 3, 10);
    s.insert(dep("r", "chat-r", "replicas: 3", now));
    let (_, g0) = bring_up(&mut s, "r", now);
    let (_, g1) = bring_up(&mut s, "r-1", now);
    // r-1 parks, and what its engine keeps on the GPU is not known (no NVML reading):
    // it holds nothing placement counts, yet it can only wake on that GPU.
    let d = s.deps.get_mut("r-1").unwrap();
    d.state = InstanceState::Parked;
    d.parked_gpu = None;
    assert!(!s.deps["r-1"].holds_gpu());
    let (_, g2) = bring_up(&mut s, "r-2", now);
    assert!(
        !g2.contains(&g1[0]) && !g2.contains(&g0[0]),
        "r-2 on a GPU of its own: {g0:?} {g1:?} {g2:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn held_switches_refuse_every_change_but_ready_models_serve_on() {
    let now = Instant::now();
    let mut s = state(now);
    ready(&mut s, "a", now);
    let mut c = *s.deps.remove("c").unwrap();
    c.rec.pending_start = true;
    s.insert(c);
    s.hold(held());
    // A request for a model that is not ready is refused at once, with the cause.
    let e = s.admissible("b").unwrap_err();
    assert_eq!(
        (e.status(), e.code(), e.retry_after()),
        (503, "unavailable", Some(2))
    );
    assert!(
        e.message().contains("API server cannot be reached"),
        "{}",
        e.message()
    );
    // The ready one is admissible (its requests are forwarded, not switched).
    assert!(s.admissible("a").is_ok());
    // Plans fail with it (requests and an operator's --evict): nothing reserved.
    for who in [PlanFor::Requests, PlanFor::Operator] {
        let e = s
            .plan("b", &none(), who, "sw-1".into(), &NoRequests, now)
            .unwrap_err();
        assert_eq!(e.code(), "unavailable");
    }
    assert_eq!(s.deps["a"].reserved, None);
    assert_eq!(s.deps["b"].claim, None);
    // Operator commands: start, preinitialize, park/stop (begin_down) refused.
    assert_eq!(
        s.start("b", true, false, now).unwrap_err().code(),
        "unavailable"
    );
    assert_eq!(
        s.park("a", "park-1", Instant::now()).unwrap_err().code(),
        "unavailable"
    );
    assert_eq!(
        s.begin_down("a", "stop-1", Instant::now())
            .unwrap_err()
            .code(),
        "unavailable"
    );
    assert_eq!(s.deps["a"].state, InstanceState::Ready);
    assert_eq!(s.deps["a"].reserved, None);
    // No idle timer, no pending start.
    let timers = LifecycleDefaults {
        ready_idle_timeout: Some(Duration::from_secs(1)),
        ..LifecycleDefaults::default()
    };
    let later = now + Duration::from_secs(60);
    assert!(s.idle_due(&timers, &none(), &NoRequests, later).is_empty());
    assert!(s.start_pending("c", later).is_none());
    // An engine exit is still recorded.
    let exit = EngineExit {
        instance: instance_id("a"),
        status: Some("signal 9".into()),
    };
    assert!(s.engine_exited("gpu-1", &exit, Instant::now()).is_some());
    assert_eq!(s.deps["a"].state, InstanceState::Failed);
    // Resumed: switching again.
    s.resume();
    assert!(s.admissible("b").is_ok());
    let plan = s.request_plan("b", "sw-2".into(), later).unwrap();
    assert!(matches!(plan, Plan::BringUp { .. }), "{plan:?}");
    assert_eq!(
        s.idle_due(&timers, &none(), &NoRequests, later).len(),
        0,
        "a failed"
    );
}

#[tokio::test(start_paused = true)]
async fn a_fenced_ready_instance_is_no_victim_until_the_fence_ends() {
    let now = Instant::now();
    let mut s = state(now);
    ready(&mut s, "a", now);
    let until = now + Duration::from_secs(90);
    assert_eq!(s.set_fence(until, now), ["chat-a"]);
    // `b` needs `a`'s memory: it waits (`Later`), never `does_not_fit`.
    let plan = s.request_plan("b", "sw-1".into(), now).unwrap();
    assert!(matches!(plan, Plan::Later), "{plan:?}");
    let plan = s
        .plan(
            "b",
            &none(),
            PlanFor::Operator,
            "sw-2".into(),
            &NoRequests,
            now,
        )
        .unwrap();
    assert!(matches!(plan, Plan::Later), "{plan:?}");
    // No operator park or stop of it, naming the fence; no idle timer.
    let e = s.park("a", "park-1", Instant::now()).unwrap_err();
    assert_eq!((e.status(), e.code()), (503, "unavailable"));
    assert!(e.message().contains("previous leader"), "{}", e.message());
    assert_eq!(e.retry_after(), Some(91));
    assert_eq!(s.deps["a"].state, InstanceState::Ready);
    let timers = LifecycleDefaults {
        ready_idle_timeout: Some(Duration::from_secs(1)),
        ..LifecycleDefaults::default()
    };
    assert!(
        s.idle_due(&timers, &none(), &NoRequests, now + Duration::from_secs(60))
            .is_empty()
    );
    // Not yet over 1 s before its end.
    assert!(!s.end_fence(until - Duration::from_secs(1)));
    assert!(s.fenced("a"));
    // Its end: `a` is the victim as usual.
    assert!(s.end_fence(until));
    let plan = s.request_plan("b", "sw-3".into(), until).unwrap();
    let Plan::Switch { victims, .. } = plan else {
        panic!("a switch: {plan:?}");
    };
    assert_eq!(victims[0].deployment, "a");
    // A fence that ends before it begins (a hold-over of 0) fences nothing.
    assert!(s.set_fence(until, until).is_empty());
    assert!(s.fence.is_none());
}

#[tokio::test(start_paused = true)]
async fn a_host_that_joins_during_the_fence_has_what_it_holds_ready_fenced_too() {
    let now = Instant::now();
    let mut s = state(now);
    ready(&mut s, "a", now);
    s.set_fence(now + Duration::from_secs(90), now);
    let adopted = capyctl_interfaces::agent::AdoptedInstance {
        instance: instance_id("b"),
        spec: s.deps["b"].spec(),
        base_url: "http://127.0.0.1:9".into(),
        pid: 4242,
        parked: None,
        gpu_held: None,
    };
    s.add_host("gpu-2".into(), host(), &[adopted]);
    assert_eq!(s.deps["b"].state, InstanceState::Ready);
    assert!(s.fenced("b"));
    assert_eq!(
        s.begin_down("b", "stop-1", Instant::now())
            .unwrap_err()
            .code(),
        "unavailable"
    );
}

#[tokio::test(start_paused = true)]
async fn a_plan_reserves_its_victim_so_a_second_plan_waits_instead_of_naming_it_again() {
    let now = Instant::now();
    let mut s = state(now);
    ready(&mut s, "a", now);
    let plan = s.request_plan("b", "sw-1".into(), now).unwrap();
    let Plan::Switch {
        switch_id, victims, ..
    } = plan
    else {
        panic!("a switch: {plan:?}");
    };
    assert_eq!(switch_id, "sw-1");
    assert_eq!(victims.len(), 1);
    assert_eq!(victims[0].deployment, "a");
    assert_eq!(s.deps["a"].reserved.as_deref(), Some("sw-1"));
    assert_eq!(s.deps["b"].claim.as_deref(), Some("sw-1"));
    // `a` is reserved and `b` claims the rest: `c` waits for memory.
    let later = s.request_plan("c", "sw-2".into(), now).unwrap();
    assert!(matches!(later, Plan::Later), "{later:?}");
    assert_eq!(s.deps["a"].reserved.as_deref(), Some("sw-1"));
    // `b` already has its switch.
    let again = s.request_plan("b", "sw-3".into(), now).unwrap();
    assert!(matches!(again, Plan::AlreadyComing), "{again:?}");
    // Given back, the victim serves on and the target is no longer claimed.
    s.release_reservation("sw-1");
    assert_eq!(s.deps["a"].reserved, None);
    assert_eq!(s.deps["b"].claim, None);
    // A switch given up does not bring its target up.
    let err = s.switch_target_up("sw-1", "b", &[], now).unwrap_err();
    assert_eq!(err.code(), "conflict");
}

/// A victim the switch could not release keeps the target down while it still holds its
/// memory (it serves again after its drain timed out, or its ended start's engine could not
/// be stopped): the switch fails with its error, a drain timeout naming the target as the
/// router's does. One that gave its memory back (its park failed and its engine was stopped)
/// lets the target come up.
#[tokio::test(start_paused = true)]
async fn a_target_comes_up_only_once_its_victims_no_longer_hold_their_memory() {
    let now = Instant::now();
    let timed_out = ApiError::DrainTimeout {
        deployment: "a".into(),
        drain_ms: 5000,
        charged: 1,
    };
    // Drained, its drain timed out: it serves again.
    let mut s = state(now);
    ready(&mut s, "a", now);
    assert!(matches!(
        s.request_plan("b", "sw-1".into(), now).unwrap(),
        Plan::Switch { .. }
    ));
    let kept = [("a".to_string(), timed_out.clone())];
    let err = s.switch_target_up("sw-1", "b", &kept, now).unwrap_err();
    assert_eq!(
        err,
        ApiError::DrainTimeout {
            deployment: "b".into(),
            drain_ms: 5000,
            charged: 1,
        }
    );
    assert_eq!(s.deps["b"].state, InstanceState::Stopped);
    assert!(!s.deps["b"].busy);
    assert_eq!(s.deps["b"].claim, None);
    assert_eq!(s.deps["a"].reserved, None);
    // Its ended start's engine could not be stopped: it may hold its memory still.
    let mut s = state(now);
    ready(&mut s, "a", now);
    s.request_plan("b", "sw-1".into(), now).unwrap();
    let d = s.deps.get_mut("a").unwrap();
    d.fail(
        "start ended, but stopping the engine failed: boom".into(),
        now,
    );
    d.ended_stop_failed = Some("boom".into());
    let failed = ApiError::EngineFailed {
        deployment: "a".into(),
        detail: "boom".into(),
    };
    let kept = [("a".to_string(), failed.clone())];
    let err = s.switch_target_up("sw-1", "b", &kept, now).unwrap_err();
    assert_eq!(err, failed);
    // Its park failed and its engine was stopped: the target comes up.
    let mut s = state(now);
    ready(&mut s, "a", now);
    s.request_plan("b", "sw-1".into(), now).unwrap();
    s.deps
        .get_mut("a")
        .unwrap()
        .fail("park or stop failed: boom".into(), now);
    let kept = [("a".to_string(), failed)];
    assert!(matches!(
        s.switch_target_up("sw-1", "b", &kept, now),
        Ok(Some(Up::Start))
    ));
    assert_eq!(s.deps["b"].state, InstanceState::Starting);
}

#[tokio::test(start_paused = true)]
async fn the_longest_idle_is_the_victim_never_a_protected_or_warm_one() {
    let t0 = Instant::now();
    let now = t0 + Duration::from_secs(60);
    let mut s = state(t0);
    // `p` and `q` (3 GiB each) hold 6 of 10 GiB; `b` needs 6: one of them must go (parked,
    // it still holds its residue, 512 MiB).
    for id in ["p", "q"] {
        s.insert(sized_dep(id, &format!("chat-{id}"), "", 3, t0));
    }
    ready(&mut s, "p", t0 + Duration::from_secs(30));
    ready(&mut s, "q", t0 + Duration::from_secs(10));
    let victims = |plan: Plan| match plan {
        Plan::Switch { victims, .. } => victims
            .into_iter()
            .map(|k| k.deployment)
            .collect::<Vec<_>>(),
        other => panic!("a switch: {other:?}"),
    };
    let plan = s.request_plan("b", "sw-1".into(), now).unwrap();
    assert_eq!(victims(plan), ["q"], "idle for 50 s, p for 30 s");
    s.release_reservation("sw-1");
    // Requests wait for `q`: `p` goes instead.
    let protected = BTreeSet::from(["q".to_string()]);
    let plan = s
        .plan(
            "b",
            &protected,
            PlanFor::Requests,
            "sw-2".into(),
            &NoRequests,
            now,
        )
        .unwrap();
    assert_eq!(victims(plan), ["p"]);
    s.release_reservation("sw-2");
    // A warm model is pinned: with `q` protected and `p` warm, nothing can be released,
    // and nothing ever can while they hold the GPU.
    s.deps.get_mut("p").unwrap().rec.doc =
        dep("p", "chat-p", "lifecycle:\n  warm: true\n", t0).rec.doc;
    let plan = s
        .plan(
            "b",
            &protected,
            PlanFor::Requests,
            "sw-3".into(),
            &NoRequests,
            now,
        )
        .unwrap();
    assert!(matches!(plan, Plan::Later), "q is only protected: {plan:?}");
    s.deps.get_mut("q").unwrap().rec.doc =
        dep("q", "chat-q", "lifecycle:\n  warm: true\n", t0).rec.doc;
    let err = s.request_plan("b", "sw-4".into(), now).unwrap_err();
    assert_eq!(err.code(), "does_not_fit", "{err:?}");
}

#[tokio::test(start_paused = true)]
async fn placement_reads_only_what_may_hold_the_gpu_and_lets_go_of_what_no_longer_does() {
    let now = Instant::now();
    let mut s = state(now);
    ready(&mut s, "a", now);
    ready(&mut s, "b", now);
    let holding = |s: &State| -> Vec<String> {
        s.holding
            .get("gpu-1")
            .into_iter()
            .flatten()
            .map(|id| id.to_string())
            .collect()
    };
    assert_eq!(holding(&s), ["a", "b"]);
    // `a` stops (no GPU memory any more), `b` parks with nothing left on the GPU: both
    // stay bound to gpu-1 (b's copy is there) but hold nothing.
    s.deps.get_mut("a").unwrap().state = InstanceState::Stopped;
    s.deps.get_mut("b").unwrap().state = InstanceState::Parked;
    let plan = s.request_plan("c", "sw-1".into(), now).unwrap();
    assert!(matches!(plan, Plan::BringUp { .. }), "{plan:?}");
    assert_eq!(holding(&s), ["c"], "let go of a and b; c is claimed");
    let on: Vec<&str> = s.on_host("gpu-1").map(|d| d.id()).collect();
    assert_eq!(on, ["a", "b", "c"], "the by-host index still has them all");
    // Woken, `b` is bound again: a holder again.
    s.release_reservation("sw-1");
    s.deps.get_mut("c").unwrap().state = InstanceState::Stopped;
    let plan = s.request_plan("b", "sw-2".into(), now).unwrap();
    assert!(matches!(plan, Plan::BringUp { .. }), "{plan:?}");
    assert_eq!(holding(&s), ["b"]);
}

#[tokio::test(start_paused = true)]
async fn a_cordoned_host_takes_nothing_and_what_is_bound_there_waits() {
    let now = Instant::now();
    let mut s = state(now);
    ready(&mut s, "a", now);
    s.deps.get_mut("a").unwrap().state = InstanceState::Parked;
    s.cordoned.insert("gpu-1".into());
    let plan = s.request_plan("a", "sw-1".into(), now).unwrap();
    assert!(
        matches!(plan, Plan::Later),
        "bound there: waits for the drain {plan:?}"
    );
    let err = s.request_plan("b", "sw-2".into(), now).unwrap_err();
    assert_eq!(err.code(), "does_not_fit");
    assert!(
        err.message().ends_with(
            "host gpu-1 is drained and out of service; `capyctl uncordon host` puts host gpu-1 back"
        ),
        "{}",
        err.message()
    );
    s.cordoned.clear();
    let plan = s.request_plan("b", "sw-3".into(), now).unwrap();
    assert!(
        matches!(plan, Plan::Switch { .. } | Plan::BringUp { .. }),
        "{plan:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn requests_may_not_bring_up_an_explicit_model_but_an_operators_switch_may() {
    let now = Instant::now();
    let mut s = state(now);
    s.insert(dep(
        "x",
        "chat-x",
        "lifecycle:\n  activation: explicit\n",
        now,
    ));
    let err = s.request_plan("x", "sw-1".into(), now).unwrap_err();
    assert_eq!(err.code(), "deployment_inactive");
    let plan = s
        .plan(
            "x",
            &none(),
            PlanFor::Operator,
            "sw-2".into(),
            &NoRequests,
            now,
        )
        .unwrap();
    assert!(matches!(plan, Plan::BringUp { .. }), "{plan:?}");
    s.deps.get_mut("b").unwrap().rec.operator_stopped = true;
    assert_eq!(s.admissible("b").unwrap_err().code(), "deployment_stopped");
}

#[tokio::test(start_paused = true)]
async fn idle_timers_are_due_by_the_last_use_and_are_decided_again_before_they_act() {
    let t0 = Instant::now();
    let mut s = state(t0);
    let timeouts = LifecycleDefaults {
        ready_idle_timeout: Some(Duration::from_secs(300)),
        parked_idle_timeout: Some(Duration::from_secs(3600)),
    };
    ready(&mut s, "a", t0);
    ready(&mut s, "b", t0 + Duration::from_secs(200));
    s.deps.get_mut("c").unwrap().state = InstanceState::Parked;
    let now = t0 + Duration::from_secs(301);
    assert_eq!(
        s.idle_due(&timeouts, &none(), &NoRequests, now),
        [("a".to_string(), true)],
        "b was used 101 s ago; c is parked for less than an hour"
    );
    let in_use = BTreeSet::from(["a".to_string()]);
    assert!(
        s.idle_due(&timeouts, &in_use, &NoRequests, now).is_empty(),
        "in use"
    );
    assert_eq!(
        s.idle_due(
            &timeouts,
            &none(),
            &NoRequests,
            t0 + Duration::from_secs(3600)
        ),
        [
            ("a".to_string(), true),
            ("b".to_string(), true),
            ("c".to_string(), false)
        ]
    );
    // Used again since the list was made: not taken down.
    s.deps.get_mut("a").unwrap().last_used = now;
    assert_eq!(
        s.begin_idle_down("a", true, &timeouts, "idle-1", &NoRequests, now),
        None
    );
    // Due: reserved, and the router is told the instant to check.
    let later = now + Duration::from_secs(300);
    let (down, since) = s
        .begin_idle_down("a", true, &timeouts, "idle-2", &NoRequests, later)
        .unwrap();
    assert_eq!(down, Some(true), "ready: drained first");
    assert_eq!(since, now);
    assert_eq!(s.deps["a"].reserved.as_deref(), Some("idle-2"));
    // A reserved one is nobody else's candidate.
    assert!(
        !s.idle_due(&timeouts, &none(), &NoRequests, later)
            .iter()
            .any(|(id, _)| id == "a")
    );
}

#[tokio::test(start_paused = true)]
async fn an_engine_exit_fails_an_idle_instance_on_its_host_only() {
    let now = Instant::now();
    let mut s = state(now);
    ready(&mut s, "a", now);
    ready(&mut s, "b", now);
    let exit = |instance: &str| EngineExit {
        instance: instance.to_string(),
        status: Some("signal 9".into()),
    };
    assert_eq!(
        s.engine_exited("gpu-2", &exit("a-0"), Instant::now()),
        None,
        "not its host"
    );
    s.deps.get_mut("b").unwrap().busy = true;
    assert_eq!(
        s.engine_exited("gpu-1", &exit("b-0"), Instant::now()),
        None,
        "its operation sees it"
    );
    let key = s
        .engine_exited("gpu-1", &exit("a-0"), Instant::now())
        .unwrap();
    assert_eq!(
        (key.deployment.as_str(), key.host_id.as_str()),
        ("a", "gpu-1")
    );
    let a = &s.deps["a"];
    assert_eq!(a.state, InstanceState::Failed);
    assert_eq!(a.addr, None);
    assert_eq!(a.last_error.as_deref(), Some("the engine exited: signal 9"));
    assert_eq!(
        s.engine_exited("gpu-1", &exit("a-0"), Instant::now()),
        None,
        "once"
    );
}

#[tokio::test(start_paused = true)]
async fn a_start_without_evict_waits_for_memory_and_begins_once_it_is_free() {
    let now = Instant::now();
    let mut s = state(now);
    ready(&mut s, "a", now);
    let next = s.start("b", false, false, now).unwrap();
    assert!(matches!(next, StartNext::Pending), "{next:?}");
    assert!(s.deps["b"].rec.pending_start);
    assert!(s.deps["b"].rec.operator_started);
    assert_eq!(s.start_pending("b", now), None, "a still holds the GPU");
    s.deps.get_mut("a").unwrap().state = InstanceState::Stopped;
    assert_eq!(s.start_pending("b", now), Some(Up::Start));
    let b = &s.deps["b"];
    assert_eq!(b.state, InstanceState::Starting);
    assert!(b.busy && !b.rec.pending_start);
    assert_eq!(b.rec.generation, 1);
    assert!(s.dirty.has("b"), "the taken start and generation are saved");
    // With --evict the start is the coordinator's switch.
    assert!(matches!(
        s.start("c", false, true, now).unwrap(),
        StartNext::Evict
    ));
}

#[tokio::test(start_paused = true)]
async fn an_ended_bring_up_is_stopped_or_failed_with_its_reason() {
    let now = Instant::now();
    let mut s = state(now);
    s.set_host("a", Some("gpu-1".into()));
    assert_eq!(s.begin_up("a", false, now), Some(Up::Start));
    let refusal = ApiError::DeploymentStopped {
        deployment: "a".into(),
    };
    let gone = s
        .up_done(
            "a",
            Up::Start,
            UpDone::Failed {
                error: refusal.clone(),
                ended: Some(Ok(())),
            },
            now,
        )
        .unwrap();
    assert!(gone.is_err(), "the router is told it is gone");
    assert_eq!(s.deps["a"].state, InstanceState::Stopped);
    assert!(
        s.deps["a"]
            .last_error
            .as_deref()
            .unwrap()
            .starts_with("start ended and engine stopped")
    );
    assert_eq!(s.begin_up("a", false, now), Some(Up::Start));
    s.up_done(
        "a",
        Up::Start,
        UpDone::Failed {
            error: refusal,
            ended: Some(Err("connection refused".into())),
        },
        now,
    );
    let a = &s.deps["a"];
    assert_eq!(a.state, InstanceState::Failed);
    assert_eq!(a.ended_stop_failed.as_deref(), Some("connection refused"));
}

fn on(inner: &State, host: &str) -> Vec<String> {
    inner.on_host(host).map(|d| d.id().to_string()).collect()
}

#[test]
fn the_by_host_index_follows_binds_moves_and_removals() {
    let mut inner = State::default();
    inner.insert(dep("a", "chat-a", "", Instant::now()));
    inner.insert(dep("b", "chat-b", "", Instant::now()));
    inner.insert(dep("c", "chat-c", "", Instant::now()));
    inner.set_host("b", Some("gpu-1".into()));
    inner.set_host("a", Some("gpu-1".into()));
    inner.set_host("c", Some("gpu-2".into()));
    assert_eq!(on(&inner, "gpu-1"), ["a", "b"], "by ID");
    assert_eq!(on(&inner, "gpu-2"), ["c"]);
    inner.set_host("a", Some("gpu-2".into()));
    assert_eq!(on(&inner, "gpu-1"), ["b"]);
    assert_eq!(on(&inner, "gpu-2"), ["a", "c"]);
    inner.remove("c");
    assert_eq!(on(&inner, "gpu-2"), ["a"]);
    inner.set_host("b", None);
    assert_eq!(on(&inner, "gpu-1"), Vec::<String>::new());
    assert!(
        !inner.by_host.contains_key("gpu-1"),
        "an empty host's set goes"
    );
    assert_eq!(on(&inner, "gpu-9"), Vec::<String>::new());
}

#[tokio::test(start_paused = true)]
async fn the_last_use_is_the_routers_record_of_requests_or_a_later_state_change() {
    use capyctl_router::admission::Admission;
    use capyctl_router::config::RouterConfig;
    use capyctl_router::coordinator::testing::{FakeLifecycle, FakeState, FakeTimings};
    use tokio::time::{Instant, advance};

    let fake = FakeLifecycle::new(FakeTimings::default());
    let a = fake.add("a", "chat-a", FakeState::Ready, 1);
    let router = fake.spawn(RouterConfig::default());
    fake.announce("a").await;
    let mut inner = State::default();
    inner.insert(dep("a", "chat-a", "", Instant::now()));
    let changed = inner.deps["a"].last_used;
    // The server's handle on the record, as the rules are given it.
    let uses = RouterUses::default();
    let used_at = |inner: &State| State::used_at(&inner.deps["a"], &uses);
    assert_eq!(used_at(&inner), changed, "no router yet");
    uses.attach(Arc::new(router.last_uses()));
    assert_eq!(used_at(&inner), changed, "no request yet");

    // A request's start and end, as the router records them (on its lane: no turn of its
    // task), are the deployment's last use.
    advance(Duration::from_secs(5)).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let permit = router.admit(a, deadline).await.unwrap();
    assert_eq!(used_at(&inner), changed + Duration::from_secs(5));
    advance(Duration::from_secs(1)).await;
    drop(permit);
    assert_eq!(used_at(&inner), changed + Duration::from_secs(6));
    // A later state change that counts as use wins when it is the later one.
    advance(Duration::from_secs(1)).await;
    inner.deps.get_mut("a").unwrap().last_used = Instant::now();
    assert_eq!(used_at(&inner), changed + Duration::from_secs(7));
    // Dropped, a deployment says so to the name cache entries that still hold it.
    let gone = Arc::clone(&inner.deps["a"].presence.0);
    assert!(!gone.load(Ordering::Acquire));
    inner.remove("a");
    assert!(gone.load(Ordering::Acquire));
}

/// Begins a park of ready `id` as a release does, and answers it with `done` at `at`.
fn released(s: &mut State, id: &str, done: DownDone, at: Instant) {
    let r = s.begin_release(id, false, false).unwrap();
    assert!(!r.parked);
    assert_eq!(s.deps[id].state, InstanceState::Parking);
    assert!(s.deps[id].busy);
    s.down_done(id, done, at);
}

/// A park that failed, whose engine could not be stopped either, leaves the instance failed
/// (its status says both) with its engine kept: the books count its memory, so another model
/// is not brought up on it, until a stop succeeds (an operator's stop tries again: failing
/// again, it still holds it) or its engine is seen gone (it exited; its host came back
/// without it). A park that failed and stopped its engine holds nothing.
#[tokio::test(start_paused = true)]
async fn an_engine_that_could_not_be_stopped_holds_its_memory_until_stopped_or_gone() {
    let t0 = Instant::now();
    let kept = |s: &mut State, id: &str| {
        ready(s, id, t0);
        released(
            s,
            id,
            DownDone::Failed {
                error: "park timed out".into(),
                stopped: Err("connection refused".into()),
            },
            t0,
        );
    };
    let mut s = state(t0);
    kept(&mut s, "a");
    let a = &s.deps["a"];
    assert_eq!(a.state, InstanceState::Failed);
    assert_eq!(
        a.last_error.as_deref(),
        Some(
            "park or stop failed: park timed out, and stopping the engine failed: \
             connection refused"
        )
    );
    assert!(a.keeps_engine());
    held_sums_agree(&mut s, t0, "kept");
    assert_eq!(s.gpu_held.on("gpu-1", None, ""), 6 * GIB);
    // b (6 GiB) does not fit beside it (10 GiB), and a is no victim: b's requests wait.
    let plan = s.request_plan("b", "sw-1".into(), t0).unwrap();
    assert!(matches!(plan, Plan::Later), "{plan:?}");
    // A stop tries again; it fails again: still held.
    assert_eq!(s.begin_down("a", "stop-1", t0), Ok(Some(false)));
    let r = s.begin_release("a", true, false).unwrap();
    assert!(r.kept && !r.parked);
    assert_eq!(s.deps["a"].state, InstanceState::Stopping);
    s.down_done(
        "a",
        DownDone::Failed {
            error: "connection refused".into(),
            stopped: Err("connection refused".into()),
        },
        t0,
    );
    s.release_reservation("stop-1");
    assert_eq!(
        s.deps["a"].last_error.as_deref(),
        Some("park or stop failed: connection refused")
    );
    held_sums_agree(&mut s, t0, "stop failed again");
    assert_eq!(s.gpu_held.on("gpu-1", None, ""), 6 * GIB);
    assert!(matches!(
        s.request_plan("b", "sw-2".into(), t0).unwrap(),
        Plan::Later
    ));
    // The stop succeeds: its memory is free, b comes up.
    assert_eq!(s.begin_down("a", "stop-2", t0), Ok(Some(false)));
    s.begin_release("a", true, false).unwrap();
    s.down_done("a", DownDone::Stopped(Released::Stopped), t0);
    s.release_reservation("stop-2");
    assert_eq!(s.deps["a"].state, InstanceState::Stopped);
    assert_eq!(s.deps["a"].ended_stop_failed, None);
    held_sums_agree(&mut s, t0, "stopped");
    assert_eq!(s.gpu_held.on("gpu-1", None, ""), 0);
    let plan = s.request_plan("b", "sw-3".into(), t0).unwrap();
    assert!(matches!(plan, Plan::BringUp { .. }), "{plan:?}");
    // Its engine exits after all: gone, its memory free.
    let mut s = state(t0);
    kept(&mut s, "a");
    let exit = EngineExit {
        instance: instance_id("a"),
        status: Some("signal 9".into()),
    };
    assert!(s.engine_exited("gpu-1", &exit, t0).is_some());
    assert!(!s.deps["a"].keeps_engine());
    assert_eq!(s.deps["a"].state, InstanceState::Failed);
    held_sums_agree(&mut s, t0, "exited");
    assert_eq!(s.gpu_held.on("gpu-1", None, ""), 0);
    assert!(matches!(
        s.request_plan("b", "sw-1".into(), t0).unwrap(),
        Plan::BringUp { .. }
    ));
    // Its host comes back without it: gone.
    let mut s = state(t0);
    kept(&mut s, "a");
    s.add_host("gpu-1".into(), host(), &[]);
    assert!(!s.deps["a"].keeps_engine());
    held_sums_agree(&mut s, t0, "lost");
    assert_eq!(s.gpu_held.on("gpu-1", None, ""), 0);
    // A park that failed and stopped its engine holds nothing.
    let mut s = state(t0);
    ready(&mut s, "a", t0);
    released(
        &mut s,
        "a",
        DownDone::Failed {
            error: "park timed out".into(),
            stopped: Ok(()),
        },
        t0,
    );
    assert_eq!(
        s.deps["a"].last_error.as_deref(),
        Some("park or stop failed: park timed out")
    );
    held_sums_agree(&mut s, t0, "park failed, engine stopped");
    assert_eq!(s.gpu_held.on("gpu-1", None, ""), 0);
    // Nothing to stop then.
    assert_eq!(s.begin_down("a", "stop-1", t0), Ok(None));
}

#[tokio::test(start_paused = true)]
async fn a_releases_outcome_is_written_once_at_the_time_given() {
    let t0 = Instant::now();
    let mut s = state(t0);
    for id in ["a", "b", "c"] {
        ready(&mut s, id, t0);
    }
    let later = t0 + Duration::from_secs(90);
    // Parked: its tier and what it still holds of the GPU, its last use the outcome's time
    // (the clock is not read: it stands at t0).
    released(
        &mut s,
        "a",
        DownDone::Parked {
            tier: ParkTier::HostRam,
            gpu_held: Some(GIB),
        },
        later,
    );
    let a = &s.deps["a"];
    assert_eq!(a.state, InstanceState::Parked);
    assert!(!a.busy);
    assert_eq!((a.tier, a.parked_gpu), (Some(ParkTier::HostRam), Some(GIB)));
    assert_eq!(a.last_used, later);
    // Stopped for want of room to park: said so in its status.
    released(
        &mut s,
        "b",
        DownDone::Stopped(Released::StoppedNoRoomToPark),
        later,
    );
    let b = &s.deps["b"];
    assert_eq!(b.state, InstanceState::Stopped);
    assert_eq!((b.addr, b.tier), (None, None));
    assert_eq!(
        b.last_error,
        Some(Released::StoppedNoRoomToPark.status_line())
    );
    // Failed: the scaler's back-off counts from the outcome's time, not the clock's.
    released(
        &mut s,
        "c",
        DownDone::Failed {
            error: "boom".into(),
            stopped: Ok(()),
        },
        later,
    );
    let c = &s.deps["c"];
    assert_eq!(c.state, InstanceState::Failed);
    assert_eq!(c.last_error.as_deref(), Some("park or stop failed: boom"));
    assert!(c.backing_off(later + FAILED_BACKOFF - Duration::from_secs(1)));
    assert!(!c.backing_off(later + FAILED_BACKOFF));
    // A drain refused: what is still shown drained serves again, nothing else changes.
    ready(&mut s, "b", t0);
    assert_eq!(
        s.show_draining(&["b".into(), "gone".into()], InstanceState::Closed)
            .len(),
        1
    );
    s.drain_refused(&["a".into(), "b".into()], InstanceState::Closed);
    assert_eq!(s.deps["b"].state, InstanceState::Ready);
    assert_eq!(s.deps["a"].state, InstanceState::Parked);
}

#[tokio::test(start_paused = true)]
async fn a_preinitialize_writes_its_start_through_up_done_and_keeps_its_last_use() {
    let t0 = Instant::now();
    let mut s = state(t0);
    let later = t0 + Duration::from_secs(30);
    let started = || Started {
        addr: Some(([127, 0, 0, 1], 9).into()),
        pid: 7,
        max_running: MaxRunning {
            count: Some(4),
            source: capyctl_interfaces::launch::MaxRunningSource::Declared,
        },
        measurement: Measurement::default(),
    };
    for id in ["a", "b", "c"] {
        let d = s.deps.get_mut(id).unwrap();
        d.busy = true;
        d.state = InstanceState::Starting;
    }
    // Started, not ready: closed and still busy (its park follows), never announced.
    let answered = s.up_done(
        "a",
        Up::Start,
        UpDone::Closed {
            started: started(),
            first_answer: capyctl_interfaces::verify::FirstAnswer::Text { text: "ok".into() },
        },
        later,
    );
    assert_eq!(answered, None);
    let a = &s.deps["a"];
    assert_eq!(a.state, InstanceState::Closed);
    assert!(a.busy);
    assert_eq!((a.pid, a.last_used), (Some(7), t0));
    assert!(a.rec.first_answer.is_some());
    // Its start failed (or no agent): failed with the status given, back-off from `later`.
    let gone = s.up_done(
        "b",
        Up::Start,
        UpDone::Gone("preinitialize: no".into()),
        later,
    );
    assert!(matches!(gone, Some(Err(_))));
    let b = &s.deps["b"];
    assert_eq!(b.state, InstanceState::Failed);
    assert!(!b.busy);
    assert_eq!(b.last_error.as_deref(), Some("preinitialize: no"));
    assert_eq!((b.failed_at, b.last_used), (Some(later), t0));
    // Ended and its engine stopped: stopped, no back-off.
    s.up_done(
        "c",
        Up::Start,
        UpDone::Ended {
            why: "ended".into(),
            stopped: Ok(()),
        },
        later,
    );
    let c = &s.deps["c"];
    assert_eq!((c.state, c.busy), (InstanceState::Stopped, false));
    assert_eq!(c.last_error.as_deref(), Some("ended"));
    // Ended, but its engine's stop failed: failed, its last use kept, and the stop's error
    // kept for the drain or stop that ended it (which then reports the engine not stopped).
    let b = s.deps.get_mut("b").unwrap();
    (b.busy, b.state) = (true, InstanceState::Starting);
    s.up_done(
        "b",
        Up::Start,
        UpDone::Ended {
            why: "ended".into(),
            stopped: Err("connection refused".into()),
        },
        later,
    );
    let b = &s.deps["b"];
    assert_eq!((b.state, b.busy), (InstanceState::Failed, false));
    assert_eq!(
        b.last_error.as_deref(),
        Some("ended, but stopping the engine failed: connection refused")
    );
    assert_eq!(b.ended_stop_failed.as_deref(), Some("connection refused"));
    assert_eq!(b.last_used, t0);
    // A start that is ready is used at the outcome's time.
    let d = s.deps.get_mut("c").unwrap();
    d.busy = true;
    d.state = InstanceState::Starting;
    assert!(matches!(
        s.up_done("c", Up::Start, UpDone::Ready(Some(started())), later),
        Some(Ok(_))
    ));
    assert_eq!(
        (s.deps["c"].state, s.deps["c"].last_used),
        (InstanceState::Ready, later)
    );
}

#[tokio::test(start_paused = true)]
async fn an_idle_timer_that_could_not_act_starts_over_from_the_time_given() {
    let t0 = Instant::now();
    let mut s = state(t0);
    ready(&mut s, "a", t0);
    let later = t0 + Duration::from_secs(600);
    let (down, _) = s
        .begin_idle_down(
            "a",
            true,
            &LifecycleDefaults {
                ready_idle_timeout: Some(Duration::from_secs(60)),
                parked_idle_timeout: None,
            },
            "idle-1",
            &NoRequests,
            later,
        )
        .unwrap();
    assert_eq!(down, Some(true));
    assert_eq!(s.deps["a"].reserved.as_deref(), Some("idle-1"));
    // Released by the router: the reservation ends, and the release is no use: the last use
    // stays the one before.
    s.idle_down_done("a", "idle-1", false, later);
    assert_eq!(s.deps["a"].reserved, None);
    assert_eq!(s.deps["a"].last_used, t0);
    // Failed: its timer starts over from the time given.
    s.idle_down_done("a", "idle-2", true, later);
    assert_eq!(s.deps["a"].last_used, later);
    s.touch("b", later);
    assert_eq!(s.deps["b"].last_used, later);
}

#[tokio::test(start_paused = true)]
async fn an_engine_exit_and_a_fence_read_the_time_given_not_the_clock() {
    let t0 = Instant::now();
    let mut s = state(t0);
    ready(&mut s, "a", t0);
    ready(&mut s, "b", t0);
    let later = t0 + Duration::from_secs(45);
    let exit = EngineExit {
        instance: "a-0".into(),
        status: Some("signal 9".into()),
    };
    assert!(s.engine_exited("gpu-1", &exit, later).is_some());
    let a = &s.deps["a"];
    assert_eq!((a.last_used, a.failed_at), (later, Some(later)));
    // Fenced until t0 + 60 s: at t0 + 45 s the refusal says 16 s more (the clock says 61).
    s.set_fence(t0 + Duration::from_secs(60), t0);
    let e = s.command_refusal("b", later).unwrap_err();
    assert!(e.message().contains("for another 16 s"), "{}", e.message());
    // A deploy writes its record as of the time given.
    let doc = capyctl_spec::documents::parse_deployment_str(
        "t.yaml",
        "name: chat-n\nengine: vllm\nmodel: m\n",
    )
    .unwrap();
    let (id, outcome) = s.apply_deploy(doc.clone(), "n".into(), None, later);
    assert_eq!((id.as_str(), outcome), ("n", DeployOutcome::Created));
    assert_eq!(s.deps["n"].last_used, later);
    assert!(s.dirty.has("n"));
    let (_, again) = s.apply_deploy(doc, "other".into(), None, later);
    assert_eq!(again, DeployOutcome::Unchanged);
}

#[tokio::test(start_paused = true)]
async fn the_operators_marks_are_rules_of_one_turn() {
    let now = Instant::now();
    let mut s = state(now);
    ready(&mut s, "a", now);
    // A stop: stopped by its operator, no start pending, the record marked for the save.
    s.deps.get_mut("b").unwrap().rec.pending_start = true;
    s.operator_stop("b").unwrap();
    let b = &s.deps["b"].rec;
    assert!(b.operator_stopped && !b.operator_started && !b.pending_start);
    assert!(s.dirty.has("b"));
    assert_eq!(s.operator_stop("nope").unwrap_err().code(), "not_found");
    // A park of a deployment none of whose instances is ready is one instance's: nothing
    // marked; with one ready, the deployment is marked parked by its operator.
    assert_eq!(s.operator_park("c"), Err("c".to_string()));
    assert!(!s.operator_parked.contains("c"));
    let units = s.operator_park("a").unwrap();
    assert_eq!(units, [("a".to_string(), InstanceState::Ready)]);
    assert!(s.operator_parked.contains("a"));
    assert!(s.end_operator_park("a"));
    assert!(!s.end_operator_park("a"));
    // A start that nothing can be released for waits for memory, once.
    assert!(s.wait_for_memory("c"));
    assert!(s.deps["c"].rec.pending_start);
    assert!(!s.wait_for_memory("c"), "already waiting");
    assert!(!s.wait_for_memory("a"), "it runs");
    // A host drain: cordoned, what is bound there named; uncordoned again.
    assert_eq!(s.cordon("gpu-1"), ["a".to_string()]);
    assert!(s.cordoned.contains("gpu-1"));
    assert!(s.uncordon("gpu-1"));
    assert!(s.cordoned.is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_hold_gives_up_the_claimed_targets_and_a_drained_order_gives_its_victims_back() {
    let now = Instant::now();
    let mut s = state(now);
    ready(&mut s, "a", now);
    ready(&mut s, "b", now);
    // A plan for `c` claims it and reserves a victim.
    let plan = s.request_plan("c", "sw-1".into(), now).unwrap();
    let Plan::Switch { victims, .. } = plan else {
        panic!("a switch: {plan:?}")
    };
    assert_eq!(s.deps["c"].claim.as_deref(), Some("sw-1"));
    // Held: the claimed target is given up (its requests get the refusal).
    assert_eq!(s.hold(held()), ["c".to_string()]);
    // The drained order is given back: the reservation ends, the victims still ready (of
    // the generation drained) are named to announce again; one of another generation is not.
    let mut stale = victims[0].clone();
    stale.generation += 1;
    let back = s.give_back_held_order("sw-1", vec![victims[0].clone(), stale]);
    assert_eq!(back.len(), 1);
    assert_eq!(back[0].0, victims[0]);
    assert_eq!(s.deps["c"].claim, None);
    assert!(s.deps.values().all(|d| d.reserved.is_none()));
}

#[tokio::test(start_paused = true)]
async fn the_scaler_takes_the_first_unit_with_room_in_one_turn() {
    let now = Instant::now();
    let mut s = one_host("box", 2, 10);
    s.insert(dep("r", "chat-r", "replicas: 3", now));
    bring_up(&mut s, "r", now);
    bring_up(&mut s, "r-1", now);
    // Both GPUs are taken by its siblings: the third has no room; `nope` is no unit.
    assert_eq!(
        s.scale_up_first(vec!["nope".into(), "r-2".into()], &NoRequests, now),
        None
    );
    // One sibling stops: the third comes up there, started by the scaler (not an operator).
    let d = s.deps.get_mut("r-1").unwrap();
    d.state = InstanceState::Stopped;
    s.set_host("r-1", None);
    let (unit, up) = s
        .scale_up_first(vec!["nope".into(), "r-2".into()], &NoRequests, now)
        .unwrap();
    assert_eq!((unit.as_str(), up), ("r-2", Up::Start));
    assert!(s.deps["r-2"].busy && !s.deps["r-2"].operator_up);
    assert_eq!(s.deps["r-2"].last_used, now);
}

/// A small deterministic generator (xorshift64*), for the property test below.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a, T>(&mut self, of: &'a [T]) -> &'a T {
        &of[self.below(of.len())]
    }

    fn odds(&mut self, in_: u64) -> bool {
        self.next().is_multiple_of(in_)
    }
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

#[tokio::test(start_paused = true)]
async fn the_held_sums_equal_the_holders_after_every_kind_of_transition() {
    let measured = |gib: u64| Measurement {
        weights: None,
        gpu_memory: Some(Measured {
            bytes: gib * GIB,
            source: MeasureSource::EngineFootprint,
        }),
    };
    for seed in 1..=24u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let t0 = Instant::now();
        let mut now = t0;
        // One host of one GPU (10 GiB), one of four GPUs (10 GiB each).
        let mut s = state(t0);
        s.add_host("box".into(), gpus_host(4, 10), &[]);
        s.insert(sized_dep("d", "chat-d", "", 3, t0));
        s.insert(sized_dep("r", "chat-r", "replicas: 2", 4, t0));
        s.insert(sized_dep("t", "chat-t", "gpus_per_instance: 2", 12, t0));
        s.insert(sized_dep(
            "w",
            "chat-w",
            "lifecycle:\n  warm: true\n",
            2,
            t0,
        ));
        let mut u = dep("u", "chat-u", "", t0);
        u.measurement = Measurement::default();
        s.insert(u);
        let deployments = ["a", "b", "c", "d", "r", "t", "w", "u"];
        let mut n = 0u32;
        for step in 0..250 {
            now += Duration::from_secs(rng.below(120) as u64);
            let units: Vec<String> = s.deps.keys().cloned().collect();
            let unit = rng.pick(&units).clone();
            let dep = rng.pick(&deployments).to_string();
            n += 1;
            let rid = format!("x-{n}");
            let what = match rng.below(12) {
                0 | 1 => {
                    // A request's (or an operator's) plan, given up or carried out.
                    let mut protected = none();
                    if rng.odds(4) {
                        protected.insert(rng.pick(&deployments).to_string());
                    }
                    let who = if rng.odds(3) {
                        PlanFor::Operator
                    } else {
                        PlanFor::Requests
                    };
                    let plan = s.plan(&dep, &protected, who, rid.clone(), &NoRequests, now);
                    if let Ok(Plan::BringUp { .. } | Plan::Switch { .. }) = plan {
                        let r = &s.reservations[&rid];
                        let target = r.target.clone().unwrap();
                        let victims = r.victims.clone();
                        if rng.odds(4) {
                            s.release_reservation(&rid);
                        } else {
                            for v in victims {
                                if s.deps[&v].bringing_up() {
                                    s.up_done(
                                        &v,
                                        Up::Start,
                                        UpDone::Ended {
                                            why: "ended".into(),
                                            stopped: Ok(()),
                                        },
                                        now,
                                    );
                                } else if s.begin_release(&v, rng.odds(3), false).is_some() {
                                    let done = match rng.below(4) {
                                        0 => DownDone::Parked {
                                            tier: ParkTier::HostRam,
                                            gpu_held: Some(rng.below(2) as u64 * GIB),
                                        },
                                        1 => DownDone::Stopped(Released::Stopped),
                                        2 => DownDone::Failed {
                                            error: "boom".into(),
                                            stopped: Ok(()),
                                        },
                                        // Its engine could not be stopped: still held.
                                        _ => DownDone::Failed {
                                            error: "boom".into(),
                                            stopped: Err("stuck".into()),
                                        },
                                    };
                                    s.down_done(&v, done, now);
                                }
                            }
                            let _ = s.switch_target_up(&rid, &target, &[], now);
                        }
                    }
                    "plan"
                }
                2..=4 => {
                    // A start or wake in progress ends.
                    let coming: Vec<String> = s
                        .deps
                        .values()
                        .filter(|d| d.bringing_up())
                        .map(|d| d.id().to_string())
                        .collect();
                    let unit = if coming.is_empty() {
                        unit
                    } else {
                        rng.pick(&coming).clone()
                    };
                    let up = if s.deps[&unit].state == InstanceState::Waking {
                        Up::Wake
                    } else {
                        Up::Start
                    };
                    if s.deps[&unit].bringing_up() {
                        let done = match rng.below(4) {
                            0 => UpDone::Failed {
                                error: held(),
                                ended: None,
                            },
                            1 if up == Up::Start => UpDone::Ready(Some(Started {
                                addr: Some(([127, 0, 0, 1], 9).into()),
                                pid: 7,
                                max_running: MaxRunning {
                                    count: Some(4),
                                    source: capyctl_interfaces::launch::MaxRunningSource::Declared,
                                },
                                // What it measured differs from what was declared.
                                measurement: measured(1 + rng.below(5) as u64),
                            })),
                            _ => UpDone::Ready(None),
                        };
                        s.up_done(&unit, up, done, now);
                    }
                    "up_done"
                }
                5 => {
                    let _ = s.start(&dep, true, false, now);
                    "start"
                }
                6 => {
                    // An operator's park or stop, or an idle timer's take-down.
                    if let Ok(Some(ready)) = s.begin_down(&unit, &rid, now) {
                        if ready {
                            s.show_draining(std::slice::from_ref(&unit), InstanceState::Closed);
                        }
                        if rng.odds(5) {
                            s.drain_refused(std::slice::from_ref(&unit), InstanceState::Closed);
                        } else if s.begin_release(&unit, rng.odds(2), rng.odds(2)).is_some() {
                            let done = if rng.odds(2) {
                                DownDone::Parked {
                                    tier: ParkTier::HostRam,
                                    gpu_held: Some(GIB / 2),
                                }
                            } else {
                                DownDone::Stopped(Released::StoppedNoRoomToPark)
                            };
                            s.down_done(&unit, done, now);
                        }
                    }
                    s.release_reservation(&rid);
                    "take down"
                }
                7 => {
                    let host = s.deps[&unit].host.clone().unwrap_or_default();
                    let exit = capyctl_interfaces::agent::EngineExit {
                        instance: unit_instance(&unit),
                        status: None,
                    };
                    s.engine_exited(&host, &exit, now);
                    "engine exit"
                }
                8 => {
                    // A host comes back with another capacity (or GPUs).
                    if rng.odds(2) {
                        let h = Host {
                            capacity: (8 + rng.below(6) as u64) * GIB,
                            ..host()
                        };
                        s.add_host("gpu-1".into(), h, &[]);
                    } else {
                        s.add_host("box".into(), gpus_host(4, 8 + rng.below(4) as u64), &[]);
                    }
                    "host back"
                }
                9 => {
                    // Deleted while it may run, and deployed again.
                    if let Some(old) = s.remove(&dep) {
                        s.insert(Dep::new(old.rec, now));
                    }
                    "delete"
                }
                10 => {
                    let _ = s.preinitialize(&dep, measured(3), now);
                    "preinitialize"
                }
                _ => {
                    if rng.odds(2) {
                        let _ = s.set_fence(now + Duration::from_secs(60), now);
                    } else {
                        s.end_fence(now);
                    }
                    "fence"
                }
            };
            s.sync_touched(now);
            held_sums_agree(&mut s, now, &format!("seed {seed} step {step} ({what})"));
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_stop_for_want_of_room_is_written_with_its_reason_in_one_rule() {
    let t0 = Instant::now();
    let mut s = state(t0);
    s.insert(dep("k", "chat-k", "residency: restart_only\n", t0));
    for id in ["a", "b", "k"] {
        ready(&mut s, id, t0);
    }
    let later = t0 + Duration::from_secs(5);
    // A model that parks, stopped for room: the release says so from its beginning, and its
    // outcome is written whole by one call (state and status together).
    let r = s.begin_release("a", true, true).unwrap();
    assert!(r.for_room);
    assert_eq!(s.deps["a"].state, InstanceState::Stopping);
    s.down_done("a", DownDone::Stopped(Released::StoppedNoRoomToPark), later);
    let a = &s.deps["a"];
    assert_eq!((a.state, a.busy), (InstanceState::Stopped, false));
    assert_eq!(
        a.last_error,
        Some(Released::StoppedNoRoomToPark.status_line())
    );
    // A parked copy stopped for room: it would have stayed parked, so it is said too.
    s.deps.get_mut("b").unwrap().state = InstanceState::Parked;
    assert!(s.begin_release("b", true, true).unwrap().for_room);
    // A model that never parks (restart_only) is only stopped: room is not why.
    assert!(!s.begin_release("k", true, true).unwrap().for_room);
    s.down_done("k", DownDone::Stopped(Released::Stopped), later);
    assert_eq!(s.deps["k"].last_error, None);
    // An operator's stop is not for room.
    s.deps.get_mut("b").unwrap().busy = false;
    assert!(!s.begin_release("b", true, false).unwrap().for_room);
}

/// A record of requests given to the rules (the router's, in the server).
#[derive(Default)]
struct Record {
    last: HashMap<String, Instant>,
    running: HashMap<(String, u32), usize>,
}

impl Requests for Record {
    fn last_use(&self, dep: &str) -> Option<Instant> {
        self.last.get(dep).copied()
    }

    fn in_flight(&self, dep: &str, index: u32) -> usize {
        self.running
            .get(&(dep.to_string(), index))
            .copied()
            .unwrap_or(0)
    }
}

#[tokio::test(start_paused = true)]
async fn the_rules_read_the_record_of_requests_they_are_given() {
    let t0 = Instant::now();
    let now = t0 + Duration::from_secs(600);
    let timeouts = LifecycleDefaults {
        ready_idle_timeout: Some(Duration::from_secs(300)),
        ..LifecycleDefaults::default()
    };
    let mut s = state(t0);
    // `a` and `b` ready, last changed at t0 and a second later: by their state alone both
    // are due, and `a` is the longer idle.
    ready(&mut s, "a", t0);
    ready(&mut s, "b", t0 + Duration::from_secs(1));
    let none_recorded = s.idle_due(&timeouts, &none(), &NoRequests, now);
    assert_eq!(none_recorded, [("a".into(), true), ("b".into(), true)]);
    // The record says `b` was used 10 s ago: its timer is not due, now or when decided again.
    let mut record = Record::default();
    record
        .last
        .insert("b".into(), now - Duration::from_secs(10));
    assert_eq!(
        s.idle_due(&timeouts, &none(), &record, now),
        [("a".into(), true)]
    );
    assert_eq!(
        s.begin_idle_down("b", true, &timeouts, "idle-1", &record, now),
        None,
        "decided again on the record given"
    );
    // The record says `a` was used 10 s ago: a plan for `c` names `b` first, the longer idle
    // by the record; with no record, `a`.
    let mut record = Record::default();
    record
        .last
        .insert("a".into(), now - Duration::from_secs(10));
    let plan = s
        .plan("c", &none(), PlanFor::Requests, "sw-1".into(), &record, now)
        .unwrap();
    assert!(matches!(plan, Plan::Switch { .. }), "{plan:?}");
    assert_eq!(
        s.reservations["sw-1"].victims[0], "b",
        "the longest idle by the record"
    );
    s.release_reservation("sw-1");
    let plan = s.request_plan("c", "sw-2".into(), now).unwrap();
    assert!(matches!(plan, Plan::Switch { .. }), "{plan:?}");
    assert_eq!(s.reservations["sw-2"].victims[0], "a", "by the state alone");
}

/// DESIGN 4.10: a deployment is never parked or stopped for one of lower priority; among the
/// victims that may go, lower priorities go first (then the page's order); a request only
/// higher priorities keep out is refused at once (`does_not_fit` naming the priority), not
/// left waiting; a start that names no victims still waits; idle timers work as before.
#[tokio::test(start_paused = true)]
async fn priorities_choose_the_victims_and_protect_the_room() {
    let t0 = Instant::now();
    let now = t0 + Duration::from_secs(60);
    let mut s = state(t0);
    let victims = |plan: Plan| match plan {
        Plan::Switch { victims, .. } => victims
            .into_iter()
            .map(|k| k.deployment)
            .collect::<Vec<_>>(),
        other => panic!("a switch: {other:?}"),
    };
    // `p` (priority 100, idle the longest) and `q` (priority 0) hold 6 of 10 GiB: `b` needs
    // 6, so one must go. The page's order would take `p`; its priority keeps it.
    s.insert(sized_dep("p", "chat-p", "priority: 100\n", 3, t0));
    s.insert(sized_dep("q", "chat-q", "", 3, t0));
    ready(&mut s, "p", t0);
    ready(&mut s, "q", t0 + Duration::from_secs(30));
    let plan = s.request_plan("b", "sw-1".into(), now).unwrap();
    assert_eq!(
        victims(plan),
        ["q"],
        "the lower priority, though p is older"
    );
    s.release_reservation("sw-1");
    // With `q` protected (requests wait for it), `p` still never goes for `b`; `q` may free
    // its memory later, so `b` waits.
    let protected = BTreeSet::from(["q".to_string()]);
    let plan = s
        .plan(
            "b",
            &protected,
            PlanFor::Requests,
            "sw-2".into(),
            &NoRequests,
            now,
        )
        .unwrap();
    assert!(matches!(plan, Plan::Later), "{plan:?}");
    // A deployment of priority 100 (equal) may take `p`'s room, the lower `q` still first.
    s.deps.get_mut("b").unwrap().rec.doc = dep("b", "chat-b", "priority: 100\n", t0).rec.doc;
    let plan = s.request_plan("b", "sw-3".into(), now).unwrap();
    assert_eq!(victims(plan), ["q"]);
    s.release_reservation("sw-3");
    let plan = s
        .plan(
            "b",
            &protected,
            PlanFor::Requests,
            "sw-3b".into(),
            &NoRequests,
            now,
        )
        .unwrap();
    assert_eq!(victims(plan), ["p"], "equal priorities: p may go");
    s.release_reservation("sw-3b");

    // Only a higher priority holds the room: refused at once, naming it.
    let mut s = state(t0);
    s.insert(dep("prod", "chat-prod", "priority: 100\n", t0));
    ready(&mut s, "prod", t0);
    let err = s.request_plan("b", "sw-4".into(), now).unwrap_err();
    assert_eq!(err.code(), "does_not_fit", "{err:?}");
    assert_eq!(err.status(), 409);
    assert_eq!(
        err.message(),
        "deployment b does not fit on any GPU: it needs 6.0 GiB, and 6.0 GiB of the GPU's 10.0 GiB is held by deployments of a higher priority, which are never parked or stopped for a lower one (chat-prod: priority 100)"
    );
    assert!(s.reservations.is_empty() && s.deps["prod"].reserved.is_none());
    // A negative priority is below the default.
    s.deps.get_mut("prod").unwrap().rec.doc = dep("prod", "chat-prod", "", t0).rec.doc;
    s.deps.get_mut("b").unwrap().rec.doc = dep("b", "chat-b", "priority: -1\n", t0).rec.doc;
    let err = s.request_plan("b", "sw-6".into(), now).unwrap_err();
    assert!(err.to_string().contains("chat-prod: priority 0"), "{err}");
    // The higher priority takes the room of the lower one.
    s.deps.get_mut("b").unwrap().rec.doc = dep("b", "chat-b", "priority: 1\n", t0).rec.doc;
    let plan = s.request_plan("b", "sw-7".into(), now).unwrap();
    assert_eq!(victims(plan), ["prod"]);
    s.release_reservation("sw-7");

    // An operator's start without --evict names no victims: it waits for memory as before.
    s.deps.get_mut("prod").unwrap().rec.doc =
        dep("prod", "chat-prod", "priority: 100\n", t0).rec.doc;
    s.deps.get_mut("b").unwrap().rec.doc = dep("b", "chat-b", "", t0).rec.doc;
    assert!(matches!(
        s.start("b", false, false, now),
        Ok(StartNext::Pending)
    ));
    // The idle timer still parks `prod` when it is due.
    let timeouts = LifecycleDefaults {
        ready_idle_timeout: Some(Duration::from_secs(300)),
        parked_idle_timeout: None,
    };
    assert_eq!(
        s.idle_due(
            &timeouts,
            &none(),
            &NoRequests,
            t0 + Duration::from_secs(301)
        ),
        [("prod".to_string(), true)]
    );
}
