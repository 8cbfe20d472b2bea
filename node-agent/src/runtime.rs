//! The engine runtime seam: how [`LocalHostAgent`](crate::LocalHostAgent) gets an engine for an
//! instance, learns where it answers and when it ends, and lets it go.
//!
//! - [`ProcessRuntime`]: engines as child processes on loopback ports (standalone, the node
//!   agent's `--engine-runtime process`);
//! - `k8s::pods::PodRuntime` (feature `kubernetes`): engine Pods the operator creates on this
//!   node (`--engine-runtime pod`).
//!
//! Every runtime keeps a [`PidRecord`] per engine in `<data dir>/engines/` (what the agent needs
//! to go on after a restart: the deployment, the parking launch, the first answer, the tier).

use std::sync::Arc;
use std::time::Duration;

use crate::agent::BoxFuture;
use crate::error::AgentError;
use crate::launch::launch_command;
use crate::process::{EngineGroup, ExitWatch, PidRecord, ProcessRuntime, Recovery};
use crate::spec::{EngineLaunch, InstanceSpec};
use crate::tier::LaunchParking;

/// What the agent asks a runtime for: an engine for `instance`.
#[derive(Debug, Clone, Copy)]
pub struct LaunchRequest<'a> {
    /// The instance's ID.
    pub instance: &'a str,
    /// The deployment it runs.
    pub spec: &'a InstanceSpec,
    /// The host's command for the engine kind.
    pub engine: &'a EngineLaunch,
    /// How the engine is launched for parking.
    pub parking: LaunchParking,
    /// How long the runtime may take to have the engine running (not ready: the agent waits
    /// for readiness itself).
    pub ready_timeout: Duration,
    /// Milliseconds since the Unix epoch (for the record).
    pub now_ms: u64,
}

/// An engine the runtime launched (or found).
#[derive(Debug)]
pub struct Launched {
    /// Its record, already written.
    pub record: PidRecord,
    /// Where it answers: `http://<address>:<port>`.
    pub base_url: String,
    /// How it ends.
    pub exit: ExitWatch,
}

/// Whether to adopt an engine left behind (its record, its base URL): it answers, and is where
/// its record says ([`crate::recovery`]). One that is not adopted is stopped.
pub type Answers = Arc<dyn Fn(PidRecord, String) -> BoxFuture<'static, bool> + Send + Sync>;

/// How engines run. Shared state lives behind std mutexes never held across an `.await`.
pub trait EngineRuntime: Send + Sync + std::fmt::Debug {
    /// `process` or `pod` (the node agent's `engine_runtime`).
    fn name(&self) -> &'static str;
    /// Gets an engine running for the request and writes its record.
    fn launch<'a>(&'a self, req: LaunchRequest<'a>) -> BoxFuture<'a, Result<Launched, AgentError>>;
    /// Whether a launch may be dropped half-way (a stop ends the start in progress) without
    /// leaving an engine nobody knows: true where the launch only waits for an engine someone
    /// else runs (an engine Pod the operator creates and deletes); the runtime's
    /// [`EngineRuntime::stop`] is called after such a drop. False by default: a launch that
    /// spawns a process is not cut.
    fn launch_cancellable(&self) -> bool {
        false
    }
    /// Where the engine of a tracked (or recovered) record answers.
    fn base_url(&self, record: &PidRecord) -> String;
    /// Who else listens where the engine should: `Some(who)` when the engine's port is held by
    /// a process that is not the engine's (it took the port while the engine loaded, since an
    /// engine binds only once loaded); `None` when the listener is the engine's or the runtime
    /// cannot tell (an engine Pod has its own address: nobody else can take its port).
    fn port_held_by_another(&self, record: &PidRecord) -> Option<String> {
        let _ = record;
        None
    }
    /// Where the engine's output can be read, for error messages: the record's log file when
    /// it has one (a child process's `<data dir>/engines/<instance>.log`).
    fn log_location(&self, record: &PidRecord) -> Option<String> {
        (!record.log.as_os_str().is_empty()).then(|| record.log.display().to_string())
    }
    /// The exit watch of a tracked engine.
    fn exit_watch(&self, instance: &str) -> Option<ExitWatch>;
    /// The pid of a tracked engine (0 where the engine is not a process of this host's agent).
    fn pid(&self, instance: &str) -> Option<u32>;
    /// Writes (atomically) the record of an engine.
    fn write_record(&self, record: &PidRecord) -> Result<(), AgentError>;
    /// Every record left in the data directory.
    fn records(&self) -> Result<Vec<PidRecord>, AgentError>;
    /// Stops `instance`'s engine and removes its record; `UnknownInstance` when not tracked.
    fn stop<'a>(
        &'a self,
        instance: &'a str,
        grace: Duration,
    ) -> BoxFuture<'a, Result<(), AgentError>>;
    /// Stops every tracked engine.
    fn stop_all(&self, grace: Duration) -> BoxFuture<'_, ()>;
    /// Forgets an engine that exited by itself: its record is removed, and what it left
    /// running (workers in its process group) is stopped.
    fn forget(&self, instance: &str);
    /// Adopts what a previous run left behind; `answers` tells whether to adopt an engine that
    /// is alive (otherwise it is stopped).
    fn recover(
        &self,
        answers: Answers,
        grace: Duration,
    ) -> BoxFuture<'_, Result<Recovery, AgentError>>;
}

/// `http://127.0.0.1:<port>`.
pub fn loopback_url(port: u16) -> String {
    format!("http://127.0.0.1:{port}")
}

impl EngineRuntime for ProcessRuntime {
    fn name(&self) -> &'static str {
        "process"
    }

    fn launch<'a>(&'a self, req: LaunchRequest<'a>) -> BoxFuture<'a, Result<Launched, AgentError>> {
        Box::pin(async move {
            let port = self.engine_port()?;
            let launch = launch_command(req.spec, req.engine, port, req.parking)?;
            tracing::info!(instance = req.instance, command = ?launch.argv(), "starting engine");
            let (record, exit) =
                self.spawn(req.instance, req.spec.engine, &launch, |pid, ticks, log| {
                    PidRecord {
                        instance: req.instance.to_string(),
                        engine: req.spec.engine,
                        pid,
                        port,
                        started_at_ms: req.now_ms,
                        start_ticks: ticks,
                        command: launch.argv(),
                        log,
                        spec: req.spec.clone(),
                        parking: req.parking,
                        first_answer: None,
                        parked: None,
                        transition: None,
                        gpu_held: None,
                        measurement: None,
                    }
                })?;
            Ok(Launched {
                record,
                base_url: loopback_url(port),
                exit,
            })
        })
    }

    fn base_url(&self, record: &PidRecord) -> String {
        loopback_url(record.port)
    }

    fn port_held_by_another(&self, record: &PidRecord) -> Option<String> {
        crate::process::port_held_by_another(&EngineGroup::of(record), record.port)
    }

    fn exit_watch(&self, instance: &str) -> Option<ExitWatch> {
        ProcessRuntime::exit_watch(self, instance)
    }

    fn pid(&self, instance: &str) -> Option<u32> {
        ProcessRuntime::pid(self, instance)
    }

    fn write_record(&self, record: &PidRecord) -> Result<(), AgentError> {
        ProcessRuntime::write_record(self, record)
    }

    fn records(&self) -> Result<Vec<PidRecord>, AgentError> {
        ProcessRuntime::records(self)
    }

    fn stop<'a>(
        &'a self,
        instance: &'a str,
        grace: Duration,
    ) -> BoxFuture<'a, Result<(), AgentError>> {
        Box::pin(ProcessRuntime::stop(self, instance, grace))
    }

    fn stop_all(&self, grace: Duration) -> BoxFuture<'_, ()> {
        Box::pin(ProcessRuntime::stop_all(self, grace))
    }

    fn forget(&self, instance: &str) {
        ProcessRuntime::forget(self, instance);
    }

    fn recover(
        &self,
        answers: Answers,
        grace: Duration,
    ) -> BoxFuture<'_, Result<Recovery, AgentError>> {
        Box::pin(async move {
            ProcessRuntime::recover(
                self,
                |record| {
                    let url = loopback_url(record.port);
                    answers(record, url)
                },
                grace,
            )
            .await
        })
    }
}
