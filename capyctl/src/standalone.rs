//! `capyctl start standalone`: a whole CapyCTL in this process until SIGINT or SIGTERM; SIGHUP
//! reads the document again: its tenants (`server.inference_auth`, key files included) replace
//! the inference listener's, and its deployments are deployed again ([`reload`]).

use std::path::{Path, PathBuf};

use capyctl_node_agent::inventory::default_probe;
use capyctl_server::standalone::{NodeAgentLink, Standalone, StandaloneError};
use capyctl_spec::documents;
use capyctl_spec::documents::{KeyPath, Seg};
use capyctl_spec::overrides::Overrides;

/// Loads the document (or the defaults with the overrides alone), starts, prints where it
/// listens, runs until a signal, then shuts down cleanly (engines stopped).
pub async fn run(
    file: Option<PathBuf>,
    set: Vec<String>,
    data_dir: PathBuf,
    node_agents: Vec<String>,
) -> Result<(), String> {
    let overrides =
        Overrides::from_args_and_env(set.clone(), std::env::vars()).map_err(|e| e.to_string())?;
    let config = match &file {
        Some(path) => documents::load_standalone_file(path, &overrides),
        None => documents::standalone_from_overrides(&overrides),
    }
    .map_err(|e| e.to_string())?;
    let node_agents = if node_agents.is_empty() {
        Vec::new()
    } else {
        let token = capyctl_node_agent::cli::agent_token()?;
        node_agents
            .into_iter()
            .map(|url| NodeAgentLink {
                url,
                token: token.clone(),
            })
            .collect()
    };
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
        .unwrap_or_else(|| capyctl_server::management::token_path(&data_dir));
    let scheme = if config.server.listen.tls.is_some() {
        "https"
    } else {
        "http"
    };
    // Installed first: a signal while it starts stops it at once, never by the default action
    // (SIGTERM and SIGINT end it, SIGHUP reads the document again once it runs).
    let signal = capyctl_node_agent::cli::shutdown_signal();
    tokio::pin!(signal);
    let mut hangup = Hangup::install();
    // What a reload compares (not the deployments: a second copy of a large document), and
    // where each deployment's size is declared, for a refusal's line.
    // (Not the tenants either: a reload replaces them, and their keys are kept once, in the
    // listener's table, as digests.)
    let settings = capyctl_spec::settings::StandaloneConfig {
        server: capyctl_spec::settings::ServerConfig {
            inference_auth: None,
            ..config.server.clone()
        },
        host: config.host.clone(),
        deployments: Vec::new(),
    };
    let declared: Vec<(String, bool)> = config
        .deployments
        .iter()
        .map(|d| {
            let sized = d.resources.as_ref().is_some_and(|r| r.gpu_memory.is_some());
            (d.name.clone(), sized)
        })
        .collect();
    let standalone = tokio::select! {
        started = Standalone::listen_with(config, data_dir.clone(), default_probe(), &node_agents) => {
            started.map_err(|e| refusal(e, &declared, file.as_deref()))?
        }
        () = &mut signal => {
            // Nothing is deployed or started yet; engines a previous run left are adopted by
            // the next start, as after a kill.
            tracing::info!("signal received while starting: exiting");
            return Ok(());
        }
    };
    drop(declared);
    // Listening, not ready (`/readyz` 503) until the document's deployments exist.
    tokio::select! {
        () = standalone.deploy_checked() => {}
        () = &mut signal => {
            tracing::info!("signal received while deploying the document: stopping");
            standalone.shutdown().await;
            return Ok(());
        }
    }
    // Every deployment, the document's and those deployed before (kept in the data directory),
    // by name: the lifecycle keeps them by ID, and IDs made in the same millisecond are in no
    // particular order.
    let mut names: Vec<String> = standalone
        .server()
        .models()
        .into_iter()
        .map(|m| m.id)
        .collect();
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
    loop {
        tokio::select! {
            () = &mut signal => break,
            () = hangup.next() => {
                // SIGTERM still ends it while the document is deployed again.
                tokio::select! {
                    () = reload(&standalone, &settings, file.as_deref(), &set) => {}
                    () = &mut signal => break,
                }
            }
        }
    }
    tracing::info!("signal received: stopping engines and listeners");
    standalone.shutdown().await;
    Ok(())
}

/// SIGHUP, which operators send for a reload (and a closing terminal sends): never the default
/// action, which would end CapyCTL and leave its engines running.
struct Hangup(Option<tokio::signal::unix::Signal>);

impl Hangup {
    fn install() -> Hangup {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::hangup()) {
            Ok(s) => Hangup(Some(s)),
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch SIGHUP; it would end CapyCTL");
                Hangup(None)
            }
        }
    }

    /// The next SIGHUP (never, when it cannot be watched).
    async fn next(&mut self) {
        match &mut self.0 {
            Some(s) => {
                s.recv().await;
            }
            None => std::future::pending().await,
        }
    }
}

/// What a refused start says: a refused deployment of the document names the file and the line
/// of its GPU memory (or of the deployment), as the document's other errors do
/// (`standalone.yaml:12: deployments[1].resources.gpu_memory: deployment big does not fit on
/// any GPU: ...`); anything else as it is. `declared`: each deployment's name, in the
/// document's order, and whether it declares `resources.gpu_memory`.
fn refusal(e: StandaloneError, declared: &[(String, bool)], file: Option<&Path>) -> String {
    let StandaloneError::Deploy { name, source } = &e else {
        return e.to_string();
    };
    let Some(i) = declared.iter().position(|(n, _)| n == name) else {
        return e.to_string();
    };
    let mut path = KeyPath(vec![Seg::Key("deployments".into()), Seg::Index(i)]);
    if declared[i].1 {
        path.0.push(Seg::Key("resources".into()));
        path.0.push(Seg::Key("gpu_memory".into()));
    }
    let at = path.display().unwrap_or_default();
    let Some(file) = file else {
        return format!("{at}: {}", source.message());
    };
    let line = std::fs::read_to_string(file)
        .ok()
        .and_then(|text| documents::line_of(&text, &path));
    match line {
        Some(line) => format!("{}:{line}: {at}: {}", file.display(), source.message()),
        None => format!("{}: {at}: {}", file.display(), source.message()),
    }
}

/// On SIGHUP: reads the document again (with the same `--set` and `CAPYCTL_SET__…`), replaces
/// the inference listener's tenants with its `server.inference_auth` (its key files read
/// again; absent: no keys), and deploys its deployments: new ones are added, changed ones get
/// a new revision, the same ones change nothing. Deployments no longer in the document stay
/// (delete them with `capyctl delete`), and other changed `server:` or `host:` settings wait
/// for the next start (logged). A document that does not load (a key file that cannot be read,
/// a repeated key...) changes nothing: the tenants stay as they were, and the log says what is
/// wrong.
async fn reload(
    standalone: &Standalone,
    running: &capyctl_spec::settings::StandaloneConfig,
    file: Option<&Path>,
    set: &[String],
) {
    let Some(path) = file else {
        tracing::warn!("SIGHUP: started without --file, there is no document to read again");
        return;
    };
    let loaded = Overrides::from_args_and_env(set.to_vec(), std::env::vars())
        .map_err(|e| e.to_string())
        .and_then(|o| documents::load_standalone_file(path, &o).map_err(|e| e.to_string()));
    let mut config = match loaded {
        Ok(config) => config,
        Err(e) => {
            tracing::error!("SIGHUP: {e}; nothing changed");
            return;
        }
    };
    let tenants = config.server.inference_auth.take();
    match standalone.replace_tenants(tenants.as_deref()) {
        Ok(()) => tracing::info!(
            file = %path.display(),
            tenants = tenants.as_ref().map_or(0, Vec::len),
            "SIGHUP: the inference listener's tenants replaced"
        ),
        Err(e) => {
            tracing::error!("SIGHUP: server.inference_auth: {e}; the tenants stay as they were")
        }
    }
    drop(tenants);
    if config.server != running.server || config.host != running.host {
        tracing::warn!(
            file = %path.display(),
            "SIGHUP: the server: and host: settings changed; they take effect at the next start"
        );
    }
    let count = config.deployments.len();
    match standalone.deploy_document(config.deployments).await {
        Ok(()) => {
            tracing::info!(file = %path.display(), deployments = count, "SIGHUP: document deployed again")
        }
        Err(e) => tracing::error!("SIGHUP: {e}"),
    }
}
