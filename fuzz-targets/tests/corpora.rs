//! Replays every checked-in corpus file (`fuzz/corpus/<target>/`) through its target, then runs
//! each target briefly on inputs mutated from its corpus, with a fixed seed: what CI runs of
//! the fuzzers (the long runs are `cargo +nightly fuzz run <target>`, see the README).

use std::time::{Duration, Instant};

use capyctl_fuzz_targets::{Mutator, TARGETS, corpus, corpus_dir};

/// Mutated inputs per target (stopping early past [`TIME_PER_TARGET`]).
const MUTATIONS: usize = 20_000;
/// The most time one target's mutated inputs take (a debug build on a slow machine).
const TIME_PER_TARGET: Duration = Duration::from_secs(3);
/// The longest mutated input.
const MAX_LEN: usize = 16 * 1024;

#[test]
fn every_target_has_a_corpus_and_a_fuzz_target() {
    let root = corpus_dir("").join("../fuzz_targets");
    for (name, _) in TARGETS {
        let files = corpus(name).unwrap_or_else(|e| panic!("{}: {e}", corpus_dir(name).display()));
        assert!(!files.is_empty(), "the corpus of {name} is empty");
        let source = root.join(format!("{name}.rs"));
        assert!(source.is_file(), "{} is missing", source.display());
    }
}

#[test]
fn every_corpus_file_passes_its_target() {
    for (name, target) in TARGETS {
        for (path, bytes) in corpus(name).unwrap_or_default() {
            let passed = std::panic::catch_unwind(|| target(&bytes));
            assert!(passed.is_ok(), "{name}: {} fails", path.display());
        }
    }
}

#[test]
fn every_target_passes_mutated_inputs() {
    for (i, (name, target)) in TARGETS.iter().enumerate() {
        let inputs: Vec<Vec<u8>> = corpus(name)
            .unwrap_or_default()
            .into_iter()
            .map(|(_, bytes)| bytes)
            .collect();
        if inputs.is_empty() {
            continue;
        }
        let mut mutator = Mutator::new(0x5eed_0000 + i as u64);
        let started = Instant::now();
        let mut ran = 0;
        for n in 0..MUTATIONS {
            if started.elapsed() > TIME_PER_TARGET {
                break;
            }
            let input = mutator.mutate(&inputs[n % inputs.len()], &inputs, MAX_LEN);
            let passed = std::panic::catch_unwind(|| target(&input));
            assert!(
                passed.is_ok(),
                "{name} fails on the mutated input {:?} (seed {:#x}, mutation {n})",
                String::from_utf8_lossy(&input),
                0x5eed_0000 + i as u64
            );
            ran += 1;
        }
        eprintln!("{name}: {ran} mutated inputs in {:?}", started.elapsed());
    }
}
