//! The drivers' contract with the engines, checked against the engines' own source at the
//! supported releases: `contracts/vllm-0.32.0.txt` and `contracts/sglang-0.5.23.txt`, written
//! by `contracts/extract.py` from the release's Python source (the README's "Engine contracts"
//! says how to write them again).
//!
//! What is checked, from the same tables and functions the driver and the launch use:
//! - every call of `VLLM_CALLS` and `SGLANG_CALLS`: its route with that method exists; every
//!   query parameter it sends is one the handler reads; a body is sent exactly where the handler
//!   takes one (none where it takes none, one where it requires one), and the body's fields are
//!   all fields of the handler's request model, with every required one present, each value
//!   of a JSON kind the field's annotation accepts (string, integer, number, boolean, array,
//!   object, null) and, where the source lists the values a field takes, a value among them;
//!   the completion bodies of
//!   `verify` (check prompt, decision, warm-up) against `CompletionRequest`;
//! - every flag of the launch command (`launch_command` over every branch: parking with and
//!   without host RAM, `max_concurrent_requests`, tensor parallelism, `adapters`' LoRA
//!   flags), the flags CapyCTL owns
//!   (`owned_flags`), `max_running_flag`, SGLang's state-cache and speculative flags, and the
//!   environment variables the launch sets (vLLM's `envs.py`);
//! - the metric names of the load read (the newest name of each figure; older names are kept
//!   for older releases).
//!
//! TensorFold publishes no source: its calls are not checked here.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};

use capyctl_interfaces::spec::AdapterSlots;
use capyctl_node_agent::driver::{
    CallBody, Endpoint, EngineCall, Verb, adapter_request_field, engine_calls,
};
use capyctl_node_agent::launch::{SGLANG_STATE_CACHE_FLAG, launch_command, max_running_flag};
use capyctl_node_agent::load::metric_names;
use capyctl_node_agent::spec::{DecisionSpec, EngineLaunch, InstanceSpec};
use capyctl_node_agent::tier::LaunchParking;
use capyctl_node_agent::verify::{check_request, decision_request, warm_up_request};
use capyctl_spec::EngineKind;
use capyctl_spec::engine_args::{SPECULATIVE_FLAG, owned_flags};
use serde_json::Value;

/// One engine release's extract.
#[derive(Debug, Default)]
struct Contract {
    version: String,
    /// (method, path) → body: `-`, `Model`, `Model?`, `json:name`.
    routes: BTreeMap<(String, String), String>,
    /// (method, path) → query parameter names.
    queries: BTreeMap<(String, String), BTreeSet<String>>,
    /// model → field → required.
    fields: BTreeMap<String, BTreeMap<String, bool>>,
    /// (model, field) → the values it takes, where the source lists them.
    values: BTreeMap<(String, String), BTreeSet<String>>,
    /// (model, field) → the JSON kinds its annotation accepts, where the extract knows them.
    kinds: BTreeMap<(String, String), BTreeSet<String>>,
    flags: BTreeSet<String>,
    envs: BTreeSet<String>,
    metrics: BTreeSet<String>,
}

impl Contract {
    fn parse(text: &str) -> Contract {
        let mut c = Contract::default();
        for (n, line) in text.lines().enumerate() {
            if line.starts_with('#') || line.is_empty() {
                continue;
            }
            let cols: Vec<&str> = line.split('\t').collect();
            let col = |i: usize| -> String {
                cols.get(i)
                    .unwrap_or_else(|| panic!("line {}: too few columns: {line}", n + 1))
                    .to_string()
            };
            match cols[0] {
                "version" => c.version = col(1),
                "route" => {
                    c.routes.insert((col(1), col(2)), col(3));
                }
                "query" => {
                    c.queries
                        .entry((col(1), col(2)))
                        .or_default()
                        .insert(col(3));
                }
                "field" => {
                    c.fields
                        .entry(col(1))
                        .or_default()
                        .insert(col(2), col(3) == "required");
                }
                "value" => {
                    c.values.entry((col(1), col(2))).or_default().insert(col(3));
                }
                "type" => {
                    c.kinds.insert(
                        (col(1), col(2)),
                        col(3).split(',').map(str::to_string).collect(),
                    );
                }
                "flag" => {
                    c.flags.insert(col(1));
                }
                "env" => {
                    c.envs.insert(col(1));
                }
                "metric" => {
                    c.metrics.insert(col(1));
                }
                other => panic!("line {}: unknown kind `{other}`", n + 1),
            }
        }
        c
    }

    fn of(engine: EngineKind) -> Contract {
        let file = match engine {
            EngineKind::Vllm => "vllm-0.32.0.txt",
            EngineKind::Sglang => "sglang-0.5.23.txt",
            EngineKind::Tensorfold => unreachable!("TensorFold publishes no source"),
        };
        let path = format!("{}/contracts/{file}", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        Contract::parse(&text)
    }

    /// What is wrong with `body` sent to a handler whose request model is `model`.
    fn body_problems(&self, model: &str, body: &Value) -> Vec<String> {
        let Some(fields) = self.fields.get(model) else {
            return vec![format!("the source lists no fields of `{model}`")];
        };
        let Some(obj) = body.as_object() else {
            return vec![format!("the body {body} is not a JSON object")];
        };
        let mut problems = Vec::new();
        for (name, value) in obj {
            if !fields.contains_key(name) {
                problems.push(format!("`{name}` is not a field of `{model}`"));
            }
            if let Some(kinds) = self.kinds.get(&(model.to_string(), name.clone()))
                && !kinds.iter().any(|k| json_kind_fits(value, k))
            {
                problems.push(format!(
                    "`{name}`: {value} is not of the kinds {kinds:?} `{model}` takes"
                ));
            }
            if let Some(allowed) = self.values.get(&(model.to_string(), name.clone())) {
                let sent: Vec<&str> = match value {
                    Value::String(s) => vec![s.as_str()],
                    Value::Array(items) => items.iter().filter_map(Value::as_str).collect(),
                    _ => vec![],
                };
                for v in sent {
                    if !allowed.contains(v) {
                        problems.push(format!(
                            "`{name}`: `{v}` is not one of {allowed:?} of `{model}`"
                        ));
                    }
                }
            }
        }
        for (name, required) in fields {
            if *required && !obj.contains_key(name) {
                problems.push(format!("`{model}` requires `{name}`, which is not sent"));
            }
        }
        problems
    }

    /// What is wrong with `call` (sending `bodies`: its own, or the completion bodies).
    fn call_problems(&self, call: &EngineCall, bodies: &[Value]) -> Vec<String> {
        let key = (call.verb.as_str().to_string(), call.path().to_string());
        let Some(taken) = self.routes.get(&key) else {
            let methods: Vec<&str> = self
                .routes
                .keys()
                .filter(|(_, p)| p == call.path())
                .map(|(m, _)| m.as_str())
                .collect();
            return vec![if methods.is_empty() {
                format!("no route {}", call.path())
            } else {
                format!(
                    "{} {} is not a route (it takes {methods:?})",
                    key.0,
                    call.path()
                )
            }];
        };
        let mut problems = Vec::new();
        let known = self.queries.get(&key).cloned().unwrap_or_default();
        for (name, _) in call.query() {
            if !known.contains(name) {
                problems.push(format!("the handler reads no query parameter `{name}`"));
            }
        }
        let (model, required) = match taken.as_str() {
            "-" => {
                if !bodies.is_empty() {
                    problems.push("a body is sent, and the handler takes none".into());
                }
                return problems;
            }
            t => match t.strip_suffix('?') {
                Some(m) => (m, false),
                None => (t, true),
            },
        };
        if bodies.is_empty() && required {
            problems.push(format!(
                "no body is sent, and the handler requires a `{model}`"
            ));
        }
        for body in bodies {
            problems.extend(self.body_problems(model, body));
        }
        problems
    }
}

/// Whether `value` is of JSON kind `kind` as the extract names it (an integer is also a
/// number, as pydantic takes it).
fn json_kind_fits(value: &Value, kind: &str) -> bool {
    match kind {
        "string" => value.is_string(),
        "integer" => value.is_i64() || value.is_u64(),
        "number" => value.is_number(),
        "boolean" => value.is_boolean(),
        "array" => value.is_array(),
        "object" => value.is_object(),
        "null" => value.is_null(),
        other => panic!("unknown JSON kind `{other}` in the extract"),
    }
}

fn endpoint(engine: EngineKind) -> Endpoint {
    Endpoint {
        engine,
        base_url: "http://127.0.0.1:1".into(),
        model_name: "chat-a".into(),
        model: "/models/Qwen3-4B".into(),
    }
}

/// The bodies `call` sends: its own, or for a completion every body `verify` builds.
fn bodies(call: &EngineCall) -> Vec<Value> {
    let ep = endpoint(call.engine);
    match call.body {
        CallBody::Empty => vec![],
        CallBody::Json(make) => vec![make(&ep)],
        CallBody::Adapter(make) => vec![make("support-bot", "/models/loras/support-bot")],
        CallBody::Completion => {
            let decision = DecisionSpec {
                prompt: "Is the sky blue?".into(),
                options: vec!["yes".into(), "no".into()],
            };
            vec![
                check_request(&ep.model_name),
                warm_up_request(&ep.model_name),
                decision_request(&ep.model_name, &decision),
            ]
        }
    }
}

fn check_calls(engine: EngineKind) {
    let contract = Contract::of(engine);
    let mut problems = Vec::new();
    for call in engine_calls(engine) {
        for p in contract.call_problems(call, &bodies(call)) {
            problems.push(format!(
                "{engine} {} {} ({}): {p}",
                call.verb.as_str(),
                call.target,
                call.step
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "calls that {engine} {} does not take:\n{}",
        contract.version,
        problems.join("\n")
    );
}

#[test]
fn vllm_calls_are_routes_of_vllm_0_32_0() {
    check_calls(EngineKind::Vllm);
}

#[test]
fn sglang_calls_are_routes_of_sglang_0_5_23() {
    check_calls(EngineKind::Sglang);
}

/// Every launch command of `engine` over the launch's branches.
fn launch_args(engine: EngineKind) -> Vec<(Vec<String>, Vec<String>)> {
    let launch = EngineLaunch {
        command: vec!["engine".into()],
        version: None,
        env: Default::default(),
    };
    let parkings = [
        LaunchParking::default(),
        LaunchParking {
            may_park: true,
            host_ram: false,
        },
        LaunchParking {
            may_park: true,
            host_ram: true,
        },
    ];
    let mut out = Vec::new();
    for parking in parkings {
        for (declared, tp, adapters) in [
            (None, None, None),
            (
                Some(12),
                Some(2),
                Some(AdapterSlots {
                    max_loaded: 4,
                    max_rank: 64,
                }),
            ),
        ] {
            let mut spec = InstanceSpec::new("01KC", "chat-a", engine, "/models/m");
            spec.max_concurrent_requests = declared;
            spec.tensor_parallel = tp;
            spec.adapters = adapters;
            let cmd = launch_command(&spec, &launch, 8000, parking).unwrap();
            out.push((cmd.args, cmd.env.keys().cloned().collect()));
        }
    }
    out
}

fn check_flags(engine: EngineKind) {
    let contract = Contract::of(engine);
    let mut used: BTreeSet<String> = BTreeSet::new();
    let mut envs: BTreeSet<String> = BTreeSet::new();
    for (args, env) in launch_args(engine) {
        for a in args.iter().filter(|a| a.starts_with("--")) {
            used.insert(a.split_once('=').map_or(a.as_str(), |(f, _)| f).to_string());
        }
        envs.extend(env);
    }
    used.extend(owned_flags(engine).iter().map(|f| f.flag.to_string()));
    used.extend(max_running_flag(engine).map(str::to_string));
    if engine == EngineKind::Sglang {
        used.insert(SGLANG_STATE_CACHE_FLAG.into());
        used.insert(SPECULATIVE_FLAG.into());
    }
    let missing: Vec<&String> = used.difference(&contract.flags).collect();
    assert!(
        missing.is_empty(),
        "flags {engine} {} does not have: {missing:?}",
        contract.version
    );
    if engine == EngineKind::Vllm {
        let missing: Vec<&String> = envs.difference(&contract.envs).collect();
        assert!(
            missing.is_empty(),
            "environment variables vLLM {} does not read: {missing:?}",
            contract.version
        );
        assert!(envs.contains("VLLM_SERVER_DEV_MODE"), "{envs:?}");
        assert!(
            envs.contains("VLLM_ALLOW_RUNTIME_LORA_UPDATING"),
            "{envs:?}"
        );
    }
}

#[test]
fn vllm_launch_flags_are_flags_of_vllm_0_32_0() {
    check_flags(EngineKind::Vllm);
}

#[test]
fn sglang_launch_flags_are_flags_of_sglang_0_5_23() {
    check_flags(EngineKind::Sglang);
}

/// The field that names a request's LoRA adapter besides `model` (`adapter_request_field`,
/// which the router sets in the bodies it forwards): SGLang's is an optional field of the
/// request models of both OpenAI routes that takes a string (a bare adapter name in `model`
/// runs SGLang's base); vLLM needs none (`model` names a loaded adapter), nor TensorFold (no
/// adapters).
#[test]
fn the_adapter_request_field_is_one_sglang_reads() {
    let sglang = Contract::of(EngineKind::Sglang);
    let field = adapter_request_field(EngineKind::Sglang).expect("SGLang needs a field");
    for (path, model) in [
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
    ] {
        assert_eq!(
            sglang
                .routes
                .get(&("POST".to_string(), path.to_string()))
                .map(String::as_str),
            Some(model),
            "POST {path}"
        );
        assert_eq!(
            sglang.fields.get(model).and_then(|f| f.get(field)),
            Some(&false),
            "`{field}` is an optional field of {model}"
        );
        let kinds = sglang
            .kinds
            .get(&(model.to_string(), field.to_string()))
            .unwrap_or_else(|| panic!("{model}.{field}: no kinds in the extract"));
        assert!(kinds.contains("string"), "{model}.{field}: {kinds:?}");
    }
    assert_eq!(adapter_request_field(EngineKind::Vllm), None);
    assert_eq!(adapter_request_field(EngineKind::Tensorfold), None);
}

#[test]
fn load_metric_names_are_the_engines() {
    for engine in [EngineKind::Vllm, EngineKind::Sglang] {
        let contract = Contract::of(engine);
        let names = metric_names(engine);
        for (figure, list) in [
            ("running", names.running),
            ("waiting", names.waiting),
            ("kv_usage", names.kv_usage),
        ] {
            let newest = list[0];
            assert!(
                contract.metrics.contains(newest),
                "{engine} {}: no metric {newest} ({figure})",
                contract.version
            );
        }
    }
}

/// The checks can fail: a route the engine lacks, a method it does not take, a query it does
/// not read, a body where it takes none, none where it requires one, an unknown field, a
/// missing required field, a value it does not take.
#[test]
fn the_checks_catch_what_the_engine_would_refuse() {
    let sglang = Contract::of(EngineKind::Sglang);
    let vllm = Contract::of(EngineKind::Vllm);
    let call = |engine, verb, target, body| EngineCall {
        engine,
        step: "test",
        verb,
        target,
        body,
    };
    let with = |c: &Contract, call: EngineCall| c.call_problems(&call, &bodies(&call));
    let s = EngineKind::Sglang;
    let v = EngineKind::Vllm;
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            with(&sglang, call(s, Verb::Post, "/pause", CallBody::Empty)),
            "no route",
        ),
        (
            with(&vllm, call(v, Verb::Get, "/sleep", CallBody::Empty)),
            "is not a route",
        ),
        (
            with(
                &vllm,
                call(v, Verb::Post, "/sleep?levels=1", CallBody::Empty),
            ),
            "no query parameter `levels`",
        ),
        (
            with(
                &vllm,
                call(
                    v,
                    Verb::Post,
                    "/sleep?level=1",
                    CallBody::Json(|_| serde_json::json!({"level": 1})),
                ),
            ),
            "takes none",
        ),
        (
            with(
                &sglang,
                call(s, Verb::Post, "/pause_generation", CallBody::Empty),
            ),
            "requires a `PauseGenerationReqInput`",
        ),
        (
            with(
                &sglang,
                call(
                    s,
                    Verb::Post,
                    "/pause_generation",
                    CallBody::Json(|_| serde_json::json!({"how": "abort"})),
                ),
            ),
            "`how` is not a field",
        ),
        (
            with(
                &sglang,
                call(
                    s,
                    Verb::Post,
                    "/update_weights_from_disk",
                    CallBody::Json(|_| serde_json::json!({})),
                ),
            ),
            "requires `model_path`",
        ),
        (
            with(
                &sglang,
                call(
                    s,
                    Verb::Post,
                    "/release_memory_occupation",
                    CallBody::Json(|_| serde_json::json!({"tags": ["weights", "kv"]})),
                ),
            ),
            "`kv` is not one of",
        ),
        (
            with(
                &vllm,
                call(
                    v,
                    Verb::Post,
                    "/collective_rpc",
                    CallBody::Json(|_| serde_json::json!({"args": []})),
                ),
            ),
            "requires `method`",
        ),
        (
            with(
                &sglang,
                call(
                    s,
                    Verb::Post,
                    "/pause_generation",
                    CallBody::Json(|_| serde_json::json!({"mode": 1})),
                ),
            ),
            "`mode`: 1 is not of the kinds",
        ),
        (
            with(
                &vllm,
                call(
                    v,
                    Verb::Post,
                    "/v1/load_lora_adapter",
                    CallBody::Json(
                        |_| serde_json::json!({"lora_name": "a", "lora_path": ["/adapters/a"]}),
                    ),
                ),
            ),
            "`lora_path`: [\"/adapters/a\"] is not of the kinds",
        ),
    ];
    // The adapter calls: a field the handler lacks, a path missing, a route of the other
    // engine.
    let cases = cases
        .into_iter()
        .chain([
            (
                with(
                    &vllm,
                    call(
                        v,
                        Verb::Post,
                        "/v1/load_lora_adapter",
                        CallBody::Adapter(|n, p| serde_json::json!({"name": n, "lora_path": p})),
                    ),
                ),
                "requires `lora_name`",
            ),
            (
                with(
                    &sglang,
                    call(
                        s,
                        Verb::Post,
                        "/load_lora_adapter",
                        CallBody::Adapter(|n, _| serde_json::json!({"lora_name": n})),
                    ),
                ),
                "requires `lora_path`",
            ),
            (
                with(
                    &sglang,
                    call(
                        s,
                        Verb::Post,
                        "/v1/unload_lora_adapter",
                        CallBody::Adapter(|n, _| serde_json::json!({"lora_name": n})),
                    ),
                ),
                "no route",
            ),
        ])
        .collect::<Vec<_>>();
    let wrong = serde_json::json!({"model": "m", "prompt": "p", "max_tokens": "16"});
    assert_eq!(
        vllm.body_problems("CompletionRequest", &wrong),
        [r#"`max_tokens`: "16" is not of the kinds {"integer", "null"} `CompletionRequest` takes"#]
    );
    for (problems, expected) in cases {
        assert!(
            problems.iter().any(|p| p.contains(expected)),
            "expected a problem with `{expected}`, got {problems:?}"
        );
    }
    assert!(!sglang.flags.contains("--enable-sleep-mode"));
    assert!(!vllm.flags.contains("--max-running-requests"));
}
