//! The **scripted** model provider, for tests and the offline demo: it
//! replays configured responses in order and never contacts a model.
//!
//! It runs inside `dexa serve` and `dexa worker` when a deployment configures
//! `provider = "scripted"`, where a runner decides how big each request is.
//! So it keeps no request: only their count and a bounded summary of the
//! last [`KEPT_REQUESTS`] ([`RequestSummary`]), whatever their size.

use std::collections::VecDeque;
use std::sync::Mutex;

use crate::plugin::factors::model::ModelFuture;
use crate::plugin::wit::{MessageRole, ModelError, ModelMessage, ModelRequest, ModelResponse};
use crate::plugin::{EventWriter, GuestEvent, ModelProvider};

/// How many request summaries the provider keeps (the most recent).
pub const KEPT_REQUESTS: usize = 8;
/// How many messages a summary keeps (the last ones of the request).
pub const KEPT_MESSAGES: usize = 16;
/// How many requested tool calls' names a kept message keeps (the first).
pub const KEPT_CALL_NAMES: usize = 4;
/// How many bytes of each kept string a summary keeps (cut at a character
/// boundary).
pub const KEPT_TEXT_BYTES: usize = 512;
/// The most text the provider keeps, whatever the requests: each kept
/// message keeps at most its content, its call id and [`KEPT_CALL_NAMES`]
/// names, each at most [`KEPT_TEXT_BYTES`] (384 KiB).
pub const MAX_KEPT_TEXT_BYTES: usize =
    KEPT_REQUESTS * KEPT_MESSAGES * (2 + KEPT_CALL_NAMES) * KEPT_TEXT_BYTES;

/// What the scripted provider keeps of one request: enough for a test to
/// check what a runner sent, and bounded however large the request was.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestSummary {
    /// The request's size: the bytes of all its strings (contents, ids,
    /// names, arguments and tool specs).
    pub bytes: usize,
    /// How many messages it had; [`Self::messages`] holds the last
    /// [`KEPT_MESSAGES`] of them.
    pub message_count: usize,
    /// How many tools it offered the model.
    pub tool_count: usize,
    /// The last [`KEPT_MESSAGES`] messages, oldest first.
    pub messages: Vec<MessageSummary>,
}

/// One message of a [`RequestSummary`].
#[derive(Clone, Debug, PartialEq)]
pub struct MessageSummary {
    pub role: MessageRole,
    /// The first [`KEPT_TEXT_BYTES`] of the content.
    pub content: Option<String>,
    /// The whole content's length in bytes.
    pub content_bytes: usize,
    /// The first [`KEPT_TEXT_BYTES`] of the id of the call this message
    /// answers.
    pub tool_call_id: Option<String>,
    /// The first [`KEPT_TEXT_BYTES`] of each requested tool's name, for the
    /// first [`KEPT_CALL_NAMES`] calls.
    pub tool_call_names: Vec<String>,
}

/// At most `KEPT_TEXT_BYTES` of `text`, cut at a character boundary.
fn prefix(text: &str) -> String {
    let mut end = text.len().min(KEPT_TEXT_BYTES);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

fn message_bytes(message: &ModelMessage) -> usize {
    message.content.as_ref().map_or(0, String::len)
        + message.tool_call_id.as_ref().map_or(0, String::len)
        + message
            .tool_calls
            .iter()
            .map(|c| c.id.len() + c.name.len() + c.arguments.len())
            .sum::<usize>()
}

impl RequestSummary {
    /// Summarises `request`; nothing of it is kept beyond the prefixes.
    pub fn of(request: &ModelRequest) -> Self {
        let skip = request.messages.len().saturating_sub(KEPT_MESSAGES);
        let messages = request.messages[skip..]
            .iter()
            .map(|m| MessageSummary {
                role: m.role,
                content: m.content.as_deref().map(prefix),
                content_bytes: m.content.as_ref().map_or(0, String::len),
                tool_call_id: m.tool_call_id.as_deref().map(prefix),
                tool_call_names: m
                    .tool_calls
                    .iter()
                    .take(KEPT_CALL_NAMES)
                    .map(|c| prefix(&c.name))
                    .collect(),
            })
            .collect();
        let tool_bytes: usize = request
            .tools
            .iter()
            .map(|t| t.name.len() + t.description.len() + t.parameters_schema.len())
            .sum();
        Self {
            bytes: request.messages.iter().map(message_bytes).sum::<usize>() + tool_bytes,
            message_count: request.messages.len(),
            tool_count: request.tools.len(),
            messages,
        }
    }

    /// The heap bytes this summary owns (beyond its own struct).
    fn heap_bytes(&self) -> usize {
        let strings = |m: &MessageSummary| {
            m.content.as_ref().map_or(0, String::capacity)
                + m.tool_call_id.as_ref().map_or(0, String::capacity)
                + m.tool_call_names
                    .iter()
                    .map(|n| n.capacity() + std::mem::size_of::<String>())
                    .sum::<usize>()
        };
        self.messages.capacity() * std::mem::size_of::<MessageSummary>()
            + self.messages.iter().map(strings).sum::<usize>()
    }
}

/// The requests seen so far: a count and the last few summaries.
#[derive(Default)]
struct Seen {
    count: u64,
    recent: VecDeque<RequestSummary>,
}

/// A provider that replays the given responses in order and never contacts
/// a model (see the module docs for what it keeps of the requests).
pub struct ScriptedModelProvider {
    responses: Mutex<VecDeque<ModelResponse>>,
    seen: Mutex<Seen>,
    /// Replays the responses again from the start once they run out.
    repeat: bool,
}

impl ScriptedModelProvider {
    /// A provider that answers with `responses`, in order, then runs out.
    pub fn new(responses: impl IntoIterator<Item = ModelResponse>) -> Self {
        Self {
            responses: Mutex::new(responses.into_iter().collect()),
            seen: Mutex::new(Seen::default()),
            repeat: false,
        }
    }

    /// Starts over after the last response instead of running out (for
    /// demos that serve more than one session).
    pub fn repeating(mut self) -> Self {
        self.repeat = true;
        self
    }

    /// Summaries of the last [`KEPT_REQUESTS`] requests, oldest first.
    pub fn requests(&self) -> Vec<RequestSummary> {
        self.seen
            .lock()
            .map(|seen| seen.recent.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// How many requests the provider has received in all.
    pub fn request_count(&self) -> u64 {
        self.seen.lock().map(|seen| seen.count).unwrap_or_default()
    }

    /// The bytes the provider holds for the requests it has seen: bounded by
    /// [`KEPT_REQUESTS`] summaries (at most [`MAX_KEPT_TEXT_BYTES`] of text),
    /// whatever the requests' number and size.
    pub fn held_bytes(&self) -> usize {
        self.seen
            .lock()
            .map(|seen| {
                seen.recent.capacity() * std::mem::size_of::<RequestSummary>()
                    + seen
                        .recent
                        .iter()
                        .map(RequestSummary::heap_bytes)
                        .sum::<usize>()
            })
            .unwrap_or_default()
    }

    fn record(&self, request: &ModelRequest) {
        let summary = RequestSummary::of(request);
        if let Ok(mut seen) = self.seen.lock() {
            seen.count += 1;
            if seen.recent.len() == KEPT_REQUESTS {
                seen.recent.pop_front();
            }
            seen.recent.push_back(summary);
        }
    }
}

impl ModelProvider for ScriptedModelProvider {
    fn complete<'a>(&'a self, request: ModelRequest, events: &'a EventWriter) -> ModelFuture<'a> {
        Box::pin(async move {
            self.record(&request);
            // The request is not needed to answer: free it now rather than
            // when the call's future is dropped.
            drop(request);
            let next = self.responses.lock().ok().and_then(|mut responses| {
                let next = responses.pop_front()?;
                if self.repeat {
                    responses.push_back(next.clone());
                }
                Some(next)
            });
            let response = next.ok_or_else(|| {
                ModelError::NotAvailable("the scripted model has no responses left".to_string())
            })?;
            if let Some(content) = &response.message.content {
                for word in content.split_inclusive(' ') {
                    // A closed writer only means the call has ended.
                    let _ = events.write(GuestEvent::TextDelta {
                        text: word.to_string(),
                    });
                }
            }
            Ok(response)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin::wit::{ModelToolCall, ToolSpec};

    #[test]
    fn the_provider_holds_at_most_its_bound_whatever_the_requests() {
        let big = "x".repeat(64 << 10);
        let message = ModelMessage {
            role: MessageRole::Assistant,
            content: Some(big.clone()),
            tool_calls: (0..100)
                .map(|n| ModelToolCall {
                    id: format!("{n}{big}"),
                    name: big.clone(),
                    arguments: big.clone(),
                })
                .collect(),
            tool_call_id: Some(big.clone()),
        };
        let request = ModelRequest {
            messages: vec![message; 40],
            tools: vec![
                ToolSpec {
                    name: big.clone(),
                    description: big.clone(),
                    parameters_schema: big.clone(),
                    effect: None,
                };
                10
            ],
            temperature: None,
            max_output_tokens: None,
        };
        let provider = ScriptedModelProvider::new([]);
        for _ in 0..20 {
            provider.record(&request);
        }
        assert_eq!(provider.request_count(), 20);
        let summary = &provider.requests()[0];
        assert_eq!(summary.message_count, 40);
        assert_eq!(summary.messages.len(), KEPT_MESSAGES);
        assert_eq!(
            summary.bytes,
            40 * (2 * big.len() + 100 * (3 * big.len() + 2) - 10) + 30 * big.len()
        );
        // The structs themselves add a little to the text's bound.
        let structs = KEPT_REQUESTS
            * (std::mem::size_of::<RequestSummary>()
                + KEPT_MESSAGES * (std::mem::size_of::<MessageSummary>() + KEPT_CALL_NAMES * 24));
        let held = provider.held_bytes();
        assert!(held <= MAX_KEPT_TEXT_BYTES + structs, "{held} bytes held");
        assert!(
            held > MAX_KEPT_TEXT_BYTES / 2,
            "{held}: the test fills the summaries"
        );
    }

    #[test]
    fn a_summary_keeps_a_prefix_cut_at_a_character_boundary() {
        let text = "é".repeat(KEPT_TEXT_BYTES);
        let kept = prefix(&text);
        assert!(kept.len() <= KEPT_TEXT_BYTES && kept.len() >= KEPT_TEXT_BYTES - 1);
        assert!(text.starts_with(&kept));
    }
}
