//! What a restarted agent does with an engine a previous run left alive (crash-only, DESIGN
//! section 5): adopt it as ready, adopt it as parked, or stop it, from its pid record and from
//! where the engine itself says it is. Pure; the engine is asked by
//! [`Driver::engine_state`](crate::driver::Driver::engine_state).
//!
//! The agent writes the intent of a park or a wake ([`Transition`]) into the record before it
//! calls the engine, and the outcome (`parked`) after. So a record tells what the agent knew
//! when it was killed, and the engine tells where it is now:
//!
//! | record | engine says | verdict |
//! |---|---|---|
//! | ready | awake | ready |
//! | ready | asleep, not generating | stop (it changed behind the agent's back) |
//! | parked in T | asleep (vLLM), not generating (SGLang) | parked in T: the next request wakes it, with the wake check |
//! | parked in T | awake | stop (it serves weights nobody checked) |
//! | parking into T | asleep (vLLM: `is_sleeping` answers after the sleep finished) | parked in T |
//! | parking into T | awake | stop: the sleep may still be under way (killed between the intent and the call, or during the call) |
//! | parking into T | not generating (SGLang) | stop: SGLang cannot say whether its memory was released |
//! | waking from T | anything | stop: the wake was not verified |
//! | any | no answer | stop |
//!
//! When unsure, stop: never serve unverified weights, never count memory as free that may
//! not be.

use serde::{Deserialize, Serialize};

use crate::process::PidRecord;
use crate::tier::ParkTier;

/// A park or a wake the agent began: written to the pid record before the engine is called
/// and cleared once the outcome is recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "to", content = "tier")]
pub enum Transition {
    /// Parking into this tier.
    Parking(ParkTier),
    /// Waking from this tier.
    Waking(ParkTier),
}

/// Where an engine says it is, asked without making a parked engine generate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineState {
    /// It serves: vLLM `is_sleeping` false (or absent without sleep mode) and `/health` 200
    /// (vLLM answers nothing while it starts; an engine answering `is_sleeping` false and
    /// `/health` 503 is not awake either), SGLang `/health_generate` 200, TensorFold `/health`
    /// 200.
    Awake,
    /// It says it is asleep: vLLM `is_sleeping` true.
    Asleep,
    /// SGLang: `/health_generate` does not answer 200 within the short probe, `/server_info`
    /// (or `/get_server_info`) answers. It
    /// does not generate; SGLang cannot say whether its memory is released.
    NotGenerating,
    /// It does not answer as expected; why.
    NoAnswer(String),
}

/// What recovery does with an engine left alive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecoveryVerdict {
    /// Adopt it, ready to serve.
    Ready,
    /// Adopt it, parked in this tier.
    Parked(ParkTier),
    /// Stop it, and why.
    Stop(String),
}

impl RecoveryVerdict {
    /// Whether the engine is adopted.
    pub fn adopts(&self) -> bool {
        !matches!(self, RecoveryVerdict::Stop(_))
    }
}

/// The verdict for `record` whose engine is in `state` (see the module doc's table).
pub fn recovery_verdict(record: &PidRecord, state: &EngineState) -> RecoveryVerdict {
    use EngineState::{Asleep, Awake, NoAnswer, NotGenerating};
    use RecoveryVerdict::{Parked, Ready, Stop};
    let stop = |why: &str| Stop(why.to_string());
    match (record.transition, record.parked, state) {
        (Some(Transition::Waking(_)), _, _) => {
            stop("it was left during a wake, whose check never ran")
        }
        (_, _, NoAnswer(why)) => Stop(format!("it does not answer: {why}")),
        (Some(Transition::Parking(tier)), _, Asleep) => Parked(tier),
        (Some(Transition::Parking(_)), _, Awake) => {
            stop("it was left with a park begun and is awake: the park may still be under way")
        }
        (Some(Transition::Parking(_)), _, NotGenerating) => stop(
            "it was left during a park and does not generate, but cannot say whether its memory \
             was released",
        ),
        (None, Some(tier), Asleep | NotGenerating) => Parked(tier),
        (None, Some(_), Awake) => {
            stop("it was recorded parked but serves: its weights are unchecked")
        }
        (None, None, Awake) => Ready,
        (None, None, Asleep | NotGenerating) => stop("it was recorded ready but does not serve"),
    }
}

/// The record of an adopted engine as it goes on: the verdict's tier, no transition.
pub fn settled(mut record: PidRecord, verdict: &RecoveryVerdict) -> PidRecord {
    record.parked = match verdict {
        RecoveryVerdict::Parked(tier) => Some(*tier),
        RecoveryVerdict::Ready | RecoveryVerdict::Stop(_) => None,
    };
    record.transition = None;
    record
}
