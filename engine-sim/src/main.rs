//! The `engine-sim` binary: parse, bind, print the listening line, serve.

use std::io::{IsTerminal, Write};

use anyhow::Context;
use capyctl_engine_sim::{SimConfig, serve};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config =
        SimConfig::parse_from(std::env::args_os().map(|a| a.to_string_lossy().into_owned()));
    // vLLM's argparse refuses a flag it does not have, before anything starts: status 2, its
    // usage and this line last on stderr.
    if let Some(refused) = config.vllm_invalid_choice() {
        eprintln!("usage: vllm serve [model_tag] [options]");
        eprintln!("vllm serve: error: {refused}");
        std::process::exit(2);
    }
    let unrecognized = config.vllm_unrecognized();
    if !unrecognized.is_empty() {
        eprintln!("usage: vllm serve [model_tag] [options]");
        eprintln!(
            "vllm: error: unrecognized arguments: {}",
            unrecognized.join(" ")
        );
        std::process::exit(2);
    }
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();
    let listener = tokio::net::TcpListener::bind((config.host.as_str(), config.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", config.host, config.port))?;
    let addr = listener.local_addr()?;
    let mut stdout = std::io::stdout();
    writeln!(stdout, "engine-sim listening on {addr}")?;
    stdout.flush()?;
    // SIGTERM ends the simulator at once, as it ends the engines' servers. It must be handled:
    // in an engine Pod the simulator is the container's PID 1, for which an unhandled SIGTERM is
    // ignored, so every stop of an engine Pod waited out its whole grace period (30 s) before
    // the kubelet's SIGKILL (found on the local cluster).
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("cannot watch SIGTERM")?;
    tokio::select! {
        served = serve(listener, config) => served,
        _ = terminate.recv() => {
            tracing::info!("SIGTERM: exiting");
            Ok(())
        }
    }
}
