//! `openai`: an OpenAI-compatible chat-completions client (OpenAI, vLLM,
//! llama.cpp, Ollama...). It streams (`"stream": true` with usage), writes
//! text deltas to the call's events as they arrive, and assembles tool calls
//! from their fragments. The key stays in the host; the runner never sees it.

use std::time::Duration;

use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use serde_json::{json, Value};

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};

use super::openai_stream::{Assembly, Chunk};
use super::retry::{self, RetryPolicy};
use crate::plugin::factors::model::ModelFuture;
use crate::plugin::wit::{MessageRole, ModelError, ModelRequest, ModelResponse};
use crate::plugin::{EventWriter, GuestEvent, ModelProvider};

/// The most text and tool-call arguments one response may carry.
pub const MAX_RESPONSE_BYTES: usize = 8 << 20;

/// Where the provider is and which model it runs.
#[derive(Clone, PartialEq, Eq)]
pub struct OpenAiConfig {
    /// Up to and including `/v1`, for example `https://api.openai.com/v1`.
    pub base_url: String,
    /// Sent as a bearer token; none for local servers that need none.
    pub api_key: Option<String>,
    pub model: String,
    /// The longest wait for the next piece of the stream.
    pub idle_timeout: Duration,
    /// Sent with every request: a gateway's own headers, or Azure OpenAI's
    /// `api-key` in place of the bearer token.
    pub headers: Vec<(String, String)>,
    /// How a 429 or a 5xx is asked again within the call.
    pub retry: RetryPolicy,
}

impl std::fmt::Debug for OpenAiConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Header values and the key are secrets as often as not.
        let header_names: Vec<&str> = self.headers.iter().map(|(n, _)| n.as_str()).collect();
        f.debug_struct("OpenAiConfig")
            .field("base_url", &self.base_url)
            .field("api_key", &self.api_key.as_ref().map(|_| "<set>"))
            .field("model", &self.model)
            .field("idle_timeout", &self.idle_timeout)
            .field("headers", &header_names)
            .field("retry", &self.retry)
            .finish()
    }
}

impl OpenAiConfig {
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into(),
            api_key: None,
            model: model.into(),
            idle_timeout: Duration::from_secs(120),
            headers: Vec::new(),
            retry: RetryPolicy::default(),
        }
    }

    /// Adds a header sent with every request.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
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
        let mut headers = HeaderMap::new();
        for (name, value) in &config.headers {
            let name = HeaderName::from_bytes(name.as_bytes())
                .map_err(|err| anyhow::anyhow!("header name {name:?}: {err}"))?;
            // The value may be a secret: never repeat it.
            let mut value = HeaderValue::from_str(value).map_err(|_| {
                anyhow::anyhow!("header {name}: its value is not a valid header value")
            })?;
            value.set_sensitive(true);
            headers.append(name, value);
        }
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            // A redirect would carry the key and the configured headers
            // (reqwest strips only `Authorization` across hosts): none.
            .redirect(reqwest::redirect::Policy::none())
            .default_headers(headers)
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
        let body = request_body(&self.config, &request);
        let mut failures = 0u32;
        loop {
            let refusal = match self.send(&body).await {
                Ok(response) => return self.read_stream(response, events).await,
                Err(refusal) => refusal,
            };
            let Refusal {
                error,
                status,
                asked,
            } = refusal;
            if !status.is_some_and(retry::retryable) {
                return Err(error);
            }
            failures = failures.saturating_add(1);
            let wait = match self.config.retry.wait(failures, asked) {
                Ok(wait) => wait,
                Err(why) => {
                    return Err(ModelError::Transient(format!(
                        "{}; {why}",
                        error_text(&error)
                    )))
                }
            };
            tracing::info!(
                url = %self.url,
                failures,
                wait_ms = wait.as_millis() as u64,
                error = %error_text(&error),
                "the model provider refused the request; asking again after the wait"
            );
            tokio::time::sleep(wait).await;
        }
    }

    /// Sends the request; an answer other than a success is a [`Refusal`].
    async fn send(&self, body: &Value) -> Result<reqwest::Response, Refusal> {
        let mut call = self.http.post(&self.url).json(body);
        if let Some(key) = &self.config.api_key {
            call = call.bearer_auth(key);
        }
        let idle = self.config.idle_timeout;
        let response = tokio::time::timeout(idle, call.send())
            .await
            .map_err(|_| {
                Refusal::unanswered(ModelError::Transient(format!(
                    "{} did not answer within {idle:?}",
                    self.url
                )))
            })?
            .map_err(|err| {
                Refusal::unanswered(ModelError::Transient(format!(
                    "cannot reach {}: {err}",
                    self.url
                )))
            })?;
        let status = response.status();
        if !status.is_success() {
            let asked = retry::retry_after(response.headers());
            // Only the start of an error body matters, and only for so long.
            let body = tokio::time::timeout(idle, response.bytes())
                .await
                .ok()
                .and_then(Result::ok)
                .map(|b| String::from_utf8_lossy(&b[..b.len().min(64 << 10)]).into_owned())
                .unwrap_or_default();
            let message = format!("{} answered {status}: {}", self.url, error_message(&body));
            let transient = retry::retryable(status) || status == reqwest::StatusCode::CONFLICT;
            return Err(Refusal {
                error: if transient {
                    ModelError::Transient(message)
                } else {
                    ModelError::Rejected(message)
                },
                status: Some(status),
                asked,
            });
        }
        Ok(response)
    }

    /// Reads the answer's event stream into the response, writing text
    /// deltas to the call's events as they come.
    async fn read_stream(
        &self,
        response: reqwest::Response,
        events: &EventWriter,
    ) -> Result<ModelResponse, ModelError> {
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

/// A request that got no success: its error, the status (none when no
/// answer came) and the wait the provider asked for.
struct Refusal {
    error: ModelError,
    status: Option<reqwest::StatusCode>,
    asked: Option<Duration>,
}

impl Refusal {
    fn unanswered(error: ModelError) -> Self {
        Self {
            error,
            status: None,
            asked: None,
        }
    }
}

fn error_text(error: &ModelError) -> &str {
    match error {
        ModelError::Transient(text) | ModelError::Rejected(text) => text,
        _ => "",
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
                // Every tool's schema was checked at load (see
                // `plugin::tool_schema`); a fake provider's may not be.
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
