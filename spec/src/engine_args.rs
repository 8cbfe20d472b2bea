//! The engines' command-line flags that a deployment's `extra_args` is read for, in one place
//! for the document checks (here) and the node agent (which launches the engines):
//!
//! - [`has_flag`] and [`flag_value`]: a flag as `--flag value` or `--flag=value`;
//! - [`speculative`]: SGLang with speculative decoding (`--speculative-algorithm`), which parks
//!   with its weights in memory (KV cache only) and refuses `residency: host_backed`
//!   ([`HOST_BACKED_SPECULATIVE`]);
//! - [`owned_flag`]: a flag CapyCTL passes the engine itself (DESIGN.md 4.2), which
//!   `extra_args` must not set;
//! - [`adapter_flags`]: the engine's LoRA flags for a base with `adapters` (DESIGN.md 4.9),
//!   whose slots [`check_adapter_slots`] checks first.

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

const ENABLE_LORA: OwnedFlag = OwnedFlag {
    flag: "--enable-lora",
    sets: "whether the engine takes LoRA adapters, from `adapters`",
};
const MAX_LORAS: OwnedFlag = OwnedFlag {
    flag: "--max-loras",
    sets: "how many adapters an instance holds at once, from `adapters.max_loaded`",
};
const MAX_LORA_RANK: OwnedFlag = OwnedFlag {
    flag: "--max-lora-rank",
    sets: "the largest adapter rank, from `adapters.max_rank`",
};
const MAX_LOADED_LORAS: OwnedFlag = OwnedFlag {
    flag: "--max-loaded-loras",
    sets: "how many adapters an instance holds at once, from `adapters.max_loaded`",
};
const MAX_LORAS_PER_BATCH: OwnedFlag = OwnedFlag {
    flag: "--max-loras-per-batch",
    sets: "how many adapters an instance holds at once, from `adapters.max_loaded`",
};
const LORA_TARGET_MODULES: OwnedFlag = OwnedFlag {
    flag: "--lora-target-modules",
    sets: "the modules adapters loaded at run time may target (`all`), with `adapters`",
};
const LORA_PATHS: OwnedFlag = OwnedFlag {
    flag: "--lora-paths",
    sets: "the adapters loaded, which are deployments of their own (`adapter:`)",
};
const LORA_MODULES: OwnedFlag = OwnedFlag {
    flag: "--lora-modules",
    sets: "the adapters loaded, which are deployments of their own (`adapter:`)",
};

/// The flags CapyCTL passes `engine` to take LoRA adapters loaded at run time, for a base
/// deployment with `adapters: {max_loaded, max_rank}` (DESIGN.md 4.9), as (flag, value)
/// pairs (`None`: a switch), for slots that [`check_adapter_slots`] accepts:
/// - vLLM 0.32: `--enable-lora --max-loras <max_loaded> --max-lora-rank <rank>`, with the
///   environment's [`VLLM_RUNTIME_LORA_ENV`] (without it vLLM has no load/unload routes);
///   `<rank>` is [`vllm_lora_rank`] of `max_rank`, the next rank vLLM takes (CapyCTL still
///   refuses adapters above the document's `max_rank`);
/// - SGLang 0.5.23: `--enable-lora --max-lora-rank <max_rank> --lora-target-modules all
///   --max-loaded-loras <max_loaded> --max-loras-per-batch <max_loaded>` (with no
///   `--lora-paths` at start SGLang needs the rank and the target modules to size its pool;
///   `--max-loaded-loras`, at least `--max-loras-per-batch`, bounds the adapters it holds:
///   a load beyond it is not refused, SGLang 0.5.23 unloads its least recently used adapter,
///   so CapyCTL itself keeps to `max_loaded`);
/// - TensorFold: none (it takes no adapters; the document refuses `adapters` for it).
pub fn adapter_flags(
    engine: EngineKind,
    max_loaded: u32,
    max_rank: u32,
) -> Vec<(&'static str, Option<String>)> {
    match engine {
        EngineKind::Vllm => vec![
            (ENABLE_LORA.flag, None),
            (MAX_LORAS.flag, Some(max_loaded.to_string())),
            (
                MAX_LORA_RANK.flag,
                Some(vllm_lora_rank(max_rank).unwrap_or(max_rank).to_string()),
            ),
        ],
        EngineKind::Sglang => vec![
            (ENABLE_LORA.flag, None),
            (MAX_LORA_RANK.flag, Some(max_rank.to_string())),
            (LORA_TARGET_MODULES.flag, Some("all".to_string())),
            (MAX_LOADED_LORAS.flag, Some(max_loaded.to_string())),
            (MAX_LORAS_PER_BATCH.flag, Some(max_loaded.to_string())),
        ],
        EngineKind::Tensorfold => Vec::new(),
    }
}

/// The ranks vLLM 0.32 takes for `--max-lora-rank` (`MaxLoRARanks` in `vllm/config/lora.py`;
/// its argument parser exits at start with `invalid choice` for any other).
pub const VLLM_LORA_RANKS: [u32; 9] = [1, 8, 16, 32, 64, 128, 256, 320, 512];

/// The `--max-lora-rank` vLLM gets for a document's `adapters.max_rank`: the smallest of
/// [`VLLM_LORA_RANKS`] at or above it (vLLM sizes its LoRA buffers for that rank; CapyCTL
/// still refuses an adapter above `max_rank` itself). `None` above 512.
pub fn vllm_lora_rank(max_rank: u32) -> Option<u32> {
    VLLM_LORA_RANKS.into_iter().find(|r| *r >= max_rank)
}

/// Why `adapters: {max_loaded, max_rank}` cannot be passed to `engine`, naming the field:
/// either is 0, or `max_rank` is above the largest rank vLLM takes.
pub fn check_adapter_slots(
    engine: EngineKind,
    max_loaded: u32,
    max_rank: u32,
) -> Result<(), String> {
    if max_loaded == 0 {
        return Err("adapters.max_loaded is 0; it must be at least 1".into());
    }
    if max_rank == 0 {
        return Err("adapters.max_rank is 0; it must be at least 1".into());
    }
    if engine == EngineKind::Vllm && vllm_lora_rank(max_rank).is_none() {
        return Err(format!(
            "adapters.max_rank is {max_rank}; vLLM takes LoRA ranks up to {}",
            VLLM_LORA_RANKS[VLLM_LORA_RANKS.len() - 1]
        ));
    }
    Ok(())
}

/// The environment variable vLLM needs to register `/v1/load_lora_adapter` and
/// `/v1/unload_lora_adapter` (set to `True` for a base with `adapters`).
pub const VLLM_RUNTIME_LORA_ENV: &str = "VLLM_ALLOW_RUNTIME_LORA_UPDATING";

/// Whether `engine` takes LoRA adapters loaded at run time (vLLM and SGLang; TensorFold none).
pub fn supports_adapters(engine: EngineKind) -> bool {
    !adapter_flags(engine, 1, 1).is_empty()
}

/// The flags CapyCTL passes `engine` (DESIGN.md 4.2) that `extra_args` would contradict: where
/// the engine listens, the model and its served name, the parking switches, how many GPUs
/// an instance spans (`gpus_per_instance`, which also decides how many GPUs it is given), and
/// the LoRA flags of `adapters` (DESIGN.md 4.9; adapters are deployments of their own, so
/// the engine's own lists of adapters to load at start are CapyCTL's too). (The flag for how
/// many requests run at once is `max_concurrent_requests`'s, checked with it.)
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
            ENABLE_LORA,
            MAX_LORAS,
            MAX_LORA_RANK,
            LORA_MODULES,
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
            ENABLE_LORA,
            MAX_LORA_RANK,
            LORA_TARGET_MODULES,
            MAX_LOADED_LORAS,
            MAX_LORAS_PER_BATCH,
            LORA_PATHS,
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
/// reads as `--host` when no other flag starts so), vLLM's short `-tp`, and negated with `--no-`
/// (`--no-enable-lora`, `--no-enable-sleep-mode`: argparse's `BooleanOptionalAction`, which
/// vLLM's switches use, reads it as the switch turned off, undoing CapyCTL's). Returns its
/// index and the flag.
pub fn owned_flag(engine: EngineKind, extra_args: &[String]) -> Option<(usize, OwnedFlag)> {
    extra_args.iter().enumerate().find_map(|(i, arg)| {
        let name = arg.split_once('=').map_or(arg.as_str(), |(name, _)| name);
        if engine == EngineKind::Vllm && name == "-tp" {
            return Some((i, TENSOR_PARALLEL_SIZE));
        }
        let name = name.strip_prefix("--")?.replace('_', "-");
        // `--no-<flag>` sets the flag too (no flag CapyCTL owns starts with `no-`).
        let name = match name.strip_prefix("no-") {
            Some(negated) => negated.to_string(),
            None => name,
        };
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
    fn the_lora_flags_are_capyctls_own() {
        let at = |engine, a: &[&str]| owned_flag(engine, &args(a)).map(|(i, f)| (i, f.flag));
        // Negated (argparse's `--no-` of a switch) undoes CapyCTL's switch: owned too.
        assert_eq!(
            at(
                EngineKind::Vllm,
                &["--dtype", "float32", "--no-enable-lora"]
            ),
            Some((2, "--enable-lora"))
        );
        assert_eq!(
            at(EngineKind::Vllm, &["--no_enable_sleep_mode"]),
            Some((0, "--enable-sleep-mode"))
        );
        assert_eq!(
            at(EngineKind::Sglang, &["--no-enable-lora"]),
            Some((0, "--enable-lora"))
        );
        // Another engine flag's `--no-` is not.
        assert_eq!(at(EngineKind::Vllm, &["--no-enable-prefix-caching"]), None);
        assert_eq!(at(EngineKind::Vllm, &["--no-", "--no-x"]), None);
        assert_eq!(
            at(EngineKind::Vllm, &["--dtype", "float32", "--enable-lora"]),
            Some((2, "--enable-lora"))
        );
        assert_eq!(
            at(EngineKind::Vllm, &["--max_loras=4"]),
            Some((0, "--max-loras"))
        );
        assert_eq!(
            at(EngineKind::Vllm, &["--max-lora-rank", "64"]),
            Some((0, "--max-lora-rank"))
        );
        assert_eq!(
            at(EngineKind::Vllm, &["--lora-modules", "a=/x"]),
            Some((0, "--lora-modules"))
        );
        assert_eq!(
            at(EngineKind::Sglang, &["--max-loras-per-batch", "2"]),
            Some((0, "--max-loras-per-batch"))
        );
        assert_eq!(
            at(EngineKind::Sglang, &["--lora-paths", "a=/x"]),
            Some((0, "--lora-paths"))
        );
        assert_eq!(
            at(EngineKind::Sglang, &["--max-loaded-loras=3"]),
            Some((0, "--max-loaded-loras"))
        );
        // The engines' other LoRA options stay the user's.
        assert_eq!(at(EngineKind::Vllm, &["--max-cpu-loras", "8"]), None);
        assert_eq!(at(EngineKind::Vllm, &["--lora-dtype", "auto"]), None);
        assert_eq!(at(EngineKind::Sglang, &["--lora-backend", "triton"]), None);
        assert_eq!(
            at(EngineKind::Sglang, &["--enable-lora-overlap-loading"]),
            None
        );
        // TensorFold has no LoRA flag of CapyCTL's (it takes no adapters).
        assert_eq!(at(EngineKind::Tensorfold, &["--enable-lora"]), None);
    }

    #[test]
    fn adapter_flags_follow_the_slots() {
        let flat = |engine| -> Vec<String> {
            adapter_flags(engine, 4, 64)
                .into_iter()
                .flat_map(|(f, v)| std::iter::once(f.to_string()).chain(v))
                .collect()
        };
        assert_eq!(
            flat(EngineKind::Vllm),
            ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "64"]
        );
        assert_eq!(
            flat(EngineKind::Sglang),
            [
                "--enable-lora",
                "--max-lora-rank",
                "64",
                "--lora-target-modules",
                "all",
                "--max-loaded-loras",
                "4",
                "--max-loras-per-batch",
                "4"
            ]
        );
        assert!(flat(EngineKind::Tensorfold).is_empty());
        // vLLM gets the next rank its parser takes; SGLang the rank itself.
        for (max_rank, passed) in [
            (1, 1),
            (4, 8),
            (8, 8),
            (24, 32),
            (48, 64),
            (300, 320),
            (512, 512),
        ] {
            let flags = adapter_flags(EngineKind::Vllm, 2, max_rank);
            assert_eq!(
                flags[2],
                ("--max-lora-rank", Some(passed.to_string())),
                "{max_rank}"
            );
            let flags = adapter_flags(EngineKind::Sglang, 2, max_rank);
            assert_eq!(
                flags[1],
                ("--max-lora-rank", Some(max_rank.to_string())),
                "{max_rank}"
            );
        }
        for (engine, loaded, rank, field) in [
            (EngineKind::Vllm, 0, 8, "adapters.max_loaded"),
            (EngineKind::Sglang, 2, 0, "adapters.max_rank"),
            (
                EngineKind::Vllm,
                2,
                513,
                "adapters.max_rank is 513; vLLM takes LoRA ranks up to 512",
            ),
        ] {
            let checked = check_adapter_slots(engine, loaded, rank);
            assert!(
                checked.as_ref().is_err_and(|e| e.starts_with(field)),
                "{checked:?}"
            );
        }
        assert_eq!(check_adapter_slots(EngineKind::Sglang, 2, 513), Ok(()));
        assert_eq!(check_adapter_slots(EngineKind::Vllm, 1, 4), Ok(()));
        assert!(supports_adapters(EngineKind::Vllm) && supports_adapters(EngineKind::Sglang));
        assert!(!supports_adapters(EngineKind::Tensorfold));
        // Every flag passed is one `extra_args` may not set.
        for engine in [EngineKind::Vllm, EngineKind::Sglang] {
            for (flag, _) in adapter_flags(engine, 1, 8) {
                assert!(owned_flags(engine).iter().any(|f| f.flag == flag), "{flag}");
            }
        }
    }

    #[test]
    fn flag_value_takes_the_last() {
        let a = args(&["--max-num-seqs", "4", "--max-num-seqs=9"]);
        assert_eq!(flag_value(&a, "--max-num-seqs"), Some("9"));
        assert_eq!(flag_position(&a, "--max-num-seqs"), Some(0));
        assert!(!has_flag(&a, "--max-num"));
    }
}
