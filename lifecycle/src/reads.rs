//! Reads: snapshots copied under the read lock, views built outside it (`deployment get/list`,
//! `engine list`, `hosts`, the load read).

use std::ops::{Bound, Range};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;

use capyctl_interfaces::router::LoadFigures;
use capyctl_spec::api::{DeploymentList, DeploymentLoadView, DeploymentView, LoadReport};
use capyctl_spec::errors::ApiError;
use serde::Serialize;
use tokio::time::Instant;

use crate::errors::not_found;
use crate::state::{self, Dep, Host, Hosts};
use crate::{Core, views};

/// How many deployments a read copies per hold of the lock ([`Core::shots`]).
pub(crate) const SHOT_CHUNK: usize = 256;

/// How many calls to host agents a read (`engine list`, `hosts`) makes at once. Each node agent
/// is a machine of its own, and the process already holds a connection to each (its exits'
/// long poll, its samples' poll): with node agents 1 ms away, 10,000 hosts take some 10 round
/// trips (at 256, 40: over the lists' 100 ms goal; lifecycle/DESIGN.md, "Host calls of a read").
pub(crate) const HOST_CALLS_AT_ONCE: usize = 1024;

/// How many hosts' deployments the host view sums per hold of the lock.
pub(crate) const HOSTS_PER_HOLD: usize = 32;

impl Core {
    /// The adapters loaded on each instance, for a read's views.
    pub(crate) fn adapter_sets(&self) -> Arc<views::AdapterSets> {
        Arc::new(views::AdapterSets::new(self.adapters.loaded_on()))
    }

    /// The view of one deployment, if it exists.
    pub fn view(&self, name_or_id: &str) -> Option<DeploymentView> {
        let (d, hosts) = self.shot(name_or_id)?;
        Some(views::deployment_view(
            &d,
            &views::Ctx::new(&self.config, &hosts).with_adapters(self.adapter_sets()),
        ))
    }

    /// Every deployment as the views need it (by ID), and the hosts: copied under the read lock
    /// [`SHOT_CHUNK`] deployments at a time, the lock let go between chunks, so that a request
    /// or a switch waits for one chunk at most, never for a whole read. NB: so the copies are
    /// not of one instant; each deployment's is of one.
    pub(crate) fn shots(&self) -> (Vec<Vec<views::DepShot>>, Hosts) {
        let (all, hosts) = self.flat_shots();
        (views::group(all), hosts)
    }

    /// [`Core::shots`] in one vector: every instance in key order, each deployment's in index
    /// order ([`views::deployments`] yields them a deployment at a time).
    fn flat_shots(&self) -> (Vec<views::DepShot>, Hosts) {
        let mut all: Vec<views::DepShot> = Vec::new();
        let hosts = self.shot_chunks(|chunk, _, total| {
            all.reserve(total.saturating_sub(all.len()));
            all.append(chunk);
        });
        (all, hosts)
    }

    /// [`Core::shots`] a chunk at a time: `each` gets every chunk (in key order, each
    /// deployment's instances in index order: [`views::deployments`]; it may take the copies)
    /// once the lock is let go, with the hosts and the number of instances at the chunk's
    /// copy. A read that builds its views chunk by chunk keeps no copy of every deployment at
    /// once. A chunk holds whole deployments: every instance of each.
    fn shot_chunks(&self, each: impl FnMut(&mut Vec<views::DepShot>, &Hosts, usize)) -> Hosts {
        self.chunks(&mut Vec::with_capacity(SHOT_CHUNK), each)
    }

    /// [`Core::shot_chunks`] into any [`Chunk`] (the load read's is [`views::LoadChunk`]).
    fn chunks<C: Chunk>(
        &self,
        taken: &mut C,
        mut each: impl FnMut(&mut C, &Hosts, usize),
    ) -> Hosts {
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
                let mut refs: Vec<&Dep> = Vec::with_capacity(SHOT_CHUNK);
                while refs.len() < SHOT_CHUNK
                    && let Some((_, d)) = it.next()
                {
                    refs.push(d);
                }
                // NB (reads at scale): each deployment's memory asked for first, all of the
                // chunk's at once (see `views::fetch`, `Chunk::fetch`), then copied.
                taken.fetch(&refs);
                for d in refs {
                    taken.push(d, &hosts);
                }
                // The rest of the last deployment's instances (they follow it in key order).
                while let Some((_, d)) = it.peek()
                    && d.index > 0
                    && taken.last().is_some_and(|(id, _)| id == d.rec.id)
                {
                    taken.push(d, &hosts);
                    it.next();
                }
                after = it.peek().is_some().then(|| {
                    taken
                        .last()
                        .map(|(id, index)| state::unit_id(id, index))
                        .unwrap_or_default()
                });
                (hosts, total, it.peek().is_none())
            };
            taken.order();
            each(taken, &hosts, total);
            taken.clear();
            if last {
                return hosts;
            }
        }
    }

    /// Deployment `name_or_id` as the views need it (every instance, index 0 first), and the
    /// hosts.
    fn shot(&self, name_or_id: &str) -> Option<(Vec<views::DepShot>, Hosts)> {
        let mut units = Vec::new();
        let hosts = self.one(name_or_id, &mut units)?;
        Some((units, hosts))
    }

    /// Every instance of deployment `name_or_id` copied into `taken` under the read lock (in
    /// index order: [`Chunk::order`]), and the hosts; `None` when there is no such deployment.
    fn one<C: Chunk>(&self, name_or_id: &str, taken: &mut C) -> Option<Hosts> {
        let hosts = {
            let inner = self.owner.state();
            let d = inner.by_name_or_id(name_or_id)?;
            let hosts = Arc::clone(&inner.hosts);
            for u in inner.units_of(d.dep_id()) {
                taken.push(u, &hosts);
            }
            hosts
        };
        taken.order();
        Some(hosts)
    }

    /// The load read (`GET /metrics/load`): every deployment, or the one `key` names. Built
    /// from copies: of the lifecycle's deployments (see [`Core::chunks`]) and of the router's
    /// published loads (`Router::loads_in_order`, `Router::figures_of` for one, read without a
    /// turn of its task); one deployment's read copies one deployment and looks up one router
    /// entry.
    pub(crate) fn do_load(&self, key: Option<&str>) -> Result<LoadReport, ApiError> {
        self.load_at(key, views::now_ms())
    }

    /// [`Core::do_load`] at `now` (Unix ms).
    fn load_at(&self, key: Option<&str>, now: u64) -> Result<LoadReport, ApiError> {
        let mut deployments = Vec::new();
        self.load_views(key, true, |chunk, d, load, cx, total| {
            deployments.reserve_exact(total.saturating_sub(deployments.len()));
            deployments.push(views::load_view(chunk, d, load, cx, now));
        })?;
        Ok(load_report(now, deployments))
    }

    /// [`Core::do_load`]'s answer as the management listener sends it (its JSON, byte for
    /// byte), each deployment's view encoded as soon as it is built and then dropped: no
    /// vector of every view. A full read writes into the buffer the last one gave back
    /// ([`AnswerBuffer`]); a read by ID (some hundred bytes) into one of its own.
    pub(crate) fn do_load_json(&self, key: Option<&str>) -> Result<Bytes, ApiError> {
        self.load_json_at(key, views::now_ms())
    }

    /// [`Core::do_load_json`] at `now` (Unix ms).
    fn load_json_at(&self, key: Option<&str>, now: u64) -> Result<Bytes, ApiError> {
        let buffer = match key {
            None => self.load_buffer.take(),
            Some(_) => Vec::new(),
        };
        let mut body = JsonArrayBody::over(buffer, &load_report(now, Vec::new()))?;
        self.load_views(key, false, |chunk, d, load, cx, total| {
            body.push_with(total, |out| {
                views::write_load_view(out, chunk, d, load, cx, now);
                Ok(())
            });
        })?;
        let json = body.finish()?;
        Ok(match key {
            None => AnswerBuffer::answer(&self.load_buffer, json),
            Some(_) => Bytes::from(json),
        })
    }

    /// Each deployment's instances as the load read needs them ([`views::LoadChunk`]: every
    /// deployment in ID order, or the one `key` names; with their names where `names`), with
    /// the router's load of it and the read's context, handed to `each` with a bound on how
    /// many there are.
    fn load_views(
        &self,
        key: Option<&str>,
        names: bool,
        mut each: impl FnMut(
            &views::LoadChunk<'_>,
            &[views::LoadUnit],
            Option<&LoadFigures>,
            &views::Ctx<'_>,
            usize,
        ),
    ) -> Result<(), ApiError> {
        let router = self.router();
        let mut chunk = views::LoadChunk::new(&self.config, names);
        match key {
            Some(k) => {
                let hosts = self.one(k, &mut chunk).ok_or_else(|| not_found(k))?;
                let cx = views::Ctx::new(&self.config, &hosts).with_adapters(self.adapter_sets());
                if let Some(d) = chunk.deployments().next() {
                    let load = router.as_ref().and_then(|r| r.figures_of(chunk.id(&d[0])));
                    each(&chunk, d, load.as_ref(), &cx, 1);
                }
            }
            None => {
                // The router's loads in ID order, joined with the lifecycle's deployments (also
                // in ID order) in one pass; each chunk's views are built as it is copied.
                let mut loads = router.as_ref().map(|r| r.loads_in_order());
                // One read's chunks share its hosts: whether any is explicit is asked once.
                let mut explicit = None;
                let sets = self.adapter_sets();
                let mut write = |chunk: &views::LoadChunk<'_>, hosts: &Hosts, total| {
                    let any = *explicit.get_or_insert_with(|| views::any_host_explicit(hosts));
                    let cx = views::Ctx::with_explicit(&self.config, hosts, any)
                        .with_adapters(Arc::clone(&sets));
                    for d in chunk.deployments() {
                        let load = loads.as_mut().and_then(|l| l.get(chunk.id(&d[0])));
                        each(chunk, d, load, &cx, total);
                    }
                };
                if self.owner.state().deps.len() <= SHOT_CHUNK {
                    self.chunks(&mut chunk, |chunk, hosts, total| write(chunk, hosts, total));
                } else {
                    self.chunks_beside(chunk, names, write);
                }
            }
        }
        Ok(())
    }

    /// [`Core::chunks`] of the load read on a thread of its own while this one takes each
    /// chunk copied (`write`: the router's figures joined, the answer written), the two
    /// threads passing two buffers back and forth: a read of more than one chunk. Where no
    /// thread can be had, the two in turn on this one.
    ///
    /// NB (reads at scale): the copy under the lock (the lifecycle's side) and the join and
    /// the writing (the router's side and the JSON) were one thread's turns, each waiting for
    /// the other, at 100,000 deployments some 60 ms in a row; side by side they overlap. The
    /// copying thread holds the read lock only while it copies a chunk, as before, and waits for
    /// a free buffer with the lock let go; it ends with the read (scoped). A writer that panics
    /// drops the channels: the copying thread then hands nothing more over and runs out, and
    /// the panic is the read's.
    fn chunks_beside<'c>(
        &'c self,
        first: views::LoadChunk<'c>,
        names: bool,
        mut write: impl FnMut(&views::LoadChunk<'c>, &Hosts, usize),
    ) {
        std::thread::scope(|scope| {
            // Made in the scope: if the writer panics, they are dropped before the scope waits
            // for the copying thread, which then ends instead of waiting on them.
            let (full_tx, full_rx) = std::sync::mpsc::sync_channel(1);
            let (spare_tx, spare_rx) = std::sync::mpsc::sync_channel(1);
            let _ = spare_tx.send(views::LoadChunk::new(&self.config, names));
            let copying = std::thread::Builder::new()
                .name("capyctl-load-read".into())
                .spawn_scoped(scope, move || {
                    let mut taken = first;
                    let mut writer_gone = false;
                    self.chunks(&mut taken, |taken, hosts, total| {
                        if writer_gone {
                            return;
                        }
                        match spare_rx.recv() {
                            Ok(spare) => {
                                let full = std::mem::replace(taken, spare);
                                writer_gone =
                                    full_tx.send((full, Arc::clone(hosts), total)).is_err();
                            }
                            Err(_) => writer_gone = true,
                        }
                    });
                });
            if copying.is_err() {
                // No thread to be had: the copy and the writing in turn, as for one chunk.
                let mut taken = views::LoadChunk::new(&self.config, names);
                self.chunks(&mut taken, |chunk, hosts, total| write(chunk, hosts, total));
                return;
            }
            for (mut chunk, hosts, total) in full_rx.iter() {
                write(&chunk, &hosts, total);
                chunk.clear();
                let _ = spare_tx.send(chunk);
            }
        });
    }

    /// `GET /deployments`: every deployment's view, by name.
    pub(crate) fn do_list(&self) -> DeploymentList {
        let (shots, order, hosts) = self.listed();
        let cx = views::Ctx::new(&self.config, &hosts).with_adapters(self.adapter_sets());
        DeploymentList {
            deployments: order
                .into_iter()
                .map(|r| views::deployment_view(&shots[r], &cx))
                .collect(),
        }
    }

    /// Every deployment's snapshots ([`Core::flat_shots`]), the ranges of each deployment's
    /// in the order the list shows them (by name), and the hosts.
    pub(crate) fn listed(&self) -> (Vec<views::DepShot>, Vec<Range<usize>>, Hosts) {
        let (shots, hosts) = self.flat_shots();
        let mut order = Vec::new();
        let mut at = 0;
        for d in views::deployments(&shots) {
            order.push(at..at + d.len());
            at += d.len();
        }
        // Stable, from ID order, as the views were sorted (a name is one deployment's). NB
        // (reads at scale): each compared with its name's first bytes kept beside its range
        // ([`name_prefix`]), the names themselves read only where those are equal: comparing
        // the names alone read two separate allocations per compare, and 100,000 deployments
        // sorted so cost more than building their views.
        let mut keyed: Vec<(u128, Range<usize>)> = order
            .into_iter()
            .map(|r| (name_prefix(shots[r.start].name()), r))
            .collect();
        keyed.sort_by(|(pa, a), (pb, b)| {
            pa.cmp(pb)
                .then_with(|| shots[a.start].name().cmp(shots[b.start].name()))
        });
        let order = keyed.into_iter().map(|(_, r)| r).collect();
        (shots, order, hosts)
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

/// What [`Core::chunks`] copies deployments into under the lock, a chunk at a time (the
/// snapshots' `Vec<DepShot>`, the load read's [`views::LoadChunk`]).
pub(crate) trait Chunk {
    /// Asks for the memory [`Chunk::push`] will read of `deps` without using it (see
    /// [`views::fetch`]).
    fn fetch(&self, deps: &[&Dep]) {
        for d in deps {
            views::fetch(d);
        }
    }
    /// Instance `d` added, as of the read's `hosts`.
    fn push(&mut self, d: &Dep, hosts: &Hosts);
    /// The last instance added: its deployment's ID and its index.
    fn last(&self) -> Option<(&str, u32)>;
    /// Each deployment's instances (added in key order) put in index order.
    fn order(&mut self);
    fn clear(&mut self);
}

impl Chunk for Vec<views::DepShot> {
    fn push(&mut self, d: &Dep, _: &Hosts) {
        Vec::push(self, views::DepShot::of(d));
    }

    fn last(&self) -> Option<(&str, u32)> {
        self.as_slice()
            .last()
            .map(|t| (t.fixed.id(), t.fixed.index))
    }

    fn order(&mut self) {
        views::order_instances(self);
    }

    fn clear(&mut self) {
        Vec::clear(self);
    }
}

/// The first 16 bytes of `name`, big-endian, zeros after a shorter name: two names' prefixes
/// compare as the names do, or are equal (names hold no zero byte), where the names must be
/// compared.
fn name_prefix(name: &str) -> u128 {
    let mut bytes = [0u8; 16];
    let n = name.len().min(16);
    bytes[..n].copy_from_slice(&name.as_bytes()[..n]);
    u128::from_be_bytes(bytes)
}

fn load_report(now: u64, deployments: Vec<DeploymentLoadView>) -> LoadReport {
    LoadReport {
        observed_at_ms: now,
        stale_after_ms: capyctl_spec::api::STALE_AFTER_MS,
        deployments,
    }
}

/// A JSON body whose last field is an array, written an element at a time: the body's own
/// encoding with the array empty (`…[]}`), the elements' (`serde_json`, as the listener
/// encodes a whole body) put between the brackets. So the bytes are those of the body with
/// the array filled, without a vector of every element.
struct JsonArrayBody {
    out: Vec<u8>,
    /// `]}`: what follows the array.
    tail: Vec<u8>,
    /// Bytes before the first element.
    head: usize,
    count: usize,
    failed: Option<serde_json::Error>,
}

impl JsonArrayBody {
    /// After how many elements the buffer is sized for every element (from their mean).
    const SIZED_AFTER: usize = 64;

    /// Around `empty`, a body whose last field is an empty array, written into `buffer`
    /// (cleared first; its memory kept).
    fn over<T: Serialize>(mut buffer: Vec<u8>, empty: &T) -> Result<Self, ApiError> {
        let (head, tail) = crate::lists::array_ends(empty)?;
        buffer.clear();
        buffer.extend_from_slice(&head);
        let out = buffer;
        Ok(JsonArrayBody {
            head: out.len(),
            out,
            tail,
            count: 0,
            failed: None,
        })
    }

    /// Appends the element `write` appends to the buffer (its JSON, whole); `total` bounds how
    /// many elements there are (to size the buffer once).
    fn push_with(
        &mut self,
        total: usize,
        write: impl FnOnce(&mut Vec<u8>) -> Result<(), serde_json::Error>,
    ) {
        if self.failed.is_some() {
            return;
        }
        if self.count > 0 {
            self.out.push(b',');
        }
        if let Err(e) = write(&mut self.out) {
            self.failed = Some(e);
            return;
        }
        self.count += 1;
        if self.count == Self::SIZED_AFTER {
            let mean = (self.out.len() - self.head) / self.count + 1;
            self.out
                .reserve(mean.saturating_mul(total.saturating_sub(self.count)) + self.tail.len());
        }
    }

    fn finish(mut self) -> Result<Vec<u8>, ApiError> {
        if let Some(e) = self.failed {
            return Err(cannot_encode(e));
        }
        self.out.extend_from_slice(&self.tail);
        Ok(self.out)
    }
}

/// The full load read's answer buffer, kept from one read for the next (`Core::load_buffer`):
/// at most one spare, of at most about twice the answer it held, dropped by the owner's tick
/// once [`AnswerBuffer::KEPT_FOR`] has passed without a full read giving it back.
///
/// NB (reads at scale): 100,000 deployments' answer is some 35 MB, and glibc maps every
/// allocation over 32 MiB afresh (the kernel zeroing each page at its first write, then
/// unmapping it all when the answer is dropped): a third of the read's time at that size. A
/// read takes the spare ([`AnswerBuffer::take`], or a new vector while another read holds it)
/// and answers [`Bytes`] whose owner gives the buffer back when the last of them is dropped
/// (the listener has sent it): the next read writes over pages already there. A buffer is
/// cleared when taken, so what one read left in it (a write cut short by a panic, which
/// drops the buffer anyway) is never another's; the lock is held only to take or put it.
#[derive(Debug, Default)]
pub(crate) struct AnswerBuffer {
    /// The buffer given back, and when.
    spare: Mutex<Option<(Vec<u8>, Instant)>>,
}

impl AnswerBuffer {
    /// How long a spare is kept without a full read giving it back: a one-off read at
    /// 100,000 does not hold its 35 MB for the rest of the process's life.
    pub(crate) const KEPT_FOR: Duration = Duration::from_secs(60);

    /// The spare (cleared), or a new vector when there is none.
    fn take(&self) -> Vec<u8> {
        let mut buffer = self.slot().take().map(|(b, _)| b).unwrap_or_default();
        buffer.clear();
        buffer
    }

    /// `json` as the answer's bytes, whose owner gives `json`'s buffer back to `home` when they
    /// are dropped.
    fn answer(home: &Arc<AnswerBuffer>, json: Vec<u8>) -> Bytes {
        Bytes::from_owner(Answer {
            json,
            home: Arc::clone(home),
        })
    }

    /// Keeps `buffer` as the spare at `now`, unless there is one already or it is over twice
    /// the size of what it held (the answers have shrunk: the next read sizes its own).
    fn give_back(&self, buffer: Vec<u8>, now: Instant) {
        if buffer.capacity() == 0 || buffer.capacity() > 2 * buffer.len() + (64 << 10) {
            return;
        }
        let mut slot = self.slot();
        if slot.is_none() {
            *slot = Some((buffer, now));
        }
    }

    /// Drops the spare if it was given back [`AnswerBuffer::KEPT_FOR`] or longer before `now`
    /// (the owner's tick): on a blocking thread where there is a runtime, since freeing some
    /// 35 MB (unmapping its pages) is not work for the owner's task, whose jobs a switch waits
    /// on.
    pub(crate) fn expire(&self, now: Instant) {
        let old = {
            let mut slot = self.slot();
            if slot
                .as_ref()
                .is_some_and(|(_, at)| now.saturating_duration_since(*at) >= Self::KEPT_FOR)
            {
                slot.take()
            } else {
                None
            }
        };
        if let Some(old) = old {
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => drop(runtime.spawn_blocking(move || drop(old))),
                Err(_) => drop(old),
            }
        }
    }

    fn slot(&self) -> MutexGuard<'_, Option<(Vec<u8>, Instant)>> {
        self.spare.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A full load read's answer: the owner of its [`Bytes`], which gives the buffer back.
struct Answer {
    json: Vec<u8>,
    home: Arc<AnswerBuffer>,
}

impl AsRef<[u8]> for Answer {
    fn as_ref(&self) -> &[u8] {
        &self.json
    }
}

impl Drop for Answer {
    fn drop(&mut self) {
        self.home
            .give_back(std::mem::take(&mut self.json), Instant::now());
    }
}

pub(crate) fn cannot_encode(e: serde_json::Error) -> ApiError {
    ApiError::Internal {
        detail: format!("cannot serialize the answer: {e}"),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Arc;
    use std::time::Duration;

    use capyctl_router::config::RouterConfig;
    use capyctl_spec::api::StartRequest;
    use capyctl_spec::documents::parse_deployment_str;

    use crate::api::ManagementApi;
    use crate::{Core, LifecycleConfig};

    const GIB: u64 = 1 << 30;

    /// Names compared by their prefixes first, then whole, sort as the names do: apart
    /// within 16 bytes, past them, and one the other's start.
    #[test]
    fn names_sort_by_their_prefixes_as_by_themselves() {
        let mut names = vec![
            "model-00002",
            "model-0000",
            "a-very-long-model-name-2",
            "a-very-long-model-name-10",
            "a-very-long-model-name",
            "a-very-long-mode",
            "a-very-long-model",
            "b",
            "a",
            "model-00001",
        ];
        let mut by_prefix = names.clone();
        by_prefix.sort_by(|a, b| {
            super::name_prefix(a)
                .cmp(&super::name_prefix(b))
                .then_with(|| a.cmp(b))
        });
        names.sort();
        assert_eq!(by_prefix, names);
        for w in names.windows(2) {
            assert!(
                super::name_prefix(w[0]) <= super::name_prefix(w[1]),
                "{w:?}"
            );
        }
    }

    /// `a` and `b` are the same bytes; else where they part, with a little of each.
    fn same_bytes(a: &[u8], b: &[u8], what: &str) {
        if a == b {
            return;
        }
        let at = a.iter().zip(b).take_while(|(x, y)| x == y).count();
        let near = |v: &[u8]| {
            String::from_utf8_lossy(&v[at.saturating_sub(80)..(at + 80).min(v.len())]).into_owned()
        };
        panic!(
            "{what}: {} and {} bytes, apart from byte {at}:\n{}\n{}",
            a.len(),
            b.len(),
            near(a),
            near(b)
        );
    }

    /// `json` with every `"sampled_at_ms":N` written `"sampled_at_ms":0`.
    fn unstamped(json: &[u8]) -> Vec<u8> {
        let key = b"\"sampled_at_ms\":";
        let mut out = Vec::with_capacity(json.len());
        let mut rest = json;
        while let Some(i) = rest.windows(key.len()).position(|w| w == key) {
            out.extend_from_slice(&rest[..i + key.len()]);
            out.push(b'0');
            rest = &rest[i + key.len()..];
            let digits = rest.iter().take_while(|c| c.is_ascii_digit()).count();
            rest = &rest[digits..];
        }
        out.extend_from_slice(rest);
        out
    }

    /// The JSON the listener sends (`load_json`, `list_json`, written a view at a time) is, byte
    /// for byte, that of the typed answers (`load`, `list`) encoded whole: over several
    /// chunks of snapshots, deployments with up to 12 instances (whose keys sort `-1`, `-10`,
    /// `-11`, `-2`, ...), ready, parked, stopped by the operator and never started, with the
    /// router's loads and the host's samples.
    #[tokio::test]
    async fn the_encoded_reads_are_the_typed_ones_byte_for_byte() {
        let host = Arc::new(
            capyctl_test_support::FakeHost::new()
                .with_gpus(16)
                .with_gpu(64 * GIB),
        );
        let server = Core::open(
            host.clone(),
            Arc::new(crate::store::MemoryStore::default()),
            LifecycleConfig::new("h"),
        )
        .await
        .unwrap();
        let router = capyctl_router::coordinator::Coordinator::spawn(
            server.clone(),
            RouterConfig::default(),
        );
        server.attach_router(Arc::new(router.clone())).await;
        let n = super::SHOT_CHUNK + 80;
        for i in 0..n {
            let replicas = match i % 97 {
                0 => "replicas: 12\n",
                1 => "replicas: 3\n",
                _ => "",
            };
            let text = format!(
                "name: m-{:04}\nengine: vllm\nmodel: m\nresources: {{gpu_memory: 1GiB}}\n{replicas}",
                (i * 7919) % 10_000
            );
            server
                .deploy(parse_deployment_str("t.yaml", &text).unwrap())
                .await
                .unwrap();
        }
        let names: Vec<String> = server
            .list()
            .await
            .deployments
            .into_iter()
            .map(|d| d.name)
            .collect();
        let wait = StartRequest {
            evict: false,
            wait: true,
        };
        for name in names.iter().step_by(37) {
            server.start(name, wait).await.unwrap();
        }
        server.stop(&names[37]).await.unwrap();
        server.park(&names[74]).await.unwrap();
        let _ = server
            .wait_for_state(
                &names[74],
                &[capyctl_spec::InstanceState::Parked],
                Duration::from_secs(10),
            )
            .await;

        // Samples for the ready instances' engines.
        for d in server.list().await.deployments {
            for i in d.instances {
                host.set_engine_waiting(&i.instance_id, 3);
            }
        }

        let typed = serde_json::to_vec(&server.list().await).unwrap();
        same_bytes(&server.list_json().await.unwrap(), &typed, "list");
        assert!(typed.len() > 500 * n, "{} bytes", typed.len());

        let now = crate::views::now_ms();
        for key in [None, Some(names[0].as_str()), Some(names[74].as_str())] {
            // The simulated host stamps each sample with its clock when it is asked (during
            // the read, not at `now`): that figure alone is left out of the comparison.
            let typed = serde_json::to_vec(&server.load_at(key, now).unwrap()).unwrap();
            let json = server.load_json_at(key, now).unwrap();
            same_bytes(&unstamped(&json), &unstamped(&typed), &format!("{key:?}"));
        }
        let all = server.load_at(None, now).unwrap();
        assert_eq!(all.deployments.len(), n);
        assert!(all.deployments.iter().any(|d| d.instances.len() == 12));
        assert!(
            all.deployments
                .iter()
                .flat_map(|d| &d.instances)
                .any(|i| i.sample.is_some())
        );
        // One unknown is refused the same way by both.
        assert_eq!(
            server.load_json(Some("no-such")).await.unwrap_err().code(),
            server.load(Some("no-such")).await.unwrap_err().code()
        );
    }
    /// A full load read of more than one chunk copies on a thread of its own
    /// ([`Core::chunks_beside`]): every deployment is handed over once, in ID order, and a
    /// writer that panics ends the read with its panic (the copying thread is not left waiting).
    #[tokio::test]
    async fn a_read_copied_beside_hands_every_chunk_over_in_order_and_ends_on_a_panic() {
        let n = 2 * super::SHOT_CHUNK + 7;
        let server = core_of(n).await;
        let mut ids = Vec::new();
        let first = crate::views::LoadChunk::new(&server.config, false);
        server.chunks_beside(first, false, |chunk, _, total| {
            assert_eq!(total, n);
            ids.extend(chunk.deployments().map(|d| chunk.id(&d[0]).to_string()));
        });
        assert_eq!(ids.len(), n);
        assert!(ids.is_sorted(), "in ID order");
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let first = crate::views::LoadChunk::new(&server.config, false);
            let mut chunks = 0;
            server.chunks_beside(first, false, |_, _, _| {
                chunks += 1;
                assert!(chunks < 2, "the writer fails at its second chunk");
            });
        }));
        assert!(panicked.is_err());
    }

    /// A core of `n` deployments (no router, no samples: its load read's bytes stay the same
    /// from one read to the next).
    async fn core_of(n: usize) -> Arc<Core> {
        let server = Core::open(
            Arc::new(capyctl_test_support::FakeHost::new().with_gpu(64 * GIB)),
            Arc::new(crate::store::MemoryStore::default()),
            LifecycleConfig::new("h"),
        )
        .await
        .unwrap();
        for i in 0..n {
            let text = format!(
                "name: m-{i:04}\nengine: vllm\nmodel: m\nresources: {{gpu_memory: 1GiB}}\n"
            );
            server
                .deploy(parse_deployment_str("t.yaml", &text).unwrap())
                .await
                .unwrap();
        }
        server
    }

    /// A full load read writes into the buffer the last one gave back: once the first answer
    /// is dropped the second shares its allocation, byte for byte the typed answer; reads at
    /// once each get a buffer of their own and the right answer; a buffer given back dirty,
    /// or a write into one cut short by a panic, never shows in a later answer.
    #[tokio::test]
    async fn a_full_load_read_reuses_the_buffer_the_last_gave_back() {
        let server = core_of(2 * super::SHOT_CHUNK + 7).await;
        let now = crate::views::now_ms();
        let typed = serde_json::to_vec(&server.load_at(None, now).unwrap()).unwrap();
        // A read, dropped, then another: each byte for byte the typed answer, the second in
        // the first's buffer.
        let twice = |what: &str| {
            let first = server.load_json_at(None, now).unwrap();
            same_bytes(&first, &typed, what);
            let at = first.as_ptr();
            drop(first);
            let second = server.load_json_at(None, now).unwrap();
            same_bytes(&second, &typed, what);
            assert_eq!(
                second.as_ptr(),
                at,
                "{what}: the second in the first's buffer"
            );
            second
        };

        let second = twice("first");
        let at = second.as_ptr();
        // While `second` is held, another read has a buffer of its own.
        let third = server.load_json_at(None, now).unwrap();
        same_bytes(&third, &typed, "third");
        assert_ne!(third.as_ptr(), at);
        // So have reads at once, on threads of their own, each answered whole.
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    for _ in 0..5 {
                        same_bytes(&server.load_json_at(None, now).unwrap(), &typed, "at once");
                    }
                });
            }
        });
        drop((second, third));

        // A buffer given back full of something else: cleared when taken.
        let mut dirty = server.load_buffer.take();
        dirty.clear();
        dirty.resize(typed.len() + 100, b'x');
        let at = dirty.as_ptr();
        server
            .load_buffer
            .give_back(dirty, tokio::time::Instant::now());
        let after_dirty = server.load_json_at(None, now).unwrap();
        same_bytes(&after_dirty, &typed, "after a dirty buffer");
        assert_eq!(after_dirty.as_ptr(), at);
        drop(after_dirty);

        // A write cut short by a panic: its buffer is dropped with it, the next read answers
        // whole in a buffer of its own, and the one after that reuses it again.
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let taken = server.load_buffer.take();
            let mut body =
                super::JsonArrayBody::over(taken, &super::load_report(now, Vec::new())).unwrap();
            body.push_with(10, |out| {
                out.extend_from_slice(b"{\"half\":");
                panic!("a write that fails half-way");
            });
        }));
        assert!(panicked.is_err());
        let again = twice("after a panic");
        let at = again.as_ptr();

        // A read by ID neither takes the spare nor gives its own back.
        drop(again);
        let one = server.load_json(Some("m-0003")).await.unwrap();
        assert_ne!(one.as_ptr(), at);
        let last = server.load_json_at(None, now).unwrap();
        assert_eq!(last.as_ptr(), at);
    }

    /// One spare at most, of at most about twice the answer it held, dropped once it has not
    /// been given back for `KEPT_FOR`.
    #[test]
    fn the_spare_is_one_buffer_kept_a_while() {
        use tokio::time::Instant;
        let spare = super::AnswerBuffer::default();
        let t0 = Instant::now();
        let kept = super::AnswerBuffer::KEPT_FOR;
        let a = vec![b'a'; 1000];
        let at = a.as_ptr();
        spare.give_back(a, t0);
        // A second one while one is kept is dropped.
        spare.give_back(vec![b'b'; 1000], t0);
        spare.expire(t0 + kept - Duration::from_millis(1));
        let taken = spare.take();
        assert_eq!((taken.as_ptr(), taken.len()), (at, 0), "the first, cleared");
        spare.give_back(taken, t0);
        spare.expire(t0 + kept);
        assert_eq!(spare.take().capacity(), 0, "gone after KEPT_FOR");
        // One far larger than what it held is not kept.
        let mut big = Vec::with_capacity(1 << 20);
        big.extend_from_slice(&[b'c'; 1000]);
        spare.give_back(big, t0);
        assert_eq!(spare.take().capacity(), 0);
    }

    /// The owner's tick drops the spare once a minute has passed without a full read (on
    /// tokio's paused clock).
    #[tokio::test(start_paused = true)]
    async fn the_tick_drops_a_spare_unused_for_a_minute() {
        let server = core_of(3).await;
        drop(server.load_json(None).await.unwrap());
        let has_spare = || server.load_buffer.slot().is_some();
        assert!(has_spare());
        tokio::time::sleep(super::AnswerBuffer::KEPT_FOR - Duration::from_secs(2)).await;
        assert!(has_spare(), "kept within the minute");
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert!(!has_spare(), "dropped by a tick after it");
    }
}
