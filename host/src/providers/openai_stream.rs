//! The pieces of an OpenAI-compatible completion stream (`data:` chunks)
//! and their assembly into one response: text deltas in order, tool calls
//! from their fragments by index, the usage the provider reports.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;

use crate::plugin::wit::{
    MessageRole, ModelError, ModelMessage, ModelResponse, ModelToolCall, Usage,
};

#[derive(Deserialize)]
pub(super) struct Chunk {
    #[serde(default)]
    choices: Vec<Choice>,
    #[serde(default)]
    usage: Option<ChunkUsage>,
    #[serde(default)]
    error: Option<Value>,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    index: u32,
    #[serde(default)]
    delta: Option<Delta>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize, Default)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    tool_calls: Vec<ToolCallFragment>,
}

#[derive(Deserialize)]
struct ToolCallFragment {
    index: u32,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    function: Option<FunctionFragment>,
}

#[derive(Deserialize)]
struct FunctionFragment {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
}

#[derive(Deserialize)]
struct ChunkUsage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    #[serde(default)]
    total_tokens: u64,
}

#[derive(Default)]
struct PartialToolCall {
    id: String,
    name: String,
    arguments: String,
}

/// A response put together from its chunks.
#[derive(Default)]
pub(super) struct Assembly {
    text: Option<String>,
    tool_calls: BTreeMap<u32, PartialToolCall>,
    finish_reason: Option<String>,
    usage: Option<Usage>,
    /// Bytes of text and arguments so far.
    pub(super) bytes: usize,
}

impl Assembly {
    /// Adds one chunk; returns its text delta.
    pub(super) fn add(&mut self, chunk: Chunk) -> Result<Option<String>, ModelError> {
        if let Some(error) = chunk.error {
            let message = error["message"]
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| error.to_string());
            return Err(ModelError::Transient(format!(
                "the provider failed mid-stream: {message}"
            )));
        }
        if let Some(usage) = chunk.usage {
            self.usage = Some(Usage {
                input_tokens: usage.prompt_tokens,
                output_tokens: usage.completion_tokens,
                total_tokens: usage
                    .total_tokens
                    .max(usage.prompt_tokens.saturating_add(usage.completion_tokens)),
            });
        }
        let mut text_delta: Option<String> = None;
        // Only the first choice is used (n = 1).
        for choice in chunk.choices.into_iter().filter(|c| c.index == 0) {
            if let Some(reason) = choice.finish_reason {
                self.finish_reason = Some(reason);
            }
            let Some(delta) = choice.delta else {
                continue;
            };
            if let Some(content) = delta.content.filter(|c| !c.is_empty()) {
                self.bytes += content.len();
                self.text.get_or_insert_with(String::new).push_str(&content);
                text_delta
                    .get_or_insert_with(String::new)
                    .push_str(&content);
            }
            for fragment in delta.tool_calls {
                let call = self.tool_calls.entry(fragment.index).or_default();
                if let Some(id) = fragment.id.filter(|id| !id.is_empty()) {
                    call.id = id;
                }
                if let Some(function) = fragment.function {
                    if let Some(name) = function.name.filter(|n| !n.is_empty()) {
                        call.name = name;
                    }
                    if let Some(arguments) = function.arguments {
                        self.bytes += arguments.len();
                        call.arguments.push_str(&arguments);
                    }
                }
            }
        }
        Ok(text_delta)
    }

    pub(super) fn finish(self) -> Result<ModelResponse, ModelError> {
        let mut tool_calls = Vec::with_capacity(self.tool_calls.len());
        for (index, call) in self.tool_calls {
            if call.id.is_empty() || call.name.is_empty() {
                return Err(ModelError::Transient(format!(
                    "tool call {index} of the response has no id or no name"
                )));
            }
            tool_calls.push(ModelToolCall {
                id: call.id,
                name: call.name,
                arguments: if call.arguments.is_empty() {
                    "{}".to_string()
                } else {
                    call.arguments
                },
            });
        }
        let finish_reason = self.finish_reason.unwrap_or_else(|| "unknown".to_string());
        Ok(ModelResponse {
            message: ModelMessage {
                role: MessageRole::Assistant,
                content: self.text,
                tool_calls,
                tool_call_id: None,
            },
            usage: self.usage.unwrap_or(Usage {
                input_tokens: 0,
                output_tokens: 0,
                total_tokens: 0,
            }),
            finish_reason,
        })
    }
}
