//! The management app in-process: [`management::router`] driven with
//! `tower::ServiceExt::oneshot` (no socket), over a real lifecycle whose one host is a
//! [`SimHost`] (engines start, park, wake and stop at once). Each route's success, and its
//! refusals: a missing or wrong admin token (401), an unknown deployment or host (404), a bad
//! document (400 naming the key), a method the route does not take (405); every error body is
//! the product page's JSON (`code`, `message`, `retryable`), and a refusal changes nothing.
//! (`management.rs` beside it tests the listener over a socket against a fake API.)

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use capyctl_lifecycle::store::MemoryStore;
use capyctl_lifecycle::{Core, LifecycleConfig};
use capyctl_router::config::RouterConfig;
use capyctl_router::coordinator::CoordinatorHandle;
use capyctl_server::assembly::assemble;
use capyctl_server::management::{self, ManagementOptions};
use capyctl_spec::api::{
    ActionReceipt, DeployOutcome, DeployReceipt, DeploymentList, DeploymentView, EngineList,
    HostDrainReceipt, HostList, LoadReport, SwitchList,
};
use capyctl_spec::{EngineKind, InstanceState};
use capyctl_test_support::SimHost;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use tower::ServiceExt;

const TOKEN: &str = "s3cret-token";
const V1: &str = "/management/v1";
const HOST: &str = "gpu-box";

/// 6 GiB: fits the simulated host's 10 GiB GPU.
const CHAT_A: &str = "name: chat-a\nengine: vllm\nmodel: Qwen3-4B\nresources: {gpu_memory: 6GiB}\n";

/// The app over a lifecycle on one simulated host, with the router attached as standalone does.
struct App {
    app: Router,
    server: Arc<Core>,
    host: Arc<SimHost>,
    _router: CoordinatorHandle,
}

async fn app() -> App {
    app_with(None).await
}

async fn app_with(tenants: Option<Arc<capyctl_router::tenants::Tenants>>) -> App {
    let host = Arc::new(SimHost::new());
    let config = LifecycleConfig::new(HOST);
    let metrics = config.metrics.clone();
    let server = Core::open(host.clone(), Arc::new(MemoryStore::default()), config)
        .await
        .unwrap();
    let router = assemble(&server, server.clone(), RouterConfig::default(), None)
        .await
        .router;
    let app = management::router(
        server.clone(),
        ManagementOptions {
            token: TOKEN.to_string(),
            metrics,
            tenants,
        },
    );
    App {
        app,
        server,
        host,
        _router: router,
    }
}

struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    fn parse<T: serde::de::DeserializeOwned>(&self, status: StatusCode) -> T {
        assert_eq!(self.status, status, "{}", self.body);
        assert_eq!(
            self.header("content-type"),
            Some("application/json"),
            "{}",
            self.body
        );
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not the expected JSON ({e}): {}", self.body))
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// Asserts the product page's error: this status, a JSON body of exactly `code`, `message`
    /// and `retryable` (true for 429, 502 and 503 only), this code. Returns the message.
    fn error(&self, status: u16, code: &str) -> String {
        assert_eq!(self.status.as_u16(), status, "{}", self.body);
        assert_eq!(
            self.header("content-type"),
            Some("application/json"),
            "{}",
            self.body
        );
        let body = self.json();
        let keys: Vec<&str> = body
            .as_object()
            .unwrap_or_else(|| panic!("not an object: {}", self.body))
            .keys()
            .map(String::as_str)
            .collect();
        assert_eq!(keys, ["code", "message", "retryable"], "{}", self.body);
        assert_eq!(body["code"], code, "{}", self.body);
        assert_eq!(
            body["retryable"],
            matches!(status, 429 | 502 | 503),
            "{}",
            self.body
        );
        let message = body["message"].as_str().unwrap().to_string();
        assert!(!message.is_empty(), "{}", self.body);
        message
    }
}

impl App {
    /// `method path` with `headers` and `body`, through a clone of the app (`oneshot`).
    async fn send(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Reply {
        let mut request = Request::builder()
            .method(Method::from_bytes(method.as_bytes()).unwrap())
            .uri(path);
        for (k, v) in headers {
            request = request.header(*k, *v);
        }
        let request = request.body(Body::from(body.to_string())).unwrap();
        let response = self.app.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let headers = response.headers().clone();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        Reply {
            status,
            headers,
            body: String::from_utf8(bytes.to_vec()).unwrap(),
        }
    }

    /// `method /management/v1<path>` with the admin token and no body.
    async fn authed(&self, method: &str, path: &str) -> Reply {
        self.authed_body(method, path, None, "").await
    }

    /// `method /management/v1<path>` with the admin token and `body` of `content_type`.
    async fn authed_body(
        &self,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: &str,
    ) -> Reply {
        let bearer = format!("Bearer {TOKEN}");
        let mut headers = vec![("Authorization", bearer.as_str())];
        if let Some(ct) = content_type {
            headers.push(("Content-Type", ct));
        }
        self.send(method, &format!("{V1}{path}"), &headers, body)
            .await
    }

    /// Deploys `yaml`, expecting it created; its view.
    async fn deploy(&self, yaml: &str) -> DeploymentView {
        let r = self
            .authed_body("POST", "/deployments", Some("application/yaml"), yaml)
            .await;
        let receipt: DeployReceipt = r.parse(StatusCode::CREATED);
        assert_eq!(receipt.outcome, DeployOutcome::Created);
        receipt.deployment
    }

    /// `POST /deployments/{name}/start` with `{"wait":true}`, expecting 200; its receipt.
    async fn start_and_wait(&self, name: &str) -> ActionReceipt {
        self.authed_body(
            "POST",
            &format!("/deployments/{name}/start"),
            Some("application/json"),
            r#"{"wait":true}"#,
        )
        .await
        .parse(StatusCode::OK)
    }

    async fn list(&self) -> DeploymentList {
        self.authed("GET", "/deployments")
            .await
            .parse(StatusCode::OK)
    }

    async fn view(&self, name: &str) -> DeploymentView {
        self.authed("GET", &format!("/deployments/{name}"))
            .await
            .parse(StatusCode::OK)
    }

    /// The state of deployment `name`.
    async fn state(&self, name: &str) -> InstanceState {
        self.view(name).await.state
    }
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

/// Every `/management/v1` route, known or not, refuses a request without the admin token, or
/// with a wrong one, 401 with the product page's body, and nothing reaches the lifecycle: no
/// deployment created, started or deleted, no host cordoned.
#[tokio::test]
async fn every_route_refuses_a_missing_or_wrong_token_and_changes_nothing() {
    let a = app().await;
    a.deploy(CHAT_A).await;
    let chat_b = "name: chat-b\nengine: vllm\nmodel: m\nresources: {gpu_memory: 1GiB}\n";
    let routes = [
        ("GET", "/deployments", ""),
        ("POST", "/deployments", chat_b),
        ("GET", "/deployments/chat-a", ""),
        ("DELETE", "/deployments/chat-a", ""),
        ("POST", "/deployments/chat-a/start", r#"{"wait":true}"#),
        ("POST", "/deployments/chat-a/stop", ""),
        ("POST", "/deployments/chat-a/park", ""),
        ("POST", "/deployments/chat-a/preinitialize", ""),
        ("GET", "/engines", ""),
        ("GET", "/hosts", ""),
        ("POST", "/hosts/gpu-box/drain", ""),
        ("POST", "/hosts/gpu-box/uncordon", ""),
        ("GET", "/metrics/load", ""),
        ("GET", "/switches", ""),
        ("GET", "/switches/trace", ""),
        ("GET", "/no-such-route", ""),
    ];
    let wrong: [&[(&str, &str)]; 6] = [
        &[],
        &[("Authorization", "Bearer wrong")],
        &[("Authorization", "Bearer s3cret-token-longer")],
        &[("Authorization", "Basic s3cret-token")],
        &[("X-CapyCTL-Token", "wrong")],
        &[("X-CapyCTL-Token", "Bearer s3cret-token")],
    ];
    for (method, path, body) in routes {
        for headers in wrong {
            let r = a.send(method, &format!("{V1}{path}"), headers, body).await;
            assert_eq!(
                r.error(401, "unauthorized"),
                "the management API needs `Authorization: Bearer <admin token>`",
                "{method} {path} {headers:?}"
            );
        }
    }
    assert_eq!(
        a.host.calls(),
        Vec::<String>::new(),
        "no engine was touched"
    );
    let list = a.list().await;
    let names: Vec<&str> = list.deployments.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["chat-a"]);
    assert_eq!(list.deployments[0].state, InstanceState::Stopped);
    let hosts: HostList = a.authed("GET", "/hosts").await.parse(StatusCode::OK);
    assert!(!hosts.hosts[0].cordoned);
    // The token in X-CapyCTL-Token (through the Kubernetes service proxy) opens it.
    let r = a
        .send(
            "GET",
            &format!("{V1}/deployments/chat-a"),
            &[
                ("Authorization", "Bearer the-api-servers-own"),
                ("X-CapyCTL-Token", TOKEN),
            ],
            "",
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
}

/// `POST /deployments` creates (201), finds a document unchanged or updated (200), in YAML and
/// JSON; the deployment is read by name and by ID and listed; `DELETE` answers it as it was,
/// and it is gone.
#[tokio::test]
async fn deployments_are_created_read_updated_and_deleted() {
    let a = app().await;
    let created = a.deploy(CHAT_A).await;
    assert_eq!(created.name, "chat-a");
    assert_eq!(created.revision, 1);
    assert_eq!(created.engine, EngineKind::Vllm);

    let r = a
        .authed_body("POST", "/deployments", Some("application/yaml"), CHAT_A)
        .await;
    let receipt: DeployReceipt = r.parse(StatusCode::OK);
    assert_eq!(receipt.outcome, DeployOutcome::Unchanged);
    assert_eq!(receipt.deployment.id, created.id);

    let changed = CHAT_A.replace("Qwen3-4B", "Qwen3-8B");
    let r = a
        .authed_body("POST", "/deployments", Some("application/yaml"), &changed)
        .await;
    let receipt: DeployReceipt = r.parse(StatusCode::OK);
    assert_eq!(receipt.outcome, DeployOutcome::Updated);
    assert_eq!(
        (
            receipt.deployment.revision,
            receipt.deployment.model.as_str()
        ),
        (2, "Qwen3-8B")
    );

    // JSON, told by its Content-Type or, without one, by its first character.
    let json = r#"{"name":"chat-b","engine":"vllm","model":"m","resources":{"gpu_memory":"1GiB"}}"#;
    let r = a
        .authed_body("POST", "/deployments", Some("application/json"), json)
        .await;
    let chat_b: DeployReceipt = r.parse(StatusCode::CREATED);
    let json = json.replace("chat-b", "chat-c");
    let r = a.authed_body("POST", "/deployments", None, &json).await;
    let _: DeployReceipt = r.parse(StatusCode::CREATED);

    let names: Vec<String> = a
        .list()
        .await
        .deployments
        .into_iter()
        .map(|d| d.name)
        .collect();
    assert_eq!(names, ["chat-a", "chat-b", "chat-c"]);
    for who in ["chat-b", chat_b.deployment.id.as_str()] {
        assert_eq!(a.view(who).await.id, chat_b.deployment.id);
    }

    let r = a.authed("DELETE", "/deployments/chat-b").await;
    let gone: DeploymentView = r.parse(StatusCode::OK);
    assert_eq!(gone.id, chat_b.deployment.id);
    for who in ["chat-b", chat_b.deployment.id.as_str()] {
        let r = a.authed("GET", &format!("/deployments/{who}")).await;
        assert_eq!(
            r.error(404, "not_found"),
            format!("deployment {who} not found")
        );
    }
    let r = a.authed("DELETE", "/deployments/chat-b").await;
    assert_eq!(r.error(404, "not_found"), "deployment chat-b not found");
    assert_eq!(a.list().await.deployments.len(), 2);
}

/// A bad document is 400 `invalid_request` naming the key (and for YAML its line), a too
/// large one 413, one that fits no GPU 409; none of them creates anything.
#[tokio::test]
async fn a_bad_document_is_400_naming_the_key_and_changes_nothing() {
    let a = app().await;
    let post = |ct: &'static str, body: String| {
        let a = &a;
        async move { a.authed_body("POST", "/deployments", Some(ct), &body).await }
    };

    let yaml = "name: chat-a\nengine: vllm\nmodel: m\nresdency: deep\n";
    let message = post("application/yaml", yaml.into())
        .await
        .error(400, "invalid_request");
    assert!(
        message.starts_with("request body:4: resdency: unknown key; expected one of"),
        "{message}"
    );
    let json = r#"{"name":"chat-a","engine":"vllm","model":"m","resources":{"gpu_memory":"4GiB","weights_mem":"1GiB"}}"#;
    let message = post("application/json", json.into())
        .await
        .error(400, "invalid_request");
    assert!(
        message.starts_with("request body: resources.weights_mem: unknown key"),
        "{message}"
    );
    let json = r#"{"name":"chat-a","engine":"vlm","model":"m"}"#;
    let message = post("application/json", json.into())
        .await
        .error(400, "invalid_request");
    assert!(message.starts_with("request body: engine:"), "{message}");
    let message = post("text/plain", CHAT_A.into())
        .await
        .error(400, "invalid_request");
    assert!(message.contains("application/yaml"), "{message}");
    let message = post("application/yaml", String::new())
        .await
        .error(400, "invalid_request");
    assert!(message.contains("empty"), "{message}");

    let big = format!("{CHAT_A}# {}\n", "x".repeat(management::MAX_DOCUMENT_BYTES));
    post("application/yaml", big)
        .await
        .error(413, "request_too_large");

    // Well formed, but larger than the host's only GPU (10 GiB): the lifecycle refuses it.
    let huge = CHAT_A.replace("6GiB", "40GiB");
    let message = post("application/yaml", huge)
        .await
        .error(409, "does_not_fit");
    assert!(message.contains("chat-a"), "{message}");

    assert!(a.list().await.deployments.is_empty());
    assert_eq!(a.host.calls(), Vec::<String>::new());
}

/// Start, park, stop and preinitialize reach the engine on the host and answer their receipt;
/// each refuses an unknown deployment 404; a start's bad body is 400 naming the key.
#[tokio::test]
async fn actions_drive_the_engine_and_refuse_an_unknown_deployment() {
    let a = app().await;
    let chat_a = a.deploy(CHAT_A).await;

    let receipt = a.start_and_wait("chat-a").await;
    assert_eq!(receipt.action, "start");
    assert_eq!(receipt.deployment.id, chat_a.id);
    assert_eq!(a.state("chat-a").await, InstanceState::Ready);
    let started = a.host.calls();
    assert!(
        started.len() == 1 && started[0].starts_with("start "),
        "{started:?}"
    );
    let instance = started[0].trim_start_matches("start ").to_string();

    let r = a
        .authed("POST", &format!("/deployments/{}/park", chat_a.id))
        .await;
    let receipt: ActionReceipt = r.parse(StatusCode::OK);
    assert_eq!(receipt.action, "park");
    assert_eq!(receipt.deployment.id, chat_a.id);
    // Parking runs in the background: its end is the lifecycle's next change.
    let mut changes = capyctl_lifecycle::api::ManagementApi::changes(a.server.as_ref()).unwrap();
    while a.state("chat-a").await != InstanceState::Parked {
        tokio::time::timeout(std::time::Duration::from_secs(10), changes.changed())
            .await
            .expect("the park ends")
            .unwrap();
    }
    assert!(a.host.calls().contains(&format!("park {instance}")));

    let r = a.authed("POST", "/deployments/chat-a/stop").await;
    let receipt: ActionReceipt = r.parse(StatusCode::OK);
    assert_eq!(receipt.action, "stop");
    assert_eq!(a.state("chat-a").await, InstanceState::Stopped);
    assert!(a.host.calls().contains(&format!("stop {instance}")));
    assert!(a.view("chat-a").await.operator_stopped);

    let r = a.authed("POST", "/deployments/chat-a/preinitialize").await;
    let receipt: ActionReceipt = r.parse(StatusCode::OK);
    assert_eq!(receipt.action, "preinitialize");
    assert_eq!(receipt.deployment.id, chat_a.id);

    for action in ["start", "stop", "park", "preinitialize"] {
        let r = a
            .authed("POST", &format!("/deployments/no-such-model/{action}"))
            .await;
        assert_eq!(
            r.error(404, "not_found"),
            "deployment no-such-model not found",
            "{action}"
        );
    }

    let calls = a.host.calls();
    for bad in [r#"{"evict":true,"force":1}"#, r#"{"wait":"yes"}"#, "["] {
        let r = a
            .authed_body(
                "POST",
                "/deployments/chat-a/start",
                Some("application/json"),
                bad,
            )
            .await;
        let message = r.error(400, "invalid_request");
        assert!(message.starts_with("request body of start:"), "{message}");
    }
    let r = a
        .authed_body(
            "POST",
            "/deployments/chat-a/start",
            Some("application/json"),
            r#"{"evict":true,"force":1}"#,
        )
        .await;
    assert!(r.body.contains("unknown field `force`"), "{}", r.body);
    assert_eq!(a.host.calls(), calls, "a refused start touches no engine");
}

/// Engines and hosts are listed from the host agent; a drain cordons the host and an uncordon
/// lifts it, each shown by the host list; an unknown host is 404.
#[tokio::test]
async fn engines_hosts_and_drains() {
    let a = app().await;
    let engines: EngineList = a.authed("GET", "/engines").await.parse(StatusCode::OK);
    assert!(
        engines
            .engines
            .iter()
            .any(|e| e.engine == EngineKind::Vllm && e.host_id == HOST),
        "{engines:?}"
    );
    let hosts: HostList = a.authed("GET", "/hosts").await.parse(StatusCode::OK);
    assert_eq!(hosts.hosts.len(), 1);
    assert_eq!(hosts.hosts[0].id, HOST);
    assert_eq!(hosts.hosts[0].gpus.len(), 1);
    assert!(!hosts.hosts[0].cordoned);

    for (action, cordoned) in [("drain", true), ("uncordon", false)] {
        let r = a.authed("POST", &format!("/hosts/{HOST}/{action}")).await;
        let receipt: HostDrainReceipt = r.parse(StatusCode::OK);
        assert_eq!(
            (
                receipt.action.as_str(),
                receipt.host_id.as_str(),
                receipt.cordoned
            ),
            (action, HOST, cordoned)
        );
        let hosts: HostList = a.authed("GET", "/hosts").await.parse(StatusCode::OK);
        assert_eq!(hosts.hosts[0].cordoned, cordoned, "after {action}");

        let r = a.authed("POST", &format!("/hosts/gpu-z/{action}")).await;
        assert_eq!(r.error(404, "not_found"), "host gpu-z not found");
    }
}

/// The load read (all, one by ID, an unknown ID 404 as the product page says, a bad query
/// 400 naming the key), the switch records (an operator's start is one; by name, after a
/// `seq`; a bad limit 400) and the request trace.
#[tokio::test]
async fn load_switches_and_trace_are_read() {
    let a = app().await;
    let chat_a = a.deploy(CHAT_A).await;

    let load: LoadReport = a.authed("GET", "/metrics/load").await.parse(StatusCode::OK);
    assert_eq!(load.stale_after_ms, 3000);
    let ids: Vec<&str> = load
        .deployments
        .iter()
        .map(|d| d.deployment_id.as_str())
        .collect();
    assert_eq!(ids, [chat_a.id.as_str()]);
    let r = a
        .authed("GET", &format!("/metrics/load?deployment={}", chat_a.id))
        .await;
    let one: LoadReport = r.parse(StatusCode::OK);
    assert_eq!(one.deployments.len(), 1);
    assert_eq!(one.deployments[0].name, "chat-a");

    let r = a.authed("GET", "/metrics/load?deployment=01KNOPE").await;
    assert_eq!(r.error(404, "not_found"), "deployment 01KNOPE not found");
    let r = a
        .authed("GET", &format!("/metrics/load?deploymnt={}", chat_a.id))
        .await;
    let message = r.error(400, "invalid_request");
    assert!(message.contains("`deploymnt`"), "{message}");

    // An operator's start is a `bring_up` switch record of its own.
    a.start_and_wait("chat-a").await;
    let switches: SwitchList = a.authed("GET", "/switches").await.parse(StatusCode::OK);
    let records: Vec<(&str, &str)> = switches
        .switches
        .iter()
        .map(|s| (s.deployment_id.as_str(), s.host_id.as_str()))
        .collect();
    assert_eq!(records, [(chat_a.id.as_str(), HOST)], "{switches:?}");
    let r = a.authed("GET", "/switches?deployment=chat-a&limit=5").await;
    let named: SwitchList = r.parse(StatusCode::OK);
    assert_eq!(named, switches);
    let r = a
        .authed("GET", &format!("/switches?after={}", switches.next))
        .await;
    let later: SwitchList = r.parse(StatusCode::OK);
    assert!(later.switches.is_empty(), "{later:?}");
    let r = a.authed("GET", "/switches?limit=0").await;
    let message = r.error(400, "invalid_request");
    assert!(message.contains("`limit`"), "{message}");

    let r = a.authed("GET", "/switches/trace").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.header("content-type"), Some("application/jsonl"));
}

/// A known route with another method is 405 `method_not_allowed` with `Allow`; an unknown one
/// 404 `not_found` naming it; both in the product page's JSON, and neither reaches the host.
#[tokio::test]
async fn wrong_methods_are_405_and_unknown_routes_404() {
    let a = app().await;
    a.deploy(CHAT_A).await;
    for (method, path, allowed) in [
        ("DELETE", "/hosts", "GET"),
        ("PUT", "/deployments", "POST"),
        ("GET", "/deployments/chat-a/start", "POST"),
        ("PATCH", "/deployments/chat-a", "DELETE"),
        ("GET", "/hosts/gpu-box/drain", "POST"),
    ] {
        let r = a.authed(method, path).await;
        let message = r.error(405, "method_not_allowed");
        assert_eq!(
            message,
            format!("method {method} is not allowed on {V1}{path}; see the Allow header")
        );
        let allow = r.header("allow").unwrap_or_default();
        assert!(allow.contains(allowed), "{method} {path}: Allow: {allow}");
    }
    let r = a.send("POST", "/healthz", &[], "").await;
    r.error(405, "method_not_allowed");

    let r = a.authed("GET", "/nothing").await;
    assert_eq!(
        r.error(404, "not_found"),
        format!("route GET {V1}/nothing not found")
    );
    let r = a.authed("POST", "/deployments/chat-a/explode").await;
    r.error(404, "not_found");
    let r = a.send("GET", "/elsewhere", &[], "").await;
    assert_eq!(r.error(404, "not_found"), "route GET /elsewhere not found");
    assert_eq!(a.host.calls(), Vec::<String>::new());
}

/// Health, readiness (the lifecycle's own) and metrics need no token.
#[tokio::test]
async fn health_readiness_and_metrics_need_no_token() {
    let a = app().await;
    let r = a.send("GET", "/healthz", &[], "").await;
    assert_eq!((r.status, r.body.as_str()), (StatusCode::OK, "ok"));
    let r = a.send("GET", "/readyz", &[], "").await;
    assert_eq!((r.status, r.body.as_str()), (StatusCode::OK, "ready"));
    a.server.set_ready(false);
    let r = a.send("GET", "/readyz", &[], "").await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.body);
    let r = a.send("GET", "/metrics", &[], "").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert!(
        r.header("content-type")
            .is_some_and(|c| c.starts_with("application/openmetrics-text")),
        "{:?}",
        r.headers
    );
    assert!(r.body.ends_with("# EOF\n"), "{}", r.body);
}

/// The load read names the inference listener's tenants (answers by status, tokens, waiting)
/// only when some are configured; otherwise it is the lifecycle's JSON as it was.
#[tokio::test]
async fn the_load_read_has_tenants_only_when_configured() {
    let plain = app().await;
    plain.deploy(CHAT_A).await;
    let r = plain.authed("GET", "/metrics/load").await;
    assert!(r.json().get("tenants").is_none(), "{}", r.body);

    let tenants = Arc::new(capyctl_router::tenants::Tenants::new());
    let a = app_with(Some(Arc::clone(&tenants))).await;
    a.deploy(CHAT_A).await;
    // None configured yet: the same keys as without.
    let r = a.authed("GET", "/metrics/load").await;
    assert!(r.json().get("tenants").is_none(), "{}", r.body);
    tenants
        .install(vec![capyctl_interfaces::tenants::Tenant {
            name: "team-a".into(),
            keys: vec!["sk-a".into()],
            models: None,
            rate: None,
        }])
        .unwrap();
    let r = a.authed("GET", "/metrics/load").await;
    let load: LoadReport = r.parse(StatusCode::OK);
    assert_eq!(load.deployments.len(), 1);
    let v = r.json();
    // Added last, after everything the lifecycle wrote.
    let at = r.body.find(",\"tenants\":[").unwrap();
    assert!(r.body[at..].trim_end().ends_with("]}"), "{}", r.body);
    assert!(r.body[..at].contains("\"deployments\":["), "{}", r.body);
    assert_eq!(
        v["tenants"],
        serde_json::json!([{"name": "team-a", "answers": {}, "tokens": 0, "waiting": 0}])
    );
    assert!(!r.body.contains("sk-a"));
    // One deployment's read carries them too.
    let one = a
        .authed(
            "GET",
            &format!(
                "/metrics/load?deployment={}",
                load.deployments[0].deployment_id
            ),
        )
        .await;
    assert_eq!(one.json()["tenants"][0]["name"], "team-a");
}

/// `GET /deployments` is sent a part at a time once it is longer than one part (each view
/// encoded as its part is sent: no answer of every deployment held), and its bytes are those
/// of the typed list encoded whole; a list of one part is sent whole, with its length.
#[tokio::test]
async fn a_long_deployments_list_is_sent_in_parts_byte_for_byte() {
    use capyctl_lifecycle::api::ManagementApi;

    let a = app().await;
    a.deploy(CHAT_A).await;
    let short = a.authed("GET", "/deployments").await;
    assert_eq!(short.status, StatusCode::OK);
    assert_eq!(
        short.header("content-length"),
        Some(short.body.len().to_string().as_str())
    );
    let typed = serde_json::to_vec(&a.server.list().await).unwrap();
    assert_eq!(short.body.as_bytes(), typed);

    // Some 750 bytes each: 200 of them are a few parts of 64 KiB.
    for i in 0..200 {
        let text = format!(
            "name: m-{:03}\nengine: vllm\nmodel: Qwen3-4B\nresources: {{gpu_memory: 1GiB}}\n",
            (i * 7) % 200
        );
        let doc = capyctl_spec::documents::parse_deployment_str("t.yaml", &text).unwrap();
        a.server.deploy(doc).await.unwrap();
    }
    a.start_and_wait("m-007").await;
    let request = Request::builder()
        .uri(format!("{V1}/deployments"))
        .header("Authorization", format!("Bearer {TOKEN}"))
        .body(Body::empty())
        .unwrap();
    let response = a.app.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let headers = response.headers().clone();
    assert_eq!(
        headers.get("content-type").unwrap().to_str().unwrap(),
        "application/json"
    );
    assert!(headers.get("content-length").is_none(), "{headers:?}");
    let mut body = response.into_body();
    let (mut bytes, mut parts) = (Vec::new(), 0);
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            bytes.extend_from_slice(&data);
            parts += 1;
        }
    }
    let typed = serde_json::to_vec(&a.server.list().await).unwrap();
    assert!(typed.len() > 2 * 64 * 1024, "{} bytes", typed.len());
    assert!(parts > 2, "{parts} parts");
    assert_eq!(bytes.len(), typed.len());
    assert!(
        bytes == typed,
        "the parts joined are the typed list's bytes"
    );
    assert_eq!(a.server.list_json().await.unwrap(), typed);
}
