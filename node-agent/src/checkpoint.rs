//! What a local checkpoint says about itself, read without loading weights: the tensors' byte
//! sizes from the safetensors headers, and the quantisation and architecture from its configs.
//!
//! A safetensors file starts with an 8-byte little-endian header length N and N bytes of JSON
//! mapping each tensor name to `{dtype, shape, data_offsets}` (plus an optional
//! `__metadata__`). Only those 8 + N bytes are read.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::AgentError;

/// What the capability table matches a model on (`capyctl_engine_rules::capability`'s), read
/// here from a checkpoint ([`ReadFacts`]).
pub use capyctl_engine_rules::capability::ModelFacts;

/// The largest header accepted (the safetensors format caps it at 100 MB).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// The weights of a local checkpoint, summed from its safetensors headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointSize {
    /// Bytes of all tensors.
    pub weights_bytes: u64,
    /// How many tensors.
    pub tensors: u64,
    /// How many `*.safetensors` files were read.
    pub files: u64,
}

/// The byte size of one element of a safetensors `dtype`; `None` for an unknown dtype.
/// Sub-byte types (`F4`, packed) are not listed: their size comes from `data_offsets`.
pub fn dtype_bytes(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" | "F8_E8M0" => 1,
        "F16" | "BF16" | "I16" | "U16" => 2,
        "F32" | "I32" | "U32" => 4,
        "F64" | "I64" | "U64" => 8,
        _ => return None,
    })
}

fn bad(path: &Path, detail: impl Into<String>) -> AgentError {
    AgentError::Checkpoint {
        path: path.to_path_buf(),
        detail: detail.into(),
    }
}

/// Reads one file's header and returns (bytes of its tensors, number of tensors).
///
/// A tensor's size is `data_offsets[1] - data_offsets[0]`; where the dtype has a whole-byte
/// size, it must equal the elements times that size, or the file is refused.
pub fn safetensors_file_size(path: &Path) -> Result<(u64, u64), AgentError> {
    let mut file =
        File::open(path).map_err(|e| AgentError::io(format!("open {}", path.display()), e))?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len)
        .map_err(|e| AgentError::io(format!("read the header length of {}", path.display()), e))?;
    let len = u64::from_le_bytes(len);
    if len == 0 || len > MAX_HEADER_BYTES {
        return Err(bad(path, format!("header length {len} is out of range")));
    }
    let file_len = file
        .metadata()
        .map_err(|e| AgentError::io(format!("stat {}", path.display()), e))?
        .len();
    if len + 8 > file_len {
        return Err(bad(path, "the header is longer than the file"));
    }
    let mut header = vec![0u8; usize::try_from(len).map_err(|_| bad(path, "header too long"))?];
    file.read_exact(&mut header)
        .map_err(|e| AgentError::io(format!("read the header of {}", path.display()), e))?;
    header_size(path, &header)
}

/// The (bytes of its tensors, number of tensors) a safetensors header says (the JSON after
/// the length; `path` names the file in errors).
pub fn header_size(path: &Path, header: &[u8]) -> Result<(u64, u64), AgentError> {
    let header: serde_json::Map<String, Value> =
        serde_json::from_slice(header).map_err(|e| AgentError::Json {
            what: format!("the safetensors header of {}", path.display()),
            source: e,
        })?;
    let mut bytes = 0u64;
    let mut tensors = 0u64;
    for (name, info) in &header {
        if name == "__metadata__" {
            continue;
        }
        let offsets = info
            .get("data_offsets")
            .and_then(Value::as_array)
            .and_then(|o| Some((o.first()?.as_u64()?, o.get(1)?.as_u64()?)))
            .ok_or_else(|| bad(path, format!("tensor {name} has no data_offsets")))?;
        let size = offsets
            .1
            .checked_sub(offsets.0)
            .ok_or_else(|| bad(path, format!("tensor {name} has reversed data_offsets")))?;
        let dtype = info.get("dtype").and_then(Value::as_str).unwrap_or("");
        let shape: Option<Vec<u64>> = info
            .get("shape")
            .and_then(Value::as_array)
            .map(|s| s.iter().filter_map(Value::as_u64).collect());
        if let (Some(elem), Some(shape)) = (dtype_bytes(dtype), shape) {
            let expected = shape
                .iter()
                .try_fold(elem, |acc, d| acc.checked_mul(*d))
                .ok_or_else(|| bad(path, format!("tensor {name} is too large")))?;
            if expected != size {
                return Err(bad(
                    path,
                    format!(
                        "tensor {name}: {dtype} {shape:?} is {expected} bytes, data_offsets say {size}"
                    ),
                ));
            }
        }
        bytes = bytes
            .checked_add(size)
            .ok_or_else(|| bad(path, "the tensors' sizes overflow"))?;
        tensors += 1;
    }
    Ok((bytes, tensors))
}

/// The safetensors files of a checkpoint directory: those named in
/// `model.safetensors.index.json`'s `weight_map` when it exists (so a `consolidated.safetensors`
/// beside the shards is not counted twice), else every `*.safetensors` in the directory.
fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>, AgentError> {
    let index = dir.join("model.safetensors.index.json");
    if let Ok(text) = std::fs::read_to_string(&index) {
        let value: Value = serde_json::from_str(&text).map_err(|e| AgentError::Json {
            what: format!("read {}", index.display()),
            source: e,
        })?;
        if let Some(map) = value.get("weight_map").and_then(Value::as_object) {
            let mut files: Vec<PathBuf> = map
                .values()
                .filter_map(Value::as_str)
                .map(|f| dir.join(f))
                .collect();
            files.sort();
            files.dedup();
            return Ok(files);
        }
    }
    let entries =
        std::fs::read_dir(dir).map_err(|e| AgentError::io(format!("list {}", dir.display()), e))?;
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| AgentError::io(format!("list {}", dir.display()), e))?;
        let path = entry.path();
        if path.extension().is_some_and(|x| x == "safetensors") && path.is_file() {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// The size of the checkpoint in directory `dir`; `None` when it has no safetensors file.
/// Blocking: call it from `spawn_blocking` in async code.
pub fn checkpoint_size(dir: &Path) -> Result<Option<CheckpointSize>, AgentError> {
    let files = safetensors_files(dir)?;
    if files.is_empty() {
        return Ok(None);
    }
    let mut total = CheckpointSize {
        weights_bytes: 0,
        tensors: 0,
        files: 0,
    };
    for file in &files {
        let (bytes, tensors) = safetensors_file_size(file)?;
        total.weights_bytes = total.weights_bytes.saturating_add(bytes);
        total.tensors += tensors;
        total.files += 1;
    }
    Ok(Some(total))
}

/// `model_type`s of hybrid and state-space models (Hugging Face `config.json`).
const HYBRID_MODEL_TYPES: &[&str] = &[
    "mamba",
    "mamba2",
    "falcon_mamba",
    "jamba",
    "zamba",
    "zamba2",
    "bamba",
    "falcon_h1",
    "nemotron_h",
    "granitemoehybrid",
    "qwen3_next",
    "plamo2",
    "minimax",
    "minimax_m1",
    "kimi_linear",
];

/// Whether a `config.json` (or its `text_config`, for vision-language models) describes a
/// hybrid or state-space model: a `model_type` of [`HYBRID_MODEL_TYPES`], `layer_types` or
/// `layers_block_type` naming `linear_attention` or `mamba` layers (Qwen3-Next, Granite 4
/// hybrids, Zamba), a `hybrid_override_pattern` with Mamba layers `M` (Nemotron-H) or a
/// `linear_attn_config` (Kimi Linear).
pub fn hybrid_state(config: &Value) -> bool {
    let one = |c: &Value| -> bool {
        let model_type = c.get("model_type").and_then(Value::as_str);
        let layers_named = |key: &str| {
            c.get(key).and_then(Value::as_array).is_some_and(|layers| {
                layers.iter().filter_map(Value::as_str).any(|l| {
                    let l = l.to_ascii_lowercase();
                    l.contains("linear_attention") || l.contains("mamba")
                })
            })
        };
        model_type.is_some_and(|t| HYBRID_MODEL_TYPES.contains(&t))
            || layers_named("layer_types")
            || layers_named("layers_block_type")
            || c.get("hybrid_override_pattern")
                .and_then(Value::as_str)
                .is_some_and(|p| p.contains('M'))
            || c.get("linear_attn_config").is_some_and(Value::is_object)
    };
    one(config) || config.get("text_config").is_some_and(one)
}

/// Reads a model's [`ModelFacts`], the capability table's input (`ModelFacts::read`).
pub trait ReadFacts {
    /// The facts of `model`: the name alone for a hub name, plus the configs for a local
    /// directory. Unreadable configs are skipped (the name still matches). Blocking.
    fn read(model: &str) -> Self;
}

impl ReadFacts for ModelFacts {
    fn read(model: &str) -> Self {
        let mut facts = ModelFacts {
            model: model.to_string(),
            ..Default::default()
        };
        let dir = Path::new(model);
        if !dir.is_dir() {
            return facts;
        }
        let json = |name: &str| -> Option<Value> {
            let text = std::fs::read_to_string(dir.join(name)).ok()?;
            serde_json::from_str(&text).ok()
        };
        if let Some(q) = json("hf_quant_config.json") {
            facts.quant_algo = q
                .pointer("/quantization/quant_algo")
                .or_else(|| q.get("quant_algo"))
                .and_then(Value::as_str)
                .map(str::to_ascii_uppercase);
        }
        if let Some(c) = json("config.json") {
            if facts.quant_algo.is_none() {
                facts.quant_algo = c
                    .pointer("/quantization_config/quant_algo")
                    .and_then(Value::as_str)
                    .map(str::to_ascii_uppercase);
            }
            facts.model_type = c
                .get("model_type")
                .and_then(Value::as_str)
                .map(str::to_string);
            facts.architectures = c
                .get("architectures")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(Value::as_str)
                        .map(str::to_string)
                        .collect()
                })
                .unwrap_or_default();
            facts.hybrid_state = hybrid_state(&c);
        }
        facts
    }
}
