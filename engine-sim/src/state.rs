//! The engine's state and its transitions, as plain data: no locks, no sockets, no clocks.
//!
//! A control operation (sleep, wake, release, resume, reload) runs in two steps: `begin_*`
//! checks it, marks the engine busy (so requests are refused) and returns a [`Plan`] with the
//! simulated duration; after that time [`SimState::finish`] applies the plan. The caller
//! serializes operations, so at most one plan is in progress.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde::Serialize;

use crate::config::{Fault, SimConfig};
use crate::text::INTACT;

/// Where the weights are and whether they are right, as reported in `/sim/state`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightsState {
    /// On the GPU and correct.
    Intact,
    /// Off the GPU, with a copy in host RAM.
    HostRam,
    /// Off the GPU, no copy: a wake needs a reload from disk.
    Discarded,
    /// On the GPU but wrong (woken without reload, a wake mismatch, a corrupted draft model).
    Corrupted,
}

/// Memory kinds that can be released and resumed (vLLM and SGLang tag names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Tag {
    /// The model weights.
    Weights,
    /// The KV cache.
    KvCache,
    /// CUDA graphs (SGLang only; cosmetic here).
    CudaGraph,
}

impl Tag {
    /// Parses a tag name as the engines spell it.
    pub fn parse(s: &str) -> Option<Tag> {
        match s {
            "weights" => Some(Tag::Weights),
            "kv_cache" => Some(Tag::KvCache),
            "cuda_graph" => Some(Tag::CudaGraph),
            _ => None,
        }
    }
}

/// Why weights stay wrong even after a reload from disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Corruption {
    /// The `wake_mismatch` fault fired.
    WakeMismatch,
    /// SGLang released the weights with speculative decoding: the draft model is lost.
    SpeculativeDraft,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Weights {
    Gpu { garbage: bool },
    HostRam { garbage: bool },
    Discarded,
}

/// Counters and gauges reported in `/sim/state` and `/metrics`.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Counters {
    /// Requests generating now.
    pub running: u64,
    /// Requests waiting for a running slot.
    pub waiting: u64,
    /// Requests answered to the end.
    pub completed: u64,
    /// Requests whose client went away before the end.
    pub aborted: u64,
    /// Requests refused with 503 because the engine was asleep, released or paused
    /// (TensorFold's flavour; vLLM and SGLang hold them: `held_asleep`).
    pub refused_asleep: u64,
    /// Requests that arrived (or came to run) while the engine was asleep, released, paused or
    /// mid-operation, and waited for it to serve again, as vLLM (its scheduler is paused) and
    /// SGLang (its tokenizer waits while generation is paused) hold them.
    pub held_asleep: u64,
    /// Requests cut off because the engine slept or paused while they ran.
    pub interrupted: u64,
    /// Sleep / release_memory_occupation calls.
    pub sleeps: u64,
    /// Wake / resume_memory_occupation calls.
    pub wakes: u64,
    /// Successful weight reloads from disk.
    pub reloads: u64,
    /// Failed weight reloads.
    pub reload_failures: u64,
    /// reset_prefix_cache / flush_cache calls.
    pub cache_resets: u64,
}

/// A control operation in progress: applied by [`SimState::finish`] after `duration`.
#[derive(Debug)]
pub struct Plan {
    /// The simulated time the operation takes.
    pub duration: Duration,
    /// Exit the process half-way (the `crash_on_wake` fault).
    pub crash_midway: bool,
    weights: Weights,
    kv_on_gpu: bool,
    cuda_graph_on_gpu: bool,
    sleep_level: Option<u8>,
    loaded_model: Option<String>,
}

/// A refused control operation: HTTP status and message.
#[derive(Debug, PartialEq, Eq)]
pub struct ControlError {
    /// HTTP status code.
    pub status: u16,
    /// What went wrong.
    pub message: String,
}

fn refuse(status: u16, message: impl Into<String>) -> ControlError {
    ControlError {
        status,
        message: message.into(),
    }
}

/// Everything about the engine that changes. Lives behind one mutex in [`crate::EngineSim`].
#[derive(Debug)]
pub struct SimState {
    weights: Weights,
    kv_on_gpu: bool,
    cuda_graph_on_gpu: bool,
    /// A control operation in progress ("sleeping", "waking", "reloading").
    busy: Option<&'static str>,
    paused: bool,
    sleep_level: Option<u8>,
    corruption: Option<Corruption>,
    loaded_model: String,
    faults: BTreeSet<Fault>,
    /// LoRA adapters loaded, in load order (the order the engines list them).
    pub adapters: Vec<LoadedAdapter>,
    /// Per adapter name: a load time and faults set through `/sim/faults`.
    pub adapter_settings: BTreeMap<String, AdapterSettings>,
    /// The adapters' use clock ([`SimState::adapter_tick`]).
    adapter_clock: u64,
    /// Tokens held in the KV cache by running requests.
    kv_tokens: u64,
    /// Counters and gauges.
    pub counters: Counters,
}

/// A LoRA adapter the engine holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LoadedAdapter {
    /// Its name (requests give it in `model`).
    pub name: String,
    /// Its directory, as given to the load.
    pub path: String,
    /// Its rank (`r` of `adapter_config.json`).
    pub rank: u64,
    /// When it was loaded or last named by a request ([`SimState::use_adapter`]): SGLang
    /// unloads its least recently used adapter beyond `--max-loaded-loras`.
    #[serde(skip)]
    pub last_used: u64,
}

/// How loads of one adapter behave, set through `/sim/faults`
/// (`{"adapters": {"<name>": {"load_time": "250ms", "fails": "why", "hangs": true}}}`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdapterSettings {
    /// How long its load takes (else `--sim-adapter-load-time`).
    #[serde(default, with = "opt_duration")]
    pub load_time: Option<Duration>,
    /// Its load fails with this reason (after the load time), as a worker error.
    #[serde(default)]
    pub fails: Option<String>,
    /// Its load never answers.
    #[serde(default)]
    pub hangs: bool,
}

mod opt_duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_str(&format!("{}ms", d.as_millis())),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|v| crate::config::parse_duration(&v).map_err(serde::de::Error::custom))
            .transpose()
    }
}

impl SimState {
    /// The adapter loaded under `name`.
    pub fn adapter(&self, name: &str) -> Option<&LoadedAdapter> {
        self.adapters.iter().find(|a| a.name == name)
    }

    /// The next tick of the adapters' use clock ([`LoadedAdapter::last_used`]).
    pub fn adapter_tick(&mut self) -> u64 {
        self.adapter_clock += 1;
        self.adapter_clock
    }

    /// Adapter `name` for a request that runs with it, marked used now.
    pub fn use_adapter(&mut self, name: &str) -> Option<&LoadedAdapter> {
        let now = self.adapter_tick();
        let a = self.adapters.iter_mut().find(|a| a.name == name)?;
        a.last_used = now;
        Some(a)
    }

    /// A freshly loaded engine.
    pub fn new(config: &SimConfig) -> SimState {
        SimState {
            weights: Weights::Gpu { garbage: false },
            kv_on_gpu: true,
            cuda_graph_on_gpu: true,
            busy: None,
            paused: false,
            sleep_level: None,
            corruption: None,
            loaded_model: config.model.clone(),
            faults: config.faults.clone(),
            kv_tokens: 0,
            adapters: Vec::new(),
            adapter_settings: BTreeMap::new(),
            adapter_clock: 0,
            counters: Counters::default(),
        }
    }

    // ----- reading -----

    /// Where the weights are and whether they are right.
    pub fn weights_state(&self) -> WeightsState {
        match self.weights {
            Weights::Gpu { garbage } if !garbage && self.corruption.is_none() => {
                WeightsState::Intact
            }
            Weights::Gpu { .. } => WeightsState::Corrupted,
            Weights::HostRam { .. } => WeightsState::HostRam,
            Weights::Discarded => WeightsState::Discarded,
        }
    }

    /// Salt for answers: [`INTACT`] for correct weights, something else for wrong ones.
    pub fn answer_salt(&self) -> String {
        match (self.weights_state(), self.corruption) {
            (WeightsState::Intact, _) => INTACT.to_owned(),
            (state, corruption) => format!("{state:?}/{corruption:?}"),
        }
    }

    /// The memory released now.
    pub fn released_tags(&self) -> Vec<Tag> {
        let mut tags = Vec::new();
        if !matches!(self.weights, Weights::Gpu { .. }) {
            tags.push(Tag::Weights);
        }
        if !self.kv_on_gpu {
            tags.push(Tag::KvCache);
        }
        if !self.cuda_graph_on_gpu {
            tags.push(Tag::CudaGraph);
        }
        tags
    }

    /// vLLM's `is_sleeping`: anything still released.
    pub fn is_sleeping(&self) -> bool {
        !self.released_tags().is_empty()
    }

    /// SGLang `pause_generation` in effect.
    pub fn paused(&self) -> bool {
        self.paused
    }

    /// The operation in progress, if any.
    pub fn busy(&self) -> Option<&'static str> {
        self.busy
    }

    /// vLLM's level of the last sleep while still asleep.
    pub fn sleep_level(&self) -> Option<u8> {
        self.sleep_level
    }

    /// Why weights stay wrong after a reload, if they do.
    pub fn corruption(&self) -> Option<Corruption> {
        self.corruption
    }

    /// The checkpoint loaded (SGLang's `update_weights_from_disk` may change it).
    pub fn loaded_model(&self) -> &str {
        &self.loaded_model
    }

    /// Whether a request can run now; otherwise why not (the text of the 503).
    pub fn servable(&self) -> Result<(), String> {
        if let Some(op) = self.busy {
            return Err(format!("the engine is sleeping ({op} in progress)"));
        }
        if self.paused {
            return Err("the engine is sleeping: generation is paused (pause_generation)".into());
        }
        let released = self.released_tags();
        if !released.is_empty() {
            let names: Vec<_> = released.iter().map(|t| format!("{t:?}")).collect();
            return Err(format!(
                "the engine is sleeping: memory released ({}); wake it before sending requests",
                names.join(", ")
            ));
        }
        Ok(())
    }

    /// GPU memory held now: the residue, plus the weights and KV pool when on the GPU.
    pub fn gpu_memory_bytes(&self, config: &SimConfig) -> u64 {
        let kv_pool = config
            .gpu_memory_bytes
            .saturating_sub(config.weights_bytes)
            .saturating_sub(config.sleep_residue_bytes);
        let mut bytes = config.sleep_residue_bytes;
        if matches!(self.weights, Weights::Gpu { .. }) {
            bytes += config.weights_bytes;
        }
        if self.kv_on_gpu {
            bytes += kv_pool;
        }
        bytes
    }

    /// Host RAM used for a copy of the weights.
    pub fn host_copy_bytes(&self, config: &SimConfig) -> u64 {
        match self.weights {
            Weights::HostRam { .. } => config.weights_bytes,
            _ => 0,
        }
    }

    /// KV-cache use, 0..1, from the running requests' tokens.
    pub fn kv_usage(&self, config: &SimConfig) -> f64 {
        if !self.kv_on_gpu {
            return 0.0;
        }
        (self.kv_tokens as f64 / config.kv_capacity_tokens as f64).min(1.0)
    }

    /// Faults active now.
    pub fn faults(&self) -> &BTreeSet<Fault> {
        &self.faults
    }

    /// Is `fault` active?
    pub fn has_fault(&self, fault: Fault) -> bool {
        self.faults.contains(&fault)
    }

    /// Sets and clears faults (clear first, then set).
    pub fn change_faults(&mut self, set: &[Fault], clear: &[Fault], clear_all: bool) {
        if clear_all {
            self.faults.clear();
        }
        for f in clear {
            self.faults.remove(f);
        }
        self.faults.extend(set.iter().copied());
    }

    // ----- requests -----

    /// A request starts waiting for a slot.
    pub fn request_waits(&mut self) {
        self.counters.waiting += 1;
    }

    /// A waiting request got its slot and holds `prompt_tokens` in the KV cache.
    pub fn request_runs(&mut self, prompt_tokens: u64) {
        self.counters.waiting = self.counters.waiting.saturating_sub(1);
        self.counters.running += 1;
        self.kv_tokens += prompt_tokens;
    }

    /// A running request produced one more token.
    pub fn request_token(&mut self) {
        self.kv_tokens += 1;
    }

    /// A request left: `was_running` tells which gauge it was in, `kv_tokens` what it held.
    pub fn request_leaves(&mut self, was_running: bool, kv_tokens: u64, outcome: Outcome) {
        if was_running {
            self.counters.running = self.counters.running.saturating_sub(1);
        } else {
            self.counters.waiting = self.counters.waiting.saturating_sub(1);
        }
        self.kv_tokens = self.kv_tokens.saturating_sub(kv_tokens);
        match outcome {
            Outcome::Completed => self.counters.completed += 1,
            Outcome::Aborted => self.counters.aborted += 1,
            Outcome::Interrupted => self.counters.interrupted += 1,
            Outcome::Refused => self.counters.refused_asleep += 1,
        }
    }

    // ----- control -----

    fn plan(&self, duration: Duration) -> Plan {
        Plan {
            duration,
            crash_midway: false,
            weights: self.weights,
            kv_on_gpu: self.kv_on_gpu,
            cuda_graph_on_gpu: self.cuda_graph_on_gpu,
            sleep_level: self.sleep_level,
            loaded_model: None,
        }
    }

    /// vLLM `POST /sleep?level=N`: level 1 copies the weights to host RAM, level 2 drops them;
    /// both free the KV cache.
    pub fn begin_vllm_sleep(
        &mut self,
        level: u8,
        config: &SimConfig,
    ) -> Result<Plan, ControlError> {
        let mut plan = self.plan(Duration::ZERO);
        plan.weights = match (level, self.weights) {
            (1, Weights::Gpu { garbage }) => {
                plan.duration = config.host_copy_time();
                Weights::HostRam { garbage }
            }
            (1, w) => w,
            (2, _) => Weights::Discarded,
            _ => {
                return Err(refuse(
                    400,
                    format!("sleep level must be 1 or 2, not {level}"),
                ));
            }
        };
        plan.kv_on_gpu = false;
        plan.sleep_level = Some(level);
        self.counters.sleeps += 1;
        self.busy = Some("sleeping");
        Ok(plan)
    }

    /// SGLang `POST /release_memory_occupation`: weights go to host RAM with the CPU backup,
    /// are discarded without it; with speculative decoding the draft model is lost.
    pub fn begin_sglang_release(
        &mut self,
        tags: &[Tag],
        config: &SimConfig,
    ) -> Result<Plan, ControlError> {
        if !config.enable_memory_saver {
            return Err(refuse(
                400,
                "memory saver is not enabled: start the server with --enable-memory-saver",
            ));
        }
        let mut plan = self.plan(Duration::ZERO);
        for tag in tags {
            match tag {
                Tag::Weights => {
                    if let Weights::Gpu { garbage } = self.weights {
                        plan.weights = if config.enable_weights_cpu_backup {
                            plan.duration = config.host_copy_time();
                            Weights::HostRam { garbage }
                        } else {
                            Weights::Discarded
                        };
                        if config.speculative_algorithm.is_some() {
                            self.corruption = Some(Corruption::SpeculativeDraft);
                        }
                    }
                }
                Tag::KvCache => plan.kv_on_gpu = false,
                Tag::CudaGraph => plan.cuda_graph_on_gpu = false,
            }
        }
        self.counters.sleeps += 1;
        self.busy = Some("sleeping");
        Ok(plan)
    }

    /// vLLM `POST /wake_up[?tags=..]` and SGLang `POST /resume_memory_occupation`: weights in
    /// host RAM are copied back; discarded weights come back as garbage until a reload.
    pub fn begin_wake(&mut self, tags: &[Tag], config: &SimConfig) -> Plan {
        let mut plan = self.plan(Duration::ZERO);
        plan.crash_midway = self.has_fault(Fault::CrashOnWake);
        for tag in tags {
            match tag {
                Tag::Weights => {
                    let back = match self.weights {
                        Weights::Gpu { .. } => None,
                        Weights::HostRam { garbage } => {
                            plan.duration = config.host_copy_time();
                            Some(Weights::Gpu { garbage })
                        }
                        Weights::Discarded => Some(Weights::Gpu { garbage: true }),
                    };
                    if let Some(w) = back {
                        plan.weights = w;
                        if self.faults.remove(&Fault::WakeMismatch) {
                            self.corruption = Some(Corruption::WakeMismatch);
                        }
                    }
                }
                Tag::KvCache => plan.kv_on_gpu = true,
                Tag::CudaGraph => plan.cuda_graph_on_gpu = true,
            }
        }
        if matches!(plan.weights, Weights::Gpu { .. }) && plan.kv_on_gpu && plan.cuda_graph_on_gpu {
            plan.sleep_level = None;
        }
        self.counters.wakes += 1;
        self.busy = Some("waking");
        plan
    }

    /// vLLM `collective_rpc reload_weights` and SGLang `update_weights_from_disk`: reload the
    /// weights from disk into GPU memory, which must be there (woken) already.
    pub fn begin_reload(
        &mut self,
        model_path: Option<String>,
        config: &SimConfig,
    ) -> Result<Plan, ControlError> {
        if !matches!(self.weights, Weights::Gpu { .. }) {
            return Err(refuse(
                400,
                "weights are not in GPU memory: wake them first (tags=weights), then reload",
            ));
        }
        if self.has_fault(Fault::ReloadFails) {
            self.counters.reload_failures += 1;
            return Err(refuse(
                500,
                "failed to reload weights from disk: simulated failure (fault reload_fails)",
            ));
        }
        let mut plan = self.plan(config.disk_reload_time());
        plan.weights = Weights::Gpu { garbage: false };
        plan.loaded_model = model_path;
        self.busy = Some("reloading");
        Ok(plan)
    }

    /// Applies a plan whose time has passed.
    pub fn finish(&mut self, plan: Plan) {
        if matches!(self.busy, Some("reloading")) {
            self.counters.reloads += 1;
        }
        if let Some(model) = plan.loaded_model {
            self.loaded_model = model;
        }
        self.weights = plan.weights;
        self.kv_on_gpu = plan.kv_on_gpu;
        self.cuda_graph_on_gpu = plan.cuda_graph_on_gpu;
        self.sleep_level = plan.sleep_level;
        self.busy = None;
    }

    /// An operation was abandoned (its task failed): clear the busy mark.
    pub fn abandon(&mut self) {
        self.busy = None;
    }

    /// SGLang `pause_generation` / `continue_generation`.
    pub fn set_paused(&mut self, paused: bool) {
        self.paused = paused;
    }
}

/// How a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Answered to the end.
    Completed,
    /// The client went away.
    Aborted,
    /// The engine slept or paused under it.
    Interrupted,
    /// Refused after waiting: the engine fell asleep meanwhile.
    Refused,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn config(args: &[&str]) -> SimConfig {
        SimConfig::try_parse_from(std::iter::once("engine-sim").chain(args.iter().copied()))
            .unwrap()
    }

    const ALL: [Tag; 2] = [Tag::Weights, Tag::KvCache];

    #[test]
    fn vllm_level1_round_trip_is_intact() {
        let c = config(&[
            "serve",
            "m",
            "--enable-sleep-mode",
            "--sim-weights-bytes",
            "1GiB",
        ]);
        let mut s = SimState::new(&c);
        let awake = s.gpu_memory_bytes(&c);
        let plan = s.begin_vllm_sleep(1, &c).unwrap();
        assert!(s.servable().is_err());
        assert_eq!(plan.duration, c.host_copy_time());
        s.finish(plan);
        assert_eq!(s.weights_state(), WeightsState::HostRam);
        assert!(s.is_sleeping());
        assert_eq!(s.gpu_memory_bytes(&c), c.sleep_residue_bytes);
        assert!(s.gpu_memory_bytes(&c) < awake);
        let plan = s.begin_wake(&ALL, &c);
        s.finish(plan);
        assert_eq!(s.weights_state(), WeightsState::Intact);
        assert_eq!(s.answer_salt(), INTACT);
        assert!(s.servable().is_ok());
    }

    #[test]
    fn vllm_level2_needs_a_reload() {
        let c = config(&["serve", "m", "--enable-sleep-mode"]);
        let mut s = SimState::new(&c);
        let p = s.begin_vllm_sleep(2, &c).unwrap();
        s.finish(p);
        assert_eq!(s.weights_state(), WeightsState::Discarded);
        assert!(s.begin_reload(None, &c).is_err());
        let p = s.begin_wake(&[Tag::Weights], &c);
        s.finish(p);
        assert!(s.is_sleeping());
        assert_eq!(s.weights_state(), WeightsState::Corrupted);
        let p = s.begin_reload(None, &c).unwrap();
        assert_eq!(p.duration, c.disk_reload_time());
        s.finish(p);
        let p = s.begin_wake(&[Tag::KvCache], &c);
        s.finish(p);
        assert_eq!(s.weights_state(), WeightsState::Intact);
        assert!(!s.is_sleeping());
        assert_eq!(s.counters.reloads, 1);
    }

    #[test]
    fn wake_mismatch_survives_a_reload_and_fires_once() {
        let c = config(&["serve", "m", "--sim-faults", "wake_mismatch"]);
        let mut s = SimState::new(&c);
        let p = s.begin_vllm_sleep(1, &c).unwrap();
        s.finish(p);
        let p = s.begin_wake(&ALL, &c);
        s.finish(p);
        assert_eq!(s.weights_state(), WeightsState::Corrupted);
        assert!(!s.has_fault(Fault::WakeMismatch));
        let p = s.begin_reload(None, &c).unwrap();
        s.finish(p);
        assert_eq!(s.weights_state(), WeightsState::Corrupted);
    }

    #[test]
    fn sglang_release_needs_memory_saver_and_speculative_corrupts() {
        let plain = config(&["--model-path", "m"]);
        let mut s = SimState::new(&plain);
        assert_eq!(
            s.begin_sglang_release(&ALL, &plain).unwrap_err().status,
            400
        );

        let spec = config(&[
            "--model-path",
            "m",
            "--enable-memory-saver",
            "--enable-weights-cpu-backup",
            "--speculative-algorithm",
            "EAGLE",
        ]);
        let mut s = SimState::new(&spec);
        let p = s.begin_sglang_release(&[Tag::KvCache], &spec).unwrap();
        s.finish(p);
        let p = s.begin_wake(&[Tag::KvCache], &spec);
        s.finish(p);
        assert_eq!(s.weights_state(), WeightsState::Intact);
        let p = s.begin_sglang_release(&ALL, &spec).unwrap();
        s.finish(p);
        assert_eq!(s.weights_state(), WeightsState::HostRam);
        let p = s.begin_wake(&ALL, &spec);
        s.finish(p);
        assert_eq!(s.weights_state(), WeightsState::Corrupted);
        assert_eq!(s.corruption(), Some(Corruption::SpeculativeDraft));
    }

    #[test]
    fn request_accounting() {
        let c = config(&["serve", "m", "--sim-kv-capacity-tokens", "100"]);
        let mut s = SimState::new(&c);
        s.request_waits();
        s.request_runs(10);
        s.request_token();
        assert!((s.kv_usage(&c) - 0.11).abs() < 1e-9);
        s.request_leaves(true, 11, Outcome::Aborted);
        assert_eq!(s.counters.running, 0);
        assert_eq!(s.counters.aborted, 1);
        assert_eq!(s.kv_usage(&c), 0.0);
    }
}
