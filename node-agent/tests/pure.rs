//! The pure decisions: launch arguments, tiers, refusals, max_running, metrics, comparisons,
//! measurement from checkpoint headers.
#![allow(clippy::unwrap_used)]

mod common;

use capyctl_node_agent::AgentError;
use capyctl_node_agent::capability::{DeepPark, REFUSALS, engine_info, refusal_for};
use capyctl_node_agent::checkpoint::{ModelFacts, ReadFacts, checkpoint_size};
use capyctl_node_agent::inventory::{HostMemory, parse_meminfo};
use capyctl_node_agent::launch::{
    MaxRunning, MaxRunningInput, MaxRunningSource, launch_command, max_running,
};
use capyctl_node_agent::load::{EngineLoad, LoadSample, parse_metrics};
use capyctl_node_agent::measure::{MeasureSource, measure_before_start, parse_ppid};
use capyctl_node_agent::spec::{DecisionSpec, EngineLaunch, InstanceSpec};
use capyctl_node_agent::tier::{
    LaunchParking, NoParkReason, ParkChoice, ParkTier, TierInput, TierRule, choose_tier,
    host_ram_for_copies, host_ram_room, launch_parking, never_parks, tier_rule,
};
use capyctl_node_agent::verify::{
    DecisionAnswer, FirstAnswer, WakeOutcome, compare_answers, compare_decisions,
    decision_from_completion,
};
use capyctl_spec::errors::WakeFailure;
use capyctl_spec::{EngineKind, Residency};
use serde_json::json;

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| (*x).to_string()).collect()
}

fn spec(engine: EngineKind, model: &str) -> InstanceSpec {
    InstanceSpec::new("01K0000000000000000000000", "chat-a", engine, model)
}

const PARK: LaunchParking = LaunchParking {
    may_park: true,
    host_ram: true,
};

#[test]
fn vllm_argv_and_env() {
    let mut sp = spec(EngineKind::Vllm, "Qwen3-4B");
    sp.max_concurrent_requests = Some(8);
    sp.extra_args = s(&["--max-model-len", "8192"]);
    sp.env.insert("HF_HOME".into(), "/cache".into());
    let cmd = launch_command(
        &sp,
        &EngineLaunch::default_for(EngineKind::Vllm),
        9000,
        PARK,
    )
    .unwrap();
    assert_eq!(
        cmd.argv(),
        s(&[
            "vllm",
            "serve",
            "Qwen3-4B",
            "--host",
            "127.0.0.1",
            "--port",
            "9000",
            "--served-model-name",
            "chat-a",
            "--enable-sleep-mode",
            "--max-num-seqs",
            "8",
            "--max-model-len",
            "8192",
        ])
    );
    assert_eq!(
        cmd.env.get("VLLM_SERVER_DEV_MODE").map(String::as_str),
        Some("1")
    );
    assert_eq!(cmd.env.get("HF_HOME").map(String::as_str), Some("/cache"));

    // Not parking: no sleep mode, no dev mode; CapyCTL's default of 32.
    let plain = spec(EngineKind::Vllm, "Qwen3-4B");
    let cmd = launch_command(
        &plain,
        &EngineLaunch::default_for(EngineKind::Vllm),
        9000,
        LaunchParking::default(),
    )
    .unwrap();
    assert_eq!(
        cmd.argv(),
        s(&[
            "vllm",
            "serve",
            "Qwen3-4B",
            "--host",
            "127.0.0.1",
            "--port",
            "9000",
            "--served-model-name",
            "chat-a",
            "--max-num-seqs",
            "32"
        ])
    );
    assert!(!cmd.env.contains_key("VLLM_SERVER_DEV_MODE"));

    // The flag in extra_args: CapyCTL adds none; both set: refused.
    let mut own = spec(EngineKind::Vllm, "m");
    own.extra_args = s(&["--max-num-seqs=4"]);
    let cmd = launch_command(&own, &EngineLaunch::default_for(EngineKind::Vllm), 1, PARK).unwrap();
    assert_eq!(
        cmd.args
            .iter()
            .filter(|a| a.starts_with("--max-num-seqs"))
            .count(),
        1
    );
    own.max_concurrent_requests = Some(8);
    let err =
        launch_command(&own, &EngineLaunch::default_for(EngineKind::Vllm), 1, PARK).unwrap_err();
    assert!(matches!(err, AgentError::InvalidSpec { .. }), "{err}");
}

#[test]
fn sglang_argv() {
    let mut sp = spec(EngineKind::Sglang, "/models/qwen");
    sp.max_concurrent_requests = Some(16);
    sp.extra_args = s(&["--tp", "2"]);
    let cmd = launch_command(
        &sp,
        &EngineLaunch::default_for(EngineKind::Sglang),
        30001,
        PARK,
    )
    .unwrap();
    assert_eq!(
        cmd.argv(),
        s(&[
            "python3",
            "-m",
            "sglang.launch_server",
            "--model-path",
            "/models/qwen",
            "--host",
            "127.0.0.1",
            "--port",
            "30001",
            "--served-model-name",
            "chat-a",
            "--enable-metrics",
            "--enable-memory-saver",
            "--enable-weights-cpu-backup",
            "--max-running-requests",
            "16",
            "--tp",
            "2",
        ])
    );
    let deep = LaunchParking {
        may_park: true,
        host_ram: false,
    };
    let cmd = launch_command(
        &spec(EngineKind::Sglang, "m"),
        &EngineLaunch::default_for(EngineKind::Sglang),
        1,
        deep,
    )
    .unwrap();
    assert!(cmd.args.contains(&"--enable-memory-saver".to_string()));
    assert!(
        !cmd.args
            .contains(&"--enable-weights-cpu-backup".to_string())
    );
    assert!(!cmd.args.contains(&"--max-running-requests".to_string()));
    assert!(cmd.env.is_empty());
}

#[test]
fn tensorfold_argv() {
    let mut sp = spec(EngineKind::Tensorfold, "tf-model");
    sp.extra_args = s(&["--threads", "4"]);
    let cmd = launch_command(
        &sp,
        &EngineLaunch::default_for(EngineKind::Tensorfold),
        7000,
        LaunchParking::default(),
    )
    .unwrap();
    assert_eq!(
        cmd.argv(),
        s(&[
            "tensorfold",
            "serve",
            "--model",
            "tf-model",
            "--port",
            "7000",
            "--threads",
            "4"
        ])
    );
    let empty = EngineLaunch {
        command: vec![],
        ..EngineLaunch::default_for(EngineKind::Tensorfold)
    };
    let err = launch_command(&sp, &empty, 1, LaunchParking::default()).unwrap_err();
    assert!(
        err.to_string().contains("host.engines.tensorfold.command"),
        "{err}"
    );
    // TensorFold has no option for max_concurrent_requests: refused, not silently ignored.
    sp.max_concurrent_requests = Some(4);
    let err = launch_command(
        &sp,
        &EngineLaunch::default_for(EngineKind::Tensorfold),
        1,
        LaunchParking::default(),
    )
    .unwrap_err();
    assert!(matches!(err, AgentError::InvalidSpec { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("chat-a") && text.contains("max_concurrent_requests: 4"),
        "{text}"
    );
}

#[test]
fn a_declared_figure_follows_the_hosts_and_wins() {
    // The host's command fixes --max-num-seqs; the deployment declares its own: CapyCTL's
    // flag comes after the host's, so the engine runs the declared figure.
    let mut sp = spec(EngineKind::Vllm, "m");
    sp.max_concurrent_requests = Some(8);
    let host = EngineLaunch {
        command: s(&["vllm", "--max-num-seqs", "16"]),
        ..EngineLaunch::default_for(EngineKind::Vllm)
    };
    let cmd = launch_command(&sp, &host, 1, PARK).unwrap();
    assert_eq!(
        capyctl_node_agent::spec::flag_value(&cmd.args, "--max-num-seqs"),
        Some("8")
    );
    assert_eq!(
        mr(MaxRunningInput {
            declared: sp.max_concurrent_requests,
            extra_args: &sp.extra_args,
            host_command: &host.command,
            ..mr_input(EngineKind::Vllm)
        }),
        (Some(8), MaxRunningSource::Declared)
    );
    // Without a declared figure the host's stands, and CapyCTL adds no default after it.
    sp.max_concurrent_requests = None;
    let cmd = launch_command(&sp, &host, 1, PARK).unwrap();
    assert_eq!(
        capyctl_node_agent::spec::flag_value(&cmd.args, "--max-num-seqs"),
        Some("16")
    );
}

fn input(engine: EngineKind) -> TierInput {
    TierInput {
        engine,
        residency: None,
        speculative: false,
        decision_model: false,
        unified_memory: false,
        weights_bytes: Some(10),
        host_room: Some(100),
        refusal: None,
        launched: None,
    }
}

fn park(t: ParkTier) -> ParkChoice {
    ParkChoice::Park(t)
}

#[test]
fn tiers() {
    use EngineKind::{Sglang, Tensorfold, Vllm};
    // Discrete card: host RAM; deep when the copy does not fit or is unknown.
    assert_eq!(choose_tier(&input(Vllm)).unwrap(), park(ParkTier::HostRam));
    assert_eq!(
        choose_tier(&TierInput {
            host_room: Some(5),
            ..input(Vllm)
        })
        .unwrap(),
        park(ParkTier::Deep)
    );
    assert_eq!(
        choose_tier(&TierInput {
            weights_bytes: None,
            ..input(Vllm)
        })
        .unwrap(),
        park(ParkTier::Deep)
    );
    // Unified memory: deep; host_backed refused there.
    assert_eq!(
        choose_tier(&TierInput {
            unified_memory: true,
            ..input(Sglang)
        })
        .unwrap(),
        park(ParkTier::Deep)
    );
    let e = choose_tier(&TierInput {
        unified_memory: true,
        residency: Some(Residency::HostBacked),
        ..input(Vllm)
    })
    .unwrap_err();
    assert!(matches!(e, AgentError::ResidencyRefused { .. }), "{e}");
    // residency chooses.
    assert_eq!(
        choose_tier(&TierInput {
            residency: Some(Residency::Deep),
            ..input(Vllm)
        })
        .unwrap(),
        park(ParkTier::Deep)
    );
    assert_eq!(
        choose_tier(&TierInput {
            residency: Some(Residency::HostBacked),
            host_room: Some(1),
            ..input(Vllm)
        })
        .unwrap(),
        ParkChoice::Stop(NoParkReason::NoRoomToPark)
    );
    assert_eq!(
        choose_tier(&TierInput {
            residency: Some(Residency::RestartOnly),
            ..input(Vllm)
        })
        .unwrap(),
        ParkChoice::Stop(NoParkReason::RestartOnly)
    );
    // TensorFold and decision models never park.
    assert_eq!(
        choose_tier(&input(Tensorfold)).unwrap(),
        ParkChoice::Stop(NoParkReason::EngineDoesNotPark)
    );
    assert_eq!(
        choose_tier(&TierInput {
            decision_model: true,
            ..input(Vllm)
        })
        .unwrap(),
        ParkChoice::Stop(NoParkReason::DecisionModel)
    );
    // SGLang speculative: KV only, even on unified memory; host_backed refused.
    let spec_in = TierInput {
        speculative: true,
        ..input(Sglang)
    };
    assert_eq!(choose_tier(&spec_in).unwrap(), park(ParkTier::KvOnly));
    assert_eq!(
        choose_tier(&TierInput {
            unified_memory: true,
            ..spec_in
        })
        .unwrap(),
        park(ParkTier::KvOnly)
    );
    let e = choose_tier(&TierInput {
        residency: Some(Residency::HostBacked),
        ..spec_in
    })
    .unwrap_err();
    assert!(e.to_string().contains("speculative"), "{e}");
    // SGLang's tier is fixed at launch.
    let backup = LaunchParking {
        may_park: true,
        host_ram: true,
    };
    let no_backup = LaunchParking {
        may_park: true,
        host_ram: false,
    };
    assert_eq!(
        choose_tier(&TierInput {
            launched: Some(backup),
            ..input(Sglang)
        })
        .unwrap(),
        park(ParkTier::HostRam)
    );
    assert_eq!(
        choose_tier(&TierInput {
            launched: Some(backup),
            host_room: Some(1),
            ..input(Sglang)
        })
        .unwrap(),
        ParkChoice::Stop(NoParkReason::NoRoomToPark)
    );
    assert_eq!(
        choose_tier(&TierInput {
            launched: Some(no_backup),
            ..input(Sglang)
        })
        .unwrap(),
        park(ParkTier::Deep)
    );
    assert_eq!(launch_parking(&input(Sglang)), backup);
    assert_eq!(
        launch_parking(&TierInput {
            host_room: Some(1),
            ..input(Sglang)
        }),
        no_backup
    );
    assert_eq!(launch_parking(&spec_in), no_backup);
    assert_eq!(launch_parking(&input(Tensorfold)), LaunchParking::default());
}

#[test]
fn the_tier_rule_before_the_room_is_looked_at() {
    use EngineKind::{Sglang, Tensorfold, Vllm};
    let deep = ParkChoice::Park(ParkTier::Deep);
    let no_room = ParkChoice::Stop(NoParkReason::NoRoomToPark);
    let if_fits = |otherwise| TierRule::HostRamIfFits { otherwise };
    // The rule reads neither the copy's size nor the room.
    for (weights_bytes, host_room) in [(Some(10), Some(100)), (Some(10), Some(1)), (None, None)] {
        let sized = |i: TierInput| TierInput {
            weights_bytes,
            host_room,
            ..i
        };
        assert_eq!(tier_rule(&sized(input(Vllm))).unwrap(), if_fits(deep));
        assert_eq!(
            tier_rule(&sized(TierInput {
                residency: Some(Residency::HostBacked),
                ..input(Vllm)
            }))
            .unwrap(),
            if_fits(no_room)
        );
        assert_eq!(
            tier_rule(&sized(TierInput {
                unified_memory: true,
                ..input(Vllm)
            }))
            .unwrap(),
            TierRule::Fixed(deep)
        );
    }
    assert!(tier_rule(&input(Sglang)).unwrap().host_ram_if_fits());
    for fixed in [
        TierInput {
            residency: Some(Residency::Deep),
            ..input(Vllm)
        },
        TierInput {
            speculative: true,
            ..input(Sglang)
        },
        TierInput {
            decision_model: true,
            ..input(Vllm)
        },
        input(Tensorfold),
        TierInput {
            residency: Some(Residency::RestartOnly),
            ..input(Vllm)
        },
        // SGLang launched without its CPU backup can only drop its weights.
        TierInput {
            launched: Some(LaunchParking {
                may_park: true,
                host_ram: false,
            }),
            ..input(Sglang)
        },
    ] {
        let rule = tier_rule(&fixed).unwrap();
        assert!(!rule.host_ram_if_fits(), "{fixed:?}: {rule:?}");
        // A fixed choice is the choice whatever the room.
        assert_eq!(rule.with_room(true), rule.with_room(false), "{fixed:?}");
        assert_eq!(choose_tier(&fixed).unwrap(), rule.with_room(true));
    }
    // SGLang launched with the backup: host RAM, or stopped when the copy does not fit.
    let backup = TierInput {
        launched: Some(LaunchParking {
            may_park: true,
            host_ram: true,
        }),
        ..input(Sglang)
    };
    assert_eq!(tier_rule(&backup).unwrap(), if_fits(no_room));
    assert_eq!(if_fits(no_room).with_room(true), park(ParkTier::HostRam));
    assert_eq!(if_fits(no_room).with_room(false), no_room);
    // Refusals are the rule's too.
    assert!(
        tier_rule(&TierInput {
            residency: Some(Residency::HostBacked),
            unified_memory: true,
            ..input(Vllm)
        })
        .is_err()
    );
}

#[test]
fn models_that_never_park_whatever_the_host() {
    use EngineKind::{Sglang, Tensorfold, Vllm};
    assert_eq!(never_parks(&input(Vllm)), None);
    assert_eq!(
        never_parks(&TierInput {
            residency: Some(Residency::Deep),
            unified_memory: true,
            ..input(Sglang)
        }),
        None
    );
    assert_eq!(
        never_parks(&input(Tensorfold)),
        Some(NoParkReason::EngineDoesNotPark)
    );
    assert_eq!(
        never_parks(&TierInput {
            residency: Some(Residency::RestartOnly),
            ..input(Vllm)
        }),
        Some(NoParkReason::RestartOnly)
    );
    assert_eq!(
        never_parks(&TierInput {
            decision_model: true,
            ..input(Vllm)
        }),
        Some(NoParkReason::DecisionModel)
    );
}

#[test]
fn host_ram_for_parked_copies() {
    let meminfo = HostMemory {
        total_bytes: 64,
        available_bytes: 10,
        overridden: false,
    };
    let overridden = HostMemory {
        total_bytes: 40,
        available_bytes: 40,
        overridden: true,
    };
    // MemAvailable already excludes the copies made: they are added back for the total.
    assert_eq!(host_ram_for_copies(&meminfo, 20), 30);
    assert_eq!(host_ram_room(&meminfo, 20, 0), 10);
    // ...but not the copies still being made.
    assert_eq!(host_ram_room(&meminfo, 20, 4), 6);
    // The override is the whole host RAM for the copies; those made are taken from it.
    assert_eq!(host_ram_for_copies(&overridden, 20), 40);
    assert_eq!(host_ram_room(&overridden, 20, 4), 16);
    assert_eq!(host_ram_room(&overridden, 30, 20), 0, "never below zero");
}

fn named(model: &str) -> ModelFacts {
    ModelFacts {
        model: model.into(),
        ..Default::default()
    }
}

#[test]
fn refusal_rows() {
    use EngineKind::{Sglang, Tensorfold, Vllm};
    let gpt = named("openai/gpt-oss-20b");
    assert_eq!(
        refusal_for(Vllm, None, &gpt, false).unwrap().reason,
        REFUSALS[0].reason
    );
    assert!(refusal_for(Sglang, Some("0.5.9"), &gpt, true).is_some());
    assert!(refusal_for(Tensorfold, None, &gpt, false).is_none());

    let fp4 = named("nvidia/Llama-3.3-70B-Instruct-NVFP4");
    assert_eq!(
        refusal_for(Sglang, None, &fp4, false).unwrap().reason,
        REFUSALS[1].reason
    );
    assert!(
        refusal_for(Sglang, None, &fp4, true).is_none(),
        "speculative keeps the weights"
    );
    assert!(refusal_for(Vllm, None, &fp4, false).is_none());

    let nemo = named("nvidia/Nemotron-3.5-Super-VL");
    let row = refusal_for(Vllm, Some("0.31.0"), &nemo, false).unwrap();
    assert!(row.reason.contains("vLLM 0.31.0 answers wrongly"));
    // No fixed release is known: later and unknown versions are refused too, and the reason
    // says so rather than naming 0.31.0 alone.
    assert_eq!(refusal_for(Vllm, Some("0.32.1"), &nemo, false), Some(row));
    assert_eq!(refusal_for(Vllm, None, &nemo, false), Some(row));
    assert!(row.reason.contains("later and unknown"), "{}", row.reason);
    assert!(refusal_for(Sglang, None, &nemo, false).is_none());

    // The error a refusal becomes, for the catalogue.
    let input = TierInput {
        refusal: Some(row),
        ..input(Vllm)
    };
    let err = choose_tier(&input).unwrap_err();
    let api = err.to_api_error("01KDEP").unwrap();
    assert_eq!(api.code(), "capability_missing:deep_park");
    assert!(
        api.message().contains("answers wrongly"),
        "{}",
        api.message()
    );
    // restart_only is the way out.
    let ok = TierInput {
        residency: Some(Residency::RestartOnly),
        ..input
    };
    assert_eq!(
        choose_tier(&ok).unwrap(),
        ParkChoice::Stop(NoParkReason::RestartOnly)
    );
}

#[test]
fn nvfp4_from_a_local_checkpoint_config() {
    let dir = common::temp_dir("nvfp4");
    std::fs::write(
        dir.join("hf_quant_config.json"),
        r#"{"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4"}}"#,
    )
    .unwrap();
    let facts = ModelFacts::read(dir.to_str().unwrap());
    assert_eq!(facts.quant_algo.as_deref(), Some("NVFP4"));
    assert!(refusal_for(EngineKind::Sglang, None, &facts, false).is_some());

    let other = common::temp_dir("cfg");
    std::fs::write(
        other.join("config.json"),
        r#"{"model_type": "gpt_oss", "quantization_config": {"quant_method": "modelopt", "quant_algo": "nvfp4"}}"#,
    )
    .unwrap();
    let facts = ModelFacts::read(other.to_str().unwrap());
    assert_eq!(facts.quant_algo.as_deref(), Some("NVFP4"));
    assert_eq!(facts.model_type.as_deref(), Some("gpt_oss"));
    assert_eq!(
        refusal_for(EngineKind::Vllm, None, &facts, false)
            .unwrap()
            .reason,
        REFUSALS[0].reason
    );
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(other);
}

#[test]
fn engine_list_rows() {
    let v = engine_info(EngineKind::Vllm, Some("0.31.0".into()));
    assert_eq!(v.deep_park, DeepPark::Enabled);
    assert_eq!(v.deep_park.to_string(), "enabled");
    assert_eq!(v.refused_models.len(), 2);
    let t = engine_info(EngineKind::Tensorfold, None);
    assert_eq!(
        t.deep_park.to_string(),
        "TensorFold does not park: it stops"
    );
    assert!(t.refused_models.is_empty());
    assert_eq!(
        engine_info(EngineKind::Sglang, None).refused_models.len(),
        2
    );
}

/// Nothing passed, declared or reported for `engine`.
fn mr_input(engine: EngineKind) -> MaxRunningInput<'static> {
    MaxRunningInput {
        engine,
        declared: None,
        extra_args: &[],
        host_command: &[],
        engine_reported: None,
        hybrid_checkpoint: false,
        sized_on_host: false,
    }
}

/// `max_running` as (count, source).
fn mr(input: MaxRunningInput<'_>) -> (Option<u32>, MaxRunningSource) {
    let m = max_running(&input);
    (m.count, m.source)
}

#[test]
fn max_running_sources() {
    let base = mr_input(EngineKind::Vllm);
    assert_eq!(mr(base), (Some(32), MaxRunningSource::Default));
    assert_eq!(
        mr(MaxRunningInput {
            engine: EngineKind::Tensorfold,
            ..base
        }),
        (Some(8), MaxRunningSource::Default)
    );
    assert_eq!(
        mr(MaxRunningInput {
            declared: Some(8),
            ..base
        }),
        (Some(8), MaxRunningSource::Declared)
    );
    let extra = s(&["--max-num-seqs", "12"]);
    assert_eq!(
        mr(MaxRunningInput {
            extra_args: &extra,
            ..base
        }),
        (Some(12), MaxRunningSource::ExtraArgs)
    );
    let host = s(&["vllm", "--max-num-seqs=6"]);
    assert_eq!(
        mr(MaxRunningInput {
            host_command: &host,
            ..base
        }),
        (Some(6), MaxRunningSource::HostFixed)
    );
    // The host's command and the deployment's declared figure: the launch puts CapyCTL's flag
    // after the host's, the engine takes the last, and the report says the same.
    assert_eq!(
        mr(MaxRunningInput {
            host_command: &host,
            declared: Some(8),
            ..base
        }),
        (Some(8), MaxRunningSource::Declared)
    );
    let sg = MaxRunningInput {
        engine: EngineKind::Sglang,
        ..base
    };
    assert_eq!(mr(sg), (None, MaxRunningSource::EngineDefault));
    assert_eq!(
        mr(MaxRunningInput {
            engine_reported: Some(48),
            ..sg
        }),
        (Some(48), MaxRunningSource::Engine)
    );
    // The server cannot see a remote host's command or checkpoint: on_host, unless the
    // deployment itself says.
    assert_eq!(
        mr(MaxRunningInput {
            sized_on_host: true,
            host_command: &host,
            ..base
        }),
        (None, MaxRunningSource::OnHost)
    );
    assert_eq!(
        mr(MaxRunningInput {
            sized_on_host: true,
            declared: Some(8),
            ..base
        }),
        (Some(8), MaxRunningSource::Declared)
    );
    assert_eq!(
        mr(MaxRunningInput {
            sized_on_host: true,
            engine: EngineKind::Tensorfold,
            ..base
        }),
        (Some(8), MaxRunningSource::Default)
    );
}

#[test]
fn a_hybrid_models_state_cache_bounds_sglang() {
    let sg = mr_input(EngineKind::Sglang);
    // The option sizes the state cache: fewer than declared, it is the bound.
    let small = s(&["--max-mamba-cache-size", "4"]);
    assert_eq!(
        mr(MaxRunningInput {
            extra_args: &small,
            declared: Some(8),
            ..sg
        }),
        (Some(4), MaxRunningSource::StateCache)
    );
    // As many or more: the passed figure stands.
    let roomy = s(&["--max-mamba-cache-size=64"]);
    assert_eq!(
        mr(MaxRunningInput {
            extra_args: &roomy,
            declared: Some(8),
            ..sg
        }),
        (Some(8), MaxRunningSource::Declared)
    );
    // Nothing passed: SGLang sizes itself, within the state cache.
    assert_eq!(
        mr(MaxRunningInput {
            extra_args: &small,
            ..sg
        }),
        (Some(4), MaxRunningSource::StateCache)
    );
    // In the host's command.
    let host = s(&[
        "python3",
        "-m",
        "sglang.launch_server",
        "--max-mamba-cache-size",
        "6",
    ]);
    assert_eq!(
        mr(MaxRunningInput {
            host_command: &host,
            ..sg
        }),
        (Some(6), MaxRunningSource::StateCache)
    );
    // A hybrid checkpoint without the option: SGLang sizes its state pool at start; the count
    // is unknown until it reports its own.
    let hybrid = MaxRunningInput {
        hybrid_checkpoint: true,
        declared: Some(8),
        ..sg
    };
    assert_eq!(mr(hybrid), (None, MaxRunningSource::StateCache));
    assert_eq!(
        mr(MaxRunningInput {
            engine_reported: Some(7),
            ..hybrid
        }),
        (Some(7), MaxRunningSource::Engine)
    );
    // vLLM keeps the states in its KV blocks: the passed figure stands.
    assert_eq!(
        mr(MaxRunningInput {
            engine: EngineKind::Vllm,
            ..hybrid
        }),
        (Some(8), MaxRunningSource::Declared)
    );
}

#[test]
fn hybrid_checkpoints_are_recognised_from_their_config() {
    use capyctl_node_agent::checkpoint::hybrid_state;
    for config in [
        json!({"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"]}),
        json!({"model_type": "nemotron_h", "hybrid_override_pattern": "M-M-M*-"}),
        json!({"model_type": "granitemoehybrid", "layer_types": ["mamba", "attention"]}),
        json!({"model_type": "jamba"}),
        json!({"model_type": "llava", "text_config": {"model_type": "falcon_h1"}}),
        json!({"model_type": "kimi_linear", "linear_attn_config": {"kda_layers": [1, 2]}}),
    ] {
        assert!(hybrid_state(&config), "{config}");
    }
    for config in [
        json!({"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]}),
        json!({"model_type": "llama"}),
        json!({}),
    ] {
        assert!(!hybrid_state(&config), "{config}");
    }
    let dir = common::temp_dir("hybrid");
    std::fs::write(
        dir.join("config.json"),
        r#"{"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"]}"#,
    )
    .unwrap();
    assert!(ModelFacts::read(dir.to_str().unwrap()).hybrid_state);
    assert!(!ModelFacts::read("Qwen/Qwen3-Next-80B-A3B").hybrid_state);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn metrics_are_read_and_absent_figures_stay_unknown() {
    let vllm = "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n\
        vllm:num_requests_running{model_name=\"a\"} 3\nvllm:num_requests_waiting{model_name=\"a\"} 1.0\n\
        vllm:kv_cache_usage_perc{model_name=\"a\"} 0.121\n";
    let l = parse_metrics(EngineKind::Vllm, vllm).unwrap();
    assert_eq!(
        (l.running, l.waiting, l.kv_usage_ppm),
        (Some(3), Some(1), Some(121_000))
    );
    let sg =
        "sglang:num_running_reqs{model_name=\"a\"} 2\nsglang:token_usage{model_name=\"a\"} 0.5\n";
    let l = parse_metrics(EngineKind::Sglang, sg).unwrap();
    assert_eq!(
        (l.running, l.waiting, l.kv_usage_ppm),
        (Some(2), None, Some(500_000))
    );
    let tf = "tensorfold_requests_running 1\ntensorfold_requests_waiting 0\ntensorfold_kv_cache_usage_ratio 0\n";
    let l = parse_metrics(EngineKind::Tensorfold, tf).unwrap();
    assert_eq!(
        (l.running, l.waiting, l.kv_usage_ppm),
        (Some(1), Some(0), Some(0))
    );
    assert_eq!(
        parse_metrics(EngineKind::Vllm, "engine_sim_requests_total 4\n"),
        None
    );
    assert_eq!(parse_metrics(EngineKind::Sglang, vllm), None);
}

#[test]
fn a_renamed_metric_counts_once_and_ranks_combine() {
    // A vLLM release exporting the new and the deprecated KV names with the same value: the
    // first name present is read, not both added.
    let both = "vllm:num_requests_running{model_name=\"a\"} 1\n\
        vllm:num_requests_waiting{model_name=\"a\"} 0\n\
        vllm:kv_cache_usage_perc{model_name=\"a\"} 0.4\n\
        vllm:gpu_cache_usage_perc{model_name=\"a\"} 0.4\n";
    assert_eq!(
        parse_metrics(EngineKind::Vllm, both).unwrap().kv_usage_ppm,
        Some(400_000)
    );
    // An older release with only the deprecated name still reads.
    let old = "vllm:gpu_cache_usage_perc{model_name=\"a\"} 0.25\n";
    assert_eq!(
        parse_metrics(EngineKind::Vllm, old).unwrap().kv_usage_ppm,
        Some(250_000)
    );
    // Two data-parallel ranks: requests add up, the KV fraction is their mean.
    let ranks = "vllm:num_requests_running{engine=\"0\"} 3\n\
        vllm:num_requests_running{engine=\"1\"} 2\n\
        vllm:num_requests_waiting{engine=\"0\"} 1\n\
        vllm:num_requests_waiting{engine=\"1\"} 4\n\
        vllm:kv_cache_usage_perc{engine=\"0\"} 0.2\n\
        vllm:kv_cache_usage_perc{engine=\"1\"} 0.6\n\
        vllm:gpu_cache_usage_perc{engine=\"0\"} 0.2\n\
        vllm:gpu_cache_usage_perc{engine=\"1\"} 0.6\n";
    let l = parse_metrics(EngineKind::Vllm, ranks).unwrap();
    assert_eq!(
        (l.running, l.waiting, l.kv_usage_ppm),
        (Some(5), Some(5), Some(400_000))
    );
    // SGLang with data parallelism: the same rules.
    let sg = "sglang:num_running_reqs{dp_rank=\"0\"} 1\nsglang:num_running_reqs{dp_rank=\"1\"} 1\n\
        sglang:num_queue_reqs{dp_rank=\"0\"} 0\nsglang:num_queue_reqs{dp_rank=\"1\"} 2\n\
        sglang:token_usage{dp_rank=\"0\"} 0.9\nsglang:token_usage{dp_rank=\"1\"} 0.3\n";
    let l = parse_metrics(EngineKind::Sglang, sg).unwrap();
    assert_eq!(
        (l.running, l.waiting, l.kv_usage_ppm),
        (Some(2), Some(2), Some(600_000))
    );
}

#[test]
fn a_node_agents_samples_are_dated_on_the_callers_clock_from_their_age() {
    use capyctl_node_agent::remote::wire::SamplesPage;
    let sample = |at| LoadSample {
        sampled_at_ms: at,
        took: std::time::Duration::from_millis(2),
        engine: None,
    };
    // The agent's clock 10 s ahead of the caller's: a sample 400 ms old there is 400 ms old
    // here (dated on the agent's clock it would look 10 s newer than now, fresh for 13 s).
    let page: SamplesPage = serde_json::from_value(json!({
        "samples": {"a": sample(1_000_100_000), "b": sample(1_000_099_000)},
        "now_ms": 1_000_100_400u64,
    }))
    .unwrap();
    let here = page.rebased(1_000_090_400);
    assert_eq!(here["a"].sampled_at_ms, 1_000_090_000);
    assert_eq!(here["a"].age_ms(1_000_090_400), 400);
    assert_eq!(here["b"].sampled_at_ms, 1_000_089_000);
    // 20 s behind: the same ages (dated on the agent's clock, every sample would be stale).
    let page = SamplesPage {
        samples: [("a".to_string(), sample(1_000_100_000))].into(),
        now_ms: 1_000_100_400,
    };
    let here = page.rebased(1_000_120_400);
    assert!(here["a"].fresh(1_000_120_400));
    assert_eq!(here["a"].sampled_at_ms, 1_000_120_000);
    // An agent that does not say its clock: the samples as they came.
    let page: SamplesPage =
        serde_json::from_value(json!({"samples": {"a": sample(1_000_100_000)}})).unwrap();
    assert_eq!(page.now_ms, 0);
    assert_eq!(page.rebased(5)["a"].sampled_at_ms, 1_000_100_000);
}

#[test]
fn samples_age_go_stale_and_are_dropped() {
    use capyctl_spec::api::{EngineLoadView, STALE_AFTER_MS, STALE_SAMPLE_KEPT_MS};
    let at = 1_791_459_999_600;
    let full = EngineLoad {
        running: Some(3),
        waiting: Some(0),
        kv_usage_ppm: Some(121_000),
    };
    let sample = LoadSample {
        sampled_at_ms: at,
        took: std::time::Duration::from_millis(2),
        engine: Some(full),
    };
    let v = sample.view(at + 400, 3).unwrap();
    assert_eq!((v.sampled_at_ms, v.age_ms, v.fresh), (at, 400, true));
    assert_eq!(v.ingress_in_flight, 3);
    assert_eq!(
        v.engine,
        Some(EngineLoadView {
            running: 3,
            waiting: 0,
            kv_usage_ppm: 121_000
        })
    );
    // The product page's example, to the letter.
    assert_eq!(
        serde_json::to_value(&v).unwrap(),
        json!({"sampled_at_ms": 1_791_459_999_600u64, "age_ms": 400, "fresh": true,
            "ingress_in_flight": 3, "engine": {"running": 3, "waiting": 0, "kv_usage_ppm": 121_000}})
    );
    // Stale from stale_after_ms on, kept 30 s more, then dropped.
    assert!(sample.fresh(at + STALE_AFTER_MS - 1));
    assert!(!sample.fresh(at + STALE_AFTER_MS));
    assert!(!sample.view(at + STALE_AFTER_MS, 0).unwrap().fresh);
    assert!(
        sample
            .view(at + STALE_AFTER_MS + STALE_SAMPLE_KEPT_MS, 0)
            .is_some()
    );
    assert!(
        sample
            .view(at + STALE_AFTER_MS + STALE_SAMPLE_KEPT_MS + 1, 0)
            .is_none()
    );
    // A clock a little behind the host's: age 0, not an underflow.
    assert_eq!(sample.age_ms(at - 50), 0);
    // A missing figure is unknown, never zero: no engine figures at all.
    let partial = LoadSample {
        engine: Some(EngineLoad {
            waiting: None,
            ..full
        }),
        ..sample
    };
    assert_eq!(partial.view(at, 0).unwrap().engine, None);
    let unreadable = LoadSample {
        engine: None,
        ..sample
    };
    assert_eq!(unreadable.view(at, 0).unwrap().engine, None);
}

#[test]
fn measurement_and_engine_views() {
    use capyctl_node_agent::measure::{Measured, Measurement};
    let m = |bytes, source| Some(Measured { bytes, source });
    let declared = Measurement {
        weights: m(8, MeasureSource::Declared),
        gpu_memory: m(40, MeasureSource::Declared),
    };
    let v = declared.view().unwrap();
    assert_eq!(
        (v.gpu_memory, v.weights_memory, v.source.as_str()),
        (40, 8, "declared")
    );
    let mixed = Measurement {
        weights: m(8, MeasureSource::Checkpoint),
        gpu_memory: m(20, MeasureSource::EngineFootprint),
    };
    assert_eq!(mixed.view().unwrap().source, "observed");
    let checkpoint = Measurement {
        weights: m(8, MeasureSource::Checkpoint),
        gpu_memory: m(40, MeasureSource::Declared),
    };
    assert_eq!(checkpoint.view().unwrap().source, "measured");
    // GPU memory unknown: no view yet (awaiting its footprint).
    let weights_only = Measurement {
        weights: m(8, MeasureSource::Checkpoint),
        gpu_memory: None,
    };
    assert_eq!(weights_only.view(), None);
    assert!(!weights_only.awaiting());
    assert!(Measurement::default().awaiting());
    assert_eq!(Measurement::default().view(), None);
    // Only the footprint: it stands in for the weights too.
    let footprint = Measurement {
        weights: None,
        gpu_memory: m(20, MeasureSource::EngineFootprint),
    };
    assert_eq!(footprint.view().unwrap().weights_memory, 20);

    let row =
        engine_info(EngineKind::Tensorfold, None).view("gpu-box", &s(&["tensorfold", "serve"]));
    assert_eq!(row.deep_park, "TensorFold does not park: it stops");
    assert_eq!((row.host_id.as_str(), row.command.len()), ("gpu-box", 2));
    let row = engine_info(EngineKind::Vllm, Some("0.31.0".into())).view("gpu-box", &s(&["vllm"]));
    assert_eq!(
        (row.deep_park.as_str(), row.version.as_deref()),
        ("enabled", Some("0.31.0"))
    );
}

#[test]
fn max_running_views_name_their_source() {
    use capyctl_spec::api::MaxRunningView;
    for (source, name) in [
        (MaxRunningSource::Engine, "engine"),
        (MaxRunningSource::Declared, "declared"),
        (MaxRunningSource::Default, "default"),
        (MaxRunningSource::StateCache, "state_cache"),
        (MaxRunningSource::ExtraArgs, "extra_args"),
        (MaxRunningSource::HostFixed, "host_fixed"),
        (MaxRunningSource::EngineDefault, "engine_default"),
        (MaxRunningSource::OnHost, "on_host"),
    ] {
        // The same name as the serde form.
        assert_eq!(serde_json::to_value(source).unwrap(), json!(name));
        let view = MaxRunningView::from(MaxRunning {
            count: Some(8),
            source,
        });
        assert_eq!(view.source, name);
    }
    let unknown = MaxRunningView::from(MaxRunning {
        count: None,
        source: MaxRunningSource::EngineDefault,
    });
    assert_eq!(
        serde_json::to_value(unknown).unwrap(),
        json!({"source": "engine_default"})
    );
}

#[test]
fn decisions_compare_option_and_probabilities() {
    let options = s(&["yes", "no"]);
    let answer = json!({"choices": [{"text": " yes", "logprobs": {"top_logprobs": [
        {" yes": (0.7f64).ln(), "Yes": (0.05f64).ln(), " no": (0.2f64).ln(), "maybe": (0.05f64).ln()}
    ]}}]});
    let d = decision_from_completion(&options, &answer);
    assert_eq!(d.picked.as_deref(), Some("yes"));
    let p = d.probabilities.clone().unwrap();
    assert!((p["yes"] - 0.75).abs() < 1e-9 && (p["no"] - 0.2).abs() < 1e-9);

    let close = DecisionAnswer {
        picked: Some("yes".into()),
        probabilities: Some([("yes".to_string(), 0.71), ("no".to_string(), 0.24)].into()),
    };
    assert!(compare_decisions(&d, &close).is_ok());
    let far = DecisionAnswer {
        probabilities: Some([("yes".to_string(), 0.69), ("no".to_string(), 0.26)].into()),
        ..close.clone()
    };
    assert!(compare_decisions(&d, &far).is_err());
    let other = DecisionAnswer {
        picked: Some("no".into()),
        ..close
    };
    assert!(compare_decisions(&d, &other).is_err());
    // Without logprobs (the simulator's answer): the option from the text, nothing to compare.
    let plain = decision_from_completion(
        &options,
        &json!({"choices": [{"text": "No", "logprobs": null}]}),
    );
    assert_eq!(plain.picked.as_deref(), Some("no"));
    assert!(compare_decisions(&plain, &plain).is_err());
    let first = FirstAnswer::Decision { answer: d.clone() };
    assert!(compare_answers(&first, &first).is_ok());
    let _ = DecisionSpec {
        prompt: "p".into(),
        options,
    };
}

/// Found by the `engine_json` fuzz target: the tokens of one option summed past 1 (` yes` at
/// log probability 0 and `y`), and a log probability above 0 gave any probability, infinity
/// too, which the state store cannot write back (JSON has no infinity).
#[test]
fn a_decisions_probabilities_stay_within_0_and_1() {
    let options = s(&["yes", "no"]);
    let answer = json!({"choices": [{"text": " yes", "logprobs": {"top_logprobs": [
        {" yes": -0.0, "y": -3.0, " no": 800.0, "No": 1e300}
    ]}}]});
    let d = decision_from_completion(&options, &answer);
    let p = d.probabilities.clone().unwrap();
    assert_eq!((p["yes"], p["no"]), (1.0, 1.0));
    let first = FirstAnswer::Decision { answer: d };
    let stored = serde_json::to_string(&first).unwrap();
    let again: FirstAnswer = serde_json::from_str(&stored).unwrap();
    assert!(compare_answers(&first, &again).is_ok());
}

#[test]
fn wake_outcomes_map_to_the_catalogue() {
    assert_eq!(WakeOutcome::Pass.failure(), None);
    assert_eq!(
        WakeOutcome::Mismatch(String::new()).failure(),
        Some(WakeFailure::Mismatch)
    );
    assert_eq!(
        WakeOutcome::ReloadFailed(String::new()).failure(),
        Some(WakeFailure::ReloadFailed)
    );
    assert_eq!(
        WakeOutcome::Uncertain(String::new()).failure(),
        Some(WakeFailure::Uncertain)
    );
    assert_eq!(
        WakeOutcome::EngineExited(String::new()).failure(),
        Some(WakeFailure::ReloadFailed)
    );
    let t = |a: &str| FirstAnswer::Text { text: a.into() };
    assert!(compare_answers(&t("x"), &t("x")).is_ok());
    assert!(compare_answers(&t("x"), &t("y")).is_err());
}

#[test]
fn checkpoint_headers_are_summed_without_loading_weights() {
    let dir = common::temp_dir("ckpt");
    let a = common::write_safetensors(
        &dir.join("model-00001-of-00002.safetensors"),
        &[("embed", "F16", &[128, 64]), ("norm", "F32", &[64])],
    );
    let b = common::write_safetensors(
        &dir.join("model-00002-of-00002.safetensors"),
        &[("lm_head", "BF16", &[64, 128]), ("bias", "F32", &[3, 5])],
    );
    assert_eq!(a, 128 * 64 * 2 + 64 * 4);
    let size = checkpoint_size(&dir).unwrap().unwrap();
    assert_eq!(size.weights_bytes, a + b);
    assert_eq!((size.tensors, size.files), (4, 2));

    let mut sp = spec(EngineKind::Vllm, dir.to_str().unwrap());
    let m = measure_before_start(&sp).unwrap();
    assert_eq!(m.weights.unwrap().bytes, a + b);
    assert_eq!(m.weights.unwrap().source, MeasureSource::Checkpoint);
    assert!(m.gpu_memory.is_none() && !m.awaiting());
    // Declared resources come first.
    sp.resources.weights_memory = Some(7);
    sp.resources.gpu_memory = Some(9);
    let m = measure_before_start(&sp).unwrap();
    assert_eq!(
        (m.weights.unwrap().bytes, m.weights.unwrap().source),
        (7, MeasureSource::Declared)
    );
    assert_eq!(m.gpu_memory.unwrap().bytes, 9);
    // A hub name: nothing known, awaiting measurement.
    assert!(
        measure_before_start(&spec(EngineKind::Vllm, "Qwen/Qwen3-4B"))
            .unwrap()
            .awaiting()
    );

    // A header that lies about a tensor's size is refused.
    let bad = dir.join("bad.safetensors");
    let header = r#"{"t":{"dtype":"F32","shape":[4],"data_offsets":[0,8]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&[0; 8]);
    std::fs::write(&bad, bytes).unwrap();
    assert!(checkpoint_size(&dir).is_err());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn proc_parsing() {
    let meminfo = "MemTotal:       65536 kB\nMemFree:  1 kB\nMemAvailable:   32768 kB\n";
    assert_eq!(parse_meminfo(meminfo), Some((65536 * 1024, 32768 * 1024)));
    assert_eq!(parse_meminfo("MemTotal: 1 kB\n"), None);
    assert_eq!(parse_ppid("123 (python3 -m (x)) S 45 123 123 0"), Some(45));
}

#[test]
fn recovery_verdicts_follow_the_record_and_the_engine() {
    use EngineState::{Asleep, Awake, NoAnswer, NotGenerating};
    use capyctl_node_agent::process::PidRecord;
    use capyctl_node_agent::recovery::{
        EngineState, RecoveryVerdict, Transition, recovery_verdict, settled,
    };
    let rec = |parked: Option<ParkTier>, transition: Option<Transition>| PidRecord {
        instance: "i".into(),
        engine: EngineKind::Vllm,
        pid: 1,
        port: 1,
        started_at_ms: 0,
        start_ticks: None,
        command: vec![],
        log: std::path::PathBuf::new(),
        spec: spec(EngineKind::Vllm, "m"),
        parking: PARK,
        first_answer: None,
        parked,
        transition,
        gpu_held: None,
        measurement: None,
    };
    let host = ParkTier::HostRam;
    let parking = Some(Transition::Parking(host));
    let waking = Some(Transition::Waking(host));
    let v = |r: &PidRecord, s: EngineState| recovery_verdict(r, &s);
    let stops = |verdict: RecoveryVerdict| matches!(verdict, RecoveryVerdict::Stop(_));
    // Ready as recorded.
    assert_eq!(v(&rec(None, None), Awake), RecoveryVerdict::Ready);
    assert!(stops(v(&rec(None, None), Asleep)));
    assert!(stops(v(&rec(None, None), NotGenerating)));
    // Parked as recorded: vLLM says asleep, SGLang does not generate.
    assert_eq!(
        v(&rec(Some(host), None), Asleep),
        RecoveryVerdict::Parked(host)
    );
    assert_eq!(
        v(&rec(Some(host), None), NotGenerating),
        RecoveryVerdict::Parked(host)
    );
    assert!(stops(v(&rec(Some(host), None), Awake)));
    // A park begun: only an engine that says it sleeps is adopted.
    assert_eq!(
        v(&rec(None, parking), Asleep),
        RecoveryVerdict::Parked(host)
    );
    assert!(stops(v(&rec(None, parking), Awake)));
    assert!(stops(v(&rec(None, parking), NotGenerating)));
    // A wake begun, or no answer: stopped, whatever else.
    for state in [Awake, Asleep, NotGenerating] {
        assert!(stops(v(&rec(Some(host), waking), state)));
    }
    assert!(stops(v(&rec(None, None), NoAnswer("refused".into()))));
    // The record goes on with the verdict's tier and no transition.
    let s = settled(rec(None, parking), &RecoveryVerdict::Parked(host));
    assert_eq!((s.parked, s.transition), (Some(host), None));
}

#[test]
fn unified_memory_is_decided_by_the_gpus_an_engine_uses() {
    use capyctl_node_agent::inventory::{GpuInfo, HostMemory, Inventory};
    let gpu = |index: u32, uuid: &str, unified: bool| GpuInfo {
        index,
        uuid: Some(uuid.into()),
        name: None,
        total_bytes: 1,
        free_bytes: None,
        unified,
    };
    let inv = Inventory {
        // The unified GPU is not the first: it still counts.
        gpus: vec![gpu(0, "GPU-aaaa", false), gpu(1, "GPU-bbbb", true)],
        gpus_overridden: true,
        host_memory: HostMemory {
            total_bytes: 1,
            available_bytes: 1,
            overridden: true,
        },
    };
    assert!(inv.unified_memory());
    assert!(inv.unified_for(None));
    assert!(!inv.unified_for(Some("0")));
    assert!(!inv.unified_for(Some("gpu-AAAA")));
    assert!(inv.unified_for(Some("1")));
    assert!(inv.unified_for(Some("0, 1")));
    // A GPU the inventory does not know: any unified GPU counts.
    assert!(inv.unified_for(Some("7")));
    // The GPUs named, by index or UUID; none without the variable or with an unknown one.
    let indices = |v: Option<&str>| {
        inv.gpus_named(v)
            .map(|g| g.iter().map(|g| g.index).collect::<Vec<_>>())
    };
    assert_eq!(indices(Some("1, gpu-AAAA")), Some(vec![1, 0]));
    assert_eq!(indices(Some(" ")), None);
    assert_eq!(indices(None), None);
    assert_eq!(indices(Some("0,7")), None);
    let discrete = Inventory {
        gpus: vec![gpu(0, "GPU-aaaa", false)],
        ..inv
    };
    assert!(!discrete.unified_memory() && !discrete.unified_for(Some("3")));
}

/// `gpus_per_instance` above 1: the engine's tensor-parallel option, before `extra_args`
/// (vLLM `--tensor-parallel-size`, SGLang `--tp-size`); none at 1.
#[test]
fn tensor_parallel_from_gpus_per_instance() {
    for (engine, flag) in [
        (EngineKind::Vllm, "--tensor-parallel-size"),
        (EngineKind::Sglang, "--tp-size"),
    ] {
        let mut sp = spec(engine, "m");
        sp.tensor_parallel = Some(4);
        sp.extra_args = s(&["--dtype", "auto"]);
        let cmd = launch_command(&sp, &EngineLaunch::default_for(engine), 1, PARK).unwrap();
        assert_eq!(
            capyctl_node_agent::spec::flag_value(&cmd.args, flag),
            Some("4"),
            "{engine}: {:?}",
            cmd.args
        );
        let at = cmd.args.iter().position(|a| a == flag).unwrap();
        let extra = cmd.args.iter().position(|a| a == "--dtype").unwrap();
        assert!(at < extra, "{:?}", cmd.args);
        let one = spec(engine, "m");
        let cmd = launch_command(&one, &EngineLaunch::default_for(engine), 1, PARK).unwrap();
        assert!(!cmd.args.iter().any(|a| a == flag), "{:?}", cmd.args);
    }
}

/// `adapters: {max_loaded, max_rank}` (DESIGN 4.9): vLLM gets `--enable-lora --max-loras
/// --max-lora-rank` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` (its load/unload routes exist
/// only with it); SGLang its own flags for adapters loaded at run time; TensorFold is refused;
/// without `adapters` none of it.
#[test]
fn adapters_pass_the_engines_lora_flags() {
    use capyctl_interfaces::spec::AdapterSlots;
    let slots = AdapterSlots {
        max_loaded: 3,
        max_rank: 16,
    };
    let mut sp = spec(EngineKind::Vllm, "m");
    sp.adapters = Some(slots);
    sp.extra_args = s(&["--dtype", "float32"]);
    let cmd = launch_command(&sp, &EngineLaunch::default_for(EngineKind::Vllm), 1, PARK).unwrap();
    use capyctl_node_agent::spec::flag_value as flag;
    assert!(
        cmd.args.iter().any(|a| a == "--enable-lora"),
        "{:?}",
        cmd.args
    );
    assert_eq!(flag(&cmd.args, "--max-loras"), Some("3"));
    assert_eq!(flag(&cmd.args, "--max-lora-rank"), Some("16"));
    assert_eq!(
        cmd.env
            .get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
            .map(String::as_str),
        Some("True")
    );
    // Before `extra_args`, like CapyCTL's other flags.
    let lora = cmd.args.iter().position(|a| a == "--enable-lora").unwrap();
    let extra = cmd.args.iter().position(|a| a == "--dtype").unwrap();
    assert!(lora < extra, "{:?}", cmd.args);

    let mut sp = spec(EngineKind::Sglang, "m");
    sp.adapters = Some(slots);
    let cmd = launch_command(&sp, &EngineLaunch::default_for(EngineKind::Sglang), 1, PARK).unwrap();
    assert!(
        cmd.args.iter().any(|a| a == "--enable-lora"),
        "{:?}",
        cmd.args
    );
    assert_eq!(flag(&cmd.args, "--max-lora-rank"), Some("16"));
    assert_eq!(flag(&cmd.args, "--max-loaded-loras"), Some("3"));
    assert_eq!(flag(&cmd.args, "--max-loras-per-batch"), Some("3"));
    assert_eq!(flag(&cmd.args, "--lora-target-modules"), Some("all"));
    assert!(!cmd.env.contains_key("VLLM_ALLOW_RUNTIME_LORA_UPDATING"));

    // vLLM takes only the ranks of its `MaxLoRARanks`: the next one at or above max_rank.
    let mut sp = spec(EngineKind::Vllm, "m");
    sp.adapters = Some(AdapterSlots {
        max_loaded: 3,
        max_rank: 24,
    });
    let cmd = launch_command(&sp, &EngineLaunch::default_for(EngineKind::Vllm), 1, PARK).unwrap();
    assert_eq!(flag(&cmd.args, "--max-lora-rank"), Some("32"));
    // No slot, or no rank: refused, naming the field.
    for (engine, max_loaded, max_rank, field) in [
        (EngineKind::Vllm, 0, 8, "adapters.max_loaded"),
        (EngineKind::Sglang, 2, 0, "adapters.max_rank"),
        (EngineKind::Vllm, 2, 1024, "adapters.max_rank"),
    ] {
        let mut sp = spec(engine, "m");
        sp.adapters = Some(AdapterSlots {
            max_loaded,
            max_rank,
        });
        let err = launch_command(&sp, &EngineLaunch::default_for(engine), 1, PARK).unwrap_err();
        assert!(
            matches!(&err, AgentError::InvalidSpec { detail } if detail.contains(field)),
            "{err}"
        );
    }

    let mut sp = spec(EngineKind::Tensorfold, "m");
    sp.adapters = Some(slots);
    let err = launch_command(
        &sp,
        &EngineLaunch::default_for(EngineKind::Tensorfold),
        1,
        PARK,
    )
    .unwrap_err();
    assert!(
        matches!(&err, AgentError::InvalidSpec { detail } if detail.contains("adapters")),
        "{err}"
    );

    for engine in [EngineKind::Vllm, EngineKind::Sglang] {
        let cmd = launch_command(
            &spec(engine, "m"),
            &EngineLaunch::default_for(engine),
            1,
            PARK,
        )
        .unwrap();
        assert!(
            !cmd.args.iter().any(|a| a.contains("lora")),
            "{:?}",
            cmd.args
        );
        assert!(!cmd.env.contains_key("VLLM_ALLOW_RUNTIME_LORA_UPDATING"));
    }
}
