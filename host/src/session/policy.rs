//! Tool policies: which effect a tool call has and whether it waits for an
//! approval, decided by the session, once, for the runner's `policy` import
//! and for the calls it defers alike; and the one model-visible rendering of
//! a tool call's outcome.
//!
//! Precedence, strongest first: the operator's explicit policy, then the
//! effect the tool component declares in `list-tools` (which the host holds
//! and the runner cannot change), then the runner's framework effect, then
//! the session's default. A runner may only make a call stricter: a stricter
//! effect or an approval it asks for is kept, a laxer one is ignored.

use std::collections::BTreeMap;

use crate::plugin::wit::{ToolCallRecord, ToolCallStatus, ToolEffect, ToolPolicy, ToolSpec};
use crate::plugin::ToolPolicyResolver;

/// Whether an effect needs approval when nothing says otherwise: writes that
/// cannot be repeated safely do.
pub fn is_approval_required(effect: ToolEffect) -> bool {
    matches!(
        effect,
        ToolEffect::NonIdempotentWrite | ToolEffect::Unclassified
    )
}

/// How much caution an effect asks for: a read least, an unknown effect most.
fn caution(effect: ToolEffect) -> u8 {
    match effect {
        ToolEffect::Read => 0,
        ToolEffect::IdempotentWrite => 1,
        ToolEffect::NonIdempotentWrite => 2,
        ToolEffect::Unclassified => 3,
    }
}

/// The more cautious of two effects.
pub fn stricter(a: ToolEffect, b: ToolEffect) -> ToolEffect {
    if caution(b) > caution(a) {
        b
    } else {
        a
    }
}

/// An operator's explicit policy for one tool. `requires_approval: None` takes
/// the effect's default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ToolPolicyOverride {
    pub effect: ToolEffect,
    pub requires_approval: Option<bool>,
}

/// The policies of one agent's tools.
#[derive(Clone, Debug)]
pub struct ToolPolicies {
    /// The operator's explicit policies, by tool name.
    pub explicit: BTreeMap<String, ToolPolicyOverride>,
    /// The effects the agent's tool components declare, by tool name.
    pub declared: BTreeMap<String, ToolEffect>,
    /// The effect of a tool nothing else classifies.
    pub default_effect: ToolEffect,
}

impl Default for ToolPolicies {
    fn default() -> Self {
        Self {
            explicit: BTreeMap::new(),
            declared: BTreeMap::new(),
            default_effect: ToolEffect::Unclassified,
        }
    }
}

impl ToolPolicies {
    /// Adds the effects that tool components declare in `list-tools`.
    pub fn with_declared<'a>(mut self, specs: impl IntoIterator<Item = &'a ToolSpec>) -> Self {
        for spec in specs {
            if let Some(effect) = spec.effect {
                self.declared.insert(spec.name.clone(), effect);
            }
        }
        self
    }

    /// The policy of `tool_name`, given the framework's effect if it has one.
    pub fn resolve(&self, tool_name: &str, framework_effect: Option<ToolEffect>) -> ToolPolicy {
        if let Some(explicit) = self.explicit.get(tool_name) {
            return ToolPolicy {
                effect: explicit.effect,
                requires_approval: explicit
                    .requires_approval
                    .unwrap_or_else(|| is_approval_required(explicit.effect)),
            };
        }
        let effect = match (self.declared.get(tool_name), framework_effect) {
            // The framework may only add caution to what the tool declares.
            (Some(declared), Some(framework)) => stricter(*declared, framework),
            (Some(declared), None) => *declared,
            (None, Some(framework)) => framework,
            (None, None) => self.default_effect,
        };
        ToolPolicy {
            effect,
            requires_approval: is_approval_required(effect),
        }
    }

    /// The policy a deferred call runs under: what [`Self::resolve`] says
    /// for the effect the runner reported, made stricter (never laxer) by
    /// the runner's own policy.
    pub fn decide(&self, tool_name: &str, reported: ToolPolicy) -> ToolPolicy {
        let resolved = self.resolve(tool_name, Some(reported.effect));
        ToolPolicy {
            effect: stricter(resolved.effect, reported.effect),
            requires_approval: resolved.requires_approval || reported.requires_approval,
        }
    }
}

impl ToolPolicyResolver for ToolPolicies {
    fn resolve(&self, tool_name: &str, framework_effect: Option<ToolEffect>) -> ToolPolicy {
        ToolPolicies::resolve(self, tool_name, framework_effect)
    }

    fn describe_outcome(&self, record: &ToolCallRecord) -> String {
        describe_tool_call_outcome(record)
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

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [ToolEffect; 4] = [
        ToolEffect::Read,
        ToolEffect::IdempotentWrite,
        ToolEffect::NonIdempotentWrite,
        ToolEffect::Unclassified,
    ];

    fn policy(effect: ToolEffect, requires_approval: bool) -> ToolPolicy {
        ToolPolicy {
            effect,
            requires_approval,
        }
    }

    /// Generated WIT records have no `PartialEq` (a record with a resource
    /// cannot); compare a policy by its fields.
    fn fields(policy: ToolPolicy) -> (ToolEffect, bool) {
        (policy.effect, policy.requires_approval)
    }

    fn declaring(tool: &str, effect: ToolEffect) -> ToolPolicies {
        let mut policies = ToolPolicies::default();
        policies.declared.insert(tool.to_string(), effect);
        policies
    }

    #[test]
    fn a_runner_cannot_under_declare_what_the_tool_declares() {
        let policies = declaring("pay", ToolEffect::NonIdempotentWrite);
        let decided = policies.decide("pay", policy(ToolEffect::Read, false));
        assert_eq!(fields(decided), (ToolEffect::NonIdempotentWrite, true));
        // The runner's import says the same, whatever effect it passes.
        assert_eq!(
            fields(policies.resolve("pay", Some(ToolEffect::Read))),
            (ToolEffect::NonIdempotentWrite, true)
        );
    }

    #[test]
    fn a_runner_may_make_any_call_stricter_and_never_laxer() {
        for declared in ALL {
            let policies = declaring("t", declared);
            for reported in ALL {
                for asks in [false, true] {
                    let decided = policies.decide("t", policy(reported, asks));
                    assert!(caution(decided.effect) >= caution(declared));
                    assert!(caution(decided.effect) >= caution(reported));
                    assert!(decided.requires_approval >= asks);
                    assert!(decided.requires_approval >= is_approval_required(declared));
                }
            }
        }
    }

    #[test]
    fn precedence_is_explicit_then_declared_then_framework_then_default() {
        let mut policies = declaring("t", ToolEffect::IdempotentWrite);
        policies.explicit.insert(
            "t".into(),
            ToolPolicyOverride {
                effect: ToolEffect::Read,
                requires_approval: Some(true),
            },
        );
        assert_eq!(
            fields(policies.resolve("t", Some(ToolEffect::Unclassified))),
            (ToolEffect::Read, true),
            "the operator's policy wins"
        );
        let policies = declaring("t", ToolEffect::IdempotentWrite);
        assert_eq!(
            fields(policies.resolve("t", None)),
            (ToolEffect::IdempotentWrite, false),
            "then the tool's declaration"
        );
        assert_eq!(
            fields(policies.resolve("other", Some(ToolEffect::Read))),
            (ToolEffect::Read, false),
            "then the framework's effect"
        );
        assert_eq!(
            fields(policies.resolve("other", None)),
            (ToolEffect::Unclassified, true),
            "then the default"
        );
    }
}
