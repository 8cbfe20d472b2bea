//! [`PodHostAgent`]: the host agent of a node whose engines run in engine Pods
//! (`capyctl-node-agent --engine-runtime pod`). It wraps the node agent's client and adds what
//! only the operator may do (the node agent cannot create, change or delete Pods):
//!
//! - `start`: deletes the instance's old Pods, creates its engine Pod ([`super::pods`]: the
//!   next generation, owned by the instance's `Deployment` CR, on the node agent's node, with
//!   the host document's engine command and environment, the node's GPUs from its `Host`
//!   object in `NVIDIA_VISIBLE_DEVICES`, and the host-RAM copy of the weights in its memory
//!   request when it parks in host RAM), then lets the node agent start it (it waits for the
//!   Pod to run and drives the engine); a failed start deletes the Pod again. Once started,
//!   the first answer goes into the Pod's annotations;
//! - `park` and `wake` (within the caller's wake window when it gives one) go to the node
//!   agent; the Pod's [`ANNOTATION_PARKED`] follows (a
//!   parked engine keeps its Pod); a failed wake and a park that stopped delete the Pod;
//! - `stop`: lets the node agent stop the engine, then deletes the instance's Pods (after an
//!   error from the agent too). The agent's stop is prompt even while a start waits for its Pod
//!   to run (it cuts the launch, which only watches). Not the other way round: a Pod deleted
//!   first is an exit the agent reports, and its stop then answers "unknown instance", which a
//!   release counts as a failed stop. A stop that comes before the start has reached the agent
//!   (it answers "unknown instance") deletes the new Pod: the start then fails at once ("engine
//!   Pod ... was deleted"), or is ended by the lifecycle's next stop, and never takes that Pod;
//! - `recover`: lets the node agent adopt what it can (from its records, else from the Pods'
//!   annotations), then deletes the engine Pods of the node that belong to no adopted
//!   instance (nothing is leaked);
//! - the rest is the node agent's as it is: its exits, samples and health (a node agent that
//!   restarted is reconciled again through it, and its recovery adopts the engine Pods).
//!
//! Measurement (DESIGN.md 2, "measured when absent"): an engine in a Pod has no pid the node
//! agent could read a footprint of. When the start of an engine whose GPU memory is unknown
//! was the only engine operation on the node from before its Pod was created until it was
//! ready, the GPUs' used memory before and after it (the node agent's NVML reading, `free`
//! of the inventory) is its footprint (`observed`). Otherwise, or on a node whose agent reads
//! no free memory (no NVML, or `host.gpus` declared), the deployment must declare
//! `resources.gpuMemory`. Footprints are kept by deployment and spec, and after a failover
//! read back from the CR's status (`measurement.gpuMemoryBytes` of the current generation).
//!
//! How the engine is launched for parking (vLLM's `--enable-sleep-mode`, SGLang's CPU backup)
//! follows the node agent's `parkability` answer, as its own launch does.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use capyctl_crds::{Deployment, Host, MeasurementSource, MeasurementState};
use capyctl_node_agent::agent::{
    AgentHealth, BoxFuture, EngineExit, ParkResult, RecoveryReport, StartedInstance, WakeReport,
};
use capyctl_node_agent::capability::EngineInfo;
use capyctl_node_agent::inventory::Inventory;
use capyctl_node_agent::k8s::pods::{ANNOTATION_FIRST_ANSWER, ANNOTATION_PARKED};
use capyctl_node_agent::load::LoadSample;
use capyctl_node_agent::measure::{MeasureSource, Measured, Measurement};
use capyctl_node_agent::spec::{HostSettings, InstanceSpec};
use capyctl_node_agent::tier::{LaunchParking, NoParkReason, ParkChoice, ParkTier};
use capyctl_node_agent::{AgentError, HostAgent};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use tokio::sync::{broadcast, watch};

use super::pods::{
    EnginePod, EnginePodSettings, LABEL_DEPLOYMENT, LABEL_GENERATION, LABEL_INSTANCE,
    engine_pod_in, visible_gpus,
};
use super::watch::Claims;

/// The launch a parkability answer calls for (what the node agent's own launch does).
pub fn launch_for(choice: &Result<ParkChoice, AgentError>) -> LaunchParking {
    match choice {
        Ok(ParkChoice::Park(tier)) => LaunchParking {
            may_park: true,
            host_ram: *tier == ParkTier::HostRam,
        },
        Ok(ParkChoice::Stop(NoParkReason::NoRoomToPark)) => LaunchParking {
            may_park: true,
            host_ram: true,
        },
        Ok(ParkChoice::Stop(_)) | Err(_) => LaunchParking::default(),
    }
}

fn kube_error(what: &str, e: kube::Error) -> AgentError {
    AgentError::AgentUnreachable {
        url: "kubernetes".to_string(),
        detail: format!("{what}: {e}"),
    }
}

fn tier_name(t: ParkTier) -> &'static str {
    match t {
        ParkTier::HostRam => "host_ram",
        ParkTier::Deep => "deep",
        ParkTier::KvOnly => "kv_only",
    }
}

/// Engine operations on the node, for telling whether a start was alone (see the module doc).
#[derive(Debug, Default)]
struct Moves {
    /// Operations in progress.
    in_flight: usize,
    /// Bumped when one begins or ends.
    seq: u64,
}

/// One operation in progress; ends when dropped.
struct Move<'a> {
    moves: &'a Mutex<Moves>,
    /// Nothing else was in progress when it began.
    alone: bool,
    /// `seq` right after it began.
    seq: u64,
}

impl Move<'_> {
    /// Whether nothing else began or ended since this one began, which was alone.
    fn still_alone(&self) -> bool {
        self.alone
            && self
                .moves
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .seq
                == self.seq
    }
}

impl Drop for Move<'_> {
    fn drop(&mut self) {
        let mut m = self.moves.lock().unwrap_or_else(PoisonError::into_inner);
        m.in_flight = m.in_flight.saturating_sub(1);
        m.seq += 1;
    }
}

/// The GPU memory a start used: the drop of the GPUs' free memory between `before` and
/// `after`; `None` when a GPU's free memory is unknown or nothing was used.
pub fn footprint(before: &Inventory, after: &Inventory) -> Option<u64> {
    if before.gpus.is_empty() || before.gpus.len() != after.gpus.len() {
        return None;
    }
    let mut used = 0u64;
    for (b, a) in before.gpus.iter().zip(&after.gpus) {
        used = used.saturating_add(b.free_bytes?.saturating_sub(a.free_bytes?));
    }
    (used > 0).then_some(used)
}

/// A host agent whose engines are Pods the operator creates (see the module doc).
pub struct PodHostAgent {
    inner: Arc<dyn HostAgent>,
    pods: Api<Pod>,
    client: Client,
    namespace: String,
    /// Which namespace's object holds each deployment name; without, the CRs are in
    /// `namespace`.
    claims: Option<Arc<Claims>>,
    hosts: Api<Host>,
    settings: EnginePodSettings,
    host: HostSettings,
    node_name: String,
    /// The engine Pod of each instance, as created or adopted.
    names: Mutex<HashMap<String, String>>,
    moves: Mutex<Moves>,
    /// Observed footprints by deployment ID, with the spec they were observed for.
    footprints: Mutex<HashMap<String, (InstanceSpec, u64)>>,
}

impl std::fmt::Debug for PodHostAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodHostAgent")
            .field("node_name", &self.node_name)
            .finish_non_exhaustive()
    }
}

impl PodHostAgent {
    /// Engine Pods on `node_name` in `namespace` built with `settings` and the engine commands
    /// of `host` (the host document), owned by the CRs of the namespace; everything else goes
    /// to `inner`.
    pub fn new(
        inner: Arc<dyn HostAgent>,
        client: Client,
        namespace: &str,
        settings: EnginePodSettings,
        host: HostSettings,
        node_name: impl Into<String>,
    ) -> Self {
        Self {
            inner,
            pods: Api::namespaced(client.clone(), namespace),
            client: client.clone(),
            namespace: namespace.to_string(),
            claims: None,
            hosts: Api::all(client),
            settings,
            host,
            node_name: node_name.into(),
            names: Mutex::new(HashMap::new()),
            moves: Mutex::new(Moves::default()),
            footprints: Mutex::new(HashMap::new()),
        }
    }

    /// Finds the CR of each deployment by `claims` (the operator watches several namespaces;
    /// the engine Pods stay in this agent's namespace, see [`engine_pod_in`]).
    pub fn with_claims(mut self, claims: Arc<Claims>) -> Self {
        self.claims = Some(claims);
        self
    }

    /// The CRs of the namespace whose object holds deployment name `name`.
    fn crs_of(&self, name: &str) -> Api<Deployment> {
        let namespace = self
            .claims
            .as_ref()
            .and_then(|c| c.holder(name))
            .unwrap_or_else(|| self.namespace.clone());
        Api::namespaced(self.client.clone(), &namespace)
    }

    fn begin(&self) -> Move<'_> {
        let mut m = self.moves.lock().unwrap_or_else(PoisonError::into_inner);
        let alone = m.in_flight == 0;
        m.in_flight += 1;
        m.seq += 1;
        Move {
            moves: &self.moves,
            alone,
            seq: m.seq,
        }
    }

    fn names(&self) -> std::sync::MutexGuard<'_, HashMap<String, String>> {
        self.names.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The engine Pods of this node, by instance.
    async fn pods_by_instance(&self) -> Result<BTreeMap<String, Vec<Pod>>, AgentError> {
        let list = self
            .pods
            .list(&ListParams::default().labels(LABEL_INSTANCE))
            .await
            .map_err(|e| kube_error("listing engine Pods", e))?;
        let mut by = BTreeMap::<String, Vec<Pod>>::new();
        for p in list.items {
            let on_node = p.spec.as_ref().and_then(|s| s.node_name.as_deref())
                == Some(self.node_name.as_str());
            if let (true, Some(i)) = (on_node, p.labels().get(LABEL_INSTANCE).cloned()) {
                by.entry(i).or_default().push(p);
            }
        }
        Ok(by)
    }

    async fn delete_pods(&self, pods: &[Pod]) {
        for p in pods {
            let name = p.name_any();
            match self.pods.delete(&name, &DeleteParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.is_not_found() => {}
                Err(e) => {
                    tracing::warn!(pod = %name, error = %e, "an engine Pod could not be deleted")
                }
            }
        }
    }

    /// Deletes the instance's Pods and forgets its Pod's name.
    async fn delete_instance_pods(&self, instance: &str) -> Result<(), AgentError> {
        self.names().remove(instance);
        let pods = self.pods_by_instance().await?.remove(instance);
        self.delete_pods(&pods.unwrap_or_default()).await;
        Ok(())
    }

    /// Sets (`Some`) or removes (`None`) annotation `key` of the instance's engine Pod. A
    /// failure is logged: the annotations only help a node agent that lost its records.
    async fn annotate(&self, instance: &str, key: &str, value: Option<String>) {
        let known = self.names().get(instance).cloned();
        let name = match known {
            Some(n) => Some(n),
            None => self.pods_by_instance().await.ok().and_then(|mut by| {
                by.remove(instance)?
                    .into_iter()
                    .max_by_key(|p| {
                        p.labels()
                            .get(LABEL_GENERATION)
                            .and_then(|g| g.parse::<u64>().ok())
                    })
                    .map(|p| p.name_any())
            }),
        };
        let Some(name) = name else { return };
        let patch = serde_json::json!({"metadata": {"annotations": {key: value}}});
        if let Err(e) = self
            .pods
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            tracing::warn!(%instance, pod = %name, annotation = key, error = %e, "an engine Pod's annotation could not be written");
        }
    }

    /// Replaces the instance's Pods by a new one of the next generation.
    async fn create_pod(&self, instance: &str, spec: &InstanceSpec) -> Result<String, AgentError> {
        let old = self
            .pods_by_instance()
            .await?
            .remove(instance)
            .unwrap_or_default();
        let generation = old
            .iter()
            .filter_map(|p| p.labels().get(LABEL_GENERATION)?.parse::<u64>().ok())
            .max()
            .unwrap_or(0)
            + 1;
        self.delete_pods(&old).await;
        let owner = self
            .crs_of(&spec.name)
            .get(&spec.name)
            .await
            .map_err(|e| kube_error(&format!("reading Deployment {}", spec.name), e))?;
        let parking = launch_for(&self.inner.parkability(spec).await);
        let host_ram_copy = if parking.host_ram {
            self.inner
                .measure(spec)
                .await
                .ok()
                .and_then(|m| m.weights.map(|w| w.bytes))
        } else {
            None
        };
        let host = match self.hosts.get_opt(&self.node_name).await {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(node = %self.node_name, error = %e, "the node's Host object could not be read; NVIDIA_VISIBLE_DEVICES=all");
                None
            }
        };
        let gpus = visible_gpus(host.as_ref());
        let pod = engine_pod_in(
            &EnginePod {
                owner: &owner,
                instance_id: instance,
                generation,
                spec,
                engine: self.host.engine(spec.engine),
                parking,
                node_name: &self.node_name,
                gpus: &gpus,
                host_ram_copy,
            },
            &self.settings,
            &self.namespace,
        )
        .map_err(|e| AgentError::InvalidSpec {
            detail: e.to_string(),
        })?;
        let created = self
            .pods
            .create(&PostParams::default(), &pod)
            .await
            .map_err(|e| kube_error("creating the engine Pod", e))?;
        let name = created.name_any();
        tracing::info!(%instance, pod = %name, node = %self.node_name, "engine Pod created");
        self.names().insert(instance.to_string(), name.clone());
        Ok(name)
    }

    /// The footprint the CR's status holds for the current generation of deployment `spec`.
    async fn footprint_in_status(&self, spec: &InstanceSpec) -> Option<u64> {
        let cr = self.crs_of(&spec.name).get_opt(&spec.name).await.ok()??;
        let status = cr.status.as_ref()?;
        if status.deployment_id.as_deref() != Some(spec.deployment_id.as_str())
            || status.observed_generation != cr.metadata.generation
        {
            return None;
        }
        let m = status.measurement.as_ref()?;
        (m.state == MeasurementState::Measured && m.source == Some(MeasurementSource::Measured))
            .then_some(m.gpu_memory_bytes?)
    }

    async fn do_start(
        &self,
        instance: &str,
        spec: &InstanceSpec,
    ) -> Result<StartedInstance, AgentError> {
        let op = self.begin();
        let before = if op.alone {
            self.inner.inventory().await.ok()
        } else {
            None
        };
        let pod = self.create_pod(instance, spec).await?;
        let mut started = match self.inner.start(instance, spec).await {
            Ok(started) => started,
            Err(e) => {
                tracing::warn!(%instance, %pod, error = %e, "the engine did not start; deleting its Pod");
                let _ = self.delete_instance_pods(instance).await;
                return Err(e);
            }
        };
        if started.measurement.gpu_memory.is_none()
            && let Some(before) = before
            && op.still_alone()
            && let Ok(after) = self.inner.inventory().await
            && op.still_alone()
            && let Some(bytes) = footprint(&before, &after)
        {
            tracing::info!(%instance, bytes, "GPU footprint of the engine Pod observed from the GPUs' free memory");
            started.measurement.gpu_memory = Some(Measured {
                bytes,
                source: MeasureSource::EngineFootprint,
            });
            self.footprints
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(spec.deployment_id.clone(), (spec.clone(), bytes));
        }
        drop(op);
        match serde_json::to_string(&started.first_answer) {
            Ok(text) => {
                self.annotate(instance, ANNOTATION_FIRST_ANSWER, Some(text))
                    .await
            }
            Err(e) => tracing::warn!(%instance, error = %e, "the first answer is not JSON"),
        }
        Ok(started)
    }
    /// A wake by the node agent (within the caller's `window` when one is given); the Pod's
    /// annotation follows.
    async fn do_wake(
        &self,
        instance: &str,
        window: Option<Duration>,
    ) -> Result<WakeReport, AgentError> {
        let _op = self.begin();
        let report = match window {
            Some(window) => self.inner.wake_within(instance, window).await,
            None => self.inner.wake(instance).await,
        };
        match &report {
            // A failed wake stops the engine: its Pod goes.
            Ok(r) if r.outcome.failure().is_some() => {
                let _ = self.delete_instance_pods(instance).await;
            }
            Ok(_) => self.annotate(instance, ANNOTATION_PARKED, None).await,
            Err(_) => {}
        }
        report
    }
}

impl HostAgent for PodHostAgent {
    fn inventory(&self) -> BoxFuture<'_, Result<Inventory, AgentError>> {
        self.inner.inventory()
    }

    fn engines(&self) -> BoxFuture<'_, Vec<EngineInfo>> {
        self.inner.engines()
    }

    fn measure<'a>(
        &'a self,
        spec: &'a InstanceSpec,
    ) -> BoxFuture<'a, Result<Measurement, AgentError>> {
        Box::pin(async move {
            let mut m = self.inner.measure(spec).await?;
            if m.gpu_memory.is_none() {
                let kept = self
                    .footprints
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get(&spec.deployment_id)
                    .filter(|(s, _)| s == spec)
                    .map(|(_, b)| *b);
                let bytes = match kept {
                    Some(b) => Some(b),
                    None => self.footprint_in_status(spec).await,
                };
                m.gpu_memory = bytes.map(|bytes| Measured {
                    bytes,
                    source: MeasureSource::EngineFootprint,
                });
            }
            Ok(m)
        })
    }

    fn parkability<'a>(
        &'a self,
        spec: &'a InstanceSpec,
    ) -> BoxFuture<'a, Result<ParkChoice, AgentError>> {
        self.inner.parkability(spec)
    }

    fn start<'a>(
        &'a self,
        instance: &'a str,
        spec: &'a InstanceSpec,
    ) -> BoxFuture<'a, Result<StartedInstance, AgentError>> {
        Box::pin(self.do_start(instance, spec))
    }

    fn park<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<ParkResult, AgentError>> {
        Box::pin(async move {
            let _op = self.begin();
            let result = self.inner.park(instance).await;
            match &result {
                Ok(ParkResult::Parked { tier, .. }) => {
                    self.annotate(instance, ANNOTATION_PARKED, Some(tier_name(*tier).into()))
                        .await;
                }
                // A model that does not park is stopped instead: its Pod goes.
                Ok(ParkResult::Stopped { .. }) => {
                    let _ = self.delete_instance_pods(instance).await;
                }
                Err(_) => {}
            }
            result
        })
    }

    fn wake<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<WakeReport, AgentError>> {
        Box::pin(self.do_wake(instance, None))
    }

    fn wake_within<'a>(
        &'a self,
        instance: &'a str,
        window: Duration,
    ) -> BoxFuture<'a, Result<WakeReport, AgentError>> {
        Box::pin(self.do_wake(instance, Some(window)))
    }

    fn stop<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<(), AgentError>> {
        Box::pin(async move {
            let _op = self.begin();
            let result = self.inner.stop(instance).await;
            self.delete_instance_pods(instance).await?;
            result
        })
    }

    fn sample(&self, instance: &str) -> Option<LoadSample> {
        self.inner.sample(instance)
    }

    // Adapters (DESIGN 4.9) load into the running engine of the Pod: the node agent in the Pod
    // drives them as for a process, and the Pod stays as it is.
    fn load_adapter<'a>(
        &'a self,
        instance: &'a str,
        name: &'a str,
        path: &'a str,
    ) -> BoxFuture<'a, Result<(), AgentError>> {
        self.inner.load_adapter(instance, name, path)
    }

    fn unload_adapter<'a>(
        &'a self,
        instance: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<(), AgentError>> {
        self.inner.unload_adapter(instance, name)
    }

    fn adapters<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<Vec<String>, AgentError>> {
        self.inner.adapters(instance)
    }

    fn recover(&self) -> BoxFuture<'_, Result<RecoveryReport, AgentError>> {
        Box::pin(async move {
            let _op = self.begin();
            let report = self.inner.recover().await?;
            let by = self.pods_by_instance().await?;
            for (instance, pods) in by {
                if report.adopted.iter().any(|a| a.instance == instance) {
                    let newest = pods
                        .iter()
                        .max_by_key(|p| {
                            p.labels()
                                .get(LABEL_GENERATION)
                                .and_then(|g| g.parse::<u64>().ok())
                        })
                        .map(|p| p.name_any());
                    if let Some(name) = newest {
                        self.names().insert(instance, name);
                    }
                } else {
                    tracing::info!(%instance, "deleting the engine Pods of an instance nobody adopted");
                    self.delete_pods(&pods).await;
                }
            }
            Ok(report)
        })
    }

    fn subscribe_exits(&self) -> broadcast::Receiver<EngineExit> {
        self.inner.subscribe_exits()
    }

    fn samples(&self) -> BTreeMap<String, LoadSample> {
        self.inner.samples()
    }

    // NB: the node agent's health is the lifecycle's only news of a node agent that restarted
    // (its exits' epoch changed): it reconciles the host again, and the restarted agent, which
    // drives no engine until a recovery, adopts its engine Pods. Left to the trait's default
    // (never changes), a node agent killed and restarted by the kubelet was never asked to
    // recover: its engines served on, unwatched, and a deleted engine Pod went unnoticed (the
    // model stayed ready, every request answered upstream_unavailable).
    fn subscribe_health(&self) -> watch::Receiver<AgentHealth> {
        self.inner.subscribe_health()
    }

    fn unreachable(&self) -> Option<String> {
        self.inner.unreachable()
    }
}

/// The label selector of one deployment's engine Pods.
pub fn deployment_selector(name: &str) -> String {
    format!("{LABEL_DEPLOYMENT}={name}")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::collections::VecDeque;
    use std::sync::Mutex;

    use capyctl_node_agent::inventory::{GpuInfo, HostMemory};
    use capyctl_node_agent::launch::{MaxRunning, MaxRunningSource};
    use capyctl_node_agent::verify::{FirstAnswer, WakeOutcome};
    use http::Method;

    use super::super::mock::{self, Exchange};
    use super::*;

    /// The node agent's side: starts fail unless `starts` is set, parks park in host RAM, wakes
    /// pass; the inventory answers the free memories of `free` in turn; the weights are 16 GiB.
    /// Calls are kept.
    #[derive(Default)]
    struct Agent {
        calls: Mutex<Vec<String>>,
        starts: bool,
        free: Mutex<VecDeque<u64>>,
        /// What it says of itself (a node agent over HTTP: its restarts, its reachability).
        health: watch::Sender<AgentHealth>,
        /// Its engines' exits, when it tells them (a node agent over HTTP does).
        exits: Option<broadcast::Sender<EngineExit>>,
    }

    impl HostAgent for Agent {
        fn inventory(&self) -> BoxFuture<'_, Result<Inventory, AgentError>> {
            let free = self.free.lock().unwrap().pop_front();
            Box::pin(async move {
                Ok(Inventory {
                    gpus: vec![GpuInfo {
                        index: 0,
                        uuid: Some("GPU-a".into()),
                        name: None,
                        total_bytes: 80 << 30,
                        free_bytes: free,
                        unified: false,
                    }],
                    gpus_overridden: false,
                    host_memory: HostMemory {
                        total_bytes: 256 << 30,
                        available_bytes: 200 << 30,
                        overridden: false,
                    },
                })
            })
        }
        fn engines(&self) -> BoxFuture<'_, Vec<EngineInfo>> {
            Box::pin(async { Vec::new() })
        }
        fn measure<'a>(
            &'a self,
            _: &'a InstanceSpec,
        ) -> BoxFuture<'a, Result<Measurement, AgentError>> {
            Box::pin(async {
                Ok(Measurement {
                    weights: Some(Measured {
                        bytes: 16 << 30,
                        source: MeasureSource::Checkpoint,
                    }),
                    gpu_memory: None,
                })
            })
        }
        fn parkability<'a>(
            &'a self,
            _: &'a InstanceSpec,
        ) -> BoxFuture<'a, Result<ParkChoice, AgentError>> {
            Box::pin(async { Ok(ParkChoice::Park(ParkTier::HostRam)) })
        }
        fn start<'a>(
            &'a self,
            instance: &'a str,
            _: &'a InstanceSpec,
        ) -> BoxFuture<'a, Result<StartedInstance, AgentError>> {
            self.calls.lock().unwrap().push(format!("start {instance}"));
            let starts = self.starts;
            Box::pin(async move {
                if !starts {
                    return Err(AgentError::InvalidSpec {
                        detail: "the engine exited".into(),
                    });
                }
                Ok(StartedInstance {
                    instance: instance.to_string(),
                    pid: 0,
                    port: 8000,
                    base_url: "http://10.1.2.3:8000".into(),
                    version: None,
                    measurement: Measurement::default(),
                    first_answer: FirstAnswer::Text {
                        text: "Paris".into(),
                    },
                    max_running: MaxRunning {
                        count: Some(32),
                        source: MaxRunningSource::Default,
                    },
                    parking: LaunchParking {
                        may_park: true,
                        host_ram: true,
                    },
                })
            })
        }
        fn park<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Result<ParkResult, AgentError>> {
            Box::pin(async {
                Ok(ParkResult::Parked {
                    tier: ParkTier::HostRam,
                    gpu_held: None,
                })
            })
        }
        fn wake<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Result<WakeReport, AgentError>> {
            Box::pin(async {
                Ok(WakeReport {
                    outcome: WakeOutcome::Pass,
                    took: Duration::from_secs(1),
                    checked: None,
                })
            })
        }
        fn stop<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<(), AgentError>> {
            self.calls.lock().unwrap().push(format!("stop {instance}"));
            Box::pin(async { Ok(()) })
        }
        fn sample(&self, _: &str) -> Option<LoadSample> {
            None
        }
        fn recover(&self) -> BoxFuture<'_, Result<RecoveryReport, AgentError>> {
            self.calls.lock().unwrap().push("recover".into());
            Box::pin(async { Ok(RecoveryReport::default()) })
        }
        fn wake_within<'a>(
            &'a self,
            instance: &'a str,
            window: Duration,
        ) -> BoxFuture<'a, Result<WakeReport, AgentError>> {
            self.calls
                .lock()
                .unwrap()
                .push(format!("wake {instance} within {} s", window.as_secs()));
            self.wake(instance)
        }
        fn subscribe_health(&self) -> watch::Receiver<AgentHealth> {
            self.health.subscribe()
        }
        fn subscribe_exits(&self) -> broadcast::Receiver<EngineExit> {
            match &self.exits {
                Some(tx) => tx.subscribe(),
                None => broadcast::channel(1).1,
            }
        }
        fn unreachable(&self) -> Option<String> {
            let held = self.health.borrow().unreachable.clone();
            held.map(|(_, why)| why)
        }
        fn load_adapter<'a>(
            &'a self,
            instance: &'a str,
            name: &'a str,
            path: &'a str,
        ) -> BoxFuture<'a, Result<(), AgentError>> {
            self.calls
                .lock()
                .unwrap()
                .push(format!("load {name} from {path} into {instance}"));
            Box::pin(async { Ok(()) })
        }
        fn unload_adapter<'a>(
            &'a self,
            instance: &'a str,
            name: &'a str,
        ) -> BoxFuture<'a, Result<(), AgentError>> {
            self.calls
                .lock()
                .unwrap()
                .push(format!("unload {name} from {instance}"));
            Box::pin(async { Ok(()) })
        }
        fn adapters<'a>(
            &'a self,
            instance: &'a str,
        ) -> BoxFuture<'a, Result<Vec<String>, AgentError>> {
            self.calls
                .lock()
                .unwrap()
                .push(format!("adapters of {instance}"));
            Box::pin(async { Ok(vec!["support-bot".to_string()]) })
        }
    }

    const PODS: &str = "/api/v1/namespaces/capyctl/pods";
    const CR: &str = "/apis/capyctl.io/v1alpha1/namespaces/capyctl/deployments/chat-a";
    const HOST: &str = "/apis/capyctl.io/v1alpha1/hosts/gpu-1";

    fn pod(name: &str, instance: &str, generation: u64, node: &str) -> serde_json::Value {
        serde_json::json!({"metadata": {"name": name, "labels": {
                LABEL_INSTANCE: instance, LABEL_GENERATION: generation.to_string()}},
            "spec": {"nodeName": node, "containers": [{"name": "engine"}]}})
    }

    fn list(items: Vec<serde_json::Value>) -> serde_json::Value {
        serde_json::json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items})
    }

    fn cr() -> serde_json::Value {
        serde_json::json!({"apiVersion": "capyctl.io/v1alpha1", "kind": "Deployment",
            "metadata": {"name": "chat-a", "namespace": "capyctl", "uid": "uid-a", "generation": 1},
            "spec": {"engine": "vllm", "model": "Qwen3-4B"}})
    }

    fn host() -> serde_json::Value {
        serde_json::json!({"apiVersion": "capyctl.io/v1alpha1", "kind": "Host",
            "metadata": {"name": "gpu-1"},
            "spec": {"gpus": [{"uuid": "GPU-a", "memory": "80GiB"}]}})
    }

    /// The calls of a first start: no old Pods, the CR, the Host, the new Pod `created`.
    fn first_pod_calls(created: &serde_json::Value) -> Vec<Exchange> {
        vec![
            Exchange::ok(Method::GET, PODS, list(vec![])),
            Exchange::ok(Method::GET, CR, cr()),
            Exchange::ok(Method::GET, HOST, host()),
            Exchange::new(Method::POST, PODS, 201, created.clone()),
        ]
    }

    fn spec() -> InstanceSpec {
        InstanceSpec::new(
            "01KDEP",
            "chat-a",
            capyctl_spec::EngineKind::Vllm,
            "Qwen3-4B",
        )
    }

    fn agent(client: kube::Client, inner: Arc<Agent>) -> PodHostAgent {
        let mut host = HostSettings::default();
        host.vllm.command = vec!["/opt/vllm/bin/vllm".into()];
        host.vllm
            .env
            .insert("VLLM_LOGGING_LEVEL".into(), "DEBUG".into());
        PodHostAgent::new(
            inner,
            client,
            "capyctl",
            EnginePodSettings::default(),
            host,
            "gpu-1",
        )
    }

    #[tokio::test]
    async fn the_pod_of_another_namespaces_object_is_found_by_the_claims_and_not_owned() {
        let (client, handle) = mock::client();
        let mut object = cr();
        object["metadata"]["namespace"] = "team-a".into();
        object["metadata"]["creationTimestamp"] = "2026-12-01T00:00:00Z".into();
        let created = pod("chat-a-0-g1", "01KDEP-0", 1, "gpu-1");
        let server = mock::serve(
            handle,
            vec![
                Exchange::ok(Method::GET, PODS, list(vec![])),
                // The object is read where its name is held, ...
                Exchange::ok(
                    Method::GET,
                    "/apis/capyctl.io/v1alpha1/namespaces/team-a/deployments/chat-a",
                    object.clone(),
                ),
                Exchange::ok(Method::GET, HOST, host()),
                // ... the Pod created in the operator's namespace.
                Exchange::new(Method::POST, PODS, 201, created),
            ],
        );
        let claims = Arc::new(Claims::default());
        claims.seed([&serde_json::from_value::<Deployment>(object).unwrap()]);
        let a = agent(client, Arc::new(Agent::default())).with_claims(claims);
        a.create_pod("01KDEP-0", &spec()).await.unwrap();
        let seen = server.await.unwrap();
        let meta = &seen[3].body["metadata"];
        assert_eq!(meta["namespace"], "capyctl");
        assert!(meta.get("ownerReferences").is_none(), "{meta}");
        assert_eq!(
            meta["labels"][super::super::pods::LABEL_DEPLOYMENT_NAMESPACE],
            "team-a"
        );
    }

    #[tokio::test]
    async fn start_replaces_old_pods_by_the_next_generation_and_a_failed_start_deletes_it() {
        let (client, handle) = mock::client();
        let created = pod("chat-a-0-g3", "01KDEP-0", 3, "gpu-1");
        let server = mock::serve(
            handle,
            vec![
                Exchange::ok(
                    Method::GET,
                    PODS,
                    list(vec![
                        pod("chat-a-0-g2", "01KDEP-0", 2, "gpu-1"),
                        // Another node's: not ours to count or delete.
                        pod("chat-a-0-g7", "01KDEP-0", 7, "gpu-2"),
                    ]),
                ),
                Exchange::ok(
                    Method::DELETE,
                    &format!("{PODS}/chat-a-0-g2"),
                    serde_json::json!({}),
                ),
                Exchange::ok(Method::GET, CR, cr()),
                Exchange::ok(Method::GET, HOST, host()),
                Exchange::new(Method::POST, PODS, 201, created.clone()),
                // The node agent's start failed: the new Pod goes.
                Exchange::ok(Method::GET, PODS, list(vec![created])),
                Exchange::ok(
                    Method::DELETE,
                    &format!("{PODS}/chat-a-0-g3"),
                    serde_json::json!({}),
                ),
            ],
        );
        let inner = Arc::new(Agent::default());
        let a = agent(client, inner.clone());
        let err = a.start("01KDEP-0", &spec()).await.unwrap_err();
        assert!(err.to_string().contains("the engine exited"), "{err}");
        assert_eq!(inner.calls.lock().unwrap().as_slice(), ["start 01KDEP-0"]);
        let seen = server.await.unwrap();
        let body = &seen[4].body;
        assert_eq!(body["metadata"]["name"], "chat-a-0-g3");
        assert_eq!(body["metadata"]["labels"][LABEL_GENERATION], "3");
        assert_eq!(body["metadata"]["ownerReferences"][0]["uid"], "uid-a");
        assert_eq!(body["spec"]["nodeName"], "gpu-1");
        let container = &body["spec"]["containers"][0];
        let command = container["command"].as_array().unwrap();
        // The host document's engine command and environment.
        assert_eq!(command[0], "/opt/vllm/bin/vllm");
        assert!(
            command.iter().any(|a| a == "--enable-sleep-mode"),
            "{command:?}"
        );
        let env: BTreeMap<String, String> = container["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                (
                    e["name"].as_str().unwrap().to_string(),
                    e["value"].as_str().unwrap_or_default().to_string(),
                )
            })
            .collect();
        assert_eq!(env["VLLM_LOGGING_LEVEL"], "DEBUG");
        // The node's GPUs from its Host.
        assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], "GPU-a");
        // 4 GiB for the engine and 16 GiB for the weights' copy in host RAM.
        assert_eq!(
            container["resources"]["requests"]["memory"],
            (20u64 << 30).to_string()
        );
        assert!(
            body["metadata"]["annotations"][capyctl_node_agent::k8s::pods::ANNOTATION_SPEC]
                .is_string()
        );
        assert!(a.names().is_empty(), "a deleted Pod is forgotten");
    }

    #[tokio::test]
    async fn a_lone_start_measures_its_footprint_and_the_pod_keeps_what_a_new_agent_needs() {
        let (client, handle) = mock::client();
        let created = pod("chat-a-0-g1", "01KDEP-0", 1, "gpu-1");
        let pod_path = format!("{PODS}/chat-a-0-g1");
        let server = mock::serve(
            handle,
            [
                first_pod_calls(&created),
                vec![
                    // The first answer, the park, the wake.
                    Exchange::ok(Method::PATCH, &pod_path, created.clone()),
                    Exchange::ok(Method::PATCH, &pod_path, created.clone()),
                    Exchange::ok(Method::PATCH, &pod_path, created.clone()),
                ],
            ]
            .into_iter()
            .flatten()
            .collect(),
        );
        let inner = Arc::new(Agent {
            starts: true,
            // 80 GiB free before the start, 60 GiB after.
            free: Mutex::new(VecDeque::from([80 << 30, 60 << 30])),
            ..Agent::default()
        });
        let a = agent(client, inner.clone());
        let started = a.start("01KDEP-0", &spec()).await.unwrap();
        let gpu = started.measurement.gpu_memory.unwrap();
        assert_eq!(gpu.bytes, 20 << 30);
        assert_eq!(gpu.source, MeasureSource::EngineFootprint);
        // Kept: the next measurement of the same spec has it.
        let m = a.measure(&spec()).await.unwrap();
        assert_eq!(m.gpu_memory.map(|g| g.bytes), Some(20 << 30));
        a.park("01KDEP-0").await.unwrap();
        a.wake("01KDEP-0").await.unwrap();
        let seen = server.await.unwrap();
        let annotations = |i: usize| seen[i].body["metadata"]["annotations"].clone();
        assert_eq!(
            annotations(4)[ANNOTATION_FIRST_ANSWER],
            r#"{"kind":"text","text":"Paris"}"#
        );
        assert_eq!(annotations(5)[ANNOTATION_PARKED], "host_ram");
        assert!(annotations(6)[ANNOTATION_PARKED].is_null());
        assert_eq!(
            seen[4].content_type.as_deref(),
            Some("application/merge-patch+json")
        );
    }

    #[tokio::test]
    async fn a_start_beside_another_operation_measures_nothing() {
        let (client, handle) = mock::client();
        let created = pod("chat-a-0-g1", "01KDEP-0", 1, "gpu-1");
        let server = mock::serve(
            handle,
            [
                first_pod_calls(&created),
                vec![
                    Exchange::ok(
                        Method::PATCH,
                        &format!("{PODS}/chat-a-0-g1"),
                        created.clone(),
                    ),
                    // measure: no footprint kept, none in the CR's status.
                    Exchange::ok(Method::GET, CR, cr()),
                ],
            ]
            .into_iter()
            .flatten()
            .collect(),
        );
        let inner = Arc::new(Agent {
            starts: true,
            free: Mutex::new(VecDeque::from([80 << 30, 60 << 30])),
            ..Agent::default()
        });
        let a = agent(client, inner.clone());
        // Another engine is parking on the node meanwhile: the free memory moves for it too.
        let other = a.begin();
        let started = a.start("01KDEP-0", &spec()).await.unwrap();
        drop(other);
        assert_eq!(started.measurement.gpu_memory, None);
        assert_eq!(a.measure(&spec()).await.unwrap().gpu_memory, None);
        server.await.unwrap();
    }

    #[test]
    fn a_footprint_needs_every_gpus_free_memory() {
        let inv = |free: &[Option<u64>]| Inventory {
            gpus: free
                .iter()
                .enumerate()
                .map(|(i, f)| GpuInfo {
                    index: i as u32,
                    uuid: None,
                    name: None,
                    total_bytes: 80 << 30,
                    free_bytes: *f,
                    unified: false,
                })
                .collect(),
            gpus_overridden: false,
            host_memory: HostMemory {
                total_bytes: 1,
                available_bytes: 1,
                overridden: false,
            },
        };
        assert_eq!(
            footprint(
                &inv(&[Some(80 << 30), Some(80 << 30)]),
                &inv(&[Some(70 << 30), Some(75 << 30)])
            ),
            Some(15 << 30)
        );
        assert_eq!(
            footprint(&inv(&[None]), &inv(&[Some(1)])),
            None,
            "no NVML reading"
        );
        assert_eq!(footprint(&inv(&[Some(5)]), &inv(&[Some(5)])), None);
        assert_eq!(footprint(&inv(&[]), &inv(&[])), None);
    }

    /// The recoveries the inner agent was asked for.
    fn recoveries(inner: &Agent) -> usize {
        inner
            .calls
            .lock()
            .unwrap()
            .iter()
            .filter(|c| *c == "recover")
            .count()
    }

    /// Found on the local cluster (issue 29): the node agent's container killed, the kubelet
    /// restarted it, and the lifecycle never asked the new agent to recover, so it never
    /// adopted (nor watched) the engine Pods; a deleted engine Pod then left its model `ready`
    /// and every request `upstream_unavailable`. The node agent's health (its restarts) goes
    /// through the Pod host agent to the lifecycle, which reconciles the host again: a
    /// recovery, whose leftover Pods are deleted as at the first.
    #[tokio::test]
    async fn a_restarted_node_agent_is_recovered_again_through_the_pod_host_agent() {
        let (client, handle) = mock::client();
        let server = mock::serve(
            handle,
            vec![
                // The first recovery, at the host's start: no engine Pods.
                Exchange::ok(Method::GET, PODS, list(vec![])),
                // The second, after the node agent's restart: a Pod nobody adopted goes.
                Exchange::ok(
                    Method::GET,
                    PODS,
                    list(vec![pod("chat-a-0-g1", "01KDEP-0", 1, "gpu-1")]),
                ),
                Exchange::ok(
                    Method::DELETE,
                    &format!("{PODS}/chat-a-0-g1"),
                    serde_json::json!({}),
                ),
            ],
        );
        let inner = Arc::new(Agent {
            exits: Some(broadcast::channel(8).0),
            ..Agent::default()
        });
        let a: Arc<dyn HostAgent> = Arc::new(agent(client, inner.clone()));
        let lifecycle = capyctl_lifecycle::Core::open(
            a.clone(),
            Arc::new(capyctl_lifecycle::store::MemoryStore::default()),
            capyctl_lifecycle::LifecycleConfig::new("gpu-1"),
        )
        .await
        .unwrap();
        assert_eq!(recoveries(&inner), 1);

        // Unreachable, then answering again: what the agent says is what the host shows.
        let why = "connection refused".to_string();
        inner.health.send_modify(|h| {
            h.unreachable = Some((std::time::Instant::now(), why.clone()));
        });
        assert_eq!(a.unreachable(), Some(why));
        inner.health.send_modify(|h| h.unreachable = None);
        assert_eq!(a.unreachable(), None);

        // It came back as a new process.
        inner.health.send_modify(|h| h.resyncs += 1);
        tokio::time::timeout(Duration::from_secs(10), async {
            while recoveries(&inner) < 2 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the host of a restarted node agent is recovered again");
        let seen = tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("the second recovery deletes the Pod nobody adopted")
            .unwrap();
        assert_eq!(seen.len(), 3);
        drop(lifecycle);
    }

    /// Adapters load into the Pod's running engine through its node agent; no Pod is
    /// created, deleted or annotated for them (the mock API server answers nothing).
    #[tokio::test]
    async fn adapters_go_to_the_node_agent_and_leave_the_pod_alone() {
        let (client, handle) = mock::client();
        let server = mock::serve(handle, vec![]);
        let inner = Arc::new(Agent::default());
        let a = agent(client, inner.clone());
        a.load_adapter("01KDEP-0", "support-bot", "/models/loras/support-bot")
            .await
            .unwrap();
        assert_eq!(a.adapters("01KDEP-0").await.unwrap(), ["support-bot"]);
        a.unload_adapter("01KDEP-0", "support-bot").await.unwrap();
        assert_eq!(
            inner.calls.lock().unwrap().as_slice(),
            [
                "load support-bot from /models/loras/support-bot into 01KDEP-0",
                "adapters of 01KDEP-0",
                "unload support-bot from 01KDEP-0"
            ]
        );
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_wake_within_the_callers_window_keeps_its_window() {
        let (client, handle) = mock::client();
        // The wake passes: the Pod's parked annotation is taken off (no Pod known: none).
        let server = mock::serve(handle, vec![Exchange::ok(Method::GET, PODS, list(vec![]))]);
        let inner = Arc::new(Agent::default());
        let a = agent(client, inner.clone());
        a.wake_within("01KDEP-0", Duration::from_secs(7))
            .await
            .unwrap();
        assert_eq!(
            inner.calls.lock().unwrap().as_slice(),
            ["wake 01KDEP-0 within 7 s"]
        );
        server.await.unwrap();
    }

    #[tokio::test]
    async fn stop_and_recovery_delete_the_pods_nobody_runs() {
        let (client, handle) = mock::client();
        let server = mock::serve(
            handle,
            vec![
                Exchange::ok(
                    Method::GET,
                    PODS,
                    list(vec![pod("chat-a-0-g1", "01KDEP-0", 1, "gpu-1")]),
                ),
                Exchange::ok(
                    Method::DELETE,
                    &format!("{PODS}/chat-a-0-g1"),
                    serde_json::json!({}),
                ),
                // Recovery: the node agent adopted nothing; the leftover Pod goes.
                Exchange::ok(
                    Method::GET,
                    PODS,
                    list(vec![pod("old-0-g4", "01KOLD-0", 4, "gpu-1")]),
                ),
                Exchange::ok(
                    Method::DELETE,
                    &format!("{PODS}/old-0-g4"),
                    serde_json::json!({}),
                ),
            ],
        );
        let inner = Arc::new(Agent::default());
        let a = agent(client, inner.clone());
        a.stop("01KDEP-0").await.unwrap();
        a.recover().await.unwrap();
        assert_eq!(
            inner.calls.lock().unwrap().as_slice(),
            ["stop 01KDEP-0", "recover"]
        );
        let seen = server.await.unwrap();
        assert!(
            seen[0]
                .query
                .contains("labelSelector=capyctl.io%2Finstance"),
            "{}",
            seen[0].query
        );
    }

    /// The engine Pods' API as the operator uses it, answered from what it holds (calls may
    /// interleave): the list, the create (the Pod gets a UID and is sent on `created`), the
    /// delete (the name is sent on `deleted`), the CR and the Host.
    fn pods_api(
        api: mock::MockApi,
        created: tokio::sync::mpsc::UnboundedSender<serde_json::Value>,
        deleted: tokio::sync::mpsc::UnboundedSender<String>,
    ) -> tokio::task::JoinHandle<Vec<mock::Seen>> {
        let mut held: BTreeMap<String, serde_json::Value> = BTreeMap::new();
        api.serve_with(move |call| {
            let (status, body) = match (call.method.clone(), call.path.as_str()) {
                (Method::GET, PODS) => (200, list(held.values().cloned().collect())),
                (Method::POST, PODS) => {
                    let mut pod = call.body.clone();
                    let name = pod["metadata"]["name"].as_str().unwrap().to_string();
                    pod["metadata"]["uid"] = format!("uid-{name}").into();
                    pod["metadata"]["namespace"] = "capyctl".into();
                    held.insert(name, pod.clone());
                    let _ = created.send(pod.clone());
                    (201, pod)
                }
                (Method::DELETE, p) if p.starts_with(PODS) => {
                    let name = p.rsplit('/').next().unwrap().to_string();
                    let _ = deleted.send(name.clone());
                    (
                        200,
                        held.remove(&name).unwrap_or_else(|| serde_json::json!({})),
                    )
                }
                (Method::GET, CR) => (200, cr()),
                (Method::GET, HOST) => (200, host()),
                _ => panic!("unexpected call {call}"),
            };
            mock::Answer::Json { status, body }
        })
    }

    /// Issue 16, item 5, in Pod mode end to end (the operator's side over a real node agent
    /// with the Pod runtime, each on a scripted API server): the engine Pod never runs, and a
    /// stop (asked again while the start has not reached the agent, as the lifecycle does)
    /// answers promptly, the Pod is deleted and the start answers `cancelled`. Before: the
    /// agent's stop waited for the start, whose launch waited up to the ready timeout (1800 s)
    /// for the Pod, and the Pod was deleted only after that.
    #[tokio::test]
    async fn a_stop_ends_a_start_whose_pod_never_runs_and_deletes_the_pod() {
        use capyctl_node_agent::agent::AgentConfig;
        use capyctl_node_agent::inventory::NoGpus;
        use capyctl_node_agent::k8s::pods::PodRuntime;
        use capyctl_node_agent::spec::GpuOverride;

        let dir = capyctl_test_support::temp_dir("engines-pending");
        // The node agent's watch of its Pods: it lists the Pod the operator created, pending,
        // and then hears nothing (its deletion included).
        let (created_tx, mut created_rx) = tokio::sync::mpsc::unbounded_channel();
        let (service, mut agent_api) = mock::MockApi::pair();
        let agent_api = tokio::spawn(async move {
            let mut pod: serde_json::Value = created_rx.recv().await.unwrap();
            pod["status"] = serde_json::json!({"phase": "Pending"});
            let list = serde_json::json!({"apiVersion": "v1", "kind": "PodList",
                "metadata": {"resourceVersion": "10"}, "items": [pod]});
            agent_api
                .answer(Exchange::ok(Method::GET, PODS, list))
                .await;
            // Every later call (the watch) is held unanswered.
            let mut held = Vec::new();
            while let Some(call) = agent_api.next_call().await {
                held.push(call);
            }
        });
        let runtime = PodRuntime::new(
            kube::Client::new(service, "capyctl"),
            "capyctl",
            "gpu-1",
            &dir,
        )
        .unwrap();
        let mut config = AgentConfig::new(&dir);
        config.ready_timeout = Duration::from_secs(1800);
        let settings = HostSettings {
            gpus: Some(vec![GpuOverride {
                memory: 80 << 30,
                unified: false,
                uuid: None,
            }]),
            host_memory: Some(64 << 30),
            ..HostSettings::default()
        };
        let node_agent = capyctl_node_agent::LocalHostAgent::with_runtime(
            config,
            settings,
            Arc::new(NoGpus),
            Arc::new(runtime),
        );

        let (client, handle) = mock::client();
        let (deleted_tx, mut deleted) = tokio::sync::mpsc::unbounded_channel();
        let api = pods_api(handle, created_tx, deleted_tx);
        let mut host = HostSettings::default();
        host.vllm.command = vec!["/opt/vllm/bin/vllm".into()];
        let a = Arc::new(PodHostAgent::new(
            Arc::new(node_agent),
            client,
            "capyctl",
            EnginePodSettings::default(),
            host,
            "gpu-1",
        ));
        let start = tokio::spawn({
            let a = Arc::clone(&a);
            async move { a.start("01KDEP-0", &spec()).await }
        });
        let stopped = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match a.stop("01KDEP-0").await {
                    Err(AgentError::UnknownInstance { .. }) if !start.is_finished() => {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    other => return other,
                }
            }
        })
        .await
        .expect("the stop answers while the engine Pod is pending");
        stopped.unwrap();
        let started = tokio::time::timeout(Duration::from_secs(5), start)
            .await
            .expect("the start has answered")
            .unwrap();
        assert!(
            matches!(started, Err(AgentError::Cancelled { what: "start", .. })),
            "{started:?}"
        );
        assert_eq!(deleted.recv().await.as_deref(), Some("chat-a-0-g1"));
        assert!(a.names().is_empty());
        api.abort();
        agent_api.abort();
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn the_launch_follows_the_parkability() {
        assert_eq!(
            launch_for(&Ok(ParkChoice::Park(ParkTier::Deep))),
            LaunchParking {
                may_park: true,
                host_ram: false
            }
        );
        assert_eq!(
            launch_for(&Ok(ParkChoice::Stop(NoParkReason::RestartOnly))),
            LaunchParking::default()
        );
        assert_eq!(
            deployment_selector("chat-a"),
            "capyctl.io/deployment=chat-a"
        );
    }
}
