//! Tenants on Kubernetes (DESIGN 4.10):
//!
//! - the tenant watcher (`capyctl_operator::tenants`) against a real API server, with a table
//!   that records what it is given;
//! - end to end through the operator's inference listener: `capyctl-operator` out of cluster, a
//!   node agent (process runtime) whose engines are the engine simulator, a `Tenant` whose key
//!   is in a Secret; the key is served, no key is 401, a model the tenant may not use 404; the
//!   Secret's key rotated: the new key served, the old 401, nothing restarted; the Secret
//!   deleted: 401, and the Tenant's status says `SecretMissing`. Against the in-process fake
//!   API server (always) and a real one.
//!
//! The real API server's tests are `#[ignore = "needs cluster"]` and run when
//! `CAPYCTL_TEST_KUBECONFIG` names a kubeconfig whose user may manage CRDs and namespaces:
//!
//! ```sh
//! CAPYCTL_TEST_KUBECONFIG=~/.cache/capyctl-k8s/kubeconfig cargo test -p capyctl-operator --test k8s_tenants -- --ignored
//! ```
#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use capyctl_crds::Deployment;
use capyctl_crds::tenant::{KeySecretRef, Tenant as TenantObject, TenantRateSpec, TenantSpec};
use capyctl_interfaces::tenants::{Tenant, TenantRate, TenantTable};
use capyctl_spec::InstanceState;
use capyctl_test_support::cluster::{self, TestNamespace};
use capyctl_test_support::harness as support;
use capyctl_test_support::operator_e2e::{
    chat_as, cluster_namespace, eventually, fake_api_server, model_cr, start_node_agent,
    start_operator, state_of,
};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client};

/// A table that records every set it is given.
#[derive(Default)]
struct Recording {
    sets: Mutex<Vec<Vec<Tenant>>>,
    changed: tokio::sync::Notify,
}

impl TenantTable for Recording {
    fn replace_requiring(&self, tenants: Vec<Tenant>, keys_required: bool) -> Result<(), String> {
        // Every set handed over while a Tenant object exists asks for keys.
        assert!(keys_required, "{tenants:?}");
        self.sets.lock().unwrap().push(tenants);
        self.changed.notify_waiters();
        Ok(())
    }
}

impl Recording {
    /// Waits (30 s at most) until the latest set satisfies `pred`; that set.
    async fn until(&self, what: &str, pred: impl Fn(&[Tenant]) -> bool) -> Vec<Tenant> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let notified = self.changed.notified();
            if let Some(last) = self.sets.lock().unwrap().last()
                && pred(last)
            {
                return last.clone();
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            assert!(
                tokio::time::timeout(left, notified).await.is_ok(),
                "the table never got {what}: {:?}",
                self.sets.lock().unwrap().last()
            );
        }
    }
}

fn secret(name: &str, key: &str, value: &str) -> Secret {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "stringData": {key: value},
    }))
    .unwrap()
}

/// team-a's spec: its key in Secret `team-a-keys` (key `key-1`), the models `models`, no rate.
fn team_a(models: &[&str]) -> TenantSpec {
    TenantSpec {
        key_secrets: vec![KeySecretRef {
            name: "team-a-keys".into(),
            key: "key-1".into(),
        }],
        models: Some(models.iter().map(|m| (*m).to_string()).collect()),
        rate: None,
    }
}

fn keys_of<'a>(set: &'a [Tenant], name: &str) -> Option<&'a [String]> {
    set.iter()
        .find(|t| t.name == name)
        .map(|t| t.keys.as_slice())
}

/// Waits (30 s at most) until `name`'s `Accepted` condition has `status` and `reason`; its
/// message.
async fn accepted(api: &Api<TenantObject>, name: &str, status: &str, reason: &str) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let o = api.get(name).await.unwrap();
        let c = o
            .status
            .as_ref()
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Accepted"));
        if let Some(c) = c
            && c.status == status
            && c.reason == reason
        {
            return c.message.clone();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{name} never Accepted={status} ({reason}): {:?}",
            o.status
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A Tenant and its Secret give the table the key; rotating the Secret's value replaces it
/// (no restart); deleting the Secret leaves the tenant out and its status says why; a second
/// Tenant with the same key is left out while the first keeps it; the API server refuses a
/// rate of 0 naming the field.
#[tokio::test]
#[ignore = "needs cluster"]
async fn tenants_follow_their_objects_and_secrets() {
    let (kubeconfig, client) = cluster::cluster().await;
    cluster::install_crds(&client).await;
    let ns = TestNamespace::create(&kubeconfig, &client, "capyctl-tenants").await;
    let tenants: Api<TenantObject> = ns.api();
    let secrets: Api<Secret> = ns.api();
    let post = PostParams::default();

    secrets
        .create(&post, &secret("team-a-keys", "key-1", "sk-team-a-1\n"))
        .await
        .unwrap();
    let spec = TenantSpec {
        rate: Some(TenantRateSpec {
            requests_per_minute: Some(600),
            tokens_per_minute: Some(200_000),
        }),
        ..team_a(&["chat-*", "support-bot"])
    };
    tenants
        .create(&post, &TenantObject::new("team-a", spec.clone()))
        .await
        .unwrap();

    let table = Arc::new(Recording::default());
    let watcher = capyctl_operator::tenants::spawn(
        client.clone(),
        &ns.name,
        Arc::clone(&table) as Arc<dyn TenantTable>,
    );

    let set = table
        .until("team-a's key", |s| {
            keys_of(s, "team-a") == Some(&["sk-team-a-1".to_string()][..])
        })
        .await;
    assert_eq!(
        set,
        vec![Tenant {
            name: "team-a".into(),
            keys: vec!["sk-team-a-1".into()],
            models: Some(vec!["chat-*".into(), "support-bot".into()]),
            rate: Some(TenantRate {
                requests_per_minute: Some(600),
                tokens_per_minute: Some(200_000),
            }),
        }]
    );
    accepted(&tenants, "team-a", "True", "KeysLoaded").await;
    assert_eq!(
        tenants.get("team-a").await.unwrap().status.unwrap().keys,
        Some(1)
    );

    // Rotation: the Secret's value changes; the new key replaces the old one.
    rotate(&secrets, "team-a-keys", "key-1", "sk-team-a-2").await;
    table
        .until("the rotated key", |s| {
            keys_of(s, "team-a") == Some(&["sk-team-a-2".to_string()][..])
        })
        .await;

    // A second tenant naming the same key is left out; the first keeps it.
    tenants
        .create(&post, &TenantObject::new("team-b", spec.clone()))
        .await
        .unwrap();
    let message = accepted(&tenants, "team-b", "False", "KeyRepeated").await;
    assert!(message.contains("also a key of tenant team-a"), "{message}");
    assert!(!message.contains("sk-team"), "never the key: {message}");
    let last = table.sets.lock().unwrap().last().cloned().unwrap();
    assert_eq!(last.len(), 1, "{last:?}");
    tenants
        .delete("team-b", &DeleteParams::default())
        .await
        .unwrap();

    // The Secret deleted: team-a is left out (its keys get 401), and its status says why.
    secrets
        .delete("team-a-keys", &DeleteParams::default())
        .await
        .unwrap();
    table
        .until("team-a left out", |s| keys_of(s, "team-a").is_none())
        .await;
    let message = accepted(&tenants, "team-a", "False", "SecretMissing").await;
    assert_eq!(
        message,
        "spec.keySecrets[0]: Secret team-a-keys does not exist; its keys are not accepted (401)"
    );
    // Back again: accepted again, without a restart.
    secrets
        .create(&post, &secret("team-a-keys", "key-1", "sk-team-a-3"))
        .await
        .unwrap();
    table
        .until("the key back", |s| {
            keys_of(s, "team-a") == Some(&["sk-team-a-3".to_string()][..])
        })
        .await;
    accepted(&tenants, "team-a", "True", "KeysLoaded").await;

    // A field the schema lets through but the rules do not: named in the status, left out,
    // and nothing else changes.
    let mut empty = spec.clone();
    empty.models = Some(Vec::new());
    tenants
        .create(&post, &TenantObject::new("team-d", empty))
        .await
        .unwrap();
    let message = accepted(&tenants, "team-d", "False", "Invalid").await;
    assert!(
        message.starts_with("spec.models: names no model"),
        "{message}"
    );
    let last = table.sets.lock().unwrap().last().cloned().unwrap();
    assert_eq!(
        last.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(),
        ["team-a"]
    );

    // Bad fields are refused by the API server, naming them.
    let mut bad = spec;
    bad.rate = Some(TenantRateSpec {
        requests_per_minute: Some(0),
        tokens_per_minute: None,
    });
    let e = tenants
        .create(&post, &TenantObject::new("team-c", bad))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("spec.rate.requestsPerMinute"), "{e}");

    drop(watcher);
}

/// Replaces the value of key `key` of Secret `name` with `value` (a rotation).
async fn rotate(secrets: &Api<Secret>, name: &str, key: &str, value: &str) {
    let mut s = secrets.get(name).await.unwrap();
    s.data = None;
    s.string_data = Some([(key.to_string(), value.to_string())].into());
    secrets
        .replace(name, &PostParams::default(), &s)
        .await
        .unwrap();
}

/// The error code of an error answer.
fn code(body: &serde_json::Value) -> &str {
    body["code"].as_str().unwrap_or_default()
}

/// The tenant scenario through the operator's inference listener, in namespace `ns` of the API
/// server of `kubeconfig` (`client`); see the module doc.
async fn keys_through_the_listener(client: Client, kubeconfig: &std::path::Path, ns: &str) {
    let dir = support::temp_dir("k8s-tenant-keys");
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    let tenants: Api<TenantObject> = Api::namespaced(client.clone(), ns);
    let post = PostParams::default();
    secrets
        .create(&post, &secret("team-a-keys", "key-1", "sk-team-a-1\n"))
        .await
        .unwrap();
    let spec = team_a(&["chat-*"]);
    tenants
        .create(&post, &TenantObject::new("team-a", spec))
        .await
        .unwrap();

    let (_agent, agent_port) = start_node_agent(&dir);
    let (mut operator, inference) = start_operator(&dir, kubeconfig, ns, "op-tenants", agent_port);
    let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
    for name in ["chat-a", "other-b"] {
        api.create(&post, &model_cr(ns, name)).await.unwrap();
    }
    let t = Duration::from_secs(60);
    for name in ["chat-a", "other-b"] {
        eventually(&format!("{name} deployed"), t, || async {
            api.get(name).await.ok()?.status?.deployment_id.map(|_| ())
        })
        .await;
    }
    // The leader serves once it has read the Tenants and their Secrets whole: the key is
    // asked for from the first request on.
    let (status, body) = eventually("the inference listener serving", t, || async {
        let body = serde_json::json!({"model": "chat-a",
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
        let asked = support::try_post_json(inference, "/v1/chat/completions", body);
        // (Bound but not serving yet: the listener waits for the Tenants.)
        tokio::time::timeout(Duration::from_secs(10), asked)
            .await
            .ok()?
            .ok()
    })
    .await;
    assert_eq!((status, code(&body)), (401, "unauthorized"), "{body}");
    accepted(&tenants, "team-a", "True", "KeysLoaded").await;

    // The key is served; without one, or with a wrong one, 401; a model the tenant may not
    // use, 404 as for one that does not exist, and nothing is started for it.
    let (status, body) = chat_as(inference, Some("sk-team-a-1"), "chat-a").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["model"], "chat-a", "{body}");
    for key in [None, Some("sk-team-a-2"), Some("sk-team-a-1x")] {
        let (status, body) = chat_as(inference, key, "chat-a").await;
        assert_eq!(
            (status, code(&body)),
            (401, "unauthorized"),
            "{key:?}: {body}"
        );
    }
    let (status, body) = chat_as(inference, Some("sk-team-a-1"), "other-b").await;
    assert_eq!((status, code(&body)), (404, "model_not_found"), "{body}");
    let (status, body) = chat_as(inference, Some("sk-team-a-1"), "no-such-model").await;
    assert_eq!((status, code(&body)), (404, "model_not_found"), "{body}");
    assert_eq!(
        state_of(&api, "other-b").await,
        Some(InstanceState::Stopped),
        "a model the tenant may not use is not started"
    );

    // Rotation: the Secret's value changes; the new key is served, the old one is 401, and
    // the operator serves on (the same process; the model's engine not restarted).
    let rotated = std::time::Instant::now();
    rotate(&secrets, "team-a-keys", "key-1", "sk-team-a-2").await;
    let (status, body) = eventually("the rotated key served", t, || async {
        let (status, body) = chat_as(inference, Some("sk-team-a-2"), "chat-a").await;
        (status != 401).then_some((status, body))
    })
    .await;
    assert_eq!(status, 200, "{body}");
    eprintln!(
        "the rotated key served {:?} after the Secret's update",
        rotated.elapsed()
    );
    let (status, body) = chat_as(inference, Some("sk-team-a-1"), "chat-a").await;
    assert_eq!((status, code(&body)), (401, "unauthorized"), "{body}");
    assert!(
        matches!(operator.0.try_wait(), Ok(None)),
        "the operator was not restarted"
    );
    let st = api.get("chat-a").await.unwrap().status.unwrap();
    assert_eq!(
        st.instances[0].generation, 1,
        "the engine was not restarted"
    );
    accepted(&tenants, "team-a", "True", "KeysLoaded").await;

    // The Secret deleted: its key is 401 like any unknown key, and the Tenant says why.
    secrets
        .delete("team-a-keys", &DeleteParams::default())
        .await
        .unwrap();
    eventually("the key of a deleted Secret refused", t, || async {
        let (status, body) = chat_as(inference, Some("sk-team-a-2"), "chat-a").await;
        (status == 401 && code(&body) == "unauthorized").then_some(())
    })
    .await;
    // The one Tenant left out: keys are still asked for (the listener never falls open).
    for key in [None, Some("sk-team-a-1")] {
        let (status, body) = chat_as(inference, key, "chat-a").await;
        assert_eq!(
            (status, code(&body)),
            (401, "unauthorized"),
            "{key:?}: {body}"
        );
    }
    let message = accepted(&tenants, "team-a", "False", "SecretMissing").await;
    assert!(
        message.contains("Secret team-a-keys does not exist"),
        "{message}"
    );
    assert!(!message.contains("sk-team"), "never the key: {message}");
    drop(operator);
    drop(_agent);
    let _ = std::fs::remove_dir_all(dir);
}

/// The operator's scenarios run one at a time (an operator, a node agent and engines each).
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn against_a_fake_api_server_a_rotated_secret_key_is_served_without_a_restart() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (dir, kubeconfig, client) = fake_api_server("k8s-tenant-keys-fake").await;
    keys_through_the_listener(client, &kubeconfig, "capyctl").await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs cluster"]
async fn against_a_cluster_a_rotated_secret_key_is_served_without_a_restart() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (kubeconfig, ns) = cluster_namespace().await;
    keys_through_the_listener(ns.client.clone(), &kubeconfig, &ns.name).await;
}
