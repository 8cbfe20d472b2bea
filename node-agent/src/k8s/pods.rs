//! [`PodRuntime`]: engines in engine Pods (`--engine-runtime pod`).
//!
//! On Kubernetes the OPERATOR creates one engine Pod per running instance, on the node the
//! lifecycle chose (operator/src/k8s/pods.rs), labelled [`LABEL_INSTANCE`]` = <instance id>`
//! and [`LABEL_GENERATION`]; the engine listens on the Pod's IP, on the port of the container
//! [`CONTAINER`] named [`PORT_NAME`] (else its first port, else the annotation
//! [`ANNOTATION_PORT`], else [`DEFAULT_PORT`]). The node agent drives the engine in it over
//! HTTP (`http://<pod IP>:<port>`) for readiness, park, wake, checks and load samples:
//!
//! - the runtime watches only its own node's engine Pods (namespace `POD_NAMESPACE`, field
//!   selector `spec.nodeName=<node>`, label selector [`LABEL_INSTANCE`]);
//! - "launch" waits, at most the agent's ready timeout, for the operator's Pod of the instance to
//!   be Running with a Pod IP (the newest generation it has not let go of); a Pod that never runs
//!   (no kubelet, an image that does not pull) fails the launch with `EngineTimeout` at step
//!   "engine Pod running", and one deleted (without a newer Pod in its place) fails it with
//!   `EngineExited` "engine Pod <ns>/<name> was deleted". A stop ends a launch at once
//!   (`launch_cancellable`: it only watches). The agent then waits up to the ready timeout again
//!   for the engine to answer, so the agent reports twice the ready timeout to the operator
//!   (`capyctl_node_agent::cli::reported_timing`), whose start call waits for both;
//! - an engine's exit is its Pod leaving Running: the engine container terminated, the Pod
//!   failed or succeeded, is being deleted, or is gone; it feeds the agent's exit reports;
//! - "stop" forgets the Pod (and never takes it, nor any other Pod of the instance seen by then,
//!   again) and removes the record: the OPERATOR deletes it. The node agent has no permission to
//!   delete Pods (the chart grants it `get`/`list`/`watch` on Pods), by design: the Pod's owner is
//!   its `Deployment` CR. A parked engine keeps its Pod;
//! - records are kept as the process runtime keeps them, in `<data dir>/engines/`, with `pid`
//!   0, `port` the engine's port and `command` `["pod", "<namespace>/<name>"]`; the chart keeps
//!   the data directory on a hostPath, so the records outlive the agent's Pod. Recovery after
//!   an agent restart adopts the Running engine Pods of its node that have a record and answer.
//!   A Running engine Pod WITHOUT a record (the data directory was lost) is rebuilt from the
//!   annotations the operator puts on every engine Pod: [`ANNOTATION_SPEC`] (the deployment),
//!   [`ANNOTATION_LAUNCH_PARKING`], and, as the operator learns them, [`ANNOTATION_FIRST_ANSWER`]
//!   and [`ANNOTATION_PARKED`]; then adopted the same way. A Pod without them is left to the
//!   operator (its recovery deletes the engine Pods nobody adopted). NB: a record rebuilt from
//!   annotations is only as fresh as the operator's last write (a park whose annotation the
//!   operator did not write before it died is seen as awake). An agent that shuts down
//!   forgets its Pods but keeps the records: the engines outlive it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use tokio::sync::watch;
use tokio::task::AbortHandle;

use crate::agent::BoxFuture;
use crate::error::AgentError;
use crate::process::{ExitWatch, PidRecord, ProcessRuntime, Recovery};
use crate::runtime::{Answers, EngineRuntime, LaunchRequest, Launched, loopback_url};
use crate::spec::InstanceSpec;
use crate::tier::{LaunchParking, ParkTier};
use crate::verify::FirstAnswer;

/// Label of every engine Pod: the instance's ID (operator/src/k8s/pods.rs `LABEL_INSTANCE`).
pub const LABEL_INSTANCE: &str = "capyctl.io/instance";
/// Label of every engine Pod: the instance's generation (a fresh start is a new Pod).
pub const LABEL_GENERATION: &str = "capyctl.io/generation";
/// The engine container's name.
pub const CONTAINER: &str = "engine";
/// The name of the engine container's port.
pub const PORT_NAME: &str = "http";
/// An annotation naming the engine's port, for Pods whose container declares none.
pub const ANNOTATION_PORT: &str = "capyctl.io/engine-port";
/// The engine's port when the Pod says nothing (the operator's default `engine_port`).
pub const DEFAULT_PORT: u16 = 8000;
/// Annotation of every engine Pod (written by the operator when it creates the Pod): the
/// instance's [`InstanceSpec`] as JSON, so that a node agent that lost its record can rebuild it.
pub const ANNOTATION_SPEC: &str = "capyctl.io/instance-spec";
/// Annotation of every engine Pod: its [`LaunchParking`] as JSON (how it was launched for
/// parking).
pub const ANNOTATION_LAUNCH_PARKING: &str = "capyctl.io/launch-parking";
/// Annotation the operator sets once the engine is ready: its first answer ([`FirstAnswer`]
/// as JSON), which wakes are checked against.
pub const ANNOTATION_FIRST_ANSWER: &str = "capyctl.io/first-answer";
/// Annotation the operator sets while the engine is parked: the tier (`host_ram`, `deep`,
/// `kv_only`); removed after a wake.
pub const ANNOTATION_PARKED: &str = "capyctl.io/parked";
/// How long recovery waits for the first list of the node's engine Pods.
///
/// NB: the operator's remote `recover` call waits `(step + stop grace) × 8 + 30 s` (350 s with
/// the defaults, `capyctl_node_agent::remote::RemoteTimeouts`), which covers this wait and
/// then a health check (`step`, 10 s) of each of up to 29 engines of the node.
pub const SYNC_TIMEOUT: Duration = Duration::from_secs(60);

/// The field selector of `node`'s Pods.
pub fn field_selector(node: &str) -> String {
    format!("spec.nodeName={node}")
}

/// The label selector of engine Pods.
pub fn label_selector() -> String {
    LABEL_INSTANCE.to_string()
}

/// Where an engine Pod is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodState {
    /// Not running yet (pending, pulling, the container not started).
    Starting,
    /// Running, the engine container too.
    Running,
    /// Ended or ending, and why (`engine Pod ns/name: container engine terminated: ...`).
    Ended(String),
}

/// What the runtime reads of an engine Pod.
#[derive(Debug, Clone, PartialEq)]
pub struct EnginePodView {
    /// `<namespace>/<name>`.
    pub key: String,
    /// Its UID.
    pub uid: String,
    /// The instance (label [`LABEL_INSTANCE`]).
    pub instance: String,
    /// The generation (label [`LABEL_GENERATION`]); 0 when absent.
    pub generation: u64,
    /// Its IP, once it has one.
    pub ip: Option<String>,
    /// The engine's port.
    pub port: u16,
    /// Where it is.
    pub state: PodState,
    /// What its annotations say of the instance, for a record rebuilt from the Pod.
    pub rebuild: Option<Rebuild>,
}

/// What an engine Pod's annotations say of its instance ([`ANNOTATION_SPEC`] and the others):
/// enough to rebuild a lost record.
#[derive(Debug, Clone, PartialEq)]
pub struct Rebuild {
    /// The deployment the engine runs.
    pub spec: InstanceSpec,
    /// How it was launched for parking (not parkable when the annotation is missing).
    pub parking: LaunchParking,
    /// Its first answer, once the operator recorded it.
    pub first_answer: Option<FirstAnswer>,
    /// The tier it is parked in, as the operator last recorded it.
    pub parked: Option<ParkTier>,
}

/// The [`Rebuild`] of a Pod's annotations; `None` without a readable [`ANNOTATION_SPEC`].
pub fn rebuild_of(annotations: &BTreeMap<String, String>) -> Option<Rebuild> {
    let spec: InstanceSpec = serde_json::from_str(annotations.get(ANNOTATION_SPEC)?).ok()?;
    let parking = annotations
        .get(ANNOTATION_LAUNCH_PARKING)
        .and_then(|t| serde_json::from_str(t).ok())
        .unwrap_or_default();
    let first_answer = annotations
        .get(ANNOTATION_FIRST_ANSWER)
        .and_then(|t| serde_json::from_str(t).ok());
    let parked = annotations
        .get(ANNOTATION_PARKED)
        .and_then(|t| serde_json::from_value(serde_json::Value::String(t.clone())).ok());
    Some(Rebuild {
        spec,
        parking,
        first_answer,
        parked,
    })
}

impl EnginePodView {
    /// `http://<ip>:<port>`, once the Pod has an IP.
    pub fn base_url(&self) -> Option<String> {
        self.ip.as_ref().map(|ip| {
            if ip.contains(':') {
                format!("http://[{ip}]:{}", self.port)
            } else {
                format!("http://{ip}:{}", self.port)
            }
        })
    }

    /// Running with an IP: an engine to drive.
    pub fn usable(&self) -> bool {
        self.state == PodState::Running && self.ip.is_some()
    }
}

/// The engine's port of `pod` (see the module doc).
fn engine_port(pod: &Pod) -> u16 {
    let containers = pod.spec.as_ref().map(|s| s.containers.as_slice());
    let container = containers.and_then(|cs| {
        cs.iter()
            .find(|c| c.name == CONTAINER)
            .or_else(|| cs.first())
    });
    let ports = container.and_then(|c| c.ports.as_deref()).unwrap_or(&[]);
    let declared = ports
        .iter()
        .find(|p| p.name.as_deref() == Some(PORT_NAME))
        .or_else(|| ports.first())
        .and_then(|p| u16::try_from(p.container_port).ok());
    declared
        .or_else(|| {
            pod.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(ANNOTATION_PORT))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(DEFAULT_PORT)
}

/// What the runtime reads of `pod`; `None` for a Pod without a name or instance label.
pub fn view(pod: &Pod) -> Option<EnginePodView> {
    let meta = &pod.metadata;
    let name = meta.name.clone()?;
    let labels = meta.labels.as_ref()?;
    let instance = labels.get(LABEL_INSTANCE)?.clone();
    let generation = labels
        .get(LABEL_GENERATION)
        .and_then(|g| g.parse().ok())
        .unwrap_or(0);
    let key = format!("{}/{name}", meta.namespace.as_deref().unwrap_or_default());
    let status = pod.status.as_ref();
    let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or("Pending");
    let engine_status = status
        .and_then(|s| s.container_statuses.as_deref())
        .and_then(|cs| {
            cs.iter()
                .find(|c| c.name == CONTAINER)
                .or_else(|| cs.first())
        });
    let terminated = engine_status
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.terminated.as_ref());
    let state = if meta.deletion_timestamp.is_some() {
        PodState::Ended(format!("engine Pod {key} is being deleted"))
    } else if let Some(t) = terminated {
        let reason = t.reason.as_deref().unwrap_or("terminated");
        PodState::Ended(format!(
            "engine Pod {key}: container {CONTAINER} terminated: exit code {} ({reason})",
            t.exit_code
        ))
    } else if phase == "Failed" || phase == "Succeeded" {
        let reason = status
            .and_then(|s| s.reason.clone().or_else(|| s.message.clone()))
            .unwrap_or_default();
        PodState::Ended(
            format!("engine Pod {key} {phase} {reason}")
                .trim_end()
                .to_string(),
        )
    } else if phase == "Running"
        && engine_status.is_none_or(|c| c.state.as_ref().is_none_or(|s| s.running.is_some()))
    {
        PodState::Running
    } else {
        PodState::Starting
    };
    Some(EnginePodView {
        key,
        uid: meta.uid.clone().unwrap_or_default(),
        instance,
        generation,
        ip: status
            .and_then(|s| s.pod_ip.clone())
            .filter(|ip| !ip.is_empty()),
        port: engine_port(pod),
        state,
        rebuild: meta.annotations.as_ref().and_then(rebuild_of),
    })
}

/// The node's engine Pods as the watcher last saw them.
#[derive(Debug, Clone, Default)]
pub struct PodsSeen {
    /// A complete list has been seen: a Pod missing from `pods` is gone.
    pub synced: bool,
    /// By `<namespace>/<name>`.
    pub pods: BTreeMap<String, EnginePodView>,
}

#[derive(Debug)]
struct TrackedPod {
    key: String,
    uid: String,
    base_url: String,
    exit: watch::Sender<Option<String>>,
}

#[derive(Debug)]
struct Shared {
    seen: watch::Sender<PodsSeen>,
    /// Instances driven, by ID.
    tracked: Mutex<HashMap<String, TrackedPod>>,
    /// UIDs of Pods let go of (stopped, or their engine ended): never taken again.
    retired: Mutex<HashSet<String>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    /// Sends each tracked engine whose Pod left Running its exit.
    fn check_exits(&self) {
        let seen = self.seen.borrow().clone();
        let tracked = lock(&self.tracked);
        for t in tracked.values() {
            let why = match seen.pods.get(&t.key) {
                Some(p) if p.uid != t.uid && !t.uid.is_empty() => {
                    Some(format!("engine Pod {} was replaced", t.key))
                }
                Some(p) => match &p.state {
                    PodState::Ended(why) => Some(why.clone()),
                    _ => None,
                },
                None if seen.synced => Some(format!("engine Pod {} was deleted", t.key)),
                None => None,
            };
            if let Some(why) = why {
                t.exit.send_if_modified(|e| {
                    if e.is_none() {
                        *e = Some(why);
                        true
                    } else {
                        false
                    }
                });
            }
        }
    }

    fn update(&self, change: impl FnOnce(&mut PodsSeen)) {
        self.seen.send_modify(change);
        self.check_exits();
    }
}

/// Engines in the operator's engine Pods on this node (see the module doc).
#[derive(Debug)]
pub struct PodRuntime {
    node: String,
    namespace: String,
    /// Records only (`<data dir>/engines/*.json`); it never starts a process.
    records: ProcessRuntime,
    shared: Arc<Shared>,
    watcher: AbortHandle,
}

impl Drop for PodRuntime {
    fn drop(&mut self) {
        self.watcher.abort();
    }
}

impl PodRuntime {
    /// Watches the engine Pods of `node` in `namespace` through `client`; records go under
    /// `<data_dir>/engines`. Needs a Tokio runtime (it spawns the watcher).
    pub fn new(
        client: Client,
        namespace: &str,
        node: &str,
        data_dir: &Path,
    ) -> Result<Self, AgentError> {
        let records = ProcessRuntime::new(data_dir)?;
        let shared = Arc::new(Shared {
            seen: watch::channel(PodsSeen::default()).0,
            tracked: Mutex::new(HashMap::new()),
            retired: Mutex::new(HashSet::new()),
        });
        let api: Api<Pod> = Api::namespaced(client, namespace);
        let config = watcher::Config::default()
            .fields(&field_selector(node))
            .labels(&label_selector());
        let task = tokio::spawn(watch_pods(api, config, Arc::downgrade(&shared)));
        Ok(Self {
            node: node.to_string(),
            namespace: namespace.to_string(),
            records,
            shared,
            watcher: task.abort_handle(),
        })
    }

    /// The node whose Pods it watches.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The namespace of the engine Pods.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The node's engine Pods as last seen.
    pub fn seen(&self) -> PodsSeen {
        self.shared.seen.borrow().clone()
    }

    /// Waits for the first complete list of the node's engine Pods, at most `bound`.
    pub async fn wait_synced(&self, bound: Duration) -> Result<(), AgentError> {
        let mut rx = self.shared.seen.subscribe();
        match tokio::time::timeout(bound, rx.wait_for(|s| s.synced)).await {
            Ok(Ok(_)) => Ok(()),
            _ => Err(AgentError::io(
                format!(
                    "list the engine Pods of node {} in namespace {}",
                    self.node, self.namespace
                ),
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no list within {} s", bound.as_secs()),
                ),
            )),
        }
    }

    /// Tracks `pod` for `instance`; its exit watch.
    fn track(&self, instance: &str, pod: &EnginePodView, base_url: String) -> ExitWatch {
        let (tx, rx) = watch::channel(None);
        lock(&self.shared.tracked).insert(
            instance.to_string(),
            TrackedPod {
                key: pod.key.clone(),
                uid: pod.uid.clone(),
                base_url,
                exit: tx,
            },
        );
        // The Pod may have ended between the look and the tracking.
        self.shared.check_exits();
        rx
    }

    /// Lets go of `instance`'s Pod: it is never taken again.
    fn untrack(&self, instance: &str) -> Option<TrackedPod> {
        let t = lock(&self.shared.tracked).remove(instance)?;
        if !t.uid.is_empty() {
            lock(&self.shared.retired).insert(t.uid.clone());
        }
        Some(t)
    }

    /// Lets go of every Pod of `instance` seen now.
    fn retire_all(&self, instance: &str) {
        let seen = self.shared.seen.borrow();
        let mut retired = lock(&self.shared.retired);
        for p in seen.pods.values().filter(|p| p.instance == instance) {
            if !p.uid.is_empty() {
                retired.insert(p.uid.clone());
            }
        }
    }

    /// The newest Pod of `instance` not let go of and not in `skip`.
    fn candidate(
        &self,
        seen: &PodsSeen,
        instance: &str,
        skip: &HashSet<String>,
    ) -> Option<EnginePodView> {
        let retired = lock(&self.shared.retired);
        seen.pods
            .values()
            .filter(|p| {
                p.instance == instance && !retired.contains(&p.uid) && !skip.contains(&p.key)
            })
            .max_by_key(|p| p.generation)
            .cloned()
    }

    fn record_of(req: &LaunchRequest<'_>, pod: &EnginePodView) -> PidRecord {
        PidRecord {
            instance: req.instance.to_string(),
            engine: req.spec.engine,
            pid: 0,
            port: pod.port,
            started_at_ms: req.now_ms,
            start_ticks: None,
            command: vec!["pod".to_string(), pod.key.clone()],
            log: std::path::PathBuf::new(),
            spec: req.spec.clone(),
            parking: req.parking,
            first_answer: None,
            parked: None,
            transition: None,
            gpu_held: None,
            measurement: None,
        }
    }

    async fn do_launch(&self, req: LaunchRequest<'_>) -> Result<Launched, AgentError> {
        let id = req.instance;
        if lock(&self.shared.tracked).contains_key(id) {
            return Err(AgentError::WrongState {
                instance: id.to_string(),
                detail: "an engine is already running for it".into(),
            });
        }
        let deadline = tokio::time::Instant::now() + req.ready_timeout;
        let mut rx = self.shared.seen.subscribe();
        // Pods of the instance that had ended before this launch (an earlier generation the
        // operator has not deleted yet) are not this launch's: only one ending now fails it.
        let stale: HashSet<String> = rx
            .borrow()
            .pods
            .values()
            .filter(|p| p.instance == id && matches!(p.state, PodState::Ended(_)))
            .map(|p| p.key.clone())
            .collect();
        // The Pod this launch waits for: deleted without a newer one in its place (the
        // operator deleted it: a stop or a delete), the engine has ended.
        let mut watching: Option<EnginePodView> = None;
        loop {
            let (found, deleted) = {
                let seen = rx.borrow_and_update();
                let found = self.candidate(&seen, id, &stale);
                let deleted = watching
                    .as_ref()
                    .filter(|w| seen.synced && !seen.pods.contains_key(&w.key))
                    .filter(|w| found.as_ref().is_none_or(|f| f.generation <= w.generation))
                    .map(|w| w.key.clone());
                (found, deleted)
            };
            if let Some(key) = deleted {
                return Err(AgentError::EngineExited {
                    engine: req.spec.engine,
                    instance: id.to_string(),
                    status: format!("engine Pod {key} was deleted"),
                    log: None,
                });
            }
            if found.is_some() {
                watching.clone_from(&found);
            }
            match found {
                Some(pod) if pod.usable() => {
                    let base_url = pod.base_url().unwrap_or_default();
                    let record = Self::record_of(&req, &pod);
                    self.records.write_record(&record)?;
                    let exit = self.track(id, &pod, base_url.clone());
                    tracing::info!(instance = id, pod = %pod.key, %base_url, "engine Pod running");
                    return Ok(Launched {
                        record,
                        base_url,
                        exit,
                    });
                }
                Some(EnginePodView {
                    state: PodState::Ended(why),
                    ..
                }) => {
                    return Err(AgentError::EngineExited {
                        engine: req.spec.engine,
                        instance: id.to_string(),
                        status: why,
                        log: None,
                    });
                }
                _ => {}
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => {
                    return Err(AgentError::io(
                        "watch the engine Pods",
                        std::io::Error::other("the Pod watcher is gone"),
                    ));
                }
                Err(_) => {
                    let last = {
                        let seen = rx.borrow();
                        self.candidate(&seen, id, &stale)
                    };
                    let url = match last {
                        Some(p) => format!(
                            "engine Pod {} of instance {id} on node {} ({}: no kubelet ran it, or its image did not pull in time)",
                            p.key,
                            self.node,
                            match (&p.state, &p.ip) {
                                (PodState::Running, None) => "running without a Pod IP",
                                _ => "not running",
                            }
                        ),
                        None => format!(
                            "the engine Pod of instance {id} on node {} (namespace {}): no such Pod appeared",
                            self.node, self.namespace
                        ),
                    };
                    return Err(AgentError::EngineTimeout {
                        engine: req.spec.engine,
                        step: "engine Pod running",
                        url,
                        after: req.ready_timeout,
                    });
                }
            }
        }
    }

    async fn do_recover(&self, answers: Answers) -> Result<Recovery, AgentError> {
        self.wait_synced(SYNC_TIMEOUT).await?;
        let mut recovery = Recovery::default();
        for record in self.records.records()? {
            if lock(&self.shared.tracked).contains_key(&record.instance) {
                continue;
            }
            let seen = self.seen();
            let recorded = record.command.get(1).and_then(|k| seen.pods.get(k));
            let pod = recorded
                .filter(|p| p.instance == record.instance)
                .cloned()
                .or_else(|| self.candidate(&seen, &record.instance, &HashSet::new()));
            let Some(pod) = pod.filter(EnginePodView::usable) else {
                self.records.forget(&record.instance);
                recovery.gone.push(record);
                continue;
            };
            let base_url = pod.base_url().unwrap_or_default();
            let mut record = record;
            record.port = pod.port;
            record.command = vec!["pod".to_string(), pod.key.clone()];
            self.records.write_record(&record)?;
            self.track(&record.instance, &pod, base_url.clone());
            if answers(record.clone(), base_url).await {
                tracing::info!(instance = %record.instance, pod = %pod.key, "engine Pod adopted");
                recovery.adopted.push(record);
            } else {
                tracing::warn!(instance = %record.instance, pod = %pod.key, "engine Pod does not answer; letting it go (the operator deletes it)");
                self.untrack(&record.instance);
                self.records.forget(&record.instance);
                recovery.stopped.push(record);
            }
        }
        // Running engine Pods of this node without a record (the agent's data directory was
        // lost): rebuilt from their annotations where the operator left them.
        let seen = self.seen();
        let mut instances: Vec<String> = seen.pods.values().map(|p| p.instance.clone()).collect();
        instances.sort();
        instances.dedup();
        for instance in instances {
            if lock(&self.shared.tracked).contains_key(&instance) {
                continue;
            }
            let Some(pod) = self.candidate(&seen, &instance, &HashSet::new()) else {
                continue;
            };
            let Some(rebuild) = pod.rebuild.clone().filter(|_| pod.usable()) else {
                tracing::info!(%instance, pod = %pod.key, "an engine Pod without a record and without the operator's annotations (or not running): left to the operator");
                continue;
            };
            let record = Self::rebuilt_record(&instance, &pod, rebuild);
            let base_url = pod.base_url().unwrap_or_default();
            self.records.write_record(&record)?;
            self.track(&instance, &pod, base_url.clone());
            if answers(record.clone(), base_url).await {
                tracing::info!(%instance, pod = %pod.key, parked = ?record.parked, "engine Pod adopted from its annotations (its record was lost)");
                recovery.adopted.push(record);
            } else {
                tracing::warn!(%instance, pod = %pod.key, "engine Pod without a record does not answer; letting it go (the operator deletes it)");
                self.untrack(&instance);
                self.records.forget(&instance);
                recovery.stopped.push(record);
            }
        }
        Ok(recovery)
    }

    /// The record of `instance` rebuilt from its engine Pod's annotations.
    fn rebuilt_record(instance: &str, pod: &EnginePodView, rebuild: Rebuild) -> PidRecord {
        PidRecord {
            instance: instance.to_string(),
            engine: rebuild.spec.engine,
            pid: 0,
            port: pod.port,
            started_at_ms: 0,
            start_ticks: None,
            command: vec!["pod".to_string(), pod.key.clone()],
            log: std::path::PathBuf::new(),
            spec: rebuild.spec,
            parking: rebuild.parking,
            first_answer: rebuild.first_answer,
            parked: rebuild.parked,
            transition: None,
            gpu_held: None,
            measurement: None,
        }
    }
}

/// Keeps `shared.seen` up to date until the runtime is dropped.
async fn watch_pods(api: Api<Pod>, config: watcher::Config, shared: std::sync::Weak<Shared>) {
    let mut stream = watcher::watcher(api, config).default_backoff().boxed();
    let mut listing: Option<BTreeMap<String, EnginePodView>> = None;
    while let Some(event) = stream.next().await {
        let Some(shared) = shared.upgrade() else {
            return;
        };
        match event {
            Ok(Event::Init) => listing = Some(BTreeMap::new()),
            Ok(Event::InitApply(pod)) => {
                if let (Some(list), Some(v)) = (listing.as_mut(), view(&pod)) {
                    list.insert(v.key.clone(), v);
                }
            }
            Ok(Event::InitDone) => {
                let pods = listing.take().unwrap_or_default();
                shared.update(|s| {
                    s.synced = true;
                    s.pods = pods;
                });
            }
            Ok(Event::Apply(pod)) => {
                if let Some(v) = view(&pod) {
                    shared.update(|s| {
                        s.pods.insert(v.key.clone(), v);
                    });
                }
            }
            Ok(Event::Delete(pod)) => {
                if let Some(v) = view(&pod) {
                    shared.update(|s| {
                        s.pods.remove(&v.key);
                    });
                }
            }
            Err(e) => tracing::warn!(error = %e, "watching the engine Pods failed; retrying"),
        }
    }
}

impl EngineRuntime for PodRuntime {
    fn name(&self) -> &'static str {
        "pod"
    }

    fn launch<'a>(&'a self, req: LaunchRequest<'a>) -> BoxFuture<'a, Result<Launched, AgentError>> {
        Box::pin(self.do_launch(req))
    }

    /// A launch only watches for the operator's Pod: dropping it leaves nothing behind.
    fn launch_cancellable(&self) -> bool {
        true
    }

    fn base_url(&self, record: &PidRecord) -> String {
        if let Some(t) = lock(&self.shared.tracked).get(&record.instance) {
            return t.base_url.clone();
        }
        let seen = self.shared.seen.borrow();
        record
            .command
            .get(1)
            .and_then(|k| seen.pods.get(k))
            .and_then(EnginePodView::base_url)
            .unwrap_or_else(|| loopback_url(record.port))
    }

    fn exit_watch(&self, instance: &str) -> Option<ExitWatch> {
        lock(&self.shared.tracked)
            .get(instance)
            .map(|t| t.exit.subscribe())
    }

    fn pid(&self, instance: &str) -> Option<u32> {
        lock(&self.shared.tracked).get(instance).map(|_| 0)
    }

    fn write_record(&self, record: &PidRecord) -> Result<(), AgentError> {
        self.records.write_record(record)
    }

    fn records(&self) -> Result<Vec<PidRecord>, AgentError> {
        self.records.records()
    }

    fn stop<'a>(
        &'a self,
        instance: &'a str,
        _grace: Duration,
    ) -> BoxFuture<'a, Result<(), AgentError>> {
        Box::pin(async move {
            let known = self.untrack(instance);
            self.records.forget(instance);
            // Every Pod of the instance seen now is let go of, running or not: the Pod of a
            // start this stop ended (or that has not reached the agent yet) is never taken
            // by a later start, whose Pod is a new one.
            self.retire_all(instance);
            match known {
                Some(t) => {
                    tracing::info!(instance, pod = %t.key, "engine let go of; the operator deletes its Pod");
                    Ok(())
                }
                None => Err(AgentError::UnknownInstance {
                    instance: instance.to_string(),
                }),
            }
        })
    }

    fn stop_all(&self, _grace: Duration) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            // The engines outlive the agent: a restarted agent adopts them from the records.
            lock(&self.shared.tracked).clear();
        })
    }

    fn forget(&self, instance: &str) {
        self.untrack(instance);
        self.records.forget(instance);
    }

    fn recover(
        &self,
        answers: Answers,
        _grace: Duration,
    ) -> BoxFuture<'_, Result<Recovery, AgentError>> {
        Box::pin(self.do_recover(answers))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::pin::pin;

    use capyctl_spec::EngineKind;
    use http::{Request, Response};
    use kube::client::Body;
    use serde_json::{Value, json};
    use tower_test::mock;

    use super::*;
    use crate::spec::{EngineLaunch, InstanceSpec};
    use crate::tier::LaunchParking;

    type Handle = mock::Handle<Request<Body>, Response<Body>>;
    type Reply = tower_test::mock::SendResponse<Response<Body>>;

    fn runtime(dir: &Path) -> (PodRuntime, Handle) {
        let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
        let rt = PodRuntime::new(Client::new(service, "capyctl"), "capyctl", "gpu-1", dir).unwrap();
        (rt, handle)
    }

    fn pod(phase: &str, ip: Option<&str>) -> Value {
        let mut status = json!({ "phase": phase });
        if let Some(ip) = ip {
            status["podIP"] = json!(ip);
        }
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": "chat-a-0-g1", "namespace": "capyctl", "uid": "uid-1", "resourceVersion": "7",
                "labels": {"capyctl.io/instance": "dep1-0", "capyctl.io/generation": "1"}
            },
            "spec": {"nodeName": "gpu-1", "containers": [
                {"name": "engine", "ports": [{"name": "http", "containerPort": 8001}]}
            ]},
            "status": status
        })
    }

    fn json_reply(reply: Reply, body: &Value) {
        reply.send_response(
            Response::builder()
                .status(200)
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(Body::from(serde_json::to_vec(body).unwrap()))
                .unwrap(),
        );
    }

    fn list(items: Vec<Value>) -> Value {
        json!({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "10"}, "items": items})
    }

    fn events(events: &[(&str, Value)]) -> Body {
        let mut text = String::new();
        for (kind, object) in events {
            text.push_str(&json!({"type": kind, "object": object}).to_string());
            text.push('\n');
        }
        Body::from(text.into_bytes())
    }

    /// The next call: its path and decoded query pairs.
    async fn next(
        handle: &mut std::pin::Pin<&mut Handle>,
    ) -> (String, Vec<(String, String)>, Reply) {
        let (request, reply) = handle.next_request().await.unwrap();
        let query = request.uri().query().unwrap_or_default().to_string();
        let pairs = query
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|p| {
                let (k, v) = p.split_once('=').unwrap_or((p, ""));
                (k.to_string(), v.replace("%3D", "=").replace("%2F", "/"))
            })
            .collect();
        (request.uri().path().to_string(), pairs, reply)
    }

    fn get<'a>(pairs: &'a [(String, String)], key: &str) -> Option<&'a str> {
        pairs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    fn spec() -> InstanceSpec {
        InstanceSpec::new("dep1", "chat-a", EngineKind::Vllm, "Qwen3-4B")
    }

    fn request<'a>(
        spec: &'a InstanceSpec,
        engine: &'a EngineLaunch,
        timeout: Duration,
    ) -> LaunchRequest<'a> {
        LaunchRequest {
            instance: "dep1-0",
            spec,
            engine,
            parking: LaunchParking {
                may_park: true,
                host_ram: false,
            },
            ready_timeout: timeout,
            now_ms: 1,
        }
    }

    #[tokio::test]
    async fn the_watch_lists_and_watches_only_this_nodes_engine_pods() {
        let dir = tempdir();
        let (rt, handle) = runtime(&dir);
        let mut handle = pin!(handle);
        let (path, pairs, reply) = next(&mut handle).await;
        assert_eq!(path, "/api/v1/namespaces/capyctl/pods");
        assert_eq!(get(&pairs, "fieldSelector"), Some("spec.nodeName=gpu-1"));
        assert_eq!(get(&pairs, "labelSelector"), Some("capyctl.io/instance"));
        assert_eq!(get(&pairs, "watch"), None);
        json_reply(reply, &list(vec![]));
        let (path, pairs, _reply) = next(&mut handle).await;
        assert_eq!(path, "/api/v1/namespaces/capyctl/pods");
        assert_eq!(get(&pairs, "watch"), Some("true"));
        assert_eq!(get(&pairs, "resourceVersion"), Some("10"));
        assert_eq!(get(&pairs, "fieldSelector"), Some("spec.nodeName=gpu-1"));
        assert_eq!(get(&pairs, "labelSelector"), Some("capyctl.io/instance"));
        assert!(rt.seen().synced);
    }

    #[tokio::test(start_paused = true)]
    async fn launch_waits_for_the_pod_to_run_with_an_ip() {
        let dir = tempdir();
        let (rt, handle) = runtime(&dir);
        let rt = Arc::new(rt);
        let mut handle = pin!(handle);
        let (_, _, reply) = next(&mut handle).await;
        json_reply(reply, &list(vec![pod("Pending", None)]));
        rt.wait_synced(Duration::from_secs(5)).await.unwrap();
        let (spec, engine) = (spec(), EngineLaunch::default_for(EngineKind::Vllm));

        // Pending: no engine within the bound.
        let err = rt
            .launch(request(&spec, &engine, Duration::from_secs(5)))
            .await
            .unwrap_err();
        assert!(matches!(err, AgentError::EngineTimeout { .. }), "{err}");
        assert!(
            err.to_string().contains(
                "engine Pod capyctl/chat-a-0-g1 of instance dep1-0 on node gpu-1 (not running: no kubelet ran it"
            ),
            "{err}"
        );
        assert!(rt.exit_watch("dep1-0").is_none());

        // Running without an IP, then with one.
        let launch = tokio::spawn({
            let rt = Arc::clone(&rt);
            async move {
                let (spec, engine) = (spec, engine);
                rt.launch(request(&spec, &engine, Duration::from_secs(600)))
                    .await
            }
        });
        let (_, pairs, reply) = next(&mut handle).await;
        assert_eq!(get(&pairs, "watch"), Some("true"));
        events_reply(
            reply,
            &[
                ("MODIFIED", pod("Running", None)),
                ("MODIFIED", pod("Running", Some("10.1.2.3"))),
            ],
        );
        let launched = launch.await.unwrap().unwrap();
        assert_eq!(launched.base_url, "http://10.1.2.3:8001");
        assert_eq!(launched.record.port, 8001);
        assert_eq!(launched.record.command, ["pod", "capyctl/chat-a-0-g1"]);
        assert!(launched.exit.borrow().is_none());
        assert_eq!(rt.records().unwrap().len(), 1);
        assert_eq!(rt.base_url(&launched.record), "http://10.1.2.3:8001");
    }

    #[tokio::test]
    async fn an_exit_is_the_pod_going_away_and_a_stopped_pod_is_never_taken_again() {
        let dir = tempdir();
        let (rt, handle) = runtime(&dir);
        let mut handle = pin!(handle);
        let (_, _, reply) = next(&mut handle).await;
        json_reply(reply, &list(vec![pod("Running", Some("10.1.2.3"))]));
        rt.wait_synced(Duration::from_secs(5)).await.unwrap();
        let (spec, engine) = (spec(), EngineLaunch::default_for(EngineKind::Vllm));
        let launched = rt
            .launch(request(&spec, &engine, Duration::from_secs(5)))
            .await
            .unwrap();
        let mut exit = launched.exit;

        let (_, _, reply) = next(&mut handle).await;
        events_reply(reply, &[("DELETED", pod("Running", Some("10.1.2.3")))]);
        let status = exit.wait_for(Option::is_some).await.unwrap().clone();
        assert_eq!(
            status.as_deref(),
            Some("engine Pod capyctl/chat-a-0-g1 was deleted")
        );

        // Stopped: forgotten, and the same Pod is not taken again.
        rt.stop("dep1-0", Duration::from_secs(1)).await.unwrap();
        assert!(rt.records().unwrap().is_empty());
        assert!(matches!(
            rt.stop("dep1-0", Duration::from_secs(1)).await,
            Err(AgentError::UnknownInstance { .. })
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_pod_let_go_of_is_not_taken_again() {
        let dir = tempdir();
        let (rt, handle) = runtime(&dir);
        let mut handle = pin!(handle);
        let (_, _, reply) = next(&mut handle).await;
        json_reply(reply, &list(vec![pod("Running", Some("10.1.2.3"))]));
        rt.wait_synced(Duration::from_secs(5)).await.unwrap();
        let (spec, engine) = (spec(), EngineLaunch::default_for(EngineKind::Vllm));
        rt.launch(request(&spec, &engine, Duration::from_secs(5)))
            .await
            .unwrap();
        rt.stop("dep1-0", Duration::from_secs(1)).await.unwrap();
        // The operator has not deleted the Pod yet: a new start waits for the next generation.
        let err = rt
            .launch(request(&spec, &engine, Duration::from_secs(5)))
            .await
            .unwrap_err();
        assert!(matches!(err, AgentError::EngineTimeout { .. }), "{err}");
    }

    fn generation(g: u64, phase: &str) -> Value {
        let mut p = pod(phase, None);
        p["metadata"]["name"] = json!(format!("chat-a-0-g{g}"));
        p["metadata"]["uid"] = json!(format!("uid-{g}"));
        p["metadata"]["labels"]["capyctl.io/generation"] = json!(g.to_string());
        p
    }

    /// A launch of `dep1-0` with this bound, in a task.
    fn spawn_launch(
        rt: &Arc<PodRuntime>,
        bound: Duration,
    ) -> tokio::task::JoinHandle<Result<Launched, AgentError>> {
        let rt = Arc::clone(rt);
        tokio::spawn(async move {
            let (spec, engine) = (spec(), EngineLaunch::default_for(EngineKind::Vllm));
            rt.launch(request(&spec, &engine, bound)).await
        })
    }

    /// Answers a watch call with these events.
    fn events_reply(reply: Reply, list: &[(&str, Value)]) {
        reply.send_response(Response::builder().status(200).body(events(list)).unwrap());
    }

    #[tokio::test]
    async fn a_pod_failing_during_the_launch_fails_it_and_an_older_failed_one_does_not() {
        let dir = tempdir();
        let (rt, handle) = runtime(&dir);
        let rt = Arc::new(rt);
        let mut handle = pin!(handle);
        let (_, _, reply) = next(&mut handle).await;
        json_reply(reply, &list(vec![generation(1, "Failed")]));
        rt.wait_synced(Duration::from_secs(5)).await.unwrap();
        let launch = spawn_launch(&rt, Duration::from_secs(600));
        let (_, _, reply) = next(&mut handle).await;
        events_reply(
            reply,
            &[
                ("ADDED", generation(2, "Pending")),
                ("MODIFIED", generation(2, "Failed")),
            ],
        );
        let err = launch.await.unwrap().unwrap_err();
        match err {
            AgentError::EngineExited { status, .. } => {
                assert_eq!(status, "engine Pod capyctl/chat-a-0-g2 Failed");
            }
            other => panic!("{other}"),
        }
    }

    /// The operator deleted the Pod a launch waits for (a stop or a delete that came before
    /// the start reached the agent): the launch ends at once, and a stop lets go of every Pod
    /// of the instance seen. (Before: a deleted Pod only left `seen`, and the launch waited for
    /// it up to the ready timeout.)
    #[tokio::test(start_paused = true)]
    async fn a_launch_whose_pod_is_deleted_ends_and_a_stop_lets_go_of_every_pod_seen() {
        let dir = tempdir();
        let (rt, handle) = runtime(&dir);
        let rt = Arc::new(rt);
        let mut handle = pin!(handle);
        let (_, _, reply) = next(&mut handle).await;
        json_reply(reply, &list(vec![generation(1, "Pending")]));
        rt.wait_synced(Duration::from_secs(5)).await.unwrap();
        let launch = spawn_launch(&rt, Duration::from_secs(1800));
        let (_, _, reply) = next(&mut handle).await;
        events_reply(reply, &[("DELETED", generation(1, "Pending"))]);
        let began = tokio::time::Instant::now();
        let err = launch.await.unwrap().unwrap_err();
        match err {
            AgentError::EngineExited { status, .. } => {
                assert_eq!(status, "engine Pod capyctl/chat-a-0-g1 was deleted");
            }
            other => panic!("{other}"),
        }
        assert!(began.elapsed() < Duration::from_secs(1));

        // A Pod of the instance seen when a stop comes (pending: its start was ended, or has
        // not reached the agent) is never taken by a later start.
        let (_, _, reply) = next(&mut handle).await;
        events_reply(reply, &[("ADDED", generation(2, "Pending"))]);
        let mut seen = rt.shared.seen.subscribe();
        seen.wait_for(|s| s.pods.len() == 1).await.unwrap();
        assert!(matches!(
            rt.stop("dep1-0", Duration::from_secs(1)).await,
            Err(AgentError::UnknownInstance { .. })
        ));
        let mut running = generation(2, "Running");
        running["status"]["podIP"] = json!("10.1.2.4");
        let (_, _, reply) = next(&mut handle).await;
        events_reply(reply, &[("MODIFIED", running)]);
        seen.wait_for(|s| s.pods.values().any(EnginePodView::usable))
            .await
            .unwrap();
        let (spec, engine) = (spec(), EngineLaunch::default_for(EngineKind::Vllm));
        let err = rt
            .launch(request(&spec, &engine, Duration::from_secs(5)))
            .await
            .unwrap_err();
        assert!(matches!(err, AgentError::EngineTimeout { .. }), "{err}");
    }

    #[tokio::test]
    async fn a_terminated_engine_container_is_an_exit() {
        let dir = tempdir();
        let (rt, handle) = runtime(&dir);
        let mut handle = pin!(handle);
        let (_, _, reply) = next(&mut handle).await;
        json_reply(reply, &list(vec![pod("Running", Some("10.1.2.3"))]));
        rt.wait_synced(Duration::from_secs(5)).await.unwrap();
        let (spec, engine) = (spec(), EngineLaunch::default_for(EngineKind::Vllm));
        let mut exit = rt
            .launch(request(&spec, &engine, Duration::from_secs(5)))
            .await
            .unwrap()
            .exit;
        let mut ended = pod("Running", Some("10.1.2.3"));
        ended["status"]["containerStatuses"] = json!([{
            "name": "engine", "ready": false, "restartCount": 0, "image": "vllm", "imageID": "",
            "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}
        }]);
        let (_, _, reply) = next(&mut handle).await;
        events_reply(reply, &[("MODIFIED", ended)]);
        let status = exit.wait_for(Option::is_some).await.unwrap().clone();
        assert_eq!(
            status.as_deref(),
            Some(
                "engine Pod capyctl/chat-a-0-g1: container engine terminated: exit code 137 (OOMKilled)"
            )
        );
    }

    #[tokio::test]
    async fn recovery_adopts_the_running_pods_listed_for_its_records() {
        let dir = tempdir();
        let store = ProcessRuntime::new(&dir).unwrap();
        let (spec, engine) = (spec(), EngineLaunch::default_for(EngineKind::Vllm));
        let pod_view =
            view(&serde_json::from_value(pod("Running", Some("10.1.2.3"))).unwrap()).unwrap();
        let mut record =
            PodRuntime::record_of(&request(&spec, &engine, Duration::from_secs(1)), &pod_view);
        store.write_record(&record).unwrap();
        record.instance = "dep2-0".into();
        record.command = vec!["pod".into(), "capyctl/chat-b-0-g1".into()];
        store.write_record(&record).unwrap();

        let (rt, handle) = runtime(&dir);
        let mut handle = pin!(handle);
        let recover = rt.recover(
            Arc::new(|_record, url: String| Box::pin(async move { url == "http://10.1.2.3:8001" })),
            Duration::from_secs(1),
        );
        let serve = async {
            let (path, pairs, reply) = next(&mut handle).await;
            assert_eq!(path, "/api/v1/namespaces/capyctl/pods");
            assert_eq!(get(&pairs, "fieldSelector"), Some("spec.nodeName=gpu-1"));
            assert_eq!(get(&pairs, "labelSelector"), Some("capyctl.io/instance"));
            json_reply(reply, &list(vec![pod("Running", Some("10.1.2.3"))]));
        };
        let (recovery, ()) = tokio::join!(recover, serve);
        let recovery = recovery.unwrap();
        let adopted: Vec<&str> = recovery
            .adopted
            .iter()
            .map(|r| r.instance.as_str())
            .collect();
        let gone: Vec<&str> = recovery.gone.iter().map(|r| r.instance.as_str()).collect();
        assert_eq!(adopted, ["dep1-0"]);
        assert_eq!(gone, ["dep2-0"]);
        assert!(recovery.stopped.is_empty());
        assert!(rt.exit_watch("dep1-0").is_some());
        assert_eq!(rt.base_url(&recovery.adopted[0]), "http://10.1.2.3:8001");
        assert_eq!(recorded(&rt), ["dep1-0"]);
    }

    #[tokio::test]
    async fn recovery_rebuilds_lost_records_from_the_operators_annotations() {
        // No record at all: the data directory was lost (an emptyDir, a new node agent Pod).
        let dir = tempdir();
        let spec = spec();
        let annotated = |name: &str, instance: &str, ip: &str, parked: Option<&str>| {
            let mut p = pod("Running", Some(ip));
            p["metadata"]["name"] = json!(name);
            p["metadata"]["uid"] = json!(format!("uid-{name}"));
            p["metadata"]["labels"]["capyctl.io/instance"] = json!(instance);
            let mut spec = spec.clone();
            spec.deployment_id = instance.trim_end_matches("-0").to_string();
            let mut annotations = json!({
                ANNOTATION_SPEC: serde_json::to_string(&spec).unwrap(),
                ANNOTATION_LAUNCH_PARKING: r#"{"may_park":true,"host_ram":true}"#,
                ANNOTATION_FIRST_ANSWER: r#"{"kind":"text","text":"Paris"}"#,
            });
            if let Some(tier) = parked {
                annotations[ANNOTATION_PARKED] = json!(tier);
            }
            p["metadata"]["annotations"] = annotations;
            p
        };
        let parked = annotated("chat-a-0-g1", "dep1-0", "10.1.2.3", Some("host_ram"));
        let silent = annotated("chat-c-0-g1", "dep3-0", "10.1.2.9", None);
        // An engine Pod of an older operator: no annotations, nothing to rebuild.
        let mut bare = pod("Running", Some("10.1.2.5"));
        bare["metadata"]["name"] = json!("chat-b-0-g1");
        bare["metadata"]["uid"] = json!("uid-b");
        bare["metadata"]["labels"]["capyctl.io/instance"] = json!("dep2-0");

        let (rt, handle) = runtime(&dir);
        let mut handle = pin!(handle);
        let recover = rt.recover(
            Arc::new(|_record, url: String| Box::pin(async move { url != "http://10.1.2.9:8001" })),
            Duration::from_secs(1),
        );
        let serve = async {
            let (_, _, reply) = next(&mut handle).await;
            json_reply(reply, &list(vec![parked, silent, bare]));
        };
        let (recovery, ()) = tokio::join!(recover, serve);
        let recovery = recovery.unwrap();
        assert_eq!(recovery.adopted.len(), 1);
        let adopted = &recovery.adopted[0];
        assert_eq!(adopted.instance, "dep1-0");
        assert_eq!(adopted.spec.deployment_id, "dep1");
        assert_eq!(adopted.spec.name, "chat-a");
        assert_eq!(adopted.parked, Some(ParkTier::HostRam));
        assert_eq!(
            adopted.parking,
            LaunchParking {
                may_park: true,
                host_ram: true
            }
        );
        assert_eq!(
            adopted.first_answer,
            Some(FirstAnswer::Text {
                text: "Paris".into()
            })
        );
        assert_eq!(adopted.command, ["pod", "capyctl/chat-a-0-g1"]);
        assert_eq!(rt.base_url(adopted), "http://10.1.2.3:8001");
        // Rebuilt but not answering: let go of (the operator deletes the Pod).
        let stopped: Vec<&str> = recovery
            .stopped
            .iter()
            .map(|r| r.instance.as_str())
            .collect();
        assert_eq!(stopped, ["dep3-0"]);
        assert!(rt.exit_watch("dep3-0").is_none());
        // The bare Pod: neither adopted nor let go of by the agent.
        assert!(rt.exit_watch("dep2-0").is_none());
        assert!(recovery.gone.is_empty());
        // The rebuilt record is written, so the next restart needs no annotations.
        assert_eq!(recorded(&rt), ["dep1-0"]);
    }

    #[test]
    fn the_port_comes_from_the_container_then_the_annotation() {
        let mut p = pod("Running", Some("10.1.2.3"));
        assert_eq!(
            view(&serde_json::from_value(p.clone()).unwrap())
                .unwrap()
                .port,
            8001
        );
        p["spec"]["containers"][0]["ports"] = json!([]);
        assert_eq!(
            view(&serde_json::from_value(p.clone()).unwrap())
                .unwrap()
                .port,
            DEFAULT_PORT
        );
        p["metadata"]["annotations"] = json!({"capyctl.io/engine-port": "9000"});
        assert_eq!(
            view(&serde_json::from_value(p).unwrap()).unwrap().port,
            9000
        );
    }

    /// The instances the runtime has records of.
    fn recorded(rt: &PodRuntime) -> Vec<String> {
        rt.records()
            .unwrap()
            .into_iter()
            .map(|r| r.instance)
            .collect()
    }

    /// A fresh directory under the system temp directory.
    fn tempdir() -> std::path::PathBuf {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("capyctl-pods-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
