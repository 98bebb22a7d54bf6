//! `dex:agents/policy`: the runner asks the host for tool policies and for
//! the rendering of outcomes. The rules are the session's
//! (`session::policy`); the sandbox only carries the questions to them.

use std::sync::Arc;

use crate::plugin::bindings::runner::dex::agents::policy;
use crate::plugin::bindings::wit::{ToolCallRecord, ToolEffect, ToolPolicy};
use crate::plugin::call::CallState;

/// Answers a runner's `policy` import.
pub trait ToolPolicyResolver: Send + Sync {
    /// The policy of a tool by name, given the framework's effect if any.
    fn resolve(&self, tool_name: &str, framework_effect: Option<ToolEffect>) -> ToolPolicy;

    /// The model-visible text of a tool call's outcome.
    fn describe_outcome(&self, record: &ToolCallRecord) -> String;
}

/// The answers of a call that serves no session (a test, `dexa component
/// call`): every tool is of unknown effect and needs approval, and an
/// outcome is its status with its raw text.
pub struct NoPolicies;

impl ToolPolicyResolver for NoPolicies {
    fn resolve(&self, _tool_name: &str, _framework_effect: Option<ToolEffect>) -> ToolPolicy {
        ToolPolicy {
            effect: ToolEffect::Unclassified,
            requires_approval: true,
        }
    }

    fn describe_outcome(&self, record: &ToolCallRecord) -> String {
        let text = record
            .output
            .as_deref()
            .or(record.error.as_deref())
            .or(record.rejection_message.as_deref())
            .unwrap_or_default();
        format!("{:?}: {text}", record.status)
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
        Ok(self.policy.describe_outcome(&tool_call))
    }
}
