//! What the workspace's tests share (a dev-dependency only, never shipped):
//!
//! - [`engine_sim_binary`]: the `engine-sim` binary, built when missing or older than its
//!   sources;
//! - [`temp_dir`]: a fresh, empty, unique temporary directory;
//! - [`mock_api`]: one scripted mock Kubernetes API server on `tower_test::mock::pair` (a
//!   [`kube::Client`] without a socket), which also serves behind a loopback HTTP listener for
//!   the programs that need a real URL.
//!
//! Test helpers panic on what a test cannot go on from (a directory that cannot be made, a
//! build that fails), naming what failed.

pub mod mock_api;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

pub use mock_api::{Answer, Exchange, MockApi, Seen, status_body};

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

/// The `engine-sim` binary of this workspace, in the profile directory of the running test or
/// benchmark (`target/<profile>/deps/<test>` → `target/<profile>/engine-sim`). It is built
/// first (`cargo build -p capyctl-engine-sim --bin engine-sim`, in that profile and target
/// directory) when it is missing or older than the simulator's sources (`engine-sim/src` and
/// its `Cargo.toml`); under `cargo test --workspace` it is already built. Once per process.
pub fn engine_sim_binary() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let exe = std::env::current_exe()
            .unwrap_or_else(|e| panic!("cannot find the test executable: {e}"));
        // target/<profile>/deps/<test> → target/<profile>
        let profile_dir = exe
            .parent()
            .and_then(Path::parent)
            .unwrap_or_else(|| panic!("{} is not under target/<profile>/deps", exe.display()))
            .to_path_buf();
        let bin = profile_dir.join(format!("engine-sim{}", std::env::consts::EXE_SUFFIX));
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .unwrap_or_else(|| panic!("test-support has no parent directory"));
        let sources = workspace.join("engine-sim");
        let newest =
            newest_source(&sources.join("src")).max(newest_source(&sources.join("Cargo.toml")));
        let fresh = std::fs::metadata(&bin)
            .and_then(|m| m.modified())
            .is_ok_and(|t| t >= newest);
        if !fresh {
            build_engine_sim(workspace, &profile_dir);
        }
        assert!(
            bin.exists(),
            "no engine-sim at {} after building it",
            bin.display()
        );
        bin
    })
    .clone()
}

/// `cargo build -p capyctl-engine-sim --bin engine-sim` into `profile_dir`'s target directory
/// and profile (`debug` is the dev profile, any other directory names its profile).
fn build_engine_sim(workspace: &Path, profile_dir: &Path) {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev",
        Some(other) => other,
    };
    let mut command = std::process::Command::new(cargo);
    command
        .args(["build", "-p", "capyctl-engine-sim", "--bin", "engine-sim"])
        .args(["--profile", profile])
        .current_dir(workspace);
    if let Some(target_dir) = profile_dir.parent() {
        command.arg("--target-dir").arg(target_dir);
    }
    let status = command
        .status()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    assert!(status.success(), "building engine-sim failed: {command:?}");
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
}
