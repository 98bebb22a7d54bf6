//! `scripted-runner`: a runner component that follows a script instead of a
//! model. It exists for tests, benchmarks and the offline demo, and it is named
//! for what it is.
//!
//! # Where the script comes from
//! 1. the component's config key `script` (JSON text), else
//! 2. the turn's user message, when its text is a JSON object with `steps`
//!    (a script for that one turn), else
//! 3. a built-in turn that answers `echo: <user text>`.
//!
//! # Script format
//! ```json
//! {"turns": [{"steps": [STEP, ...]}, ...]}
//! ```
//! Turn `turn-<n>` plays `turns[n-1]`; a turn past the end plays the last one.
//! Each `run-model-step` plays the next STEP of its turn. A STEP is one of
//! ```json
//! {"text": "final answer", "deltas": ["final ", "answer"]}
//! {"tool_calls": [{"id": "c1", "name": "echo", "arguments": {"x": 1}, "effect": "read"}]}
//! {"text": "Let me look.", "tool_calls": [...]}   (streams the text first)
//! {"model": true}
//! {"compact": {"keep": 2, "summary": "text"}}
//! ```
//! and may also carry `"usage": {"input": 10, "output": 5}`,
//! `"fail_attempts": N` (attempts 1..=N return an error),
//! `"trap_attempts": N` (attempts 1..=N trap), `"fail_after_deltas": N`
//! (attempts 1..=N stream the step's deltas, then fail), `"heartbeat": true` and
//! `"model_twice": true` (with `model`: calls the model a second time and
//! appends that call's result to the answer, to test the host's one-call rule),
//! `"run_state": "..."` (overrides the run state it returns, to test the host's
//! checks), `"log": "name"` (appends `name <flow>/<turn>#<attempt>` to
//! `/gates/invocations.log`, to count model calls across processes),
//! `"sleep_ms": N` (then waits, like a model's latency), `"tool_events":
//! ["id", ...]` (writes a started and a succeeded finished tool event for
//! each id, as a framework running its own tools would), `"events": [{"type":
//! "name", "payload": {...}}]` (writes each as a custom event) and
//! `"gate": "name"` (logs the same way, creates `/gates/<name>.reached` and
//! waits up to 60 s for `/gates/<name>.release`, then creates
//! `/gates/<name>.passed`; crash tests kill the worker there, cancel tests
//! look for the `.passed` a stopped call never writes). Both need `/gates` granted. `effect` is the framework effect passed to `resolve-tool-policy`;
//! a tool call's `"requires_approval"` overrides the policy it returned.
//!
//! A `compact` step returns `compacted` through the history's length minus
//! `keep` (or through `"through": N`, to test the host's checks); the host
//! then runs the step again with that compaction in its context, and the
//! runner moves on to the next step.
//!
//! Every step reads the newest `history_window` messages (config, default
//! 50) after the newest compaction from the host's history, a page at a
//! time: the user's text comes from them, and a `model` step sends them
//! (after the summary) to the model.
//!
//! The config key `user_role` makes `build-user-message` use another role, to
//! test the host's check that it is `user`; `refuse_notes` makes it trap on
//! the host's turn-failure note.

use dex::agents::types::{
    AgentMessage, DeferredToolCall, History, HistoryCompacted, HistoryOrder, MessageRole,
    ModelMessage, ModelRequest, ModelToolCall, ToolCallRecord, ToolCallStatus, ToolCallsRequested,
    ToolEffect, TurnCompleted, Usage,
};
use dex::agents::{config, events, model, policy, step};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

wit_bindgen::generate!({ path: "../../wit", world: "dex:agents/runner" });

struct ScriptedRunner;

#[derive(Deserialize, Default)]
struct Script {
    #[serde(default)]
    turns: Vec<TurnScript>,
}

#[derive(Deserialize, Clone)]
struct TurnScript {
    steps: Vec<StepScript>,
}

#[derive(Deserialize, Clone, Default)]
struct StepScript {
    text: Option<String>,
    deltas: Option<Vec<String>>,
    tool_calls: Option<Vec<ScriptedToolCall>>,
    #[serde(default)]
    model: bool,
    #[serde(default)]
    model_twice: bool,
    usage: Option<ScriptedUsage>,
    #[serde(default)]
    fail_attempts: u32,
    #[serde(default)]
    trap_attempts: u32,
    #[serde(default)]
    fail_after_deltas: u32,
    #[serde(default)]
    heartbeat: bool,
    run_state: Option<String>,
    log: Option<String>,
    gate: Option<String>,
    /// Milliseconds to wait first, like a model's latency.
    #[serde(default)]
    sleep_ms: u64,
    /// Tool call ids to write started/finished events for.
    #[serde(default)]
    tool_events: Vec<String>,
    /// Custom events to write, in order.
    #[serde(default)]
    events: Vec<ScriptedEvent>,
    /// Summarize the history instead of answering.
    compact: Option<ScriptedCompaction>,
}

/// A `compact` step.
#[derive(Deserialize, Clone, Default)]
struct ScriptedCompaction {
    /// How many of the newest messages stay after the summary.
    #[serde(default)]
    keep: u64,
    /// Compacts through this sequence instead (to test the host's checks).
    through: Option<u64>,
    #[serde(default)]
    summary: String,
}

/// A custom event (`events.write-event`) a step writes.
#[derive(Deserialize, Clone)]
struct ScriptedEvent {
    #[serde(rename = "type")]
    event_type: String,
    #[serde(default)]
    payload: Value,
}

#[derive(Deserialize, Clone)]
struct ScriptedToolCall {
    id: String,
    name: String,
    #[serde(default)]
    arguments: Value,
    effect: Option<String>,
    /// Overrides the resolved policy's approval (a lying runner, to test
    /// that the host does not let a runner skip an approval).
    #[serde(default)]
    requires_approval: Option<bool>,
}

#[derive(Deserialize, Clone, Copy, Default)]
struct ScriptedUsage {
    #[serde(default)]
    input: u64,
    #[serde(default)]
    output: u64,
}

/// What the runner keeps between the model calls of one turn.
#[derive(Serialize, Deserialize, Default)]
struct RunState {
    /// The index of the next step of the turn's script.
    step: usize,
    /// Framework items produced so far in this turn.
    items: Vec<Value>,
    /// Tool calls of the last step, waiting for their records.
    pending: Vec<String>,
}

fn usage_of(step: &StepScript) -> Usage {
    let scripted = step.usage.unwrap_or_default();
    Usage {
        input_tokens: scripted.input,
        output_tokens: scripted.output,
        total_tokens: scripted.input + scripted.output,
    }
}

fn effect_named(name: &str) -> Result<ToolEffect, String> {
    match name {
        "read" => Ok(ToolEffect::Read),
        "idempotent_write" | "idempotent-write" => Ok(ToolEffect::IdempotentWrite),
        "non_idempotent_write" | "non-idempotent-write" => Ok(ToolEffect::NonIdempotentWrite),
        "unclassified" => Ok(ToolEffect::Unclassified),
        other => Err(format!("script names an unknown effect {other:?}")),
    }
}

fn turn_number(turn_id: &str) -> Result<usize, String> {
    turn_id
        .strip_prefix("turn-")
        .and_then(|n| n.parse::<usize>().ok())
        .filter(|n| *n >= 1)
        .ok_or_else(|| format!("turn id {turn_id:?} is not turn-<n>"))
}

/// The newest `history_window` messages after the newest compaction,
/// oldest first, read a page at a time.
fn window(turn: &TurnContext) -> Vec<AgentMessage> {
    let size = config::get("history_window")
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(50);
    let length = turn.history.length();
    let since = turn.compaction.as_ref().map_or(0, |c| c.through_sequence);
    let first = (since + 1).max(length.saturating_sub(size) + 1);
    read_range(&turn.history, first, length)
}

/// Messages `first..=last`, oldest first.
fn read_range(history: &History, first: u64, last: u64) -> Vec<AgentMessage> {
    let mut out = Vec::new();
    let mut next = first.max(1);
    while next <= last {
        let page = history.read(next, last, HistoryOrder::OldestFirst, 500);
        let Some(newest) = page.last().map(|m| m.sequence) else {
            break;
        };
        out.extend(page);
        next = newest + 1;
    }
    out
}

fn compacted(turn: &TurnContext, compact: &ScriptedCompaction) -> TurnOutcome {
    let length = turn.history.length();
    let through = compact
        .through
        .unwrap_or_else(|| length.saturating_sub(compact.keep));
    TurnOutcome::Compacted(HistoryCompacted {
        through_sequence: through,
        summary: FrameworkMessage {
            role: MessageRole::System,
            framework_item: json!({"type": "summary", "text": compact.summary}).to_string(),
            text: Some(compact.summary.clone()),
        },
        usage: Usage {
            input_tokens: 0,
            output_tokens: 0,
            total_tokens: 0,
        },
    })
}

fn last_user_text(messages: &[AgentMessage]) -> String {
    messages
        .iter()
        .rev()
        .find(|m| m.role == MessageRole::User)
        .and_then(|m| m.text.clone())
        .unwrap_or_default()
}

/// Picks the turn's script: config, then the user's message, then echo.
fn turn_script(turn_id: &str, messages: &[AgentMessage]) -> Result<TurnScript, String> {
    if let Some(text) = config::get("script") {
        let script: Script =
            serde_json::from_str(&text).map_err(|err| format!("config key script: {err}"))?;
        let n = turn_number(turn_id)?;
        let turn = script
            .turns
            .get(n - 1)
            .or(script.turns.last())
            .ok_or("config key script has no turns")?;
        return Ok(turn.clone());
    }
    let user_text = last_user_text(messages);
    if let Ok(turn) = serde_json::from_str::<TurnScript>(&user_text) {
        return Ok(turn);
    }
    Ok(TurnScript {
        steps: vec![StepScript {
            text: Some(format!("echo: {user_text}")),
            ..StepScript::default()
        }],
    })
}

fn log_invocation(name: &str, call: &str) -> Result<(), String> {
    use std::io::Write;
    let mut log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open("/gates/invocations.log")
        .map_err(|err| format!("no /gates directory granted: {err}"))?;
    // One write per line, so that concurrent calls do not interleave.
    log.write_all(format!("{name} {call}\n").as_bytes())
        .map_err(|err| err.to_string())
}

fn gate(name: &str, call: &str) -> Result<(), String> {
    log_invocation(name, call)?;
    std::fs::write(format!("/gates/{name}.reached"), call).map_err(|err| err.to_string())?;
    let started = std::time::Instant::now();
    while !std::path::Path::new(&format!("/gates/{name}.release")).exists() {
        if started.elapsed() > std::time::Duration::from_secs(60) {
            return Err(format!("gate {name} was not released within 60 s"));
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    std::fs::write(format!("/gates/{name}.passed"), call).map_err(|err| err.to_string())?;
    Ok(())
}

fn record_item(record: &ToolCallRecord) -> Value {
    json!({
        "type": "tool_result",
        "tool_call_id": record.tool_call_id,
        "tool_name": record.tool_name,
        "content": policy::describe_tool_call_outcome(record),
    })
}

/// Calls the host's model with the conversation so far and turns its answer
/// into an outcome.
fn model_step(
    turn: &TurnContext,
    window: &[AgentMessage],
    mut state: RunState,
    twice: bool,
) -> Result<TurnOutcome, String> {
    let summary = turn.compaction.as_ref().map(|c| ModelMessage {
        role: MessageRole::System,
        content: c.summary.text.clone(),
        tool_calls: Vec::new(),
        tool_call_id: None,
    });
    let mut messages: Vec<ModelMessage> = summary
        .into_iter()
        .chain(window.iter().map(|m| ModelMessage {
            role: m.role,
            content: m.text.clone(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }))
        .collect();
    for item in &state.items {
        if item["type"] == "tool_result" {
            messages.push(ModelMessage {
                role: MessageRole::Tool,
                content: item["content"].as_str().map(str::to_string),
                tool_calls: Vec::new(),
                tool_call_id: item["tool_call_id"].as_str().map(str::to_string),
            });
        } else if item["type"] == "assistant_tool_calls" {
            let calls = item["calls"].as_array().cloned().unwrap_or_default();
            messages.push(ModelMessage {
                role: MessageRole::Assistant,
                content: None,
                tool_calls: calls
                    .iter()
                    .map(|c| ModelToolCall {
                        id: c["id"].as_str().unwrap_or_default().to_string(),
                        name: c["name"].as_str().unwrap_or_default().to_string(),
                        arguments: c["arguments"].as_str().unwrap_or("{}").to_string(),
                    })
                    .collect(),
                tool_call_id: None,
            });
        }
    }
    let request = ModelRequest {
        messages,
        tools: turn.tools.clone(),
        temperature: None,
        max_output_tokens: None,
    };
    let response =
        model::complete(&request).map_err(|err| format!("model call failed: {err:?}"))?;
    let second = twice.then(|| match model::complete(&request) {
        Ok(_) => "second call: answered".to_string(),
        Err(err) => format!("second call: {err:?}"),
    });
    if response.message.tool_calls.is_empty() {
        let mut text = response.message.content.unwrap_or_default();
        if let Some(second) = second {
            text = format!("{text} | {second}");
        }
        state.items.push(json!({"type": "text", "text": text}));
        return Ok(completed(state, response.usage));
    }
    let calls = response
        .message
        .tool_calls
        .into_iter()
        .map(|c| ScriptedToolCall {
            id: c.id,
            name: c.name,
            arguments: Value::String(c.arguments),
            effect: None,
            requires_approval: None,
        })
        .collect::<Vec<_>>();
    request_tools(state, &calls, response.usage, None)
}

fn completed(state: RunState, usage: Usage) -> TurnOutcome {
    let new_messages = state
        .items
        .into_iter()
        .map(|item| {
            let role = match item["type"].as_str() {
                Some("tool_result") => MessageRole::Tool,
                _ => MessageRole::Assistant,
            };
            let text = match item["type"].as_str() {
                Some("text") => item["text"].as_str().map(str::to_string),
                Some("tool_result") => item["content"].as_str().map(str::to_string),
                _ => None,
            };
            FrameworkMessage {
                role,
                framework_item: item.to_string(),
                text,
            }
        })
        .collect();
    TurnOutcome::Completed(TurnCompleted {
        new_messages,
        usage,
    })
}

fn request_tools(
    mut state: RunState,
    calls: &[ScriptedToolCall],
    usage: Usage,
    run_state_override: Option<String>,
) -> Result<TurnOutcome, String> {
    let mut deferred = Vec::with_capacity(calls.len());
    for call in calls {
        let framework_effect = call.effect.as_deref().map(effect_named).transpose()?;
        let arguments = match &call.arguments {
            Value::String(text) => text.clone(),
            other => other.to_string(),
        };
        let mut policy = policy::resolve_tool_policy(&call.name, framework_effect);
        if let Some(required) = call.requires_approval {
            policy.requires_approval = required;
        }
        deferred.push(DeferredToolCall {
            tool_call_id: call.id.clone(),
            tool_name: call.name.clone(),
            arguments: arguments.clone(),
            policy,
        });
    }
    state.items.push(json!({
        "type": "assistant_tool_calls",
        "calls": deferred.iter().map(|c| json!({
            "id": c.tool_call_id, "name": c.tool_name, "arguments": c.arguments,
        })).collect::<Vec<_>>(),
    }));
    state.pending = deferred.iter().map(|c| c.tool_call_id.clone()).collect();
    let framework_run_state = match run_state_override {
        Some(text) => text,
        None => serde_json::to_string(&state).map_err(|err| err.to_string())?,
    };
    Ok(TurnOutcome::ToolCallsRequested(ToolCallsRequested {
        framework_run_state,
        tool_calls: deferred,
        usage,
    }))
}

impl Guest for ScriptedRunner {
    fn build_user_message(text: String) -> FrameworkMessage {
        // The host's turn-failure note starts with "[Dex]"; `refuse_notes`
        // traps on it, to test that the failure still ends the turn.
        if config::get("refuse_notes").is_some() && text.starts_with("[Dex]") {
            panic!("scripted-runner refuses the failure note");
        }
        let role = match config::get("user_role").as_deref() {
            Some("assistant") => MessageRole::Assistant,
            Some("system") => MessageRole::System,
            Some("tool") => MessageRole::Tool,
            _ => MessageRole::User,
        };
        FrameworkMessage {
            role,
            framework_item: json!({"type": "user", "text": text}).to_string(),
            text: Some(text),
        }
    }

    fn run_model_step(turn: TurnContext) -> Result<TurnOutcome, String> {
        let mut state = match &turn.framework_run_state {
            None => RunState::default(),
            Some(text) => serde_json::from_str::<RunState>(text)
                .map_err(|err| format!("run state is not this runner's: {err}"))?,
        };
        // Resuming: every pending call now has a final record; use it instead of
        // running the tool.
        for id in std::mem::take(&mut state.pending) {
            let record = turn
                .tool_calls
                .iter()
                .find(|r| r.tool_call_id == id)
                .ok_or_else(|| format!("no record for tool call {id:?}"))?;
            state.items.push(record_item(record));
        }

        let window = window(&turn);
        let script = turn_script(&turn.turn_id, &window)?;
        let step_at = |index: usize| {
            script
                .steps
                .get(index)
                .or(script.steps.last())
                .cloned()
                .ok_or("the turn's script has no steps")
        };
        let mut step_script = step_at(state.step)?;
        state.step += 1;
        // A compaction is returned once; when the host runs the step again
        // with this turn's compaction, the script goes on.
        let compacted_now = turn
            .compaction
            .as_ref()
            .is_some_and(|c| c.turn_id == turn.turn_id);
        if step_script.compact.is_some() && compacted_now && state.step < script.steps.len() {
            step_script = step_at(state.step)?;
            state.step += 1;
        }
        if let Some(compact) = &step_script.compact {
            if !compacted_now {
                return Ok(compacted(&turn, compact));
            }
        }

        if step_script.heartbeat {
            step::heartbeat();
        }
        // A framework reporting tools it ran itself (or forging the host's).
        for id in &step_script.tool_events {
            events::write_tool_call_started(id, "inner");
            events::write_tool_call_finished(id, "inner", ToolCallStatus::Succeeded);
        }
        for event in &step_script.events {
            events::write_event(&event.event_type, &event.payload.to_string());
        }
        let call = format!("{}/{}#{}", turn.flow_id, turn.turn_id, turn.attempt);
        if let Some(name) = &step_script.log {
            log_invocation(name, &call)?;
        }
        if step_script.sleep_ms > 0 {
            std::thread::sleep(std::time::Duration::from_millis(step_script.sleep_ms));
        }
        if let Some(name) = &step_script.gate {
            gate(name, &call)?;
        }
        if turn.attempt <= step_script.trap_attempts {
            panic!("scripted trap on attempt {}", turn.attempt);
        }
        if turn.attempt <= step_script.fail_attempts {
            return Err(format!("scripted failure on attempt {}", turn.attempt));
        }
        if turn.attempt <= step_script.fail_after_deltas {
            // A model call that streamed part of its answer, then broke.
            let text = step_script.text.clone().unwrap_or_default();
            for delta in step_script
                .deltas
                .clone()
                .unwrap_or_else(|| vec![text.clone()])
            {
                events::write_text_delta(&delta);
            }
            // Long enough for the host to publish the live text.
            std::thread::sleep(std::time::Duration::from_millis(100));
            return Err(format!(
                "scripted failure after streaming, on attempt {}",
                turn.attempt
            ));
        }
        if step_script.model {
            return model_step(&turn, &window, state, step_script.model_twice);
        }
        let usage = usage_of(&step_script);
        if let Some(calls) = &step_script.tool_calls {
            // Text before tool calls, as a model that says what it will do.
            if let Some(text) = &step_script.text {
                for delta in step_script
                    .deltas
                    .clone()
                    .unwrap_or_else(|| vec![text.clone()])
                {
                    events::write_text_delta(&delta);
                }
                state.items.push(json!({"type": "text", "text": text}));
            }
            return request_tools(state, calls, usage, step_script.run_state.clone());
        }
        let text = step_script.text.clone().unwrap_or_default();
        let deltas = step_script
            .deltas
            .clone()
            .unwrap_or_else(|| vec![text.clone()]);
        for delta in &deltas {
            events::write_text_delta(delta);
        }
        state.items.push(json!({"type": "text", "text": text}));
        Ok(completed(state, usage))
    }

    fn execute_deferred_tool_call(call: DeferredToolExecution) -> Result<String, ToolError> {
        step::heartbeat();
        let record = &call.tool_call;
        match record.tool_name.as_str() {
            "runner_fail" => Err(ToolError::Execution(format!(
                "runner tool failed: {}",
                record.arguments
            ))),
            "runner_internal_fail" => Err(ToolError::Internal("runner tool broke".to_string())),
            "runner_trap" => panic!("runner tool trapped"),
            _ => Ok(json!({
                "tool": record.tool_name,
                "arguments": record.arguments,
                "idempotency_key": call.idempotency_key,
                "attempt": call.attempt,
                "handled_by": "scripted-runner",
            })
            .to_string()),
        }
    }
}

export!(ScriptedRunner);
