//! Reads: snapshots copied under the read lock, views built outside it (`deployment get/list`,
//! `engine list`, `hosts`, the load read).

use std::ops::Bound;
use std::sync::Arc;

use capyctl_spec::api::{DeploymentView, LoadReport};
use capyctl_spec::errors::ApiError;

use crate::errors::not_found;
use crate::state::{self, Host, Hosts};
use crate::{Server, views};

/// How many deployments a read copies per hold of the lock ([`Server::shots`]).
pub(crate) const SHOT_CHUNK: usize = 256;

/// How many calls to host agents a read (`engine list`, `hosts`) makes at once.
pub(crate) const HOST_CALLS_AT_ONCE: usize = 64;

/// How many hosts' deployments the host view sums per hold of the lock.
pub(crate) const HOSTS_PER_HOLD: usize = 32;

impl Server {
    /// The view of one deployment, if it exists.
    pub fn view(&self, name_or_id: &str) -> Option<DeploymentView> {
        let (d, hosts) = self.shot(name_or_id)?;
        Some(views::deployment_view(
            &d,
            &views::Ctx::new(&self.config, &hosts),
        ))
    }

    /// Every deployment as the views need it (by ID), and the hosts: copied under the read lock
    /// [`SHOT_CHUNK`] deployments at a time, the lock let go between chunks, so that a request
    /// or a switch waits for one chunk at most, never for a whole read. NB: so the copies are
    /// not of one instant; each deployment's is of one.
    pub(crate) fn shots(&self) -> (Vec<Vec<views::DepShot>>, Hosts) {
        let mut all: Vec<Vec<views::DepShot>> = Vec::new();
        let hosts = self.shot_chunks(|chunk, _, total| {
            all.reserve(total.saturating_sub(all.len()));
            all.append(chunk);
        });
        (all, hosts)
    }

    /// [`Server::shots`] a chunk at a time: `each` gets every chunk (in ID order; it may take
    /// the copies) once the lock is let go, with the hosts and the number of instances at
    /// the chunk's copy. A read that builds its views chunk by chunk keeps no copy of every
    /// deployment at once. A chunk holds whole deployments: every instance of each.
    fn shot_chunks(
        &self,
        mut each: impl FnMut(&mut Vec<Vec<views::DepShot>>, &Hosts, usize),
    ) -> Hosts {
        let mut taken: Vec<views::DepShot> = Vec::with_capacity(SHOT_CHUNK);
        let mut hosts: Option<Hosts> = None;
        let mut after: Option<String> = None;
        loop {
            let (hosts, total, last) = {
                let inner = self.owner.state();
                let hosts = Arc::clone(hosts.get_or_insert_with(|| Arc::clone(&inner.hosts)));
                let total = inner.deps.len();
                let from = after
                    .as_ref()
                    .map_or(Bound::Unbounded, |k| Bound::Excluded(k.as_str()));
                let mut it = inner
                    .deps
                    .range::<str, _>((from, Bound::Unbounded))
                    .peekable();
                while taken.len() < SHOT_CHUNK
                    && let Some((_, d)) = it.next()
                {
                    taken.push(views::DepShot::of(d));
                }
                // The rest of the last deployment's instances (they follow it in key order).
                while let Some((_, d)) = it.peek()
                    && d.index > 0
                    && taken.last().is_some_and(|t| t.fixed.id == d.rec.id)
                {
                    taken.push(views::DepShot::of(d));
                    it.next();
                }
                after = it.peek().is_some().then(|| {
                    let l = taken.last().map(|t| &t.fixed);
                    l.map(|f| state::unit_id(&f.id, f.index))
                        .unwrap_or_default()
                });
                (hosts, total, it.peek().is_none())
            };
            let mut chunk = views::group(std::mem::take(&mut taken));
            each(&mut chunk, &hosts, total);
            if last {
                return hosts;
            }
        }
    }

    /// Deployment `name_or_id` as the views need it (every instance, index 0 first), and the
    /// hosts.
    fn shot(&self, name_or_id: &str) -> Option<(Vec<views::DepShot>, Hosts)> {
        let inner = self.owner.state();
        let d = inner.by_name_or_id(name_or_id)?;
        let units = inner.units_of(d.dep_id()).map(views::DepShot::of).collect();
        Some((views::group(units).remove(0), Arc::clone(&inner.hosts)))
    }

    /// The load read (`GET /metrics/load`): every deployment, or the one `key` names. Built
    /// from snapshots: of the lifecycle (see [`Server::shots`]) and of the router (each
    /// deployment's published load, `Router::load_shared`, read without a turn of
    /// its task); one deployment's read copies one deployment and looks up one router entry.
    pub(crate) fn do_load(&self, key: Option<&str>) -> Result<LoadReport, ApiError> {
        let router = self.router();
        let now = views::now_ms();
        let deployments = match key {
            Some(k) => {
                let (d, hosts) = self.shot(k).ok_or_else(|| not_found(k))?;
                let load = router.as_ref().and_then(|r| r.load_shared(d[0].id()));
                let cx = views::Ctx::new(&self.config, &hosts);
                vec![views::load_view(&d, load.as_deref(), &cx, now)]
            }
            None => {
                // The router's loads in ID order, joined with the lifecycle's deployments (also
                // in ID order) in one pass; each chunk's views are built as it is copied.
                let mut loads = router.as_ref().map(|r| r.loads_in_order());
                let mut out = Vec::new();
                self.shot_chunks(|chunk, hosts, total| {
                    out.reserve_exact(total.saturating_sub(out.len()));
                    let cx = views::Ctx::new(&self.config, hosts);
                    out.extend(chunk.iter().map(|d| {
                        let load = loads.as_mut().and_then(|l| l.get(d[0].id()));
                        views::load_view(d, load.as_deref(), &cx, now)
                    }));
                });
                out
            }
        };
        Ok(LoadReport {
            observed_at_ms: now,
            stale_after_ms: capyctl_spec::api::STALE_AFTER_MS,
            deployments,
        })
    }

    /// What each of `hosts`' deployments hold (in the hosts' order), summed under the read lock from
    /// the by-host index a few hosts at a time.
    pub(crate) fn host_uses(&self, hosts: &Hosts) -> Vec<views::HostUse> {
        let all: Vec<(&String, &Arc<Host>)> = hosts.iter().collect();
        let mut used = Vec::with_capacity(all.len());
        for chunk in all.chunks(HOSTS_PER_HOLD) {
            let inner = self.owner.state();
            used.extend(
                chunk
                    .iter()
                    .map(|(id, h)| views::HostUse::of(h.capacity, inner.on_host(id))),
            );
        }
        used
    }
}
