//! A non-idempotent-write tool component: every call appends one line to an
//! outbox, so running it twice sends twice. The host must never repeat it.
//!
//! With a directory granted at `/outbox`, the line goes to `/outbox/sent.log`
//! and the output says how many lines the log now holds.

use std::io::Write;

use dex::agents::types::ToolEffect;

wit_bindgen::generate!({ path: "../../wit", world: "dex:agents/tool" });

const OUTBOX_LOG: &str = "/outbox/sent.log";

struct NotifyTool;

impl Guest for NotifyTool {
    fn list_tools() -> Vec<ToolSpec> {
        vec![ToolSpec {
            name: "send_notification".to_string(),
            description: "Sends a notification. Each call sends one.".to_string(),
            parameters_schema:
                r#"{"type":"object","properties":{"message":{"type":"string"}},"required":["message"]}"#
                    .to_string(),
            effect: Some(ToolEffect::NonIdempotentWrite),
        }]
    }

    fn call(call: DeferredToolExecution) -> Result<String, ToolError> {
        if call.tool_call.tool_name != "send_notification" {
            return Err(ToolError::Execution(format!(
                "notify-tool has no tool {:?}",
                call.tool_call.tool_name
            )));
        }
        let line = format!("{}\t{}\n", call.idempotency_key, call.tool_call.arguments);
        if !std::path::Path::new("/outbox").is_dir() {
            return Ok("sent (no outbox granted)".to_string());
        }
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(OUTBOX_LOG)
            .map_err(|err| ToolError::Internal(format!("cannot open {OUTBOX_LOG}: {err}")))?;
        file.write_all(line.as_bytes())
            .map_err(|err| ToolError::Internal(format!("cannot append to {OUTBOX_LOG}: {err}")))?;
        drop(file);
        let sent = std::fs::read_to_string(OUTBOX_LOG)
            .map_err(|err| ToolError::Internal(format!("cannot read {OUTBOX_LOG}: {err}")))?
            .lines()
            .count();
        Ok(format!("sent #{sent}"))
    }
}

export!(NotifyTool);
