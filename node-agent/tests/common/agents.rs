//! A [`LocalHostAgent`] running the real `engine-sim` binary as its engines, with short
//! timings, and ways to poke its engines and pid records.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use capyctl_node_agent::agent::AgentConfig;
use capyctl_node_agent::http::{Call, EngineClient};
use capyctl_node_agent::inventory::{GpuProbe, NoGpus};
use capyctl_node_agent::load::LoadSample;
use capyctl_node_agent::process::{PidRecord, ProcessRuntime};
use capyctl_node_agent::spec::{GpuOverride, HostSettings, InstanceSpec};
use capyctl_node_agent::{HostAgent, LocalHostAgent};
use capyctl_spec::EngineKind;

/// One MiB.
pub const MIB: u64 = 1024 * 1024;

/// Every engine is the simulator; one 80 GiB GPU, unified or not; `host_memory` of host RAM.
pub fn settings(host_memory: u64, unified: bool) -> HostSettings {
    let bin = super::engine_sim_binary();
    let mut s = HostSettings::all_engines(vec![bin.to_string_lossy().into_owned()]);
    s.gpus = Some(vec![GpuOverride {
        memory: 80 * 1024 * MIB,
        unified,
        uuid: None,
    }]);
    s.host_memory = Some(host_memory);
    s
}

/// The test timings: 20 s to be ready or to wake, 5 s of grace, a sample every 100 ms, a
/// 300 ms probe of a parked SGLang.
pub fn config(dir: &Path) -> AgentConfig {
    let mut config = AgentConfig::new(dir);
    config.ready_timeout = Duration::from_secs(20);
    config.wake_window = Duration::from_secs(20);
    config.stop_grace = Duration::from_secs(5);
    config.sample_interval = Duration::from_millis(100);
    config.timeouts.idle_probe = Duration::from_millis(300);
    config
}

/// An agent on data directory `dir` without a GPU probe.
pub fn agent(dir: &Path, host_memory: u64, unified: bool) -> LocalHostAgent {
    agent_with_probe(dir, host_memory, unified, Arc::new(NoGpus))
}

/// An agent on data directory `dir` reading GPU memory through `probe`.
pub fn agent_with_probe(
    dir: &Path,
    host_memory: u64,
    unified: bool,
    probe: Arc<dyn GpuProbe>,
) -> LocalHostAgent {
    LocalHostAgent::new(config(dir), settings(host_memory, unified), probe).unwrap()
}

/// Deployment `chat-a` of 64 MiB declared weights on `engine`, with simulator `faults`.
pub fn spec(engine: EngineKind, faults: &str) -> InstanceSpec {
    let mut s = InstanceSpec::new("01KAGENT", "chat-a", engine, "Qwen3-4B");
    s.env
        .insert("ENGINE_SIM_WEIGHTS_BYTES".into(), "64MiB".into());
    if !faults.is_empty() {
        s.env.insert("ENGINE_SIM_FAULTS".into(), faults.into());
    }
    s.resources.weights_memory = Some(64 * MIB);
    s
}

/// No pid record is left in `dir`.
pub fn assert_no_records(dir: &Path) {
    let left = ProcessRuntime::new(dir).unwrap().records().unwrap();
    assert!(left.is_empty(), "records left: {left:?}");
}

/// The pid record of `instance` in `dir`.
pub fn record(dir: &Path, instance: &str) -> PidRecord {
    ProcessRuntime::new(dir)
        .unwrap()
        .records()
        .unwrap()
        .into_iter()
        .find(|r| r.instance == instance)
        .unwrap_or_else(|| panic!("no record of {instance}"))
}

/// Changes the pid record of `instance` in `dir` (what a killed agent left written).
pub fn tamper(dir: &Path, instance: &str, change: impl FnOnce(&mut PidRecord)) {
    let mut r = record(dir, instance);
    change(&mut r);
    ProcessRuntime::new(dir).unwrap().write_record(&r).unwrap();
}

/// Calls the engine of `instance` directly; its status.
pub async fn engine_call(
    agent: &LocalHostAgent,
    instance: &str,
    method: http::Method,
    path: &str,
    body: Option<serde_json::Value>,
) -> u16 {
    let ep = agent.endpoint(instance).unwrap();
    let url = ep.url(path);
    let call = Call {
        engine: ep.engine,
        step: "test call",
        url: &url,
        timeout: Duration::from_secs(10),
    };
    EngineClient::new()
        .send(call, method, body.as_ref())
        .await
        .map_or(0, |(status, _)| status)
}

/// Sets `fault` on the simulator behind `instance` (`crash` exits it before it answers).
pub async fn set_fault(agent: &LocalHostAgent, instance: &str, fault: &str) {
    let body = serde_json::json!({ "set": [fault] });
    engine_call(
        agent,
        instance,
        http::Method::POST,
        "/sim/faults",
        Some(body),
    )
    .await;
}

/// The first load sample of `id` (bounded: 5 s).
pub async fn sample_arrives(agent: &LocalHostAgent, id: &str) -> LoadSample {
    for _ in 0..100 {
        if let Some(s) = agent.sample(id) {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no load sample for {id}");
}
