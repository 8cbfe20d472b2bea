//! The Kubernetes adapter against a real API server (Kubernetes 1.34; no kubelet needed: engine
//! Pods stay Pending). Every test is `#[ignore = "needs cluster"]` and runs when
//! `CAPYCTL_TEST_KUBECONFIG` names a kubeconfig whose user may manage CRDs and namespaces:
//!
//! ```sh
//! CAPYCTL_TEST_KUBECONFIG=~/.kube/config cargo test -p capyctl-operator --test k8s_cluster -- --ignored
//! ```
//!
//! Each test works in a namespace of its own (`capyctl-test-<ulid>`), deleted at its end; the
//! CRDs are applied from `charts/capyctl/crds/` (server-side apply, so a rerun is harmless).
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use capyctl_crds::api::{
    ActionReceipt, ConditionView, DeployOutcome, DeployReceipt, DeploymentList, DeploymentView,
    EngineList, HostList, InstanceView, LoadReport, StartRequest,
};
use capyctl_crds::documents::DeploymentDoc;
use capyctl_crds::errors::ApiError;
use capyctl_crds::k8s::{Deployment, chart_crd_dir, parse_deployment_manifest_str};
use capyctl_crds::{Activation, EngineKind, InstanceState};
use capyctl_node_agent::spec::{EngineLaunch, InstanceSpec};
use capyctl_node_agent::tier::LaunchParking;
use capyctl_operator::api::{BoxFuture, ManagementApi};
use capyctl_operator::k8s::leader::{Attempt, LeaderElector, LeaseConfig};
use capyctl_operator::k8s::pods::{EnginePod, EnginePodSettings, engine_pod};
use capyctl_operator::k8s::reconcile::{Reconciler, ReconcilerConfig};
use capyctl_operator::k8s::status::{Parkability, StatusInput, apply_status, deployment_status};
use capyctl_operator::k8s::{FIELD_MANAGER, FINALIZER};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config, ResourceExt};

/// The cluster's client, or `None` (the test returns) when `CAPYCTL_TEST_KUBECONFIG` is unset.
async fn cluster() -> Option<Client> {
    let Some(path) = std::env::var_os("CAPYCTL_TEST_KUBECONFIG").filter(|p| !p.is_empty()) else {
        eprintln!("CAPYCTL_TEST_KUBECONFIG is not set; skipping");
        return None;
    };
    let kubeconfig = Kubeconfig::read_from(&path).unwrap();
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap();
    Some(Client::try_from(config).unwrap())
}

/// Applies the chart's CRDs and waits until they are established.
async fn install_crds(client: &Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let dir = chart_crd_dir();
    let mut names = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let crd: CustomResourceDefinition = serde_yaml_ng::from_str(&text).unwrap();
        let name = crd.name_any();
        crds.patch(
            &name,
            &PatchParams::apply("capyctl-tests").force(),
            &Patch::Apply(&crd),
        )
        .await
        .unwrap();
        names.push(name);
    }
    for name in names {
        let cond = kube::runtime::wait::conditions::is_crd_established();
        tokio::time::timeout(
            Duration::from_secs(30),
            kube::runtime::wait::await_condition(crds.clone(), &name, cond),
        )
        .await
        .unwrap()
        .unwrap();
    }
}

/// A fresh namespace; deleted by [`Ns::delete`].
struct Ns {
    name: String,
    client: Client,
}

impl Ns {
    async fn new(client: &Client) -> Ns {
        let name = format!(
            "capyctl-test-{}",
            ulid::Ulid::new().to_string().to_lowercase()
        );
        let nss: Api<Namespace> = Api::all(client.clone());
        let ns: Namespace =
            serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).unwrap();
        nss.create(&PostParams::default(), &ns).await.unwrap();
        Ns {
            name,
            client: client.clone(),
        }
    }

    fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as kube::Resource>::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), &self.name)
    }

    async fn delete(self) {
        let nss: Api<Namespace> = Api::all(self.client.clone());
        let _ = nss.delete(&self.name, &DeleteParams::default()).await;
    }
}

/// The fixture manifest, in namespace `ns`.
fn manifest(ns: &str) -> Deployment {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../crds/tests/fixtures/deployment-cr.yaml"),
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
        engine: doc.engine,
        model: doc.model.clone(),
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
    let Some(client) = cluster().await else {
        return;
    };
    install_crds(&client).await;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd = crds.get("deployments.capyctl.io").await.unwrap();
    let columns: Vec<String> = crd.spec.versions[0]
        .additional_printer_columns
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.name)
        .collect();
    assert_eq!(columns, ["State", "Ready", "Revision", "Hosts", "Age"]);
    let ns = Ns::new(&client).await;
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
    assert_eq!(back.spec, cr.spec);
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
    ns.delete().await;
}

#[tokio::test]
#[ignore = "needs cluster"]
async fn status_is_applied_by_the_one_field_manager_on_the_status_subresource() {
    let Some(client) = cluster().await else {
        return;
    };
    install_crds(&client).await;
    let ns = Ns::new(&client).await;
    let api: Api<Deployment> = ns.api();
    let cr = api
        .create(&PostParams::default(), &manifest(&ns.name))
        .await
        .unwrap();
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
    ns.delete().await;
}

#[tokio::test]
#[ignore = "needs cluster"]
async fn the_finalizer_holds_a_deleted_cr_until_the_lifecycle_let_go() {
    let Some(client) = cluster().await else {
        return;
    };
    install_crds(&client).await;
    let ns = Ns::new(&client).await;
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
    reconciler
        .reconcile(&api.get("my-model").await.unwrap())
        .await
        .unwrap();
    let cr = api.get("my-model").await.unwrap();
    assert!(cr.finalizers().iter().any(|f| f == FINALIZER));
    let status = cr.status.clone().unwrap();
    assert_eq!(
        status.deployment_id.as_deref(),
        Some("01KTESTDEPLOYMENT0000000000")
    );
    assert_eq!(status.observed_generation, cr.metadata.generation);
    // The same object again writes nothing: the resourceVersion stays.
    reconciler.reconcile(&cr).await.unwrap();
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
    reconciler.reconcile(&deleting).await.unwrap();
    assert_eq!(lifecycle.deleted.lock().unwrap().as_slice(), ["my-model"]);
    assert!(api.get_opt("my-model").await.unwrap().is_none());
    ns.delete().await;
}

#[tokio::test]
#[ignore = "needs cluster"]
async fn one_replica_holds_the_lease_and_the_other_takes_it_after_a_release() {
    let Some(client) = cluster().await else {
        return;
    };
    let ns = Ns::new(&client).await;
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
    ns.delete().await;
}

#[tokio::test]
#[ignore = "needs cluster"]
async fn an_engine_pod_is_created_on_its_node_owned_by_its_cr() {
    let Some(client) = cluster().await else {
        return;
    };
    install_crds(&client).await;
    let ns = Ns::new(&client).await;
    let crs: Api<Deployment> = ns.api();
    let cr = crs
        .create(&PostParams::default(), &manifest(&ns.name))
        .await
        .unwrap();
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
    ns.delete().await;
}
