//! `openai`: an OpenAI-compatible chat-completions client (OpenAI, vLLM,
//! llama.cpp, Ollama...). It streams (`"stream": true` with usage), writes
//! text deltas to the call's events as they arrive, and assembles tool calls
//! from their fragments. The key stays in the host; the runner never sees it.

use std::collections::BTreeMap;
use std::time::Duration;

use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::plugin::factors::model::ModelFuture;
use crate::plugin::wit::{
    MessageRole, ModelError, ModelMessage, ModelRequest, ModelResponse, ModelToolCall, Usage,
};
use crate::plugin::{EventWriter, GuestEvent, ModelProvider};

/// The most text and tool-call arguments one response may carry.
pub const MAX_RESPONSE_BYTES: usize = 8 << 20;

/// Where the provider is and which model it runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenAiConfig {
    /// Up to and including `/v1`, for example `https://api.openai.com/v1`.
    pub base_url: String,
    /// Sent as a bearer token; none for local servers that need none.
    pub api_key: Option<String>,
    pub model: String,
    /// The longest wait for the next piece of the stream.
    pub idle_timeout: Duration,
}

impl OpenAiConfig {
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into(),
            api_key: None,
            model: model.into(),
            idle_timeout: Duration::from_secs(120),
        }
    }

    pub fn api_key(mut self, key: impl Into<String>) -> Self {
        self.api_key = Some(key.into());
        self
    }
}

/// The provider. Cheap to share; one connection pool.
pub struct OpenAiProvider {
    config: OpenAiConfig,
    http: reqwest::Client,
    url: String,
}

impl std::fmt::Debug for OpenAiProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        f.debug_struct("OpenAiProvider")
            .field("url", &self.url)
            .field("model", &self.config.model)
            .finish_non_exhaustive()
    }
}

impl OpenAiProvider {
    pub fn new(config: OpenAiConfig) -> anyhow::Result<Self> {
        let base = config.base_url.trim_end_matches('/');
        anyhow::ensure!(
            base.starts_with("http://") || base.starts_with("https://"),
            "the model base URL {base:?} must start with http:// or https://"
        );
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .build()?;
        Ok(Self {
            url: format!("{base}/chat/completions"),
            config,
            http,
        })
    }

    async fn run(
        &self,
        request: ModelRequest,
        events: &EventWriter,
    ) -> Result<ModelResponse, ModelError> {
        let mut call = self
            .http
            .post(&self.url)
            .json(&request_body(&self.config, &request));
        if let Some(key) = &self.config.api_key {
            call = call.bearer_auth(key);
        }
        let idle = self.config.idle_timeout;
        let response = tokio::time::timeout(idle, call.send())
            .await
            .map_err(|_| {
                ModelError::Transient(format!("{} did not answer within {idle:?}", self.url))
            })?
            .map_err(|err| ModelError::Transient(format!("cannot reach {}: {err}", self.url)))?;
        let status = response.status();
        if !status.is_success() {
            // Only the start of an error body matters, and only for so long.
            let body = tokio::time::timeout(idle, response.bytes())
                .await
                .ok()
                .and_then(Result::ok)
                .map(|b| String::from_utf8_lossy(&b[..b.len().min(64 << 10)]).into_owned())
                .unwrap_or_default();
            let message = format!("{} answered {status}: {}", self.url, error_message(&body));
            let retryable = status.is_server_error()
                || status == reqwest::StatusCode::TOO_MANY_REQUESTS
                || status == reqwest::StatusCode::REQUEST_TIMEOUT
                || status == reqwest::StatusCode::CONFLICT;
            return Err(if retryable {
                ModelError::Transient(message)
            } else {
                ModelError::Rejected(message)
            });
        }
        let mut stream = response.bytes_stream().eventsource();
        let mut assembly = Assembly::default();
        loop {
            let next = tokio::time::timeout(self.config.idle_timeout, stream.next())
                .await
                .map_err(|_| {
                    ModelError::Transient(format!(
                        "the stream was idle for {:?}",
                        self.config.idle_timeout
                    ))
                })?;
            let Some(event) = next else {
                return Err(ModelError::Transient(
                    "the stream ended before data: [DONE]".to_string(),
                ));
            };
            let event =
                event.map_err(|err| ModelError::Transient(format!("the stream broke: {err}")))?;
            let data = event.data.trim();
            if data == "[DONE]" {
                break;
            }
            if data.is_empty() {
                continue;
            }
            let chunk: Chunk = serde_json::from_str(data).map_err(|err| {
                ModelError::Transient(format!("a stream chunk is not a completion chunk: {err}"))
            })?;
            let delta = assembly.add(chunk)?;
            if assembly.bytes > MAX_RESPONSE_BYTES {
                return Err(ModelError::Transient(format!(
                    "the response grew past {MAX_RESPONSE_BYTES} bytes"
                )));
            }
            if let Some(delta) = delta {
                // A closed writer only means the call has ended.
                let _ = events.write(GuestEvent::TextDelta { text: delta });
            }
        }
        assembly.finish()
    }
}

impl ModelProvider for OpenAiProvider {
    fn complete<'a>(&'a self, request: ModelRequest, events: &'a EventWriter) -> ModelFuture<'a> {
        Box::pin(self.run(request, events))
    }
}

fn role_name(role: MessageRole) -> &'static str {
    match role {
        MessageRole::System => "system",
        MessageRole::User => "user",
        MessageRole::Assistant => "assistant",
        MessageRole::Tool => "tool",
    }
}

/// The JSON body of `POST /chat/completions`.
pub fn request_body(config: &OpenAiConfig, request: &ModelRequest) -> Value {
    let messages: Vec<Value> = request
        .messages
        .iter()
        .map(|message| {
            let mut out = json!({
                "role": role_name(message.role),
                "content": message.content,
            });
            if !message.tool_calls.is_empty() {
                out["tool_calls"] = message
                    .tool_calls
                    .iter()
                    .map(|call| {
                        json!({
                            "id": call.id,
                            "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments},
                        })
                    })
                    .collect();
            }
            if let Some(id) = &message.tool_call_id {
                out["tool_call_id"] = json!(id);
            }
            out
        })
        .collect();
    let mut body = json!({
        "model": config.model,
        "messages": messages,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if !request.tools.is_empty() {
        body["tools"] = request
            .tools
            .iter()
            .map(|tool| {
                // A schema that is not JSON is sent as an open object.
                let parameters: Value = serde_json::from_str(&tool.parameters_schema)
                    .unwrap_or_else(|_| json!({"type": "object"}));
                json!({
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "description": tool.description,
                        "parameters": parameters,
                    },
                })
            })
            .collect();
    }
    if let Some(temperature) = request.temperature {
        body["temperature"] = json!(temperature);
    }
    if let Some(max) = request.max_output_tokens {
        body["max_tokens"] = json!(max);
    }
    body
}

/// The provider's error text, from `{"error": {"message": ...}}` when it is
/// there.
fn error_message(body: &str) -> String {
    let parsed: Option<String> = serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_string));
    let text = parsed.unwrap_or_else(|| body.trim().to_string());
    text.chars().take(500).collect()
}

#[derive(Deserialize)]
struct Chunk {
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
struct Assembly {
    text: Option<String>,
    tool_calls: BTreeMap<u32, PartialToolCall>,
    finish_reason: Option<String>,
    usage: Option<Usage>,
    /// Bytes of text and arguments so far.
    bytes: usize,
}

impl Assembly {
    /// Adds one chunk; returns its text delta.
    fn add(&mut self, chunk: Chunk) -> Result<Option<String>, ModelError> {
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

    fn finish(self) -> Result<ModelResponse, ModelError> {
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
