//! AgentSessionFlow, rule by rule. Each test drives real sessions through the
//! engine on SQLite, with the scripted runner and the tool components as
//! sandboxed guests.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dexa::flow::{
    history, FlowStatus, FlowType, MapQuery, Registry, RetryPolicy, StepCall, StepContext, StepDef,
    StepResult,
};
use dexa::plugin::{DirAccess, Grants};
use dexa::session::*;
use dexa_tests::session::{
    all_events, last_text, wait_for_agent_snapshot, wait_for_turns, AgentSpec, SessionStack,
};
use dexa_tests::toy::wait_until;
use serde_json::{json, Value};

/// A user message that scripts its own turn for the scripted runner.
fn turn(steps: Value) -> String {
    json!({ "steps": steps }).to_string()
}

fn tool_call(id: &str, name: &str, arguments: Value, effect: &str) -> Value {
    json!({"id": id, "name": name, "arguments": arguments, "effect": effect})
}

fn echo_agent(flow_type: &str) -> AgentSpec {
    AgentSpec::scripted(flow_type).tool("echo-tool", Grants::none())
}

async fn started(agents: Vec<AgentSpec>) -> SessionStack {
    let mut stack = SessionStack::new(agents).await;
    stack.start_worker();
    stack
}

fn executed(history: &[dexa::flow::StepHistoryEntry]) -> Vec<String> {
    history
        .iter()
        .filter(|e| e.event_type == history::EXECUTE_COMPLETED)
        .map(|e| e.step_type.clone())
        .collect()
}

fn count(items: &[String], step: &str) -> usize {
    items.iter().filter(|s| s.as_str() == step).count()
}

fn record<'a>(snapshot: &'a AgentSnapshot, id: &str) -> &'a AgentToolCall {
    snapshot
        .tool_calls
        .iter()
        .find(|r| r.tool_call_id == id)
        .unwrap_or_else(|| panic!("no record {id} in {:?}", snapshot.tool_calls))
}

/// The tool results the runner saw, from the stored tool messages.
fn tool_results(snapshot: &AgentSnapshot) -> BTreeMap<String, String> {
    snapshot
        .messages
        .iter()
        .filter(|m| m.role == MessageRole::Tool)
        .map(|m| {
            let item: Value = serde_json::from_str(&m.framework_item).unwrap_or(Value::Null);
            (
                item["tool_call_id"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                m.text.clone().unwrap_or_default(),
            )
        })
        .collect()
}

/// Waits for the session's first pending approval.
async fn first_pending_interrupt(
    sessions: &AgentSessionClient,
    session_id: &str,
) -> AgentInterrupt {
    wait_for_agent_snapshot(sessions, session_id, "the approval", |s| {
        s.pending_interrupts.first().cloned()
    })
    .await
}

/// A `resolve_interrupt` request.
fn answer(
    interrupt_id: impl Into<String>,
    approved: bool,
    rejection_message: Option<&str>,
) -> ResolveInterruptRequest {
    ResolveInterruptRequest {
        interrupt_id: interrupt_id.into(),
        approved,
        rejection_message: rejection_message.map(str::to_string),
    }
}

async fn a_turn_with_tools_follows_the_flow_shape() {
    let stack = started(vec![echo_agent("Shape")]).await;
    let sessions = stack.sessions("Shape");
    let script = turn(json!([
        {"tool_calls": [tool_call("c1", "echo", json!({"n": 1}), "read"), tool_call("c2", "echo", json!({"n": 2}), "read")]},
        {"text": "done"}
    ]));
    sessions.start_session("s1", &script).await.unwrap();
    let snapshot = wait_for_turns(&sessions, "s1", 1).await;
    assert_eq!(
        snapshot.state.as_ref().map(|s| s.status),
        Some(SessionStatus::WaitingForUserMessage)
    );
    let steps = executed(&stack.step_history("s1").await);
    assert_eq!(steps[0], step::START_AGENT_SESSION);
    assert_eq!(count(&steps, step::RUN_MODEL), 2, "{steps:?}");
    assert_eq!(count(&steps, step::CALL_TOOL), 2, "{steps:?}");
    assert_eq!(count(&steps, step::RESUME_TURN), 1, "{steps:?}");
    let resume = steps.iter().position(|s| s == step::RESUME_TURN).unwrap();
    let tools: Vec<usize> = steps
        .iter()
        .enumerate()
        .filter(|(_, s)| s.as_str() == step::CALL_TOOL)
        .map(|(i, _)| i)
        .collect();
    assert!(
        tools.iter().all(|i| *i < resume),
        "ResumeTurn ran before the tools: {steps:?}"
    );

    // The next message runs AwaitUserMessage and a turn of its own.
    assert!(sessions.send_user_message("s1", "again").await.unwrap());
    let snapshot = wait_for_turns(&sessions, "s1", 2).await;
    let steps = executed(&stack.step_history("s1").await);
    assert_eq!(count(&steps, step::AWAIT_USER_MESSAGE), 1);
    assert_eq!(last_text(&snapshot).as_deref(), Some("echo: again"));
}

async fn step_policies_follow_the_spec() {
    let flow = AgentSessionFlow::for_clients("Policies", AgentSessionOptions::default());
    let def = flow.definition();
    let run_model = def.step_def(step::RUN_MODEL).unwrap();
    assert_eq!(run_model.policy.max_attempts, 3);
    assert_eq!(run_model.policy.window, Some(Duration::from_secs(30 * 60)));
    assert!(run_model.policy.attempt_timeout >= Some(Duration::from_secs(15 * 60)));
    assert!(run_model.policy.attempt_timeout <= Some(Duration::from_secs(15 * 60 + 10)));
    assert_eq!(
        run_model.policy.heartbeat_timeout,
        Some(Duration::from_secs(120))
    );
    assert_eq!(
        run_model.failure_route.as_deref(),
        Some(step::RECORD_TURN_FAILURE)
    );
    let call_tool = def.step_def(step::CALL_TOOL).unwrap();
    assert_eq!(call_tool.policy.max_attempts, 3);
    assert_eq!(
        call_tool.failure_route.as_deref(),
        Some(step::RECORD_TOOL_FAILURE)
    );
    let single = def.step_def(step::CALL_SINGLE_ATTEMPT_TOOL).unwrap();
    assert_eq!(single.policy.max_attempts, 1);
    assert_eq!(
        single.failure_route.as_deref(),
        Some(step::RECORD_TOOL_OUTCOME_UNKNOWN)
    );
    assert_eq!(
        def.step_def(step::AWAIT_TOOL_APPROVAL).unwrap().locks,
        vec![PENDING_INTERRUPTS.to_string()]
    );
    assert_eq!(BACKGROUND_HEARTBEAT, Duration::from_secs(20));
}

async fn run_model_failures_retry_three_times_then_record_turn_failure_and_the_next_turn_clears_the_error(
) {
    let stack = started(vec![echo_agent("Failing")]).await;
    let sessions = stack.sessions("Failing");
    sessions
        .start_session("s1", &turn(json!([{"text": "never", "fail_attempts": 3}])))
        .await
        .unwrap();
    let snapshot = wait_for_turns(&sessions, "s1", 1).await;
    let state = snapshot.state.unwrap();
    let error = state.last_turn_error.unwrap_or_default();
    assert!(error.contains("scripted failure on attempt 3"), "{error}");
    let history = stack.step_history("s1").await;
    let failed: Vec<_> = history
        .iter()
        .filter(|e| e.step_type == step::RUN_MODEL)
        .map(|e| (e.event_type.as_str(), e.final_attempt))
        .collect();
    assert_eq!(
        failed,
        vec![
            (history::ATTEMPT_FAILED, 1),
            (history::ATTEMPT_FAILED, 2),
            (history::EXECUTE_FAILED, 3)
        ]
    );
    assert_eq!(count(&executed(&history), step::RECORD_TURN_FAILURE), 1);
    // No tool call ran, so no note: only the user message is stored.
    assert_eq!(snapshot.messages.len(), 1);

    // A trap fails only its attempt; the turn after it completes and clears the error.
    sessions
        .send_user_message(
            "s1",
            &turn(json!([{"text": "recovered", "trap_attempts": 1}])),
        )
        .await
        .unwrap();
    let snapshot = wait_for_turns(&sessions, "s1", 2).await;
    assert_eq!(snapshot.state.as_ref().unwrap().last_turn_error, None);
    assert_eq!(
        snapshot.messages.last().unwrap().text.as_deref(),
        Some("recovered")
    );
}

async fn an_invalid_tool_calls_requested_fails_the_turn() {
    let stack = started(vec![echo_agent("Invalid")]).await;
    let sessions = stack.sessions("Invalid");
    let cases = [
        (
            "empty-run-state",
            json!({"tool_calls": [tool_call("c1", "echo", json!({}), "read")], "run_state": ""}),
            "framework_run_state is empty",
        ),
        (
            "empty-id",
            json!({"tool_calls": [tool_call("", "echo", json!({}), "read")]}),
            "empty tool call id",
        ),
        (
            "slash-id",
            json!({"tool_calls": [tool_call("a/b", "echo", json!({}), "read")]}),
            "contains '/'",
        ),
        (
            "duplicate-id",
            json!({"tool_calls": [tool_call("c1", "echo", json!({}), "read"), tool_call("c1", "echo", json!({}), "read")]}),
            "not unique",
        ),
    ];
    for (id, step_script, _) in &cases {
        sessions
            .start_session(id, &turn(json!([step_script, {"text": "never"}])))
            .await
            .unwrap();
    }
    for (id, _, reason) in &cases {
        let snapshot = wait_for_turns(&sessions, id, 1).await;
        let error = snapshot.state.unwrap().last_turn_error.unwrap_or_default();
        assert!(error.contains(reason), "{id}: {error}");
        // Refused at once: one RunModel attempt, no tool Step.
        let history = stack.step_history(id).await;
        let run_model: Vec<_> = history
            .iter()
            .filter(|e| e.step_type == step::RUN_MODEL)
            .collect();
        assert_eq!(run_model.len(), 1, "{id}: {run_model:?}");
        assert!(
            executed(&history).iter().all(|s| s != step::CALL_TOOL),
            "{id}"
        );
        assert!(snapshot.tool_calls.is_empty());
    }
    // Unique within one turn only: ids may repeat in a later turn.
    let two_calls = |text: &str| {
        turn(
            json!([{"tool_calls": [tool_call("c1", "echo", json!({"t": text}), "read")]}, {"text": text}]),
        )
    };
    sessions
        .start_session("repeat", &two_calls("one"))
        .await
        .unwrap();
    wait_for_turns(&sessions, "repeat", 1).await;
    sessions
        .send_user_message("repeat", &two_calls("two"))
        .await
        .unwrap();
    let snapshot = wait_for_turns(&sessions, "repeat", 2).await;
    assert_eq!(snapshot.state.unwrap().last_turn_error, None);
    assert_eq!(
        snapshot.messages.last().unwrap().text.as_deref(),
        Some("two")
    );
}

async fn turn_completed_appends_all_messages_in_one_commit_in_order_with_sequences_from_1_and_12_digit_keys(
) {
    let stack = started(vec![echo_agent("Append")]).await;
    let sessions = stack.sessions("Append");
    let script = turn(json!([
        {"tool_calls": [tool_call("c1", "echo", json!({"n": 1}), "read"), tool_call("c2", "echo", json!({"n": 2}), "read")]},
        {"tool_calls": [tool_call("c3", "echo", json!({"n": 3}), "read")]},
        {"text": "final answer"}
    ]));
    sessions.start_session("s1", &script).await.unwrap();
    // While the turn runs, nothing but the user message is stored.
    let snapshot = wait_for_agent_snapshot(&sessions, "s1", "the finished turn", |s| {
        let state = s.state.as_ref()?;
        if state.active_turn_id.is_some() {
            assert_eq!(
                s.messages.len(),
                1,
                "messages were stored before the turn completed"
            );
            None
        } else {
            Some(s.clone())
        }
    })
    .await;
    let kinds: Vec<String> = snapshot
        .messages
        .iter()
        .map(|m| {
            let item: Value = serde_json::from_str(&m.framework_item).unwrap();
            format!("{}:{}", m.sequence, item["type"].as_str().unwrap_or("?"))
        })
        .collect();
    assert_eq!(
        kinds,
        [
            "1:user",
            "2:assistant_tool_calls",
            "3:tool_result",
            "4:tool_result",
            "5:assistant_tool_calls",
            "6:tool_result",
            "7:text"
        ]
    );
    assert_eq!(snapshot.state.as_ref().unwrap().message_count, 7);
    assert!(snapshot.messages.iter().all(|m| m.turn_id == "turn-1"));
    // Stored under 12-digit keys, in sequence order.
    let keys: Vec<String> = stack
        .store
        .read_map("s1", AGENT_MESSAGES, MapQuery::default())
        .await
        .unwrap()
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(keys.first().map(String::as_str), Some("000000000001"));
    assert_eq!(keys.last().map(String::as_str), Some("000000000007"));
    assert!(keys.iter().all(|k| k.len() == 12));
    assert_eq!(message_sequence_key(42), "000000000042");
    // The turn's records and run state are gone.
    assert!(snapshot.tool_calls.is_empty());
    assert!(stack
        .store
        .get("s1", FRAMEWORK_RUN_STATE, "")
        .await
        .unwrap()
        .is_none());
    // One turn_completed event with the count of appended messages.
    let completed: Vec<_> = all_events(&sessions, "s1")
        .await
        .into_iter()
        .filter(|e| e.event_type == event_type::TURN_COMPLETED)
        .collect();
    assert_eq!(completed.len(), 1);
    assert_eq!(completed[0].data["message_count"], json!(6));
}

async fn the_usage_of_each_model_call_is_added_to_the_session_total() {
    let stack = started(vec![echo_agent("Usage")]).await;
    let sessions = stack.sessions("Usage");
    let script = turn(json!([
        {"tool_calls": [tool_call("c1", "echo", json!({}), "read")], "usage": {"input": 10, "output": 5}},
        {"text": "done", "usage": {"input": 3, "output": 2}}
    ]));
    sessions.start_session("s1", &script).await.unwrap();
    let snapshot = wait_for_turns(&sessions, "s1", 1).await;
    assert_eq!(
        snapshot.usage,
        AgentUsage {
            input_tokens: 13,
            output_tokens: 7,
            total_tokens: 20,
            model_calls: 2
        }
    );
    sessions
        .send_user_message(
            "s1",
            &turn(json!([{"text": "more", "usage": {"input": 100, "output": 1}}])),
        )
        .await
        .unwrap();
    let snapshot = wait_for_turns(&sessions, "s1", 2).await;
    assert_eq!(
        snapshot.usage,
        AgentUsage {
            input_tokens: 113,
            output_tokens: 8,
            total_tokens: 121,
            model_calls: 3
        }
    );
    let usage_events: Vec<_> = all_events(&sessions, "s1")
        .await
        .into_iter()
        .filter(|e| e.event_type == event_type::USAGE_RECORDED)
        .collect();
    assert_eq!(usage_events.len(), 3);
    assert_eq!(usage_events[0].data["recorded"]["input_tokens"], json!(10));
    assert_eq!(usage_events[2].data["session"]["total_tokens"], json!(121));
}

async fn a_blank_initial_message_starts_no_turn_and_blank_messages_are_refused() {
    let mut stack = SessionStack::new(vec![echo_agent("Blank")]).await;
    let sessions = stack.sessions("Blank");
    sessions.start_session("s1", "   \n").await.unwrap();
    // Before StartAgentSession commits, the state is None.
    let snapshot = sessions.get_agent_snapshot("s1").await.unwrap();
    assert_eq!(snapshot.state, None);
    assert_eq!(snapshot.flow_status, FlowStatus::Running);
    assert!(!sessions.send_user_message("s1", "").await.unwrap());
    assert!(!sessions.send_user_message("s1", " \t ").await.unwrap());
    assert!(sessions.send_user_message("s1", "queued").await.unwrap());
    assert_eq!(
        sessions
            .get_agent_snapshot("s1")
            .await
            .unwrap()
            .queued_message_count,
        1
    );
    stack.start_worker();
    let snapshot = wait_for_turns(&sessions, "s1", 1).await;
    // The blank message started nothing; the queued one is turn 1, message 1.
    assert_eq!(snapshot.state.as_ref().unwrap().turn_count, 1);
    assert_eq!(snapshot.messages[0].sequence, 1);
    assert_eq!(snapshot.messages[0].text.as_deref(), Some("queued"));
    assert!(matches!(
        sessions.get_agent_snapshot("missing").await,
        Err(SessionError::NoSuchSession(_))
    ));
}

async fn tools_served_by_a_component_go_to_it_and_others_to_the_runner_with_the_idempotency_key() {
    let stack = started(vec![echo_agent("Routing")]).await;
    let sessions = stack.sessions("Routing");
    let script = turn(json!([
        {"tool_calls": [tool_call("c1", "describe_call", json!({"a": 1}), "read"), tool_call("c2", "runner_side", json!({"b": 2}), "read")]},
        {"text": "done"}
    ]));
    sessions.start_session("sess-é", &script).await.unwrap();
    let snapshot = wait_for_turns(&sessions, "sess-é", 1).await;
    let results = tool_results(&snapshot);
    let by_tool: Value = serde_json::from_str(&results["c1"]).unwrap();
    assert_eq!(by_tool["idempotency_key"], json!("sess-é/turn-1/c1"));
    assert_eq!(by_tool["attempt"], json!(1));
    let by_runner: Value = serde_json::from_str(&results["c2"]).unwrap();
    assert_eq!(by_runner["handled_by"], json!("scripted-runner"));
    assert_eq!(by_runner["idempotency_key"], json!("sess-é/turn-1/c2"));
}

async fn the_policy_is_explicit_then_framework_effect_then_default_and_approval_follows_the_effect_table(
) {
    let options = AgentSessionOptions::default()
        .tool_policy("explicit_read", ToolPolicy::new(ToolEffect::Read))
        .tool_policy(
            "explicit_gated",
            ToolPolicy::new(ToolEffect::Read).requires_approval(true),
        )
        .tool_policy(
            "explicit_ungated",
            ToolPolicy::new(ToolEffect::NonIdempotentWrite).requires_approval(false),
        )
        .default_tool_effect(ToolEffect::IdempotentWrite);
    let stack = started(vec![AgentSpec::scripted("Policy").options(options)]).await;
    let sessions = stack.sessions("Policy");
    let script = turn(json!([
        {"tool_calls": [
            // The explicit policy wins over the framework's effect.
            tool_call("a", "explicit_read", json!({}), "non_idempotent_write"),
            tool_call("b", "explicit_gated", json!({}), "read"),
            tool_call("c", "explicit_ungated", json!({}), "read"),
            {"id": "d", "name": "framework_read", "arguments": {}, "effect": "read"},
            {"id": "e", "name": "framework_write", "arguments": {}, "effect": "non_idempotent_write"},
            {"id": "f", "name": "framework_unclassified", "arguments": {}, "effect": "unclassified"},
            {"id": "g", "name": "framework_idempotent", "arguments": {}, "effect": "idempotent_write"},
            {"id": "h", "name": "no_metadata", "arguments": {}}
        ]},
        {"text": "done"}
    ]));
    sessions.start_session("s1", &script).await.unwrap();
    let snapshot = wait_for_agent_snapshot(&sessions, "s1", "the ungated calls finished", |s| {
        let done = ["a", "c", "d", "g", "h"].iter().all(|id| {
            s.tool_calls
                .iter()
                .any(|r| r.tool_call_id == *id && r.status.is_final())
        });
        done.then(|| s.clone())
    })
    .await;
    let expect = [
        ("a", ToolEffect::Read, false),
        ("b", ToolEffect::Read, true),
        ("c", ToolEffect::NonIdempotentWrite, false),
        ("d", ToolEffect::Read, false),
        ("e", ToolEffect::NonIdempotentWrite, true),
        ("f", ToolEffect::Unclassified, true),
        ("g", ToolEffect::IdempotentWrite, false),
        ("h", ToolEffect::IdempotentWrite, false),
    ];
    for (id, effect, approval) in expect {
        let r = record(&snapshot, id);
        assert_eq!((r.effect, r.requires_approval), (effect, approval), "{id}");
        if approval {
            assert_eq!(r.status, ToolCallStatus::Pending, "{id}");
        }
    }
    let pending: BTreeSet<String> = snapshot
        .pending_interrupts
        .iter()
        .map(|i| i.tool_call_id.clone())
        .collect();
    assert_eq!(
        pending,
        ["b", "e", "f"].iter().map(|s| s.to_string()).collect()
    );
    // The Step type follows the effect: reads and idempotent writes may repeat.
    let steps = executed(&stack.step_history("s1").await);
    assert_eq!(count(&steps, step::CALL_TOOL), 4, "{steps:?}"); // a d g h
    assert_eq!(
        count(&steps, step::CALL_SINGLE_ATTEMPT_TOOL),
        1,
        "{steps:?}"
    ); // c
}

async fn a_tool_execution_error_records_failed_with_no_retry() {
    let stack = started(vec![echo_agent("ExecError")]).await;
    let sessions = stack.sessions("ExecError");
    let script = turn(
        json!([{"tool_calls": [tool_call("c1", "fail", json!({"x": 1}), "read")]}, {"text": "done"}]),
    );
    sessions.start_session("s1", &script).await.unwrap();
    let snapshot = wait_for_turns(&sessions, "s1", 1).await;
    assert_eq!(
        tool_results(&snapshot)["c1"],
        r#"Tool call failed: echo-tool refused: {"x":1}"#
    );
    let history = stack.step_history("s1").await;
    let tool: Vec<_> = history
        .iter()
        .filter(|e| e.step_type == step::CALL_TOOL)
        .map(|e| (e.event_type.as_str(), e.final_attempt))
        .collect();
    assert_eq!(tool, vec![(history::EXECUTE_COMPLETED, 1)]);
}

async fn other_tool_errors_retry_as_the_effect_allows_then_record_failed_or_outcome_unknown() {
    let options = AgentSessionOptions::default()
        .tool_policy("internal_fail", ToolPolicy::new(ToolEffect::Read))
        .tool_policy("trap", ToolPolicy::new(ToolEffect::IdempotentWrite))
        .tool_policy(
            "runner_internal_fail",
            ToolPolicy::new(ToolEffect::NonIdempotentWrite).requires_approval(false),
        );
    let stack = started(vec![echo_agent("Errors").options(options)]).await;
    let sessions = stack.sessions("Errors");
    let script = turn(json!([
        {"tool_calls": [
            tool_call("read", "internal_fail", json!({}), "read"),
            tool_call("write", "trap", json!({}), "read"),
            tool_call("single", "runner_internal_fail", json!({}), "read")
        ]},
        {"text": "done"}
    ]));
    sessions.start_session("s1", &script).await.unwrap();
    wait_for_turns(&sessions, "s1", 1).await;
    let snapshot = sessions.get_agent_snapshot("s1").await.unwrap();
    let results = tool_results(&snapshot);
    assert!(
        results["read"].starts_with("Tool call failed: the tool call did not complete"),
        "{}",
        results["read"]
    );
    assert!(
        results["read"].contains("echo-tool broke"),
        "{}",
        results["read"]
    );
    assert!(
        results["write"].starts_with("Tool call outcome is unknown"),
        "{}",
        results["write"]
    );
    assert!(
        results["single"].starts_with("Tool call outcome is unknown"),
        "{}",
        results["single"]
    );
    let history = stack.step_history("s1").await;
    let attempts = |step_type: &str| {
        history
            .iter()
            .filter(|e| e.step_type == step_type && e.event_type != history::EXECUTE_COMPLETED)
            .count()
    };
    assert_eq!(
        attempts(step::CALL_TOOL),
        6,
        "read and write: 3 attempts each"
    );
    assert_eq!(attempts(step::CALL_SINGLE_ATTEMPT_TOOL), 1);
    let steps = executed(&history);
    assert_eq!(count(&steps, step::RECORD_TOOL_FAILURE), 2);
    assert_eq!(count(&steps, step::RECORD_TOOL_OUTCOME_UNKNOWN), 1);
}

async fn every_tool_call_publishes_exactly_one_result_when_its_record_becomes_final() {
    let options = AgentSessionOptions::default()
        .tool_policy("internal_fail", ToolPolicy::new(ToolEffect::Read));
    let stack = started(vec![echo_agent("OneResult")
        .options(options)
        .tool("gate-tool", Grants::none())])
    .await;
    let sessions = stack.sessions("OneResult");
    let script = turn(json!([
        {"tool_calls": [
            tool_call("ok", "echo", json!({}), "read"),
            tool_call("failed", "fail", json!({}), "read"),
            tool_call("retried", "internal_fail", json!({}), "read"),
            tool_call("rejected", "echo", json!({}), "unclassified")
        ]},
        {"text": "done"}
    ]));
    sessions.start_session("s1", &script).await.unwrap();
    let interrupt = first_pending_interrupt(&sessions, "s1").await;
    assert!(sessions
        .resolve_interrupt("s1", answer(interrupt.interrupt_id, false, Some("no")))
        .await
        .unwrap());
    wait_for_turns(&sessions, "s1", 1).await;
    let finished: Vec<String> = all_events(&sessions, "s1")
        .await
        .into_iter()
        .filter(|e| e.event_type == event_type::TOOL_CALL_FINISHED)
        .map(|e| {
            e.data["tool_call_id"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    let mut sorted = finished.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        ["failed", "ok", "rejected", "retried"],
        "{finished:?}"
    );
    // Every result was consumed by ResumeTurn; none is left over.
    assert_eq!(
        stack
            .store
            .channel_len("s1", TOOL_CALL_RESULTS, "")
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        count(
            &executed(&stack.step_history("s1").await),
            step::RESUME_TURN
        ),
        1
    );
}

/// Creates session `id` whose first task is `call`, with `state` written
/// before any worker runs; the stack's worker must be stopped.
async fn inject(
    stack: &SessionStack,
    flow_type: &str,
    id: &str,
    call: StepCall,
    writes: Vec<(&'static str, String, Value)>,
) {
    let now = stack.store.now().await.unwrap();
    let task = stack.registry.new_task(flow_type, call, now, None).unwrap();
    stack.store.create_flow(id, flow_type, task).await.unwrap();
    let client = stack.flow_client();
    client
        .rpc_once(id, move |tx| {
            for (name, key, value) in &writes {
                tx.set(name, key, value.clone())?;
            }
            Ok(())
        })
        .await
        .unwrap();
}

fn injected_record(id: &str, status: ToolCallStatus, order: u32) -> AgentToolCall {
    AgentToolCall {
        tool_call_id: id.to_string(),
        turn_id: "turn-1".to_string(),
        tool_name: "log".to_string(),
        arguments: json!({"name": id}).to_string(),
        effect: ToolEffect::Read,
        requires_approval: false,
        status,
        output: status.is_final().then(|| "earlier".to_string()),
        error: None,
        rejection_message: None,
        deferral_order: order,
        output_limit: None,
        component: None,
        digest: None,
    }
}

fn running_state() -> AgentState {
    AgentState {
        status: SessionStatus::RunningTools,
        turn_count: 1,
        active_turn_id: Some("turn-1".to_string()),
        message_count: 1,
        last_turn_error: None,
        runner_digest: None,
        turn_trace: None,
    }
}

fn entry<T: serde::Serialize>(
    name: &'static str,
    key: &str,
    value: &T,
) -> (&'static str, String, Value) {
    (name, key.to_string(), serde_json::to_value(value).unwrap())
}

fn tool_result_message(id: &str, status: ToolCallStatus) -> Value {
    serde_json::to_value(ToolCallCompleted {
        tool_call_id: id.to_string(),
        status,
    })
    .unwrap()
}

async fn wait_for_history(
    stack: &SessionStack,
    id: &str,
    step_type: &str,
    times: usize,
) -> Vec<String> {
    wait_until(
        &format!("{times} completed {step_type} Step(s) of {id}"),
        Duration::from_secs(20),
        || async {
            let steps = executed(&stack.step_history(id).await);
            (count(&steps, step_type) >= times).then_some(steps)
        },
    )
    .await
}

async fn a_tool_step_whose_record_is_already_final_ends_without_running() {
    let mut stack = SessionStack::new(vec![
        AgentSpec::scripted("Final").tool("gate-tool", Grants::none())
    ])
    .await;
    let state = running_state();
    inject(
        &stack,
        "Final",
        "final",
        StepCall::new(step::CALL_TOOL, json!("c1")),
        vec![
            entry(AGENT_STATE, "", &state),
            entry(
                AGENT_TOOL_CALLS,
                "c1",
                &injected_record("c1", ToolCallStatus::Succeeded, 0),
            ),
        ],
    )
    .await;
    // The control: the same Step on an approved record runs the tool.
    inject(
        &stack,
        "Final",
        "control",
        StepCall::new(step::CALL_SINGLE_ATTEMPT_TOOL, json!("c2")),
        vec![
            entry(AGENT_STATE, "", &state),
            entry(
                AGENT_TOOL_CALLS,
                "c2",
                &injected_record("c2", ToolCallStatus::Approved, 0),
            ),
        ],
    )
    .await;
    stack.start_worker();
    wait_for_history(&stack, "final", step::CALL_TOOL, 1).await;
    wait_for_history(&stack, "control", step::CALL_SINGLE_ATTEMPT_TOOL, 1).await;
    assert_eq!(
        stack.invocations(),
        vec!["c2 control/turn-1/c2".to_string()]
    );
    assert_eq!(
        stack
            .store
            .channel_len("final", TOOL_CALL_RESULTS, "")
            .await
            .unwrap(),
        0,
        "a final record publishes nothing again"
    );
    assert_eq!(
        stack
            .store
            .channel_len("control", TOOL_CALL_RESULTS, "")
            .await
            .unwrap(),
        1
    );
    let sessions = stack.sessions("Final");
    assert!(all_events(&sessions, "final").await.is_empty());
    assert_eq!(
        record(&sessions.get_agent_snapshot("final").await.unwrap(), "c1")
            .output
            .as_deref(),
        Some("earlier")
    );
}

async fn resume_turn_waits_again_if_a_consumed_result_left_a_record_of_the_turn_unfinished() {
    let mut stack = SessionStack::new(vec![AgentSpec::scripted("Resume")]).await;
    let user_text = turn(json!([{"tool_calls": []}, {"text": "resumed"}]));
    let user = AgentMessage {
        sequence: 1,
        turn_id: "turn-1".into(),
        role: MessageRole::User,
        framework_item: json!({"type": "user", "text": user_text}).to_string(),
        text: Some(user_text.clone()),
    };
    let run_state = json!({"step": 1, "items": [], "pending": ["c1", "c2"]}).to_string();
    inject(
        &stack,
        "Resume",
        "s1",
        StepCall::new(step::RESUME_TURN, json!(1))
            .wait_for(dexa::flow::ChannelWait::for_n(TOOL_CALL_RESULTS, 1)),
        vec![
            entry(AGENT_STATE, "", &running_state()),
            entry(AGENT_MESSAGES, &message_sequence_key(1), &user),
            entry(FRAMEWORK_RUN_STATE, "", &run_state),
            entry(
                AGENT_TOOL_CALLS,
                "c1",
                &injected_record("c1", ToolCallStatus::Succeeded, 0),
            ),
            entry(
                AGENT_TOOL_CALLS,
                "c2",
                &injected_record("c2", ToolCallStatus::Approved, 1),
            ),
        ],
    )
    .await;
    let client = stack.flow_client();
    client
        .rpc_once("s1", |tx| {
            Ok(tx.publish(
                TOOL_CALL_RESULTS,
                "",
                tool_result_message("c1", ToolCallStatus::Succeeded),
            )?)
        })
        .await
        .unwrap();
    stack.start_worker();
    wait_for_history(&stack, "s1", step::RESUME_TURN, 1).await;
    // c2 is unfinished: ResumeTurn waits again instead of running the model.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let steps = executed(&stack.step_history("s1").await);
    assert_eq!(count(&steps, step::RUN_MODEL), 0, "{steps:?}");
    let sessions = stack.sessions("Resume");
    assert_eq!(
        sessions
            .get_agent_snapshot("s1")
            .await
            .unwrap()
            .state
            .unwrap()
            .status,
        SessionStatus::RunningTools
    );
    let finished = injected_record("c2", ToolCallStatus::Succeeded, 1);
    client
        .rpc_once("s1", move |tx| {
            tx.set(
                AGENT_TOOL_CALLS,
                "c2",
                serde_json::to_value(&finished).unwrap(),
            )?;
            Ok(tx.publish(
                TOOL_CALL_RESULTS,
                "",
                tool_result_message("c2", ToolCallStatus::Succeeded),
            )?)
        })
        .await
        .unwrap();
    let snapshot = wait_for_turns(&sessions, "s1", 1).await;
    let steps = executed(&stack.step_history("s1").await);
    assert_eq!(count(&steps, step::RESUME_TURN), 2, "{steps:?}");
    assert_eq!(count(&steps, step::RUN_MODEL), 1, "{steps:?}");
    assert_eq!(
        snapshot.messages.last().unwrap().text.as_deref(),
        Some("resumed")
    );
}

async fn a_deadline_timer_that_fires_early_waits_again() {
    let mut stack = SessionStack::new(vec![
        AgentSpec::scripted("Early").tool("gate-tool", Grants::none())
    ])
    .await;
    let now = stack.store.now().await.unwrap();
    let interrupt = AgentInterrupt {
        interrupt_id: interrupt_id("turn-1", "c1"),
        turn_id: "turn-1".into(),
        tool_call_id: "c1".into(),
        tool_name: "log".into(),
        arguments: "{}".into(),
        deadline: Some(now + 60_000),
    };
    let mut pending = injected_record("c1", ToolCallStatus::Pending, 0);
    pending.requires_approval = true;
    // The timer is due at once, long before the interrupt's deadline.
    let call = StepCall::new(step::AWAIT_TOOL_APPROVAL, json!("c1"))
        .wait_for(dexa::flow::ChannelWait::for_key(
            INTERRUPT_RESOLUTIONS,
            &interrupt.interrupt_id,
        ))
        .wake_at(now);
    inject(
        &stack,
        "Early",
        "s1",
        call,
        vec![
            entry(AGENT_STATE, "", &running_state()),
            entry(AGENT_TOOL_CALLS, "c1", &pending),
            entry(PENDING_INTERRUPTS, &interrupt.interrupt_id, &interrupt),
        ],
    )
    .await;
    stack.start_worker();
    wait_for_history(&stack, "s1", step::AWAIT_TOOL_APPROVAL, 1).await;
    let sessions = stack.sessions("Early");
    let snapshot = sessions.get_agent_snapshot("s1").await.unwrap();
    assert_eq!(record(&snapshot, "c1").status, ToolCallStatus::Pending);
    assert_eq!(snapshot.pending_interrupts, vec![interrupt.clone()]);
    assert!(stack.invocations().is_empty());
    // It still waits for the answer, and applies it.
    assert!(sessions
        .resolve_interrupt("s1", answer(interrupt.interrupt_id.clone(), true, None))
        .await
        .unwrap());
    wait_for_agent_snapshot(&sessions, "s1", "the approved call", |s| {
        (record(s, "c1").status == ToolCallStatus::Succeeded).then_some(())
    })
    .await;
    assert_eq!(stack.invocations(), vec!["c1 s1/turn-1/c1".to_string()]);
}

async fn approvals_expire_at_their_exact_deadline_and_the_timer_fires_on_the_whole_second() {
    let options = AgentSessionOptions::default().interrupt_deadline(Duration::from_millis(1500));
    let stack = started(vec![echo_agent("Expire").options(options)]).await;
    let sessions = stack.sessions("Expire");
    let before = stack.store.now().await.unwrap();
    sessions.start_session("s1", &turn(json!([{"tool_calls": [tool_call("c1", "echo", json!({}), "unclassified")]}, {"text": "done"}]))).await.unwrap();
    let interrupt = first_pending_interrupt(&sessions, "s1").await;
    let observed = stack.store.now().await.unwrap();
    let deadline = interrupt.deadline.expect("a deadline");
    assert!(
        deadline >= before + 1500 && deadline <= observed + 1500,
        "the deadline is raised-at + 1500 ms exactly: {deadline}, start {before}, seen {observed}"
    );
    // Past the exact deadline but (usually) before the Timer's whole second:
    // the answer is late and refused, not accepted for up to 999 ms more.
    while stack.store.now().await.unwrap() < observed + 1500 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        !sessions
            .resolve_interrupt("s1", answer(interrupt.interrupt_id.clone(), true, None))
            .await
            .unwrap(),
        "an answer after the deadline is refused"
    );
    let snapshot = wait_for_turns(&sessions, "s1", 1).await;
    let after = stack.store.now().await.unwrap();
    assert!(after >= deadline);
    assert_eq!(
        tool_results(&snapshot)["c1"],
        "Tool call was rejected: the approval request expired before anyone answered it"
    );
    assert!(!sessions
        .resolve_interrupt("s1", answer(interrupt.interrupt_id, true, None))
        .await
        .unwrap());
    let events = all_events(&sessions, "s1").await;
    assert!(
        events
            .iter()
            .all(|e| e.event_type != event_type::TOOL_CALL_STARTED),
        "the expired call never ran"
    );
    let resolved: Vec<_> = events
        .iter()
        .filter(|e| e.event_type == event_type::INTERRUPT_RESOLVED)
        .collect();
    assert_eq!(resolved.len(), 1);
    assert_eq!(resolved[0].data["expired"], json!(true));
    assert_eq!(resolved[0].data["approved"], json!(false));
}

async fn a_rejected_approval_records_rejected_and_resolve_interrupt_returns_false_when_not_pending()
{
    let stack = started(vec![echo_agent("Reject")]).await;
    let sessions = stack.sessions("Reject");
    sessions.start_session("s1", &turn(json!([{"tool_calls": [tool_call("c1", "echo", json!({}), "non_idempotent_write")]}, {"text": "done"}]))).await.unwrap();
    let interrupt = first_pending_interrupt(&sessions, "s1").await;
    assert_eq!(interrupt.tool_call_id, "c1");
    let unknown = sessions
        .resolve_interrupt("s1", answer("turn-1/nope", true, None))
        .await;
    assert!(
        matches!(unknown, Err(SessionError::NoSuchInterrupt { .. })),
        "never raised: {unknown:?}"
    );
    let reject = answer(interrupt.interrupt_id.clone(), false, Some("not today"));
    assert!(sessions
        .resolve_interrupt("s1", reject.clone())
        .await
        .unwrap());
    assert!(
        !sessions.resolve_interrupt("s1", reject).await.unwrap(),
        "already answered"
    );
    let snapshot = wait_for_turns(&sessions, "s1", 1).await;
    assert_eq!(
        tool_results(&snapshot)["c1"],
        "Tool call was rejected: not today"
    );
    assert!(snapshot.pending_interrupts.is_empty());
    let steps = executed(&stack.step_history("s1").await);
    assert_eq!(
        count(&steps, step::CALL_SINGLE_ATTEMPT_TOOL),
        0,
        "{steps:?}"
    );
}

async fn resolve_interrupt_drops_the_rejection_message_on_approval() {
    let stack = started(vec![echo_agent("Approve")]).await;
    let sessions = stack.sessions("Approve");
    sessions.start_session("s1", &turn(json!([{"tool_calls": [tool_call("c1", "echo", json!({"ok": true}), "unclassified")]}, {"text": "done"}]))).await.unwrap();
    let interrupt = first_pending_interrupt(&sessions, "s1").await;
    assert!(sessions
        .resolve_interrupt("s1", answer(interrupt.interrupt_id, true, Some("ignored")))
        .await
        .unwrap());
    let snapshot = wait_for_turns(&sessions, "s1", 1).await;
    assert_eq!(tool_results(&snapshot)["c1"], r#"{"ok":true}"#);
    let resolved: Vec<_> = all_events(&sessions, "s1")
        .await
        .into_iter()
        .filter(|e| e.event_type == event_type::INTERRUPT_RESOLVED)
        .collect();
    assert_eq!(resolved.len(), 1);
    assert_eq!(resolved[0].data["approved"], json!(true));
    assert_eq!(resolved[0].data["rejection_message"], Value::Null);
    let steps = executed(&stack.step_history("s1").await);
    assert_eq!(
        count(&steps, step::CALL_SINGLE_ATTEMPT_TOOL),
        1,
        "{steps:?}"
    );
}

#[tokio::test]
async fn resolve_interrupt_retries_a_lock_conflict_until_the_step_holding_it_ends() {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn dexa::flow::FlowStore> = Arc::new(
        dexa::store::sqlite::SqliteStore::open(dir.path().join("s.sqlite"), Default::default())
            .unwrap(),
    );
    let holding = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = holding.clone();
    let holder = FlowType::new("LockHolder", "Hold")
        .step(
            StepDef::new("Hold", move |_ctx: StepContext| {
                let flag = flag.clone();
                async move {
                    flag.store(true, std::sync::atomic::Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(600)).await;
                    // Keep the flow running afterwards.
                    Ok(StepResult::go_to(
                        StepCall::new("Idle", Value::Null)
                            .wait_for(dexa::flow::ChannelWait::for_one("never")),
                    ))
                }
            })
            .locks([PENDING_INTERRUPTS])
            .policy(RetryPolicy::single_attempt()),
        )
        .step(StepDef::new("Idle", |_ctx: StepContext| async move {
            Ok(StepResult::end())
        }));
    let registry = Arc::new(
        Registry::new([
            holder,
            AgentSessionFlow::for_clients("Agent", AgentSessionOptions::default()).definition(),
        ])
        .unwrap(),
    );
    let client = dexa::flow::FlowClient::new(store.clone(), registry.clone());
    client
        .start_flow("LockHolder", "h1", Value::Null)
        .await
        .unwrap();
    let interrupt = AgentInterrupt {
        interrupt_id: "turn-1/c1".into(),
        turn_id: "turn-1".into(),
        tool_call_id: "c1".into(),
        tool_name: "t".into(),
        arguments: "{}".into(),
        deadline: None,
    };
    let value = serde_json::to_value(&interrupt).unwrap();
    client
        .rpc_once("h1", move |tx| {
            Ok(tx.set(PENDING_INTERRUPTS, "turn-1/c1", value.clone())?)
        })
        .await
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let worker = tokio::spawn(
        dexa::flow::Worker::new(store.clone(), registry, Default::default()).run(async move {
            let _ = stopped.await;
        }),
    );
    wait_until(
        "the lock holder to run",
        Duration::from_secs(10),
        || async {
            holding
                .load(std::sync::atomic::Ordering::SeqCst)
                .then_some(())
        },
    )
    .await;
    // A single try meets the lock.
    let once = client
        .rpc_once("h1", |tx| tx.lock(PENDING_INTERRUPTS))
        .await;
    assert!(
        matches!(once, Err(dexa::flow::RpcError::LockConflict { .. })),
        "{once:?}"
    );
    let sessions = AgentSessionClient::new(client.clone(), "Agent");
    let started_at = Instant::now();
    let resolved = sessions
        .resolve_interrupt("h1", answer("turn-1/c1", true, None))
        .await
        .unwrap();
    assert!(resolved);
    assert!(
        started_at.elapsed() >= Duration::from_millis(200),
        "it waited for the Step: {:?}",
        started_at.elapsed()
    );
    assert_eq!(
        store
            .channel_len("h1", INTERRUPT_RESOLUTIONS, "turn-1/c1")
            .await
            .unwrap(),
        1
    );
    let _ = stop.send(());
    let _ = worker.await;
}

async fn record_turn_failure_writes_the_turn_failure_note_exactly_through_build_user_message() {
    let stack = started(vec![echo_agent("Note")]).await;
    let sessions = stack.sessions("Note");
    let script = turn(json!([
        {"tool_calls": [tool_call("c1", "echo", json!({"a": 1}), "read"), tool_call("c2", "fail", json!({"b": 2}), "read")]},
        {"text": "never", "fail_attempts": 3}
    ]));
    sessions.start_session("s1", &script).await.unwrap();
    let snapshot = wait_for_turns(&sessions, "s1", 1).await;
    let expected = "[Dex] The previous turn failed after these tool calls ran:\n\
- echo {\"a\":1} -> succeeded: {\"a\":1}\n\
- fail {\"b\":2} -> failed: Tool call failed: echo-tool refused: {\"b\":2}\n\
Do not repeat these tool calls unless the user asks again.";
    assert_eq!(snapshot.messages.len(), 2, "the user message and the note");
    let note = &snapshot.messages[1];
    assert_eq!(note.text.as_deref(), Some(expected));
    assert_eq!(note.role, MessageRole::User);
    assert_eq!(note.sequence, 2);
    // Built by the runner's build-user-message.
    assert_eq!(
        note.framework_item,
        json!({"type": "user", "text": expected}).to_string()
    );
    assert!(
        snapshot.tool_calls.is_empty(),
        "the turn's records are cleared"
    );
    assert!(stack
        .store
        .get("s1", FRAMEWORK_RUN_STATE, "")
        .await
        .unwrap()
        .is_none());
    let failed: Vec<_> = all_events(&sessions, "s1")
        .await
        .into_iter()
        .filter(|e| e.event_type == event_type::TURN_FAILED)
        .collect();
    assert_eq!(failed.len(), 1);
    assert!(failed[0].data["error"]
        .as_str()
        .unwrap_or_default()
        .contains("scripted failure"));
    // The next turn sees the note and works.
    sessions.send_user_message("s1", "next").await.unwrap();
    let snapshot = wait_for_turns(&sessions, "s1", 2).await;
    assert_eq!(
        snapshot.messages.last().unwrap().text.as_deref(),
        Some("echo: next")
    );
    assert_eq!(
        expected,
        turn_failure_note(&[
            AgentToolCall {
                status: ToolCallStatus::Succeeded,
                output: Some("{\"a\":1}".into()),
                tool_name: "echo".into(),
                arguments: "{\"a\":1}".into(),
                ..injected_record("c1", ToolCallStatus::Succeeded, 0)
            },
            AgentToolCall {
                status: ToolCallStatus::Failed,
                output: None,
                error: Some("echo-tool refused: {\"b\":2}".into()),
                tool_name: "fail".into(),
                arguments: "{\"b\":2}".into(),
                ..injected_record("c2", ToolCallStatus::Failed, 1)
            },
        ])
    );
}

async fn snapshots_keep_the_last_200_messages_pages_are_clamped_and_stopped_sessions_are_served() {
    let stack = started(vec![echo_agent("Paging")]).await;
    let sessions = stack.sessions("Paging");
    sessions.start_session("s1", "").await.unwrap();
    for n in 1..=104 {
        assert!(sessions
            .send_user_message("s1", &format!("m{n}"))
            .await
            .unwrap());
    }
    let snapshot = wait_for_turns(&sessions, "s1", 104).await;
    assert_eq!(snapshot.messages.len(), 200);
    assert_eq!(snapshot.messages.first().unwrap().sequence, 9);
    assert_eq!(snapshot.messages.last().unwrap().sequence, 208);
    let page = |after: Option<u64>, limit: u32| {
        let sessions = sessions.clone();
        async move {
            sessions
                .list_agent_messages(
                    "s1",
                    ListAgentMessagesRequest {
                        after_sequence: after,
                        limit,
                    },
                )
                .await
                .unwrap()
        }
    };
    let one = page(None, 0).await;
    assert_eq!(one.messages.len(), 1, "a limit of 0 is clamped to 1");
    assert_eq!(one.messages[0].sequence, 1);
    assert_eq!(one.next_after_sequence, Some(1));
    let big = page(None, 1000).await;
    assert_eq!(
        big.messages.len(),
        200,
        "a limit over 200 is clamped to 200"
    );
    let mut all = Vec::new();
    let mut after = None;
    loop {
        let next = page(after, 50).await;
        all.extend(next.messages.iter().map(|m| m.sequence));
        match next.next_after_sequence {
            Some(seq) => after = Some(seq),
            None => break,
        }
    }
    assert_eq!(all, (1..=208).collect::<Vec<u64>>());
    assert_eq!(page(Some(206), 50).await.messages.len(), 2);

    assert!(sessions.stop_session("s1").await.unwrap());
    assert!(!sessions.stop_session("s1").await.unwrap());
    let stopped = sessions.get_agent_snapshot("s1").await.unwrap();
    assert_eq!(stopped.flow_status, FlowStatus::Stopped);
    assert_eq!(stopped.messages.len(), 200);
    assert_eq!(page(Some(200), 200).await.messages.len(), 8);
    assert!(matches!(
        sessions.send_user_message("s1", "late").await,
        Err(SessionError::NotRunning { .. })
    ));
}

async fn events_carry_turn_step_execution_and_attempt_and_every_event_type_appears() {
    let options = AgentSessionOptions::default()
        .tool_policy("emit_events", ToolPolicy::new(ToolEffect::Read));
    let stack = started(vec![echo_agent("Events").options(options)]).await;
    let sessions = stack.sessions("Events");
    let script = turn(json!([
        {"tool_calls": [tool_call("c1", "emit_events", json!({}), "read"), tool_call("c2", "echo", json!({}), "unclassified")], "usage": {"input": 1, "output": 1}},
        {"text": "Hello there", "deltas": ["Hel", "lo there"]}
    ]));
    sessions.start_session("s1", &script).await.unwrap();
    let interrupt = first_pending_interrupt(&sessions, "s1").await;
    sessions
        .resolve_interrupt("s1", answer(interrupt.interrupt_id, true, None))
        .await
        .unwrap();
    wait_for_turns(&sessions, "s1", 1).await;
    sessions
        .send_user_message("s1", &turn(json!([{"text": "x", "fail_attempts": 3}])))
        .await
        .unwrap();
    wait_for_turns(&sessions, "s1", 2).await;
    let events = all_events(&sessions, "s1").await;
    let types: BTreeSet<&str> = events.iter().map(|e| e.event_type.as_str()).collect();
    for expected in [
        event_type::TURN_STARTED,
        event_type::TURN_COMPLETED,
        event_type::TURN_FAILED,
        event_type::TEXT_DELTA,
        event_type::REASONING_DELTA,
        event_type::TOOL_CALL_STARTED,
        event_type::TOOL_CALL_FINISHED,
        event_type::TOOL_CALL_DEFERRED,
        event_type::INTERRUPT_RAISED,
        event_type::INTERRUPT_RESOLVED,
        event_type::USAGE_RECORDED,
    ] {
        assert!(types.contains(expected), "no {expected} event in {types:?}");
    }
    let history = stack.step_history("s1").await;
    let executions: BTreeSet<&str> = history
        .iter()
        .map(|e| e.step_execution_id.as_str())
        .collect();
    for event in &events {
        assert!(
            event.turn_id == "turn-1" || event.turn_id == "turn-2",
            "{event:?}"
        );
        assert!(
            executions.contains(event.step_execution_id.as_str()),
            "{event:?} names no Step execution"
        );
        assert!(event.attempt >= 1, "{event:?}");
    }
    // The runner's live text is tagged with its RunModel Step execution.
    let run_model: BTreeSet<&str> = history
        .iter()
        .filter(|e| e.step_type == step::RUN_MODEL)
        .map(|e| e.step_execution_id.as_str())
        .collect();
    // Consecutive deltas of one call may be merged into one entry.
    let text: Vec<&AgentEvent> = events
        .iter()
        .filter(|e| {
            e.event_type == event_type::TEXT_DELTA
                && run_model.contains(e.step_execution_id.as_str())
                && e.turn_id == "turn-1"
        })
        .collect();
    let streamed: String = text
        .iter()
        .filter_map(|e| e.data["text"].as_str())
        .collect();
    assert_eq!(streamed, "Hello there");
    assert!(text
        .iter()
        .all(|e| run_model.contains(e.step_execution_id.as_str())));
    // Each tool call finishes once: emit_events' own tool events about its
    // call (c1), which the host runs, were refused, not filtered out here.
    let mut finished: Vec<(&str, Option<&str>)> = events
        .iter()
        .filter(|e| e.event_type == event_type::TOOL_CALL_FINISHED)
        .map(|e| {
            (
                e.data["tool_call_id"].as_str().unwrap_or(""),
                e.origin.as_deref(),
            )
        })
        .collect();
    finished.sort();
    assert_eq!(finished, vec![("c1", None), ("c2", None)]);
    assert!(
        events
            .iter()
            .filter(|e| e.event_type == event_type::TOOL_CALL_STARTED)
            .all(|e| e.origin.is_none()),
        "no guest-written tool_call_started"
    );
    // What a guest wrote is marked as the guest's.
    let custom: Vec<&AgentEvent> = events.iter().filter(|e| e.event_type == "custom").collect();
    assert_eq!(custom.len(), 1);
    assert_eq!(custom[0].origin.as_deref(), Some(ORIGIN_GUEST));
}

async fn the_events_capacity_bounds_the_stream() {
    let options = AgentSessionOptions::default().events_capacity(4096);
    let stack = started(vec![echo_agent("Capacity").options(options)]).await;
    let sessions = stack.sessions("Capacity");
    // 10 KB of deltas: merged into entries that each fit the stream, and
    // more of them than it holds.
    let deltas: Vec<String> = (0..200)
        .map(|n| format!("chunk-{n:03} {}", "x".repeat(40)))
        .collect();
    sessions
        .start_session(
            "s1",
            &turn(json!([{"text": deltas.concat(), "deltas": deltas}])),
        )
        .await
        .unwrap();
    wait_for_turns(&sessions, "s1", 1).await;
    let page = stack
        .store
        .read_stream("s1", AGENT_EVENTS, 0, 10_000)
        .await
        .unwrap();
    assert!(
        page.first_seq > 1,
        "the oldest events were trimmed: {}",
        page.first_seq
    );
    let bytes: usize = page
        .entries
        .iter()
        .map(|e| e.payload.to_string().len())
        .sum();
    assert!(bytes <= 4096 + 1024, "{bytes} bytes kept");
    assert_eq!(
        page.entries.last().map(|e| e.payload["type"].clone()),
        Some(json!(event_type::TURN_COMPLETED))
    );
}

async fn several_agents_run_at_once_each_with_its_own_runner_and_tools() {
    let ledger = tempfile::tempdir().unwrap();
    let alpha = echo_agent("Alpha");
    let beta = AgentSpec::scripted("Beta")
        .tool(
            "ledger-tool",
            Grants::none().dir(ledger.path(), "/ledger", DirAccess::ReadWrite),
        )
        .options(AgentSessionOptions::default().tool_policy(
            "record_payment",
            ToolPolicy::new(ToolEffect::IdempotentWrite),
        ));
    let stack = started(vec![alpha, beta]).await;
    let script = turn(json!([
        {"tool_calls": [tool_call("c1", "echo", json!({"e": 1}), "read"), tool_call("c2", "record_payment", json!({"amount": 5}), "idempotent_write")]},
        {"text": "done"}
    ]));
    let (a, b) = (stack.sessions("Alpha"), stack.sessions("Beta"));
    a.start_session("a1", &script).await.unwrap();
    b.start_session("b1", &script).await.unwrap();
    let (sa, sb) = tokio::join!(wait_for_turns(&a, "a1", 1), wait_for_turns(&b, "b1", 1));
    let (ra, rb) = (tool_results(&sa), tool_results(&sb));
    assert_eq!(ra["c1"], r#"{"e":1}"#, "Alpha's echo-tool served echo");
    assert!(
        ra["c2"].contains("scripted-runner"),
        "Alpha has no ledger: its runner ran it: {}",
        ra["c2"]
    );
    assert!(
        rb["c1"].contains("scripted-runner"),
        "Beta has no echo-tool: {}",
        rb["c1"]
    );
    assert!(
        !rb["c2"].contains("scripted-runner"),
        "Beta's ledger-tool served it: {}",
        rb["c2"]
    );
    assert_eq!(
        std::fs::read_dir(ledger.path()).unwrap().count(),
        1,
        "one payment recorded"
    );
    assert_eq!(
        stack.store.flow("a1").await.unwrap().unwrap().flow_type,
        "Alpha"
    );
}

async fn the_tool_steps_of_one_response_run_in_parallel() {
    let options =
        AgentSessionOptions::default().tool_policy("gate", ToolPolicy::new(ToolEffect::Read));
    let stack = started(vec![AgentSpec::scripted("Parallel")
        .tool("gate-tool", Grants::none())
        .options(options)])
    .await;
    let sessions = stack.sessions("Parallel");
    // Each gate waits until the other is reached: both pass only if they overlap.
    let script = turn(json!([
        {"tool_calls": [
            tool_call("a", "gate", json!({"name": "a", "await": ["b", "c"], "timeout_ms": 10000}), "read"),
            tool_call("b", "gate", json!({"name": "b", "await": ["a", "c"], "timeout_ms": 10000}), "read"),
            tool_call("c", "gate", json!({"name": "c", "await": ["a", "b"], "timeout_ms": 10000}), "read")
        ]},
        {"text": "done"}
    ]));
    sessions.start_session("s1", &script).await.unwrap();
    let snapshot = wait_for_turns(&sessions, "s1", 1).await;
    let results = tool_results(&snapshot);
    for id in ["a", "b", "c"] {
        assert_eq!(results[id], format!("gate {id} passed"));
    }
}

/// A user message build-user-message cannot turn into a `user` message is
/// given up after StartAgentSession's attempts, with the reason recorded;
/// the session itself goes on (it has no failure route to fall back to).
async fn build_user_message_must_return_the_user_role() {
    let stack = started(vec![
        AgentSpec::scripted("Role").runner_config("user_role", "assistant")
    ])
    .await;
    let sessions = stack.sessions("Role");
    sessions.start_session("s1", "hello").await.unwrap();
    let snapshot = wait_for_turns(&sessions, "s1", 1).await;
    assert_eq!(snapshot.flow_status, FlowStatus::Running);
    let error = snapshot
        .state
        .and_then(|s| s.last_turn_error)
        .unwrap_or_default();
    assert!(
        error.contains("the user message could not be used") && error.contains("it must be user"),
        "{error}"
    );
    assert!(snapshot.messages.is_empty(), "the message was not stored");
    let history = stack.step_history("s1").await;
    let attempts = history
        .iter()
        .filter(|e| e.step_type == step::START_AGENT_SESSION)
        .count();
    assert_eq!(attempts, 3, "its three attempts, then the session went on");
}

async fn the_host_model_answers_run_model_and_its_usage_and_text_reach_the_session() {
    use dexa::plugin::wit::{
        MessageRole as WitRole, ModelMessage, ModelResponse, ModelToolCall, Usage,
    };
    use dexa::providers::ScriptedModelProvider;
    let responses = vec![
        ModelResponse {
            message: ModelMessage {
                role: WitRole::Assistant,
                content: None,
                tool_calls: vec![ModelToolCall {
                    id: "m1".into(),
                    name: "echo".into(),
                    arguments: r#"{"from":"model"}"#.into(),
                }],
                tool_call_id: None,
            },
            usage: Usage {
                input_tokens: 7,
                output_tokens: 3,
                total_tokens: 10,
            },
            finish_reason: "tool_calls".into(),
        },
        ModelResponse {
            message: ModelMessage {
                role: WitRole::Assistant,
                content: Some("the model is done".into()),
                tool_calls: vec![],
                tool_call_id: None,
            },
            usage: Usage {
                input_tokens: 20,
                output_tokens: 5,
                total_tokens: 25,
            },
            finish_reason: "stop".into(),
        },
    ];
    let model = Arc::new(ScriptedModelProvider::new(responses));
    let options =
        AgentSessionOptions::default().tool_policy("echo", ToolPolicy::new(ToolEffect::Read));
    let stack = started(vec![echo_agent("Model")
        .options(options)
        .model(model.clone())])
    .await;
    let sessions = stack.sessions("Model");
    sessions
        .start_session("s1", &turn(json!([{"model": true}, {"model": true}])))
        .await
        .unwrap();
    let snapshot = wait_for_turns(&sessions, "s1", 1).await;
    assert_eq!(snapshot.state.as_ref().unwrap().last_turn_error, None);
    assert_eq!(
        snapshot.usage,
        AgentUsage {
            input_tokens: 27,
            output_tokens: 8,
            total_tokens: 35,
            model_calls: 2
        }
    );
    assert_eq!(tool_results(&snapshot)["m1"], r#"{"from":"model"}"#);
    assert_eq!(
        snapshot.messages.last().unwrap().text.as_deref(),
        Some("the model is done")
    );
    // The second request carried the tool's result back to the model.
    let requests = model.requests();
    assert_eq!(requests.len(), 2);
    assert!(requests[1]
        .messages
        .iter()
        .any(|m| m.tool_call_id.as_deref() == Some("m1")));
    // The provider's streamed text reached the session's events.
    let text: String = all_events(&sessions, "s1")
        .await
        .into_iter()
        .filter(|e| e.event_type == event_type::TEXT_DELTA)
        .map(|e| e.data["text"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(text, "the model is done");
}

async fn a_runner_may_add_an_approval_but_never_skip_one() {
    let stack = started(vec![echo_agent("Lying")]).await;
    let sessions = stack.sessions("Lying");
    let script = turn(json!([
        {"tool_calls": [
            {"id": "skip", "name": "echo", "arguments": {}, "effect": "non_idempotent_write", "requires_approval": false},
            {"id": "add", "name": "echo", "arguments": {}, "effect": "read", "requires_approval": true}
        ]},
        {"text": "done"}
    ]));
    sessions.start_session("s1", &script).await.unwrap();
    let snapshot = wait_for_agent_snapshot(&sessions, "s1", "both approvals", |s| {
        (s.pending_interrupts.len() == 2).then(|| s.clone())
    })
    .await;
    assert!(
        record(&snapshot, "skip").requires_approval,
        "the effect's approval stands"
    );
    assert!(record(&snapshot, "add").requires_approval);
    assert!(stack
        .step_history("s1")
        .await
        .iter()
        .all(|e| e.step_type != step::CALL_SINGLE_ATTEMPT_TOOL));
}

async fn an_event_too_large_for_the_stream_is_dropped_and_the_turn_completes() {
    let options = AgentSessionOptions::default().events_capacity(2000);
    let stack = started(vec![echo_agent("Oversize").options(options)]).await;
    let sessions = stack.sessions("Oversize");
    let big = "x".repeat(5000);
    sessions
        .start_session(
            "s1",
            &turn(json!([{"text": big.clone(), "deltas": [big, "small"]}])),
        )
        .await
        .unwrap();
    let snapshot = wait_for_turns(&sessions, "s1", 1).await;
    assert_eq!(snapshot.state.unwrap().last_turn_error, None);
    assert_eq!(
        snapshot
            .messages
            .last()
            .unwrap()
            .text
            .as_deref()
            .map(str::len),
        Some(5000),
        "the message is stored in full"
    );
    let deltas: Vec<String> = all_events(&sessions, "s1")
        .await
        .into_iter()
        .filter(|e| e.event_type == event_type::TEXT_DELTA)
        .map(|e| e.data["text"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(deltas, vec!["small".to_string()]);
    let steps = executed(&stack.step_history("s1").await);
    assert_eq!(
        count(&steps, step::RUN_MODEL),
        1,
        "committed on the first attempt: {steps:?}"
    );
}

/// The effect a tool component declares in `list-tools` binds the runner: a
/// runner that reports a non-idempotent write as a read needing no approval
/// gets the approval and the single-attempt path all the same.
async fn a_runner_cannot_skip_an_approval_by_under_declaring_a_tools_effect() {
    let outbox = tempfile::tempdir().unwrap();
    let agent = AgentSpec::scripted("Underdeclared").tool(
        "notify-tool",
        Grants::none().dir(outbox.path(), "/outbox", DirAccess::ReadWrite),
    );
    let stack = started(vec![agent]).await;
    let sessions = stack.sessions("Underdeclared");
    let mut call = tool_call("n1", "send_notification", json!({"message": "hi"}), "read");
    call["requires_approval"] = json!(false);
    sessions
        .start_session(
            "s1",
            &turn(json!([{"tool_calls": [call]}, {"text": "done"}])),
        )
        .await
        .unwrap();
    let interrupt = first_pending_interrupt(&sessions, "s1").await;
    assert_eq!(interrupt.tool_call_id, "n1");
    let snapshot = sessions.get_agent_snapshot("s1").await.unwrap();
    let pending = record(&snapshot, "n1");
    assert_eq!(pending.effect, ToolEffect::NonIdempotentWrite);
    assert!(pending.requires_approval);
    assert_eq!(pending.status, ToolCallStatus::Pending);
    assert!(
        !outbox.path().join("sent.log").exists(),
        "nothing was sent before the approval"
    );
    sessions
        .resolve_interrupt("s1", answer(interrupt.interrupt_id, true, None))
        .await
        .unwrap();
    wait_for_turns(&sessions, "s1", 1).await;
    let history = stack.step_history("s1").await;
    assert!(
        executed(&history)
            .iter()
            .any(|s| s == step::CALL_SINGLE_ATTEMPT_TOOL),
        "a non-idempotent write takes the single-attempt path"
    );
}

/// A session client on its own SQLite store (not the stack's), run by the
/// stack's registry: a test can reach that store's writer.
fn client_on_own_store(
    stack: &SessionStack,
    flow_type: &str,
) -> (dexa::store::sqlite::SqliteStore, AgentSessionClient) {
    let store = dexa::store::sqlite::SqliteStore::open(
        stack.dir.path().join("own.sqlite"),
        Default::default(),
    )
    .unwrap_or_else(|err| panic!("open store: {err}"));
    let client = dexa::flow::FlowClient::new(Arc::new(store.clone()), stack.registry.clone());
    (store, AgentSessionClient::new(client, flow_type))
}

#[tokio::test]
async fn snapshots_and_message_pages_do_not_wait_for_the_store_writer() {
    let stack = SessionStack::new(vec![AgentSpec::scripted("Reader")]).await;
    let (store, sessions) = client_on_own_store(&stack, "Reader");
    sessions.start_session("s1", "").await.unwrap();
    assert!(sessions.send_user_message("s1", "hello").await.unwrap());
    // A viewer that has polled before holds a pooled read connection.
    sessions.get_agent_snapshot("s1").await.unwrap();

    // A slow commit holds the writer; the viewer polls meanwhile.
    // Long, so that even a busy machine reads well before it ends.
    let hold = Duration::from_secs(5);
    store.hold_writer_for_test(hold).await.unwrap();
    let held_at = Instant::now();
    let snapshot = sessions.get_agent_snapshot("s1").await.unwrap();
    let page = sessions
        .list_agent_messages(
            "s1",
            ListAgentMessagesRequest {
                after_sequence: None,
                limit: 10,
            },
        )
        .await
        .unwrap();
    let read_in = held_at.elapsed();
    assert!(
        read_in < hold / 2,
        "the reads waited {read_in:?} for a writer held for {hold:?}"
    );
    assert_eq!(snapshot.queued_message_count, 1);
    assert_eq!(snapshot.flow_status, FlowStatus::Running);
    assert!(page.messages.is_empty());

    // The writer was held all along: a write queued now waits it out.
    assert!(sessions.send_user_message("s1", "after").await.unwrap());
    assert!(
        held_at.elapsed() >= hold - Duration::from_millis(500),
        "the write did not wait for the held writer ({:?})",
        held_at.elapsed()
    );
}

async fn a_read_only_rpc_refuses_every_write() {
    let stack = SessionStack::new(vec![AgentSpec::scripted("ReadOnly")]).await;
    let sessions = stack.sessions("ReadOnly");
    sessions.start_session("s1", "").await.unwrap();
    let client = stack.flow_client();
    let set = client
        .read_rpc("s1", |tx| Ok(tx.set("NOTE", "", json!("x"))?))
        .await;
    let delete = client.read_rpc("s1", |tx| Ok(tx.delete("NOTE", "")?)).await;
    let publish = client
        .read_rpc("s1", |tx| {
            Ok(tx.publish(QUEUED_USER_MESSAGES, "", json!({"text": "sneaked in"}))?)
        })
        .await;
    let lock = client
        .read_rpc("s1", |tx| tx.lock(PENDING_INTERRUPTS))
        .await;
    assert!(set.is_err(), "{set:?}");
    assert!(delete.is_err(), "{delete:?}");
    assert!(publish.is_err(), "{publish:?}");
    assert!(lock.is_err(), "{lock:?}");
    // Reads work in one, and nothing above was written.
    let (flow, note, queued) = client
        .read_rpc("s1", |tx| {
            Ok((
                tx.flow()?,
                tx.get("NOTE", "")?,
                tx.channel_len(QUEUED_USER_MESSAGES, "")?,
            ))
        })
        .await
        .unwrap();
    assert_eq!(flow.map(|f| f.status), Some(FlowStatus::Running));
    assert_eq!(note, None);
    assert_eq!(queued, 0);
}

async fn a_user_message_over_the_cap_is_refused_before_anything_is_queued() {
    let stack = SessionStack::new(vec![AgentSpec::scripted("Big")]).await;
    let sessions = stack.sessions("Big");
    let over = "x".repeat(MAX_USER_MESSAGE_BYTES + 1);
    let started = sessions.start_session("s1", &over).await;
    assert!(
        matches!(
            started,
            Err(SessionError::MessageTooLarge { bytes, limit })
                if bytes == MAX_USER_MESSAGE_BYTES + 1 && limit == MAX_USER_MESSAGE_BYTES
        ),
        "{started:?}"
    );
    assert!(
        stack.store.flow("s1").await.unwrap().is_none(),
        "no session was created"
    );
    sessions.start_session("s1", "").await.unwrap();
    assert!(matches!(
        sessions.send_user_message("s1", &over).await,
        Err(SessionError::MessageTooLarge { .. })
    ));
    assert!(matches!(
        sessions
            .send_user_message_with_key("s1", &over, Some("big"))
            .await,
        Err(SessionError::MessageTooLarge { .. })
    ));
    // At the cap is fine.
    let at_cap = "x".repeat(MAX_USER_MESSAGE_BYTES);
    assert!(sessions.send_user_message("s1", &at_cap).await.unwrap());
    // A deployment can set a lower cap.
    let strict = stack.sessions("Big").with_max_user_message_bytes(10);
    assert!(matches!(
        strict.send_user_message("s1", "eleven byte").await,
        Err(SessionError::MessageTooLarge {
            bytes: 11,
            limit: 10
        })
    ));
    assert_eq!(
        stack
            .store
            .channel_len("s1", QUEUED_USER_MESSAGES, "")
            .await
            .unwrap(),
        1,
        "only the message at the cap was queued"
    );
}

async fn a_user_message_at_the_cap_fits_build_user_message_whatever_it_holds() {
    let stack = started(vec![AgentSpec::scripted("AtCap")]).await;
    let sessions = stack.sessions("AtCap");
    // Control characters are the worst case: JSON escapes each as 6 bytes,
    // and the runner returns the text both raw and inside its JSON item.
    let text = "\u{1}".repeat(MAX_USER_MESSAGE_BYTES);
    sessions.start_session("s1", &text).await.unwrap();
    let snapshot = wait_for_turns(&sessions, "s1", 1).await;
    let state = snapshot.state.clone().unwrap();
    assert_eq!(state.last_turn_error, None);
    assert_eq!(snapshot.flow_status, FlowStatus::Running);
    let user = dexa_tests::session::texts_of(&snapshot, MessageRole::User);
    assert_eq!(
        user.iter().map(String::len).collect::<Vec<_>>(),
        vec![MAX_USER_MESSAGE_BYTES]
    );
}

async fn an_idempotency_key_holds_for_every_store_handle_and_a_bad_key_is_refused() {
    let stack = SessionStack::new(vec![AgentSpec::scripted("Keys")]).await;
    let sessions = stack.sessions("Keys");
    sessions.start_session("s1", "").await.unwrap();
    // Another handle on the same file, as another process opens it.
    let other = stack.another_handle().await;
    let elsewhere = AgentSessionClient::new(
        dexa::flow::FlowClient::new(other, stack.registry.clone()),
        "Keys",
    );
    let send = |client: &AgentSessionClient, text: &str, key: &str| {
        let (client, text, key) = (client.clone(), text.to_string(), key.to_string());
        async move {
            client
                .send_user_message_with_key("s1", &text, Some(key.as_str()))
                .await
        }
    };
    assert_eq!(
        send(&sessions, "pay", "k-1").await.unwrap(),
        SendOutcome::Queued
    );
    assert_eq!(
        send(&elsewhere, "pay", "k-1").await.unwrap(),
        SendOutcome::Replayed
    );
    let reused = send(&elsewhere, "pay twice", "k-1").await;
    assert!(
        matches!(reused, Err(SessionError::IdempotencyKeyReused { .. })),
        "{reused:?}"
    );
    let too_long = "k".repeat(MAX_IDEMPOTENCY_KEY_BYTES + 1);
    let bad: [&str; 6] = ["", " k", "k ", "clé", "a\tb", too_long.as_str()];
    for key in bad {
        let refused = send(&sessions, "pay", key).await;
        assert!(
            matches!(refused, Err(SessionError::InvalidIdempotencyKey(_))),
            "{key:?}: {refused:?}"
        );
    }
    let longest = "~".repeat(MAX_IDEMPOTENCY_KEY_BYTES);
    assert_eq!(
        send(&sessions, "pay", longest.as_str()).await.unwrap(),
        SendOutcome::Queued
    );
    // Blank text queues nothing and records no key.
    assert_eq!(
        send(&sessions, "  ", "k-blank").await.unwrap(),
        SendOutcome::Blank
    );
    assert_eq!(
        send(&sessions, "now", "k-blank").await.unwrap(),
        SendOutcome::Queued
    );
    assert_eq!(
        stack
            .store
            .channel_len("s1", QUEUED_USER_MESSAGES, "")
            .await
            .unwrap(),
        3
    );
    // A stopped session still recognises a retry.
    sessions.stop_session("s1").await.unwrap();
    assert_eq!(
        send(&sessions, "pay", "k-1").await.unwrap(),
        SendOutcome::Replayed
    );
    assert!(matches!(
        send(&sessions, "pay", "k-new").await,
        Err(SessionError::NotRunning { .. })
    ));
}

/// A keyed send remembers where the session's events stood before it (as
/// its sender read them), and a replay answers with that: the replay's wait
/// for the message's turn starts there rather than at the oldest event kept,
/// so a cheap retry does not read the whole stream.
async fn a_replay_answers_where_the_first_send_saw_the_events_end() {
    let stack = SessionStack::new(vec![AgentSpec::scripted("Replays")]).await;
    let sessions = stack.sessions("Replays");
    sessions.start_session("s1", "").await.unwrap();
    let head = sessions.event_head("s1").await.unwrap();
    let trace = || dexa::telemetry::traces::TurnTrace::new_root();
    let first = sessions
        .send_traced("s1", "hello", Some("k1"), false, trace(), Some(head))
        .await
        .unwrap();
    assert_eq!(first.outcome, SendOutcome::Queued);
    let stored = stack
        .store
        .get("s1", IDEMPOTENCY_KEYS, "k1")
        .await
        .unwrap()
        .expect("the key is remembered");
    assert_eq!(stored.value["events_after"], json!(head));
    // The replay's own sender read a later head; the first send's stands.
    let replay = sessions
        .send_traced("s1", "hello", Some("k1"), false, trace(), Some(i64::MAX))
        .await
        .unwrap();
    assert_eq!(replay.outcome, SendOutcome::Replayed);
    assert_eq!(replay.message_id, first.message_id);
    assert_eq!(replay.events_after, Some(head));
    // A key sent without a head (a send that will not wait) has none.
    sessions
        .send_traced("s1", "plain", Some("k2"), false, trace(), None)
        .await
        .unwrap();
    let replay = sessions
        .send_traced("s1", "plain", Some("k2"), false, trace(), Some(5))
        .await
        .unwrap();
    assert_eq!(replay.outcome, SendOutcome::Replayed);
    assert_eq!(replay.events_after, None);
}

async fn a_session_remembers_at_most_its_newest_idempotency_keys() {
    let stack = SessionStack::new(vec![AgentSpec::scripted("ManyKeys")]).await;
    let sessions = stack.sessions("ManyKeys");
    sessions.start_session("s1", "").await.unwrap();
    let cap = MAX_IDEMPOTENCY_KEYS as usize;
    for n in 0..cap + 5 {
        let outcome = sessions
            .send_user_message_with_key("s1", &format!("m{n}"), Some(format!("k-{n}").as_str()))
            .await
            .unwrap();
        assert_eq!(outcome, SendOutcome::Queued, "k-{n}");
    }
    for name in [IDEMPOTENCY_KEYS, IDEMPOTENCY_KEY_ORDER] {
        let kept = stack
            .store
            .read_map("s1", name, MapQuery::default())
            .await
            .unwrap();
        assert_eq!(kept.len(), cap, "{name}");
    }
    // The newest and the oldest kept are remembered; the five before are not.
    let newest = format!("k-{}", cap + 4);
    let replayed = sessions
        .send_user_message_with_key("s1", &format!("m{}", cap + 4), Some(newest.as_str()))
        .await
        .unwrap();
    assert_eq!(replayed, SendOutcome::Replayed);
    let replayed = sessions
        .send_user_message_with_key("s1", "m5", Some("k-5"))
        .await
        .unwrap();
    assert_eq!(replayed, SendOutcome::Replayed);
    let forgotten = sessions
        .send_user_message_with_key("s1", "m0", Some("k-0"))
        .await
        .unwrap();
    assert_eq!(forgotten, SendOutcome::Queued);
    let kept = stack
        .store
        .read_map("s1", IDEMPOTENCY_KEYS, MapQuery::default())
        .await
        .unwrap();
    assert_eq!(kept.len(), cap);
    assert_eq!(
        stack
            .store
            .channel_len("s1", QUEUED_USER_MESSAGES, "")
            .await
            .unwrap(),
        (cap + 6) as u64
    );
}

/// A long answer streamed token by token is stored as a few merged delta
/// entries, each at most 4 KiB, not one row per token.
async fn a_ten_thousand_delta_answer_is_stored_in_a_few_rows() {
    let stack = started(vec![echo_agent("Deltas")]).await;
    let sessions = stack.sessions("Deltas");
    let deltas: Vec<String> = (0..10_000).map(|n| format!("t{} ", n % 10)).collect();
    sessions
        .start_session(
            "s1",
            &turn(json!([{"text": deltas.concat(), "deltas": deltas}])),
        )
        .await
        .unwrap();
    wait_for_turns(&sessions, "s1", 1).await;
    let rows: Vec<AgentEvent> = all_events(&sessions, "s1")
        .await
        .into_iter()
        .filter(|e| e.event_type == event_type::TEXT_DELTA)
        .collect();
    let streamed: String = rows
        .iter()
        .filter_map(|e| e.data["text"].as_str())
        .collect();
    assert!(
        streamed == deltas.concat(),
        "every token, in order: {} of {} bytes streamed",
        streamed.len(),
        deltas.concat().len()
    );
    println!(
        "10,000 deltas ({} bytes) stored as {} rows",
        streamed.len(),
        rows.len()
    );
    assert!(rows.len() <= 100, "{} rows for 10,000 deltas", rows.len());
    assert!(rows
        .iter()
        .all(|e| e.data["text"].as_str().map_or(0, str::len) <= 4096));
}

/// A runner's tool events about a call the host runs (one already deferred,
/// or one it defers in the same response) are refused; those about tools its
/// framework ran itself are kept, marked as the guest's.
async fn a_runner_cannot_report_the_hosts_tool_calls() {
    let stack = started(vec![echo_agent("Forger")]).await;
    let sessions = stack.sessions("Forger");
    let script = turn(json!([
        {"tool_events": ["c1", "inner-1"], "tool_calls": [tool_call("c1", "echo", json!({}), "read")]},
        {"tool_events": ["c1", "inner-2"], "text": "done"}
    ]));
    sessions.start_session("s1", &script).await.unwrap();
    wait_for_turns(&sessions, "s1", 1).await;
    let events = all_events(&sessions, "s1").await;
    let tool_events = |id: &str| -> Vec<(String, Option<String>)> {
        events
            .iter()
            .filter(|e| {
                (e.event_type == event_type::TOOL_CALL_STARTED
                    || e.event_type == event_type::TOOL_CALL_FINISHED)
                    && e.data["tool_call_id"] == json!(id)
            })
            .map(|e| (e.event_type.clone(), e.origin.clone()))
            .collect()
    };
    assert_eq!(
        tool_events("c1"),
        vec![
            (event_type::TOOL_CALL_STARTED.to_string(), None),
            (event_type::TOOL_CALL_FINISHED.to_string(), None)
        ],
        "only the host's own, once each"
    );
    for inner in ["inner-1", "inner-2"] {
        let guest = Some(ORIGIN_GUEST.to_string());
        assert_eq!(
            tool_events(inner),
            vec![
                (event_type::TOOL_CALL_STARTED.to_string(), guest.clone()),
                (event_type::TOOL_CALL_FINISHED.to_string(), guest)
            ],
            "{inner}: kept, marked as the runner's"
        );
    }
}

/// RecordTurnFailure has no failure route: when its note cannot be built
/// (the runner traps on it), its last attempt ends the turn without the note
/// and says why, and the session goes on.
async fn a_failure_note_the_runner_cannot_take_still_ends_the_turn() {
    let agent = echo_agent("NoNote").runner_config("refuse_notes", "yes");
    let stack = started(vec![agent]).await;
    let sessions = stack.sessions("NoNote");
    let script = turn(json!([
        {"tool_calls": [tool_call("c1", "echo", json!({"n": 1}), "read")]},
        {"text": "never", "fail_attempts": 3}
    ]));
    sessions.start_session("s1", &script).await.unwrap();
    let snapshot = wait_for_turns(&sessions, "s1", 1).await;
    assert_eq!(snapshot.flow_status, FlowStatus::Running);
    let error = snapshot
        .state
        .clone()
        .and_then(|s| s.last_turn_error)
        .unwrap_or_default();
    assert!(
        error.contains("scripted failure on attempt 3")
            && error.contains("its failure note could not be built")
            && error.contains("refuses the failure note"),
        "{error}"
    );
    assert!(
        dexa_tests::session::texts_of(&snapshot, MessageRole::User)
            .iter()
            .all(|t| !t.starts_with("[Dex]")),
        "no note was stored"
    );
    assert!(sessions.send_user_message("s1", "hello").await.unwrap());
    let after = wait_for_turns(&sessions, "s1", 2).await;
    assert_eq!(after.state.and_then(|s| s.last_turn_error), None);
}

/// Every test above without its own `#[tokio::test]` runs once per store
/// backend; those two read SQLite's writer and stay SQLite's.
macro_rules! backends {
    ($($test:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test]
                async fn $test() {
                    dexa_tests::session::BACKEND
                        .scope(dexa_tests::session::Backend::Sqlite, super::$test())
                        .await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test]
                async fn $test() {
                    dexa_tests::session::BACKEND
                        .scope(dexa_tests::session::Backend::Postgres, super::$test())
                        .await;
                }
            )*
        }
    };
}

backends!(
    a_turn_with_tools_follows_the_flow_shape,
    step_policies_follow_the_spec,
    run_model_failures_retry_three_times_then_record_turn_failure_and_the_next_turn_clears_the_error,
    an_invalid_tool_calls_requested_fails_the_turn,
    turn_completed_appends_all_messages_in_one_commit_in_order_with_sequences_from_1_and_12_digit_keys,
    the_usage_of_each_model_call_is_added_to_the_session_total,
    a_blank_initial_message_starts_no_turn_and_blank_messages_are_refused,
    tools_served_by_a_component_go_to_it_and_others_to_the_runner_with_the_idempotency_key,
    the_policy_is_explicit_then_framework_effect_then_default_and_approval_follows_the_effect_table,
    a_tool_execution_error_records_failed_with_no_retry,
    other_tool_errors_retry_as_the_effect_allows_then_record_failed_or_outcome_unknown,
    every_tool_call_publishes_exactly_one_result_when_its_record_becomes_final,
    a_tool_step_whose_record_is_already_final_ends_without_running,
    resume_turn_waits_again_if_a_consumed_result_left_a_record_of_the_turn_unfinished,
    a_deadline_timer_that_fires_early_waits_again,
    approvals_expire_at_their_exact_deadline_and_the_timer_fires_on_the_whole_second,
    a_rejected_approval_records_rejected_and_resolve_interrupt_returns_false_when_not_pending,
    resolve_interrupt_drops_the_rejection_message_on_approval,
    record_turn_failure_writes_the_turn_failure_note_exactly_through_build_user_message,
    snapshots_keep_the_last_200_messages_pages_are_clamped_and_stopped_sessions_are_served,
    events_carry_turn_step_execution_and_attempt_and_every_event_type_appears,
    the_events_capacity_bounds_the_stream,
    several_agents_run_at_once_each_with_its_own_runner_and_tools,
    the_tool_steps_of_one_response_run_in_parallel,
    build_user_message_must_return_the_user_role,
    the_host_model_answers_run_model_and_its_usage_and_text_reach_the_session,
    a_runner_may_add_an_approval_but_never_skip_one,
    an_event_too_large_for_the_stream_is_dropped_and_the_turn_completes,
    a_runner_cannot_skip_an_approval_by_under_declaring_a_tools_effect,
    a_read_only_rpc_refuses_every_write,
    a_user_message_over_the_cap_is_refused_before_anything_is_queued,
    a_user_message_at_the_cap_fits_build_user_message_whatever_it_holds,
    an_idempotency_key_holds_for_every_store_handle_and_a_bad_key_is_refused,
    a_session_remembers_at_most_its_newest_idempotency_keys,
    a_replay_answers_where_the_first_send_saw_the_events_end,
    a_ten_thousand_delta_answer_is_stored_in_a_few_rows,
    a_runner_cannot_report_the_hosts_tool_calls,
    a_failure_note_the_runner_cannot_take_still_ends_the_turn,
);
