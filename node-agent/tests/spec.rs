//! The agent's input types built from the `capyctl-crds` documents and settings.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use capyctl_node_agent::spec::{
    DecisionSpec, DeclaredResources, EngineLaunch, GpuOverride, HostSettings, InstanceSpec,
};
use capyctl_spec::documents::{parse_deployment_str, parse_host_str};
use capyctl_spec::overrides::Overrides;
use capyctl_spec::{EngineKind, Residency};

const GIB: u64 = 1 << 30;

#[test]
fn instance_spec_from_a_full_deployment_document() {
    let doc = parse_deployment_str(
        "my-model.yaml",
        r#"
name: my-model
engine: sglang
model: /models/qwen
residency: deep
max_concurrent_requests: 8
extra_args: ["--speculative-algorithm", "EAGLE"]
env: {HF_HOME: /data/hf}
resources: {gpu_memory: 40GiB, weights_memory: 8GiB}
lifecycle: {activation: explicit, warm: true}
decision: {prompt: "Is the sky blue?", options: ["yes", "no"]}
"#,
    )
    .unwrap();
    let spec = InstanceSpec::from_doc("01K0000000000000000000000", &doc);
    let mut expected = InstanceSpec::new(
        "01K0000000000000000000000",
        "my-model",
        EngineKind::Sglang,
        "/models/qwen",
    );
    expected.residency = Some(Residency::Deep);
    expected.max_concurrent_requests = Some(8);
    expected.extra_args = vec!["--speculative-algorithm".into(), "EAGLE".into()];
    expected.env = BTreeMap::from([("HF_HOME".to_string(), "/data/hf".to_string())]);
    expected.resources = DeclaredResources {
        gpu_memory: Some(40 * GIB),
        weights_memory: Some(8 * GIB),
    };
    expected.decision = Some(DecisionSpec {
        prompt: "Is the sky blue?".into(),
        options: vec!["yes".into(), "no".into()],
    });
    assert_eq!(spec, expected);
    assert!(spec.speculative());
}

#[test]
fn instance_spec_from_a_minimal_deployment_document() {
    let doc =
        parse_deployment_str("m.yaml", "name: chat-a\nengine: vllm\nmodel: Qwen3-4B\n").unwrap();
    let spec = InstanceSpec::from_doc(String::from("01K1"), &doc);
    assert_eq!(
        spec,
        InstanceSpec::new("01K1", "chat-a", EngineKind::Vllm, "Qwen3-4B")
    );
    // Only one of the two resources declared: the other stays unknown.
    let doc = parse_deployment_str(
        "m.yaml",
        "name: chat-a\nengine: vllm\nmodel: Qwen3-4B\nresources: {weights_memory: 1MiB}\n",
    )
    .unwrap();
    let spec = InstanceSpec::from_doc("01K1", &doc);
    assert_eq!(
        spec.resources,
        DeclaredResources {
            gpu_memory: None,
            weights_memory: Some(1 << 20)
        }
    );
}

#[test]
fn host_settings_from_a_host_document() {
    let host = parse_host_str(
        "host.yaml",
        r#"
engines:
  vllm:
    command: ["/opt/sim/engine-sim", "vllm"]
    version: "0.31.0"
    env: {VLLM_LOGGING_LEVEL: DEBUG}
gpus:
  - {memory: 80GiB, unified: false, uuid: GPU-0000}
  - {memory: 24GiB, unified: true}
host_memory: 64GiB
"#,
        &Overrides::none(),
    )
    .unwrap();
    let settings = HostSettings::from(&host);
    assert_eq!(
        settings.vllm,
        EngineLaunch {
            command: vec!["/opt/sim/engine-sim".into(), "vllm".into()],
            version: Some("0.31.0".into()),
            env: BTreeMap::from([("VLLM_LOGGING_LEVEL".to_string(), "DEBUG".to_string())]),
        }
    );
    // Engines the document leaves out keep their default commands.
    assert_eq!(
        settings.sglang,
        EngineLaunch::default_for(EngineKind::Sglang)
    );
    assert_eq!(
        settings.tensorfold,
        EngineLaunch::default_for(EngineKind::Tensorfold)
    );
    assert_eq!(
        settings.gpus,
        Some(vec![
            GpuOverride {
                memory: 80 * GIB,
                unified: false,
                uuid: Some("GPU-0000".into())
            },
            GpuOverride {
                memory: 24 * GIB,
                unified: true,
                uuid: None
            },
        ])
    );
    assert_eq!(settings.host_memory, Some(64 * GIB));
}

#[test]
fn host_settings_from_an_empty_host_document_are_the_defaults() {
    let host = parse_host_str("host.yaml", "{}\n", &Overrides::none()).unwrap();
    assert_eq!(HostSettings::from(&host), HostSettings::default());
}
