//! The lifecycle stays Kubernetes-free and socket-free: kube, the node agent and its program's
//! HTTP server and command line, the router and its HTTP and TLS are not in its dependency tree (a failure names the dependency
//! that brings one), and its sources open no socket (listeners and clients live in
//! `capyctl-server` and the router).
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;

/// What the lifecycle must not depend on (normal dependencies, directly or not): Kubernetes,
/// the node agent's program (its HTTP server, command line), HTTP and TLS (the router's
/// listener and the agents' clients), and the node agent and the router themselves (the
/// lifecycle knows host agents and the router through `capyctl-interfaces` only; the assembly,
/// `capyctl_server::assembly`, builds the router and hands it over).
const FORBIDDEN: &[&str] = &[
    "kube",
    "k8s-openapi",
    "axum",
    "clap",
    "hyper",
    "rustls",
    "capyctl-node-agent",
    "capyctl-router",
];

/// `cargo tree --offline -p capyctl-lifecycle -e normal` with `args`: its lines.
fn cargo_tree(args: &[&str]) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "-p",
            "capyctl-lifecycle",
            "-e",
            "normal",
        ])
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cargo tree {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

/// The lifecycle's direct dependencies through which `krate` comes, from the inverted tree
/// (`-i krate --prefix depth`: a line is `<depth><name> <version>`, each followed by what
/// depends on it one level deeper): each line of the lifecycle names, as what it depends on,
/// the nearest line above it one level up.
fn brought_by(krate: &str) -> Vec<String> {
    let lines = cargo_tree(&["-i", krate, "--prefix", "depth"]);
    let parsed: Vec<(usize, String)> = lines
        .iter()
        .filter_map(|l| {
            let digits = l.find(|c: char| !c.is_ascii_digit())?;
            let depth = l[..digits].parse().ok()?;
            let name = l[digits..].split_whitespace().next()?.to_string();
            Some((depth, name))
        })
        .collect();
    let mut direct: Vec<String> = parsed
        .iter()
        .enumerate()
        .filter(|(_, (depth, name))| name == "capyctl-lifecycle" && *depth > 0)
        .filter_map(|(i, (depth, _))| {
            let above = parsed[..i].iter().rev().find(|(d, _)| d + 1 == *depth)?;
            Some(above.1.clone())
        })
        .collect();
    direct.sort();
    direct.dedup();
    direct
}

#[test]
fn the_lifecycles_dependency_tree_has_no_kubernetes_http_tls_node_agent_or_router() {
    let tree: Vec<String> = cargo_tree(&["--prefix", "none"]);
    let names: Vec<&str> = tree
        .iter()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    // The tree is real: it names the lifecycle's own dependencies.
    assert!(names.contains(&"capyctl-interfaces"), "{tree:?}");
    assert!(names.contains(&"redb"), "{tree:?}");
    let found: Vec<String> = FORBIDDEN
        .iter()
        .filter(|f| names.contains(f))
        .map(|f| format!("{f} (through {})", brought_by(f).join(", ")))
        .collect();
    assert!(
        found.is_empty(),
        "in the lifecycle's dependency tree: {}",
        found.join("; ")
    );
}

#[test]
fn a_crate_in_the_tree_is_named_with_what_brings_it() {
    // The check's own means, on crates that are there: serde_yaml_ng comes through
    // capyctl-spec, a direct dependency that the engine rules and the interfaces bring too ...
    assert_eq!(
        brought_by("serde_yaml_ng"),
        ["capyctl-engine-rules", "capyctl-interfaces", "capyctl-spec"]
    );
    // ... and a direct dependency is named itself (the interfaces also through the engine
    // rules, which depend on them).
    assert_eq!(
        brought_by("capyctl-interfaces"),
        ["capyctl-engine-rules", "capyctl-interfaces"]
    );
    assert_eq!(brought_by("capyctl-engine-rules"), ["capyctl-engine-rules"]);
}

#[test]
fn the_lifecycles_sources_open_no_socket() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut seen = 0;
    // Every file under src/, its module folders (`state/`) included.
    let mut dirs = vec![src.clone()];
    let mut files = Vec::new();
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                files.push(path);
            }
        }
    }
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        seen += 1;
        for word in [
            "TcpListener",
            "TcpStream",
            "UdpSocket",
            "UnixStream",
            "tokio::net",
        ] {
            assert!(
                !text.contains(word),
                "{} uses {word}: sockets belong to the server and the router",
                path.display()
            );
        }
    }
    assert!(
        seen >= 5,
        "only {seen} source files under {}",
        src.display()
    );
}
