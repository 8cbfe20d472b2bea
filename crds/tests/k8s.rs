//! Kubernetes objects: CRD shape, generated files, spec validation and conversions.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::PathBuf;

use capyctl_crds::{
    self as k8s, Deployment, DeploymentSpec, Host, QueueSpec, load_deployment_manifest_file,
    parse_deployment_manifest_str,
};
use capyctl_spec::documents::{Origin, Problem, parse_deployment_str};
use capyctl_spec::settings::{Mode, QueueSettings};
use capyctl_spec::{Activation, EngineKind, Residency, Routing};
use kube::CustomResourceExt;
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../spec/tests/fixtures")
        .join(name)
}

fn at(name: &str, rest: &str) -> String {
    format!("{}{rest}", fixture(name).display())
}

#[test]
fn checked_in_crds_match_the_types() {
    let dir = k8s::chart_crd_dir();
    for (name, text) in k8s::crd_files().unwrap() {
        let path = dir.join(name);
        let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            on_disk == text,
            "{} is out of date with crds/src/lib.rs; run `{}` and commit the result",
            path.display(),
            k8s::CRDGEN_COMMAND
        );
        assert!(text.starts_with("# Generated from the Rust types"));
        // The file is a CRD that reads back.
        let _: k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition =
            serde_yaml_ng::from_str(&text).unwrap();
    }
}

fn crd_json<K: CustomResourceExt>() -> Value {
    serde_json::to_value(K::crd()).unwrap()
}

/// Every property below `schema` has a description.
fn assert_described(schema: &Value, at: &str) {
    if let Some(props) = schema.get("properties").and_then(Value::as_object) {
        for (name, prop) in props {
            let here = format!("{at}.{name}");
            assert!(
                prop.get("description")
                    .and_then(Value::as_str)
                    .is_some_and(|d| !d.is_empty()),
                "{here} has no description"
            );
            assert_described(prop, &here);
        }
    }
    if let Some(items) = schema.get("items") {
        assert_described(items, &format!("{at}[]"));
    }
}

#[test]
fn deployment_crd_shape() {
    let crd = crd_json::<Deployment>();
    assert_eq!(crd["metadata"]["name"], "deployments.capyctl.io");
    assert_eq!(crd["spec"]["group"], "capyctl.io");
    assert_eq!(crd["spec"]["scope"], "Namespaced");
    assert_eq!(
        crd["spec"]["names"]["shortNames"],
        serde_json::json!(["cdeploy", "cdep"])
    );
    let version = &crd["spec"]["versions"][0];
    assert_eq!(version["name"], "v1alpha1");
    assert!(version["subresources"]["status"].is_object());
    // `kubectl scale cdep NAME --replicas=3` (no label selector: the instances are not
    // always Pods, nor Pods of the object's namespace).
    assert_eq!(
        version["subresources"]["scale"],
        serde_json::json!({
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
        })
    );
    let columns: Vec<(&str, &str)> = version["additionalPrinterColumns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["name"].as_str().unwrap(), c["jsonPath"].as_str().unwrap()))
        .collect();
    assert_eq!(
        columns,
        [
            ("State", ".status.state"),
            ("Ready", ".status.ready"),
            ("Revision", ".status.revision"),
            ("Hosts", ".status.hosts"),
            ("Priority", ".spec.priority"),
        ]
    );
    let schema = &version["schema"]["openAPIV3Schema"];
    let spec = &schema["properties"]["spec"];
    let status = &schema["properties"]["status"];
    assert_described(spec, "spec");
    for key in [
        "deploymentId",
        "state",
        "ready",
        "revision",
        "hosts",
        "instances",
        "measurement",
        "conditions",
        "observedGeneration",
        "replicas",
        "readyReplicas",
    ] {
        assert!(status["properties"][key].is_object(), "status.{key}");
    }
    for key in ["replicas", "readyReplicas"] {
        assert_eq!(status["properties"][key]["type"], "integer", "status.{key}");
    }
    // Replicas: the document's range, and the API server fills in the default (what the scale
    // subresource reads for an object that does not say).
    let replicas = &spec["properties"]["replicas"];
    assert_eq!(
        (
            &replicas["minimum"],
            &replicas["maximum"],
            &replicas["default"]
        ),
        (
            &serde_json::json!(1.0),
            &serde_json::json!(64.0),
            &serde_json::json!(1)
        )
    );
    assert_eq!(spec["properties"]["gpusPerInstance"]["maximum"], 16.0);
    assert_eq!(
        spec["properties"]["routing"]["enum"],
        serde_json::json!(["least_loaded", "prefix"])
    );
    assert!(
        spec["properties"]["routing"]["description"]
            .as_str()
            .unwrap()
            .starts_with("How requests are spread")
    );
    // The rule across keys that `kubectl scale` can break, checked by the API server too.
    assert_eq!(
        spec["x-kubernetes-validations"],
        serde_json::json!([{
            "rule": k8s::SCALE_MIN_RULE,
            "message": "scale.min is above replicas: the deployment scales between scale.min and replicas; raise replicas or lower scale.min",
            "fieldPath": ".scale.min",
            "reason": "FieldValueInvalid",
        }])
    );
    let scale = &spec["properties"]["scale"]["properties"];
    assert_eq!(scale["min"]["maximum"], 64.0);
    assert_eq!(scale["targetInFlight"]["maximum"], 32.0);
    assert_eq!(scale["scaleDownDelay"]["type"], "string");
    // Field descriptions come from the fields, even for optional enums.
    assert_eq!(
        spec["properties"]["residency"]["description"],
        "Where parked weights go: host_backed (host RAM, discrete cards only), deep (dropped,\nreloaded from disk) or restart_only (never park, stop instead). Unset: CapyCTL picks."
    );
    assert_eq!(
        spec["properties"]["residency"]["enum"],
        serde_json::json!(["host_backed", "deep", "restart_only"])
    );
    assert_eq!(
        spec["properties"]["lifecycle"]["properties"]["activation"]["enum"],
        serde_json::json!(["on_demand", "explicit"])
    );
    assert_eq!(
        spec["properties"]["maxConcurrentRequests"]["maximum"],
        4096.0
    );
    assert_eq!(
        spec["properties"]["decision"]["properties"]["options"]["minItems"],
        2
    );
    assert!(
        status["properties"]["state"]["description"]
            .as_str()
            .unwrap()
            .starts_with("The deployment's state")
    );
    // STATE as `capyctl list deployments` shows it: an instance state, or an adapter's
    // `loaded` / `unloaded` (the API server refuses a status with any other word).
    let states = &status["properties"]["state"]["enum"];
    assert_eq!(states, &serde_json::json!(k8s::deployment_states()));
    for word in ["stopped", "ready", "parked", "failed", "loaded", "unloaded"] {
        assert!(
            states.as_array().unwrap().iter().any(|s| s == word),
            "{word}: {states}"
        );
    }
    assert_eq!(status["properties"]["state"]["type"], "string");
}

#[test]
fn host_crd_shape() {
    let crd = crd_json::<Host>();
    assert_eq!(crd["metadata"]["name"], "hosts.capyctl.io");
    assert_eq!(crd["spec"]["scope"], "Cluster");
    let version = &crd["spec"]["versions"][0];
    assert!(version["subresources"]["status"].is_object());
    let names: Vec<&str> = version["additionalPrinterColumns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["Ready", "Activation", "Host Memory", "Age"]);
    let schema = &version["schema"]["openAPIV3Schema"];
    let spec = &schema["properties"]["spec"];
    assert_described(spec, "spec");
    assert_described(&schema["properties"]["status"], "status");
    for key in [
        "gpus",
        "hostMemory",
        "engines",
        "resourcePolicy",
        "lifecycle",
    ] {
        assert!(spec["properties"][key].is_object(), "spec.{key}");
    }
    let engine = &spec["properties"]["engines"]["items"]["properties"];
    assert!(engine["deepPark"].is_object());
    assert!(engine["version"].is_object());
    let queue = &spec["properties"]["resourcePolicy"]["properties"]["queue"]["properties"];
    for key in [
        "admissionWindow",
        "requestDeadline",
        "streamIdleTimeout",
        "maxPendingPerDeployment",
        "maxPendingTotal",
        "maxBufferedBytesTotal",
    ] {
        assert!(queue[key].is_object(), "queue.{key}");
    }
}

#[test]
fn deployment_manifest_fixture_errors() {
    let e = load_deployment_manifest_file(fixture("deployment-cr-unknown-key.yaml")).unwrap_err();
    assert_eq!(
        e.to_string(),
        at(
            "deployment-cr-unknown-key.yaml",
            ":8: spec.max_concurrent_requests: unknown key; expected one of engine, model, residency, maxConcurrentRequests, extraArgs, env, resources, lifecycle, decision, replicas, scale, gpusPerInstance, routing, priority, adapters, adapter"
        )
    );
    let e = load_deployment_manifest_file(fixture("deployment-cr-wrong-type.yaml")).unwrap_err();
    assert_eq!(
        e.to_string(),
        at(
            "deployment-cr-wrong-type.yaml",
            ":9: spec.lifecycle.warm: wrong type: string \"sometimes\", expected a boolean"
        )
    );
    let e = load_deployment_manifest_file(fixture("deployment-cr-out-of-range.yaml")).unwrap_err();
    assert_eq!(
        e.to_string(),
        at(
            "deployment-cr-out-of-range.yaml",
            ":8: spec.maxConcurrentRequests: 5000 is out of range (1 to 4096)"
        )
    );
    assert!(matches!(e.problem, Problem::OutOfRange(_)));
}

#[test]
fn deployment_manifest_reads_and_converts() {
    let d = load_deployment_manifest_file(fixture("deployment-cr.yaml")).unwrap();
    assert_eq!(d.metadata.name.as_deref(), Some("my-model"));
    assert_eq!(d.spec.engine, Some(EngineKind::Vllm));
    assert_eq!(d.spec.residency, Some(Residency::RestartOnly));
    assert_eq!(d.spec.max_concurrent_requests, Some(8));
    let doc = d.to_document().unwrap();
    assert_eq!(doc.name, "my-model");
    assert_eq!(doc.activation(), Activation::Explicit);
    assert_eq!(doc.extra_args, ["--max-model-len", "8192"]);
    assert_eq!(
        doc.resources.unwrap().gpu_memory.unwrap().as_u64(),
        40 << 30
    );
    // Document -> object -> document is the identity.
    let full = parse_deployment_str(
        "d.yaml",
        &std::fs::read_to_string(fixture("deployment.yaml")).unwrap(),
    )
    .unwrap();
    let object = Deployment::from_document(&full);
    assert_eq!(object.metadata.name.as_deref(), Some("my-model"));
    assert_eq!(object.to_document().unwrap(), full);
    // And the object serializes as a manifest that reads back.
    let text = serde_yaml_ng::to_string(&object).unwrap();
    let again = parse_deployment_manifest_str("again.yaml", &text).unwrap();
    assert_eq!(again.spec, object.spec);
}

#[test]
fn deployment_manifest_other_errors() {
    let e = parse_deployment_manifest_str(
        "m.yaml",
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: a}\nspec: {engine: vllm, model: m}\n",
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "m.yaml:1: apiVersion: `apps/v1` is not valid; expected capyctl.io/v1alpha1"
    );
    let e = parse_deployment_manifest_str(
        "m.yaml",
        "apiVersion: capyctl.io/v1alpha1\nkind: Deployment\nmetadata:\n  name: My_Model\nspec: {engine: vllm, model: m}\n",
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("m.yaml:4: metadata.name: `My_Model` is not a valid name"),
        "{e}"
    );
    let e = parse_deployment_manifest_str(
        "m.yaml",
        "apiVersion: capyctl.io/v1alpha1\nkind: Deployment\nmetadata: {}\nspec: {engine: vllm, model: m}\n",
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "m.yaml:3: metadata.name: missing required key"
    );
    let e = parse_deployment_manifest_str(
        "m.yaml",
        "apiVersion: capyctl.io/v1alpha1\nkind: Deployment\nmetadata: {name: a}\nspec:\n  engine: vllm\n  model: m\n  decision:\n    prompt: p\n    options: [a]\n",
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "m.yaml:9: spec.decision.options: a decision needs at least 2 options, found 1"
    );
}

#[test]
fn objects_from_the_api_are_validated_with_spec_paths() {
    let mut spec = DeploymentSpec {
        engine: Some(EngineKind::Sglang),
        model: Some("m".into()),
        residency: None,
        max_concurrent_requests: Some(0),
        extra_args: vec![],
        env: Default::default(),
        resources: None,
        lifecycle: None,
        decision: None,
        replicas: None,
        scale: None,
        gpus_per_instance: None,
        routing: None,
        priority: None,
        adapters: None,
        adapter: None,
    };
    let mut object = Deployment::new("chat", spec.clone());
    object.metadata.namespace = Some("team-a".into());
    let e = object.to_document().unwrap_err();
    assert_eq!(
        e.to_string(),
        "Deployment team-a/chat: spec.maxConcurrentRequests: 0 is out of range (1 to 4096)"
    );
    spec.max_concurrent_requests = None;
    spec.env.insert("A=B".into(), "x".into());
    let e = spec
        .to_document("chat", Origin::Object("Deployment chat".into()))
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "Deployment chat: spec.env: `A=B` is not a valid environment variable name"
    );
    spec.env.clear();
    spec.resources = Some(k8s::ResourcesSpec {
        gpu_memory: Some(capyctl_spec::units::ByteSize::bytes(0)),
        weights_memory: None,
    });
    let e = spec
        .to_document("chat", Origin::Object("Deployment chat".into()))
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "Deployment chat: spec.resources.gpuMemory: a size of 0 bytes is not allowed"
    );
    spec.resources = None;
    let doc = spec
        .to_document("chat", Origin::Object("Deployment chat".into()))
        .unwrap();
    assert_eq!(doc.engine, Some(EngineKind::Sglang));

    // The rules across keys, named as the object's fields (what the operator reports in the
    // Accepted condition and a Refused event).
    spec.extra_args = vec!["--speculative-algorithm=EAGLE".into()];
    spec.residency = Some(capyctl_spec::Residency::HostBacked);
    let e = spec
        .to_document("chat", Origin::Object("Deployment chat".into()))
        .unwrap_err();
    assert!(
        e.to_string().starts_with(
            "Deployment chat: spec.residency: host_backed is refused for SGLang with speculative decoding (--speculative-algorithm): it parks with its weights in memory"
        ),
        "{e}"
    );
    spec.residency = None;
    spec.extra_args = vec!["--served-model-name".into(), "x".into()];
    let e = spec
        .to_document("chat", Origin::Object("Deployment chat".into()))
        .unwrap_err();
    assert!(
        e.to_string().starts_with(
            "Deployment chat: spec.extraArgs[0]: `--served-model-name`: CapyCTL sets --served-model-name itself"
        ),
        "{e}"
    );
    spec.extra_args.clear();
    spec.resources = Some(k8s::ResourcesSpec {
        gpu_memory: Some(capyctl_spec::units::ByteSize::bytes(1 << 30)),
        weights_memory: Some(capyctl_spec::units::ByteSize::bytes(2 << 30)),
    });
    let e = spec
        .to_document("chat", Origin::Object("Deployment chat".into()))
        .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("Deployment chat: spec.resources.weightsMemory: 2GiB is above resources.gpu_memory (1GiB)"),
        "{e}"
    );
}

/// A manifest file gets the same rules, with the line of the field.
#[test]
fn manifest_refuses_host_backed_with_speculative_decoding() {
    let e = parse_deployment_manifest_str(
        "m.yaml",
        "apiVersion: capyctl.io/v1alpha1\nkind: Deployment\nmetadata: {name: a}\nspec:\n  engine: sglang\n  model: m\n  extraArgs: [--speculative-algorithm, EAGLE]\n  residency: host_backed\n",
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("m.yaml:8: spec.residency: host_backed is refused for SGLang"),
        "{e}"
    );
}

#[test]
fn queue_spec_round_trips_the_settings() {
    let q = QueueSettings {
        max_pending_per_deployment: 0,
        ..QueueSettings::defaults(Mode::Standalone)
    };
    let spec = QueueSpec::from(&q);
    assert_eq!(spec.request_deadline.to_string(), "30m");
    assert_eq!(spec.max_buffered_bytes_total.to_string(), "64MiB");
    assert_eq!(QueueSettings::from(&spec), q);
    let json = serde_json::to_value(&spec).unwrap();
    assert_eq!(json["admissionWindow"], "2s");
    assert_eq!(json["maxPendingPerDeployment"], 0);
}

/// The replicas keys, from an object to the document and back.
#[test]
fn replicas_scale_gpus_and_routing_map_both_ways() {
    let text = "apiVersion: capyctl.io/v1alpha1\nkind: Deployment\nmetadata: {name: chat, namespace: team-a}\nspec:\n  engine: vllm\n  model: m\n  replicas: 4\n  scale: {min: 2, targetInFlight: 16, scaleDownDelay: 30s}\n  gpusPerInstance: 2\n  routing: prefix\n";
    let object = parse_deployment_manifest_str("m.yaml", text).unwrap();
    assert_eq!(object.spec.replicas, Some(4));
    let doc = object.to_document().unwrap();
    assert_eq!(doc.replicas(), 4);
    let scale = doc.scale().unwrap();
    assert_eq!(
        (scale.min, scale.target_in_flight, scale.scale_down_delay),
        (2, 16, std::time::Duration::from_secs(30))
    );
    assert_eq!(doc.gpus_per_instance(), 2);
    assert_eq!(doc.routing(), Routing::Prefix);
    // The same document as a YAML deployment document.
    let same = parse_deployment_str(
        "d.yaml",
        "name: chat\nengine: vllm\nmodel: m\nreplicas: 4\nscale: {min: 2, target_in_flight: 16, scale_down_delay: 30s}\ngpus_per_instance: 2\nrouting: prefix\n",
    )
    .unwrap();
    assert_eq!(doc, same);
    // Document -> object -> document is the identity, and the object's JSON is camelCase.
    let back = Deployment::from_document(&doc);
    assert_eq!(back.spec, object.spec);
    assert_eq!(back.to_document().unwrap(), doc);
    let json = serde_json::to_value(&back.spec).unwrap();
    assert_eq!(json["replicas"], 4);
    assert_eq!(json["scale"]["targetInFlight"], 16);
    assert_eq!(json["scale"]["scaleDownDelay"], "30s");
    assert_eq!(json["gpusPerInstance"], 2);
    assert_eq!(json["routing"], "prefix");

    // A scale with defaults only, and none of the keys: the document's defaults.
    let mut bare = object.clone();
    bare.spec.scale = Some(k8s::ScaleSpec::default());
    bare.spec.replicas = None;
    bare.spec.gpus_per_instance = None;
    bare.spec.routing = None;
    let doc = bare.to_document().unwrap();
    assert_eq!(doc.replicas(), 1);
    let scale = doc.scale().unwrap();
    assert_eq!(
        (scale.min, scale.target_in_flight, scale.scale_down_delay),
        (1, 24, std::time::Duration::from_secs(60))
    );
    assert_eq!(doc.gpus_per_instance(), 1);
    assert_eq!(doc.routing(), Routing::LeastLoaded);
    assert_eq!(
        serde_json::to_value(&bare.spec).unwrap()["scale"],
        serde_json::json!({})
    );
}

/// The API server fills in `replicas: 1` (the schema's default) on objects that do not say,
/// also on objects stored before the key existed: that is the document's unset `replicas`, so
/// the deployment it gives is the one already deployed (no new revision).
#[test]
fn the_defaulted_replicas_is_the_documents_unset() {
    let bare = r#"{"apiVersion": "capyctl.io/v1alpha1", "kind": "Deployment", "metadata": {"name": "chat"}, "spec": {"engine": "vllm", "model": "m"}}"#;
    let bare: Deployment = serde_json::from_str(bare).unwrap();
    let mut defaulted = bare.clone();
    defaulted.spec.replicas = Some(k8s::DEFAULT_REPLICAS);
    let doc = defaulted.to_document().unwrap();
    assert_eq!(doc.replicas, None);
    assert_eq!(doc, bare.to_document().unwrap());
    // A document that says 1 is the same deployment as one that does not.
    let one = parse_deployment_str(
        "d.yaml",
        "name: chat\nengine: vllm\nmodel: m\nreplicas: 1\n",
    )
    .unwrap();
    assert_eq!(
        Deployment::from_document(&one)
            .to_document()
            .unwrap()
            .replicas(),
        1
    );
    // Scaled: the document says so.
    defaulted.spec.replicas = Some(3);
    assert_eq!(defaulted.to_document().unwrap().replicas, Some(3));
}

/// Refusals of the replicas keys name the object's field, as the operator reports them.
#[test]
fn replicas_errors_name_the_objects_fields() {
    let object = |spec: Value| -> Deployment {
        let mut o: Deployment = serde_json::from_value(serde_json::json!({
            "apiVersion": "capyctl.io/v1alpha1",
            "kind": "Deployment",
            "metadata": {"name": "chat", "namespace": "team-a"},
            "spec": spec,
        }))
        .unwrap();
        o.metadata.namespace = Some("team-a".into());
        o
    };
    let refused = |spec: Value| object(spec).to_document().unwrap_err();

    let e = refused(serde_json::json!({"engine": "vllm", "model": "m", "replicas": 65}));
    assert_eq!(
        e.to_string(),
        "Deployment team-a/chat: spec.replicas: 65 is out of range (1 to 64)"
    );
    let e = refused(serde_json::json!({"engine": "vllm", "model": "m", "replicas": 0}));
    assert_eq!(
        e.to_string(),
        "Deployment team-a/chat: spec.replicas: 0 is out of range (1 to 64)"
    );
    assert!(matches!(e.problem, Problem::OutOfRange(_)));
    let e = refused(serde_json::json!({"engine": "vllm", "model": "m", "gpusPerInstance": 17}));
    assert_eq!(
        e.to_string(),
        "Deployment team-a/chat: spec.gpusPerInstance: 17 is out of range (1 to 16)"
    );
    let e = refused(
        serde_json::json!({"engine": "vllm", "model": "m", "scale": {"targetInFlight": 33}}),
    );
    assert_eq!(
        e.to_string(),
        "Deployment team-a/chat: spec.scale.targetInFlight: 33 is out of range (1 to 32)"
    );
    let e = refused(
        serde_json::json!({"engine": "vllm", "model": "m", "scale": {"scaleDownDelay": "0s"}}),
    );
    assert!(
        e.to_string()
            .starts_with("Deployment team-a/chat: spec.scale.scaleDownDelay: 0s is out of range"),
        "{e}"
    );
    // Across keys: scale.min above replicas (what `kubectl scale` below scale.min gives), and
    // several GPUs on an engine without a tensor-parallel option.
    let e = refused(
        serde_json::json!({"engine": "vllm", "model": "m", "replicas": 2, "scale": {"min": 3}}),
    );
    assert!(
        e.to_string()
            .starts_with("Deployment team-a/chat: spec.scale.min: 3 is above replicas (2)"),
        "{e}"
    );
    assert!(matches!(e.problem, Problem::Conflict(_)));
    // The defaulted replicas (1) counts as replicas too.
    let e = refused(
        serde_json::json!({"engine": "vllm", "model": "m", "replicas": 1, "scale": {"min": 2}}),
    );
    assert!(
        e.to_string()
            .starts_with("Deployment team-a/chat: spec.scale.min: 2 is above replicas (1)"),
        "{e}"
    );
    let e =
        refused(serde_json::json!({"engine": "tensorfold", "model": "m", "gpusPerInstance": 2}));
    assert!(
        e.to_string()
            .starts_with("Deployment team-a/chat: spec.gpusPerInstance: 2 cannot be passed to"),
        "{e}"
    );
    // Unknown keys and values are refused when read, naming the field and the line.
    let e = parse_deployment_manifest_str(
        "m.yaml",
        "apiVersion: capyctl.io/v1alpha1\nkind: Deployment\nmetadata: {name: a}\nspec:\n  engine: vllm\n  model: m\n  routing: round_robin\n",
    )
    .unwrap_err();
    assert!(e.to_string().starts_with("m.yaml:7: spec.routing: "), "{e}");
    assert!(e.to_string().contains("round_robin"), "{e}");
    let e = parse_deployment_manifest_str(
        "m.yaml",
        "apiVersion: capyctl.io/v1alpha1\nkind: Deployment\nmetadata: {name: a}\nspec:\n  engine: vllm\n  model: m\n  scale:\n    max: 3\n",
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("m.yaml:8: spec.scale.max: unknown key"),
        "{e}"
    );
    let e = parse_deployment_manifest_str(
        "m.yaml",
        "apiVersion: capyctl.io/v1alpha1\nkind: Deployment\nmetadata: {name: a}\nspec:\n  engine: vllm\n  model: m\n  replicas: 2\n  scale: {min: 3}\n",
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("m.yaml:8: spec.scale.min: 3 is above replicas (2)"),
        "{e}"
    );
}

/// `spec.priority`: to the document and back, a printer column, and a value outside i32
/// refused naming `spec.priority` (by the schema's bounds and by the operator's check).
#[test]
fn priority_maps_both_ways_and_is_refused_outside_i32() {
    let text = "apiVersion: capyctl.io/v1alpha1\nkind: Deployment\nmetadata: {name: prod, namespace: team-a}\nspec:\n  engine: vllm\n  model: m\n  priority: 100\n";
    let object = parse_deployment_manifest_str("m.yaml", text).unwrap();
    assert_eq!(object.spec.priority, Some(100));
    let doc = object.to_document().unwrap();
    assert_eq!(doc.priority(), 100);
    let back = Deployment::from_document(&doc);
    assert_eq!(back.spec, object.spec);
    assert_eq!(serde_json::to_value(&back.spec).unwrap()["priority"], 100);
    let mut far = object.clone();
    far.spec.priority = Some(i64::from(i32::MAX) + 1);
    assert_eq!(
        far.to_document().unwrap_err().to_string(),
        "Deployment team-a/prod: spec.priority: 2147483648 is out of range (-2147483648 to 2147483647)"
    );
    let crd = serde_json::to_value(Deployment::crd()).unwrap();
    let version = &crd["spec"]["versions"][0];
    let schema =
        &version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["priority"];
    assert_eq!(schema["minimum"].as_f64(), Some(f64::from(i32::MIN)));
    assert_eq!(schema["maximum"].as_f64(), Some(f64::from(i32::MAX)));
    let columns = version["additionalPrinterColumns"].as_array().unwrap();
    assert!(
        columns
            .iter()
            .any(|c| c["name"] == "Priority" && c["jsonPath"] == ".spec.priority"),
        "{columns:?}"
    );
}
