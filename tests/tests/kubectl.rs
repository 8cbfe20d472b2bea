//! `kubectl capyctl`: the real `kubectl-capyctl` binary finds the cluster in the kubeconfig and
//! reaches the management API through the API server's service proxy. Here the API server is the
//! shared mock API server (`capyctl_test_support::MockApi`) behind a loopback listener, answering
//! as a real one would and recording what it saw; the `needs cluster` test runs against a real
//! one.
#![allow(clippy::unwrap_used)]

use capyctl_test_support::cluster;

use std::process::Command;
use std::sync::{Arc, Mutex};

use capyctl_test_support::{Answer, MockApi};

/// The real `kubectl-capyctl` of this workspace, built first when missing or stale.
fn plugin() -> std::path::PathBuf {
    capyctl_test_support::workspace_binary("capyctl", "kubectl-capyctl")
}

/// One request the fake API server saw.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: String,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The shared mock API server ([`MockApi::listen`]) on a loopback port, with a runtime of its
/// own for the test's life: each request is answered with `answer(request) -> (status, body)`
/// and recorded.
fn fake_api_server(
    answer: impl Fn(&Seen) -> (u16, String) + Send + Sync + 'static,
) -> (String, Arc<Mutex<Vec<Seen>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    let (url_tx, url_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let (url, api) = MockApi::listen().await;
            let server = api.serve_with(move |call| {
                let path = if call.query.is_empty() {
                    call.path.clone()
                } else {
                    format!("{}?{}", call.path, call.query)
                };
                let seen = Seen {
                    method: call.method.to_string(),
                    path,
                    headers: call
                        .headers
                        .iter()
                        .map(|(k, v)| (k.as_str().to_string(), v.to_str().unwrap().to_string()))
                        .collect(),
                    body: String::from_utf8_lossy(&call.raw_body).into_owned(),
                };
                let (status, body) = answer(&seen);
                log.lock().unwrap().push(seen);
                Answer::Raw {
                    status,
                    body: body.into(),
                }
            });
            url_tx.send(url).unwrap();
            let _ = server.await;
        });
    });
    (url_rx.recv().unwrap(), seen)
}

fn kubeconfig(dir: &std::path::Path, server: &str) -> std::path::PathBuf {
    let path = dir.join("kubeconfig");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: test\nclusters:\n- name: test\n  cluster: {{server: \"{server}\"}}\n\
             users:\n- name: me\n  user: {{token: kube-user-token}}\ncontexts:\n- name: test\n  context: {{cluster: test, user: me, namespace: gpu}}\n"
        ),
    )
    .unwrap();
    path
}

fn run_plugin(kubeconfig: &std::path::Path, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(plugin())
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .env_remove("CAPYCTL_SERVER")
        .env_remove("CAPYCTL_ADMIN_TOKEN")
        .env_remove("CAPYCTL_NAMESPACE")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

const LIST: &str = r#"{"deployments":[]}"#;

/// The management API's view of `my-model` at `revision`.
fn view_json(revision: u64) -> String {
    serde_json::json!({
        "id": "01KMYMODEL", "name": "my-model", "state": "stopped", "ready": "0/1",
        "revision": revision, "hosts": ["node-a"], "activation": "on_demand", "warm": false,
        "operator_stopped": false, "engine": "vllm", "model": "Qwen/Qwen3-4B", "instances": [],
        "spec": {"name": "my-model", "engine": "vllm", "model": "Qwen/Qwen3-4B"},
    })
    .to_string()
}

const NOT_FOUND_API: &str =
    r#"{"code":"not_found","message":"deployment my-model not found","retryable":false}"#;
const NOT_FOUND_KUBE: &str = r#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"not found","reason":"NotFound","code":404}"#;

/// `kubectl capyctl deploy model --file` of a document `text` (written into a fresh directory
/// beside a kubeconfig for the fake API server at `url`): the kubeconfig, and the exit code,
/// stdout and stderr.
fn deploy_through(
    url: &str,
    test: &str,
    text: &str,
) -> (std::path::PathBuf, (i32, String, String)) {
    let dir = capyctl_test_support::temp_dir(&format!("kubectl-capyctl-{test}"));
    let config = kubeconfig(&dir, url);
    let file = dir.join("my-model.yaml");
    std::fs::write(&file, text).unwrap();
    let file = file.to_str().unwrap();
    let out = run_plugin(
        &config,
        &["deploy", "model", "--file", file, "--token", "t"],
    );
    (config, out)
}

/// `kubectl capyctl deploy model` writes the Deployment object (the operator's management API
/// refuses deploys on Kubernetes) with the user's credentials, waits until the operator has
/// taken its generation, and prints the receipt; `delete deployment` deletes the object and
/// waits until the operator has let the deployment go.
#[test]
fn deploy_and_delete_write_the_deployment_object() {
    #[derive(Default)]
    struct Cluster {
        object: Option<serde_json::Value>,
        /// The operator has deployed the object's generation.
        deployed: bool,
        deleted: bool,
    }
    let cluster = Arc::new(Mutex::new(Cluster::default()));
    let state = cluster.clone();
    let crs = "/apis/capyctl.io/v1alpha1/namespaces/gpu/deployments";
    let view = "/api/v1/namespaces/gpu/services/capyctl-management:management/proxy/management/v1/deployments/";
    let (url, seen) = fake_api_server(move |req| {
        let mut c = state.lock().unwrap();
        let path = req.path.split('?').next().unwrap().to_string();
        match (req.method.as_str(), path.as_str()) {
            ("GET", p) if p == format!("{crs}/my-model") => match &c.object {
                None => (404, NOT_FOUND_KUBE.to_string()),
                Some(o) => {
                    let mut o = o.clone();
                    // The operator takes a generation on the first read after it was written.
                    if !c.deleted {
                        o["status"] = serde_json::json!({"observedGeneration": 1});
                        c.deployed = true;
                    }
                    (200, o.to_string())
                }
            },
            ("POST", p) if p == crs => {
                let mut o: serde_json::Value = serde_json::from_str(&req.body).unwrap();
                o["metadata"]["generation"] = 1.into();
                o["metadata"]["resourceVersion"] = "1".into();
                c.object = Some(o.clone());
                (201, o.to_string())
            }
            ("DELETE", p) if p == format!("{crs}/my-model") => {
                c.deleted = true;
                (200, c.object.clone().unwrap().to_string())
            }
            ("GET", p) if p.starts_with(view) => {
                if c.deployed && !c.deleted {
                    (200, view_json(1))
                } else {
                    (404, NOT_FOUND_API.to_string())
                }
            }
            _ => (404, NOT_FOUND_KUBE.to_string()),
        }
    });
    let (config, (code, stdout, stderr)) = deploy_through(
        &url,
        "deploy",
        "name: my-model\nengine: vllm\nmodel: Qwen/Qwen3-4B\nresources: {gpu_memory: 20GiB}\n",
    );
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(
        stdout,
        "deployment my-model (01KMYMODEL) created, revision 1, state stopped\n"
    );
    let created = seen
        .lock()
        .unwrap()
        .iter()
        .find(|s| s.method == "POST")
        .cloned()
        .unwrap();
    // With the user's own credentials, as the field manager kubectl-capyctl.
    assert_eq!(
        created.header("authorization"),
        Some("Bearer kube-user-token")
    );
    assert!(
        created.path.contains("fieldManager=kubectl-capyctl"),
        "{}",
        created.path
    );
    let body: serde_json::Value = serde_json::from_str(&created.body).unwrap();
    assert_eq!(body["kind"], "Deployment");
    assert_eq!(body["metadata"]["name"], "my-model");
    assert_eq!(body["spec"]["model"], "Qwen/Qwen3-4B");
    assert_eq!(body["spec"]["resources"]["gpuMemory"], "20GiB");
    // Nothing was posted to the management API.
    assert!(
        !seen
            .lock()
            .unwrap()
            .iter()
            .any(|s| s.method == "POST" && s.path.contains("/proxy/"))
    );

    let (code, stdout, stderr) = run_plugin(
        &config,
        &["delete", "deployment", "my-model", "--token", "t"],
    );
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout, "deleted deployment my-model (01KMYMODEL)\n");
    assert!(
        seen.lock()
            .unwrap()
            .iter()
            .any(|s| s.method == "DELETE" && s.path.starts_with(&format!("{crs}/my-model")))
    );
    assert!(
        !seen
            .lock()
            .unwrap()
            .iter()
            .any(|s| s.method == "DELETE" && s.path.contains("/proxy/"))
    );
    assert!(cluster.lock().unwrap().deleted);
}

#[test]
fn the_plugin_goes_through_the_service_proxy_with_the_secrets_token() {
    let (url, seen) = fake_api_server(|req| {
        match req.path.as_str() {
        "/api/v1/namespaces/gpu/secrets/capyctl-admin-token" => (
            200,
            // base64("s3cret\n")
            r#"{"apiVersion":"v1","kind":"Secret","metadata":{"name":"capyctl-admin-token"},"data":{"token":"czNjcmV0Cg=="}}"#.to_string(),
        ),
        "/api/v1/namespaces/gpu/services/capyctl-management:management/proxy/management/v1/deployments" => {
            (200, LIST.to_string())
        }
        _ => (404, r#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"not found","reason":"NotFound","code":404}"#.to_string()),
    }
    });
    let dir = capyctl_test_support::temp_dir("kubectl-capyctl");
    let config = kubeconfig(&dir, &url);

    let (code, stdout, stderr) = run_plugin(&config, &["list", "deployments"]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout, "NAME   STATE   READY   REVISION   HOSTS\n");
    let seen = seen.lock().unwrap().clone();
    let proxied = seen
        .iter()
        .find(|s| s.path.contains("/proxy/"))
        .expect("no proxied request");
    assert_eq!(proxied.method, "GET");
    // The API server's credential in Authorization, the admin token beside it.
    assert_eq!(
        proxied.header("authorization"),
        Some("Bearer kube-user-token")
    );
    assert_eq!(proxied.header("x-capyctl-token"), Some("s3cret"));
    assert!(
        seen.iter()
            .any(|s| s.path.ends_with("/secrets/capyctl-admin-token"))
    );
}

#[test]
fn namespace_release_and_token_flags_pick_the_service() {
    let (url, seen) = fake_api_server(|req| {
        if req.path
            == "/api/v1/namespaces/ml/services/prod-capyctl-management:management/proxy/management/v1/engines"
        {
            (200, r#"{"engines":[]}"#.to_string())
        } else {
            (403, r#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"services \"x\" is forbidden: User \"me\" cannot get resource \"services/proxy\"","reason":"Forbidden","code":403}"#.to_string())
        }
    });
    let dir = capyctl_test_support::temp_dir("kubectl-capyctl-ns");
    let config = kubeconfig(&dir, &url);
    let (code, stdout, stderr) = run_plugin(
        &config,
        &[
            "engine",
            "list",
            "-n",
            "ml",
            "--release",
            "prod",
            "--token",
            "t0k",
        ],
    );
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout, "ENGINE   VERSION   DEEP PARK   HOST\n");
    let proxied = seen
        .lock()
        .unwrap()
        .iter()
        .find(|s| s.path.contains("/proxy/"))
        .cloned()
        .unwrap();
    assert_eq!(proxied.header("x-capyctl-token"), Some("t0k"));
    // The API server's own refusal is one line with its message.
    let (code, _, stderr) = run_plugin(&config, &["list", "deployments", "--token", "t0k"]);
    assert_ne!(code, 0);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("403 Forbidden from the Kubernetes API server")
            && stderr.contains("cannot get resource \"services/proxy\" (Forbidden)"),
        "{stderr}"
    );
}

#[test]
fn a_tls_management_listener_is_reached_with_https_through_the_proxy() {
    let (url, seen) = fake_api_server(|req| {
        match req.path.as_str() {
        // The chart marks the port https when operator.tls.secretName is set.
        "/api/v1/namespaces/gpu/services/capyctl-management" => (
            200,
            r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"capyctl-management"},"spec":{"ports":[{"name":"management","port":7443,"appProtocol":"https"}]}}"#.to_string(),
        ),
        "/api/v1/namespaces/gpu/services/https:capyctl-management:management/proxy/management/v1/deployments" => {
            (200, LIST.to_string())
        }
        _ => (404, r#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"not found","reason":"NotFound","code":404}"#.to_string()),
    }
    });
    let dir = capyctl_test_support::temp_dir("kubectl-capyctl-tls");
    let config = kubeconfig(&dir, &url);
    let (code, stdout, stderr) = run_plugin(&config, &["list", "deployments", "--token", "t"]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout, "NAME   STATE   READY   REVISION   HOSTS\n");
    assert!(seen.lock().unwrap().iter().any(|s| {
        s.path
            .contains("/services/https:capyctl-management:management/proxy/")
    }),);
}

/// Against a real API server (Kubernetes 1.34, no kubelet, no controller-manager): the
/// plugin's calls reach the release's management Service through the service proxy. No Pod
/// runs behind it, so the API server itself answers the proxied call with an error: 503 "no
/// endpoints available" where an Endpoints object exists, or 404 for the Endpoints nobody
/// created; either way the answer names the Service and comes from the API server, which
/// proves the path, the RBAC and the token lookup. Without the Secret the plugin says it
/// cannot read it. Fails, naming it, when `CAPYCTL_TEST_KUBECONFIG` is unset, as every
/// needs-cluster test.
#[tokio::test]
#[ignore = "needs cluster"]
async fn the_plugin_reaches_the_service_proxy_of_a_real_cluster() {
    use k8s_openapi::api::core::v1::{Secret, Service};
    use kube::api::{DeleteParams, PostParams};

    let (kubeconfig, client) = cluster::cluster().await;
    let ns = cluster::TestNamespace::create(&kubeconfig, &client, "capyctl-plugin").await;
    let service: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "capyctl-management"},
        "spec": {"ports": [{"name": "management", "port": 7443}],
                 "selector": {"app": "nothing-runs-here"}},
    }))
    .unwrap();
    ns.api::<Service>()
        .create(&PostParams::default(), &service)
        .await
        .unwrap();
    let secret: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "capyctl-admin-token"},
        "stringData": {"token": "s3cret"},
    }))
    .unwrap();
    ns.api::<Secret>()
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();

    let args = ["list", "deployments", "-n", ns.name.as_str()];
    let (code, _, stderr) = run_plugin(&kubeconfig, &args);
    assert_ne!(code, 0);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    // The service proxy's own answer for a Service with nothing behind it (no Endpoints:
    // 404 or 503; an Endpoints object nothing answers at: 502 or 503).
    assert!(stderr.contains("capyctl-management"), "{stderr}");
    assert!(
        ["503", "404", "502"].iter().any(|s| stderr.contains(s)),
        "{stderr}"
    );
    assert!(!stderr.contains("admin token"), "{stderr}");

    ns.api::<Secret>()
        .delete("capyctl-admin-token", &DeleteParams::default())
        .await
        .unwrap();
    let (code, _, stderr) = run_plugin(&kubeconfig, &args);
    assert_ne!(code, 0);
    assert!(
        stderr.contains(&format!(
            "cannot read the admin token Secret {}/capyctl-admin-token",
            ns.name
        )),
        "{stderr}"
    );
}

/// An object the operator refuses (`Accepted=False`) is reported at once with its reason, not
/// after the wait.
#[test]
fn a_refused_object_is_reported_with_the_operators_reason() {
    let created = Arc::new(Mutex::new(None::<serde_json::Value>));
    let state = created.clone();
    let crs = "/apis/capyctl.io/v1alpha1/namespaces/gpu/deployments";
    let (url, _seen) = fake_api_server(move |req| {
        let mut c = state.lock().unwrap();
        let path = req.path.split('?').next().unwrap().to_string();
        match (req.method.as_str(), path.as_str()) {
            ("GET", p) if p == format!("{crs}/my-model") => match &*c {
                None => (404, NOT_FOUND_KUBE.to_string()),
                Some(o) => {
                    let mut o = o.clone();
                    o["status"] = serde_json::json!({"conditions": [{
                        "type": "Accepted", "status": "False", "reason": "invalid_spec",
                        "message": "the lifecycle refused it: no host has the engine sglang",
                        "lastTransitionTime": "2026-12-03T00:00:00Z",
                    }]});
                    (200, o.to_string())
                }
            },
            ("POST", p) if p == crs => {
                let mut o: serde_json::Value = serde_json::from_str(&req.body).unwrap();
                o["metadata"]["generation"] = 1.into();
                *c = Some(o.clone());
                (201, o.to_string())
            }
            _ => (404, NOT_FOUND_API.to_string()),
        }
    });
    // The plugin is built (when missing or stale) before the clock starts: the bound is on
    // its answers, not on a build.
    plugin();
    let began = std::time::Instant::now();
    let (_, (code, _, stderr)) = deploy_through(
        &url,
        "refused",
        "name: my-model\nengine: sglang\nmodel: m\n",
    );
    assert_eq!(code, 1, "{stderr}");
    assert_eq!(
        stderr,
        "capyctl: the operator did not accept the Deployment object gpu/my-model: the lifecycle refused it: no host has the engine sglang\n"
    );
    // Not the 120 s wait.
    assert!(began.elapsed() < std::time::Duration::from_secs(60));
}

/// A 503 through the service proxy (an operator not ready, or the management API's own
/// `unavailable`) is printed at once and never sent again: kube's client retried it 15 times
/// with a backoff growing to minutes (the cluster test's `list` took 380 s), and a refused
/// `start` would have been sent again. Fails without `default_retry = false` (16 calls of each).
#[test]
fn a_503_through_the_proxy_is_printed_at_once_and_never_sent_again() {
    let proxy = "/api/v1/namespaces/gpu/services/capyctl-management:management/proxy/management/v1";
    let (url, seen) = fake_api_server(move |req| {
        if req.path.starts_with(proxy) {
            (
                503,
                r#"{"code":"unavailable","message":"the management API is not ready","retryable":true}"#
                    .to_string(),
            )
        } else {
            (404, NOT_FOUND_KUBE.to_string())
        }
    });
    let dir = capyctl_test_support::temp_dir("kubectl-capyctl-503");
    let config = kubeconfig(&dir, &url);
    // The plugin is built (when missing or stale) before the clock starts: the bound is on
    // its answers, not on a build.
    plugin();
    let began = std::time::Instant::now();
    for args in [
        &["list", "deployments", "--token", "t"][..],
        &["start", "deployment", "my-model", "--token", "t"][..],
    ] {
        let (code, _, stderr) = run_plugin(&config, args);
        assert_eq!(code, 1, "{stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(
            stderr.contains("the management API is not ready"),
            "{stderr}"
        );
    }
    let calls: Vec<String> = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|s| s.path.starts_with(proxy))
        .map(|s| format!("{} {}", s.method, s.path.trim_start_matches(proxy)))
        .collect();
    assert_eq!(
        calls,
        ["GET /deployments", "POST /deployments/my-model/start"]
    );
    assert!(began.elapsed() < std::time::Duration::from_secs(30));
}

/// The operator watches the namespaces the management Service's annotation names: `deploy` in
/// another writes nothing and says where models go; `list` says so too, with the objects it
/// ignores there; in a watched namespace `list` names the objects the operator refuses.
#[test]
fn a_namespace_the_operator_does_not_watch_is_told_where_models_go() {
    let crs = |ns: &str| format!("/apis/capyctl.io/v1alpha1/namespaces/{ns}/deployments");
    let object = |ns: &str, name: &str, status: serde_json::Value| {
        serde_json::json!({"apiVersion": "capyctl.io/v1alpha1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": ns, "generation": 1},
            "spec": {"engine": "vllm", "model": "m"}, "status": status})
    };
    let list = |items: Vec<serde_json::Value>| {
        serde_json::json!({"apiVersion": "capyctl.io/v1alpha1", "kind": "DeploymentList",
            "metadata": {}, "items": items})
        .to_string()
    };
    let ignored = list(vec![object("team-x", "chat-x", serde_json::json!({}))]);
    let refused = list(vec![object(
        "team-a",
        "chat",
        serde_json::json!({"conditions": [{"type": "Accepted", "status": "False",
            "reason": "name_taken", "lastTransitionTime": "2026-12-04T00:00:00Z",
            "message": "the deployment name chat is taken by the Deployment object ops/chat"}]}),
    )]);
    let refused_one =
        serde_json::from_str::<serde_json::Value>(&refused).unwrap()["items"][0].clone();
    let (crs_x, crs_a) = (crs("team-x"), crs("team-a"));
    let (url, seen) = fake_api_server(move |req| {
        let path = req.path.split('?').next().unwrap();
        match (req.method.as_str(), path) {
            ("GET", "/api/v1/namespaces/ops/services/capyctl-management") => (
                200,
                serde_json::json!({"apiVersion": "v1", "kind": "Service",
                    "metadata": {"name": "capyctl-management", "namespace": "ops",
                        "annotations": {"capyctl.io/watch-namespaces": "ops,team-a"}},
                    "spec": {"ports": [{"name": "management", "port": 7443}]}})
                .to_string(),
            ),
            (
                "GET",
                "/api/v1/namespaces/ops/services/capyctl-management:management/proxy/management/v1/deployments",
            ) => (200, LIST.to_string()),
            ("GET", p) if p == crs_x => (200, ignored.clone()),
            ("GET", p) if p == crs_a => (200, refused.clone()),
            ("GET", p) if p == format!("{crs_a}/chat") => (200, refused_one.to_string()),
            ("DELETE", p) if p == format!("{crs_a}/chat") => (200, refused_one.to_string()),
            _ => (404, NOT_FOUND_KUBE.to_string()),
        }
    });
    let dir = capyctl_test_support::temp_dir("kubectl-capyctl-watch");
    let config = kubeconfig(&dir, &url);
    let doc = dir.join("chat-x.yaml");
    std::fs::write(&doc, "name: chat-x\nengine: vllm\nmodel: m\n").unwrap();
    let at = |ns: &'static str| ["-n", ns, "--release-namespace", "ops", "--token", "t"];

    let mut args = vec!["deploy", "model", "--file", doc.to_str().unwrap()];
    args.extend(at("team-x"));
    let (code, _, stderr) = run_plugin(&config, &args);
    assert_eq!(code, 1, "{stderr}");
    assert_eq!(
        stderr,
        "capyctl: the CapyCTL operator of release capyctl (namespace ops) does not watch namespace team-x: it takes Deployment objects from ops, team-a only; deploy in one of those (kubectl capyctl -n ops --release-namespace ops deploy model --file F), or add team-x to the chart value operator.watchNamespaces\n"
    );
    // Nothing was written, nor asked of the operator.
    assert!(
        seen.lock()
            .unwrap()
            .iter()
            .all(|s| s.method == "GET" && !s.path.contains("/proxy/")),
        "{:?}",
        seen.lock()
            .unwrap()
            .iter()
            .map(|s| &s.path)
            .collect::<Vec<_>>()
    );

    let mut args = vec!["list", "deployments"];
    args.extend(at("team-x"));
    let (code, stdout, stderr) = run_plugin(&config, &args);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout, "NAME   STATE   READY   REVISION   HOSTS\n");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 2, "{stderr}");
    assert!(
        lines[0].starts_with("note: the CapyCTL operator of release capyctl (namespace ops) does not watch namespace team-x"),
        "{stderr}"
    );
    assert_eq!(
        lines[1],
        "note: so the Deployment objects of team-x are not served: chat-x"
    );

    let mut args = vec!["list", "deployments"];
    args.extend(at("team-a"));
    let (code, _, stderr) = run_plugin(&config, &args);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(
        stderr,
        "note: the Deployment object team-a/chat is not accepted: the deployment name chat is taken by the Deployment object ops/chat\n"
    );
    // Deleting that object deletes it at once and leaves ops/chat's deployment alone: the
    // operator is not asked, nothing waits for the deployment to go.
    let mut args = vec!["delete", "deployment", "chat"];
    args.extend(at("team-a"));
    let (code, stdout, stderr) = run_plugin(&config, &args);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(
        stdout,
        "deleted the Deployment object team-a/chat, which was not served: the deployment name chat is taken by the Deployment object ops/chat\n"
    );
    let seen = seen.lock().unwrap();
    assert!(seen.iter().any(|s| s.method == "DELETE"));
    assert!(
        !seen
            .iter()
            .any(|s| s.path.contains("/proxy/management/v1/deployments/chat"))
    );
}
