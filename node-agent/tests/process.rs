//! The process runtime's hold on engine processes, with tiny shell "engines" that leave a
//! worker in their process group: the group is stopped even after its leader exited (stop,
//! forget, recovery of a dead engine), an engine left alive but not answering is stopped on
//! recovery, and a pid (and group) that another program took over is left alone.
#![allow(clippy::unwrap_used)]

mod common;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use capyctl_node_agent::launch::LaunchCommand;
use capyctl_node_agent::process::{
    EngineGroup, INSTANCE_ENV, PidRecord, ProcessRuntime, alive, start_ticks,
};
use capyctl_node_agent::spec::InstanceSpec;
use capyctl_node_agent::tier::LaunchParking;
use capyctl_spec::EngineKind;

const GRACE: Duration = Duration::from_secs(2);

fn record(
    instance: &str,
    pid: u32,
    ticks: Option<u64>,
    log: PathBuf,
    command: Vec<String>,
) -> PidRecord {
    PidRecord {
        instance: instance.to_string(),
        engine: EngineKind::Vllm,
        pid,
        port: 1,
        started_at_ms: ProcessRuntime::now_ms(),
        start_ticks: ticks,
        command,
        log,
        spec: InstanceSpec::new("01KPROC", "chat-a", EngineKind::Vllm, "m"),
        parking: LaunchParking::default(),
        first_answer: None,
        parked: None,
        transition: None,
        gpu_held: None,
        measurement: None,
    }
}

/// Starts a shell "engine" that starts `sleep 600` in its group, writes the worker's pid to
/// `<dir>/<instance>.worker` and waits for it. Returns (record, worker pid).
async fn engine_with_worker(rt: &ProcessRuntime, dir: &Path, instance: &str) -> (PidRecord, u32) {
    let pid_file = dir.join(format!("{instance}.worker"));
    let script = format!("sleep 600 & echo $! > '{}'; wait", pid_file.display());
    let command = LaunchCommand {
        program: "sh".into(),
        args: vec!["-c".into(), script],
        env: Default::default(),
    };
    let argv = command.argv();
    let (rec, _exit) = rt
        .spawn(instance, EngineKind::Vllm, &command, |pid, ticks, log| {
            record(instance, pid, ticks, log, argv)
        })
        .unwrap();
    (rec, pid_in(&pid_file).await)
}

/// The pid written to `file`, once it is there (bounded: 10 s).
async fn pid_in(file: &Path) -> u32 {
    for _ in 0..500 {
        if let Some(pid) = std::fs::read_to_string(file)
            .ok()
            .and_then(|t| t.trim().parse().ok())
        {
            return pid;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("no pid in {}", file.display());
}

/// The environment of `pid`, once it can be read (bounded: 10 s). A worker whose pid was just
/// written may still be in its `exec` of `sleep`, and the kernel reads its environment as empty
/// until the exec is done.
async fn environ_of(pid: u32) -> Vec<u8> {
    for _ in 0..500 {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
        if !environ.is_empty() {
            return environ;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("no environment for {pid}");
}

/// Whether `pid` is gone within `bound` (polled).
async fn gone_within(pid: u32, bound: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + bound;
    while alive(pid) {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

fn kill9(target: &str) {
    let status = std::process::Command::new("kill")
        .args(["-9", "--", target])
        .status()
        .unwrap();
    assert!(status.success(), "kill -9 {target}");
}

/// Kills the leader alone (as an OOM kill would), leaving its worker in the group.
async fn kill_leader(rec: &PidRecord) {
    kill9(&rec.pid.to_string());
    assert!(gone_within(rec.pid, Duration::from_secs(10)).await);
}

#[tokio::test]
async fn workers_carry_the_instance_and_a_stop_takes_the_whole_group() {
    let dir = common::temp_dir("group-stop");
    let rt = ProcessRuntime::new(&dir).unwrap();
    let (rec, worker) = engine_with_worker(&rt, &dir, "e1").await;
    let environ = environ_of(worker).await;
    let marker = format!("{INSTANCE_ENV}=e1");
    assert!(environ.split(|b| *b == 0).any(|v| v == marker.as_bytes()));
    let group = EngineGroup::of(&rec);
    let mut members = group.members().unwrap();
    members.sort_unstable();
    let mut expected = vec![rec.pid, worker];
    expected.sort_unstable();
    assert_eq!(members, expected);

    // The leader dies alone; its worker still holds what it held.
    kill_leader(&rec).await;
    assert!(alive(worker));
    assert_eq!(group.members().unwrap(), vec![worker]);
    // A stop now still stops the worker, and removes the record.
    rt.stop("e1", GRACE).await.unwrap();
    assert!(!alive(worker));
    assert!(rt.records().unwrap().is_empty());
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn an_engine_that_exited_by_itself_leaves_no_worker_behind() {
    let dir = common::temp_dir("group-forget");
    let rt = ProcessRuntime::new(&dir).unwrap();
    let (rec, worker) = engine_with_worker(&rt, &dir, "e2").await;
    kill_leader(&rec).await;
    rt.forget("e2");
    assert!(rt.records().unwrap().is_empty());
    assert!(
        gone_within(worker, Duration::from_secs(10)).await,
        "worker {worker} still runs"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn recovery_stops_the_workers_of_a_dead_engine() {
    let dir = common::temp_dir("group-recover-dead");
    let first = ProcessRuntime::new(&dir).unwrap();
    let (rec, worker) = engine_with_worker(&first, &dir, "e3").await;
    drop(first); // CapyCTL "crashes".
    kill_leader(&rec).await;
    let second = ProcessRuntime::new(&dir).unwrap();
    let recovery = second.recover(|_| async { true }, GRACE).await.unwrap();
    assert_eq!(recovery.gone.len(), 1, "{recovery:?}");
    assert!(recovery.adopted.is_empty() && recovery.stopped.is_empty());
    // Killed by the recovery; gone once init has reaped it (its parent, the leader, is dead),
    // which takes a moment on a busy machine (a full run under load failed an at-once check).
    assert!(
        gone_within(worker, Duration::from_secs(10)).await,
        "worker {worker} still runs"
    );
    assert!(second.records().unwrap().is_empty());
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn recovery_stops_an_engine_that_does_not_answer() {
    let dir = common::temp_dir("group-recover-silent");
    let first = ProcessRuntime::new(&dir).unwrap();
    let (rec, worker) = engine_with_worker(&first, &dir, "e4").await;
    drop(first);
    let second = ProcessRuntime::new(&dir).unwrap();
    let recovery = second.recover(|_| async { false }, GRACE).await.unwrap();
    assert_eq!(
        recovery
            .stopped
            .iter()
            .map(|r| r.instance.as_str())
            .collect::<Vec<_>>(),
        ["e4"]
    );
    assert!(recovery.adopted.is_empty() && recovery.gone.is_empty());
    assert!(!alive(rec.pid) && !alive(worker));
    assert!(second.records().unwrap().is_empty());
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_pid_another_program_took_over_is_left_alone() {
    let dir = common::temp_dir("group-reused");
    // Another program, leading a group of its own with a child, holds the recorded pid.
    let pid_file = dir.join("other.worker");
    let mut other = std::process::Command::new("sh")
        .args([
            "-c",
            &format!("sleep 600 & echo $! > '{}'; wait", pid_file.display()),
        ])
        .process_group(0)
        .spawn()
        .unwrap();
    let other_pid = other.id();
    let other_child = pid_in(&pid_file).await;
    let rt = ProcessRuntime::new(&dir).unwrap();
    let ticks = start_ticks(other_pid).map(|t| t.saturating_sub(1));
    rt.write_record(&record(
        "e5",
        other_pid,
        ticks,
        dir.join("e5.log"),
        vec!["vllm".into(), "serve".into(), "m".into()],
    ))
    .unwrap();
    let recovery = rt.recover(|_| async { true }, GRACE).await.unwrap();
    assert_eq!(recovery.gone.len(), 1, "{recovery:?}");
    assert!(rt.records().unwrap().is_empty());
    // Neither the program nor its child was signalled.
    assert!(alive(other_pid) && alive(other_child));
    assert!(EngineGroup::of(&recovery.gone[0]).members().is_none());
    kill9(&format!("-{other_pid}"));
    let _ = other.wait();
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_record_is_read_whole_wherever_a_kill_left_its_write() {
    // `write_record` writes `<stem>.json.tmp` whole, removes `<stem>.json`, renames the first
    // to the second. Each state a kill can leave is read as one whole record.
    let dir = common::temp_dir("record-writes");
    let rt = ProcessRuntime::new(&dir).unwrap();
    let engines = dir.join("engines");
    let old = record("a", 1, None, dir.join("a.log"), vec!["old".into()]);
    let new = record("a", 1, None, dir.join("a.log"), vec!["new".into()]);
    rt.write_record(&old).unwrap();
    rt.write_record(&new).unwrap();
    let commands = |rt: &ProcessRuntime| -> Vec<Vec<String>> {
        rt.records()
            .unwrap()
            .into_iter()
            .map(|r| r.command)
            .collect()
    };
    assert_eq!(commands(&rt), [vec!["new".to_string()]]);
    assert!(
        !engines.join("a.json.tmp").exists(),
        "nothing left beside it"
    );
    let text = std::fs::read(engines.join("a.json")).unwrap();

    // Killed while the next one was written: the whole old record beside a torn one.
    std::fs::write(engines.join("a.json.tmp"), &text[..text.len() / 2]).unwrap();
    assert_eq!(commands(&rt), [vec!["new".to_string()]]);
    // Killed between the removal and the rename: only the whole new one.
    std::fs::write(engines.join("a.json.tmp"), &text).unwrap();
    std::fs::remove_file(engines.join("a.json")).unwrap();
    assert_eq!(commands(&rt), [vec!["new".to_string()]]);
    // And the next write goes on from there.
    rt.write_record(&old).unwrap();
    assert_eq!(commands(&rt), [vec!["old".to_string()]]);
    assert!(!engines.join("a.json.tmp").exists());
    let _ = std::fs::remove_dir_all(dir);
}
