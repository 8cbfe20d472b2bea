//! The API server gone (issue 19): the leader and a standby reach the API server through a
//! TCP proxy ([`CutProxy`]) that the test cuts. While it is cut the leader is held over
//! (`operator/src/leader.rs`): requests to its ready models keep being answered, a request that
//! needs a switch and a management command that changes something are refused at once with
//! 503 `unavailable` naming the cause, an engine that exits is still noticed, and the standby
//! does not take over. Once it is restored, the same leader goes on, a switch works again, and
//! the CR status of what changed during the cut is written. And the fence: with only the
//! leader cut off, the standby takes over, serves the models it adopted but neither parks them
//! nor lets a switch take their memory until the old leader has surely stopped serving.
//!
//! The same body runs against the in-process fake API server (always, with short election
//! timing and a 12 s cut) and against a real API server (`#[ignore = "needs cluster"]`, with
//! `CAPYCTL_TEST_KUBECONFIG`: the chart's default timing, a 60 s cut):
//! `CAPYCTL_TEST_KUBECONFIG=~/.kube/config cargo test -p capyctl-operator --test
//! k8s_apiserver_gone -- --ignored`.
#![allow(clippy::unwrap_used)]

use capyctl_test_support::harness as support;

use std::net::SocketAddr;
use std::time::Duration;

use capyctl_crds::Deployment;
use capyctl_spec::InstanceState;
use capyctl_test_support::{Cut, CutProxy};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::PostParams;
use kube::{Api, Client};
use tokio::time::Instant;

use capyctl_test_support::operator_e2e::*;

/// The election's timing and the cut's length.
#[derive(Debug, Clone, Copy)]
struct Timing {
    lease_duration: Duration,
    renew_deadline: Duration,
    retry_period: Duration,
    holdover: Duration,
    cut: Duration,
}

impl Timing {
    fn env(&self) -> Vec<(&'static str, String)> {
        let s = |d: Duration| format!("{}ms", d.as_millis());
        vec![
            ("CAPYCTL_LEASE_DURATION", s(self.lease_duration)),
            ("CAPYCTL_LEASE_RENEW_DEADLINE", s(self.renew_deadline)),
            ("CAPYCTL_LEASE_RETRY_PERIOD", s(self.retry_period)),
            ("CAPYCTL_LEADER_HOLDOVER", s(self.holdover)),
        ]
    }

    /// By then the leader is surely held over: its last renewal began at most a retry period
    /// (plus a try) before the cut, and it is held over at that renewal plus the renew
    /// deadline.
    fn held_after(&self) -> Duration {
        self.renew_deadline + self.retry_period + Duration::from_secs(1)
    }
}

/// A model CR needing `gib` GiB of the node agent's 10 GiB GPU.
fn model_of(ns: &str, name: &str, gib: u32) -> Deployment {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "capyctl.io/v1alpha1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"engine": "vllm", "model": "Qwen3-4B",
                 "resources": {"gpuMemory": format!("{gib}GiB"), "weightsMemory": "64MiB"},
                 "env": {"ENGINE_SIM_WEIGHTS_BYTES": "64MiB"}},
    }))
    .unwrap()
}

/// The answer's text of a chat request's JSON answer.
fn text_of(body: &serde_json::Value) -> String {
    body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// `kubeconfig` with its cluster's server at `proxy` (same scheme: TLS passes through).
fn proxied_kubeconfig(
    dir: &std::path::Path,
    kubeconfig: &std::path::Path,
    proxy: SocketAddr,
) -> std::path::PathBuf {
    let text = std::fs::read_to_string(kubeconfig).unwrap();
    let mut doc: serde_json::Value = serde_yaml_ng::from_str(&text).unwrap();
    for cluster in doc["clusters"].as_array_mut().unwrap() {
        let server = cluster["cluster"]["server"].as_str().unwrap().to_string();
        let scheme = server.split("://").next().unwrap().to_string();
        cluster["cluster"]["server"] = format!("{scheme}://{proxy}").into();
    }
    let path = dir.join("kubeconfig-proxied");
    std::fs::write(&path, serde_yaml_ng::to_string(&doc).unwrap()).unwrap();
    path
}

/// The address of the API server of `kubeconfig` (its current context's cluster).
fn api_server_addr(kubeconfig: &std::path::Path) -> SocketAddr {
    let text = std::fs::read_to_string(kubeconfig).unwrap();
    let doc: serde_json::Value = serde_yaml_ng::from_str(&text).unwrap();
    let server = doc["clusters"][0]["cluster"]["server"].as_str().unwrap();
    let authority = server.split("://").nth(1).unwrap().trim_end_matches('/');
    use std::net::ToSocketAddrs;
    authority.to_socket_addrs().unwrap().next().unwrap()
}

async fn lease_of(client: &Client, ns: &str) -> (Option<String>, Option<i32>) {
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    let spec = leases
        .get("capyctl-e2e")
        .await
        .ok()
        .and_then(|l| l.spec)
        .unwrap_or_default();
    (spec.holder_identity, spec.lease_transitions)
}

/// What both scenarios begin with.
struct Setup {
    dir: std::path::PathBuf,
    proxy: CutProxy,
    _agent: Proc,
    /// The leader, behind the proxy.
    a: Operator,
    /// The standby, behind the proxy or not.
    b: Operator,
    api: Api<Deployment>,
    /// chat-b's answer.
    answer: String,
    /// op-a's admin token.
    token: String,
    /// The Lease's transitions before the cut.
    transitions: Option<i32>,
}

/// The leader op-a behind the proxy, the standby op-b (behind it too when
/// `standby_behind_proxy`), one node agent with a GPU of 10 GiB, and three models: chat-a
/// (6 GiB) parked, chat-b (6 GiB) and chat-c (3 GiB) ready.
async fn setup(
    client: &Client,
    kubeconfig: &std::path::Path,
    ns: &str,
    timing: Timing,
    standby_behind_proxy: bool,
) -> Setup {
    let dir = support::temp_dir("k8s-apiserver-gone");
    let proxy = CutProxy::start(api_server_addr(kubeconfig)).await;
    let proxied = proxied_kubeconfig(&dir, kubeconfig, proxy.addr());
    let env = timing.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let (_agent, agent_port) = start_node_agent(&dir);
    let a = start_operator_env(&dir, &proxied, ns, "op-a", AgentsBy::Url(agent_port), &env);
    let t = Duration::from_secs(90);
    eventually("op-a holds the Lease", t, || async {
        (lease_of(client, ns).await.0.as_deref() == Some("op-a")).then_some(())
    })
    .await;
    let standby_config = if standby_behind_proxy {
        &proxied
    } else {
        kubeconfig
    };
    let b = start_operator_env(
        &dir,
        standby_config,
        ns,
        "op-b",
        AgentsBy::Url(agent_port),
        &env,
    );

    // chat-a (6 GiB) parked; chat-b (6 GiB) and chat-c (3 GiB) ready: the GPU has 10 GiB.
    let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
    for (name, gib) in [("chat-a", 6), ("chat-b", 6), ("chat-c", 3)] {
        api.create(&PostParams::default(), &model_of(ns, name, gib))
            .await
            .unwrap();
        eventually(&format!("{name} deployed"), t, || async {
            api.get(name).await.ok()?.status?.deployment_id
        })
        .await;
    }
    for name in ["chat-a", "chat-b", "chat-c"] {
        let (status, body) = chat(a.inference, name).await;
        assert_eq!(status, 200, "{name}: {body}");
    }
    for (name, state) in [
        ("chat-a", InstanceState::Parked),
        ("chat-b", InstanceState::Ready),
        ("chat-c", InstanceState::Ready),
    ] {
        eventually(&format!("{name} {state:?} in its status"), t, || async {
            (state_of(&api, name).await == Some(state)).then_some(())
        })
        .await;
    }
    let (status, body) = chat(a.inference, "chat-b").await;
    assert_eq!(status, 200, "{body}");
    let answer = text_of(&body);
    assert!(!answer.is_empty(), "{body}");
    let token = eventually("op-a's admin token", t, || async { a.admin_token() }).await;
    let (_, transitions) = lease_of(client, ns).await;

    Setup {
        dir,
        proxy,
        _agent,
        a,
        b,
        api,
        answer,
        token,
        transitions,
    }
}

/// The scenario (see the module doc) in namespace `ns` of the API server of `kubeconfig`,
/// whose client (`client`, not proxied) the test itself uses.
async fn apiserver_gone(client: Client, kubeconfig: &std::path::Path, ns: &str, timing: Timing) {
    let Setup {
        dir,
        proxy,
        _agent,
        a,
        b,
        api,
        answer,
        token,
        transitions,
    } = setup(&client, kubeconfig, ns, timing, true).await;
    let t = Duration::from_secs(90);
    // The API server goes: refused for the first half of the cut, then black-holed
    // (nothing moves, nothing closes: every call hangs until its own timeout).
    proxy.cut(Cut::Refuse);
    let cut = Instant::now();
    let mut black_holed = false;
    let mut served = 0usize;
    let mut refused_switch = false;
    let mut refused_command = false;
    let mut killed = false;
    while cut.elapsed() < timing.cut {
        if !black_holed && cut.elapsed() >= timing.cut / 2 {
            proxy.cut(Cut::BlackHole);
            black_holed = true;
        }
        // Traffic to a ready model keeps flowing, the same answer every time.
        let (status, body) = chat(a.inference, "chat-b").await;
        assert_eq!(
            status,
            200,
            "chat-b {:?} into the cut: {body}",
            cut.elapsed()
        );
        assert_eq!(text_of(&body), answer, "{body}");
        served += 1;
        if cut.elapsed() >= timing.held_after() {
            // A request that needs a switch: refused at once, retryable, naming the cause.
            let began = Instant::now();
            let (status, body) = chat(a.inference, "chat-a").await;
            assert!(
                began.elapsed() < Duration::from_secs(2),
                "took {:?}",
                began.elapsed()
            );
            assert_eq!(status, 503, "{body}");
            assert_eq!(body["code"], "unavailable", "{body}");
            assert_eq!(body["retryable"], true, "{body}");
            let message = body["message"].as_str().unwrap_or_default();
            assert!(
                message.contains("the Kubernetes API server cannot be reached"),
                "{message}"
            );
            refused_switch = true;
            // A command that changes something: refused with the same words; reads answer.
            let (status, body) = support::management(
                "POST",
                a.management,
                "/management/v1/deployments/chat-b/park",
                &token,
                None,
            )
            .await;
            assert_eq!(status, 503, "{body}");
            assert_eq!(body["code"], "unavailable", "{body}");
            assert!(
                body["message"]
                    .as_str()
                    .unwrap_or_default()
                    .contains("the Kubernetes API server cannot be reached"),
                "{body}"
            );
            refused_command = true;
            if !killed {
                // An engine that exits is still noticed (its status is written after).
                let (status, view) = support::management(
                    "GET",
                    a.management,
                    "/management/v1/deployments/chat-c",
                    &token,
                    None,
                )
                .await;
                assert_eq!(status, 200, "{view}");
                let pid = view["instances"][0]["pid"].as_u64().unwrap();
                let _ = std::process::Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
                killed = true;
            }
        }
        // The standby does not take over (it cannot reach the API server either; the test's
        // own client is not behind the proxy). NB: a standby does not listen on its inference
        // port, which an engine may have been given since.
        assert_eq!(
            lease_of(&client, ns).await,
            (Some("op-a".to_string()), transitions),
            "the Lease changed hands during the cut"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(refused_switch && refused_command && killed && black_holed);
    assert!(served >= 10, "only {served} requests during the cut");
    eprintln!(
        "{served} requests to the ready model answered 200 during a {:?} cut",
        timing.cut
    );
    // Stopped serving nothing: the leader is still running.
    let mut leader = a.process;
    assert!(matches!(leader.0.try_wait(), Ok(None)), "op-a exited");

    // Back: the same leader goes on, the status catches up, a switch works again.
    proxy.restore();
    let (status, body) = eventually("a switch to chat-a works again", t, || async {
        let (status, body) = chat(a.inference, "chat-a").await;
        (status == 200).then_some((status, body))
    })
    .await;
    assert_eq!(status, 200, "{body}");
    eventually("chat-c's engine exit in its status", t, || async {
        (state_of(&api, "chat-c").await == Some(InstanceState::Failed)).then_some(())
    })
    .await;
    eventually("chat-a ready in its status", t, || async {
        (state_of(&api, "chat-a").await == Some(InstanceState::Ready)).then_some(())
    })
    .await;
    let (holder, after) = lease_of(&client, ns).await;
    assert_eq!(holder.as_deref(), Some("op-a"));
    assert_eq!(after, transitions, "the Lease changed hands");
    assert!(matches!(leader.0.try_wait(), Ok(None)), "op-a exited");
    drop(b);
    drop(leader);
    drop(proxy);
    let _ = std::fs::remove_dir_all(dir);
}

/// Only the leader cut off: the standby takes the Lease over once it expires, fenced. The old
/// leader, held over, keeps serving its ready models; the new one serves them too, refuses to
/// park them, and switches a waiting request onto their memory only at the fence's end, by
/// which time the old leader has stopped serving (it stepped down at its last renewal + the
/// renew deadline + the hold-over). So no engine is parked while a leader forwards to it.
async fn fenced_takeover(client: Client, kubeconfig: &std::path::Path, ns: &str, timing: Timing) {
    let up = setup(&client, kubeconfig, ns, timing, false).await;
    let (a, b, answer) = (&up.a, &up.b, up.answer.clone());
    let t = Duration::from_secs(90);
    up.proxy.cut(Cut::Refuse);
    eventually("op-b takes the expired Lease over", t, || async {
        (lease_of(&client, ns).await.0.as_deref() == Some("op-b")).then_some(())
    })
    .await;
    let took = Instant::now();
    // The new leader serves the adopted model at once; a park of it is refused, naming the
    // fence.
    let (status, body) = eventually("op-b serves chat-b", t, || async {
        let body = serde_json::json!({"model": "chat-b",
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
        support::try_post_json(b.inference, "/v1/chat/completions", body)
            .await
            .ok()
            .filter(|(status, _)| *status == 200)
    })
    .await;
    assert_eq!((status, text_of(&body)), (200, answer.clone()), "{body}");
    let token_b = eventually("op-b's admin token", t, || async { b.admin_token() }).await;
    let (status, body) = support::management(
        "POST",
        b.management,
        "/management/v1/deployments/chat-b/park",
        &token_b,
        None,
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (503, Some("unavailable")),
        "{body}"
    );
    assert!(
        body["message"]
            .as_str()
            .unwrap_or_default()
            .contains("previous leader"),
        "{body}"
    );
    // The old leader, held over, still serves chat-b meanwhile.
    let (status, body) = chat(a.inference, "chat-b").await;
    assert_eq!((status, text_of(&body)), (200, answer), "{body}");
    // A request for chat-a needs chat-b's and chat-c's memory: it waits for the fence's end.
    let (status, body) = chat(b.inference, "chat-a").await;
    let switched = took.elapsed();
    assert_eq!(status, 200, "{body}");
    assert!(
        switched + Duration::from_secs(1) >= timing.holdover,
        "switched {switched:?} after the takeover, within the fence ({:?})",
        timing.holdover
    );
    // By then the old leader has stopped serving.
    assert!(
        support::try_post_json(a.inference, "/v1/chat/completions", serde_json::json!({}))
            .await
            .is_err(),
        "the old leader still serves after the fence"
    );
    let dir = up.dir.clone();
    drop(up);
    let _ = std::fs::remove_dir_all(dir);
}

/// The scenarios run one at a time (each runs operators, a node agent and engines).
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn against_a_fake_api_server_the_leader_serves_ready_models_through_a_cut_and_catches_up() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (dir, kubeconfig, client) = fake_api_server("k8s-apiserver-gone-fake").await;
    let timing = Timing {
        lease_duration: Duration::from_secs(6),
        renew_deadline: Duration::from_secs(4),
        retry_period: Duration::from_secs(1),
        holdover: Duration::from_secs(30),
        cut: Duration::from_secs(12),
    };
    apiserver_gone(client, &kubeconfig, "capyctl", timing).await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs cluster"]
async fn against_a_cluster_the_leader_serves_ready_models_through_a_60s_cut_and_catches_up() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (kubeconfig, ns) = cluster_namespace().await;
    // The chart's timing: 15 s, 10 s, 2 s, a hold-over of 90 s; the API server gone 60 s.
    let timing = Timing {
        lease_duration: Duration::from_secs(15),
        renew_deadline: Duration::from_secs(10),
        retry_period: Duration::from_secs(2),
        holdover: Duration::from_secs(90),
        cut: Duration::from_secs(60),
    };
    apiserver_gone(ns.client.clone(), &kubeconfig, &ns.name, timing).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn against_a_fake_api_server_a_standby_takes_over_from_a_cut_off_leader_fenced() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (dir, kubeconfig, client) = fake_api_server("k8s-fenced-takeover-fake").await;
    fenced_takeover(client, &kubeconfig, "capyctl", FENCE_TIMING).await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs cluster"]
async fn against_a_cluster_a_standby_takes_over_from_a_cut_off_leader_fenced() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (kubeconfig, ns) = cluster_namespace().await;
    fenced_takeover(ns.client.clone(), &kubeconfig, &ns.name, FENCE_TIMING).await;
}

/// Short election timing and a short hold-over (the fence lasts as long): the takeover comes
/// 6 s after the last renewal at the earliest, the fence ends 12 s after it.
const FENCE_TIMING: Timing = Timing {
    lease_duration: Duration::from_secs(6),
    renew_deadline: Duration::from_secs(4),
    retry_period: Duration::from_secs(1),
    holdover: Duration::from_secs(12),
    cut: Duration::ZERO,
};
