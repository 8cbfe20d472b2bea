//! Adapter documents (DESIGN 4.9): `adapters:` on a base, `adapter:` as a deployment of its own,
//! and every refusal that names the key and why.
#![allow(clippy::unwrap_used, missing_docs)]

use capyctl_spec::EngineKind;
use capyctl_spec::documents::{
    BaseOf, DeploymentDoc, check_adapter_of, parse_deployment_json, parse_deployment_str,
};

fn parse(text: &str) -> Result<DeploymentDoc, String> {
    parse_deployment_str("d.yaml", text).map_err(|e| e.to_string())
}

fn base() -> DeploymentDoc {
    parse("name: qwen\nengine: vllm\nmodel: Qwen3-4B\nadapters: {max_loaded: 2, max_rank: 16}\n")
        .unwrap()
}

fn adapter(path: &str) -> DeploymentDoc {
    parse(&format!(
        "name: support-bot\nadapter: {{base: qwen, path: {path}}}\n"
    ))
    .unwrap()
}

fn refusal(doc: &DeploymentDoc, base: Option<&DeploymentDoc>, visible: bool) -> String {
    let (path, problem) = check_adapter_of(
        doc,
        base.map(|doc| BaseOf {
            doc,
            files_visible: visible,
        }),
    )
    .unwrap_err();
    format!("{}: {problem}", path.display().unwrap_or_default())
}

/// A PEFT directory with `adapter_config.json` of rank `r`, removed when dropped.
struct PeftDir(std::path::PathBuf);

impl PeftDir {
    fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for PeftDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn peft_dir(r: u32) -> PeftDir {
    let dir = std::env::temp_dir().join(format!("capyctl-peft-{}-{r}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("adapter_config.json"),
        format!(r#"{{"r": {r}, "lora_alpha": 16, "peft_type": "LORA"}}"#),
    )
    .unwrap();
    PeftDir(dir)
}

#[test]
fn a_base_and_an_adapter_are_read() {
    let b = base();
    let slots = b.adapters.as_ref().unwrap();
    assert_eq!((slots.max_loaded, slots.max_rank), (2, 16));
    let a = adapter("/models/loras/support-bot");
    assert_eq!(a.base(), Some("qwen"));
    assert_eq!(a.engine, None, "an adapter's engine is its base's");
    assert_eq!(
        a.adapter.as_ref().unwrap().path,
        "/models/loras/support-bot"
    );
    // The same through the management API's JSON.
    let j = parse_deployment_json(
        "body",
        r#"{"name":"support-bot","adapter":{"base":"qwen","path":"/p"}}"#,
    )
    .unwrap();
    assert_eq!(j.base(), Some("qwen"));
}

#[test]
fn document_refusals_name_the_key() {
    for (text, want) in [
        (
            "name: a\nmodel: m\n",
            "d.yaml:1: engine: missing required key",
        ),
        (
            "name: a\nengine: vllm\n",
            "d.yaml:1: model: missing required key",
        ),
        (
            "name: a\nengine: tensorfold\nmodel: m\nadapters: {max_loaded: 2, max_rank: 8}\n",
            "d.yaml:4: adapters: tensorfold cannot load LoRA adapters into a running engine; remove adapters or choose vllm or sglang",
        ),
        (
            "name: a\nengine: vllm\nmodel: m\nadapters: {max_loaded: 0, max_rank: 8}\n",
            "adapters.max_loaded: 0 is out of range (1 to 256)",
        ),
        (
            "name: a\nengine: vllm\nmodel: m\nadapters: {max_loaded: 2, max_rank: 1024}\n",
            "adapters.max_rank: 1024 is out of range (1 to 512)",
        ),
        (
            "name: a\nengine: vllm\nmodel: m\nadapters: {max_loaded: 2}\n",
            "adapters.max_rank: missing required key",
        ),
        (
            "name: a\nadapter: {base: qwen, path: /p}\nadapters: {max_loaded: 2, max_rank: 8}\n",
            "adapters: an adapter cannot take adapters of its own",
        ),
        (
            "name: a\nadapter: {base: qwen, path: /p}\nreplicas: 2\n",
            "d.yaml:3: replicas: an adapter runs in its base's engine with the base's replicas; remove replicas",
        ),
        (
            "name: a\nadapter: {base: qwen, path: /p}\nextra_args: [--x]\n",
            "extra_args: an adapter runs in its base's engine",
        ),
        (
            "name: a\nadapter: {base: qwen}\n",
            "adapter.path: missing required key",
        ),
        (
            "name: a\nadapter: {base: Qwen_8b, path: /p}\n",
            "adapter.base:",
        ),
        (
            "name: a\nadapter: {base: qwen, path: /p, rank: 8}\n",
            "adapter.rank: unknown key; expected one of base, path",
        ),
    ] {
        let e = parse(text).unwrap_err();
        assert!(e.contains(want), "{text:?}:\n got  {e}\n want {want}");
    }
}

#[test]
fn deploy_refusals_read_the_base_and_the_files() {
    let b = base();
    let dir = peft_dir(8);
    let ok = adapter(dir.path().to_str().unwrap());
    check_adapter_of(
        &ok,
        Some(BaseOf {
            doc: &b,
            files_visible: true,
        }),
    )
    .unwrap();

    // No base, a base without adapters, an adapter as a base.
    assert!(
        refusal(&ok, None, true).starts_with("adapter.base: `qwen`: no deployment has that name")
    );
    let plain = parse("name: qwen\nengine: vllm\nmodel: Qwen3-4B\n").unwrap();
    assert!(
        refusal(&ok, Some(&plain), true).contains("`qwen` does not allow adapters; add adapters:")
    );
    let other = adapter("/p");
    assert!(
        refusal(&ok, Some(&other), true)
            .contains("`qwen` is itself an adapter (an adapter of an adapter)")
    );

    // Engine and model, when given, are the base's.
    let mut wrong = ok.clone();
    wrong.engine = Some(EngineKind::Sglang);
    assert!(
        refusal(&wrong, Some(&b), true)
            .starts_with("engine: sglang: an adapter runs on its base's engine")
    );
    let mut same = ok.clone();
    same.engine = Some(EngineKind::Vllm);
    same.model = Some("Qwen3-4B".into());
    check_adapter_of(
        &same,
        Some(BaseOf {
            doc: &b,
            files_visible: true,
        }),
    )
    .unwrap();
    let mut model = ok.clone();
    model.model = Some("Llama".into());
    assert!(
        refusal(&model, Some(&b), true)
            .starts_with("model: `Llama`: an adapter is loaded into its base's model")
    );

    // The files, where CapyCTL sees them.
    let missing = adapter("/nonexistent/capyctl/lora");
    assert!(
        refusal(&missing, Some(&b), true)
            .contains("adapter.path: `/nonexistent/capyctl/lora` does not exist")
    );
    let file = dir.path().join("adapter_config.json");
    let not_dir = adapter(file.to_str().unwrap());
    assert!(refusal(&not_dir, Some(&b), true).contains("is not a directory"));
    let big = peft_dir(64);
    let too_big = adapter(big.path().to_str().unwrap());
    assert!(
        refusal(&too_big, Some(&b), true).contains(
            "adapter.path: the adapter's rank 64 (r in adapter_config.json) is above its base's adapters.max_rank (16)"
        )
    );
    // Where CapyCTL cannot see them (Kubernetes), only the engine's load can tell.
    check_adapter_of(
        &missing,
        Some(BaseOf {
            doc: &b,
            files_visible: false,
        }),
    )
    .unwrap();
}

#[test]
fn on_kubernetes_the_path_is_the_pods_and_the_volume_a_pod_volume() {
    let with_volume = parse(
        "name: qwen\nengine: vllm\nmodel: Qwen3-4B\nadapters: {max_loaded: 2, max_rank: 16, volume: {persistentVolumeClaim: {claimName: loras}}}\n",
    )
    .unwrap();
    let no_volume = base();
    let hidden = |doc: &DeploymentDoc, base: &DeploymentDoc| {
        check_adapter_of(
            doc,
            Some(BaseOf {
                doc: base,
                files_visible: false,
            }),
        )
    };
    // Absolute inside the Pod: under the volume's mount path with a volume, elsewhere without.
    hidden(&adapter("/capyctl/adapters/support-bot"), &with_volume).unwrap();
    hidden(&adapter("/var/lib/capyctl/models/loras/a"), &no_volume).unwrap();
    for (path, base, want) in [
        (
            "loras/support-bot",
            &with_volume,
            "adapter.path: `loras/support-bot` is not an absolute path",
        ),
        (
            "/capyctl/adapters/../etc",
            &with_volume,
            "adapter.path: `/capyctl/adapters/../etc` is not an absolute path",
        ),
        (
            "/models/support-bot",
            &with_volume,
            "adapter.path: `/models/support-bot` is outside the base `qwen`'s adapters.volume",
        ),
        (
            "/capyctl/adapters",
            &with_volume,
            "adapter.path: `/capyctl/adapters` is outside the base `qwen`'s adapters.volume",
        ),
        (
            "/capyctl/adapters/support-bot",
            &no_volume,
            "adapter.path: `/capyctl/adapters/support-bot`: the base `qwen` has no adapters.volume",
        ),
    ] {
        let got = refusal(&adapter(path), Some(base), false);
        assert!(got.contains(want), "{path}: {got}");
    }
    // The volume is a Pod volume: a source, its name being CapyCTL's.
    for bad in ["volume: {}", "volume: {name: x}", "volume: claim"] {
        let e = parse(&format!(
            "name: qwen\nengine: vllm\nmodel: Qwen3-4B\nadapters: {{max_loaded: 2, max_rank: 16, {bad}}}\n"
        ))
        .unwrap_err();
        assert!(
            e.contains("adapters.volume: ") && e.contains("not a Pod volume"),
            "{bad}: {e}"
        );
    }
}
