//! An idempotent-write tool component: it records each payment under the
//! idempotency key it was given, so a retried call overwrites instead of
//! paying twice.
//!
//! With a directory granted at `/ledger`, each key becomes one file there whose
//! content is the arguments and the attempt that wrote it. Without the grant it
//! only reports what it would have recorded.

use std::path::PathBuf;

use dex::agents::types::ToolEffect;

wit_bindgen::generate!({ path: "../../wit", world: "dex:agents/tool" });

const LEDGER_DIR: &str = "/ledger";

struct LedgerTool;

/// Keys look like `<flow>/<turn>/<call>`; a file name cannot hold `/`.
fn file_name_for(key: &str) -> String {
    key.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '~'
            }
        })
        .collect()
}

impl Guest for LedgerTool {
    fn list_tools() -> Vec<ToolSpec> {
        vec![ToolSpec {
            name: "record_payment".to_string(),
            description: "Records a payment once per idempotency key.".to_string(),
            parameters_schema:
                r#"{"type":"object","properties":{"amount":{"type":"number"}},"required":["amount"]}"#
                    .to_string(),
            effect: Some(ToolEffect::IdempotentWrite),
        }]
    }

    fn call(call: DeferredToolExecution) -> Result<String, ToolError> {
        if call.tool_call.tool_name != "record_payment" {
            return Err(ToolError::Execution(format!(
                "ledger-tool has no tool {:?}",
                call.tool_call.tool_name
            )));
        }
        let entry = serde_json::json!({
            "idempotency_key": call.idempotency_key,
            "attempt": call.attempt,
            "arguments": call.tool_call.arguments,
        })
        .to_string();
        let dir = PathBuf::from(LEDGER_DIR);
        if dir.is_dir() {
            let path = dir.join(file_name_for(&call.idempotency_key));
            std::fs::write(&path, &entry).map_err(|err| {
                ToolError::Internal(format!("cannot write {}: {err}", path.display()))
            })?;
        }
        Ok(entry)
    }
}

export!(LedgerTool);
