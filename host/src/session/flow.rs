//! AgentSessionFlow: one flow type per agent, and the Step
//! definitions (policies, failure routes, locks) the engine runs.

use std::sync::Arc;
use std::time::Duration;

use super::components::AgentComponents;
use super::options::AgentSessionOptions;
use super::records::PENDING_INTERRUPTS;
use super::steps::{step, SessionSteps};
use crate::flow::{FlowType, RetryPolicy, StepContext, StepDef, StepError, StepResult};

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
        let declared = components.iter().flat_map(|c| c.fixed_specs().iter());
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
            .step(self.def(step::CANCEL_TURN, SessionSteps::cancel_turn))
    }

    fn def<F, Fut>(&self, name: &str, run: F) -> StepDef
    where
        F: Fn(Arc<SessionSteps>, StepContext) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<StepResult, StepError>> + Send + 'static,
    {
        let steps = self.steps.clone();
        // An event too large for the stream is dropped by the store, judged
        // by the stream's own capacity, and never sinks the commit.
        let run = Arc::new(run);
        StepDef::new(name, move |ctx: StepContext| {
            let (steps, run) = (steps.clone(), run.clone());
            async move {
                super::steps::join_open_turn(&ctx).await;
                run(steps, ctx).await
            }
        })
    }
}
