//! `chat-runner`: the plain agent loop, as a runner component. Each
//! `run-model-step` sends the conversation and the session's tools to the
//! host's model (`model.complete`); tool calls in the answer become deferred
//! tool calls (each its own durable Step on the host), and the next step
//! sends their outcomes back to the model. An answer without tool calls ends
//! the turn.
//!
//! Config keys: `system_prompt`, `temperature`, `max_output_tokens`,
//! `compact_after` (default 100; `0` turns compaction off), `compact_keep`
//! (default 20), `compact_chunk` (default 400) and `history_window` (default
//! 200).
//!
//! The prompt is the newest compaction's summary, if any, and the messages
//! after it (at most the newest `history_window`), read from the host's
//! history a page at a time. When a turn begins with more than
//! `compact_after` messages after the summary, the turn's first model call
//! writes a new summary instead: of the old summary and the messages after
//! it but the newest `compact_keep`, at most `compact_chunk` of them (an
//! imported history of thousands is caught up over several turns), each cut
//! to 2,000 characters. The host then calls the runner again with it. So
//! the prompt stays bounded however long the session lives, and the full
//! history stays stored.
//!
//! Each stored message's `framework_item` is the model message as JSON, so
//! later turns replay the conversation to the model exactly, tool calls
//! included.

use dex::agents::types::{
    AgentMessage, DeferredToolCall, History, HistoryCompacted, HistoryOrder, MessageRole,
    ModelMessage, ModelRequest, ModelToolCall, ToolCallRecord, ToolCallsRequested, TurnCompleted,
    Usage,
};
use dex::agents::{config, model, policy};
use serde::{Deserialize, Serialize};

wit_bindgen::generate!({ path: "../../wit", world: "dex:agents/runner" });

struct ChatRunner;

/// A model message as JSON (the framework item).
#[derive(Serialize, Deserialize, Clone)]
struct Item {
    role: String,
    #[serde(default)]
    content: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<ItemToolCall>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tool_call_id: Option<String>,
}

#[derive(Serialize, Deserialize, Clone)]
struct ItemToolCall {
    id: String,
    name: String,
    arguments: String,
}

/// What the runner keeps between the model calls of one turn.
#[derive(Serialize, Deserialize, Default)]
struct RunState {
    /// This turn's messages after the user's: assistant tool calls and tool
    /// results.
    items: Vec<Item>,
    /// Tool calls of the last answer, waiting for their records.
    pending: Vec<String>,
}

fn role_name(role: MessageRole) -> &'static str {
    match role {
        MessageRole::System => "system",
        MessageRole::User => "user",
        MessageRole::Assistant => "assistant",
        MessageRole::Tool => "tool",
    }
}

fn role_of(name: &str) -> MessageRole {
    match name {
        "system" => MessageRole::System,
        "assistant" => MessageRole::Assistant,
        "tool" => MessageRole::Tool,
        _ => MessageRole::User,
    }
}

fn to_model(item: &Item) -> ModelMessage {
    ModelMessage {
        role: role_of(&item.role),
        content: item.content.clone(),
        tool_calls: item
            .tool_calls
            .iter()
            .map(|c| ModelToolCall {
                id: c.id.clone(),
                name: c.name.clone(),
                arguments: c.arguments.clone(),
            })
            .collect(),
        tool_call_id: item.tool_call_id.clone(),
    }
}

/// A stored message back as an item: its own framework item when it is one
/// of ours, else its role and text (messages the host wrote, such as the
/// turn-failure note, were built by `build-user-message` too).
fn stored_item(message: &AgentMessage) -> Item {
    serde_json::from_str::<Item>(&message.framework_item).unwrap_or_else(|_| Item {
        role: role_name(message.role).to_string(),
        content: message.text.clone(),
        tool_calls: Vec::new(),
        tool_call_id: None,
    })
}

fn framework_message(item: &Item) -> Result<FrameworkMessage, String> {
    Ok(FrameworkMessage {
        role: role_of(&item.role),
        framework_item: serde_json::to_string(item).map_err(|err| err.to_string())?,
        text: item.content.clone(),
    })
}

fn outcome_item(record: &ToolCallRecord) -> Item {
    Item {
        role: "tool".to_string(),
        content: Some(policy::describe_tool_call_outcome(record)),
        tool_calls: Vec::new(),
        tool_call_id: Some(record.tool_call_id.clone()),
    }
}

/// The most messages one history page holds.
const PAGE: u32 = 500;

/// Messages `first..=last`, oldest first, a page at a time.
fn read_range(history: &History, first: u64, last: u64) -> Vec<AgentMessage> {
    let mut out = Vec::new();
    let mut next = first.max(1);
    while next <= last {
        let page = history.read(next, last, HistoryOrder::OldestFirst, PAGE);
        let Some(newest) = page.last().map(|m| m.sequence) else {
            break;
        };
        out.extend(page);
        next = newest + 1;
    }
    out
}

fn config_number(key: &str, default: u64) -> u64 {
    config::get(key)
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

fn system(text: String) -> ModelMessage {
    ModelMessage {
        role: MessageRole::System,
        content: Some(text),
        tool_calls: Vec::new(),
        tool_call_id: None,
    }
}

/// The most characters of one message a summary request carries.
const TRANSCRIPT_MESSAGE_CHARS: usize = 2_000;

/// `text` cut to `max` characters, marked when cut.
fn cut(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((at, _)) => format!("{} [...]", &text[..at]),
        None => text.to_string(),
    }
}

/// Messages as a transcript the model can summarize: plain lines, so that no
/// tool call is left without its result, each cut to a bounded length.
fn transcript(messages: &[AgentMessage]) -> String {
    let mut text = String::new();
    for message in messages {
        let item = stored_item(message);
        let mut line = format!("{}: {}", item.role, item.content.as_deref().unwrap_or(""));
        for call in &item.tool_calls {
            line.push_str(&format!(" [calls {}({})]", call.name, call.arguments));
        }
        text.push_str(&cut(&line, TRANSCRIPT_MESSAGE_CHARS));
        text.push('\n');
    }
    text
}

/// The turn's first model call, when the messages after the newest summary
/// are more than `compact_after`: summarize all but the newest
/// `compact_keep` instead of answering.
fn compaction(turn: &TurnContext) -> Result<Option<TurnOutcome>, String> {
    let after = config_number("compact_after", 100);
    if after == 0 || turn.framework_run_state.is_some() {
        return Ok(None);
    }
    let keep = config_number("compact_keep", 20).max(1);
    let length = turn.history.length();
    let since = turn.compaction.as_ref().map_or(0, |c| c.through_sequence);
    if turn
        .compaction
        .as_ref()
        .is_some_and(|c| c.turn_id == turn.turn_id)
        || length.saturating_sub(since) <= after
        || length <= since + keep
    {
        return Ok(None);
    }
    let chunk = config_number("compact_chunk", 400).max(1);
    let through = (length - keep).min(since + chunk);
    let mut prompt = String::from(
        "Summarize the conversation below for your own later use. Keep facts, decisions, \
         names, numbers, open tasks and what each tool did. Reply with the summary only.\n\n",
    );
    if let Some(earlier) = &turn.compaction {
        prompt.push_str("Summary of the conversation before it:\n");
        prompt.push_str(earlier.summary.text.as_deref().unwrap_or(""));
        prompt.push_str("\n\n");
    }
    prompt.push_str(&transcript(&read_range(&turn.history, since + 1, through)));
    let request = ModelRequest {
        messages: vec![ModelMessage {
            role: MessageRole::User,
            content: Some(prompt),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }],
        tools: Vec::new(),
        temperature: None,
        max_output_tokens: config::get("max_output_tokens").and_then(|t| t.parse().ok()),
    };
    let response = model::complete(&request)
        .map_err(|err| format!("the summarizing model call failed: {err:?}"))?;
    let text = format!(
        "Summary of the conversation through message {through}:\n{}",
        response.message.content.unwrap_or_default()
    );
    let summary = Item {
        role: "system".to_string(),
        content: Some(text),
        tool_calls: Vec::new(),
        tool_call_id: None,
    };
    Ok(Some(TurnOutcome::Compacted(HistoryCompacted {
        through_sequence: through,
        summary: framework_message(&summary)?,
        usage: response.usage,
    })))
}

/// The conversation the model sees: the newest summary, then the messages
/// after it, at most the newest `history_window`. A tool result whose call
/// is not in the window (summarized, or cut off) is dropped: a model API
/// refuses one.
fn conversation(turn: &TurnContext) -> Vec<ModelMessage> {
    let mut messages = Vec::new();
    let since = match &turn.compaction {
        Some(compaction) => {
            messages.push(system(
                compaction
                    .summary
                    .text
                    .clone()
                    .unwrap_or_else(|| compaction.summary.framework_item.clone()),
            ));
            compaction.through_sequence
        }
        None => 0,
    };
    let length = turn.history.length();
    let window = config_number("history_window", 200).max(1);
    let first = (since + 1).max((length + 1).saturating_sub(window));
    let mut announced = std::collections::HashSet::new();
    for item in read_range(&turn.history, first, length)
        .iter()
        .map(stored_item)
    {
        if item.role == "tool" {
            let known = item
                .tool_call_id
                .as_ref()
                .is_some_and(|id| announced.contains(id));
            if !known {
                continue;
            }
        }
        for call in &item.tool_calls {
            announced.insert(call.id.clone());
        }
        messages.push(to_model(&item));
    }
    messages
}

impl Guest for ChatRunner {
    fn build_user_message(text: String) -> FrameworkMessage {
        let item = Item {
            role: "user".to_string(),
            content: Some(text.clone()),
            tool_calls: Vec::new(),
            tool_call_id: None,
        };
        FrameworkMessage {
            role: MessageRole::User,
            framework_item: serde_json::to_string(&item).unwrap_or_default(),
            text: Some(text),
        }
    }

    fn run_model_step(turn: TurnContext) -> Result<TurnOutcome, String> {
        let mut state = match &turn.framework_run_state {
            None => RunState::default(),
            Some(text) => serde_json::from_str::<RunState>(text)
                .map_err(|err| format!("run state is not chat-runner's: {err}"))?,
        };
        for id in std::mem::take(&mut state.pending) {
            let record = turn
                .tool_calls
                .iter()
                .find(|r| r.tool_call_id == id)
                .ok_or_else(|| format!("no record for tool call {id:?}"))?;
            state.items.push(outcome_item(record));
        }

        if let Some(compacted) = compaction(&turn)? {
            return Ok(compacted);
        }
        let mut messages = Vec::new();
        if let Some(prompt) = config::get("system_prompt").filter(|p| !p.trim().is_empty()) {
            messages.push(system(prompt));
        }
        messages.extend(conversation(&turn));
        messages.extend(state.items.iter().map(to_model));
        let request = ModelRequest {
            messages,
            tools: turn.tools.clone(),
            temperature: config::get("temperature").and_then(|t| t.parse().ok()),
            max_output_tokens: config::get("max_output_tokens").and_then(|t| t.parse().ok()),
        };
        let response =
            model::complete(&request).map_err(|err| format!("the model call failed: {err:?}"))?;
        let usage = response.usage;
        let answer = Item {
            role: "assistant".to_string(),
            content: response.message.content.clone(),
            tool_calls: response
                .message
                .tool_calls
                .iter()
                .map(|c| ItemToolCall {
                    id: c.id.clone(),
                    name: c.name.clone(),
                    arguments: c.arguments.clone(),
                })
                .collect(),
            tool_call_id: None,
        };
        if answer.tool_calls.is_empty() {
            state.items.push(answer);
            let new_messages = state
                .items
                .iter()
                .map(framework_message)
                .collect::<Result<Vec<_>, _>>()?;
            return Ok(TurnOutcome::Completed(TurnCompleted {
                new_messages,
                usage,
            }));
        }
        let tool_calls: Vec<DeferredToolCall> = answer
            .tool_calls
            .iter()
            .map(|call| DeferredToolCall {
                tool_call_id: call.id.clone(),
                tool_name: call.name.clone(),
                arguments: call.arguments.clone(),
                // The effect the tool declares is the framework's effect;
                // the operator's explicit policy still wins in the host.
                policy: policy::resolve_tool_policy(
                    &call.name,
                    turn.tools
                        .iter()
                        .find(|t| t.name == call.name)
                        .and_then(|t| t.effect),
                ),
            })
            .collect();
        state.pending = tool_calls.iter().map(|c| c.tool_call_id.clone()).collect();
        state.items.push(answer);
        Ok(TurnOutcome::ToolCallsRequested(ToolCallsRequested {
            framework_run_state: serde_json::to_string(&state).map_err(|err| err.to_string())?,
            tool_calls,
            usage: Usage {
                input_tokens: usage.input_tokens,
                output_tokens: usage.output_tokens,
                total_tokens: usage.total_tokens,
            },
        }))
    }

    fn execute_deferred_tool_call(call: DeferredToolExecution) -> Result<String, ToolError> {
        Err(ToolError::Execution(format!(
            "no tool component serves {:?}, and chat-runner runs no tools itself",
            call.tool_call.tool_name
        )))
    }
}

export!(ChatRunner);
