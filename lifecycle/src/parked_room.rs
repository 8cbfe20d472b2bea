//! Room in host RAM for a parked copy, as a pure function: before a deployment parks, which
//! older parked host-RAM copies on its host are stopped so that its copy fits, or
//! `parked_capacity` when only copies never stopped for room stand in the way.
//!
//! The victims follow the rules of DESIGN 4.10, as the choice of GPU victims does
//! (`placement::place`): a copy of a higher priority than the new copy's is never stopped for
//! it (it stands in the way as a kept one does); among the others lower priorities go first,
//! then the least recently used; and with several priorities among the victims, only as many
//! as needed (a lower one taken first is let off when a higher one frees enough). With one
//! priority everywhere the order is the page's, least recently used first.
//!
//! Whether a model parks at all, whether its park goes to host RAM, and how much host RAM the
//! copies may use are the engine rules (`capyctl_engine_rules::tier`: [`never_parks`],
//! [`tier_rule`], [`host_ram_for_copies`]); this module only reads them.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Mutex, PoisonError};

use capyctl_engine_rules::tier::{
    TierInput, TierRule, host_ram_for_copies, never_parks, tier_rule,
};
use capyctl_interfaces::inventory::HostMemory;
#[cfg(test)]
use capyctl_interfaces::spec::InstanceSpec;
use capyctl_spec::documents::DeploymentDoc;
use capyctl_spec::{EngineKind, Residency};
use tokio::time::Instant;

/// The copy a park is about to make.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NewCopy {
    /// Its size (the weights); unknown, it never fits and the agent parks deep or stops.
    pub bytes: Option<u64>,
    /// The tier rule sends the park to host RAM when the copy fits ([`parks_in_host_ram`]).
    pub to_host_ram: bool,
    /// Its deployment's `priority` (DESIGN 4.10): no copy of a higher one is stopped for it.
    pub priority: i32,
}

/// Another deployment's copy parked in host RAM on the same host (borrowed from the
/// lifecycle's state).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ParkedCopy<'a> {
    /// The deployment's ID.
    pub id: &'a str,
    /// The bytes its copy holds in host RAM.
    pub bytes: u64,
    /// Its last use (the least recently used is stopped first).
    pub used_at: Instant,
    /// Its deployment's `priority`: lower ones are stopped first, higher ones than the new
    /// copy's never.
    pub priority: i32,
    /// Never stopped for room: explicit or warm, or busy or reserved.
    pub kept: bool,
    /// A switch has claimed it: it is about to wake (and leave host RAM). Never stopped, and
    /// not held against the new copy when deciding `parked_capacity`: if the copy still does
    /// not fit when the park runs, the agent parks deep or stops it.
    pub claimed: bool,
}

/// The answer of [`parked_room`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ParkedRoom {
    /// Nothing to stop: the park does not go to host RAM, the copy's size is unknown, it fits
    /// already, or it is larger than all the host RAM the copies may use (the agent's call:
    /// it parks deep or stops the model), or only claimed copies stand in the way.
    NothingToStop,
    /// Stop these copies, in this order (lower priority first, then least recently used; only
    /// as many as needed).
    Stop(Vec<String>),
    /// Only copies never stopped for room (kept, or of a higher priority) stand in the way
    /// (`parked_capacity`).
    Capacity,
}

/// Per host, the units that may hold a parked copy in host RAM there: every one that does
/// (and some that no longer do), so that a park reads those, not every deployment that ever
/// ran on its host ([`CopiesIndex::copies_on`]). A host's set is built by one scan of its
/// deployments the first time it is read after [`CopiesIndex::forget`] (a host added or
/// reconciled: adopted engines may be parked copies); after that each park adds its own unit
/// before it runs (every park to host RAM goes through `Core::make_parked_room`), and each
/// read lets go of the units that can no longer hold a copy there.
///
/// It sits in `State` behind a mutex of its own: a park reads under the state's read lock.
#[derive(Debug, Default)]
pub(crate) struct CopiesIndex(Mutex<HashMap<String, BTreeSet<String>>>);

/// What [`CopiesIndex::copies_on`] asks of a unit of the set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Held {
    /// It holds a copy in host RAM on this host now.
    Copy,
    /// It holds none now but may come to (running or on its way there, a park's copy being
    /// made): kept in the set.
    Maybe,
    /// It can hold none there before its next park (gone, on another host, stopped, failed,
    /// parked deep): let go of.
    Never,
}

impl CopiesIndex {
    /// The units of `host`'s set that hold a copy now (as `held` says), with `park`'s own unit
    /// added to the set first. `scan` lists the units on the host, for a set not built yet.
    pub(crate) fn copies_on<'a>(
        &self,
        host: &str,
        park: &str,
        scan: impl FnOnce() -> Vec<&'a str>,
        held: impl Fn(&str) -> Held,
    ) -> Vec<String> {
        let mut all = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let set = all.entry(host.to_string()).or_insert_with(|| {
            scan()
                .into_iter()
                .filter(|id| held(id) != Held::Never)
                .map(str::to_string)
                .collect()
        });
        let mut copies = Vec::new();
        set.retain(|id| match held(id) {
            Held::Copy => {
                copies.push(id.clone());
                true
            }
            Held::Maybe => true,
            Held::Never => false,
        });
        if !set.contains(park) {
            set.insert(park.to_string());
        }
        copies
    }

    /// Lets go of `host`'s set: the next read builds it again from a scan.
    pub(crate) fn forget(&self, host: &str) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(host);
    }
}

/// What the tier rule reads of a model: its engine, `residency`, whether its engine decodes
/// speculatively and whether it is a decision model. Read from its document
/// (`From<&DeploymentDoc>`: the lifecycle keeps no
/// [`InstanceSpec`](capyctl_interfaces::spec::InstanceSpec) per deployment, `Dep::spec`) or, in
/// the tests, from a spec made of it, the same fields as
/// [`InstanceSpec::from_doc`](capyctl_interfaces::spec::InstanceSpec::from_doc) copies them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TierModel {
    engine: EngineKind,
    residency: Option<Residency>,
    /// SGLang's speculative decoding is on
    /// ([`InstanceSpec::speculative`](capyctl_interfaces::spec::InstanceSpec::speculative)).
    pub speculative: bool,
    decision_model: bool,
}

/// A spec's tier model: only the tests read one (the lifecycle reads the document's), to hold
/// the two the same.
#[cfg(test)]
impl From<&InstanceSpec> for TierModel {
    fn from(spec: &InstanceSpec) -> Self {
        Self {
            engine: spec.engine,
            residency: spec.residency,
            speculative: spec.speculative(),
            decision_model: spec.decision.is_some(),
        }
    }
}

impl From<&DeploymentDoc> for TierModel {
    fn from(doc: &DeploymentDoc) -> Self {
        let engine = doc.engine_kind();
        Self {
            engine,
            residency: doc.residency,
            speculative: capyctl_spec::engine_args::speculative(engine, &doc.extra_args),
            decision_model: doc.decision.is_some(),
        }
    }
}

/// The host agent's tier input for a park of `model`, as far as the lifecycle knows it: the
/// deployment's document and whether the host's GPUs have `unified_memory`. Two facts of the
/// agent are not known here and taken as absent: the refusal table's row (the agent refuses
/// such a park; the lifecycle then stops the model) and how the engine was launched (so the
/// rule is read as at launch). The copy's size and the room are not part of the rule.
fn tier_input(model: TierModel, unified_memory: bool) -> TierInput {
    TierInput {
        engine: model.engine,
        residency: model.residency,
        speculative: model.speculative,
        decision_model: model.decision_model,
        unified_memory,
        weights_bytes: None,
        host_room: None,
        refusal: None,
        launched: None,
    }
}

/// Whether `model` parks when released, on any host (not `residency: restart_only`,
/// TensorFold or a decision model: [`never_parks`]).
pub(crate) fn parks(model: impl Into<TierModel>) -> bool {
    never_parks(&tier_input(model.into(), false)).is_none()
}

/// Whether a park of `model` goes to host RAM when its copy fits there: the host agent's tier
/// rule ([`tier_rule`]), with `unified_memory` read from the host's inventory.
pub(crate) fn parks_in_host_ram(model: impl Into<TierModel>, unified_memory: bool) -> bool {
    tier_rule(&tier_input(model.into(), unified_memory)).is_ok_and(TierRule::host_ram_if_fits)
}

/// Which of `copies` (the other copies parked in host RAM on the host whose memory is
/// `memory`) to stop so that `copy` fits.
pub(crate) fn parked_room(
    copy: NewCopy,
    memory: &HostMemory,
    copies: &[ParkedCopy<'_>],
) -> ParkedRoom {
    let Some(bytes) = copy.bytes.filter(|_| copy.to_host_ram) else {
        return ParkedRoom::NothingToStop;
    };
    let sum = |keep: &dyn Fn(&ParkedCopy<'_>) -> bool| {
        copies
            .iter()
            .filter(|c| keep(c))
            .fold(0u64, |n, c| n.saturating_add(c.bytes))
    };
    let held = sum(&|_| true);
    let total = host_ram_for_copies(memory, held);
    if bytes > total || bytes <= total.saturating_sub(held) {
        return ParkedRoom::NothingToStop;
    }
    // Never stopped for this copy: kept ones, and those of a higher priority (DESIGN 4.10).
    let stays = |c: &ParkedCopy<'_>| c.kept || c.priority > copy.priority;
    if bytes > total.saturating_sub(sum(&|c| stays(c) && !c.claimed)) {
        return ParkedRoom::Capacity;
    }
    let mut removable: Vec<&ParkedCopy<'_>> =
        copies.iter().filter(|c| !stays(c) && !c.claimed).collect();
    removable.sort_by_key(|c| (c.priority, c.used_at));
    let mut free = total.saturating_sub(held);
    let mut stop: Vec<&ParkedCopy<'_>> = Vec::new();
    for c in removable {
        if free >= bytes {
            break;
        }
        free = free.saturating_add(c.bytes);
        stop.push(c);
    }
    if free >= bytes && stop.windows(2).any(|w| w[0].priority != w[1].priority) {
        // A lower priority taken first may not be needed once a higher one goes too: only as
        // many as needed, tried from the last taken (the highest priority) back, as
        // `placement::place` does.
        // NB: with one priority everywhere the page's order is exact as it was.
        for i in (0..stop.len()).rev() {
            if free - stop[i].bytes >= bytes {
                free -= stop[i].bytes;
                stop.remove(i);
            }
        }
    }
    if stop.is_empty() {
        ParkedRoom::NothingToStop
    } else {
        ParkedRoom::Stop(stop.iter().map(|c| c.id.to_string()).collect())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use capyctl_interfaces::spec::InstanceSpec;
    use capyctl_spec::{EngineKind, Residency};

    use super::*;

    const G: u64 = 1 << 30;

    /// `MemAvailable` of `available` GiB (the copies made are not in it).
    fn meminfo(available: u64) -> HostMemory {
        HostMemory {
            total_bytes: 256 * G,
            available_bytes: available * G,
            overridden: false,
        }
    }

    /// The `host_memory` override of `gib` GiB.
    fn overridden(gib: u64) -> HostMemory {
        HostMemory {
            total_bytes: gib * G,
            available_bytes: gib * G,
            overridden: true,
        }
    }

    fn to_host_ram(gib: u64) -> NewCopy {
        NewCopy {
            bytes: Some(gib * G),
            to_host_ram: true,
            priority: 0,
        }
    }

    /// The same new copy, of a deployment of `priority`.
    fn of_priority(copy: NewCopy, priority: i32) -> NewCopy {
        NewCopy { priority, ..copy }
    }

    /// The same parked copy, of a deployment of `priority`.
    fn prio(c: ParkedCopy<'static>, priority: i32) -> ParkedCopy<'static> {
        ParkedCopy { priority, ..c }
    }

    /// A removable copy of `gib` GiB, last used `age` seconds before the others' zero.
    fn parked(id: &'static str, gib: u64, age: u64) -> ParkedCopy<'static> {
        let base = Instant::now() + Duration::from_secs(1_000);
        ParkedCopy {
            id,
            bytes: gib * G,
            used_at: base - Duration::from_secs(age),
            priority: 0,
            kept: false,
            claimed: false,
        }
    }

    fn kept(c: ParkedCopy<'static>) -> ParkedCopy<'static> {
        ParkedCopy { kept: true, ..c }
    }

    fn claimed(c: ParkedCopy<'static>) -> ParkedCopy<'static> {
        ParkedCopy { claimed: true, ..c }
    }

    fn stop(ids: &[&str]) -> ParkedRoom {
        ParkedRoom::Stop(ids.iter().map(|s| s.to_string()).collect())
    }

    #[test]
    fn least_recently_used_first_and_only_as_many_as_needed() {
        // MemAvailable 4 GiB with 3 copies of 4 GiB made: 16 GiB for copies, 4 free.
        let copies = [parked("a", 4, 10), parked("b", 4, 300), parked("c", 4, 50)];
        assert_eq!(
            parked_room(to_host_ram(4), &meminfo(4), &copies),
            ParkedRoom::NothingToStop,
            "it fits"
        );
        assert_eq!(
            parked_room(to_host_ram(8), &meminfo(4), &copies),
            stop(&["b"])
        );
        assert_eq!(
            parked_room(to_host_ram(12), &meminfo(4), &copies),
            stop(&["b", "c"])
        );
        assert_eq!(
            parked_room(to_host_ram(16), &meminfo(4), &copies),
            stop(&["b", "c", "a"])
        );
    }

    #[test]
    fn a_higher_prioritys_copy_is_never_stopped_for_a_lower_ones() {
        // 12 GiB: prod (priority 100) is the least recently used, yet a test model's copy
        // (priority 0) makes its room from the other test copy only.
        let copies = [prio(parked("prod", 6, 900), 100), parked("test-b", 6, 10)];
        assert_eq!(
            parked_room(to_host_ram(6), &overridden(12), &copies),
            stop(&["test-b"])
        );
        // Only prod could make the room: parked_capacity, as for a kept copy.
        assert_eq!(
            parked_room(to_host_ram(8), &overridden(12), &copies),
            ParkedRoom::Capacity
        );
        // A copy of the same priority or a higher one may stop it (the lower one first).
        for p in [100, 200] {
            assert_eq!(
                parked_room(of_priority(to_host_ram(8), p), &overridden(12), &copies),
                stop(&["test-b", "prod"]),
                "priority {p}"
            );
        }
        // Negative priorities are lower than the default 0.
        let copies = [parked("zero", 6, 900), prio(parked("neg", 6, 10), -5)];
        assert_eq!(
            parked_room(to_host_ram(6), &overridden(12), &copies),
            stop(&["neg"])
        );
        assert_eq!(
            parked_room(of_priority(to_host_ram(6), -5), &overridden(12), &copies),
            stop(&["neg"])
        );
        assert_eq!(
            parked_room(of_priority(to_host_ram(8), -5), &overridden(12), &copies),
            ParkedRoom::Capacity
        );
    }

    #[test]
    fn lower_priorities_go_first_then_the_least_recently_used_and_only_as_many_as_needed() {
        // 12 GiB full: a (priority 50, the oldest), b and c (priority 0, newer).
        let copies = [
            prio(parked("a", 4, 900), 50),
            parked("b", 4, 20),
            parked("c", 4, 10),
        ];
        let new = |gib| of_priority(to_host_ram(gib), 100);
        assert_eq!(parked_room(new(4), &overridden(12), &copies), stop(&["b"]));
        assert_eq!(
            parked_room(new(8), &overridden(12), &copies),
            stop(&["b", "c"])
        );
        assert_eq!(
            parked_room(new(12), &overridden(12), &copies),
            stop(&["b", "c", "a"])
        );
        // A lower priority's small copy taken first is let off when the higher one it had to
        // stop as well frees enough alone.
        let copies = [parked("small", 2, 10), prio(parked("big", 8, 900), 50)];
        assert_eq!(
            parked_room(new(8), &overridden(10), &copies),
            stop(&["big"])
        );
        // With one priority everywhere, the least recently used first, exactly as before.
        let copies = [parked("small", 2, 900), parked("big", 8, 10)];
        assert_eq!(
            parked_room(to_host_ram(8), &overridden(10), &copies),
            stop(&["small", "big"])
        );
    }

    #[test]
    fn kept_copies_are_never_chosen() {
        // The oldest is kept (explicit, warm, busy or reserved): the next oldest goes.
        let copies = [
            kept(parked("old", 4, 900)),
            parked("a", 4, 10),
            parked("b", 4, 20),
        ];
        assert_eq!(
            parked_room(to_host_ram(6), &overridden(14), &copies),
            stop(&["b"])
        );
        // Even stopping every other copy leaves too little: parked_capacity.
        assert_eq!(
            parked_room(to_host_ram(11), &overridden(14), &copies),
            ParkedRoom::Capacity
        );
        assert_eq!(
            parked_room(to_host_ram(10), &overridden(14), &copies),
            stop(&["b", "a"])
        );
    }

    #[test]
    fn claimed_copies_are_neither_stopped_nor_counted_against_it() {
        // 12 GiB: a kept 4, a claimed 6 (about to wake) and a removable 2 hold all of it.
        let copies = [
            kept(parked("k", 4, 900)),
            claimed(parked("w", 6, 800)),
            parked("r", 2, 10),
        ];
        // 8 GiB: with the claimed copy gone there is room, so no parked_capacity; only the
        // removable copy is stopped (the agent parks deep or stops it if 8 still do not fit).
        assert_eq!(
            parked_room(to_host_ram(8), &overridden(12), &copies),
            stop(&["r"])
        );
        // Had the claimed copy been kept instead, the 8 GiB could never fit.
        let copies = [kept(parked("k", 4, 900)), kept(parked("w", 6, 800))];
        assert_eq!(
            parked_room(to_host_ram(8), &overridden(12), &copies),
            ParkedRoom::Capacity
        );
        // Only a claimed copy in the way: nothing to stop.
        let copies = [claimed(parked("w", 6, 800))];
        assert_eq!(
            parked_room(to_host_ram(8), &overridden(12), &copies),
            ParkedRoom::NothingToStop
        );
    }

    #[test]
    fn overridden_host_memory_is_the_total_for_the_copies() {
        // Overridden: the 16 GiB hold the copies made; MemAvailable would add them back.
        let copies = [parked("a", 6, 10)];
        assert_eq!(
            parked_room(to_host_ram(12), &overridden(16), &copies),
            stop(&["a"])
        );
        assert_eq!(
            parked_room(to_host_ram(12), &meminfo(16), &copies),
            ParkedRoom::NothingToStop
        );
    }

    #[test]
    fn a_copy_larger_than_host_ram_or_not_for_host_ram_stops_nothing() {
        let copies = [parked("a", 6, 10)];
        // Larger than all of host RAM for copies: the agent parks deep (or stops it).
        assert_eq!(
            parked_room(to_host_ram(17), &overridden(16), &copies),
            ParkedRoom::NothingToStop
        );
        assert_eq!(
            parked_room(to_host_ram(17), &meminfo(10), &copies),
            ParkedRoom::NothingToStop
        );
        // Exactly all of it: the others make room.
        assert_eq!(
            parked_room(to_host_ram(16), &meminfo(10), &copies),
            stop(&["a"])
        );
        // Not to host RAM, or of unknown size.
        let deep = NewCopy {
            to_host_ram: false,
            ..to_host_ram(12)
        };
        assert_eq!(
            parked_room(deep, &overridden(16), &copies),
            ParkedRoom::NothingToStop
        );
        let unknown = NewCopy {
            bytes: None,
            to_host_ram: true,
            priority: 0,
        };
        assert_eq!(
            parked_room(unknown, &overridden(16), &copies),
            ParkedRoom::NothingToStop
        );
    }

    fn spec(yaml: &str) -> InstanceSpec {
        let doc = capyctl_spec::documents::parse_deployment_str("t.yaml", yaml)
            .unwrap_or_else(|e| panic!("{e}"));
        InstanceSpec::from_doc("d".to_string(), &doc)
    }

    #[test]
    fn the_agents_tier_rule_says_which_parks_go_to_host_ram() {
        let vllm = spec("name: m\nengine: vllm\nmodel: m\n");
        assert_eq!(vllm.engine, EngineKind::Vllm);
        assert!(parks_in_host_ram(&vllm, false));
        assert!(!parks_in_host_ram(&vllm, true), "unified memory parks deep");
        let deep = InstanceSpec {
            residency: Some(Residency::Deep),
            ..vllm.clone()
        };
        assert!(!parks_in_host_ram(&deep, false));
        let host_backed = InstanceSpec {
            residency: Some(Residency::HostBacked),
            ..vllm.clone()
        };
        assert!(parks_in_host_ram(&host_backed, false));
        assert!(!parks_in_host_ram(&host_backed, true), "refused there");
        let restart = InstanceSpec {
            residency: Some(Residency::RestartOnly),
            ..vllm.clone()
        };
        assert!(!parks_in_host_ram(&restart, false));
        assert!(!parks(&restart));
        assert!(parks(&deep) && parks(&host_backed) && parks(&vllm));
        let tensorfold = InstanceSpec {
            engine: EngineKind::Tensorfold,
            ..vllm.clone()
        };
        assert!(!parks_in_host_ram(&tensorfold, false));
        assert!(!parks(&tensorfold));
        let decision =
            spec("name: m\nengine: vllm\nmodel: m\ndecision:\n  prompt: p\n  options: [yes, no]\n");
        assert!(decision.decision.is_some());
        assert!(!parks(&decision) && !parks_in_host_ram(&decision, false));
        let speculative = spec(
            "name: m\nengine: sglang\nmodel: m\nextra_args: [\"--speculative-algorithm\", \"EAGLE\"]\n",
        );
        assert!(speculative.speculative());
        assert!(!parks_in_host_ram(&speculative, false), "KV cache only");
        assert!(parks(&speculative));
    }

    /// The lifecycle reads the tier rule's fields from a deployment's document (it keeps no
    /// spec per deployment): the same as from the spec the agent is given.
    #[test]
    fn a_documents_tier_model_is_its_specs() {
        for yaml in [
            "name: m\nengine: vllm\nmodel: m\n",
            "name: m\nengine: vllm\nmodel: m\nresidency: restart_only\n",
            "name: m\nengine: vllm\nmodel: m\nresidency: host_backed\n",
            "name: m\nengine: tensorfold\nmodel: m\n",
            "name: m\nengine: vllm\nmodel: m\ndecision:\n  prompt: p\n  options: [yes, no]\n",
            "name: m\nengine: sglang\nmodel: m\nextra_args: [\"--speculative-algorithm\", \"EAGLE\"]\n",
        ] {
            let doc = capyctl_spec::documents::parse_deployment_str("t.yaml", yaml)
                .unwrap_or_else(|e| panic!("{e}"));
            let from_spec = TierModel::from(&InstanceSpec::from_doc("d".to_string(), &doc));
            assert_eq!(TierModel::from(&doc), from_spec, "{yaml}");
            for unified in [false, true] {
                assert_eq!(
                    parks_in_host_ram(&doc, unified),
                    parks_in_host_ram(from_spec, unified)
                );
            }
        }
        let restart = "name: m\nengine: vllm\nmodel: m\nresidency: restart_only\n";
        let doc = capyctl_spec::documents::parse_deployment_str("t.yaml", restart)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(!parks(&doc));
        assert!(TierModel::from(&spec(
            "name: m\nengine: sglang\nmodel: m\nextra_args: [\"--speculative-algorithm\", \"EAGLE\"]\n"
        ))
        .speculative);
    }
}
