//! `capyctl` (also installed as `kubectl-capyctl`): CapyCTL's command line.
//!
//! Every command of DESIGN.md 4.1. `start standalone` runs a whole CapyCTL in this process;
//! `check` validates documents locally; every other command is a client of the management API
//! ([`client`]), printing the product page's tables ([`render`]) or, with `--json`, the API's
//! JSON. A failure prints one line, `capyctl: …`, and exits 1 (2 for a command line that does
//! not parse).
//!
//! The two binaries (`capyctl`, `kubectl-capyctl`) are this library's [`main`].

pub mod client;
pub mod cluster;
pub mod render;
pub mod simulate;
pub mod simulate_svg;
pub mod standalone;
pub mod trace;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use capyctl_spec::InstanceState;
use capyctl_spec::api::{
    ActionReceipt, DeployReceipt, DeploymentList, DeploymentView, EngineList, StartRequest,
    SwitchList, SwitchOutcome, SwitchRecord,
};
use capyctl_spec::documents;
use capyctl_spec::overrides::Overrides;
use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};

use client::{Client, ClientError, segment};

/// CapyCTL: park idle models, wake them on demand, switch the GPU under load.
#[derive(Parser)]
#[command(name = "capyctl", version)]
struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    command: Command,
}

/// Options accepted anywhere on the command line.
#[derive(Args)]
struct Global {
    /// The CapyCTL server's management URL [default: http://127.0.0.1:7443; as `kubectl
    /// capyctl`: the release's management Service through the API server].
    #[arg(long, global = true, env = "CAPYCTL_SERVER")]
    server: Option<String>,
    /// As `kubectl capyctl`: the namespace of the Deployment objects, and of the release unless
    /// --release-namespace says another [default: the kubeconfig's].
    #[arg(long, short = 'n', global = true, env = "CAPYCTL_NAMESPACE")]
    namespace: Option<String>,
    /// As `kubectl capyctl`: the namespace of the Helm release [default: --namespace].
    #[arg(long, global = true, env = "CAPYCTL_RELEASE_NAMESPACE")]
    release_namespace: Option<String>,
    /// As `kubectl capyctl`: the Helm release.
    #[arg(
        long,
        global = true,
        env = "CAPYCTL_RELEASE",
        default_value = "capyctl"
    )]
    release: String,
    /// The admin token (default: the standalone data directory's `admin-token` file).
    #[arg(
        long,
        global = true,
        env = "CAPYCTL_ADMIN_TOKEN",
        hide_env_values = true
    )]
    token: Option<String>,
    /// Print the management API's JSON instead of a table.
    #[arg(long, global = true)]
    json: bool,
    /// PEM certificates to verify an `https://` server with (a private CA) instead of the
    /// system's roots.
    #[arg(long, global = true, env = "CAPYCTL_CA_FILE")]
    ca_file: Option<PathBuf>,
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
    /// Start CapyCTL itself (`standalone`, `host`) or a deployment.
    #[command(subcommand)]
    Start(Start),
    /// Stop a deployment: requests get 409 `deployment_stopped` until it is started again.
    #[command(subcommand)]
    Stop(Target),
    /// Park a deployment: its engine stays up and gives back its GPU memory.
    #[command(subcommand)]
    Park(Target),
    /// Delete a deployment: its instances are stopped and it is forgotten.
    #[command(subcommand)]
    Delete(Target),
    /// Measure and prepare a deployment without serving it.
    #[command(subcommand)]
    Preinitialize(Target),
    /// Take a host out of service: nothing new is placed on it, and every instance there is
    /// drained (running requests finish) and stopped, explicit ones too.
    #[command(subcommand)]
    Drain(HostTarget),
    /// Put a drained host back in service.
    #[command(subcommand)]
    Uncordon(HostTarget),
    /// Deploy a model from a deployment document (a changed document bumps REVISION).
    #[command(subcommand)]
    Deploy(Deploy),
    /// List deployments: NAME STATE READY REVISION HOSTS.
    #[command(subcommand)]
    List(List),
    /// Show one deployment.
    #[command(subcommand)]
    Status(Target),
    /// The engines of every host: ENGINE VERSION DEEP PARK HOST.
    #[command(subcommand)]
    Engine(Engine),
    /// The inference listener's tenants: TENANT MODELS RATE KEYS ANSWERS TOKENS WAITING
    /// (never a key).
    #[command(subcommand)]
    Tenants(Tenants),
    /// The recent switches, phase by phase (the last 1,000 at least, kept across restarts):
    /// TIME DEPLOYMENT CAUSE WAVE VICTIMS PHASES OUTCOME; `--json` prints the records as JSON
    /// lines.
    Switches(Switches),
    /// Validate a document, with `--set` and `CAPYCTL_SET__…` overrides applied, and print the
    /// effective settings; exits non-zero with one line naming the file, line and key on error.
    Check {
        /// The document's kind.
        kind: Kind,
        /// The document.
        #[arg(long)]
        file: PathBuf,
        /// An override, `a.b=c` (repeatable); wins over `CAPYCTL_SET__A__B=c`.
        #[arg(long = "set")]
        set: Vec<String>,
    },
    /// Replay a request trace through CapyCTL's switching code on a virtual clock and print,
    /// per model, the waits, errors and switches, and the GPU time serving vs switching.
    Simulate {
        /// The trace: one JSON object a line, `{"at_ms": 0, "model": "chat", "duration_ms":
        /// 1200}` (or `"output_tokens": 64` instead of `duration_ms`).
        #[arg(long)]
        trace: PathBuf,
        /// The standalone document (deployments, GPUs, settings); without it, each model of
        /// the trace on one 80GiB GPU.
        #[arg(long)]
        file: Option<PathBuf>,
        /// An override, `a.b=c` (repeatable): a document key as for `start standalone`, or a
        /// `simulate.…` key (engine times and token rates; see the README).
        #[arg(long = "set")]
        set: Vec<String>,
        /// Run once per value and print one row each: `key=v1,v2,...`.
        #[arg(long)]
        compare: Option<String>,
        /// Draw the simulated timeline into this SVG file.
        #[arg(long)]
        svg: Option<PathBuf>,
        /// Begin with every deployment stopped (default: each started once, in document
        /// order, as on a server that has run a while).
        #[arg(long)]
        cold: bool,
        /// Take each model's park, wake, wake check, start and stop times from a running
        /// server's switch records (the median of each phase; `--server` and `--token` as for
        /// the other commands); `--set` still wins.
        #[arg(long)]
        measured: bool,
    },
    /// Print a shell completion script (e.g. `capyctl completion bash > /etc/bash_completion.d/capyctl`).
    Completion {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

#[derive(Subcommand)]
enum Start {
    /// Run a whole CapyCTL (server and one host) in this process until SIGINT or SIGTERM.
    Standalone {
        /// The standalone document; the product page's defaults without it.
        #[arg(long)]
        file: Option<PathBuf>,
        /// An override, `a.b=c` (repeatable); wins over `CAPYCTL_SET__A__B=c`.
        #[arg(long = "set")]
        set: Vec<String>,
        /// Where the state (`state.redb`), the admin token and engine logs live (default
        /// `$XDG_STATE_HOME/capyctl`, or `~/.local/state/capyctl`).
        #[arg(long, env = "CAPYCTL_DATA_DIR")]
        data_dir: Option<PathBuf>,
        /// Also drive the GPUs of the node agent at this URL (`http://host:port`, as `capyctl
        /// start host --listen` serves; repeatable): one more host each, under its own host
        /// document's `host.id`. The agent token is `CAPYCTL_AGENT_TOKEN_FILE` or
        /// `CAPYCTL_AGENT_TOKEN`, as the agents have it.
        #[arg(long = "node-agent", value_name = "URL")]
        node_agents: Vec<String>,
    },
    /// Run a host agent for a CapyCTL server: the program `capyctl-node-agent`, with its flags
    /// (engines as child processes unless `--engine-runtime pod`; the agent token from
    /// `CAPYCTL_AGENT_TOKEN_FILE` or `CAPYCTL_AGENT_TOKEN`).
    Host(capyctl_node_agent::cli::Args),
    /// Start a deployment.
    Deployment {
        /// Its name or ID.
        name: String,
        /// Park (or stop) idle models to make room; without it the start waits for memory.
        #[arg(long)]
        evict: bool,
        /// Wait for the measurement, then for the model to be ready; exit non-zero if it fails.
        #[arg(long)]
        wait: bool,
    },
}

#[derive(Subcommand)]
enum Target {
    /// A deployment, by name or ID.
    Deployment {
        /// Its name or ID.
        name: String,
    },
}

#[derive(Subcommand)]
enum HostTarget {
    /// A host, by ID (`host.id`; the node's name on Kubernetes).
    Host {
        /// Its ID.
        id: String,
    },
}

#[derive(Subcommand)]
enum Deploy {
    /// A model, from a deployment document.
    Model {
        /// The deployment document.
        #[arg(long)]
        file: PathBuf,
    },
}

#[derive(Subcommand)]
enum List {
    /// Every deployment.
    Deployments,
}

/// `capyctl switches`.
#[derive(Args)]
struct Switches {
    /// Only the switches of this deployment (its name or ID).
    #[arg(long)]
    deployment: Option<String>,
    /// Keep polling (every second) and print each new switch once it has ended.
    #[arg(long)]
    follow: bool,
    /// Instead of the switches, write the server's recent requests as a trace for `capyctl
    /// simulate` to this file (`-`: standard output).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["deployment", "follow"])]
    export_trace: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Engine {
    /// Every engine of every host.
    List,
}

#[derive(Subcommand)]
enum Tenants {
    /// Every tenant, with its models, rates and use now.
    List,
}

/// The whole program: parses the command line, runs it, prints the one-line error.
pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(&e),
    };
    let result = match cli.command {
        Command::Check { kind, file, set } => check(kind, &file, set),
        Command::Completion { shell } => {
            let mut command = Cli::command();
            let name = invoked_as();
            clap_complete::generate(shell, &mut command, name, &mut std::io::stdout());
            Ok(())
        }
        Command::Start(Start::Standalone {
            file,
            set,
            data_dir,
            node_agents,
        }) => {
            init_logging();
            runtime().and_then(|rt| {
                rt.block_on(standalone::run(
                    file,
                    set,
                    data_dir.unwrap_or_else(client::default_data_dir),
                    node_agents,
                ))
            })
        }
        Command::Simulate {
            trace,
            file,
            mut set,
            compare,
            svg,
            cold,
            measured,
        } => {
            let json = cli.global.json;
            let measured = if measured {
                runtime().and_then(|rt| rt.block_on(measured_sets(cli.global)))
            } else {
                Ok(Vec::new())
            };
            measured.and_then(|mut keys| {
                // The measured times first: a `--set` of the same key comes later and wins.
                keys.append(&mut set);
                simulate::run(simulate::SimulateArgs {
                    trace,
                    file,
                    set: keys,
                    compare,
                    svg,
                    json,
                    cold,
                })
            })
        }
        Command::Start(Start::Host(args)) => {
            init_logging();
            runtime().and_then(|rt| {
                rt.block_on(capyctl_node_agent::cli::run(args))
                    .map_err(|e| e.to_string())
            })
        }
        command => runtime().and_then(|rt| rt.block_on(remote(cli.global, command))),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(line) => {
            eprintln!("capyctl: {line}");
            ExitCode::FAILURE
        }
    }
}

/// `--help` and `--version` print as usual (exit 0); a command line that does not parse gets
/// one line, `capyctl: <what clap says>; see `capyctl --help``, and exit 2.
fn usage_error(e: &clap::Error) -> ExitCode {
    if !e.use_stderr() {
        let _ = e.print();
        return ExitCode::SUCCESS;
    }
    // clap's message up to its blank line or usage, on one line.
    let text = e.render().to_string();
    let what = text
        .lines()
        .map(str::trim)
        .skip_while(|l| l.is_empty())
        .take_while(|l| !l.is_empty() && !l.starts_with("Usage:"))
        .collect::<Vec<_>>()
        .join(" ");
    let what = what.strip_prefix("error: ").unwrap_or(&what);
    let what = if what.is_empty() {
        "the command line does not parse"
    } else {
        what
    };
    let name = invoked_as();
    let name = name
        .strip_prefix("kubectl-")
        .map_or(name.clone(), |n| format!("kubectl {n}"));
    eprintln!("capyctl: {what}; see `{name} --help`");
    ExitCode::from(2)
}

/// `capyctl` or `kubectl-capyctl`, as invoked.
fn invoked_as() -> String {
    std::env::args_os()
        .next()
        .map(PathBuf::from)
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "capyctl".to_string())
}

fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))
}

/// Logs to stderr, `RUST_LOG` or `info`.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

fn check(kind: Kind, file: &std::path::Path, set: Vec<String>) -> Result<(), String> {
    let o = Overrides::from_args_and_env(set, std::env::vars()).map_err(|e| e.to_string())?;
    let text = match kind {
        Kind::Deployment => documents::load_deployment_file(file).map(|d| format!("{d:#?}")),
        Kind::Standalone => documents::load_standalone_file(file, &o).map(|c| format!("{c:#?}")),
        Kind::Host => documents::load_host_file(file, &o).map(|c| format!("{c:#?}")),
        Kind::Server => documents::load_server_file(file, &o).map(|c| format!("{c:#?}")),
    }
    .map_err(|e| e.to_string())?;
    println!("{text}");
    Ok(())
}

/// A body as the management API's pretty JSON.
fn pretty(body: &impl serde::Serialize) -> String {
    serde_json::to_string_pretty(body).unwrap_or_default()
}

/// The longest a command other than `start --wait` waits for the server.
const CALL_TIMEOUT: Duration = Duration::from_secs(120);

/// Every command that talks to the management API.
/// `capyctl simulate --measured`: every switch record of the server, as engine-time keys.
async fn measured_sets(global: Global) -> Result<Vec<String>, String> {
    let client = connect(&global).await?;
    let mut records = Vec::new();
    let mut after = 0;
    loop {
        let page = switches_page(&client, None, after)
            .await
            .map_err(|e| e.to_string())?;
        let full = page.switches.len() >= capyctl_spec::api::SWITCHES_PAGE_MAX;
        after = page.next;
        records.extend(page.switches);
        if !full {
            break;
        }
    }
    Ok(simulate::measured_sets(&records))
}

/// The management API's client: the kubeconfig's service proxy under kubectl, else `--server`
/// (or the default) with the token resolved.
async fn connect(global: &Global) -> Result<Client, String> {
    Ok(match global.server.clone() {
        None if invoked_as().starts_with("kubectl-") => {
            cluster::connect(
                global.namespace.clone(),
                global.release_namespace.clone(),
                &global.release,
                global.token.clone(),
            )
            .await?
        }
        server => {
            let token = client::resolve_token(global.token.clone(), &client::default_data_dir())
                .map_err(|e| e.to_string())?;
            let server = server.unwrap_or_else(|| client::DEFAULT_SERVER.to_string());
            Client::with_ca(&server, token, global.ca_file.as_deref()).map_err(|e| e.to_string())?
        }
    })
}

async fn remote(global: Global, command: Command) -> Result<(), String> {
    let client = connect(&global).await?;
    let json = global.json;
    let call = async {
        match command {
            Command::Start(Start::Deployment { name, evict, wait }) => {
                start(&client, &name, evict, wait, json).await
            }
            Command::Stop(Target::Deployment { name }) => {
                action(&client, "stop", &name, json).await
            }
            Command::Park(Target::Deployment { name }) => {
                action(&client, "park", &name, json).await
            }
            Command::Preinitialize(Target::Deployment { name }) => {
                action(&client, "preinitialize", &name, json).await
            }
            Command::Drain(HostTarget::Host { id }) => {
                host_action(&client, "drain", &id, json).await
            }
            Command::Uncordon(HostTarget::Host { id }) => {
                host_action(&client, "uncordon", &id, json).await
            }
            Command::Delete(Target::Deployment { name }) if client.cluster().is_some() => {
                match cluster::delete_object(&client, &name, CALL_TIMEOUT).await? {
                    cluster::Deleted::Served(d) if json => println!("{}", pretty(&d)),
                    cluster::Deleted::Served(d) => {
                        println!("deleted deployment {} ({})", d.name, d.id)
                    }
                    cluster::Deleted::NotServed { object, why } if json => println!(
                        "{}",
                        pretty(
                            &serde_json::json!({"deleted_object": object, "served": false, "why": why})
                        )
                    ),
                    cluster::Deleted::NotServed { object, why } => {
                        println!(
                            "deleted the Deployment object {object}, which was not served: {why}"
                        )
                    }
                }
                Ok(())
            }
            Command::Delete(Target::Deployment { name }) => {
                let answer = client
                    .delete(&format!("/deployments/{}", segment(&name)))
                    .await?;
                if json {
                    println!("{}", answer.pretty());
                } else {
                    let d: DeploymentView = answer.json(client.server())?;
                    println!("deleted deployment {} ({})", d.name, d.id);
                }
                Ok(())
            }
            Command::Deploy(Deploy::Model { file }) => deploy(&client, &file, json).await,
            Command::List(List::Deployments) => {
                let answer = client.get("/deployments").await?;
                if json {
                    println!("{}", answer.pretty());
                } else {
                    let list: DeploymentList = answer.json(client.server())?;
                    print!("{}", render::deployments(&list.deployments));
                }
                // Under kubectl: what the operator does not take from the user's namespace.
                for note in cluster::list_notes(&client).await {
                    eprintln!("{note}");
                }
                Ok(())
            }
            Command::Status(Target::Deployment { name }) => {
                let answer = client
                    .get(&format!("/deployments/{}", segment(&name)))
                    .await?;
                if json {
                    println!("{}", answer.pretty());
                } else {
                    let d: DeploymentView = answer.json(client.server())?;
                    print!("{}", render::status(&d));
                }
                Ok(())
            }
            Command::Engine(Engine::List) => {
                let answer = client.get("/engines").await?;
                if json {
                    println!("{}", answer.pretty());
                } else {
                    let list: EngineList = answer.json(client.server())?;
                    print!("{}", render::engines(&list.engines));
                }
                Ok(())
            }
            Command::Tenants(Tenants::List) => {
                let answer = client.get("/tenants").await?;
                if json {
                    println!("{}", answer.pretty());
                } else {
                    let list: capyctl_server::management::TenantList =
                        answer.json(client.server())?;
                    print!("{}", render::tenants(&list.tenants));
                }
                Ok(())
            }
            Command::Switches(Switches {
                export_trace: Some(file),
                ..
            }) => trace::export(&client, &file)
                .await
                .map_err(CommandError::Failed),
            Command::Switches(args) => switches(&client, &args, json).await,
            Command::Check { .. }
            | Command::Completion { .. }
            | Command::Start(_)
            | Command::Simulate { .. } => {
                unreachable!("handled before the client")
            }
        }
    };
    call.await.map_err(|e: CommandError| e.to_string())
}

/// One page of `GET /switches` after `after`.
async fn switches_page(
    client: &Client,
    deployment: Option<&str>,
    after: u64,
) -> Result<SwitchList, CommandError> {
    let mut path = format!("/switches?after={after}");
    if let Some(d) = deployment {
        path.push_str(&format!("&deployment={}", segment(d)));
    }
    Ok(client.get(&path).await?.json(client.server())?)
}

/// `capyctl switches [--deployment NAME] [--follow]`: every record there is (page after page),
/// then, with `--follow`, each new one once it has ended. A record still in progress is printed
/// as such, except by `--follow`, which waits for its end: it polls from just before the
/// oldest record still in progress, so that none is missed or printed twice.
async fn switches(client: &Client, args: &Switches, json: bool) -> Result<(), CommandError> {
    use std::collections::BTreeSet;
    use std::io::Write;
    let deployment = args.deployment.as_deref();
    let mut after = 0;
    let mut printed: BTreeSet<u64> = BTreeSet::new();
    let mut header = true;
    loop {
        let mut batch = Vec::new();
        let mut next = after;
        // Every page there is now.
        loop {
            let page = switches_page(client, deployment, next).await?;
            let full = page.switches.len() >= capyctl_spec::api::SWITCHES_PAGE_MAX;
            next = page.next;
            batch.extend(page.switches);
            if !full {
                break;
            }
        }
        let running = |r: &SwitchRecord| r.outcome == SwitchOutcome::InProgress;
        let show: Vec<SwitchRecord> = batch
            .iter()
            .filter(|r| !printed.contains(&r.seq))
            .filter(|r| !args.follow || !running(r))
            .cloned()
            .collect();
        if json {
            let mut out = std::io::stdout().lock();
            for r in &show {
                let line = serde_json::to_string(r).unwrap_or_default();
                let _ = writeln!(out, "{line}");
            }
            let _ = out.flush();
        } else if !show.is_empty() || (header && !args.follow) {
            print!("{}", render::switches(&show, header));
            let _ = std::io::stdout().flush();
            header = false;
        }
        if !args.follow {
            return Ok(());
        }
        printed.extend(show.iter().map(|r| r.seq));
        // From just before the oldest one still running (it is printed when it ends).
        after = batch
            .iter()
            .find(|r| running(r))
            .map_or(next, |r| r.seq.saturating_sub(1));
        printed.retain(|seq| *seq > after);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// A command's failure: the client's, or what the answer said.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CommandError {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("{0}")]
    Failed(String),
}

async fn deploy(client: &Client, file: &std::path::Path, json: bool) -> Result<(), CommandError> {
    // Checked here first so that the error names the file and line; the server checks again.
    let doc =
        documents::load_deployment_file(file).map_err(|e| CommandError::Failed(e.to_string()))?;
    if client.cluster().is_some() {
        // Under kubectl: the Deployment object (the operator refuses deploys of its own).
        let receipt = cluster::deploy_object(client, &doc, CALL_TIMEOUT).await?;
        if json {
            println!("{}", pretty(&receipt));
        } else {
            print!("{}", render::deployed(&receipt));
        }
        return Ok(());
    }
    let text = std::fs::read_to_string(file)
        .map_err(|e| CommandError::Failed(format!("cannot read {}: {e}", file.display())))?;
    let answer = client.post_yaml("/deployments", text).await?;
    if json {
        println!("{}", answer.pretty());
    } else {
        let receipt: DeployReceipt = answer.json(client.server())?;
        print!("{}", render::deployed(&receipt));
    }
    Ok(())
}

async fn action(client: &Client, verb: &str, name: &str, json: bool) -> Result<(), CommandError> {
    let path = format!("/deployments/{}/{verb}", segment(name));
    post_command(client, &path, verb, json, render::receipt).await
}

async fn host_action(
    client: &Client,
    verb: &str,
    id: &str,
    json: bool,
) -> Result<(), CommandError> {
    let path = format!("/hosts/{}/{verb}", segment(id));
    post_command(client, &path, verb, json, render::host_receipt).await
}

/// A command without a body (`verb` on `path`): prints its receipt `R`, as JSON or by `text`.
async fn post_command<R: serde::de::DeserializeOwned>(
    client: &Client,
    path: &str,
    verb: &str,
    json: bool,
    text: fn(&R) -> String,
) -> Result<(), CommandError> {
    let answer = tokio::time::timeout(CALL_TIMEOUT, client.post_json(path, &serde_json::json!({})))
        .await
        .map_err(|_| timed_out(client, verb))??;
    if json {
        println!("{}", answer.pretty());
    } else {
        let receipt: R = answer.json(client.server())?;
        print!("{}", text(&receipt));
    }
    Ok(())
}

fn timed_out(client: &Client, what: &str) -> CommandError {
    CommandError::Failed(format!(
        "the server at {} did not answer `{what}` within {} s",
        client.server(),
        CALL_TIMEOUT.as_secs()
    ))
}

async fn start(
    client: &Client,
    name: &str,
    evict: bool,
    wait: bool,
    json: bool,
) -> Result<(), CommandError> {
    let path = format!("/deployments/{}/start", segment(name));
    let body = serde_json::to_value(StartRequest { evict, wait })
        .map_err(|e| CommandError::Failed(e.to_string()))?;
    let call = client.post_json(&path, &body);
    let answer = if wait {
        // No bound of our own: the server's wake window and start timeouts bound it.
        if std::io::stderr().is_terminal() && !json {
            with_progress(client, name, call).await?
        } else {
            call.await?
        }
    } else {
        tokio::time::timeout(CALL_TIMEOUT, call)
            .await
            .map_err(|_| timed_out(client, "start"))??
    };
    let receipt: ActionReceipt = answer.json(client.server())?;
    if json {
        println!("{}", answer.pretty());
    } else {
        print!("{}", render::receipt(&receipt));
    }
    if wait && receipt.deployment.state != InstanceState::Ready {
        let d = &receipt.deployment;
        let why = d
            .conditions
            .iter()
            .find(|c| c.kind == "Ready" && c.status != "True")
            .map(|c| format!(": {} {}", c.reason, c.message))
            .unwrap_or_default();
        return Err(CommandError::Failed(format!(
            "deployment {} did not become ready (state {}){why}",
            d.name, d.state
        )));
    }
    Ok(())
}

/// Runs `call` while printing the deployment's state to stderr each time it changes
/// (measurement, then starting, then ready).
async fn with_progress(
    client: &Client,
    name: &str,
    call: impl Future<Output = Result<client::Answer, ClientError>>,
) -> Result<client::Answer, ClientError> {
    let path = format!("/deployments/{}", segment(name));
    let poll = async {
        let mut last: Option<(InstanceState, bool)> = None;
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tick.tick().await;
            let Ok(answer) = client.get(&path).await else {
                continue;
            };
            let Ok(d) = answer.json::<DeploymentView>(client.server()) else {
                continue;
            };
            let now = (d.state, d.measurement.is_some());
            if last != Some(now) {
                let measured = match &d.measurement {
                    Some(m) => format!(
                        "measured (gpu {}, weights {})",
                        capyctl_spec::units::format_bytes(m.gpu_memory),
                        capyctl_spec::units::format_bytes(m.weights_memory)
                    ),
                    None => "awaiting measurement".to_string(),
                };
                eprintln!("{}: {measured}; {}", d.name, d.state);
                last = Some(now);
            }
        }
    };
    tokio::select! {
        answer = call => answer,
        _ = poll => unreachable!("the poll loop never ends"),
    }
}
