//! Switch records (DESIGN 4.8) under tokio's paused clock: the real coordinator and lifecycle
//! over the in-memory simulated host, whose starts, parks and wakes take set (virtual) times, so that
//! every phase's instants are exact. Plus the records kept across a restart.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use capyctl_lifecycle::api::ManagementApi;
use capyctl_lifecycle::metrics::Metrics;
use capyctl_lifecycle::store::MemoryStore;
use capyctl_lifecycle::switches::{KEEP, SwitchLog, Target};
use capyctl_lifecycle::{Core, LifecycleConfig};
use capyctl_router::admission::Admission;
use capyctl_router::config::RouterConfig;
use capyctl_router::coordinator::{CoordinatorHandle, CoordinatorPermit};
use capyctl_server::assembly::assemble;
use capyctl_spec::InstanceState;
use capyctl_spec::api::{
    StartRequest, SwitchCause, SwitchError, SwitchOutcome, SwitchPhaseKind, SwitchQuery,
    SwitchRecord, VictimAction, VictimResult,
};
use capyctl_spec::documents::{DeploymentDoc, parse_deployment_str};
use capyctl_spec::errors::ApiError;
use capyctl_spec::settings::LifecycleDefaults;
use capyctl_test_support::{SimHost, Timings};
use tokio::time::Instant;

const START: Duration = Duration::from_secs(4);
const PARK: Duration = Duration::from_secs(1);
const WAKE: Duration = Duration::from_secs(2);
const CHECK: Duration = Duration::from_millis(500);
const WINDOW: Duration = Duration::from_millis(500);

/// Two of these do not fit the simulated host's 10 GiB GPU together.
fn doc(name: &str) -> DeploymentDoc {
    parse_deployment_str(
        "t.yaml",
        &format!("name: {name}\nengine: vllm\nmodel: m\nresources: {{gpu_memory: 6GiB}}\n"),
    )
    .unwrap()
}

struct Scene {
    server: Arc<Core>,
    router: CoordinatorHandle,
    agent: Arc<SimHost>,
}

async fn scene(drain_timeout: Duration, defaults: LifecycleDefaults) -> Scene {
    let agent = Arc::new(
        SimHost::new()
            .with_gpu_uuid("GPU-0f1e")
            .with_times(Timings {
                start: START,
                park_host_ram: PARK,
                wake_host_ram: WAKE + CHECK,
                wake_check: CHECK,
                ..Timings::default()
            }),
    );
    let mut lc = LifecycleConfig::new("h");
    lc.lifecycle_defaults = defaults;
    lc.timer_tick = Duration::from_millis(100);
    let server = Core::open(agent.clone(), Arc::new(MemoryStore::default()), lc)
        .await
        .unwrap();
    let router = assemble(
        &server,
        server.clone(),
        RouterConfig {
            admission_window: WINDOW,
            drain_timeout,
            request_deadline: Duration::from_secs(600),
            ..RouterConfig::default()
        },
        None,
    )
    .await
    .router;
    for name in ["a", "b"] {
        server.deploy(doc(name)).await.unwrap();
    }
    Scene {
        server,
        router,
        agent,
    }
}

impl Scene {
    /// A request for `model`, admitted (it runs while the permit is held).
    async fn request(&self, model: &str) -> Result<CoordinatorPermit, ApiError> {
        let d = self.router.resolve(model).unwrap();
        self.router
            .admit(d, Instant::now() + Duration::from_secs(600))
            .await
    }

    /// A request for `model` in a task of its own: its answer (the permit let go at once).
    fn request_later(&self, model: &str) -> tokio::task::JoinHandle<Result<(), ApiError>> {
        let router = self.router.clone();
        let model = model.to_string();
        tokio::spawn(async move {
            let d = router.resolve(&model).unwrap();
            router
                .admit(d, Instant::now() + Duration::from_secs(600))
                .await
                .map(drop)
        })
    }

    async fn records(&self) -> Vec<SwitchRecord> {
        self.server
            .switches(SwitchQuery::default())
            .await
            .unwrap()
            .switches
    }

    /// The record of the switch to `deployment` of cause `cause` (the last one), once ended.
    async fn ended(&self, deployment: &str, cause: SwitchCause) -> SwitchRecord {
        loop {
            let found = self.records().await.into_iter().rev().find(|r| {
                r.deployment == deployment
                    && r.cause == cause
                    && r.outcome != SwitchOutcome::InProgress
            });
            if let Some(r) = found {
                return r;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// The phases as (kind, began, ended) in milliseconds from the record's begin.
fn phases(r: &SwitchRecord) -> Vec<(SwitchPhaseKind, u64, u64)> {
    r.phases
        .iter()
        .map(|p| {
            (
                p.phase,
                p.began_ms - r.began_ms,
                p.ended_ms.expect("ended") - r.began_ms,
            )
        })
        .collect()
}

/// `got` equals `want` within 1 ms on each instant (milliseconds are truncated).
fn assert_phases(got: &[(SwitchPhaseKind, u64, u64)], want: &[(SwitchPhaseKind, u64, u64)]) {
    let close = |a: u64, b: u64| a.abs_diff(b) <= 1;
    assert!(
        got.len() == want.len()
            && got
                .iter()
                .zip(want)
                .all(|(g, w)| g.0 == w.0 && close(g.1, w.1) && close(g.2, w.2)),
        "phases {got:?}, expected {want:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_waves_switch_records_each_phase_at_its_instant() {
    use SwitchPhaseKind::*;
    let s = scene(Duration::from_secs(10), LifecycleDefaults::default()).await;
    // b starts cold (a bring-up), then an operator parks it (a release).
    drop(s.request("b").await.unwrap());
    let up = s.ended("b", SwitchCause::BringUp).await;
    assert_eq!(up.outcome, SwitchOutcome::Ok, "{up:?}");
    assert!(up.victims.is_empty(), "{up:?}");
    assert_eq!(up.wave, 1);
    assert_phases(&phases(&up), &[(Start, 0, 4000), (Release, 4000, 4000)]);
    s.server.park("b").await.unwrap();
    let parked = s.ended("b", SwitchCause::Release).await;
    assert_eq!(parked.outcome, SwitchOutcome::Ok, "{parked:?}");
    assert_eq!(
        parked.phases.iter().map(|p| p.phase).collect::<Vec<_>>(),
        [Drain, Park]
    );
    assert_eq!(parked.victims.len(), 1);
    assert_eq!(parked.victims[0].deployment, "b");
    assert_eq!(parked.victims[0].result, VictimResult::Parked);

    // a runs a request while b's wave comes: the window is its full length, the drain lasts
    // until a's request ends (700 ms after the switch began), then a parks and b wakes.
    let running = s.request("a").await.unwrap();
    let t0 = Instant::now();
    let waiting = s.request_later("b");
    // Shown while it runs: its window, then its drain, still open.
    let live = |phase: SwitchPhaseKind| {
        let s = &s;
        async move {
            let r = s.records().await.pop().unwrap();
            assert_eq!(
                (r.deployment.as_str(), r.cause, r.outcome, r.ended_ms),
                ("b", SwitchCause::Wave, SwitchOutcome::InProgress, None),
                "{r:?}"
            );
            let last = r.phases.last().unwrap();
            assert_eq!((last.phase, last.ended_ms), (phase, None), "{r:?}");
        }
    };
    tokio::time::sleep_until(t0 + Duration::from_millis(300)).await;
    live(AdmissionWindow).await;
    tokio::time::sleep_until(t0 + Duration::from_millis(600)).await;
    live(Drain).await;
    tokio::time::sleep_until(t0 + Duration::from_millis(700)).await;
    drop(running);
    waiting.await.unwrap().unwrap();
    let served = t0.elapsed();
    let r = s.ended("b", SwitchCause::Wave).await;
    assert_eq!(r.outcome, SwitchOutcome::Ok, "{r:?}");
    assert_eq!(r.error, None);
    assert_eq!(r.wave, 1);
    assert_eq!(r.host_id, "h");
    assert_eq!(r.gpus, ["GPU-0f1e"]);
    assert_eq!(r.instance, format!("{}-0", r.deployment_id));
    assert_phases(
        &phases(&r),
        &[
            (AdmissionWindow, 0, 500),
            (Drain, 500, 700),
            (Park, 700, 1700),
            (Wake, 1700, 3700),
            (WakeCheck, 3700, 4200),
            (Release, 4200, 4200),
        ],
    );
    assert_eq!(r.ended_ms.unwrap() - r.began_ms, 4200);
    assert_eq!(served, Duration::from_millis(4200));
    let a_id = s.server.get("a").await.unwrap().id;
    assert_eq!(
        r.phases[2].instance,
        format!("{a_id}-0"),
        "park is the victim's"
    );
    assert_eq!(r.phases[3].instance, r.instance, "wake is the target's");
    assert_eq!(r.victims.len(), 1);
    let v = &r.victims[0];
    assert_eq!(
        (v.deployment.as_str(), v.action, v.result),
        ("a", VictimAction::Park, VictimResult::Parked)
    );
    // Oldest first, numbered one by one; `after` pages; `deployment` filters.
    let all = s.records().await;
    let seqs: Vec<u64> = all.iter().map(|r| r.seq).collect();
    let first = seqs[0];
    assert_eq!(seqs, (first..first + seqs.len() as u64).collect::<Vec<_>>());
    let page = s
        .server
        .switches(SwitchQuery {
            after: Some(first),
            limit: Some(1),
            ..SwitchQuery::default()
        })
        .await
        .unwrap();
    assert_eq!(page.switches.len(), 1);
    assert_eq!(page.switches[0].seq, first + 1);
    assert_eq!(page.next, first + 1);
    let only_a = s
        .server
        .switches(SwitchQuery {
            deployment: Some("a".into()),
            ..SwitchQuery::default()
        })
        .await
        .unwrap();
    assert!(only_a.switches.iter().all(|r| r.deployment == "a"));
    assert_eq!(only_a.switches.len(), 1, "a's cold start: {only_a:?}");
    let none = s
        .server
        .switches(SwitchQuery {
            after: Some(seqs[seqs.len() - 1]),
            ..SwitchQuery::default()
        })
        .await
        .unwrap();
    assert!(none.switches.is_empty());
    assert_eq!(none.next, seqs[seqs.len() - 1]);
}

#[tokio::test(start_paused = true)]
async fn an_operators_start_evict_has_no_admission_window() {
    use SwitchPhaseKind::*;
    let s = scene(Duration::from_secs(10), LifecycleDefaults::default()).await;
    drop(s.request("a").await.unwrap());
    s.ended("a", SwitchCause::BringUp).await;
    s.server
        .start(
            "b",
            StartRequest {
                evict: true,
                wait: true,
            },
        )
        .await
        .unwrap();
    let r = s.ended("b", SwitchCause::Operator).await;
    assert_eq!(r.outcome, SwitchOutcome::Ok, "{r:?}");
    assert_eq!(r.wave, 0);
    assert_phases(
        &phases(&r),
        &[
            (Drain, 0, 0),
            (Park, 0, 1000),
            (Start, 1000, 5000),
            (Release, 5000, 5000),
        ],
    );
    assert_eq!(r.victims[0].deployment, "a");
    assert_eq!(r.victims[0].result, VictimResult::Parked);
}

#[tokio::test(start_paused = true)]
async fn a_drain_timeout_is_a_failed_record_with_its_code() {
    use SwitchPhaseKind::*;
    let s = scene(Duration::from_secs(2), LifecycleDefaults::default()).await;
    let running = s.request("a").await.unwrap();
    let e = s.request("b").await.err().unwrap();
    assert_eq!(e.metric_label(), "drain_timeout", "{e:?}");
    let r = s.ended("b", SwitchCause::Wave).await;
    assert_eq!(r.outcome, SwitchOutcome::Failed, "{r:?}");
    let error = r.error.clone().unwrap();
    assert_eq!(error.code, "drain_timeout");
    assert_eq!(error.message, e.message());
    assert_phases(
        &phases(&r),
        &[(AdmissionWindow, 0, 500), (Drain, 500, 2500)],
    );
    assert_eq!(r.ended_ms.unwrap() - r.began_ms, 2500);
    assert_eq!(r.victims.len(), 1);
    assert_eq!(r.victims[0].result, VictimResult::Kept);
    drop(running);
    // Nothing was parked or woken for it.
    assert!(
        !s.agent.calls().iter().any(|c| c.starts_with("park")),
        "{:?}",
        s.agent.calls()
    );
}

#[tokio::test(start_paused = true)]
async fn an_idle_timers_park_is_an_idle_record() {
    use SwitchPhaseKind::*;
    let s = scene(
        Duration::from_secs(10),
        LifecycleDefaults {
            ready_idle_timeout: Some(Duration::from_secs(5)),
            parked_idle_timeout: None,
        },
    )
    .await;
    drop(s.request("a").await.unwrap());
    let r = s.ended("a", SwitchCause::Idle).await;
    assert_eq!(r.outcome, SwitchOutcome::Ok, "{r:?}");
    assert_eq!(
        r.phases.iter().map(|p| p.phase).collect::<Vec<_>>(),
        [Drain, Park]
    );
    let park = &r.phases[1];
    assert_eq!(park.ended_ms.unwrap() - park.began_ms, 1000);
    assert_eq!(r.victims[0].result, VictimResult::Parked);
    assert_eq!(r.wave, 0);
}

fn target(i: u64) -> Target {
    Target {
        switch_id: format!("sw-{i}"),
        deployment: "chat".into(),
        deployment_id: "01KCHAT".into(),
        instance: "01KCHAT-0".into(),
        host_id: "h".into(),
        gpus: vec!["GPU-0f1e".into()],
        engine: "vllm",
        wave: 2,
    }
}

/// Kept across restarts: a bounded ring (the newest [`KEEP`] of 1,100 come back, and after
/// many more the file was compacted), a record in progress comes back interrupted, a torn
/// last line is skipped, and numbering goes on.
#[test]
fn records_survive_a_restart_bounded_and_an_interrupted_one_says_so() {
    let dir = capyctl_test_support::temp_dir("switch-records");
    let path = dir.join(capyctl_lifecycle::switches::FILE);
    let metrics = Arc::new(Metrics::new());
    {
        let log = Arc::new(SwitchLog::open(&path, metrics.clone()).unwrap());
        for i in 0..1100 {
            let at = Instant::now();
            let rec = log.begin(target(i), SwitchCause::Wave, at);
            rec.phase(SwitchPhaseKind::Wake, "01KCHAT-0", "vllm", at, at);
            rec.finish(Ok(()), at);
        }
        // One in progress when the server "dies".
        let at = Instant::now();
        let rec = log.begin(target(1100), SwitchCause::Operator, at);
        rec.begin_phase(SwitchPhaseKind::Park, "01KOTHER-0", "vllm", at);
        log.flush();
    }
    // A write cut short.
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(b"{\"seq\":99999,\"switch_").unwrap();
    }
    let log = Arc::new(SwitchLog::open(&path, metrics.clone()).unwrap());
    let all = log.list(&SwitchQuery::default()).switches;
    assert_eq!(all.len(), KEEP);
    assert_eq!(all[0].seq, 102);
    let last = all.last().unwrap();
    assert_eq!(last.seq, 1101);
    assert_eq!(last.switch_id, "sw-1100");
    assert_eq!(last.outcome, SwitchOutcome::Failed);
    let error = last.error.clone().unwrap();
    assert_eq!(
        (error.code.as_str(), error.message.as_str()),
        ("interrupted", "the server stopped during this switch")
    );
    assert!(last.ended_ms.is_some());
    assert!(last.phases.iter().all(|p| p.ended_ms.is_some()));
    assert!(
        all[..KEEP - 1]
            .iter()
            .all(|r| r.outcome == SwitchOutcome::Ok && r.phases.len() == 1)
    );
    // Numbering goes on; the file stays bounded however many come.
    for i in 0..3000 {
        let at = Instant::now();
        log.begin(target(2000 + i), SwitchCause::Idle, at)
            .finish(Ok(()), at);
    }
    log.flush();
    let lines = std::fs::read_to_string(&path).unwrap().lines().count();
    assert!(lines <= 4 * KEEP + 100, "{lines} lines");
    drop(log);
    let log = SwitchLog::open(&path, metrics).unwrap();
    let all = log.list(&SwitchQuery::default()).switches;
    assert_eq!(all.len(), KEEP);
    assert_eq!(all.last().unwrap().seq, 1101 + 3000);
    assert_eq!(all[0].seq, 1101 + 3000 - KEEP as u64 + 1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A request for `model` with its own `deadline`: how long it waited, and its answer.
async fn request_within(
    s: &Scene,
    model: &str,
    deadline: Duration,
) -> (Duration, Result<CoordinatorPermit, ApiError>) {
    let asked = Instant::now();
    let d = s.router.resolve(model).unwrap();
    let answer = s.router.admit(d, asked + deadline).await;
    (asked.elapsed(), answer)
}

/// A start that hangs, that no request waits for any more and no operator asked for, is a
/// victim like an idle model: a request for another model that needs the GPU ends it (its
/// engine is stopped, as a stop ends a start) and is served, without an operator.
#[tokio::test(start_paused = true)]
async fn a_hanging_start_nobody_waits_for_is_a_victim_of_another_models_request() {
    let s = scene(Duration::from_secs(30), LifecycleDefaults::default()).await;
    s.agent.hang("a");
    // a's request gives up after its deadline; its start goes on hanging.
    let (_, gave_up) = request_within(&s, "a", Duration::from_secs(20)).await;
    assert_eq!(gave_up.unwrap_err().code(), "unavailable");
    let a = s.server.get("a").await.unwrap();
    assert_eq!(a.state, InstanceState::Starting);

    let (waited, served) = request_within(&s, "b", Duration::from_secs(300)).await;
    served.unwrap();
    assert!(
        waited <= START + Duration::from_secs(1),
        "b waited {waited:?}"
    );
    assert_eq!(
        s.server.get("a").await.unwrap().state,
        InstanceState::Stopped
    );
    let a_iid = format!("{}-0", a.id);
    assert!(
        s.agent.calls().contains(&format!("stop {a_iid}")),
        "{:?}",
        s.agent.calls()
    );
    // b's switch (a bring-up: its victim was not ready, so the router drained nothing).
    let r = s.ended("b", SwitchCause::BringUp).await;
    assert_eq!(r.outcome, SwitchOutcome::Ok, "{r:?}");
    assert_eq!(r.victims.len(), 1, "{r:?}");
    assert_eq!(r.victims[0].deployment, "a");
    assert_eq!(r.victims[0].result, VictimResult::Stopped);
}

/// An operator's start that hangs is what the operator asked for: another model's requests
/// never end it (they wait, and get their deadline's 503); the operator's `stop` or
/// `start --evict` does.
#[tokio::test(start_paused = true)]
async fn an_operators_hanging_start_is_never_a_requests_victim() {
    let s = scene(Duration::from_secs(30), LifecycleDefaults::default()).await;
    s.agent.hang("a");
    s.server.start("a", StartRequest::default()).await.unwrap();
    let (waited, refused) = request_within(&s, "b", Duration::from_secs(20)).await;
    assert_eq!(refused.unwrap_err().code(), "unavailable");
    assert_eq!(waited, Duration::from_secs(20));
    assert_eq!(
        s.server.get("a").await.unwrap().state,
        InstanceState::Starting
    );
}

/// A deployment of `gib` GiB.
fn sized(name: &str, gib: u64) -> DeploymentDoc {
    parse_deployment_str(
        "t.yaml",
        &format!("name: {name}\nengine: vllm\nmodel: m\nresources: {{gpu_memory: {gib}GiB}}\n"),
    )
    .unwrap()
}

/// A start in progress that no request waits for is a victim of another model's switch, ended
/// if it is still starting when the switch is carried out. One whose start ended meanwhile
/// serves, and is drained then; when that drain times out (it runs a request), it still holds
/// its memory, so the switch fails as a drain timeout fails one (the loaded model keeps
/// serving, the waiting requests get the retryable error) and the target is not brought up
/// beside it. (The soak, CI, seed 20261205: `soak-d`, 10 GiB, started beside the second
/// instance of `soak-e`, 3 GiB, on the 12 GiB GPU.)
#[tokio::test(start_paused = true)]
async fn a_victim_ready_since_the_plan_that_cannot_be_drained_keeps_the_target_off_its_memory() {
    let s = scene(Duration::from_secs(2), LifecycleDefaults::default()).await;
    for (name, gib) in [("c", 4), ("e", 4), ("t", 8)] {
        s.server.deploy(sized(name, gib)).await.unwrap();
    }
    drop(s.request("c").await.unwrap());
    // e's start (4 s) goes on after its request gave up (1 s).
    let began = Instant::now();
    let (_, gave_up) = request_within(&s, "e", Duration::from_secs(1)).await;
    assert_eq!(gave_up.unwrap_err().code(), "unavailable");
    // t (8 GiB) needs the memory of both c and e: planned while e starts, its window (500 ms)
    // ends after e's start has. c was just used, so the window runs its whole length (a
    // victim idle for longer closes it at once: then, when the switch ended e's start before
    // parking c, which it does when e's ID sorts first, e's request was refused).
    tokio::time::sleep_until(began + START - Duration::from_millis(300)).await;
    drop(s.request("c").await.unwrap());
    let t = s.request_later("t");
    // A request for e that e serves from the end of its start, through t's drain of it.
    tokio::time::sleep_until(began + START - Duration::from_millis(200)).await;
    let running = s.request("e").await.unwrap();
    assert_eq!(Instant::now(), began + START);
    let refused = t.await.unwrap().unwrap_err();
    assert_eq!(refused.metric_label(), "drain_timeout", "{refused:?}");
    assert!(
        refused.message().contains("the victims serve again"),
        "{}",
        refused.message()
    );
    // Its record: failed as a drain timeout; e, not released, with its own error's code.
    let r = s.ended("t", SwitchCause::Wave).await;
    let code = |e: &Option<SwitchError>| e.as_ref().map(|e| e.code.clone());
    assert_eq!(code(&r.error).as_deref(), Some("drain_timeout"), "{r:?}");
    let kept = r.victims.iter().find(|v| v.deployment == "e").unwrap();
    assert_eq!(kept.result, VictimResult::Failed, "{r:?}");
    assert_eq!(code(&kept.error).as_deref(), Some("drain_timeout"), "{r:?}");
    let e = s.server.get("e").await.unwrap();
    assert_eq!(e.state, InstanceState::Ready);
    let t_id = s.server.get("t").await.unwrap().id;
    assert!(
        !s.agent.calls().contains(&format!("start {t_id}-0")),
        "t was started beside e: {:?}",
        s.agent.calls()
    );
    drop(running);
    // Once e is idle, t's next request switches as usual.
    drop(s.request("t").await.unwrap());
    assert_eq!(
        s.server.get("e").await.unwrap().state,
        InstanceState::Parked
    );
}
