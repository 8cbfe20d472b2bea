//! The load read's views (`GET /metrics/load`): each deployment's figures computed once
//! ([`LoadFigures`], [`InstanceFigures`]) and either built into the typed view ([`load_view`])
//! or written straight into the answer's JSON ([`write_load_view`], byte for byte
//! `serde_json`'s of the typed view).

use std::sync::Arc;

use capyctl_interfaces::launch::MaxRunning;
use capyctl_interfaces::router::LoadFigures as RouterFigures;
use capyctl_spec::InstanceState;
use capyctl_spec::api::{
    DeploymentLoadView, InstanceLoadView, MaxRunningView, RouterLoadView, SampleView,
};

use super::{Ctx, expected_max_running, sample_view, shown_state};
use crate::LifecycleConfig;
use crate::reads::Chunk;
use crate::state::{Dep, Hosts};

/// What the load read needs of one instance, copied under the lifecycle's lock
/// ([`Chunk::push`]), its texts in its chunk's [`LoadChunk::text`].
///
/// NB (reads at scale): no reference count is taken: a snapshot ([`super::DepShot`]) cloned
/// the deployment's `Arc`'d [`super::Fixed`] and its host's `Arc<str>`, and each of those
/// locked increments waited for its deployment's memory before the next deployment's could
/// be fetched (the snapshots were most of the lifecycle's share of a full load read). What
/// the read shows of the instance's host settings (its expected `max_running`) is found here
/// too, from the read's hosts: no agent is called under the lock.
#[derive(Debug)]
pub(crate) struct LoadUnit {
    /// Where its texts begin in [`LoadChunk::text`], then where each ends: its deployment's
    /// ID, its instance's ID, its load view's head ([`load_head`]), its host's ID (empty where
    /// the read knows no host), its deployment's name (typed reads only: empty otherwise).
    at: [u32; 6],
    index: u32,
    generation: u64,
    /// The state shown ([`shown_state`]).
    state: InstanceState,
    /// The read knows its host (or, where it has none, a first host: see [`Chunk::push`]).
    has_host: bool,
    /// The engine's own figure where it said (SGLang).
    own_max_running: Option<MaxRunning>,
    /// What CapyCTL passed or expects, with its host's settings.
    expected: MaxRunning,
}

/// The [`LoadUnit`]s of a chunk of deployments (every instance of each), and their texts.
pub(crate) struct LoadChunk<'c> {
    config: &'c LifecycleConfig,
    units: Vec<LoadUnit>,
    text: String,
    /// Keep each deployment's name (the typed read's view shows it; the JSON's head has it).
    names: bool,
}

impl<'c> LoadChunk<'c> {
    pub(crate) fn new(config: &'c LifecycleConfig, names: bool) -> Self {
        LoadChunk {
            config,
            units: Vec::new(),
            text: String::new(),
            names,
        }
    }

    /// Text `i` of `u` (see [`LoadUnit::at`]).
    fn part(&self, u: &LoadUnit, i: usize) -> &str {
        self.text
            .get(u.at[i] as usize..u.at[i + 1] as usize)
            .unwrap_or_default()
    }

    /// Its deployment's ID.
    pub(crate) fn id(&self, u: &LoadUnit) -> &str {
        self.part(u, 0)
    }

    fn same_deployment(&self, a: &LoadUnit, b: &LoadUnit) -> bool {
        b.index > 0 && self.id(a) == self.id(b)
    }

    /// The deployments of the chunk ([`Chunk::order`]ed): each one's instances, index 0
    /// first.
    pub(crate) fn deployments(&self) -> impl Iterator<Item = &[LoadUnit]> {
        self.units.chunk_by(|a, b| self.same_deployment(a, b))
    }
}

/// Filled by `Core::chunks` under the read lock, a chunk of deployments at a time.
impl Chunk for LoadChunk<'_> {
    /// NB (reads at scale): in three passes over the chunk, each one's loads independent
    /// across its deployments, so that they are in flight together: the `Dep`s' fields
    /// [`Chunk::push`] reads, then their `Fixed`s, then the texts it copies (a byte loaded in
    /// each 64 bytes of the instance's ID and the head, the first and the last) and the
    /// document's fields the expected `max_running` reads. (Not the snapshots' fetch,
    /// [`super::fetch`]: these passes load what it does, and it loads the document's JSON,
    /// which the load read does not copy.) One pass that followed each deployment's pointers in
    /// turn (the `Dep`, its `Fixed`, its texts) kept a few deployments' accesses in flight at once,
    /// and touched two of the texts' two to three cache lines: `perf` put most of `push` on
    /// the first reads of the texts and of the spec (now the document).
    fn fetch(&self, deps: &[&Dep]) {
        for d in deps {
            std::hint::black_box((
                d.state,
                d.rec.generation,
                Arc::as_ptr(&d.fixed),
                d.host.as_deref().map(str::len),
                d.max_running.is_some(),
            ));
        }
        for d in deps {
            let f = &*d.fixed;
            std::hint::black_box((f.index, f.ends, f.text.len()));
        }
        for d in deps {
            let f = &*d.fixed;
            for part in [f.instance_id(), f.load_head()] {
                let bytes = part.as_bytes();
                for at in (0..bytes.len()).step_by(64) {
                    // The byte itself, not its address: `black_box` of a reference reads nothing.
                    std::hint::black_box(bytes.get(at).copied());
                }
                std::hint::black_box(bytes.last().copied());
            }
            std::hint::black_box((f.doc.extra_args.len(), f.doc.max_concurrent_requests));
        }
    }

    /// Instance `d` added, as of the read's `hosts`.
    fn push(&mut self, d: &Dep, hosts: &Hosts) {
        let fixed = &*d.fixed;
        // The host of its instance, else the first host (one host in standalone).
        let host = d
            .host
            .as_deref()
            .and_then(|h| hosts.get_key_value(h))
            .or_else(|| hosts.iter().next());
        let mut at = [0u32; 6];
        let end = |text: &String| u32::try_from(text.len()).unwrap_or(u32::MAX);
        at[0] = end(&self.text);
        for (i, part) in [fixed.id(), fixed.instance_id()].into_iter().enumerate() {
            self.text.push_str(part);
            at[i + 1] = end(&self.text);
        }
        self.text.push_str(fixed.load_head());
        at[3] = end(&self.text);
        self.text.push_str(host.map_or("", |(id, _)| id.as_str()));
        at[4] = end(&self.text);
        if self.names {
            self.text.push_str(fixed.name());
        }
        at[5] = end(&self.text);
        self.units.push(LoadUnit {
            at,
            index: fixed.index,
            generation: d.rec.generation,
            state: shown_state(d),
            has_host: host.is_some(),
            own_max_running: d.max_running,
            expected: expected_max_running(&fixed.doc, self.config, host.map(|(_, h)| &**h)),
        });
    }

    fn clear(&mut self) {
        self.units.clear();
        self.text.clear();
    }

    fn last(&self) -> Option<(&str, u32)> {
        self.units.last().map(|u| (self.id(u), u.index))
    }

    fn order(&mut self) {
        let mut units = std::mem::take(&mut self.units);
        super::in_index_order(&mut units, |a, b| self.same_deployment(a, b), |u| u.index);
        self.units = units;
    }
}

/// One deployment's load (`units`, its instances in `chunk`, index 0 first).
pub(crate) fn load_view(
    chunk: &LoadChunk<'_>,
    units: &[LoadUnit],
    router: Option<&RouterFigures>,
    cx: &Ctx<'_>,
    now_ms: u64,
) -> DeploymentLoadView {
    let d = &units[0];
    DeploymentLoadView {
        deployment_id: chunk.id(d).to_string(),
        name: chunk.part(d, 4).to_string(),
        router: router_view(router, cx),
        max_running: MaxRunningView::from(d.expected),
        instances: units
            .iter()
            .map(|u| InstanceFigures::of(chunk, d, u, router, cx, now_ms).view())
            .collect(),
    }
}

/// How `serde_json` begins the [`DeploymentLoadView`] of deployment `id` named `name`
/// (`{"deployment_id":…,"name":…,`): encoded once per revision ([`super::Fixed`]), written as
/// it is by each full load read ([`write_load_view`]).
pub(super) fn load_head(id: &str, name: &str) -> String {
    let mut out = Vec::with_capacity(32 + id.len() + name.len());
    out.extend_from_slice(br#"{"deployment_id":"#);
    json::string(&mut out, id);
    out.extend_from_slice(br#","name":"#);
    json::string(&mut out, name);
    out.push(b',');
    // Two `str`s written escaped: UTF-8.
    String::from_utf8(out).unwrap_or_default()
}

/// [`load_view`]'s JSON appended to `out`, byte for byte `serde_json`'s of it, written straight
/// from the chunk: no view built (no vector of instances, no copy of the host's ID per
/// instance), the ID and name from the head encoded once per revision. The figures are
/// [`load_view`]'s own ([`InstanceFigures`]); `tests` and `reads::tests` hold the bytes
/// equal. NB (reads at scale): the full load read writes 100,000 of these.
pub(crate) fn write_load_view(
    out: &mut Vec<u8>,
    chunk: &LoadChunk<'_>,
    units: &[LoadUnit],
    router: Option<&RouterFigures>,
    cx: &Ctx<'_>,
    now_ms: u64,
) {
    let d = &units[0];
    out.extend_from_slice(chunk.part(d, 2).as_bytes());
    json::router(out, &router_view(router, cx));
    out.extend_from_slice(br#","max_running":"#);
    json::max_running(out, d.expected);
    out.extend_from_slice(br#","instances":["#);
    for (i, u) in units.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        InstanceFigures::of(chunk, d, u, router, cx, now_ms).write(out);
    }
    out.extend_from_slice(b"]}");
}

/// The router's side of a deployment's load: its figures, else its limits with nothing in
/// flight.
fn router_view(router: Option<&RouterFigures>, cx: &Ctx<'_>) -> RouterLoadView {
    RouterLoadView {
        in_flight: router.map_or(0, |r| r.in_flight as u64),
        in_flight_limit: router.map_or(
            u64::from(capyctl_spec::settings::IN_FLIGHT_PER_DEPLOYMENT),
            |r| r.in_flight_limit as u64,
        ),
        waiting: router.map_or(0, |r| r.waiting as u64),
        waiting_limit: router.map_or(u64::from(cx.config.waiting_limit), |r| {
            r.waiting_limit as u64
        }),
    }
}

/// One instance's figures in the load read ([`InstanceLoadView`]'s, borrowed).
struct InstanceFigures<'a> {
    adapters: &'a [String],
    index: u32,
    host_id: &'a str,
    generation: u64,
    state: InstanceState,
    router_in_flight: u64,
    max_running: MaxRunning,
    sample: Option<SampleView>,
}

impl<'a> InstanceFigures<'a> {
    /// Of instance `u` of the deployment whose first instance is `d`. The deployment's figure
    /// (`max_running`) is the one CapyCTL passed or expects; the instance's is the engine's
    /// own where it said (SGLang).
    fn of(
        chunk: &'a LoadChunk<'_>,
        d: &LoadUnit,
        u: &LoadUnit,
        router: Option<&RouterFigures>,
        cx: &'a Ctx<'_>,
        now_ms: u64,
    ) -> Self {
        let router_in_flight = router
            .and_then(|r| r.router_in_flight(u.index, u.generation))
            .map_or(0, |n| n as u64);
        let host_id = chunk.part(u, 3);
        let loaded = matches!(u.state, InstanceState::Ready | InstanceState::Closed);
        let sample = if loaded && u.has_host {
            cx.hosts
                .get(host_id)
                .and_then(|h| h.agent.sample(chunk.part(u, 1)))
                .and_then(|s| sample_view(&s, now_ms, router_in_flight))
        } else {
            None
        };
        InstanceFigures {
            // NB (reads at scale): no copy of the ID to look up where no adapter is loaded.
            adapters: match &cx.adapters.by_instance {
                m if m.is_empty() => &[],
                m => m
                    .get(&(chunk.id(d).to_string(), u.index))
                    .map_or(&[], Vec::as_slice),
            },
            index: u.index,
            host_id: if u.has_host {
                host_id
            } else {
                cx.config.host_id.as_str()
            },
            generation: u.generation,
            state: u.state,
            router_in_flight,
            max_running: u.own_max_running.unwrap_or(u.expected),
            sample,
        }
    }

    fn view(self) -> InstanceLoadView {
        InstanceLoadView {
            adapters: self.adapters.to_vec(),
            index: self.index,
            host_id: self.host_id.to_string(),
            generation: self.generation,
            observed_state: self.state,
            router_in_flight: self.router_in_flight,
            max_running: MaxRunningView::from(self.max_running),
            sample: self.sample,
        }
    }

    /// [`InstanceFigures::view`]'s JSON, as `serde_json` writes it (the fields in their order,
    /// `adapters` left out when empty).
    fn write(&self, out: &mut Vec<u8>) {
        out.push(b'{');
        if !self.adapters.is_empty() {
            out.extend_from_slice(br#""adapters":["#);
            for (i, a) in self.adapters.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                json::string(out, a);
            }
            out.extend_from_slice(b"],");
        }
        out.extend_from_slice(br#""index":"#);
        json::number(out, u64::from(self.index));
        out.extend_from_slice(br#","host_id":"#);
        json::string(out, self.host_id);
        out.extend_from_slice(br#","generation":"#);
        json::number(out, self.generation);
        out.extend_from_slice(br#","observed_state":""#);
        // The states' words need no escaping (`kinds` tests them against serde's).
        out.extend_from_slice(self.state.as_str().as_bytes());
        out.extend_from_slice(br#"","router_in_flight":"#);
        json::number(out, self.router_in_flight);
        out.extend_from_slice(br#","max_running":"#);
        json::max_running(out, self.max_running);
        out.extend_from_slice(br#","sample":"#);
        match &self.sample {
            None => out.extend_from_slice(b"null"),
            Some(s) => json::sample(out, s),
        }
        out.push(b'}');
    }
}

/// The load read's JSON written by hand, as `serde_json` writes the views (compact, fields in
/// declaration order).
mod json {
    use super::{MaxRunning, RouterLoadView, SampleView};
    pub(super) use crate::views::json::{boolean, number, string};

    /// An object of numbers only, `{"name":n,…}` (the names need no escaping).
    fn numbers<const N: usize>(out: &mut Vec<u8>, fields: [(&str, u64); N]) {
        for (i, (name, n)) in fields.into_iter().enumerate() {
            out.extend_from_slice(if i == 0 { b"{\"" } else { b",\"" });
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(b"\":");
            number(out, n);
        }
        out.push(b'}');
    }

    pub(super) fn router(out: &mut Vec<u8>, r: &RouterLoadView) {
        out.extend_from_slice(br#""router":"#);
        numbers(
            out,
            [
                ("in_flight", r.in_flight),
                ("in_flight_limit", r.in_flight_limit),
                ("waiting", r.waiting),
                ("waiting_limit", r.waiting_limit),
            ],
        );
    }

    /// A [`MaxRunningView`]: `count` left out when unknown.
    pub(super) fn max_running(out: &mut Vec<u8>, m: MaxRunning) {
        out.push(b'{');
        if let Some(n) = m.count {
            out.extend_from_slice(br#""count":"#);
            number(out, u64::from(n));
            out.push(b',');
        }
        out.extend_from_slice(br#""source":"#);
        string(out, m.source.as_str());
        out.push(b'}');
    }

    pub(super) fn sample(out: &mut Vec<u8>, s: &SampleView) {
        out.extend_from_slice(br#"{"sampled_at_ms":"#);
        number(out, s.sampled_at_ms);
        out.extend_from_slice(br#","age_ms":"#);
        number(out, s.age_ms);
        out.extend_from_slice(br#","fresh":"#);
        boolean(out, s.fresh);
        out.extend_from_slice(br#","ingress_in_flight":"#);
        number(out, s.ingress_in_flight);
        out.extend_from_slice(br#","engine":"#);
        match &s.engine {
            None => out.extend_from_slice(b"null"),
            Some(e) => numbers(
                out,
                [
                    ("running", e.running),
                    ("waiting", e.waiting),
                    ("kv_usage_ppm", e.kv_usage_ppm),
                ],
            ),
        }
        out.push(b'}');
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::views::tests::sample;
    use capyctl_interfaces::load::EngineLoad;

    /// The load read's hand-written JSON is `serde_json`'s of the views, byte for byte: every
    /// optional part present and absent, numbers at their ends, strings that need escaping.
    #[test]
    fn the_load_views_json_is_serde_jsons() {
        use capyctl_interfaces::launch::MaxRunningSource;
        let sources = [
            MaxRunningSource::Engine,
            MaxRunningSource::Declared,
            MaxRunningSource::Default,
            MaxRunningSource::StateCache,
            MaxRunningSource::ExtraArgs,
            MaxRunningSource::HostFixed,
            MaxRunningSource::EngineDefault,
            MaxRunningSource::OnHost,
        ];
        let adapters = ["sql-lora".to_string(), "q\"uote\\ \u{1}é\u{7f}".to_string()];
        let samples = [
            None,
            sample_view(&sample(1000, None), 1200, 0),
            sample_view(
                &sample(
                    u64::MAX - 5,
                    Some(EngineLoad {
                        running: Some(u64::MAX),
                        waiting: Some(0),
                        kv_usage_ppm: Some(999_999),
                    }),
                ),
                u64::MAX,
                7,
            ),
        ];
        let mut cases = 0;
        for (i, state) in InstanceState::ALL.iter().enumerate() {
            for (j, sample) in samples.iter().enumerate() {
                let f = InstanceFigures {
                    adapters: if j == 1 {
                        &adapters[..]
                    } else {
                        &adapters[..i % 2]
                    },
                    index: [0, 9, u32::MAX][j],
                    host_id: ["gpu-box", "h\tö\"st", ""][j],
                    generation: [0, 10, u64::MAX][(i + j) % 3],
                    state: *state,
                    router_in_flight: [0, 1, 123_456_789][j],
                    max_running: MaxRunning {
                        count: [None, Some(0), Some(u32::MAX)][(i + j) % 3],
                        source: sources[(i + j) % sources.len()],
                    },
                    sample: sample.clone(),
                };
                let mut out = b"x".to_vec();
                f.write(&mut out);
                let typed = serde_json::to_vec(&f.view()).expect("encodes");
                assert_eq!(
                    String::from_utf8_lossy(&out[1..]),
                    String::from_utf8_lossy(&typed)
                );
                cases += 1;
            }
        }
        assert!(cases >= 30);
        for (id, name) in [("01K", "chat-a"), ("", "n\"a\\me\n"), ("id", "ünï")] {
            let view = DeploymentLoadView {
                deployment_id: id.to_string(),
                name: name.to_string(),
                router: RouterLoadView {
                    in_flight: 3,
                    in_flight_limit: 32,
                    waiting: 0,
                    waiting_limit: u64::MAX,
                },
                max_running: MaxRunningView::from(MaxRunning {
                    count: None,
                    source: MaxRunningSource::OnHost,
                }),
                instances: Vec::new(),
            };
            let mut out = load_head(id, name).into_bytes();
            json::router(&mut out, &view.router);
            out.extend_from_slice(br#","max_running":"#);
            json::max_running(
                &mut out,
                MaxRunning {
                    count: None,
                    source: MaxRunningSource::OnHost,
                },
            );
            out.extend_from_slice(br#","instances":[]}"#);
            assert_eq!(
                String::from_utf8_lossy(&out),
                serde_json::to_string(&view).expect("encodes")
            );
        }
    }
}
