//! Component versions for the agents of a `dexa.toml`: loading a version
//! from the catalog with its role's settings, verifying one before it is
//! activated, and the bootstrap that activates the config's own files.
//!
//! How the two paths meet: `dexa.toml` names a file per role. At start, a
//! worker (or `dexa serve`) adds that file's version to the catalog and
//! activates it, as actor `config`, **only when the config never named that
//! version before** (see [`ActivateIf::ConfigChanged`]). So an explicit
//! activation (`dexa agent activate`) stands across restarts until someone
//! deploys a new file, a new file wins over an older explicit activation,
//! recorded in the log, and a worker restarted on an older `dexa.toml`
//! during a rolling deploy does not bring its older file back.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use async_trait::async_trait;

use super::{ComponentConfig, DexaConfig};
use crate::catalog::{
    short_digest, ActivateIf, Activation, ActivationMode, CatalogError, CatalogStore, CatalogTool,
    ComponentRecord, NewActivation, RoleStates, CONFIG_ACTOR, RUNNER_ROLE,
};
use crate::plugin::{
    ComponentSettings, RunnerComponent, SandboxConfig, SandboxEngine, ToolComponent, World,
};
use crate::session::{ComponentLoader, ToolEffect, VersionError};

/// Loads versions with the settings `dexa.toml` gives each role.
pub struct ConfigLoader {
    pub(crate) engine: SandboxEngine,
    /// By component name, grants resolved and checked.
    pub(crate) settings: BTreeMap<String, ComponentSettings>,
    /// Agent name → its runner's component name.
    pub(crate) runners: BTreeMap<String, String>,
}

impl ConfigLoader {
    fn settings_of(&self, component: &str) -> Result<ComponentSettings, VersionError> {
        self.settings.get(component).cloned().ok_or_else(|| {
            VersionError::Invalid(format!(
                "component {component:?} has no settings in dexa.toml"
            ))
        })
    }
}

fn check_digest(expected: &str, loaded: &str) -> Result<(), VersionError> {
    if expected == loaded {
        Ok(())
    } else {
        Err(VersionError::Invalid(format!(
            "the stored bytes hash to {loaded}, not {expected}: the registry is corrupt"
        )))
    }
}

/// A loading task that did not finish: a panic (in the host, on these
/// bytes) would repeat, so the version is unusable; a cancelled one (the
/// worker is shutting down) may load next time.
fn stopped(err: tokio::task::JoinError) -> VersionError {
    if err.is_panic() {
        VersionError::Invalid(format!("loading panicked: {err}"))
    } else {
        VersionError::Unavailable(format!("loading stopped: {err}"))
    }
}

#[async_trait]
impl ComponentLoader for ConfigLoader {
    async fn load_runner(
        &self,
        agent: &str,
        digest: &str,
        wasm: Vec<u8>,
    ) -> Result<RunnerComponent, VersionError> {
        let component = self
            .runners
            .get(agent)
            .ok_or_else(|| VersionError::Invalid(format!("agent {agent:?} is not in dexa.toml")))?;
        let settings = self.settings_of(component)?;
        let engine = self.engine.clone();
        // Compiling is CPU work of up to seconds: off the runtime's threads.
        let runner = tokio::task::spawn_blocking(move || engine.load_runner(&wasm, settings))
            .await
            .map_err(stopped)?
            .map_err(|err| VersionError::Invalid(err.to_string()))?;
        check_digest(digest, &runner.info().sha256)?;
        Ok(runner)
    }

    async fn load_tool(
        &self,
        _agent: &str,
        role: &str,
        digest: &str,
        wasm: Vec<u8>,
    ) -> Result<ToolComponent, VersionError> {
        let mut settings = self.settings_of(role)?;
        // A version a session is pinned to was verified when it was
        // activated; a check added since must not strand the session.
        settings.keep_bad_tool_schemas = true;
        let engine = self.engine.clone();
        // Compiling is CPU work of up to seconds, and `list-tools` runs
        // the guest: both off the runtime's threads, which serve the
        // worker's other Steps meanwhile.
        let runtime = tokio::runtime::Handle::current();
        let tool = tokio::task::spawn_blocking(move || {
            runtime.block_on(engine.load_tool(&wasm, settings))
        })
        .await
        .map_err(stopped)?
        .map_err(|err| VersionError::Invalid(err.to_string()))?;
        check_digest(digest, &tool.info().sha256)?;
        Ok(tool)
    }
}

/// The package of the worlds the host implements.
fn wit_package(world: World) -> String {
    let name = world.name();
    match (name.split_once('/'), name.rsplit_once('@')) {
        (Some((package, _)), Some((_, version))) => format!("{package}@{version}"),
        _ => name.to_string(),
    }
}

/// The catalog's record of a verified runner.
pub fn runner_record(runner: &RunnerComponent, size: usize, actor: &str) -> ComponentRecord {
    ComponentRecord {
        digest: runner.info().sha256.clone(),
        world: "runner".to_string(),
        wit_package: wit_package(World::Runner),
        tools: Vec::new(),
        size: size as u64,
        added_at: 0,
        added_by: actor.to_string(),
    }
}

/// The catalog's record of a verified tool component, with its tools.
pub fn tool_record(tool: &ToolComponent, size: usize, actor: &str) -> ComponentRecord {
    ComponentRecord {
        digest: tool.info().sha256.clone(),
        world: "tool".to_string(),
        wit_package: wit_package(World::Tool),
        tools: tool
            .tools()
            .iter()
            .map(|spec| CatalogTool {
                name: spec.name.clone(),
                effect: spec
                    .effect
                    .map(|e| ToolEffect::from(e).as_str().to_string()),
            })
            .collect(),
        size: size as u64,
        added_at: 0,
        added_by: actor.to_string(),
    }
}

/// The engine a worker of `config` runs, so that what verification
/// compiles is what the workers find in the cache.
pub fn config_engine(config: &DexaConfig) -> anyhow::Result<SandboxEngine> {
    SandboxEngine::new(SandboxConfig {
        cache_dir: Some(config.cache_dir.clone()),
        cache_max_bytes: config.cache_max_bytes,
        // Metering slows every guest, so it is on only when asked for.
        consume_fuel: config.components.values().any(|c| c.limits.fuel.is_some()),
        ..SandboxConfig::default()
    })
}

/// The component of `dexa.toml` that plays `role` for `agent`.
pub fn role_component<'a>(
    config: &'a DexaConfig,
    agent: &str,
    role: &str,
) -> Result<&'a ComponentConfig, String> {
    let agent_config = config.agents.get(agent).ok_or_else(|| {
        let known: Vec<&String> = config.agents.keys().collect();
        format!("there is no agent {agent:?}; the agents are {known:?}")
    })?;
    let name = if role == RUNNER_ROLE {
        &agent_config.runner
    } else if agent_config.tools.iter().any(|t| t == role) {
        role
    } else {
        return Err(format!(
            "agent {agent:?} has no tool component {role:?}; its tool components are {:?}",
            agent_config.tools
        ));
    };
    config
        .components
        .get(name)
        .ok_or_else(|| format!("component {name:?} is not in dexa.toml"))
}

/// Adds the config's file version of one role and activates it as actor
/// `config` when the config never named that version before (see
/// [`ActivateIf::ConfigChanged`]).
pub async fn bootstrap_role(
    catalog: &dyn CatalogStore,
    agent: &str,
    role: &str,
    record: ComponentRecord,
    wasm: Vec<u8>,
    path: &Path,
) -> Result<Option<Activation>, CatalogError> {
    let digest = record.digest.clone();
    let activation = NewActivation {
        agent: agent.to_string(),
        role: role.to_string(),
        digest: digest.clone(),
        mode: ActivationMode::Current,
        upgrade_in_flight: false,
        actor: CONFIG_ACTOR.to_string(),
        after_seq: None,
        reason: format!("dexa.toml names {}", path.display()),
    };
    catalog.add_component(record.clone(), wasm.clone()).await?;
    let activated = match catalog
        .activate(activation.clone(), ActivateIf::ConfigChanged)
        .await
    {
        // A gc removed the version between the add and the activation (it
        // was added long ago and never active): add it again, once.
        Err(CatalogError::NoSuchComponent { .. }) => {
            catalog.add_component(record, wasm).await?;
            catalog
                .activate(activation, ActivateIf::ConfigChanged)
                .await?
        }
        other => other?,
    };
    if activated.is_none() {
        let log = catalog.activations(Some(agent)).await?;
        let states = RoleStates::from_log(&log);
        let current = states.role(agent, role).and_then(|s| s.current.as_deref());
        if current.is_some_and(|current| current != digest) {
            // Reverting dexa.toml to a file it named before does not bring
            // that version back (a worker on an older config would undo a
            // rolling deploy); say so where the operator looks.
            tracing::warn!(
                agent,
                role,
                "dexa.toml names {} (version {}), which it named before; it stays as it is, and \
                 version {} stays current (use `dexa agent activate` or `rollback` to change it)",
                path.display(),
                short_digest(&digest),
                short_digest(current.unwrap_or_default()),
            );
        }
    }
    Ok(activated)
}

/// The loader a worker of `config` uses, with `settings` by component name.
pub fn loader(
    config: &DexaConfig,
    engine: SandboxEngine,
    settings: BTreeMap<String, ComponentSettings>,
) -> Arc<ConfigLoader> {
    Arc::new(ConfigLoader {
        engine,
        settings,
        runners: config
            .agents
            .values()
            .map(|a| (a.name.clone(), a.runner.clone()))
            .collect(),
    })
}
