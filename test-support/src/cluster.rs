//! What the `needs cluster` tests share (the operator's, the node agent's and the end-to-end
//! ones): the cluster of `CAPYCTL_TEST_KUBECONFIG`, [`TestNamespace`], a namespace of its own
//! per test that is cleaned up when it is dropped, even after a failed assertion, and
//! [`install_crds`], the chart's CRDs applied. Run (`--ignored`) without the variable, such a test
//! fails, naming it and how to get a cluster: a test that checked nothing does not pass.
//!
//! The clusters these tests run against may have an API server only (Kubernetes 1.34, no
//! kubelet, no controller-manager): nothing creates the `default` ServiceAccount (Pod admission
//! needs it), nothing runs or garbage-collects Pods, and nothing finishes a namespace's
//! deletion. So a [`TestNamespace`] creates its `default` ServiceAccount, and its cleanup
//! removes the finalizers of the `Deployment` objects left (a test that killed its operator
//! leaves them), deletes the Pods at once (grace period 0), deletes the namespace and
//! finalizes it itself (`/finalize` with no finalizers), then deletes the cluster-scoped
//! objects the test registered ([`TestNamespace::also_delete`]).
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config, ResourceExt};

/// The variable naming the cluster's kubeconfig.
pub const KUBECONFIG_VAR: &str = "CAPYCTL_TEST_KUBECONFIG";

/// The kubeconfig of `CAPYCTL_TEST_KUBECONFIG`.
///
/// # Panics
/// When it is unset or empty: a `needs cluster` test run (`--ignored`) without a cluster fails,
/// saying how to get one, rather than pass having checked nothing.
pub fn kubeconfig() -> PathBuf {
    match std::env::var_os(KUBECONFIG_VAR).filter(|p| !p.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => panic!(
            "{KUBECONFIG_VAR} is not set: this `needs cluster` test needs a Kubernetes API \
             server (1.34). Start one with `../shared/tools/k8s/k8s-up.sh` (it writes \
             ~/.cache/capyctl-k8s/kubeconfig) or `scripts/local-cluster.sh up`, then run \
             `{KUBECONFIG_VAR}=<its kubeconfig> cargo test ... -- --ignored` (README, \
             Kubernetes); without a cluster, run the tests without `--ignored`"
        ),
    }
}

/// The configuration of the kubeconfig at `path`.
pub async fn config_of(path: &std::path::Path) -> Config {
    let kubeconfig = Kubeconfig::read_from(path)
        .unwrap_or_else(|e| panic!("CAPYCTL_TEST_KUBECONFIG {}: {e}", path.display()));
    Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap_or_else(|e| panic!("CAPYCTL_TEST_KUBECONFIG {}: {e}", path.display()))
}

/// A client of the kubeconfig at `path`.
pub async fn client_of(path: &std::path::Path) -> Client {
    Client::try_from(config_of(path).await).unwrap()
}

/// The cluster's kubeconfig and client ([`kubeconfig`]: fails the test when
/// `CAPYCTL_TEST_KUBECONFIG` is unset).
pub async fn cluster() -> (PathBuf, Client) {
    let path = kubeconfig();
    let client = client_of(&path).await;
    (path, client)
}

/// A name no other test run uses: `<prefix>-<nanoseconds>-<pid>-<n>` in base 36.
pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let b36 = |mut v: u64| {
        let mut s = Vec::new();
        loop {
            s.push(b"0123456789abcdefghijklmnopqrstuvwxyz"[(v % 36) as usize]);
            v /= 36;
            if v == 0 {
                break;
            }
        }
        s.reverse();
        String::from_utf8(s).unwrap()
    };
    format!(
        "{prefix}-{}-{}-{}",
        b36(nanos),
        b36(u64::from(std::process::id())),
        b36(n)
    )
}

/// A namespace of the test's own (see the module doc).
pub struct TestNamespace {
    /// Its name.
    pub name: String,
    /// The cluster's client.
    pub client: Client,
    kubeconfig: PathBuf,
    /// Cluster-scoped objects to delete too: API paths.
    extra: Mutex<Vec<String>>,
}

impl TestNamespace {
    /// Creates namespace `<prefix>-<unique>` and its `default` ServiceAccount.
    pub async fn create(kubeconfig: &std::path::Path, client: &Client, prefix: &str) -> Self {
        let name = unique(prefix);
        let nss: Api<Namespace> = Api::all(client.clone());
        let ns: Namespace =
            serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).unwrap();
        nss.create(&PostParams::default(), &ns).await.unwrap();
        let me = Self {
            name,
            client: client.clone(),
            kubeconfig: kubeconfig.to_path_buf(),
            extra: Mutex::new(Vec::new()),
        };
        // Pod admission needs it; the controller-manager that would create it may not run.
        let sas: Api<ServiceAccount> = me.api();
        let sa: ServiceAccount =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "default"}})).unwrap();
        match sas.create(&PostParams::default(), &sa).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.is_already_exists() => {}
            Err(e) => panic!("creating the default ServiceAccount: {e}"),
        }
        me
    }

    /// The namespaced API of `K` in this namespace.
    pub fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as kube::Resource>::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), &self.name)
    }

    /// Deletes the cluster-scoped object at API path `path` (e.g.
    /// `/apis/rbac.authorization.k8s.io/v1/clusterroles/x`) at cleanup too.
    pub fn also_delete(&self, path: impl Into<String>) {
        self.extra.lock().unwrap().push(path.into());
    }
}

/// Deletes namespace `ns` and what the tests leave in it, then the objects at `extra`.
pub async fn clean_up(client: &Client, ns: &str, extra: &[String]) {
    let crs: Api<capyctl_crds::Deployment> = Api::namespaced(client.clone(), ns);
    if let Ok(list) = crs.list(&ListParams::default()).await {
        for cr in list.items {
            let name = cr.name_any();
            let patch = serde_json::json!({"metadata": {"finalizers": null}});
            let _ = crs
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await;
            let _ = crs.delete(&name, &DeleteParams::default()).await;
        }
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let _ = pods
        .delete_collection(
            &DeleteParams {
                grace_period_seconds: Some(0),
                ..DeleteParams::default()
            },
            &ListParams::default(),
        )
        .await;
    // What the namespace controller would delete (none may run): finalizing the namespace
    // alone would leave its objects stored, and a Service its cluster IP allocated.
    delete_all::<k8s_openapi::api::core::v1::Service>(client, ns).await;
    delete_all::<k8s_openapi::api::core::v1::Secret>(client, ns).await;
    delete_all::<k8s_openapi::api::core::v1::ConfigMap>(client, ns).await;
    delete_all::<ServiceAccount>(client, ns).await;
    delete_all::<k8s_openapi::api::rbac::v1::Role>(client, ns).await;
    delete_all::<k8s_openapi::api::rbac::v1::RoleBinding>(client, ns).await;
    delete_all::<k8s_openapi::api::coordination::v1::Lease>(client, ns).await;
    delete_all::<k8s_openapi::api::events::v1::Event>(client, ns).await;
    delete_all::<k8s_openapi::api::networking::v1::NetworkPolicy>(client, ns).await;
    let nss: Api<Namespace> = Api::all(client.clone());
    let _ = nss.delete(ns, &DeleteParams::default()).await;
    // No namespace controller may run: finalize it ourselves.
    if let Ok(Some(mut namespace)) = nss.get_opt(ns).await {
        if let Some(spec) = namespace.spec.as_mut() {
            spec.finalizers = Some(Vec::new());
        }
        if let Ok(body) = serde_json::to_vec(&namespace) {
            let request = http::Request::put(format!("/api/v1/namespaces/{ns}/finalize"))
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(body);
            if let Ok(request) = request {
                let _ = client.request_text(request).await;
            }
        }
    }
    for path in extra {
        if let Ok(request) = http::Request::delete(path.as_str()).body(Vec::new()) {
            let _ = client.request_text(request).await;
        }
    }
}

/// Deletes every `K` in namespace `ns`, one by one (Services have no `deletecollection`).
async fn delete_all<K>(client: &Client, ns: &str)
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
    <K as kube::Resource>::DynamicType: Default,
{
    let api: Api<K> = Api::namespaced(client.clone(), ns);
    let Ok(list) = api.list(&ListParams::default()).await else {
        return;
    };
    for item in list.items {
        let _ = api.delete(&item.name_any(), &DeleteParams::default()).await;
    }
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        // NB: a drop cannot await, and the test's runtime may be a current-thread one busy
        // dropping this: the cleanup runs on a thread of its own with its own runtime and
        // client, bounded.
        let (ns, kubeconfig) = (self.name.clone(), self.kubeconfig.clone());
        let extra = std::mem::take(&mut *self.extra.lock().unwrap_or_else(|e| e.into_inner()));
        let (done_tx, done) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                rt.block_on(async {
                    let client = client_of(&kubeconfig).await;
                    let _ = tokio::time::timeout(
                        Duration::from_secs(60),
                        clean_up(&client, &ns, &extra),
                    )
                    .await;
                });
            }
            let _ = done_tx.send(());
        });
        let _ = done.recv_timeout(Duration::from_secs(70));
    }
}

/// Applies the chart's CRDs (server-side apply: a rerun is harmless) and waits until they are
/// established.
pub async fn install_crds(client: &Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let dir = capyctl_crds::chart_crd_dir();
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
        tokio::time::timeout(
            Duration::from_secs(30),
            kube::runtime::wait::await_condition(
                crds.clone(),
                &name,
                kube::runtime::wait::conditions::is_crd_established(),
            ),
        )
        .await
        .unwrap()
        .unwrap();
    }
}
