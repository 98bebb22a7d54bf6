//! The catalog's versions as one worker sees them: the activation log,
//! re-read when a Step asks and the last read is older than
//! [`ActivationWatch::REFRESH`], and the versions loaded so far, by digest.
//!
//! A Step never falls back to another version: a pinned digest whose bytes
//! are missing fails the Step with [`VersionError::Missing`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio::sync::OnceCell;

use super::components::{Hop, PinnedRunner, ServedTool, ToolSet, VersionError};
use crate::catalog::{short_digest, CatalogStore, RoleState, RoleStates, RUNNER_ROLE};
use crate::plugin::{RunnerComponent, ToolComponent};

/// Builds a loaded component from a version's bytes, with the settings
/// (grants, limits, config) the operator gave the role. A version that
/// cannot load is [`VersionError::Invalid`]; a failure a later attempt may
/// not meet (the loading task was stopped, say) is
/// [`VersionError::Unavailable`].
#[async_trait]
pub trait ComponentLoader: Send + Sync {
    async fn load_runner(
        &self,
        agent: &str,
        digest: &str,
        wasm: Vec<u8>,
    ) -> Result<RunnerComponent, VersionError>;
    async fn load_tool(
        &self,
        agent: &str,
        role: &str,
        digest: &str,
        wasm: Vec<u8>,
    ) -> Result<ToolComponent, VersionError>;
}

/// Puts `what` before the reason, keeping whether a later attempt may do.
fn in_context(what: String, err: VersionError) -> VersionError {
    match err {
        VersionError::Missing(reason) => VersionError::Missing(format!("{what}: {reason}")),
        VersionError::Invalid(reason) => VersionError::Invalid(format!("{what}: {reason}")),
        VersionError::Unavailable(reason) => VersionError::Unavailable(format!("{what}: {reason}")),
    }
}

/// The activation log, folded, shared by every agent of a worker.
pub struct ActivationWatch {
    catalog: Arc<dyn CatalogStore>,
    seen: tokio::sync::Mutex<(Arc<RoleStates>, Option<Instant>)>,
}

impl ActivationWatch {
    /// How stale a worker's view of the log may be: an activation reaches
    /// every new turn within this (well inside the promised second).
    pub const REFRESH: Duration = Duration::from_millis(250);

    pub fn new(catalog: Arc<dyn CatalogStore>) -> Self {
        Self {
            catalog,
            seen: tokio::sync::Mutex::new((Arc::new(RoleStates::default()), None)),
        }
    }

    /// The log as of at most [`Self::REFRESH`] ago.
    pub async fn current(&self) -> Result<Arc<RoleStates>, VersionError> {
        self.read(None).await
    }

    /// The log as it is now: read after this call began (by this call, or
    /// by another that waited for the same lock, so that callers queued
    /// behind one read share it).
    pub async fn fresh(&self) -> Result<Arc<RoleStates>, VersionError> {
        self.read(Some(Instant::now())).await
    }

    /// [`Self::current`], read anew when that view has no active version of
    /// one of `roles` of `agent`: a Step must not fail for an activation a
    /// moment old (another worker's first start activating the config's
    /// files, say) while the view is [`Self::REFRESH`] old. Only a role the
    /// log itself lacks is missing.
    pub async fn current_with(
        &self,
        agent: &str,
        roles: &[&str],
    ) -> Result<Arc<RoleStates>, VersionError> {
        let states = self.current().await?;
        if roles.iter().all(|role| has_active(&states, agent, role)) {
            return Ok(states);
        }
        self.fresh().await
    }

    /// The cached view if it is recent enough: read after `asked` when
    /// that is given, else within [`Self::REFRESH`].
    async fn read(&self, asked: Option<Instant>) -> Result<Arc<RoleStates>, VersionError> {
        let mut seen = self.seen.lock().await;
        let recent = match asked {
            Some(asked) => seen.1.is_some_and(|at| at >= asked),
            None => seen.1.is_some_and(|at| at.elapsed() < Self::REFRESH),
        };
        if recent {
            return Ok(seen.0.clone());
        }
        // When the read began: what it returns is at least this new.
        let read_at = Instant::now();
        let newer = self
            .catalog
            .activations_after(seen.0.last_seq)
            .await
            .map_err(|err| {
                VersionError::Unavailable(format!("the activation log is unreadable: {err}"))
            })?;
        if !newer.is_empty() {
            let mut states = (*seen.0).clone();
            for activation in &newer {
                states.apply(activation);
            }
            seen.0 = Arc::new(states);
        }
        seen.1 = Some(read_at);
        Ok(seen.0.clone())
    }
}

/// Whether `role` of `agent` has a version to serve (current or ramping).
fn has_active(states: &RoleStates, agent: &str, role: &str) -> bool {
    states
        .role(agent, role)
        .is_some_and(|state| state.current.is_some() || state.ramp.is_some())
}

type Cell<T> = Arc<OnceCell<Arc<T>>>;

/// How many versions of one kind (runners, or tool components) an agent
/// keeps loaded; the least recently used beyond this are dropped, and load
/// again from the store (and the compiled-artifact cache) if a Step needs
/// them. A Step running one keeps its own reference.
pub const MAX_LOADED_VERSIONS: usize = 8;

/// Loaded versions by key, least recently used dropped first.
struct Loaded<K, T> {
    /// Each cell with the tick of its last use.
    cells: HashMap<K, (Cell<T>, u64)>,
    tick: u64,
}

impl<K: std::hash::Hash + Eq + Clone, T> Loaded<K, T> {
    fn new() -> Self {
        Self {
            cells: HashMap::new(),
            tick: 0,
        }
    }

    fn cell(&mut self, key: K) -> Cell<T> {
        self.tick += 1;
        let now = self.tick;
        let cell = match self.cells.get_mut(&key) {
            Some((cell, used)) => {
                *used = now;
                cell.clone()
            }
            None => {
                let cell: Cell<T> = Arc::default();
                self.cells.insert(key.clone(), (cell.clone(), now));
                cell
            }
        };
        while self.cells.len() > MAX_LOADED_VERSIONS {
            let oldest = self
                .cells
                .iter()
                .filter(|(k, _)| **k != key)
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| k.clone());
            match oldest {
                Some(oldest) => {
                    self.cells.remove(&oldest);
                }
                None => break,
            }
        }
        cell
    }

    fn len(&self) -> usize {
        self.cells.len()
    }
}

/// One agent's versions from the catalog.
pub struct CatalogVersions {
    agent: String,
    tool_roles: Vec<String>,
    watch: Arc<ActivationWatch>,
    catalog: Arc<dyn CatalogStore>,
    loader: Arc<dyn ComponentLoader>,
    runners: Mutex<Loaded<String, RunnerComponent>>,
    tools: Mutex<Loaded<(String, String), ToolComponent>>,
    sets: Mutex<HashMap<Vec<String>, Arc<ToolSet>>>,
}

impl CatalogVersions {
    pub fn new(
        agent: impl Into<String>,
        tool_roles: Vec<String>,
        watch: Arc<ActivationWatch>,
        catalog: Arc<dyn CatalogStore>,
        loader: Arc<dyn ComponentLoader>,
    ) -> Self {
        Self {
            agent: agent.into(),
            tool_roles,
            watch,
            catalog,
            loader,
            runners: Mutex::new(Loaded::new()),
            tools: Mutex::new(Loaded::new()),
            sets: Mutex::new(HashMap::new()),
        }
    }

    /// Hands over a runner already loaded (from `dexa.toml`'s file).
    pub fn preloaded_runner(&self, runner: Arc<RunnerComponent>) {
        let digest = runner.info().sha256.clone();
        let cell = self.runner_cell(&digest);
        let _ = cell.set(runner);
    }

    /// Hands over a tool component already loaded (from `dexa.toml`'s file).
    pub fn preloaded_tool(&self, role: &str, tool: Arc<ToolComponent>) {
        let digest = tool.info().sha256.clone();
        let cell = self.tool_cell(role, &digest);
        let _ = cell.set(tool);
    }

    /// Loads every version a new turn may take now, so the first turn after
    /// a start does not compile. A version that fails to load does not stop
    /// the worker (its other agents and versions still serve): it is logged
    /// and returned, and the turns that take it fail with the same error.
    pub async fn preload(&self) -> Vec<VersionError> {
        let mut failed = Vec::new();
        // Fresh: the config's files were activated a moment ago.
        let states = match self.watch.fresh().await {
            Ok(states) => states,
            Err(err) => {
                tracing::warn!(agent = %self.agent, "no version preloaded: {err}");
                failed.push(err);
                return failed;
            }
        };
        if let Some(role) = states.role(&self.agent, RUNNER_ROLE) {
            for digest in role.active() {
                if let Err(err) = self.runner(digest).await {
                    failed.push(err);
                }
            }
        }
        for role_name in &self.tool_roles {
            if let Some(role) = states.role(&self.agent, role_name) {
                for digest in role.active() {
                    if let Err(err) = self.tool(role_name, digest).await {
                        failed.push(err);
                    }
                }
            }
        }
        for err in &failed {
            tracing::warn!(agent = %self.agent, "an active version did not load: {err}");
        }
        failed
    }

    fn runner_cell(&self, digest: &str) -> Cell<RunnerComponent> {
        let mut runners = self.runners.lock().unwrap_or_else(|p| p.into_inner());
        runners.cell(digest.to_string())
    }

    fn tool_cell(&self, role: &str, digest: &str) -> Cell<ToolComponent> {
        let mut tools = self.tools.lock().unwrap_or_else(|p| p.into_inner());
        tools.cell((role.to_string(), digest.to_string()))
    }

    /// How many versions are loaded now: (runners, tool components).
    pub fn loaded(&self) -> (usize, usize) {
        let runners = self.runners.lock().map_or(0, |r| r.len());
        let tools = self.tools.lock().map_or(0, |t| t.len());
        (runners, tools)
    }

    fn role<'a>(&self, states: &'a RoleStates, role: &str) -> Result<&'a RoleState, VersionError> {
        states
            .role(&self.agent, role)
            .filter(|state| state.current.is_some() || state.ramp.is_some())
            .ok_or_else(|| {
                VersionError::Missing(format!(
                    "agent {:?} has no active version of its {role}",
                    self.agent
                ))
            })
    }

    async fn bytes(&self, role: &str, digest: &str) -> Result<Vec<u8>, VersionError> {
        match self.catalog.component_bytes(digest).await {
            Ok(Some(bytes)) => Ok(bytes),
            Ok(None) => Err(VersionError::Missing(format!(
                "the {role} version {digest} of agent {:?} is not in the registry (its bytes \
                 are missing); the Step fails rather than run another version",
                self.agent
            ))),
            Err(err) => Err(VersionError::Unavailable(format!(
                "the bytes of version {digest} are unreadable: {err}"
            ))),
        }
    }

    pub(crate) async fn new_turn_runner(
        &self,
        session_id: &str,
    ) -> Result<PinnedRunner, VersionError> {
        let states = self.watch.current_with(&self.agent, &[RUNNER_ROLE]).await?;
        let role = self.role(&states, RUNNER_ROLE)?;
        let digest = role
            .choose(session_id)
            .map(str::to_string)
            .ok_or_else(|| VersionError::Missing("no runner version is active".into()))?;
        let runner = self.runner(&digest).await?;
        Ok(PinnedRunner { digest, runner })
    }

    pub(crate) async fn runner(&self, digest: &str) -> Result<Arc<RunnerComponent>, VersionError> {
        let cell = self.runner_cell(digest);
        cell.get_or_try_init(|| async {
            let bytes = self.bytes(RUNNER_ROLE, digest).await?;
            let runner = self
                .loader
                .load_runner(&self.agent, digest, bytes)
                .await
                .map_err(|err| in_context(format!("runner version {digest} does not load"), err))?;
            Ok(Arc::new(runner))
        })
        .await
        .cloned()
    }

    pub(crate) async fn tool(
        &self,
        role: &str,
        digest: &str,
    ) -> Result<Arc<ToolComponent>, VersionError> {
        let cell = self.tool_cell(role, digest);
        cell.get_or_try_init(|| async {
            let bytes = self.bytes(role, digest).await?;
            let tool = self
                .loader
                .load_tool(&self.agent, role, digest, bytes)
                .await
                .map_err(|err| {
                    in_context(
                        format!("tool component {role:?} version {digest} does not load"),
                        err,
                    )
                })?;
            Ok(Arc::new(tool))
        })
        .await
        .cloned()
    }

    pub(crate) async fn forward_fix(
        &self,
        session_id: &str,
        pinned: &str,
    ) -> Result<Option<Hop>, VersionError> {
        let states = self.watch.current_with(&self.agent, &[RUNNER_ROLE]).await?;
        let role = self.role(&states, RUNNER_ROLE)?;
        let Some((by, target)) = role.moves_turns_off(session_id, pinned) else {
            return Ok(None);
        };
        Ok(Some(Hop {
            to: target.to_string(),
            why: format!(
                "activation {} of {} by {} moves turns in flight{}",
                by.seq,
                short_digest(&by.digest),
                by.actor,
                if by.reason.is_empty() {
                    String::new()
                } else {
                    format!(": {}", by.reason)
                }
            ),
        }))
    }

    pub(crate) async fn tool_set(&self, session_id: &str) -> Result<Arc<ToolSet>, VersionError> {
        let roles: Vec<&str> = self.tool_roles.iter().map(String::as_str).collect();
        let states = self.watch.current_with(&self.agent, &roles).await?;
        let mut digests = Vec::with_capacity(self.tool_roles.len());
        for role_name in &self.tool_roles {
            let role = self.role(&states, role_name)?;
            let digest = role.choose(session_id).unwrap_or_default();
            digests.push(digest.to_string());
        }
        if let Some(set) = self
            .sets
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&digests)
        {
            return Ok(set.clone());
        }
        let mut served = Vec::with_capacity(digests.len());
        for (role, digest) in self.tool_roles.iter().zip(&digests) {
            served.push(ServedTool {
                role: role.clone(),
                digest: digest.clone(),
                component: self.tool(role, digest).await?,
            });
        }
        let set = Arc::new(ToolSet::new(served).map_err(|err| {
            VersionError::Invalid(format!(
                "the tool versions active for this session do not fit together: {err}"
            ))
        })?);
        let mut sets = self.sets.lock().unwrap_or_else(|p| p.into_inner());
        // Combinations change only with activations: a clear now and then
        // bounds them, and a set is rebuilt from loaded versions.
        if sets.len() >= MAX_LOADED_VERSIONS {
            sets.clear();
        }
        sets.insert(digests, set.clone());
        Ok(set)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loaded_versions_are_bounded_and_the_least_recently_used_go_first() {
        let mut loaded: Loaded<u32, ()> = Loaded::new();
        let first = loaded.cell(0);
        for key in 1..=(MAX_LOADED_VERSIONS as u32 + 5) {
            loaded.cell(key);
            // Key 0 stays in use.
            loaded.cell(0);
        }
        assert_eq!(loaded.len(), MAX_LOADED_VERSIONS);
        assert!(Arc::ptr_eq(&first, &loaded.cell(0)), "the one in use stays");
        assert!(!loaded.cells.contains_key(&1), "the oldest went");
    }
}
