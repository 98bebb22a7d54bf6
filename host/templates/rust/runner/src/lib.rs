//! `__NAME__`: a runner component for dexa, the plain agent loop.
//!
//! Each `run-model-step` sends the conversation and the session's tools to
//! the host's model (`model.complete`). Tool calls in the answer become
//! deferred tool calls, each its own durable Step on the host; the next
//! `run-model-step` sends their outcomes back. An answer without tool calls
//! ends the turn. Try it on the scripted model with the project's
//! `dexa.toml`:
//!
//!     dexa demo -c dexa.toml --agent __NAME__ --message "Hello"
//!
//! Config keys (`[components.__NAME__] config = {...}`): `system_prompt`,
//! `history_window` (default 50, the newest messages the model sees).
//!
//! Every call runs in a fresh instance that is dropped afterwards: what a
//! turn needs between its model calls travels in `framework-run-state`.
//! A long session can also be compacted: return `turn-outcome::compacted`
//! with a summary (see the guest authors' guide).

mod conversation;

use conversation::{window, Item, ItemToolCall, RunState};
use dex::agents::types::{
    DeferredToolCall, HistoryOrder, MessageRole, ModelMessage, ModelRequest, ModelToolCall,
    ToolCallsRequested, TurnCompleted,
};
use dex::agents::{config, model, policy};

wit_bindgen::generate!({ path: "wit", world: "dex:agents/runner" });

struct Component;

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

fn framework_message(item: &Item) -> Result<FrameworkMessage, String> {
    Ok(FrameworkMessage {
        role: role_of(&item.role),
        framework_item: serde_json::to_string(item).map_err(|err| err.to_string())?,
        text: item.content.clone(),
    })
}

/// The newest `history_window` stored messages, oldest first: one page read
/// from the host, so a session of 10,000 messages costs what one of 50 does.
fn history(turn: &TurnContext) -> Vec<Item> {
    let window_size = config::get("history_window")
        .and_then(|v| v.trim().parse::<u32>().ok())
        .unwrap_or(50)
        .clamp(1, 500);
    let since = turn.compaction.as_ref().map_or(0, |c| c.through_sequence);
    let length = turn.history.length();
    let mut page = turn
        .history
        .read(since + 1, length, HistoryOrder::NewestFirst, window_size);
    page.reverse();
    page.iter()
        .map(|m| Item::stored(&m.framework_item, role_name(m.role), m.text.as_deref()))
        .collect()
}

impl Guest for Component {
    fn build_user_message(text: String) -> FrameworkMessage {
        let item = Item::text("user", Some(text.clone()));
        FrameworkMessage {
            role: MessageRole::User,
            framework_item: serde_json::to_string(&item).unwrap_or_default(),
            text: Some(text),
        }
    }

    fn run_model_step(turn: TurnContext) -> Result<TurnOutcome, String> {
        // An `Err` fails this attempt; the host retries RunModel.
        let mut state = match &turn.framework_run_state {
            None => RunState::default(),
            Some(text) => serde_json::from_str::<RunState>(text)
                .map_err(|err| format!("the run state is not __NAME__'s: {err}"))?,
        };
        for id in std::mem::take(&mut state.pending) {
            let record = turn
                .tool_calls
                .iter()
                .find(|r| r.tool_call_id == id)
                .ok_or_else(|| format!("no record for tool call {id:?}"))?;
            state.items.push(Item {
                tool_call_id: Some(id.clone()),
                ..Item::text("tool", Some(policy::describe_tool_call_outcome(record)))
            });
        }

        let mut messages = Vec::new();
        if let Some(prompt) = config::get("system_prompt").filter(|p| !p.trim().is_empty()) {
            messages.push(to_model(&Item::text("system", Some(prompt))));
        }
        if let Some(compaction) = &turn.compaction {
            messages.push(to_model(&Item::text(
                "system",
                compaction.summary.text.clone(),
            )));
        }
        messages.extend(window(history(&turn)).iter().map(to_model));
        messages.extend(state.items.iter().map(to_model));
        let request = ModelRequest {
            messages,
            tools: turn.tools.clone(),
            temperature: None,
            max_output_tokens: None,
        };
        let response =
            model::complete(&request).map_err(|err| format!("the model call failed: {err:?}"))?;
        let answer = Item {
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
            ..Item::text("assistant", response.message.content.clone())
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
                usage: response.usage,
            }));
        }
        let tool_calls: Vec<DeferredToolCall> = answer
            .tool_calls
            .iter()
            .map(|call| DeferredToolCall {
                tool_call_id: call.id.clone(),
                tool_name: call.name.clone(),
                arguments: call.arguments.clone(),
                // The tool's declared effect is the framework's; the
                // operator's policy in dexa.toml still wins.
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
            usage: response.usage,
        }))
    }

    fn execute_deferred_tool_call(call: DeferredToolExecution) -> Result<String, ToolError> {
        // Tools served by tool components never come here; a runner that
        // runs tools of its framework in-process would.
        Err(ToolError::Execution(format!(
            "__NAME__ runs no tools itself ({:?})",
            call.tool_call.tool_name
        )))
    }
}

export!(Component);
