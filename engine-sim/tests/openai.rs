//! The OpenAI API over real sockets: chat and completions, streamed and not, determinism,
//! usage, wrong model, embeddings, models.
#![allow(clippy::unwrap_used)]

mod common;

use common::{chat, sse_events, start, stream_text};
use hyper::StatusCode;
use serde_json::{Value, json};

const VLLM: &[&str] = &[
    "--engine",
    "vllm",
    "serve",
    "Qwen3-4B",
    "--served-model-name",
    "chat-a",
];

#[tokio::test]
async fn chat_and_completions_streamed_and_not_agree_and_are_deterministic() {
    let sim = start(VLLM).await;

    let (status, body) = sim
        .post("/v1/chat/completions", chat("chat-a", "hello there", false))
        .await;
    assert_eq!(status, StatusCode::OK);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "chat-a");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(
        v["usage"]["completion_tokens"], 16,
        "max_tokens defaults to 16"
    );
    assert_eq!(v["usage"]["prompt_tokens"], 3, "user: hello there");
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(text.split(' ').count(), 16);

    // Same prompt, same answer; another prompt, another answer.
    assert_eq!(sim.chat_text("chat-a", "hello there").await, text);
    assert_ne!(sim.chat_text("chat-a", "something else").await, text);

    // Streamed: the same text; as vLLM 0.32: the role (with an empty content) in a chunk of its
    // own sent with the first token, the finish reason with the last token, usage, [DONE].
    let mut req = chat("chat-a", "hello there", true);
    req["stream_options"] = json!({"include_usage": true});
    let (status, body) = sim.post("/v1/chat/completions", req).await;
    assert_eq!(status, StatusCode::OK);
    let events = sse_events(&body);
    assert_eq!(events.last().unwrap(), "[DONE]");
    assert_eq!(stream_text(&events), text);
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(first["choices"][0]["delta"]["content"], "");
    let second: Value = serde_json::from_str(&events[1]).unwrap();
    assert!(
        second["choices"][0]["delta"]["content"]
            .as_str()
            .is_some_and(|c| !c.is_empty())
    );
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 16);
    let finish: Value = serde_json::from_str(&events[events.len() - 3]).unwrap();
    assert_eq!(finish["choices"][0]["finish_reason"], "length");

    // Without include_usage there is no usage chunk.
    let (_, body) = sim
        .post("/v1/chat/completions", chat("chat-a", "hello there", true))
        .await;
    let events = sse_events(&body);
    assert!(events.iter().all(|e| !e.contains("\"usage\"")));
    assert_eq!(events.len(), 16 + 2);

    // Text completions, with max_tokens.
    let req = json!({"model": "chat-a", "prompt": "once upon a time", "max_tokens": 5, "temperature": 0.7});
    let (status, body) = sim.post("/v1/completions", req.clone()).await;
    assert_eq!(status, StatusCode::OK);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["usage"]["prompt_tokens"], 4);
    let text = v["choices"][0]["text"].as_str().unwrap().to_owned();
    let mut streamed = req;
    streamed["stream"] = json!(true);
    let (_, body) = sim.post("/v1/completions", streamed).await;
    let events = sse_events(&body);
    assert_eq!(stream_text(&events), text);
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["object"], "text_completion");

    let s = sim.state().await;
    assert_eq!(s["completed"], 7);
    assert_eq!(s["aborted"], 0);
    assert_eq!(s["running"], 0);
}

#[tokio::test]
async fn answers_depend_on_the_model() {
    let a = start(VLLM).await;
    let b = start(&["serve", "Llama-3-8B", "--served-model-name", "chat-a"]).await;
    assert_ne!(
        a.chat_text("chat-a", "hi").await,
        b.chat_text("chat-a", "hi").await
    );
}

#[tokio::test]
async fn wrong_model_bad_body_and_unknown_paths() {
    let sim = start(VLLM).await;
    let (status, body) = sim
        .post("/v1/chat/completions", chat("other", "hi", false))
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["code"], 404);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("`other` does not exist")
    );
    let (status, _) = sim
        .post("/v1/completions", json!({"model": "other", "prompt": "x"}))
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = sim
        .post("/v1/embeddings", json!({"model": "other", "input": "x"}))
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    let (status, _) = sim
        .post("/v1/chat/completions", json!("not an object"))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _) = sim
        .post("/v1/chat/completions", json!({"model": "chat-a"}))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _) = sim
        .post("/v1/completions", json!({"prompt": {"no": 1}}))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    let (status, body) = sim.get("/no/such/path").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(body, r#"{"detail":"Not Found"}"#);
    assert_eq!(sim.state().await["completed"], 0);
}

#[tokio::test]
async fn embeddings_and_models() {
    let sim = start(VLLM).await;
    let req = json!({"model": "chat-a", "input": ["alpha", "beta"]});
    let (status, body) = sim.post("/v1/embeddings", req.clone()).await;
    assert_eq!(status, StatusCode::OK);
    let v: Value = serde_json::from_str(&body).unwrap();
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    assert_eq!(data[0]["embedding"].as_array().unwrap().len(), 32);
    assert_ne!(data[0]["embedding"], data[1]["embedding"]);
    let (_, again) = sim.post("/v1/embeddings", req).await;
    let again: Value = serde_json::from_str(&again).unwrap();
    assert_eq!(again["data"], v["data"]);

    let (status, body) = sim.get("/v1/models").await;
    assert_eq!(status, StatusCode::OK);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["data"][0]["id"], "chat-a");
    assert_eq!(v["data"][0]["root"], "Qwen3-4B");
    assert_eq!(v["data"].as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn startup_delay_refuses_until_ready() {
    // SGLang answers while it starts: /health and requests 503.
    let sim = start(&["--model-path", "m", "--sim-startup-delay", "300ms"]).await;
    let (status, _) = sim.get("/health").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let (status, _) = sim
        .post("/v1/chat/completions", chat("m", "hi", false))
        .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    sim.wait_state("started", |s| s["started"] == true).await;
    let (status, _) = sim.get("/health").await;
    assert_eq!(status, StatusCode::OK);
    // vLLM refuses connections until it is ready (tests/real_vllm.rs), then answers.
    let sim = start(&["serve", "m"]).await;
    let (status, body) = sim.get("/version").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, r#"{"version":"0.32.0"}"#);
}
