//! Shared helpers of the integration tests.
#![allow(dead_code, clippy::unwrap_used)]

pub mod agents;

use std::path::{Path, PathBuf};

pub use capyctl_test_support::engine_sim_binary;

/// A fresh, empty temporary directory (the shared test-support's).
pub fn temp_dir(name: &str) -> PathBuf {
    capyctl_test_support::temp_dir(&format!("node-agent-{name}"))
}

/// Writes a safetensors file with `tensors` (name, dtype, shape); the data is zeros.
pub fn write_safetensors(path: &Path, tensors: &[(&str, &str, &[u64])]) -> u64 {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut offset = 0u64;
    for (name, dtype, shape) in tensors {
        let elem = match *dtype {
            "F16" | "BF16" => 2,
            "F32" => 4,
            "F64" | "I64" => 8,
            _ => 1,
        };
        let size = shape.iter().product::<u64>() * elem;
        header.insert(
            (*name).into(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}),
        );
        offset += size;
    }
    let text = serde_json::Value::Object(header).to_string();
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(text.as_bytes());
    bytes.resize(bytes.len() + offset as usize, 0);
    std::fs::write(path, bytes).unwrap();
    offset
}
