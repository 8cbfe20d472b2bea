//! How an inference request names the LoRA adapter it runs with (DESIGN 4.9), per engine: the
//! router forwards `model` as the client sent it (the adapter's name) and, where the base's
//! engine needs it, sets the field [`adapter_request_field`] names. The node agent's driver
//! re-exports it; `node-agent/tests/contract.rs` checks it against the engine's source.

use capyctl_spec::EngineKind;

/// The field of an inference request's body that names the LoRA adapter it runs with, besides
/// `model` (which the router leaves as the client sent it: the adapter's name), for a base on
/// `engine`; `None` where `model` alone does.
///
/// - vLLM 0.32 serves a loaded adapter under its own name: `model` is enough.
/// - SGLang 0.5.23's OpenAI routes (`/v1/chat/completions`, `/v1/completions`) do not look
///   `model` up: `OpenAIServingBase._resolve_lora_path` takes the adapter from `model` only
///   in the `base-model:adapter-name` form (`_parse_model_parameter`: the text after the
///   served model's name and a colon, else after the first colon), which wins, else from the
///   `lora_path` field of `CompletionRequest` / `ChatCompletionRequest`. A bare adapter name
///   in `model` runs on the **base**, answering 200 (a wrong answer, not an error). CapyCTL
///   sends `lora_path`: it needs no served model name (the `base:` prefix would have to be
///   the engine's `--served-model-name`), and it leaves `model` as the client sent it
///   (SGLang echoes it in the answer).
/// - TensorFold serves no adapters.
pub fn adapter_request_field(engine: EngineKind) -> Option<&'static str> {
    match engine {
        EngineKind::Vllm | EngineKind::Tensorfold => None,
        EngineKind::Sglang => Some(SGLANG_ADAPTER_FIELD),
    }
}

/// SGLang's field that names a request's adapter (see [`adapter_request_field`]).
pub const SGLANG_ADAPTER_FIELD: &str = "lora_path";
