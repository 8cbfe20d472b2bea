//! Documents, settings and overrides: every error names file, line (or override), key and problem.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::PathBuf;
use std::time::Duration;

use capyctl_spec::documents::{
    self, DocumentError, Problem, load_deployment_file, load_host_file, load_server_file,
    load_standalone_file, parse_deployment_str, parse_host_str, parse_server_str,
    parse_standalone_str,
};
use capyctl_spec::overrides::Overrides;
use capyctl_spec::settings::{
    self, HostConfig, LifecycleDefaults, ListenSettings, Mode, QueueSettings, ServerConfig,
    SwitchingSettings,
};
use capyctl_spec::{Activation, EngineKind, Residency};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The expected text of an error about fixture `name`.
fn at(name: &str, rest: &str) -> String {
    format!("{}{rest}", fixture(name).display())
}

fn none() -> Overrides {
    Overrides::none()
}

fn overrides(sets: &[&str], env: &[(&str, &str)]) -> Overrides {
    Overrides::from_args_and_env(sets.iter().copied(), env.iter().copied()).unwrap()
}

fn host(text: &str) -> Result<HostConfig, DocumentError> {
    parse_host_str("host.yaml", text, &none())
}

// ---- the fixtures: unknown key, wrong type, out of range for each document ----

#[test]
fn deployment_fixture_errors() {
    let e = load_deployment_file(fixture("deployment-unknown-key.yaml")).unwrap_err();
    assert_eq!(
        e.to_string(),
        at(
            "deployment-unknown-key.yaml",
            ":3: resdency: unknown key; expected one of name, engine, model, residency, max_concurrent_requests, extra_args, env, resources, lifecycle, decision, replicas, scale, gpus_per_instance, routing, priority, adapters, adapter"
        )
    );
    assert!(matches!(e.problem, Problem::UnknownKey { .. }));
    assert_eq!(e.line(), Some(3));

    let e = load_deployment_file(fixture("deployment-wrong-type.yaml")).unwrap_err();
    assert_eq!(
        e.to_string(),
        at(
            "deployment-wrong-type.yaml",
            ":4: max_concurrent_requests: wrong type: string \"lots\", expected an integer from 1 to 4096"
        )
    );
    assert!(matches!(e.problem, Problem::WrongType(_)));

    let e = load_deployment_file(fixture("deployment-out-of-range.yaml")).unwrap_err();
    assert_eq!(
        e.to_string(),
        at(
            "deployment-out-of-range.yaml",
            ":4: max_concurrent_requests: 5000 is out of range (1 to 4096)"
        )
    );
    assert!(matches!(e.problem, Problem::OutOfRange(_)));
    assert_eq!(e.metric_label(), "out_of_range");
}

#[test]
fn host_fixture_errors() {
    let e = load_host_file(fixture("host-unknown-key.yaml"), &none()).unwrap_err();
    assert_eq!(
        e.to_string(),
        at(
            "host-unknown-key.yaml",
            ":4: resource_policy.queue.max_pending: unknown key; expected one of admission_window, request_deadline, stream_idle_timeout, max_pending_per_deployment, max_pending_total, max_buffered_bytes_total"
        )
    );
    let e = load_host_file(fixture("host-wrong-type.yaml"), &none()).unwrap_err();
    assert_eq!(
        e.to_string(),
        at(
            "host-wrong-type.yaml",
            ":4: resource_policy.queue.max_pending_total: wrong type: string \"many\", expected an integer from 0 to 65536"
        )
    );
    let e = load_host_file(fixture("host-out-of-range.yaml"), &none()).unwrap_err();
    assert_eq!(
        e.to_string(),
        at(
            "host-out-of-range.yaml",
            ":4: resource_policy.queue.admission_window: 45s is out of range (1ms to 30s)"
        )
    );
}

#[test]
fn server_fixture_errors() {
    let e = load_server_file(fixture("server-unknown-key.yaml"), &none()).unwrap_err();
    assert_eq!(
        e.to_string(),
        at(
            "server-unknown-key.yaml",
            ":3: switching.drain_timout: unknown key; expected one of drain_timeout, wake_timeout"
        )
    );
    let e = load_server_file(fixture("server-wrong-type.yaml"), &none()).unwrap_err();
    assert_eq!(
        e.to_string(),
        at(
            "server-wrong-type.yaml",
            ":3: listen.management: wrong type: sequence, expected a socket address such as 127.0.0.1:8080 or [::1]:8080"
        )
    );
    let e = load_server_file(fixture("server-out-of-range.yaml"), &none()).unwrap_err();
    assert_eq!(
        e.to_string(),
        at(
            "server-out-of-range.yaml",
            ":3: switching.drain_timeout: 601s is out of range (1s to 600s)"
        )
    );
}

#[test]
fn standalone_fixture_errors() {
    let e = load_standalone_file(fixture("standalone-unknown-key.yaml"), &none()).unwrap_err();
    assert_eq!(
        e.to_string(),
        at(
            "standalone-unknown-key.yaml",
            ":8: deployments[0].resdency: unknown key; expected one of name, engine, model, residency, max_concurrent_requests, extra_args, env, resources, lifecycle, decision, replicas, scale, gpus_per_instance, routing, priority, adapters, adapter"
        )
    );
    let e = load_standalone_file(fixture("standalone-wrong-type.yaml"), &none()).unwrap_err();
    assert_eq!(
        e.to_string(),
        at(
            "standalone-wrong-type.yaml",
            ":4: deployments: wrong type: map, expected a sequence"
        )
    );
    let e = load_standalone_file(fixture("standalone-out-of-range.yaml"), &none()).unwrap_err();
    assert_eq!(
        e.to_string(),
        at(
            "standalone-out-of-range.yaml",
            ":7: host.resource_policy.queue.admission_window: 45s is out of range (1ms to 30s)"
        )
    );
}

// ---- the good fixtures ----

#[test]
fn full_deployment_document_reads() {
    let d = load_deployment_file(fixture("deployment.yaml")).unwrap();
    assert_eq!(d.name, "my-model");
    assert_eq!(d.engine, Some(EngineKind::Vllm));
    assert_eq!(d.model.as_deref(), Some("Qwen3-4B"));
    assert_eq!(d.residency, Some(Residency::HostBacked));
    assert_eq!(d.max_concurrent_requests, Some(8));
    assert_eq!(d.extra_args, ["--max-model-len", "8192"]);
    assert_eq!(d.env["HF_HOME"], "/data/hf");
    let r = d.resources.unwrap();
    assert_eq!(r.gpu_memory.unwrap().as_u64(), 40 << 30);
    assert_eq!(r.weights_memory.unwrap().as_u64(), 8 << 30);
    assert_eq!(d.activation(), Activation::Explicit);
    assert!(d.warm());
    assert_eq!(d.decision.unwrap().options, ["yes", "no"]);

    let minimal =
        parse_deployment_str("m.yaml", "name: a\nengine: tensorfold\nmodel: x\n").unwrap();
    assert_eq!(minimal.activation(), Activation::OnDemand);
    assert!(!minimal.warm());
    assert_eq!(minimal.residency, None);
    // Serializes back to a document that reads the same.
    let text = serde_yaml_ng::to_string(&minimal).unwrap();
    assert_eq!(parse_deployment_str("again.yaml", &text).unwrap(), minimal);
}

#[test]
fn full_host_document_reads() {
    let h = load_host_file(fixture("host.yaml"), &none()).unwrap();
    assert_eq!(h.id, "gpu-box");
    assert_eq!(
        h.queue,
        QueueSettings {
            admission_window: Duration::from_millis(500),
            request_deadline: Duration::from_secs(3600),
            stream_idle_timeout: Duration::from_secs(300),
            max_pending_per_deployment: 0,
            max_pending_total: 1000,
            max_buffered_bytes_total: 1 << 30,
        }
    );
    assert_eq!(h.activation, Activation::Explicit);
    assert_eq!(h.engines.vllm.command, ["/opt/sim/engine-sim", "vllm"]);
    assert_eq!(h.engines.vllm.version.as_deref(), Some("0.31.0"));
    assert_eq!(h.engines.vllm.env["VLLM_LOGGING_LEVEL"], "DEBUG");
    assert_eq!(
        h.engines.get(EngineKind::Sglang).command,
        ["engine-sim", "sglang"]
    );
    assert_eq!(h.engines.tensorfold.command, ["tensorfold", "serve"]);
    let gpus = h.gpus.unwrap();
    assert_eq!(gpus.len(), 2);
    assert_eq!(gpus[0].memory, 80 << 30);
    assert_eq!(gpus[0].uuid.as_deref(), Some("GPU-0000"));
    assert!(!gpus[1].unified);
    assert_eq!(h.host_memory, Some(64 << 30));
}

#[test]
fn full_server_document_reads() {
    let s = load_server_file(fixture("server.yaml"), &none()).unwrap();
    assert_eq!(s.listen.inference.to_string(), "0.0.0.0:8080");
    assert_eq!(s.listen.management.to_string(), "[::1]:7443");
    let tls = s.listen.tls.unwrap();
    assert_eq!(tls.cert, PathBuf::from("/etc/capyctl/tls.crt"));
    assert_eq!(tls.key, PathBuf::from("/etc/capyctl/tls.key"));
    assert_eq!(s.switching.drain_timeout, Duration::from_secs(60));
    assert_eq!(s.switching.wake_timeout, Duration::from_secs(1200));
    assert_eq!(
        s.lifecycle_defaults,
        LifecycleDefaults {
            ready_idle_timeout: Some(Duration::from_secs(300)),
            parked_idle_timeout: Some(Duration::from_secs(1800)),
        }
    );
    assert_eq!(
        s.admin_token_file,
        Some(PathBuf::from("/etc/capyctl/admin-token"))
    );
}

#[test]
fn full_standalone_document_reads() {
    let s = load_standalone_file(fixture("standalone.yaml"), &none()).unwrap();
    assert_eq!(s.host.queue.request_deadline, Duration::from_secs(3600));
    assert_eq!(
        s.server.lifecycle_defaults.ready_idle_timeout,
        Some(Duration::from_secs(300))
    );
    let names: Vec<&str> = s.deployments.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["chat-a", "chat-b"]);
    assert_eq!(s.deployments[1].residency, Some(Residency::RestartOnly));
}

// ---- defaults of both modes ----

#[test]
fn server_and_hosts_defaults() {
    let h = host("{}").unwrap();
    assert_eq!(h.queue.admission_window, Duration::from_secs(2));
    assert_eq!(h.queue.request_deadline, Duration::from_secs(600));
    assert_eq!(h.queue.stream_idle_timeout, Duration::from_secs(120));
    assert_eq!(h.queue.max_pending_per_deployment, 64);
    assert_eq!(h.queue.max_pending_total, 256);
    assert_eq!(h.queue.max_buffered_bytes_total, 64 * 1024 * 1024);
    assert_eq!(h.queue, QueueSettings::defaults(Mode::ServerAndHosts));
    assert_eq!(h.activation, Activation::OnDemand);
    assert_eq!(h.engines.vllm.command, ["vllm"]);
    assert_eq!(
        h.engines.sglang.command,
        ["python3", "-m", "sglang.launch_server"]
    );
    assert_eq!(h.engines.tensorfold.command, ["tensorfold", "serve"]);
    assert_eq!(h.engines.vllm.version, None);
    assert!(h.engines.vllm.env.is_empty());
    assert_eq!(h.gpus, None);
    assert_eq!(h.host_memory, None);
    assert_eq!(h.id, settings::default_host_id());
    assert_eq!(h, HostConfig::defaults(Mode::ServerAndHosts));

    let s = parse_server_str("server.yaml", "{}", &none()).unwrap();
    assert_eq!(s, ServerConfig::default());
    assert_eq!(s.listen.inference.to_string(), "127.0.0.1:8080");
    assert_eq!(s.listen.management.to_string(), "127.0.0.1:7443");
    assert_eq!(s.listen.tls, None);
    assert_eq!(s.switching.drain_timeout, Duration::from_secs(30));
    assert_eq!(s.switching.wake_timeout, Duration::from_secs(600));
    assert_eq!(s.lifecycle_defaults.ready_idle_timeout, None);
    assert_eq!(s.lifecycle_defaults.parked_idle_timeout, None);
    assert_eq!(s.admin_token_file, None);
}

#[test]
fn standalone_defaults() {
    let s = parse_standalone_str("standalone.yaml", "{}", &none()).unwrap();
    assert_eq!(s.host.queue.admission_window, Duration::from_secs(2));
    assert_eq!(s.host.queue.request_deadline, Duration::from_secs(1800));
    assert_eq!(s.host.queue.stream_idle_timeout, Duration::from_secs(120));
    assert_eq!(s.host.queue.max_pending_per_deployment, 64);
    assert_eq!(s.host.queue.max_pending_total, 256);
    assert_eq!(s.host.queue.max_buffered_bytes_total, 64 << 20);
    assert_eq!(s.host, HostConfig::defaults(Mode::Standalone));
    assert_eq!(s.server.switching, SwitchingSettings::defaults());
    assert_eq!(s.server.listen, ListenSettings::default());
    assert!(s.deployments.is_empty());
    // Also with empty parts and without a file.
    let s2 = parse_standalone_str("s.yaml", "server:\nhost:\n", &none()).unwrap();
    assert_eq!(s2, s);
    assert_eq!(documents::standalone_from_overrides(&none()).unwrap(), s);
}

#[test]
fn fixed_constants() {
    assert_eq!(settings::IN_FLIGHT_PER_DEPLOYMENT, 32);
    assert_eq!(settings::STREAM_READ_STALL, Duration::from_secs(10));
    assert_eq!(settings::STREAM_MAX_PIECE, 64 * 1024);
}

// ---- every range bound, just inside and just outside ----

struct Bound {
    /// Parent keys, then the key.
    keys: &'static [&'static str],
    inside: [&'static str; 2],
    outside: [&'static str; 2],
    range: &'static str,
    /// Extra lines (at the same level as the key) to keep other rules satisfied.
    extra: &'static str,
}

const HOST_BOUNDS: &[Bound] = &[
    Bound {
        keys: &["resource_policy", "queue", "admission_window"],
        inside: ["1ms", "30s"],
        outside: ["0ms", "30001ms"],
        range: "1ms to 30s",
        extra: "",
    },
    Bound {
        keys: &["resource_policy", "queue", "request_deadline"],
        inside: ["1ms", "3600s"],
        outside: ["0s", "3601s"],
        range: "1ms to 3600s",
        extra: "admission_window: 1ms",
    },
    Bound {
        keys: &["resource_policy", "queue", "stream_idle_timeout"],
        inside: ["1s", "3600s"],
        outside: ["999ms", "3601s"],
        range: "1s to 3600s",
        extra: "",
    },
    Bound {
        keys: &["resource_policy", "queue", "max_pending_per_deployment"],
        inside: ["0", "4096"],
        outside: ["-1", "4097"],
        range: "0 to 4096",
        extra: "",
    },
    Bound {
        keys: &["resource_policy", "queue", "max_pending_total"],
        inside: ["0", "65536"],
        outside: ["-1", "65537"],
        range: "0 to 65536",
        extra: "",
    },
    Bound {
        keys: &["resource_policy", "queue", "max_buffered_bytes_total"],
        inside: ["1KiB", "16GiB"],
        outside: ["1023", "17179869185"],
        range: "1KiB to 16GiB",
        extra: "",
    },
];

const SERVER_BOUNDS: &[Bound] = &[
    Bound {
        keys: &["switching", "drain_timeout"],
        inside: ["1s", "600s"],
        outside: ["999ms", "601s"],
        range: "1s to 600s",
        extra: "",
    },
    Bound {
        keys: &["switching", "wake_timeout"],
        inside: ["1s", "3600s"],
        outside: ["999ms", "3601s"],
        range: "1s to 3600s",
        extra: "",
    },
    Bound {
        keys: &["lifecycle_defaults", "ready_idle_timeout"],
        inside: ["1s", "168h"],
        outside: ["999ms", "604801s"],
        range: "1s to 168h",
        extra: "",
    },
    Bound {
        keys: &["lifecycle_defaults", "parked_idle_timeout"],
        inside: ["1s", "168h"],
        outside: ["999ms", "604801s"],
        range: "1s to 168h",
        extra: "",
    },
];

/// A block document setting `keys` to `value`, nested under `top` (e.g. `host`) when given.
/// Returns the text and the line of the key.
fn nested(top: Option<&str>, b: &Bound, value: &str) -> (String, usize) {
    let mut keys: Vec<&str> = top.into_iter().collect();
    keys.extend_from_slice(b.keys);
    let mut text = String::new();
    for (depth, k) in keys[..keys.len() - 1].iter().enumerate() {
        text.push_str(&format!("{}{k}:\n", "  ".repeat(depth)));
    }
    let indent = "  ".repeat(keys.len() - 1);
    if !b.extra.is_empty() {
        text.push_str(&format!("{indent}{}\n", b.extra));
    }
    text.push_str(&format!("{indent}{}: {value}\n", keys[keys.len() - 1]));
    let line = text.lines().count();
    (text, line)
}

fn check_bounds(
    bounds: &[Bound],
    top: Option<&str>,
    parse: impl Fn(&str) -> Result<(), DocumentError>,
) {
    for b in bounds {
        for v in b.inside {
            let (text, _) = nested(top, b, v);
            parse(&text).unwrap_or_else(|e| panic!("{v} should be accepted:\n{text}{e}"));
        }
        for v in b.outside {
            let (text, line) = nested(top, b, v);
            let err = parse(&text).expect_err(&text);
            let key: Vec<&str> = top.into_iter().chain(b.keys.iter().copied()).collect();
            let shown = if v.starts_with('-') || v.chars().all(|c| c.is_ascii_digit()) {
                match b.keys.last() {
                    Some(&"max_buffered_bytes_total") => {
                        capyctl_spec::units::format_bytes(v.parse().unwrap())
                    }
                    _ => v.to_string(),
                }
            } else {
                v.parse::<capyctl_spec::units::DurationSetting>()
                    .unwrap()
                    .to_string()
            };
            assert_eq!(
                err.to_string(),
                format!(
                    "doc.yaml:{line}: {}: {shown} is out of range ({})",
                    key.join("."),
                    b.range
                ),
                "{text}"
            );
        }
    }
}

#[test]
fn host_bounds_in_both_modes() {
    check_bounds(HOST_BOUNDS, None, |t| {
        parse_host_str("doc.yaml", t, &none()).map(|_| ())
    });
    check_bounds(HOST_BOUNDS, Some("host"), |t| {
        parse_standalone_str("doc.yaml", t, &none()).map(|_| ())
    });
}

#[test]
fn server_bounds_in_both_modes() {
    check_bounds(SERVER_BOUNDS, None, |t| {
        parse_server_str("doc.yaml", t, &none()).map(|_| ())
    });
    check_bounds(SERVER_BOUNDS, Some("server"), |t| {
        parse_standalone_str("doc.yaml", t, &none()).map(|_| ())
    });
}

#[test]
fn deployment_bounds() {
    let doc = |v: &str| format!("name: a\nengine: vllm\nmodel: m\nmax_concurrent_requests: {v}\n");
    for v in ["1", "4096"] {
        parse_deployment_str("d.yaml", &doc(v)).unwrap();
    }
    for v in ["0", "4097", "-3"] {
        assert_eq!(
            parse_deployment_str("d.yaml", &doc(v))
                .unwrap_err()
                .to_string(),
            format!("d.yaml:4: max_concurrent_requests: {v} is out of range (1 to 4096)")
        );
    }
}

// ---- cross-field rules ----

/// `max_concurrent_requests` is passed to the engine: TensorFold has no option for it, and the
/// engine's own option in `extra_args` as well says it twice. Refused in a deployment document,
/// in a standalone document's `deployments`, and in a Kubernetes object's spec.
#[test]
fn max_concurrent_requests_needs_an_engine_option_and_is_said_once() {
    let e = parse_deployment_str(
        "d.yaml",
        "name: a\nengine: tensorfold\nmodel: m\nmax_concurrent_requests: 4\n",
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "d.yaml:4: max_concurrent_requests: 4 cannot be passed to tensorfold: it has no option for how many requests run at once; remove max_concurrent_requests"
    );
    let e = parse_deployment_str(
        "d.yaml",
        "name: a\nengine: vllm\nmodel: m\nmax_concurrent_requests: 4\nextra_args:\n  - --max-model-len\n  - \"8192\"\n  - --max-num-seqs=16\n",
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "d.yaml:8: extra_args[2]: --max-num-seqs here and max_concurrent_requests both set how many requests run at once; keep one"
    );
    // Either one alone is fine.
    parse_deployment_str(
        "d.yaml",
        "name: a\nengine: sglang\nmodel: m\nextra_args: [--max-running-requests, \"16\"]\n",
    )
    .unwrap();
    parse_deployment_str("d.yaml", "name: a\nengine: tensorfold\nmodel: m\n").unwrap();

    let e = parse_standalone_str(
        "s.yaml",
        "deployments:\n  - name: a\n    engine: tensorfold\n    model: m\n    max_concurrent_requests: 4\n",
        &none(),
    )
    .unwrap_err();
    assert!(
        e.to_string().starts_with(
            "s.yaml:5: deployments[0].max_concurrent_requests: 4 cannot be passed to tensorfold"
        ),
        "{e}"
    );

    let object = capyctl_crds::parse_deployment_manifest_str(
        "m.yaml",
        "apiVersion: capyctl.io/v1alpha1\nkind: Deployment\nmetadata: {name: a}\nspec:\n  engine: tensorfold\n  model: m\n  maxConcurrentRequests: 4\n",
    );
    let e = object.unwrap_err();
    assert!(
        e.to_string()
            .contains("spec.maxConcurrentRequests: 4 cannot be passed to tensorfold"),
        "{e}"
    );
}

#[test]
fn admission_window_above_request_deadline_is_refused() {
    let e =
        host("resource_policy:\n  queue:\n    request_deadline: 10s\n    admission_window: 20s\n")
            .unwrap_err();
    assert_eq!(
        e.to_string(),
        "host.yaml:4: resource_policy.queue.admission_window: 20s is above the request deadline (10s); the admission window must not be above resource_policy.queue.request_deadline"
    );
    assert!(matches!(e.problem, Problem::Conflict(_)));

    // Only the deadline is set, below the default window: the deadline is named.
    let e = parse_standalone_str(
        "standalone.yaml",
        "host:\n  resource_policy:\n    queue:\n      request_deadline: 1s\n",
        &none(),
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "standalone.yaml:4: host.resource_policy.queue.request_deadline: 1s is below the admission window (2s, the default of host.resource_policy.queue.admission_window); the request deadline must not be below the admission window"
    );

    // Equal is fine.
    host("resource_policy:\n  queue:\n    request_deadline: 5s\n    admission_window: 5s\n")
        .unwrap();

    // An override causing it is named.
    let e = parse_host_str(
        "host.yaml",
        "resource_policy:\n  queue:\n    request_deadline: 10s\n",
        &overrides(&["resource_policy.queue.admission_window=11s"], &[]),
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "--set resource_policy.queue.admission_window=11s: resource_policy.queue.admission_window: 11s is above the request deadline (10s); the admission window must not be above resource_policy.queue.request_deadline"
    );
}

#[test]
fn deployment_names_must_be_unique_in_a_standalone_document() {
    let text = "deployments:\n  - name: a\n    engine: vllm\n    model: m\n  - name: b\n    engine: vllm\n    model: m\n  - engine: sglang\n    name: a\n    model: m\n";
    let e = parse_standalone_str("s.yaml", text, &none()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "s.yaml:9: deployments[2].name: `a` is already the name of deployments[0]; deployment names must be unique"
    );
}

// ---- other bad input ----

#[test]
fn empty_not_a_mapping_and_syntax_errors() {
    for text in ["", "   \n", "# only a comment\n"] {
        assert_eq!(
            host(text).unwrap_err().to_string(),
            "host.yaml: the document is empty; expected a mapping of keys"
        );
    }
    assert_eq!(
        host("- a\n- b\n").unwrap_err().to_string(),
        "host.yaml:1: the document is a list, not a mapping of keys"
    );
    assert_eq!(
        parse_deployment_str("m.yaml", "just text")
            .unwrap_err()
            .to_string(),
        "m.yaml:1: the document is a string, not a mapping of keys"
    );
    let e = host("id: a\nresource_policy: {queue: [\n").unwrap_err();
    assert!(matches!(e.problem, Problem::Syntax(_)), "{e}");
    assert!(e.to_string().starts_with("host.yaml:"), "{e}");
    assert!(e.line().is_some(), "{e}");
    let e = host("id: a\nid: b\n").unwrap_err();
    assert!(matches!(e.problem, Problem::Syntax(_)), "{e}");
    let e = load_host_file(fixture("does-not-exist.yaml"), &none()).unwrap_err();
    assert!(matches!(e.problem, Problem::Read(_)));
    assert!(
        e.to_string()
            .starts_with(&at("does-not-exist.yaml", ": cannot read the file:")),
        "{e}"
    );
}

#[test]
fn deployment_value_errors() {
    let cases: &[(&str, &str)] = &[
        (
            "name: a\nmodel: m\n",
            "d.yaml:1: engine: missing required key",
        ),
        (
            "name: a\nengine: gpu\nmodel: m\n",
            "d.yaml:2: engine: `gpu` is not valid; expected one of vllm, sglang, tensorfold",
        ),
        (
            "name: My_Model\nengine: vllm\nmodel: m\n",
            "d.yaml:1: name: `My_Model` is not a valid name: use 1 to 63 lowercase letters, digits and '-', starting and ending with a letter or digit",
        ),
        (
            "name: a\nengine: vllm\nmodel: \"\"\n",
            "d.yaml:3: model: must not be empty",
        ),
        (
            "name: a\nengine: vllm\nmodel: m\nresidency: shallow\n",
            "d.yaml:4: residency: `shallow` is not valid; expected one of host_backed, deep, restart_only",
        ),
        (
            "name: a\nengine: vllm\nmodel: m\ndecision: {prompt: p, options: [yes]}\n",
            "d.yaml:4: decision.options: a decision needs at least 2 options, found 1",
        ),
        (
            "name: a\nengine: vllm\nmodel: m\ndecision:\n  prompt: p\n  options:\n    - a\n    - a\n",
            "d.yaml:7: decision.options: option `a` is listed twice; options must be distinct",
        ),
        (
            "name: a\nengine: vllm\nmodel: m\nresources:\n  gpu_memory: 40G\n",
            "d.yaml:5: resources.gpu_memory: `40G` is not a byte size: use a number of bytes or a number followed by KiB, MiB, GiB, TiB, KB, MB, GB or TB (e.g. 64MiB)",
        ),
        (
            "name: a\nengine: vllm\nmodel: m\nresources:\n  gpu_memory: 0\n",
            "d.yaml:5: resources.gpu_memory: a size of 0 bytes is not allowed",
        ),
        (
            "name: a\nengine: vllm\nmodel: m\nlifecycle: {activation: explicit, warm: yes}\n",
            "d.yaml:4: lifecycle.warm: wrong type: string \"yes\", expected a boolean",
        ),
        (
            "name: a\nengine: vllm\nmodel: m\nenv: {A: [1]}\n",
            "d.yaml:4: env.A: wrong type: sequence, expected a string",
        ),
        (
            "name: a\nengine: vllm\nmodel: m\nlifecycle:\n  activation: true\n",
            "d.yaml:5: lifecycle.activation: `true` is not valid; expected one of on_demand, explicit",
        ),
    ];
    for (text, want) in cases {
        let e = parse_deployment_str("d.yaml", text).unwrap_err();
        assert_eq!(&e.to_string(), want, "{text}");
    }
    let long = "a".repeat(64);
    assert!(
        parse_deployment_str("d.yaml", &format!("name: {long}\nengine: vllm\nmodel: m\n")).is_err()
    );
    let ok = "a".repeat(63);
    parse_deployment_str("d.yaml", &format!("name: {ok}\nengine: vllm\nmodel: m\n")).unwrap();
}

#[test]
fn duration_and_size_errors_name_the_key_and_line() {
    assert_eq!(
        host("resource_policy:\n  queue:\n    admission_window: 2x\n")
            .unwrap_err()
            .to_string(),
        "host.yaml:3: resource_policy.queue.admission_window: `2x` is not a duration: use a number followed by ms, s, m or h (e.g. 500ms, 2s, 5m, 1h)"
    );
    assert_eq!(
        host("resource_policy:\n  queue:\n    request_deadline: 3600\n")
            .unwrap_err()
            .to_string(),
        "host.yaml:3: resource_policy.queue.request_deadline: `3600` is not a duration: use a number followed by ms, s, m or h (e.g. 500ms, 2s, 5m, 1h)"
    );
    assert_eq!(
        host("engines:\n  vllm:\n    command: []\n")
            .unwrap_err()
            .to_string(),
        "host.yaml:3: engines.vllm.command: must name a program: give at least one item"
    );
    assert_eq!(
        host("engines:\n  llama: {}\n").unwrap_err().to_string(),
        "host.yaml:2: engines.llama: unknown key; expected one of vllm, sglang, tensorfold"
    );
    assert_eq!(
        host("gpus:\n  - unified: true\n").unwrap_err().to_string(),
        "host.yaml:2: gpus[0].memory: missing required key"
    );
    // Byte sizes may be bare numbers of bytes.
    let h = host("host_memory: 1073741824\n").unwrap();
    assert_eq!(h.host_memory, Some(1 << 30));
    assert_eq!(
        parse_server_str("s.yaml", "listen:\n  inference: localhost:80\n", &none())
            .unwrap_err()
            .to_string(),
        "s.yaml:2: listen.inference: `localhost:80` is not a socket address: use IP:PORT, e.g. 127.0.0.1:8080 or [::1]:8080"
    );
    assert_eq!(
        parse_server_str("s.yaml", "listen:\n  tls: {cert: /a}\n", &none())
            .unwrap_err()
            .to_string(),
        "s.yaml:2: listen.tls.key: missing required key"
    );
}

// ---- overrides ----

const DOC_WITH_TOTAL: &str = "resource_policy:\n  queue:\n    max_pending_total: 10\n";
const KEY: &str = "resource_policy.queue.max_pending_total";
const VAR: &str = "CAPYCTL_SET__RESOURCE_POLICY__QUEUE__MAX_PENDING_TOTAL";

#[test]
fn set_wins_over_variable_wins_over_document() {
    let total = |o: &Overrides| {
        parse_host_str("host.yaml", DOC_WITH_TOTAL, o)
            .unwrap()
            .queue
            .max_pending_total
    };
    assert_eq!(total(&none()), 10);
    assert_eq!(total(&overrides(&[], &[(VAR, "20")])), 20);
    assert_eq!(total(&overrides(&[&format!("{KEY}=30")], &[])), 30);
    assert_eq!(
        total(&overrides(&[&format!("{KEY}=30")], &[(VAR, "20")])),
        30
    );
    // The last --set of a key wins.
    assert_eq!(
        total(&overrides(
            &[&format!("{KEY}=30"), &format!("{KEY}=40")],
            &[]
        )),
        40
    );
    // Unrelated variables are ignored.
    assert_eq!(total(&overrides(&[], &[("HOME", "/root")])), 10);
}

/// An override wins over the document even where the document's own value is refused: the
/// value it replaces is never used. A refused value no override replaces is still refused with
/// its line, and a refused override names the override.
#[test]
fn an_override_replaces_a_refused_document_value() {
    let doc =
        "resource_policy:\n  queue:\n    admission_window: 45s\n    max_pending_total: lots\n";
    let key = "resource_policy.queue.admission_window";
    let both = overrides(&[&format!("{key}=3s"), &format!("{KEY}=7")], &[]);
    let q = parse_host_str("host.yaml", doc, &both).unwrap().queue;
    assert_eq!(q.admission_window, Duration::from_secs(3));
    assert_eq!(q.max_pending_total, 7);
    // Only one of the two replaced: the other is refused at its line.
    let e = parse_host_str("host.yaml", doc, &overrides(&[&format!("{key}=3s")], &[])).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("host.yaml:4: resource_policy.queue.max_pending_total: wrong type"),
        "{e}"
    );
    let e = parse_host_str(
        "host.yaml",
        doc,
        &overrides(
            &[],
            &[
                (VAR, "9"),
                (
                    "CAPYCTL_SET__RESOURCE_POLICY__QUEUE__ADMISSION_WINDOW",
                    "60s",
                ),
            ],
        ),
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("CAPYCTL_SET__RESOURCE_POLICY__QUEUE__ADMISSION_WINDOW")
            && e.to_string().contains("is out of range (1ms to 30s)"),
        "{e}"
    );
}

#[test]
fn product_page_override_examples() {
    // Host document.
    let h = parse_host_str(
        "host.yaml",
        "{}",
        &overrides(
            &["resource_policy.queue.max_pending_per_deployment=0"],
            &[("CAPYCTL_SET__LIFECYCLE__ACTIVATION", "explicit")],
        ),
    )
    .unwrap();
    assert_eq!(h.queue.max_pending_per_deployment, 0);
    assert_eq!(h.activation, Activation::Explicit);
    let h = parse_host_str(
        "host.yaml",
        "id: box\n",
        &overrides(&["lifecycle.activation=explicit"], &[]),
    )
    .unwrap();
    assert_eq!(h.activation, Activation::Explicit);
    assert_eq!(h.id, "box");

    // Standalone document, and standalone without a document.
    let o = overrides(
        &["host.resource_policy.queue.request_deadline=3600s"],
        &[
            (
                "CAPYCTL_SET__HOST__RESOURCE_POLICY__QUEUE__MAX_PENDING_PER_DEPLOYMENT",
                "0",
            ),
            ("CAPYCTL_SET__HOST__LIFECYCLE__ACTIVATION", "explicit"),
        ],
    );
    for s in [
        parse_standalone_str("s.yaml", "server: {}\n", &o).unwrap(),
        documents::standalone_from_overrides(&o).unwrap(),
    ] {
        assert_eq!(s.host.queue.max_pending_per_deployment, 0);
        assert_eq!(s.host.queue.request_deadline, Duration::from_secs(3600));
        assert_eq!(s.host.activation, Activation::Explicit);
    }
    // Server document.
    let s = parse_server_str(
        "server.yaml",
        "switching:\n  drain_timeout: 30s\n",
        &overrides(
            &[
                "switching.drain_timeout=60s",
                "listen.inference=0.0.0.0:9000",
            ],
            &[],
        ),
    )
    .unwrap();
    assert_eq!(s.switching.drain_timeout, Duration::from_secs(60));
    assert_eq!(s.listen.inference.to_string(), "0.0.0.0:9000");
    let s = documents::server_from_overrides(&overrides(
        &["lifecycle_defaults.ready_idle_timeout=5m"],
        &[],
    ))
    .unwrap();
    assert_eq!(
        s.lifecycle_defaults.ready_idle_timeout,
        Some(Duration::from_secs(300))
    );
}

#[test]
fn overrides_are_validated_and_named() {
    let e = parse_standalone_str("s.yaml", "{}", &overrides(&["host.x=y"], &[])).unwrap_err();
    assert_eq!(
        e.to_string(),
        "--set host.x=y: host.x: unknown key; expected one of id, resource_policy, lifecycle, engines, gpus, host_memory"
    );
    let e = parse_standalone_str(
        "s.yaml",
        "{}",
        &overrides(
            &[],
            &[(
                "CAPYCTL_SET__HOST__RESOURCE_POLICY__QUEUE__ADMISSION_WINDOW",
                "45s",
            )],
        ),
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "CAPYCTL_SET__HOST__RESOURCE_POLICY__QUEUE__ADMISSION_WINDOW=45s: host.resource_policy.queue.admission_window: 45s is out of range (1ms to 30s)"
    );
    // A bad variable overridden by a good --set is not an error: the --set wins.
    let s = parse_standalone_str(
        "s.yaml",
        "{}",
        &overrides(
            &["host.resource_policy.queue.admission_window=1s"],
            &[(
                "CAPYCTL_SET__HOST__RESOURCE_POLICY__QUEUE__ADMISSION_WINDOW",
                "45s",
            )],
        ),
    )
    .unwrap();
    assert_eq!(s.host.queue.admission_window, Duration::from_secs(1));
    // Host-document keys do not work on a standalone document (they belong under host.).
    let e = parse_standalone_str(
        "s.yaml",
        "{}",
        &overrides(&["resource_policy.queue.max_pending_per_deployment=0"], &[]),
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "--set resource_policy.queue.max_pending_per_deployment=0: resource_policy: unknown key; expected one of server, host, deployments"
    );
    let e = parse_host_str(
        "host.yaml",
        "{}",
        &overrides(&["resource_policy.queue.max_pending_total=lots"], &[]),
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "--set resource_policy.queue.max_pending_total=lots: resource_policy.queue.max_pending_total: wrong type: string \"lots\", expected an integer from 0 to 65536"
    );
    let e = parse_host_str(
        "host.yaml",
        "{}",
        &overrides(&["lifecycle.activation=sometimes"], &[]),
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "--set lifecycle.activation=sometimes: lifecycle.activation: `sometimes` is not valid; expected one of on_demand, explicit"
    );
    // A bad document is reported against its file even when overrides are given.
    let e = parse_host_str(
        "host.yaml",
        "resource_policy:\n  queue:\n    max_pending_total: -1\n",
        &overrides(&["lifecycle.activation=explicit"], &[]),
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "host.yaml:3: resource_policy.queue.max_pending_total: -1 is out of range (0 to 65536)"
    );
}

// ---- the multi-host rule ----

#[test]
fn several_hosts_use_the_tightest_waiting_limits() {
    let a = parse_host_str("a.yaml", "id: a\n", &none()).unwrap();
    let b = parse_host_str(
        "b.yaml",
        "id: b\nresource_policy:\n  queue:\n    max_pending_per_deployment: 0\n    request_deadline: 60s\n    admission_window: 10s\n",
        &none(),
    )
    .unwrap();
    let c = parse_host_str(
        "c.yaml",
        "id: c\nresource_policy:\n  queue:\n    max_pending_total: 8\n    max_buffered_bytes_total: 1MiB\n",
        &none(),
    )
    .unwrap();
    let t = settings::tightest([&a.queue, &b.queue, &c.queue]).unwrap();
    assert_eq!(t.max_pending_per_deployment, 0);
    assert_eq!(t.max_pending_total, 8);
    assert_eq!(t.max_buffered_bytes_total, 1 << 20);
    assert_eq!(t.request_deadline, Duration::from_secs(60));
    // The admission window stays per host.
    assert_eq!(b.queue.admission_window, Duration::from_secs(10));
    assert_eq!(a.queue.admission_window, Duration::from_secs(2));
}

/// Product page: "SGLang with speculative decoding (--speculative-algorithm) ... residency:
/// host_backed is refused for it." Refused when the document is checked, naming `residency` and
/// why, in both spellings of the flag, in a deployment document and in `deployments:`.
#[test]
fn host_backed_is_refused_for_sglang_with_speculative_decoding() {
    let doc = |args: &str, residency: &str| {
        format!("name: a\nengine: sglang\nmodel: m\nresidency: {residency}\nextra_args: {args}\n")
    };
    let why = "residency: host_backed is refused for SGLang with speculative decoding (--speculative-algorithm): it parks with its weights in memory, giving back only the KV cache, because releasing them would drop the draft model's weights; remove residency (CapyCTL then parks only the KV cache) or set deep or restart_only";
    for args in [
        "[--speculative-algorithm, EAGLE]",
        "[--mem-fraction-static, \"0.8\", --speculative-algorithm=EAGLE3]",
        "[--speculative-algo, EAGLE]",
    ] {
        let e = parse_deployment_str("d.yaml", &doc(args, "host_backed")).unwrap_err();
        assert_eq!(e.to_string(), format!("d.yaml:4: {why}"));
        assert!(matches!(e.problem, Problem::Conflict(_)));
        // Any other residency, or none, is fine; so is host_backed without it, or on vLLM.
        for residency in ["deep", "restart_only"] {
            parse_deployment_str("d.yaml", &doc(args, residency)).unwrap();
        }
    }
    parse_deployment_str(
        "d.yaml",
        "name: a\nengine: sglang\nmodel: m\nextra_args: [--speculative-algorithm, EAGLE]\n",
    )
    .unwrap();
    parse_deployment_str(
        "d.yaml",
        &doc("[--speculative-num-steps, \"3\"]", "host_backed"),
    )
    .unwrap();
    parse_deployment_str(
        "d.yaml",
        "name: a\nengine: vllm\nmodel: m\nresidency: host_backed\nextra_args: [--speculative-algorithm, x]\n",
    )
    .unwrap();

    let e = parse_standalone_str(
        "s.yaml",
        "deployments:\n  - name: ok\n    engine: vllm\n    model: m\n  - name: spec\n    engine: sglang\n    model: m\n    extra_args: [--speculative-algorithm=EAGLE]\n    residency: host_backed\n",
        &none(),
    )
    .unwrap_err();
    assert_eq!(e.to_string(), format!("s.yaml:9: deployments[1].{why}"));
}

/// CapyCTL passes each engine where to listen, the model and its served name, and the parking
/// switches (DESIGN.md 4.2): `extra_args` setting one of them, in any spelling, is refused,
/// naming the argument and saying that CapyCTL sets it.
#[test]
fn extra_args_must_not_set_what_capyctl_passes_the_engine() {
    let doc = |engine: &str, args: &str| {
        format!(
            "name: a\nengine: {engine}\nmodel: m\nextra_args:\n  - --max-model-len\n  - \"8192\"\n{args}"
        )
    };
    let refused = |engine: &str, args: &str| {
        parse_deployment_str("d.yaml", &doc(engine, args))
            .unwrap_err()
            .to_string()
    };
    assert_eq!(
        refused("vllm", "  - --port\n  - \"1\"\n"),
        "d.yaml:7: extra_args[2]: `--port`: CapyCTL sets --port itself (the loopback port it picks for the engine); remove it from extra_args"
    );
    assert_eq!(
        refused("sglang", "  - --host=0.0.0.0\n"),
        "d.yaml:7: extra_args[2]: `--host=0.0.0.0`: CapyCTL sets --host itself (the engine's address: 127.0.0.1, so that its control endpoints stay on loopback); remove it from extra_args"
    );
    for (engine, arg, flag) in [
        ("vllm", "--host", "--host"),
        ("vllm", "--port=8000", "--port"),
        ("vllm", "--served-model-name", "--served-model-name"),
        ("vllm", "--served_model_name=x", "--served-model-name"),
        ("vllm", "--served-model=x", "--served-model-name"),
        ("sglang", "--hos", "--host"),
        ("vllm", "--model", "--model"),
        ("vllm", "--enable-sleep-mode", "--enable-sleep-mode"),
        ("sglang", "--port", "--port"),
        ("sglang", "--model-path=/m", "--model-path"),
        ("sglang", "--model", "--model"),
        ("sglang", "--served-model-name", "--served-model-name"),
        ("sglang", "--enable-memory-saver", "--enable-memory-saver"),
        (
            "sglang",
            "--enable-weights-cpu-backup",
            "--enable-weights-cpu-backup",
        ),
        ("tensorfold", "--port", "--port"),
        ("tensorfold", "--host=127.0.0.2", "--host"),
        ("tensorfold", "--model=x", "--model"),
    ] {
        let e = refused(engine, &format!("  - {arg}\n"));
        assert!(
            e.starts_with(&format!(
                "d.yaml:7: extra_args[2]: `{arg}`: CapyCTL sets {flag} itself ("
            )),
            "{engine} {arg}: {e}"
        );
    }
    // Flags CapyCTL does not pass are the engine's business.
    parse_deployment_str("d.yaml", &doc("vllm", "  - --portal\n  - --hosts=2\n")).unwrap();
    parse_deployment_str("d.yaml", &doc("tensorfold", "  - --enable-sleep-mode\n")).unwrap();

    let e = parse_standalone_str(
        "s.yaml",
        "deployments:\n  - name: a\n    engine: vllm\n    model: m\n    extra_args: [--host, 0.0.0.0]\n",
        &none(),
    )
    .unwrap_err();
    assert!(
        e.to_string().starts_with(
            "s.yaml:5: deployments[0].extra_args[0]: `--host`: CapyCTL sets --host itself"
        ),
        "{e}"
    );
}

/// The weights are part of what a loaded model holds in GPU memory.
#[test]
fn weights_memory_above_gpu_memory_is_refused() {
    let doc = |gpu: &str, weights: &str| {
        format!(
            "name: a\nengine: vllm\nmodel: m\nresources:\n  gpu_memory: {gpu}\n  weights_memory: {weights}\n"
        )
    };
    let e = parse_deployment_str("d.yaml", &doc("8GiB", "16GiB")).unwrap_err();
    assert_eq!(
        e.to_string(),
        "d.yaml:6: resources.weights_memory: 16GiB is above resources.gpu_memory (8GiB): the weights are part of the GPU memory the loaded model holds; raise gpu_memory or correct weights_memory"
    );
    assert!(matches!(e.problem, Problem::Conflict(_)));
    parse_deployment_str("d.yaml", &doc("8GiB", "8GiB")).unwrap();
    parse_deployment_str("d.yaml", &doc("40GiB", "8GiB")).unwrap();
    // One of them alone says nothing about the other.
    parse_deployment_str(
        "d.yaml",
        "name: a\nengine: vllm\nmodel: m\nresources: {weights_memory: 1TiB}\n",
    )
    .unwrap();

    let e = parse_standalone_str(
        "s.yaml",
        "deployments:\n  - name: a\n    engine: vllm\n    model: m\n    resources: {gpu_memory: 1GiB, weights_memory: 2GiB}\n",
        &none(),
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("s.yaml:5: deployments[0].resources.weights_memory: 2GiB is above resources.gpu_memory (1GiB)"),
        "{e}"
    );
}

/// A text nested deeper than the limit is refused before the YAML parser reads it (the parser
/// takes seconds on 100 KB of `[[[[...`), naming the limit and the line, for every kind of
/// document and for JSON bodies.
#[test]
fn deeply_nested_documents_are_refused_before_parsing() {
    let limit = documents::MAX_DEPTH;
    let want = |file: &str, line: usize| {
        format!(
            "{file}:{line}: nested deeper than {limit} levels, the limit for documents and request bodies"
        )
    };
    let half = 50 * 1024;
    let flow = format!(
        "name: a\nengine: vllm\nmodel: m\nextra_args: {}{}\n",
        "[".repeat(half),
        "]".repeat(half)
    );
    let mapping = format!(
        "name: a\nengine: vllm\nmodel: m\nenv:\n  {}1{}\n",
        "{a: ".repeat(half / 4),
        "}".repeat(half / 4)
    );
    let block: String = format!(
        "name: a\nengine: vllm\nmodel: m\nenv:\n{}",
        (0..300)
            .map(|i| format!("{}k{i}:\n", "  ".repeat(i + 1)))
            .collect::<String>()
    );
    let json = format!(
        "{{\"name\":\"a\",\"engine\":\"vllm\",\n\"model\":{}1{}}}",
        "[".repeat(half),
        "]".repeat(half)
    );
    assert!(flow.len() > 100_000 && json.len() > 100_000);
    let started = std::time::Instant::now();
    for (text, line) in [(&flow, 4), (&mapping, 5), (&block, 5 + limit - 1)] {
        let e = parse_deployment_str("d.yaml", text).unwrap_err();
        assert_eq!(e.to_string(), want("d.yaml", line));
        assert!(matches!(e.problem, Problem::TooDeep(l) if l == limit));
    }
    let e = documents::parse_deployment_json("body", &json).unwrap_err();
    assert_eq!(e.to_string(), want("body", 2));
    let e = parse_standalone_str(
        "s.yaml",
        &format!("host:\n  gpus: {}\n", "[".repeat(half)),
        &none(),
    )
    .unwrap_err();
    assert_eq!(e.to_string(), want("s.yaml", 2));
    let e =
        parse_host_str("h.yaml", &format!("gpus: {}\n", "[".repeat(half)), &none()).unwrap_err();
    assert_eq!(e.to_string(), want("h.yaml", 1));
    let e = parse_server_str(
        "v.yaml",
        &format!("listen: {}\n", "{a: ".repeat(half)),
        &none(),
    )
    .unwrap_err();
    assert_eq!(e.to_string(), want("v.yaml", 1));
    let e = capyctl_crds::parse_deployment_manifest_str(
        "m.yaml",
        &format!(
            "apiVersion: capyctl.io/v1alpha1\nkind: Deployment\nspec: {}\n",
            "[".repeat(half)
        ),
    )
    .unwrap_err();
    assert_eq!(e.to_string(), want("m.yaml", 3));
    // An override's value nested that deep is taken as the string it is (then refused as one).
    let set = format!(
        "resource_policy.queue.max_pending_total={}",
        "[".repeat(half)
    );
    let e = parse_host_str("h.yaml", "id: box\n", &overrides(&[set.as_str()], &[])).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("--set resource_policy.queue.max_pending_total=[[[[")
            && e.to_string().contains("wrong type: string"),
        "{e}"
    );
    println!(
        "8 nested texts of about 100 KB refused in {:?}",
        started.elapsed()
    );

    // Nesting up to the limit is read as usual (and refused for what it is).
    let at_limit = format!(
        "name: a\nengine: vllm\nmodel: m\nextra_args: {}{}\n",
        "[".repeat(limit - 1),
        "]".repeat(limit - 1)
    );
    let e = parse_deployment_str("d.yaml", &at_limit).unwrap_err();
    assert!(matches!(e.problem, Problem::WrongType(_)), "{e}");
}

/// The management API's JSON body gets every rule of a deployment document, as YAML does.
#[test]
fn json_documents_get_every_rule() {
    let e = documents::parse_deployment_json(
        "request body",
        r#"{"name":"a","engine":"sglang","model":"m","residency":"host_backed","extra_args":["--speculative-algorithm","EAGLE"]}"#,
    )
    .unwrap_err();
    assert!(
        e.to_string().starts_with(
            "request body: residency: host_backed is refused for SGLang with speculative decoding"
        ),
        "{e}"
    );
    let e = documents::parse_deployment_json(
        "request body",
        r#"{"name":"a","engine":"tensorfold","model":"m","max_concurrent_requests":4}"#,
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("request body: max_concurrent_requests: 4 cannot be passed"),
        "{e}"
    );
    let e = documents::parse_deployment_json("request body", r#"{"name":"a","engine":"vllm","model":"m","resources":{"gpu_memory":"1GiB","weights_mem":"1GiB"}}"#).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("request body: resources.weights_mem: unknown key"),
        "{e}"
    );
    let e = documents::parse_deployment_json("request body", "[1]").unwrap_err();
    assert_eq!(
        e.to_string(),
        "request body: the document is an array, not a JSON object"
    );
    let e = documents::parse_deployment_json("request body", r#"{"name":"#).unwrap_err();
    assert!(
        e.to_string().starts_with("request body: not valid JSON: "),
        "{e}"
    );
    let doc = documents::parse_deployment_json(
        "request body",
        r#"{"name":"a","engine":"vllm","model":"m"}"#,
    )
    .unwrap();
    assert_eq!(doc.engine, Some(EngineKind::Vllm));
}

// ---- replicas, scale, gpus_per_instance, routing (DESIGN 4.7) ----

fn deployment(extra: &str) -> Result<documents::DeploymentDoc, DocumentError> {
    parse_deployment_str(
        "d.yaml",
        &format!("name: m\nengine: vllm\nmodel: org/m\n{extra}"),
    )
}

#[test]
fn replicas_scale_gpus_and_routing_are_read_with_their_defaults() {
    let d = deployment("").unwrap();
    assert_eq!(d.replicas(), 1);
    assert_eq!(d.gpus_per_instance(), 1);
    assert_eq!(d.routing(), capyctl_spec::Routing::LeastLoaded);
    assert_eq!(d.scale(), None);

    let d = deployment(
        "replicas: 4\ngpus_per_instance: 2\nrouting: prefix\nscale: {min: 0, target_in_flight: 8, scale_down_delay: 90s}\n",
    )
    .unwrap();
    assert_eq!(d.replicas(), 4);
    assert_eq!(d.gpus_per_instance(), 2);
    assert_eq!(d.routing(), capyctl_spec::Routing::Prefix);
    let s = d.scale().unwrap();
    assert_eq!(
        (s.min, s.target_in_flight, s.scale_down_delay),
        (0, 8, Duration::from_secs(90))
    );
    let s = deployment("replicas: 3\nscale: {}\n")
        .unwrap()
        .scale()
        .unwrap();
    assert_eq!(
        (s.min, s.target_in_flight, s.scale_down_delay),
        (1, 24, Duration::from_secs(60))
    );
}

#[test]
fn replicas_scale_gpus_and_routing_refuse_bad_values_naming_the_key() {
    let err = |extra: &str| deployment(extra).unwrap_err().to_string();
    assert_eq!(
        err("replicas: 65\n"),
        "d.yaml:4: replicas: 65 is out of range (1 to 64)"
    );
    assert_eq!(
        err("replicas: 0\n"),
        "d.yaml:4: replicas: 0 is out of range (1 to 64)"
    );
    assert_eq!(
        err("scale: {target_in_flight: 33}\n"),
        "d.yaml:4: scale.target_in_flight: 33 is out of range (1 to 32)"
    );
    assert_eq!(
        err("scale: {scale_down_delay: 0s}\n"),
        "d.yaml:4: scale.scale_down_delay: 0s is out of range (1s to 24h)"
    );
    assert_eq!(
        err("scale: {max: 3}\n"),
        "d.yaml:4: scale.max: unknown key; expected one of min, target_in_flight, scale_down_delay"
    );
    assert_eq!(
        err("gpus_per_instance: 17\n"),
        "d.yaml:4: gpus_per_instance: 17 is out of range (1 to 16)"
    );
    assert!(
        err("routing: round_robin\n").starts_with("d.yaml:4: routing: "),
        "{}",
        err("routing: round_robin\n")
    );
    assert_eq!(
        err("replicas: 2\nscale: {min: 3}\n"),
        "d.yaml:5: scale.min: 3 is above replicas (2): the deployment scales between scale.min and replicas; raise replicas or lower scale.min"
    );
    assert_eq!(
        parse_deployment_str(
            "d.yaml",
            "name: m\nengine: tensorfold\nmodel: org/m\ngpus_per_instance: 2\n"
        )
        .unwrap_err()
        .to_string(),
        "d.yaml:4: gpus_per_instance: 2 cannot be passed to tensorfold: it has no tensor-parallel option, so an instance runs on one GPU; remove gpus_per_instance"
    );
    assert_eq!(
        err("extra_args: [\"--tensor-parallel-size\", \"2\"]\n"),
        "d.yaml:4: extra_args[0]: `--tensor-parallel-size`: CapyCTL sets --tensor-parallel-size itself (how many GPUs each instance spans, from `gpus_per_instance`); remove it from extra_args"
    );
}

// ---- priority (DESIGN 4.10) ----

#[test]
fn priority_is_any_i32_and_0_when_unset() {
    assert_eq!(deployment("").unwrap().priority(), 0);
    assert_eq!(deployment("").unwrap().priority, None);
    assert_eq!(deployment("priority: 100\n").unwrap().priority(), 100);
    assert_eq!(deployment("priority: -5\n").unwrap().priority(), -5);
    assert_eq!(
        deployment("priority: 2147483647\n").unwrap().priority(),
        i32::MAX
    );
    assert_eq!(
        deployment("priority: -2147483648\n").unwrap().priority(),
        i32::MIN
    );
    // Through the management API's JSON too.
    let doc = documents::deployment_from_json(serde_json::json!({
        "name": "a", "engine": "vllm", "model": "m", "priority": 7,
    }))
    .unwrap();
    assert_eq!(doc.priority(), 7);
}

#[test]
fn a_priority_outside_i32_is_refused_naming_the_key() {
    let err = |extra: &str| deployment(extra).unwrap_err().to_string();
    assert_eq!(
        err("priority: 2147483648\n"),
        "d.yaml:4: priority: 2147483648 is out of range (-2147483648 to 2147483647)"
    );
    assert_eq!(
        err("priority: -2147483649\n"),
        "d.yaml:4: priority: -2147483649 is out of range (-2147483648 to 2147483647)"
    );
    for bad in ["priority: high\n", "priority: 1.5\n"] {
        let e = err(bad);
        assert!(e.starts_with("d.yaml:4: priority: "), "{e}");
    }
    let (path, _) = documents::deployment_from_json(serde_json::json!({
        "name": "a", "engine": "vllm", "model": "m", "priority": 1u64 << 40,
    }))
    .unwrap_err();
    assert_eq!(path.display().as_deref(), Some("priority"));
}
