//! `server.inference_auth.tenants` of a standalone document: resolved with its key files read,
//! and each refusal naming file, line and key (never the key itself).
#![allow(clippy::unwrap_used, missing_docs)]

use capyctl_spec::documents::parse_standalone_str;
use capyctl_spec::overrides::Overrides;
use capyctl_spec::settings::TenantSettings;

fn tenants(text: &str) -> Result<Option<Vec<TenantSettings>>, String> {
    parse_standalone_str("standalone.yaml", text, &Overrides::none())
        .map(|c| c.server.inference_auth)
        .map_err(|e| e.to_string())
}

#[test]
fn absent_is_off() {
    assert_eq!(tenants("host: {id: h}\n").unwrap(), None);
    assert_eq!(tenants("server: {}\n").unwrap(), None);
}

#[test]
fn tenants_resolve_with_their_key_files() {
    let dir = tempdir();
    let file = dir.join("b.key");
    std::fs::write(&file, "  sk-from-file\n").unwrap();
    let text = format!(
        "server:
  inference_auth:
    tenants:
      - name: team-a
        keys: [\"sk-a-1\", \"sk-a-2\"]
        models: [\"chat-*\", \"support-bot\"]
        rate: {{requests_per_minute: 600, tokens_per_minute: 200000}}
      - name: team-b
        key_files: [{}]
",
        file.display()
    );
    let t = tenants(&text).unwrap().unwrap();
    assert_eq!(t.len(), 2);
    assert_eq!(t[0].name, "team-a");
    assert_eq!(t[0].keys.len(), 2);
    assert_eq!(t[0].requests_per_minute, Some(600));
    assert_eq!(t[0].tokens_per_minute, Some(200_000));
    assert_eq!(t[1].keys[0].0, "sk-from-file");
    assert_eq!(t[1].models, None);
    // Never shown by a debug print.
    let debug = format!("{t:?}");
    assert!(!debug.contains("sk-"), "{debug}");
}

#[test]
fn each_refusal_names_file_line_and_key() {
    let head = "server:\n  inference_auth:\n    tenants:\n";
    let cases = [
        (
            "      - name: a\n        keys: [\"\"]\n",
            "standalone.yaml:5: server.inference_auth.tenants[0].keys[0]: the key is empty",
        ),
        (
            "      - name: a\n        keys: []\n",
            "standalone.yaml:5: server.inference_auth.tenants[0].keys: tenant a has no key",
        ),
        (
            "      - name: a\n        keys: [\"sk-1\"]\n      - name: b\n        keys: [\"sk-1\"]\n",
            "standalone.yaml:7: server.inference_auth.tenants[1].keys[0]: this key is already a key of tenant a",
        ),
        (
            "      - name: a\n        keys: [\"sk-1\"]\n        models: []\n",
            "standalone.yaml:6: server.inference_auth.tenants[0].models: tenant a names no models",
        ),
        (
            "      - name: a\n        keys: [\"sk-1\"]\n        rate: {requests_per_minute: 0}\n",
            "standalone.yaml:6: server.inference_auth.tenants[0].rate.requests_per_minute: 0 is out of range (1 to 1000000)",
        ),
        (
            "      - name: a\n        keys: [\"sk-1\"]\n        rate:\n          tokens_per_minute: 99999999999999\n",
            "standalone.yaml:7: server.inference_auth.tenants[0].rate.tokens_per_minute: 99999999999999 is out of range",
        ),
        (
            "      - name: a\n        key_files: [/nonexistent/capyctl.key]\n",
            "standalone.yaml:5: server.inference_auth.tenants[0].key_files[0]: cannot read the key file /nonexistent/capyctl.key",
        ),
        (
            "      - name: a\n        keys: [\"sk-1\"]\n        rate: {per_hour: 3}\n",
            "standalone.yaml:6: server.inference_auth.tenants[0].rate.per_hour: unknown key",
        ),
    ];
    for (body, expected) in cases {
        let got = tenants(&format!("{head}{body}")).unwrap_err();
        assert!(got.starts_with(expected), "{got}\nexpected {expected}");
        assert!(!got.contains("sk-1"), "a key is shown: {got}");
    }
    let got = tenants("server:\n  inference_auth:\n    tenants: []\n").unwrap_err();
    assert!(
        got.starts_with("standalone.yaml:3: server.inference_auth.tenants: no tenants"),
        "{got}"
    );
}

#[test]
fn a_server_document_refuses_inference_auth() {
    let e = capyctl_spec::documents::parse_server_str(
        "server.yaml",
        "inference_auth:\n  tenants: []\n",
        &Overrides::none(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with("server.yaml:1: inference_auth: on Kubernetes the inference listener's tenants are `Tenant` objects"),
        "{e}"
    );
}

fn tempdir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("capyctl-spec-tenants-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
