//! What the benchmarks share: a Step tag and a tool call.

use dexa::plugin::wit::{
    DeferredToolExecution, ToolCallRecord, ToolCallStatus, ToolEffect, ToolPolicy,
};
use dexa::plugin::{CallEnv, StepTag};

pub fn env() -> CallEnv {
    CallEnv::new(StepTag {
        flow_id: "bench".into(),
        turn_id: "turn-1".into(),
        step_execution_id: "step".into(),
        attempt: 1,
    })
}

/// An approved read of `tool` with `arguments`, on attempt 1.
pub fn tool_call(tool: &str, arguments: &str) -> DeferredToolExecution {
    DeferredToolExecution {
        flow_id: "bench".into(),
        turn_id: "turn-1".into(),
        tool_call: ToolCallRecord {
            tool_call_id: "c1".into(),
            tool_name: tool.into(),
            arguments: arguments.into(),
            policy: ToolPolicy {
                effect: ToolEffect::Read,
                requires_approval: false,
            },
            status: ToolCallStatus::Approved,
            output: None,
            error: None,
            rejection_message: None,
            deferral_order: 0,
        },
        idempotency_key: "bench/turn-1/c1".into(),
        attempt: 1,
    }
}
