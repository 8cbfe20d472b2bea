//! `capyctl start standalone`: a whole CapyCTL in this process until SIGINT or SIGTERM.

use std::path::PathBuf;

use capyctl_crds::documents;
use capyctl_crds::overrides::Overrides;
use capyctl_operator::standalone::Standalone;

/// Loads the document (or the defaults with the overrides alone), starts, prints where it
/// listens, runs until a signal, then shuts down cleanly (engines stopped).
pub async fn run(file: Option<PathBuf>, set: Vec<String>, data_dir: PathBuf) -> Result<(), String> {
    let overrides =
        Overrides::from_args_and_env(set, std::env::vars()).map_err(|e| e.to_string())?;
    let config = match &file {
        Some(path) => documents::load_standalone_file(path, &overrides),
        None => documents::standalone_from_overrides(&overrides),
    }
    .map_err(|e| e.to_string())?;
    std::fs::create_dir_all(&data_dir).map_err(|e| {
        format!(
            "cannot create the data directory {}: {e}",
            data_dir.display()
        )
    })?;
    let token_file = config
        .server
        .admin_token_file
        .clone()
        .unwrap_or_else(|| capyctl_operator::management::token_path(&data_dir));
    let scheme = if config.server.listen.tls.is_some() {
        "https"
    } else {
        "http"
    };
    // Installed first: a signal while it starts stops it cleanly, never by the default action.
    let signal = capyctl_node_agent::cli::shutdown_signal();
    let standalone = Standalone::start(config, data_dir.clone())
        .await
        .map_err(|e| e.to_string())?;
    let mut names: Vec<String> = standalone
        .server()
        .models()
        .into_iter()
        .map(|m| m.id)
        .collect();
    // By name: the lifecycle keeps them by ID, and IDs made in the same millisecond are in no
    // particular order.
    names.sort();
    println!(
        "capyctl standalone: inference {scheme}://{}  management {scheme}://{}",
        standalone.inference_addr(),
        standalone.management_addr()
    );
    println!(
        "data directory {}; admin token in {}",
        data_dir.display(),
        token_file.display()
    );
    if names.is_empty() {
        println!("no deployments yet: capyctl deploy model --file <document>");
    } else {
        println!("deployments: {}", names.join(", "));
    }
    signal.await;
    tracing::info!("signal received: stopping engines and listeners");
    standalone.shutdown().await;
    Ok(())
}
