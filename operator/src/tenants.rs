//! The tenants of the inference listener on Kubernetes (DESIGN 4.10): the `Tenant` objects of
//! one namespace and the Secrets their keys are in, watched, made into the whole tenant set and
//! handed to the router's key check ([`TenantTable::replace_requiring`]) on every change, so that a
//! rotated key works without a restart; and each object's `status` says whether it is in use.
//!
//! [`decide`] is the pure policy (objects and Secrets in, the set and each object's verdict
//! out); [`spawn`] runs the watches and writes. A tenant is left out of the set, its keys then
//! answered 401 like any unknown key, and nothing else changes, when:
//!
//! - its spec breaks a rule ([`TenantSpec::check`](capyctl_crds::tenant::TenantSpec::check),
//!   or a name that is not a DNS-1123 label): reason `Invalid`;
//! - a Secret it names does not exist: `SecretMissing`; the Secret has no such key, or the
//!   value is empty or not text: `KeyMissing`;
//! - one of its keys is another tenant's too (the older object, by `creationTimestamp` then
//!   name, keeps it) or given twice: `KeyRepeated`;
//! - the table refuses the set (a rule of its own): every tenant is `Refused` with its words,
//!   and the table keeps the set it had.
//!
//! Keys are asked for while any `Tenant` object exists, also when every one is left out (the
//! table is told `keys_required`): a Secret deleted makes its keys 401, never the listener
//! open to requests without a key. With no `Tenant` object no key is asked for.
//!
//! Key values are never logged nor written in a status: a status names the Secret and key.
//!
//! NB (decision): only the operator's own namespace is watched, also when it reconciles the
//! Deployment objects of other namespaces (`--watch-namespaces`). A Tenant is not scoped to its
//! namespace: it grants keys to the one inference listener, for every model unless it names
//! some, so the right to write one must not come with the right to deploy models in a team's
//! namespace; and the operator needs no Secret rights outside its own (the README, "Tenants on
//! Kubernetes").

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use capyctl_crds::tenant::{ACCEPTED, Tenant as TenantObject, TenantStatus};
use capyctl_interfaces::tenants::{Tenant, TenantRate, TenantTable};
use futures_util::StreamExt as _;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, ResourceExt};

use crate::FIELD_MANAGER;

/// The longest key, in bytes (what a client can send as `Authorization: Bearer <key>`).
const MAX_KEY_BYTES: usize = 4096;

/// Why a tenant is or is not in use: the `Accepted` condition's reason and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Whether its keys are in the set.
    pub accepted: bool,
    /// The condition's reason (`KeysLoaded`, `Invalid`, `SecretMissing`, `KeyMissing`,
    /// `KeyRepeated`, `Refused`).
    pub reason: &'static str,
    /// What the condition says.
    pub message: String,
    /// Its keys in the set.
    pub keys: u32,
}

impl Verdict {
    fn refused(reason: &'static str, message: String) -> Self {
        Self {
            accepted: false,
            reason,
            message: format!("{message}; its keys are not accepted (401)"),
            keys: 0,
        }
    }
}

/// The tenant set of the `objects` (by name) with the Secrets of their namespace (by name),
/// and each object's verdict (by name). Pure: see the module's doc for the rules.
pub fn decide(
    objects: &BTreeMap<String, TenantObject>,
    secrets: &BTreeMap<String, Secret>,
) -> (Vec<Tenant>, BTreeMap<String, Verdict>) {
    // The older object keeps a key two objects give.
    let mut order: Vec<&TenantObject> = objects.values().collect();
    order.sort_by_key(|o| {
        (
            o.metadata.creation_timestamp.as_ref().map(|t| t.0),
            o.name_any(),
        )
    });
    let mut owners: HashMap<String, String> = HashMap::new();
    let mut set = Vec::new();
    let mut verdicts = BTreeMap::new();
    for o in order {
        let name = o.name_any();
        match tenant_of(o, secrets, &owners) {
            Ok(t) => {
                for k in &t.keys {
                    owners.insert(k.clone(), name.clone());
                }
                verdicts.insert(
                    name,
                    Verdict {
                        accepted: true,
                        reason: "KeysLoaded",
                        message: format!("{} key(s) in use", t.keys.len()),
                        keys: u32::try_from(t.keys.len()).unwrap_or(u32::MAX),
                    },
                );
                set.push(t);
            }
            Err(v) => {
                verdicts.insert(name, v);
            }
        }
    }
    (set, verdicts)
}

/// One object as a tenant, its keys read from `secrets`; `owners` are the keys taken by the
/// tenants decided before it.
fn tenant_of(
    o: &TenantObject,
    secrets: &BTreeMap<String, Secret>,
    owners: &HashMap<String, String>,
) -> Result<Tenant, Verdict> {
    let name = o.name_any();
    if !capyctl_spec::documents::is_dns_label(&name) {
        return Err(Verdict::refused(
            "Invalid",
            format!("metadata.name: `{name}` is not a tenant name (a DNS-1123 label)"),
        ));
    }
    o.spec.check().map_err(|e| Verdict::refused("Invalid", e))?;
    let mut keys: Vec<String> = Vec::with_capacity(o.spec.key_secrets.len());
    for (i, r) in o.spec.key_secrets.iter().enumerate() {
        let at = format!("spec.keySecrets[{i}]");
        let Some(secret) = secrets.get(&r.name) else {
            return Err(Verdict::refused(
                "SecretMissing",
                format!("{at}: Secret {} does not exist", r.name),
            ));
        };
        let value = secret
            .data
            .as_ref()
            .and_then(|d| d.get(&r.key))
            .map(|b| b.0.as_slice())
            .or_else(|| {
                secret
                    .string_data
                    .as_ref()
                    .and_then(|d| d.get(&r.key))
                    .map(|s| s.as_bytes())
            });
        let Some(value) = value else {
            return Err(Verdict::refused(
                "KeyMissing",
                format!("{at}: Secret {} has no key {}", r.name, r.key),
            ));
        };
        let key = match std::str::from_utf8(value) {
            Ok(text)
                if text.trim().len() > MAX_KEY_BYTES
                    || !text.trim().bytes().all(|b| b.is_ascii_graphic()) =>
            {
                return Err(Verdict::refused(
                    "KeyMissing",
                    format!(
                        "{at}: key {} of Secret {} is not an API key (up to {MAX_KEY_BYTES} visible ASCII characters)",
                        r.key, r.name
                    ),
                ));
            }
            Ok(text) if !text.trim().is_empty() => text.trim().to_string(),
            Ok(_) => {
                return Err(Verdict::refused(
                    "KeyMissing",
                    format!("{at}: key {} of Secret {} is empty", r.key, r.name),
                ));
            }
            Err(_) => {
                return Err(Verdict::refused(
                    "KeyMissing",
                    format!("{at}: key {} of Secret {} is not text", r.key, r.name),
                ));
            }
        };
        if let Some(other) = owners.get(&key) {
            return Err(Verdict::refused(
                "KeyRepeated",
                format!(
                    "{at}: the key in Secret {} is also a key of tenant {other} (a key names one tenant)",
                    r.name
                ),
            ));
        }
        if keys.contains(&key) {
            return Err(Verdict::refused(
                "KeyRepeated",
                format!(
                    "{at}: the key in Secret {} is given twice in this tenant",
                    r.name
                ),
            ));
        }
        keys.push(key);
    }
    Ok(Tenant {
        name,
        keys,
        models: o.spec.models.clone(),
        rate: o.spec.rate.map(|r| TenantRate {
            requests_per_minute: r
                .requests_per_minute
                .map(|n| u32::try_from(n).unwrap_or(u32::MAX)),
            tokens_per_minute: r.tokens_per_minute,
        }),
    })
}

/// The status an object with `verdict` should show, keeping the transition time of a
/// condition that did not change.
fn status_of(o: &TenantObject, v: &Verdict) -> TenantStatus {
    let status = if v.accepted { "True" } else { "False" };
    let old = o
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == ACCEPTED));
    let since = old
        .filter(|c| c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or_else(|| Time(Timestamp::now()));
    TenantStatus {
        keys: Some(v.keys),
        conditions: vec![Condition {
            type_: ACCEPTED.to_string(),
            status: status.to_string(),
            reason: v.reason.to_string(),
            message: v.message.clone(),
            last_transition_time: since,
            observed_generation: o.metadata.generation,
        }],
        observed_generation: o.metadata.generation,
    }
}

/// Whether `o` shows `want` already (the transition time aside).
fn shows(o: &TenantObject, want: &TenantStatus) -> bool {
    let Some(have) = &o.status else {
        return false;
    };
    let same = |a: &Condition, b: &Condition| {
        (
            &a.type_,
            &a.status,
            &a.reason,
            &a.message,
            a.observed_generation,
        ) == (
            &b.type_,
            &b.status,
            &b.reason,
            &b.message,
            b.observed_generation,
        )
    };
    have.keys == want.keys
        && have.observed_generation == want.observed_generation
        && have.conditions.len() == want.conditions.len()
        && have
            .conditions
            .iter()
            .zip(&want.conditions)
            .all(|(a, b)| same(a, b))
}

/// One watched kind's objects by name: the list being read (between `Init` and `InitDone`)
/// replaces the known ones when it is whole.
struct Known<K> {
    objects: BTreeMap<String, K>,
    relisting: Option<BTreeMap<String, K>>,
    listed: bool,
}

impl<K: kube::Resource> Known<K> {
    fn new() -> Self {
        Self {
            objects: BTreeMap::new(),
            relisting: None,
            listed: false,
        }
    }

    /// Takes `event` in; whether the known objects changed.
    fn take(&mut self, event: Event<K>) -> bool {
        match event {
            Event::Init => {
                self.relisting = Some(BTreeMap::new());
                false
            }
            Event::InitApply(o) => {
                let name = o.meta().name.clone().unwrap_or_default();
                self.relisting
                    .get_or_insert_with(BTreeMap::new)
                    .insert(name, o);
                false
            }
            Event::InitDone => {
                self.objects = self.relisting.take().unwrap_or_default();
                self.listed = true;
                true
            }
            Event::Apply(o) => {
                let name = o.meta().name.clone().unwrap_or_default();
                self.objects.insert(name, o);
                true
            }
            Event::Delete(o) => {
                let name = o.meta().name.clone().unwrap_or_default();
                self.objects.remove(&name).is_some()
            }
        }
    }
}

/// Whether a watch error is the API server's 404 for a resource it does not serve (the CRD is
/// not installed).
fn crd_missing(e: &watcher::Error) -> bool {
    matches!(
        e,
        watcher::Error::InitialListFailed(kube::Error::Api(r))
            | watcher::Error::WatchStartFailed(kube::Error::Api(r))
            if r.code == 404
    )
}

/// The watcher [`spawn`] started: it runs until this is dropped.
#[derive(Debug)]
pub struct TenantWatch {
    task: tokio::task::JoinHandle<()>,
    /// Turns `true` once the first whole set (both lists read) has been handed to the table.
    synced: tokio::sync::watch::Receiver<bool>,
}

impl TenantWatch {
    /// Resolves once the table has had the first whole tenant set ([`spawn`]'s lists of the
    /// `Tenant` objects and their Secrets both read): before that, a listener fed by the table
    /// would serve without asking for keys.
    pub async fn synced(&mut self) {
        let _ = self.synced.wait_for(|s| *s).await;
    }
}

impl Drop for TenantWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Watches the `Tenant` objects of `namespace` and the Secrets there, and on every change hands
/// the whole tenant set to `table` (only when it changed) and writes each object's `status`
/// where it differs; until the answer is dropped. A failed watch is retried with backoff, a
/// failed status write at the next change.
pub fn spawn(client: Client, namespace: &str, table: Arc<dyn TenantTable>) -> TenantWatch {
    let tenants: Api<TenantObject> = Api::namespaced(client.clone(), namespace);
    let secrets: Api<Secret> = Api::namespaced(client, namespace);
    let (synced_tx, synced) = tokio::sync::watch::channel(false);
    TenantWatch {
        task: tokio::spawn(run(tenants, secrets, table, synced_tx)),
        synced,
    }
}

async fn run(
    tenants: Api<TenantObject>,
    secrets: Api<Secret>,
    table: Arc<dyn TenantTable>,
    synced: tokio::sync::watch::Sender<bool>,
) {
    let config = watcher::Config::default();
    let mut tenant_events = watcher::watcher(tenants.clone(), config.clone())
        .default_backoff()
        .boxed();
    let mut secret_events = watcher::watcher(secrets, config).default_backoff().boxed();
    let mut objects = Known::<TenantObject>::new();
    let mut known_secrets = Known::<Secret>::new();
    // The set handed to the table, and whether keys are asked for (any Tenant object).
    let mut applied: Option<(Vec<Tenant>, bool)> = None;
    loop {
        let changed = tokio::select! {
            e = tenant_events.next() => match e {
                Some(Ok(e)) => objects.take(e),
                Some(Err(e)) if crd_missing(&e) && !objects.listed => {
                    // A chart upgraded in place keeps its old CRDs (Helm installs `crds/` only
                    // once): without the Tenant CRD there can be no tenant, which is what an
                    // empty list says; the watch goes on and finds them once it is applied.
                    tracing::warn!("the Tenant CRD is not installed: no tenants (apply the chart's crds/tenants.capyctl.io.yaml to use them)");
                    objects.listed = true;
                    true
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "watching the Tenant objects failed; retrying");
                    false
                }
                None => return,
            },
            e = secret_events.next() => match e {
                Some(Ok(e)) => known_secrets.take(e),
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "watching the Secrets of the tenants failed; retrying");
                    false
                }
                None => return,
            },
        };
        if !changed || !objects.listed || !known_secrets.listed {
            continue;
        }
        let (set, mut verdicts) = decide(&objects.objects, &known_secrets.objects);
        // A Tenant object left out (its Secret missing, ...) still means keys are asked for:
        // its keys get 401 and the listener never falls open to requests without a key.
        let required = !objects.objects.is_empty();
        let next = (set, required);
        if applied.as_ref() != Some(&next) {
            match table.replace_requiring(next.0.clone(), required) {
                Ok(()) => {
                    tracing::info!(
                        tenants = next.0.len(),
                        keys_required = required,
                        "the tenant set changed"
                    );
                    applied = Some(next);
                }
                Err(why) => {
                    tracing::warn!(error = %why, "the router refused the tenant set; it keeps the one it had");
                    for v in verdicts.values_mut() {
                        *v = Verdict::refused(
                            "Refused",
                            format!("the tenant set was refused: {why}"),
                        );
                    }
                }
            }
        }
        synced.send_replace(true);
        for (name, v) in &verdicts {
            let Some(o) = objects.objects.get(name) else {
                continue;
            };
            let want = status_of(o, v);
            if shows(o, &want) {
                continue;
            }
            let body = serde_json::json!({
                "apiVersion": capyctl_crds::API_VERSION,
                "kind": "Tenant",
                "status": want,
            });
            let params = PatchParams::apply(FIELD_MANAGER).force();
            if let Err(e) = tenants
                .patch_status(name, &params, &Patch::Apply(body))
                .await
            {
                tracing::warn!(tenant = %name, error = %e, "writing a Tenant's status failed; retried at the next change");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use capyctl_crds::tenant::{KeySecretRef, TenantSpec};
    use k8s_openapi::ByteString;

    #[test]
    fn only_a_404_says_the_crd_is_missing() {
        let api = |code| {
            kube::Error::Api(
                kube::core::Status::failure("x", "NotFound")
                    .with_code(code)
                    .boxed(),
            )
        };
        assert!(crd_missing(&watcher::Error::InitialListFailed(api(404))));
        assert!(crd_missing(&watcher::Error::WatchStartFailed(api(404))));
        assert!(!crd_missing(&watcher::Error::InitialListFailed(api(403))));
        assert!(!crd_missing(&watcher::Error::InitialListFailed(api(500))));
    }

    fn object(name: &str, secrets: &[(&str, &str)], created_s: i64) -> TenantObject {
        let mut o = TenantObject::new(
            name,
            TenantSpec {
                key_secrets: secrets
                    .iter()
                    .map(|(n, k)| KeySecretRef {
                        name: (*n).into(),
                        key: (*k).into(),
                    })
                    .collect(),
                models: Some(vec!["chat-*".into()]),
                rate: None,
            },
        );
        o.metadata.creation_timestamp = Some(Time(Timestamp::from_second(created_s).unwrap()));
        o
    }

    fn secret(name: &str, data: &[(&str, &str)]) -> (String, Secret) {
        let mut s = Secret::default();
        s.metadata.name = Some(name.into());
        s.data = Some(
            data.iter()
                .map(|(k, v)| ((*k).to_string(), ByteString(v.as_bytes().to_vec())))
                .collect(),
        );
        (name.to_string(), s)
    }

    #[test]
    fn the_set_leaves_out_what_cannot_be_read_and_says_why() {
        let objects: BTreeMap<String, TenantObject> = [
            object("team-a", &[("a-keys", "k1"), ("a-keys", "k2")], 10),
            object("team-b", &[("missing", "k")], 11),
            object("team-c", &[("a-keys", "k1")], 12),
            object("team-d", &[("d-keys", "nope")], 13),
            object("team-e", &[("d-keys", "blank")], 14),
            object("team-h", &[("d-keys", "spaced")], 17),
        ]
        .into_iter()
        .map(|o| (o.name_any(), o))
        .collect();
        let secrets: BTreeMap<String, Secret> = [
            secret("a-keys", &[("k1", "sk-a-1\n"), ("k2", "sk-a-2")]),
            secret("d-keys", &[("blank", " \n"), ("spaced", "sk a")]),
        ]
        .into_iter()
        .collect();
        let (set, verdicts) = decide(&objects, &secrets);
        assert_eq!(set.len(), 1);
        assert_eq!(set[0].name, "team-a");
        assert_eq!(set[0].keys, ["sk-a-1", "sk-a-2"], "trimmed");
        assert_eq!(set[0].models.as_deref(), Some(&["chat-*".to_string()][..]));
        assert!(verdicts["team-a"].accepted);
        assert_eq!(verdicts["team-a"].keys, 2);
        let why = |n: &str| (verdicts[n].reason, verdicts[n].message.clone());
        assert_eq!(
            why("team-b"),
            (
                "SecretMissing",
                "spec.keySecrets[0]: Secret missing does not exist; its keys are not accepted (401)"
                    .into()
            )
        );
        assert_eq!(why("team-c").0, "KeyRepeated");
        assert!(why("team-c").1.contains("also a key of tenant team-a"));
        assert!(!why("team-c").1.contains("sk-a"), "never the key");
        assert_eq!(why("team-d").0, "KeyMissing");
        assert!(why("team-d").1.contains("Secret d-keys has no key nope"));
        assert_eq!(why("team-e").0, "KeyMissing");
        assert!(why("team-e").1.contains("is empty"));
        assert!(
            why("team-h").1.contains("is not an API key"),
            "{:?}",
            why("team-h")
        );
        // A bad spec is named; a key given twice within one tenant too.
        let mut bad = object("team-f", &[("a-keys", "k1")], 15);
        bad.spec.models = Some(vec![]);
        let twice = object("team-g", &[("g", "k"), ("g", "k")], 16);
        let objects: BTreeMap<String, TenantObject> = [bad, twice]
            .into_iter()
            .map(|o| (o.name_any(), o))
            .collect();
        let secrets: BTreeMap<String, Secret> =
            [secret("a-keys", &[("k1", "x")]), secret("g", &[("k", "y")])]
                .into_iter()
                .collect();
        let (set, verdicts) = decide(&objects, &secrets);
        assert!(set.is_empty());
        assert_eq!(verdicts["team-f"].reason, "Invalid");
        assert!(
            verdicts["team-f"]
                .message
                .starts_with("spec.models: names no model")
        );
        assert_eq!(verdicts["team-g"].reason, "KeyRepeated");
    }
}
