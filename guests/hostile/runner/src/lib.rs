//! A runner component that attacks its sandbox and the session's rules; the
//! last user message picks the attack (see guests/hostile/README.md).

use std::hint::black_box;

use dex::agents::types::{
    DeferredToolCall, HistoryCompacted, HistoryOrder, MessageRole, ModelMessage, ModelRequest,
    ToolCallStatus, ToolCallsRequested, ToolEffect, ToolPolicy, TurnCompleted, Usage,
};
use dex::agents::{events, model};

wit_bindgen::generate!({ path: "../../../wit", world: "dex:agents/runner" });

struct HostileRunner;

fn usage() -> Usage {
    Usage {
        input_tokens: 0,
        output_tokens: 0,
        total_tokens: 0,
    }
}

fn completed(text: String) -> Result<TurnOutcome, String> {
    Ok(TurnOutcome::Completed(TurnCompleted {
        new_messages: vec![FrameworkMessage {
            role: MessageRole::Assistant,
            framework_item: text.clone(),
            text: Some(text),
        }],
        usage: usage(),
    }))
}

fn deferred(id: &str, tool: &str) -> DeferredToolCall {
    DeferredToolCall {
        tool_call_id: id.to_string(),
        tool_name: tool.to_string(),
        arguments: "{}".to_string(),
        policy: ToolPolicy {
            effect: ToolEffect::Read,
            requires_approval: false,
        },
    }
}

fn request(run_state: String, calls: Vec<DeferredToolCall>) -> Result<TurnOutcome, String> {
    Ok(TurnOutcome::ToolCallsRequested(ToolCallsRequested {
        framework_run_state: run_state,
        tool_calls: calls,
        usage: usage(),
    }))
}

#[inline(never)]
fn status_name(status: ToolCallStatus) -> &'static str {
    match status {
        ToolCallStatus::Pending => "Pending",
        ToolCallStatus::Approved => "Approved",
        ToolCallStatus::Succeeded => "Succeeded",
        ToolCallStatus::Failed => "Failed",
        ToolCallStatus::Rejected => "Rejected",
        ToolCallStatus::OutcomeUnknown => "OutcomeUnknown",
    }
}

fn recurse(depth: u64) -> u64 {
    // Small frames: the wasm call stack runs out long before the shadow
    // stack in linear memory does.
    if depth == u64::MAX {
        return 0;
    }
    black_box(recurse(depth + 1)) ^ depth
}

impl Guest for HostileRunner {
    fn build_user_message(text: String) -> FrameworkMessage {
        if text == "trap-build" {
            panic!("hostile build-user-message traps on purpose");
        }
        FrameworkMessage {
            role: MessageRole::User,
            framework_item: text.clone(),
            text: Some(text),
        }
    }

    fn run_model_step(turn: TurnContext) -> Result<TurnOutcome, String> {
        if !turn.tool_calls.is_empty() {
            // Report each record so that a test can read what the host recorded.
            let reports: Vec<String> = turn
                .tool_calls
                .iter()
                .map(|c| {
                    let shown = |text: &Option<String>| {
                        text.as_deref()
                            .map(|t| t.chars().take(300).collect::<String>())
                    };
                    format!(
                        "{} {} output={:?} error={:?}",
                        c.tool_name,
                        status_name(c.status),
                        shown(&c.output),
                        shown(&c.error)
                    )
                })
                .collect();
            return completed(format!("after tools: {}", reports.join("; ")));
        }
        let length = turn.history.length();
        let attack = turn
            .history
            .read(1, length, HistoryOrder::NewestFirst, 16)
            .into_iter()
            .find(|m| m.role == MessageRole::User)
            .map(|m| m.framework_item)
            .unwrap_or_default();
        // `history-flood` reads the whole history again and again: the host
        // ends the call at its read budget.
        if attack == "history-flood" {
            let mut read = 0usize;
            loop {
                read += turn
                    .history
                    .read(0, u64::MAX, HistoryOrder::OldestFirst, u32::MAX)
                    .len();
                black_box(read);
            }
        }
        // `history-range` asks for every sequence there could be, both ways.
        if attack == "history-range" {
            let oldest = turn
                .history
                .read(0, u64::MAX, HistoryOrder::OldestFirst, u32::MAX);
            let newest = turn.history.read(u64::MAX, 0, HistoryOrder::NewestFirst, 0);
            let empty = turn
                .history
                .read(length + 1, u64::MAX, HistoryOrder::NewestFirst, 10);
            return completed(format!(
                "history-range: length {length}, oldest-first {} (first {:?}), inverted {}, past \
                 the end {}",
                oldest.len(),
                oldest.first().map(|m| m.sequence),
                newest.len(),
                empty.len()
            ));
        }
        // `compact-past-end` and `compact-loop` try the host's compaction checks.
        // `compact-loop` needs a message before its own to summarize.
        if attack == "compact-past-end" || (attack == "compact-loop" && length > 1) {
            let through = if attack == "compact-past-end" {
                u64::MAX
            } else {
                turn.compaction
                    .as_ref()
                    .map_or(1, |c| c.through_sequence + 1)
                    .min(length - 1)
            };
            return Ok(TurnOutcome::Compacted(HistoryCompacted {
                through_sequence: through,
                summary: FrameworkMessage {
                    role: MessageRole::System,
                    framework_item: "summary".to_string(),
                    text: Some("summary".to_string()),
                },
                usage: usage(),
            }));
        }
        // `big-model-request N` sends the model one request of N MiB: the
        // host's provider must not keep it after answering.
        if let Some(mib) = attack.strip_prefix("big-model-request ") {
            let mib: usize = mib.trim().parse().unwrap_or(1);
            let request = ModelRequest {
                messages: vec![ModelMessage {
                    role: MessageRole::User,
                    content: Some("m".repeat(mib << 20)),
                    tool_calls: Vec::new(),
                    tool_call_id: None,
                }],
                tools: Vec::new(),
                temperature: None,
                max_output_tokens: None,
            };
            let answer = model::complete(&request)
                .map(|r| r.message.content.unwrap_or_default())
                .unwrap_or_else(|err| format!("{err:?}"));
            return completed(format!("sent {mib} MiB: {answer}"));
        }
        // `tool NAME {json}` calls hostile-tool's NAME with those arguments.
        if let Some(rest) = attack.strip_prefix("tool ") {
            let (name, arguments) = rest.split_once(' ').unwrap_or((rest, "{}"));
            let mut call = deferred("c1", name);
            call.arguments = arguments.to_string();
            return request("state".into(), vec![call]);
        }
        match attack.as_str() {
            "spin" => {
                let mut counter: u64 = 0;
                loop {
                    counter = black_box(counter.wrapping_add(1));
                }
            }
            "memory-bomb" => {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(vec![0xA5; 1 << 20]);
                    black_box(&hoard);
                }
            }
            "recurse" => completed(recurse(0).to_string()),
            "trap-model" => panic!("hostile run-model-step traps on purpose"),
            // 10 MB of deltas against a far smaller event budget: the host
            // drops what is over it and the call goes on.
            "event-flood" => {
                let chunk = "z".repeat(1000);
                for _ in 0..10_000 {
                    events::write_text_delta(&chunk);
                }
                completed("flooded".to_string())
            }
            // Zero-byte events for the whole deadline: each is free to send,
            // so only what the host stores may be counted.
            "empty-flood" => loop {
                events::write_text_delta("");
                events::write_reasoning_delta("");
                events::write_tool_call_started("", "");
                events::write_tool_call_finished("", "", ToolCallStatus::Succeeded);
            },
            // Fan-outs that cost nothing to ask for: the host's turn budget
            // must refuse them before they cost the worker or the store.
            "many-calls" => request(
                "state".into(),
                (0..10_000)
                    .map(|n| deferred(&format!("c{n}"), "runner_ok"))
                    .collect(),
            ),
            "empty-messages" => Ok(TurnOutcome::Completed(TurnCompleted {
                new_messages: (0..100_000)
                    .map(|_| FrameworkMessage {
                        role: MessageRole::Assistant,
                        framework_item: String::new(),
                        text: None,
                    })
                    .collect(),
                usage: usage(),
            })),
            "big-output" => completed("x".repeat(4 << 20)),
            "big-run-state" => request("s".repeat(4 << 20), vec![deferred("c1", "runner_ok")]),
            "empty-run-state" => request(String::new(), vec![deferred("c1", "runner_ok")]),
            "dup-ids" => request(
                "state".into(),
                vec![deferred("c1", "runner_ok"), deferred("c1", "runner_ok")],
            ),
            "slash-ids" => request("state".into(), vec![deferred("a/b", "runner_ok")]),
            "trap-deferred" => request("state".into(), vec![deferred("c1", "runner_trap")]),
            "env" => {
                let vars: Vec<String> = std::env::vars().map(|(k, v)| format!("{k}={v}")).collect();
                let root = std::fs::read_dir("/")
                    .map(|d| d.count())
                    .map_err(|e| e.to_string());
                completed(format!("env: {vars:?}; root: {root:?}"))
            }
            other => completed(format!("ok: {other}")),
        }
    }

    fn execute_deferred_tool_call(call: DeferredToolExecution) -> Result<String, ToolError> {
        match call.tool_call.tool_name.as_str() {
            "runner_trap" => panic!("hostile execute-deferred-tool-call traps on purpose"),
            _ => Ok("fine".to_string()),
        }
    }
}

export!(HostileRunner);
