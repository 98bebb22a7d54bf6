//! AgentSessionOptions: how one agent's sessions run.

use std::collections::BTreeMap;
use std::time::Duration;

use super::flow::RUN_MODEL_TIMEOUT;
use super::limits::TurnLimits;
use super::policy::{ToolPolicies, ToolPolicyOverride};
use super::records::{ToolEffect, ToolPolicy};

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
