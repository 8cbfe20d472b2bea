//! Deterministic "inference": words picked by a sha2 hash of (model, weights salt, prompt,
//! token index), prompt token counts, and embedding vectors.

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
        Words { base }
    }

    fn digest(&self, index: u64) -> [u8; 32] {
        let mut h = self.base.clone();
        h.update(index.to_le_bytes());
        h.finalize().into()
    }

    /// The text of token `index`: a word, with a leading space after the first.
    pub fn token(&self, index: u64) -> String {
        let d = self.digest(index);
        let word = VOCABULARY[usize::from(d[0]) % VOCABULARY.len()];
        if index == 0 {
            word.to_owned()
        } else {
            format!(" {word}")
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
    fn embeddings_are_unit_length() {
        let e = embedding("m", INTACT, "x");
        assert_eq!(e.len(), EMBEDDING_DIM);
        let n: f32 = e.iter().map(|x| x * x).sum();
        assert!((n - 1.0).abs() < 1e-4);
        assert_eq!(e, embedding("m", INTACT, "x"));
    }
}
