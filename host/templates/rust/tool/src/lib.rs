//! `__NAME__`: a tool component for dexa.
//!
//! It serves one tool, `__IDENT__`, which counts the words, characters and
//! lines of `{"text": "..."}`. Change `stats.rs` and the spec below, then
//! `./build.sh` (or `dexa build`) and try it:
//!
//!     dexa component call build/__NAME__.wasm __IDENT__ --args '{"text": "a b"}'
//!
//! Every call runs in a fresh instance that is dropped afterwards: keep no
//! state between calls. Declare the tool's effect truthfully: it decides
//! whether the host retries a call, and whether a person must approve it.

mod stats;

use dex::agents::types::ToolEffect;
use dex::agents::{config, step};

wit_bindgen::generate!({ path: "wit", world: "dex:agents/tool" });

const SCHEMA: &str =
    r#"{"type":"object","properties":{"text":{"type":"string"}},"required":["text"]}"#;

struct Component;

impl Guest for Component {
    fn list_tools() -> Vec<ToolSpec> {
        vec![ToolSpec {
            name: "__IDENT__".to_string(),
            description: "Counts the words, characters and lines of a text.".to_string(),
            parameters_schema: SCHEMA.to_string(),
            effect: Some(ToolEffect::Read),
        }]
    }

    fn call(call: DeferredToolExecution) -> Result<String, ToolError> {
        let record = &call.tool_call;
        if record.tool_name != "__IDENT__" {
            return Err(ToolError::Execution(format!(
                "__NAME__ serves no tool {:?}",
                record.tool_name
            )));
        }
        // The model wrote the arguments: a mistake in them is an `execution`
        // error, which the model sees and may correct. `internal` is for a
        // fault of the tool itself; the host retries it as the effect allows.
        let arguments: serde_json::Value = serde_json::from_str(&record.arguments)
            .map_err(|err| ToolError::Execution(format!("the arguments are not JSON: {err}")))?;
        let Some(text) = arguments.get("text").and_then(|t| t.as_str()) else {
            return Err(ToolError::Execution(
                r#"expected {"text": "..."}"#.to_string(),
            ));
        };
        // A long call tells the host it is alive.
        step::heartbeat();
        let mut answer = serde_json::to_value(stats::stats(text))
            .map_err(|err| ToolError::Internal(err.to_string()))?;
        // Config comes from dexa.toml (`[components.<name>] config = {...}`)
        // or `dexa component call --config KEY=VALUE`.
        if let (Some(note), Some(object)) = (config::get("note"), answer.as_object_mut()) {
            object.insert("note".to_string(), note.into());
        }
        Ok(answer.to_string())
    }
}

export!(Component);
