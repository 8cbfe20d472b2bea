//! A standalone server that drives node agents besides its own host (`capyctl start standalone
//! --node-agent URL`), end to end with the real binaries: two models that cannot share one GPU
//! run at once, one on each host; a kill -9 of the server and a restart adopt the node agent's
//! engine (same process); an agent that cannot be reached stops the start with one clear line.
#![allow(clippy::unwrap_used)]

mod support;

use std::path::Path;

use support::{AGENT_TOKEN, Capy, NodeAgent, chat, document, model, start_node_agent, temp_dir};

fn start_agent(dir: &Path) -> NodeAgent {
    start_agent_as(dir, "a")
}

/// A node agent (`capyctl start host`) with its own 10 GiB GPU as host `box-<x>` (node
/// `node-<x>`), the engine simulator as its engines.
fn start_agent_as(dir: &Path, x: &str) -> NodeAgent {
    let bin = support::engine_sim().display().to_string();
    start_node_agent(
        dir,
        x,
        &format!(
            "id: box-{x}\ngpus: [{{memory: 10GiB}}]\nhost_memory: 1GiB\nengines:\n  vllm: {{command: [\"{bin}\"]}}\n"
        ),
    )
}

/// The host and pid of `name`'s instance, once it is ready.
fn placed(capy: &Capy, name: &str) -> (String, u64) {
    let s = capy.status_until(name, "ready", |s| s["state"] == "ready");
    let i = &s["instances"][0];
    (
        i["host_id"].as_str().unwrap().to_string(),
        i["pid"].as_u64().unwrap(),
    )
}

#[test]
fn standalone_drives_a_node_agent_as_a_second_host_and_adopts_its_engine_after_a_kill() {
    let dir = temp_dir("e2e-node-agents");
    let agent = start_agent(&dir);
    let doc = document("", "", &[&model("chat-a", ""), &model("chat-b", "")]);
    let args = ["--node-agent", agent.url.as_str()];
    let env = [("CAPYCTL_AGENT_TOKEN", AGENT_TOKEN)];
    let capy = Capy::start_with(&dir, &doc, &args, &env);

    let hosts = capy.management_get("/management/v1/hosts").json();
    let ids: Vec<&str> = hosts["hosts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["box-a", "gpu-box"], "{hosts}");

    // 6 GiB each: one per 10 GiB GPU, both at once, with no switch.
    for name in ["chat-a", "chat-b"] {
        let r = chat(capy.inference, name, false);
        assert_eq!(r.status, 200, "{name}: {}", r.body);
    }
    let (host_a, pid_a) = placed(&capy, "chat-a");
    let (host_b, _) = placed(&capy, "chat-b");
    let mut both = [host_a.clone(), host_b.clone()];
    both.sort();
    assert_eq!(both, ["box-a", "gpu-box"]);
    let (remote, remote_pid) = if host_a == "box-a" {
        ("chat-a", pid_a)
    } else {
        ("chat-b", placed(&capy, "chat-b").1)
    };
    // The remote model's engine is the node agent's child.
    assert_eq!(
        capyctl_test_support::live_parent(remote_pid),
        Some(u64::from(agent.child.id()))
    );

    // kill -9 and a restart on the same data directory: the node agent's engine is adopted as
    // it is (same process), and both models are served again.
    capy.kill();
    let capy = Capy::start_with(&dir, &doc, &args, &env);
    let (host, pid) = placed(&capy, remote);
    assert_eq!((host.as_str(), pid), ("box-a", remote_pid));
    for name in ["chat-a", "chat-b"] {
        let r = chat(capy.inference, name, false);
        assert_eq!(r.status, 200, "{name}: {}", r.body);
    }
    drop(capy);
    drop(agent);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_node_agent_that_cannot_be_reached_stops_the_start_naming_it() {
    let dir = temp_dir("e2e-node-agent-gone");
    let doc = document("", "", &[]);
    let url = "http://127.0.0.1:9";
    let out = Capy::try_start(
        &dir,
        &doc,
        &["--node-agent", url],
        &[("CAPYCTL_AGENT_TOKEN", AGENT_TOKEN)],
    )
    .map(|_| ())
    .expect_err("started without its node agent");
    let line = out.fails();
    assert!(line.contains(url), "{line}");
    assert!(line.contains("--node-agent"), "{line}");
    let _ = std::fs::remove_dir_all(dir);
}

/// Replicas over hosts (DESIGN 4.7): two node agents (process runtime) beside the
/// standalone's own host, whose 4 GiB GPU is too small for the model. A deployment of two
/// replicas runs one instance on each agent, each engine the child of its agent; a kill -9 of
/// one agent's engine fails that instance alone, and the deployment serves from the other.
#[test]
fn replicas_run_one_instance_on_each_of_two_node_agents() {
    let dir = temp_dir("e2e-node-agents-replicas");
    let (a, b) = (start_agent_as(&dir, "a"), start_agent_as(&dir, "b"));
    let doc = document("", "", &[&model("chat-r", "replicas: 2")])
        .replace("gpus: [{memory: 10GiB}]", "gpus: [{memory: 4GiB}]");
    let args = [
        "--node-agent",
        a.url.as_str(),
        "--node-agent",
        b.url.as_str(),
    ];
    let env = [("CAPYCTL_AGENT_TOKEN", AGENT_TOKEN)];
    let capy = Capy::start_with(&dir, &doc, &args, &env);

    assert_eq!(chat(capy.inference, "chat-r", false).status, 200);
    let s = capy.status_until("chat-r", "had two ready instances", |s| s["ready"] == "2/2");
    let instances: Vec<(String, u64)> = s["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            (
                i["host_id"].as_str().unwrap().to_string(),
                i["pid"].as_u64().unwrap(),
            )
        })
        .collect();
    let mut hosts: Vec<&str> = instances.iter().map(|(h, _)| h.as_str()).collect();
    hosts.sort_unstable();
    hosts.dedup();
    assert_eq!(hosts, ["box-a", "box-b"], "one instance per agent: {s:#}");
    for (host, pid) in &instances {
        let agent = if host == "box-a" { &a } else { &b };
        assert_eq!(
            capyctl_test_support::live_parent(*pid),
            Some(u64::from(agent.child.id())),
            "{host}'s engine is its agent's child"
        );
    }

    // One engine dies: its instance fails alone, and the deployment keeps serving.
    support::signal(instances[0].1 as u32, "KILL");
    let s = capy.status_until("chat-r", "showed one failed instance", |s| {
        s["instances"]
            .as_array()
            .unwrap()
            .iter()
            .any(|i| i["state"] == "failed")
    });
    assert_eq!(s["ready"], "1/2", "{s:#}");
    for _ in 0..4 {
        let r = chat(capy.inference, "chat-r", false);
        assert_eq!(r.status, 200, "{}", r.body);
    }
    drop(capy);
    drop((a, b));
    let _ = std::fs::remove_dir_all(dir);
}
