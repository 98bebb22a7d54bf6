//! AgentSessionFlow: one flow type per agent, its options, and the Step
//! definitions (policies, failure routes, locks) the engine runs.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use super::limits::TurnLimits;
use super::policy::{ToolPolicies, ToolPolicyOverride};
use super::records::{ToolEffect, ToolPolicy, PENDING_INTERRUPTS};
use super::steps::{step, SessionSteps};
use crate::flow::{FlowType, RetryPolicy, StepContext, StepDef, StepError, StepResult};
use crate::plugin::wit::ToolSpec;
use crate::plugin::{ModelProvider, RunnerComponent, ToolComponent};

/// How a session runs. Every field has a default.
#[derive(Clone, Debug, PartialEq)]
pub struct AgentSessionOptions {
    /// Explicit policies by tool name; they win over the effect a tool
    /// declares and the framework's (see `session::policy`).
    pub tool_policies: BTreeMap<String, ToolPolicy>,
    /// The effect of a tool with no explicit policy and no framework effect.
    pub default_tool_effect: ToolEffect,
    /// Bytes the session's event stream keeps (oldest events are trimmed).
    pub events_capacity: u64,
    /// How long an approval may wait; none waits forever. The deadline is
    /// exact to the millisecond of the store's clock (an answer after it is
    /// refused); the Timer that expires the request fires on the next whole
    /// second, as the spec says.
    pub interrupt_deadline: Option<Duration>,
    /// How long one tool call attempt may run.
    pub tool_attempt_timeout: Duration,
    /// How long one RunModel attempt may run (the runner's CPU deadline too).
    pub model_step_timeout: Duration,
    /// What one turn may cost (tool calls, messages, tool output).
    pub turn_limits: TurnLimits,
}

impl Default for AgentSessionOptions {
    fn default() -> Self {
        Self {
            tool_policies: BTreeMap::new(),
            default_tool_effect: ToolEffect::Unclassified,
            events_capacity: 10 << 20,
            interrupt_deadline: None,
            tool_attempt_timeout: Duration::from_secs(5 * 60),
            model_step_timeout: RUN_MODEL_TIMEOUT,
            turn_limits: TurnLimits::default(),
        }
    }
}

impl AgentSessionOptions {
    pub fn tool_policy(mut self, tool_name: impl Into<String>, policy: ToolPolicy) -> Self {
        self.tool_policies.insert(tool_name.into(), policy);
        self
    }

    pub fn default_tool_effect(mut self, effect: ToolEffect) -> Self {
        self.default_tool_effect = effect;
        self
    }

    pub fn turn_limits(mut self, limits: TurnLimits) -> Self {
        self.turn_limits = limits;
        self
    }

    pub fn events_capacity(mut self, bytes: u64) -> Self {
        self.events_capacity = bytes;
        self
    }

    pub fn interrupt_deadline(mut self, deadline: Duration) -> Self {
        self.interrupt_deadline = Some(deadline);
        self
    }

    pub fn model_step_timeout(mut self, timeout: Duration) -> Self {
        self.model_step_timeout = timeout;
        self
    }

    pub fn tool_attempt_timeout(mut self, timeout: Duration) -> Self {
        self.tool_attempt_timeout = timeout;
        self
    }

    /// The operator's part of the agent's tool policies.
    pub(crate) fn resolver(&self) -> ToolPolicies {
        ToolPolicies {
            explicit: self
                .tool_policies
                .iter()
                .map(|(name, policy)| {
                    (
                        name.clone(),
                        ToolPolicyOverride {
                            effect: policy.effect.into(),
                            requires_approval: policy.requires_approval,
                        },
                    )
                })
                .collect(),
            default_effect: self.default_tool_effect.into(),
            ..ToolPolicies::default()
        }
    }
}

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

/// The durable agent session of one agent (flow type).
#[derive(Clone)]
pub struct AgentSessionFlow {
    steps: Arc<SessionSteps>,
}

/// How long RunModel's attempt may run, and how long without a heartbeat.
pub const RUN_MODEL_TIMEOUT: Duration = Duration::from_secs(15 * 60);
pub const RUN_MODEL_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(2 * 60);
/// RunModel's attempts must all start within this window.
pub const RUN_MODEL_WINDOW: Duration = Duration::from_secs(30 * 60);
/// The slack between a guest call's own deadline and its Step's timeout, so
/// that the call's typed timeout error is the one recorded.
const STEP_TIMEOUT_SLACK: Duration = Duration::from_secs(5);

impl AgentSessionFlow {
    /// An agent that workers can run.
    pub fn new(
        flow_type: impl Into<String>,
        components: AgentComponents,
        options: AgentSessionOptions,
    ) -> Self {
        Self::build(flow_type.into(), Some(Arc::new(components)), options)
    }

    /// The same flow type for clients (RPCs, starting sessions), with no
    /// components: its Steps refuse to run.
    pub fn for_clients(flow_type: impl Into<String>, options: AgentSessionOptions) -> Self {
        Self::build(flow_type.into(), None, options)
    }

    fn build(
        flow_type: String,
        components: Option<Arc<AgentComponents>>,
        options: AgentSessionOptions,
    ) -> Self {
        // The operator's policies, and the effects the tool components
        // declare, which a runner cannot lower.
        let declared = components.iter().flat_map(|c| c.tool_specs.iter());
        let policies = Arc::new(options.resolver().with_declared(declared));
        Self {
            steps: Arc::new(SessionSteps {
                flow_type,
                options,
                policies,
                components,
            }),
        }
    }

    pub fn flow_type(&self) -> &str {
        &self.steps.flow_type
    }

    pub fn options(&self) -> &AgentSessionOptions {
        &self.steps.options
    }

    /// The flow type to register with the engine.
    pub fn definition(&self) -> FlowType {
        let tool_timeout = self.steps.options.tool_attempt_timeout + STEP_TIMEOUT_SLACK;
        let tool_policy = RetryPolicy::default()
            .attempts(3)
            .attempt_timeout(tool_timeout)
            .heartbeat_timeout(RUN_MODEL_HEARTBEAT_TIMEOUT);
        FlowType::new(self.flow_type(), step::START_AGENT_SESSION)
            .step(self.def(step::START_AGENT_SESSION, SessionSteps::start_agent_session))
            .step(self.def(step::AWAIT_USER_MESSAGE, SessionSteps::await_user_message))
            .step(
                self.def(step::RUN_MODEL, SessionSteps::run_model)
                    .policy(
                        RetryPolicy::default()
                            .attempts(3)
                            .window(RUN_MODEL_WINDOW)
                            .attempt_timeout(
                                self.steps.options.model_step_timeout + STEP_TIMEOUT_SLACK,
                            )
                            .heartbeat_timeout(RUN_MODEL_HEARTBEAT_TIMEOUT),
                    )
                    .failure_route(step::RECORD_TURN_FAILURE),
            )
            .step(
                self.def(step::AWAIT_TOOL_APPROVAL, SessionSteps::await_tool_approval)
                    .locks([PENDING_INTERRUPTS]),
            )
            .step(
                self.def(step::CALL_TOOL, SessionSteps::call_tool)
                    .policy(tool_policy.clone())
                    .failure_route(step::RECORD_TOOL_FAILURE),
            )
            .step(
                self.def(step::CALL_SINGLE_ATTEMPT_TOOL, SessionSteps::call_tool)
                    .policy(tool_policy.attempts(1))
                    .failure_route(step::RECORD_TOOL_OUTCOME_UNKNOWN),
            )
            .step(self.def(step::RECORD_TOOL_FAILURE, SessionSteps::record_tool_failure))
            .step(self.def(
                step::RECORD_TOOL_OUTCOME_UNKNOWN,
                SessionSteps::record_tool_outcome_unknown,
            ))
            .step(self.def(step::RESUME_TURN, SessionSteps::resume_turn))
            .step(self.def(step::RECORD_TURN_FAILURE, SessionSteps::record_turn_failure))
    }

    fn def<F, Fut>(&self, name: &str, run: F) -> StepDef
    where
        F: Fn(Arc<SessionSteps>, StepContext) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<StepResult, StepError>> + Send + 'static,
    {
        let steps = self.steps.clone();
        // An event too large for the stream is dropped by the store, judged
        // by the stream's own capacity, and never sinks the commit.
        StepDef::new(name, move |ctx: StepContext| run(steps.clone(), ctx))
    }
}
