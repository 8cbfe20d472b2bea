//! Drives the real `capyctl` binary: settings precedence and one-line errors.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::Command;

/// The real `capyctl` of this workspace, built first when missing or stale.
fn capyctl() -> PathBuf {
    capyctl_test_support::workspace_binary("capyctl", "capyctl")
}

fn fixture(name: &str) -> String {
    format!(
        "{}/../spec/tests/fixtures/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[test]
fn set_beats_variable_beats_document() {
    let out = Command::new(capyctl())
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
    let out = Command::new(capyctl())
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

#[test]
fn a_command_line_that_does_not_parse_is_one_line_and_exit_2() {
    for (args, says) in [
        (
            &["start", "deployment"][..],
            "capyctl: the following required arguments were not provided: <NAME>; see `capyctl --help`",
        ),
        (
            &["lst", "deployments"][..],
            "capyctl: unrecognized subcommand 'lst'; see `capyctl --help`",
        ),
        (
            &["park", "deployment", "a", "--bogus"][..],
            "capyctl: unexpected argument '--bogus' found; see `capyctl --help`",
        ),
    ] {
        let out = Command::new(capyctl()).args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert_eq!(err, format!("{says}\n"), "{args:?}");
    }
    let help = Command::new(capyctl()).arg("--help").output().unwrap();
    assert!(help.status.success());
    assert!(
        String::from_utf8(help.stdout)
            .unwrap()
            .contains("Usage: capyctl")
    );
}

/// Every example document in `examples/` is valid as the README uses it (a trace, `.jsonl`,
/// simulates on the standalone example).
#[test]
fn every_example_document_checks() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples");
    let mut checked = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name.ends_with(".jsonl") {
            // A request trace: the README simulates it on the standalone example.
            let out = Command::new(capyctl())
                .args(["simulate", "--set", "simulate.token_rate=20", "--trace"])
                .arg(&path)
                .arg("--file")
                .arg(path.with_file_name("standalone.yaml"))
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{name}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            checked += 1;
            continue;
        }
        let kind = if name.starts_with("standalone") {
            "standalone"
        } else {
            "deployment"
        };
        let out = Command::new(capyctl())
            .args(["check", kind, "--file"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        checked += 1;
    }
    assert!(checked >= 5, "only {checked} examples");
}
