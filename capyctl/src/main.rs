//! `capyctl` (also installed as `kubectl-capyctl`): CapyCTL's command line.
//!
//! Today it checks documents (`capyctl check`); the management commands of DESIGN.md 4.1 and
//! `capyctl start standalone` come with the standalone issue.

use std::process::ExitCode;

use capyctl_crds::documents;
use capyctl_crds::overrides::Overrides;
use clap::{Parser, Subcommand, ValueEnum};

/// CapyCTL: park idle models, wake them on demand, switch the GPU under load.
#[derive(Parser)]
#[command(name = "capyctl", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The kind of document `check` reads.
#[derive(Clone, Copy, ValueEnum)]
enum Kind {
    /// A deployment document (`capyctl deploy model --file`).
    Deployment,
    /// A standalone document (`capyctl start standalone --file`).
    Standalone,
    /// A host document.
    Host,
    /// A server document.
    Server,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a document, with `--set` and `CAPYCTL_SET__…` overrides applied, and print the
    /// effective settings; exits non-zero with one line naming the file, line and key on error.
    Check {
        /// The document's kind.
        kind: Kind,
        /// The document.
        #[arg(long)]
        file: std::path::PathBuf,
        /// An override, `a.b=c` (repeatable); wins over `CAPYCTL_SET__A__B=c`.
        #[arg(long = "set")]
        set: Vec<String>,
    },
}

fn main() -> ExitCode {
    let Command::Check { kind, file, set } = Cli::parse().command;
    let result = Overrides::from_args_and_env(set, std::env::vars()).and_then(|o| match kind {
        Kind::Deployment => documents::load_deployment_file(&file).map(|d| format!("{d:#?}")),
        Kind::Standalone => documents::load_standalone_file(&file, &o).map(|c| format!("{c:#?}")),
        Kind::Host => documents::load_host_file(&file, &o).map(|c| format!("{c:#?}")),
        Kind::Server => documents::load_server_file(&file, &o).map(|c| format!("{c:#?}")),
    });
    match result {
        Ok(text) => {
            println!("{text}");
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("capyctl: {err}");
            ExitCode::FAILURE
        }
    }
}
