//! Log probabilities over real sockets: chat (`logprobs: true, top_logprobs: N`) and
//! completions (`logprobs: N`), streamed and not, in the engines' shapes; deterministic;
//! decisions answered with an option while the weights are intact; refused bad values.
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
    "--sim-vllm-dev-mode",
    "1",
    "--enable-sleep-mode",
    "--sim-weights-bytes",
    "16MiB",
];

const DECISION: &str = "Is the sky blue?\nAnswer with exactly one of: yes, no.\nAnswer:";

fn completion(prompt: &str, max_tokens: u64, logprobs: Value, stream: bool) -> Value {
    json!({
        "model": "chat-a", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "logprobs": logprobs, "stream": stream,
    })
}

async fn post_json(sim: &common::Sim, path: &str, body: Value) -> Value {
    let (status, text) = sim.post(path, body).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    serde_json::from_str(&text).unwrap()
}

/// Probabilities of a top list are sorted, distinct, each in (0, 1], summing to at most 1.
fn check_distribution(lps: &[f64]) {
    assert!(lps.iter().all(|l| *l <= 0.0 && l.is_finite()), "{lps:?}");
    assert!(lps.windows(2).all(|w| w[0] > w[1]), "{lps:?}");
    assert!(lps.iter().map(|l| l.exp()).sum::<f64>() <= 1.0);
}

#[tokio::test]
async fn chat_logprobs_have_openai_shape_and_are_deterministic() {
    let sim = start(VLLM).await;
    let mut req = chat("chat-a", "hello there", false);
    req["max_tokens"] = json!(4);
    req["logprobs"] = json!(true);
    req["top_logprobs"] = json!(3);
    let v = post_json(&sim, "/v1/chat/completions", req.clone()).await;
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 4);
    let tokens: String = content
        .iter()
        .map(|c| c["token"].as_str().unwrap())
        .collect();
    assert_eq!(tokens, text);
    for c in content {
        let token = c["token"].as_str().unwrap();
        assert_eq!(c["bytes"], json!(token.as_bytes()));
        let top = c["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(
            top[0]["token"], c["token"],
            "greedy: the token is the top one"
        );
        assert_eq!(top[0]["logprob"], c["logprob"]);
        let lps: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        check_distribution(&lps);
    }
    assert_eq!(
        post_json(&sim, "/v1/chat/completions", req.clone()).await["choices"],
        v["choices"]
    );

    // Streamed: each token chunk carries its own entry, the last one with the finish reason
    // (as vLLM 0.32 streams); the opening role chunk none.
    req["stream"] = json!(true);
    let (status, body) = sim.post("/v1/chat/completions", req).await;
    assert_eq!(status, StatusCode::OK);
    let events = sse_events(&body);
    assert_eq!(stream_text(&events), text);
    let chunks: Vec<Value> = events
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert!(
        chunks[0]["choices"][0]["logprobs"].is_null(),
        "the role chunk"
    );
    let streamed: Vec<Value> = chunks[1..]
        .iter()
        .map(|c| c["choices"][0]["logprobs"]["content"][0].clone())
        .collect();
    assert_eq!(&streamed, content);
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");

    // Not asked: null, as before; logprobs without top_logprobs: only the token's own.
    let plain = post_json(
        &sim,
        "/v1/chat/completions",
        chat("chat-a", "hello there", false),
    )
    .await;
    assert!(plain["choices"][0]["logprobs"].is_null());
    let mut own = chat("chat-a", "hello there", false);
    own["logprobs"] = json!(true);
    let v = post_json(&sim, "/v1/chat/completions", own).await;
    let first = &v["choices"][0]["logprobs"]["content"][0];
    assert_eq!(first["top_logprobs"], json!([]));
    assert!(first["logprob"].as_f64().unwrap() < 0.0);
}

#[tokio::test]
async fn completion_logprobs_have_the_legacy_shape() {
    let sim = start(VLLM).await;
    let v = post_json(
        &sim,
        "/v1/completions",
        completion("one two", 5, json!(4), false),
    )
    .await;
    let text = v["choices"][0]["text"].as_str().unwrap();
    let lp = &v["choices"][0]["logprobs"];
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(tokens.len(), 5);
    assert_eq!(tokens.concat(), text);
    let mut offset = 0;
    for (i, token) in tokens.iter().enumerate() {
        assert_eq!(lp["text_offset"][i], offset);
        offset += token.chars().count();
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert_eq!(top.len(), 4);
        assert_eq!(top[*token], lp["token_logprobs"][i]);
        let mut lps: Vec<f64> = top.values().map(|l| l.as_f64().unwrap()).collect();
        lps.sort_by(|a, b| b.total_cmp(a));
        assert_eq!(lps[0], lp["token_logprobs"][i].as_f64().unwrap());
        check_distribution(&lps);
    }

    // Streamed: one token per chunk, offsets running on, the finish reason on the last.
    let (status, body) = sim
        .post("/v1/completions", completion("one two", 5, json!(4), true))
        .await;
    assert_eq!(status, StatusCode::OK);
    let events = sse_events(&body);
    let chunks: Vec<Value> = events
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks.len(), 5);
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], "length");
    for (i, c) in chunks.iter().enumerate() {
        let l = &c["choices"][0]["logprobs"];
        assert_eq!(l["tokens"], json!([tokens[i]]));
        assert_eq!(l["token_logprobs"][0], lp["token_logprobs"][i]);
        assert_eq!(l["top_logprobs"][0], lp["top_logprobs"][i]);
        assert_eq!(l["text_offset"][0], lp["text_offset"][i]);
    }

    // logprobs: 0 still gives the token's own; null gives none.
    let v = post_json(
        &sim,
        "/v1/completions",
        completion("one two", 1, json!(0), false),
    )
    .await;
    assert_eq!(
        v["choices"][0]["logprobs"]["top_logprobs"][0]
            .as_object()
            .unwrap()
            .len(),
        1
    );
    let v = post_json(
        &sim,
        "/v1/completions",
        completion("one two", 1, Value::Null, false),
    )
    .await;
    assert!(v["choices"][0]["logprobs"].is_null());
}

#[tokio::test]
async fn bad_logprobs_values_are_refused() {
    let sim = start(VLLM).await;
    let cases = [
        (
            "/v1/completions",
            completion("x", 1, json!(21), false),
            "more than the maximum of 20",
        ),
        (
            "/v1/completions",
            completion("x", 1, json!(true), false),
            "`logprobs` must be an integer",
        ),
        (
            "/v1/completions",
            completion("x", 1, json!(-1), false),
            "`logprobs` must be an integer",
        ),
    ];
    for (path, body, message) in cases {
        let (status, text) = sim.post(path, body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
        assert!(text.contains(message), "{text}");
    }
    let mut c = chat("chat-a", "x", false);
    c["top_logprobs"] = json!(2);
    let (status, text) = sim.post("/v1/chat/completions", c.clone()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(text.contains("`logprobs` must be set to true"), "{text}");
    c["logprobs"] = json!(3);
    let (status, text) = sim.post("/v1/chat/completions", c.clone()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(text.contains("`logprobs` must be true or false"), "{text}");
    c["logprobs"] = json!(true);
    c["top_logprobs"] = json!(50);
    let (status, text) = sim.post("/v1/chat/completions", c).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(text.contains("`top_logprobs`: requested 50"), "{text}");
}

/// The first token's option and each option's probability in a decision answer.
fn decision_of(v: &Value) -> (String, f64, f64) {
    let top = v["choices"][0]["logprobs"]["top_logprobs"][0]
        .as_object()
        .unwrap();
    let p = |o: &str| top.get(o).and_then(Value::as_f64).map_or(0.0, f64::exp);
    (
        v["choices"][0]["text"].as_str().unwrap().to_owned(),
        p("yes"),
        p("no"),
    )
}

#[tokio::test]
async fn decisions_pick_an_option_until_a_bad_wake() {
    let sim = start(VLLM).await;
    let ask = completion(DECISION, 1, json!(20), false);
    let first = decision_of(&post_json(&sim, "/v1/completions", ask.clone()).await);
    assert!(first.0 == "yes" || first.0 == "no", "{first:?}");
    assert!(first.1 > 0.0 && first.2 > 0.0, "{first:?}");
    assert!((first.1 + first.2 - 1.0).abs() < 0.2);
    // A good park and wake changes nothing.
    sim.post_ok("/sleep?level=1").await;
    sim.post_ok("/wake_up").await;
    assert_eq!(
        decision_of(&post_json(&sim, "/v1/completions", ask.clone()).await),
        first
    );
    // Chat asks the same way.
    let mut c = chat("chat-a", DECISION, false);
    c["max_tokens"] = json!(1);
    c["logprobs"] = json!(true);
    c["top_logprobs"] = json!(5);
    let v = post_json(&sim, "/v1/chat/completions", c).await;
    let tops: Vec<&str> = v["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["token"].as_str().unwrap())
        .collect();
    assert!(
        tops[..2].contains(&"yes") && tops[..2].contains(&"no"),
        "{tops:?}"
    );
    // After a wake with wake_mismatch the model ignores the instruction.
    sim.post("/sim/faults", json!({"set": ["wake_mismatch"]}))
        .await;
    sim.post_ok("/sleep?level=1").await;
    sim.post_ok("/wake_up").await;
    let bad = decision_of(&post_json(&sim, "/v1/completions", ask).await);
    assert!(bad.0 != "yes" && bad.0 != "no", "{bad:?}");
    assert_eq!((bad.1, bad.2), (0.0, 0.0));
}
