//! Opening the server on its hosts, hosts joining ([`Core::upsert_host`]) and coming back
//! (resync), each host's engine exits forwarded to the owner.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use capyctl_interfaces::HostAgent;
use capyctl_interfaces::agent::{AgentHealth, EngineExit};
use capyctl_interfaces::measure::Measurement;
use capyctl_interfaces::spec::InstanceSpec;
use capyctl_spec::documents::DeploymentDoc;
use capyctl_spec::errors::ApiError;
use futures_util::StreamExt;
use tokio::sync::{broadcast, mpsc, watch};
use tokio::time::Instant;

use crate::config::{HostEntry, LifecycleConfig};
use crate::errors::{CoreError, internal};
use crate::names::NameCache;
use crate::state::{self, Dep, Host, Hosts, State};
use crate::store::Store;
use crate::switches::SwitchLog;
use crate::{Core, owner};

/// A host's agent's answers when it is added ([`Core::fetch_host`]).
struct FetchedHost {
    entry: HostEntry,
    inventory: capyctl_interfaces::inventory::Inventory,
    report: capyctl_interfaces::agent::RecoveryReport,
}

/// How many hosts [`Core::open_hosts`] asks for their inventory and recovery report at once
/// (10,000 hosts a millisecond away, one at a time, took 23 s to open).
const HOSTS_OPENED_AT_ONCE: usize = 256;

/// How many deployments [`Core::open_hosts`] measures at once.
pub(crate) const MEASURE_AT_ONCE: usize = 16;

impl Core {
    /// Opens the server on one host (standalone; `config.host_*` describe it): see
    /// [`Core::open_hosts`]. No other host ever joins: a deployment needing more GPU memory
    /// than this one has is refused at deploy.
    pub async fn open(
        agent: Arc<dyn HostAgent>,
        store: Arc<dyn Store>,
        config: LifecycleConfig,
    ) -> Result<Arc<Core>, CoreError> {
        let host = config.own_host(agent);
        Self::open_fixed_hosts(vec![host], store, config).await
    }

    /// [`Core::open_hosts`] for hosts that are all known now and never join later
    /// (standalone, with its own host and the node agents it was given): a deployment that fits
    /// none of them is refused at deploy.
    pub async fn open_fixed_hosts(
        hosts: Vec<HostEntry>,
        store: Arc<dyn Store>,
        config: LifecycleConfig,
    ) -> Result<Arc<Core>, CoreError> {
        let server = Self::open_hosts(hosts, store, config).await?;
        server.hosts_fixed.store(true, Ordering::Relaxed);
        Ok(server)
    }

    /// Opens the server: loads the stored deployments, then for each host reads its
    /// inventory and recovers the engines a previous run left there (adopted ones come back
    /// ready or parked and are announced once a router is attached; unknown ones are
    /// stopped), then measures each deployment.
    pub async fn open_hosts(
        hosts: Vec<HostEntry>,
        store: Arc<dyn Store>,
        config: LifecycleConfig,
    ) -> Result<Arc<Core>, CoreError> {
        let mut inner = State {
            host_id: config.host_id.clone(),
            ..State::default()
        };
        for rec in store.load()? {
            inner.insert(Dep::new(rec, Instant::now()));
        }
        inner.deps.pack();
        let switches = Arc::new(match &config.switch_log {
            Some(path) => SwitchLog::open(path, Arc::clone(&config.metrics))?,
            None => SwitchLog::in_memory(Arc::clone(&config.metrics)),
        });
        let changes = Arc::new(watch::channel(0).0);
        let (closed, _) = watch::channel(false);
        let (exits_tx, exits_rx) = mpsc::channel(256);
        let server = Arc::new_cyclic(|me: &Weak<Core>| {
            let owner = owner::Owner::spawn(
                inner,
                Arc::clone(&changes),
                exits_rx,
                config.timer_tick,
                me.clone(),
                closed.subscribe(),
            );
            Core {
                owner,
                timers_running: Arc::new(AtomicBool::new(false)),
                scaling: Arc::new(AtomicBool::new(false)),
                below_since: Mutex::new(HashMap::new()),
                config,
                exits_tx,
                store,
                host_exits: Mutex::new(HashMap::new()),
                persist: Arc::new(Mutex::new(())),
                router: Mutex::new(None),
                uses: state::RouterUses::default(),
                names: NameCache::new(changes.subscribe()),
                changes,
                closed,
                ready: AtomicBool::new(false),
                hosts_fixed: AtomicBool::new(false),
                next_id: AtomicU64::new(1),
                switches,
                planned: Mutex::new(HashMap::new()),
                me: me.clone(),
                adapters: crate::adapters::Adapters::new(Arc::new(crate::adapters::CoreEngines(
                    me.clone(),
                ))),
                load_buffer: Arc::default(),
            }
        });
        // Each host's inventory and recovery report are asked for concurrently (a node agent's
        // round trip each), a bounded number at once; the hosts are added in their order.
        let mut fetched = futures_util::stream::iter(hosts)
            .map(Self::fetch_host)
            .buffered(HOSTS_OPENED_AT_ONCE);
        while let Some(host) = fetched.next().await {
            server.apply_host(host?).await;
        }
        drop(fetched);
        let docs: Vec<(String, Arc<DeploymentDoc>)> = server.read(|inner| {
            inner
                .deps
                .values()
                // An adapter runs no engine of its own: nothing to measure.
                .filter(|d| d.rec.doc.adapter.is_none())
                .map(|d| (d.rec.id.clone(), Arc::clone(&d.rec.doc)))
                .collect()
        });
        // A few at a time: each is a call to a host agent (a blocking task of a local one).
        // Each spec is made as its call begins (the deployments keep none: `Dep::spec`).
        let measured: Vec<(String, Measurement)> = futures_util::stream::iter(docs)
            .map(|(id, doc)| {
                let server = &server;
                async move {
                    let agent = server.agent_of(&id).ok()?;
                    let spec = InstanceSpec::from_doc(id.clone(), &doc);
                    Some((id, agent.measure(&spec).await.unwrap_or_default()))
                }
            })
            .buffer_unordered(MEASURE_AT_ONCE)
            .filter_map(std::future::ready)
            .collect()
            .await;
        server
            .write(move |inner| inner.learn_measurements(measured, Instant::now()))
            .await;
        server.ready.store(true, Ordering::SeqCst);
        Ok(server)
    }

    /// Adds a host, or replaces the agent of a known one (a node agent that came back at
    /// another address): reads its inventory, then its recovery report, and reconciles the
    /// deployments with it: engines it holds are adopted (ready or parked), engines of unknown
    /// deployments (or of a deployment already running elsewhere) are stopped, and instances
    /// believed to be on this host that it no longer has are failed (the next request starts
    /// them afresh).
    pub async fn upsert_host(&self, host: HostEntry) -> Result<(), CoreError> {
        self.add_host(host).await
    }

    async fn add_host(&self, entry: HostEntry) -> Result<(), CoreError> {
        let fetched = Self::fetch_host(entry).await?;
        self.apply_host(fetched).await;
        Ok(())
    }

    /// The host agent's half of [`Core::add_host`]: its inventory, then its recovery report.
    async fn fetch_host(entry: HostEntry) -> Result<FetchedHost, CoreError> {
        let inventory = entry.agent.inventory().await?;
        let report = entry.agent.recover().await?;
        Ok(FetchedHost {
            entry,
            inventory,
            report,
        })
    }

    /// The lifecycle's half of [`Core::add_host`]: reconciles the deployments with what the
    /// host's agent answered.
    async fn apply_host(&self, fetched: FetchedHost) {
        let FetchedHost {
            entry:
                HostEntry {
                    id: host_id,
                    agent,
                    activation,
                    settings,
                    admission_window,
                    remote,
                },
            inventory,
            report,
        } = fetched;
        let capacity = inventory.gpus.iter().map(|g| g.total_bytes).sum();
        let host = Host {
            agent: agent.clone(),
            activation,
            settings,
            admission_window,
            remote,
            capacity,
            gpus: inventory.gpus,
        };
        let (adopted, stopped, gone) = (report.adopted, report.stopped, report.gone);
        if let Some(exits) = self.host_exits_of().remove(&host_id) {
            // The replaced agent's exits are no longer this host's.
            exits.abort();
        }
        let hid = host_id.clone();
        let state::Adoption {
            to_stop,
            came,
            lost,
        } = self
            .write(move |inner| inner.add_host(hid, host, &adopted))
            .await;
        for gone in stopped.iter().chain(gone.iter()) {
            tracing::info!(host = %host_id, instance = %gone, "an engine a previous run left is gone or did not answer");
        }
        for iid in to_stop {
            if let Err(e) = agent.stop(&iid).await {
                tracing::warn!(host = %host_id, instance = %iid, error = %e, "stopping a left engine failed");
            }
        }
        let exits = self.forward_exits(
            host_id.clone(),
            agent.subscribe_exits(),
            agent.subscribe_health(),
        );
        self.host_exits_of().insert(host_id.clone(), exits);
        self.flush_due().await;
        for key in lost {
            self.announce_gone(key).await;
        }
        for (key, addr) in came {
            self.announce_ready(key, addr).await;
        }
        if self.router().is_some() {
            self.memory_freed();
        }
    }

    /// Forwards `host`'s engine exits to the owner's task, until the server closes or the
    /// agent's channel does; follows the agent's health: reconciles the host again
    /// ([`Core::resync_host`]) each time its agent says it may have lost track of engines
    /// (`resyncs`: a node agent that restarted, or missed exits), and tells the views' readers
    /// (the status writer) when it becomes unreachable or answers again.
    fn forward_exits(
        &self,
        host: String,
        mut exits: broadcast::Receiver<EngineExit>,
        mut health: watch::Receiver<AgentHealth>,
    ) -> tokio::task::AbortHandle {
        let tx = self.exits_tx.clone();
        let mut closed = self.closed.subscribe();
        let me = self.me.clone();
        let mut health_open = true;
        let mut resyncs = health.borrow_and_update().resyncs;
        let task = tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = closed.changed() => return,
                    changed = health.changed(), if health_open => {
                        if changed.is_err() {
                            // An agent that never tells (in this process).
                            health_open = false;
                            continue;
                        }
                        let Some(server) = me.upgrade() else { return };
                        let now = health.borrow_and_update().resyncs;
                        if now == resyncs {
                            // Unreachable, or answering again: the views say so.
                            server.changes.send_modify(|n| *n = n.wrapping_add(1));
                            continue;
                        }
                        resyncs = now;
                        // Run apart and awaited: the reconciliation replaces this very task
                        // (it aborts it once the agent's report is in), which must not cut
                        // the reconciliation short.
                        let host = host.clone();
                        let _ = tokio::spawn(async move { server.resync_host(&host).await }).await;
                    }
                    exit = exits.recv() => match exit {
                        Ok(exit) => {
                            if tx.send((host.clone(), exit)).await.is_err() {
                                return;
                            }
                        }
                        Err(broadcast::error::RecvError::Lagged(n)) => {
                            tracing::warn!(%host, missed = n, "missed engine exit events");
                        }
                        Err(broadcast::error::RecvError::Closed) => return,
                    },
                }
            }
        });
        task.abort_handle()
    }

    /// Wakes `iid` on `agent` within the server's wake window when one is set (every host's
    /// wake then has the same bound, `server.switching.wake_timeout`), else the agent's own.
    pub(crate) async fn wake(
        &self,
        agent: &Arc<dyn HostAgent>,
        iid: &str,
    ) -> Result<capyctl_interfaces::agent::WakeReport, capyctl_interfaces::AgentError> {
        match self.config.wake_window {
            Some(window) => agent.wake_within(iid, window).await,
            None => agent.wake(iid).await,
        }
    }

    /// Reconciles host `host_id` with its agent again, as [`Core::upsert_host`] does with
    /// the agent it already has: what the agent still runs is adopted, instances it no longer
    /// has are failed (the router hears of both). Retried while the agent cannot answer
    /// (every second, then up to every 30 s), until it does or the host is replaced.
    async fn resync_host(&self, host_id: &str) {
        let mut pause = Duration::from_secs(1);
        let mut closed = self.closed.subscribe();
        loop {
            let Some(host) = self.read(|inner| inner.hosts.get(host_id).cloned()) else {
                return;
            };
            let entry = HostEntry {
                id: host_id.to_string(),
                agent: host.agent.clone(),
                activation: host.activation,
                settings: host.settings.clone(),
                admission_window: host.admission_window,
                remote: host.remote,
            };
            match self.add_host(entry).await {
                Ok(()) => {
                    tracing::info!(host = %host_id, "host reconciled again with its agent");
                    return;
                }
                Err(e) => {
                    tracing::warn!(host = %host_id, error = %e, "reconciling the host again failed; retrying");
                }
            }
            tokio::select! {
                _ = closed.changed() => return,
                () = tokio::time::sleep(pause) => {}
            }
            pause = (pause * 2).min(Duration::from_secs(30));
        }
    }

    /// Every host, by ID (shared: one `Arc` copied under the read lock).
    pub(crate) fn hosts_now(&self) -> Hosts {
        self.read(|inner| Arc::clone(&inner.hosts))
    }

    /// The agent of the host `id`'s instance is bound to; the first host's when it is bound
    /// to none (measurements, capability checks).
    pub(crate) fn agent_of(&self, id: &str) -> Result<Arc<dyn HostAgent>, ApiError> {
        self.read(|inner| {
            let host = inner.deps.get(id).and_then(|d| d.host.as_deref());
            host.and_then(|h| inner.hosts.get(h))
                .or_else(|| inner.hosts.values().next())
                .map(|h| h.agent.clone())
        })
        .ok_or_else(|| internal("no host is known"))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Arc;

    use crate::api::ManagementApi;

    #[tokio::test]
    async fn after_a_restart_every_instance_knows_its_deployments_measurement() {
        let store = Arc::new(crate::store::MemoryStore::default());
        let open = || async {
            crate::Core::open(
                Arc::new(capyctl_test_support::FakeHost::new().with_gpus(2)),
                store.clone(),
                crate::LifecycleConfig::new("h"),
            )
            .await
            .unwrap()
        };
        let doc = capyctl_spec::documents::parse_deployment_str(
            "t.yaml",
            "name: r\nengine: vllm\nmodel: m\nresources: {gpu_memory: 6GiB}\nreplicas: 2\n",
        )
        .unwrap();
        let id = open().await.deploy(doc).await.unwrap().deployment.id;
        let server = open().await;
        let known: Vec<Option<u64>> = server.read(|inner| {
            inner
                .units_of(&id)
                .map(|d| d.measurement.gpu_memory.map(|m| m.bytes))
                .collect()
        });
        assert_eq!(known, [Some(6 << 30), Some(6 << 30)]);
    }
}
