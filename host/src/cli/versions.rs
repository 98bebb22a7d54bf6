//! `dexa component add|list|gc` and `dexa agent versions|activate|rollback`:
//! the component catalog and the activation log, from the command line.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use serde_json::json;

use crate::catalog::{ActivationMode, RUNNER_ROLE};
use crate::config::activate::{
    activate, add_component, rollback_reason, rollback_request, versions_report, ActivationRequest,
    VersionSource,
};
use crate::config::gc;
use crate::config::versions::{config_engine, role_component};
use crate::config::{Deployment, DexaConfig};

/// The config file and who acts.
#[derive(Args, Debug)]
pub struct CatalogArgs {
    /// The config file (it names the store).
    #[arg(long, short, default_value = crate::config::DEFAULT_CONFIG_FILE, env = "DEXA_CONFIG")]
    pub config: PathBuf,
    /// Who is recorded as adding or activating (default: $USER).
    #[arg(long)]
    pub actor: Option<String>,
}

impl CatalogArgs {
    fn actor(&self) -> String {
        self.actor
            .clone()
            .or_else(|| std::env::var("USER").ok())
            .filter(|a| !a.trim().is_empty())
            .unwrap_or_else(|| "cli".to_string())
    }

    async fn open(&self) -> anyhow::Result<Deployment> {
        Deployment::for_clients(DexaConfig::load(&self.config)?).await
    }
}

#[derive(Args, Debug)]
pub struct AddArgs {
    /// The component file (.wasm): a runner or a tool component.
    pub path: PathBuf,
    #[command(flatten)]
    pub catalog: CatalogArgs,
}

#[derive(Args, Debug)]
pub struct GcArgs {
    /// Keep versions that were active or added within this many seconds.
    #[arg(long, default_value_t = gc::DEFAULT_GRACE.as_secs())]
    pub grace_secs: u64,
    #[command(flatten)]
    pub catalog: CatalogArgs,
}

#[derive(Subcommand, Debug)]
pub enum AgentCommand {
    /// The activation log of an agent and what each role takes now.
    Versions(VersionsArgs),
    /// Verify a version and make it active for new turns (or a ramp).
    Activate(ActivateArgs),
    /// Activate the version that was current before (or end a ramp).
    Rollback(RollbackArgs),
}

#[derive(Args, Debug)]
pub struct VersionsArgs {
    pub agent: String,
    #[command(flatten)]
    pub catalog: CatalogArgs,
}

#[derive(Args, Debug)]
pub struct ActivateArgs {
    pub agent: String,
    /// The runner: a .wasm file or a digest already added.
    #[arg(long, conflicts_with = "tool")]
    pub runner: Option<String>,
    /// A tool component: NAME=FILE or NAME=DIGEST (NAME as in dexa.toml).
    #[arg(long)]
    pub tool: Option<String>,
    /// Send this percent of sessions (1-99, stable by session id) to it.
    #[arg(long)]
    pub ramp: Option<u8>,
    /// Move turns pinned to another runner to this one at their next
    /// RunModel (a forward fix), recording the hop.
    #[arg(long)]
    pub upgrade_in_flight: bool,
    /// Why, for the log.
    #[arg(long, default_value = "")]
    pub reason: String,
    #[command(flatten)]
    pub catalog: CatalogArgs,
}

#[derive(Args, Debug)]
pub struct RollbackArgs {
    pub agent: String,
    /// Roll the runner back (the default).
    #[arg(long, conflicts_with = "tool")]
    pub runner: bool,
    /// Roll this tool component back.
    #[arg(long)]
    pub tool: Option<String>,
    /// Move turns pinned to the rolled-back runner at their next RunModel.
    #[arg(long)]
    pub upgrade_in_flight: bool,
    #[arg(long, default_value = "")]
    pub reason: String,
    #[command(flatten)]
    pub catalog: CatalogArgs,
}

fn print(value: serde_json::Value) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(&value)?);
    Ok(())
}

/// `dexa component add`: verifies the file as a runner or a tool component
/// (with no grants) and adds it.
pub async fn add(args: AddArgs) -> anyhow::Result<()> {
    let deployment = args.catalog.open().await?;
    let engine = config_engine(&deployment.config)?;
    let wasm = std::fs::read(&args.path)
        .with_context(|| format!("cannot read {}", args.path.display()))?;
    let (record, added) = add_component(
        &engine,
        &*deployment.catalog,
        wasm,
        &super::component_name(&args.path),
        &args.catalog.actor(),
    )
    .await?;
    print(
        json!({"digest": record.digest, "world": record.world, "added": added,
        "tools": record.tools}),
    )
}

pub async fn list(args: CatalogArgs) -> anyhow::Result<()> {
    let deployment = args.open().await?;
    let records = deployment.catalog.list_components().await?;
    print(serde_json::to_value(records)?)
}

pub async fn collect(args: GcArgs) -> anyhow::Result<()> {
    let deployment = args.catalog.open().await?;
    let report = gc::collect(
        &*deployment.catalog,
        &*deployment.store,
        Duration::from_secs(args.grace_secs),
    )
    .await?;
    print(json!({"removed": report.removed, "kept": report.kept}))
}

pub async fn versions(args: VersionsArgs) -> anyhow::Result<()> {
    let deployment = args.catalog.open().await?;
    if !deployment.config.agents.contains_key(&args.agent) {
        bail!(
            "there is no agent {:?} in {}",
            args.agent,
            args.catalog.config.display()
        );
    }
    print(serde_json::to_value(
        versions_report(&*deployment.catalog, &args.agent).await?,
    )?)
}

fn split_tool(spec: &str) -> anyhow::Result<(String, String)> {
    match spec.split_once('=') {
        Some((name, source)) if !name.is_empty() && !source.is_empty() => {
            Ok((name.to_string(), source.to_string()))
        }
        _ => bail!("--tool {spec:?}: expected NAME=FILE or NAME=DIGEST"),
    }
}

pub async fn activate_command(args: ActivateArgs) -> anyhow::Result<()> {
    let deployment = args.catalog.open().await?;
    let (role, source) = match (&args.runner, &args.tool) {
        (Some(runner), None) => (RUNNER_ROLE.to_string(), runner.clone()),
        (None, Some(tool)) => split_tool(tool)?,
        _ => bail!("say what to activate: --runner FILE|DIGEST or --tool NAME=FILE|DIGEST"),
    };
    let mode = match args.ramp {
        Some(percent) => ActivationMode::ramp(percent).map_err(anyhow::Error::msg)?,
        None => ActivationMode::Current,
    };
    let engine = config_engine(&deployment.config)?;
    let activation = activate(
        &deployment.config,
        &engine,
        &*deployment.catalog,
        ActivationRequest {
            agent: args.agent,
            role,
            source: VersionSource::parse(&source),
            mode,
            upgrade_in_flight: args.upgrade_in_flight,
            actor: args.catalog.actor(),
            reason: args.reason,
            after_seq: None,
        },
    )
    .await?;
    print(serde_json::to_value(activation)?)
}

pub async fn rollback(args: RollbackArgs) -> anyhow::Result<()> {
    let deployment = args.catalog.open().await?;
    let role = args.tool.clone().unwrap_or_else(|| RUNNER_ROLE.to_string());
    role_component(&deployment.config, &args.agent, &role).map_err(anyhow::Error::msg)?;
    let target = rollback_request(&*deployment.catalog, &args.agent, &role).await?;
    let engine = config_engine(&deployment.config)?;
    let activation = activate(
        &deployment.config,
        &engine,
        &*deployment.catalog,
        ActivationRequest {
            agent: args.agent,
            role,
            reason: rollback_reason(&target.digest, args.reason),
            source: VersionSource::Digest(target.digest),
            after_seq: Some(target.after_seq),
            mode: ActivationMode::Current,
            upgrade_in_flight: args.upgrade_in_flight,
            actor: args.catalog.actor(),
        },
    )
    .await?;
    print(serde_json::to_value(activation)?)
}
