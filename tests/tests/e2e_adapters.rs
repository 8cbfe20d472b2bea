//! LoRA adapters end to end (DESIGN 4.9): the real `capyctl` standalone, real sockets, and the
//! engine simulator serving adapters the way vLLM does (`/v1/load_lora_adapter`,
//! `/v1/unload_lora_adapter`, answers under the adapter's name).
#![allow(clippy::unwrap_used)]

mod support;

use std::path::Path;

use support::{Capy, assert_error, chat, document, model, temp_dir};

/// A PEFT directory (`adapter_config.json` of rank `r`) under `dir`.
fn peft(dir: &Path, name: &str, r: u32) -> String {
    let at = dir.join("loras").join(name);
    std::fs::create_dir_all(&at).unwrap();
    std::fs::write(
        at.join("adapter_config.json"),
        format!(
            r#"{{"r": {r}, "lora_alpha": 16, "peft_type": "LORA", "target_modules": ["q_proj"]}}"#
        ),
    )
    .unwrap();
    at.display().to_string()
}

#[test]
fn adapters_load_on_demand_and_survive_a_kill_of_capyctl() {
    let dir = temp_dir("adapters");
    let adapters: Vec<String> = ["a1", "a2", "a3"]
        .iter()
        .map(|n| {
            format!(
                "name: {n}\nadapter: {{base: base, path: {}}}\n",
                peft(&dir, n, 8)
            )
        })
        .collect();
    let base = model("base", "adapters: {max_loaded: 2, max_rank: 16}\n");
    let mut deployments = vec![base.as_str()];
    deployments.extend(adapters.iter().map(String::as_str));
    let doc = document("", "", &deployments);

    let capy = Capy::start(&dir, &doc);
    // A request for an adapter starts its base, loads it, and runs under its name.
    let r = chat(capy.inference, "a1", false);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.json()["model"], "a1");
    // Loaded before the request was forwarded.
    let list = capy.list();
    assert!(list.contains("a1 ") && list.contains("loaded"), "{list}");
    assert!(list.contains("unloaded"), "{list}");
    // Streamed too.
    assert_eq!(chat(capy.inference, "a2", true).status, 200);
    // Past max_loaded: the least recently used is unloaded first (records of cause adapter).
    assert_eq!(chat(capy.inference, "a3", false).status, 200);
    let switches = capy.cli(&["switches", "--json"]).ok();
    assert!(
        switches.contains("adapter_load") && switches.contains("adapter_unload"),
        "{switches}"
    );

    // A load the engine refuses: 503 adapter_load_failed naming it; the base serves on.
    let bad = dir.join("loras").join("not-peft");
    std::fs::create_dir_all(&bad).unwrap();
    capy.cli(&["deploy", "model", "--file", &{
        let f = dir.join("bad.yaml");
        std::fs::write(
            &f,
            format!(
                "name: bad\nadapter: {{base: base, path: {}}}\n",
                bad.display()
            ),
        )
        .unwrap();
        f.display().to_string()
    }])
    .ok();
    let r = chat(capy.inference, "bad", false);
    let message = assert_error(&r, 503, "adapter_load_failed", true);
    assert!(message.contains("adapter bad"), "{message}");
    assert_eq!(chat(capy.inference, "a3", false).status, 200);

    // kill -9 and a restart: the engine is adopted, its adapters are what it lists, the others
    // load again on demand; never the engine's 404.
    capy.kill();
    let capy = Capy::start(&dir, &doc);
    for name in ["a1", "a2", "a3"] {
        let r = chat(capy.inference, name, false);
        assert_eq!(r.status, 200, "{name}: {r:?}");
        assert_eq!(r.json()["model"], name);
    }
}
