//! Engine drivers: readiness, park and wake call sequences per engine and tier, the check
//! prompt, load scrapes and what the engine says about itself. Every step has a timeout and
//! fails with an error naming the engine, the step and the URL.
//!
//! Sequences (DESIGN 4.2):
//! - vLLM host RAM: `POST /sleep?level=1`, confirm `GET /is_sleeping` true; wake `POST
//!   /wake_up`, confirm false.
//! - vLLM deep: `POST /sleep?level=2`, confirm; wake `POST /wake_up?tags=weights`, `POST
//!   /collective_rpc {"method":"reload_weights"}`, `POST /wake_up?tags=kv_cache`, `POST
//!   /reset_prefix_cache`, confirm false.
//! - SGLang: `POST /pause_generation`, `POST /release_memory_occupation {"tags":[...]}`
//!   (`["kv_cache"]` alone for KV-only, else weights, kv_cache and cuda_graph), confirm that it
//!   no longer generates (below); wake `POST /resume_memory_occupation` (same tags), after a
//!   deep park `POST /update_weights_from_disk {"model_path": model}` and `POST /flush_cache`,
//!   then `POST /continue_generation`, confirm `GET /health` 200.
//!   NB: the reload runs before `continue_generation`, so the engine never generates on
//!   dropped weights.
//!
//! NB (SGLang's `/health`): it generates one token and, while generation is paused, waits for
//! it up to `SGLANG_HEALTH_CHECK_TIMEOUT` (20 s by default) before answering 503; it answers
//! 200 about a second after the call when the engine generates. SGLang has no endpoint that
//! says whether its memory is released. So a park is confirmed by a short probe
//! ([`DriverTimeouts::idle_probe`], 2 s): `/health` answering 200 within it means the engine
//! still generates (the park did not take) and fails the park; any other status, or no answer
//! within the probe, means it no longer generates. Then `/server_info` (older:
//! `/get_server_info`), which does not generate, must answer, so that a wedged or dead
//! engine is not taken for a parked one. The release call's own success is SGLang's word that
//! the memory went.
//! - TensorFold does not park: it is stopped.

use std::time::Duration;

use capyctl_spec::EngineKind;
use http::Method;
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::error::AgentError;
use crate::http::{Call, EngineClient};
use crate::load::{EngineLoad, parse_metrics};
use crate::recovery::EngineState;
use crate::spec::DecisionSpec;
use crate::tier::ParkTier;
use crate::verify::{
    FirstAnswer, WakeOutcome, check_request, compare_answers, completion_text,
    decision_from_completion, decision_request, warm_up_request,
};

/// Where an engine answers and under which model name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// The engine.
    pub engine: EngineKind,
    /// `http://127.0.0.1:<port>`.
    pub base_url: String,
    /// The `model` requests name (the served model name; TensorFold: the model).
    pub model_name: String,
    /// The model argument (checkpoint path or hub name), for SGLang's reload.
    pub model: String,
}

impl Endpoint {
    /// The URL of `path` (which starts with `/`).
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base_url, path)
    }
}

/// Timeouts of the driver's steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DriverTimeouts {
    /// One quick call (health, is_sleeping, pause, flush, metrics).
    pub step: Duration,
    /// A park call (copying weights to host RAM takes time).
    pub park: Duration,
    /// A check or warm-up request.
    pub check: Duration,
    /// How long SGLang's `/health` may take to show that a parked engine still generates (see
    /// the module doc); no answer within it counts as "no longer generates". At most `step`.
    pub idle_probe: Duration,
}

impl Default for DriverTimeouts {
    fn default() -> Self {
        Self {
            step: Duration::from_secs(10),
            park: Duration::from_secs(600),
            check: Duration::from_secs(120),
            idle_probe: Duration::from_secs(2),
        }
    }
}

/// Talks to engines over HTTP. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct Driver {
    client: EngineClient,
    timeouts: DriverTimeouts,
}

const SGLANG_ALL_TAGS: [&str; 3] = ["weights", "kv_cache", "cuda_graph"];
const SGLANG_KV_TAGS: [&str; 1] = ["kv_cache"];

fn sglang_tags(tier: ParkTier) -> Value {
    match tier {
        ParkTier::KvOnly => json!({"tags": SGLANG_KV_TAGS}),
        ParkTier::HostRam | ParkTier::Deep => json!({"tags": SGLANG_ALL_TAGS}),
    }
}

impl Driver {
    /// A driver with these timeouts.
    pub fn new(timeouts: DriverTimeouts) -> Self {
        Self {
            client: EngineClient::new(),
            timeouts,
        }
    }

    /// The timeouts.
    pub fn timeouts(&self) -> DriverTimeouts {
        self.timeouts
    }

    fn call<'a>(&self, ep: &Endpoint, step: &'static str, url: &'a str, t: Duration) -> Call<'a> {
        Call {
            engine: ep.engine,
            step,
            url,
            timeout: t,
        }
    }

    async fn post(
        &self,
        ep: &Endpoint,
        step: &'static str,
        path: &str,
        body: Option<Value>,
        timeout: Duration,
    ) -> Result<bytes::Bytes, AgentError> {
        let url = ep.url(path);
        self.client
            .expect_ok(
                self.call(ep, step, &url, timeout),
                Method::POST,
                body.as_ref(),
            )
            .await
    }

    /// `GET /health` once: the status, or the error.
    pub async fn health(&self, ep: &Endpoint) -> Result<u16, AgentError> {
        let url = ep.url("/health");
        let call = self.call(ep, "health", &url, self.timeouts.step);
        Ok(self.client.send(call, Method::GET, None).await?.0)
    }

    /// Polls `GET /health` every 100 ms until it answers 200, for at most `bound`.
    pub async fn wait_ready(&self, ep: &Endpoint, bound: Duration) -> Result<(), AgentError> {
        let deadline = Instant::now() + bound;
        let mut last = String::from("no answer yet");
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(AgentError::EngineTimeout {
                    engine: ep.engine,
                    step: "readiness (GET /health until 200)",
                    url: format!("{} (last: {last})", ep.url("/health")),
                    after: bound,
                });
            }
            let url = ep.url("/health");
            let call = self.call(ep, "health", &url, remaining.min(self.timeouts.step));
            match self.client.send(call, Method::GET, None).await {
                Ok((200, _)) => return Ok(()),
                Ok((status, _)) => last = format!("status {status}"),
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(100).min(remaining)).await;
        }
    }

    /// vLLM `GET /is_sleeping`.
    async fn vllm_is_sleeping(&self, ep: &Endpoint, timeout: Duration) -> Result<bool, AgentError> {
        let url = ep.url("/is_sleeping");
        let v = self
            .client
            .expect_json(
                self.call(ep, "is_sleeping", &url, timeout),
                Method::GET,
                None,
            )
            .await?;
        is_sleeping_of(&v).ok_or_else(|| AgentError::EngineAnswer {
            engine: ep.engine,
            step: "is_sleeping",
            url,
            detail: format!("no boolean `is_sleeping` in {v}"),
        })
    }

    async fn confirm_vllm(
        &self,
        ep: &Endpoint,
        asleep: bool,
        t: Duration,
    ) -> Result<(), AgentError> {
        let now = self.vllm_is_sleeping(ep, t).await?;
        if now == asleep {
            Ok(())
        } else {
            Err(AgentError::EngineAnswer {
                engine: ep.engine,
                step: if asleep {
                    "confirm asleep"
                } else {
                    "confirm awake"
                },
                url: ep.url("/is_sleeping"),
                detail: format!("is_sleeping is {now}, expected {asleep}"),
            })
        }
    }

    /// SGLang: whether `/health` answers 200 within `bound` (it generates a token). `false` for
    /// any other status or no answer within `bound`; an error when the engine cannot be reached
    /// (refused, or the connection broke).
    pub async fn sglang_generates(
        &self,
        ep: &Endpoint,
        bound: Duration,
    ) -> Result<bool, AgentError> {
        let url = ep.url("/health");
        match self
            .client
            .send(self.call(ep, "health", &url, bound), Method::GET, None)
            .await
        {
            Ok((status, _)) => Ok(status == 200),
            Err(AgentError::EngineTimeout { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// SGLang's `/server_info` (older: `/get_server_info`), which answers without generating.
    async fn sglang_server_info(&self, ep: &Endpoint) -> Result<Value, AgentError> {
        let first = self
            .get_json_checked(ep, "server_info", "/server_info")
            .await;
        match first {
            Ok(v) => Ok(v),
            Err(AgentError::EngineStatus { status: 404, .. }) => {
                self.get_json_checked(ep, "get_server_info", "/get_server_info")
                    .await
            }
            Err(e) => Err(e),
        }
    }

    /// SGLang no longer generates (a bounded `/health` probe) and still answers without
    /// generating (`/server_info`): see the module doc.
    async fn confirm_sglang_parked(&self, ep: &Endpoint) -> Result<(), AgentError> {
        let probe = self.timeouts.idle_probe.min(self.timeouts.step);
        if self.sglang_generates(ep, probe).await? {
            return Err(AgentError::EngineAnswer {
                engine: ep.engine,
                step: "confirm asleep",
                url: ep.url("/health"),
                detail: "GET /health answered 200: the engine still generates after \
                         pause_generation and release_memory_occupation"
                    .into(),
            });
        }
        self.sglang_server_info(ep).await.map(drop)
    }

    /// SGLang generates again: `/health` answers 200 within `t`.
    async fn confirm_sglang_awake(&self, ep: &Endpoint, t: Duration) -> Result<(), AgentError> {
        let url = ep.url("/health");
        let step = "confirm awake";
        let (status, body) = self
            .client
            .send(self.call(ep, step, &url, t), Method::GET, None)
            .await?;
        if status == 200 {
            Ok(())
        } else {
            Err(AgentError::EngineAnswer {
                engine: ep.engine,
                step,
                url,
                detail: format!(
                    "GET /health answered {status} ({}), expected 200",
                    crate::http::excerpt(&body)
                ),
            })
        }
    }

    /// Where an engine left behind says it is ([`crate::recovery`]), without making a parked
    /// engine generate: vLLM `GET /is_sleeping`, then, when it is not asleep (or was launched
    /// without sleep mode and has no such endpoint), `/health`; SGLang a `/health` probe, bounded by the step timeout
    /// when it is expected awake (`expect_awake`) and by the short idle probe otherwise, then
    /// `/server_info` when it does not generate; TensorFold `/health`.
    pub async fn engine_state(&self, ep: &Endpoint, expect_awake: bool) -> EngineState {
        let health = || async {
            match self.health(ep).await {
                Ok(200) => EngineState::Awake,
                Ok(status) => {
                    EngineState::NoAnswer(format!("GET {} answered {status}", ep.url("/health")))
                }
                Err(e) => EngineState::NoAnswer(e.to_string()),
            }
        };
        match ep.engine {
            EngineKind::Vllm => match self.vllm_is_sleeping(ep, self.timeouts.step).await {
                Ok(true) => EngineState::Asleep,
                // Not asleep is not serving: an engine still starting (its agent killed before
                // it was ready) answers `is_sleeping` too. It serves once `/health` says so.
                Ok(false) | Err(AgentError::EngineStatus { status: 404, .. }) => health().await,
                Err(e) => EngineState::NoAnswer(e.to_string()),
            },
            EngineKind::Sglang => {
                let bound = if expect_awake {
                    self.timeouts.step
                } else {
                    self.timeouts.idle_probe.min(self.timeouts.step)
                };
                match self.sglang_generates(ep, bound).await {
                    Ok(true) => EngineState::Awake,
                    Ok(false) => match self.sglang_server_info(ep).await {
                        Ok(_) => EngineState::NotGenerating,
                        Err(e) => EngineState::NoAnswer(e.to_string()),
                    },
                    Err(e) => EngineState::NoAnswer(e.to_string()),
                }
            }
            EngineKind::Tensorfold => health().await,
        }
    }

    /// Parks the engine in `tier` and checks that it really is asleep. Call it only after the
    /// drain (no request running).
    pub async fn park(&self, ep: &Endpoint, tier: ParkTier) -> Result<(), AgentError> {
        let (step, park) = (self.timeouts.step, self.timeouts.park);
        match (ep.engine, tier) {
            (EngineKind::Vllm, ParkTier::HostRam | ParkTier::Deep) => {
                let level = if tier == ParkTier::HostRam { 1 } else { 2 };
                self.post(ep, "sleep", &format!("/sleep?level={level}"), None, park)
                    .await?;
                self.confirm_vllm(ep, true, step).await
            }
            (EngineKind::Sglang, _) => {
                self.post(ep, "pause_generation", "/pause_generation", None, step)
                    .await?;
                self.post(
                    ep,
                    "release_memory_occupation",
                    "/release_memory_occupation",
                    Some(sglang_tags(tier)),
                    park,
                )
                .await?;
                self.confirm_sglang_parked(ep).await
            }
            (EngineKind::Vllm, ParkTier::KvOnly) => Err(AgentError::Unsupported {
                engine: ep.engine,
                what: "a KV-only park",
            }),
            (EngineKind::Tensorfold, _) => Err(AgentError::Unsupported {
                engine: ep.engine,
                what: "parking (it stops instead)",
            }),
        }
    }

    /// The wake calls of `tier`, each bounded by what is left until `deadline`, then the check
    /// that the engine is awake. Does not run the check prompt.
    pub async fn wake_steps(
        &self,
        ep: &Endpoint,
        tier: ParkTier,
        deadline: Instant,
    ) -> Result<(), AgentError> {
        let left = || deadline.saturating_duration_since(Instant::now());
        let quick = || left().min(self.timeouts.step);
        match (ep.engine, tier) {
            (EngineKind::Vllm, ParkTier::HostRam) => {
                self.post(ep, "wake_up", "/wake_up", None, left()).await?;
                self.confirm_vllm(ep, false, quick()).await
            }
            (EngineKind::Vllm, ParkTier::Deep) => {
                self.post(ep, "wake_up weights", "/wake_up?tags=weights", None, left())
                    .await?;
                self.post(
                    ep,
                    "reload_weights",
                    "/collective_rpc",
                    Some(json!({"method": "reload_weights"})),
                    left(),
                )
                .await?;
                self.post(
                    ep,
                    "wake_up kv_cache",
                    "/wake_up?tags=kv_cache",
                    None,
                    left(),
                )
                .await?;
                self.post(
                    ep,
                    "reset_prefix_cache",
                    "/reset_prefix_cache",
                    None,
                    quick(),
                )
                .await?;
                self.confirm_vllm(ep, false, quick()).await
            }
            (EngineKind::Sglang, _) => {
                self.post(
                    ep,
                    "resume_memory_occupation",
                    "/resume_memory_occupation",
                    Some(sglang_tags(tier)),
                    left(),
                )
                .await?;
                if tier == ParkTier::Deep {
                    let url = ep.url("/update_weights_from_disk");
                    let answer = self
                        .client
                        .expect_json(
                            self.call(ep, "update_weights_from_disk", &url, left()),
                            Method::POST,
                            Some(&json!({"model_path": ep.model})),
                        )
                        .await?;
                    if answer.get("success").and_then(Value::as_bool) == Some(false) {
                        return Err(AgentError::EngineAnswer {
                            engine: ep.engine,
                            step: "update_weights_from_disk",
                            url,
                            detail: format!("the reload failed: {answer}"),
                        });
                    }
                    self.post(ep, "flush_cache", "/flush_cache", None, quick())
                        .await?;
                }
                self.post(
                    ep,
                    "continue_generation",
                    "/continue_generation",
                    None,
                    quick(),
                )
                .await?;
                self.confirm_sglang_awake(ep, quick()).await
            }
            (EngineKind::Vllm, ParkTier::KvOnly) | (EngineKind::Tensorfold, _) => {
                Err(AgentError::Unsupported {
                    engine: ep.engine,
                    what: "this wake",
                })
            }
        }
    }

    async fn completion(
        &self,
        ep: &Endpoint,
        step: &'static str,
        body: &Value,
        timeout: Duration,
    ) -> Result<Value, AgentError> {
        let url = ep.url("/v1/completions");
        self.client
            .expect_json(self.call(ep, step, &url, timeout), Method::POST, Some(body))
            .await
    }

    /// Asks the check prompt (or the fixed decision) and returns the answer.
    pub async fn check_answer(
        &self,
        ep: &Endpoint,
        decision: Option<&DecisionSpec>,
        timeout: Duration,
    ) -> Result<FirstAnswer, AgentError> {
        match decision {
            Some(d) => {
                let answer = self
                    .completion(
                        ep,
                        "decision check",
                        &decision_request(&ep.model_name, d),
                        timeout,
                    )
                    .await?;
                Ok(FirstAnswer::Decision {
                    answer: decision_from_completion(&d.options, &answer),
                })
            }
            None => {
                let answer = self
                    .completion(ep, "check prompt", &check_request(&ep.model_name), timeout)
                    .await?;
                let text = completion_text(&answer).ok_or_else(|| AgentError::EngineAnswer {
                    engine: ep.engine,
                    step: "check prompt",
                    url: ep.url("/v1/completions"),
                    detail: format!("no choices[0].text in {answer}"),
                })?;
                Ok(FirstAnswer::Text {
                    text: text.to_string(),
                })
            }
        }
    }

    /// The one-token warm-up.
    pub async fn warm_up(&self, ep: &Endpoint, timeout: Duration) -> Result<(), AgentError> {
        self.completion(ep, "warm-up", &warm_up_request(&ep.model_name), timeout)
            .await
            .map(drop)
    }

    /// Scrapes `/metrics`; `None` when it cannot be read or holds none of the engine's figures.
    pub async fn scrape(&self, ep: &Endpoint, timeout: Duration) -> Option<EngineLoad> {
        let url = ep.url("/metrics");
        let body = self
            .client
            .expect_ok(self.call(ep, "metrics", &url, timeout), Method::GET, None)
            .await
            .ok()?;
        parse_metrics(ep.engine, &String::from_utf8_lossy(&body))
    }

    async fn get_json_checked(
        &self,
        ep: &Endpoint,
        step: &'static str,
        path: &str,
    ) -> Result<Value, AgentError> {
        let url = ep.url(path);
        self.client
            .expect_json(
                self.call(ep, step, &url, self.timeouts.step),
                Method::GET,
                None,
            )
            .await
    }

    async fn get_json(&self, ep: &Endpoint, step: &'static str, path: &str) -> Option<Value> {
        self.get_json_checked(ep, step, path).await.ok()
    }

    /// SGLang's own `max_running_requests` from `/server_info` (older: `/get_server_info`),
    /// top level or in `internal_states[0]`.
    pub async fn sglang_max_running(&self, ep: &Endpoint) -> Option<u32> {
        let info = self.sglang_server_info(ep).await.ok()?;
        max_running_of(&info)
    }

    /// The engine's version: vLLM `GET /version`, SGLang `/server_info`'s `version`,
    /// TensorFold `GET /version`.
    pub async fn version(&self, ep: &Endpoint) -> Option<String> {
        let v = match ep.engine {
            EngineKind::Sglang => self.get_json(ep, "server_info", "/server_info").await?,
            EngineKind::Vllm | EngineKind::Tensorfold => {
                self.get_json(ep, "version", "/version").await?
            }
        };
        version_of(&v)
    }

    /// Wakes a parked engine and verifies it: the wake steps of `tier`, then the check prompt
    /// (or the fixed decision) compared with `first`, then the one-token warm-up, all within
    /// `window`. A failed step (an error answer, or an engine still asleep after its wake
    /// calls) is [`WakeOutcome::ReloadFailed`]; the whole running past the window, or a step
    /// not answering within its own timeout (its detail names the step and says it was the
    /// step's timeout), [`WakeOutcome::Uncertain`]; a check that cannot be asked
    /// [`WakeOutcome::Uncertain`]; a different answer [`WakeOutcome::Mismatch`]. (Whether the
    /// engine exited is for the caller, who owns the process, to add.)
    ///
    /// The attempt also tells whether the engine could no longer be reached (it may have
    /// exited: the caller finds out).
    pub async fn wake_and_verify(
        &self,
        ep: &Endpoint,
        tier: ParkTier,
        decision: Option<&DecisionSpec>,
        first: Option<&FirstAnswer>,
        window: Duration,
    ) -> WakeAttempt {
        let mut lost = false;
        let mut check_began = None;
        let outcome = self
            .wake_outcome(
                ep,
                (tier, decision, first),
                window,
                &mut lost,
                &mut check_began,
            )
            .await;
        WakeAttempt {
            outcome,
            engine_unreachable: lost,
            check_began,
        }
    }

    async fn wake_outcome(
        &self,
        ep: &Endpoint,
        (tier, decision, first): (ParkTier, Option<&DecisionSpec>, Option<&FirstAnswer>),
        window: Duration,
        lost: &mut bool,
        check_began: &mut Option<Instant>,
    ) -> WakeOutcome {
        let deadline = Instant::now() + window;
        let window_ms = window.as_millis();
        let uncertain = || {
            WakeOutcome::Uncertain(format!(
                "the wake did not finish within the wake window of {window_ms} ms"
            ))
        };
        // A step's own timeout that fired before the window ended is still uncertain (the
        // engine did not say whether its weights came back), but says which step it was.
        let timed_out = |e: &AgentError| {
            if Instant::now() >= deadline {
                uncertain()
            } else {
                WakeOutcome::Uncertain(format!(
                    "{e} (the step's own timeout, inside the wake window of {window_ms} ms)"
                ))
            }
        };
        match tokio::time::timeout_at(deadline, self.wake_steps(ep, tier, deadline)).await {
            Err(_) => return uncertain(),
            Ok(Err(e @ AgentError::EngineTimeout { .. })) => return timed_out(&e),
            Ok(Err(e)) => {
                *lost = matches!(e, AgentError::EngineUnreachable { .. });
                return WakeOutcome::ReloadFailed(e.to_string());
            }
            Ok(Ok(())) => {}
        }
        *check_began = Some(Instant::now());
        let check = async {
            let left = || {
                deadline
                    .saturating_duration_since(Instant::now())
                    .min(self.timeouts.check)
            };
            let now = self.check_answer(ep, decision, left()).await?;
            self.warm_up(ep, left()).await?;
            Ok::<_, AgentError>(now)
        };
        let now = match tokio::time::timeout_at(deadline, check).await {
            Err(_) => return uncertain(),
            Ok(Err(e @ AgentError::EngineTimeout { .. })) => return timed_out(&e),
            Ok(Err(e)) => {
                *lost = matches!(e, AgentError::EngineUnreachable { .. });
                return WakeOutcome::Uncertain(format!("the check after the wake failed: {e}"));
            }
            Ok(Ok(now)) => now,
        };
        let Some(first) = first else {
            return WakeOutcome::Uncertain("no first answer was recorded to compare with".into());
        };
        match compare_answers(first, &now) {
            Ok(()) => WakeOutcome::Pass,
            Err(why) => WakeOutcome::Mismatch(why),
        }
    }
}

/// What [`Driver::wake_and_verify`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WakeAttempt {
    /// How the wake went.
    pub outcome: WakeOutcome,
    /// It failed because the engine could not be reached (refused or broken connection).
    pub engine_unreachable: bool,
    /// When the wake check (the answer compared, the warm-up) began; `None` when the wake
    /// failed before it.
    pub check_began: Option<Instant>,
}

/// vLLM's `/is_sleeping` answer: its boolean `is_sleeping`.
pub(crate) fn is_sleeping_of(answer: &Value) -> Option<bool> {
    answer.get("is_sleeping").and_then(Value::as_bool)
}

/// SGLang's `max_running_requests` in a `/server_info` answer: top level or in
/// `internal_states[0]`.
pub(crate) fn max_running_of(info: &Value) -> Option<u32> {
    info.get("max_running_requests")
        .or_else(|| info.pointer("/internal_states/0/max_running_requests"))
        .and_then(Value::as_u64)
        .and_then(|n| u32::try_from(n).ok())
}

/// The `version` of a `/version` or `/server_info` answer.
pub(crate) fn version_of(answer: &Value) -> Option<String> {
    answer
        .get("version")
        .and_then(Value::as_str)
        .map(str::to_string)
}
