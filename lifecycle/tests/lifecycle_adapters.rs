//! LoRA adapters as models of their own (DESIGN 4.9) under tokio's paused clock: the real
//! coordinator and lifecycle over the simulated host, whose adapter loads take a set time.
//! Deploy refusals, a request for an adapter making its base servable and loading it, least
//! recently used unloads, a failed load, switch records of cause `adapter`, the views and the
//! load read, and the loaded set after a restart of the base.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use capyctl_interfaces::router::{AdapterLease, Lifecycle};
use capyctl_lifecycle::Core;
use capyctl_lifecycle::LifecycleConfig;
use capyctl_lifecycle::api::ManagementApi;
use capyctl_lifecycle::store::MemoryStore;
use capyctl_router::admission::{Admission, Permit};
use capyctl_router::config::RouterConfig;
use capyctl_router::coordinator::{CoordinatorHandle, CoordinatorPermit};
use capyctl_server::assembly::assemble;
use capyctl_spec::api::{StartRequest, SwitchCause, SwitchOutcome, SwitchPhaseKind, SwitchQuery};
use capyctl_spec::documents::{DeploymentDoc, parse_deployment_str};
use capyctl_spec::errors::ApiError;
use capyctl_test_support::{SimHost, Timings};
use tokio::time::Instant;

const START: Duration = Duration::from_secs(4);
const LOAD: Duration = Duration::from_millis(50);

fn doc(text: &str) -> DeploymentDoc {
    parse_deployment_str("t.yaml", text).unwrap()
}

/// PEFT directories of the given ranks, removed when dropped.
struct Peft(PathBuf);

impl Peft {
    fn new(tag: &str, ranks: &[(&str, u32)]) -> Self {
        let root = std::env::temp_dir().join(format!("capyctl-lora-{tag}-{}", std::process::id()));
        for (name, r) in ranks {
            let dir = root.join(name);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(
                dir.join("adapter_config.json"),
                format!(r#"{{"r": {r}, "peft_type": "LORA"}}"#),
            )
            .unwrap();
        }
        Peft(root)
    }

    fn path(&self, name: &str) -> String {
        self.0.join(name).display().to_string()
    }
}

impl Drop for Peft {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn open(agent: &Arc<SimHost>) -> Arc<Core> {
    Core::open(
        agent.clone(),
        Arc::new(MemoryStore::default()),
        LifecycleConfig::new("h"),
    )
    .await
    .unwrap()
}

/// The base on vLLM (`max_loaded`, `base_extra` lines) and the adapters `names` of `files`.
async fn deploy_all(
    server: &Core,
    files: &Peft,
    max_loaded: u32,
    base_extra: &str,
    names: &[&str],
) {
    deploy_on(server, "vllm", files, max_loaded, base_extra, names).await;
}

/// [`deploy_all`] with the base on `engine`.
async fn deploy_on(
    server: &Core,
    engine: &str,
    files: &Peft,
    max_loaded: u32,
    base_extra: &str,
    names: &[&str],
) {
    server
        .deploy(doc(&format!(
            "name: base\nengine: {engine}\nmodel: m\nresources: {{gpu_memory: 6GiB}}\nadapters: {{max_loaded: {max_loaded}, max_rank: 16}}\n{base_extra}"
        )))
        .await
        .unwrap();
    for name in names {
        server
            .deploy(doc(&format!(
                "name: {name}\nadapter: {{base: base, path: {}}}\n",
                files.path(name)
            )))
            .await
            .unwrap();
    }
}

struct Scene {
    server: Arc<Core>,
    router: CoordinatorHandle,
    agent: Arc<SimHost>,
    files: Peft,
}

async fn scene(tag: &str, max_loaded: u32, base_extra: &str) -> Scene {
    scene_on(1, tag, max_loaded, base_extra).await
}

/// [`scene`] on a host of `gpus` GPUs.
async fn scene_on(gpus: u32, tag: &str, max_loaded: u32, base_extra: &str) -> Scene {
    let agent = Arc::new(
        SimHost::new()
            .with_gpus(gpus)
            .with_adapter_load(LOAD)
            .with_times(Timings {
                start: START,
                ..Timings::default()
            }),
    );
    let server = open(&agent).await;
    let router = assemble(&server, server.clone(), RouterConfig::default(), None)
        .await
        .router;
    let files = Peft::new(tag, &[("a1", 8), ("a2", 8), ("a3", 8), ("big", 64)]);
    deploy_all(&server, &files, max_loaded, base_extra, &["a1", "a2", "a3"]).await;
    Scene {
        server,
        router,
        agent,
        files,
    }
}

impl Scene {
    /// A request for `model` admitted and, for an adapter, its adapter loaded: what it holds
    /// while it runs.
    async fn request(
        &self,
        model: &str,
    ) -> Result<(CoordinatorPermit, Option<AdapterLease>), ApiError> {
        let deadline = Instant::now() + Duration::from_secs(600);
        let d = self.router.resolve(model).unwrap();
        let route = self.server.adapter(model);
        // As the listener does: the instances that have the adapter loaded take it first.
        let prefer = route
            .as_ref()
            .map_or_else(Vec::new, |r| self.server.adapter_loaded_on(&r.name));
        let permit = self
            .router
            .admit_preferring(d, deadline, None, None, prefer)
            .await?;
        let lease = match route {
            Some(route) => Some(
                self.server
                    .acquire_adapter(&permit.upstream().key, &route, deadline)
                    .await?,
            ),
            None => None,
        };
        Ok((permit, lease))
    }

    fn adapter_calls(&self) -> Vec<String> {
        self.agent
            .calls()
            .into_iter()
            .filter(|c| c.contains("adapter"))
            .map(|c| {
                // `load_adapter <iid> <name>` without the instance ID.
                let mut w = c.split(' ');
                format!("{} {}", w.next().unwrap(), w.nth(1).unwrap())
            })
            .collect()
    }
}

#[tokio::test(start_paused = true)]
async fn a_request_for_an_adapter_starts_its_base_and_loads_it_once() {
    let s = scene("serve", 2, "").await;
    let began = Instant::now();
    let (permit, lease) = s.request("a1").await.unwrap();
    assert_eq!(
        began.elapsed(),
        START + LOAD,
        "the base's start, then the load"
    );
    assert_eq!(
        permit.upstream().key.deployment,
        s.server.view("base").unwrap().id
    );
    assert_eq!(s.adapter_calls(), ["load_adapter a1"]);
    drop((permit, lease));
    // Loaded: the next one runs at once, with no load.
    let began = Instant::now();
    drop(s.request("a1").await.unwrap());
    assert_eq!(began.elapsed(), Duration::ZERO);
    assert_eq!(s.adapter_calls(), ["load_adapter a1"]);

    // The lists: loaded / unloaded, the base as its host, the load read per instance.
    let a1 = s.server.view("a1").unwrap();
    assert_eq!(capyctl_spec::api::listed_state(&a1), "loaded");
    assert_eq!(a1.hosts, ["base"]);
    assert_eq!(a1.ready, "1/1");
    let a2 = s.server.view("a2").unwrap();
    assert_eq!(capyctl_spec::api::listed_state(&a2), "unloaded");
    let models = s.server.models();
    let state = |id: &str| models.iter().find(|m| m.id == id).unwrap().state.clone();
    assert_eq!(
        (state("a1"), state("a2"), state("base")),
        ("loaded".into(), "unloaded".into(), "ready".into())
    );
    let load = s.server.load(Some("base")).await.unwrap();
    assert_eq!(load.deployments[0].instances[0].adapters, ["a1"]);

    // Its record: cause adapter, one adapter_load phase of the load's time, ok.
    let records = s
        .server
        .switches(SwitchQuery::default())
        .await
        .unwrap()
        .switches;
    let r = records
        .iter()
        .find(|r| r.cause == SwitchCause::Adapter)
        .unwrap();
    assert_eq!(
        (r.deployment.as_str(), r.outcome),
        ("a1", SwitchOutcome::Ok)
    );
    assert_eq!(r.phases.len(), 1);
    assert_eq!(r.phases[0].phase, SwitchPhaseKind::AdapterLoad);
    assert_eq!(
        r.phases[0].ended_ms.unwrap() - r.phases[0].began_ms,
        u64::try_from(LOAD.as_millis()).unwrap()
    );
}

#[tokio::test(start_paused = true)]
async fn with_replicas_the_next_request_for_an_adapter_goes_where_it_is_loaded() {
    // Two GPUs: one instance of the base on each.
    let s = scene_on(2, "replicas", 2, "replicas: 2\n").await;
    let (first, lease) = s.request("a1").await.unwrap();
    let ready = || s.server.view("base").unwrap().ready;
    if ready() != "2/2" {
        tokio::time::sleep(START).await;
    }
    assert_eq!(ready(), "2/2");
    let loaded_on = first.upstream().key.clone();
    assert_eq!(
        s.server.adapter_loaded_on("a1"),
        std::slice::from_ref(&loaded_on)
    );
    // The first still runs there, the other instance is idle: the next request for a1 goes
    // where a1 is loaded (no second load), and one for the base to the idle one.
    let (second, lease2) = s.request("a1").await.unwrap();
    assert_eq!(second.upstream().key, loaded_on);
    let (base, _) = s.request("base").await.unwrap();
    assert_ne!(base.upstream().key, loaded_on);
    assert_eq!(s.adapter_calls(), ["load_adapter a1"]);
    // a2, loaded nowhere: the least loaded instance (the other one), loaded there.
    let (third, lease3) = s.request("a2").await.unwrap();
    assert_ne!(third.upstream().key, loaded_on);
    assert_eq!(s.adapter_calls(), ["load_adapter a1", "load_adapter a2"]);
    drop((first, lease, second, lease2, base, third, lease3));
}

#[tokio::test(start_paused = true)]
async fn past_max_loaded_the_least_recently_used_idle_adapter_is_unloaded() {
    let s = scene("lru", 2, "").await;
    drop(s.request("a1").await.unwrap());
    let busy = s.request("a2").await.unwrap();
    drop(s.request("a1").await.unwrap());
    // a2 runs a request; a1 is idle: a3 takes a1's place even though a2 was used earlier.
    drop(s.request("a3").await.unwrap());
    assert_eq!(
        s.adapter_calls(),
        [
            "load_adapter a1",
            "load_adapter a2",
            "unload_adapter a1",
            "load_adapter a3"
        ]
    );
    drop(busy);
    let records = s
        .server
        .switches(SwitchQuery::default())
        .await
        .unwrap()
        .switches;
    let unload = records
        .iter()
        .find(|r| {
            r.phases
                .iter()
                .any(|p| p.phase == SwitchPhaseKind::AdapterUnload)
        })
        .unwrap();
    assert_eq!(
        (unload.deployment.as_str(), unload.cause),
        ("a1", SwitchCause::Adapter)
    );
}

#[tokio::test(start_paused = true)]
async fn a_failed_load_answers_adapter_load_failed_and_the_base_serves_on() {
    let s = scene("fail", 2, "").await;
    drop(s.request("a1").await.unwrap());
    s.agent.fail_adapter_path(&s.files.path("a2"));
    let e = s.request("a2").await.err().unwrap();
    assert_eq!((e.status(), e.code()), (503, "adapter_load_failed"));
    assert!(
        e.message().contains("adapter a2") && e.message().contains("no adapter found"),
        "{e}"
    );
    // Nothing else changed: a1 still loaded, the base serves.
    let began = Instant::now();
    drop(s.request("a1").await.unwrap());
    drop(s.request("base").await.unwrap());
    assert_eq!(began.elapsed(), Duration::ZERO);
    let records = s
        .server
        .switches(SwitchQuery::default())
        .await
        .unwrap()
        .switches;
    let failed = records
        .iter()
        .find(|r| r.deployment == "a2" && r.cause == SwitchCause::Adapter)
        .unwrap();
    assert_eq!(failed.outcome, SwitchOutcome::Failed);
    assert_eq!(failed.error.as_ref().unwrap().code, "adapter_load_failed");
}

#[tokio::test(start_paused = true)]
async fn after_a_restart_of_the_base_adapters_are_loaded_again_on_demand() {
    let s = scene("restart", 2, "").await;
    drop(s.request("a1").await.unwrap());
    s.server.stop("base").await.unwrap();
    s.server
        .start(
            "base",
            StartRequest {
                evict: false,
                wait: true,
            },
        )
        .await
        .unwrap();
    // The fresh engine lists none: a1 loads again.
    drop(s.request("a1").await.unwrap());
    assert_eq!(s.adapter_calls(), ["load_adapter a1", "load_adapter a1"]);
}

#[tokio::test(start_paused = true)]
async fn a_deleted_or_revised_adapter_is_unloaded_where_it_is_idle() {
    let s = scene("forget", 2, "").await;
    drop(s.request("a1").await.unwrap());
    drop(s.request("a2").await.unwrap());
    s.server.delete("a1").await.unwrap();
    // New files for a2: the loaded one is the old revision.
    s.server
        .deploy(doc(&format!(
            "name: a2\nadapter: {{base: base, path: {}}}\n",
            s.files.path("a3")
        )))
        .await
        .unwrap();
    tokio::time::sleep(LOAD).await;
    assert_eq!(
        s.adapter_calls(),
        [
            "load_adapter a1",
            "load_adapter a2",
            "unload_adapter a1",
            "unload_adapter a2"
        ]
    );
    // The next request for a2 loads its new files.
    drop(s.request("a2").await.unwrap());
    assert_eq!(s.adapter_calls().last().unwrap(), "load_adapter a2");
}

#[tokio::test(start_paused = true)]
async fn an_explicit_stopped_base_answers_its_409_for_its_adapters() {
    let s = scene("explicit", 2, "lifecycle: {activation: explicit}\n").await;
    let e = s.request("a1").await.err().unwrap();
    assert_eq!((e.status(), e.code()), (409, "deployment_inactive"));
    assert!(s.adapter_calls().is_empty());
}

#[tokio::test(start_paused = true)]
async fn deploys_and_commands_that_break_the_adapter_rules_are_refused_and_change_nothing() {
    let s = scene("refusals", 2, "").await;
    let refused = |r: Result<_, ApiError>| {
        let e = r.err().unwrap();
        format!("{} {}", e.code(), e.message())
    };
    let deploy = |text: String| {
        let server = s.server.clone();
        async move { server.deploy(doc(&text)).await.map(|_| ()) }
    };
    let cases = [
        (
            format!(
                "name: x\nadapter: {{base: nobody, path: {}}}\n",
                s.files.path("a1")
            ),
            "adapter.base: `nobody`: no deployment has that name",
        ),
        (
            format!(
                "name: x\nadapter: {{base: a1, path: {}}}\n",
                s.files.path("a1")
            ),
            "`a1` is itself an adapter (an adapter of an adapter)",
        ),
        (
            format!(
                "name: x\nadapter: {{base: base, path: {}}}\n",
                s.files.path("big")
            ),
            "the adapter's rank 64 (r in adapter_config.json) is above its base's adapters.max_rank (16)",
        ),
        (
            "name: x\nadapter: {base: base, path: /nonexistent/lora}\n".to_string(),
            "adapter.path: `/nonexistent/lora` does not exist",
        ),
        (
            format!(
                "name: base\nadapter: {{base: base, path: {}}}\n",
                s.files.path("a1")
            ),
            "`base` is a model; an adapter needs a name of its own",
        ),
        (
            "name: base\nengine: vllm\nmodel: m\nresources: {gpu_memory: 6GiB}\n".to_string(),
            "adapters: the adapters a1, a2, a3 are loaded into `base`",
        ),
    ];
    for (text, want) in cases {
        let got = refused(deploy(text.clone()).await);
        assert!(got.contains(want), "{text}\n got  {got}\n want {want}");
    }
    // A base without adapters, and a second base for the same-name rule.
    deploy("name: plain\nengine: vllm\nmodel: m\nresources: {gpu_memory: 1GiB}\n".into())
        .await
        .unwrap();
    let got = refused(
        deploy(format!(
            "name: x\nadapter: {{base: plain, path: {}}}\n",
            s.files.path("a1")
        ))
        .await,
    );
    assert!(got.contains("`plain` does not allow adapters"), "{got}");
    deploy("name: other\nengine: vllm\nmodel: m\nresources: {gpu_memory: 1GiB}\nadapters: {max_loaded: 1, max_rank: 8}\n".into())
        .await
        .unwrap();
    let got = refused(
        deploy(format!(
            "name: a1\nadapter: {{base: other, path: {}}}\n",
            s.files.path("a1")
        ))
        .await,
    );
    assert!(
        got.contains("two adapters of the same name on different bases"),
        "{got}"
    );

    // Commands that would move an adapter, and deleting a base that has adapters.
    let got = refused(
        s.server
            .start("a1", StartRequest::default())
            .await
            .map(|_| ()),
    );
    assert!(
        got.starts_with("conflict deployment a1 is an adapter of base"),
        "{got}"
    );
    let got = refused(s.server.delete("base").await.map(|_| ()));
    assert!(
        got.contains("deployment base is the base of the adapters a1, a2, a3"),
        "{got}"
    );
    // Nothing changed: the adapters are where they were; deleting one works.
    assert_eq!(s.server.view("a1").unwrap().spec.base(), Some("base"));
    s.server.delete("a3").await.unwrap();
    assert!(s.server.view("a3").is_none());
}

/// The body of SGLang 0.5.23's 400 for an adapter it has not loaded (`LoRARegistry.acquire`'s
/// message, as its OpenAI routes answer it).
fn sglang_not_loaded(name: &str) -> serde_json::Value {
    serde_json::json!({"object": "error", "message": format!("The following requested LoRA adapters are not loaded: {name}\nLoaded adapters: odict_keys([])."), "type": "BadRequestError", "param": null, "code": 400})
}

/// The body of another 400, for a request with `max_tokens: 0`.
const OTHER_400: &str = r#"{"object":"error","message":"max_tokens must be at least 1, got 0.","type":"BadRequestError","param":null,"code":400}"#;

/// The body of a 400 larger than the listener reads (for a request with `max_tokens: 1`),
/// though it names the adapter as SGLang's does.
fn large_400(adapter: &str) -> String {
    let mut body = sglang_not_loaded(adapter);
    body["detail"] = "x".repeat(5000).into();
    body.to_string()
}

/// An engine that answers every request with its body's `model`, or 404 as vLLM answers a
/// model it does not serve when that name is in `lost`; with `sglang`, as SGLang does: the
/// adapter is the one named in `lora_path`, and one in `lost` is answered SGLang's 400
/// ([`sglang_not_loaded`]). A request with `max_tokens: 0` is answered [`OTHER_400`], one
/// with `max_tokens: 1` [`large_400`]; one with `max_tokens: 2` gets the head of a 400 and the
/// first bytes of its body, then nothing. Asked for a stream (`"stream": true`), it streams its
/// answer as one chunk, and SGLang's error for a lost adapter as the stream's first event after
/// a `200` (as SGLang releases that write a stream's errors as events do).
async fn fake_engine(
    lost: Arc<std::sync::Mutex<std::collections::BTreeSet<String>>>,
    sglang: bool,
) -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            let lost = lost.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    // One request: its head, then its body of content-length bytes.
                    let head_end = loop {
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                        let mut chunk = [0u8; 4096];
                        match conn.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
                    let length: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .map_or(0, |v| v.trim().parse().unwrap());
                    while buf.len() < head_end + length {
                        let mut chunk = [0u8; 4096];
                        match conn.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    let body: serde_json::Value =
                        serde_json::from_slice(&buf[head_end..head_end + length]).unwrap();
                    buf.drain(..head_end + length);
                    let model = body["model"].as_str().unwrap().to_string();
                    let adapter = if sglang {
                        body["lora_path"].as_str().map(str::to_string)
                    } else {
                        Some(model.clone())
                    };
                    let runs = adapter.clone().unwrap_or_else(|| "the base".into());
                    let is_lost = adapter.is_some_and(|a| lost.lock().unwrap().contains(&a));
                    if body["max_tokens"] == 2 {
                        let stalled = "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 200\r\n\r\n{\"object\":";
                        if conn.write_all(stalled.as_bytes()).await.is_ok() {
                            // Held until the listener gives up and closes it.
                            let _ = conn.read(&mut [0u8; 1]).await;
                        }
                        return;
                    }
                    if body["stream"] == true {
                        let event = if is_lost && sglang {
                            sglang_not_loaded(&runs)
                        } else {
                            serde_json::json!({"id": "x", "object": "chat.completion.chunk", "model": model, "choices": [{"index": 0, "delta": {"content": format!("answered by {runs}")}, "finish_reason": "stop"}]})
                        };
                        let text = format!("data: {event}\n\ndata: [DONE]\n\n");
                        let out = format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\n\r\n{text}",
                            text.len()
                        );
                        if conn.write_all(out.as_bytes()).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    let (status, text) = if body["max_tokens"] == 1 {
                        ("400 Bad Request", large_400(&runs))
                    } else if body["max_tokens"] == 0 {
                        ("400 Bad Request", OTHER_400.to_string())
                    } else if is_lost && sglang {
                        ("400 Bad Request", sglang_not_loaded(&runs).to_string())
                    } else if is_lost {
                        (
                            "404 Not Found",
                            serde_json::json!({"object": "error", "message": format!("The model `{model}` does not exist."), "code": 404}).to_string(),
                        )
                    } else {
                        (
                            "200 OK",
                            serde_json::json!({"id": "x", "object": "chat.completion", "model": model, "choices": [{"index": 0, "message": {"role": "assistant", "content": format!("answered by {runs}")}, "finish_reason": "stop"}]}).to_string(),
                        )
                    };
                    let out = format!(
                        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{text}",
                        text.len()
                    );
                    if conn.write_all(out.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// The real listener over the real coordinator and lifecycle, on the simulated host whose
/// instances are served by a [`fake_engine`] (as SGLang with `sglang`).
struct Listening {
    /// The names the engine answers as an adapter it does not have (see [`fake_engine`]).
    lost: Arc<std::sync::Mutex<std::collections::BTreeSet<String>>>,
    agent: Arc<SimHost>,
    server: Arc<Core>,
    addr: std::net::SocketAddr,
    stop: tokio::sync::watch::Sender<bool>,
    _assembly: capyctl_server::assembly::Assembly,
}

/// The listener's `stream_idle_timeout` in [`listening`].
const IDLE: Duration = Duration::from_secs(1);

async fn listening(sglang: bool) -> Listening {
    use capyctl_router::proxy::ProxyConfig;
    use capyctl_server::assembly::Inference;

    let lost = Arc::new(std::sync::Mutex::new(std::collections::BTreeSet::new()));
    let engine = fake_engine(lost.clone(), sglang).await;
    let agent = Arc::new(SimHost::new().with_upstream(engine));
    let server = open(&agent).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, rx) = tokio::sync::watch::channel(false);
    let inference = Inference {
        listener,
        config: ProxyConfig {
            request_deadline: Duration::from_secs(30),
            stream_idle_timeout: IDLE,
            ..ProxyConfig::default()
        },
        observer: None,
        stop: rx,
        give_back: None,
        tenants: Default::default(),
    };
    let assembly = assemble(
        &server,
        server.clone(),
        RouterConfig::default(),
        Some(inference),
    )
    .await;
    Listening {
        lost,
        agent,
        server,
        addr,
        stop,
        _assembly: assembly,
    }
}

/// The adapter loads the simulated host was asked for.
fn loads(agent: &SimHost) -> usize {
    agent
        .calls()
        .into_iter()
        .filter(|c| c.starts_with("load_adapter"))
        .count()
}

/// `POST /v1/chat/completions` for `model` through the listener at `addr`.
async fn chat(addr: std::net::SocketAddr, model: &str) -> (u16, serde_json::Value) {
    capyctl_test_support::harness::post_json(
        addr,
        "/v1/chat/completions",
        serde_json::json!({"model": model, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await
}

/// Through the real listener (real sockets, real time): a request for an adapter is answered by
/// the engine under the adapter's name after its load; `/v1/models` lists adapters; a failed
/// load and an engine's 404 for an adapter it lost are `503 adapter_load_failed`, never the
/// engine's 404, and the next request loads it again.
#[tokio::test]
async fn through_the_listener_an_adapter_is_loaded_and_answered_under_its_name() {
    use capyctl_test_support::harness::try_get_json;

    let l = listening(false).await;
    let files = Peft::new("listener", &[("a1", 8), ("a2", 8)]);
    deploy_all(&l.server, &files, 2, "", &["a1", "a2"]).await;
    let loads = || loads(&l.agent);

    let (status, body) = chat(l.addr, "a1").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["model"], "a1",
        "the engine ran it under the adapter's name"
    );
    assert_eq!(loads(), 1);
    let (status, body) = chat(l.addr, "base").await;
    assert_eq!((status, body["model"].as_str()), (200, Some("base")));

    let (status, models) = try_get_json(l.addr, "/v1/models").await.unwrap();
    assert_eq!(status, 200);
    let state = |id: &str| {
        models["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["id"] == id)
            .map(|m| m["state"].clone())
            .unwrap()
    };
    assert_eq!(
        (state("a1"), state("a2")),
        ("loaded".into(), "unloaded".into())
    );

    // A load the engine refuses.
    l.agent.fail_adapter_path(&files.path("a2"));
    let (status, body) = chat(l.addr, "a2").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (503, Some("adapter_load_failed")),
        "{body}"
    );
    assert!(
        body["message"].as_str().unwrap().contains("adapter a2"),
        "{body}"
    );
    assert_eq!(body["retryable"], true);

    // The engine lost a1 unseen: its 404 is not passed on; the next request loads it again.
    l.lost.lock().unwrap().insert("a1".to_string());
    let (status, body) = chat(l.addr, "a1").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (503, Some("adapter_load_failed")),
        "{body}"
    );
    l.lost.lock().unwrap().clear();
    let before = loads();
    let (status, body) = chat(l.addr, "a1").await;
    assert_eq!(
        (status, body["model"].as_str()),
        (200, Some("a1")),
        "{body}"
    );
    assert_eq!(loads(), before + 1, "loaded again");
    l.stop.send_replace(true);
}

/// `POST /v1/chat/completions` with `body` on a connection of its own that the client closes
/// after the answer: the answer's head and body as the listener sent them.
async fn raw_chat(addr: std::net::SocketAddr, body: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: capyctl\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), conn.read_to_end(&mut answer))
        .await
        .expect("the answer ends")
        .unwrap();
    String::from_utf8(answer).unwrap()
}

/// The same on SGLang, which answers a request for an adapter it does not have `400` with a
/// message naming it: that answer is not passed on (`503 adapter_load_failed` saying what the
/// engine answered), and the next request loads it again (so too a stream whose first event is
/// that error); another 400 to a request for an
/// adapter goes to the client byte for byte (read first when it is small, passed on unread
/// when it is not), and loads nothing; one whose body stops coming ends after
/// `stream_idle_timeout`.
#[tokio::test]
async fn through_the_listener_sglangs_400_for_an_adapter_it_lost_is_not_passed_on() {
    let l = listening(true).await;
    let files = Peft::new("listener-sglang", &[("s1", 8)]);
    deploy_on(&l.server, "sglang", &files, 2, "", &["s1"]).await;
    let text = |body: &serde_json::Value| body["choices"][0]["message"]["content"].clone();

    let (status, body) = chat(l.addr, "s1").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        text(&body),
        "answered by s1",
        "run with the adapter in lora_path"
    );
    assert_eq!(loads(&l.agent), 1);

    // Another 400 for a request for the adapter: the engine's answer as it sent it.
    let asked = r#"{"model":"s1","max_tokens":0,"messages":[{"role":"user","content":"hi"}]}"#;
    let answer = raw_chat(l.addr, asked).await;
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
    assert!(
        answer.ends_with(&format!("\r\n\r\n{OTHER_400}")),
        "the body byte for byte: {answer}"
    );
    let head = answer.to_ascii_lowercase();
    assert!(
        head.contains("content-type: application/json\r\n")
            && head.contains(&format!("content-length: {}\r\n", OTHER_400.len())),
        "{answer}"
    );
    // One larger than the listener reads is passed on unread, whole, whatever it says.
    let asked = r#"{"model":"s1","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}"#;
    let answer = raw_chat(l.addr, asked).await;
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
    assert!(
        answer.ends_with(&format!("\r\n\r\n{}", large_400("s1"))),
        "{answer}"
    );
    // One whose body stops coming: nothing was passed on, so a 502 once the engine has been
    // silent for stream_idle_timeout; nothing hangs.
    let asked = r#"{"model":"s1","max_tokens":2,"messages":[{"role":"user","content":"hi"}]}"#;
    let began = std::time::Instant::now();
    let answer = raw_chat(l.addr, asked).await;
    assert!(
        answer.starts_with("HTTP/1.1 502 ") && answer.contains("stream_idle_timeout"),
        "{answer}"
    );
    assert!(began.elapsed() >= IDLE, "{:?}", began.elapsed());
    let (status, body) = chat(l.addr, "s1").await;
    assert_eq!((status, text(&body)), (200, "answered by s1".into()));
    assert_eq!(loads(&l.agent), 1, "none taken for a lost adapter");

    // The engine lost s1 unseen: its 400 is not passed on; the next request loads it again.
    l.lost.lock().unwrap().insert("s1".to_string());
    let (status, body) = chat(l.addr, "s1").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (503, Some("adapter_load_failed")),
        "{body}"
    );
    let message = body["message"].as_str().unwrap();
    assert!(
        message.contains("adapter s1")
            && message.contains(
                "the engine answered 400 \"The following requested LoRA adapters are not loaded: s1\""
            ),
        "{message}"
    );
    assert_eq!(body["retryable"], true);
    // Asked for a stream, an SGLang that says so as the stream's first event (after a 200):
    // that stream is not passed on either (nothing of it reached the client).
    let streamed = r#"{"model":"s1","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let answer = raw_chat(l.addr, streamed).await;
    assert!(
        answer.starts_with("HTTP/1.1 503 ")
            && answer.contains("adapter_load_failed")
            && answer.contains("the engine's stream said")
            && answer.contains("are not loaded: s1")
            && !answer.contains("data:"),
        "{answer}"
    );
    assert_eq!(loads(&l.agent), 2, "loaded again after the first 503");
    l.lost.lock().unwrap().clear();
    let (status, body) = chat(l.addr, "s1").await;
    assert_eq!(
        (status, text(&body)),
        (200, "answered by s1".into()),
        "{body}"
    );
    assert_eq!(loads(&l.agent), 3, "loaded again after the stream's 503");
    // A stream whose first event is not that error is passed on as it came.
    let answer = raw_chat(l.addr, streamed).await;
    assert!(
        answer.starts_with("HTTP/1.1 200 ")
            && answer.contains("answered by s1")
            && answer.contains("data: [DONE]"),
        "{answer}"
    );
    assert_eq!(loads(&l.agent), 3);
    l.stop.send_replace(true);
}
