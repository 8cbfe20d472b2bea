//! The chart's RBAC against a real API server (`#[ignore = "needs cluster"]`; runs when
//! `CAPYCTL_TEST_KUBECONFIG` names a kubeconfig whose user may manage RBAC and impersonate):
//!
//! ```sh
//! CAPYCTL_TEST_KUBECONFIG=~/.kube/config cargo test -p capyctl-operator --test k8s_rbac -- --ignored
//! ```
//!
//! `k8s_rbac.yaml` beside this file is the RBAC the chart renders with its default values
//! (`scripts/helm-lint.sh` renders it with Helm's library and fails when the file drifts). The
//! test applies it in a namespace of its own (cluster-scoped names suffixed with it), then asks
//! the API server, impersonating each ServiceAccount (`Config.auth_info.impersonate`), with
//! `SelfSubjectAccessReview`s whether it may do each call the binaries make, and that it may
//! not do what they must not (a node agent deleting Pods, anyone reading Secrets, ...); and
//! makes one refused call for real.
#![allow(clippy::unwrap_used)]

use capyctl_test_support::cluster;

use cluster::TestNamespace;
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client};
use serde::Deserialize;

/// The namespace the file was rendered for.
const RENDERED_NAMESPACE: &str = "capyctl-system";
/// The operator's Lease with the default values.
const LEASE: &str = "capyctl-operator";
/// The operator's own Deployment (apps/v1) with the default values: the Lease's owner.
const OPERATOR_DEPLOYMENT: &str = "capyctl-operator";

/// The rendered RBAC, moved into namespace `ns`: namespaced objects into it, cluster-scoped
/// ones (and the references to them) renamed `<name>-<ns>`, subjects into it.
fn rendered(ns: &str) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/k8s_rbac.yaml"),
    )
    .unwrap();
    let mut docs = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(&text) {
        let mut v = serde_json::Value::deserialize(doc).unwrap();
        let kind = v["kind"].as_str().unwrap().to_string();
        if kind.starts_with("Cluster") {
            let name = format!("{}-{ns}", v["metadata"]["name"].as_str().unwrap());
            v["metadata"]["name"] = name.into();
        } else {
            assert_eq!(v["metadata"]["namespace"], RENDERED_NAMESPACE);
            v["metadata"]["namespace"] = ns.into();
        }
        if kind == "ClusterRoleBinding" {
            let role = format!("{}-{ns}", v["roleRef"]["name"].as_str().unwrap());
            v["roleRef"]["name"] = role.into();
        }
        if let Some(subjects) = v["subjects"].as_array_mut() {
            for s in subjects {
                s["namespace"] = ns.into();
            }
        }
        docs.push(v);
    }
    docs
}

/// Creates `docs` (ServiceAccounts, Roles, bindings); the cluster-scoped ones are deleted
/// with the namespace.
async fn apply(ns: &TestNamespace, docs: &[serde_json::Value]) {
    let pp = PostParams::default();
    for doc in docs {
        let name = doc["metadata"]["name"].as_str().unwrap().to_string();
        match doc["kind"].as_str().unwrap() {
            "ServiceAccount" => {
                let sa: ServiceAccount = serde_json::from_value(doc.clone()).unwrap();
                ns.api::<ServiceAccount>().create(&pp, &sa).await.unwrap();
            }
            "Role" => {
                let r: Role = serde_json::from_value(doc.clone()).unwrap();
                ns.api::<Role>().create(&pp, &r).await.unwrap();
            }
            "RoleBinding" => {
                let r: RoleBinding = serde_json::from_value(doc.clone()).unwrap();
                ns.api::<RoleBinding>().create(&pp, &r).await.unwrap();
            }
            "ClusterRole" => {
                ns.also_delete(format!(
                    "/apis/rbac.authorization.k8s.io/v1/clusterroles/{name}"
                ));
                let r: ClusterRole = serde_json::from_value(doc.clone()).unwrap();
                Api::<ClusterRole>::all(ns.client.clone())
                    .create(&pp, &r)
                    .await
                    .unwrap();
            }
            "ClusterRoleBinding" => {
                ns.also_delete(format!(
                    "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{name}"
                ));
                let r: ClusterRoleBinding = serde_json::from_value(doc.clone()).unwrap();
                Api::<ClusterRoleBinding>::all(ns.client.clone())
                    .create(&pp, &r)
                    .await
                    .unwrap();
            }
            other => panic!("k8s_rbac.yaml holds a {other}"),
        }
    }
}

/// A client that is ServiceAccount `sa` of namespace `ns` (impersonation).
async fn client_as(kubeconfig: &std::path::Path, ns: &str, sa: &str) -> Client {
    let mut config = cluster::config_of(kubeconfig).await;
    config.auth_info.impersonate = Some(format!("system:serviceaccount:{ns}:{sa}"));
    Client::try_from(config).unwrap()
}

/// One access: `verb` on `group`/`resource`[/`subresource`] [`name`] in `namespace` (`None`:
/// cluster-scoped).
#[derive(Debug, Clone, Copy)]
struct Access<'a> {
    verb: &'a str,
    group: &'a str,
    resource: &'a str,
    subresource: Option<&'a str>,
    name: Option<&'a str>,
    namespace: Option<&'a str>,
}

fn access<'a>(verb: &'a str, group: &'a str, resource: &'a str, ns: Option<&'a str>) -> Access<'a> {
    let (resource, subresource) = match resource.split_once('/') {
        Some((r, s)) => (r, Some(s)),
        None => (resource, None),
    };
    Access {
        verb,
        group,
        resource,
        subresource,
        name: None,
        namespace: ns,
    }
}

/// Whether the client's user may do `a` (a `SelfSubjectAccessReview`).
async fn may(client: &Client, a: Access<'_>) -> bool {
    let review = SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(ResourceAttributes {
                verb: Some(a.verb.to_string()),
                group: Some(a.group.to_string()),
                resource: Some(a.resource.to_string()),
                subresource: a.subresource.map(str::to_string),
                name: a.name.map(str::to_string),
                namespace: a.namespace.map(str::to_string),
                ..ResourceAttributes::default()
            }),
            ..SelfSubjectAccessReviewSpec::default()
        },
        ..SelfSubjectAccessReview::default()
    };
    let answer = Api::<SelfSubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
        .unwrap();
    answer.status.is_some_and(|s| s.allowed)
}

/// Every access of `allowed` is allowed and every one of `denied` is not; the message lists
/// every miss.
async fn check(client: &Client, who: &str, allowed: &[Access<'_>], denied: &[Access<'_>]) {
    let mut misses = Vec::new();
    for a in allowed {
        // The API server's authorizer reads RBAC from a cache that lags just-created Roles and
        // bindings a little: an allowed call may read as denied for a moment, never the
        // reverse. So a denial of what is needed is asked again for up to 10 s.
        let until = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut ok = may(client, *a).await;
        while !ok && tokio::time::Instant::now() < until {
            tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            ok = may(client, *a).await;
        }
        if !ok {
            misses.push(format!("{who} may not {a:?}, which it needs"));
        }
    }
    for a in denied {
        if may(client, *a).await {
            misses.push(format!("{who} may {a:?}, which it must not"));
        }
    }
    assert!(misses.is_empty(), "{}", misses.join("\n"));
}

#[tokio::test]
#[ignore = "needs cluster"]
async fn the_charts_service_accounts_may_do_what_they_need_and_no_more() {
    let (kubeconfig, client) = cluster::cluster().await;
    let ns = TestNamespace::create(&kubeconfig, &client, "capyctl-rbac").await;
    apply(&ns, &rendered(&ns.name)).await;
    let n = Some(ns.name.as_str());
    let capy = "capyctl.io";
    let events = "events.k8s.io";
    let lease = |verb| Access {
        name: Some(LEASE),
        ..access(verb, "coordination.k8s.io", "leases", n)
    };

    let operator = client_as(&kubeconfig, &ns.name, "capyctl-operator").await;
    check(
        &operator,
        "the operator",
        &[
            access("get", capy, "deployments", n),
            access("list", capy, "deployments", n),
            access("watch", capy, "deployments", n),
            access("patch", capy, "deployments", n),
            access("patch", capy, "deployments/status", n),
            access("update", capy, "deployments/finalizers", n),
            access("list", "", "pods", n),
            access("create", "", "pods", n),
            access("delete", "", "pods", n),
            access("patch", "", "pods", n),
            access("create", events, "events", n),
            access("patch", events, "events", n),
            access("create", "coordination.k8s.io", "leases", n),
            lease("get"),
            lease("update"),
            Access {
                name: Some(OPERATOR_DEPLOYMENT),
                ..access("get", "apps", "deployments", n)
            },
            access("get", capy, "hosts", None),
            access("list", capy, "hosts", None),
            access("watch", capy, "hosts", None),
            // The Tenant objects and the Secrets their keys are in (DESIGN 4.10).
            access("get", capy, "tenants", n),
            access("list", capy, "tenants", n),
            access("watch", capy, "tenants", n),
            access("patch", capy, "tenants/status", n),
            access("get", "", "secrets", n),
            access("list", "", "secrets", n),
            access("watch", "", "secrets", n),
        ],
        &[
            access("create", capy, "tenants", n),
            access("delete", capy, "tenants", n),
            access("patch", capy, "tenants", n),
            access("create", "", "secrets", n),
            access("update", "", "secrets", n),
            access("delete", "", "secrets", n),
            access("get", "", "secrets", Some("default")),
            access("create", capy, "deployments", n),
            access("delete", capy, "deployments", n),
            access("update", capy, "deployments", n),
            access("get", capy, "deployments", Some("default")),
            access("deletecollection", "", "pods", n),
            access("create", "", "pods/exec", n),
            access("get", "", "configmaps", n),
            access("create", "", "events", n),
            access("delete", "coordination.k8s.io", "leases", n),
            access("get", "apps", "deployments", n),
            access("list", "apps", "deployments", n),
            Access {
                name: Some(OPERATOR_DEPLOYMENT),
                ..access("update", "apps", "deployments", n)
            },
            Access {
                name: Some("someone-elses-deployment"),
                ..access("get", "apps", "deployments", n)
            },
            Access {
                name: Some("someone-elses-lease"),
                ..access("update", "coordination.k8s.io", "leases", n)
            },
            access("patch", capy, "hosts", None),
            access("delete", capy, "hosts", None),
            access("get", "", "nodes", None),
            access("create", "rbac.authorization.k8s.io", "roles", n),
        ],
    )
    .await;

    let agent = client_as(&kubeconfig, &ns.name, "capyctl-node-agent").await;
    check(
        &agent,
        "the node agent",
        &[
            access("create", capy, "hosts", None),
            access("patch", capy, "hosts", None),
            access("patch", capy, "hosts/status", None),
            access("get", "", "nodes", None),
            access("list", "", "pods", n),
            access("watch", "", "pods", n),
        ],
        &[
            access("delete", "", "pods", n),
            access("create", "", "pods", n),
            access("patch", "", "pods", n),
            access("delete", capy, "hosts", None),
            access("get", capy, "deployments", n),
            access("patch", capy, "deployments/status", n),
            access("get", "", "secrets", n),
            access("create", "coordination.k8s.io", "leases", n),
            access("create", events, "events", n),
            access("patch", "", "nodes", None),
            access("list", "", "pods", Some("default")),
        ],
    )
    .await;

    // And for real: the node agent cannot delete a Pod (refused before it is even looked up).
    let err = Api::<Pod>::namespaced(agent, &ns.name)
        .delete("any-engine-pod", &DeleteParams::default())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 403),
        "{err}"
    );
}
