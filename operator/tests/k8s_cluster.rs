//! The Kubernetes adapter against a real API server (Kubernetes 1.34; no kubelet needed: engine
//! Pods stay Pending). Every test is `#[ignore = "needs cluster"]` and runs when
//! `CAPYCTL_TEST_KUBECONFIG` names a kubeconfig whose user may manage CRDs and namespaces:
//!
//! ```sh
//! CAPYCTL_TEST_KUBECONFIG=~/.kube/config cargo test -p capyctl-operator --test k8s_cluster -- --ignored
//! ```
//!
//! Each test works in a namespace of its own (`cluster::TestNamespace`), cleaned up when
//! the test ends, passed or failed; the CRDs are applied from `charts/capyctl/crds/`
//! (server-side apply, so a rerun is harmless). Written for an API server without kubelet
//! or controller-manager (no Pod runs, nothing is garbage-collected), except
//! `deleting_the_operators_deployment_deletes_its_lease`, which needs the controller-manager's
//! garbage collector (`k8s-up.sh` and `scripts/local-cluster.sh` run it).
#![allow(clippy::unwrap_used)]

use capyctl_test_support::cluster;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use capyctl_crds::{Deployment, parse_deployment_manifest_str};
use capyctl_lifecycle::api::{BoxFuture, ManagementApi};
use capyctl_node_agent::spec::{EngineLaunch, InstanceSpec};
use capyctl_node_agent::tier::LaunchParking;
use capyctl_operator::leader::{Attempt, LeaderElector, LeaseConfig};
use capyctl_operator::pods::{EnginePod, EnginePodSettings, engine_pod};
use capyctl_operator::reconcile::{Reconciler, ReconcilerConfig};
use capyctl_operator::status::{Parkability, StatusInput, apply_status, deployment_status};
use capyctl_operator::{FIELD_MANAGER, FINALIZER};
use capyctl_spec::api::{
    ActionReceipt, ConditionView, DeployOutcome, DeployReceipt, DeploymentList, DeploymentView,
    EngineList, HostDrainReceipt, HostList, InstanceView, LoadReport, StartRequest,
};
use capyctl_spec::documents::DeploymentDoc;
use capyctl_spec::errors::ApiError;
use capyctl_spec::{Activation, EngineKind, InstanceState};
use cluster::TestNamespace;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};

/// A namespace of the test's own in the cluster of `CAPYCTL_TEST_KUBECONFIG`, with the chart's
/// CRDs applied; fails the test when the variable is unset ([`cluster::kubeconfig`]).
async fn namespace_with_crds() -> TestNamespace {
    let (kubeconfig, client) = cluster::cluster().await;
    cluster::install_crds(&client).await;
    TestNamespace::create(&kubeconfig, &client, "capyctl-test").await
}

/// [`namespace_with_crds`] with the fixture manifest created in it.
async fn namespace_with_the_manifest() -> (TestNamespace, Deployment) {
    let ns = namespace_with_crds().await;
    let cr = ns
        .api::<Deployment>()
        .create(&PostParams::default(), &manifest(&ns.name))
        .await
        .unwrap();
    (ns, cr)
}

/// The fixture manifest, in namespace `ns`.
fn manifest(ns: &str) -> Deployment {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../spec/tests/fixtures/deployment-cr.yaml"),
    )
    .unwrap();
    let mut cr = parse_deployment_manifest_str("deployment-cr.yaml", &text).unwrap();
    cr.metadata.namespace = Some(ns.to_string());
    cr
}

/// A lifecycle that only records: what the reconciler deploys and deletes.
#[derive(Default)]
struct Recording {
    deps: Mutex<BTreeMap<String, DeploymentView>>,
    deleted: Mutex<Vec<String>>,
}

fn view_of(doc: &DeploymentDoc) -> DeploymentView {
    DeploymentView {
        id: "01KTESTDEPLOYMENT0000000000".into(),
        name: doc.name.clone(),
        state: InstanceState::Stopped,
        ready: "0/1".into(),
        revision: 1,
        hosts: vec!["gpu-1".into()],
        activation: Activation::Explicit,
        warm: false,
        operator_stopped: false,
        engine: doc.engine_kind(),
        model: doc.model_arg().to_string(),
        residency: doc.residency,
        measurement: None,
        instances: vec![InstanceView {
            instance_id: "01KTESTDEPLOYMENT0000000000-0".into(),
            index: 0,
            host_id: "gpu-1".into(),
            generation: 0,
            state: InstanceState::Stopped,
            parked_tier: None,
            port: None,
            pid: None,
            last_error: None,
        }],
        conditions: vec![ConditionView {
            kind: "Ready".into(),
            status: "False".into(),
            reason: "not_running".into(),
            message: "the instance is stopped".into(),
        }],
        spec: doc.clone(),
    }
}

impl ManagementApi for Recording {
    fn list(&self) -> BoxFuture<'_, DeploymentList> {
        Box::pin(async move {
            DeploymentList {
                deployments: self.deps.lock().unwrap().values().cloned().collect(),
            }
        })
    }
    fn deploy(&self, doc: DeploymentDoc) -> BoxFuture<'_, Result<DeployReceipt, ApiError>> {
        Box::pin(async move {
            let mut deps = self.deps.lock().unwrap();
            let outcome = if deps.contains_key(&doc.name) {
                DeployOutcome::Unchanged
            } else {
                DeployOutcome::Created
            };
            let view = deps
                .entry(doc.name.clone())
                .or_insert_with(|| view_of(&doc))
                .clone();
            Ok(DeployReceipt {
                outcome,
                deployment: view,
            })
        })
    }
    fn get<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<DeploymentView, ApiError>> {
        Box::pin(async move {
            self.deps
                .lock()
                .unwrap()
                .get(name)
                .cloned()
                .ok_or(ApiError::NotFound {
                    what: name.to_string(),
                })
        })
    }
    fn delete<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<DeploymentView, ApiError>> {
        Box::pin(async move {
            self.deleted.lock().unwrap().push(name.to_string());
            self.deps
                .lock()
                .unwrap()
                .remove(name)
                .ok_or(ApiError::NotFound {
                    what: name.to_string(),
                })
        })
    }
    fn start<'a>(
        &'a self,
        _: &'a str,
        _: StartRequest,
    ) -> BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        Box::pin(async {
            Err(ApiError::Internal {
                detail: "not in this test".into(),
            })
        })
    }
    fn stop<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        Box::pin(async {
            Err(ApiError::Internal {
                detail: "not in this test".into(),
            })
        })
    }
    fn park<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        Box::pin(async {
            Err(ApiError::Internal {
                detail: "not in this test".into(),
            })
        })
    }
    fn preinitialize<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        Box::pin(async {
            Err(ApiError::Internal {
                detail: "not in this test".into(),
            })
        })
    }
    fn engines(&self) -> BoxFuture<'_, EngineList> {
        Box::pin(async { EngineList { engines: vec![] } })
    }
    fn hosts(&self) -> BoxFuture<'_, HostList> {
        Box::pin(async { HostList { hosts: vec![] } })
    }
    fn drain_host<'a>(
        &'a self,
        _: &'a str,
        _: bool,
    ) -> BoxFuture<'a, Result<HostDrainReceipt, ApiError>> {
        Box::pin(async {
            Err(ApiError::Internal {
                detail: "not in this test".into(),
            })
        })
    }
    fn load<'a>(&'a self, _: Option<&'a str>) -> BoxFuture<'a, Result<LoadReport, ApiError>> {
        Box::pin(async {
            Err(ApiError::Internal {
                detail: "not in this test".into(),
            })
        })
    }
    fn ready(&self) -> bool {
        true
    }
}

#[tokio::test]
#[ignore = "needs cluster"]
async fn crds_install_and_a_model_manifest_applies_with_its_printer_columns() {
    let ns = namespace_with_crds().await;
    let crds: Api<CustomResourceDefinition> = Api::all(ns.client.clone());
    let crd = crds.get("deployments.capyctl.io").await.unwrap();
    let columns: Vec<String> = crd.spec.versions[0]
        .additional_printer_columns
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.name)
        .collect();
    // As `capyctl list deployments` prints them (no Age), and the priority (empty when unset).
    assert_eq!(columns, ["State", "Ready", "Revision", "Hosts", "Priority"]);
    let api: Api<Deployment> = ns.api();
    let cr = manifest(&ns.name);
    api.patch(
        &cr.name_any(),
        &PatchParams::apply("capyctl-tests"),
        &Patch::Apply(&cr),
    )
    .await
    .unwrap();
    let back = api.get("my-model").await.unwrap();
    // As applied, with the schema's default `replicas: 1` filled in: the same document.
    assert_eq!(cr.spec.replicas, None);
    assert_eq!(
        back.spec,
        capyctl_crds::DeploymentSpec {
            replicas: Some(capyctl_crds::DEFAULT_REPLICAS),
            ..cr.spec.clone()
        }
    );
    assert_eq!(back.to_document().unwrap(), cr.to_document().unwrap());
    // A bad object is refused by the API server's schema (maxConcurrentRequests is 1..4096).
    let mut bad = serde_json::to_value(&cr).unwrap();
    bad["metadata"]["name"] = "bad-model".into();
    bad["spec"]["maxConcurrentRequests"] = 0.into();
    let err = api
        .create(
            &PostParams::default(),
            &serde_json::from_value(bad).unwrap(),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.is_invalid()),
        "{err}"
    );
}

#[tokio::test]
#[ignore = "needs cluster"]
async fn status_is_applied_by_the_one_field_manager_on_the_status_subresource() {
    let (ns, cr) = namespace_with_the_manifest().await;
    let client = ns.client.clone();
    let api: Api<Deployment> = ns.api();
    let doc = cr.to_document().unwrap();
    let view = view_of(&doc);
    let status = deployment_status(StatusInput {
        view: Some(&view),
        observed_generation: cr.metadata.generation,
        parkability: &Parkability::from_doc(&doc),
        refused: None,
        previous: None,
        now: Timestamp::from_second(Timestamp::now().as_second()).unwrap(),
        lifecycle_record: Some(r#"{"operator_stopped":true,"operator_started":false}"#),
    });
    let written = apply_status(&api, "my-model", &status).await.unwrap();
    assert_eq!(written.status.as_ref(), Some(&status));
    let managers: Vec<(String, Option<String>)> = written
        .metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .map(|m| (m.manager.unwrap_or_default(), m.subresource))
        .collect();
    assert!(
        managers.contains(&(FIELD_MANAGER.to_string(), Some("status".to_string()))),
        "{managers:?}"
    );
    // The spec is untouched, and the printer columns read the status.
    assert_eq!(written.spec, cr.spec);
    assert_eq!(written.status.unwrap().ready.as_deref(), Some("0/1"));

    // The printer columns by value, as `kubectl get cdeploy` shows them: the API server's
    // Table rendering of the list. On a cluster that had an older version of the CRD, the
    // server may render with it for a moment after the update: asked again for up to 10 s.
    let want = ["Name", "State", "Ready", "Revision", "Hosts", "Priority"];
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    let table = loop {
        let request = http::Request::get(format!(
            "/apis/capyctl.io/v1alpha1/namespaces/{}/deployments",
            ns.name
        ))
        .header(
            http::header::ACCEPT,
            "application/json;as=Table;v=v1;g=meta.k8s.io",
        )
        .body(Vec::new())
        .unwrap();
        let table: serde_json::Value = client.request(request).await.unwrap();
        assert_eq!(table["kind"], "Table", "{table}");
        let columns: Vec<String> = table["columnDefinitions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap().to_string())
            .collect();
        if columns == want || tokio::time::Instant::now() >= until {
            assert_eq!(columns, want);
            break table;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let rows = table["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "{table}");
    let cells = rows[0]["cells"].as_array().unwrap();
    assert_eq!(cells[0], "my-model");
    assert_eq!(cells[1], "stopped");
    assert_eq!(cells[2], "0/1");
    assert_eq!(cells[3], 1);
    assert_eq!(cells[4], "gpu-1");
    // No `priority` set: an empty cell, not 0.
    assert!(cells[5].is_null(), "{table}");
}

#[tokio::test]
#[ignore = "needs cluster"]
async fn the_finalizer_holds_a_deleted_cr_until_the_lifecycle_let_go() {
    let ns = namespace_with_crds().await;
    let client = ns.client.clone();
    let api: Api<Deployment> = ns.api();
    api.create(&PostParams::default(), &manifest(&ns.name))
        .await
        .unwrap();
    let lifecycle = Arc::new(Recording::default());
    let reconciler = Reconciler::new(
        lifecycle.clone(),
        api.clone(),
        Some(Reconciler::recorder(client.clone(), Some("test".into()))),
        None,
        ReconcilerConfig::default(),
    );
    // The first pass adds the finalizer and nothing else (the controller would see its patch
    // and reconcile again); the second deploys.
    let action = reconciler
        .reconcile(Arc::new(api.get("my-model").await.unwrap()))
        .await
        .unwrap();
    assert_eq!(action, kube::runtime::controller::Action::await_change());
    let cr = api.get("my-model").await.unwrap();
    assert!(cr.finalizers().iter().any(|f| f == FINALIZER));
    assert!(cr.status.is_none(), "{cr:?}");
    assert!(lifecycle.deps.lock().unwrap().is_empty());
    reconciler.reconcile(Arc::new(cr)).await.unwrap();
    let cr = api.get("my-model").await.unwrap();
    let status = cr.status.clone().unwrap();
    assert_eq!(
        status.deployment_id.as_deref(),
        Some("01KTESTDEPLOYMENT0000000000")
    );
    assert_eq!(status.observed_generation, cr.metadata.generation);
    // The same object again writes nothing: the resourceVersion stays.
    reconciler.reconcile(Arc::new(cr.clone())).await.unwrap();
    assert_eq!(
        api.get("my-model").await.unwrap().resource_version(),
        cr.resource_version()
    );
    // An Event says it was deployed.
    let events: Api<Event> = ns.api();
    let list = events.list(&ListParams::default()).await.unwrap();
    assert!(
        list.items
            .iter()
            .any(|e| e.reason.as_deref() == Some("Deployed")),
        "{:?}",
        list.items
    );

    api.delete("my-model", &DeleteParams::default())
        .await
        .unwrap();
    let deleting = api.get("my-model").await.unwrap();
    assert!(deleting.metadata.deletion_timestamp.is_some());
    reconciler.reconcile(Arc::new(deleting)).await.unwrap();
    assert_eq!(lifecycle.deleted.lock().unwrap().as_slice(), ["my-model"]);
    assert!(api.get_opt("my-model").await.unwrap().is_none());
}

/// Polls `api` for object `name` until `done` holds (within 30 s).
async fn wait_for(
    api: &Api<Deployment>,
    name: &str,
    what: &str,
    done: impl Fn(&Deployment) -> bool,
) -> Deployment {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let last = api.get_opt(name).await.unwrap();
        if let Some(cr) = &last
            && done(cr)
        {
            return cr.clone();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within 30 s; the object is {last:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn accepted_reason(cr: &Deployment) -> Option<(String, String)> {
    cr.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == "Accepted")
        .map(|c| (c.reason.clone(), c.message.clone()))
}

/// The controllers watch two namespaces besides the operator's (`--watch-namespaces`): a model
/// applied in either is reconciled; the same name applied in the second is refused naming the
/// first (the router routes by name), and takes the name when the first is deleted.
#[tokio::test]
#[ignore = "needs cluster"]
async fn models_of_watched_namespaces_are_reconciled_and_a_name_is_served_from_one() {
    use capyctl_operator::watch::{Claims, Watch};

    let release = namespace_with_crds().await;
    let (kubeconfig, client) = cluster::cluster().await;
    let team_a = TestNamespace::create(&kubeconfig, &client, "capyctl-team-a").await;
    let team_b = TestNamespace::create(&kubeconfig, &client, "capyctl-team-b").await;
    let unwatched = TestNamespace::create(&kubeconfig, &client, "capyctl-team-x").await;
    let watch = Watch::parse(
        &release.name,
        &format!("{},{}", team_a.name, team_b.name),
        "test",
    )
    .unwrap();
    let lifecycle = Arc::new(Recording::default());
    let reconciler = Arc::new(
        Reconciler::new(
            lifecycle.clone(),
            release.api(),
            Some(Reconciler::recorder(client.clone(), Some("test".into()))),
            None,
            ReconcilerConfig::default(),
        )
        .with_watch(&watch, Arc::new(Claims::default())),
    );
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let controllers = tokio::spawn(reconciler.clone().run_controller(stopped));

    let a: Api<Deployment> = team_a.api();
    let b: Api<Deployment> = team_b.api();
    let x: Api<Deployment> = unwatched.api();
    a.create(&PostParams::default(), &manifest(&team_a.name))
        .await
        .unwrap();
    let served = |cr: &Deployment| {
        cr.status
            .as_ref()
            .is_some_and(|s| s.deployment_id.is_some() && s.observed_generation.is_some())
    };
    wait_for(&a, "my-model", "team-a's object deployed", served).await;
    b.create(&PostParams::default(), &manifest(&team_b.name))
        .await
        .unwrap();
    let refused = wait_for(&b, "my-model", "team-b's object refused", |cr| {
        accepted_reason(cr).is_some()
    })
    .await;
    let (reason, message) = accepted_reason(&refused).unwrap();
    assert_eq!(reason, "name_taken");
    assert!(
        message.contains(&format!("the Deployment object {}/my-model", team_a.name)),
        "{message}"
    );
    assert!(refused.status.as_ref().unwrap().deployment_id.is_none());
    // An Event on team-b's object says so.
    let events: Api<Event> = team_b.api();
    let list = events.list(&ListParams::default()).await.unwrap();
    assert!(
        list.items
            .iter()
            .any(|e| e.reason.as_deref() == Some("NameTaken")),
        "{:?}",
        list.items
    );
    // Not watched: left alone (no finalizer, no status).
    x.create(&PostParams::default(), &manifest(&unwatched.name))
        .await
        .unwrap();

    // team-a's goes: its finalizer deletes the deployment, and team-b's takes the name.
    a.delete("my-model", &DeleteParams::default())
        .await
        .unwrap();
    let taken = wait_for(&b, "my-model", "team-b's object deployed", |cr| {
        served(cr) && accepted_reason(cr).is_none()
    })
    .await;
    assert!(taken.finalizers().iter().any(|f| f == FINALIZER));
    assert!(a.get_opt("my-model").await.unwrap().is_none());
    assert_eq!(lifecycle.deleted.lock().unwrap().as_slice(), ["my-model"]);
    assert!(lifecycle.deps.lock().unwrap().contains_key("my-model"));
    let ignored = x.get("my-model").await.unwrap();
    assert!(
        ignored.finalizers().is_empty() && ignored.status.is_none(),
        "{ignored:?}"
    );

    stop.send_replace(true);
    tokio::time::timeout(Duration::from_secs(30), controllers)
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test]
#[ignore = "needs cluster"]
async fn one_replica_holds_the_lease_and_the_other_takes_it_after_a_release() {
    let (kubeconfig, client) = cluster::cluster().await;
    let ns = TestNamespace::create(&kubeconfig, &client, "capyctl-test").await;
    let leases: Api<Lease> = ns.api();
    let mut a = LeaderElector::new(leases.clone(), LeaseConfig::new("capyctl-operator", "op-a"));
    let mut b = LeaderElector::new(leases.clone(), LeaseConfig::new("capyctl-operator", "op-b"));
    assert_eq!(a.try_acquire_or_renew().await.unwrap(), Attempt::Held);
    assert_eq!(
        b.try_acquire_or_renew().await.unwrap(),
        Attempt::HeldBy("op-a".into())
    );
    assert_eq!(a.try_acquire_or_renew().await.unwrap(), Attempt::Held);
    let lease = leases.get("capyctl-operator").await.unwrap();
    assert_eq!(
        lease.spec.as_ref().unwrap().holder_identity.as_deref(),
        Some("op-a")
    );
    a.release().await.unwrap();
    assert_eq!(b.try_acquire_or_renew().await.unwrap(), Attempt::Held);
    let lease = leases.get("capyctl-operator").await.unwrap();
    let spec = lease.spec.unwrap();
    assert_eq!(spec.holder_identity.as_deref(), Some("op-b"));
    assert_eq!(spec.lease_transitions, Some(1));
}

/// `helm uninstall` leaves no Lease behind: the Lease is owned by the operator's Deployment
/// (apps/v1), so the garbage collector deletes it with the Deployment, and deletes again a Lease
/// a standby makes after it (its owner's UID is gone). Needs kube-controller-manager (its
/// garbage collector), which `k8s-up.sh` and `scripts/local-cluster.sh` both run. The
/// Deployment has no replicas: nothing needs to run.
#[tokio::test]
#[ignore = "needs cluster"]
async fn deleting_the_operators_deployment_deletes_its_lease() {
    use capyctl_operator::leader::{Leadership, deployment_owner};
    use k8s_openapi::api::apps::v1::Deployment as AppsDeployment;
    use tokio::sync::watch;

    let (kubeconfig, client) = cluster::cluster().await;
    let ns = TestNamespace::create(&kubeconfig, &client, "capyctl-test").await;
    let deployments: Api<AppsDeployment> = ns.api();
    let leases: Api<Lease> = ns.api();
    let labels = serde_json::json!({"app.kubernetes.io/component": "operator"});
    let operator: AppsDeployment = serde_json::from_value(serde_json::json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "capyctl-operator"},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "operator", "image": "capyctl/none:0"}]},
            },
        },
    }))
    .unwrap();
    let created = deployments
        .create(&PostParams::default(), &operator)
        .await
        .unwrap();
    let uid = created.uid().unwrap();
    let owner = deployment_owner(&deployments, "capyctl-operator", Duration::from_secs(10)).await;
    assert_eq!(owner.as_ref().map(|o| o.uid.as_str()), Some(uid.as_str()));

    // The election as the operator runs it: a leader, which releases the Lease when stopped.
    let (leading_tx, mut leading) = watch::channel(Leadership::default());
    let (stop_tx, stop) = watch::channel(false);
    let elector = LeaderElector::new(leases.clone(), LeaseConfig::new("capyctl-operator", "op-a"))
        .with_owner(owner.clone());
    let run = tokio::spawn(elector.run(leading_tx, stop));
    tokio::time::timeout(Duration::from_secs(30), leading.wait_for(|l| l.leading))
        .await
        .unwrap()
        .unwrap();
    let lease = leases.get("capyctl-operator").await.unwrap();
    let owners = lease.metadata.owner_references.clone().unwrap();
    assert_eq!(owners.len(), 1, "{owners:?}");
    assert_eq!(
        (owners[0].api_version.as_str(), owners[0].kind.as_str()),
        ("apps/v1", "Deployment")
    );
    assert_eq!(owners[0].name, "capyctl-operator");
    assert_eq!(owners[0].uid, uid);
    assert_eq!(owners[0].controller, Some(false));
    assert_eq!(owners[0].block_owner_deletion, Some(false));

    // `helm uninstall`: the Deployment goes first, then its Pods stop (the leader releases).
    deployments
        .delete("capyctl-operator", &DeleteParams::background())
        .await
        .unwrap();
    stop_tx.send_replace(true);
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .unwrap()
        .unwrap();
    lease_collected(&leases, "after its Deployment was deleted").await;

    // A standby that read the Deployment before it went makes the Lease again: collected too.
    let mut standby =
        LeaderElector::new(leases.clone(), LeaseConfig::new("capyctl-operator", "op-b"))
            .with_owner(owner);
    assert_eq!(standby.try_acquire_or_renew().await.unwrap(), Attempt::Held);
    lease_collected(
        &leases,
        "made again by a standby after its owner was deleted",
    )
    .await;
}

/// Waits (60 s at most: the garbage collector is quick, the machine may be loaded) until Lease
/// `capyctl-operator` is gone.
async fn lease_collected(leases: &Api<Lease>, when: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while leases.get_opt("capyctl-operator").await.unwrap().is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the Lease {when} is still there after 60 s: is kube-controller-manager (its garbage \
             collector) running?"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
#[ignore = "needs cluster"]
async fn an_engine_pod_is_created_on_its_node_owned_by_its_cr() {
    let (ns, cr) = namespace_with_the_manifest().await;
    let spec = InstanceSpec::from_doc("01KTESTDEPLOYMENT0000000000", &cr.to_document().unwrap());
    let engine = EngineLaunch::default_for(EngineKind::Vllm);
    let pod = engine_pod(
        &EnginePod {
            owner: &cr,
            instance_id: "01KTESTDEPLOYMENT0000000000-0",
            generation: 1,
            spec: &spec,
            engine: &engine,
            parking: LaunchParking::default(),
            // No kubelet: the Pod stays Pending on a node that need not exist.
            node_name: "gpu-node-that-does-not-exist",
            gpus: &["GPU-0".to_string()],
            host_ram_copy: None,
        },
        // The default runtime: the RuntimeClass admission plugin refuses a Pod naming a
        // runtime class the cluster does not have (a test cluster has no `nvidia`).
        &EnginePodSettings {
            runtime_class_name: String::new(),
            ..EnginePodSettings::default()
        },
    )
    .unwrap();
    let pods: Api<Pod> = ns.api();
    let created = pods.create(&PostParams::default(), &pod).await.unwrap();
    let owner = &created.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(owner.uid, cr.uid().unwrap());
    assert_eq!(owner.controller, Some(true));
    assert_eq!(
        created.spec.as_ref().unwrap().node_name.as_deref(),
        Some("gpu-node-that-does-not-exist")
    );
}

/// The node agent's pod runtime against a real API server: the operator's side
/// ([`PodHostAgent`]) creates the engine Pod, no kubelet runs it, and the node agent's side
/// ([`PodRuntime`], watching its node's Pods) reports clearly that the Pod never ran; the
/// failed start deletes the Pod (which, without a kubelet, stays Terminating: its owner and
/// labels can still be read).
#[tokio::test]
#[ignore = "needs cluster"]
async fn an_engine_pod_that_never_runs_fails_the_start_clearly_and_is_owned_and_labelled() {
    use capyctl_node_agent::HostAgent;
    use capyctl_node_agent::agent::AgentConfig;
    use capyctl_node_agent::k8s::pods::{ANNOTATION_SPEC, PodRuntime};
    use capyctl_node_agent::spec::{GpuOverride, HostSettings};
    use capyctl_operator::engines::PodHostAgent;
    use capyctl_operator::pods::{LABEL_DEPLOYMENT, LABEL_GENERATION, LABEL_INSTANCE};

    let (ns, cr) = namespace_with_the_manifest().await;
    let client = ns.client.clone();
    let node = "gpu-node-that-does-not-exist";
    let data = std::env::temp_dir().join(cluster::unique("capyctl-pod-runtime"));
    let runtime = PodRuntime::new(client.clone(), &ns.name, node, &data).unwrap();
    let mut config = AgentConfig::new(&data);
    // Includes the watch delivering the new Pod: room for a slow API server.
    config.ready_timeout = Duration::from_secs(15);
    let host = HostSettings {
        gpus: Some(vec![GpuOverride {
            memory: 80 << 30,
            unified: false,
            uuid: Some("GPU-test-0".into()),
        }]),
        host_memory: Some(64 << 30),
        ..HostSettings::default()
    };
    let agent = Arc::new(capyctl_node_agent::LocalHostAgent::with_runtime(
        config,
        host.clone(),
        Arc::new(capyctl_node_agent::inventory::NoGpus),
        Arc::new(runtime),
    ));
    let pods = PodHostAgent::new(
        agent,
        client.clone(),
        &ns.name,
        EnginePodSettings {
            // A test cluster has no `nvidia` RuntimeClass (admission would refuse the Pod).
            runtime_class_name: String::new(),
            ..EnginePodSettings::default()
        },
        host,
        node,
    );
    let id = "01KTESTDEPLOYMENT0000000000";
    let spec = InstanceSpec::from_doc(id, &cr.to_document().unwrap());
    let instance = format!("{id}-0");
    let err = pods.start(&instance, &spec).await.unwrap_err();
    let text = err.to_string();
    assert_eq!(err.metric_label(), "engine_timeout", "{text}");
    assert!(
        text.contains(&format!(
            "engine Pod {}/my-model-0-g1 of instance {instance} on node {node} (not running: no kubelet ran it",
            ns.name
        )),
        "{text}"
    );

    let pod = ns.api::<Pod>().get("my-model-0-g1").await.unwrap();
    let owner = &pod.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(owner.uid, cr.uid().unwrap());
    assert_eq!(owner.kind, "Deployment");
    assert_eq!(owner.controller, Some(true));
    let labels = pod.labels();
    assert_eq!(labels[LABEL_INSTANCE], instance);
    assert_eq!(labels[LABEL_GENERATION], "1");
    assert_eq!(labels[LABEL_DEPLOYMENT], "my-model");
    assert!(pod.annotations().contains_key(ANNOTATION_SPEC));
    assert_eq!(pod.spec.as_ref().unwrap().node_name.as_deref(), Some(node));
    // The failed start deleted it; without a kubelet the deletion does not complete.
    assert!(pod.metadata.deletion_timestamp.is_some());
    let _ = std::fs::remove_dir_all(data);
}
