//! Fuzz targets of what the node agent reads from engines and checkpoints (see `fuzz/` and
//! `fuzz-targets/`): each takes arbitrary bytes, runs the reading the agent runs on them, and
//! panics only when an invariant fails. Not part of the crate's API.
//!
//! - [`metrics`]: an engine's `/metrics` (Prometheus text), for each engine;
//! - [`engine_json`]: an engine's JSON answers (`/is_sleeping`, `/version`, `/server_info`, a
//!   completion, a decision's log probabilities), a checkpoint's `config.json` and a
//!   safetensors file's header ([`safetensors`]).

use std::path::Path;

use capyctl_spec::EngineKind;
use serde_json::Value;

use crate::checkpoint::{ModelFacts, header_size, hybrid_state};
use crate::driver::{is_sleeping_of, max_running_of, version_of};
use crate::load::parse_metrics;
use crate::verify::{
    DecisionAnswer, FirstAnswer, compare_answers, completion_text, decision_from_completion,
};

/// `/metrics` text, read as the agent reads it (lossy UTF-8), for each engine: the KV use is a
/// fraction (at most 1 000 000 ppm), and a text that holds figures still holds them with
/// comment lines and blank lines put between its lines.
pub fn metrics(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let spaced: String = text
        .lines()
        .flat_map(|line| [line, "\n# a comment\n\n"])
        .collect();
    for &engine in EngineKind::ALL {
        let load = parse_metrics(engine, &text);
        if let Some(load) = &load {
            assert!(load.kv_usage_ppm.is_none_or(|ppm| ppm <= 1_000_000));
        }
        assert_eq!(
            parse_metrics(engine, &spaced),
            load,
            "comments and blank lines change the figures"
        );
    }
}

/// An engine's JSON answer, read as each driver step reads it: the figures it takes from it,
/// the check prompt's text, a decision (against three options and against options taken from
/// the answer itself) and a model's `config.json` facts. A first answer made from it compares
/// equal to itself, and writes to JSON and reads back as an answer that compares equal to it
/// (the lifecycle keeps it in its state store).
pub fn engine_json(data: &[u8]) {
    let _ = crate::http::excerpt(data);
    safetensors(data);
    let Ok(answer) = serde_json::from_slice::<Value>(data) else {
        return;
    };
    let _ = is_sleeping_of(&answer);
    let _ = max_running_of(&answer);
    let _ = version_of(&answer);
    let _ = hybrid_state(&answer);
    let facts = ModelFacts {
        model: version_of(&answer).unwrap_or_default(),
        ..Default::default()
    };
    let _ = facts.name_words();
    if let Some(text) = completion_text(&answer) {
        first_answer_holds(FirstAnswer::Text {
            text: text.to_string(),
        });
    }
    let fixed = ["yes".to_string(), "no".to_string(), "Maybe".to_string()];
    let own: Vec<String> = answer
        .get("options")
        .and_then(Value::as_array)
        .map(|o| {
            o.iter()
                .filter_map(Value::as_str)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    for options in [&fixed[..], &own[..]] {
        let decision = decision_from_completion(options, &answer);
        check_decision(options, &decision);
        first_answer_holds(FirstAnswer::Decision { answer: decision });
    }
}

fn check_decision(options: &[String], decision: &DecisionAnswer) {
    if let Some(picked) = &decision.picked {
        assert!(options.contains(picked));
    }
    if let Some(p) = &decision.probabilities {
        for (option, p) in p {
            assert!(options.contains(option));
            assert!(
                p.is_finite() && (0.0..=1.0).contains(p),
                "probability {p} of {option:?}"
            );
        }
    }
}

fn first_answer_holds(first: FirstAnswer) {
    assert_eq!(
        compare_answers(&first, &first),
        expected_self_compare(&first)
    );
    let json = serde_json::to_string(&first).expect("a first answer writes as JSON");
    let again: FirstAnswer = serde_json::from_str(&json)
        .unwrap_or_else(|e| panic!("the first answer {json} does not read back: {e}"));
    // NB: not equal to the last bit: serde_json reads a float back to within an ulp.
    assert_eq!(
        compare_answers(&first, &again),
        expected_self_compare(&first),
        "{json}"
    );
}

/// What comparing a first answer with itself gives: the same, but for a decision without
/// probabilities (the engine gave no log probabilities), which cannot be compared.
fn expected_self_compare(first: &FirstAnswer) -> Result<(), String> {
    match first {
        FirstAnswer::Decision { answer } if answer.probabilities.is_none() => {
            Err("no option probabilities to compare (the engine returned no logprobs)".into())
        }
        _ => Ok(()),
    }
}

/// A safetensors header (the JSON after the length): the size read is the sum of its tensors'
/// sizes, and the tensors are those of the header.
pub fn safetensors(data: &[u8]) {
    let Ok((bytes, tensors)) = header_size(Path::new("fuzz.safetensors"), data) else {
        return;
    };
    let header: serde_json::Map<String, Value> =
        serde_json::from_slice(data).expect("a header that is read is JSON");
    let named = header.keys().filter(|k| *k != "__metadata__").count() as u64;
    assert_eq!(tensors, named);
    if tensors == 0 {
        assert_eq!(bytes, 0);
    }
}
