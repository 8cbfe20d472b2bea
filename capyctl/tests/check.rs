//! Drives the real `capyctl` binary: settings precedence and one-line errors.
#![allow(clippy::unwrap_used)]

use std::process::Command;

fn fixture(name: &str) -> String {
    format!(
        "{}/../crds/tests/fixtures/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[test]
fn set_beats_variable_beats_document() {
    let out = Command::new(env!("CARGO_BIN_EXE_capyctl"))
        .args(["check", "standalone", "--file", &fixture("standalone.yaml")])
        .args([
            "--set",
            "host.resource_policy.queue.max_pending_per_deployment=3",
        ])
        .env(
            "CAPYCTL_SET__HOST__RESOURCE_POLICY__QUEUE__MAX_PENDING_PER_DEPLOYMENT",
            "7",
        )
        .env(
            "CAPYCTL_SET__HOST__RESOURCE_POLICY__QUEUE__MAX_PENDING_TOTAL",
            "9",
        )
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("max_pending_per_deployment: 3,"), "{text}");
    assert!(text.contains("max_pending_total: 9,"), "{text}");
}

#[test]
fn out_of_range_is_one_line_naming_file_line_and_key() {
    let out = Command::new(env!("CARGO_BIN_EXE_capyctl"))
        .args([
            "check",
            "standalone",
            "--file",
            &fixture("standalone-out-of-range.yaml"),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("standalone-out-of-range.yaml:7: host.resource_policy.queue.admission_window: 45s is out of range (1ms to 30s)"),
        "{err}"
    );
}
