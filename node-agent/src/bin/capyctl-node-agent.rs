//! `capyctl-node-agent`: the host agent as a server (the node agent DaemonSet on Kubernetes;
//! DESIGN.md 4.1). The program is [`capyctl_node_agent::cli`], so that `capyctl start host`
//! runs the same one; see it for the flags, their environment variables and what runs.

use std::process::ExitCode;

fn main() -> ExitCode {
    capyctl_node_agent::cli::main()
}
