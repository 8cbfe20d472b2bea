//! The lifecycle stays Kubernetes-free and socket-free: kube is not in its dependency tree, and
//! its sources open no socket (listeners and clients live in `capyctl-server` and the router).
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;

#[test]
fn kube_is_not_in_the_lifecycles_dependency_tree() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "-p",
            "capyctl-lifecycle",
            "-e",
            "normal",
            "--prefix",
            "none",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8(out.stdout).unwrap();
    // The tree is real: it names the lifecycle's own dependencies.
    assert!(tree.contains("capyctl-node-agent"), "{tree}");
    assert!(tree.contains("capyctl-router"), "{tree}");
    let kube: Vec<&str> = tree
        .lines()
        .filter(|l| l.starts_with("kube") || l.starts_with("k8s-openapi"))
        .collect();
    assert!(kube.is_empty(), "kube in the lifecycle's tree: {kube:?}");
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
