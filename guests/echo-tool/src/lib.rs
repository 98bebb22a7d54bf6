//! A read-only tool component used by the tests and the sandbox benchmark.
//!
//! Tools:
//! - `echo`: returns its arguments unchanged (the trivial tool of the benchmark);
//! - `count_calls`: bumps a global counter and returns it. Every call runs in a
//!   fresh instance, so it must always return 1;
//! - `describe_call`: returns the call as JSON (key, attempt, ids), so tests can
//!   check what crossed the boundary;
//! - `emit_events`: heartbeats and writes one event of each kind;
//! - `fail`: returns an execution error (the model should see it);
//! - `internal_fail`: returns an internal error (a Step failure);
//! - `trap`: panics, which traps the instance;
//! - `spin`: loops forever, until the host's deadline stops it.

use std::sync::atomic::{AtomicU32, Ordering};

use dex::agents::types::{ToolCallStatus, ToolEffect};
use dex::agents::{events, step};

wit_bindgen::generate!({ path: "../../wit", world: "dex:agents/tool" });

static CALLS: AtomicU32 = AtomicU32::new(0);

struct EchoTool;

fn spec(name: &str, description: &str) -> ToolSpec {
    ToolSpec {
        name: name.to_string(),
        description: description.to_string(),
        parameters_schema: r#"{"type":"object"}"#.to_string(),
        effect: Some(ToolEffect::Read),
    }
}

impl Guest for EchoTool {
    fn list_tools() -> Vec<ToolSpec> {
        vec![
            spec("echo", "Returns its arguments."),
            spec(
                "count_calls",
                "Returns how many calls this instance has seen.",
            ),
            spec("describe_call", "Returns the call as the tool saw it."),
            spec("emit_events", "Writes one event of each kind."),
            spec("fail", "Fails with an error the model sees."),
            spec("internal_fail", "Fails with an internal error."),
            spec("trap", "Traps."),
            spec("spin", "Never returns."),
        ]
    }

    fn call(call: DeferredToolExecution) -> Result<String, ToolError> {
        let record = &call.tool_call;
        match record.tool_name.as_str() {
            "echo" => Ok(record.arguments.clone()),
            "count_calls" => Ok((CALLS.fetch_add(1, Ordering::SeqCst) + 1).to_string()),
            "describe_call" => Ok(serde_json::json!({
                "flow_id": call.flow_id,
                "turn_id": call.turn_id,
                "tool_call_id": record.tool_call_id,
                "idempotency_key": call.idempotency_key,
                "attempt": call.attempt,
                "arguments": record.arguments,
            })
            .to_string()),
            "emit_events" => {
                step::heartbeat();
                events::write_text_delta("hello ");
                events::write_reasoning_delta("thinking");
                events::write_tool_call_started(&record.tool_call_id, "inner");
                events::write_tool_call_finished(
                    &record.tool_call_id,
                    "inner",
                    ToolCallStatus::Succeeded,
                );
                events::write_event("custom", r#"{"n":1}"#);
                Ok("emitted".to_string())
            }
            "fail" => Err(ToolError::Execution(format!(
                "echo-tool refused: {}",
                record.arguments
            ))),
            "internal_fail" => Err(ToolError::Internal("echo-tool broke".to_string())),
            "trap" => panic!("echo-tool was asked to trap"),
            "spin" => {
                let mut n: u64 = 0;
                loop {
                    n = std::hint::black_box(n.wrapping_add(1));
                }
            }
            other => Err(ToolError::Execution(format!(
                "echo-tool has no tool {other:?}"
            ))),
        }
    }
}

export!(EchoTool);
