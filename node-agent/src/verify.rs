//! Wake verification: the fixed check prompt (or a decision model's fixed decision), the first
//! answer it is compared with, and how a wake ends.
//!
//! The check asks `POST /v1/completions` with [`CHECK_PROMPT`], `temperature: 0` and
//! `max_tokens: `[`CHECK_MAX_TOKENS`]; the text of the answer is the first answer. After every
//! wake the same request runs, then a one-token warm-up, before any waiting request is released.
//!
//! A decision model is asked its decision prompt followed by the options, with
//! `max_tokens: 1`, `temperature: 0` and `logprobs: 20` (OpenAI completions' top log
//! probabilities of the first token). Each option's probability is the sum of `exp(logprob)`
//! of the top tokens that spell it or its unique beginning; the option picked is the most
//! probable one (or, without log probabilities, the option the text spells). A wake passes
//! when the same option is picked and every probability is within [`DECISION_TOLERANCE`].
//! NB: answers without log probabilities cannot pass that comparison. The engine simulator
//! answers them in vLLM's shape and picks an option of a decision prompt while its weights are
//! intact (`tests/driver.rs` checks a pass and a `wake_mismatch`); decision models restart
//! instead of parking in this release, so the lifecycle compares nothing yet.
//!
//! The values (the first answer, a wake's outcome) are `capyctl_interfaces::verify`'s,
//! re-exported here.

use std::collections::BTreeMap;

use serde_json::{Value, json};

pub use capyctl_interfaces::verify::{DecisionAnswer, FirstAnswer, WakeOutcome};

use crate::spec::DecisionSpec;

/// The fixed check prompt.
pub const CHECK_PROMPT: &str =
    "CapyCTL wake check. Continue the list without comment: one, two, three, four,";
/// Tokens the check prompt's answer has.
pub const CHECK_MAX_TOKENS: u32 = 16;
/// How far a decision's option probability may move between the first answer and a wake.
pub const DECISION_TOLERANCE: f64 = 0.05;
/// Top log probabilities asked for a decision (vLLM's maximum).
pub const DECISION_TOP_LOGPROBS: u32 = 20;

/// The body of the check request for model name `model`.
pub fn check_request(model: &str) -> Value {
    json!({
        "model": model,
        "prompt": CHECK_PROMPT,
        "max_tokens": CHECK_MAX_TOKENS,
        "temperature": 0,
        "stream": false,
    })
}

/// The body of the one-token warm-up.
pub fn warm_up_request(model: &str) -> Value {
    json!({
        "model": model,
        "prompt": CHECK_PROMPT,
        "max_tokens": 1,
        "temperature": 0,
        "stream": false,
    })
}

/// The prompt a decision is asked with.
pub fn decision_prompt(decision: &DecisionSpec) -> String {
    format!(
        "{}\nAnswer with exactly one of: {}.\nAnswer:",
        decision.prompt,
        decision.options.join(", ")
    )
}

/// The body of a decision request.
pub fn decision_request(model: &str, decision: &DecisionSpec) -> Value {
    json!({
        "model": model,
        "prompt": decision_prompt(decision),
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": DECISION_TOP_LOGPROBS,
        "stream": false,
    })
}

fn normalise(s: &str) -> String {
    s.trim().to_lowercase()
}

/// The text of `choices[0]` of a completion answer.
pub fn completion_text(answer: &Value) -> Option<&str> {
    answer.pointer("/choices/0/text").and_then(Value::as_str)
}

/// Reads a decision from a completion answer (see the module doc).
pub fn decision_from_completion(options: &[String], answer: &Value) -> DecisionAnswer {
    let opts: Vec<String> = options.iter().map(|o| normalise(o)).collect();
    let option_of = |token: &str| -> Option<usize> {
        let t = normalise(token);
        if t.is_empty() {
            return None;
        }
        if let Some(i) = opts.iter().position(|o| *o == t) {
            return Some(i);
        }
        let starts: Vec<usize> = (0..opts.len())
            .filter(|i| opts[*i].starts_with(&t))
            .collect();
        (starts.len() == 1).then(|| starts[0])
    };
    let top = answer
        .pointer("/choices/0/logprobs/top_logprobs/0")
        .and_then(Value::as_object);
    let probabilities = top.map(|top| {
        let mut p: BTreeMap<String, f64> = options.iter().map(|o| (o.clone(), 0.0)).collect();
        for (token, lp) in top {
            // A probability stays within 0 and 1 whatever the engine sends: a log probability
            // above 0 counts as 0, and the tokens of one option (` yes`, `y`) sum to at most
            // 1. (An infinite one, from a large log probability, would not even write to the
            // state store: JSON has no infinity.)
            if let (Some(i), Some(lp)) = (option_of(token), lp.as_f64())
                && let Some(slot) = p.get_mut(&options[i])
            {
                *slot = (*slot + lp.min(0.0).exp()).min(1.0);
            }
        }
        p
    });
    let picked = match &probabilities {
        Some(p) => options
            .iter()
            .filter(|o| p.get(*o).copied().unwrap_or(0.0) > 0.0)
            .fold(None::<(&String, f64)>, |best, o| {
                let v = p.get(o).copied().unwrap_or(0.0);
                match best {
                    Some((_, b)) if b >= v => best,
                    _ => Some((o, v)),
                }
            })
            .map(|(o, _)| o.clone()),
        None => completion_text(answer)
            .and_then(option_of)
            .map(|i| options[i].clone()),
    };
    DecisionAnswer {
        picked,
        probabilities,
    }
}

/// Compares a decision after a wake with the first one: `Ok` when the same option is picked and
/// every option's probability is within [`DECISION_TOLERANCE`]; otherwise why not.
pub fn compare_decisions(first: &DecisionAnswer, now: &DecisionAnswer) -> Result<(), String> {
    if first.picked != now.picked {
        return Err(format!(
            "picked {:?}, first answer picked {:?}",
            now.picked, first.picked
        ));
    }
    let (Some(a), Some(b)) = (&first.probabilities, &now.probabilities) else {
        return Err("no option probabilities to compare (the engine returned no logprobs)".into());
    };
    for (option, p0) in a {
        let p1 = b.get(option).copied().unwrap_or(0.0);
        if (p1 - p0).abs() > DECISION_TOLERANCE {
            return Err(format!(
                "option {option:?}: probability {p1:.3}, first answer {p0:.3} (tolerance {DECISION_TOLERANCE})"
            ));
        }
    }
    Ok(())
}

/// Compares an answer after a wake with the first answer.
pub fn compare_answers(first: &FirstAnswer, now: &FirstAnswer) -> Result<(), String> {
    match (first, now) {
        (FirstAnswer::Text { text: a }, FirstAnswer::Text { text: b }) if a == b => Ok(()),
        (FirstAnswer::Text { text: a }, FirstAnswer::Text { text: b }) => Err(format!(
            "the check prompt's answer {b:?} differs from the first answer {a:?}"
        )),
        (FirstAnswer::Decision { answer: a }, FirstAnswer::Decision { answer: b }) => {
            compare_decisions(a, b)
        }
        _ => Err("the answers are of different kinds".into()),
    }
}
