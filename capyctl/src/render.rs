//! What the commands print: the product page's tables, receipts and the status page.

use capyctl_spec::InstanceState;
use capyctl_spec::api::{
    ActionReceipt, DeployOutcome, DeployReceipt, DeploymentView, EngineView, HostDrainReceipt,
    Released, SwitchPhaseKind, SwitchRecord, Victim, VictimResult,
};
use capyctl_spec::units::{format_bytes, format_duration};

/// A table as the product page prints it: every column as wide as its widest cell plus three
/// spaces, the last one unpadded, no trailing spaces.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let columns = header.len();
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate().take(columns) {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = header.iter().map(|h| h.to_string()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate().take(columns) {
            line.push_str(cell);
            if i + 1 < columns {
                let pad = widths[i] + 3 - cell.chars().count();
                line.extend(std::iter::repeat_n(' ', pad));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// READY: the ready instances over the deployment's `replicas` (`1/3`), as the `Deployment`
/// object's printer column shows it.
pub fn ready(d: &DeploymentView) -> String {
    let (ready, replicas) = capyctl_crds::ready_replicas(d);
    format!("{ready}/{replicas}")
}

/// `capyctl list deployments`: `NAME STATE READY REVISION HOSTS`, and `PRIORITY` last when
/// some deployment sets `priority` (DESIGN 4.10; the page's table is unchanged otherwise).
pub fn deployments(list: &[DeploymentView]) -> String {
    let priorities = list.iter().any(|d| d.spec.priority.is_some());
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|d| {
            let mut row = vec![
                d.name.clone(),
                capyctl_spec::api::listed_state(d),
                match d.spec.adapter {
                    // The instances of its base that have it loaded, of those known.
                    Some(_) => d.ready.clone(),
                    None => ready(d),
                },
                d.revision.to_string(),
                hosts(&d.hosts),
            ];
            if priorities {
                row.push(d.spec.priority().to_string());
            }
            row
        })
        .collect();
    if priorities {
        table(
            &["NAME", "STATE", "READY", "REVISION", "HOSTS", "PRIORITY"],
            &rows,
        )
    } else {
        table(&["NAME", "STATE", "READY", "REVISION", "HOSTS"], &rows)
    }
}

/// `capyctl engine list`: `ENGINE VERSION DEEP PARK HOST`.
pub fn engines(list: &[EngineView]) -> String {
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|e| {
            vec![
                e.engine.to_string(),
                e.version.clone().unwrap_or_else(|| "unknown".to_string()),
                e.deep_park.clone(),
                e.host_id.clone(),
            ]
        })
        .collect();
    table(&["ENGINE", "VERSION", "DEEP PARK", "HOST"], &rows)
}

/// `capyctl tenants list`: `TENANT MODELS RATE KEYS ANSWERS TOKENS WAITING` (never a key).
/// RATE is `<requests>/min <tokens> tok/min` with what is left now; ANSWERS by status.
pub fn tenants(list: &[capyctl_router::tenants::TenantReport]) -> String {
    if list.is_empty() {
        return "no tenants: the inference listener asks for no key\n".to_string();
    }
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|t| {
            let mut rate = Vec::new();
            if let Some(r) = t.requests_per_minute {
                rate.push(format!(
                    "{r} req/min ({} left)",
                    t.remaining_requests.unwrap_or(0)
                ));
            }
            if let Some(r) = t.tokens_per_minute {
                rate.push(format!(
                    "{r} tok/min ({} left)",
                    t.remaining_tokens.unwrap_or(0)
                ));
            }
            let answers: Vec<String> = t.answers.iter().map(|(s, n)| format!("{s}:{n}")).collect();
            vec![
                t.name.clone(),
                t.models
                    .as_ref()
                    .map_or_else(|| "*".to_string(), |m| m.join(",")),
                if rate.is_empty() {
                    "-".to_string()
                } else {
                    rate.join(", ")
                },
                t.keys.to_string(),
                if answers.is_empty() {
                    "-".to_string()
                } else {
                    answers.join(" ")
                },
                t.tokens.to_string(),
                t.waiting.to_string(),
            ]
        })
        .collect();
    table(
        &[
            "TENANT", "MODELS", "RATE", "KEYS", "ANSWERS", "TOKENS", "WAITING",
        ],
        &rows,
    )
}

fn hosts(hosts: &[String]) -> String {
    if hosts.is_empty() {
        "-".to_string()
    } else {
        hosts.join(",")
    }
}

/// `capyctl deploy model`.
pub fn deployed(receipt: &DeployReceipt) -> String {
    let d = &receipt.deployment;
    let what = match receipt.outcome {
        DeployOutcome::Created => "created",
        DeployOutcome::Updated => "updated",
        DeployOutcome::Unchanged => "unchanged",
    };
    format!(
        "deployment {} ({}) {what}, revision {}, state {}\n",
        d.name, d.id, d.revision, d.state
    )
}

/// The receipt of `start`, `stop`, `park`, `delete` and `preinitialize`: what happened, then
/// `switch_id` and the `victims` (deployment and instance IDs) with what was released.
pub fn receipt(receipt: &ActionReceipt) -> String {
    let d = &receipt.deployment;
    let mut out = format!(
        "{} deployment {} ({}): state {}, ready {}\n",
        receipt.action,
        d.name,
        d.id,
        d.state,
        ready(d)
    );
    if d.state != InstanceState::Ready
        && let Some(c) = d
            .conditions
            .iter()
            .find(|c| c.kind == "Ready" && c.status != "True" && !c.reason.is_empty())
    {
        out.push_str(&format!("  {}: {}\n", c.reason, c.message));
    }
    if let Some(id) = &receipt.switch_id {
        out.push_str(&format!("switch_id: {id}\n"));
    }
    victims(&mut out, &receipt.victims);
    out
}

/// The instances a command released: deployment and instance IDs, and how.
fn victims(out: &mut String, victims: &[Victim]) {
    if victims.is_empty() {
        return;
    }
    out.push_str("victims:\n");
    for v in victims {
        out.push_str(&format!(
            "  - deployment: {} ({})\n    instance: {}\n    released: {}\n",
            v.deployment_id,
            v.name,
            v.instance_id,
            v.released.words()
        ));
    }
    if victims
        .iter()
        .any(|v| v.released == Released::StoppedNoRoomToPark)
    {
        out.push_str(&format!(
            "released: {}\n",
            Released::StoppedNoRoomToPark.words()
        ));
    }
}

/// `capyctl drain host ID` and `capyctl uncordon host ID`.
pub fn host_receipt(receipt: &HostDrainReceipt) -> String {
    let mut out = match (receipt.action.as_str(), receipt.victims.len()) {
        ("drain", 0) => format!(
            "drained host {}: out of service, nothing was running there\n",
            receipt.host_id
        ),
        ("drain", n) => format!(
            "drained host {}: out of service, {n} instance(s) stopped\n",
            receipt.host_id
        ),
        _ => format!("uncordoned host {}: in service\n", receipt.host_id),
    };
    victims(&mut out, &receipt.victims);
    out
}

/// `capyctl status deployment NAME`.
pub fn status(d: &DeploymentView) -> String {
    let mut rows: Vec<(&str, String)> = vec![
        ("name", d.name.clone()),
        ("id", d.id.clone()),
        ("state", d.state.to_string()),
        ("ready", ready(d)),
        ("revision", d.revision.to_string()),
        ("hosts", hosts(&d.hosts)),
        ("engine", d.engine.to_string()),
        ("model", d.model.clone()),
        ("activation", d.activation.to_string()),
        ("warm", d.warm.to_string()),
        (
            "residency",
            d.residency
                .map(|r| r.to_string())
                .unwrap_or_else(|| "auto".to_string()),
        ),
        (
            "measurement",
            match &d.measurement {
                Some(m) => format!(
                    "gpu {} weights {} ({})",
                    format_bytes(m.gpu_memory),
                    format_bytes(m.weights_memory),
                    m.source
                ),
                None => "awaiting measurement".to_string(),
            },
        ),
    ];
    // The replicas keys, when the document sets them.
    let doc = &d.spec;
    if let Some(n) = doc.replicas {
        rows.push(("replicas", n.to_string()));
    }
    if let Some(s) = doc.scale() {
        rows.push((
            "scale",
            format!(
                "min {}, target_in_flight {}, scale_down_delay {}",
                s.min,
                s.target_in_flight,
                format_duration(s.scale_down_delay)
            ),
        ));
    }
    if let Some(n) = doc.gpus_per_instance {
        rows.push(("gpus_per_instance", n.to_string()));
    }
    if let Some(r) = doc.routing {
        rows.push(("routing", r.to_string()));
    }
    if let Some(p) = doc.priority {
        rows.push(("priority", p.to_string()));
    }
    if d.operator_stopped {
        rows.push(("stopped by", "operator".to_string()));
    }
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0) + 2;
    let mut out = String::new();
    for (k, v) in rows {
        out.push_str(&format!("{:width$}{v}\n", format!("{k}:")));
    }
    if !d.instances.is_empty() {
        out.push_str("instances:\n");
        for i in &d.instances {
            let mut line = format!(
                "  {} host {} index {} generation {}: {}",
                i.instance_id, i.host_id, i.index, i.generation, i.state
            );
            if let Some(tier) = &i.parked_tier {
                line.push_str(&format!(" ({tier})"));
            }
            if let Some(port) = i.port {
                line.push_str(&format!(" port {port}"));
            }
            if let Some(pid) = i.pid {
                line.push_str(&format!(" pid {pid}"));
            }
            if let Some(err) = &i.last_error {
                line.push_str(&format!("; last error: {err}"));
            }
            out.push_str(&line);
            out.push('\n');
        }
    }
    if !d.conditions.is_empty() {
        out.push_str("conditions:\n");
        for c in &d.conditions {
            let mut line = format!("  {} {}", c.kind, c.status);
            if !c.reason.is_empty() {
                line.push_str(&format!(" {}", c.reason));
            }
            if !c.message.is_empty() {
                line.push_str(&format!(": {}", c.message));
            }
            out.push_str(&line);
            out.push('\n');
        }
    }
    out
}

/// `capyctl switches`: one row per switch, `TIME DEPLOYMENT CAUSE WAVE VICTIMS PHASES OUTCOME`
/// (TIME in UTC; PHASES each phase's duration in order, `…` for one still running).
pub fn switches(records: &[SwitchRecord], header: bool) -> String {
    let rows: Vec<Vec<String>> = records.iter().map(switch_row).collect();
    let text = table(
        &[
            "TIME",
            "DEPLOYMENT",
            "CAUSE",
            "WAVE",
            "VICTIMS",
            "PHASES",
            "OUTCOME",
        ],
        &rows,
    );
    if header {
        text
    } else {
        text.split_once('\n')
            .map(|(_, rest)| rest.to_string())
            .unwrap_or_default()
    }
}

fn switch_row(r: &SwitchRecord) -> Vec<String> {
    let victims = if r.victims.is_empty() {
        "-".to_string()
    } else {
        r.victims
            .iter()
            .map(|v| {
                let result = match v.result {
                    VictimResult::Parked => "parked",
                    VictimResult::Stopped => "stopped",
                    VictimResult::Kept => "kept",
                    VictimResult::Failed => "failed",
                };
                format!("{} {result}", v.deployment)
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let phases = if r.phases.is_empty() {
        "-".to_string()
    } else {
        r.phases
            .iter()
            .map(|p| {
                let name = match p.phase {
                    SwitchPhaseKind::AdmissionWindow => "window",
                    SwitchPhaseKind::WakeCheck => "check",
                    other => other.word(),
                };
                match p.ended_ms {
                    Some(end) => format!("{name} {}", seconds(end.saturating_sub(p.began_ms))),
                    None => format!("{name} …"),
                }
            })
            .collect::<Vec<_>>()
            .join(" ")
    };
    let outcome = match &r.error {
        Some(e) => format!("{} {}", r.outcome.word(), e.code),
        None => r.outcome.word().to_string(),
    };
    vec![
        utc_time(r.began_ms),
        r.deployment.clone(),
        r.cause.word().to_string(),
        r.wave.to_string(),
        victims,
        phases,
        outcome,
    ]
}

/// Milliseconds as seconds with two decimals: `0.50s`, `12.34s`.
fn seconds(ms: u64) -> String {
    format!("{}.{:02}s", ms / 1000, (ms % 1000) / 10)
}

/// Unix milliseconds as `YYYY-MM-DD HH:MM:SS` in UTC.
pub fn utc_time(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Days since 1970-01-01 to a civil date (H. Hinnant's `civil_from_days`).
    let z = i64::try_from(days).unwrap_or(0) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}",
        rest / 3600,
        (rest % 3600) / 60,
        rest % 60
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn rows(cells: &[[&str; 5]]) -> Vec<Vec<String>> {
        cells
            .iter()
            .map(|r| r.iter().map(|c| c.to_string()).collect())
            .collect()
    }

    #[test]
    fn the_product_pages_tables_byte_for_byte() {
        let header = ["NAME", "STATE", "READY", "REVISION", "HOSTS"];
        assert_eq!(
            table(
                &header,
                &rows(&[["my-model", "parked", "0/1", "1", "gpu-box"]])
            ),
            "NAME       STATE    READY   REVISION   HOSTS\n\
             my-model   parked   0/1     1          gpu-box\n"
        );
        assert_eq!(
            table(
                &header,
                &rows(&[["my-model", "ready", "1/1", "1", "gpu-box"]])
            ),
            "NAME       STATE   READY   REVISION   HOSTS\n\
             my-model   ready   1/1     1          gpu-box\n"
        );
        assert_eq!(
            table(
                &header,
                &rows(&[
                    ["my-model", "parked", "0/1", "1", "gpu-box"],
                    ["other-model", "ready", "1/1", "1", "gpu-box"],
                ])
            ),
            "NAME          STATE    READY   REVISION   HOSTS\n\
             my-model      parked   0/1     1          gpu-box\n\
             other-model   ready    1/1     1          gpu-box\n"
        );
    }

    /// A deployment of `doc` with one instance per state in `states`.
    fn view(doc: &str, states: &[InstanceState]) -> DeploymentView {
        use capyctl_spec::api::InstanceView;
        let spec = capyctl_spec::documents::parse_deployment_str("d.yaml", doc).unwrap();
        DeploymentView {
            id: "01KDEP".into(),
            name: spec.name.clone(),
            state: states.first().copied().unwrap_or(InstanceState::Stopped),
            // What today's lifecycle says whatever the instances: READY is counted instead.
            ready: "0/1".into(),
            revision: 1,
            hosts: vec!["gpu-box".into()],
            activation: capyctl_spec::Activation::OnDemand,
            warm: false,
            operator_stopped: false,
            engine: spec.engine_kind(),
            model: spec.model_arg().to_string(),
            residency: None,
            measurement: None,
            instances: states
                .iter()
                .enumerate()
                .map(|(i, &state)| InstanceView {
                    instance_id: format!("01KDEP-{i}"),
                    index: u32::try_from(i).unwrap(),
                    host_id: "gpu-box".into(),
                    generation: 1,
                    state,
                    parked_tier: None,
                    port: None,
                    pid: None,
                    last_error: None,
                })
                .collect(),
            conditions: Vec::new(),
            spec,
        }
    }

    #[test]
    fn ready_is_the_ready_instances_over_the_replicas() {
        use InstanceState::{Parked, Ready, Starting};
        let three = "name: chat\nengine: vllm\nmodel: m\nreplicas: 3\n";
        let one = "name: solo\nengine: vllm\nmodel: m\n";
        assert_eq!(
            deployments(&[
                view(three, &[Ready, Parked, Ready]),
                view(one, &[Ready]),
                view(three, &[Starting]),
            ]),
            "NAME   STATE      READY   REVISION   HOSTS\n\
             chat   ready      2/3     1          gpu-box\n\
             solo   ready      1/1     1          gpu-box\n\
             chat   starting   0/3     1          gpu-box\n"
        );
        let receipt_text = receipt(&ActionReceipt {
            action: "started".into(),
            deployment: view(three, &[Ready, Ready, Ready]),
            switch_id: None,
            victims: Vec::new(),
        });
        assert!(
            receipt_text.starts_with("started deployment chat (01KDEP): state ready, ready 3/3\n"),
            "{receipt_text}"
        );
    }

    #[test]
    fn status_shows_the_replicas_keys_when_set() {
        let plain = status(&view(
            "name: solo\nengine: vllm\nmodel: m\n",
            &[InstanceState::Ready],
        ));
        assert!(plain.contains("ready:       1/1\n"), "{plain}");
        for key in [
            "replicas:",
            "scale:",
            "gpus_per_instance:",
            "routing:",
            "priority:",
        ] {
            assert!(!plain.contains(key), "{key} in\n{plain}");
        }
        let text = status(&view(
            "name: chat\nengine: vllm\nmodel: m\nreplicas: 4\nscale: {min: 2, target_in_flight: 16}\ngpus_per_instance: 2\nrouting: prefix\n",
            &[InstanceState::Ready, InstanceState::Parked],
        ));
        for line in [
            "ready:             1/4\n",
            "replicas:          4\n",
            "scale:             min 2, target_in_flight 16, scale_down_delay 1m\n",
            "gpus_per_instance: 2\n",
            "routing:           prefix\n",
            "  01KDEP-1 host gpu-box index 1 generation 1: parked\n",
        ] {
            assert!(text.contains(line), "no {line:?} in\n{text}");
        }
    }

    #[test]
    fn status_and_the_list_show_the_priority_when_set() {
        let prod = view(
            "name: prod\nengine: vllm\nmodel: m\npriority: 100\n",
            &[InstanceState::Ready],
        );
        let text = status(&prod);
        assert!(text.contains("\npriority:    100\n"), "{text}");
        let plain = view(
            "name: test\nengine: vllm\nmodel: m\n",
            &[InstanceState::Parked],
        );
        assert!(
            !deployments(std::slice::from_ref(&plain)).contains("PRIORITY"),
            "the page's table without priorities"
        );
        let list = deployments(&[prod, plain]);
        let lines: Vec<&str> = list.lines().collect();
        assert!(lines[0].ends_with("HOSTS     PRIORITY"), "{list}");
        assert!(
            lines[1].starts_with("prod ") && lines[1].ends_with(" 100"),
            "{list}"
        );
        assert!(
            lines[2].starts_with("test ") && lines[2].ends_with(" 0"),
            "{list}"
        );
    }

    #[test]
    fn an_empty_table_is_its_header() {
        assert_eq!(table(&["A", "BB"], &[]), "A   BB\n");
    }

    #[test]
    fn a_switch_is_one_row_with_its_phases_in_order() {
        use capyctl_spec::api::{
            SwitchCause, SwitchError, SwitchOutcome, SwitchPhase, SwitchVictim, VictimAction,
        };
        let phase = |phase, began_ms, ended_ms| SwitchPhase {
            phase,
            instance: "01KB-0".into(),
            began_ms,
            ended_ms,
        };
        let mut r = SwitchRecord {
            seq: 7,
            switch_id: "sw-1".into(),
            deployment: "chat-b".into(),
            deployment_id: "01KB".into(),
            instance: "01KB-0".into(),
            host_id: "gpu-box".into(),
            gpus: Vec::new(),
            cause: SwitchCause::Wave,
            wave: 3,
            began_ms: 1_764_950_000_000,
            ended_ms: Some(1_764_950_004_123),
            outcome: SwitchOutcome::Ok,
            error: None,
            victims: vec![SwitchVictim {
                deployment: "chat-a".into(),
                deployment_id: "01KA".into(),
                instance: "01KA-0".into(),
                action: VictimAction::Park,
                result: VictimResult::Parked,
                error: None,
            }],
            phases: vec![
                phase(
                    SwitchPhaseKind::AdmissionWindow,
                    1_764_950_000_000,
                    Some(1_764_950_000_500),
                ),
                phase(
                    SwitchPhaseKind::Drain,
                    1_764_950_000_500,
                    Some(1_764_950_000_510),
                ),
                phase(
                    SwitchPhaseKind::Park,
                    1_764_950_000_510,
                    Some(1_764_950_001_710),
                ),
                phase(
                    SwitchPhaseKind::Wake,
                    1_764_950_001_710,
                    Some(1_764_950_003_900),
                ),
                phase(
                    SwitchPhaseKind::WakeCheck,
                    1_764_950_003_900,
                    Some(1_764_950_004_120),
                ),
                phase(SwitchPhaseKind::Release, 1_764_950_004_120, None),
            ],
        };
        assert_eq!(
            switches(std::slice::from_ref(&r), true),
            "TIME                  DEPLOYMENT   CAUSE   WAVE   VICTIMS         PHASES                                                                 OUTCOME\n\
             2025-12-05 15:53:20   chat-b       wave    3      chat-a parked   window 0.50s drain 0.01s park 1.20s wake 2.19s check 0.22s release …   ok\n"
        );
        r.outcome = SwitchOutcome::Failed;
        r.error = Some(SwitchError {
            code: "drain_timeout".into(),
            message: "…".into(),
        });
        let row = switches(&[r], false);
        assert!(!row.contains("TIME"), "{row}");
        assert!(row.trim_end().ends_with("failed drain_timeout"), "{row}");
        assert_eq!(utc_time(0), "1970-01-01 00:00:00");
        assert_eq!(utc_time(951_782_400_000), "2000-02-29 00:00:00");
    }
}
