//! Deterministic "inference": words picked by a sha2 hash of (model, weights salt, prompt,
//! token index), their log probabilities, prompt token counts, and embedding vectors.
//!
//! Log probabilities: the token answered is always the most probable one (as at temperature
//! 0), with a probability of 0.40 to 0.95 taken from the same hash; the alternatives are other
//! words, the k-th (from 0) with `(1 - p) / 2^(k+1)`, so the top list is sorted and sums
//! below 1.
//!
//! Decisions: a prompt with a line holding `one of: a, b, c.` (CapyCTL's decision prompt says
//! `Answer with exactly one of: yes, no.`) is answered as an instruction-following model
//! would: with intact weights the first token is one whole option, with a probability of 0.60
//! to 0.95, and the other options follow it in the top list. With wrong weights the model
//! ignores the instruction and answers words, so a decision after a bad wake picks nothing.

use sha2::{Digest, Sha256};

/// The fixed vocabulary answers are drawn from.
const VOCABULARY: [&str; 64] = [
    "the",
    "capybara",
    "river",
    "model",
    "quiet",
    "green",
    "swims",
    "under",
    "a",
    "warm",
    "afternoon",
    "and",
    "reads",
    "tokens",
    "slowly",
    "near",
    "GPU",
    "memory",
    "parks",
    "wakes",
    "bright",
    "answer",
    "of",
    "stone",
    "leaf",
    "water",
    "runs",
    "over",
    "small",
    "lazy",
    "moon",
    "light",
    "across",
    "field",
    "where",
    "grass",
    "grows",
    "tall",
    "every",
    "morning",
    "sun",
    "rises",
    "gently",
    "above",
    "hill",
    "birds",
    "sing",
    "softly",
    "while",
    "wind",
    "moves",
    "clouds",
    "far",
    "away",
    "into",
    "blue",
    "sky",
    "dreams",
    "begin",
    "again",
    "with",
    "calm",
    "steady",
    "rhythm",
];

/// Salt of intact weights; anything else makes other words.
pub const INTACT: &str = "intact";

/// Generates the words of one answer.
#[derive(Clone)]
pub struct Words {
    base: Sha256,
    /// The options of a decision prompt, answered as the first token (intact weights only).
    options: Option<Vec<String>>,
}

/// One token's log probability and the most probable tokens at its place.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The natural log of the answered token's probability.
    pub logprob: f64,
    /// Up to the number asked of (token, logprob), most probable first; the answered token is
    /// the first.
    pub top: Vec<(String, f64)>,
}

/// The options of the last line of `prompt` holding `one of:` followed by a comma-separated
/// list ending in `.` (or the line's end); `None` without such a line or with fewer than 2.
pub fn decision_options(prompt: &str) -> Option<Vec<String>> {
    let line = prompt.lines().rev().find(|l| l.contains("one of:"))?;
    let (_, list) = line.rsplit_once("one of:")?;
    let list = list.trim();
    let list = list.strip_suffix('.').unwrap_or(list);
    let mut options: Vec<String> = Vec::new();
    for o in list.split(',').map(str::trim) {
        if o.is_empty() {
            return None;
        }
        if !options.iter().any(|x| x == o) {
            options.push(o.to_owned());
        }
    }
    (options.len() >= 2).then_some(options)
}

/// A probability from a hash byte: `low` at 0, `high` at 255.
fn share(byte: u8, low: f64, high: f64) -> f64 {
    low + (high - low) * f64::from(byte) / 255.0
}

impl std::fmt::Debug for Words {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Words")
    }
}

impl Words {
    /// An answer of `model` with weights described by `salt` (see [`INTACT`]) to `prompt`.
    pub fn new(model: &str, salt: &str, prompt: &str) -> Words {
        let mut base = Sha256::new();
        for part in [model, salt, prompt] {
            base.update((part.len() as u64).to_le_bytes());
            base.update(part.as_bytes());
        }
        Words {
            base,
            options: None,
        }
    }

    /// The answer of `model` with weights `salt` to `prompt`: [`Words::new`], answering a
    /// decision prompt's options when the weights are intact (see the module doc).
    pub fn answering(model: &str, salt: &str, prompt: &str) -> Words {
        let mut words = Words::new(model, salt, prompt);
        if salt == INTACT {
            words.options = decision_options(prompt);
        }
        words
    }

    /// The option picked (its index) and its probability, for a decision's first token.
    fn decision(&self) -> Option<(&[String], usize, f64)> {
        let options = self.options.as_deref()?;
        let d = self.digest(0);
        let picked = usize::from(d[0]) % options.len();
        Some((options, picked, share(d[1], 0.60, 0.95)))
    }

    fn spaced(index: u64, word: &str) -> String {
        if index == 0 {
            word.to_owned()
        } else {
            format!(" {word}")
        }
    }
    fn digest(&self, index: u64) -> [u8; 32] {
        let mut h = self.base.clone();
        h.update(index.to_le_bytes());
        h.finalize().into()
    }

    /// The text of token `index`: a word, with a leading space after the first (or, for a
    /// decision prompt's first token, the option picked).
    pub fn token(&self, index: u64) -> String {
        if index == 0
            && let Some((options, picked, _)) = self.decision()
        {
            return options[picked].clone();
        }
        let d = self.digest(index);
        Self::spaced(index, VOCABULARY[usize::from(d[0]) % VOCABULARY.len()])
    }

    /// The log probability of token `index` and the `top` most probable tokens at its place
    /// (the token itself first), as the module doc says.
    pub fn logprobs(&self, index: u64, top: usize) -> TokenLogprobs {
        let d = self.digest(index);
        let chosen = self.token(index);
        let (p, mut others): (f64, Vec<String>) = match (index, self.decision()) {
            (0, Some((options, picked, p))) => (
                p,
                (1..options.len())
                    .map(|k| options[(picked + k) % options.len()].clone())
                    .collect(),
            ),
            _ => (share(d[1], 0.40, 0.95), Vec::new()),
        };
        // Then other words: from the hash, then the vocabulary in order, without repeats.
        let words = d[2..]
            .iter()
            .map(|b| VOCABULARY[usize::from(*b) % VOCABULARY.len()])
            .chain(VOCABULARY);
        for word in words {
            if others.len() + 1 >= top {
                break;
            }
            let word = Self::spaced(index, word);
            if word != chosen && !others.contains(&word) {
                others.push(word);
            }
        }
        let rest = 1.0 - p;
        let mut list = vec![(chosen, p.ln())];
        list.extend(
            others
                .into_iter()
                .zip(1..)
                .map(|(t, k)| (t, (rest / 2f64.powi(k)).ln())),
        );
        list.truncate(top);
        TokenLogprobs {
            logprob: p.ln(),
            top: list,
        }
    }
}

/// Prompt tokens: whitespace-separated words, at least one.
pub fn count_tokens(prompt: &str) -> u64 {
    (prompt.split_whitespace().count() as u64).max(1)
}

/// Dimensions of an embedding vector.
pub const EMBEDDING_DIM: usize = 32;

/// A deterministic, unit-length embedding of `input`.
pub fn embedding(model: &str, salt: &str, input: &str) -> Vec<f32> {
    let words = Words::new(model, salt, input);
    let mut v: Vec<f32> = (0..EMBEDDING_DIM as u64)
        .map(|i| {
            let d = words.digest(i);
            let x = u32::from_le_bytes([d[0], d[1], d[2], d[3]]);
            (x as f64 / u32::MAX as f64 * 2.0 - 1.0) as f32
        })
        .collect();
    let norm = v
        .iter()
        .map(|x| x * x)
        .sum::<f32>()
        .sqrt()
        .max(f32::EPSILON);
    v.iter_mut().for_each(|x| *x /= norm);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_inputs_same_words_other_salt_other_words() {
        let a = Words::new("m", INTACT, "hello");
        let b = Words::new("m", INTACT, "hello");
        let c = Words::new("m", "garbage", "hello");
        let take = |w: &Words| (0..16).map(|i| w.token(i)).collect::<String>();
        assert_eq!(take(&a), take(&b));
        assert_ne!(take(&a), take(&c));
        assert!(!take(&a).starts_with(' '));
    }

    #[test]
    fn logprobs_are_sorted_distinct_and_sum_below_one() {
        let w = Words::answering("m", INTACT, "hello there");
        for i in 0..8 {
            let lp = w.logprobs(i, 20);
            assert_eq!(lp.top.len(), 20);
            assert_eq!(lp.top[0], (w.token(i), lp.logprob));
            let sum: f64 = lp.top.iter().map(|(_, l)| l.exp()).sum();
            assert!(sum < 1.0 && sum > 0.9, "{sum}");
            assert!(lp.top.windows(2).all(|p| p[0].1 > p[1].1));
            let mut tokens: Vec<&String> = lp.top.iter().map(|(t, _)| t).collect();
            tokens.sort();
            tokens.dedup();
            assert_eq!(tokens.len(), 20);
            assert_eq!(lp, w.logprobs(i, 20));
        }
        assert!(w.logprobs(0, 0).top.is_empty());
        assert_eq!(w.logprobs(3, 1).top.len(), 1);
    }

    #[test]
    fn decision_prompts_are_answered_with_an_option_while_the_weights_are_intact() {
        let prompt = "Is the sky blue?\nAnswer with exactly one of: yes, no, maybe so.\nAnswer:";
        assert_eq!(
            decision_options(prompt),
            Some(vec!["yes".into(), "no".into(), "maybe so".into()])
        );
        assert_eq!(decision_options("pick one of: a."), None);
        assert_eq!(decision_options("pick one of: a, , b"), None);
        assert_eq!(decision_options("no list here"), None);
        let w = Words::answering("m", INTACT, prompt);
        let lp = w.logprobs(0, 5);
        let first: Vec<&str> = lp.top.iter().take(3).map(|(t, _)| t.as_str()).collect();
        assert!(["yes", "no", "maybe so"].contains(&w.token(0).as_str()));
        for o in ["yes", "no", "maybe so"] {
            assert!(first.contains(&o), "{first:?}");
        }
        assert!(lp.logprob.exp() >= 0.6);
        // Wrong weights ignore the instruction.
        let bad = Words::answering("m", "corrupted", prompt);
        assert!(!["yes", "no", "maybe so"].contains(&bad.token(0).as_str()));
        // Words::new never answers options.
        assert_eq!(Words::new("m", INTACT, prompt).options, None);
    }

    #[test]
    fn embeddings_are_unit_length() {
        let e = embedding("m", INTACT, "x");
        assert_eq!(e.len(), EMBEDDING_DIM);
        let n: f32 = e.iter().map(|x| x * x).sum();
        assert!((n - 1.0).abs() < 1e-4);
        assert_eq!(e, embedding("m", INTACT, "x"));
    }
}
