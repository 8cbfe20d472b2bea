//! What the workspace's tests share (a dev-dependency only, never shipped):
//!
//! - [`workspace_binary`]: any binary of the workspace (the end-to-end tests' `capyctl`,
//!   `kubectl-capyctl`, `capyctl-node-agent`, …), built when missing or older than its sources;
//!   [`engine_sim_binary`] is the `engine-sim` one;
//! - [`temp_dir`]: a fresh, empty, unique temporary directory;
//! - [`free_port`]: a loopback port for a listener a child process binds, outside the range
//!   the kernel hands out for `bind(0)` and outgoing connections;
//! - [`mock_api`]: one scripted mock Kubernetes API server on `tower_test::mock::pair` (a
//!   [`kube::Client`] without a socket), which also serves behind a loopback HTTP listener for
//!   the programs that need a real URL;
//! - [`SimHost`] (re-exported from the node agent, where `capyctl simulate` takes it too): the
//!   in-process host agent of the lifecycle's tests and the scale benchmark: engines that start,
//!   park, wake and stop in set times, a latency per inventory/engines call, the calls logged,
//!   operations that hang and stops that fail; [`FakeHost`] is its former name, still used
//!   by two unit tests in lifecycle/src (`state/tests/`, `hosts.rs`): rename them and drop it;
//! - [`cut_proxy`]: a TCP proxy a test cuts (refused, or black-holed) and restores, between a
//!   program and a server it calls (the operators and the Kubernetes API server);
//! - [`http`]: a small HTTP client for the listeners (JSON in and out, the management API's
//!   token);
//! - `harness` (feature `lifecycle`): a lifecycle server with the real coordinator and the
//!   real listener on a loopback port, over in-process host agents running the engine
//!   simulator;
//! - `cluster` (feature `cluster`): the `needs cluster` tests' cluster (`CAPYCTL_TEST_KUBECONFIG`,
//!   failing clearly without it), a namespace of their own, the chart's CRDs;
//! - `operator_e2e`, `fake_api_server` and `crs_api` (feature `operator`): the operator and node
//!   agent programs as child processes, a fake Kubernetes API server they talk to over HTTP, and
//!   a small stateful one holding `Deployment` CRs behind [`MockApi`].
//!
//! The features keep what a crate's tests do not use out of their build (the node agent's
//! tests need no lifecycle, the lifecycle's no operator).
//!
//! Test helpers panic on what a test cannot go on from (a directory that cannot be made, a
//! build that fails), naming what failed.

#[cfg(feature = "cluster")]
pub mod cluster;
#[cfg(feature = "operator")]
pub mod crs_api;
pub mod cut_proxy;
#[cfg(feature = "operator")]
pub mod fake_api_server;
#[cfg(feature = "lifecycle")]
pub mod harness;
pub mod http;
pub mod mock_api;
#[cfg(feature = "operator")]
pub mod operator_e2e;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

/// [`SimHost`]'s former name (two unit tests in lifecycle/src still use it).
pub use capyctl_node_agent::sim_host::SimHost as FakeHost;
pub use capyctl_node_agent::sim_host::{Concurrency, SimHost, Timings};
pub use cut_proxy::{Cut, CutProxy};
pub use mock_api::{Answer, Exchange, MockApi, Seen, status_body};

/// One switch record of cause `adapter`, as `GET /management/v1/switches` (its `switches`) and
/// `capyctl switches --json` (a record a line) write it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterSwitch {
    /// The adapter's deployment.
    pub deployment: String,
    /// Its phases' names, in order (`adapter_load`, `adapter_unload`).
    pub phases: Vec<String>,
    /// `ok`, `failed`, ...
    pub outcome: String,
}

/// The records of cause `adapter` among switch `records`, in their order (a record without
/// its deployment or phases panics: the tests read them).
pub fn adapter_switches<'a>(
    records: impl IntoIterator<Item = &'a serde_json::Value>,
) -> Vec<AdapterSwitch> {
    records
        .into_iter()
        .filter(|r| r["cause"] == "adapter")
        .map(|r| AdapterSwitch {
            deployment: r["deployment"].as_str().expect("a deployment").to_string(),
            phases: r["phases"]
                .as_array()
                .expect("phases")
                .iter()
                .map(|p| p["phase"].as_str().expect("a phase's name").to_string())
                .collect(),
            outcome: r["outcome"].as_str().unwrap_or("").to_string(),
        })
        .collect()
}

/// A fresh, empty temporary directory, unique to this call: `capyctl-<name>-<pid>-<nanos>-<n>`
/// under the system's temporary directory. The test removes it when it wants to.
pub fn temp_dir(name: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let root = std::env::temp_dir();
    loop {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir = root.join(format!("capyctl-{name}-{}-{nanos}-{n}", std::process::id()));
        match std::fs::create_dir(&dir) {
            Ok(()) => return dir,
            // Another process's directory of the same name: take the next number.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => panic!(
                "cannot create the temporary directory {}: {e}",
                dir.display()
            ),
        }
    }
}

/// A loopback port nobody listens on, for a listener that a child process binds a moment
/// later (a test must know the address before the child says it).
///
/// A port from `bind("127.0.0.1:0")` is taken from the kernel's ephemeral range, the range
/// every outgoing connection and every other `bind(0)` also draws from: between this call and
/// the child's bind, a connection of a test running beside it (or of its children) may take it,
/// and the child fails with "Address already in use" (a CI run failed so). So the port comes
/// from below that range (`/proc/sys/net/ipv4/ip_local_port_range`), where nothing is handed
/// out: each call of this process takes the next one after a start drawn from its pid and the
/// clock, and skips ports something listens on. Where that range cannot be read or leaves no
/// room, it falls back to `bind(0)`.
pub fn free_port() -> u16 {
    /// The lowest port taken (above the well-known and most registered services').
    const FLOOR: u16 = 20_000;
    static NEXT: OnceLock<std::sync::atomic::AtomicU32> = OnceLock::new();
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok());
    let Some(ceiling) = ephemeral_low.filter(|low| *low > FLOOR + 1_000) else {
        return std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap_or_else(|e| panic!("cannot find a free loopback port: {e}"))
            .port();
    };
    let next = NEXT.get_or_init(|| {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        std::sync::atomic::AtomicU32::new(std::process::id().wrapping_mul(7_919) ^ nanos)
    });
    next_free_port(next, FLOOR, ceiling)
        .unwrap_or_else(|| panic!("no free loopback port in {FLOOR}..{ceiling}"))
}

/// The first port of `floor..ceiling` from `next` on (taken modulo the span) that a listener
/// can bind on the loopback address; `next` moves past it.
fn next_free_port(next: &std::sync::atomic::AtomicU32, floor: u16, ceiling: u16) -> Option<u16> {
    let span = u32::from(ceiling.saturating_sub(floor));
    (0..span).find_map(|_| {
        let port = floor + (next.fetch_add(1, Ordering::Relaxed) % span) as u16;
        std::net::TcpListener::bind(("127.0.0.1", port))
            .is_ok()
            .then_some(port)
    })
}

/// The newest modification time of the files under `path` (a file or a directory, walked
/// recursively); the epoch when there is none.
pub fn newest_source(path: &Path) -> SystemTime {
    let Ok(meta) = std::fs::metadata(path) else {
        return UNIX_EPOCH;
    };
    if !meta.is_dir() {
        return meta.modified().unwrap_or(UNIX_EPOCH);
    }
    std::fs::read_dir(path)
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| newest_source(&entry.path()))
        .max()
        .unwrap_or(UNIX_EPOCH)
}

/// The parent of process `pid` while it lives (from `/proc/<pid>/stat`); `None` once it is
/// gone or a zombie.
pub fn live_parent(pid: u64) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid ...`: the fields after the last ')' (a name may hold one).
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?;
    let ppid = fields.next()?.parse().ok()?;
    (state != "Z").then_some(ppid)
}

/// Whether process `pid` is alive (and not a zombie).
pub fn alive(pid: u64) -> bool {
    live_parent(pid).is_some()
}

/// The `engine-sim` binary of this workspace: [`workspace_binary`] of package
/// `capyctl-engine-sim`, binary `engine-sim`.
pub fn engine_sim_binary() -> PathBuf {
    workspace_binary("capyctl-engine-sim", "engine-sim")
}

/// Binary `bin` of workspace package `package` (`capyctl`/`kubectl-capyctl`,
/// `capyctl-node-agent`, `capyctl-operator`, `capyctl-engine-sim`/`engine-sim`, …), in the
/// profile directory of the running test or benchmark (`target/<profile>/deps/<test>` →
/// `target/<profile>/<bin>`). `CARGO_BIN_EXE_<bin>` names only the test's own package's
/// binaries; this finds any.
///
/// It is built first (`cargo build -p <package> --bin <bin>`, in that profile and target
/// directory) when it is missing or older than the sources it is built from: the `src/`,
/// `build.rs` and `Cargo.toml` of its package and of every workspace package it depends on,
/// directly or not (`cargo metadata` says which). Under `cargo test --workspace` it is
/// already built. Once per binary and process.
pub fn workspace_binary(package: &str, bin: &str) -> PathBuf {
    static BINS: Mutex<BTreeMap<(String, String), PathBuf>> = Mutex::new(BTreeMap::new());
    // Held while building, so that two tests of one process never build the same binary twice.
    let mut bins = BINS.lock().unwrap_or_else(PoisonError::into_inner);
    let key = (package.to_string(), bin.to_string());
    if let Some(path) = bins.get(&key) {
        return path.clone();
    }
    let profile_dir = profile_dir();
    let path = profile_dir.join(format!("{bin}{}", std::env::consts::EXE_SUFFIX));
    let newest = workspace_packages().newest_source(package);
    let fresh = std::fs::metadata(&path)
        .and_then(|m| m.modified())
        .is_ok_and(|t| t >= newest);
    if !fresh {
        build(package, bin, &profile_dir);
    }
    assert!(
        path.exists(),
        "no {bin} of package {package} at {} after building it",
        path.display()
    );
    bins.insert(key, path.clone());
    path
}

/// The workspace's root directory (the parent of `test-support/`).
fn workspace_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap_or_else(|| panic!("test-support has no parent directory"))
}

/// The profile directory of the running test: `target/<profile>/deps/<test>` →
/// `target/<profile>`.
fn profile_dir() -> PathBuf {
    let exe =
        std::env::current_exe().unwrap_or_else(|e| panic!("cannot find the test executable: {e}"));
    exe.parent()
        .and_then(Path::parent)
        .unwrap_or_else(|| panic!("{} is not under target/<profile>/deps", exe.display()))
        .to_path_buf()
}

/// The workspace's packages, from `cargo metadata --no-deps`: each one's directory and the
/// workspace packages it depends on (normal and build dependencies; dev-dependencies are not
/// in its binaries).
struct Packages {
    /// By package name: (its directory, the names of its workspace dependencies).
    by_name: BTreeMap<String, (PathBuf, Vec<String>)>,
}

/// [`Packages`], read once per process.
fn workspace_packages() -> &'static Packages {
    static PACKAGES: OnceLock<Packages> = OnceLock::new();
    PACKAGES.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut command = std::process::Command::new(cargo);
        command
            .args(["metadata", "--no-deps", "--format-version", "1"])
            .current_dir(workspace_root());
        let out = command
            .output()
            .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
        assert!(
            out.status.success(),
            "{command:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let metadata: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{command:?} printed no JSON: {e}"));
        Packages::from_metadata(&metadata)
    })
}

impl Packages {
    /// The packages of `cargo metadata --no-deps --format-version 1`'s output.
    fn from_metadata(metadata: &serde_json::Value) -> Packages {
        let mut by_name = BTreeMap::new();
        for package in metadata["packages"].as_array().into_iter().flatten() {
            let (Some(name), Some(manifest)) =
                (package["name"].as_str(), package["manifest_path"].as_str())
            else {
                continue;
            };
            let dir = Path::new(manifest)
                .parent()
                .unwrap_or_else(|| panic!("{manifest} has no parent directory"))
                .to_path_buf();
            let dependencies = package["dependencies"]
                .as_array()
                .into_iter()
                .flatten()
                // A path dependency is a workspace package; a dev-dependency is not in a binary.
                .filter(|d| d["path"].is_string() && d["kind"].as_str() != Some("dev"))
                .filter_map(|d| d["name"].as_str().map(str::to_string))
                .collect();
            by_name.insert(name.to_string(), (dir, dependencies));
        }
        Packages { by_name }
    }

    /// The newest modification time of the sources `package`'s binaries are built from: the
    /// `src/`, `build.rs` and `Cargo.toml` of the package and of its workspace dependencies,
    /// transitively.
    fn newest_source(&self, package: &str) -> SystemTime {
        assert!(
            self.by_name.contains_key(package),
            "{package} is not a package of this workspace (known: {:?})",
            self.by_name.keys().collect::<Vec<_>>()
        );
        let mut seen = BTreeSet::new();
        let mut todo = vec![package.to_string()];
        let mut newest = UNIX_EPOCH;
        while let Some(name) = todo.pop() {
            let Some((dir, dependencies)) = self.by_name.get(&name) else {
                continue;
            };
            if !seen.insert(name) {
                continue;
            }
            for part in ["src", "build.rs", "Cargo.toml"] {
                newest = newest.max(newest_source(&dir.join(part)));
            }
            todo.extend(dependencies.iter().cloned());
        }
        newest
    }
}

/// `cargo build -p <package> --bin <bin>` into `profile_dir`'s target directory and profile
/// (`debug` is the dev profile, any other directory names its profile).
fn build(package: &str, bin: &str, profile_dir: &Path) {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev",
        Some(other) => other,
    };
    let mut command = std::process::Command::new(cargo);
    command
        .args(["build", "-p", package, "--bin", bin])
        .args(["--profile", profile])
        .current_dir(workspace_root());
    if let Some(target_dir) = profile_dir.parent() {
        command.arg("--target-dir").arg(target_dir);
    }
    let status = command
        .status()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    assert!(
        status.success(),
        "building {bin} of package {package} failed: {command:?}"
    );
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn temp_dirs_are_fresh_empty_and_distinct() {
        let a = temp_dir("same");
        let b = temp_dir("same");
        assert_ne!(a, b);
        for d in [&a, &b] {
            assert!(d.is_dir());
            assert_eq!(std::fs::read_dir(d).unwrap().count(), 0);
            assert!(d.starts_with(std::env::temp_dir()));
            std::fs::remove_dir_all(d).unwrap();
        }
    }

    #[test]
    fn free_ports_are_distinct_bindable_and_outside_the_ephemeral_range() {
        let ports: Vec<u16> = (0..200).map(|_| free_port()).collect();
        let distinct: BTreeSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len(), "{ports:?}");
        let low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        for port in ports {
            assert!(
                (20_000..low).contains(&port),
                "{port} (ephemeral from {low})"
            );
            drop(std::net::TcpListener::bind(("127.0.0.1", port)).unwrap());
        }
    }

    #[test]
    fn a_port_something_listens_on_is_skipped() {
        let held = std::net::TcpListener::bind(("127.0.0.1", free_port())).unwrap();
        let port = held.local_addr().unwrap().port();
        // The span is the held port and the one after it; the walk starts at the held one.
        let next = std::sync::atomic::AtomicU32::new(0);
        let got = next_free_port(&next, port, port + 2);
        if std::net::TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
            assert_eq!(got, Some(port + 1));
        }
        // With both held, there is none.
        let _also = std::net::TcpListener::bind(("127.0.0.1", port + 1));
        assert_eq!(next_free_port(&next, port, port + 2), None);
    }

    #[test]
    fn the_newest_source_is_found_in_subdirectories() {
        let dir = temp_dir("newest");
        std::fs::create_dir(dir.join("sub")).unwrap();
        std::fs::write(dir.join("old"), "x").unwrap();
        let old = SystemTime::now() - std::time::Duration::from_secs(3600);
        std::fs::File::options()
            .write(true)
            .open(dir.join("old"))
            .unwrap()
            .set_modified(old)
            .unwrap();
        std::fs::write(dir.join("sub/new"), "y").unwrap();
        let new = std::fs::metadata(dir.join("sub/new"))
            .unwrap()
            .modified()
            .unwrap();
        assert_eq!(newest_source(&dir), new);
        assert_eq!(newest_source(&dir.join("old")), old);
        assert_eq!(newest_source(&dir.join("missing")), UNIX_EPOCH);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn the_engine_sim_binary_is_built_and_runs() {
        let bin = engine_sim_binary();
        assert!(bin.ends_with(format!("engine-sim{}", std::env::consts::EXE_SUFFIX)));
        let out = std::process::Command::new(&bin)
            .arg("--help")
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
    }

    /// Sets `path`'s modification time `secs_ago` seconds in the past.
    fn age(path: &Path, secs_ago: u64) -> SystemTime {
        let t = SystemTime::now() - std::time::Duration::from_secs(secs_ago);
        std::fs::File::options()
            .write(true)
            .open(path)
            .unwrap()
            .set_modified(t)
            .unwrap();
        t
    }

    #[test]
    fn a_binary_is_as_new_as_the_newest_source_of_its_workspace_dependencies() {
        let root = temp_dir("packages");
        for (name, secs_ago) in [("app", 300), ("core", 200), ("other", 10), ("devonly", 5)] {
            std::fs::create_dir_all(root.join(name).join("src")).unwrap();
            std::fs::write(root.join(name).join("Cargo.toml"), "").unwrap();
            std::fs::write(root.join(name).join("src/lib.rs"), "").unwrap();
            age(&root.join(name).join("Cargo.toml"), 1000);
            age(&root.join(name).join("src/lib.rs"), secs_ago);
        }
        // Not a source of any binary: a test's change does not make the binary stale.
        std::fs::create_dir_all(root.join("app/tests")).unwrap();
        std::fs::write(root.join("app/tests/t.rs"), "").unwrap();
        let manifest = |name: &str| root.join(name).join("Cargo.toml").display().to_string();
        let metadata = serde_json::json!({"packages": [
            {"name": "app", "manifest_path": manifest("app"), "dependencies": [
                {"name": "core", "path": root.join("core").display().to_string(), "kind": null},
                {"name": "devonly", "path": root.join("devonly").display().to_string(), "kind": "dev"},
                {"name": "serde", "kind": null},
            ]},
            {"name": "core", "manifest_path": manifest("core"), "dependencies": [
                {"name": "app", "path": root.join("app").display().to_string(), "kind": "build"},
            ]},
            {"name": "other", "manifest_path": manifest("other"), "dependencies": []},
            {"name": "devonly", "manifest_path": manifest("devonly"), "dependencies": []},
        ]});
        let packages = Packages::from_metadata(&metadata);
        let core = std::fs::metadata(root.join("core/src/lib.rs"))
            .unwrap()
            .modified()
            .unwrap();
        // app's own source is older; core's (a dependency) is the newest; other and devonly
        // (newer still) are not app's; the cycle back to app ends.
        assert_eq!(packages.newest_source("app"), core);
        assert_eq!(packages.newest_source("core"), core);
        let build_rs = root.join("other/build.rs");
        std::fs::write(&build_rs, "").unwrap();
        let now = std::fs::metadata(&build_rs).unwrap().modified().unwrap();
        assert_eq!(packages.newest_source("other"), now);
        let unknown = std::panic::catch_unwind(|| packages.newest_source("nope")).unwrap_err();
        let message = unknown.downcast_ref::<String>().unwrap();
        assert!(
            message.contains("nope is not a package of this workspace"),
            "{message}"
        );
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn this_workspace_s_packages_are_found() {
        let packages = workspace_packages();
        for name in ["capyctl", "capyctl-engine-sim", "capyctl-node-agent"] {
            let (dir, _) = &packages.by_name[name];
            assert!(
                dir.join("Cargo.toml").is_file(),
                "{name}: {}",
                dir.display()
            );
        }
        // The CLI is built from the node agent's sources, among others.
        assert!(packages.newest_source("capyctl") >= packages.newest_source("capyctl-node-agent"));
    }
}
