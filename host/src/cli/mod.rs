//! The `dexa` command line.

pub mod bench;
pub mod bench_http;
mod bench_long;
pub mod bench_scale;
pub mod bench_store;
pub mod bench_swap;
pub mod bench_turn;
pub mod chat;
pub mod demo;
pub mod new;
pub mod project;
pub mod serve;
pub mod session;
pub mod signals;
pub mod store;
pub mod versions;
pub mod worker;

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::plugin::grant_paths::{check_state_paths, StatePaths};
use crate::plugin::wit::{
    DeferredToolExecution, ToolCallRecord, ToolCallStatus, ToolEffect, ToolPolicy,
};
use crate::plugin::{
    CallEnv, ComponentSettings, DirAccess, Grants, SandboxConfig, SandboxEngine, StepTag,
};

#[derive(Parser, Debug)]
#[command(
    name = "dexa",
    version,
    about = "Durable agent sessions with sandboxed WebAssembly runners and tools"
)]
pub struct Cli {
    /// How log lines are written to stderr: `text` for people, `json` (one
    /// object per line) for a log pipeline. Which lines: `RUST_LOG`
    /// (default `info`).
    #[arg(long, global = true, value_enum, env = "DEXA_LOG_FORMAT", default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

/// The format of log lines (`--log-format`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    /// Lines for people, coloured on a terminal.
    Text,
    /// One JSON object a line (`timestamp`, `level`, `message`, fields).
    Json,
}

impl LogFormat {
    /// Installs the process's log subscriber: lines to stderr, filtered by
    /// `RUST_LOG` (default `info`).
    pub fn install(self) {
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
        let builder = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr);
        match self {
            LogFormat::Text => builder
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .init(),
            LogFormat::Json => {
                builder
                    .json()
                    .flatten_event(true)
                    .with_current_span(true)
                    .init();
                // A panic (a Step handler's, say) is a log line too, not
                // the default hook's plain text.
                std::panic::set_hook(Box::new(|info| {
                    tracing::error!(panic = %info, "panicked");
                }));
            }
        }
    }
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Work with a single component (inspect, call) and the component
    /// catalog (add, list, gc).
    #[command(subcommand)]
    Component(ComponentCommand),
    /// An agent's component versions: the activation log, activate, rollback.
    #[command(subcommand)]
    Agent(versions::AgentCommand),
    /// Run one session of the offline example agent (scripted runner, two
    /// tool components) on the embedded SQLite store.
    Demo(demo::DemoArgs),
    /// Serve the HTTP API (and run a worker) for the agents in dexa.toml.
    Serve(serve::ServeArgs),
    /// Talk to an agent in the terminal; reattaches after a restart.
    Chat(chat::ChatArgs),
    /// Session RPCs for scripts: list, start, show, send, approve, reject, stop, history.
    Session(session::SessionArgs),
    /// Run the Steps of every agent in dexa.toml until stopped.
    Worker(worker::WorkerArgs),
    /// Make a component project: a tool or a runner in Rust, Python or
    /// JavaScript, with its WIT, build script and one test, ready to build.
    New(new::NewArgs),
    /// Build the component project in a directory (its build.sh), then load
    /// the component as a worker would.
    Build(project::BuildArgs),
    /// Check dexa.toml as a worker's start would (components, grants,
    /// variables, models) without starting one; exits 1 with file:line
    /// errors. For CI pipelines.
    Check(CheckArgs),
    /// The store itself: migrate its schema, copy SQLite into PostgreSQL.
    #[command(subcommand)]
    Store(store::StoreCommand),
    /// Measure the engine (build with --release for real numbers).
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Durable no-op Steps on each --store (SQLite by default, PostgreSQL
    /// too): throughput, claim-to-commit latency, wake latency.
    Engine(bench::EngineBenchArgs),
    /// One agent turn through AgentSessionFlow with sandboxed guests:
    /// sequential latency, throughput with concurrent clients, peak RSS.
    Turn(bench_turn::TurnBenchArgs),
    /// The benchmark turn under 16 clients and two workers, with a runner
    /// activation every second against a run with none: turns/s, p50/p99,
    /// failed turns, and how fast each worker sees an activation.
    Swap(bench_swap::SwapBenchArgs),
    /// Waiting-bound throughput with 1, 2 and 4 worker processes on one
    /// store: how it grows with workers, and the per-Step overhead.
    Scale(bench_scale::ScaleBenchArgs),
    /// A worker process of `dexa bench scale`.
    #[command(hide = true)]
    ScaleWorker(bench_scale::ScaleWorkerArgs),
}

#[derive(Subcommand, Debug)]
pub enum ComponentCommand {
    /// Load a component, check that it implements its world, and describe it.
    Inspect(InspectArgs),
    /// Call one tool of a tool component in a fresh sandbox.
    Call(CallArgs),
    /// Verify a component and add it to the catalog (by its SHA-256).
    Add(versions::AddArgs),
    /// The catalog's components.
    List(versions::CatalogArgs),
    /// Remove the versions that are neither active nor in use.
    Gc(versions::GcArgs),
}

#[derive(ValueEnum, Clone, Copy, Debug)]
pub enum WorldArg {
    Runner,
    Tool,
}

#[derive(Args, Debug)]
pub struct EngineArgs {
    /// Where compiled components are cached.
    #[arg(long, default_value = ".dexa/cache/components", env = "DEXA_CACHE_DIR")]
    pub cache_dir: PathBuf,
}

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// The component file (.wasm).
    pub path: PathBuf,
    /// The world it should implement.
    #[arg(long, value_enum, default_value = "tool")]
    pub world: WorldArg,
    #[command(flatten)]
    pub engine: EngineArgs,
}

#[derive(Args, Debug)]
pub struct CallArgs {
    /// The tool component file (.wasm).
    pub path: PathBuf,
    /// The tool to call.
    pub tool: String,
    /// The arguments, as JSON text.
    #[arg(long, default_value = "{}")]
    pub args: String,
    /// Grant a directory: HOST:GUEST (read-only), or HOST:GUEST:rw to let the
    /// tool write there. Never the `.dexa` directory or one holding it.
    #[arg(long = "dir")]
    pub dirs: Vec<String>,
    /// A config value: KEY=VALUE.
    #[arg(long = "config")]
    pub config: Vec<String>,
    /// Stop the call after this many seconds.
    #[arg(long, default_value_t = 60)]
    pub timeout_secs: u64,
    #[command(flatten)]
    pub engine: EngineArgs,
}

fn engine(args: &EngineArgs) -> anyhow::Result<SandboxEngine> {
    SandboxEngine::new(SandboxConfig {
        cache_dir: Some(args.cache_dir.clone()),
        ..SandboxConfig::default()
    })
}

fn parse_dir(spec: &str) -> anyhow::Result<(PathBuf, String, DirAccess)> {
    let parts: Vec<&str> = spec.split(':').collect();
    match parts.as_slice() {
        // Read-only unless asked, as in dexa.toml.
        [host, guest] | [host, guest, "ro"] => {
            Ok((host.into(), guest.to_string(), DirAccess::ReadOnly))
        }
        [host, guest, "rw"] => Ok((host.into(), guest.to_string(), DirAccess::ReadWrite)),
        _ => {
            bail!("--dir {spec:?}: expected HOST:GUEST (read-only), HOST:GUEST:ro or HOST:GUEST:rw")
        }
    }
}

#[derive(Args, Debug)]
pub struct CheckArgs {
    /// The config file.
    #[arg(long, short, default_value = crate::config::DEFAULT_CONFIG_FILE, env = "DEXA_CONFIG")]
    pub config: PathBuf,
    /// Also ask each OpenAI-compatible model's server for its model list
    /// (with its key and headers).
    #[arg(long)]
    pub online: bool,
}

async fn check(args: CheckArgs) -> anyhow::Result<()> {
    let config = crate::config::DexaConfig::load(&args.config)?;
    let problems = crate::config::check::check(&config, args.online).await;
    crate::config::check::report(&problems, &args.config);
    if problems.is_empty() {
        Ok(())
    } else {
        anyhow::bail!(
            "{} problem(s) in {}; a worker would refuse to start",
            problems.len(),
            args.config.display()
        )
    }
}

fn component_name(path: &std::path::Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "component".to_string())
}

pub async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Demo(args) => demo::run(args).await,
        Command::Worker(args) => worker::run(args).await,
        Command::Check(args) => check(args).await,
        Command::New(args) => new::run(args),
        Command::Build(args) => project::build(args).await,
        Command::Serve(args) => serve::run(args).await,
        Command::Chat(args) => chat::run(args).await,
        Command::Session(args) => session::run(args).await,
        Command::Component(ComponentCommand::Inspect(args)) => inspect(args).await,
        Command::Component(ComponentCommand::Call(args)) => call(args).await,
        Command::Component(ComponentCommand::Add(args)) => versions::add(args).await,
        Command::Component(ComponentCommand::List(args)) => versions::list(args).await,
        Command::Component(ComponentCommand::Gc(args)) => versions::collect(args).await,
        Command::Agent(versions::AgentCommand::Versions(args)) => versions::versions(args).await,
        Command::Agent(versions::AgentCommand::Activate(args)) => {
            versions::activate_command(args).await
        }
        Command::Agent(versions::AgentCommand::Rollback(args)) => versions::rollback(args).await,
        Command::Store(command) => store::run(command).await,
        Command::Bench(BenchCommand::Engine(args)) => bench::run(args).await,
        Command::Bench(BenchCommand::Turn(args)) => bench_turn::run(args).await,
        Command::Bench(BenchCommand::Swap(args)) => bench_swap::run(args).await,
        Command::Bench(BenchCommand::Scale(args)) => bench_scale::run(args).await,
        Command::Bench(BenchCommand::ScaleWorker(args)) => bench_scale::worker(args).await,
    }
}

async fn inspect(args: InspectArgs) -> anyhow::Result<()> {
    let report = describe(&args.engine, args.world, &args.path).await?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

/// Loads the component at `path` for `world`, as a worker would, and
/// describes it (its tools, for a tool component).
async fn describe(
    engine_args: &EngineArgs,
    world: WorldArg,
    path: &std::path::Path,
) -> anyhow::Result<serde_json::Value> {
    let engine = engine(engine_args)?;
    let settings = ComponentSettings::named(component_name(path));
    let report = match world {
        WorldArg::Runner => {
            let runner = engine.load_runner_file(path, settings)?;
            let info = runner.info();
            serde_json::json!({
                "name": info.name, "world": info.world.name(), "sha256": info.sha256,
                "cache": format!("{:?}", info.cache).to_lowercase(),
                "extra_exports": info.extra_exports,
            })
        }
        WorldArg::Tool => {
            let tool = engine.load_tool_file(path, settings).await?;
            let info = tool.info();
            let tools: Vec<_> = tool
                .tools()
                .iter()
                .map(|t| {
                    // Checked at load, so it parses; shown as the JSON it is.
                    let schema = serde_json::from_str::<serde_json::Value>(&t.parameters_schema)
                        .unwrap_or_else(|_| serde_json::Value::String(t.parameters_schema.clone()));
                    serde_json::json!({
                        "name": t.name, "description": t.description,
                        "effect": t.effect.map(|e| crate::session::ToolEffect::from(e).as_str()),
                        "parameters_schema": schema,
                    })
                })
                .collect();
            serde_json::json!({
                "name": info.name, "world": info.world.name(), "sha256": info.sha256,
                "cache": format!("{:?}", info.cache).to_lowercase(), "tools": tools,
                "extra_exports": info.extra_exports,
            })
        }
    };
    Ok(report)
}

async fn call(args: CallArgs) -> anyhow::Result<()> {
    let engine = engine(&args.engine)?;
    let mut grants = Grants::none();
    for spec in &args.dirs {
        let (host, guest, access) = parse_dir(spec)?;
        grants = grants.dir(host, guest, access);
    }
    // Never the directory that holds dexa's own state (the store, the API
    // token, compiled native code) or anything inside the cache.
    grants.resolve().map_err(anyhow::Error::msg)?;
    let state = StatePaths {
        state: vec![PathBuf::from(".dexa"), args.engine.cache_dir.clone()],
        code: vec![args.path.clone()],
        cache_dir: Some(args.engine.cache_dir.clone()),
    };
    check_state_paths(&component_name(&args.path), &grants.dirs, &state)
        .map_err(anyhow::Error::msg)?;
    let mut config = BTreeMap::new();
    for pair in &args.config {
        let (key, value) = pair
            .split_once('=')
            .with_context(|| format!("--config {pair:?}: expected KEY=VALUE"))?;
        config.insert(key.to_string(), value.to_string());
    }
    let settings = ComponentSettings::named(component_name(&args.path))
        .with_grants(grants)
        .with_config(config);
    let tool = engine.load_tool_file(&args.path, settings).await?;
    let spec = tool
        .tools()
        .iter()
        .find(|t| t.name == args.tool)
        .with_context(|| {
            let names: Vec<_> = tool.tools().iter().map(|t| t.name.as_str()).collect();
            format!(
                "the component serves no tool {:?}; it serves {names:?}",
                args.tool
            )
        })?;
    let effect = spec.effect.unwrap_or(ToolEffect::Unclassified);
    let execution = DeferredToolExecution {
        flow_id: "cli".to_string(),
        turn_id: "turn-1".to_string(),
        tool_call: ToolCallRecord {
            tool_call_id: "call-1".to_string(),
            tool_name: args.tool.clone(),
            arguments: args.args.clone(),
            policy: ToolPolicy {
                effect,
                requires_approval: false,
            },
            status: ToolCallStatus::Approved,
            output: None,
            error: None,
            rejection_message: None,
            deferral_order: 0,
        },
        idempotency_key: "cli/turn-1/call-1".to_string(),
        attempt: 1,
    };
    let env = CallEnv::new(StepTag {
        flow_id: "cli".to_string(),
        turn_id: "turn-1".to_string(),
        step_execution_id: "cli-call".to_string(),
        attempt: 1,
    })
    .with_timeout(std::time::Duration::from_secs(args.timeout_secs));
    match tool.call(env, &execution).await? {
        Ok(output) => {
            println!("{output}");
            Ok(())
        }
        Err(err) => bail!("the tool returned an error: {err:?}"),
    }
}
