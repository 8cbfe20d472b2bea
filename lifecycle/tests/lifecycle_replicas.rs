//! Replicas under tokio's paused clock (DESIGN 4.7): the real coordinator and lifecycle over the
//! in-memory simulated host, with two GPUs, whose starts and parks take set (virtual) times. A
//! deployment of two replicas comes up on both GPUs at once; another model's wave takes
//! one instance only, with no admission window (its deployment keeps the other), while the
//! deployment's own requests are admitted at once; instances name `<id>-<index>`. The
//! background runs (the idle timers, the scaler) go on after a run of theirs panics.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use capyctl_lifecycle::api::ManagementApi;
use capyctl_lifecycle::store::MemoryStore;
use capyctl_lifecycle::{Core, LifecycleConfig};
use capyctl_router::admission::{Admission, Permit};
use capyctl_router::config::RouterConfig;
use capyctl_router::coordinator::CoordinatorHandle;
use capyctl_server::assembly::assemble;
use capyctl_spec::InstanceState;
use capyctl_spec::api::{SwitchCause, SwitchOutcome, SwitchQuery, SwitchRecord};
use capyctl_spec::documents::parse_deployment_str;
use capyctl_test_support::{SimHost, Timings};
use tokio::time::Instant;

const START: Duration = Duration::from_secs(4);
const PARK: Duration = Duration::from_secs(1);
const WINDOW: Duration = Duration::from_secs(2);

struct Scene {
    server: Arc<Core>,
    router: CoordinatorHandle,
    store: Arc<MemoryStore>,
}

/// Two GPUs of 10 GiB; `r` (two replicas) and `b`, 6 GiB each: one instance per GPU.
async fn scene() -> Scene {
    scene_of(timed(), &[("r", "replicas: 2\n"), ("b", "")]).await
}

/// A simulated host of two 10 GiB GPUs whose operations take the set times.
fn timed() -> SimHost {
    SimHost::new().with_gpus(2).with_times(Timings {
        start: START,
        park_host_ram: PARK,
        // A wake of 2 s, then its check of 500 ms.
        wake_host_ram: Duration::from_millis(2_500),
        wake_check: Duration::from_millis(500),
        ..Timings::default()
    })
}

/// The lifecycle over `agent` with the router (the test's window), and `models` (name, more
/// lines) of 6 GiB deployed.
async fn scene_of(agent: impl Into<Arc<SimHost>>, models: &[(&str, &str)]) -> Scene {
    scene_with(agent, models, |_| {}).await
}

/// [`scene_of`] with `tweak` applied to the lifecycle's configuration.
async fn scene_with(
    agent: impl Into<Arc<SimHost>>,
    models: &[(&str, &str)],
    tweak: impl FnOnce(&mut LifecycleConfig),
) -> Scene {
    let mut lc = LifecycleConfig::new("h");
    lc.timer_tick = Duration::from_millis(100);
    tweak(&mut lc);
    let store = Arc::new(MemoryStore::default());
    let server = Core::open(agent.into(), store.clone(), lc).await.unwrap();
    let router = assemble(
        &server,
        server.clone(),
        RouterConfig {
            admission_window: WINDOW,
            drain_timeout: Duration::from_secs(30),
            request_deadline: Duration::from_secs(600),
            ..RouterConfig::default()
        },
        None,
    )
    .await
    .router;
    for (name, more) in models {
        let doc = parse_deployment_str(
            "t.yaml",
            &format!(
                "name: {name}\nengine: vllm\nmodel: m\nresources: {{gpu_memory: 6GiB}}\n{more}"
            ),
        )
        .unwrap();
        server.deploy(doc).await.unwrap();
    }
    Scene {
        server,
        router,
        store,
    }
}

/// `r` alone, two replicas, brought up by a request: both instances ready.
async fn two_ready() -> Scene {
    let s = scene_of(timed(), &[("r", "replicas: 2\n")]).await;
    s.request("r", Duration::ZERO).await.unwrap();
    s.until("both ready", |s| {
        s.states("r") == [InstanceState::Ready, InstanceState::Ready]
    })
    .await;
    s
}

impl Scene {
    /// Admits a request for `model` and holds it for `hold` (virtual time), in a task: how
    /// long it waited, and the index of the instance it ran on.
    fn request(&self, model: &str, hold: Duration) -> tokio::task::JoinHandle<(Duration, u32)> {
        let router = self.router.clone();
        let model = model.to_string();
        tokio::spawn(async move {
            let asked = Instant::now();
            let d = router.resolve(&model).unwrap();
            let permit = router
                .admit(d, Instant::now() + Duration::from_secs(600))
                .await
                .unwrap();
            let waited = asked.elapsed();
            let index = permit.upstream().key.index;
            tokio::time::sleep(hold).await;
            drop(permit);
            (waited, index)
        })
    }

    /// The states of `name`'s instances, by index.
    fn states(&self, name: &str) -> Vec<InstanceState> {
        let v = self.server.view(name).unwrap();
        v.instances.iter().map(|i| i.state).collect()
    }

    async fn until(&self, what: &str, pred: impl Fn(&Self) -> bool) {
        let give_up = Instant::now() + Duration::from_secs(120);
        while !pred(self) {
            assert!(Instant::now() < give_up, "never {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn records(&self) -> Vec<SwitchRecord> {
        self.server
            .switches(SwitchQuery::default())
            .await
            .unwrap()
            .switches
    }
}

#[tokio::test(start_paused = true)]
async fn a_wave_takes_one_instance_without_a_window_while_the_deployment_serves_on() {
    use InstanceState::{Parked, Ready, Stopped};
    let s = scene().await;
    assert_eq!(s.states("r"), [Stopped, Stopped]);
    assert_eq!(s.server.view("r").unwrap().ready, "0/2");

    // A request starts one instance (4 s); the scaler starts the other meanwhile, on the
    // other GPU, at its next tick (100 ms): both are ready within a tick of each other.
    let t0 = Instant::now();
    let (waited, _) = s.request("r", Duration::ZERO).await.unwrap();
    assert_eq!(waited, START);
    s.until("both instances ready", |s| s.states("r") == [Ready, Ready])
        .await;
    let both = t0.elapsed();
    assert!(
        both > START && both <= START + Duration::from_millis(200),
        "{both:?}"
    );
    let v = s.server.view("r").unwrap();
    assert_eq!(v.ready, "2/2");
    assert_eq!(
        v.instances
            .iter()
            .map(|i| i.instance_id.clone())
            .collect::<Vec<_>>(),
        [format!("{}-0", v.id), format!("{}-1", v.id)]
    );
    let up = s
        .records()
        .await
        .into_iter()
        .find(|r| r.cause == SwitchCause::Scale)
        .expect("the second instance's bring-up is a scale record");
    assert_eq!(up.instance, format!("{}-1", v.id));

    // r runs a long request on one instance; b's wave comes. Both GPUs hold r: the switch
    // takes one instance only (the idle one), with no admission window since r keeps the
    // other: b is ready after the park and the start alone.
    let long = s.request("r", Duration::from_secs(30));
    tokio::time::sleep(Duration::from_millis(10)).await;
    // A short request goes to the other instance (the least loaded) and ends just before the
    // wave: as a model's one instance, it would now keep a full window (2 s) from there.
    let (quick, on) = s.request("r", Duration::from_millis(10)).await.unwrap();
    assert_eq!(quick, Duration::ZERO);
    let t1 = Instant::now();
    let b = s.request("b", Duration::ZERO);
    // Meanwhile r's requests are admitted at once (its other instance serves).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (now_too, _) = s.request("r", Duration::ZERO).await.unwrap();
    assert_eq!(now_too, Duration::ZERO);
    let (b_waited, _) = b.await.unwrap();
    assert_eq!(b_waited, PARK + START, "no window: {:?}", t1.elapsed());
    let states = s.states("r");
    assert_eq!(
        states.iter().filter(|s| **s == Ready).count(),
        1,
        "{states:?}"
    );
    assert!(states.contains(&Parked), "{states:?}");
    assert_eq!(s.server.view("r").unwrap().ready, "1/2");
    let wave = s
        .records()
        .await
        .into_iter()
        .rev()
        .find(|r| r.cause == SwitchCause::Wave)
        .unwrap();
    assert_eq!(wave.outcome, SwitchOutcome::Ok, "{wave:?}");
    assert_eq!(wave.victims.len(), 1, "{wave:?}");
    assert_eq!(wave.victims[0].deployment, "r");
    assert_eq!(
        wave.victims[0].instance,
        format!("{}-{on}", v.id),
        "the idle instance is the victim, not the busy one"
    );
    let (long_waited, long_on) = long.await.unwrap();
    assert_eq!(long_waited, Duration::ZERO);
    assert_ne!(long_on, on, "the short request went to the other instance");
}

/// Two GPUs of 10 GiB, each holding one of `a`, `b`; waves for `c` and `d` (6 GiB each) come
/// together: the two switches (one on each GPU) run at the same time, so both models are
/// ready one park and one start after their waves (no window: `a` and `b` are idle), not one
/// switch after the other.
#[tokio::test(start_paused = true)]
async fn switches_on_different_gpus_run_at_the_same_time() {
    let s = scene_of(
        timed().with_gpu_uuid("GPU-t"),
        &[("a", ""), ("b", ""), ("c", ""), ("d", "")],
    )
    .await;
    for name in ["a", "b"] {
        s.request(name, Duration::ZERO).await.unwrap();
    }
    assert_eq!(s.states("a"), [InstanceState::Ready]);
    assert_eq!(s.states("b"), [InstanceState::Ready]);
    // Idle for longer than a window: they yield at once.
    tokio::time::sleep(WINDOW * 2).await;
    let (c, d) = (
        s.request("c", Duration::ZERO),
        s.request("d", Duration::ZERO),
    );
    let (c, d) = (c.await.unwrap().0, d.await.unwrap().0);
    assert_eq!((c, d), (PARK + START, PARK + START), "both at once");
    let waves: Vec<SwitchRecord> = s
        .records()
        .await
        .into_iter()
        .filter(|r| r.cause == SwitchCause::Wave)
        .collect();
    assert_eq!(waves.len(), 2, "{waves:?}");
    assert!(
        waves[0].began_ms.abs_diff(waves[1].began_ms) < 50,
        "{waves:?}"
    );
    let mut gpus: Vec<Vec<String>> = waves.iter().map(|r| r.gpus.clone()).collect();
    gpus.sort();
    assert_eq!(gpus, [vec!["GPU-t"], vec!["GPU-t-1"]], "on two GPUs");
}

/// `least_loaded` reads the engines' waiting counts: the lifecycle passes each ready
/// instance's latest sample to the router every tick, and requests go to the instance whose
/// engine has nothing waiting while the other's has ten.
#[tokio::test(start_paused = true)]
async fn requests_go_where_the_engines_have_nothing_waiting() {
    let agent = Arc::new(SimHost::new().with_gpus(2));
    let s = scene_of(agent.clone(), &[("r", "replicas: 2\n")]).await;
    s.request("r", Duration::ZERO).await.unwrap();
    s.until("both instances ready", |s| {
        s.states("r") == [InstanceState::Ready, InstanceState::Ready]
    })
    .await;
    let id = s.server.view("r").unwrap().id;
    // Instance 0's engine has ten requests waiting (requests sent to it directly, say).
    agent.set_engine_waiting(&format!("{id}-0"), 10);
    agent.set_engine_waiting(&format!("{id}-1"), 0);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let held: Vec<_> = (0..5)
        .map(|_| s.request("r", Duration::from_secs(5)))
        .collect();
    for h in held {
        let (waited, on) = h.await.unwrap();
        assert_eq!((waited, on), (Duration::ZERO, 1));
    }
}

/// `replicas` lowered from 2 to 1: the scaler stops the instance past it, and the instance is
/// then gone from the deployment (not left behind, stopped, under READY 1/1).
#[tokio::test(start_paused = true)]
async fn an_instance_past_a_lowered_replicas_is_stopped_and_gone() {
    use InstanceState::Ready;
    let s = two_ready().await;
    let doc = parse_deployment_str(
        "t.yaml",
        "name: r\nengine: vllm\nmodel: m\nresources: {gpu_memory: 6GiB}\nreplicas: 1\n",
    )
    .unwrap();
    s.server.deploy(doc).await.unwrap();
    s.until("one instance left", |s| s.states("r") == [Ready])
        .await;
    assert_eq!(s.server.view("r").unwrap().ready, "1/1");
}

/// An operator's park while the second instance is still starting (it came a tick after the
/// first): the ready one parks at once, the starting one once it is ready, and the scaler
/// does not wake either again (the deployment is not in use); a request then wakes it, and
/// the scaler brings up the other.
#[tokio::test(start_paused = true)]
async fn a_park_takes_an_instance_still_starting_and_the_scaler_leaves_it_parked() {
    use InstanceState::{Parked, Ready, Starting, Waking};
    let s = scene_of(timed(), &[("r", "replicas: 2\n")]).await;
    s.request("r", Duration::ZERO).await.unwrap();
    assert_eq!(s.states("r"), [Ready, Starting]);
    s.server.park("r").await.unwrap();
    s.until("both parked", |s| s.states("r") == [Parked, Parked])
        .await;
    // Parked, then one instance woken by a request whose wave is under way: as for one
    // instance, only a ready deployment parks (the one on its way is not left to come up
    // while the park says it is done).
    let woken = s.request("r", Duration::ZERO);
    s.until("one waking", |s| s.states("r").contains(&Waking))
        .await;
    let e = s.server.park("r").await.unwrap_err();
    assert_eq!(e.code(), "conflict", "{e:?}");
    assert!(
        e.message()
            .contains("is waking; only a ready deployment parks"),
        "{e:?}"
    );
    woken.await.unwrap();
    s.until("both ready again", |s| s.states("r") == [Ready, Ready])
        .await;
    s.server.park("r").await.unwrap();
    s.until("both parked again", |s| s.states("r") == [Parked, Parked])
        .await;
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert_eq!(s.states("r"), [Parked, Parked], "nothing woke them");
    s.request("r", Duration::ZERO).await.unwrap();
    s.until("both ready again", |s| s.states("r") == [Ready, Ready])
        .await;
}

/// `start --evict --wait` while instance 0 was taken as a victim and its sibling serves (with
/// `scale.min: 1` one instance is what a start wants): the start answers at once, the
/// deployment serving, instead of waiting for instance 0 forever.
#[tokio::test(start_paused = true)]
async fn a_waited_start_ends_when_a_sibling_serves_and_the_first_instance_is_parked() {
    use InstanceState::{Parked, Ready};
    let s = scene().await;
    s.request("r", Duration::ZERO).await.unwrap();
    s.until("both ready", |s| s.states("r") == [Ready, Ready])
        .await;
    // A short request (instance 0), then a long one (instance 1): b's wave takes the idle
    // instance 0.
    let short = s.request("r", Duration::from_millis(10));
    tokio::time::sleep(Duration::from_millis(1)).await;
    let _long = s.request("r", Duration::from_secs(600));
    short.await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    s.request("b", Duration::ZERO).await.unwrap();
    assert_eq!(s.states("r"), [Parked, Ready]);
    let doc = parse_deployment_str(
        "t.yaml",
        "name: r\nengine: vllm\nmodel: m\nresources: {gpu_memory: 6GiB}\nreplicas: 2\nscale: {min: 1, target_in_flight: 24, scale_down_delay: 600s}\n",
    )
    .unwrap();
    s.server.deploy(doc).await.unwrap();
    let started = tokio::time::timeout(
        Duration::from_secs(120),
        s.server.start(
            "r",
            capyctl_spec::api::StartRequest {
                evict: true,
                wait: true,
            },
        ),
    )
    .await;
    let receipt = started.expect("start --evict --wait answers").unwrap();
    assert_eq!(receipt.action, "start");
    assert_eq!(s.states("r"), [Parked, Ready]);
}

/// `stop` of a deployment with two ready instances, one running a long request: from the
/// stop on no instance admits a request (the other instance is closed with the first, not
/// after its drain): while the first drains a request gets 503 `unavailable` (the router's
/// answer for a deployment finishing its work, as for one instance), and once it is stopped
/// `deployment_stopped`; the running request ends.
#[tokio::test(start_paused = true)]
async fn after_a_stop_begins_no_instance_admits_a_request() {
    let s = two_ready().await;
    let long = s.request("r", Duration::from_secs(20));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let server = s.server.clone();
    let stop = tokio::spawn(async move { server.stop("r").await });
    tokio::time::sleep(Duration::from_secs(1)).await;
    let ask = || async {
        let d = s.router.resolve("r").unwrap();
        s.router
            .admit(d, Instant::now() + Duration::from_secs(600))
            .await
            .map(|p| p.upstream().key.index)
            .map_err(|e| (e.status(), e.code()))
    };
    assert_eq!(ask().await, Err((503, "unavailable")));
    long.await.unwrap();
    stop.await.unwrap().unwrap();
    assert_eq!(ask().await, Err((409, "deployment_stopped")));
}

/// The stored record of a deployment is its own (instance 0's), whatever instance changed: the
/// scaler's start of instance 1 (whose copy has no first answer yet) does not write over it.
#[tokio::test(start_paused = true)]
async fn an_instance_coming_up_does_not_write_over_the_deployments_record() {
    use InstanceState::{Ready, Starting};
    let scale = "replicas: 2\nscale: {min: 1, target_in_flight: 1, scale_down_delay: 600s}\n";
    let s = scene_of(timed(), &[("r", scale)]).await;
    s.request("r", Duration::ZERO).await.unwrap();
    let id = s.server.view("r").unwrap().id;
    let stored = || s.store.get(&id).unwrap();
    let before = stored();
    assert_eq!(before.generation, 1);
    assert!(before.first_answer.is_some(), "{before:?}");
    // Two requests in flight on one instance, past the target of 1: the scaler starts the second.
    let _a = s.request("r", Duration::from_secs(60));
    let _b = s.request("r", Duration::from_secs(60));
    s.until("the second instance starting", |s| {
        s.states("r").get(1) == Some(&Starting)
    })
    .await;
    assert_eq!(stored(), before);
    s.until("both ready", |s| s.states("r") == [Ready, Ready])
        .await;
    assert_eq!(stored(), before);
}

/// An operator's park of two ready instances where one does not park (its drain passes the
/// router's bound, 30 s here, and it serves again): the deployment is in use on that
/// instance, so the scaler brings the parked sibling back (`replicas: 2`, no `scale`: both
/// run while it is in use).
#[tokio::test(start_paused = true)]
async fn a_park_that_does_not_take_leaves_the_deployment_to_the_scaler() {
    use InstanceState::{Parked, Parking, Ready};
    let s = two_ready().await;
    // A request longer than the drain bound on one instance.
    let _long = s.request("r", Duration::from_secs(600));
    tokio::time::sleep(Duration::from_millis(10)).await;
    s.server.park("r").await.unwrap();
    // The idle one parks; the busy one drains (parking).
    tokio::time::sleep(Duration::from_secs(20)).await;
    let mut st = s.states("r");
    st.sort_by_key(|s| *s == Parked);
    assert_eq!(st, [Parking, Parked]);
    // Its drain passes the bound (30 s): it serves on, and the scaler wakes its sibling.
    s.until("the parked instance back", |s| {
        s.states("r") == [Ready, Ready]
    })
    .await;
    for _ in 0..5 {
        let (waited, _) = s.request("r", Duration::from_secs(1)).await.unwrap();
        assert_eq!(waited, Duration::ZERO);
    }
}

#[tokio::test(start_paused = true)]
async fn idle_instances_are_parked_in_turn_and_the_scaler_leaves_them_until_a_request() {
    use InstanceState::{Parked, Ready, Stopped};
    const IDLE: Duration = Duration::from_secs(30);
    let s = scene_with(timed(), &[("r", "replicas: 2\n"), ("b", "")], |lc| {
        lc.lifecycle_defaults.ready_idle_timeout = Some(IDLE);
    })
    .await;
    // b takes one GPU, r's first instance the other; its second has no room yet.
    s.request("b", Duration::ZERO).await.unwrap();
    s.request("r", Duration::ZERO).await.unwrap();
    assert_eq!(s.states("r"), [Ready, Stopped]);
    // b stops 10 s later: the scaler starts r's second instance there, ready 14 s after the
    // first (their idle times are 14 s apart).
    tokio::time::sleep(Duration::from_secs(10)).await;
    s.server.stop("b").await.unwrap();
    s.until("both instances ready", |s| s.states("r") == [Ready, Ready])
        .await;
    let scaled = |records: &[SwitchRecord]| {
        records
            .iter()
            .filter(|r| r.cause == SwitchCause::Scale)
            .count()
    };
    let before = scaled(&s.records().await);

    // Idle for the timeout: the timer parks each instance when its own time comes, and the
    // scaler wakes neither (the deployment is not in use: the other instance being ready
    // does not make it so).
    s.until("the first instance parked", |s| {
        s.states("r") == [Parked, Ready]
    })
    .await;
    s.until("both instances parked", |s| {
        s.states("r") == [Parked, Parked]
    })
    .await;
    tokio::time::sleep(IDLE * 10).await;
    assert_eq!(s.states("r"), [Parked, Parked]);
    let records = s.records().await;
    assert_eq!(scaled(&records), before, "no instance was brought back");
    assert_eq!(
        records
            .iter()
            .filter(|r| r.cause == SwitchCause::Idle)
            .count(),
        2
    );

    // A request wakes one; the deployment is in use, so the scaler wakes the other.
    s.request("r", Duration::ZERO).await.unwrap();
    s.until("both instances ready again", |s| {
        s.states("r") == [Ready, Ready]
    })
    .await;
    assert_eq!(scaled(&s.records().await), before + 1);
}

/// A hook that panics the first time it is called (a bug in a host agent, say), and counts
/// its calls.
fn panics_once() -> (Arc<AtomicUsize>, impl Fn() + Send + Sync + 'static) {
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    (calls, move || {
        if c.fetch_add(1, Ordering::SeqCst) == 0 {
            panic!("a bug: the first call panics");
        }
    })
}

/// Waits (virtual time) until `calls` counts one at least: the run that panicked happened.
async fn until_called(calls: &AtomicUsize, what: &str) {
    let give_up = Instant::now() + Duration::from_secs(60);
    while calls.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < give_up, "{what} was never called");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A run of the idle timers that panics (here in the host agent's inventory, asked before a
/// park) does not stop them: a later tick parks the idle model.
#[tokio::test(start_paused = true)]
async fn the_idle_timers_run_again_after_a_run_that_panicked() {
    use InstanceState::{Parked, Ready};
    let agent = Arc::new(timed());
    let s = scene_with(agent.clone(), &[("b", "")], |lc| {
        lc.lifecycle_defaults.ready_idle_timeout = Some(Duration::from_secs(5));
    })
    .await;
    s.request("b", Duration::ZERO).await.unwrap();
    assert_eq!(s.states("b"), [Ready]);
    let (calls, hook) = panics_once();
    agent.on_inventory(hook);
    // The views ask the inventory too: none is read until the timers' run has panicked.
    until_called(&calls, "the inventory (by the idle timers)").await;
    s.until("b parked by a later run of the idle timers", |s| {
        s.states("b") == [Parked]
    })
    .await;
}

/// A run of the scaler that panics (here in the host agent's sample of an engine's load) does
/// not stop it: a later run brings up a second instance for the load.
#[tokio::test(start_paused = true)]
async fn the_scaler_runs_again_after_a_run_that_panicked() {
    use InstanceState::Ready;
    let agent = Arc::new(timed());
    let scale = "replicas: 2\nscale: {min: 1, target_in_flight: 1, scale_down_delay: 600s}\n";
    let s = scene_of(agent.clone(), &[("r", scale)]).await;
    s.request("r", Duration::ZERO).await.unwrap();
    assert_eq!(s.states("r"), [Ready, InstanceState::Stopped]);
    let (calls, hook) = panics_once();
    agent.on_sample(move |_| hook());
    // The views sample the engines too: none is read until the scaler's run has panicked.
    until_called(&calls, "the sample (by the scaler)").await;
    // Two requests in flight on one instance, past the target of 1.
    let _a = s.request("r", Duration::from_secs(60));
    let _b = s.request("r", Duration::from_secs(60));
    s.until(
        "a second instance brought up by a later run of the scaler",
        |s| s.states("r") == [Ready, Ready],
    )
    .await;
}
