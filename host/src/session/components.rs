//! AgentComponents: the runner, tool components and model of one agent, and
//! which version of each a Step runs.
//!
//! Two sources: a fixed set (loaded once, as tests and embedders build it),
//! or the component catalog ([`CatalogVersions`]), where versions change
//! under live sessions and every turn and tool call is pinned to one.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::versions::CatalogVersions;
use crate::plugin::wit::ToolSpec;
use crate::plugin::{ModelProvider, RunnerComponent, ToolComponent};

/// Why an agent's components do not fit together.
#[derive(Debug, thiserror::Error)]
pub enum AgentConfigError {
    #[error("tool {tool:?} is served by both component {first:?} and component {second:?}")]
    DuplicateTool {
        tool: String,
        first: String,
        second: String,
    },
}

/// Why a Step cannot have the component version it needs.
#[derive(Debug, thiserror::Error)]
pub enum VersionError {
    /// The version is not in the registry, or the agent has none active:
    /// the Step fails, and never runs another version instead.
    #[error("{0}")]
    Missing(String),
    /// The version cannot be used (it does not load, its tools collide).
    #[error("{0}")]
    Invalid(String),
    /// The store did not answer; a later attempt may.
    #[error("{0}")]
    Unavailable(String),
}

/// One tool component of a turn's tool set, at one version.
pub struct ServedTool {
    /// The tool component's name in `dexa.toml` (its role in the catalog).
    pub role: String,
    pub digest: String,
    pub component: Arc<ToolComponent>,
}

/// The tool components a turn offers, at the versions it takes.
pub struct ToolSet {
    pub(crate) tools: Vec<ServedTool>,
    pub(crate) specs: Vec<ToolSpec>,
}

impl ToolSet {
    /// Refuses two tool components that serve the same tool name.
    pub fn new(tools: Vec<ServedTool>) -> Result<Self, AgentConfigError> {
        let mut served: BTreeMap<String, String> = BTreeMap::new();
        let mut specs = Vec::new();
        for tool in &tools {
            for spec in tool.component.tools() {
                if let Some(first) = served.insert(spec.name.clone(), tool.role.clone()) {
                    return Err(AgentConfigError::DuplicateTool {
                        tool: spec.name.clone(),
                        first,
                        second: tool.role.clone(),
                    });
                }
                specs.push(spec.clone());
            }
        }
        Ok(Self { tools, specs })
    }

    /// The tool component serving `tool_name`; none means the runner runs it.
    pub(crate) fn serving(&self, tool_name: &str) -> Option<&ServedTool> {
        self.tools
            .iter()
            .find(|tool| tool.component.serves(tool_name))
    }
}

/// A runner at the version a turn is pinned to.
pub struct PinnedRunner {
    pub digest: String,
    pub runner: Arc<RunnerComponent>,
}

/// A forward fix: the turn moves from its pinned runner to `to`.
pub struct Hop {
    pub to: String,
    pub why: String,
}

enum Source {
    Fixed {
        runner: Arc<RunnerComponent>,
        tools: Arc<ToolSet>,
    },
    Catalog(Arc<CatalogVersions>),
}

/// The components of one agent: its runner, its tool components and the model
/// behind `model.complete`.
pub struct AgentComponents {
    source: Source,
    pub(crate) model: Option<Arc<dyn ModelProvider>>,
}

impl AgentComponents {
    /// A fixed set; refuses two tool components that serve the same tool
    /// name.
    pub fn new(
        runner: Arc<RunnerComponent>,
        tools: Vec<Arc<ToolComponent>>,
    ) -> Result<Self, AgentConfigError> {
        let served = tools
            .into_iter()
            .map(|component| ServedTool {
                role: component.info().name.clone(),
                digest: component.info().sha256.clone(),
                component,
            })
            .collect();
        Ok(Self {
            source: Source::Fixed {
                runner,
                tools: Arc::new(ToolSet::new(served)?),
            },
            model: None,
        })
    }

    /// Versions from the component catalog, as its activations say.
    pub fn from_catalog(versions: Arc<CatalogVersions>) -> Self {
        Self {
            source: Source::Catalog(versions),
            model: None,
        }
    }

    pub fn with_model(mut self, model: Arc<dyn ModelProvider>) -> Self {
        self.model = Some(model);
        self
    }

    /// Whether this is a fixed set (no catalog).
    pub(crate) fn is_fixed(&self) -> bool {
        matches!(self.source, Source::Fixed { .. })
    }

    /// The tools a fixed set declares (a catalog's change with its versions).
    pub(crate) fn fixed_specs(&self) -> &[ToolSpec] {
        match &self.source {
            Source::Fixed { tools, .. } => &tools.specs,
            Source::Catalog(_) => &[],
        }
    }

    /// The runner a new turn of `session_id` takes.
    pub(crate) async fn new_turn_runner(
        &self,
        session_id: &str,
    ) -> Result<PinnedRunner, VersionError> {
        match &self.source {
            Source::Fixed { runner, .. } => Ok(PinnedRunner {
                digest: runner.info().sha256.clone(),
                runner: runner.clone(),
            }),
            Source::Catalog(versions) => versions.new_turn_runner(session_id).await,
        }
    }

    /// The runner at `digest`.
    pub(crate) async fn runner(&self, digest: &str) -> Result<Arc<RunnerComponent>, VersionError> {
        match &self.source {
            Source::Fixed { runner, .. } if runner.info().sha256 == digest => Ok(runner.clone()),
            Source::Fixed { .. } => Err(VersionError::Missing(format!(
                "runner version {digest} is not loaded here (this worker runs one fixed version)"
            ))),
            Source::Catalog(versions) => versions.runner(digest).await,
        }
    }

    /// Whether a turn pinned to `pinned` moves to another runner now.
    pub(crate) async fn forward_fix(
        &self,
        session_id: &str,
        pinned: &str,
    ) -> Result<Option<Hop>, VersionError> {
        match &self.source {
            Source::Fixed { .. } => Ok(None),
            Source::Catalog(versions) => versions.forward_fix(session_id, pinned).await,
        }
    }

    /// The tool components a turn of `session_id` offers now.
    pub(crate) async fn tool_set(&self, session_id: &str) -> Result<Arc<ToolSet>, VersionError> {
        match &self.source {
            Source::Fixed { tools, .. } => Ok(tools.clone()),
            Source::Catalog(versions) => versions.tool_set(session_id).await,
        }
    }

    /// The tool component `role` at `digest`.
    pub(crate) async fn tool(
        &self,
        role: &str,
        digest: &str,
    ) -> Result<Arc<ToolComponent>, VersionError> {
        match &self.source {
            Source::Fixed { tools, .. } => tools
                .tools
                .iter()
                .find(|t| t.role == role && t.digest == digest)
                .map(|t| t.component.clone())
                .ok_or_else(|| {
                    VersionError::Missing(format!(
                        "tool component {role:?} version {digest} is not loaded here (this \
                         worker runs one fixed version)"
                    ))
                }),
            Source::Catalog(versions) => versions.tool(role, digest).await,
        }
    }
}
