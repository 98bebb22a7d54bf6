//! Crash safety: real `dexa worker` processes killed at exact points (file
//! gates in the tool or the runner, or an abort right after a commit), and
//! what runs again afterwards. See `dexa_tests::kit`.

use dexa::flow::history;
use dexa::session::{
    event_type, step, AgentSnapshot, MessageRole, ResolveInterruptRequest, ToolCallStatus,
    ToolEffect,
};
use dexa_tests::kit::{
    entries, render_config, wait_for_agent_snapshot, wait_for_turns, AgentTestStack, KitAgent,
    KitSettings,
};
use dexa_tests::session::{last_text, texts_of};
use serde_json::{json, Value};

const AGENT: &str = "Crash";

fn agent(turns: Value) -> KitAgent {
    KitAgent::scripted(AGENT, json!({ "turns": turns })).tool("gate-tool")
}

/// A scripted tool call of gate-tool.
fn call(id: &str, tool: &str, args: Value) -> Value {
    json!({"id": id, "name": tool, "arguments": args})
}

/// The record of tool call `id` while its turn runs (a finished turn's
/// records are cleared).
fn tool_call<'a>(snapshot: &'a AgentSnapshot, id: &str) -> &'a dexa::session::AgentToolCall {
    snapshot
        .tool_calls
        .iter()
        .find(|c| c.tool_call_id == id)
        .unwrap_or_else(|| panic!("no tool call {id} in {:?}", snapshot.tool_calls))
}

/// The final status of tool call `id` in each of its tool_call_finished
/// events (one per record that became final).
async fn finished(stack: &AgentTestStack, id: &str) -> Vec<String> {
    dexa_tests::session::all_events(&stack.sessions(AGENT), "s1")
        .await
        .into_iter()
        .filter(|e| e.event_type == event_type::TOOL_CALL_FINISHED)
        .filter(|e| e.data["tool_call_id"] == id)
        .map(|e| e.data["status"].as_str().unwrap_or_default().to_string())
        .collect()
}

async fn a_worker_killed_while_waiting_for_approval_is_replaced_and_the_tool_runs_once() {
    let mut stack = AgentTestStack::new(vec![agent(json!([{"steps": [
        {"tool_calls": [call("pay", "log", json!({"name": "pay"}))]},
        {"text": "paid"}
    ]}]))
    .policy("log", ToolEffect::NonIdempotentWrite, None)]);
    let first = stack.start_worker();
    let sessions = stack.sessions(AGENT);
    sessions.start_session("s1", "pay it").await.unwrap();
    let interrupt = wait_for_agent_snapshot(&sessions, "s1", "the approval", |s| {
        s.pending_interrupts.first().cloned()
    })
    .await;
    stack.kill_worker(first);
    stack.start_worker();
    let resolved = sessions
        .resolve_interrupt(
            "s1",
            ResolveInterruptRequest {
                interrupt_id: interrupt.interrupt_id.clone(),
                approved: true,
                rejection_message: None,
            },
        )
        .await
        .unwrap();
    assert!(resolved);
    let snapshot = wait_for_turns(&sessions, "s1", 1).await;
    assert_eq!(stack.invocations().keys("pay"), vec!["s1/turn-1/pay"]);
    assert_eq!(finished(&stack, "pay").await, vec!["succeeded"]);
    assert_eq!(last_text(&snapshot).as_deref(), Some("paid"));
}

/// Kills the worker while gate `name` holds tool call `id`, starts a
/// replacement, and returns the finished turn's snapshot.
async fn kill_during_tool(stack: &mut AgentTestStack, name: &str) -> AgentSnapshot {
    let first = stack.start_worker();
    let sessions = stack.sessions(AGENT);
    sessions.start_session("s1", "go").await.unwrap();
    stack.gate(name).wait_until_reached().await;
    stack.kill_worker(first);
    stack.gate(name).release();
    stack.start_worker();
    wait_for_turns(&sessions, "s1", 1).await
}

async fn a_read_tool_killed_mid_call_runs_again_and_its_result_is_recorded_once() {
    let mut stack = AgentTestStack::new(vec![agent(json!([{"steps": [
        {"tool_calls": [call("r", "gate", json!({"name": "r"}))]},
        {"text": "read it"}
    ]}]))
    .policy("gate", ToolEffect::Read, None)]);
    let snapshot = kill_during_tool(&mut stack, "r").await;
    assert_eq!(stack.invocations().count("r"), 2, "the read ran again");
    assert_eq!(finished(&stack, "r").await, vec!["succeeded"]);
    assert_eq!(
        texts_of(&snapshot, MessageRole::Tool),
        vec!["gate r passed".to_string()]
    );
    let history = stack.read_step_history("s1").await;
    assert_eq!(
        entries(&history, step::CALL_TOOL),
        vec![
            (history::ATTEMPT_FAILED.to_string(), 1),
            (history::EXECUTE_COMPLETED.to_string(), 2)
        ],
        "the lost attempt counts, and the result is committed once"
    );
}

async fn an_idempotent_write_killed_mid_call_runs_again_with_the_same_idempotency_key() {
    let mut stack = AgentTestStack::new(vec![agent(json!([{"steps": [
        {"tool_calls": [call("w", "gate", json!({"name": "w"}))]},
        {"text": "written"}
    ]}]))
    .policy("gate", ToolEffect::IdempotentWrite, None)]);
    let snapshot = kill_during_tool(&mut stack, "w").await;
    assert_eq!(
        stack.invocations().keys("w"),
        vec!["s1/turn-1/w".to_string(), "s1/turn-1/w".to_string()]
    );
    assert_eq!(finished(&stack, "w").await, vec!["succeeded"]);
    assert_eq!(
        texts_of(&snapshot, MessageRole::Tool),
        vec!["gate w passed"]
    );
}

async fn a_non_idempotent_write_killed_mid_call_becomes_outcome_unknown_and_never_runs_twice() {
    let mut stack = AgentTestStack::new(vec![agent(json!([{"steps": [
        {"tool_calls": [call("nw", "gate", json!({"name": "nw"}))]},
        {"text": "told the user"}
    ]}]))
    .policy("gate", ToolEffect::NonIdempotentWrite, Some(false))]);
    let snapshot = kill_during_tool(&mut stack, "nw").await;
    assert_eq!(stack.invocations().count("nw"), 1);
    assert_eq!(finished(&stack, "nw").await, vec!["outcome_unknown"]);
    // The runner's resumed model step got the outcome text as the tool result.
    let texts = texts_of(&snapshot, MessageRole::Tool);
    assert_eq!(texts.len(), 1);
    assert!(
        texts[0].starts_with("Tool call outcome is unknown; it may or may not have taken effect"),
        "{texts:?}"
    );
    let history = stack.read_step_history("s1").await;
    assert_eq!(
        entries(&history, step::CALL_SINGLE_ATTEMPT_TOOL),
        vec![(history::EXECUTE_FAILED.to_string(), 1)]
    );
    assert_eq!(
        entries(&history, step::RECORD_TOOL_OUTCOME_UNKNOWN),
        vec![(history::EXECUTE_COMPLETED.to_string(), 1)]
    );
}

async fn a_worker_killed_during_run_model_repeats_only_that_model_call() {
    let mut stack = AgentTestStack::new(vec![agent(json!([{"steps": [
        {"log": "model-1", "tool_calls": [call("t1", "log", json!({"name": "t1"}))]},
        {"gate": "model-2", "text": "answered"}
    ]}]))
    .policy("log", ToolEffect::Read, None)]);
    let first = stack.start_worker();
    let sessions = stack.sessions(AGENT);
    sessions.start_session("s1", "go").await.unwrap();
    stack.gate("model-2").wait_until_reached().await;
    stack.kill_worker(first);
    stack.gate("model-2").release();
    stack.start_worker();
    let snapshot = wait_for_turns(&sessions, "s1", 1).await;
    let log = stack.invocations();
    assert_eq!(
        log.count("model-1"),
        1,
        "the first model call did not repeat"
    );
    assert_eq!(log.count("t1"), 1, "the earlier tool Step did not repeat");
    assert_eq!(log.count("model-2"), 2, "the killed model call ran again");
    assert_eq!(last_text(&snapshot).as_deref(), Some("answered"));
}

async fn two_gates_reached_at_once_prove_two_tool_steps_run_in_parallel() {
    let mut stack = AgentTestStack::new(vec![agent(json!([{"steps": [
        {"tool_calls": [
            call("a", "gate", json!({"name": "a", "await": ["b"], "timeout_ms": 20000})),
            call("b", "gate", json!({"name": "b", "await": ["a"], "timeout_ms": 20000}))
        ]},
        {"text": "both"}
    ]}]))
    .policy("gate", ToolEffect::Read, None)]);
    stack.start_worker();
    let sessions = stack.sessions(AGENT);
    sessions.start_session("s1", "go").await.unwrap();
    stack.gate("a").wait_until_reached().await;
    stack.gate("b").wait_until_reached().await;
    let snapshot = wait_for_turns(&sessions, "s1", 1).await;
    assert_eq!(
        texts_of(&snapshot, MessageRole::Tool),
        vec!["gate a passed", "gate b passed"]
    );
    for id in ["a", "b"] {
        assert_eq!(finished(&stack, id).await, vec!["succeeded"]);
    }
    assert_eq!(
        stack.invocations().count("a"),
        1,
        "{:?}",
        stack.invocations().entries()
    );
    assert_eq!(stack.invocations().count("b"), 1);
}

async fn run_model_failing_three_times_records_the_turn_failure_note_and_the_next_turn_works() {
    let mut stack = AgentTestStack::new(vec![agent(json!([
        {"steps": [
            {"tool_calls": [call("t", "log", json!({"name": "t"}))]},
            {"log": "m1", "fail_attempts": 3, "text": "never"}
        ]},
        {"steps": [{"text": "second turn works"}]}
    ]))
    .policy("log", ToolEffect::Read, None)]);
    stack.start_worker();
    let sessions = stack.sessions(AGENT);
    sessions.start_session("s1", "first").await.unwrap();
    let snapshot = wait_for_turns(&sessions, "s1", 1).await;
    assert_eq!(stack.invocations().count("m1"), 3);
    let state = snapshot.state.clone().unwrap();
    assert!(state.last_turn_error.is_some(), "{state:?}");
    let note = last_text(&snapshot).unwrap_or_default();
    assert_eq!(
        note,
        "[Dex] The previous turn failed after these tool calls ran:\n\
         - log {\"name\":\"t\"} -> succeeded: s1/turn-1/t\n\
         Do not repeat these tool calls unless the user asks again."
    );
    assert_eq!(stack.invocations().count("t"), 1);
    sessions.send_user_message("s1", "second").await.unwrap();
    let snapshot = wait_for_turns(&sessions, "s1", 2).await;
    assert_eq!(last_text(&snapshot).as_deref(), Some("second turn works"));
    assert!(snapshot.state.unwrap().last_turn_error.is_none());
}

async fn a_worker_killed_between_a_commit_and_the_next_step_loses_nothing() {
    let mut stack = AgentTestStack::new(vec![agent(json!([{"steps": [
        {"log": "model-1", "tool_calls": [call("t1", "log", json!({"name": "t1"}))]},
        {"log": "model-2", "text": "resumed"}
    ]}]))
    .policy("log", ToolEffect::Read, None)]);
    // Its commit of CallTool also leased it the next Step; it dies first.
    let first = stack.start_worker_with(&["--crash-after-commit", step::CALL_TOOL]);
    let sessions = stack.sessions(AGENT);
    sessions.start_session("s1", "go").await.unwrap();
    wait_until_exited(&mut stack, first).await;
    assert!(
        stack
            .worker_log(first)
            .contains("aborting after committing CallTool"),
        "{}",
        stack.worker_log(first)
    );
    stack.start_worker();
    let snapshot = wait_for_turns(&sessions, "s1", 1).await;
    let log = stack.invocations();
    assert_eq!(
        (log.count("model-1"), log.count("t1"), log.count("model-2")),
        (1, 1, 1)
    );
    assert_eq!(texts_of(&snapshot, MessageRole::Tool).len(), 1);
    assert_eq!(last_text(&snapshot).as_deref(), Some("resumed"));
    let history = stack.read_step_history("s1").await;
    assert_eq!(
        entries(&history, step::CALL_TOOL),
        vec![(history::EXECUTE_COMPLETED.to_string(), 1)]
    );
}

async fn wait_until_exited(stack: &mut AgentTestStack, index: usize) {
    for _ in 0..3000 {
        if stack.worker(index).exit_status().is_some() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("worker {index} did not exit:\n{}", stack.worker_log(index));
}

async fn a_worker_killed_in_await_user_message_with_messages_queued_loses_and_duplicates_none() {
    let mut stack = AgentTestStack::new(vec![agent(json!([
        {"steps": [{"tool_calls": [call("hold", "gate", json!({"name": "hold"}))]}, {"text": "one"}]},
        {"steps": [{"text": "two"}]},
        {"steps": [{"text": "three"}]}
    ]))
    .policy("gate", ToolEffect::Read, None)]);
    let first = stack.start_worker();
    let sessions = stack.sessions(AGENT);
    sessions.start_session("s1", "m1").await.unwrap();
    stack.gate("hold").wait_until_reached().await;
    sessions.send_user_message("s1", "m2").await.unwrap();
    sessions.send_user_message("s1", "m3").await.unwrap();
    stack.kill_worker(first);
    stack.gate("hold").release();
    // The replacement finishes turn 1 and dies right after AwaitUserMessage
    // took m2 from the queue.
    let second = stack.start_worker_with(&["--crash-after-commit", step::AWAIT_USER_MESSAGE]);
    wait_until_exited(&mut stack, second).await;
    stack.start_worker();
    let snapshot = wait_for_turns(&sessions, "s1", 3).await;
    assert_eq!(
        texts_of(&snapshot, MessageRole::User),
        vec!["m1", "m2", "m3"]
    );
    let assistant: Vec<String> = snapshot
        .messages
        .iter()
        .filter(|m| m.role == MessageRole::Assistant)
        .filter_map(|m| m.text.clone())
        .collect();
    assert_eq!(assistant, vec!["one", "two", "three"]);
    assert_eq!(snapshot.queued_message_count, 0);
    assert_eq!(snapshot.state.unwrap().turn_count, 3);
}

/// Beyond the spec: the spec lets a single-attempt tool run twice when its
/// worker dies after the tool started but before its result committed
/// (the same attempt is redelivered). dexa commits the Step's "started"
/// output before calling the tool, so that death is a lost attempt, which
/// routes a single-attempt tool to RecordToolOutcomeUnknown.
async fn a_single_attempt_tool_never_runs_again_when_its_worker_dies_after_it_started() {
    let mut stack = AgentTestStack::new(vec![agent(json!([{"steps": [
        {"tool_calls": [
            call("u", "gate", json!({"name": "u"}))
        ]},
        {"text": "done"}
    ]}]))
    // Unclassified: single attempt, and no approval here.
    .policy("gate", ToolEffect::Unclassified, Some(false))]);
    let first = stack.start_worker();
    let sessions = stack.sessions(AGENT);
    sessions.start_session("s1", "go").await.unwrap();
    // The tool has started (it logged and marked the gate) and has not
    // returned: its result cannot have been committed.
    stack.gate("u").wait_until_reached().await;
    let before = sessions.get_agent_snapshot("s1").await.unwrap();
    assert_eq!(tool_call(&before, "u").status, ToolCallStatus::Approved);
    stack.kill_worker(first);
    stack.gate("u").release();
    stack.start_worker();
    let snapshot = wait_for_turns(&sessions, "s1", 1).await;
    assert_eq!(
        stack.invocations().count("u"),
        1,
        "the tool never ran again"
    );
    assert_eq!(finished(&stack, "u").await, vec!["outcome_unknown"]);
    let texts = texts_of(&snapshot, MessageRole::Tool);
    assert!(
        texts.len() == 1 && texts[0].starts_with("Tool call outcome is unknown"),
        "{texts:?}"
    );
    let history = stack.read_step_history("s1").await;
    let single = entries(&history, step::CALL_SINGLE_ATTEMPT_TOOL);
    assert_eq!(single, vec![(history::EXECUTE_FAILED.to_string(), 1)]);
    assert!(
        !history.iter().any(|e| e.event_type == history::REDELIVERED
            && e.step_type == step::CALL_SINGLE_ATTEMPT_TOOL),
        "the attempt was not redelivered: {history:?}"
    );
    // Exactly one tool_call_started event: the Step never began again.
    let events = dexa_tests::session::all_events(&sessions, "s1").await;
    let started = events
        .iter()
        .filter(|e| e.event_type == dexa::session::event_type::TOOL_CALL_STARTED)
        .count();
    assert_eq!(started, 1);
}

#[test]
fn dexa_worker_refuses_a_bad_config_naming_the_file_and_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("dexa.toml");
    std::fs::write(
        &config,
        "[components.r]\npath = \"r.wasm\"\n\n[agents.A]\nrunner = \"missing\"\n",
    )
    .unwrap();
    let output = std::process::Command::new(dexa_tests::kit::dexa_binary())
        .arg("worker")
        .arg("--config")
        .arg(&config)
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!(
            "{}:5:10: there is no component \"missing\"; the components are \"r\"",
            config.display()
        )),
        "{stderr}"
    );
}

/// A single-attempt tool call that never got a sandbox (no instance free
/// within its deadline) provably did not run: it is recorded `failed` with
/// the reason, not `outcome_unknown`.
async fn a_single_attempt_tool_that_never_started_is_recorded_failed() {
    let holder = KitAgent::scripted(
        "Holder",
        json!({"turns": [{"steps": [
            {"tool_calls": [call("h", "gate", json!({"name": "h", "timeout_ms": 60000}))]},
            {"text": "held"}
        ]}]}),
    )
    .tool("gate-tool")
    .policy("gate", ToolEffect::NonIdempotentWrite, Some(false))
    .extra("tool_attempt_timeout = \"60s\"");
    let starved = KitAgent::scripted(
        "Starved",
        json!({"turns": [{"steps": [
            {"tool_calls": [call("s", "gate", json!({"name": "s"}))]},
            {"text": "starved"}
        ]}]}),
    )
    .tool("gate-tool")
    .policy("gate", ToolEffect::NonIdempotentWrite, Some(false))
    .extra("tool_attempt_timeout = \"1s\"");
    let agents = vec![holder, starved];
    let mut stack = AgentTestStack::with_config(|_| {
        // One instance of gate-tool at a time, shared by both agents.
        render_config(&agents, &KitSettings::default()).replace(
            "[components.gate-tool]\n",
            "[components.gate-tool]\nlimits = { max_concurrent_calls = 1 }\n",
        )
    });
    stack.start_worker();
    let holding = stack.sessions("Holder");
    holding.start_session("holder", "go").await.unwrap();
    stack.gate("h").wait_until_reached().await;
    let starving = stack.sessions("Starved");
    starving.start_session("starved", "go").await.unwrap();
    let snapshot = wait_for_turns(&starving, "starved", 1).await;
    let texts = texts_of(&snapshot, MessageRole::Tool);
    assert!(
        texts.len() == 1
            && texts[0].starts_with("Tool call failed")
            && texts[0].contains("did not start: no free instance"),
        "{texts:?}"
    );
    assert_eq!(stack.invocations().count("s"), 0, "the tool never ran");
    stack.gate("h").release();
    let held = wait_for_turns(&holding, "holder", 1).await;
    assert_eq!(last_text(&held).as_deref(), Some("held"));
}

/// A runner whose sandbox cannot be set up at all (its granted directory is
/// gone) never runs: the message goes back to the queue a few times, then is
/// given up with the reason, instead of cycling forever.
async fn a_user_message_the_runner_never_gets_is_requeued_a_few_times_then_given_up() {
    let mut stack = AgentTestStack::new(vec![agent(json!([{"steps": [{"text": "hi"}]}]))]);
    stack.start_worker();
    let sessions = stack.sessions(AGENT);
    sessions.start_session("s1", "").await.unwrap();
    wait_for_turns(&sessions, "s1", 0).await;
    // Every component of the kit is granted gates/: without it, no sandbox.
    std::fs::rename(stack.gates_dir(), stack.dir.path().join("gates-gone")).unwrap();
    assert!(sessions.send_user_message("s1", "hello").await.unwrap());
    let snapshot = wait_for_turns(&sessions, "s1", 1).await;
    let error = snapshot
        .state
        .clone()
        .and_then(|s| s.last_turn_error)
        .unwrap_or_default();
    assert!(
        error.contains("the user message could not be used") && error.contains("did not start"),
        "{error}"
    );
    let history = stack.read_step_history("s1").await;
    let attempts = history
        .iter()
        .filter(|e| {
            e.step_type == step::AWAIT_USER_MESSAGE && e.event_type == history::ATTEMPT_FAILED
        })
        .count();
    assert_eq!(
        attempts, 8,
        "4 rounds of 3 attempts, the last of each committing"
    );
}

// Every crash test above without its own test attribute runs once per
// store backend: the same kills, on SQLite and on PostgreSQL.
dexa_tests::on_each_backend!(
    a_worker_killed_while_waiting_for_approval_is_replaced_and_the_tool_runs_once,
    a_read_tool_killed_mid_call_runs_again_and_its_result_is_recorded_once,
    an_idempotent_write_killed_mid_call_runs_again_with_the_same_idempotency_key,
    a_non_idempotent_write_killed_mid_call_becomes_outcome_unknown_and_never_runs_twice,
    a_worker_killed_during_run_model_repeats_only_that_model_call,
    two_gates_reached_at_once_prove_two_tool_steps_run_in_parallel,
    run_model_failing_three_times_records_the_turn_failure_note_and_the_next_turn_works,
    a_worker_killed_between_a_commit_and_the_next_step_loses_nothing,
    a_worker_killed_in_await_user_message_with_messages_queued_loses_and_duplicates_none,
    a_single_attempt_tool_never_runs_again_when_its_worker_dies_after_it_started,
    a_single_attempt_tool_that_never_started_is_recorded_failed,
    a_user_message_the_runner_never_gets_is_requeued_a_few_times_then_given_up,
);
