//! The local host agent over [`PodRuntime`]: the "engine Pod" is the real `engine-sim` binary
//! on a loopback port, and a scripted mock API server (the shared `capyctl_test_support::MockApi`) says the Pod
//! of the instance runs on `127.0.0.1`. The agent starts (waits for the Pod, then readiness and
//! the first answer), parks and wakes the engine over HTTP, and reports an exit when the Pod is
//! deleted.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use capyctl_node_agent::agent::AgentConfig;
use capyctl_node_agent::inventory::NoGpus;
use capyctl_node_agent::k8s::pods::PodRuntime;
use capyctl_node_agent::launch::launch_command;
use capyctl_node_agent::spec::{GpuOverride, HostSettings, InstanceSpec};
use capyctl_node_agent::tier::{LaunchParking, ParkTier};
use capyctl_node_agent::verify::WakeOutcome;
use capyctl_node_agent::{AgentError, HostAgent, LocalHostAgent};
use capyctl_spec::EngineKind;
use capyctl_test_support::{Exchange, MockApi};
use http::Method;
use serde_json::json;

const MIB: u64 = 1024 * 1024;

/// The engine Pods of namespace `capyctl`, as the runtime lists and watches them.
const PODS: &str = "/api/v1/namespaces/capyctl/pods";

fn settings() -> HostSettings {
    let bin = common::engine_sim_binary();
    let mut s = HostSettings::all_engines(vec![bin.to_string_lossy().into_owned()]);
    s.gpus = Some(vec![GpuOverride {
        memory: 80 * 1024 * MIB,
        unified: false,
        uuid: None,
    }]);
    s.host_memory = Some(1024 * MIB);
    s
}

fn spec() -> InstanceSpec {
    let mut s = InstanceSpec::new("01KPODS", "chat-a", EngineKind::Vllm, "Qwen3-4B");
    s.env
        .insert("ENGINE_SIM_WEIGHTS_BYTES".into(), "64MiB".into());
    s.resources.weights_memory = Some(64 * MIB);
    s
}

fn pod(port: u16) -> serde_json::Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": "chat-a-0-g1", "namespace": "capyctl", "uid": "uid-1", "resourceVersion": "7",
            "labels": {"capyctl.io/instance": "01KPODS-0", "capyctl.io/generation": "1"}
        },
        "spec": {"nodeName": "gpu-1", "containers": [
            {"name": "engine", "ports": [{"name": "http", "containerPort": port}]}
        ]},
        "status": {"phase": "Running", "podIP": "127.0.0.1"}
    })
}

#[tokio::test]
async fn the_agent_drives_the_engine_of_its_pod_and_reports_the_pod_going_away() {
    let dir = common::temp_dir("pods");
    // The "engine Pod": the simulator, launched as the operator's Pod would launch it.
    let port = capyctl_test_support::free_port();
    let settings = settings();
    let launch = launch_command(
        &spec(),
        settings.engine(EngineKind::Vllm),
        port,
        LaunchParking {
            may_park: true,
            host_ram: true,
        },
    )
    .unwrap();
    let mut engine = tokio::process::Command::new(&launch.program)
        .args(&launch.args)
        .envs(&launch.env)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();

    let (client, mut api) = MockApi::client("capyctl");
    let (delete_tx, delete_rx) = tokio::sync::oneshot::channel::<()>();
    let api_server = tokio::spawn(async move {
        let list = json!({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "10"}, "items": [pod(port)]});
        api.answer(Exchange::ok(Method::GET, PODS, list)).await;
        // The watch: the Pod's deletion once the test says so.
        delete_rx.await.unwrap();
        api.answer(Exchange::watch(PODS, &[("DELETED", pod(port))]))
            .await;
        // Later calls (the watcher's next watch) stay unanswered.
        let mut held = Vec::new();
        while let Some(call) = api.next_call().await {
            held.push(call);
        }
    });

    let runtime = PodRuntime::new(client, "capyctl", "gpu-1", &dir).unwrap();
    let mut config = AgentConfig::new(&dir);
    config.ready_timeout = Duration::from_secs(20);
    config.wake_window = Duration::from_secs(20);
    config.sample_interval = Duration::from_millis(100);
    let agent = LocalHostAgent::with_runtime(config, settings, Arc::new(NoGpus), Arc::new(runtime));
    assert_eq!(agent.runtime_name(), "pod");

    let started = agent.start("01KPODS-0", &spec()).await.unwrap();
    assert_eq!(started.base_url, format!("http://127.0.0.1:{port}"));
    assert_eq!(started.port, port);
    assert_eq!(started.pid, 0);
    assert_eq!(started.version.as_deref(), Some("0.32.0"));
    assert_eq!(
        agent.park("01KPODS-0").await.unwrap().tier(),
        Some(ParkTier::HostRam)
    );
    assert_eq!(
        agent.wake("01KPODS-0").await.unwrap().outcome,
        WakeOutcome::Pass
    );

    // The operator deletes the Pod: the agent reports the exit and forgets the instance.
    let mut exits = agent.subscribe_exits();
    delete_tx.send(()).unwrap();
    let exit = tokio::time::timeout(Duration::from_secs(10), exits.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(exit.instance, "01KPODS-0");
    assert_eq!(
        exit.status.as_deref(),
        Some("engine Pod capyctl/chat-a-0-g1 was deleted")
    );
    assert!(agent.sample("01KPODS-0").is_none());
    assert!(matches!(
        agent.stop("01KPODS-0").await,
        Err(AgentError::UnknownInstance { .. })
    ));

    api_server.abort();
    let _ = engine.kill().await;
    let _ = std::fs::remove_dir_all(dir);
}

/// Issue 16, item 5, in Pod mode: the engine Pod of a start never runs (an image that does not
/// pull, a Pod nobody schedules), so the start waits in the runtime's launch, up to the ready
/// timeout. A stop ends it at once: the stop answers, the start answers `cancelled`, nothing is
/// left, and the Pod is never taken again. (Before: the launch was not cut by a stop, which
/// waited for the start, here 1800 s.)
#[tokio::test]
async fn a_stop_ends_a_start_whose_pod_never_runs() {
    let dir = common::temp_dir("pods-pending");
    let mut pending = pod(8000);
    pending["status"] = json!({"phase": "Pending"});
    let (client, mut api) = MockApi::client("capyctl");
    let api_server = tokio::spawn(async move {
        let list = json!({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "10"}, "items": [pending]});
        api.answer(Exchange::ok(Method::GET, PODS, list)).await;
        // The watch stays open and says nothing: the Pod stays pending.
        let mut held = Vec::new();
        while let Some(call) = api.next_call().await {
            held.push(call);
        }
    });
    let runtime = PodRuntime::new(client, "capyctl", "gpu-1", &dir).unwrap();
    runtime.wait_synced(Duration::from_secs(10)).await.unwrap();
    let mut config = AgentConfig::new(&dir);
    config.ready_timeout = Duration::from_secs(1800);
    let agent = Arc::new(LocalHostAgent::with_runtime(
        config,
        settings(),
        Arc::new(NoGpus),
        Arc::new(runtime),
    ));

    let start = tokio::spawn({
        let agent = Arc::clone(&agent);
        async move { agent.start("01KPODS-0", &spec()).await }
    });
    // As the operator does: a stop that comes before the start has begun finds nothing, and
    // is asked again.
    let stopped = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match agent.stop("01KPODS-0").await {
                Err(AgentError::UnknownInstance { .. }) if !start.is_finished() => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                other => return other,
            }
        }
    })
    .await
    .expect("the stop answers while the Pod is pending");
    stopped.unwrap();
    let started = tokio::time::timeout(Duration::from_secs(5), start)
        .await
        .expect("the start has answered")
        .unwrap();
    match started {
        Err(AgentError::Cancelled { instance, what }) => {
            assert_eq!((instance.as_str(), what), ("01KPODS-0", "start"));
        }
        other => panic!("the start answered {other:?}"),
    }
    assert!(agent.sample("01KPODS-0").is_none());
    assert!(
        std::fs::read_dir(dir.join("engines"))
            .map(|d| d.count())
            .unwrap_or(0)
            == 0,
        "no record is left"
    );
    api_server.abort();
    let _ = std::fs::remove_dir_all(dir);
}
