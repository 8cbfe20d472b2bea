//! `kubectl scale` of a `Deployment` object against a real API server (DESIGN.md 4.7): the
//! scale subresource changes `spec.replicas`, the operator redeploys it like any spec change,
//! and `status.replicas`, `status.readyReplicas` and READY (`ready/replicas`) follow. Runs
//! `capyctl-operator` out of cluster with a `capyctl-node-agent --engine-runtime process`
//! (engines: the simulator), as `k8s_e2e.rs` does; `#[ignore = "needs cluster"]`:
//!
//! ```sh
//! CAPYCTL_TEST_KUBECONFIG=~/.kube/config cargo test -p capyctl-operator --test k8s_scale -- --ignored
//! ```
//!
//! kubectl is the real one: `$KUBECTL`, else `$CAPYCTL_K8S_HOME/bin/kubectl` (default
//! `~/.cache/capyctl-k8s/bin/kubectl`), else `kubectl` on the `PATH`; without any, the test
//! sends the same merge patch to the scale subresource itself (`Api::patch_scale`).
#![allow(clippy::unwrap_used)]

use capyctl_test_support::harness as support;

use capyctl_test_support::operator_e2e::*;

use std::path::{Path, PathBuf};
use std::time::Duration;

use capyctl_crds::{Deployment, DeploymentStatus};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};

/// The kubectl to run, if there is one.
fn kubectl() -> Option<PathBuf> {
    if let Some(k) = std::env::var_os("KUBECTL").filter(|k| !k.is_empty()) {
        return Some(PathBuf::from(k));
    }
    let home = std::env::var_os("CAPYCTL_K8S_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/capyctl-k8s")));
    if let Some(k) = home.map(|h| h.join("bin/kubectl")).filter(|k| k.exists()) {
        return Some(k);
    }
    let on_path = std::process::Command::new("kubectl")
        .arg("version")
        .arg("--client")
        .output()
        .is_ok_and(|o| o.status.success());
    on_path.then(|| PathBuf::from("kubectl"))
}

/// `kubectl --kubeconfig K -n NS ARGS...`: success, and standard output and error.
fn run_kubectl(kubectl: &Path, kubeconfig: &Path, ns: &str, args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(kubectl)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["-n", ns])
        .args(args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// Scales object `name` to `replicas` with kubectl (`cdep`, the short name), or through the
/// scale subresource when there is no kubectl; whether the API server took it, and what it
/// said.
async fn scale_to(
    api: &Api<Deployment>,
    kubeconfig: &Path,
    ns: &str,
    name: &str,
    replicas: u32,
) -> (bool, String) {
    match kubectl() {
        Some(k) => run_kubectl(
            &k,
            kubeconfig,
            ns,
            &["scale", "cdep", name, &format!("--replicas={replicas}")],
        ),
        None => {
            let patch = serde_json::json!({"spec": {"replicas": replicas}});
            match api
                .patch_scale(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => (true, format!("deployment.capyctl.io/{name} scaled")),
                Err(e) => (false, e.to_string()),
            }
        }
    }
}

async fn status_of(api: &Api<Deployment>, name: &str) -> Option<DeploymentStatus> {
    api.get(name).await.ok()?.status
}

/// The deployment `chat-r` as the operator holds it (its management API's view).
async fn held(operator: &Operator, token: &str) -> serde_json::Value {
    let (code, view) = support::management(
        "GET",
        operator.management,
        "/management/v1/deployments/chat-r",
        token,
        None,
    )
    .await;
    assert_eq!(code, 200, "{view}");
    view
}

/// The scenario in namespace `ns` of the API server of `kubeconfig`.
async fn scaled(client: kube::Client, kubeconfig: &Path, ns: &str) {
    let dir = support::temp_dir("k8s-scale");
    let (_agent, agent_port) = start_node_agent(&dir);
    let operator = start_operator_env(
        &dir,
        kubeconfig,
        ns,
        "op-scale",
        AgentsBy::Url(agent_port),
        &[],
    );
    let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let t = Duration::from_secs(60);

    // An object that does not say `replicas`: the API server fills in 1, the document's unset,
    // so the deployment stays at revision 1.
    let created = api
        .create(&PostParams::default(), &model_cr(ns, "chat-r"))
        .await
        .unwrap();
    assert_eq!(created.spec.replicas, Some(1), "the schema's default");
    let first = eventually("chat-r deployed with 1 replica", t, || async {
        let s = status_of(&api, "chat-r").await?;
        (s.deployment_id.is_some() && s.replicas == Some(1)).then_some(s)
    })
    .await;
    assert_eq!(first.ready_replicas, Some(0));
    assert_eq!(first.ready.as_deref(), Some("0/1"));
    assert_eq!(first.revision, Some(1));
    let scale = api.get_scale("chat-r").await.unwrap();
    assert_eq!(scale.spec.and_then(|s| s.replicas), Some(1));
    assert_eq!(scale.status.map(|s| s.replicas), Some(1));

    // kubectl scale: a new generation whose spec says 3.
    let (ok, out) = scale_to(&api, kubeconfig, ns, "chat-r", 3).await;
    assert!(ok, "{out}");
    assert!(out.contains("chat-r scaled"), "{out}");
    let object = api.get("chat-r").await.unwrap();
    assert_eq!(object.spec.replicas, Some(3));
    let generation = object.metadata.generation.unwrap();
    let after = eventually("status.replicas 3", t, || async {
        let s = status_of(&api, "chat-r").await?;
        (s.replicas == Some(3) && s.observed_generation == Some(generation)).then_some(s)
    })
    .await;
    assert_eq!(after.revision, Some(2), "redeployed as a new revision");
    assert_eq!(after.ready.as_deref(), Some("0/3"));
    // The deployment the operator holds has 3 replicas.
    let token = eventually("the admin token", t, || async { operator.admin_token() }).await;
    let view = held(&operator, &token).await;
    assert_eq!(view["spec"]["replicas"], 3, "{view}");
    assert_eq!(view["revision"], 2, "{view}");
    // The scale subresource reads both sides.
    let scale = api.get_scale("chat-r").await.unwrap();
    assert_eq!(scale.spec.and_then(|s| s.replicas), Some(3));
    assert_eq!(scale.status.map(|s| s.replicas), Some(3));

    // A request makes an instance ready: READY counts it (one GPU: one instance fits).
    let (code, body) = chat(operator.inference, "chat-r").await;
    assert_eq!(code, 200, "{body}");
    let ready = eventually("an instance ready in the status", t, || async {
        let s = status_of(&api, "chat-r").await?;
        (s.ready_replicas == Some(1)).then_some(s)
    })
    .await;
    assert_eq!(ready.ready.as_deref(), Some("1/3"));
    // The printer column, as kubectl shows it.
    if let Some(k) = kubectl() {
        let (ok, out) = run_kubectl(&k, kubeconfig, ns, &["get", "cdep", "chat-r"]);
        assert!(ok, "{out}");
        let header: Vec<&str> = out.lines().next().unwrap().split_whitespace().collect();
        let row: Vec<&str> = out.lines().nth(1).unwrap().split_whitespace().collect();
        let ready_at = header.iter().position(|h| *h == "READY").unwrap();
        assert_eq!(row[ready_at], "1/3", "{out}");
    }

    // Out of the document's range: the API server refuses it, nothing changes.
    for bad in [0, 65] {
        let (ok, out) = scale_to(&api, kubeconfig, ns, "chat-r", bad).await;
        assert!(!ok, "--replicas={bad} taken: {out}");
        assert!(out.contains("spec.replicas"), "{out}");
    }
    assert_eq!(api.get("chat-r").await.unwrap().spec.replicas, Some(3));
    // Below scale.min: the CRD's rule refuses it, naming spec.scale.min.
    let merge = |patch: serde_json::Value| {
        let api = api.clone();
        async move {
            api.patch("chat-r", &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .unwrap();
        }
    };
    merge(serde_json::json!({"spec": {"scale": {"min": 2}}})).await;
    let (ok, out) = scale_to(&api, kubeconfig, ns, "chat-r", 1).await;
    assert!(!ok, "--replicas=1 below scale.min taken: {out}");
    assert!(
        out.contains("spec.scale.min") && out.contains("scale.min is above replicas"),
        "{out}"
    );
    assert_eq!(api.get("chat-r").await.unwrap().spec.replicas, Some(3));
    merge(serde_json::json!({"spec": {"scale": null}})).await;

    // Back to 1: the document's unset again, a new revision.
    let (ok, out) = scale_to(&api, kubeconfig, ns, "chat-r", 1).await;
    assert!(ok, "{out}");
    let generation = api.get("chat-r").await.unwrap().metadata.generation;
    let back = eventually("status.replicas 1", t, || async {
        let s = status_of(&api, "chat-r").await?;
        (s.replicas == Some(1) && s.observed_generation == generation).then_some(s)
    })
    .await;
    assert!(back.revision.is_some_and(|r| r > 2), "{:?}", back.revision);
    let view = held(&operator, &token).await;
    assert!(view["spec"].get("replicas").is_none(), "{view}");
    assert!(view["spec"].get("scale").is_none(), "{view}");
    assert!(
        back.ready.as_deref().is_some_and(|r| r.ends_with("/1")),
        "{:?}",
        back.ready
    );
    drop(operator);
    drop(_agent);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs cluster"]
async fn against_a_cluster_kubectl_scale_changes_the_replicas_and_the_status_follows() {
    let (kubeconfig, ns) = cluster_namespace().await;
    scaled(ns.client.clone(), &kubeconfig, &ns.name).await;
}
