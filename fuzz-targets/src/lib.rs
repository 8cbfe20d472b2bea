//! CapyCTL's fuzz targets by name, for the cargo-fuzz project in `fuzz/` (nightly, libFuzzer)
//! and for the stable replay test (`cargo test -p capyctl-fuzz-targets`), which runs every
//! checked-in corpus file (`fuzz/corpus/<target>/`) through its target and then each target
//! briefly on inputs mutated from its corpus with a fixed seed ([`Mutator`]).
//!
//! A target takes arbitrary bytes, runs a parser of outside input on them and panics only when
//! an invariant fails; the targets live beside their parsers (`fuzz` modules of the crates).

use std::path::{Path, PathBuf};

/// A fuzz target: parses `data` and checks its invariants, panicking when one fails.
pub type Target = fn(&[u8]);

/// Every target, by the name of its `fuzz/fuzz_targets/<name>.rs` and corpus directory.
pub const TARGETS: &[(&str, Target)] = &[
    // The router: client requests (head, framing, body), the body's `model`, an engine's
    // answer (head, framing, events), an engine's event stream.
    ("request", capyctl_router::proxy::fuzz::request),
    ("model", capyctl_router::proxy::fuzz::model),
    ("response", capyctl_router::proxy::fuzz::response),
    ("sse", capyctl_router::proxy::fuzz::sse),
    // The node agent: an engine's metrics and JSON answers, a checkpoint's headers.
    ("metrics", capyctl_node_agent::fuzz::metrics),
    ("engine_json", capyctl_node_agent::fuzz::engine_json),
    // Documents, settings (and units), overrides.
    ("deployment", capyctl_spec::fuzz::deployment),
    ("settings", capyctl_spec::fuzz::settings),
    ("overrides", capyctl_spec::fuzz::overrides),
    // The management API's bodies and query.
    ("management", capyctl_server::management::fuzz::bodies),
    // The custom resources' specs.
    ("crd", capyctl_crds::fuzz::specs),
    // A request trace (`capyctl simulate --trace`).
    ("trace", capyctl::trace::fuzz),
];

/// The target named `name`.
pub fn target(name: &str) -> Option<Target> {
    TARGETS.iter().find(|(n, _)| *n == name).map(|(_, t)| *t)
}

/// The checked-in corpus directory of a target: `fuzz/corpus/<name>` of the repository.
pub fn corpus_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(name)
}

/// The files of a target's corpus, sorted by name, with their bytes.
pub fn corpus(name: &str) -> std::io::Result<Vec<(PathBuf, Vec<u8>)>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(corpus_dir(name))? {
        let path = entry?.path();
        if path.is_file() {
            let bytes = std::fs::read(&path)?;
            files.push((path, bytes));
        }
    }
    files.sort();
    Ok(files)
}

/// Byte strings the mutator inserts: the tokens the parsers look for.
const DICTIONARY: &[&[u8]] = &[
    b"\r\n",
    b"\n\n",
    b"\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\n",
    b"HTTP/1.1 200 OK\r\n",
    b"Host: a\r\n",
    b"Content-Length: ",
    b"Transfer-Encoding: chunked\r\n",
    b"Connection: close\r\n",
    b"Content-Type: text/event-stream\r\n",
    b"0\r\n\r\n",
    b"ffffffffffffffff",
    b"data: ",
    b"[DONE]",
    b"\"model\"",
    b"\"choices\"",
    b"\"delta\"",
    b"\\u00",
    b"{",
    b"}",
    b"[",
    b"]",
    b"\"",
    b":",
    b",",
    b"\xc3\xa9",
    b"\xff",
    b"\xe2\x80\xa8",
    b"18446744073709551616",
    b"-1",
    b"1e309",
    b"99999999999h",
    b"GiB",
    b"ms",
    b"&a",
    b"*a",
    b"<<: ",
    b"--set ",
    b"CAPYCTL_SET__",
    b"%",
    b"vllm:num_requests_running",
    b"sglang:num_running_reqs",
];

/// A small deterministic mutator (xorshift): byte flips, inserts, deletions, duplications,
/// dictionary tokens and splices with other corpus inputs.
pub struct Mutator {
    state: u64,
}

impl Mutator {
    /// A mutator whose choices follow from `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed.max(1) }
    }

    fn next(&mut self) -> u64 {
        let mut x = self.state;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.state = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }

    /// A mutation of `input`: one to four edits, some splicing from `others`; at most
    /// `max_len` bytes.
    pub fn mutate(&mut self, input: &[u8], others: &[Vec<u8>], max_len: usize) -> Vec<u8> {
        let mut out = input.to_vec();
        for _ in 0..=self.below(4) {
            let at = self.below(out.len() + 1);
            match self.below(7) {
                0 if !out.is_empty() => {
                    let i = self.below(out.len());
                    out[i] ^= 1 << self.below(8);
                }
                1 => {
                    let byte = self.next() as u8;
                    out.insert(at, byte);
                }
                2 if !out.is_empty() => {
                    let start = self.below(out.len());
                    let end = (start + 1 + self.below(16)).min(out.len());
                    out.drain(start..end);
                }
                3 if !out.is_empty() => {
                    let start = self.below(out.len());
                    let end = start + 1 + self.below((out.len() - start).min(64));
                    let piece = out[start..end].to_vec();
                    for _ in 0..=self.below(3) {
                        out.splice(at..at, piece.iter().copied());
                    }
                }
                4 | 5 => {
                    let token = DICTIONARY[self.below(DICTIONARY.len())];
                    out.splice(at..at, token.iter().copied());
                }
                _ if !others.is_empty() => {
                    let other = &others[self.below(others.len())];
                    let start = self.below(other.len() + 1);
                    let end = start + self.below(other.len() - start + 1);
                    out.splice(at..at, other[start..end].iter().copied());
                }
                _ => {}
            }
        }
        out.truncate(max_len);
        out
    }
}
