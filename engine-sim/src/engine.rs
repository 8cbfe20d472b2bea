//! The running engine: shared state, request admission and generation, control operations.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::Serialize;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tracing::{error, info, warn};

use crate::adapters::AdapterNames;
use crate::config::{Fault, Flavour, SimConfig};
use crate::state::{
    ControlError, Corruption, Counters, Outcome, Plan, SimState, Tag, WeightsState,
};
use crate::text::{TokenLogprobs, Words, count_tokens};

/// Exit status of a simulated crash (`crash`, `crash_on_wake`).
pub const CRASH_EXIT_CODE: i32 = 70;

/// Size of the one oversized chunk sent with the `oversized_chunks` fault: above 64 KiB.
const OVERSIZED_BYTES: usize = 72 * 1024;

/// One simulated engine: configuration, state, running slots. Shared by every handler.
#[derive(Debug)]
pub struct EngineSim {
    /// Read-only after start.
    config: SimConfig,
    /// Every fact that changes. A std mutex, locked only for short sections without `.await`.
    state: Mutex<SimState>,
    /// One permit per running slot (`max_running`). Tokio's semaphore is FIFO, so waiting
    /// requests get slots first come, first served. Held by a request's [`Ticket`].
    slots: Arc<Semaphore>,
    /// Serializes control operations. A tokio mutex, held across an operation's simulated time
    /// (by a spawned task, so a client that hangs up does not cut an operation in half).
    control: tokio::sync::Mutex<()>,
    /// Serializes adapter loads (vLLM's engine core adds one adapter at a time), and SGLang's
    /// unloads too (its `lora_update_lock`).
    pub(crate) adapter_lock: tokio::sync::Mutex<()>,
    /// vLLM's lock per adapter name (`lora_resolver_lock`), held by a load and an unload of
    /// that name; an entry goes when no call holds or waits for it.
    pub(crate) adapter_names: AdapterNames,
    /// When the simulated start-up is over. Read-only.
    ready_at: Instant,
    /// Source of request ids (`chatcmpl-N`). Atomic, no lock.
    next_id: AtomicU64,
}

/// Why a request was not taken.
#[derive(Debug)]
pub(crate) enum Refusal {
    /// Still starting up.
    Starting,
    /// Asleep, released, paused or busy with a control operation: the message says which.
    Asleep(String),
}

/// Everything `/sim/state` reports.
#[derive(Debug, Serialize)]
pub struct SimSnapshot {
    /// The engine simulated.
    pub flavour: Flavour,
    /// The name clients send.
    pub served_model_name: String,
    /// The model argument.
    pub model: String,
    /// The checkpoint loaded now.
    pub loaded_model: String,
    /// Reported version.
    pub version: String,
    /// Start-up finished.
    pub started: bool,
    /// Anything released (vLLM's `is_sleeping`).
    pub asleep: bool,
    /// vLLM: level of the current sleep.
    pub sleep_level: Option<u8>,
    /// SGLang: generation paused.
    pub paused: bool,
    /// Memory released now.
    pub released_tags: Vec<Tag>,
    /// A control operation in progress.
    pub busy: Option<&'static str>,
    /// Where the weights are, and whether they are right.
    pub weights: WeightsState,
    /// Why weights stay wrong even after a reload.
    pub corruption: Option<Corruption>,
    /// Counters and gauges (running, waiting, completed, aborted, refused_asleep, …).
    #[serde(flatten)]
    pub counters: Counters,
    /// Requests run at once.
    pub max_running: usize,
    /// KV-cache use, 0..1.
    pub kv_cache_usage: f64,
    /// GPU memory held now.
    pub gpu_memory_bytes: u64,
    /// GPU memory held while fully awake.
    pub gpu_memory_awake_bytes: u64,
    /// Host RAM holding a copy of the weights now.
    pub host_memory_bytes: u64,
    /// Size of the weights.
    pub weights_bytes: u64,
    /// Faults active now.
    pub faults: Vec<Fault>,
    /// LoRA adapters loaded, in load order.
    pub adapters: Vec<crate::state::LoadedAdapter>,
    /// Launch arguments the engine did not know.
    pub unknown_args: Vec<String>,
}

impl EngineSim {
    /// A freshly started engine; start-up ends `config.startup_delay` from now.
    pub fn new(config: SimConfig) -> Arc<EngineSim> {
        Arc::new(EngineSim {
            state: Mutex::new(SimState::new(&config)),
            slots: Arc::new(Semaphore::new(config.max_running)),
            control: tokio::sync::Mutex::new(()),
            adapter_lock: tokio::sync::Mutex::new(()),
            adapter_names: AdapterNames::default(),
            ready_at: Instant::now() + config.startup_delay,
            next_id: AtomicU64::new(1),
            config,
        })
    }

    /// The configuration it was started with.
    pub fn config(&self) -> &SimConfig {
        &self.config
    }

    /// Start-up is over.
    pub fn started(&self) -> bool {
        Instant::now() >= self.ready_at
    }

    /// Waits until start-up is over.
    pub async fn wait_started(&self) {
        tokio::time::sleep_until(self.ready_at).await;
    }

    /// Runs `f` on the state under the lock. Never call it across an `.await`.
    pub(crate) fn with_state<R>(&self, f: impl FnOnce(&mut SimState) -> R) -> R {
        let mut guard = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        f(&mut guard)
    }

    pub(crate) fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// What `/sim/state` reports now.
    pub fn snapshot(&self) -> SimSnapshot {
        let c = &self.config;
        let started = self.started();
        self.with_state(|s| SimSnapshot {
            flavour: c.flavour,
            served_model_name: c.served_model_name.clone(),
            model: c.model.clone(),
            loaded_model: s.loaded_model().to_owned(),
            version: c.version.clone(),
            started,
            asleep: s.is_sleeping(),
            sleep_level: s.sleep_level(),
            paused: s.paused(),
            released_tags: s.released_tags(),
            busy: s.busy(),
            weights: s.weights_state(),
            corruption: s.corruption(),
            counters: s.counters.clone(),
            max_running: c.max_running,
            kv_cache_usage: s.kv_usage(c),
            gpu_memory_bytes: s.gpu_memory_bytes(c),
            gpu_memory_awake_bytes: c.gpu_memory_bytes,
            host_memory_bytes: s.host_copy_bytes(c),
            weights_bytes: c.weights_bytes,
            faults: s.faults().iter().copied().collect(),
            adapters: s.adapters.clone(),
            unknown_args: c.unknown_args.clone(),
        })
    }

    /// Whether a request that finds the engine asleep waits for its wake (vLLM, SGLang) rather
    /// than being refused (TensorFold, which never parks).
    pub(crate) fn holds_while_asleep(&self) -> bool {
        self.config.flavour != Flavour::Tensorfold
    }

    /// Waits while the engine is asleep, released, paused or mid-operation, as vLLM and SGLang
    /// hold a request then; the first wait is counted (`held_asleep`) and logged loudly, since
    /// CapyCTL should never send a request to a parked engine.
    pub(crate) async fn hold_while_asleep(&self) {
        let mut held = false;
        while let Err(why) = self.with_state(|s| s.servable()) {
            if !held {
                held = true;
                self.with_state(|s| s.counters.held_asleep += 1);
                error!(reason = %why, "a request arrived while the engine sleeps: held until it serves again");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Can a new request be taken? Not while starting. Asleep: vLLM and SGLang take it (it
    /// waits, [`EngineSim::hold_while_asleep`]); TensorFold refuses it, counted and logged
    /// loudly.
    pub(crate) fn check_servable(&self) -> Result<(), Refusal> {
        if !self.started() {
            return Err(Refusal::Starting);
        }
        if self.holds_while_asleep() {
            return Ok(());
        }
        self.with_state(|s| {
            s.servable().map_err(|why| {
                s.counters.refused_asleep += 1;
                error!(reason = %why, "refusing a request: the engine is sleeping");
                Refusal::Asleep(why)
            })
        })
    }

    /// Runs a control operation: `begin` under the lock, the simulated time, then `finish`.
    /// Runs in its own task, so a client hanging up does not leave it half done.
    pub(crate) async fn control<F>(
        self: &Arc<Self>,
        what: &'static str,
        begin: F,
    ) -> Result<(), ControlError>
    where
        F: FnOnce(&mut SimState, &SimConfig) -> Result<Plan, ControlError> + Send + 'static,
    {
        let sim = Arc::clone(self);
        let task = tokio::spawn(async move {
            let _serial = sim.control.lock().await;
            let plan = sim.with_state(|s| begin(s, &sim.config))?;
            info!(
                operation = what,
                duration_ms = plan.duration.as_millis() as u64,
                "control operation begins"
            );
            if plan.crash_midway {
                tokio::time::sleep(plan.duration / 2).await;
                crash("fault crash_on_wake: exiting in the middle of a wake");
            }
            tokio::time::sleep(plan.duration).await;
            sim.with_state(|s| s.finish(plan));
            info!(operation = what, "control operation done");
            Ok(())
        });
        match task.await {
            Ok(result) => result,
            Err(e) => {
                self.with_state(SimState::abandon);
                Err(ControlError {
                    status: 500,
                    message: format!("{what} failed: {e}"),
                })
            }
        }
    }

    /// With the `wake_hangs` fault, never returns (the client's connection is held).
    pub(crate) async fn hang_if_wake_hangs(&self) {
        if self.with_state(|s| s.has_fault(Fault::WakeHangs)) {
            warn!("fault wake_hangs: this wake will never answer");
            std::future::pending::<()>().await;
        }
    }
}

/// Exits the process now, as a crashing engine would.
pub(crate) fn crash(reason: &str) -> ! {
    error!(reason, "engine-sim crashing (simulated)");
    eprintln!("engine-sim: simulated crash: {reason}");
    std::process::exit(CRASH_EXIT_CODE)
}

/// A request's place in the engine: waiting, then running with a slot. Dropping it before
/// [`Ticket::finish`] means the client went away: the request is aborted and counted.
#[derive(Debug)]
pub(crate) struct Ticket {
    sim: Arc<EngineSim>,
    permit: Option<OwnedSemaphorePermit>,
    kv_tokens: u64,
    done: bool,
}

impl Ticket {
    /// A new request, waiting for a slot.
    pub(crate) fn new(sim: Arc<EngineSim>) -> Ticket {
        sim.with_state(SimState::request_waits);
        Ticket {
            sim,
            permit: None,
            kv_tokens: 0,
            done: false,
        }
    }

    /// Waits for a running slot; then the prompt occupies the KV cache.
    async fn admit(&mut self, prompt_tokens: u64) {
        let Ok(permit) = Arc::clone(&self.sim.slots).acquire_owned().await else {
            return; // never closed
        };
        self.permit = Some(permit);
        self.kv_tokens = prompt_tokens;
        self.sim.with_state(|s| s.request_runs(prompt_tokens));
    }

    fn token(&mut self) {
        self.kv_tokens += 1;
        self.sim.with_state(SimState::request_token);
    }

    /// Ends the request now: counters, KV tokens and slot are released.
    pub(crate) fn finish(&mut self, outcome: Outcome) {
        if self.done {
            return;
        }
        self.done = true;
        let was_running = self.permit.is_some();
        let kv = self.kv_tokens;
        self.sim
            .with_state(|s| s.request_leaves(was_running, kv, outcome));
        self.permit = None;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.done {
            info!(
                running = self.permit.is_some(),
                "client went away: request aborted"
            );
            self.finish(Outcome::Aborted);
        }
    }
}

/// Why generation stopped early.
#[derive(Debug)]
pub(crate) enum Stop {
    /// The engine fell asleep while the request waited: refused.
    Refused(String),
    /// The engine slept or paused while the request ran.
    Interrupted(String),
}

impl Stop {
    /// The message for the client.
    pub(crate) fn message(&self) -> String {
        match self {
            Stop::Refused(why) => why.clone(),
            Stop::Interrupted(why) => format!("request interrupted: {why}"),
        }
    }
}

/// One generated token.
#[derive(Debug)]
pub(crate) struct Token {
    /// Its text.
    pub(crate) text: String,
    /// Its log probabilities, when the request asked for them.
    pub(crate) logprobs: Option<TokenLogprobs>,
}

/// One answer being generated: admission, prefill, tokens at the configured rate.
#[derive(Debug)]
pub(crate) struct Generation {
    ticket: Ticket,
    prompt: String,
    /// Prompt tokens.
    pub(crate) prompt_tokens: u64,
    max_tokens: u64,
    /// Tokens produced so far.
    pub(crate) produced: u64,
    words: Option<Words>,
    /// Top log probabilities asked per token; `None`: no log probabilities.
    top_logprobs: Option<usize>,
    oversized: bool,
    /// When the first token is due (after prefill); token i is due i+1 intervals later.
    decode_start: Option<Instant>,
    /// The LoRA adapter's directory the request runs with: its answers depend on it (the
    /// adapter's weights), not on its name.
    adapter: Option<String>,
}

impl Generation {
    /// A request for `max_tokens` tokens answering `prompt`, with `top_logprobs` alternatives
    /// per token when log probabilities are asked for.
    pub(crate) fn new(
        sim: Arc<EngineSim>,
        prompt: String,
        max_tokens: u64,
        top_logprobs: Option<usize>,
    ) -> Generation {
        Generation {
            top_logprobs,
            ticket: Ticket::new(sim),
            prompt_tokens: count_tokens(&prompt),
            prompt,
            max_tokens,
            produced: 0,
            words: None,
            oversized: false,
            decode_start: None,
            adapter: None,
        }
    }

    /// Runs with the LoRA adapter whose directory is `path`.
    pub(crate) fn with_adapter(mut self, path: Option<String>) -> Generation {
        self.adapter = path;
        self
    }

    fn sim(&self) -> &EngineSim {
        &self.ticket.sim
    }

    /// Waits for a slot, then for the prefill.
    pub(crate) async fn start(&mut self) -> Result<(), Stop> {
        if self.sim().holds_while_asleep() {
            self.sim().hold_while_asleep().await;
        }
        self.ticket.admit(self.prompt_tokens).await;
        if self.sim().holds_while_asleep() {
            // It may have gone to sleep while the request waited for its slot.
            self.sim().hold_while_asleep().await;
        }
        let salt = self.sim().with_state(|s| {
            s.servable().map(|()| {
                (
                    s.answer_salt(),
                    s.loaded_model().to_owned(),
                    s.has_fault(Fault::OversizedChunks),
                )
            })
        });
        let (salt, model, oversized) = match salt {
            Ok(v) => v,
            Err(why) => {
                error!(reason = %why, "refusing a waiting request: the engine is sleeping");
                self.ticket.finish(Outcome::Refused);
                return Err(Stop::Refused(why));
            }
        };
        let model = match &self.adapter {
            Some(path) => format!("{model}+lora:{path}"),
            None => model,
        };
        self.words = Some(Words::answering(&model, &salt, &self.prompt));
        self.oversized = oversized;
        let prefill = self
            .sim()
            .config
            .prefill_per_token
            .saturating_mul(u32::try_from(self.prompt_tokens).unwrap_or(u32::MAX));
        if !prefill.is_zero() {
            // NB: even a zero sleep waits for the timer's next 1 ms tick.
            tokio::time::sleep(prefill).await;
        }
        self.decode_start = Some(Instant::now());
        Ok(())
    }

    /// Whether every token asked for was produced (the last one was the last).
    pub(crate) fn exhausted(&self) -> bool {
        self.produced >= self.max_tokens
    }

    /// The next token, at the token rate; `None` after `max_tokens`.
    pub(crate) async fn next_token(&mut self) -> Result<Option<Token>, Stop> {
        if self.produced >= self.max_tokens {
            return Ok(None);
        }
        let rate = self.sim().config.token_rate;
        if let (Some(start), true) = (self.decode_start, rate > 0.0) {
            let due = start + Duration::from_secs_f64((self.produced + 1) as f64 / rate);
            tokio::time::sleep_until(due).await;
        }
        if let Err(why) = self.sim().with_state(|s| s.servable()) {
            error!(reason = %why, "request interrupted: the engine went to sleep under it");
            self.ticket.finish(Outcome::Interrupted);
            return Err(Stop::Interrupted(why));
        }
        let Some(words) = &self.words else {
            return Ok(None);
        };
        let mut text = words.token(self.produced);
        let logprobs = self.top_logprobs.map(|n| words.logprobs(self.produced, n));
        if self.oversized && self.produced == 0 {
            let filler = " overflow";
            text.push_str(&filler.repeat(OVERSIZED_BYTES / filler.len() + 1));
        }
        self.produced += 1;
        self.ticket.token();
        Ok(Some(Token { text, logprobs }))
    }

    /// Whether the request asked for log probabilities.
    pub(crate) fn logprobs_asked(&self) -> bool {
        self.top_logprobs.is_some()
    }

    /// The answer is complete.
    pub(crate) fn complete(&mut self) {
        self.ticket.finish(Outcome::Completed);
    }
}

/// Waits for a slot and completes at once (embeddings).
/// Answers the loaded model and the weights' salt.
pub(crate) async fn run_instant(
    sim: Arc<EngineSim>,
    prompt_tokens: u64,
) -> Result<(String, String), Stop> {
    let mut ticket = Ticket::new(Arc::clone(&sim));
    if sim.holds_while_asleep() {
        sim.hold_while_asleep().await;
    }
    ticket.admit(prompt_tokens).await;
    if sim.holds_while_asleep() {
        sim.hold_while_asleep().await;
    }
    match sim.with_state(|s| {
        s.servable()
            .map(|()| (s.loaded_model().to_owned(), s.answer_salt()))
    }) {
        Ok(found) => {
            ticket.finish(Outcome::Completed);
            Ok(found)
        }
        Err(why) => {
            ticket.finish(Outcome::Refused);
            Err(Stop::Refused(why))
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::future::Future;

    use super::*;

    fn sim(args: &[&str]) -> Arc<EngineSim> {
        EngineSim::new(
            SimConfig::try_parse_from(std::iter::once("engine-sim").chain(args.iter().copied()))
                .unwrap(),
        )
    }

    /// A start without prefill is ready at its first poll: no timer (which would wait for the
    /// timer wheel's next 1 ms tick, even for a zero sleep).
    #[tokio::test(start_paused = true)]
    async fn a_zero_prefill_waits_for_no_timer() {
        // Off a millisecond boundary, as a real clock always is (a zero sleep rounds up).
        tokio::time::advance(Duration::from_micros(500)).await;
        let sim = sim(&["serve", "m"]);
        let mut g = Generation::new(Arc::clone(&sim), "a b c".into(), 2, Some(2));
        {
            let mut start = std::pin::pin!(g.start());
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            assert!(matches!(
                start.as_mut().poll(&mut cx),
                std::task::Poll::Ready(Ok(()))
            ));
        }
        let first = g.next_token().await.unwrap().unwrap();
        assert_eq!(first.logprobs.unwrap().top.len(), 2);
        g.complete();

        // With a prefill of 1 ms a token, three prompt tokens take 3 ms (to the timer's next
        // millisecond).
        let sim = self::sim(&["serve", "m", "--sim-prefill-per-token", "1ms"]);
        let began = Instant::now();
        let mut g = Generation::new(sim, "a b c".into(), 1, None);
        g.start().await.unwrap();
        let took = Instant::now() - began;
        assert!(
            took >= Duration::from_millis(3) && took <= Duration::from_millis(4),
            "{took:?}"
        );
        assert!(g.next_token().await.unwrap().unwrap().logprobs.is_none());
        g.complete();
    }
}
