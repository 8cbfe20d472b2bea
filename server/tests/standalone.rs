//! `Standalone` end to end: the document's deployments, the inference and management listeners
//! on real sockets, the state database across a restart, engines stopped on a clean shutdown.
#![allow(clippy::unwrap_used)]

use capyctl_test_support::harness as support;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use capyctl_lifecycle::store::DeploymentRecord;
use capyctl_node_agent::inventory::NoGpus;
use capyctl_node_agent::process::alive;
use capyctl_server::standalone::Standalone;
use capyctl_spec::InstanceState;
use capyctl_spec::documents::parse_standalone_str;
use capyctl_spec::overrides::Overrides;
use capyctl_spec::settings::StandaloneConfig;
use support::{engine_sim_binary, management, post_json, temp_dir};

fn config() -> StandaloneConfig {
    let bin = engine_sim_binary();
    let text = format!(
        r#"
server:
  listen:
    inference: "127.0.0.1:0"
    management: "127.0.0.1:0"
host:
  id: gpu-box
  gpus: [{{memory: 10GiB}}]
  host_memory: 1GiB
  resource_policy:
    queue:
      admission_window: 100ms
  engines:
    vllm: {{command: ["{bin}"]}}
deployments:
  - name: chat-a
    engine: vllm
    model: Qwen3-4B
    resources: {{gpu_memory: 6GiB, weights_memory: 64MiB}}
    env: {{ENGINE_SIM_WEIGHTS_BYTES: 64MiB}}
  - name: chat-b
    engine: vllm
    model: Qwen3-4B
    resources: {{gpu_memory: 6GiB, weights_memory: 64MiB}}
    env: {{ENGINE_SIM_WEIGHTS_BYTES: 64MiB}}
"#,
        bin = bin.display()
    );
    parse_standalone_str("standalone.yaml", &text, &Overrides::none()).unwrap()
}

async fn start(dir: &Path) -> Standalone {
    Standalone::start_with_probe(config(), dir.to_path_buf(), std::sync::Arc::new(NoGpus))
        .await
        .unwrap()
}

async fn chat(addr: SocketAddr, model: &str) -> (u16, serde_json::Value) {
    post_json(
        addr,
        "/v1/chat/completions",
        serde_json::json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    )
    .await
}

#[tokio::test]
async fn standalone_serves_switches_and_keeps_its_state() {
    let dir = temp_dir("standalone");
    let s = start(&dir).await;
    assert_ne!(s.inference_addr().port(), 0);
    let token = s.admin_token().to_string();
    assert_eq!(
        std::fs::read_to_string(dir.join("admin-token"))
            .unwrap()
            .trim(),
        token
    );
    let m = s.management_addr();

    // Deployed, not started.
    let (status, list) = management("GET", m, "/management/v1/deployments", &token, None).await;
    assert_eq!(status, 200, "{list}");
    let names: Vec<&str> = list["deployments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["chat-a", "chat-b"]);
    assert!(
        list["deployments"]
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d["state"] == "stopped")
    );

    // A request starts chat-a; start --evict of chat-b parks it and names it.
    assert_eq!(chat(s.inference_addr(), "chat-a").await.0, 200);
    let (status, receipt) = management(
        "POST",
        m,
        "/management/v1/deployments/chat-b/start",
        &token,
        Some(serde_json::json!({"evict": true, "wait": true})),
    )
    .await;
    assert_eq!(status, 200, "{receipt}");
    assert_eq!(receipt["deployment"]["state"], "ready");
    assert_eq!(receipt["victims"][0]["name"], "chat-a");
    assert_eq!(receipt["victims"][0]["released"], "parked");
    assert!(receipt["switch_id"].is_string());
    let (status, a) = management("GET", m, "/management/v1/deployments/chat-a", &token, None).await;
    assert_eq!((status, a["state"].as_str()), (200, Some("parked")));

    // The load read answers for every deployment, and 404 for an unknown ID.
    let (status, load) = management("GET", m, "/management/v1/metrics/load", &token, None).await;
    assert_eq!(status, 200, "{load}");
    assert_eq!(load["deployments"].as_array().unwrap().len(), 2);
    let (status, err) = management(
        "GET",
        m,
        "/management/v1/metrics/load?deployment=01NOTHING",
        &token,
        None,
    )
    .await;
    assert_eq!((status, err["code"].as_str()), (404, Some("not_found")));

    // A clean shutdown stops the engines.
    let b_pid = s.server().view("chat-b").unwrap().instances[0].pid.unwrap();
    let a_pid = s.server().view("chat-a").unwrap().instances[0].pid;
    s.shutdown().await;
    assert!(!alive(b_pid), "chat-b's engine was stopped");
    if let Some(p) = a_pid {
        assert!(!alive(p), "chat-a's parked engine was stopped");
    }

    // The same data directory again: the same deployments and IDs, the same token.
    let s = start(&dir).await;
    assert_eq!(s.admin_token(), token);
    let a2 = s.server().view("chat-a").unwrap();
    assert_eq!(a2.id, a["id"].as_str().unwrap());
    assert_eq!(a2.revision, 1);
    assert_eq!(a2.state, InstanceState::Stopped);
    assert_eq!(chat(s.inference_addr(), "chat-a").await.0, 200);
    let v = s
        .server()
        .wait_for_state("chat-a", &[InstanceState::Ready], Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(v.instances[0].generation, 2);
    s.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_listener_that_cannot_bind_is_named() {
    let dir = temp_dir("standalone-bind");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut cfg = config();
    cfg.server.listen.management = taken.local_addr().unwrap();
    let err = Standalone::start_with_probe(cfg, dir, std::sync::Arc::new(NoGpus))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("server.listen.management"), "{err}");
}

/// A second CapyCTL on a data directory in use is refused before it touches anything: the
/// first one's engines keep serving.
#[tokio::test]
async fn a_second_standalone_on_the_same_data_directory_is_refused() {
    let dir = temp_dir("standalone-lock");
    let s = start(&dir).await;
    assert_eq!(chat(s.inference_addr(), "chat-a").await.0, 200);
    let pid = s.server().view("chat-a").unwrap().instances[0].pid.unwrap();
    let err = Standalone::start_with_probe(config(), dir.clone(), std::sync::Arc::new(NoGpus))
        .await
        .unwrap_err();
    assert_eq!(err.metric_label(), "data_dir_in_use");
    assert_eq!(
        err.to_string(),
        format!(
            "data directory {} is in use by another CapyCTL (its lock {} is held); stop it or use another --data-dir",
            dir.display(),
            dir.join("lock").display()
        )
    );
    assert!(alive(pid), "the first one's engine was left alone");
    assert_eq!(chat(s.inference_addr(), "chat-a").await.0, 200);
    s.shutdown().await;
    // Let go with the first one: the directory can be used again.
    let s = start(&dir).await;
    s.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// The state of a CapyCTL before the state database (`state.json`) is imported on the first
/// start: the deployments keep their IDs, revisions and operator stops (the same document
/// changes nothing), and the file is renamed `state.json.migrated`; the next start does not
/// import it again.
#[tokio::test]
async fn a_state_json_of_an_earlier_capyctl_is_imported_once() {
    let dir = temp_dir("standalone-migrate");
    let record = DeploymentRecord {
        id: "01KOLDCHATA0000000000000000".into(),
        revision: 3,
        doc: config().deployments[0].clone().into(),
        operator_stopped: true,
        operator_started: false,
        pending_start: false,
        generation: 5,
        first_answer: None,
    };
    let text = serde_json::to_string_pretty(&serde_json::json!({
        "version": 1,
        "deployments": [record],
    }))
    .unwrap();
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("state.json"), &text).unwrap();
    for _ in 0..2 {
        let s = start(&dir).await;
        let a = s.server().view("chat-a").unwrap();
        assert_eq!(
            (a.id.as_str(), a.revision, a.operator_stopped),
            (record.id.as_str(), 3, true)
        );
        assert_eq!(a.instances[0].generation, 5);
        assert!(s.server().view("chat-b").is_some());
        assert!(!dir.join("state.json").exists());
        assert_eq!(
            std::fs::read_to_string(dir.join("state.json.migrated")).unwrap(),
            text
        );
        assert!(dir.join("state.redb").is_file());
        s.shutdown().await;
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A state database that is not one stops the start with an error naming the file.
#[tokio::test]
async fn a_damaged_state_database_is_named() {
    let dir = temp_dir("standalone-damaged");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("state.redb"), b"not a database, not at all").unwrap();
    let err = Standalone::start_with_probe(config(), dir.clone(), std::sync::Arc::new(NoGpus))
        .await
        .unwrap_err();
    assert_eq!(err.metric_label(), "corrupt");
    let text = err.to_string();
    assert!(
        text.contains(&dir.join("state.redb").display().to_string()),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
