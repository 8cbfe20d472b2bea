//! The engines' command-line flags that a deployment's `extra_args` is read for, in one place
//! for the document checks (here) and the node agent (which launches the engines):
//!
//! - [`has_flag`] and [`flag_value`]: a flag as `--flag value` or `--flag=value`;
//! - [`speculative`]: SGLang with speculative decoding (`--speculative-algorithm`), which parks
//!   with its weights in memory (KV cache only) and refuses `residency: host_backed`
//!   ([`HOST_BACKED_SPECULATIVE`]);
//! - [`owned_flag`]: a flag CapyCTL passes the engine itself (DESIGN.md 4.2), which
//!   `extra_args` must not set.

use crate::kinds::EngineKind;

/// Whether `args` holds `flag`, alone or as `flag=value`.
pub fn has_flag(args: &[String], flag: &str) -> bool {
    flag_position(args, flag).is_some()
}

/// The index of the first occurrence of `flag` in `args`, alone or as `flag=value`.
pub fn flag_position(args: &[String], flag: &str) -> Option<usize> {
    args.iter().position(|a| {
        a == flag
            || a.strip_prefix(flag)
                .is_some_and(|rest| rest.starts_with('='))
    })
}

/// The value of `flag` in `args` (`flag value` or `flag=value`); the last one wins, as in the
/// engines' argument parsers.
pub fn flag_value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    let mut found = None;
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        if a == flag {
            if let Some(v) = args.get(i + 1) {
                found = Some(v.as_str());
                i += 1;
            }
        } else if let Some(v) = a.strip_prefix(flag).and_then(|r| r.strip_prefix('=')) {
            found = Some(v);
        }
        i += 1;
    }
    found
}

/// SGLang's flag that turns on speculative decoding.
pub const SPECULATIVE_FLAG: &str = "--speculative-algorithm";

/// The shortest spelling of [`SPECULATIVE_FLAG`] SGLang's argparse reads as it: shorter ones
/// (`--speculative-a`) are shared with `--speculative-accept-threshold-…` and
/// `--speculative-attention-mode`, so argparse refuses them as ambiguous.
const SPECULATIVE_SHORTEST: &str = "--speculative-al";

/// Whether a deployment of `engine` with `extra_args` runs SGLang with speculative decoding
/// (`--speculative-algorithm X` or `--speculative-algorithm=X`, shortened as argparse allows:
/// `--speculative-algo EAGLE`; `_` for `-`). Such a model parks with its weights in memory:
/// only the KV cache is given back (product page, "How a model parks").
pub fn speculative(engine: EngineKind, extra_args: &[String]) -> bool {
    engine == EngineKind::Sglang
        && extra_args.iter().any(|arg| {
            let name = arg.split_once('=').map_or(arg.as_str(), |(name, _)| name);
            let name = name.replace('_', "-");
            name.len() >= SPECULATIVE_SHORTEST.len() && SPECULATIVE_FLAG.starts_with(&name)
        })
}

/// Why `residency: host_backed` is refused for SGLang with speculative decoding (the product
/// page's reason, in short).
pub const HOST_BACKED_SPECULATIVE: &str = "host_backed is refused for SGLang with speculative \
     decoding (--speculative-algorithm): it parks with its weights in memory, giving back only \
     the KV cache, because releasing them would drop the draft model's weights";

/// A flag CapyCTL passes the engine itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OwnedFlag {
    /// The flag, e.g. `--port`.
    pub flag: &'static str,
    /// What CapyCTL sets with it, e.g. `the engine's loopback port`.
    pub sets: &'static str,
}

const HOST: OwnedFlag = OwnedFlag {
    flag: "--host",
    sets: "the engine's address: 127.0.0.1, so that its control endpoints stay on loopback",
};
const PORT: OwnedFlag = OwnedFlag {
    flag: "--port",
    sets: "the loopback port it picks for the engine",
};
const SERVED_MODEL_NAME: OwnedFlag = OwnedFlag {
    flag: "--served-model-name",
    sets: "the deployment's name, which requests give in `model`",
};
const MODEL: OwnedFlag = OwnedFlag {
    flag: "--model",
    sets: "the deployment's `model`",
};
const MODEL_PATH: OwnedFlag = OwnedFlag {
    flag: "--model-path",
    sets: "the deployment's `model`",
};
const TENSOR_PARALLEL_SIZE: OwnedFlag = OwnedFlag {
    flag: "--tensor-parallel-size",
    sets: "how many GPUs each instance spans, from `gpus_per_instance`",
};
const TP_SIZE: OwnedFlag = OwnedFlag {
    flag: "--tp-size",
    sets: "how many GPUs each instance spans, from `gpus_per_instance`",
};
const SLEEP_MODE: OwnedFlag = OwnedFlag {
    flag: "--enable-sleep-mode",
    sets: "whether the engine can park, from `residency` and the parking tier",
};
const MEMORY_SAVER: OwnedFlag = OwnedFlag {
    flag: "--enable-memory-saver",
    sets: "whether the engine can park, from `residency` and the parking tier",
};
const WEIGHTS_CPU_BACKUP: OwnedFlag = OwnedFlag {
    flag: "--enable-weights-cpu-backup",
    sets: "whether parked weights go to host RAM, from `residency` and the parking tier",
};

/// The flags CapyCTL passes `engine` (DESIGN.md 4.2) that `extra_args` would contradict: where
/// the engine listens, the model and its served name, the parking switches, and how many GPUs
/// an instance spans (`gpus_per_instance`, which also decides how many GPUs it is given). (The
/// flag for how many requests run at once is `max_concurrent_requests`'s, checked with it.)
pub fn owned_flags(engine: EngineKind) -> &'static [OwnedFlag] {
    match engine {
        // vLLM reads `--model` too, over the `serve <model>` CapyCTL passes.
        EngineKind::Vllm => &[
            HOST,
            PORT,
            SERVED_MODEL_NAME,
            MODEL,
            SLEEP_MODE,
            TENSOR_PARALLEL_SIZE,
        ],
        // SGLang's `--model` is another name of `--model-path`.
        EngineKind::Sglang => &[
            HOST,
            PORT,
            SERVED_MODEL_NAME,
            MODEL_PATH,
            MODEL,
            MEMORY_SAVER,
            WEIGHTS_CPU_BACKUP,
            TP_SIZE,
            TENSOR_PARALLEL_SIZE,
        ],
        // CapyCTL passes TensorFold no `--host`, and its engines listen on loopback all the same.
        EngineKind::Tensorfold => &[HOST, PORT, MODEL],
    }
}

/// The engine option that spreads one instance over several GPUs (tensor parallelism), passed
/// with `gpus_per_instance` when it is above 1; TensorFold has none.
pub fn tensor_parallel_flag(engine: EngineKind) -> Option<&'static str> {
    match engine {
        EngineKind::Vllm => Some(TENSOR_PARALLEL_SIZE.flag),
        EngineKind::Sglang => Some(TP_SIZE.flag),
        EngineKind::Tensorfold => None,
    }
}

/// The first argument of `extra_args` that sets a flag CapyCTL passes `engine` itself, in any
/// spelling the engines read: `--port 1`, `--port=1`, with `_` for `-` (`--served_model_name`,
/// which vLLM reads as `--served-model-name`), and shortened (`--hos`, which Python's argparse
/// reads as `--host` when no other flag starts so), and vLLM's short `-tp`. Returns its index
/// and the flag.
pub fn owned_flag(engine: EngineKind, extra_args: &[String]) -> Option<(usize, OwnedFlag)> {
    extra_args.iter().enumerate().find_map(|(i, arg)| {
        let name = arg.split_once('=').map_or(arg.as_str(), |(name, _)| name);
        if engine == EngineKind::Vllm && name == "-tp" {
            return Some((i, TENSOR_PARALLEL_SIZE));
        }
        let name = name.strip_prefix("--")?.replace('_', "-");
        if name.len() < 2 {
            return None;
        }
        let owned = owned_flags(engine);
        // The whole name first: `--model` is SGLang's `--model`, not short for `--model-path`.
        owned
            .iter()
            .find(|f| f.flag.trim_start_matches('-') == name)
            .or_else(|| {
                owned
                    .iter()
                    .find(|f| f.flag.trim_start_matches('-').starts_with(&name))
            })
            .map(|f| (i, *f))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| (*s).to_string()).collect()
    }

    #[test]
    fn speculative_reads_both_spellings_on_sglang_only() {
        let spaced = args(&["--speculative-algorithm", "EAGLE"]);
        let joined = args(&[
            "--mem-fraction-static",
            "0.8",
            "--speculative-algorithm=EAGLE",
        ]);
        assert!(speculative(EngineKind::Sglang, &spaced));
        assert!(speculative(EngineKind::Sglang, &joined));
        assert!(!speculative(EngineKind::Vllm, &spaced));
        // Shortened as argparse reads it, but not into another flag's prefix.
        for short in [
            "--speculative-algo",
            "--speculative-al=EAGLE",
            "--speculative_algorithm",
        ] {
            assert!(
                speculative(EngineKind::Sglang, &args(&[short, "EAGLE"])),
                "{short}"
            );
        }
        for other in [
            "--speculative-a",
            "--speculative-accept-threshold-single",
            "--spec",
        ] {
            assert!(
                !speculative(EngineKind::Sglang, &args(&[other, "1"])),
                "{other}"
            );
        }
        assert!(!speculative(
            EngineKind::Sglang,
            &args(&[
                "--speculative-algorithmx=EAGLE",
                "--speculative-num-steps",
                "3"
            ])
        ));
    }

    #[test]
    fn owned_flags_are_found_in_every_spelling() {
        let at = |engine, a: &[&str]| owned_flag(engine, &args(a)).map(|(i, f)| (i, f.flag));
        assert_eq!(at(EngineKind::Vllm, &["--port", "1"]), Some((0, "--port")));
        assert_eq!(
            at(
                EngineKind::Sglang,
                &["--mem-fraction-static", "0.8", "--host=0.0.0.0"]
            ),
            Some((2, "--host"))
        );
        // How many GPUs an instance spans is `gpus_per_instance`'s, in every spelling.
        assert_eq!(
            at(EngineKind::Sglang, &["--tp", "2"]),
            Some((0, "--tp-size"))
        );
        assert_eq!(
            at(EngineKind::Sglang, &["--tensor-parallel-size=2"]),
            Some((0, "--tensor-parallel-size"))
        );
        assert_eq!(
            at(EngineKind::Vllm, &["--dtype", "auto", "-tp", "2"]),
            Some((2, "--tensor-parallel-size"))
        );
        assert_eq!(at(EngineKind::Tensorfold, &["--tp", "2"]), None);
        assert_eq!(
            at(EngineKind::Vllm, &["--served_model_name", "x"]),
            Some((0, "--served-model-name"))
        );
        assert_eq!(
            at(EngineKind::Sglang, &["--model", "m"]),
            Some((0, "--model"))
        );
        assert_eq!(
            at(EngineKind::Tensorfold, &["--host", "::"]),
            Some((0, "--host"))
        );
        assert_eq!(
            at(EngineKind::Sglang, &["--hos", "::"]),
            Some((0, "--host"))
        );
        assert_eq!(
            at(EngineKind::Vllm, &["--served-model=x"]),
            Some((0, "--served-model-name"))
        );
        assert_eq!(at(EngineKind::Vllm, &["--max-model-len", "8192"]), None);
        assert_eq!(at(EngineKind::Vllm, &["--", "-", "--h"]), None);
        assert_eq!(
            at(EngineKind::Vllm, &["--portal", "--hosts=2", "port"]),
            None
        );
    }

    #[test]
    fn flag_value_takes_the_last() {
        let a = args(&["--max-num-seqs", "4", "--max-num-seqs=9"]);
        assert_eq!(flag_value(&a, "--max-num-seqs"), Some("9"));
        assert_eq!(flag_position(&a, "--max-num-seqs"), Some(0));
        assert!(!has_flag(&a, "--max-num"));
    }
}
