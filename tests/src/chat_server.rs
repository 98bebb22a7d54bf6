//! A loopback HTTP server that speaks OpenAI's streaming chat-completions
//! protocol, replaying recorded transcripts (`tests/fixtures/openai`) the
//! way real servers send them: CRLF line endings, `: keep-alive` comments, and
//! the body split at arbitrary bytes (inside JSON strings and UTF-8
//! characters). It records every request it gets.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use serde_json::Value;

use crate::repo_root;

/// A transcript from `tests/fixtures/openai` (copied from the shared
/// fixtures).
pub fn openai_fixture(name: &str) -> String {
    let path: PathBuf = repo_root()
        .join("tests")
        .join("fixtures")
        .join("openai")
        .join(name);
    std::fs::read_to_string(&path)
        .unwrap_or_else(|err| panic!("cannot read fixture {}: {err}", path.display()))
}

/// A streamed answer of `text` in OpenAI's chunk format, cut into words.
pub fn text_transcript(text: &str, usage: (u64, u64)) -> String {
    let mut chunks = vec![chunk(
        serde_json::json!({"role": "assistant", "content": ""}),
        None,
    )];
    for word in text.split_inclusive(' ') {
        chunks.push(chunk(serde_json::json!({"content": word}), None));
    }
    chunks.push(chunk(serde_json::json!({}), Some("stop")));
    transcript(chunks, usage)
}

/// A streamed answer that calls `calls` (id, tool name, arguments), each
/// call's arguments split over two chunks.
pub fn tool_calls_transcript(calls: &[(&str, &str, Value)], usage: (u64, u64)) -> String {
    let mut chunks = vec![chunk(
        serde_json::json!({"role": "assistant", "content": null}),
        None,
    )];
    for (index, (id, name, arguments)) in calls.iter().enumerate() {
        let arguments = arguments.to_string();
        let (head, tail) = arguments.split_at(arguments.len() / 2);
        chunks.push(chunk(
            serde_json::json!({"tool_calls": [{"index": index, "id": id, "type": "function",
                "function": {"name": name, "arguments": head}}]}),
            None,
        ));
        chunks.push(chunk(
            serde_json::json!({"tool_calls": [{"index": index, "function": {"arguments": tail}}]}),
            None,
        ));
    }
    chunks.push(chunk(serde_json::json!({}), Some("tool_calls")));
    transcript(chunks, usage)
}

fn chunk(delta: Value, finish_reason: Option<&str>) -> Value {
    serde_json::json!({
        "id": "chatcmpl-kit", "object": "chat.completion.chunk", "created": 1764460001,
        "model": "gpt-4o-mini", "usage": null,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    })
}

fn transcript(mut chunks: Vec<Value>, (input, output): (u64, u64)) -> String {
    chunks.push(serde_json::json!({
        "id": "chatcmpl-kit", "object": "chat.completion.chunk", "created": 1764460001,
        "model": "gpt-4o-mini", "choices": [],
        "usage": {"prompt_tokens": input, "completion_tokens": output, "total_tokens": input + output},
    }));
    let mut text: String = chunks.iter().map(|c| format!("data: {c}\n\n")).collect();
    text.push_str("data: [DONE]\n\n");
    text
}

/// What the server answers to one request.
#[derive(Clone, Debug)]
pub enum Reply {
    /// A transcript, re-sent with CRLF, keep-alive comments and the body cut
    /// into pieces of `piece` bytes.
    Stream { transcript: String, piece: usize },
    /// The transcript without its `data: [DONE]`: the connection just ends.
    Truncated { transcript: String },
    /// An error status with an OpenAI-style error body.
    Error { status: u16, message: String },
    /// An error status with a `Retry-After` header, as a rate limit sends.
    Refused { status: u16, retry_after: String },
}

/// A request the server received.
#[derive(Clone, Debug)]
pub struct ReceivedRequest {
    pub authorization: Option<String>,
    /// Every header, by lower-case name.
    pub headers: std::collections::BTreeMap<String, String>,
    pub body: Value,
    /// When it arrived.
    pub at: std::time::Instant,
}

#[derive(Default)]
struct ServerState {
    replies: Mutex<VecDeque<Reply>>,
    requests: Mutex<Vec<ReceivedRequest>>,
}

/// The server; it stops when dropped.
pub struct ReplayChatServer {
    /// `http://127.0.0.1:<port>/v1`
    pub base_url: String,
    state: Arc<ServerState>,
    task: tokio::task::JoinHandle<()>,
}

impl ReplayChatServer {
    pub async fn start(replies: Vec<Reply>) -> Self {
        let state = Arc::new(ServerState {
            replies: Mutex::new(replies.into()),
            requests: Mutex::new(Vec::new()),
        });
        let app = Router::new()
            .route("/v1/chat/completions", post(complete))
            .route("/v1/models", axum::routing::get(models))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|err| panic!("bind the chat server: {err}"));
        let port = listener
            .local_addr()
            .unwrap_or_else(|err| panic!("chat server address: {err}"))
            .port();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self {
            base_url: format!("http://127.0.0.1:{port}/v1"),
            state,
            task,
        }
    }

    pub fn requests(&self) -> Vec<ReceivedRequest> {
        self.state
            .requests
            .lock()
            .map(|r| r.clone())
            .unwrap_or_default()
    }
}

impl Drop for ReplayChatServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The transcript as a real server sends it.
fn as_sent(transcript: &str, keep_done: bool) -> Vec<u8> {
    let mut out = String::from(": keep-alive\r\n\r\n");
    for (i, event) in transcript
        .split("\n\n")
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .enumerate()
    {
        if !keep_done && event == "data: [DONE]" {
            continue;
        }
        if i % 3 == 2 {
            out.push_str(": keep-alive\r\n\r\n");
        }
        out.push_str(&event.replace('\n', "\r\n"));
        out.push_str("\r\n\r\n");
    }
    out.into_bytes()
}

fn pieces(bytes: Vec<u8>, piece: usize) -> Body {
    let chunks: Vec<Bytes> = bytes
        .chunks(piece.max(1))
        .map(Bytes::copy_from_slice)
        .collect();
    let stream = futures_util::stream::unfold(chunks.into_iter(), |mut rest| async move {
        let next = rest.next()?;
        // Separate writes, so the client really sees the pieces.
        tokio::time::sleep(Duration::from_micros(200)).await;
        Some((Ok::<Bytes, Infallible>(next), rest))
    });
    Body::from_stream(stream)
}

/// `GET /v1/models`, as OpenAI answers it: 401 without a key.
async fn models(headers: HeaderMap) -> Response {
    if headers.get(header::AUTHORIZATION).is_none() && headers.get("api-key").is_none() {
        return (
            StatusCode::UNAUTHORIZED,
            axum::Json(serde_json::json!({"error": {"message": "You didn't provide an API key."}})),
        )
            .into_response();
    }
    axum::Json(
        serde_json::json!({"object": "list", "data": [{"id": "gpt-4o-mini", "object": "model"}]}),
    )
    .into_response()
}

async fn complete(
    State(state): State<Arc<ServerState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    if let Ok(mut requests) = state.requests.lock() {
        requests.push(ReceivedRequest {
            authorization: headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string),
            headers: headers
                .iter()
                .map(|(name, value)| {
                    (
                        name.as_str().to_string(),
                        String::from_utf8_lossy(value.as_bytes()).into_owned(),
                    )
                })
                .collect(),
            body,
            at: std::time::Instant::now(),
        });
    }
    let reply = state.replies.lock().ok().and_then(|mut r| r.pop_front());
    let sse = [(header::CONTENT_TYPE, "text/event-stream")];
    match reply {
        Some(Reply::Stream { transcript, piece }) => {
            (sse, pieces(as_sent(&transcript, true), piece)).into_response()
        }
        Some(Reply::Truncated { transcript }) => {
            (sse, pieces(as_sent(&transcript, false), 64)).into_response()
        }
        Some(Reply::Error { status, message }) => (
            StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            axum::Json(serde_json::json!({
                "error": {"message": message, "type": "invalid_request_error"}
            })),
        )
            .into_response(),
        Some(Reply::Refused {
            status,
            retry_after,
        }) => (
            StatusCode::from_u16(status).unwrap_or(StatusCode::TOO_MANY_REQUESTS),
            [(header::RETRY_AFTER, retry_after)],
            axum::Json(serde_json::json!({
                "error": {"message": "Rate limit reached", "type": "requests"}
            })),
        )
            .into_response(),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            "the replay server has no replies left",
        )
            .into_response(),
    }
}
