//! The lifecycle over several hosts (a Kubernetes cluster's GPU nodes): placement chooses a
//! host, a parked model wakes where its copy is, switches take victims on the host where the
//! room is needed, and a restart adopts each engine on its own host. Real engines (the
//! simulator) behind one in-process host agent per host.
#![allow(clippy::unwrap_used)]

use capyctl_test_support::harness as support;

use capyctl_lifecycle::HostEntry;
use capyctl_lifecycle::api::ManagementApi;
use capyctl_node_agent::HostAgent;
use capyctl_spec::InstanceState;
use support::{Harness, Opts, doc, temp_dir};

/// The host each deployment's instance is on.
async fn host_of(h: &Harness, name: &str) -> String {
    let v = h.server.get(name).await.unwrap();
    assert_eq!(v.hosts.len(), 1, "{name}: {:?}", v.hosts);
    assert_eq!(v.instances[0].host_id, v.hosts[0]);
    v.hosts[0].clone()
}

async fn state(h: &Harness, name: &str) -> InstanceState {
    h.server.get(name).await.unwrap().state
}

#[tokio::test]
async fn placement_spreads_models_over_hosts_and_switches_where_the_room_is() {
    let dir = temp_dir("hosts");
    // Each host's GPU (10 GiB) holds one 6 GiB model.
    let h = Harness::with_hosts(&dir, Opts::default(), &["gpu-a", "gpu-b"]).await;
    h.server.deploy(doc("chat-a", "")).await.unwrap();
    // chat-b is smaller: where it runs, chat-a would need fewer victim bytes.
    let b = capyctl_spec::documents::parse_deployment_str(
        "chat-b.yaml",
        "name: chat-b\nengine: vllm\nmodel: Qwen3-4B\nresources: {gpu_memory: 5GiB, weights_memory: 64MiB}\nenv: {ENGINE_SIM_WEIGHTS_BYTES: 64MiB}\n",
    )
    .unwrap();
    h.server.deploy(b).await.unwrap();
    h.server.deploy(doc("chat-c", "")).await.unwrap();
    // A stopped deployment may run on any host: it names none (`-`) until it is placed.
    assert_eq!(
        h.server.get("chat-a").await.unwrap().hosts,
        Vec::<String>::new()
    );

    // chat-a lands on the first host; chat-b fits on the other one: nothing is parked.
    assert_eq!(h.chat("chat-a").await.0, 200);
    assert_eq!(host_of(&h, "chat-a").await, "gpu-a");
    assert_eq!(h.chat("chat-b").await.0, 200);
    assert_eq!(host_of(&h, "chat-b").await, "gpu-b");
    assert_eq!(state(&h, "chat-a").await, InstanceState::Ready);

    // chat-c fits nowhere: one switch, on one host, parks the model whose release frees the
    // room with the fewest bytes: chat-b (5 GiB) on gpu-b, where chat-c then runs.
    assert_eq!(h.chat("chat-c").await.0, 200);
    assert_eq!(host_of(&h, "chat-c").await, "gpu-b");
    assert_eq!(state(&h, "chat-b").await, InstanceState::Parked);
    assert_eq!(host_of(&h, "chat-b").await, "gpu-b", "parked where it ran");
    assert_eq!(state(&h, "chat-a").await, InstanceState::Ready);

    // chat-b wakes where its copy is: gpu-b, parking chat-c. Unbound, it would have gone to
    // gpu-a (the same victim bytes there, and gpu-a comes first) and started afresh.
    assert_eq!(h.chat("chat-b").await.0, 200);
    assert_eq!(host_of(&h, "chat-b").await, "gpu-b");
    let b = h.server.get("chat-b").await.unwrap();
    assert_eq!(b.instances[0].generation, 1, "woken, not started again");
    assert_eq!(state(&h, "chat-c").await, InstanceState::Parked);
    assert_eq!(host_of(&h, "chat-c").await, "gpu-b");
    assert_eq!(state(&h, "chat-a").await, InstanceState::Ready);

    // The views: engines and hosts of both, the load read names each instance's host.
    let hosts = h.server.hosts().await;
    let ids: Vec<&str> = hosts.hosts.iter().map(|x| x.id.as_str()).collect();
    assert_eq!(ids, ["gpu-a", "gpu-b"]);
    assert_eq!(hosts.hosts[0].host_memory_used, 0);
    assert_eq!(hosts.hosts[1].host_memory_used, 64 << 20, "chat-c's copy");
    let engines = h.server.engines().await;
    assert_eq!(engines.engines.len(), 6, "three engines on each host");
    let load = h.server.load(Some("chat-a")).await.unwrap();
    assert_eq!(load.deployments[0].instances[0].host_id, "gpu-a");

    // An operator start --evict of chat-c (bound to gpu-b, parked) names its victim there.
    let r = h.start("chat-c", true, true).await.unwrap();
    assert_eq!(r.victims.len(), 1, "{:?}", r.victims);
    assert_eq!(r.victims[0].name, "chat-b");
    assert_eq!(host_of(&h, "chat-c").await, "gpu-b");
    assert_eq!(state(&h, "chat-a").await, InstanceState::Ready);
    h.shutdown().await;
}

#[tokio::test]
async fn a_restart_adopts_each_engine_on_its_own_host() {
    let dir = temp_dir("hosts-restart");
    let h = Harness::with_hosts(&dir, Opts::default(), &["gpu-a", "gpu-b"]).await;
    h.server.deploy(doc("chat-a", "")).await.unwrap();
    h.server.deploy(doc("chat-b", "")).await.unwrap();
    assert_eq!(h.chat("chat-a").await.0, 200);
    assert_eq!(h.chat("chat-b").await.0, 200);
    h.server.park("chat-a").await.unwrap();
    h.server
        .wait_for_state(
            "chat-a",
            &[InstanceState::Parked],
            std::time::Duration::from_secs(30),
        )
        .await
        .unwrap();
    // As after a kill: the engines keep running.
    h.close().await;

    let h = Harness::with_hosts(&dir, Opts::default(), &["gpu-a", "gpu-b"]).await;
    assert_eq!(state(&h, "chat-a").await, InstanceState::Parked);
    assert_eq!(host_of(&h, "chat-a").await, "gpu-a");
    assert_eq!(state(&h, "chat-b").await, InstanceState::Ready);
    assert_eq!(host_of(&h, "chat-b").await, "gpu-b");
    assert_eq!(h.chat("chat-b").await.0, 200);
    // The parked one wakes on its host, with nothing to park: gpu-a is free.
    assert_eq!(h.chat("chat-a").await.0, 200);
    assert_eq!(host_of(&h, "chat-a").await, "gpu-a");
    assert_eq!(state(&h, "chat-b").await, InstanceState::Ready);
    h.shutdown().await;
}

#[tokio::test]
async fn a_host_added_later_takes_what_fits_nowhere_else() {
    let dir = temp_dir("hosts-added");
    let opts = Opts::default();
    let h = Harness::with_hosts(&dir, opts.clone(), &["gpu-a"]).await;
    let big = capyctl_spec::documents::parse_deployment_str(
        "big.yaml",
        "name: big\nengine: vllm\nmodel: Qwen3-4B\nresources: {gpu_memory: 30GiB, weights_memory: 64MiB}\nenv: {ENGINE_SIM_WEIGHTS_BYTES: 64MiB}\n",
    )
    .unwrap();
    h.server.deploy(big).await.unwrap();
    let (status, body) = h.chat("big").await;
    assert_eq!((status, body["code"].as_str()), (409, Some("does_not_fit")));

    // A node with a 40 GiB GPU joins.
    let roomy = Opts {
        gpu: 40 * support::GIB,
        ..opts
    };
    let agent = Harness::host_agent(&dir.join("gpu-big"), &roomy);
    h.server
        .upsert_host(HostEntry {
            id: "gpu-big".into(),
            agent: agent.clone(),
            activation: capyctl_spec::Activation::OnDemand,
            settings: support::host_settings(roomy.gpu, roomy.host_memory),
            admission_window: None,
            remote: false,
        })
        .await
        .unwrap();
    assert_eq!(h.chat("big").await.0, 200);
    assert_eq!(host_of(&h, "big").await, "gpu-big");
    h.shutdown().await;
    agent.stop_all().await;
}

/// "A model is explicit when its deployment or any host it may run on says so."
#[tokio::test]
async fn one_explicit_host_makes_every_model_explicit() {
    let dir = temp_dir("hosts-explicit");
    let h = Harness::with_hosts(&dir, Opts::default(), &["gpu-a"]).await;
    h.server.deploy(doc("chat-a", "")).await.unwrap();
    let opts = Opts::default();
    let agent = Harness::host_agent(&dir.join("gpu-x"), &opts);
    h.server
        .upsert_host(HostEntry {
            id: "gpu-x".into(),
            agent: agent.clone(),
            activation: capyctl_spec::Activation::Explicit,
            settings: support::host_settings(opts.gpu, opts.host_memory),
            admission_window: None,
            remote: false,
        })
        .await
        .unwrap();
    let (status, body) = h.chat("chat-a").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (409, Some("deployment_inactive"))
    );
    assert_eq!(
        h.server.get("chat-a").await.unwrap().activation,
        capyctl_spec::Activation::Explicit
    );
    h.shutdown().await;
    agent.stop_all().await;
}

/// A node agent that comes back (the same host, again): what it still runs is adopted as it
/// is, and an instance it no longer has is failed and started afresh by the next request.
#[tokio::test]
async fn a_host_that_comes_back_is_reconciled() {
    let dir = temp_dir("hosts-back");
    let opts = Opts::default();
    let h = Harness::with_hosts(&dir, opts.clone(), &["gpu-a", "gpu-b"]).await;
    h.server.deploy(doc("chat-a", "")).await.unwrap();
    h.server.deploy(doc("chat-b", "")).await.unwrap();
    assert_eq!(h.chat("chat-a").await.0, 200);
    assert_eq!(h.chat("chat-b").await.0, 200);
    let a = h.server.get("chat-a").await.unwrap();
    let (a_pid, a_host) = (a.instances[0].pid, a.hosts[0].clone());
    let b = h.server.get("chat-b").await.unwrap();
    let b_host = b.hosts[0].clone();
    assert_ne!(a_host, b_host);
    // chat-b's engine goes away behind the lifecycle's back.
    let b_agent = h
        .agents
        .iter()
        .find(|(id, _)| *id == b_host)
        .unwrap()
        .1
        .clone();
    b_agent.stop(&b.instances[0].instance_id).await.unwrap();

    for (id, agent) in &h.agents {
        h.server
            .upsert_host(HostEntry {
                id: id.clone(),
                agent: agent.clone(),
                activation: capyctl_spec::Activation::OnDemand,
                settings: support::host_settings(opts.gpu, opts.host_memory),
                admission_window: None,
                remote: false,
            })
            .await
            .unwrap();
    }
    let a = h.server.get("chat-a").await.unwrap();
    assert_eq!(a.state, InstanceState::Ready);
    assert_eq!(a.instances[0].pid, a_pid, "adopted as it was");
    assert_eq!(a.instances[0].generation, 1);
    assert_eq!(h.chat("chat-a").await.0, 200);
    let b = h.server.get("chat-b").await.unwrap();
    assert_eq!(b.state, InstanceState::Failed);
    assert!(
        b.instances[0]
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("no longer has it")),
        "{:?}",
        b.instances[0].last_error
    );
    assert_eq!(h.chat("chat-b").await.0, 200);
    assert_eq!(
        h.server.get("chat-b").await.unwrap().instances[0].generation,
        2
    );
    h.shutdown().await;
}

/// A host drain: the host takes nothing new, what runs there (explicit models too) is drained
/// and stopped, and its models come back elsewhere on their next request; with no host left in
/// service a request is refused at once, naming the drained host; an uncordon puts it back.
#[tokio::test]
async fn a_drained_host_takes_nothing_and_its_models_come_back_elsewhere() {
    let dir = temp_dir("hosts-drain");
    let h = Harness::with_hosts(&dir, Opts::default(), &["gpu-a", "gpu-b"]).await;
    h.server.deploy(doc("chat-a", "")).await.unwrap();
    h.server
        .deploy(doc("chat-x", "lifecycle: {activation: explicit}\n"))
        .await
        .unwrap();
    assert_eq!(h.chat("chat-a").await.0, 200);
    assert_eq!(host_of(&h, "chat-a").await, "gpu-a");
    // The explicit model (started by the operator) does not fit beside it (6 + 6 > 10 GiB).
    h.start("chat-x", false, true).await.unwrap();
    assert_eq!(host_of(&h, "chat-x").await, "gpu-b");

    let drained = h.server.drain_host("gpu-b", true).await.unwrap();
    assert_eq!((drained.action.as_str(), drained.cordoned), ("drain", true));
    let names: Vec<&str> = drained.victims.iter().map(|v| v.name.as_str()).collect();
    assert_eq!(names, ["chat-x"], "an explicit model too");
    assert_eq!(
        drained.victims[0].released,
        capyctl_spec::api::Released::Stopped
    );
    assert_eq!(state(&h, "chat-x").await, InstanceState::Stopped);
    assert_eq!(
        state(&h, "chat-a").await,
        InstanceState::Ready,
        "gpu-a untouched"
    );
    let hosts = h.server.hosts().await;
    let cordoned: Vec<(&str, bool)> = hosts
        .hosts
        .iter()
        .map(|x| (x.id.as_str(), x.cordoned))
        .collect();
    assert_eq!(cordoned, [("gpu-a", false), ("gpu-b", true)]);

    // Drained gpu-a too: chat-a stops; a request for it finds no host in service.
    let drained = h.server.drain_host("gpu-a", true).await.unwrap();
    assert_eq!(drained.victims.len(), 1);
    assert_eq!(drained.victims[0].name, "chat-a");
    let (status, body) = h.chat("chat-a").await;
    assert_eq!((status, body["code"].as_str()), (409, Some("does_not_fit")));
    let message = body["message"].as_str().unwrap();
    assert!(
        message.contains("drained") && message.contains("gpu-a") && message.contains("uncordon"),
        "{message}"
    );
    // A second drain finds nothing to stop.
    assert!(
        h.server
            .drain_host("gpu-a", true)
            .await
            .unwrap()
            .victims
            .is_empty()
    );
    let unknown = h.server.drain_host("gpu-z", true).await.unwrap_err();
    assert_eq!(unknown.code(), "not_found");

    // gpu-b back in service: chat-a comes back there (a fresh start).
    let back = h.server.drain_host("gpu-b", false).await.unwrap();
    assert_eq!((back.action.as_str(), back.cordoned), ("uncordon", false));
    assert_eq!(h.chat("chat-a").await.0, 200);
    assert_eq!(host_of(&h, "chat-a").await, "gpu-b");
    h.shutdown().await;
}
