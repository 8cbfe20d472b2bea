//! End to end: `capyctl-operator` out of cluster, a `capyctl-node-agent --engine-runtime process`
//! whose engines are the engine simulator, two model manifests; a request through the router
//! switches them and the CRs' status and Events show the park and the wake; deleting a CR stops
//! its engine (the finalizer) and lets the object go. Then faults: a standby takes over from a
//! leader that releases its Lease, and from one killed mid-switch; a node agent goes away with
//! its engines.
//!
//! The same test body runs twice:
//! - against a small in-process fake API server (always; see [`fake`]): the Kubernetes calls the
//!   operator makes (Lease get/create/update, CR list/watch/patch, status apply, Events), with
//!   resource versions, finalizers, deletion and watch streams, and nothing else;
//! - against a real API server (`#[ignore = "needs cluster"]`), when `CAPYCTL_TEST_KUBECONFIG`
//!   names a kubeconfig: `CAPYCTL_TEST_KUBECONFIG=~/.kube/config cargo test -p capyctl-operator
//!   --test k8s_e2e -- --ignored`.
#![allow(clippy::unwrap_used)]

use capyctl_test_support::fake_api_server::FakeApiServer;
use capyctl_test_support::harness as support;

use capyctl_test_support::operator_e2e::*;

use std::time::Duration;

use capyctl_crds::Deployment;
use capyctl_operator::FINALIZER;
use capyctl_spec::InstanceState;
use k8s_openapi::api::events::v1::Event;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client, ResourceExt};

async fn has_event(events: &Api<Event>, object: &str, reason: &str) -> bool {
    events
        .list(&ListParams::default())
        .await
        .map(|l| {
            l.items.iter().any(|e| {
                e.reason.as_deref() == Some(reason)
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(object)
            })
        })
        .unwrap_or(false)
}

/// The end-to-end scenario in namespace `ns` of the API server of `kubeconfig` (`client`).
async fn scenario(client: Client, kubeconfig: &std::path::Path, ns: &str) {
    let dir = support::temp_dir("k8s-e2e");
    let (_agent, agent_port) = start_node_agent(&dir);
    let (_operator, inference) = start_operator(&dir, kubeconfig, ns, "op-e2e", agent_port);

    let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
    for name in ["chat-a", "chat-b"] {
        api.create(&PostParams::default(), &model_cr(ns, name))
            .await
            .unwrap();
    }
    let t = Duration::from_secs(60);
    for name in ["chat-a", "chat-b"] {
        eventually(&format!("{name} deployed"), t, || async {
            let cr = api.get(name).await.ok()?;
            let ok = cr.finalizers().iter().any(|f| f == FINALIZER)
                && cr.status?.deployment_id.is_some();
            ok.then_some(())
        })
        .await;
    }
    assert_eq!(lease_holder(&client, ns).await.as_deref(), Some("op-e2e"));

    let (status, body) = chat(inference, "chat-a").await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = chat(inference, "chat-b").await;
    assert_eq!(status, 200, "{body}");
    eventually("chat-a parked, chat-b ready in the status", t, || async {
        (state_of(&api, "chat-a").await == Some(InstanceState::Parked)
            && state_of(&api, "chat-b").await == Some(InstanceState::Ready))
        .then_some(())
    })
    .await;
    let (status, body) = chat(inference, "chat-a").await;
    assert_eq!(status, 200, "{body}");
    eventually("chat-a woken in the status", t, || async {
        (state_of(&api, "chat-a").await == Some(InstanceState::Ready)).then_some(())
    })
    .await;
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    for (object, reason) in [
        ("chat-a", "Parked"),
        ("chat-a", "Woken"),
        ("chat-a", "Switched"),
        ("chat-b", "Started"),
        ("chat-b", "Switched"),
        ("chat-b", "Parked"),
    ] {
        eventually(&format!("a {reason} event on {object}"), t, || async {
            has_event(&events, object, reason).await.then_some(())
        })
        .await;
    }
    let a = api.get("chat-a").await.unwrap().status.unwrap();
    assert_eq!(a.instances[0].generation, 1, "woken, not restarted");

    // Deleting a CR stops its engine and lets the object go.
    api.delete("chat-b", &DeleteParams::default())
        .await
        .unwrap();
    eventually("chat-b gone", t, || async {
        api.get_opt("chat-b").await.ok()?.is_none().then_some(())
    })
    .await;
    let (status, _) = chat(inference, "chat-b").await;
    assert_eq!(status, 404);
    drop(_operator);
    drop(_agent);
    let _ = std::fs::remove_dir_all(dir);
}

/// Two GPU nodes: the operator finds both node agents by their Pods (as the DaemonSet's), places
/// two models that do not fit on one GPU on one node each (nothing is parked), and a third one
/// switches on one node; the CRs' status names each instance's host.
async fn two_hosts(client: Client, kubeconfig: &std::path::Path, ns: &str) {
    let dir = support::temp_dir("k8s-e2e-hosts");
    let (_a, _b, port) = two_node_agents(&client, &dir, ns).await;
    let (_operator, inference) =
        start_operator_with(&dir, kubeconfig, ns, "op-hosts", AgentsBy::Pods(port));

    let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
    for name in ["chat-a", "chat-b", "chat-c"] {
        api.create(&PostParams::default(), &model_cr(ns, name))
            .await
            .unwrap();
    }
    let t = Duration::from_secs(60);
    for name in ["chat-a", "chat-b", "chat-c"] {
        eventually(&format!("{name} deployed"), t, || async {
            api.get(name).await.ok()?.status?.deployment_id.map(|_| ())
        })
        .await;
    }
    let hosts_of = |name: &'static str| {
        let api = api.clone();
        async move {
            let status = api.get(name).await.ok()?.status?;
            Some((status.state.and_then(|s| s.parse().ok()), status.hosts))
        }
    };
    for name in ["chat-a", "chat-b"] {
        let (status, body) = chat(inference, name).await;
        assert_eq!(status, 200, "{name}: {body}");
    }
    let (a, b) = eventually("chat-a and chat-b ready, one per node", t, || async {
        let (sa, ha) = hosts_of("chat-a").await?;
        let (sb, hb) = hosts_of("chat-b").await?;
        let ready = sa == Some(InstanceState::Ready) && sb == Some(InstanceState::Ready);
        // One host each (the column joins several with commas).
        let one = |h: &Option<String>| h.clone().filter(|h| !h.is_empty() && !h.contains(','));
        Some((one(&ha)?, one(&hb)?)).filter(|_| ready)
    })
    .await;
    let mut nodes = [a.clone(), b.clone()];
    nodes.sort();
    assert_eq!(nodes, ["node-a".to_string(), "node-b".to_string()]);
    // chat-c fits on neither: one switch on one node parks the longer-idle chat-a.
    let (status, body) = chat(inference, "chat-c").await;
    assert_eq!(status, 200, "{body}");
    eventually(
        "chat-a parked where it ran, chat-c ready beside it",
        t,
        || async {
            let (sa, ha) = hosts_of("chat-a").await?;
            let (sc, hc) = hosts_of("chat-c").await?;
            let (sb, _) = hosts_of("chat-b").await?;
            (sa == Some(InstanceState::Parked)
                && sc == Some(InstanceState::Ready)
                && sb == Some(InstanceState::Ready)
                && ha.as_deref() == Some(a.as_str())
                && hc.as_deref() == Some(a.as_str()))
            .then_some(())
        },
    )
    .await;
    drop(_operator);
    drop(_a);
    drop(_b);
    let _ = std::fs::remove_dir_all(dir);
}

/// Replicas over nodes (DESIGN 4.7): two node agents (two GPU nodes, one 10 GiB GPU each) and
/// one CR with `replicas: 2` of a 6 GiB model: a request brings both instances up, one on each
/// node; the status says `readyReplicas: 2` and both hosts. Scaled to 1 (the scale
/// subresource's field), the instance past it is stopped and the status follows.
async fn replicas_over_nodes(client: Client, kubeconfig: &std::path::Path, ns: &str) {
    let dir = support::temp_dir("k8s-e2e-replicas");
    let (_a, _b, port) = two_node_agents(&client, &dir, ns).await;
    let (_operator, inference) =
        start_operator_with(&dir, kubeconfig, ns, "op-replicas", AgentsBy::Pods(port));
    let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let mut cr = model_cr(ns, "chat-r");
    cr.spec.replicas = Some(2);
    api.create(&PostParams::default(), &cr).await.unwrap();
    let t = Duration::from_secs(60);
    eventually("chat-r deployed", t, || async {
        api.get("chat-r")
            .await
            .ok()?
            .status?
            .deployment_id
            .map(|_| ())
    })
    .await;
    let (status, body) = chat(inference, "chat-r").await;
    assert_eq!(status, 200, "{body}");
    let hosts = eventually("both instances ready", t, || async {
        let st = api.get("chat-r").await.ok()?.status?;
        (st.ready_replicas == Some(2) && st.replicas == Some(2))
            .then_some(st.hosts)
            .flatten()
    })
    .await;
    let mut nodes: Vec<&str> = hosts.split(',').map(str::trim).collect();
    nodes.sort_unstable();
    assert_eq!(nodes, ["node-a", "node-b"], "one instance on each node");
    for _ in 0..4 {
        let (status, body) = chat(inference, "chat-r").await;
        assert_eq!(status, 200, "{body}");
    }
    // Scaled to 1: the instance past it stops; the deployment serves from the other.
    let patch = serde_json::json!({"spec": {"replicas": 1}});
    api.patch(
        "chat-r",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&patch),
    )
    .await
    .unwrap();
    eventually("scaled to one", t, || async {
        let st = api.get("chat-r").await.ok()?.status?;
        (st.ready_replicas == Some(1) && st.replicas == Some(1)).then_some(())
    })
    .await;
    let (status, body) = chat(inference, "chat-r").await;
    assert_eq!(status, 200, "{body}");
    drop(_operator);
    drop(_a);
    drop(_b);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn against_a_fake_api_server_replicas_run_on_two_nodes_and_scale_down() {
    let _one = ONE_AT_A_TIME.lock().await;
    let addr = FakeApiServer::start().await;
    let dir = support::temp_dir("k8s-replicas-fake");
    let kubeconfig = fake_kubeconfig(&dir, addr);
    let client = client_of(&kubeconfig).await;
    replicas_over_nodes(client, &kubeconfig, "capyctl").await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs cluster"]
async fn against_a_cluster_replicas_run_on_two_nodes_and_scale_down() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (kubeconfig, ns) = cluster_namespace().await;
    replicas_over_nodes(ns.client.clone(), &kubeconfig, &ns.name).await;
}

/// A PEFT adapter directory `name` under `dir` (its `adapter_config.json`, rank 8).
fn peft(dir: &std::path::Path, name: &str) -> String {
    let at = dir.join("loras").join(name);
    std::fs::create_dir_all(&at).unwrap();
    std::fs::write(
        at.join("adapter_config.json"),
        r#"{"r": 8, "lora_alpha": 16, "peft_type": "LORA", "target_modules": ["q_proj"]}"#,
    )
    .unwrap();
    at.display().to_string()
}

/// The text of a chat answer.
fn content(body: &serde_json::Value) -> String {
    body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("no content: {body}"))
        .to_string()
}

/// Adapters on Kubernetes (DESIGN 4.9, issue 31): a base `Deployment` with `spec.adapters`
/// (one loaded at a time) and two adapter objects (`spec.adapter`, their PEFT directories on
/// the node: the process runtime's engines read the node's files), the first applied before
/// its base (refused, then taken when the base is deployed). The adapters' STATE reads
/// `unloaded`, then `loaded` for the one a request named (as `capyctl list deployments` shows
/// it), never an instance state; the answers are the adapter's own; each load and unload is a
/// switch record of cause `adapter`.
async fn adapters(client: Client, kubeconfig: &std::path::Path, ns: &str) {
    let dir = support::temp_dir("k8s-e2e-adapters");
    let (_agent, agent_port) = start_node_agent(&dir);
    let operator = start_operator_env(
        &dir,
        kubeconfig,
        ns,
        "op-adapters",
        AgentsBy::Url(agent_port),
        &[],
    );
    let inference = operator.inference;
    let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let adapter = |name: &str| -> Deployment {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "capyctl.io/v1alpha1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"adapter": {"base": "chat-base", "path": peft(&dir, name)}},
        }))
        .unwrap()
    };
    let t = Duration::from_secs(60);
    let deployed = |name: &'static str| {
        let api = api.clone();
        async move {
            eventually(&format!("{name} deployed"), t, || async {
                api.get(name).await.ok()?.status?.deployment_id.map(|_| ())
            })
            .await
        }
    };
    // a1 applied before its base: refused, saying why, then taken once the base is there
    // (at once, not at its next requeue minutes later).
    api.create(&PostParams::default(), &adapter("a1"))
        .await
        .unwrap();
    let why = eventually("a1 refused for want of its base", t, || async {
        let status = api.get("a1").await.ok()?.status?;
        let c = status.conditions.iter().find(|c| c.type_ == "Accepted")?;
        (c.status == "False" && c.reason == "invalid_spec").then(|| c.message.clone())
    })
    .await;
    assert!(why.contains("adapter.base"), "{why}");
    let mut base = model_cr(ns, "chat-base");
    base.spec.adapters = Some(capyctl_crds::AdaptersSpec {
        max_loaded: 1,
        max_rank: 16,
        volume: None,
    });
    api.create(&PostParams::default(), &base).await.unwrap();
    deployed("chat-base").await;
    deployed("a1").await;
    api.create(&PostParams::default(), &adapter("a2"))
        .await
        .unwrap();
    deployed("a2").await;
    let states = |want: [&'static str; 3]| {
        let api = api.clone();
        async move {
            eventually(&format!("chat-base, a1, a2 {want:?}"), t, || async {
                let mut seen = Vec::new();
                for name in ["chat-base", "a1", "a2"] {
                    seen.push(state_word_of(&api, name).await?);
                }
                (seen == want).then_some(())
            })
            .await
        }
    };
    states(["stopped", "unloaded", "unloaded"]).await;
    let a1 = api.get("a1").await.unwrap().status.unwrap();
    // Nothing of a checkpoint or of parking on an adapter: its base has those.
    assert_eq!(a1.measurement, None, "{a1:?}");
    let kinds: Vec<&str> = a1.conditions.iter().map(|c| c.type_.as_str()).collect();
    assert_eq!(kinds, ["Ready"], "{a1:?}");
    assert_eq!(a1.conditions[0].reason, "unloaded");

    // A request for a1 starts the base and loads a1 into it; the answer is a1's.
    let (status, body) = chat(inference, "a1").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["model"], "a1", "{body}");
    let first_a1 = content(&body);
    states(["ready", "loaded", "unloaded"]).await;
    let a1 = api.get("a1").await.unwrap().status.unwrap();
    assert_eq!(a1.ready.as_deref(), Some("1/1"), "{a1:?}");
    assert_eq!(a1.hosts.as_deref(), Some("chat-base"), "its base: {a1:?}");
    assert_eq!(a1.conditions[0].reason, "loaded");

    // a2 takes the one place: a1 is unloaded. The engine answers through each adapter's
    // files, so the base and the two adapters answer the same prompt differently.
    let (status, body) = chat(inference, "a2").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["model"], "a2", "{body}");
    let a2 = content(&body);
    states(["ready", "unloaded", "loaded"]).await;
    let (status, body) = chat(inference, "chat-base").await;
    assert_eq!(status, 200, "{body}");
    let base_answer = content(&body);
    assert_ne!(first_a1, a2);
    assert_ne!(first_a1, base_answer);
    assert_ne!(a2, base_answer);
    // a1 again: loaded again from its directory, the same answer as before.
    let (status, body) = chat(inference, "a1").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(content(&body), first_a1);
    states(["ready", "loaded", "unloaded"]).await;

    // Every load and unload is a switch record of cause `adapter`.
    let token = eventually("the admin token", t, || async { operator.admin_token() }).await;
    let (status, body) = support::management(
        "GET",
        operator.management,
        "/management/v1/switches",
        &token,
        None,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let adapter_phases: Vec<(String, String)> =
        capyctl_test_support::adapter_switches(body["switches"].as_array().unwrap())
            .into_iter()
            .map(|r| {
                assert_eq!(r.outcome, "ok", "{r:?}");
                (r.deployment, r.phases.join(","))
            })
            .collect();
    let want = [
        ("a1", "adapter_load"),
        ("a1", "adapter_unload"),
        ("a2", "adapter_load"),
        ("a2", "adapter_unload"),
        ("a1", "adapter_load"),
    ];
    for (name, phase) in want {
        assert!(
            adapter_phases.iter().any(|(n, p)| n == name && p == phase),
            "no {phase} of {name}: {adapter_phases:?}"
        );
    }
    assert_eq!(adapter_phases.len(), want.len(), "{adapter_phases:?}");
    drop(operator);
    drop(_agent);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn against_a_fake_api_server_adapters_show_loaded_and_unloaded() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (dir, kubeconfig, client) = fake_api_server("k8s-adapters-fake").await;
    adapters(client, &kubeconfig, "capyctl").await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs cluster"]
async fn against_a_cluster_adapters_show_loaded_and_unloaded() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (kubeconfig, ns) = cluster_namespace().await;
    adapters(ns.client.clone(), &kubeconfig, &ns.name).await;
}

/// Two node agents (process runtime, one 10 GiB GPU each) as nodes `node-a` and `node-b`, on
/// one port at two loopback addresses (their Pods' IPs), with their Pods created and marked
/// running (no kubelet: the test says so); and the port.
async fn two_node_agents(client: &Client, dir: &std::path::Path, ns: &str) -> (Proc, Proc, u16) {
    let port = free_port();
    let a = start_node_agent_at(dir, "node-a", "127.0.0.2", port);
    let b = start_node_agent_at(dir, "node-b", "127.0.0.3", port);
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), ns);
    for (name, ip) in [("agent-a", "127.0.0.2"), ("agent-b", "127.0.0.3")] {
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns,
                "labels": {"app.kubernetes.io/component": "node-agent"}},
            "spec": {"containers": [{"name": "agent", "image": "capyctl-node-agent"}],
                "automountServiceAccountToken": false},
        }))
        .unwrap();
        pods.create(&PostParams::default(), &pod).await.unwrap();
        let status = serde_json::json!({"status": {"phase": "Running", "podIP": ip,
            "podIPs": [{"ip": ip}]}});
        pods.patch_status(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&status),
        )
        .await
        .unwrap();
    }
    (a, b, port)
}

/// Failover: the leader shuts down (it stops its work, then releases the Lease), the standby
/// takes over, rebuilds the deployment from the CR's status (same ID) and adopts the running
/// engine from the node agent (a request is served by the same engine, generation 1).
async fn failover(client: Client, kubeconfig: &std::path::Path, ns: &str) {
    let dir = support::temp_dir("k8s-failover");
    let (_agent, agent_port) = start_node_agent(&dir);
    let (a, inference_a) = start_operator(&dir, kubeconfig, ns, "op-a", agent_port);
    let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
    api.create(&PostParams::default(), &model_cr(ns, "chat-a"))
        .await
        .unwrap();
    let t = Duration::from_secs(60);
    let id = eventually("chat-a deployed", t, || async {
        api.get("chat-a").await.ok()?.status?.deployment_id
    })
    .await;
    assert_eq!(lease_holder(&client, ns).await.as_deref(), Some("op-a"));
    let (_b, inference_b) = start_operator(&dir, kubeconfig, ns, "op-b", agent_port);
    let (status, body) = chat(inference_a, "chat-a").await;
    assert_eq!(status, 200, "{body}");
    eventually("chat-a ready in the status", t, || async {
        (state_of(&api, "chat-a").await == Some(InstanceState::Ready)).then_some(())
    })
    .await;
    // The standby does not serve while it stands by.
    assert!(
        support::try_post_json(inference_b, "/v1/chat/completions", serde_json::json!({}))
            .await
            .is_err()
    );

    drop(a);
    eventually("op-b holds the Lease", t, || async {
        (lease_holder(&client, ns).await.as_deref() == Some("op-b")).then_some(())
    })
    .await;
    let (status, body) = eventually("op-b serves chat-a", t, || async {
        let body = serde_json::json!({"model": "chat-a",
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
        support::try_post_json(inference_b, "/v1/chat/completions", body)
            .await
            .ok()
    })
    .await;
    assert_eq!(status, 200, "{body}");
    let cr = api.get("chat-a").await.unwrap();
    let st = cr.status.unwrap();
    assert_eq!(
        st.deployment_id.as_deref(),
        Some(id.as_str()),
        "the same deployment"
    );
    assert_eq!(
        st.instances[0].generation, 1,
        "the engine was adopted, not restarted"
    );
    assert_eq!(st.state.as_deref(), Some("ready"));
    let _ = std::fs::remove_dir_all(dir);
}

/// A model CR whose engine takes `delay` to start (the simulator's start-up delay).
fn slow_model_cr(ns: &str, name: &str, delay: &str) -> Deployment {
    let mut cr = serde_json::to_value(model_cr(ns, name)).unwrap();
    cr["spec"]["env"]["ENGINE_SIM_STARTUP_DELAY"] = serde_json::json!(delay);
    serde_json::from_value(cr).unwrap()
}

/// One engine process of a node agent (a child of its process): its instance (from the
/// agent's record of it, `None` when the agent has no record: a leak) and whether it holds
/// its GPU memory now (started and not asleep, as the simulator says).
#[derive(Debug)]
struct EngineProc {
    pid: u32,
    instance: Option<String>,
    awake: bool,
}

/// The engine processes of the node agent `agent_pid` whose records are in `agent_dir`.
async fn engines_of(agent_dir: &std::path::Path, agent_pid: u32) -> Vec<EngineProc> {
    let mut records = std::collections::HashMap::new();
    for entry in std::fs::read_dir(agent_dir.join("engines"))
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Some(r) = std::fs::read_to_string(entry.path())
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            && let (Some(pid), Some(instance), Some(port)) = (
                r["pid"].as_u64(),
                r["instance"].as_str(),
                r["port"].as_u64(),
            )
        {
            records.insert(pid as u32, (instance.to_string(), port as u16));
        }
    }
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if capyctl_test_support::live_parent(u64::from(pid)) != Some(u64::from(agent_pid)) {
            continue;
        }
        let record = records.get(&pid).cloned();
        let mut awake = false;
        if let Some((_, port)) = &record {
            let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
            if let Ok((200, state)) = support::try_get_json(addr, "/sim/state").await {
                awake = state["started"] == true && state["asleep"] == false;
            }
        }
        out.push(EngineProc {
            pid,
            instance: record.map(|(i, _)| i),
            awake,
        });
    }
    out
}

/// No engine leaked (each engine process is one the agent knows, at most one per instance),
/// and at most one holds its GPU memory: each model needs 6 GiB of the node's 10 GiB, so two
/// awake would be the GPU double-booked.
#[track_caller]
fn assert_no_leak_no_double_booking(engines: &[EngineProc]) {
    let mut seen = std::collections::BTreeSet::new();
    for e in engines {
        let instance = e
            .instance
            .as_ref()
            .unwrap_or_else(|| panic!("engine {} has no record: leaked ({engines:?})", e.pid));
        assert!(
            seen.insert(instance.clone()),
            "two engines of {instance}: {engines:?}"
        );
    }
    let awake = engines.iter().filter(|e| e.awake).count();
    assert!(
        awake <= 1,
        "{awake} engines awake on one 10 GiB GPU: {engines:?}"
    );
}

/// The leader is killed (SIGKILL) in the middle of a switch, while the target's engine starts:
/// the standby takes over once the Lease expires, serves both models, and the node's engines
/// are the ones the agent knows, one per deployment at most, within the GPU's memory.
async fn leader_killed_mid_switch(client: Client, kubeconfig: &std::path::Path, ns: &str) {
    let dir = support::temp_dir("k8s-kill");
    let (agent, agent_port) = start_node_agent(&dir);
    let (a, inference_a) = start_operator(&dir, kubeconfig, ns, "op-a", agent_port);
    let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
    api.create(&PostParams::default(), &model_cr(ns, "chat-a"))
        .await
        .unwrap();
    api.create(&PostParams::default(), &slow_model_cr(ns, "chat-b", "4s"))
        .await
        .unwrap();
    let t = Duration::from_secs(60);
    for name in ["chat-a", "chat-b"] {
        eventually(&format!("{name} deployed"), t, || async {
            api.get(name).await.ok()?.status?.deployment_id.map(|_| ())
        })
        .await;
    }
    let (_b, inference_b) = start_operator(&dir, kubeconfig, ns, "op-b", agent_port);
    let (status, body) = chat(inference_a, "chat-a").await;
    assert_eq!(status, 200, "{body}");
    // The switch to chat-b: chat-a parks, chat-b's engine starts (4 s).
    let switching = tokio::spawn(async move {
        let body = serde_json::json!({"model": "chat-b",
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
        support::try_post_json(inference_a, "/v1/chat/completions", body).await
    });
    eventually("chat-b starting in the status", t, || async {
        (state_of(&api, "chat-b").await == Some(InstanceState::Starting)).then_some(())
    })
    .await;
    kill9(&a);
    // The request in flight ends with the leader (its connection is cut), never hangs.
    let ended = tokio::time::timeout(Duration::from_secs(10), switching).await;
    assert!(
        ended.is_ok(),
        "the request to the killed leader did not end"
    );

    eventually("op-b holds the Lease", t, || async {
        (lease_holder(&client, ns).await.as_deref() == Some("op-b")).then_some(())
    })
    .await;
    for name in ["chat-b", "chat-a", "chat-b"] {
        let (status, body) = eventually(&format!("op-b serves {name}"), t, || async {
            let body = serde_json::json!({"model": name,
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
            support::try_post_json(inference_b, "/v1/chat/completions", body)
                .await
                .ok()
                .filter(|(status, _)| *status == 200)
        })
        .await;
        assert_eq!(status, 200, "{name}: {body}");
    }
    let engines = engines_of(&dir.join("agent-e2e-node"), agent.0.id()).await;
    assert_no_leak_no_double_booking(&engines);
    assert_eq!(
        engines.iter().filter(|e| e.awake).count(),
        1,
        "chat-b serves: {engines:?}"
    );
    drop(a);
    drop(_b);
    drop(agent);
    let _ = std::fs::remove_dir_all(dir);
}

/// The `Ready` condition of CR `name`: (status, reason).
async fn ready_condition(api: &Api<Deployment>, name: &str) -> Option<(String, String)> {
    let status = api.get(name).await.ok()?.status?;
    let c = status.conditions.iter().find(|c| c.type_ == "Ready")?;
    Some((c.status.clone(), c.reason.clone()))
}

/// The node agent is gone (SIGKILL), with its engine (`engine_too`) or alone. Its instance is
/// reported (the CR's `Ready` condition turns `Unknown`, reason `node_agent_unreachable`).
/// - With its engine: a request for the model is answered with one of the page's errors,
///   promptly (never hung). When the node agent comes back (a new process at the same
///   address), the host is reconciled again: the lost instance is failed, and the next request
///   starts it afresh and is served.
/// - Alone: the model is still served by its engine meanwhile, and the agent's new life adopts
///   the same engine (served, `Ready` again, never started twice).
async fn node_agent_gone(client: Client, kubeconfig: &std::path::Path, ns: &str, engine_too: bool) {
    let dir = support::temp_dir("k8s-agent-gone");
    let (agent, agent_port) = start_node_agent(&dir);
    let (_operator, inference) = start_operator(&dir, kubeconfig, ns, "op-gone", agent_port);
    let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
    api.create(&PostParams::default(), &model_cr(ns, "chat-a"))
        .await
        .unwrap();
    let t = Duration::from_secs(60);
    eventually("chat-a deployed", t, || async {
        api.get("chat-a")
            .await
            .ok()?
            .status?
            .deployment_id
            .map(|_| ())
    })
    .await;
    let (status, body) = chat(inference, "chat-a").await;
    assert_eq!(status, 200, "{body}");
    let engines = engines_of(&dir.join("agent-e2e-node"), agent.0.id()).await;
    assert_eq!(engines.len(), 1, "{engines:?}");
    // The node agent goes without a word, and with it (a node lost) its engine.
    kill9(&agent);
    drop(agent);
    if engine_too {
        for e in &engines {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", e.pid)])
                .status();
        }
        for e in &engines {
            // Gone, or a zombie its dead parent left.
            eventually(&format!("engine {} gone", e.pid), t, || async {
                (!capyctl_test_support::alive(u64::from(e.pid))).then_some(())
            })
            .await;
        }
        for attempt in 0..3 {
            let asked = std::time::Instant::now();
            let answer =
                tokio::time::timeout(Duration::from_secs(30), chat(inference, "chat-a")).await;
            let (status, body) = answer.unwrap_or_else(|_| panic!("request {attempt} hung"));
            let code = body["code"].as_str().unwrap_or_default().to_string();
            assert!(
                matches!(status, 502 | 503),
                "request {attempt}: {status} {body}"
            );
            assert!(
                ["upstream_unavailable", "unavailable", "engine_failed"].contains(&code.as_str()),
                "request {attempt}: {body}"
            );
            assert!(asked.elapsed() < Duration::from_secs(30));
        }
    }
    eventually(
        "chat-a reported: its node agent is unreachable",
        t,
        || async {
            let (status, reason) = ready_condition(&api, "chat-a").await?;
            (status == "Unknown" && reason == "node_agent_unreachable").then_some(())
        },
    )
    .await;
    if !engine_too {
        let (status, body) = chat(inference, "chat-a").await;
        assert_eq!(status, 200, "served by its engine meanwhile: {body}");
    }
    // The node agent comes back, a new process at the same address.
    let agent = start_node_agent_at(&dir, "e2e-node", "127.0.0.1", agent_port);
    let served = eventually(
        "chat-a served after its node agent came back",
        t,
        || async {
            let (status, body) = chat(inference, "chat-a").await;
            (status == 200).then_some(body)
        },
    )
    .await;
    assert!(served["choices"].is_array(), "{served}");
    eventually("chat-a ready again", t, || async {
        let (status, reason) = ready_condition(&api, "chat-a").await?;
        (status == "True" && reason == "ready").then_some(())
    })
    .await;
    let started = engines_of(&dir.join("agent-e2e-node"), agent.0.id()).await;
    if engine_too {
        // One engine, started afresh by the agent's new life.
        assert_eq!(started.len(), 1, "{started:?}");
        assert!(
            engines.iter().all(|e| e.pid != started[0].pid),
            "{started:?}"
        );
    } else {
        // The same engine, adopted by the agent's new life: alive, and not started twice (the
        // new life has no engine child of its own; the adopted one's parent is init now).
        assert!(capyctl_test_support::alive(u64::from(engines[0].pid)));
        assert!(started.is_empty(), "started again: {started:?}");
    }
    drop(_operator);
    drop(agent);
    let _ = std::fs::remove_dir_all(dir);
}

/// The scenarios run one at a time: each runs an operator, node agents and engines, and on two
/// cores several at once only make each slower (and their ports, chosen free, more likely to
/// meet).
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn against_a_fake_api_server_the_operator_switches_two_models_and_the_crs_show_it() {
    let _one = ONE_AT_A_TIME.lock().await;
    let addr = FakeApiServer::start().await;
    let dir = support::temp_dir("k8s-e2e-fake");
    let kubeconfig = fake_kubeconfig(&dir, addr);
    let client = client_of(&kubeconfig).await;
    scenario(client, &kubeconfig, "capyctl").await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn against_a_fake_api_server_the_standby_takes_over_and_adopts_the_engine() {
    let _one = ONE_AT_A_TIME.lock().await;
    let addr = FakeApiServer::start().await;
    let dir = support::temp_dir("k8s-failover-fake");
    let kubeconfig = fake_kubeconfig(&dir, addr);
    let client = client_of(&kubeconfig).await;
    failover(client, &kubeconfig, "capyctl").await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn against_a_fake_api_server_two_node_agents_are_two_hosts() {
    let _one = ONE_AT_A_TIME.lock().await;
    let addr = FakeApiServer::start().await;
    let dir = support::temp_dir("k8s-hosts-fake");
    let kubeconfig = fake_kubeconfig(&dir, addr);
    let client = client_of(&kubeconfig).await;
    two_hosts(client, &kubeconfig, "capyctl").await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs cluster"]
async fn against_a_cluster_the_operator_switches_two_models_and_the_crs_show_it() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (kubeconfig, ns) = cluster_namespace().await;
    scenario(ns.client.clone(), &kubeconfig, &ns.name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs cluster"]
async fn against_a_cluster_two_node_agents_are_two_hosts() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (kubeconfig, ns) = cluster_namespace().await;
    two_hosts(ns.client.clone(), &kubeconfig, &ns.name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs cluster"]
async fn against_a_cluster_the_standby_takes_over_and_adopts_the_engine() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (kubeconfig, ns) = cluster_namespace().await;
    failover(ns.client.clone(), &kubeconfig, &ns.name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn against_a_fake_api_server_a_leader_killed_mid_switch_is_taken_over_cleanly() {
    let _one = ONE_AT_A_TIME.lock().await;
    let addr = FakeApiServer::start().await;
    let dir = support::temp_dir("k8s-kill-fake");
    let kubeconfig = fake_kubeconfig(&dir, addr);
    let client = client_of(&kubeconfig).await;
    leader_killed_mid_switch(client, &kubeconfig, "capyctl").await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn against_a_fake_api_server_a_node_agent_gone_is_reported_and_served_again_when_back() {
    let _one = ONE_AT_A_TIME.lock().await;
    let addr = FakeApiServer::start().await;
    let dir = support::temp_dir("k8s-gone-fake");
    let kubeconfig = fake_kubeconfig(&dir, addr);
    let client = client_of(&kubeconfig).await;
    node_agent_gone(client, &kubeconfig, "capyctl", true).await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs cluster"]
async fn against_a_cluster_a_leader_killed_mid_switch_is_taken_over_cleanly() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (kubeconfig, ns) = cluster_namespace().await;
    leader_killed_mid_switch(ns.client.clone(), &kubeconfig, &ns.name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs cluster"]
async fn against_a_cluster_a_node_agent_gone_is_reported_and_served_again_when_back() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (kubeconfig, ns) = cluster_namespace().await;
    node_agent_gone(ns.client.clone(), &kubeconfig, &ns.name, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn against_a_fake_api_server_a_node_agent_gone_alone_is_adopted_again_when_back() {
    let _one = ONE_AT_A_TIME.lock().await;
    let addr = FakeApiServer::start().await;
    let dir = support::temp_dir("k8s-alone-fake");
    let kubeconfig = fake_kubeconfig(&dir, addr);
    let client = client_of(&kubeconfig).await;
    node_agent_gone(client, &kubeconfig, "capyctl", false).await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs cluster"]
async fn against_a_cluster_a_node_agent_gone_alone_is_adopted_again_when_back() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (kubeconfig, ns) = cluster_namespace().await;
    node_agent_gone(ns.client.clone(), &kubeconfig, &ns.name, false).await;
}
