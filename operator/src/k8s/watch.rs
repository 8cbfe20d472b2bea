//! Which namespaces' `Deployment` objects the operator reconciles ([`Watch`]), and which
//! object serves a name that several namespaces use ([`Claims`]).
//!
//! The operator always watches its own namespace (the release namespace, `POD_NAMESPACE`);
//! `--watch-namespaces` / `CAPYCTL_WATCH_NAMESPACES` (the chart's `operator.watchNamespaces`)
//! adds a comma-separated list of namespaces, or `*` for every namespace. The chart's RBAC
//! follows the same value (a Role and RoleBinding per listed namespace; a ClusterRole and
//! ClusterRoleBinding for `*`), and the chart writes it on the management Service as the
//! annotation [`WATCH_ANNOTATION`], where `kubectl capyctl` reads it to say where models go.
//!
//! Names: the router routes by the body's `model`, which is the deployment's name, so one name
//! is served from one namespace. Of the objects with one name, the oldest
//! (`metadata.creationTimestamp`, then the namespace's name) holds it: the lifecycle runs its
//! spec, its status and Events say what happens. Every other object of that name is refused,
//! `Accepted=False` with reason [`REASON_NAME_TAKEN`] naming the holder, and changes nothing;
//! when the holder is deleted, the oldest remaining object takes the name. An object being
//! deleted keeps a name it holds (its finalizer stops the engines) but never takes one from an
//! object that is not being deleted.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, PoisonError};

use capyctl_crds::Deployment;
use k8s_openapi::jiff::Timestamp;
use kube::{Api, Client, ResourceExt};

/// The annotation on the management Service that says which namespaces the operator watches:
/// the namespaces, comma-separated, or `*` for every namespace.
pub const WATCH_ANNOTATION: &str = "capyctl.io/watch-namespaces";

/// The reason of `Accepted=False` on an object whose name another namespace's object holds.
pub const REASON_NAME_TAKEN: &str = "name_taken";

/// The namespaces whose `Deployment` objects the operator reconciles.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Watch {
    release: String,
    scope: Scope,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Scope {
    /// Every namespace.
    All,
    /// These (the release namespace among them).
    Listed(BTreeSet<String>),
}

/// Whether `s` is a namespace name (an RFC 1123 label: at most 63 lowercase letters, digits
/// and `-`, starting and ending with a letter or digit).
fn is_namespace_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

impl Watch {
    /// The release namespace alone.
    pub fn release_only(release: &str) -> Self {
        Self {
            release: release.to_string(),
            scope: Scope::Listed(BTreeSet::from([release.to_string()])),
        }
    }

    /// The release namespace and what `value` says (`--watch-namespaces`): empty for none
    /// more, namespaces separated by commas, or `*` for every namespace. `what` names the
    /// setting in the error.
    pub fn parse(release: &str, value: &str, what: &str) -> Result<Self, String> {
        let items: Vec<&str> = value
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        if items.contains(&"*") {
            if items.len() > 1 {
                return Err(format!(
                    "{what}: `{value}`: `*` (every namespace) cannot be combined with namespaces"
                ));
            }
            return Ok(Self {
                release: release.to_string(),
                scope: Scope::All,
            });
        }
        let mut listed = BTreeSet::from([release.to_string()]);
        for item in items {
            if !is_namespace_name(item) {
                return Err(format!(
                    "{what}: `{item}` is not a namespace name (lowercase letters, digits and '-', at most 63), nor `*`"
                ));
            }
            listed.insert(item.to_string());
        }
        Ok(Self {
            release: release.to_string(),
            scope: Scope::Listed(listed),
        })
    }

    /// The release namespace (the operator's own: engine Pods, Lease, node agents).
    pub fn release(&self) -> &str {
        &self.release
    }

    /// Whether the `Deployment` objects of `namespace` are reconciled.
    pub fn covers(&self, namespace: &str) -> bool {
        match &self.scope {
            Scope::All => true,
            Scope::Listed(l) => l.contains(namespace),
        }
    }

    /// `*`, or the namespaces comma-separated (as in [`WATCH_ANNOTATION`]).
    pub fn describe(&self) -> String {
        match &self.scope {
            Scope::All => "*".to_string(),
            Scope::Listed(l) => l.iter().cloned().collect::<Vec<_>>().join(","),
        }
    }

    /// The APIs to watch: every namespace's (one cluster-wide watch), or one per namespace.
    pub fn apis(&self, client: &Client) -> Vec<Api<Deployment>> {
        match &self.scope {
            Scope::All => vec![Api::all(client.clone())],
            Scope::Listed(l) => l
                .iter()
                .map(|ns| Api::namespaced(client.clone(), ns))
                .collect(),
        }
    }
}

/// One object of a name, as the claims know it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Known {
    created: Option<Timestamp>,
    deleting: bool,
}

impl Known {
    fn of(cr: &Deployment) -> Self {
        Self {
            created: cr.metadata.creation_timestamp.as_ref().map(|t| t.0),
            deleting: cr.metadata.deletion_timestamp.is_some(),
        }
    }
}

#[derive(Debug, Default)]
struct State {
    /// By name, by namespace.
    objects: BTreeMap<String, BTreeMap<String, Known>>,
    /// The namespace whose object holds each name.
    holders: BTreeMap<String, String>,
}

impl State {
    /// Applies the rule of the module doc to `name`; answers whether the holder changed.
    fn settle(&mut self, name: &str) -> bool {
        let objects = self.objects.get(name);
        let current = self
            .holders
            .get(name)
            .filter(|ns| objects.is_some_and(|o| o.contains_key(*ns)))
            .cloned();
        let key = |ns: &String, k: &Known| (k.created.is_none(), k.created, ns.clone());
        let oldest_live = objects.and_then(|o| {
            o.iter()
                .filter(|(_, k)| !k.deleting)
                .min_by_key(|(ns, k)| key(ns, k))
                .map(|(ns, k)| (ns.clone(), key(ns, k)))
        });
        let next = match (current.clone(), oldest_live) {
            (Some(c), Some((o, ok))) => {
                let ck = objects
                    .and_then(|obj| obj.get(&c))
                    .map(|k| key(&c, k))
                    .unwrap_or(ok.clone());
                if ok < ck { Some(o) } else { Some(c) }
            }
            (Some(c), None) => Some(c),
            (None, Some((o, _))) => Some(o),
            // Only objects being deleted: the oldest, so that its finalizer stops whatever
            // runs under the name (a leader that starts while the object is being deleted).
            (None, None) => objects.and_then(|o| {
                o.iter()
                    .min_by_key(|(ns, k)| key(ns, k))
                    .map(|(ns, _)| ns.clone())
            }),
        };
        let before = self.holders.get(name).cloned();
        match &next {
            Some(ns) => {
                self.holders.insert(name.to_string(), ns.clone());
            }
            None => {
                self.holders.remove(name);
            }
        }
        if self.objects.get(name).is_some_and(BTreeMap::is_empty) {
            self.objects.remove(name);
        }
        before != next
    }
}

/// Which object holds each deployment name (see the module doc).
#[derive(Debug, Default)]
pub struct Claims {
    state: Mutex<State>,
}

/// What [`Claims::observe`] says of an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// The namespace whose object holds the name.
    pub holder: Option<String>,
    /// Whether the holder changed (the other objects of the name are to be reconciled again).
    pub changed: bool,
}

impl Claim {
    /// Whether the object in `namespace` holds the name.
    pub fn holds(&self, namespace: &str) -> bool {
        self.holder.as_deref() == Some(namespace)
    }
}

fn namespace_of(cr: &Deployment) -> String {
    cr.namespace().unwrap_or_default()
}

impl Claims {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The claims of `crs` (a new leader's list of every watched namespace): each name is
    /// held by its oldest object not being deleted.
    pub fn seed<'a>(&self, crs: impl IntoIterator<Item = &'a Deployment>) {
        let mut state = self.state();
        let mut names = BTreeSet::new();
        for cr in crs {
            let name = cr.name_any();
            state
                .objects
                .entry(name.clone())
                .or_default()
                .insert(namespace_of(cr), Known::of(cr));
            names.insert(name);
        }
        for name in names {
            state.settle(&name);
        }
    }

    /// Records `cr` as it is now and answers who holds its name.
    pub fn observe(&self, cr: &Deployment) -> Claim {
        let name = cr.name_any();
        let mut state = self.state();
        state
            .objects
            .entry(name.clone())
            .or_default()
            .insert(namespace_of(cr), Known::of(cr));
        let changed = state.settle(&name);
        Claim {
            holder: state.holders.get(&name).cloned(),
            changed,
        }
    }

    /// Forgets the object `namespace/name` (gone from the API server); answers whether the
    /// holder of the name changed.
    pub fn forget(&self, namespace: &str, name: &str) -> bool {
        let mut state = self.state();
        if let Some(o) = state.objects.get_mut(name) {
            o.remove(namespace);
        }
        state.settle(name)
    }

    /// The namespace whose object holds `name`.
    pub fn holder(&self, name: &str) -> Option<String> {
        self.state().holders.get(name).cloned()
    }

    /// Whether `cr` holds its name.
    pub fn holds(&self, cr: &Deployment) -> bool {
        self.holder(&cr.name_any()).as_deref() == Some(namespace_of(cr).as_str())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn cr(ns: &str, name: &str, created: &str, deleting: bool) -> Deployment {
        let mut v = serde_json::json!({
            "apiVersion": "capyctl.io/v1alpha1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": ns, "uid": format!("{ns}-{name}"),
                         "creationTimestamp": created},
            "spec": {"engine": "vllm", "model": "m"},
        });
        if deleting {
            v["metadata"]["deletionTimestamp"] = "2026-12-04T10:00:00Z".into();
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn the_watch_value_is_the_release_namespace_and_a_list_or_all() {
        let w = Watch::parse("capyctl", "", "--watch-namespaces").unwrap();
        assert_eq!(w, Watch::release_only("capyctl"));
        assert_eq!(w.describe(), "capyctl");
        let w = Watch::parse("capyctl", " team-a, team-b ,team-a", "x").unwrap();
        assert_eq!(w.describe(), "capyctl,team-a,team-b");
        assert!(w.covers("team-b") && w.covers("capyctl") && !w.covers("team-c"));
        let all = Watch::parse("capyctl", "*", "x").unwrap();
        assert_eq!(all.describe(), "*");
        assert!(all.covers("anything"));
        let e = Watch::parse("capyctl", "*,team-a", "--watch-namespaces").unwrap_err();
        assert!(e.starts_with("--watch-namespaces: `*,team-a`: `*`"), "{e}");
        let e = Watch::parse("capyctl", "team-a,Team_B", "CAPYCTL_WATCH_NAMESPACES").unwrap_err();
        assert!(
            e.starts_with("CAPYCTL_WATCH_NAMESPACES: `Team_B` is not a namespace name"),
            "{e}"
        );
        assert!(Watch::parse("c", &"a".repeat(64), "x").is_err());
        assert!(Watch::parse("c", "-a", "x").is_err());
    }

    #[test]
    fn the_oldest_object_of_a_name_holds_it_and_the_next_takes_it_when_it_goes() {
        let claims = Claims::default();
        let a = cr("team-a", "chat", "2026-12-01T00:00:00Z", false);
        let b = cr("team-b", "chat", "2026-12-02T00:00:00Z", false);
        let c = cr("team-c", "chat", "2026-12-03T00:00:00Z", false);
        claims.seed([&c, &b]);
        assert_eq!(claims.holder("chat").as_deref(), Some("team-b"));
        // A younger object is refused; the holder stays.
        let seen = claims.observe(&c);
        assert_eq!(seen.holder.as_deref(), Some("team-b"));
        assert!(!seen.changed && !seen.holds("team-c"));
        // An older one (a namespace watched since, or a race of two creations) takes it.
        let seen = claims.observe(&a);
        assert!(seen.holds("team-a") && seen.changed);
        assert!(claims.holds(&a) && !claims.holds(&b));
        // Being deleted, the holder keeps it (its finalizer stops the engines) ...
        let a_deleting = cr("team-a", "chat", "2026-12-01T00:00:00Z", true);
        assert!(claims.observe(&a_deleting).holds("team-a"));
        // ... and once gone the oldest remaining object takes it.
        assert!(claims.forget("team-a", "chat"));
        assert_eq!(claims.holder("chat").as_deref(), Some("team-b"));
        // An object being deleted never takes a name from a live one.
        let b_deleting = cr("team-b", "chat", "2026-12-02T00:00:00Z", true);
        claims.observe(&b_deleting);
        assert!(claims.forget("team-b", "chat"));
        assert_eq!(claims.holder("chat").as_deref(), Some("team-c"));
        assert!(claims.forget("team-c", "chat"));
        assert_eq!(claims.holder("chat"), None);
        // Alone, it does: its finalizer must stop whatever runs under the name.
        let gone = cr("team-d", "chat", "2026-12-05T00:00:00Z", true);
        assert!(claims.observe(&gone).holds("team-d"));
        // Same creation second: the namespace's name decides.
        let claims = Claims::default();
        let x = cr("zeta", "m", "2026-12-01T00:00:00Z", false);
        let y = cr("alpha", "m", "2026-12-01T00:00:00Z", false);
        claims.seed([&x, &y]);
        assert_eq!(claims.holder("m").as_deref(), Some("alpha"));
    }
}
