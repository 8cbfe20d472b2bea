//! The tenant watcher (`capyctl_operator::tenants`) against a real API server. Every test is
//! `#[ignore = "needs cluster"]` and runs when `CAPYCTL_TEST_KUBECONFIG` names a kubeconfig
//! whose user may manage CRDs and namespaces:
//!
//! ```sh
//! CAPYCTL_TEST_KUBECONFIG=~/.cache/capyctl-k8s/kubeconfig cargo test -p capyctl-operator --test k8s_tenants -- --ignored
//! ```
#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use capyctl_crds::tenant::{KeySecretRef, Tenant as TenantObject, TenantRateSpec, TenantSpec};
use capyctl_interfaces::tenants::{Tenant, TenantRate, TenantTable};
use capyctl_test_support::cluster::{self, TestNamespace};
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::api::{DeleteParams, PostParams};

/// A table that records every set it is given.
#[derive(Default)]
struct Recording {
    sets: Mutex<Vec<Vec<Tenant>>>,
    changed: tokio::sync::Notify,
}

impl TenantTable for Recording {
    fn replace(&self, tenants: Vec<Tenant>) -> Result<(), String> {
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
        key_secrets: vec![KeySecretRef {
            name: "team-a-keys".into(),
            key: "key-1".into(),
        }],
        models: Some(vec!["chat-*".into(), "support-bot".into()]),
        rate: Some(TenantRateSpec {
            requests_per_minute: Some(600),
            tokens_per_minute: Some(200_000),
        }),
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
    secrets
        .replace("team-a-keys", &post, &{
            let mut s = secrets.get("team-a-keys").await.unwrap();
            s.data = None;
            s.string_data = Some([("key-1".to_string(), "sk-team-a-2".to_string())].into());
            s
        })
        .await
        .unwrap();
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
