//! `dex:agents/policy`: tool policies and the model-visible text of outcomes.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::plugin::bindings::runner::dex::agents::policy;
use crate::plugin::bindings::wit::{ToolCallRecord, ToolCallStatus, ToolEffect, ToolPolicy};
use crate::plugin::call::CallState;

/// Resolves the policy of a tool by name.
pub trait ToolPolicyResolver: Send + Sync {
    fn resolve(&self, tool_name: &str, framework_effect: Option<ToolEffect>) -> ToolPolicy;
}

/// An operator's explicit policy for one tool. `requires_approval: None` takes
/// the effect's default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ToolPolicyOverride {
    pub effect: ToolEffect,
    pub requires_approval: Option<bool>,
}

/// Whether an effect needs approval when nothing says otherwise: writes that
/// cannot be repeated safely do.
pub fn is_approval_required(effect: ToolEffect) -> bool {
    matches!(
        effect,
        ToolEffect::NonIdempotentWrite | ToolEffect::Unclassified
    )
}

/// The spec's resolution: explicit policy, else the framework's effect, else
/// the session's default effect.
#[derive(Clone, Debug)]
pub struct ToolPolicies {
    pub explicit: BTreeMap<String, ToolPolicyOverride>,
    pub default_effect: ToolEffect,
}

impl Default for ToolPolicies {
    fn default() -> Self {
        Self {
            explicit: BTreeMap::new(),
            default_effect: ToolEffect::Unclassified,
        }
    }
}

impl ToolPolicyResolver for ToolPolicies {
    fn resolve(&self, tool_name: &str, framework_effect: Option<ToolEffect>) -> ToolPolicy {
        if let Some(explicit) = self.explicit.get(tool_name) {
            return ToolPolicy {
                effect: explicit.effect,
                requires_approval: explicit
                    .requires_approval
                    .unwrap_or_else(|| is_approval_required(explicit.effect)),
            };
        }
        let effect = framework_effect.unwrap_or(self.default_effect);
        ToolPolicy {
            effect,
            requires_approval: is_approval_required(effect),
        }
    }
}

/// The model-visible text for a tool-call record. The host's turn-failure note
/// and every runner (through the `policy` import) use this one rendering.
pub fn describe_tool_call_outcome(record: &ToolCallRecord) -> String {
    match record.status {
        ToolCallStatus::Succeeded => record.output.clone().unwrap_or_default(),
        ToolCallStatus::Failed => format!(
            "Tool call failed: {}",
            record.error.as_deref().unwrap_or("no error message")
        ),
        ToolCallStatus::Rejected => match record.rejection_message.as_deref() {
            Some(message) if !message.trim().is_empty() => {
                format!("Tool call was rejected: {message}")
            }
            _ => "Tool call was rejected.".to_string(),
        },
        ToolCallStatus::OutcomeUnknown => format!(
            "Tool call outcome is unknown; it may or may not have taken effect: {}",
            record.error.as_deref().unwrap_or("no detail")
        ),
        ToolCallStatus::Pending | ToolCallStatus::Approved => {
            "Tool call has not finished.".to_string()
        }
    }
}

pub(crate) type SharedPolicyResolver = Arc<dyn ToolPolicyResolver>;

impl policy::Host for CallState {
    fn resolve_tool_policy(
        &mut self,
        name: String,
        framework_effect: Option<ToolEffect>,
    ) -> wasmtime::Result<ToolPolicy> {
        Ok(self.policy.resolve(&name, framework_effect))
    }

    fn describe_tool_call_outcome(
        &mut self,
        tool_call: ToolCallRecord,
    ) -> wasmtime::Result<String> {
        Ok(describe_tool_call_outcome(&tool_call))
    }
}
