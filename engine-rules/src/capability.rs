//! Models their engine cannot wake correctly: parking them is refused
//! (`capability_missing:deep_park`), and they must declare `residency: restart_only`.
//!
//! The whole policy is the one table [`REFUSALS`]; each row has its reason. How a row
//! recognises a model (from [`ModelFacts`]):
//! - **gpt-oss**: the model name's words contain `gpt oss` (`openai/gpt-oss-120b`,
//!   `gpt_oss-20b`, a local dir `/models/gpt-oss-20b`), or a local `config.json` says
//!   `model_type: gpt_oss` or an architecture `GptOss*`.
//! - **NVFP4 (ModelOpt)**: a local `hf_quant_config.json` with `quantization.quant_algo: NVFP4`,
//!   or a `config.json` with `quantization_config.quant_algo: NVFP4`, or a name with the word
//!   `nvfp4` (`nvidia/Llama-3.3-70B-Instruct-NVFP4`).
//! - **Nemotron 3.5 Super VL**: the name's words contain `nemotron`, then `3 5` (or `35`), then
//!   `super` and `vl`, in that order (`nvidia/Nemotron-3.5-Super-VL-…`).
//!
//! Rows are version-aware through `fixed_in`: a row stops applying from that engine version on
//! (and also applies when the version is unknown). No row has a known fix yet, so every row
//! applies to every version of its engines; a row that names the version it was seen on (the
//! Nemotron row names vLLM 0.31.0) says so in its reason, and gets its `fixed_in` once a release
//! wakes the model correctly.
//!
//! The facts a row matches on ([`ModelFacts`]) are read from the checkpoint by the node agent
//! (`capyctl_node_agent::checkpoint`).

use capyctl_interfaces::capability::{DeepPark, EngineInfo};
use capyctl_spec::EngineKind;

/// What the capability table matches a model on: its name and, for a local checkpoint, what its
/// configs say.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelFacts {
    /// The model argument (hub name or path), as given.
    pub model: String,
    /// `quant_algo` from `hf_quant_config.json` (`quantization.quant_algo`) or `config.json`
    /// (`quantization_config.quant_algo`), upper-cased.
    pub quant_algo: Option<String>,
    /// `model_type` from `config.json`.
    pub model_type: Option<String>,
    /// `architectures` from `config.json`.
    pub architectures: Vec<String>,
    /// `config.json` describes a hybrid model (Mamba / state-space or linear-attention layers
    /// beside attention, or a pure state-space model): each running request holds a state of
    /// its own, so the engine's state cache can bound how many run at once (see the node
    /// agent's `checkpoint::hybrid_state`).
    pub hybrid_state: bool,
}

impl ModelFacts {
    /// The name's words: lower-cased, split at anything not a letter or digit
    /// (`nvidia/Nemotron-3.5-Super-VL` → `nvidia nemotron 3 5 super vl`).
    pub fn name_words(&self) -> Vec<String> {
        self.model
            .to_ascii_lowercase()
            .split(|c: char| !c.is_ascii_alphanumeric())
            .filter(|w| !w.is_empty())
            .map(str::to_string)
            .collect()
    }
}

/// Which models a refusal row matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelMatch {
    /// OpenAI's gpt-oss family.
    GptOss,
    /// NVFP4-quantised (ModelOpt) checkpoints.
    Nvfp4,
    /// NVIDIA Nemotron 3.5 Super VL.
    Nemotron35SuperVl,
}

/// One row of the refusal table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefusalRow {
    /// Which models.
    pub model: ModelMatch,
    /// On which engines.
    pub engines: &'static [EngineKind],
    /// The row does not apply when the engine keeps the weights in memory while parked
    /// (SGLang with speculative decoding parks KV-only).
    pub unless_weights_stay: bool,
    /// The first engine version that wakes the model correctly, when one is known.
    pub fixed_in: Option<&'static str>,
    /// Why: shown in `capability_missing:deep_park` and in `Parkable` conditions.
    pub reason: &'static str,
}

/// The refusal table (product page, "How a model parks").
pub const REFUSALS: &[RefusalRow] = &[
    RefusalRow {
        model: ModelMatch::GptOss,
        engines: &[EngineKind::Vllm, EngineKind::Sglang],
        unless_weights_stay: false,
        fixed_in: None,
        reason: "gpt-oss on vLLM and SGLang cannot be woken correctly by its engine",
    },
    RefusalRow {
        model: ModelMatch::Nvfp4,
        engines: &[EngineKind::Sglang],
        unless_weights_stay: true,
        fixed_in: None,
        reason: "NVFP4 (ModelOpt) checkpoints on SGLang cannot be woken correctly unless SGLang keeps the weights in memory",
    },
    RefusalRow {
        model: ModelMatch::Nemotron35SuperVl,
        engines: &[EngineKind::Vllm],
        unless_weights_stay: false,
        fixed_in: None,
        reason: "Nemotron 3.5 Super VL on vLLM: after a park and a wake, vLLM 0.31.0 answers wrongly; \
                 refused on every vLLM version (0.31.0, later and unknown ones) until a release is \
                 known to wake it correctly",
    },
];

fn words_in_order(words: &[String], wanted: &[&[&str]]) -> bool {
    // Each entry of `wanted` is a sequence of consecutive words; the sequences appear in order.
    let mut at = 0;
    'next: for seq in wanted {
        while at + seq.len() <= words.len() {
            if words[at..at + seq.len()]
                .iter()
                .zip(seq.iter())
                .all(|(w, s)| w == s)
            {
                at += seq.len();
                continue 'next;
            }
            at += 1;
        }
        return false;
    }
    true
}

impl ModelMatch {
    /// Whether `facts` describe such a model.
    pub fn matches(self, facts: &ModelFacts) -> bool {
        let words = facts.name_words();
        let has_word = |w: &str| words.iter().any(|x| x == w);
        match self {
            ModelMatch::GptOss => {
                words_in_order(&words, &[&["gpt", "oss"]])
                    || words.iter().any(|w| w.starts_with("gptoss"))
                    || facts.model_type.as_deref() == Some("gpt_oss")
                    || facts
                        .architectures
                        .iter()
                        .any(|a| a.to_ascii_lowercase().starts_with("gptoss"))
            }
            ModelMatch::Nvfp4 => has_word("nvfp4") || facts.quant_algo.as_deref() == Some("NVFP4"),
            ModelMatch::Nemotron35SuperVl => {
                words_in_order(&words, &[&["nemotron"], &["3", "5"], &["super"], &["vl"]])
                    || words_in_order(&words, &[&["nemotron"], &["35"], &["super"], &["vl"]])
            }
        }
    }
}

/// Compares dotted versions numerically (`0.31.0` < `0.31.10`); non-numeric parts compare as 0.
fn version_at_least(version: &str, floor: &str) -> bool {
    let parse = |v: &str| -> Vec<u64> {
        v.trim_start_matches('v')
            .split(['.', '-', '+'])
            .map(|p| {
                p.chars()
                    .take_while(char::is_ascii_digit)
                    .collect::<String>()
                    .parse()
                    .unwrap_or(0)
            })
            .collect()
    };
    let (a, b) = (parse(version), parse(floor));
    let len = a.len().max(b.len());
    let pad = |v: &[u64], i: usize| v.get(i).copied().unwrap_or(0);
    for i in 0..len {
        match pad(&a, i).cmp(&pad(&b, i)) {
            std::cmp::Ordering::Less => return false,
            std::cmp::Ordering::Greater => return true,
            std::cmp::Ordering::Equal => {}
        }
    }
    true
}

/// The refusal that applies to `facts` on `engine` at `version` (unknown = `None`), if any.
/// `weights_stay` is true when the engine keeps the weights in memory while parked.
pub fn refusal_for(
    engine: EngineKind,
    version: Option<&str>,
    facts: &ModelFacts,
    weights_stay: bool,
) -> Option<&'static RefusalRow> {
    REFUSALS.iter().find(|row| {
        row.engines.contains(&engine)
            && !(row.unless_weights_stay && weights_stay)
            && !matches!((row.fixed_in, version), (Some(fix), Some(v)) if version_at_least(v, fix))
            && row.model.matches(facts)
    })
}

/// The `engine list` row of `engine` at `version`.
pub fn engine_info(engine: EngineKind, version: Option<String>) -> EngineInfo {
    let deep_park = match engine {
        EngineKind::Vllm | EngineKind::Sglang => DeepPark::Enabled,
        EngineKind::Tensorfold => {
            DeepPark::Unavailable("TensorFold does not park: it stops".to_string())
        }
    };
    let refused_models = REFUSALS
        .iter()
        .filter(|r| r.engines.contains(&engine))
        .filter(|r| !matches!((r.fixed_in, version.as_deref()), (Some(fix), Some(v)) if version_at_least(v, fix)))
        .map(|r| r.reason)
        .collect();
    EngineInfo {
        engine,
        version,
        deep_park,
        refused_models,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(model: &str) -> ModelFacts {
        ModelFacts {
            model: model.to_string(),
            ..Default::default()
        }
    }

    #[test]
    fn versions_compare_numerically() {
        assert!(version_at_least("0.31.10", "0.31.2"));
        assert!(!version_at_least("0.31.0", "0.32"));
        assert!(version_at_least("v1.0", "1.0.0"));
    }

    #[test]
    fn names_are_recognised() {
        assert!(ModelMatch::GptOss.matches(&named("openai/gpt-oss-120b")));
        assert!(ModelMatch::GptOss.matches(&named("/models/GPT_OSS-20b")));
        assert!(!ModelMatch::GptOss.matches(&named("gpt-2")));
        assert!(ModelMatch::Nvfp4.matches(&named("nvidia/Llama-3.3-70B-Instruct-NVFP4")));
        assert!(!ModelMatch::Nvfp4.matches(&named("nvidia/Llama-3.3-70B-FP8")));
        assert!(ModelMatch::Nemotron35SuperVl.matches(&named("nvidia/Nemotron-3.5-Super-VL-120B")));
        assert!(ModelMatch::Nemotron35SuperVl.matches(&named("nemotron_35_super_vl")));
        assert!(!ModelMatch::Nemotron35SuperVl.matches(&named("nvidia/Nemotron-3.5-Super-120B")));
        assert!(!ModelMatch::Nemotron35SuperVl.matches(&named("nvidia/Nemotron-3-Super-VL")));
    }
}
