//! AgentComponents: the runner, tool components and model of one agent.

use std::collections::BTreeMap;
use std::sync::Arc;

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

/// The components of one agent: its runner, its tool components and the model
/// behind `model.complete`.
pub struct AgentComponents {
    pub(crate) runner: Arc<RunnerComponent>,
    pub(crate) tools: Vec<Arc<ToolComponent>>,
    pub(crate) model: Option<Arc<dyn ModelProvider>>,
    pub(crate) tool_specs: Vec<ToolSpec>,
}

impl AgentComponents {
    /// Refuses two tool components that serve the same tool name.
    pub fn new(
        runner: Arc<RunnerComponent>,
        tools: Vec<Arc<ToolComponent>>,
    ) -> Result<Self, AgentConfigError> {
        let mut served: BTreeMap<String, String> = BTreeMap::new();
        let mut tool_specs = Vec::new();
        for component in &tools {
            for spec in component.tools() {
                let name = component.info().name.clone();
                if let Some(first) = served.insert(spec.name.clone(), name.clone()) {
                    return Err(AgentConfigError::DuplicateTool {
                        tool: spec.name.clone(),
                        first,
                        second: name,
                    });
                }
                tool_specs.push(spec.clone());
            }
        }
        Ok(Self {
            runner,
            tools,
            model: None,
            tool_specs,
        })
    }

    pub fn with_model(mut self, model: Arc<dyn ModelProvider>) -> Self {
        self.model = Some(model);
        self
    }

    /// The tool component serving `tool_name`; none means the runner runs it.
    pub(crate) fn tool_for(&self, tool_name: &str) -> Option<&Arc<ToolComponent>> {
        self.tools.iter().find(|tool| tool.serves(tool_name))
    }
}
