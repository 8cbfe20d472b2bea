//! `capyctl-operator`: CapyCTL's server on Kubernetes (DESIGN.md 4.1): in-cluster, or out of
//! cluster with `KUBECONFIG`; the namespace from `--namespace` / `POD_NAMESPACE`. Its command
//! line is `capyctl_operator::args`; see `capyctl_operator::operator` for what runs where.

use std::process::ExitCode;

use capyctl_operator::args::Args;
use clap::Parser;

fn main() -> ExitCode {
    let args = Args::parse();
    capyctl_node_agent::cli::run_binary("capyctl-operator", || args.run())
}
